"""Shared fixtures: a small real shapes dataset on disk, and helpers to make quirky image files."""

import io
import os
import subprocess
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import pytest
from PIL import Image

from data_prep.shapes import synthesize

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="session")
def shapes_dir(tmp_path_factory):
    """40 synthetic images (32 train, 4 val, 4 test) in COCO layout; read-only for tests."""
    root = str(tmp_path_factory.mktemp("shapes"))
    synthesize(root, num_images=40, seed=7, progress=False)
    return root


def model_config(**values):
    """A ModelConfig from keyword values, the decoder's own settings (``lstm_units``, ...) among them."""
    from captioning.config import ModelConfig, keys_of

    shared = {k: v for k, v in values.items() if k in keys_of(ModelConfig)}
    return ModelConfig(**shared, options={k: v for k, v in values.items() if k not in shared})


def coco_split_args(shapes_dir, splits=("train", "val", "test")):
    return [f"{s}={shapes_dir}/annotations/captions_{s}.json:{shapes_dir}/images" for s in splits]


def encode(image: Image.Image, fmt: str, **kwargs) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format=fmt, **kwargs)
    return buf.getvalue()


def gradient(mode: str = "RGB", size=(48, 32)) -> Image.Image:
    """A small image with real content (so JPEG round trips are meaningful)."""
    w, h = size
    image = Image.new("RGB", size)
    image.putdata([(x * 255 // w, y * 255 // h, 128) for y in range(h) for x in range(w)])
    return image if mode == "RGB" else image.convert(mode)


def huge_jpeg(width: int = 20000, height: int = 10000) -> bytes:
    """A real baseline JPEG of ``width`` x ``height`` (a horizontal gradient), made in milliseconds and
    without ever holding the image: one 8-pixel strip is encoded with a restart marker per MCU row; a
    restart resets the DC predictors, so that row's entropy-coded bytes are the same for every row and
    are repeated (with the RST0…RST7 cycle between them) under a SOF header patched to the full height.
    20000 x 10000 is 200M pixels, past Pillow's decompression-bomb error limit (2 x 89M), in ~6 MB."""
    assert height % 8 == 0
    ramp = Image.linear_gradient("L").rotate(90).resize((width, 8))
    strip = Image.merge("RGB", (ramp, ramp.transpose(Image.Transpose.FLIP_LEFT_RIGHT), Image.new("L", (width, 8), 96)))
    data = encode(strip, "JPEG", quality=90, subsampling=0, restart_marker_rows=1)  # 4:4:4: 8x8 MCUs
    head, pos, restarts = bytearray(data[:2]), 2, False
    while True:  # the marker segments up to and including SOS
        marker, length = data[pos + 1], int.from_bytes(data[pos + 2:pos + 4], "big")
        segment = bytearray(data[pos:pos + 2 + length])
        if marker == 0xC0:  # SOF0: precision, height, width, ...
            segment[5:7] = height.to_bytes(2, "big")
        restarts |= marker == 0xDD  # DRI
        head += segment
        pos += 2 + length
        if marker == 0xDA:
            break
    assert restarts and data.endswith(b"\xff\xd9")
    row = data[pos:-2]
    markers = [bytes([0xFF, 0xD0 + i % 8]) for i in range(height // 8 - 1)] + [b"\xff\xd9"]
    return bytes(head) + b"".join(row + marker for marker in markers)


def free_port() -> int:
    """A TCP port on localhost that nothing listens on right now."""
    import socket

    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def run_main(*args) -> tuple[int, str, str]:
    """The command line in this process (no TensorFlow start-up to pay again): ``(exit code, stdout,
    stderr)``. For what happens before a command's work; signals, kills and servers use :func:`run_cli`."""
    import contextlib

    from captioning.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main([str(a) for a in args])
        except SystemExit as e:  # argparse's usage errors
            code = e.code
    return code, out.getvalue(), err.getvalue()


def run_cli(*args, cwd=None, timeout=300, env=None):
    """Runs ``python -m captioning ARGS`` in a fresh process; returns the CompletedProcess."""
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", PYTHONPATH=REPO, **(env or {}))
    return subprocess.run([sys.executable, "-m", "captioning", *args], capture_output=True, text=True,
                          cwd=cwd or REPO, env=env, timeout=timeout, stdin=subprocess.DEVNULL)


class Background:
    """A process in the background (``argv``, run in ``cwd``), its stdout and stderr going to
    ``folder/<name>.out`` and ``.err``, which the properties read as they grow."""

    def __init__(self, folder, name, argv, cwd=None, env=None):
        self.name, self.out_path, self.err_path = name, folder / f"{name}.out", folder / f"{name}.err"
        env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", PYTHONPATH=REPO, **(env or {}))
        with open(self.out_path, "w") as out, open(self.err_path, "w") as err:
            self.proc = subprocess.Popen(argv, stdout=out, stderr=err, cwd=cwd or REPO, env=env,
                                         stdin=subprocess.DEVNULL)

    @property
    def stdout(self):
        return self.out_path.read_text()

    @property
    def stderr(self):
        return self.err_path.read_text()


def run_distributed_worker(mode, *args, timeout=600):
    """``tests/distributed_worker.py MODE ARGS`` in a fresh process (logical devices and collectives must be
    set before TensorFlow starts); asserts that it exits 0."""
    env = dict(os.environ, PYTHONPATH=REPO, TF_CPP_MIN_LOG_LEVEL="2")
    done = subprocess.run([sys.executable, os.path.join(REPO, "tests", "distributed_worker.py"), mode, *args],
                          env=env, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]


@pytest.fixture(scope="session")
def prepared_dir(shapes_dir, tmp_path_factory):
    """The shapes fixture prepared into TFRecords (min word count 1: every word in the vocabulary)."""
    from data_prep.prepare import PrepareOptions, prepare

    out = str(tmp_path_factory.mktemp("records"))
    prepare(PrepareOptions(output_dir=out, split=coco_split_args(shapes_dir), workers=1, min_word_count=1),
            progress=False)
    return out


def small_train_config(data_dir, *extra):
    """A config that trains in seconds on the shapes fixture (tests/distributed_worker.py defines it)."""
    sys.path.insert(0, os.path.join(REPO, "tests"))
    from distributed_worker import small_config

    return small_config(data_dir, *extra)


@pytest.fixture(scope="session")
def trained_model_dir(prepared_dir, tmp_path_factory):
    """A small model trained for 60 steps: real checkpoints, config.yaml and vocab.txt."""
    from captioning.train import Trainer

    model_dir = str(tmp_path_factory.mktemp("model"))
    cfg = small_train_config(prepared_dir, "train.steps=60", "train.optimizer=adam", "train.learning_rate=0.01",
                             "model.embedding_size=32", "model.lstm_units=32", "train.checkpoint_every_steps=60")
    Trainer(cfg, model_dir).run(progress=False)
    return model_dir


@pytest.fixture(scope="session")
def trained_attention_dir(prepared_dir, tmp_path_factory):
    """A small soft-attention model (2 x 2 grid at 32 px) trained for 40 steps, with an evaluation (and
    its TensorBoard sample pictures) at the end."""
    from captioning.train import Trainer

    model_dir = str(tmp_path_factory.mktemp("attention_model"))
    cfg = small_train_config(prepared_dir, "model.decoder=attention", "model.attention_size=16", "train.steps=40",
                             "train.optimizer=adam", "train.learning_rate=0.01", "model.embedding_size=32",
                             "model.lstm_units=32", "train.checkpoint_every_steps=40", "train.eval_every_steps=40",
                             "train.eval_batches=1", "train.sample_captions=2")
    Trainer(cfg, model_dir).run(progress=False)
    return model_dir
