"""``captioning features import``: region features people already have, into a features store.

Three layouts are read, one per import (the store: :mod:`captioning.data.features_store`):

- ``--tsv FILE``: bottom-up-attention's (``tools/generate_tsv.py``): one tab-separated line per image,
  ``image_id, image_w, image_h, num_boxes, boxes, features``, the last two base64 of float32
  (``[num_boxes, 4]`` as x1, y1, x2, y2; ``[num_boxes, D]``);
- ``--npz-dir DIR [--boxes-dir DIR]``: self-critical.pytorch's per-image files, ``DIR/<id>.npz`` with
  ``feat [n, D]`` (``cocobu_att``) and ``BOXES/<id>.npy`` ``[n, 4]`` (``cocobu_box``);
- ``--hdf5 FILE``: the meshed-memory Transformer's one file, datasets ``<id>_features [n, D]`` and
  ``<id>_boxes [n, 4]``.

Every image of the prepared dataset (all splits) is looked up; what the import leaves out is reported
one line per kind, with a count and a few examples, as ``prepare`` reports skipped images, and recorded
in the store's manifest: dataset images without features (*missing*), features of images the
dataset does not have (*extra*) and rows that cannot be read (*malformed*: bad base64, a wrong
number of values, no region, non-finite values, a feature size other than the first row's, a repeated
image). A TSV whose last line is cut short (a download that stopped) is an error naming the line.

The store is written into a temporary folder and renamed into place when complete
(:func:`captioning.fileio.atomic_folder`): an interrupted import leaves no store (with ``--overwrite``,
the old one stays) and its rerun starts again; a rerun of a finished import of the same source is a
no-op. Features are kept as float16 (2,048 floats of 36 regions: 144 KB an image).
"""

from __future__ import annotations

import base64
import binascii
import collections
import dataclasses
import math
import os
from typing import Iterable, Iterator

import numpy as np
from tqdm import tqdm

from captioning.data.features_store import FeaturesStore, Left, StoreSplit, check_name, shard_name, store_path
from captioning.data.prepared import PreparedDataset
from captioning.errors import InputError
from captioning.fileio import atomic_folder
from data_prep.records import RecordWriter, encode_regions

EXAMPLES = 5  # examples kept per kind of left-out row
TSV_FIELDS = ("image_id", "image_w", "image_h", "num_boxes", "boxes", "features")


@dataclasses.dataclass
class Row:
    """One image's regions as a source gives them (``boxes`` None when it gives none; sizes 0 when unknown)."""

    image_id: int
    features: np.ndarray
    boxes: np.ndarray | None = None
    width: int = 0
    height: int = 0


class Malformed(Exception):
    """A row that cannot be read: where it is (``line 7``, a file name) and why."""

    def __init__(self, where: str, reason: str):
        super().__init__(f"{where}: {reason}")


def _matrix(data: bytes, columns: int | None, rows: int, what: str) -> np.ndarray:
    values = np.frombuffer(data, dtype="<f4")
    if rows < 1 or values.size == 0 or values.size % rows or (columns and values.size != rows * columns):
        raise ValueError(f"{what}: {values.size} floats for {rows} regions")
    return values.reshape(rows, -1)


def tsv_rows(path: str) -> Iterator[Row | Malformed]:
    """bottom-up-attention's TSV, one :class:`Row` (or :class:`Malformed`) per line. A last line without
    its line end that does not parse is an InputError naming it (the file was cut short)."""
    try:
        f = open(path, encoding="ascii", errors="replace", newline="")
    except OSError as e:
        raise InputError(f"`tsv` {path}: cannot read it ({e.strerror or e})", params=("tsv",)) from None
    with f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                fields = line.rstrip("\r\n").split("\t")
                if len(fields) != len(TSV_FIELDS):
                    raise ValueError(f"{len(fields)} tab-separated fields, not {len(TSV_FIELDS)} "
                                     f"({', '.join(TSV_FIELDS)})")
                image_id, width, height, count = (int(v) for v in fields[:4])
                boxes = _matrix(base64.b64decode(fields[4], validate=True), 4, count, "boxes")
                features = _matrix(base64.b64decode(fields[5], validate=True), None, count, "features")
                yield Row(image_id, features, boxes, width, height)
            except (ValueError, binascii.Error) as e:
                if not line.endswith("\n"):
                    raise InputError(f"`tsv` {path} is cut short at line {number} ({e}): download or write it "
                                     "again", params=("tsv",)) from None
                yield Malformed(f"line {number}", str(e))


def _image_id(name: str, suffix: str) -> int | None:
    stem = name[:-len(suffix)] if name.endswith(suffix) else None
    return int(stem) if stem and stem.isdigit() else None


def npz_rows(npz_dir: str, boxes_dir: str | None = None) -> Iterator[Row | Malformed]:
    """self-critical.pytorch's ``<id>.npz`` files (key ``feat``), with ``<id>.npy`` boxes beside them in
    ``boxes_dir``, in file-name order."""
    try:
        names = sorted(os.listdir(npz_dir))
    except OSError as e:
        raise InputError(f"`npz_dir` {npz_dir}: cannot list it ({e.strerror or e})", params=("npz_dir",)) from None
    for name in names:
        image_id = _image_id(name, ".npz")
        if image_id is None:
            continue
        try:
            with np.load(os.path.join(npz_dir, name)) as data:
                features = np.asarray(data["feat"], np.float32)
            boxes = None
            if boxes_dir is not None:
                boxes = np.asarray(np.load(os.path.join(boxes_dir, f"{image_id}.npy")), np.float32)
            yield Row(image_id, features, boxes)
        except (OSError, ValueError, KeyError, EOFError) as e:
            yield Malformed(name, f"{type(e).__name__}: {e}")


def hdf5_rows(path: str) -> Iterator[Row | Malformed]:
    """The meshed-memory Transformer's HDF5: ``<id>_features`` (and ``<id>_boxes``) datasets."""
    import h5py

    try:
        f = h5py.File(path, "r")
    except OSError as e:
        raise InputError(f"`hdf5` {path}: cannot read it as HDF5 ({e})", params=("hdf5",)) from None
    with f:
        for key in sorted(f.keys()):
            image_id = _image_id(key, "_features")
            if image_id is None:
                continue
            try:
                features = np.asarray(f[key][()], np.float32)
                boxes = np.asarray(f[f"{image_id}_boxes"][()], np.float32) if f"{image_id}_boxes" in f else None
                yield Row(image_id, features, boxes)
            except (OSError, ValueError, KeyError) as e:
                yield Malformed(key, f"{type(e).__name__}: {e}")


def _check(row: Row, size: int | None) -> str | None:
    """Why ``row`` cannot be stored, or None."""
    if row.features.ndim != 2 or len(row.features) < 1:
        return f"features of shape {row.features.shape}, not [regions, size] with at least one region"
    if size is not None and row.features.shape[1] != size:
        return f"{row.features.shape[1]} features a region, where the first row had {size}"
    if row.boxes is not None and row.boxes.shape != (len(row.features), 4):
        return f"boxes of shape {row.boxes.shape} for {len(row.features)} regions"
    if not np.isfinite(row.features).all() or (row.boxes is not None and not np.isfinite(row.boxes).all()):
        return "values that are not finite"
    if np.abs(row.features).max() > np.finfo(np.float16).max:
        return "features too large for float16"
    return None


@dataclasses.dataclass
class _Tally:
    ids: list = dataclasses.field(default_factory=list)
    count: int = 0

    def add(self, example: str) -> None:
        self.count += 1
        if len(self.ids) < EXAMPLES:
            self.ids.append(example)

    def left(self) -> Left:
        return Left(self.count, tuple(self.ids))


def import_features(data_dir: str, tsv: str | None = None, npz_dir: str | None = None, boxes_dir: str | None = None,
                    hdf5: str | None = None, name: str = "regions", images_per_shard: int = 1000,
                    overwrite: bool = False, progress: bool = True) -> tuple[FeaturesStore, bool]:
    """Imports one source's region features into the store ``name`` of the prepared dataset ``data_dir``
    (module docstring). Returns the store and whether it was written (False: the same source was imported
    already)."""
    sources = {"tsv": tsv, "npz_dir": npz_dir, "hdf5": hdf5}
    given = [k for k, v in sources.items() if v]
    if len(given) != 1:
        raise InputError("give exactly one of `tsv`, `npz_dir` or `hdf5`" + (f" (got {', '.join(given)})" if given
                                                                          else ""), params=("tsv", "npz_dir", "hdf5"))
    if boxes_dir and not npz_dir:
        raise InputError("`boxes_dir` goes with `npz_dir`", params=("boxes_dir", "npz_dir"))
    if images_per_shard < 1:
        raise InputError(f"`images_per_shard` must be at least 1, got {images_per_shard}", params=("images_per_shard",))
    kind = given[0]
    source = {"kind": kind, "path": os.path.abspath(sources[kind])}
    if boxes_dir:
        source["boxes"] = os.path.abspath(boxes_dir)
    if not os.path.exists(sources[kind]):
        raise InputError(f"`{kind}` {sources[kind]} does not exist", params=(kind,))
    existing = finished_store(data_dir, name, source, overwrite)
    if existing is not None:
        return existing, False
    rows = {"tsv": lambda: tsv_rows(tsv), "npz_dir": lambda: npz_rows(npz_dir, boxes_dir),
            "hdf5": lambda: hdf5_rows(hdf5)}[kind]()
    return write_store(data_dir, rows, source=source, name=name, images_per_shard=images_per_shard,
                       progress=progress, what=f"`{kind}` {sources[kind]}", params=(kind,)), True


def finished_store(data_dir: str, name: str, source: dict, overwrite: bool) -> FeaturesStore | None:
    """The store ``name`` when it holds ``source``'s features for this dataset already (a rerun: nothing to
    do); None when there is none or ``overwrite`` replaces it; an InputError when another source's is there."""
    dataset = PreparedDataset.load(data_dir)
    path = store_path(data_dir, check_name(name))
    if not os.path.exists(FeaturesStore.manifest_path(path)) or overwrite:
        return None
    existing = FeaturesStore.load(data_dir, name)
    if existing.get("source") == source and existing.dataset == dataset.identity:
        return existing
    raise InputError(f"{path} holds a features store already (from {existing.get('source', {}).get('path')}); "
                     "pass `overwrite` to replace it, or give another `name`", params=("overwrite", "name"))


def write_store(data_dir: str, rows: Iterable[Row | Malformed], *, source: dict, name: str = "regions",
                images_per_shard: int = 1000, progress: bool = True, what: str = "the source",
                params: tuple[str, ...] = ()) -> FeaturesStore:
    """Writes the rows of one source (:class:`Row` or :class:`Malformed`, in any order) as the store ``name``
    of the prepared dataset ``data_dir``, into a temporary folder renamed into place when complete (module
    docstring). ``what`` and ``params`` name the source in errors."""
    if images_per_shard < 1:
        raise InputError(f"`images_per_shard` must be at least 1, got {images_per_shard}", params=("images_per_shard",))
    dataset = PreparedDataset.load(data_dir)
    path = store_path(data_dir, check_name(name))
    parent = os.path.dirname(path)
    made_parent = not os.path.isdir(parent)
    os.makedirs(parent, exist_ok=True)
    try:
        return _write(data_dir, dataset, path, rows, source, name, images_per_shard, progress, what, params)
    except BaseException:
        if made_parent:  # a store that failed leaves nothing behind, not even DATA/features/
            try:
                os.rmdir(parent)
            except OSError:
                pass
        raise


def _write(data_dir, dataset, path, rows, source, name, images_per_shard, progress, what, params) -> FeaturesStore:
    images = dataset.image_records()  # id -> split, size, captions
    ids = sorted(images)
    by_split = {split: [i for i in ids if images[i].split == split] for split in dataset.splits}
    counts = {split: max(1, math.ceil(len(members) / images_per_shard)) for split, members in by_split.items()}
    # each image's shard: (split, index of its run of the split's sorted ids)
    shard_of = {image_id: (split, k // images_per_shard) for split, members in by_split.items()
                for k, image_id in enumerate(members)}
    extra, malformed, seen = _Tally(), _Tally(), set()
    size, boxes_given = None, None
    with atomic_folder(path) as tmp:
        writers, records, held = {}, collections.Counter(), collections.Counter()
        try:
            bar = tqdm(total=len(ids), desc="features", unit="img", disable=None if progress else True,
                       mininterval=0.5)
            for row in rows:
                if isinstance(row, Malformed):
                    malformed.add(str(row.args[0]))
                    continue
                if row.image_id not in images:
                    extra.add(str(row.image_id))
                    continue
                reason = "features of this image came before" if row.image_id in seen else _check(row, size)
                if reason is None and boxes_given is not None and (row.boxes is not None) != boxes_given:
                    reason = "boxes where the first row had none, or none where it had them"
                if reason:
                    malformed.add(f"image {row.image_id}: {reason}")
                    continue
                size, boxes_given = row.features.shape[1], row.boxes is not None
                seen.add(row.image_id)
                split, index = shard_of[row.image_id]
                if (split, index) not in writers:
                    writers[split, index] = RecordWriter(os.path.join(tmp, shard_name(split, index, counts[split])))
                boxes = row.boxes if row.boxes is not None else np.zeros((len(row.features), 4), np.float32)
                record = images[row.image_id]  # a source that does not say the image's size: the stored one's
                width, height = (row.width, row.height) if row.width and row.height else (record.width, record.height)
                writers[split, index].write(encode_regions(image_id=row.image_id, features=row.features, boxes=boxes,
                                                           width=width, height=height, captions=record.captions))
                records[split, index] += 1
                held[split] += len(row.features)
                bar.update(1)
            bar.close()
        finally:
            for writer in writers.values():
                writer.close()
        if not seen:
            raise InputError(f"{what} has features of none of the {len(ids)} images of {data_dir}"
                             + (f" (e.g. {', '.join(extra.ids)} are not in it)" if extra.ids else ""), params=params)
        splits = {}
        for split, members in by_split.items():
            shards = [shard_name(split, k, counts[split]) for k in range(counts[split])]
            for shard in shards:  # a run without features is an empty shard: every shard exists; all on disk
                with open(os.path.join(tmp, shard), "ab") as f:  # before store.json says they are complete
                    os.fsync(f.fileno())
            splits[split] = StoreSplit(
                sum(1 for i in members if i in seen), held[split], tuple(shards),
                tuple(records[split, k] for k in range(counts[split])),
                tuple(os.path.getsize(os.path.join(tmp, shard)) for shard in shards),
                tuple(members[k * images_per_shard] for k in range(counts[split])) if members else (0,))
        missing = _Tally()
        for image_id in ids:
            if image_id not in seen:
                missing.add(str(image_id))
        FeaturesStore.create(tmp, name=name, feature_size=int(size), boxes=bool(boxes_given), splits=splits,
                             source=source, dataset=dataset.identity,
                             left={"missing": missing.left(), "extra": extra.left(),
                                   "malformed": malformed.left()}).write()
    return FeaturesStore.load(data_dir, name)


def report(store: FeaturesStore) -> list[str]:
    """What an import wrote and left out, one line each (the command prints them)."""
    lines = [f"features store {store.name} in {store.path}: {store.images} images, {store.regions} regions of "
             f"{store.feature_size} features" + ("" if store.has_boxes else " (no boxes)")]
    for kind, what in (("missing", "dataset images without features"), ("extra", "images not in the dataset"),
                       ("malformed", "rows that could not be read")):
        left = store.left[kind]
        if left.count:
            lines.append(f"{kind}: {left.count} {what} (e.g. {'; '.join(left.examples)})")
    return lines
