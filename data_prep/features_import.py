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
image, a dataset key that is an HDF5 group). Boxes follow the one rule of
:func:`captioning.data.features_store.clean_boxes` (clipped to the image, degenerate ones dropped with their
regions, both counted). A source with features of fewer than half the dataset's images is refused unless
``allow_missing``. A TSV whose last line has no line end was cut short (a download that stopped; the
layout's writer ends every line): an error naming the line, even when what is left of it still parses; a
file that is not text (gzip, HDF5, npz) is an error saying so.

The store is written by :func:`data_prep.features_writer.write_store`: in a work folder renamed into place
when complete (an interrupted import leaves no store; with ``--overwrite`` the old one stays until then),
resumed by running the same command again (a download completed, a killed run), and a rerun of a finished
import of the same source is a no-op. Features are kept as float16 (2,048 floats of 36 regions: 144 KB an
image).
"""

from __future__ import annotations

import base64
import binascii
import io
import os
from typing import Iterator

import numpy as np

from captioning.data.features_store import FeaturesStore
from captioning.errors import InputError
from data_prep.features_writer import Malformed, Row, check_sizes, finished_store, head_of, write_store

TSV_FIELDS = ("image_id", "image_w", "image_h", "num_boxes", "boxes", "features")
TEXT_BYTES = frozenset(range(32, 127)) | {9, 10, 13}  # all a TSV of base64 holds


def _matrix(data: bytes, columns: int | None, rows: int, what: str) -> np.ndarray:
    values = np.frombuffer(data, dtype="<f4")
    if rows < 1 or values.size == 0 or values.size % rows or (columns and values.size != rows * columns):
        raise ValueError(f"{what}: {values.size} floats for {rows} regions")
    return values.reshape(rows, -1)


def tsv_rows(path: str, skip: int = 0) -> Iterator[Row | Malformed]:
    """bottom-up-attention's TSV, one :class:`Row` (or :class:`Malformed`) per line that is not blank,
    after the first ``skip`` of them (not parsed). A last line without its line end is an InputError naming
    it: the file was cut short (what is left of the line may still parse, as a row of fewer features)."""
    try:
        raw = open(path, "rb")
    except OSError as e:
        raise InputError(f"`tsv` {path}: cannot read it ({e.strerror or e})", params=("tsv",)) from None
    with raw:
        _check_text(raw, path)
        f = io.TextIOWrapper(raw, encoding="ascii", errors="replace", newline="")
        rows = 0
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            rows += 1
            if rows <= skip:
                continue
            if not line.endswith("\n"):
                raise InputError(f"`tsv` {path} is cut short at line {number} (it has no line end, as every line "
                                 "of a complete file has): complete the file and run the same command again",
                                 params=("tsv",))
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
                yield Malformed(f"line {number}", str(e))


def _check_text(f, path: str) -> None:
    """An InputError when what ``f`` (binary, buffered: a pipe too) begins with is not text as a TSV of base64
    is (printable ASCII, tabs and line ends): a gzip file, an HDF5 or npz file given as ``--tsv``. Nothing
    is consumed."""
    head = f.peek(1 << 16)[:1 << 16]
    odd = next((k for k, byte in enumerate(head) if byte not in TEXT_BYTES), None)
    if odd is not None:
        kind = ("a gzip file (give `tsv` <(zcat FILE))" if head[:2] == b"\x1f\x8b" else
                "an HDF5 file (give it as `hdf5`)" if head[:8] == b"\x89HDF\r\n\x1a\n" else
                "a zip or npz file" if head[:2] == b"PK" else "not text")
        raise InputError(f"`tsv` {path} is not a TSV of text: byte {odd} is 0x{head[odd]:02x}; it looks like {kind}",
                         params=("tsv", "hdf5"))


def _image_id(name: str, suffix: str) -> int | None:
    stem = name[:-len(suffix)] if name.endswith(suffix) else None
    return int(stem) if stem and stem.isdigit() else None


def npz_rows(npz_dir: str, boxes_dir: str | None = None, skip: int = 0) -> Iterator[Row | Malformed]:
    """self-critical.pytorch's ``<id>.npz`` files (key ``feat``), with ``<id>.npy`` boxes beside them in
    ``boxes_dir``, in file-name order, after the first ``skip``."""
    try:
        names = sorted(os.listdir(npz_dir))
    except OSError as e:
        raise InputError(f"`npz_dir` {npz_dir}: cannot list it ({e.strerror or e})", params=("npz_dir",)) from None
    for name in [n for n in names if _image_id(n, ".npz") is not None][skip:]:
        image_id = _image_id(name, ".npz")
        try:
            with np.load(os.path.join(npz_dir, name)) as data:
                features = np.asarray(data["feat"], np.float32)
            boxes = None
            if boxes_dir is not None:
                boxes = np.asarray(np.load(os.path.join(boxes_dir, f"{image_id}.npy")), np.float32)
            yield Row(image_id, features, boxes)
        except (OSError, ValueError, KeyError, EOFError) as e:
            yield Malformed(name, f"{type(e).__name__}: {e}")


def hdf5_rows(path: str, skip: int = 0) -> Iterator[Row | Malformed]:
    """The meshed-memory Transformer's HDF5: ``<id>_features`` (and ``<id>_boxes``) datasets, in key order,
    after the first ``skip``."""
    import h5py

    try:
        f = h5py.File(path, "r")
    except OSError as e:
        raise InputError(f"`hdf5` {path}: cannot read it as HDF5 ({e})", params=("hdf5",)) from None
    with f:
        for key in [k for k in sorted(f.keys()) if _image_id(k, "_features") is not None][skip:]:
            image_id = _image_id(key, "_features")
            try:
                names = [key] + ([f"{image_id}_boxes"] if f"{image_id}_boxes" in f else [])
                for name in names:
                    if not isinstance(f[name], h5py.Dataset):
                        kind = "a group" if isinstance(f[name], h5py.Group) else type(f[name]).__name__
                        raise ValueError(f"{name} is {kind}, not a dataset (an array)")
                features = np.asarray(f[key][()], np.float32)
                boxes = np.asarray(f[names[1]][()], np.float32) if len(names) > 1 else None
                yield Row(image_id, features, boxes)
            except (OSError, ValueError, KeyError, TypeError) as e:
                yield Malformed(key, f"{type(e).__name__}: {e}")


def import_features(data_dir: str, tsv: str | None = None, npz_dir: str | None = None, boxes_dir: str | None = None,
                    hdf5: str | None = None, name: str = "regions", images_per_shard: int = 1000,
                    overwrite: bool = False, progress: bool = True,
                    checkpoint_every: int = 500, allow_missing: bool = False) -> tuple[FeaturesStore, bool]:
    """Imports one source's region features into the store ``name`` of the prepared dataset ``data_dir``
    (module docstring), a checkpoint every ``checkpoint_every`` rows. Returns the store and whether it was
    written (False: the same source was imported already). A source with features of fewer than half the
    dataset's images is refused unless ``allow_missing``."""
    sources = {"tsv": tsv, "npz_dir": npz_dir, "hdf5": hdf5}
    given = [k for k, v in sources.items() if v]
    if len(given) != 1:
        raise InputError("give exactly one of `tsv`, `npz_dir` or `hdf5`" + (f" (got {', '.join(given)})" if given
                                                                          else ""), params=("tsv", "npz_dir", "hdf5"))
    if boxes_dir and not npz_dir:
        raise InputError("`boxes_dir` goes with `npz_dir`", params=("boxes_dir", "npz_dir"))
    check_sizes(images_per_shard, checkpoint_every)
    kind = given[0]
    source = {"kind": kind, "path": os.path.abspath(sources[kind])}
    if boxes_dir:
        source["boxes"] = os.path.abspath(boxes_dir)
    if not os.path.exists(sources[kind]):
        raise InputError(f"`{kind}` {sources[kind]} does not exist", params=(kind,))
    existing = finished_store(data_dir, name, source, overwrite)
    if existing is not None:
        return existing, False
    rows_from = {"tsv": lambda skip: tsv_rows(tsv, skip), "npz_dir": lambda skip: npz_rows(npz_dir, boxes_dir, skip),
                 "hdf5": lambda skip: hdf5_rows(hdf5, skip)}[kind]
    return write_store(data_dir, rows_from, source=source, head=head_of([sources[kind]]), name=name,
                       images_per_shard=images_per_shard, progress=progress, what=f"`{kind}` {sources[kind]}",
                       params=(kind,), checkpoint_every=checkpoint_every, allow_missing=allow_missing), True
