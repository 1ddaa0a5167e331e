"""The prepared dataset: the folder ``captioning prepare`` writes, as one typed object every reader takes.

::

    train-00000-of-00004.tfrecord …   the shards: one tf.train.Example per image (captioning.data.schema)
    vocab.txt                         the vocabulary, line i is id i (captioning.vocab)
    manifest.json                     what the folder holds, written last: a folder with it is complete

:class:`PreparedDataset` is the only code that knows ``manifest.json``'s name and keys: ``prepare``
writes it through :meth:`PreparedDataset.write`, readers (the input pipeline, the integrity checks,
the disk cache, ``train``, ``evaluate``, the benchmarks) get it from :meth:`PreparedDataset.load`,
once, with the format check. Per split it records the images, the captions, the shards and each
shard's record count and size (readers use those to catch a shard cut short, emptied or grown), the
captions dropped empty and clipped; for the whole folder the vocabulary size, the skipped images with
their reasons, the options ``prepare`` ran with, and the ``fingerprint`` of what it wrote (the dataset's
identity: sources, options and the plan).

Example::

    >>> dataset = PreparedDataset.load("runs/demo/records")            # doctest: +SKIP
    >>> dataset.split("train").images, dataset.files("val")[0]         # doctest: +SKIP
    (4000, 'runs/demo/records/val-00000-of-00004.tfrecord')

The object *is* the manifest document (a ``dict``: ``dataset["splits"]["train"]["images"]``, JSON as it
is on disk), with typed access on top (:attr:`PreparedDataset.splits` of :class:`SplitInfo`).
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass

from captioning.errors import InputError
from captioning.data.schema import FORMAT_VERSION
from captioning.fileio import atomic_write_json
from captioning.vocab import Vocabulary

MANIFEST = "manifest.json"
VOCAB = "vocab.txt"


@dataclass(frozen=True)
class SplitInfo:
    """One split of a prepared dataset. ``shard_records`` and ``shard_bytes`` are parallel to ``shards``
    (None in datasets prepared before they were recorded)."""

    name: str
    images: int
    captions: int
    shards: tuple[str, ...]
    shard_records: tuple[int, ...] | None = None
    shard_bytes: tuple[int, ...] | None = None
    empty_captions: int = 0
    clipped_captions: int = 0

    @property
    def captions_per_image(self) -> float:
        return self.captions / max(1, self.images)

    def to_json(self) -> dict:
        out = {"images": self.images, "captions": self.captions, "shards": list(self.shards),
               "empty_captions": self.empty_captions, "clipped_captions": self.clipped_captions}
        if self.shard_records is not None:
            out["shard_records"] = list(self.shard_records)
        if self.shard_bytes is not None:
            out["shard_bytes"] = list(self.shard_bytes)
        return out

    @classmethod
    def from_json(cls, name: str, data: dict) -> "SplitInfo":
        shards = tuple(data["shards"])

        def parallel(key):  # a list that does not match the shards is as good as none
            values = data.get(key)
            return tuple(values) if isinstance(values, list) and len(values) == len(shards) else None

        return cls(name, int(data["images"]), int(data["captions"]), shards, parallel("shard_records"),
                   parallel("shard_bytes"), int(data.get("empty_captions", 0)), int(data.get("clipped_captions", 0)))


@dataclass(frozen=True)
class ImageRecord:
    """What the prepared dataset holds of one image, but its pixels: its split, stored size, source file name
    and captions' token ids (one list per caption, ``<start>`` and ``<end>`` included)."""

    split: str
    width: int
    height: int
    file_name: str
    captions: list


class PreparedDataset(dict):
    """A prepared dataset folder (see the module docstring): its manifest document (this dict, exactly what
    ``manifest.json`` holds) with typed access to it."""

    def __init__(self, path: str, document: dict):
        super().__init__(document)
        self.path = path
        try:  # parsed once: a manifest that does not parse is refused when loaded
            self.splits = {name: SplitInfo.from_json(name, info) for name, info in document["splits"].items()}
            self.vocab_size = int(document["vocab_size"])
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise InputError(f"{os.path.join(path, MANIFEST)} is damaged ({type(e).__name__}: {e}): prepare the "
                             "dataset again") from None

    @classmethod
    def create(cls, path: str, splits: dict[str, SplitInfo], vocab_size: int, skipped: list[dict], config: dict,
               fingerprint: str) -> "PreparedDataset":
        """The dataset ``prepare`` has just written the shards and vocabulary of (:meth:`write` it last)."""
        return cls(path, {"format_version": FORMAT_VERSION, "splits": {n: s.to_json() for n, s in splits.items()},
                          "vocab_size": vocab_size, "skipped": skipped, "config": config, "fingerprint": fingerprint})

    # ---- reading ------------------------------------------------------------------------------------
    @classmethod
    def load(cls, path: str) -> "PreparedDataset":
        """Reads and checks ``path/manifest.json``; InputError when it is missing, damaged or of another
        format version."""
        manifest = os.path.join(path, MANIFEST)
        try:
            with open(manifest, encoding="utf-8") as f:
                data = json.load(f)
        except FileNotFoundError:
            raise InputError(f"{path} is not a prepared dataset: {MANIFEST} is missing "
                             "(run `captioning prepare`, or finish it with --resume)") from None
        except (OSError, ValueError) as e:  # ValueError: not JSON, not UTF-8
            raise InputError(f"cannot read {manifest}: {e}") from None
        if not isinstance(data, dict) or data.get("format_version") != FORMAT_VERSION:
            version = data.get("format_version") if isinstance(data, dict) else None
            raise InputError(f"{manifest} has format_version {version}; this code reads {FORMAT_VERSION}: "
                             "prepare the dataset again")
        return cls(path, data)

    @property
    def fingerprint(self) -> str | None:
        return self.get("fingerprint")

    @property
    def skipped(self) -> list[dict]:
        return self.get("skipped", [])

    def split(self, name: str) -> SplitInfo:
        if name not in self.splits:
            raise InputError(f"split {name!r} is not in {self.path} (it has {', '.join(self.splits)})")
        return self.splits[name]

    def files(self, split: str) -> list[str]:
        """Full paths of a split's shards, in the manifest's order."""
        return [os.path.join(self.path, name) for name in self.split(split).shards]

    def expected_sizes(self, split: str) -> dict[str, tuple[int | None, int | None]]:
        """Each shard's path → (records, bytes) as recorded (None where not recorded)."""
        info = self.split(split)
        return {os.path.join(self.path, name): ((info.shard_records or (None,) * len(info.shards))[i],
                                                (info.shard_bytes or (None,) * len(info.shards))[i])
                for i, name in enumerate(info.shards)}

    def image_sizes(self) -> dict[int, tuple[str, int, int]]:
        """Every image's id → (split, stored width, stored height), read from the shards with TensorFlow
        (the records' ids and sizes only; the images are not decoded)."""
        return {i: (r.split, r.width, r.height) for i, r in self.image_records().items()}

    def image_records(self) -> dict[int, "ImageRecord"]:
        """Every image's id → its :class:`ImageRecord` (all but the JPEG), from the shards."""
        import tensorflow as tf

        from captioning.data import schema

        spec = {key: value for key, value in schema.feature_spec().items()
                if key not in (schema.IMAGE_ENCODED, schema.CAPTION_TEXT)}
        out = {}
        for split in self.splits:
            for batch in tf.data.TFRecordDataset(self.files(split)).batch(1024).map(
                    tf.autograph.experimental.do_not_convert(lambda s: tf.io.parse_example(s, spec))):
                ragged = batch[schema.CAPTION_IDS]  # [images, (captions), (ids)], split with numpy (fast)
                ids = ragged.flat_values.numpy().tolist()
                inner = ragged.values.row_splits.numpy().tolist()
                outer = ragged.row_splits.numpy().tolist()
                captions = [[ids[inner[c]:inner[c + 1]] for c in range(outer[i], outer[i + 1])]
                            for i in range(len(outer) - 1)]
                for i, w, h, name, caps in zip(
                        *(batch[k].numpy().tolist() for k in (schema.IMAGE_ID, schema.IMAGE_WIDTH,
                                                              schema.IMAGE_HEIGHT, schema.IMAGE_FILENAME)), captions):
                    out[i] = ImageRecord(split, w, h, name.decode("utf-8"), caps)
        return out

    def caption_texts(self, split: str) -> list[str]:
        """Every caption's text (the records' ``caption/text``, as ``prepare`` read it) of ``split``, image by
        image in the shards' order: the text ``captioning lm train --text DATA --split SPLIT`` learns from."""
        import tensorflow as tf

        from captioning.data import schema

        spec = {schema.CAPTION_TEXT: schema.feature_spec()[schema.CAPTION_TEXT]}
        texts = []
        for batch in tf.data.TFRecordDataset(self.files(split)).batch(1024).map(
                tf.autograph.experimental.do_not_convert(lambda s: tf.io.parse_example(s, spec))):
            texts += [t.decode("utf-8") for t in batch[schema.CAPTION_TEXT].flat_values.numpy().tolist()]
        return texts

    @property
    def vocab_path(self) -> str:
        return os.path.join(self.path, VOCAB)

    def vocabulary(self) -> Vocabulary:
        return Vocabulary.load(self.vocab_path)

    @property
    def identity(self) -> str:
        """What the dataset holds, as a string: the fingerprint, or for datasets prepared before fingerprints
        a hash of the manifest itself."""
        if self.fingerprint:
            return self.fingerprint
        with open(os.path.join(self.path, MANIFEST), "rb") as f:
            return hashlib.sha256(f.read()).hexdigest()

    # ---- writing (prepare) --------------------------------------------------------------------------
    def write(self) -> None:
        """Writes ``manifest.json`` atomically: the last file of a prepared dataset."""
        atomic_write_json(os.path.join(self.path, MANIFEST), dict(self))

    @staticmethod
    def manifest_path(path: str) -> str:
        """Where a dataset folder's manifest is (``prepare`` checks for a complete dataset there)."""
        return os.path.join(path, MANIFEST)
