"""The table of benchmarks/lm_data_efficiency.sh's runs (docs/decoders.md): per training size and model, the test
split's CIDEr, BLEU-4, CHAIRi and relations right (of those judged), the trainable parameters, and with --time the
milliseconds of a training step (``captioning benchmark train`` of each folder's config, one after the other; run it
with no other job).

    python benchmarks/lm_data_efficiency_table.py [OUT] [--time]
"""

from __future__ import annotations

import json
import os
import sys

NAMES = ("transformer", "frozen_mlp", "frozen_transformer", "frozen_qformer", "lora", "finetuned", "random_lm")
SIZES = (1000, 4000)


def trainable(model_dir: str) -> int:
    from captioning import inference

    model = inference.load(model_dir).model
    return int(sum(v.shape.num_elements() for v in model.trainable_variables))


def step_ms(model_dir: str, steps: int = 40) -> float:
    """A training step of the folder's own config.yaml (fresh weights, its data), in milliseconds: ``captioning
    benchmark train`` (``steps`` measured after 10)."""
    import subprocess
    import tempfile

    with tempfile.TemporaryDirectory() as work:
        out = os.path.join(work, "train.json")
        subprocess.run([sys.executable, "-m", "captioning", "-q", "benchmark", "train", "--config",
                        os.path.join(model_dir, "config.yaml"), "--steps", str(steps), "--warmup", "10", "--json", out],
                       check=True, capture_output=True)
        with open(out) as f:
            return json.load(f)["step_ms"]


def main(out: str = "runs/lm_study", timed: bool = False) -> None:
    rows, times = [], {}
    for n in SIZES:
        for name in NAMES:
            folder = os.path.join(out, f"n{n}_{name}")
            path = os.path.join(folder, "study_eval.json")
            if not os.path.exists(path):
                continue
            with open(path) as f:
                r = json.load(f)
            rel = r["grounding"]["relations"]["all"]
            cells = [str(n), f"`{name}`", f"{r['metrics']['CIDEr']:.3f}", f"{r['metrics']['Bleu_4']:.3f}",
                     f"{r['chair_i']:.3f}", f"{rel['correct']} of {rel['judged']}", f"{trainable(folder):,}"]
            if timed:  # a step costs the same at either size: each model timed once
                if name not in times:
                    times[name] = step_ms(folder)
                cells.append(f"{times[name]:.0f}")
            rows.append("| " + " | ".join(cells) + " |")
    head = ["images", "model", "CIDEr", "BLEU-4", "CHAIRi", "relations right", "trainable parameters"]
    if timed:
        head.append("ms a step")
    print("| " + " | ".join(head) + " |\n|" + "---|" * len(head))
    print("\n".join(rows))


if __name__ == "__main__":
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    main(args[0] if args else "runs/lm_study", "--time" in sys.argv)
