"""``captioning benchmark train``: the real training loop, each iteration split into ingestion and step.

The seeds' definition: iteration time = ingestion time (waiting for the next batch) + train step time.
:meth:`captioning.train.Trainer.run` measures both for every iteration (and logs them to TensorBoard
during any training); this benchmark runs it for ``warmup + steps`` steps in a scratch model folder,
with evaluation and sample captions off, and reports the steps after the warm-up (tracing, cache
filling and the autotuner's ramp-up happen there).
"""

from __future__ import annotations

import logging
import shutil
import statistics
import tempfile

from captioning import config as config_lib
from captioning.cli.benchmarks import common
from captioning.errors import InputError

log = logging.getLogger("captioning.benchmark")

TARGET_INGESTION_SHARE = 0.02


def run(config: str, overrides: tuple[str, ...] = (), steps: int = 300, warmup: int = 50,
        progress: bool = True) -> dict:
    from captioning.train import train

    if steps < 1 or warmup < 0:
        raise InputError("steps must be at least 1 and warmup at least 0", params=("steps", "warmup"))
    cfg = config_lib.load_config(config, overrides)
    cfg.train.steps = warmup + steps
    cfg.train.eval_every_steps = 0
    cfg.train.sample_captions = 0
    cfg.train.checkpoint_every_steps = cfg.train.steps  # one save, after the last step
    cfg.train.log_every_steps = max(1, min(cfg.train.log_every_steps, steps))
    model_dir = tempfile.mkdtemp(prefix="captioning-benchmark-train-")
    try:
        log.info("benchmarking %d training steps (after %d warm-up steps) of %s in %s", steps, warmup, config,
                 model_dir)
        result = train(cfg, model_dir, progress=progress)
    finally:
        shutil.rmtree(model_dir, ignore_errors=True)
    ingestion, step = result.ingestion_s[warmup:], result.step_s[warmup:]
    total = sum(ingestion) + sum(step)
    return {
        "ingestion_share": sum(ingestion) / total,
        "step_ms": 1000 * statistics.fmean(step),
        "iteration_ms": 1000 * total / len(step),
        "examples_per_s": cfg.train.batch_size * len(step) / total,
        "ingestion_ms": {"mean": 1000 * statistics.fmean(ingestion), "median": 1000 * statistics.median(ingestion),
                         "max": 1000 * max(ingestion)},
        "settings": {"config": config, "overrides": list(overrides), "steps": steps, "warmup": warmup,
                     "batch_size": cfg.train.batch_size, "cache": cfg.data.cache,
},
        "target": {"ingestion_share": [TARGET_INGESTION_SHARE,
                                       sum(ingestion) / total <= TARGET_INGESTION_SHARE]},
        "machine": common.machine(),
    }


def summary(result: dict) -> str:
    return (f"iteration {result['iteration_ms']:.1f} ms = ingestion {result['ingestion_ms']['mean']:.2f} ms "
            f"+ train step {result['step_ms']:.1f} ms; ingestion share {result['ingestion_share']:.4f} "
            f"(target <= {TARGET_INGESTION_SHARE}); {result['examples_per_s']:.0f} examples/s")
