"""Reproduces docs/decoders.md's "Fine-tuning a vision-language model, measured" (benchmarks/RESULTS.md has the
runs): a PaliGemma-shaped preset, small but not a toy, fine-tuned on the hard scenes.

    python benchmarks/vlm_finetune.py speed     # `captioning train` against the guide's `model.fit` loop
    python benchmarks/vlm_finetune.py quality   # LoRA against full fine-tuning, after the same steps

Run it alone on the machine (the speed figures are ratios of runs side by side). Needs `make demo`'s hard scenes
(`runs/demo/scenes`, `runs/demo/scenes_records`) and, for `quality`, its shapes (`runs/demo/records`). Every
output goes under `--out` (default `runs/vlm_bench`); a step whose output exists is skipped, so a second run
only prints the tables.

**The preset** (`preset/`, written here with `save_to_preset`): the architecture of PaliGemma — a SigLIP-style
ViT whose patch tokens are projected into a Gemma with one key/value head, image and prompt attending both ways —
at 64 px in patches of 8 (64 image tokens), a 4-layer ViT of width 192 and a 4-layer Gemma of width 256, and a
SentencePiece tokenizer trained on the hard scenes' training captions. Its weights are random: nothing can be
downloaded here.

**speed**: each loop in its own process, one after the other, at the same batch size and steps, LoRA of rank 4 on
the language model's query and value projections, the vision tower frozen:

- `guide`: the Keras team's fine-tuning guides' loop: `PaliGemmaCausalLM.from_preset`, `backbone.enable_lora(4)`,
  a Python list of examples (the images decoded and resized beforehand, one caption each, the prompt
  `caption en\\n`), `compile` with AdamW and `fit(batch_size=B)`.
- `guide_frozen_vit`: the same with the vision tower frozen after `enable_lora` (which adapts the ViT's query and
  value projections too), so that the variables that train are this project's default's.
- `train`: this project's `Trainer` on `experiments/scenes_vlm.yaml` (the records, the tf.data pipeline with its
  random crops and JPEG decoding, checkpoints, TensorBoard).

Examples per second over the steps after the first `--warmup` (compiling is left out of both), and the process's
peak resident memory (`ru_maxrss`: TensorFlow, the model, and for the guide its list of images).

**quality**: the random preset is first fine-tuned fully on the shapes (`pretrained/`, saved as a preset), then
fine-tuned from it on the hard scenes for the same steps with LoRA (rank 4) and fully (`model.vlm_trainable: all`);
each is evaluated on the test split (beam 3) with the instances file for CHAIR.
"""

import argparse
import json
import math
import os
import resource
import shutil
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)  # tests/harness/lm_presets.py's preset writer
SCENES, SCENES_RECORDS, SHAPES_RECORDS = "runs/demo/scenes", "runs/demo/scenes_records", "runs/demo/records"
CONFIG = "experiments/scenes_vlm.yaml"
IMAGE, PROMPT, RANK = 64, "caption en\n", 4
LOOPS = ("guide", "guide_frozen_vit", "train", "train_k10")  # train_k10: train.steps_per_execution=10


def captions_of(split: str) -> tuple[list[str], list[str]]:
    """The split's image files and each image's first caption, in image id order."""
    with open(os.path.join(REPO, SCENES, "annotations", f"captions_{split}.json")) as f:
        data = json.load(f)
    first = {}
    for a in data["annotations"]:
        first.setdefault(a["image_id"], a["caption"])
    files = {i["id"]: os.path.join(REPO, SCENES, "images", i["file_name"]) for i in data["images"]}
    ids = sorted(first)
    return [files[i] for i in ids], [first[i] for i in ids]


def write_preset(folder: str) -> str:
    from tests.harness.lm_presets import write_paligemma

    if not os.path.exists(os.path.join(folder, "config.json")):
        _, captions = captions_of("train")
        write_paligemma(folder + ".partial", hidden=256, layers=4, heads=4, image_size=IMAGE, patch=8,
                        vit_layers=4, vit_hidden=192, vit_heads=3, sentences=[c.lower() for c in captions],
                        vocab_size=400)
        os.replace(folder + ".partial", folder)
    return folder


def peak_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def guide_loop(preset: str, batch: int, steps: int, warmup: int, frozen_vit: bool = False) -> dict:
    """The guide's loop: a Python list of examples and ``fit``; the time of each batch's end from a callback.
    ``frozen_vit``: the vision tower frozen after ``enable_lora`` (which adapts the ViT's projections too), so that
    the same variables train as in this project's default."""
    import keras
    import keras_hub
    import numpy as np
    from PIL import Image

    files, captions = captions_of("train")
    n = batch * steps
    images = np.stack([np.asarray(Image.open(f).convert("RGB").resize((IMAGE, IMAGE))) for f in files[:n]])
    lm = keras_hub.models.PaliGemmaCausalLM.from_preset(preset)
    lm.backbone.enable_lora(rank=RANK)
    for variable in lm.backbone.vit_encoder.weights if frozen_vit else []:  # (the layer's flag does not reach them)
        variable.trainable = False
    lm.preprocessor.sequence_length = 32
    optimizer = keras.optimizers.AdamW(learning_rate=5e-4, weight_decay=0.01)
    optimizer.exclude_from_weight_decay(var_names=["bias", "scale"])
    lm.compile(loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True), optimizer=optimizer,
               weighted_metrics=[keras.metrics.SparseCategoricalAccuracy()])
    ends = []

    class Clock(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            ends.append(time.perf_counter())

    x = {"images": images, "prompts": [PROMPT] * n, "responses": captions[:n]}
    history = lm.fit(x=x, batch_size=batch, epochs=1, callbacks=[Clock()], verbose=0)
    return {"steps": len(ends), "examples_per_s": batch * (len(ends) - warmup) / (ends[-1] - ends[warmup - 1]),
            "trained_variables": len(lm.trainable_variables), "peak_mib": peak_mib(),
            "loss_finite": bool(all(map(math.isfinite, history.history["loss"])))}


def train_loop(preset: str, batch: int, steps: int, warmup: int, folder: str, *extra: str) -> dict:
    """This project's Trainer on the scenes_vlm config, in a fresh folder; ``extra``: more ``--set`` values."""
    from captioning.config import load_config
    from captioning.experiment import for_training
    from captioning.train import Trainer

    shutil.rmtree(folder, ignore_errors=True)
    cfg = load_config(os.path.join(REPO, CONFIG), [
        f"model.vlm_preset={preset}", f"data.dir={os.path.join(REPO, SCENES_RECORDS)}", f"train.steps={steps}",
        f"train.batch_size={batch}", f"train.checkpoint_every_steps={steps}", "train.eval_every_steps=0",
        f"model.lm_lora_rank={RANK}", *extra])
    trainer = Trainer(for_training(cfg), folder)
    result = trainer.run(progress=False)
    ends = result.elapsed_s
    return {"steps": len(ends), "examples_per_s": batch * (len(ends) - warmup) / (ends[-1] - ends[warmup - 1]),
            "trained_variables": len(trainer.model.trainable_variables), "peak_mib": peak_mib(),
            "loss_finite": bool(all(map(math.isfinite, result.losses)))}


def one(args) -> None:
    """One loop's run, in this process (``speed`` starts one process per run)."""
    preset = write_preset(os.path.join(args.out, "preset"))
    if args.loop.startswith("guide"):
        out = guide_loop(preset, args.batch_size, args.steps, args.warmup, frozen_vit=args.loop == "guide_frozen_vit")
    else:
        out = train_loop(preset, args.batch_size, args.steps, args.warmup, os.path.join(args.out, "speed_model"),
                         *["train.steps_per_execution=10"] * (args.loop == "train_k10"))
    print(json.dumps({"loop": args.loop, "batch_size": args.batch_size, **out}))


def cpu_model() -> str:
    with open("/proc/cpuinfo") as f:
        return next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "unknown")


def speed(args) -> None:
    write_preset(os.path.join(args.out, "preset"))
    path = os.path.join(args.out, "speed.json")
    if not os.path.exists(path):
        runs, started = [], time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
        for batch, steps in [(1, args.steps), (16, max(2 * args.warmup, args.steps // 5))] * 2:
            for loop in LOOPS:  # each setting twice, the loops side by side: the spread is in the table
                done = subprocess.run([sys.executable, __file__, "one", "--loop", loop, "--batch-size", str(batch),
                                       "--steps", str(steps), "--warmup", str(args.warmup), "--out", args.out],
                                      capture_output=True, text=True, check=False)
                if done.returncode:
                    sys.exit(f"{loop} at batch {batch} failed:\n{done.stderr[-3000:]}")
                runs.append(json.loads(done.stdout.strip().splitlines()[-1]))
                print(runs[-1], flush=True)
        record = {"cpu": cpu_model(), "date": f"{started} to {time.strftime('%H:%M UTC', time.gmtime())}",
                  "runs": runs}
        with open(path + ".partial", "w") as f:
            json.dump(record, f, indent=1)
        os.replace(path + ".partial", path)
    with open(path) as f:
        record = json.load(f)
    print(f"{record['cpu']}, {record['date']}")
    print("| loop | batch | steps | trained variables | examples/s | peak memory (MiB) |\n|---|---|---|---|---|---|")
    for r in record["runs"]:
        print(f"| {r['loop']} | {r['batch_size']} | {r['steps']} | {r['trained_variables']} "
              f"| {r['examples_per_s']:.1f} | {r['peak_mib']:.0f} |")


def cli(*argv) -> None:
    done = subprocess.run([sys.executable, "-m", "captioning", "-q", *argv], cwd=REPO, check=False)
    if done.returncode:
        sys.exit(f"captioning {' '.join(argv)} failed")


def save_as_preset(model_dir: str, preset: str, folder: str) -> None:
    """The fully fine-tuned model of ``model_dir`` as a preset: ``preset``'s files with its backbone's weights."""
    from captioning import inference

    if os.path.exists(os.path.join(folder, "config.json")):
        return
    shutil.rmtree(folder + ".partial", ignore_errors=True)
    shutil.copytree(preset, folder + ".partial")
    inference.load(model_dir).model.backbone.save_to_preset(folder + ".partial")
    os.replace(folder + ".partial", folder)


def quality(args) -> None:
    preset = write_preset(os.path.join(args.out, "preset"))
    shapes = os.path.join(args.out, "shapes_full")
    cli("train", "--config", CONFIG, "--model-dir", shapes, "--set", f"model.vlm_preset={preset}",
        "--set", f"data.dir={SHAPES_RECORDS}", "--set", "model.vlm_trainable=all", "--set",
        "model.encoder_trainable=true", "--set", f"train.steps={args.pretrain_steps}", "--set",
        "train.batch_size=32", "--set", "train.eval_every_steps=0")
    pretrained = os.path.join(args.out, "pretrained")
    save_as_preset(shapes, preset, pretrained)
    rows = []
    for name, trainable in (("lora", "lora"), ("full", "all")):
        folder = os.path.join(args.out, f"scenes_{name}")
        cli("train", "--config", CONFIG, "--model-dir", folder, "--set", f"model.vlm_preset={pretrained}",
            "--set", f"model.vlm_trainable={trainable}", "--set", f"train.steps={args.steps}",
            "--set", "train.batch_size=32", "--set", "train.eval_every_steps=0")
        metrics = os.path.join(folder, "bench_metrics.json")
        if not os.path.exists(metrics):
            cli("evaluate", "--model-dir", folder, "--split", "test", "--instances",
                os.path.join(SCENES, "annotations", "instances_test.json"), "--output", metrics)
        with open(metrics) as f:
            rows.append((name, json.load(f)))
    print(json.dumps({name: m for name, m in rows}, indent=1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("what", choices=["speed", "quality", "one"])
    parser.add_argument("--out", default=os.path.join(REPO, "runs", "vlm_bench"))
    parser.add_argument("--loop", choices=LOOPS)
    parser.add_argument("--batch-size", type=int, default=1)
    parser.add_argument("--steps", type=int, default=None, help="speed: 300 at batch 1 (a fifth at 16); quality: 1000")
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--pretrain-steps", type=int, default=1500)
    args = parser.parse_args()
    args.out = os.path.abspath(args.out)
    if args.steps is None:
        args.steps = 1000 if args.what == "quality" else 300
    {"speed": speed, "quality": quality, "one": one}[args.what](args)


if __name__ == "__main__":
    main()
