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
* **One writer at a time.** The work folder is locked (``fcntl``) while a run writes; a second run on the
  same store stops at once with one line.
* **What is left out is counted.** Dataset images without features (*missing*), features of images the
  dataset does not have (*extra*) and rows that cannot be read (*malformed*), each a count and a few
  examples, in ``store.json`` and in the lines :func:`report` prints.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import hashlib
import json
import logging
import math
import os
import shutil
from typing import Callable, Iterable

import numpy as np
from tqdm import tqdm

from captioning.data.features_store import FOLDER, FeaturesStore, Left, StoreSplit, check_name, shard_name, store_path
from captioning.data.prepared import PreparedDataset
from captioning.errors import InputError
from captioning.fileio import atomic_write_json, replace_folder
from data_prep.records import RecordWriter, encode_regions

log = logging.getLogger("captioning.features")

EXAMPLES = 5  # examples kept per kind of left-out row
PROGRESS = "progress.json"
LOCK = "lock"


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


def work_path(data_dir: str, name: str) -> str:
    """The work folder of the store ``name`` while it is written (module docstring)."""
    return os.path.join(data_dir, FOLDER, f".partial-{check_name(name)}")


def check_row(row: Row, size: int | None) -> str | None:
    """Why ``row`` cannot be stored (``size``: the feature size of the rows before it), or None."""
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
class Tally:
    """A kind of left-out row: how many, and the first few examples."""

    count: int = 0
    ids: list = dataclasses.field(default_factory=list)

    def add(self, example: str) -> None:
        self.count += 1
        if len(self.ids) < EXAMPLES:
            self.ids.append(example)

    def left(self) -> Left:
        return Left(self.count, tuple(self.ids))


@dataclasses.dataclass
class Progress:
    """What ``progress.json`` holds at a checkpoint: rows of the source done, each shard's records and
    bytes, the regions held per split, the images stored, the tallies and what the first row set."""

    plan: dict
    done: int = 0
    shard_bytes: dict = dataclasses.field(default_factory=dict)
    shard_records: dict = dataclasses.field(default_factory=dict)
    held: dict = dataclasses.field(default_factory=dict)
    seen: list = dataclasses.field(default_factory=list)
    extra: Tally = dataclasses.field(default_factory=Tally)
    malformed: Tally = dataclasses.field(default_factory=Tally)
    size: int | None = None
    boxes: bool | None = None

    @classmethod
    def read(cls, path: str) -> "Progress | None":
        try:
            with open(path, encoding="utf-8") as f:
                data = json.load(f)
            data["extra"], data["malformed"] = Tally(**data["extra"]), Tally(**data["malformed"])
            return cls(**data)
        except (OSError, ValueError, TypeError, KeyError):
            return None  # none, or not this format: the work starts again

    def write(self, path: str) -> None:
        atomic_write_json(path, dataclasses.asdict(self))


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


class KeptWork(InputError):
    """The source stopped making sense part of the way (a TSV cut short); what came before is checkpointed
    in the work folder for a rerun."""


def head_of(paths) -> str:
    """A fingerprint of what the files (or folders: their sorted names) at ``paths`` begin with: the first
    64 KB of each, so a source replaced by another is not resumed, and one that grew (a download
    continued) is. A pipe is not read (a rerun gets a new stream from the start, and skips what was done)."""
    digest = hashlib.sha256()
    for path in paths:
        if os.path.isdir(path):
            digest.update("\n".join(sorted(os.listdir(path))[:1000]).encode("utf-8", "replace"))
        elif os.path.isfile(path):
            with open(path, "rb") as f:
                digest.update(f.read(1 << 16))
        else:  # a pipe (``--tsv <(zcat x.tsv.gz)``): reading it would take what the import reads
            digest.update(b"a stream")
    return digest.hexdigest()[:16]


@contextlib.contextmanager
def _locked(work: str):
    """The work folder, made if missing and locked for this run: an InputError if another run holds it, or
    has just renamed it into the finished store."""
    os.makedirs(work, exist_ok=True)
    lock = os.path.join(work, LOCK)
    try:
        fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
    except FileNotFoundError:  # renamed into the store between the two lines
        raise InputError(f"another run has just finished writing {work}: run the command again") from None
    try:
        try:
            import fcntl

            fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except ImportError:  # no fcntl (Windows): no lock
            pass
        except OSError:
            raise InputError(f"another run is writing this features store ({work} is locked): wait for it to "
                             "finish, then run the command again") from None
        try:
            moved = os.stat(lock).st_ino != os.fstat(fd).st_ino
        except FileNotFoundError:
            moved = True
        if moved:
            raise InputError(f"another run has just finished writing {work}: run the command again")
        yield work
    finally:
        os.close(fd)


def write_store(data_dir: str, rows_from: Callable[[int], Iterable[Row | Malformed]], *, source: dict,
                head: str = "", name: str = "regions", images_per_shard: int = 1000, progress: bool = True,
                what: str = "the source", params: tuple[str, ...] = (), checkpoint_every: int = 500) -> FeaturesStore:
    """Writes the rows of one source as the store ``name`` of the prepared dataset ``data_dir`` (module
    docstring): ``rows_from(skip)`` gives the source's rows (:class:`Row` or :class:`Malformed`, in a fixed
    order) after its first ``skip``; ``head`` fingerprints the source's content (:func:`head_of`). ``what``
    and ``params`` name the source in errors."""
    if images_per_shard < 1:
        raise InputError(f"`images_per_shard` must be at least 1, got {images_per_shard}", params=("images_per_shard",))
    if checkpoint_every < 1:
        raise ValueError("checkpoint_every must be at least 1")
    dataset = PreparedDataset.load(data_dir)
    path, work = store_path(data_dir, check_name(name)), work_path(data_dir, name)
    parent = os.path.dirname(path)
    made_parent = not os.path.isdir(parent)
    plan = {"source": source, "head": head, "dataset": dataset.identity, "images_per_shard": images_per_shard}
    with _locked(work):  # (another run's lock: an error, and nothing of its work touched)
        try:
            _write(data_dir, dataset, work, rows_from, _resumed(work, plan), name, progress, what, params,
                   checkpoint_every)
            os.remove(os.path.join(work, LOCK))  # (still held: a run waiting for it finds it moved)
            replace_folder(work, path)
        except BaseException as e:  # interrupted, the disk full, a source cut short: the work stays for a rerun
            if isinstance(e, InputError) and not isinstance(e, KeptWork):  # other input errors: nothing to keep
                shutil.rmtree(work, ignore_errors=True)
                if made_parent:  # a store that failed leaves nothing behind, not even DATA/features/
                    with contextlib.suppress(OSError):
                        os.rmdir(parent)
            raise
    return FeaturesStore.load(data_dir, name)


def _resumed(work: str, plan: dict) -> Progress:
    """The progress of an earlier run of the same plan, its shards cut back to its last checkpoint; or a
    new start, with anything else in the work folder removed."""
    state = Progress.read(os.path.join(work, PROGRESS))
    resumed = state is not None and state.plan == plan
    if resumed:
        log.info("going on from row %d of an interrupted run (%d images stored)", state.done, len(state.seen))
    else:
        if state is not None:
            log.info("an interrupted run of another source, dataset or shard size left %s: starting again", work)
        state = Progress(plan)
    for entry in os.listdir(work):
        file = os.path.join(work, entry)
        if entry in state.shard_bytes:
            with open(file, "r+b") as f:
                f.truncate(state.shard_bytes[entry])
        elif entry != LOCK and not (resumed and entry == PROGRESS):
            shutil.rmtree(file) if os.path.isdir(file) else os.remove(file)
    return state


def _write(data_dir, dataset, work, rows_from, state: Progress, name, progress, what, params,
           checkpoint_every) -> None:
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
                reason = "features of this image came before" if row.image_id in seen else check_row(row, state.size)
                if reason is None and state.boxes is not None and (row.boxes is not None) != state.boxes:
                    reason = "boxes where the first row had none, or none where it had them"
                if reason:
                    state.malformed.add(f"image {row.image_id}: {reason}")
                else:
                    state.size, state.boxes = int(row.features.shape[1]), row.boxes is not None
                    seen.add(row.image_id)
                    shard = shard_of[row.image_id]
                    if shard not in writers:
                        writers[shard] = RecordWriter(os.path.join(work, shard), append=True)
                    boxes = row.boxes if row.boxes is not None else np.zeros((len(row.features), 4), np.float32)
                    record = images[row.image_id]  # a source that does not say the image's size: the stored one's
                    width, height = (row.width, row.height) if row.width and row.height else \
                        (record.width, record.height)
                    writers[shard].write(encode_regions(image_id=row.image_id, features=row.features, boxes=boxes,
                                                        width=width, height=height, captions=record.captions))
                    records[shard] += 1
                    held[images[row.image_id].split] += len(row.features)
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
    with contextlib.suppress(FileNotFoundError):
        os.remove(os.path.join(work, PROGRESS))  # a store, no longer work
    FeaturesStore.create(work, name=name, feature_size=int(state.size), boxes=bool(state.boxes), splits=splits,
                         source=state.plan["source"], dataset=dataset.identity,
                         left={"missing": missing.left(), "extra": state.extra.left(),
                               "malformed": state.malformed.left()}).write()


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
