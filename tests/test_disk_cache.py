"""data.cache: disk serves only what it was written from: another dataset, size or sharding never reads
it; a cache cut short by a killed run is never read; a live writer is not disturbed."""

import glob
import json
import os
import signal
import subprocess
import sys
import time

import pytest

from captioning.config.sections import DataConfig
from captioning.errors import InputError
from captioning.data.pipeline import make_dataset
from data_prep.prepare import PrepareOptions, prepare
from tests.helpers import REPO


@pytest.fixture(scope="module")
def small_dir(shapes_dir, tmp_path_factory):
    """Another dataset: a train split of 4 images (the fixture's val annotations)."""
    out = str(tmp_path_factory.mktemp("small"))
    prepare(PrepareOptions(output_dir=out, split=[f"train={shapes_dir}/annotations/captions_val.json:"
                                                  f"{shapes_dir}/images"], workers=1, min_word_count=1),
            progress=False)
    return out


def epoch(data_dir, cache_dir, **kw):
    """(captions, image shape) of one evaluation pass over train through the disk cache."""
    cfg = DataConfig(dir=data_dir, image_size=kw.pop("image_size", 32), resize_size=kw.pop("resize_size", 40),
                     cache="disk", **kw)
    count, shape = 0, None
    for batch in make_dataset(cfg, "train", training=False, batch_size=16, cache_dir=cache_dir):
        count += int(batch["input_ids"].shape[0])
        shape = tuple(batch["image"].shape[1:])
    return count, shape


def test_a_cache_of_other_data_or_sizes_is_never_read(prepared_dir, small_dir, tmp_path):
    cache = str(tmp_path / "cache")
    assert epoch(prepared_dir, cache) == (160, (32, 32, 3))  # 32 images, 5 captions each: written
    assert epoch(prepared_dir, cache) == (160, (32, 32, 3))  # read back
    assert epoch(small_dir, cache) == (20, (32, 32, 3))  # another dataset: its own 20 captions
    assert epoch(prepared_dir, cache, image_size=48, resize_size=56) == (160, (48, 48, 3))  # other size
    assert epoch(prepared_dir, cache, skip_corrupt=True) == (160, (32, 32, 3))
    assert len(glob.glob(os.path.join(cache, "*.index"))) == 4  # four keys, four complete caches
    assert len(glob.glob(os.path.join(cache, "*.json"))) == 4  # each says what it holds


def wait_for(proc, out, ready, what):
    """Waits until ``ready(the lines proc printed)``; the process ending first fails the test with its output."""
    deadline = time.time() + 300
    while time.time() < deadline:
        lines = out.read_text().splitlines()
        if ready(lines):
            return lines
        assert proc.poll() is None, out.read_text()[-2000:]
        time.sleep(0.05)
    raise AssertionError(f"{what} never came: {out.read_text()[-2000:]}")


@pytest.fixture(scope="module")
def keys_then_writer(prepared_dir, tmp_path_factory):
    """One process (:data:`ENCODER_KEYS`) for both tests that need one of their own: it prints its encoders' cache
    keys and its seeded run's weights (one JSON line), then writes ``prepared_dir``'s train split into a disk cache,
    a batch every 0.5 s, printing each batch's number (a live writer, which the writer's test kills with SIGKILL).
    ``(process, its output file, the cache folder)``; the process is killed at the end of the module."""
    root = tmp_path_factory.mktemp("keys_then_writer")
    out, cache = root / "out.txt", str(root / "cache")
    proc = subprocess.Popen([sys.executable, "-c", ENCODER_KEYS, *ENCODERS, "--train", prepared_dir,
                             str(root / "there"), "--write", cache], stdout=open(out, "w"), stderr=subprocess.STDOUT,
                            cwd=REPO, env=dict(os.environ, PYTHONPATH=REPO, TF_CPP_MIN_LOG_LEVEL="2"))
    try:
        yield proc, out, cache
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()


@pytest.mark.slow
def test_a_live_writer_is_left_alone_and_a_killed_ones_cache_is_never_read(prepared_dir, keys_then_writer):
    """The writer is :func:`keys_then_writer`'s process, once it has written a few batches."""
    writer, out, cache = keys_then_writer
    wait_for(writer, out, lambda lines: len([x for x in lines if x.isdigit()]) >= 3
             and glob.glob(os.path.join(cache, "*.lockfile")), "the writer's third batch")
    try:
        with pytest.raises(InputError, match="another process is writing the cache"):
            epoch(prepared_dir, cache)
    finally:
        writer.send_signal(signal.SIGKILL)
        writer.wait()
    left = os.listdir(cache)
    assert not [n for n in left if n.endswith(".index")]  # cut short: no complete cache
    assert [n for n in left if n.endswith(".lockfile")]  # and TF's lockfile, which would block a writer
    assert epoch(prepared_dir, cache) == (160, (32, 32, 3))  # a whole epoch, written afresh
    assert not [n for n in os.listdir(cache) if "lockfile" in n or "tempstate" in n]
    assert epoch(prepared_dir, cache) == (160, (32, 32, 3))


def test_train_refuses_a_cache_dir_it_cannot_write(prepared_dir, tmp_path):
    from captioning.experiment import for_training
    from captioning.train import Trainer
    from tests.helpers import small_train_config

    (tmp_path / "a_file").write_text("x")
    for cache_dir, message in ((tmp_path / "a_file", "cannot create it"),
                               (tmp_path / "a_file" / "below", "cannot create it"),
                               ("/proc/captioning-cache", "cannot create it")):
        cfg = small_train_config(prepared_dir, "data.cache=disk", f"data.cache_dir={cache_dir}")
        with pytest.raises(InputError, match=f"data.cache_dir {cache_dir}: {message}"):
            Trainer(for_training(cfg), str(tmp_path / "model"))
        assert not os.path.exists(tmp_path / "model" / "config.yaml")  # refused before writing anything


ENCODER_KEYS = r"""
import json, sys
import keras
from captioning.config import load_config
from captioning.data.feature_cache import encoder_key
from captioning.model import build_model

def key(encoder, seed):
    cfg = load_config("experiments/shapes.yaml", [f"model.encoder={encoder}", "model.encoder_weights=none",
                                                  "data.image_size=32", "data.resize_size=36", f"train.seed={seed}"])
    keras.utils.set_random_seed(cfg.train.seed)  # as the trainer does before it builds the model
    model = build_model(20, cfg.model, cfg.data.image_size, seed=cfg.train.seed)
    model.build_all()
    return encoder_key(model.encoder)

def keys(encoders, builds=2):  # each encoder twice (the second build's unnamed layers: normalization_1...); the
    # first with another seed too
    return {e: [key(e, 1) for _ in range(builds)] + ([key(e, 2)] if e == encoders[0] else []) for e in encoders}

def trained(data_dir, model_dir):  # the weights of a seeded run, random crops and flips in a fixed order
    import hashlib
    from captioning.experiment import for_training
    from captioning.train import Trainer
    from tests.helpers import small_train_config

    trainer = Trainer(for_training(small_train_config(data_dir, "data.random_crop=true", "data.random_flip=true",
                                                      "data.deterministic=true", "train.steps=12")), model_dir)
    trainer.run(progress=False)
    digest = hashlib.sha256()
    for v in trainer.model.variables:
        digest.update(v.numpy().tobytes())
    return digest.hexdigest()

def write_slowly(data_dir, cache_dir):  # a live writer of a disk cache: a batch every 0.5 s
    import time
    from captioning.config.sections import DataConfig
    from captioning.data.pipeline import make_dataset

    cfg = DataConfig(dir=data_dir, image_size=32, resize_size=40, cache="disk", shuffle_buffer=2, length_window=1)
    for i, batch in enumerate(make_dataset(cfg, "train", training=True, batch_size=2, cache_dir=cache_dir)):
        print(i, flush=True)
        time.sleep(0.5)

if __name__ == "__main__":
    encoders, (_, data_dir, model_dir, _, cache_dir) = sys.argv[1:-5], sys.argv[-5:]
    print(json.dumps({"keys": keys(encoders), "trained": trained(data_dir, model_dir)}), flush=True)
    write_slowly(data_dir, cache_dir)
"""

ENCODERS = ["small_cnn", "vit", "efficientnet_b0"]  # EfficientNet has layers Keras names by count


@pytest.mark.slow  # a process of its own, and EfficientNet built six times: 21 s in the quick loop
def test_a_seeded_untrained_encoder_has_one_cache_key_and_a_seeded_run_one_result_in_every_process(prepared_dir,
                                                                                                  keys_then_writer,
                                                                                                  tmp_path):
    """``data.cache: features`` finds its cache again: the key of a seeded encoder without pretrained weights
    (``model.encoder_weights: none``) is the same in two processes and for a second model built in one process
    (``benchmark train --compare`` builds one per round: the process of its own builds each twice, this one, whose
    first build already meets other layer names, once), and another seed gives another key. And a seeded
    run with ``data.deterministic: true`` ends with the same weights, bit for bit, in both processes, random
    crops and flips included (their draws are the images' own: captioning/data/seeds.py)."""
    encoders = ENCODERS
    process, out, _ = keys_then_writer  # its keys and weights: its JSON line, printed before it writes the cache
    printed = wait_for(process, out, lambda lines: any(x.startswith("{") for x in lines), "the process's keys")
    here = {}  # and in this process, which built other models before (other layer names even at its first build)
    exec(compile(ENCODER_KEYS, "encoder_keys", "exec"), here)
    cwd = os.getcwd()
    try:
        os.chdir(REPO)
        there = json.loads(next(x for x in printed if x.startswith("{")))
        runs = [there["keys"], here["keys"](encoders, builds=1)]  # a second build here would add nothing
        assert there["trained"] == here["trained"](prepared_dir, str(tmp_path / "here"))
    finally:
        os.chdir(cwd)
    for encoder, (first, second, *other_seed) in runs[0].items():
        assert first == second, encoder
        assert first.startswith(f"encoder_{encoder}-")
        assert runs[1][encoder] == [first, *other_seed], encoder  # the same keys in this process
    assert runs[0]["small_cnn"][2] != runs[0]["small_cnn"][0]  # another seed: other weights, another key
