"""``captioning benchmark quality``: time to quality, DAWNBench's measure — the wall-clock training time
until a model first reaches a test CIDEr, and the quality it ends at.

It trains ``--config`` (on ``--data`` or the config's records) to ``train.steps`` in a scratch model folder
(or ``--model-dir``, kept), writing a checkpoint every ``--eval-every`` steps, then evaluates every one
of those checkpoints on ``--split`` with the same code and settings as ``captioning evaluate`` (the
model's ``decode:`` section: beam 3, 20 words). Evaluating after training keeps evaluation time out of
the clock by construction; the clock of checkpoint *k* is the wall time from the start of the run to
the end of step *k* (ingestion, steps, logging and earlier checkpoints included: what training costs).
Training's own periodic validation and sample captions are switched off.

Reported: ``seconds_to_target`` and ``steps_to_target`` (None when no checkpoint reached
``--target``), the final checkpoint's CIDEr and BLEU-4, and the whole curve.

``--compare SECTION.KEY=VALUE`` trains a second setting after the first, on the same machine in the same
run, and reports both and the ratios (compared / base) of the time to the target and of the training
time, e.g. the demo config against the one it replaced::

    captioning benchmark quality --config experiments/shapes.yaml --compare model.dropout=0.2 \
        --compare train.steps=8000
"""

from __future__ import annotations

import logging
import shutil
import tempfile

from captioning import config as config_lib
from captioning.benchmarks import common
from captioning.errors import InputError
from captioning.model.folder import ModelDir

log = logging.getLogger("captioning.benchmark")


def run(config: str, overrides: tuple[str, ...] = (), data_dir: str | None = None, eval_every: int = 1000,
        target: float = 3.0, split: str = "test", model_dir: str | None = None, compare: tuple[str, ...] = (),
        progress: bool = True) -> dict:
    if eval_every < 1 or target < 0:
        raise InputError("`eval_every` must be at least 1 and `target` at least 0", params=("eval_every", "target"))
    if compare and model_dir:
        raise InputError("`model_dir` keeps one trained model: leave it out with `compare`",
                         params=("model_dir", "compare"))
    base = _measure(config, tuple(overrides), data_dir, eval_every, target, split, model_dir, progress)
    if not compare:
        return base
    compared = _measure(config, tuple(overrides) + tuple(compare), data_dir, eval_every, target, split, None, progress)

    def ratio(key):
        a, b = base[key], compared[key]
        return None if a is None or b is None else b / a

    return {"base": base, "compared": compared, "compare": list(compare),
            "seconds_to_target_ratio": ratio("seconds_to_target"), "train_seconds_ratio": ratio("train_seconds"),
            "machine": common.machine()}


def _measure(config: str, overrides: tuple[str, ...], data_dir: str | None, eval_every: int, target: float,
             split: str, model_dir: str | None, progress: bool) -> dict:
    from captioning.evaluation.evaluate import evaluate
    from captioning.experiment import for_training
    from captioning.train import train

    cfg = config_lib.load_config(config, overrides)
    if data_dir:
        cfg.data.dir = data_dir
    steps = cfg.train.steps
    cfg.train.checkpoint_every_steps = eval_every
    cfg.train.keep_checkpoints = steps // eval_every + 2
    cfg.train.eval_every_steps = 0
    cfg.train.sample_captions = 0
    scratch = model_dir is None
    model_dir = model_dir or tempfile.mkdtemp(prefix="captioning-benchmark-quality-")
    try:
        log.info("time to quality: training %s for %d steps in %s, a checkpoint every %d", config, steps, model_dir,
                 eval_every)
        result = train(for_training(cfg), model_dir, progress=progress)
        if result.interrupted:
            raise InputError(f"the training run was interrupted ({result.interrupted}) at step {result.step}: "
                             "no time to quality")
        if len(result.elapsed_s) != steps:
            raise InputError(f"{model_dir} already held a trained model (trained {len(result.elapsed_s)} of "
                             f"{steps} steps now): give `model_dir` an empty folder", params=("model_dir",))
        curve = []
        for step in list(range(eval_every, steps + 1, eval_every)) + ([steps] if steps % eval_every else []):
            scores = evaluate(model_dir, split=split, checkpoint=ModelDir(model_dir).checkpoint(step),
                              progress=False)
            curve.append({"step": step, "seconds": result.elapsed_s[step - 1], "CIDEr": scores.metrics["CIDEr"],
                          "Bleu_4": scores.metrics["Bleu_4"], "perplexity": scores.perplexity})
            log.info("step %d (%.0f s of training): %s CIDEr %.3f, BLEU-4 %.3f", step, curve[-1]["seconds"], split,
                     curve[-1]["CIDEr"], curve[-1]["Bleu_4"])
    finally:
        if scratch:
            shutil.rmtree(model_dir, ignore_errors=True)
    reached = next((point for point in curve if point["CIDEr"] >= target), None)
    return {
        "target_cider": target,
        "seconds_to_target": reached["seconds"] if reached else None,
        "steps_to_target": reached["step"] if reached else None,
        "final": curve[-1],
        "train_seconds": result.elapsed_s[-1],
        "curve": curve,
        "settings": {"config": config, "overrides": list(overrides), "data": cfg.data.dir, "steps": steps,
                     "eval_every": eval_every, "split": split, "batch_size": cfg.train.batch_size,
                     "captions_per_image": cfg.data.captions_per_image, "decode": config_lib.to_dict(cfg)["decode"]},
        "machine": common.machine(),
    }


def summary(result: dict) -> str:
    if "compared" in result:
        def times(key):
            value = result[key]
            return "-" if value is None else f"{value:.2f}x"

        return (f"base:     {summary(result['base'])}\ncompared: {summary(result['compared'])}\n"
                f"with {' '.join(result['compare'])}: time to the target {times('seconds_to_target_ratio')}, "
                f"training time {times('train_seconds_ratio')} of the base's")
    final = result["final"]
    reached = (f"CIDEr >= {result['target_cider']:g} after {result['seconds_to_target']:.0f} s of training "
               f"(step {result['steps_to_target']})" if result["steps_to_target"] is not None else
               f"CIDEr {result['target_cider']:g} not reached")
    return (f"time to quality: {reached}; final (step {final['step']}, {result['train_seconds']:.0f} s): CIDEr "
            f"{final['CIDEr']:.3f}, BLEU-4 {final['Bleu_4']:.3f}")
