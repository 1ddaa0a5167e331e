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
    images = dataset.image_records()  # id -> split, size, captions
    ids = sorted(images)
    per_shard = state.plan["images_per_shard"]
    by_split = {split: [i for i in ids if images[i].split == split] for split in dataset.splits}
    counts = {split: max(1, math.ceil(len(members) / per_shard)) for split, members in by_split.items()}
    # each image's shard: the run of its split's sorted ids it falls in
    shard_of = {image_id: shard_name(split, k // per_shard, counts[split]) for split, members in by_split.items()
                for k, image_id in enumerate(members)}
    seen = set(state.seen)
    records, held = collections.Counter(state.shard_records), collections.Counter(state.held)
    writers: dict[str, RecordWriter] = {}

    def checkpoint():
        for writer in writers.values():
            writer.sync()
        state.shard_bytes = {shard: os.path.getsize(os.path.join(work, shard)) for shard in records}
        state.shard_records, state.held, state.seen = dict(records), dict(held), sorted(seen)
        state.write(os.path.join(work, PROGRESS))

    bar = tqdm(total=len(ids), initial=len(seen), desc="features", unit="img", disable=None if progress else True,
               mininterval=0.5)
    try:
        for row in rows_from(state.done):
            state.done += 1
            if isinstance(row, Malformed):
                state.malformed.add(str(row.args[0]))
            elif row.image_id not in images:
                state.extra.add(str(row.image_id))
            else:
                record = images[row.image_id]  # a source that does not say the image's size: the stored one's
                width, height = (row.width, row.height) if row.width and row.height else (record.width, record.height)
                reason = "features of this image came before" if row.image_id in seen else check_row(row, state.size)
                if reason is None and state.boxes is not None and (row.boxes is not None) != state.boxes:
                    reason = "boxes where the first row had none, or none where it had them"
                features, boxes, clean = row.features, row.boxes, None
                if reason is None and boxes is not None:  # the one rule: clipped to the image, degenerate dropped
                    clean = clean_boxes(boxes, width, height)
                    features, boxes = features[clean.kept], clean.boxes
                    if not len(boxes):
                        reason = f"none of its {len(clean.kept)} boxes has an area inside its {width}x{height} image"
                if reason:
                    state.malformed.add(f"image {row.image_id}: {reason}")
                else:
                    state.size, state.boxes = int(features.shape[1]), boxes is not None
                    seen.add(row.image_id)
                    dropped = row.dropped + (clean.dropped if clean else 0)
                    clipped = row.clipped + (clean.clipped if clean else 0)
                    if dropped:
                        state.boxes_dropped.add(f"image {row.image_id}: {dropped}", dropped)
                    if clipped:
                        state.boxes_clipped.add(f"image {row.image_id}: {clipped}", clipped)
                    shard = shard_of[row.image_id]
                    if shard not in writers:
                        writers[shard] = RecordWriter(os.path.join(work, shard), append=True)
                    boxes = boxes if boxes is not None else np.zeros((len(features), 4), np.float32)
                    writers[shard].write(encode_regions(image_id=row.image_id, features=features, boxes=boxes,
                                                        width=width, height=height, captions=record.captions))
                    records[shard] += 1
                    held[record.split] += len(features)
                    bar.update(1)
            if state.done % checkpoint_every == 0:
                checkpoint()
    except InputError as e:  # the source stopped making sense: what came before it stays, for a rerun
        if not seen:
            raise
        checkpoint()
        raise KeptWork(f"{e}; the {len(seen)} images before it are kept (in {work}) and the rerun goes on from "
                       "there", params=e.params) from None
    finally:
        bar.close()
        for writer in writers.values():
            writer.close()
    if not seen:
        raise InputError(f"{what} has features of none of the {len(ids)} images of {data_dir}"
                         + (f" (e.g. {', '.join(state.extra.ids)} are not in it)" if state.extra.ids else ""),
                         params=params)
    splits = {}
    for split, members in by_split.items():
        shards = [shard_name(split, k, counts[split]) for k in range(counts[split])]
        for shard in shards:  # a run without features is an empty shard: every shard exists; all on disk
            with open(os.path.join(work, shard), "ab") as f:  # before store.json says they are complete
                os.fsync(f.fileno())
        splits[split] = StoreSplit(
            sum(1 for i in members if i in seen), held[split], tuple(shards), tuple(records[s] for s in shards),
            tuple(os.path.getsize(os.path.join(work, shard)) for shard in shards),
            tuple(members[k * per_shard] for k in range(counts[split])) if members else (0,))
    missing = Tally()
    for image_id in ids:
        if image_id not in seen:
            missing.add(str(image_id))
    if len(seen) < MIN_SHARE * len(ids) and not allow_missing:
        unread = (f"; {state.malformed.count} rows could not be read (e.g. {'; '.join(state.malformed.ids[:2])})"
                  if state.malformed.count else "")
        raise InputError(f"{what} has features of only {len(seen)} of the {len(ids)} images of {data_dir} "
                         f"({len(seen) / len(ids):.1%}; a store needs at least {MIN_SHARE:.0%} of them): "
                         f"{missing.count} missing (e.g. {', '.join(missing.ids[:3])}){unread}; nothing was written: "
                         "complete the source, or pass `allow_missing=True` to write the store anyway",
                         params=tuple(params) + ("allow_missing",))
    with contextlib.suppress(FileNotFoundError):
        os.remove(os.path.join(work, PROGRESS))  # a store, no longer work
    FeaturesStore.create(work, name=name, feature_size=int(state.size), boxes=bool(state.boxes), splits=splits,
                         source=state.plan["source"], dataset=dataset.identity,
                         left={"missing": missing.left(), "extra": state.extra.left(),
                               "malformed": state.malformed.left(), "boxes_dropped": state.boxes_dropped.left(),
                               "boxes_clipped": state.boxes_clipped.left()}).write()


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
