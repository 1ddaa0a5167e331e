#!/usr/bin/env bash
# What each SCST reward does to the captions (docs/decoders.md, "A CLIP reward"): cross-entropy, then SCST from it
# with CIDEr-D, with CLIP-S and with the mix (CIDEr-D + scst.clip_weight · CLIP-S), on two datasets, each scored
# with a CLIP that `captioning clip train` trained on that dataset's training split:
#   - the hard scenes (8,000 images, seed 0): experiments/scenes_transformer.yaml, then scenes_transformer_scst.yaml;
#   - the demo's shapes (`make demo`'s records and its cross-entropy model, runs/demo/model): shapes_scst.yaml.
# Every model is evaluated on its test split with --clip-preset and --instances (CIDEr, CLIP-S, RefCLIP-S,
# text-to-image recall, CHAIRi, distinct-2, bad endings); benchmarks/clip_reward_table.py makes the table.
#
#   make demo && bash benchmarks/clip_reward.sh [OUT]      (default OUT: runs/clip_study; about an hour on 2 cores)
#
# Every command is the project's CLI; each step is skipped when its output exists (a rerun goes on).
set -euo pipefail
OUT=${1:-runs/clip_study}
C="${CAPTIONING:-captioning}"
mkdir -p "$OUT"

# The hard scenes and their CLIP: the issue's own command
A=runs/scenes/annotations
[ -f "$A/captions_test.json" ] || $C synth --scenes hard --output-dir runs/scenes --num-images 8000 --seed 0
[ -f runs/scenes/records/manifest.json ] || $C prepare --output-dir runs/scenes/records \
    --split "train=$A/captions_train.json:runs/scenes/images" --split "val=$A/captions_val.json:runs/scenes/images" \
    --split "test=$A/captions_test.json:runs/scenes/images"
$C clip train --records runs/scenes/records --split train --steps 2000 --output runs/clip
# The shapes' CLIP, trained the same way on the demo's training split
[ -f runs/demo/records/manifest.json ] || { echo "run make demo first (runs/demo/records)" >&2; exit 2; }
$C clip train --records runs/demo/records --split train --steps 2000 --output runs/clip_shapes

scst() {  # name xe_dir config clip_preset data_dir
    local name=$1 xe=$2 config=$3 preset=$4 data=$5
    for reward in cider clip mix; do
        local dir="$OUT/${name}_scst_$reward"
        # shellcheck disable=SC2046
        [ -f "$dir/done" ] || { rm -rf "$dir" && $C train --config "experiments/$config" --set "data.dir=$data" \
            --set "scst.reward=$reward" $( [ "$reward" = cider ] || echo --set "scst.clip_preset=$preset" ) \
            --model-dir "$dir" --init-from "$xe" && touch "$dir/done"; }
    done
}
evaluate() {  # name model_dir preset instances
    [ -f "$OUT/$1.json" ] || $C evaluate --model-dir "$2" --split test --clip-preset "$3" --instances "$4" \
        --output "$OUT/$1.json"
}

$C train --config experiments/scenes_transformer.yaml --set data.dir=runs/scenes/records --model-dir "$OUT/scenes_xe"
scst scenes "$OUT/scenes_xe" scenes_transformer_scst.yaml runs/clip runs/scenes/records
for run in scenes_xe scenes_scst_{cider,clip,mix}; do evaluate "$run" "$OUT/$run" runs/clip "$A/instances_test.json"; done

scst shapes runs/demo/model shapes_scst.yaml runs/clip_shapes runs/demo/records
I=runs/demo/shapes/annotations/instances_test.json
evaluate shapes_xe runs/demo/model runs/clip_shapes "$I"
for run in shapes_scst_{cider,clip,mix}; do evaluate "$run" "$OUT/$run" runs/clip_shapes "$I"; done
"${PYTHON:-python}" benchmarks/clip_reward_table.py "$OUT"
