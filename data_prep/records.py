"""TFRecord files and ``tf.train.Example`` records, written without TensorFlow: the writing half of the record
format (:mod:`captioning.data.schema` holds the keys and the reading half).

``prepare`` writes shards in worker processes. Importing TensorFlow costs a process ~3 s of CPU (3.7 s
wall on the project's 2-core machine) — as long as a worker needs to validate and re-encode ~350
COCO photos — so the writing side of the format is plain Python: the protobuf wire format of the few
message types an ``Example`` needs, and TFRecord framing with CRC-32C (``google-crc32c``, a C
extension). The output is byte for byte what ``tf.io.TFRecordWriter`` and
``Example.SerializeToString(deterministic=True)`` give (``tests/test_records.py`` compares them).
Reading stays with TensorFlow (``tf.data.TFRecordDataset``, ``tf.io.parse_example``).

A TFRecord file is a sequence of records, each::

    uint64 length | uint32 masked_crc32c(length) | data (length bytes) | uint32 masked_crc32c(data)

little-endian, with ``masked_crc(c) = ((c >> 15) | (c << 17)) + 0xa282ead8`` (mod 2³²).

The messages (``tensorflow/core/example/{example,feature}.proto``)::

    Example  { Features features = 1; }
    Features { map<string, Feature> feature = 1; }      (entries sorted by key: deterministic)
    Feature  { oneof kind { BytesList bytes_list = 1; FloatList float_list = 2; Int64List int64_list = 3; } }
    BytesList { repeated bytes value = 1; }
    Int64List { repeated int64 value = 1 [packed = true]; }

>>> int64_feature([1, 300]).hex()
'1a050a0301ac02'
"""

from __future__ import annotations

import os
import struct
from typing import BinaryIO, Mapping, Sequence

import numpy as np

from captioning.data import features_store as store
from captioning.data import schema
from captioning.data.schema import masked_crc32c

_U64 = 0xFFFFFFFFFFFFFFFF


def _varint(value: int) -> bytes:
    value &= _U64  # negative int64s are ten-byte two's complement varints
    out = bytearray()
    while value > 0x7F:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def _length_delimited(field: int, payload: bytes) -> bytes:
    return _varint(field << 3 | 2) + _varint(len(payload)) + payload


def bytes_feature(values: Sequence[bytes]) -> bytes:
    """A serialised ``Feature`` holding a ``BytesList``."""
    return _length_delimited(1, b"".join(_length_delimited(1, v) for v in values))


def int64_feature(values: Sequence[int]) -> bytes:
    """A serialised ``Feature`` holding a packed ``Int64List``."""
    packed = b"".join(_varint(int(v)) for v in values)
    return _length_delimited(3, _length_delimited(1, packed) if values else b"")


def example(features: Mapping[str, bytes]) -> bytes:
    """A serialised ``Example`` from serialised ``Feature``s, keys in sorted order."""
    entries = b"".join(
        _length_delimited(1, _length_delimited(1, key.encode("utf-8")) + _length_delimited(2, features[key]))
        for key in sorted(features, key=lambda k: k.encode("utf-8")))
    return _length_delimited(1, entries)


def frame(record: bytes) -> bytes:
    """One record in TFRecord framing."""
    length = struct.pack("<Q", len(record))
    return length + struct.pack("<I", masked_crc32c(length)) + record + struct.pack("<I", masked_crc32c(record))


class RecordWriter:
    """Writes a TFRecord file (uncompressed), like ``tf.io.TFRecordWriter``; a context manager. ``target``
    is a path (``append``: records go after those it holds), or a binary file object the caller owns (and
    closes), e.g. one from :func:`captioning.fileio.atomic_file`."""

    def __init__(self, target: str | BinaryIO, append: bool = False):
        self._owned = isinstance(target, (str, os.PathLike))
        self._file = open(target, "ab" if append else "wb") if self._owned else target

    def write(self, record: bytes) -> None:
        self._file.write(frame(record))

    def flush(self) -> None:
        self._file.flush()

    def sync(self) -> None:
        """Every record written so far on the disk (flushed and fsynced)."""
        self._file.flush()
        os.fsync(self._file.fileno())

    def close(self) -> None:
        if self._owned:
            self._file.close()
        else:
            self._file.flush()

    def __enter__(self) -> "RecordWriter":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def encode_example(*, image_id: int, filename: str, jpeg: bytes, height: int, width: int,
                   captions: Sequence[str], caption_ids: Sequence[Sequence[int]]) -> bytes:
    """Serialises one image and all its captions. ``captions[i]`` is the text of ``caption_ids[i]``."""
    if len(captions) != len(caption_ids) or not captions:
        raise ValueError(f"image {image_id}: {len(captions)} captions but {len(caption_ids)} id lists")
    # Keys in sorted order (protobuf's deterministic serialisation of the Features map), so the same
    # inputs give the same bytes whatever process (or worker count) writes them.
    return example({
        schema.IMAGE_ID: int64_feature([image_id]),
        schema.IMAGE_FILENAME: bytes_feature([filename.encode("utf-8")]),
        schema.IMAGE_ENCODED: bytes_feature([jpeg]),
        schema.IMAGE_HEIGHT: int64_feature([height]),
        schema.IMAGE_WIDTH: int64_feature([width]),
        schema.CAPTION_TEXT: bytes_feature([c.encode("utf-8") for c in captions]),
        schema.CAPTION_IDS: int64_feature([i for ids in caption_ids for i in ids]),
        schema.CAPTION_LENGTH: int64_feature([len(ids) for ids in caption_ids]),
    })


def encode_regions(*, image_id: int, features, boxes, width: int, height: int,
                   captions: Sequence[Sequence[int]]) -> bytes:
    """Serialises one image's regions for the features store (keys in
    :mod:`captioning.data.features_store`): ``features [n, D]`` stored as float16 and ``boxes [n, 4]``
    as float32, little-endian; ``captions`` the image's token ids, one list per caption."""
    features = np.ascontiguousarray(features, dtype="<f2")
    boxes = np.ascontiguousarray(boxes, dtype="<f4")
    return example({
        store.IMAGE_ID: int64_feature([image_id]),
        store.COUNT: int64_feature([len(features)]),
        store.FEATURES: bytes_feature([features.tobytes()]),
        store.BOXES: bytes_feature([boxes.tobytes()]),
        store.WIDTH: int64_feature([width]),
        store.HEIGHT: int64_feature([height]),
        store.CAPTION_IDS: int64_feature([t for caption in captions for t in caption]),
        store.CAPTION_LENGTH: int64_feature([len(caption) for caption in captions]),
    })
