"""Run by the tests (tests/helpers.py) in fresh processes (logical devices must be set before TF starts).

    python tests/distributed_worker.py mirrored DATA_DIR OUT_DIR
        one training step from the same weights and the same global batch on one device and on a
        MirroredStrategy over 2 logical CPUs; writes both losses and weights to OUT_DIR/mirrored.npz
    python tests/distributed_worker.py mirrored_decoder DATA_DIR OUT_DIR NAME[,NAME...] [--decoder FILE:NAME ...]
        the same for each decoder NAME with its tiny settings, and its XLA-compiled step, into
        OUT_DIR/mirrored-NAME.npz (tests/test_decoders.py, for every decoder; conftest's mirrored_contracts runs it
        with mirrored_specs, tests/test_encoders_end_to_end.py's pairs, in one process through many)
    python tests/distributed_worker.py mirrored_scst DATA_DIR OUT_DIR
        one self-critical step (samples, CIDEr-D reward, policy gradient) on one device and on 2 replicas
    python tests/distributed_worker.py multi_worker DATA_DIR OUT_DIR   (with TF_CONFIG set; multi_worker_scst: SCST)
        trains a few steps under MultiWorkerMirroredStrategy; writes OUT_DIR/weights-<task>.npz
    python tests/distributed_worker.py multi_worker_service DATA_DIR OUT_DIR HOST:PORT   (with TF_CONFIG set)
        the same for 30 steps (1.5 epochs) with the input from a tf.data service (distributed_epoch)
    python tests/distributed_worker.py eval_losses DATA_DIR OUT_DIR MODEL_DIR STRATEGY
        the evaluation loss of MODEL_DIR's checkpoint on the val and test splits for several global
        batch sizes, under STRATEGY (one, mirrored over 2 logical CPUs, or multi_worker with TF_CONFIG);
        writes OUT_DIR/eval-<strategy>[-<task>].json: {"split/batch": [loss, tokens]}
    python tests/distributed_worker.py many SPEC.json   (TF_CONFIG set: the multi-worker scenarios)
        the scenarios SPEC.json lists ([MODE, DATA_DIR, OUT_DIR, ARG...] each) one after another in this
        process (tests/helpers.py's run_distributed_scenarios, for the tests of several files at once)

The scenarios that belong to one test file each (accumulate, nan_skip, uneven_cli, resume, fused) and
eval_losses, which tests/test_uneven_splits.py also runs on one device in its own process, live in the harness
(tests/harness/scenarios.py), as do the small config, the two logical CPUs and the process's one multi-worker
strategy (tests/harness/distributed.py); this script imports them, and no test module.
"""

import json
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

from tests.harness import scenarios  # noqa: E402
from tests.harness.distributed import multi_worker_strategy, small_config, two_cpus, two_replicas  # noqa: E402


def weights(model):
    return {f"{i:03d}_{v.name}": v.numpy() for i, v in enumerate(model.variables)}


def mirrored(data_dir, out_dir, *extra, out_name="mirrored", xla=False, average=False):
    """One training step on one device against two mirrored replicas from the same weights and batch, into
    ``OUT_NAME.npz`` (``one_*``, ``two_*``, and each weight as ``one/KEY``, ``two/KEY``). ``xla``: a third,
    on one device with ``train.jit_compile=true`` (``xla_*``, ``xla/KEY``), for tests/test_decoders.py's XLA
    test, which so shares this process's plain step and TensorFlow start-up: the one-device Trainer's own step with
    the key set, from its variables (and average) put back as they were before its plain step (one model and
    Trainer for both; its plain step is the one its configuration compiles). ``average``: with the weight average
    (``train.ema_decay`` at tests/harness/scenarios.py's DECAY) started from the weights all start with, three steps
    on the batch instead of one (the loss and norm are the first's, the weights those after the third), and each
    replica's copy of every average (``NAME_copies_K``) beside its weight (``NAME_weight_K``), for
    tests/test_ema.py's 2-replica test, which so shares the decoder contract's run of show_and_tell."""
    two_cpus()
    from captioning.data.pipeline import make_dataset
    from captioning.experiment import for_training
    from captioning.train import Trainer
    from captioning.train.steps import Compiled
    from tests.harness.training import restore, snapshot

    # clipping at 0.05 is always active here, so clipping per replica instead of after the all-reduce
    # would change the update
    # The encoder trains too: its batch norm sees the global batch's statistics (model.sync_batch_norm).
    settings = ("train.clip_gradient_norm=0.05", *extra, *[f"train.ema_decay={scenarios.DECAY}"] * average)
    cfg = small_config(data_dir, *settings)
    folders = os.path.join(out_dir, out_name)
    one = Trainer(for_training(cfg), os.path.join(folders, "one"), strategy=tf.distribute.OneDeviceStrategy("/cpu:0"))
    two = Trainer(for_training(cfg), os.path.join(folders, "two"), strategy=two_replicas())
    trainers = [("one", one), ("two", two)] + [("xla", one)] * xla  # the XLA step: the one-device Trainer's
    for a, b in zip(one.model.variables, two.model.variables):
        b.assign(a.numpy())
    if average:
        two.average.start(None)  # from the weights all start with
    start = snapshot(one) if xla else None  # what the XLA step starts from: the plain one's start
    # one fixed global batch of 8 captions; its two halves hold different numbers of real tokens
    batch = next(iter(make_dataset(cfg.data, "train", training=False, batch_size=8, source=one.source,
                                   tokenizer=one.vocab)))  # the run's ids: a language model's pieces for prefix_lm
    mask = batch["mask"].numpy()
    results = {"tokens_first_half": mask[:4].sum(), "tokens_second_half": mask[4:].sum()}
    for name, trainer in trainers:
        if name == "xla":  # the same Trainer, its variables and average put back, its step compiled by XLA
            assert not trainer.cfg.train.jit_compile and trainer.accumulation is None
            restore(trainer, start)
            if average:
                trainer.average.start(None)
            trainer.cfg.train.jit_compile, trainer._compiled = True, Compiled()  # train.jit_compile: true
        dataset = trainer.strategy.experimental_distribute_dataset(
            tf.data.Dataset.from_tensors(batch).unbatch().batch(8))
        step = trainer.train_step_for(dataset)
        out = step(next(iter(dataset)))
        for _ in range(2 if average else 0):
            step(next(iter(dataset)))
        loss, norm, tokens = out["loss"], out["gradient_norm"], out["weight"]
        results[f"{name}_loss"], results[f"{name}_norm"] = float(loss), float(norm)
        results[f"{name}_replicas"] = trainer.strategy.num_replicas_in_sync
        for key, value in weights(trainer.model).items():
            results[f"{name}/{key}"] = value
        for k, (variable, copies) in enumerate(trainer.average.pairs if average else ()):
            local = trainer.strategy.experimental_local_results(copies)
            results[f"{name}_copies_{k}"] = np.stack([c.numpy() for c in local])
            results[f"{name}_weight_{k}"] = variable.numpy()
    np.savez(os.path.join(out_dir, f"{out_name}.npz"), **results)


def mirrored_grouped(data_dir, out_dir, *extra, out_name="mirrored_grouped"):
    """captions_per_image: grouped under 2 replicas (each its own batch of whole images, as
    distribute_datasets_from_function hands them out) against one device given both batches as one;
    with split padding (train.split_padding), whose cut each replica chooses for its own batch."""
    two_cpus()
    from captioning.data.pipeline import make_dataset
    from captioning.experiment import for_training
    from captioning.train import Trainer

    cfg = small_config(data_dir, "train.clip_gradient_norm=0.05", "data.captions_per_image=grouped",
                       "train.split_padding=true", *extra)
    one = Trainer(for_training(cfg), os.path.join(out_dir, "one"), strategy=tf.distribute.OneDeviceStrategy("/cpu:0"))
    two = Trainer(for_training(cfg), os.path.join(out_dir, "two"), strategy=two_replicas())
    for a, b in zip(one.model.variables, two.model.variables):
        b.assign(a.numpy())
    stream = iter(make_dataset(cfg.data, "train", training=True, batch_size=10, source=one.source, tokenizer=one.vocab))
    first, second = next(stream), next(stream)  # 2 images each, 10 or so captions, different lengths
    width = max(int(first["input_ids"].shape[1]), int(second["input_ids"].shape[1]))
    # data.features: regions — each batch's regions padded to its own most; joined, to the larger of the two
    regions = max(int(b["regions"].shape[1]) for b in (first, second)) if "regions" in first else 0

    def padded(batch, own_regions=True):
        out = {}
        for k, v in batch.items():
            if k in ("input_ids", "target_ids", "mask"):
                v = tf.pad(v, [[0, 0], [0, width - v.shape[1]]])
            elif k in ("regions", "boxes", "region_mask") and not own_regions:
                v = tf.pad(v, [[0, 0], [0, regions - v.shape[1]]] + [[0, 0]] * (len(v.shape) - 2))
            out[k] = v
        return out

    images = "regions" if regions else "image"
    joined = {k: tf.concat([v, padded(second, False)[k] + (len(first[images]) if k == "image_index" else 0)], 0)
              for k, v in padded(first, False).items()}
    first, second = padded(first), padded(second)  # each replica keeps its own number of regions
    results = {"tokens_first": first["mask"].numpy().sum(), "tokens_second": second["mask"].numpy().sum(),
               "images": len(joined[images]), "captions": len(joined["image_index"]),
               "regions_first": int(first["regions"].shape[1]) if regions else 0,
               "regions_second": int(second["regions"].shape[1]) if regions else 0}
    sources = {"one": tf.data.Dataset.from_tensors(joined),
               "two": tf.data.Dataset.from_tensors(first).concatenate(tf.data.Dataset.from_tensors(second))}
    for name, trainer in (("one", one), ("two", two)):
        dataset = trainer.strategy.distribute_datasets_from_function(lambda ctx, name=name: sources[name])
        out = trainer.train_step_for(dataset)(next(iter(dataset)))
        loss, norm, tokens = out["loss"], out["gradient_norm"], out["weight"]
        results[f"{name}_loss"], results[f"{name}_norm"] = float(loss), float(norm)
        results[f"{name}_tokens"] = float(tokens)
        results[f"{name}_reward"] = float(out.get("reward", 0.0))
        results[f"{name}_xe"] = float(out.get("xe", 0.0))  # scst.xe_weight's term (mirrored_scst)
        for key, value in weights(trainer.model).items():
            results[f"{name}/{key}"] = value
    np.savez(os.path.join(out_dir, f"{out_name}.npz"), **results)


SCST = ("train.objective=scst", "data.captions_per_image=grouped", "train.batch_size=10", "train.optimizer=sgd",
        "train.learning_rate=0.05", "scst.samples=3")


def mirrored_scst(data_dir, out_dir):
    """SCST under 2 replicas (each its own batch of whole images) against one device given both batches as
    one: the samples are drawn for the global batch, so both draw the same and update the same. With
    scst.xe_weight 0.5: the references' cross-entropy term is a global mean per real token on both (SCST
    alone runs in mirrored_scst_with, over regions, and in multi_worker_scst)."""
    mirrored_grouped(data_dir, out_dir, *SCST, "scst.xe_weight=0.5", out_name="mirrored_scst")


def multi_worker(data_dir, out_dir, *extra):
    strategy = multi_worker_strategy()
    from captioning.experiment import for_training
    from captioning.train import Trainer

    task = json.loads(os.environ["TF_CONFIG"])["task"]["index"]
    cfg = small_config(data_dir, "train.steps=4", "distribute.strategy=multi_worker", *extra)
    trainer = Trainer(for_training(cfg), os.path.join(out_dir, "model"), strategy=strategy)
    result = trainer.run(progress=False)
    np.savez(os.path.join(out_dir, f"weights-{task}.npz"), losses=np.array(result["losses"]),
             replicas=strategy.num_replicas_in_sync, **weights(trainer.model))


def mirrored_decoder(data_dir, out_dir, names, *registered):
    """``mirrored`` (with its XLA step; for tests/harness/scenarios.py's AVERAGED, with the weight average) for each
    decoder of ``names`` (comma-separated) with its tiny settings, into
    ``mirrored-NAME.npz``, or its traceback into ``mirrored-NAME.error``: one process (one TensorFlow
    start) for every decoder. ``--decoder FILE:NAME`` pairs in ``registered`` register decoders from
    files first, as the contract tests' option does."""
    import traceback

    from tests.harness.models import encoder_of, tiny_options
    from tests.helpers import register_decoder_file

    for flag, spec in zip(registered[::2], registered[1::2]):
        path, _, registered_name = spec.rpartition(":")
        register_decoder_file(path, registered_name)
    two_cpus()  # before a tiny LM preset is written (prefix_lm's tiny options): TensorFlow starts then
    for name in names.split(","):
        tiny = [f"model.{k}={v}" for k, v in tiny_options(name).items()]  # (a tiny LM preset written for prefix_lm)
        tiny.append(f"model.encoder={encoder_of(name)}")  # small_cnn, or the decoder's own (vlm's preset's tower)
        try:
            mirrored(data_dir, out_dir, f"model.decoder={name}", *tiny, out_name=f"mirrored-{name}", xla=True,
                     average=name == scenarios.AVERAGED)
        except Exception:  # noqa: BLE001 - reported by the test of that decoder
            with open(os.path.join(out_dir, f"mirrored-{name}.error"), "w") as f:
                f.write(traceback.format_exc())


def mirrored_specs(data_dir, out_dir, *specs):
    """``mirrored`` for each ``LABEL=KEY=VALUE;KEY=VALUE...`` of ``specs`` (an encoder and decoder with their
    settings), into ``mirrored-LABEL.npz`` or ``mirrored-LABEL.error``, in one process."""
    import traceback

    for spec in specs:
        label, _, overrides = spec.partition("=")
        try:
            mirrored(data_dir, out_dir, *overrides.split(";"), out_name=f"mirrored-{label}")
        except Exception:  # noqa: BLE001 - reported by the test of that pair
            with open(os.path.join(out_dir, f"mirrored-{label}.error"), "w") as f:
                f.write(traceback.format_exc())


def many(spec_file):
    """The scenarios that ``spec_file`` (JSON) lists, ``[[MODE, DATA_DIR, OUT_DIR, ARG...], ...]``, one after
    another in this process: one TensorFlow start-up (and under TF_CONFIG one cluster) for all of them. Each
    writes its results into its OUT_DIR, and then OUT_DIR/done-TASK (TASK: the TF_CONFIG index, or "one"; it holds
    the scenario's CPU seconds in this process), or
    its traceback into OUT_DIR/error.txt. Under multi-worker the first error ends the process (the peer would
    wait on a collective that never comes); the scenarios not run then have neither."""
    import time
    import traceback

    with open(spec_file) as f:
        scenarios = json.load(f)
    begun = time.time()
    print(f"[many] {len(scenarios)} scenarios, after {time.process_time():.1f} CPU-s of start-up", flush=True)
    for mode, *args in scenarios:
        os.makedirs(args[1], exist_ok=True)
        try:
            started, wall = time.process_time(), time.time()
            MODES[mode](*args)
            task = json.loads(os.environ.get("TF_CONFIG", "{}")).get("task", {}).get("index", "one")
            cpu = time.process_time() - started
            with open(os.path.join(args[1], f"done-{task}"), "w") as f:  # the scenario's CPU seconds, to measure
                f.write(f"{cpu:.1f}\n")
            # each scenario's cost in the process's log (root/GROUP[-TASK].log), to see where the time goes
            print(f"[many] {os.path.basename(args[1])} ({mode}): {cpu:.1f} CPU-s, {time.time() - wall:.1f} s wall, "
                  f"ended {time.time() - begun:.1f} s after the first began", flush=True)
        except Exception:  # noqa: BLE001 - reported by the test of that scenario
            with open(os.path.join(args[1], "error.txt"), "w") as f:
                f.write(traceback.format_exc())
            if "TF_CONFIG" in os.environ:
                raise


MODES = {"mirrored_decoder": mirrored_decoder, "mirrored_specs": mirrored_specs, "mirrored": mirrored,
         "mirrored_grouped": mirrored_grouped, "multi_worker": multi_worker, "mirrored_scst": mirrored_scst,
         "multi_worker_scst": lambda d, o: multi_worker(d, o, *SCST),
         "mirrored_scst_with": lambda d, o, *extra: mirrored_grouped(d, o, *SCST, *extra, out_name="mirrored_scst"),
         "eval_losses": scenarios.eval_losses,
         "accumulate": scenarios.accumulate,
         # commands that need 2 logical CPUs, through the CLI's main in this process (tests/helpers.py's run_main_into)
         "nan_skip": scenarios.nan_skip, "uneven_cli": scenarios.uneven_cli, "resume": scenarios.resume,
         "fused": scenarios.fused,
         "multi_worker_service": lambda d, o, service: multi_worker(
             d, o, f"data.service={service}", "data.service_mode=distributed_epoch", "train.steps=30"),
         "many": many}

if __name__ == "__main__":
    MODES[sys.argv[1]](*sys.argv[2:])
