"""Reproduces the decoding-options and ensembles tables of docs/using.md ("Decoding options and ensembles,
measured"): on the test split of the shapes and the hard scenes data, one `captioning evaluate` per setting
and per ensemble, then the tables. Trains the models it lacks first (hours on 2 CPU cores); every step is
skipped when its output exists, so a second run only prints the tables.

    python benchmarks/decoding_options.py [--out runs/decoding]   # after `make demo` made the two datasets

The data: `runs/demo/records` (the shapes demo, 5,000 images) and `runs/demo/scenes_records` (the hard
scenes, 8,000 images), as `make demo` and docs/data.md prepare them.
"""

import argparse
import json
import os
import subprocess
import sys

CLI = [sys.executable, "-m", "captioning", "-q"]
SHAPES, SCENES = "runs/demo/records", "runs/demo/scenes_records"
# name: (config, data, extra --set values)
MODELS = {
    "shapes_transformer": ("experiments/shapes_transformer.yaml", SHAPES, []),
    "shapes_transformer_seed1": ("experiments/shapes_transformer.yaml", SHAPES, ["train.seed=1"]),
    "shapes_transformer_seed2": ("experiments/shapes_transformer.yaml", SHAPES, ["train.seed=2"]),
    "shapes_attention": ("experiments/shapes_attention.yaml", SHAPES, []),
    "scenes_transformer": ("experiments/scenes_transformer.yaml", SCENES, ["train.steps=4610"]),
    "scenes_attention": ("experiments/scenes_attention.yaml", SCENES, []),
    "scenes_updown": ("experiments/scenes_updown.yaml", SCENES, []),
}
DATASETS = {  # the model the settings are measured on; the ensembles' members in order (of the first 2, of all 3)
    "shapes": ("shapes_transformer", {"seeds": ["shapes_transformer", "shapes_transformer_seed1",
                                                "shapes_transformer_seed2"],
                                      "seeds and decoders": ["shapes_transformer", "shapes_transformer_seed1",
                                                             "shapes_attention"]}),
    "scenes": ("scenes_transformer", {"decoders": ["scenes_transformer", "scenes_attention", "scenes_updown"]}),
}
SETTINGS = [
    ("beam 1 (greedy)", ["--beam-size", "1"]),
    ("beam 3", []),
    ("beam 5", ["--beam-size", "5"]),
    ("beam 3, avg length penalty α 0.7", ["--length-normalization", "0.7"]),
    ("beam 3, GNMT length penalty α 0.7", ["--length-normalization", "0.7", "--set", "decode.length_penalty=gnmt"]),
    ("diverse beams: 3 groups of 1, λ 0.5", ["--set", "decode.beam_groups=3", "--set", "decode.diversity=0.5"]),
    ("diverse beams: 3 groups of 2, λ 0.5", ["--beam-size", "6", "--set", "decode.beam_groups=3",
                                             "--set", "decode.diversity=0.5"]),
    ("beam 3, trigram blocking", ["--set", "decode.block_ngrams=3"]),
    ("beam 3, English bad endings", ["--set", "decode.bad_endings=english"]),
    ("beam 3, both", ["--set", "decode.block_ngrams=3", "--set", "decode.bad_endings=english"]),
    ("sampling T 0.5, 5 per image", ["--set", "decode.method=sample", "--set", "decode.temperature=0.5",
                                     "--set", "decode.top_k=5"]),
    ("sampling T 1.0, 5 per image", ["--set", "decode.method=sample", "--set", "decode.temperature=1.0",
                                     "--set", "decode.top_k=5"]),
    ("beam 3, its 3 captions per image", ["--set", "decode.top_k=3"]),
    ("diverse beams: 3 groups of 1, λ 0.5, 3 per image", ["--set", "decode.beam_groups=3", "--set",
                                                          "decode.diversity=0.5", "--set", "decode.top_k=3"]),
    ("diverse beams: 3 groups of 1, λ 2, 3 per image", ["--set", "decode.beam_groups=3", "--set",
                                                        "decode.diversity=2.0", "--set", "decode.top_k=3"]),
]


def run(args, log):
    with open(log, "w") as f:
        f.write(" ".join(args) + "\n")
        f.flush()
        if subprocess.run(args, stdout=f, stderr=subprocess.STDOUT).returncode:
            sys.exit(f"failed: {' '.join(args)} (see {log})")


def evaluate(out, key, model_dirs, extra=()):
    path = os.path.join(out, "results", key + ".json")
    if not os.path.exists(path):
        run(CLI + ["evaluate", *(a for m in model_dirs for a in ("--model-dir", m)), *extra, "--output", path],
            path[:-5] + ".log")
    return json.load(open(path))


def row(label, result):
    d = result["diversity"]

    def cell(v):
        return "–" if v is None else f"{v:.3f}"

    per = f"{d['captions_per_image']}: {cell(d['mbleu_4'])}" if "mbleu_4" in d else "1"
    # distinct-2 (Li et al. 2016: / words) and per bigram; a result of before the two held the second as distinct_2
    li, per_bigram = ((d["distinct_2"], d["distinct_2_per_bigram"]) if "distinct_2_per_bigram" in d
                      else (None, d["distinct_2"]))
    return (f"| {label} | {result['metrics']['CIDEr']:.3f} | {result['metrics']['Bleu_4']:.3f} | {cell(d['distinct_1'])} "
            f"| {cell(li)} | {cell(per_bigram)} | {cell(d['vocabulary_usage'])} ({d['words_used']}) | "
            f"{cell(d['novel_captions'])} | {per} |")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="runs/decoding", help="models and results (default runs/decoding)")
    out = parser.parse_args().out
    os.makedirs(os.path.join(out, "results"), exist_ok=True)
    folder = {name: os.path.join(out, name) for name in MODELS}
    for name, (config, data, extra) in MODELS.items():
        run(CLI + ["train", "--config", config, "--model-dir", folder[name], "--set", f"data.dir={data}",
                   *(a for e in extra for a in ("--set", e))], os.path.join(out, name + ".train.log"))
    for dataset, (model, ensembles) in DATASETS.items():
        print(f"\n{dataset} ({model})\n")
        print("| setting | CIDEr | BLEU-4 | distinct-1 | distinct-2 | distinct-2 per bigram | vocabulary used | "
              "novel captions | captions per image: mBLEU-4 |\n|---|---|---|---|---|---|---|---|---|")
        for i, (label, extra) in enumerate(SETTINGS):
            print(row(label, evaluate(out, f"{dataset}-setting{i:02d}", [folder[model]], extra)))
        for kind, members in ensembles.items():
            for m in members:
                print(row(f"alone: {m}", evaluate(out, f"{dataset}-{m}", [folder[m]])))
            for n in (2, 3):
                print(row(f"ensemble of the first {n} ({kind})",
                          evaluate(out, f"{dataset}-{kind.replace(' ', '_')}-{n}", [folder[m] for m in members[:n]])))


if __name__ == "__main__":
    main()
