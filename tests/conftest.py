"""Shared fixtures: a small real shapes dataset on disk, prepared records and small trained models (built
once per test run, see :func:`built_once`), and the ``--decoder FILE:NAME`` option that registers a decoder
from a file before the contract tests (tests/test_decoders.py) are collected. Helpers are in tests/helpers.py."""

import fcntl
import os
import shutil

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import pytest

from data_prep.synth import synthesize
from tests.helpers import coco_split_args, small_train_config


def pytest_addoption(parser):
    parser.addoption("--decoder", action="append", default=[], metavar="FILE:NAME",
                     help="register the decoder class that FILE's module names DECODER as NAME (repeatable)")


# Each test file's time in the full suite (seconds, 3 workers on 2 cores, measured 2026-11-25 after issue 30's tests
# were added; the files whose CPU was cut for issue 31 re-measured alone, one process, on the shared machine).
# `make test` runs pytest-xdist with --dist loadfile, which hands the files to the workers in collection order:
# collected heaviest first, the long ones start at once and the short ones fill the gaps at the end (longest
# processing time first). A file not listed counts 4 s.
FILE_SECONDS = {"test_encoders_end_to_end": 105, "test_decoders": 190, "test_encoders": 90, "test_service_training": 190, "test_benchmarks": 117, "test_region_training": 130,
                "test_data_service": 97, "test_train_reliability": 103, "test_train": 100, "test_scst": 100,
                "test_full_disk": 39, "test_lost_worker": 71, "test_uneven_splits": 50, "test_model_dir": 57,
                "test_evaluate_identity": 50, "test_steps_per_execution": 50, "test_ensemble": 40, "test_inference": 40,
                "test_attention_use": 36, "test_train_start": 35, "test_transformer": 30, "test_objectives": 25,
                "test_corrupt_shards": 26, "test_input_pipeline": 26, "test_features_store": 25, "test_metrics": 25,
                "test_optimizer": 23, "test_regions": 18, "test_security": 18, "test_cli_edges": 16, "test_prepare": 15,
                "test_decode": 13, "test_cli": 10, "test_outputs": 10, "test_model": 8, "test_config": 7, "test_cider": 6,
                "test_attention": 6, "test_disk_cache": 5}


def pytest_collection_modifyitems(config, items):
    """The heaviest files first (:data:`FILE_SECONDS`); the order within a file stays as written."""
    items.sort(key=lambda item: -FILE_SECONDS.get(item.path.stem, 4))


def pytest_configure(config):
    from tests.helpers import register_decoder_file

    for spec in config.getoption("--decoder"):
        path, _, name = spec.rpartition(":")
        register_decoder_file(path, name)


def built_once(tmp_path_factory, name, build, own_copy=False):
    """The folder that ``build(path)`` makes, made once per test run. Alone (``-n 0``), in this process's
    temporary folder. Under pytest-xdist (`make test`'s workers) the first worker that asks builds it in the
    run's shared temporary folder while holding a lock; the others wait for it and use it: the workers do
    not each train the same fixture models (about 12 s of CPU a worker). ``own_copy``: each worker gets a
    copy of its own to write into (evaluations are stored in a model folder), as when it built it itself;
    else the shared folder, read-only for tests."""
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        path = str(tmp_path_factory.mktemp(name))
        build(path)
        return path
    root = tmp_path_factory.getbasetemp().parent / "built_once"  # the run's folder, above every worker's
    root.mkdir(exist_ok=True)
    shared = root / name
    with open(root / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, or when a worker dies
        if not (root / f"{name}.done").exists():
            shutil.rmtree(shared, ignore_errors=True)  # what a worker that failed left
            shared.mkdir()
            build(str(shared))
            (root / f"{name}.done").touch()
    if not own_copy:
        return str(shared)
    own = tmp_path_factory.mktemp(name)
    shutil.copytree(shared, own, dirs_exist_ok=True)
    return str(own)


@pytest.fixture(scope="session")
def shapes_dir(tmp_path_factory):
    """40 synthetic images (32 train, 4 val, 4 test) in COCO layout; read-only for tests."""
    return built_once(tmp_path_factory, "shapes", lambda root: synthesize(root, num_images=40, seed=7, progress=False))


@pytest.fixture(scope="session")
def prepared_dir(shapes_dir, tmp_path_factory):
    """The shapes fixture prepared into TFRecords (min word count 1: every word in the vocabulary); read-only
    for tests."""
    from data_prep.prepare import PrepareOptions, prepare

    return built_once(tmp_path_factory, "records", lambda out: prepare(
        PrepareOptions(output_dir=out, split=coco_split_args(shapes_dir), workers=1, min_word_count=1), progress=False))


@pytest.fixture(scope="session")
def trained_model_dir(prepared_dir, tmp_path_factory):
    """A small model trained for 60 steps: real checkpoints, config.yaml and vocab.txt."""
    from captioning.train import Trainer

    cfg = small_train_config(prepared_dir, "train.steps=60", "train.optimizer=adam", "train.learning_rate=0.01",
                             "model.embedding_size=32", "model.lstm_units=32", "train.checkpoint_every_steps=60")
    return built_once(tmp_path_factory, "model", lambda model_dir: Trainer(cfg, model_dir).run(progress=False),
                      own_copy=True)


@pytest.fixture(scope="session")
def trained_attention_dir(prepared_dir, tmp_path_factory):
    """A small soft-attention model (2 x 2 grid at 32 px) trained for 40 steps, with an evaluation (and
    its TensorBoard sample pictures) at the end."""
    from captioning.train import Trainer

    cfg = small_train_config(prepared_dir, "model.decoder=attention", "model.attention_size=16", "train.steps=40",
                             "train.optimizer=adam", "train.learning_rate=0.01", "model.embedding_size=32",
                             "model.lstm_units=32", "train.checkpoint_every_steps=40", "train.eval_every_steps=40",
                             "train.eval_batches=1", "train.sample_captions=2")
    return built_once(tmp_path_factory, "attention_model",
                      lambda model_dir: Trainer(cfg, model_dir).run(progress=False), own_copy=True)


@pytest.fixture(scope="session")
def hub_presets(tmp_path_factory):
    """A tiny random keras-hub preset folder of each family the keras_hub encoder reads (tests/hub_presets.py)."""
    from tests.hub_presets import FAMILIES, write_preset

    root = tmp_path_factory.mktemp("hub_presets")
    return {family: write_preset(family, str(root / family)) for family in FAMILIES}
