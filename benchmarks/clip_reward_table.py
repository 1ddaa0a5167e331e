"""The table of benchmarks/clip_reward.sh's runs (docs/decoders.md, "A CLIP reward"): per dataset and objective, the
test split's CIDEr, CLIP-S, RefCLIP-S, text-to-image recall@1 (the references' beside it, for scale), CHAIRi,
distinct-2, the share of bad endings and the mean words of a caption; then each run's caption of the test split's
first image.

    python benchmarks/clip_reward_table.py [OUT]
"""

from __future__ import annotations

import json
import os
import sys

RUNS = (("xe", "cross-entropy"), ("scst_cider", "SCST, CIDEr-D"), ("scst_clip", "SCST, CLIP-S"),
        ("scst_mix", "SCST, mix"))
DATASETS = (("scenes", "hard scenes"), ("shapes", "shapes"))


def _load(out: str, name: str) -> dict | None:
    path = os.path.join(out, name + ".json")
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return json.load(f)


def _captions(result: dict) -> list[dict]:
    """The evaluation's predictions (the stored result's file beside its metrics, in the model folder's ``eval/``:
    the test split at the checkpoint's step, scored with the result's CLIP preset)."""
    from captioning.tf_import import import_tensorflow_quietly

    import_tensorflow_quietly()  # clip_score's module imports it; its C++ start-up lines stay out of the table
    from captioning.evaluation.clip_score import identity

    folder = os.path.join(os.path.dirname(result["checkpoint"]), "eval")
    step, preset = f"test-step{result['checkpoint_step']}-", f"-clip{identity(result['clip']['preset'])}-"
    found = [n for n in os.listdir(folder) if n.startswith(step) and preset in n and n.endswith(".predictions.json")]
    if len(found) != 1:
        raise SystemExit(f"expected one predictions file {step}*{preset}* in {folder}, found {found}")
    with open(os.path.join(folder, found[0])) as f:
        return sorted(json.load(f), key=lambda p: p["image_id"])


def main(out: str = "runs/clip_study") -> None:
    rows, examples = [], []
    for prefix, dataset in DATASETS:
        for suffix, objective in RUNS:
            r = _load(out, f"{prefix}_{suffix}")
            if r is None:
                continue
            clip, words, captions = r["clip"], r["diversity"], _captions(r)
            length = sum(len(p["caption"].split()) for p in captions) / len(captions)
            cells = [dataset, objective, f"{r['metrics']['CIDEr']:.3f}", f"{clip['clip_score']:.3f}",
                     f"{clip['ref_clip_score']:.3f}", f"{clip['recall@1']:.3f} ({clip['references_recall@1']:.3f})",
                     f"{r['chair_i']:.3f}", f"{words['distinct_2']:.3f}", f"{r['bad_ending_rate']:.3f}",
                     f"{length:.1f}"]
            rows.append("| " + " | ".join(cells) + " |")
            examples.append(f"- {dataset}, {objective}: \"{captions[0]['caption']}\"")
    head = ["data", "objective", "CIDEr", "CLIP-S", "RefCLIP-S", "recall@1 (references')", "CHAIRi", "distinct-2",
            "bad endings", "words"]
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    print("\n".join(rows))
    print()
    print("\n".join(examples))


if __name__ == "__main__":
    main(*sys.argv[1:2])
