"""The features store: region features beside a prepared dataset, as one typed object.

``captioning features import`` (data_prep/features_import.py) writes it inside the prepared dataset's
folder, one store per name::

    DATA/features/NAME/
        train-00000-of-00007.tfrecord …       one tf.train.Example per image that has features, per split
        store.json                             what the store holds, written last: a store with it is complete

:class:`FeaturesStore` is the only code that knows ``store.json``'s keys and the records' keys. The
records (:data:`KEYS`)::

    image/id          int64   the COCO image id (the prepared dataset's)
    region/count      int64   n ≥ 1, the number of regions
    region/features   bytes   n × D float16, little-endian, row-major
    region/boxes      bytes   n × 4 float32: x1, y1, x2, y2 in pixels of the image the detector saw
    image/width       int64   that image's size in pixels (where the source does not say, as self-critical.pytorch's
    image/height      int64   and the meshed-memory Transformer's files do not: its prepared record's size)
    caption/ids       int64[] the image's captions' token ids from the prepared dataset, concatenated, and
    caption/length    int64[] how many each caption has (as in the prepared records): training and evaluation
                              read regions and captions from the store alone, with no join

Shards, per split of the prepared dataset (so training reads only its split): the split's image ids
sorted and cut into runs of ``images_per_shard``; shard *k* holds the images of run *k* that have
features (in the source's order), so an image's shard is found from the split's ``shard_first_ids``
(:meth:`FeaturesStore.shard_of`). ``store.json`` also records the feature size, whether the source
gave boxes, per split the images and regions held and each shard's records and bytes, the source (kind
and path), the dataset it belongs to (its identity) and what the import left out: dataset images
without features (``missing``), features of images the dataset does not have (``extra``) and rows that
could not be read (``malformed``), each a count and a few examples, and the boxes :func:`clean_boxes`
dropped (``boxes_dropped``) or clipped to the image (``boxes_clipped``): a count and a few image ids.

Example::

    >>> store = FeaturesStore.load("runs/demo/records", "bottomup")            # doctest: +SKIP
    >>> store.feature_size, store.images, store.shard_of(9, "train")          # doctest: +SKIP
    (2048, 123287, 'runs/demo/records/features/bottomup/train-00000-of-00114.tfrecord')
    >>> store.read([9])[9].features.shape                                     # doctest: +SKIP
    (36, 2048)
"""

from __future__ import annotations

import bisect
import json
import os
import re
from dataclasses import dataclass, field

import numpy as np

from captioning.errors import InputError
from captioning.fileio import atomic_write_json

FORMAT_VERSION = 2  # 2: the records carry the captions
FOLDER = "features"
MANIFEST = "store.json"
IMAGE_ID, COUNT, FEATURES, BOXES, WIDTH, HEIGHT, CAPTION_IDS, CAPTION_LENGTH = (
    "image/id", "region/count", "region/features", "region/boxes", "image/width", "image/height", "caption/ids",
    "caption/length")
KEYS = (IMAGE_ID, COUNT, FEATURES, BOXES, WIDTH, HEIGHT, CAPTION_IDS, CAPTION_LENGTH)
BOX_KINDS = ("boxes_dropped", "boxes_clipped")  # what clean_boxes did, counted in store.json
_NAME = re.compile(r"^[A-Za-z0-9_-][A-Za-z0-9_.-]*$")  # not starting with '.': DATA/features/.partial-* are work


def shard_name(split: str, index: int, count: int) -> str:
    """``shard_name("train", 3, 114) == "train-00003-of-00114.tfrecord"``."""
    return f"{split}-{index:05d}-of-{count:05d}.tfrecord"


def check_name(name: str) -> str:
    """A store's name: letters, digits, ``_ . -``, not starting with ``.`` (it is a folder name, and the
    hidden ``.partial-NAME`` folders beside the stores are work folders); an InputError naming ``name``."""
    if not _NAME.match(name or ""):
        raise InputError(f"`name` must be letters, digits, '_', '.' or '-', not starting with '.' (a folder name; "
                         f"hidden folders in DATA/{FOLDER}/ are work folders), got {name!r}", params=("name",))
    return name


@dataclass(frozen=True)
class CleanBoxes:
    """What :func:`clean_boxes` kept: the boxes (clipped), which of the given ones they are, and how many of
    them were clipped."""

    boxes: np.ndarray
    kept: np.ndarray
    clipped: int

    @property
    def dropped(self) -> int:
        return int(len(self.kept) - self.kept.sum())


def clean_boxes(boxes, width: float, height: float) -> CleanBoxes:
    """The one rule for boxes, on every path that takes them (``features import``, ``features extract``,
    ``caption --detections``): ``boxes [n, 4]`` (x1, y1, x2, y2 pixels of a ``width`` × ``height`` image) are
    clipped to the image, and a box with a coordinate that is not finite, or with no area once clipped
    (x2 ≤ x1 or y2 ≤ y1: empty, inverted or outside the image), is dropped. The callers count both in
    their reports.

    >>> c = clean_boxes([[-50, -50, 786, 789], [10, 10, 5, 5], [10, 10, 10, 10], [np.nan, 1, 2, 3], [1, 2, 3, 4]],
    ...                 262, 263)
    >>> c.boxes.tolist(), c.kept.tolist(), c.clipped, c.dropped
    ([[0.0, 0.0, 262.0, 263.0], [1.0, 2.0, 3.0, 4.0]], [True, False, False, False, True], 1, 3)
    """
    given = np.asarray(boxes, np.float64).reshape(-1, 4)
    finite = np.isfinite(given).all(axis=1)
    limits = np.array([width, height, width, height], np.float64)
    clipped = np.clip(np.where(finite[:, None], given, 0.0), 0.0, limits)
    kept = finite & (clipped[:, 2] > clipped[:, 0]) & (clipped[:, 3] > clipped[:, 1])
    moved = kept & (clipped != np.where(finite[:, None], given, 0.0)).any(axis=1)
    return CleanBoxes(clipped[kept].astype(np.float32), kept, int(moved.sum()))


def store_path(data_dir: str, name: str) -> str:
    """Where the store ``name`` of the prepared dataset ``data_dir`` is."""
    return os.path.join(data_dir, FOLDER, check_name(name))


@dataclass(frozen=True)
class Regions:
    """One image's regions: ``features [n, D]`` float16, ``boxes [n, 4]`` float32 (x1, y1, x2, y2 pixels of
    a ``width`` × ``height`` image; all zeros when the source gave no boxes); ``captions`` its captions'
    token ids from the prepared dataset, one list per caption."""

    features: np.ndarray
    boxes: np.ndarray
    width: int
    height: int
    captions: list = field(default_factory=list)


@dataclass(frozen=True)
class StoreSplit:
    """One split's part of a store: its images and regions, shards (with records, bytes and the first image
    id of each shard's run)."""

    images: int
    regions: int
    shards: tuple[str, ...]
    shard_records: tuple[int, ...]
    shard_bytes: tuple[int, ...]
    shard_first_ids: tuple[int, ...]

    def to_json(self) -> dict:
        return {"images": self.images, "regions": self.regions, "shards": list(self.shards),
                "shard_records": list(self.shard_records), "shard_bytes": list(self.shard_bytes),
                "shard_first_ids": list(self.shard_first_ids)}

    @classmethod
    def from_json(cls, data: dict) -> "StoreSplit":
        split = cls(int(data["images"]), int(data["regions"]), tuple(map(str, data["shards"])),
                    tuple(map(int, data["shard_records"])), tuple(map(int, data["shard_bytes"])),
                    tuple(map(int, data["shard_first_ids"])))
        if not len(split.shards) == len(split.shard_records) == len(split.shard_bytes) == len(split.shard_first_ids):
            raise ValueError("its shard lists differ in length")
        return split


@dataclass(frozen=True)
class Left:
    """What an import left out of one kind: how many, and a few examples (ids, or ``line N: reason``)."""

    count: int = 0
    examples: tuple[str, ...] = ()

    def to_json(self) -> dict:
        return {"count": self.count, "examples": list(self.examples)}


class FeaturesStore(dict):
    """A features store folder (see the module docstring): its manifest document (this dict) with typed access."""

    def __init__(self, path: str, document: dict):
        super().__init__(document)
        self.path = path
        try:
            self.name = str(document["name"])
            self.feature_size = int(document["feature_size"])
            self.has_boxes = bool(document["boxes"])
            self.splits = {name: StoreSplit.from_json(data) for name, data in document["splits"].items()}
            self.dataset = document["dataset"]
            left = {kind: document[kind] for kind in ("missing", "extra", "malformed")}
            left.update({kind: document[kind] for kind in BOX_KINDS if kind in document})  # (stores before them)
            self.left = {kind: Left(int(v["count"]), tuple(map(str, v["examples"]))) for kind, v in left.items()}
            self.left.update({kind: Left() for kind in BOX_KINDS if kind not in self.left})
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise InputError(f"{os.path.join(path, MANIFEST)} is damaged ({type(e).__name__}: {e}): import the "
                             "features again") from None
        self.images = sum(split.images for split in self.splits.values())
        self.regions = sum(split.regions for split in self.splits.values())

    @classmethod
    def create(cls, path: str, *, name: str, feature_size: int, boxes: bool, splits: dict[str, StoreSplit],
               source: dict, dataset: str | None, left: dict[str, Left]) -> "FeaturesStore":
        """The store an import has just written the shards of (:meth:`write` it last)."""
        return cls(path, {"format_version": FORMAT_VERSION, "name": name, "feature_size": feature_size,
                          "boxes": boxes, "splits": {n: split.to_json() for n, split in splits.items()},
                          "source": source, "dataset": dataset,
                          **{kind: left[kind].to_json() for kind in ("missing", "extra", "malformed") + BOX_KINDS
                             if kind in left}})

    @classmethod
    def load(cls, data_dir: str, name: str) -> "FeaturesStore":
        """The store ``name`` of the prepared dataset ``data_dir``; an InputError when it is missing,
        unfinished, damaged or of another format version."""
        path = store_path(data_dir, name)
        manifest = os.path.join(path, MANIFEST)
        try:
            with open(manifest, encoding="utf-8") as f:
                document = json.load(f)
        except FileNotFoundError:
            raise InputError(f"{data_dir} has no features store {name!r} ({manifest} is missing): run `captioning "
                             f"features import --data-dir {data_dir} --name {name} ...`, or finish it") from None
        except (OSError, ValueError) as e:
            raise InputError(f"cannot read {manifest}: {e}") from None
        if not isinstance(document, dict) or document.get("format_version") != FORMAT_VERSION:
            raise InputError(f"{manifest} is not a features store of format {FORMAT_VERSION}: write it again "
                             "(`captioning features import` or `extract` with --overwrite)")
        return cls(path, document)

    @staticmethod
    def manifest_path(path: str) -> str:
        return os.path.join(path, MANIFEST)

    def write(self) -> None:
        """Writes ``store.json`` atomically: the last file of a store."""
        atomic_write_json(os.path.join(self.path, MANIFEST), dict(self))

    def split(self, name: str) -> StoreSplit:
        if name not in self.splits:
            raise InputError(f"split {name!r} is not in the features store {self.path} (it has "
                             f"{', '.join(self.splits)})")
        return self.splits[name]

    def files(self, split: str | None = None) -> list[str]:
        """Full paths of a split's shards (every split's, by default)."""
        names = [split] if split is not None else list(self.splits)
        return [os.path.join(self.path, shard) for name in names for shard in self.split(name).shards]

    def shard_of(self, image_id: int, split: str) -> str | None:
        """The shard of ``split`` that holds ``image_id`` if the split has it at all (None before its first run)."""
        info = self.split(split)
        index = bisect.bisect_right(info.shard_first_ids, int(image_id)) - 1
        return os.path.join(self.path, info.shards[index]) if index >= 0 else None

    def read(self, image_ids=None) -> dict[int, Regions]:
        """The regions of ``image_ids`` (all, by default) that the store holds, read with TensorFlow."""
        import tensorflow as tf

        wanted = None if image_ids is None else {int(i) for i in image_ids}
        files = self.files() if wanted is None else sorted(
            {f for image_id in wanted for split in self.splits if (f := self.shard_of(image_id, split))})
        out = {}
        for parsed in tf.data.TFRecordDataset(files).map(tf.autograph.experimental.do_not_convert(parse_regions)):
            image_id = int(parsed[IMAGE_ID])
            if wanted is None or image_id in wanted:
                out[image_id] = Regions(parsed[FEATURES].numpy(), parsed[BOXES].numpy(), int(parsed[WIDTH]),
                                        int(parsed[HEIGHT]), parsed[CAPTION_IDS].to_list())
        return out


def parse_regions(serialized) -> dict:
    """One serialised region record → ``image/id``, ``image/width``, ``image/height`` (scalars),
    ``region/features [n, D]`` (float16), ``region/boxes [n, 4]`` (float32) and ``caption/ids`` (ragged
    ``[(captions), (ids)]``). (Per record: the regions' bytes differ in length between images.)"""
    import tensorflow as tf

    spec = {key: tf.io.FixedLenFeature([], tf.string if key in (FEATURES, BOXES) else tf.int64)
            for key in KEYS if key not in (CAPTION_IDS, CAPTION_LENGTH)}
    spec[CAPTION_IDS] = tf.io.RaggedFeature(tf.int64, value_key=CAPTION_IDS,
                                            partitions=[tf.io.RaggedFeature.RowLengths(CAPTION_LENGTH)])
    parsed = tf.io.parse_single_example(serialized, spec)
    n = tf.cast(parsed[COUNT], tf.int32)
    features = tf.io.decode_raw(parsed[FEATURES], tf.float16, little_endian=True)
    boxes = tf.io.decode_raw(parsed[BOXES], tf.float32, little_endian=True)
    return {IMAGE_ID: parsed[IMAGE_ID], WIDTH: parsed[WIDTH], HEIGHT: parsed[HEIGHT],
            FEATURES: tf.reshape(features, [n, -1]), BOXES: tf.reshape(boxes, [n, 4]),
            CAPTION_IDS: parsed[CAPTION_IDS]}
