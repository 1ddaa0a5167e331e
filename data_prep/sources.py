"""Where images and captions come from: COCO annotation files, Karpathy's split json, or TFDS.

Each source returns, per split name, a list of :class:`Entry` in a fixed order (sorted by image id for
files, TFDS's own order for TFDS). Bad input raises :class:`captioning.errors.InputError` with one line.

* :class:`CocoSource` — ``captions_*.json`` files read with pycocotools, one per split, each with its
  images folder (``--split train=captions_train2014.json:train2014/``).
* :class:`KarpathySource` — ``dataset_coco.json`` (Karpathy & Fei-Fei): each image carries its split
  (``train``/``val``/``test``/``restval``) and sentences; the file is ``ROOT/filepath/filename``.
  ``restval`` joins ``train`` (113,287 training images for COCO) unless ``keep_restval``.
* :class:`TfdsSource` — TFDS's prepared ``coco_captions`` (Karpathy splits, ``restval`` likewise). The
  JPEG bytes are streamed from TFDS's records (``SkipDecoding``), so nothing is decoded twice.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
from dataclasses import dataclass, field
from typing import Iterator

from captioning.errors import InputError

SPLIT_NAME = re.compile(r"^[A-Za-z0-9_]+$")


@dataclass
class Entry:
    """One image of a split and its captions as annotated."""

    image_id: int
    filename: str  # the name reports use (relative path for files, TFDS's file name)
    captions: list[str]
    path: str | None = None  # file to read; None for a streamed source
    tokens: list[list[str]] = field(default_factory=list)  # filled by prepare


def check_split_name(name: str) -> str:
    if not SPLIT_NAME.match(name):
        raise InputError(f"split name {name!r} must be letters, digits or underscores")
    return name


def _load_json(path: str, what: str):
    if not os.path.isfile(path):
        raise InputError(f"{what} {path} does not exist")
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except json.JSONDecodeError as e:
        raise InputError(f"{what} {path} is not valid JSON (line {e.lineno}, column {e.colno}: {e.msg})") from None
    except (OSError, UnicodeDecodeError) as e:
        raise InputError(f"cannot read {what} {path}: {e}") from None


def parse_split_arg(arg: str) -> tuple[str, str, str]:
    """``"train=ann.json:images/"`` → ``("train", "ann.json", "images/")``."""
    name, eq, rest = arg.partition("=")
    annotations, colon, images = rest.rpartition(":")
    if not eq or not colon or not name or not annotations or not images:
        raise InputError(f"`split` {arg!r} must look like NAME=ANNOTATIONS.json:IMAGES_DIR", params=("split",))
    return check_split_name(name), annotations, images


class CocoSource:
    """COCO captions files, one per split, read with pycocotools."""

    streamed = False

    def __init__(self, split_args: list[str]):
        self.splits_spec = [parse_split_arg(a) for a in split_args]
        names = [name for name, _, _ in self.splits_spec]
        if len(set(names)) != len(names):
            raise InputError(f"`split` names must be distinct, got {', '.join(names)}", params=("split",))

    def describe(self) -> dict:
        return {"kind": "coco", "splits": {n: {"annotations": a, "images": i} for n, a, i in self.splits_spec}}

    def load(self) -> dict[str, list[Entry]]:
        return {name: self._load_split(name, ann, images) for name, ann, images in self.splits_spec}

    @staticmethod
    def _load_split(name: str, ann_path: str, image_dir: str) -> list[Entry]:
        from pycocotools.coco import COCO

        what = f"split {name!r}: annotations file"
        data = _load_json(ann_path, what)
        if not isinstance(data, dict) or not isinstance(data.get("images"), list) \
                or not isinstance(data.get("annotations"), list):
            raise InputError(f"{what} {ann_path} is not COCO captions: it needs 'images' and 'annotations' lists")
        if not os.path.isdir(image_dir):
            raise InputError(f"split {name!r}: images folder {image_dir} does not exist")
        seen: set = set()
        for image in data["images"]:
            if not isinstance(image, dict) or "id" not in image or "file_name" not in image:
                raise InputError(f"{what} {ann_path}: every image needs 'id' and 'file_name', got {str(image)[:80]}")
            if image["id"] in seen:
                raise InputError(f"{what} {ann_path}: image id {image['id']} appears twice")
            seen.add(image["id"])
        for ann in data["annotations"]:
            if not isinstance(ann, dict) or "image_id" not in ann:
                raise InputError(f"{what} {ann_path}: every annotation needs an 'image_id', got {str(ann)[:80]}")
            if "caption" not in ann:
                raise InputError(f"{what} {ann_path}: annotation {ann.get('id')} has no 'caption' "
                                 "(is this an instances file rather than captions?)")
            if ann["image_id"] not in seen:
                raise InputError(f"{what} {ann_path}: annotation {ann.get('id')} refers to unknown image id "
                                 f"{ann['image_id']}")
        if not data["images"]:
            raise InputError(f"split {name!r} is empty: {ann_path} lists no images")
        if not data["annotations"]:
            raise InputError(f"split {name!r} is empty: {ann_path} has no captions")
        coco = COCO()
        coco.dataset = data
        with contextlib.redirect_stdout(io.StringIO()):  # pycocotools prints progress to stdout
            coco.createIndex()
        entries = []
        for image_id in sorted(coco.getImgIds()):
            image = coco.imgs[image_id]
            anns = sorted(coco.imgToAnns.get(image_id, []), key=lambda a: a.get("id", 0))
            entries.append(Entry(int(image_id), image["file_name"], [str(a["caption"]) for a in anns],
                                 path=os.path.join(image_dir, image["file_name"])))
        return entries


def _merge_restval(splits: dict[str, list], keep_restval: bool) -> dict[str, list]:
    if "restval" in splits and not keep_restval:
        splits.setdefault("train", []).extend(splits.pop("restval"))
    return splits


class KarpathySource:
    """Karpathy's ``dataset_coco.json`` (also ``dataset_flickr8k.json`` and friends)."""

    streamed = False

    def __init__(self, json_path: str, images_root: str, keep_restval: bool = False):
        self.json_path, self.images_root, self.keep_restval = json_path, images_root, keep_restval

    def describe(self) -> dict:
        return {"kind": "karpathy", "json": self.json_path, "images_root": self.images_root,
                "keep_restval": self.keep_restval}

    def load(self) -> dict[str, list[Entry]]:
        what = "Karpathy split file"
        data = _load_json(self.json_path, what)
        if not isinstance(data, dict) or not isinstance(data.get("images"), list):
            raise InputError(f"{what} {self.json_path} has no 'images' list")
        if not os.path.isdir(self.images_root):
            raise InputError(f"`images_root` {self.images_root} does not exist", params=("images_root",))
        splits: dict[str, list[Entry]] = {}
        seen: set = set()
        for i, image in enumerate(data["images"]):
            try:
                image_id = int(image.get("cocoid", image["imgid"]))
                rel = os.path.join(image.get("filepath", ""), image["filename"])
                split = check_split_name(str(image["split"]))
                captions = [s["raw"] if "raw" in s else " ".join(s["tokens"]) for s in image["sentences"]]
            except (KeyError, TypeError, ValueError, AttributeError) as e:
                raise InputError(f"{what} {self.json_path}: image #{i} is malformed "
                                 f"(needs imgid or cocoid, filename, split, sentences): {e!r}") from None
            if image_id in seen:
                raise InputError(f"{what} {self.json_path}: image id {image_id} appears twice")
            seen.add(image_id)
            splits.setdefault(split, []).append(Entry(image_id, rel, captions,
                                                      path=os.path.join(self.images_root, rel)))
        if not splits:
            raise InputError(f"{what} {self.json_path} lists no images")
        splits = _merge_restval(splits, self.keep_restval)
        return {name: sorted(entries, key=lambda e: e.image_id) for name, entries in splits.items()}


class TfdsSource:
    """A prepared TFDS captioning dataset (``coco_captions``): features ``image``, ``image/id``,
    ``image/filename`` and ``captions/text``. Reads TFDS's own files; never downloads."""

    streamed = True
    DEFAULT_SPLITS = ("train", "val", "test", "restval")

    def __init__(self, name: str, data_dir: str | None = None, keep_restval: bool = False):
        self.name, self.data_dir, self.keep_restval = name, data_dir, keep_restval
        self._parts: dict[str, list[str]] = {}  # our split -> TFDS splits, in order

    def describe(self) -> dict:
        return {"kind": "tfds", "name": self.name, "data_dir": self.data_dir, "keep_restval": self.keep_restval}

    def _builder(self):
        import tensorflow_datasets as tfds  # the only source that needs TensorFlow (the CLI imported it quietly)

        try:
            return tfds.builder(self.name, data_dir=self.data_dir)
        except Exception as e:  # tfds raises many types for unknown names and missing data
            raise InputError(f"TFDS dataset {self.name!r} is not available: {str(e).splitlines()[0]}") from None

    def _dataset(self, builder, tfds_split: str, with_image: bool):
        import tensorflow as tf
        import tensorflow_datasets as tfds

        ds = builder.as_dataset(split=tfds_split, shuffle_files=False,
                                decoders={"image": tfds.decode.SkipDecoding()})
        keys = ["image/id", "image/filename", "captions"] + (["image"] if with_image else [])
        return tfds.as_numpy(ds.map(tf.autograph.experimental.do_not_convert(lambda ex: {k: ex[k] for k in keys})))

    def load(self) -> dict[str, list[Entry]]:
        builder = self._builder()
        known = list(builder.info.splits.keys()) if builder.info.splits else []
        names = [s for s in self.DEFAULT_SPLITS if not known or s in known] + \
                [s for s in known if s not in self.DEFAULT_SPLITS]
        parts = {name: [name] for name in names}
        parts = _merge_restval(parts, self.keep_restval)
        self._parts = parts
        splits = {}
        for name, tfds_splits in parts.items():
            entries = []
            for tfds_split in tfds_splits:
                try:
                    examples = list(self._dataset(builder, tfds_split, with_image=False))
                except Exception as e:
                    raise InputError(f"cannot read TFDS {self.name} split {tfds_split!r}: "
                                     f"{str(e).splitlines()[0]}") from None
                for ex in examples:
                    entries.append(Entry(int(ex["image/id"]), ex["image/filename"].decode("utf-8"),
                                         [t.decode("utf-8") for t in ex["captions"]["text"]]))
            if entries:
                splits[check_split_name(name)] = entries
        if not splits:
            raise InputError(f"TFDS dataset {self.name!r} has no examples")
        return splits

    def stream(self, split: str) -> Iterator[tuple[int, bytes]]:
        """Yields ``(image_id, encoded image)`` in the order :meth:`load` listed them."""
        builder = self._builder()
        for tfds_split in self._parts[split]:
            for ex in self._dataset(builder, tfds_split, with_image=True):
                yield int(ex["image/id"]), bytes(ex["image"])
