"""The prepared dataset's format: one ``tf.train.Example`` per image, shard names, side files.

This module is the only place that knows the feature keys. ``data_prep`` writes records with
:func:`data_prep.records.encode_example`; the input pipeline reads them with :func:`parse_batch`. Bump
:data:`FORMAT_VERSION` when the layout changes; readers refuse a dataset of another version
(:class:`captioning.data.prepared.PreparedDataset`).

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

FORMAT_VERSION = 1  # bump when the record layout or the prepared dataset's manifest changes


IMAGE_ID = "image/id"
IMAGE_FILENAME = "image/filename"
IMAGE_ENCODED = "image/encoded"
IMAGE_HEIGHT = "image/height"
IMAGE_WIDTH = "image/width"
CAPTION_TEXT = "caption/text"
CAPTION_IDS = "caption/ids"
CAPTION_LENGTH = "caption/length"


_SHARD = re.compile(r"^(?P<split>[A-Za-z0-9_]+)-(?P<index>\d{5})-of-(?P<count>\d{5})\.tfrecord$")


def shard_name(split: str, index: int, count: int) -> str:
    """``shard_name("train", 3, 128) == "train-00003-of-00128.tfrecord"``."""
    return f"{split}-{index:05d}-of-{count:05d}.tfrecord"


def is_shard_name(name: str) -> bool:
    return _SHARD.match(name) is not None


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


# ---- TFRecord framing (TensorFlow's format): uint64 length | uint32 masked CRC-32C(length) | data |
# uint32 masked CRC-32C(data), little-endian, with masked_crc(c) = ((c >> 15) | (c << 17)) + CRC_MASK_DELTA.
# The writer (data_prep.records) frames records with it; the integrity scanner finds record boundaries.
CRC_MASK_DELTA = 0xA282EAD8


def masked_crc32c(data: bytes) -> int:
    import google_crc32c

    crc = google_crc32c.value(data)
    return (((crc >> 15) | (crc << 17)) + CRC_MASK_DELTA) & 0xFFFFFFFF
