#!/usr/bin/env bash
# CPU seconds (user+system) of six commands (train 20 steps, evaluate 50 images, caption 2 images, export, export
# --format litert, and train 20 steps as 2 mirrored replicas on 2 logical CPUs), the code before (a worktree of commit
# BEFORE) and after (this checkout), alternating, ROUNDS rounds. Run from the repository root after `make demo`
# (runs/demo/records): BEFORE=26d3999 benchmarks/command_cpu.sh (benchmarks/RESULTS.md)
set -euo pipefail
BEFORE=${BEFORE:?commit}; ROUNDS=${ROUNDS:-3}; PY=$PWD/.venv/bin/python; OUT=${OUT:-/tmp/startup}
rm -rf "$OUT"; mkdir -p "$OUT"; git worktree add -q "$OUT/before" "$BEFORE"; ln -s "$PWD/runs" "$OUT/before/runs"
for round in $(seq "$ROUNDS"); do
  for tree in "$OUT/before" "$PWD"; do
    name=$([ "$tree" = "$PWD" ] && echo after || echo before); m=$OUT/model-$name; rm -rf "$m" "$m-2" "$m.tflite"
    cd "$tree"
    for cmd in "train --config experiments/shapes.yaml --model-dir $m --set train.steps=20 --set train.eval_every_steps=0" \
               "evaluate --model-dir $m --max-images 50" \
               "caption --model-dir $m runs/demo/shapes/images/shapes_000001.jpg runs/demo/shapes/images/shapes_000002.jpg" \
               "export --model-dir $m --output $m/export" \
               "export --model-dir $m --format litert --output $m.tflite" \
               "train --config experiments/shapes.yaml --model-dir $m-2 --set train.steps=20 --set train.eval_every_steps=0 --set distribute.strategy=mirrored --set distribute.logical_cpus=2"; do
      label=${cmd%% *}; [[ $cmd == *litert* ]] && label=litert; [[ $cmd == *logical_cpus* ]] && label=train2
      /usr/bin/time -f "$name $label %U %S" -a -o "$OUT/times.txt" env PYTHONPATH="$tree" TF_CPP_MIN_LOG_LEVEL=2 \
        "$PY" -m captioning $cmd > /dev/null 2>&1
    done
    cd - > /dev/null
  done
done
git worktree remove --force "$OUT/before"
awk '{cpu[$1" "$2] = cpu[$1" "$2] " " $3 + $4} END {for (k in cpu) print k ":" cpu[k]}' "$OUT/times.txt" | sort
