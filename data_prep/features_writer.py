"""Writing a features store, for ``captioning features import`` and ``features extract``: one source's rows
(:class:`Row`, or :class:`Malformed` for a row that cannot be read) into the store ``NAME`` of a prepared
dataset (the format: :mod:`captioning.data.features_store`).

What the writing promises:

* **All or nothing.** The shards are written in a work folder beside the store,
  ``DATA/features/.partial-NAME/``, and it is renamed to ``DATA/features/NAME`` only when complete, with
  ``store.json`` written last (a store replaced with ``overwrite`` stays whole until then).
* **Resumable.** Every ``checkpoint_every`` rows the shards are flushed to disk and ``progress.json``
  records how many of the source's rows are done, each shard's length and what was counted. A run that
  is killed, interrupted or stopped by an error in the source (a TSV cut short: what came before the cut
  is checkpointed) is continued by running the same command again: the shards are cut back to the last
  checkpoint and the source is read on from the row after it (``rows_from(skip)``; a TSV skips those
  lines without parsing them). Only the same plan is continued — the same source (``source``, and
  ``head``, a fingerprint of the source's first bytes), the same dataset, the same shard size; the work of
  another plan is removed and the import starts again. A resumed run writes what an uninterrupted one
  writes (tested).
* **Only its own work folder.** The work folder is made with a marker file (``work.json``, naming the
  store: :mod:`data_prep.features_work`) and nothing in a folder without it is resumed or removed: a folder ``.partial-NAME`` that this
  command did not make is refused in one line and left as it is (store names may not start with ``.``).
  A failure a rerun could not go on from (an input error, a failure that would repeat) leaves no work
  folder; an interrupt, a full disk or a source cut short leaves it for the rerun.
* **One writer at a time.** The work folder is locked (``fcntl``) while a run writes; a second run on the
  same store stops at once with one line.
* **What is left out is counted.** Dataset images without features (*missing*), features of images the
  dataset does not have (*extra*) and rows that cannot be read (*malformed*), each a count and a few
  examples, in ``store.json`` and in the lines :func:`report` prints; so are the boxes
  :func:`~captioning.data.features_store.clean_boxes` clipped to the image or dropped (one rule for every
  source). A source with features of fewer than half the dataset's images (:data:`MIN_SHARE`) is refused,
  and nothing written, unless ``allow_missing``.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import math
import os
import shutil
from typing import Callable, Iterable

import numpy as np
from tqdm import tqdm

from captioning.data.features_store import FeaturesStore, StoreSplit, check_name, clean_boxes, shard_name, store_path
from captioning.data.prepared import PreparedDataset
from captioning.errors import InputError
from captioning.fileio import replace_folder
from data_prep.features_work import (LOCK, MARKER, PROGRESS, KeptWork, Progress, Tally, head_of, locked, resumable,
                                     resumed, work_path)
from data_prep.records import RecordWriter, encode_regions

__all__ = ["Malformed", "Row", "check_sizes", "finished_store", "head_of", "report", "work_path", "write_store"]

MIN_SHARE = 0.5  # a store holds features of at least this share of the dataset's images, unless allow_missing
MAX_IMAGES_PER_SHARD = 100_000
MAX_CHECKPOINT_EVERY = 1_000_000


@dataclasses.dataclass
class Row:
    """One image's regions as a source gives them (``boxes`` None when it gives none; sizes 0 when unknown).
    ``clipped`` and ``dropped``: boxes the source has already clipped or dropped by
    :func:`~captioning.data.features_store.clean_boxes` (extraction must, before it pools them), for the report."""

    image_id: int
    features: np.ndarray
    boxes: np.ndarray | None = None
    width: int = 0
    height: int = 0
    clipped: int = 0
    dropped: int = 0


class Malformed(Exception):
    """A row that cannot be read: where it is (``line 7``, a file name) and why."""

    def __init__(self, where: str, reason: str):
        super().__init__(f"{where}: {reason}")


def check_row(row: Row, size: int | None) -> str | None:
    """Why ``row`` cannot be stored (``size``: the feature size of the rows before it), or None."""
    if row.features.ndim != 2 or len(row.features) < 1:
        return f"features of shape {row.features.shape}, not [regions, size] with at least one region"
    if size is not None and row.features.shape[1] != size:
        return f"{row.features.shape[1]} features a region, where the first row had {size}"
    if row.boxes is not None and row.boxes.shape != (len(row.features), 4):
        return f"boxes of shape {row.boxes.shape} for {len(row.features)} regions"
    if not np.isfinite(row.features).all():
        return "features that are not finite"  # (boxes that are not finite: dropped by clean_boxes, counted)
    if np.abs(row.features).max() > np.finfo(np.float16).max:
        return "features too large for float16"
    return None


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
    raise InputError(f"{path} holds a features store already ({describe_source(existing.get('source'))}); "
                     "pass `overwrite` to replace it, or give another `name`", params=("overwrite", "name"))


def describe_source(source) -> str:
    """Where a store's features came from, in words, for a message: a file or folder, a model or encoder
    that extracted them, or that its store.json does not say.

    >>> describe_source({"kind": "tsv", "path": "/d/a.tsv"}), describe_source({"kind": "extract", "model": "/m"})
    ('from /d/a.tsv', 'extracted with the model in /m')
    >>> describe_source({"kind": "extract", "encoder": {"encoder": "resnet50"}}), describe_source(None)
    ('extracted with the encoder resnet50', 'from a source its store.json does not name')
    """
    source = source if isinstance(source, dict) else {}
    if source.get("path"):
        return f"from {source['path']}" + (f" with the boxes of {source['boxes']}" if source.get("boxes") else "")
    if source.get("model"):
        return f"extracted with the model in {source['model']}"
    if isinstance(source.get("encoder"), dict) and source["encoder"].get("encoder"):
        return f"extracted with the encoder {source['encoder']['encoder']}"
    return "from a source its store.json does not name"


def write_store(data_dir: str, rows_from: Callable[[int], Iterable[Row | Malformed]], *, source: dict,
                head: str = "", name: str = "regions", images_per_shard: int = 1000, progress: bool = True,
                what: str = "the source", params: tuple[str, ...] = (), checkpoint_every: int = 500,
                allow_missing: bool = False) -> FeaturesStore:
    """Writes the rows of one source as the store ``name`` of the prepared dataset ``data_dir`` (module
    docstring): ``rows_from(skip)`` gives the source's rows (:class:`Row` or :class:`Malformed`, in a fixed
    order) after its first ``skip``; ``head`` fingerprints the source's content (:func:`head_of`). ``what``
    and ``params`` name the source in errors. A source with features of fewer than :data:`MIN_SHARE` of the
    dataset's images is refused (nothing written) unless ``allow_missing``."""
    check_sizes(images_per_shard, checkpoint_every)
    dataset = PreparedDataset.load(data_dir)
    path, work = store_path(data_dir, check_name(name)), work_path(data_dir, name)
    parent = os.path.dirname(path)
    made_parent = not os.path.isdir(parent)
    plan = {"source": source, "head": head, "dataset": dataset.identity, "images_per_shard": images_per_shard}
    with locked(work, name):  # (not ours, or another run's lock: an error, and nothing of it touched)
        try:
            _write(data_dir, dataset, work, rows_from, resumed(work, plan), name, progress, what, params,
                   checkpoint_every, allow_missing)
            os.remove(os.path.join(work, MARKER))
            os.remove(os.path.join(work, LOCK))  # (still held: a run waiting for it finds it moved)
            replace_folder(work, path)
        except BaseException as e:
            if not resumable(e):  # a rerun would fail alike: no work folder is left behind
                shutil.rmtree(work, ignore_errors=True)
                if made_parent:  # a store that failed leaves nothing behind, not even DATA/features/
                    with contextlib.suppress(OSError):
                        os.rmdir(parent)
            raise
    return FeaturesStore.load(data_dir, name)


def check_sizes(images_per_shard: int, checkpoint_every: int) -> None:
    """The sizes a writer takes, each between 1 and its documented bound; an InputError naming it."""
    for value, most, param in ((images_per_shard, MAX_IMAGES_PER_SHARD, "images_per_shard"),
                               (checkpoint_every, MAX_CHECKPOINT_EVERY, "checkpoint_every")):
        if not 1 <= value <= most:
            raise InputError(f"`{param}` must be an integer in [1, {most:,}], got {value}", params=(param,))


def _write(data_dir, dataset, work, rows_from, state: Progress, name, progress, what, params,
           checkpoint_every, allow_missing=False) -> None:
    """The store written in ``work`` from the source's rows after the ``state.done`` already written, ``store.json``
    last; an InputError, and nothing finished, when no row (or, unless ``allow_missing``, too few) fits the dataset."""
    layout = _Layout.of(dataset, state.plan["images_per_shard"])
    shards = _Shards(work, state)
    _write_rows(rows_from, state, layout, shards, progress, checkpoint_every)
    seen = shards.seen
    if not seen:
        raise InputError(f"{what} has features of none of the {len(layout.ids)} images of {data_dir}"
                         + (f" (e.g. {', '.join(state.extra.ids)} are not in it)" if state.extra.ids else ""),
                         params=params)
    splits = _store_splits(work, layout, shards)
    missing = Tally()
    for image_id in layout.ids:
        if image_id not in seen:
            missing.add(str(image_id))
    if len(seen) < MIN_SHARE * len(layout.ids) and not allow_missing:
        _refuse_too_few(state, missing, len(seen), len(layout.ids), data_dir, what, params)
    with contextlib.suppress(FileNotFoundError):
        os.remove(os.path.join(work, PROGRESS))  # a store, no longer work
    FeaturesStore.create(work, name=name, feature_size=int(state.size), boxes=bool(state.boxes), splits=splits,
                         source=state.plan["source"], dataset=dataset.identity,
                         left={"missing": missing.left(), "extra": state.extra.left(),
                               "malformed": state.malformed.left(), "boxes_dropped": state.boxes_dropped.left(),
                               "boxes_clipped": state.boxes_clipped.left()}).write()


@dataclasses.dataclass
class _Layout:
    """Where each of the dataset's images goes: ``images`` (id -> split, size, captions), their sorted ``ids``,
    each split's sorted ids (``by_split``) cut into ``shard_counts[split]`` runs of ``per_shard``, and the shard
    of each image (``shard_of``)."""

    images: dict
    ids: list
    per_shard: int
    by_split: dict
    shard_counts: dict
    shard_of: dict

    @classmethod
    def of(cls, dataset: PreparedDataset, per_shard: int) -> "_Layout":
        images = dataset.image_records()
        ids = sorted(images)
        by_split = {split: [i for i in ids if images[i].split == split] for split in dataset.splits}
        shard_counts = {split: max(1, math.ceil(len(members) / per_shard)) for split, members in by_split.items()}
        # each image's shard: the run of its split's sorted ids it falls in
        shard_of = {image_id: shard_name(split, position // per_shard, shard_counts[split])
                    for split, members in by_split.items() for position, image_id in enumerate(members)}
        return cls(images, ids, per_shard, by_split, shard_counts, shard_of)

    def shards(self, split: str) -> list[str]:
        return [shard_name(split, index, self.shard_counts[split]) for index in range(self.shard_counts[split])]


class _Shards:
    """The shards being written in ``work``, resumed from ``state``: their open writers, the records of each
    shard, the regions held by each split and the images ``seen``; :meth:`checkpoint` records them in ``state``
    and ``progress.json``."""

    def __init__(self, work: str, state: Progress):
        self.work, self.state = work, state
        self.seen = set(state.seen)
        self.records, self.held = collections.Counter(state.shard_records), collections.Counter(state.held)
        self.writers: dict[str, RecordWriter] = {}

    def write(self, shard: str, split: str, example: bytes, regions: int) -> None:
        if shard not in self.writers:
            self.writers[shard] = RecordWriter(os.path.join(self.work, shard), append=True)
        self.writers[shard].write(example)
        self.records[shard] += 1
        self.held[split] += regions

    def checkpoint(self) -> None:
        for writer in self.writers.values():
            writer.sync()
        state = self.state
        state.shard_bytes = {shard: os.path.getsize(os.path.join(self.work, shard)) for shard in self.records}
        state.shard_records, state.held, state.seen = dict(self.records), dict(self.held), sorted(self.seen)
        state.write(os.path.join(self.work, PROGRESS))

    def close(self) -> None:
        for writer in self.writers.values():
            writer.close()


def _write_rows(rows_from, state: Progress, layout: _Layout, shards: _Shards, progress: bool,
                checkpoint_every: int) -> None:
    """Every row of the source after ``state.done`` counted (malformed, extra) or written, with a checkpoint every
    ``checkpoint_every`` rows; a source that stops making sense after some images were written keeps them
    (:class:`KeptWork`) for a rerun."""
    bar = tqdm(total=len(layout.ids), initial=len(shards.seen), desc="features", unit="img",
               disable=None if progress else True, mininterval=0.5)
    try:
        for row in rows_from(state.done):
            state.done += 1
            if isinstance(row, Malformed):
                state.malformed.add(str(row.args[0]))
            elif row.image_id not in layout.images:
                state.extra.add(str(row.image_id))
            elif _write_row(row, layout, state, shards):
                bar.update(1)
            if state.done % checkpoint_every == 0:
                shards.checkpoint()
    except InputError as e:  # the source stopped making sense: what came before it stays, for a rerun
        if not shards.seen:
            raise
        shards.checkpoint()
        raise KeptWork(f"{e}; the {len(shards.seen)} images before it are kept (in {shards.work}) and the rerun "
                       "goes on from there", params=e.params) from None
    finally:
        bar.close()
        shards.close()


@dataclasses.dataclass
class _Regions:
    """A row's regions as stored: its features and boxes (None when the source gives none), after
    :func:`~captioning.data.features_store.clean_boxes`; its image's size; the boxes dropped and clipped in all."""

    features: np.ndarray
    boxes: np.ndarray | None
    width: int
    height: int
    dropped: int
    clipped: int


def _write_row(row: Row, layout: _Layout, state: Progress, shards: _Shards) -> bool:
    """One row of a dataset image written to its shard (True), or counted as malformed (False)."""
    record = layout.images[row.image_id]
    regions = _stored_regions(row, record, state, shards.seen)
    if isinstance(regions, str):
        state.malformed.add(f"image {row.image_id}: {regions}")
        return False
    state.size, state.boxes = int(regions.features.shape[1]), regions.boxes is not None
    shards.seen.add(row.image_id)
    if regions.dropped:
        state.boxes_dropped.add(f"image {row.image_id}: {regions.dropped}", regions.dropped)
    if regions.clipped:
        state.boxes_clipped.add(f"image {row.image_id}: {regions.clipped}", regions.clipped)
    boxes = regions.boxes if regions.boxes is not None else np.zeros((len(regions.features), 4), np.float32)
    example = encode_regions(image_id=row.image_id, features=regions.features, boxes=boxes, width=regions.width,
                             height=regions.height, captions=record.captions)
    shards.write(layout.shard_of[row.image_id], record.split, example, len(regions.features))
    return True


def _stored_regions(row: Row, record, state: Progress, seen: set) -> _Regions | str:
    """What of ``row`` is stored (``record``: its dataset image), or why it cannot be: a repeated image, a row
    :func:`check_row` refuses, boxes where the first row had none (or none where it had them), or no box left."""
    # a source that does not say the image's size: the stored one's
    width, height = (row.width, row.height) if row.width and row.height else (record.width, record.height)
    reason = "features of this image came before" if row.image_id in seen else check_row(row, state.size)
    if reason is None and state.boxes is not None and (row.boxes is not None) != state.boxes:
        reason = "boxes where the first row had none, or none where it had them"
    if reason:
        return reason
    features, boxes, clean = row.features, row.boxes, None
    if boxes is not None:  # the one rule: clipped to the image, degenerate dropped
        clean = clean_boxes(boxes, width, height)
        features, boxes = features[clean.kept], clean.boxes
        if not len(boxes):
            return f"none of its {len(clean.kept)} boxes has an area inside its {width}x{height} image"
    return _Regions(features, boxes, width, height, row.dropped + (clean.dropped if clean else 0),
                    row.clipped + (clean.clipped if clean else 0))


def _store_splits(work: str, layout: _Layout, shards: _Shards) -> dict[str, StoreSplit]:
    """Each split's :class:`StoreSplit`, every one of its shards on disk (a shard no row went to is empty) before
    ``store.json`` says they are complete."""
    splits = {}
    for split, members in layout.by_split.items():
        names = layout.shards(split)
        for shard in names:
            with open(os.path.join(work, shard), "ab") as f:
                os.fsync(f.fileno())
        splits[split] = StoreSplit(
            sum(1 for i in members if i in shards.seen), shards.held[split], tuple(names),
            tuple(shards.records[s] for s in names), tuple(os.path.getsize(os.path.join(work, s)) for s in names),
            tuple(members[index * layout.per_shard] for index in range(len(names))) if members else (0,))
    return splits


def _refuse_too_few(state: Progress, missing: Tally, found: int, images: int, data_dir, what, params) -> None:
    """The InputError of a source with features of fewer than :data:`MIN_SHARE` of the dataset's ``images``."""
    unread = (f"; {state.malformed.count} rows could not be read (e.g. {'; '.join(state.malformed.ids[:2])})"
              if state.malformed.count else "")
    raise InputError(f"{what} has features of only {found} of the {images} images of {data_dir} "
                     f"({found / images:.1%}; a store needs at least {MIN_SHARE:.0%} of them): "
                     f"{missing.count} missing (e.g. {', '.join(missing.ids[:3])}){unread}; nothing was written: "
                     "complete the source, or pass `allow_missing=True` to write the store anyway",
                     params=tuple(params) + ("allow_missing",))


def report(store: FeaturesStore) -> list[str]:
    """What an import wrote and left out, one line each (the command prints them)."""
    lines = [f"features store {store.name} in {store.path}: {store.images} images, {store.regions} regions of "
             f"{store.feature_size} features" + ("" if store.has_boxes else " (no boxes)")]
    for kind, said in (("missing", "missing: {} dataset images without features (e.g. {})"),
                       ("extra", "extra: {} images not in the dataset (e.g. {})"),
                       ("malformed", "malformed: {} rows that could not be read (e.g. {})"),
                       ("boxes_dropped", "boxes: {} dropped (a coordinate not finite, or no area inside the image; "
                                         "e.g. {})"),
                       ("boxes_clipped", "boxes: {} clipped to the image (e.g. {})")):
        left = store.left[kind]
        if left.count:
            lines.append(said.format(left.count, "; ".join(left.examples)))
    return lines
