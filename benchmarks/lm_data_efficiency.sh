#!/usr/bin/env bash
# What a pretrained language model buys with little paired data (docs/decoders.md, "Language models as decoders"):
# a tiny GPT-2 trained on the text of 100,000 synthetic hard scenes (seed 0), then captioners trained on 1,000 and
# on 4,000 paired images of other hard scenes (seed 1) for the same 1,000 steps of 64 captions, scored on the same
# 500 test images: the Transformer from scratch; prefix_lm with the LM frozen and each mapper (mlp, transformer,
# qformer); LoRA (rank 4, transformer mapper); full fine-tuning (transformer mapper); and the control, a prefix_lm
# whose LM is untrained (one step: random weights, the same tokenizer) and fine-tuned.
#
#   bash benchmarks/lm_data_efficiency.sh [OUT]      (default OUT: runs/lm_study; about 30 CPU minutes a size)
#
# Every command is the project's CLI; each run and evaluation is skipped when its output exists (a rerun goes on).
set -euo pipefail
OUT=${1:-runs/lm_study}
C="${CAPTIONING:-captioning}"
STEPS=${STEPS:-1000}
mkdir -p "$OUT"
[ -f runs/text/captions.txt ] || $C synth --output-dir runs/text --scenes hard --num-images 100000 --text-only
[ -d runs/lm ] || $C lm train --architecture gpt2 --size tiny --text runs/text/captions.txt --steps 3000 --output runs/lm
[ -d "$OUT/lm_random" ] || $C lm train --architecture gpt2 --size tiny --text runs/text/captions.txt --steps 1 \
    --output "$OUT/lm_random"
S="$OUT/scenes/annotations"
I="$OUT/scenes/images"
[ -f "$S/captions_test.json" ] || $C synth --scenes hard --output-dir "$OUT/scenes" --num-images 5000 --seed 1
if [ ! -f "$S/captions_train1000.json" ]; then  # the first 1,000 training images (by id) of the 4,000
    python - "$S" <<'EOF'
import json, sys
folder = sys.argv[1]
a = json.load(open(f"{folder}/captions_train.json"))
keep = set(sorted(im["id"] for im in a["images"])[:1000])
a["images"] = [im for im in a["images"] if im["id"] in keep]
a["annotations"] = [x for x in a["annotations"] if x["image_id"] in keep]
json.dump(a, open(f"{folder}/captions_train1000.json", "w"))
EOF
fi
for n in 1000 4000; do
    train=$S/captions_train.json
    [ "$n" = 1000 ] && train=$S/captions_train1000.json
    [ -f "$OUT/records_$n/manifest.json" ] || $C prepare --output-dir "$OUT/records_$n" --split "train=$train:$I" \
        --split "val=$S/captions_val.json:$I" --split "test=$S/captions_test.json:$I"
done
PLM="--config experiments/scenes_prefix_lm.yaml --set model.decoder_preset=runs/lm"
declare -A RUNS=(
    [transformer]="--config experiments/scenes_transformer.yaml"
    [frozen_mlp]="$PLM --set model.mapper=mlp"
    [frozen_transformer]="$PLM --set model.mapper=transformer"
    [frozen_qformer]="$PLM --set model.mapper=qformer"
    [lora]="$PLM --set model.lm_lora_rank=4"
    [finetuned]="$PLM --set model.lm_trainable=true"
    [random_lm]="--config experiments/scenes_prefix_lm.yaml --set model.decoder_preset=$OUT/lm_random --set model.lm_trainable=true"
)
for n in ${SIZES:-1000 4000}; do
    for name in transformer frozen_mlp frozen_transformer frozen_qformer lora finetuned random_lm; do
        dir="$OUT/n${n}_$name"
        # shellcheck disable=SC2086
        [ -f "$dir/ckpt-$STEPS.index" ] || $C train ${RUNS[$name]} --set "data.dir=$OUT/records_$n" \
            --set "train.steps=$STEPS" --set train.eval_every_steps=0 --set train.checkpoint_every_steps=500 \
            --model-dir "$dir"
        [ -f "$dir/study_eval.json" ] || $C evaluate --model-dir "$dir" --split test --max-length 24 \
            --instances "$S/instances_test.json" --output "$dir/study_eval.json"
    done
done
