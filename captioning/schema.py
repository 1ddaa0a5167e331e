"""The prepared dataset's format: one ``tf.train.Example`` per image, shard names, side files.

This module is the only place that knows the feature keys. ``data_prep`` writes records with
:func:`encode_example`; the input pipeline reads them with :func:`parse_batch`. Bump
:data:`FORMAT_VERSION` when the layout changes; readers refuse a ``manifest.json`` of another version.

One record per image (im2txt stored one record per caption, so each image five times):

=====================  =======  =================================================================
key                    type     value
=====================  =======  =================================================================
``image/id``           int64    the COCO image id
``image/filename``     bytes    the source file name, for reports
``image/encoded``      bytes    an RGB baseline JPEG (always decodable with ``decode_jpeg(channels=3)``)
``image/height``       int64    height of the stored JPEG in pixels
``image/width``        int64    width of the stored JPEG in pixels
``caption/text``       bytes[]  each caption as annotated (UTF-8), the references for evaluation
``caption/ids``        int64[]  all captions' token ids, concatenated
``caption/length``     int64[]  how many ids each caption has (row lengths of ``caption/ids``)
=====================  =======  =================================================================

Each caption's ids are ``[<start>, w1 … wn, <end>]`` (see :mod:`captioning.vocab`), so an image with
captions "a red circle" and "a circle" and vocabulary ``a=4 circle=5 red=6`` stores::

    caption/ids    = [1, 4, 6, 5, 2,   1, 4, 5, 2]
    caption/length = [5,               4]

:func:`parse_batch` returns ``caption/ids`` as a ``tf.RaggedTensor`` of shape
``[batch, (captions), (ids)]`` built from those row lengths: one vectorised ``parse_example`` call per
batch of records, no per-record Python.
"""

from __future__ import annotations

import re
from typing import Sequence

from captioning import records

FORMAT_VERSION = 1

IMAGE_ID = "image/id"
IMAGE_FILENAME = "image/filename"
IMAGE_ENCODED = "image/encoded"
IMAGE_HEIGHT = "image/height"
IMAGE_WIDTH = "image/width"
CAPTION_TEXT = "caption/text"
CAPTION_IDS = "caption/ids"
CAPTION_LENGTH = "caption/length"

MANIFEST = "manifest.json"
VOCAB = "vocab.txt"

_SHARD = re.compile(r"^(?P<split>[A-Za-z0-9_]+)-(?P<index>\d{5})-of-(?P<count>\d{5})\.tfrecord$")


def shard_name(split: str, index: int, count: int) -> str:
    """``shard_name("train", 3, 128) == "train-00003-of-00128.tfrecord"``."""
    return f"{split}-{index:05d}-of-{count:05d}.tfrecord"


def is_shard_name(name: str) -> bool:
    return _SHARD.match(name) is not None


def encode_example(*, image_id: int, filename: str, jpeg: bytes, height: int, width: int,
                   captions: Sequence[str], caption_ids: Sequence[Sequence[int]]) -> bytes:
    """Serialises one image and all its captions. ``captions[i]`` is the text of ``caption_ids[i]``."""
    if len(captions) != len(caption_ids) or not captions:
        raise ValueError(f"image {image_id}: {len(captions)} captions but {len(caption_ids)} id lists")
    # Keys in sorted order (protobuf's deterministic serialisation of the Features map), so the same
    # inputs give the same bytes whatever process (or worker count) writes them.
    return records.example({
        IMAGE_ID: records.int64_feature([image_id]),
        IMAGE_FILENAME: records.bytes_feature([filename.encode("utf-8")]),
        IMAGE_ENCODED: records.bytes_feature([jpeg]),
        IMAGE_HEIGHT: records.int64_feature([height]),
        IMAGE_WIDTH: records.int64_feature([width]),
        CAPTION_TEXT: records.bytes_feature([c.encode("utf-8") for c in captions]),
        CAPTION_IDS: records.int64_feature([i for ids in caption_ids for i in ids]),
        CAPTION_LENGTH: records.int64_feature([len(ids) for ids in caption_ids]),
    })


def feature_spec() -> dict:
    """The ``tf.io.parse_example`` spec of a record (see the module docstring)."""
    import tensorflow as tf  # the reading side only: writers (prepare's workers) never load TensorFlow

    return {
        IMAGE_ID: tf.io.FixedLenFeature([], tf.int64),
        IMAGE_FILENAME: tf.io.FixedLenFeature([], tf.string),
        IMAGE_ENCODED: tf.io.FixedLenFeature([], tf.string),
        IMAGE_HEIGHT: tf.io.FixedLenFeature([], tf.int64),
        IMAGE_WIDTH: tf.io.FixedLenFeature([], tf.int64),
        CAPTION_TEXT: tf.io.RaggedFeature(tf.string),
        CAPTION_IDS: tf.io.RaggedFeature(
            tf.int64, value_key=CAPTION_IDS, partitions=[tf.io.RaggedFeature.RowLengths(CAPTION_LENGTH)]),
    }


def parse_batch(serialized) -> dict:
    """Parses a 1-D batch of serialised records in one vectorised call.

    Returns a dict with ``image/id``, ``image/height``, ``image/width`` of shape ``[batch]``,
    ``image/encoded`` and ``image/filename`` strings ``[batch]``, ``caption/text`` ragged
    ``[batch, (captions)]`` and ``caption/ids`` ragged ``[batch, (captions), (ids)]``.
    """
    import tensorflow as tf

    return tf.io.parse_example(serialized, feature_spec())


def read_manifest(data_dir: str) -> dict:
    """Reads and checks ``data_dir/manifest.json``; raises InputError when it is missing or too new."""
    import json
    import os

    from captioning.errors import InputError

    path = os.path.join(data_dir, MANIFEST)
    try:
        with open(path, encoding="utf-8") as f:
            manifest = json.load(f)
    except FileNotFoundError:
        raise InputError(f"{data_dir} is not a prepared dataset: {MANIFEST} is missing "
                         "(run `captioning prepare`, or finish it with --resume)") from None
    except (OSError, json.JSONDecodeError) as e:
        raise InputError(f"cannot read {path}: {e}") from None
    if manifest.get("format_version") != FORMAT_VERSION:
        raise InputError(f"{path} has format_version {manifest.get('format_version')}; this code reads "
                         f"{FORMAT_VERSION}: prepare the dataset again")
    return manifest


def split_files(data_dir: str, manifest: dict, split: str) -> list[str]:
    """Full paths of a split's shards, as listed by the manifest."""
    import os

    from captioning.errors import InputError

    if split not in manifest["splits"]:
        raise InputError(f"split {split!r} is not in {data_dir} (it has {', '.join(manifest['splits'])})")
    return [os.path.join(data_dir, name) for name in manifest["splits"][split]["shards"]]
