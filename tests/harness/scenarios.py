"""The 2-replica scenarios of conftest's ``distributed_runs`` that belong to one test file each, run by
tests/distributed_worker.py (its ``MODES`` of the same names) in the process of the MirroredStrategy scenarios (2
logical CPUs) or, for :func:`fused`, also in the two workers of a localhost cluster (TF_CONFIG); and what those test
files share with them. Each writes its results into OUT_DIR, which the test reads with
``distributed_result(distributed_runs, GROUP, NAME)``:

- :func:`accumulate` (tests/test_accumulate.py) — ``mirrored.npz``: an accumulated step on 2 replicas, one of them
  given an empty micro-batch, against one device's step on the batches joined (:data:`GROUPED`, :func:`joined`,
  :func:`grouped_batches`).
- :data:`DECAY` (tests/test_ema.py): the weight average's decay in the decoder contract's 2-replica run of
  :data:`AVERAGED` (tests/distributed_worker.py's ``mirrored_decoder``, conftest's ``mirrored_contracts``), which
  writes every replica's copy of each average.
- :func:`nan_skip` (tests/test_train_reliability.py) — ``train.json``: ``train.nan_policy=skip`` through the CLI.
- :func:`eval_losses` (tests/test_uneven_splits.py, which runs it on one device too) — ``eval-STRATEGY[-TASK].json``:
  a checkpoint's evaluation losses for the batch sizes :data:`EVAL_BATCHES`.
- :func:`uneven_cli` (tests/test_uneven_splits.py) — ``train.json``: training that evaluates a 1-caption split.
- :func:`resume` (tests/test_train.py) — ``first.json``, ``first.yaml``, ``resumed.json``: a run resumed on 2
  replicas (:data:`RESUME`).
- :func:`fused` (tests/test_optimizer.py) — ``fused-TASK.npz``: the fused optimizer updates under 2 replicas against
  Keras' own on one device (:data:`KINDS`, :func:`optimizer_of`, :func:`random_gradients`, :func:`start_values`,
  :func:`run_updates`).

And what conftest's ``mirrored_contracts`` (the decoder and encoder contracts' 2-replica steps, a process for each of
tests/test_decoders.py and tests/test_encoders_end_to_end.py, at once) selects and runs: :data:`DECODER_TESTS`,
:data:`EMA_TEST`, :data:`AVERAGED`, :data:`ENCODER_TEST`, :data:`MIRRORED_PAIRS`, :func:`pair_spec`; and
:func:`contract_result`, which reads it.
"""

import json
import os
import shutil

import numpy as np

from tests.harness.distributed import multi_worker_strategy, small_config, two_cpus, two_replicas
from tests.helpers import REPO, run_main_into, small_train_config

# ---- tests/test_accumulate.py ---------------------------------------------------------------------------------

# a frozen encoder: batch normalisation in training mode normalises by its batch's statistics, which no
# accumulation (here, Keras' or PyTorch's) can make those of the large batch
GROUPED = ("data.captions_per_image=grouped", "train.split_padding=true", "model.encoder_trainable=false",
           "train.clip_gradient_norm=0.05")  # clipping always active: it must see the whole step's gradient


def joined(*batches):
    """One batch holding ``batches`` (grouped: each with its images), captions padded to the longest."""
    import tensorflow as tf

    width = max(int(b["input_ids"].shape[1]) for b in batches)
    out, images = {}, 0
    for b in batches:
        for k, v in b.items():
            if k in ("input_ids", "target_ids", "mask"):
                v = tf.pad(v, [[0, 0], [0, width - v.shape[1]]])
            if k == "image_index":
                v = v + images
            out.setdefault(k, []).append(v)
        images += int(b["image"].shape[0])
    return {k: tf.concat(v, 0) for k, v in out.items()}


def grouped_batches(cfg, count, images, tokenizer=None):
    """``count`` grouped training batches of ``images`` images each, as the pipeline makes them (``tokenizer``: the
    run's, whose ids the captions are in; None: the words')."""
    from captioning.data.pipeline import make_dataset

    stream = iter(make_dataset(cfg.data, "train", training=True, batch_size=5 * images, tokenizer=tokenizer))
    return [next(stream) for _ in range(count)]


def accumulate(data_dir, out_dir):
    """The 2-replica check of accumulation (scenario ``accumulate``): writes OUT_DIR/mirrored.npz."""
    import tensorflow as tf

    from captioning.experiment import for_training
    from captioning.train import Trainer

    two_cpus()
    extra = (*GROUPED, "train.optimizer=sgd", "train.learning_rate=0.5")
    one = Trainer(for_training(small_train_config(data_dir, *extra, "train.batch_size=10")), os.path.join(out_dir, "one"),
                  strategy=tf.distribute.OneDeviceStrategy("/cpu:0"))
    two = Trainer(for_training(small_train_config(data_dir, *extra, "train.batch_size=10", "train.accumulate_steps=2")),
                  os.path.join(out_dir, "two"), strategy=two_replicas())
    for a, b in zip(one.model.variables, two.model.variables):
        b.assign(a.numpy())
    a1, b1, a2 = grouped_batches(one.cfg, 3, images=1)
    empty = {k: v[:0] for k, v in b1.items()}
    results = {"replicas": two.strategy.num_replicas_in_sync, "empty_captions": int(empty["mask"].shape[0])}
    big = one.strategy.experimental_distribute_dataset(tf.data.Dataset.from_tensors(joined(a1, b1, a2)))
    out = one.train_step_for(big)(next(iter(big)))
    # distribute_datasets_from_function hands the elements to the replicas in turn: micro-batch 1 is (a1, b1),
    # micro-batch 2 is (a2, nothing)
    elements = tf.data.Dataset.from_tensors(a1)
    for b in (b1, a2, empty):
        elements = elements.concatenate(tf.data.Dataset.from_tensors(b))
    micro = two.strategy.distribute_datasets_from_function(lambda context: elements)
    batches = iter(micro)
    got = two.train_step_for(micro)([next(batches), next(batches)])
    for name, trainer, o in (("one", one, out), ("two", two, got)):
        results[f"{name}_loss"], results[f"{name}_norm"] = float(o["loss"]), float(o["gradient_norm"])
        results[f"{name}_weight"], results[f"{name}_step"] = float(o["weight"]), int(trainer.step.numpy())
        for i, v in enumerate(trainer.model.trainable_variables):
            results[f"{name}/{i:03d}_{v.name}"] = v.numpy()
    np.savez(os.path.join(out_dir, "mirrored.npz"), **results)


# ---- tests/test_ema.py ----------------------------------------------------------------------------------------

DECAY = 0.5  # train.ema_decay (also of the decoder contract's run of AVERAGED: tests/distributed_worker.py's mirrored)


# ---- tests/test_uneven_splits.py -------------------------------------------------------------------------------

EVAL_BATCHES = (2, 4, 6, 16)  # global batch sizes: per replica 1, 2, 3, 8 under two replicas
# the architecture of tests/conftest.py's trained_model_dir
TRAINED = ("train.optimizer=adam", "train.learning_rate=0.01", "model.embedding_size=32", "model.lstm_units=32")


def eval_losses(data_dir, out_dir, model_dir, strategy_name):
    """Every (split, global batch) evaluation loss of one checkpoint under one strategy (scenario ``eval_losses``
    under ``mirrored`` or ``multi_worker``; tests/test_uneven_splits.py runs it under ``one`` in its own process)."""
    import tensorflow as tf

    if strategy_name == "mirrored":
        two_cpus()
        strategy = two_replicas()
    elif strategy_name == "multi_worker":
        strategy = multi_worker_strategy()
    else:
        strategy = tf.distribute.OneDeviceStrategy("/cpu:0")
    from captioning.experiment import for_training
    from captioning.train import Trainer

    trainer = Trainer(for_training(small_config(data_dir, *TRAINED)), model_dir, strategy=strategy)
    results = {"replicas": strategy.num_replicas_in_sync, "step": int(trainer.step.numpy())}
    for split in ("val", "test"):
        for batch in EVAL_BATCHES:
            trainer.cfg.data.eval_split, trainer.cfg.train.batch_size = split, batch
            loss = trainer.evaluate_loss()
            results[f"{split}/{batch}"] = [loss["loss"], loss["tokens"]]
    task = json.loads(os.environ.get("TF_CONFIG", "{}")).get("task", {}).get("index")
    name = f"eval-{strategy_name}" + ("" if task is None else f"-{task}")
    with open(os.path.join(out_dir, name + ".json"), "w") as f:
        json.dump(results, f)


# ---- commands that need 2 logical CPUs, through the CLI's main in this process (tests/helpers.py's run_main_into)

def nan_skip(data_dir, out_dir):
    """tests/test_train_reliability.py's ``test_nan_policy_skip_under_mirrored_strategy``'s command (scenario
    ``nan_skip``): 4 steps with ``train.nan_policy=skip`` on a MirroredStrategy of 2 logical CPUs, the rate
    made to explode (tests/harness/training.py's ``EXPLODE``)."""
    from tests.harness.training import EXPLODE, write_config

    two_cpus()
    config = write_config(os.path.join(out_dir, "c.yaml"), data_dir, "train.steps=4",
                          "train.checkpoint_every_steps=1", "train.nan_policy=skip", "distribute.logical_cpus=2",
                          "distribute.strategy=mirrored", *EXPLODE)
    run_main_into(out_dir, "train", "train", "--config", config, "--model-dir", os.path.join(out_dir, "m"))


def uneven_cli(data_dir, out_dir):
    """tests/test_uneven_splits.py's ``test_mirrored_train_cli_evaluates_a_split_smaller_than_the_replicas``'s
    command (scenario ``uneven_cli``): the issue's command on 2 replicas, evaluating every 2 of 4 steps."""
    two_cpus()
    run_main_into(out_dir, "train", "train", "--config", os.path.join(REPO, "experiments", "shapes.yaml"),
                  "--model-dir", os.path.join(out_dir, "m"), "--set", f"data.dir={data_dir}",
                  "--set", "train.batch_size=16", "--set", "train.steps=4", "--set", "train.eval_every_steps=2",
                  "--set", "train.warmup_steps=0", "--set", "distribute.strategy=mirrored",
                  "--set", "distribute.logical_cpus=2")


RESUME = ("train.steps=6", "train.checkpoint_every_steps=3")


def resume(data_dir, out_dir):
    """tests/test_train.py's ``test_train_cli_runs_and_resumes``'s two commands (scenario ``resume``): 6 steps
    on one device, then resumed to 9 on 2 replicas, replaying the stream (``data.deterministic: true``)."""
    from captioning.config import save_config

    two_cpus()
    config, model_dir = os.path.join(out_dir, "c.yaml"), os.path.join(out_dir, "m")
    save_config(small_config(data_dir, *RESUME), config)
    run_main_into(out_dir, "first", "train", "--config", config, "--model-dir", model_dir)
    shutil.copy(os.path.join(model_dir, "config.yaml"), os.path.join(out_dir, "first.yaml"))  # as the first saved it
    run_main_into(out_dir, "resumed", "train", "--config", config, "--model-dir", model_dir, "--set",
                  "train.steps=9", "--set", "distribute.logical_cpus=2", "--set", "distribute.strategy=mirrored",
                  "--set", "data.deterministic=true")


# ---- tests/test_optimizer.py ----------------------------------------------------------------------------------
# The fused updates (captioning.train.optimizer._FusedUpdates) against Keras' own element-wise ones: every kind the
# config can ask for, with a schedule, a rate scale on some variables and AdamW's decay.
KINDS = {"sgd": ["train.optimizer=sgd"], "momentum": ["train.optimizer=sgd", "train.momentum=0.9"],
         "adam": ["train.optimizer=adam"], "adamw": ["train.optimizer=adamw", "train.weight_decay=0.1"]}
SHAPES = [(7, 5), (5,), (64,)]


def optimizer_of(kind, fused, variables):
    """The optimizer of ``kind`` (fused or Keras' own), built for ``variables``, the first at a quarter rate."""
    from captioning.config import load_config
    from captioning.train.optimizer import make_optimizer

    cfg = load_config(None, [*KINDS[kind], "train.learning_rate=0.01", "train.lr_schedule=cosine",
                             "train.warmup_steps=2", "train.steps=10"]).train
    optimizer = make_optimizer(cfg, 10, False, variables[:1], 0.25, fused=fused)  # the first at a quarter rate
    optimizer.build(variables)
    return optimizer


def random_gradients(steps, seed=0):
    """Gradients from 1e-4 to 10 in size, so Adam's normalisation and its epsilon both matter."""
    rng = np.random.default_rng(seed)
    return [[(rng.normal(size=s) * 10 ** rng.uniform(-4, 1, size=s)).astype(np.float32) for s in SHAPES]
            for _ in range(steps)]


def start_values():
    rng = np.random.default_rng(1)
    return [rng.normal(size=s).astype(np.float32) for s in SHAPES]


def run_updates(kind, fused, gradients, start=None):
    """Variables of :data:`SHAPES` from :func:`start_values` updated by ``gradients`` on one device (the optimizer
    first restored from the checkpoint ``start``, if given): the variables, the optimizer and its step's ops."""
    import tensorflow as tf

    variables = [tf.Variable(x) for x in start_values()]
    optimizer = optimizer_of(kind, fused, variables)
    if start is not None:
        tf.train.Checkpoint(optimizer=optimizer, variables=variables).read(start).assert_consumed()
    step = tf.function(lambda g: optimizer.apply(g, variables), autograph=False)
    for g in gradients:
        step([tf.constant(x) for x in g])
    graph = step.get_concrete_function([tf.TensorSpec(s, tf.float32) for s in SHAPES]).graph
    return variables, optimizer, [op.type for op in graph.get_operations()]


def fused(data_dir, out_dir):
    """The fused updates under this process's strategy (scenario ``fused``: 2 mirrored replicas on 2 logical CPUs,
    or one replica in each of 2 workers under TF_CONFIG), each replica handing ``optimizer.apply`` half of every
    gradient as the training step does (its sum restores the whole), against Keras' own update on one device:
    ``fused-TASK.npz`` holds both sets of variables and slots after 4 steps."""
    import tensorflow as tf

    if "TF_CONFIG" in os.environ:
        strategy = multi_worker_strategy()
    else:
        two_cpus()
        strategy = two_replicas()
    gradients = random_gradients(4)
    out = {"replicas": strategy.num_replicas_in_sync}
    for kind in KINDS:
        with strategy.scope():
            variables = [tf.Variable(x) for x in start_values()]
            optimizer = optimizer_of(kind, True, variables)

        @tf.function(autograph=False)
        def step(g):
            share = 1.0 / strategy.num_replicas_in_sync
            strategy.run(lambda: optimizer.apply([x * share for x in g], variables))

        for g in gradients:
            step([tf.constant(x) for x in g])
        reference, keras_own, _ = run_updates(kind, False, gradients)  # Keras' own, on one device
        for name, vs in (("two", list(variables) + list(optimizer.variables)),
                         ("one", reference + list(keras_own.variables))):
            for i, v in enumerate(vs):
                out[f"{name}/{kind}/{i}"] = v.numpy()
    task = json.loads(os.environ.get("TF_CONFIG", "{}")).get("task", {}).get("index", "one")
    np.savez(os.path.join(out_dir, f"fused-{task}.npz"), **out)


# ---- tests/test_decoders.py and tests/test_encoders_end_to_end.py: the contracts' 2-replica steps ------------
# conftest's ``mirrored_contracts`` runs them (tests/distributed_worker.py's ``mirrored_decoder``, ``mirrored_specs``)
# in a process for each file, at once, for the decoders and pairs of the tests selected.

DECODER_TESTS = ("test_two_mirrored_replicas_compute_what_one_device_computes",
                 "test_an_xla_compiled_training_step_equals_the_plain_one")
# tests/test_ema.py's 2-replica test reads the run of AVERAGED, which alone trains with the weight average (3 steps: the
# average's 2 traces more in each of the 4 decoders' 3 steps cost more than the 2 of a run of its own)
EMA_TEST, AVERAGED = "test_two_replicas_keep_identical_averages_equal_to_one_replicas", "show_and_tell"
ENCODER_TEST = "test_two_mirrored_replicas_compute_what_one_device_computes_over_every_encoder"
# each kind of token set once: a ViT's class token and patches (vit), a preset's with its normalisation (CLIP),
# patches alone (SigLIP), under soft attention; pooled from a class token with registers beside it (DINOv2, whose
# unused mask token gets no gradient) under Show and Tell. Every decoder over small_cnn is tests/test_decoders.py's;
# keras-hub's ViT preset is the vit encoder's backbone read from a folder (tests/test_encoders.py).
MIRRORED_PAIRS = [("vit", "attention"), ("keras_hub:clip", "attention"), ("keras_hub:siglip", "attention"),
                  ("keras_hub:dinov2", "show_and_tell")]


def pair_label(entry, decoder) -> str:
    return f"{entry.replace(':', '-')}-{decoder}"


def pair_spec(entry, decoder, presets) -> str:
    """``mirrored_specs``' argument for an encoder entry under a decoder (tests/harness/presets.py's tiny configs)."""
    from tests.harness.presets import entry_config

    cfg, _ = entry_config(entry, presets, decoder)
    overrides = [f"model.decoder={decoder}", f"model.encoder={cfg.encoder}",
                 *(f"model.{k}={v}" for k, v in cfg.options.items())]
    return f"{pair_label(entry, decoder)}=" + ";".join(overrides)


def contract_result(root, folder, label):
    """What ``mirrored_contracts`` wrote for decoder or pair ``label`` (``folder``: "decoders" or "encoders"), after
    asserting that its scenario finished; the test fails with the traceback of that decoder or pair if it raised."""
    import pytest

    from tests.helpers import distributed_result

    out = distributed_result(root, "mirrored", folder)
    error = os.path.join(out, f"mirrored-{label}.error")
    if os.path.exists(error):
        pytest.fail(open(error).read())
    return np.load(os.path.join(out, f"mirrored-{label}.npz"))
