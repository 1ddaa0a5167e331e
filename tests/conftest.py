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


def run_cli(*args, cwd=None, timeout=300):
    """Runs ``python -m captioning ARGS`` in a fresh process; returns the CompletedProcess."""
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", PYTHONPATH=REPO)
    return subprocess.run([sys.executable, "-m", "captioning", *args], capture_output=True, text=True,
                          cwd=cwd or REPO, env=env, timeout=timeout, stdin=subprocess.DEVNULL)
