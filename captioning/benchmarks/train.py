"""``captioning benchmark train``: the real training loop, each iteration split into ingestion and step.

The seeds' definition: iteration time = ingestion time (waiting for the next batch) + train step time.
:meth:`captioning.train.Trainer.run` measures both for every iteration (and logs them to TensorBoard
during any training); this benchmark runs it for ``warmup + steps`` steps in a scratch model folder,
with evaluation and sample captions off, and reports the steps after the warm-up (tracing, cache
filling and the autotuner's ramp-up happen there); ``first_step_s`` is the first step alone (with
``train.steps_per_execution`` K, its call's time over K), most of it tracing and optimizing the step's graph,
whose size ``step_graph_nodes`` gives (``train.fused_updates`` shrinks it). ``xla_compilations``: how many times XLA
compiled during the whole run (warm-up, measured steps and the step-in-parts timing), counted by TensorFlow's
profiler (:func:`captioning.benchmarks.common.counting_xla_compilations`): a compiled step (``train.jit_compile``)
or SCST's compiled sampling (``scst.xla_sampling``) compiles again for every new input shape, about 1.4 s each here.

Any config runs on any prepared records (``--data DIR`` sets ``data.dir``; ``--photos`` the COCO-like
benchmark photos of ``benchmark input``). ``--compare SECTION.KEY=VALUE`` measures the config with and
without those overrides side by side (``--rounds`` runs of each, alternated, the fastest kept), e.g.
grouped captions against per-caption examples on the COCO recipe::

    captioning benchmark train --config experiments/show_and_tell_coco.yaml --photos \
        --set model.encoder_weights=none --set data.captions_per_image=all \
        --compare data.captions_per_image=grouped --compare train.split_padding=true --steps 10 --warmup 3
 Throughput is reported as
captions (examples) and distinct images per second, and ``encoder_images_per_caption``: how many images
the encoder runs per caption — 1 when every caption is its own example (``captions_per_image: all``
or ``sample``; an image seen with several captions is encoded again for each), ``1 / captions per
image`` with ``grouped``. Per step they follow from the batch size and the split's captions per image:
``all`` and ``sample`` batches hold ``batch_size`` captions; ``grouped`` batches hold
``round(per-replica batch / captions per image)`` images with all their captions, per replica.
"""

from __future__ import annotations

import logging
import shutil
import statistics
import tempfile

from captioning import config as config_lib
from captioning.benchmarks import common
from captioning.errors import InputError

log = logging.getLogger("captioning.benchmark")

TARGET_INGESTION_SHARE = 0.02


def run(config: str, overrides: tuple[str, ...] = (), steps: int = 300, warmup: int = 50,
        data_dir: str | None = None, compare: tuple[str, ...] = (), rounds: int = 2, photos: bool = False,
        work_dir: str = "runs/benchmarks", progress: bool = True) -> dict:
    """The measurement of ``config`` (with ``overrides``), or with ``compare`` (more overrides) two of
    them side by side: ``rounds`` runs of each, alternated, the fastest of each kept, and
    ``captions_per_s_ratio`` (compared / base). ``photos``: train on the COCO-like benchmark photos made
    once in ``work_dir`` (as ``benchmark input`` does) instead of the config's records."""
    if steps < 1 or warmup < 0 or rounds < 1:
        raise InputError("`steps` and `rounds` must be at least 1 and `warmup` at least 0",
                         params=("steps", "warmup", "rounds"))
    if photos and data_dir:
        raise InputError("give `photos` or `data_dir`, not both", params=("photos", "data_dir"))
    if photos:
        from captioning.benchmarks.input import PHOTOS, photo_records

        data_dir = photo_records(work_dir, PHOTOS["images"], PHOTOS["cache_images"], PHOTOS["size"],
                                 progress=progress)
    if not compare:
        return _measure(config, tuple(overrides), steps, warmup, data_dir, progress)
    variants = {"base": tuple(overrides), "compared": tuple(overrides) + tuple(compare)}
    best: dict[str, dict] = {}
    for r in range(rounds):
        for name, values in variants.items():
            m = _measure(config, values, steps, warmup, data_dir, progress)
            log.info("round %d: %-8s %s", r + 1, name, summary(m))
            if name not in best or m["captions_per_s"] > best[name]["captions_per_s"]:
                best[name] = m
    return {"base": best["base"], "compared": best["compared"], "compare": list(compare), "rounds": rounds,
            "captions_per_s_ratio": best["compared"]["captions_per_s"] / best["base"]["captions_per_s"],
            "machine": common.machine()}


def _measure(config: str, overrides: tuple[str, ...], steps: int, warmup: int, data_dir: str | None,
             progress: bool) -> dict:
    from captioning.data.batching import epoch_captions_per_image
    from captioning.experiment import for_training
    from captioning.train import train
    from captioning.train.objectives import objective_class

    cfg = config_lib.load_config(config, overrides)
    if data_dir:
        cfg.data.dir = data_dir
    experiment = for_training(cfg)  # as training will run it
    cfg = experiment.config  # the run's lengths below are the benchmark's own (typed values, checked above)
    stored = experiment.dataset.split(cfg.data.train_split).captions_per_image
    per_image = epoch_captions_per_image(cfg.data, stored)  # data.group_captions: k per image
    cfg.train.steps = warmup + steps
    cfg.train.eval_every_steps = 0
    cfg.train.sample_captions = 0
    cfg.train.checkpoint_every_steps = cfg.train.steps  # one save, after the last step
    cfg.train.log_every_steps = max(1, min(cfg.train.log_every_steps, steps))
    model_dir = tempfile.mkdtemp(prefix="captioning-benchmark-train-")
    try:
        log.info("benchmarking %d training steps (after %d warm-up steps) of %s in %s", steps, warmup, config,
                 model_dir)
        parts: dict = {}
        with common.counting_xla_compilations() as counted:
            result = train(experiment, model_dir, progress=progress, then=lambda trainer: parts.update(_after(trainer)))
    finally:
        shutil.rmtree(model_dir, ignore_errors=True)
    ingestion, step = result.ingestion_s[warmup:], result.step_s[warmup:]
    total = sum(ingestion) + sum(step)
    captions, images = per_step(cfg, per_image, result.replicas)
    objective = objective_class(cfg.train.objective)
    extra = objective.measure(cfg, images / result.replicas, per_image, 1000 * statistics.fmean(step))
    if extra:  # what the objective measured of its own, and one line about it
        extra["objective_note"] = objective.summarize(extra)
    graph_nodes = parts.pop("graph_nodes", None)
    if parts:  # its step in parts, timed with the run's model
        extra["parts_ms"] = parts["parts_ms"]
        extra["objective_note"] = "\n".join(filter(None, (extra.get("objective_note"), parts["note"])))
    return {**extra,
        "ingestion_share": sum(ingestion) / total,
        "xla_compilations": counted["xla_compilations"],
        "step_ms": 1000 * statistics.fmean(step),
        # the first step's whole time: tracing the step, TensorFlow's graph optimizations and its first run
        "first_step_s": result.step_s[0],
        "step_graph_nodes": graph_nodes,
        "iteration_ms": 1000 * total / len(step),
        "examples_per_s": captions * len(step) / total,
        "captions_per_s": captions * len(step) / total,
        "images_per_s": images * len(step) / total,
        "encoder_images_per_caption": images / captions if cfg.data.captions_per_image == "grouped" else 1.0,
        "ingestion_ms": {"mean": 1000 * statistics.fmean(ingestion), "median": 1000 * statistics.median(ingestion),
                         "max": 1000 * max(ingestion)},
        "settings": {"config": config, "overrides": list(overrides), "data": cfg.data.dir, "steps": steps,
                     "warmup": warmup, "batch_size": cfg.train.batch_size, "cache": cfg.data.cache,
                     "captions_per_image": cfg.data.captions_per_image, "encoder": cfg.model.encoder,
                     "replicas": result.replicas},
        "target": {"ingestion_share": [TARGET_INGESTION_SHARE,
                                       sum(ingestion) / total <= TARGET_INGESTION_SHARE]},
        "machine": common.machine(),
    }


def _after(trainer) -> dict:
    """After the run (the model as trained): :func:`_parts` and, under ``graph_nodes``, :func:`_graph_nodes`, both
    of one training input pipeline built for them (a construction traces the pipeline's functions); nothing when
    the run was interrupted."""
    if trainer.current_step() < trainer.cfg.train.steps:
        return {}
    dataset = trainer.distributed_dataset(trainer.cfg.data.train_split, training=True)
    return {**_parts(trainer, dataset), "graph_nodes": _graph_nodes(trainer, dataset)}


def _parts(trainer, dataset) -> dict:
    """The objective's breakdown of its step (:meth:`~captioning.train.objectives.Objective.breakdown`), on the
    first replica's share of one batch of ``dataset`` (the run's training input); nothing, and no batch read, for an
    objective without a breakdown of its own."""
    from captioning.train.objectives.base import Objective

    if type(trainer.objective).breakdown is Objective.breakdown:  # the base's: nothing to time
        return {}
    batch = trainer.strategy.experimental_local_results(next(iter(dataset)))[0]
    return trainer.objective.breakdown(trainer.model, batch)


def _graph_nodes(trainer, dataset) -> int | None:
    """The nodes of the training step's graph for batches of ``dataset``, with those of the functions it calls
    (what TensorFlow traces and optimizes before the first step); None when the loop did not call the one
    step function (``train.accumulate_steps`` or ``train.steps_per_execution`` above 1)."""
    t = trainer.cfg.train
    if trainer.accumulation is not None or t.steps_per_execution > 1:
        return None
    step = trainer.train_step_for(dataset)
    graph = step.get_concrete_function().graph.as_graph_def()
    return len(graph.node) + sum(len(f.node_def) for f in graph.library.function)


def per_step(cfg: config_lib.Config, captions_per_image: float, replicas: int) -> tuple[float, float]:
    """(captions, distinct images) in one optimizer step: one global batch, or ``train.accumulate_steps``
    of them (see the module docstring).

    >>> cfg = config_lib.load_config(None, ["train.batch_size=32", "data.captions_per_image=grouped"])
    >>> per_step(cfg, 5.0, 1), per_step(cfg, 5.0, 2)
    ((30.0, 6), (30.0, 6))
    >>> per_step(config_lib.load_config(None, ["train.batch_size=32", "train.accumulate_steps=4"]), 5.0, 1)
    (128.0, 128.0)
    """
    batch, k = cfg.train.batch_size, cfg.train.accumulate_steps
    if cfg.data.captions_per_image != "grouped":
        return float(batch * k), float(batch * k)  # nearly all distinct: a caption's image, once per caption
    images = replicas * max(1, round(batch / replicas / captions_per_image))
    return images * captions_per_image * k, images * k


def summary(result: dict) -> str:
    if "objective_note" in result and "compared" not in result:
        return summary({k: v for k, v in result.items() if k != "objective_note"}) + "\n" + result["objective_note"]
    if "compared" in result:
        return (f"base:     {summary(result['base'])}\ncompared: {summary(result['compared'])}\n"
                f"with {' '.join(result['compare'])}: {result['captions_per_s_ratio']:.2f}x the captions/s "
                f"(best of {result['rounds']} runs each, alternated)")
    return (f"iteration {result['iteration_ms']:.1f} ms = ingestion {result['ingestion_ms']['mean']:.2f} ms "
            f"+ train step {result['step_ms']:.1f} ms (the first {result['first_step_s']:.1f} s); "
            f"ingestion share {result['ingestion_share']:.4f} "
            f"(target <= {TARGET_INGESTION_SHARE}); {result['captions_per_s']:.0f} captions/s, "
            f"{result['images_per_s']:.0f} images/s, encoder images per caption "
            f"{result['encoder_images_per_caption']:.2f}"
            + (f"; {result['xla_compilations']} XLA compilation{'s' * (result['xla_compilations'] != 1)}"
               if result.get("xla_compilations") else ""))
