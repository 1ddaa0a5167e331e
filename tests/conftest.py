"""Shared fixtures: a small real shapes dataset on disk, prepared records and small trained models (built
once per test run, see :func:`built_once`), and the ``--decoder FILE:NAME`` option that registers a decoder
from a file before the contract tests (tests/test_decoders.py) are collected. Helpers are in tests/helpers.py."""

import fcntl
import os
import resource
import shutil
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
# XLA's code generation at LLVM's lowest optimisation level, in the test processes and every process they start
# (tests/helpers.py's worker_env keeps it): the same graphs and HLO passes, machine code made in less CPU time; how fast
# the compiled code runs does not matter to a program run a few times (docs/reliability.md)
XLA_TEST_FLAG = "--xla_backend_optimization_level=0"
if XLA_TEST_FLAG not in os.environ.get("XLA_FLAGS", "").split():
    os.environ["XLA_FLAGS"] = " ".join(f for f in (os.environ.get("XLA_FLAGS", ""), XLA_TEST_FLAG) if f)

import pytest

pytest.register_assert_rewrite("tests.harness")  # its checks' asserts report values, as a test module's do

from data_prep.synth import synthesize  # noqa: E402 - after the registration, before anything imports the harness
from tests.helpers import coco_split_args, small_train_config  # noqa: E402


def pytest_addoption(parser):
    parser.addoption("--decoder", action="append", default=[], metavar="FILE:NAME",
                     help="register the decoder class that FILE's module names DECODER as NAME (repeatable)")
    parser.addoption("--cpu-log", metavar="FILE", default=None,
                     help="append a line per test to FILE: its id, CPU seconds in its process and in the children "
                          "it waited for, wall seconds, worker (tab-separated; docs/reliability.md)")


def _cpu_and_wall():
    own, children = (resource.getrusage(who) for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN))
    return own.ru_utime + own.ru_stime, children.ru_utime + children.ru_stime, time.time()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """``--cpu-log FILE``: what each test cost, its setup (the fixtures it is the first to ask for) and teardown
    included. CPU seconds rather than durations: the workers share two cores with each other and with the
    processes tests start, so a duration in the full suite says little about the test (a test of 1.7 s alone
    took 10-30 s there). The children's seconds count once they have ended and been waited for."""
    path = item.config.getoption("--cpu-log")
    before = _cpu_and_wall() if path else None
    yield
    if path:
        after = _cpu_and_wall()
        own, children, wall = (b - a for a, b in zip(before, after))
        worker = os.environ.get("PYTEST_XDIST_WORKER", "-")
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)  # runs/ is not in a fresh clone
        with open(path, "a", encoding="utf-8") as f:  # one short append a line: the workers' lines stay whole
            f.write(f"{item.nodeid}\t{own:.2f}\t{children:.2f}\t{wall:.2f}\t{worker}\n")


# Each test file's CPU seconds in the full suite (its tests', their subprocesses' and the session fixtures it built
# first; `make test` in a fresh clone of 614436e, 3 workers on 2 cores, 2026-11-28, 15:44). `make test` runs
# pytest-xdist with --dist loadfile --no-loadscope-reorder, which hands the files to the workers in collection order:
# collected heaviest first, the long ones start at once and the short ones fill the gaps at the end (longest processing
# time first). Without --no-loadscope-reorder xdist sorts the files by their number of tests instead: test_config's 310
# quick ones first and test_lost_worker's 2 long ones last, alone on one worker for the run's last 32 s (measured). A
# file not listed counts 4 s.
FILE_SECONDS = {
    "test_decoders": 140, "test_scst": 109, "test_litert": 76, "test_service_training": 64, "test_benchmarks": 59,
    "test_prefix_lm_training": 58, "test_train_reliability": 41, "test_encoders_end_to_end": 36,
    "test_lost_worker": 35, "test_encoders": 32, "test_data_service": 32, "test_region_training": 28,
    "test_inference": 27, "test_model_dir": 24, "test_tokenizers": 23, "test_ema": 23, "test_ensemble": 22,
    "test_prefix_lm_use": 22, "test_steps_per_execution": 21, "test_train": 20, "test_lm_train": 19,
    "test_attention_use": 15, "test_accumulate": 15, "test_disk_cache": 14, "test_input_pipeline": 13,
    "test_train_start": 13, "test_transformer": 12, "test_corrupt_shards": 11, "test_cli": 11, "test_decode": 10,
    "test_security": 10, "test_evaluate_identity": 10, "test_full_disk": 10, "test_serve_parsing": 10,
    "test_metrics": 9, "test_features_store": 9, "test_regions": 8, "test_objectives": 7, "test_prefix_lm": 7,
    "test_orientation": 7, "test_serve": 7, "test_optimizer": 7, "test_word_rules_pieces": 7, "test_architecture": 6,
    "test_prepare": 6, "test_uneven_splits": 5, "test_config": 5, "test_outputs": 5, "test_serve_clients": 5,
    "test_scheduled_sampling": 5, "test_text": 5}


# The same for the quick loop (`-m 'not slow'`): each file's CPU seconds in its tests not marked slow (the quick loop
# in a fresh clone, 2 workers, 2026-11-28, 17:03). Ordered by FILE_SECONDS, the quick loop's worker given test_scst and
# test_decoders first (light there without their 2-replica runs) ended 13 s after the other two. A file not listed
# counts 3 s. test_serve_parsing weighs, in the whole suite, the 10 s its out-of-memory test holds its worker for 0.1
# CPU s (TensorFlow's allocator waits 10 s for memory before it refuses the 4 TiB the test asks for): at 3 s it came
# last in the quick loop, its wait the loop's last 10 s on one of two workers (measured), and so that test is slow now.
QUICK_SECONDS = {
    "test_decoders": 28, "test_encoders": 15, "test_ensemble": 13, "test_scst": 12, "test_input_pipeline": 11,
    "test_decode": 11, "test_outputs": 8, "test_prefix_lm": 7, "test_tokenizers": 7,
    "test_architecture": 6, "test_features_store": 6, "test_word_rules_pieces": 6, "test_region_training": 5,
    "test_regions": 5, "test_reward_words": 4, "test_docs": 4, "test_mappers": 4, "test_ema": 4}


@pytest.hookimpl(tryfirst=True)
def pytest_xdist_auto_num_workers(config):
    """The number of workers `-n auto` (the Makefile's `make test`) starts: one a core when no slow test is selected
    (the quick loop's tests compute: on 2 cores a third worker only made the two cores' work dearer), one more when the
    slow ones are (they wait on processes, servers and JVMs, and the extra worker fills those waits). Measured on 2
    cores in fresh clones, 2026-11-28 (docs/reliability.md). ``PYTEST_XDIST_AUTO_NUM_WORKERS`` still decides."""
    from _pytest.mark.expression import Expression

    if os.environ.get("PYTEST_XDIST_AUTO_NUM_WORKERS"):
        return None  # pytest-xdist's own hook reads it
    markexpr = config.getoption("markexpr")
    slow = not markexpr or Expression.compile(markexpr).evaluate(lambda name, **kwargs: name == "slow")
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return workers_for(cores, os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"), slow)


WORKER_MEMORY = 3 * 2**30  # a worker holds 2.0-2.8 GB once its TensorFlow has built the suite's models (ps, 2026-11-28)


def workers_for(cores: int, memory: int, slow: bool) -> int:
    """A worker a core, one more with slow tests selected, and never more than ``memory`` bytes hold
    (:data:`WORKER_MEMORY` each; at least one)."""
    return max(1, min(cores + 1 if slow else cores, memory // WORKER_MEMORY))


def schedule(items):
    """Sorts ``items`` heaviest file first, the order within a file kept: a file counts :data:`FILE_SECONDS` when
    a test of it marked slow is among ``items``, else :data:`QUICK_SECONDS` (its quick tests only)."""
    with_slow = {item.path.stem for item in items if item.get_closest_marker("slow")}

    def seconds(stem):
        return FILE_SECONDS.get(stem, 4) if stem in with_slow else QUICK_SECONDS.get(stem, 3)

    items.sort(key=lambda item: -seconds(item.path.stem))


@pytest.hookimpl(trylast=True)  # after `-m` and `-k` have deselected: the files' weights are those of what runs
def pytest_collection_modifyitems(config, items):
    schedule(items)


def pytest_configure(config):
    from tests.helpers import register_decoder_file

    for spec in config.getoption("--decoder"):
        path, _, name = spec.rpartition(":")
        register_decoder_file(path, name)


_CONVERTED = []  # what AutoGraph converted for the project's own code (not for a test's), in this process
_PROJECT = tuple(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), d) + os.sep
                 for d in ("captioning", "data_prep"))
_LIBRARIES = tuple({sys.prefix, sys.base_prefix, sys.exec_prefix})  # TensorFlow, Keras, the standard library


def _asked_by_the_project(frame) -> bool:
    """Whether the conversion under way was asked for by the project's code: the nearest caller outside the
    libraries is a module of captioning/ or data_prep/ (a test's own tf.function, or its map of a project
    function, is the test's choice; code AutoGraph already converted was counted when it was)."""
    while frame is not None:
        path = frame.f_code.co_filename
        if "__autograph_generated_file" in path:
            return False
        if path.startswith(_PROJECT):
            return True
        if not path.startswith(_LIBRARIES) and not path.startswith("<"):
            return False
        frame = frame.f_back
    return False


def _record_autograph_conversions():
    """Records in :data:`_CONVERTED` every function of the project that AutoGraph converts (or finds converted in its
    cache) for the project's own code in this process, once installed."""
    from tensorflow.python.autograph.impl import api

    if getattr(api._convert_actual, "recording", False):
        return
    convert = api._convert_actual

    def recorded(entity, program_ctx):  # (TensorFlow's and Keras' own functions, e.g. a SavedModel's, are theirs)
        module = getattr(entity, "__module__", None) or ""
        if module.split(".")[0] in ("captioning", "data_prep") and _asked_by_the_project(sys._getframe(1)):
            _CONVERTED.append(f"{getattr(entity, '__module__', '?')}.{getattr(entity, '__qualname__', entity)}")
        return convert(entity, program_ctx)

    recorded.recording = True
    api._convert_actual = recorded


@pytest.fixture(autouse=True)
def graph_code_without_autograph():
    """Every test also checks that the project's code had nothing converted by AutoGraph (docs/architecture.md: the
    graph code is plain TensorFlow, ``tf.function(..., autograph=False)`` and ``tf.while_loop``; the conversions cost
    a process 1-3 CPU s). AutoGraph falls back to the unconverted function when a conversion fails, so only this
    record can tell."""
    if "tensorflow" in sys.modules:
        _record_autograph_conversions()
    start = len(_CONVERTED)
    yield
    if "tensorflow" in sys.modules:
        _record_autograph_conversions()  # for the tests after the one that first imported TensorFlow
    converted = sorted(set(_CONVERTED[start:]))
    assert not converted, f"AutoGraph converted the project's {', '.join(converted)}: write its control flow with " \
                          "tf.while_loop / tf.cond, and tf.function(..., autograph=False)"


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
    from captioning.experiment import for_training
    from captioning.train import Trainer

    cfg = small_train_config(prepared_dir, "train.steps=60", "train.optimizer=adam", "train.learning_rate=0.01",
                             "model.embedding_size=32", "model.lstm_units=32", "train.checkpoint_every_steps=60")
    return built_once(tmp_path_factory, "model", lambda model_dir: Trainer(for_training(cfg), model_dir).run(progress=False),
                      own_copy=True)


@pytest.fixture(scope="session")
def trained_attention_dir(prepared_dir, tmp_path_factory):
    """A small soft-attention model (2 x 2 grid at 32 px) trained for 40 steps, with an evaluation (and
    its TensorBoard sample pictures) at the end."""
    from captioning.experiment import for_training
    from captioning.train import Trainer

    cfg = small_train_config(prepared_dir, "model.decoder=attention", "model.attention_size=16", "train.steps=40",
                             "train.optimizer=adam", "train.learning_rate=0.01", "model.embedding_size=32",
                             "model.lstm_units=32", "train.checkpoint_every_steps=40", "train.eval_every_steps=40",
                             "train.eval_batches=1", "train.sample_captions=2")
    return built_once(tmp_path_factory, "attention_model",
                      lambda model_dir: Trainer(for_training(cfg), model_dir).run(progress=False), own_copy=True)


@pytest.fixture(scope="session")
def hub_presets(tmp_path_factory):
    """A tiny random keras-hub preset folder of each family the keras_hub encoder reads (tests/harness/presets.py),
    written once per test run (:func:`built_once`: test_encoders, test_encoders_end_to_end and test_litert share
    them); read-only for tests."""
    from tests.harness.presets import FAMILIES, write_preset

    root = built_once(tmp_path_factory, "hub_presets",
                      lambda root: [write_preset(family, os.path.join(root, family)) for family in FAMILIES])
    return {family: os.path.join(root, family) for family in FAMILIES}


@pytest.fixture(scope="session")
def lm_presets(tmp_path_factory):
    """Tiny random keras-hub causal LMs with their tokenizers (tests/harness/lm_presets.py: ``gpt2``, a byte-level
    BPE from a dict and merges; ``gemma``, a SentencePiece model trained in process), written once per test run with
    ``save_to_preset``; read-only for tests."""
    from tests.harness.lm_presets import WRITERS

    root = built_once(tmp_path_factory, "lm_presets",
                      lambda root: [write(os.path.join(root, name)) for name, write in WRITERS.items()])
    return {name: os.path.join(root, name) for name in WRITERS}


@pytest.fixture(scope="session")
def trained_prefix_lm_dir(prepared_dir, lm_presets, tmp_path_factory):
    """A small ``prefix_lm`` model over the tiny GPT-2 preset (its tokenizer: ``data.tokenizer`` auto), ClipCap's MLP
    mapper into 2 prefix vectors, the LM fine-tuned, trained for 30 steps: real checkpoints, config.yaml and the
    tokenizer kept in the folder (a copy for each worker)."""
    from captioning.experiment import for_training
    from captioning.train import Trainer

    cfg = small_train_config(prepared_dir, "model.decoder=prefix_lm", f"model.decoder_preset={lm_presets['gpt2']}",
                             "model.mapper=mlp", "model.prefix_length=2", "model.lm_trainable=true", "train.steps=30",
                             "train.optimizer=adam", "train.learning_rate=0.003", "train.checkpoint_every_steps=30")
    return built_once(tmp_path_factory, "prefix_lm_model",
                      lambda model_dir: Trainer(for_training(cfg), model_dir).run(progress=False), own_copy=True)


@pytest.fixture(scope="session")
def region_data(prepared_dir, shapes_dir, trained_attention_dir, tmp_path_factory):
    """A copy of the prepared fixture with the store "oracle": the trained attention fixture's 2 x 2 grid
    pooled in each shape's box (and the whole image); the first training image left out. ``(data folder,
    the image left out)``, a copy of its own for each worker (tests/test_region_training.py and the
    2-replica scenarios of :func:`distributed_runs`)."""

    def build(root):
        from captioning.data.prepared import PreparedDataset
        from captioning.inference.captioner import load
        from captioning.inference.regions import read_detections, region_features
        from data_prep.features_writer import Row, write_store

        data_dir = os.path.join(root, "data")
        shutil.copytree(prepared_dir, data_dir)
        dataset = PreparedDataset.load(data_dir)
        left_out = min(i for i, r in dataset.image_records().items() if r.split == "train")
        detections = read_detections([os.path.join(shapes_dir, "annotations", f"instances_{s}.json")
                                      for s in ("train", "val", "test")])
        trained = load(trained_attention_dir)  # once: its model and its step
        rows = [Row(i, r.features, r.boxes, r.width, r.height) for i, r in
                region_features(trained.model, dataset, os.path.join(shapes_dir, "images"), detections)
                if i != left_out]
        source = {"kind": "extract", "model": trained_attention_dir, "checkpoint": trained.step}
        write_store(data_dir, lambda skip: rows[skip:], source=source, name="oracle", images_per_shard=7,
                    progress=False)
        with open(os.path.join(root, "left_out.txt"), "w") as f:
            f.write(str(left_out))

    root = built_once(tmp_path_factory, "region_data", build, own_copy=True)
    with open(os.path.join(root, "left_out.txt")) as f:
        return os.path.join(root, "data"), int(f.read())


@pytest.fixture(scope="session")
def uneven_dir(shapes_dir, prepared_dir, tmp_path_factory):
    """train: 8 images; val: ONE image with ONE caption (fewer captions than replicas); test: 3 images (15
    captions). The vocabulary of ``prepared_dir``, so ``trained_model_dir``'s checkpoint fits
    (tests/test_uneven_splits.py and :func:`distributed_runs`); read-only for tests."""

    def build(root):
        import json

        from data_prep.prepare import PrepareOptions, prepare
        from data_prep.synth import load_split

        splits = []
        for split, images, captions in (("train", 8, 5), ("val", 1, 1), ("test", 3, 5)):
            data = load_split(shapes_dir, split if split != "val" else "train")
            keep = [image["id"] for image in data["images"][:images]]
            data["images"] = [image for image in data["images"] if image["id"] in keep]
            seen = {}
            anns = []
            for ann in data["annotations"]:
                if ann["image_id"] in keep and seen.get(ann["image_id"], 0) < captions:
                    seen[ann["image_id"]] = seen.get(ann["image_id"], 0) + 1
                    anns.append(ann)
            data["annotations"] = anns
            path = os.path.join(root, f"captions_{split}.json")
            with open(path, "w") as f:
                json.dump(data, f)
            splits.append(f"{split}={path}:{shapes_dir}/images")
        manifest = prepare(PrepareOptions(output_dir=os.path.join(root, "records"), split=splits, workers=1,
                                          vocab=os.path.join(prepared_dir, "vocab.txt")), progress=False)
        assert [manifest["splits"][s]["captions"] for s in ("train", "val", "test")] == [40, 1, 15]

    return os.path.join(built_once(tmp_path_factory, "uneven", build), "records")


@pytest.fixture(scope="session")
def distributed_runs(prepared_dir, region_data, uneven_dir, trained_model_dir, tmp_path_factory):
    """The 2-replica scenarios of tests/test_train.py, test_scst.py, test_region_training.py,
    test_uneven_splits.py, test_accumulate.py, test_optimizer.py, test_vlm.py, test_clip_score.py and
    test_train_reliability.py
    (tests/distributed_worker.py's modes; those of one test file each are in tests/harness/scenarios.py),
    run once for all of them: the MirroredStrategy ones (one device against 2 logical CPUs) in two processes and
    the MultiWorkerMirroredStrategy ones in one pair of localhost workers, all four processes at once
    (tests/helpers.py's run_distributed_scenarios). A test reads its scenario
    with ``distributed_result(distributed_runs, GROUP, NAME)``, which asserts that it finished."""
    from tests.harness.clip_presets import write_clip
    from tests.harness.models import vlm_preset
    from tests.helpers import REGIONS, run_distributed_scenarios

    # a PaliGemma's rank-2 LoRA adapters, its ViT frozen (the tiny preset written here, read by the scenario's process)
    VLM_LORA = ("model.encoder=vlm", "model.decoder=vlm", f"model.vlm_preset={vlm_preset()}", "model.lm_lora_rank=2",
                "model.encoder_trainable=false")

    def build(root):
        # the evaluation scenarios restore trained_model_dir's checkpoint: a copy for each group
        models = {}
        for group in ("mirrored", "multi_worker"):
            models[group] = os.path.join(root, f"model-{group}")
            shutil.copytree(trained_model_dir, models[group])
        data, regions = prepared_dir, region_data[0]
        clip = write_clip(os.path.join(root, "clip"))  # SCST's CLIP reward's preset (tests/test_clip_score.py)
        run_distributed_scenarios(root, {
            # in two processes at once (each scenario's CPU and wall seconds are in root/mirrored-pN.log), each about
            # as long as the multi-worker pair: the SCST steps and the evaluation's, then the training steps' own
            # scenarios and the CLI commands on 2 logical CPUs (test_train_reliability, test_uneven_splits, test_train).
            # In one process they cost 2.6 CPU s less but the chain twice the wall, and the worker that waits for it
            # idles: the full suite's first 150 s ran at 1.2 of the 2 cores (2026-11-28). tests/test_ema.py's
            # 2-replica run is the decoder contract's run of show_and_tell (mirrored_contracts).
            "mirrored": ([["mirrored_scst", data, "scst"], ["mirrored_scst_with", regions, "scst_regions", *REGIONS],
                          ["mirrored_grouped", data, "grouped"],
                          ["eval_losses", uneven_dir, "uneven", models["mirrored"], "mirrored"],
                          ["mirrored", data, "vlm_lora", *VLM_LORA],  # tests/test_vlm.py
                          ["mirrored_scst_with", data, "scst_clip", "scst.reward=mix", f"scst.clip_preset={clip}"]],
                         [["accumulate", data, "accumulate"],  # tests/test_accumulate.py
                          ["nan_skip", data, "nan_skip"], ["uneven_cli", uneven_dir, "uneven_cli"],
                          ["resume", data, "resume"], ["fused", data, "fused"]]),  # test_optimizer.py
            "multi_worker": [["multi_worker", data, "xe"], ["multi_worker_scst", data, "scst"],
                             ["multi_worker", regions, "regions", *REGIONS],
                             ["eval_losses", uneven_dir, "uneven", models["multi_worker"], "multi_worker"],
                             ["fused", data, "fused"]]})

    return built_once(tmp_path_factory, "distributed_runs", build)


@pytest.fixture(scope="session")
def mirrored_contracts(prepared_dir, request, tmp_path_factory):
    """The 2-replica steps of the decoder contract (tests/test_decoders.py's mirrored and XLA tests, over every
    selected decoder, ``--decoder`` ones included; show_and_tell's also trains with the weight average, for
    tests/test_ema.py's 2-replica test) and of the encoder contract (tests/test_encoders_end_to_end.py's
    mirrored test, over tests/harness/scenarios.py's MIRRORED_PAIRS selected), run once for both files, each
    file's in a process of 2 logical CPUs, both at once (tests/distributed_worker.py's ``mirrored_decoder`` and
    ``mirrored_specs``, each through ``many``). A test reads its decoder's or pair's
    result with tests/harness/scenarios.py's ``contract_result``."""
    from tests.harness.scenarios import AVERAGED, DECODER_TESTS, EMA_TEST, ENCODER_TEST, pair_spec
    from tests.helpers import run_distributed_scenarios

    items = request.session.items
    names = sorted({item.callspec.params["name"] for item in items
                    if getattr(item, "originalname", None) in DECODER_TESTS}
                   | {AVERAGED for item in items if getattr(item, "originalname", None) == EMA_TEST})
    pairs = sorted({(item.callspec.params["entry"], item.callspec.params["decoder"]) for item in items
                    if getattr(item, "originalname", None) == ENCODER_TEST})
    registered = [a for spec in request.config.getoption("--decoder") for a in ("--decoder", spec)]
    presets = request.getfixturevalue("hub_presets") if pairs else None

    def build(root):
        # the decoders' and the encoders' in two processes at once: in one, 3 CPU s less, but the worker waiting
        # for it idled 145 s instead of 88 (2026-11-28)
        parts = []
        if names:
            parts.append([["mirrored_decoder", prepared_dir, "decoders", ",".join(names), *registered]])
        if pairs:
            specs = [pair_spec(entry, decoder, presets) for entry, decoder in pairs]
            parts.append([["mirrored_specs", prepared_dir, "encoders", *specs]])
        run_distributed_scenarios(root, {"mirrored": tuple(parts)})

    return built_once(tmp_path_factory, "mirrored_contracts", build)
