"""The work folder of a features store being written (:mod:`data_prep.features_writer`):
``DATA/features/.partial-NAME/``, made with its marker, locked by the run that writes it, and what a rerun
goes on from (``progress.json``: the checkpoint). Its promises are the writer's (that module's docstring)."""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import logging
import os
import shutil

from captioning.data.features_store import FOLDER, Left, check_name
from captioning.errors import DiskFullError, InputError
from captioning.fileio import atomic_write_json

log = logging.getLogger("captioning.features")

EXAMPLES = 5  # examples kept per kind of left-out row
PROGRESS = "progress.json"
LOCK = "lock"
MARKER = "work.json"  # written when the work folder is made: {"features_work_folder_of": NAME}


def work_path(data_dir: str, name: str) -> str:
    """The work folder of the store ``name`` while it is written."""
    return os.path.join(data_dir, FOLDER, f".partial-{check_name(name)}")


@dataclasses.dataclass
class Tally:
    """A kind of left-out row: how many, and the first few examples."""

    count: int = 0
    ids: list = dataclasses.field(default_factory=list)

    def add(self, example: str, count: int = 1) -> None:
        self.count += count
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
    boxes_dropped: Tally = dataclasses.field(default_factory=Tally)
    boxes_clipped: Tally = dataclasses.field(default_factory=Tally)
    size: int | None = None
    boxes: bool | None = None

    @classmethod
    def read(cls, path: str) -> "Progress | None":
        try:
            with open(path, encoding="utf-8") as f:
                data = json.load(f)
            for kind in ("extra", "malformed", "boxes_dropped", "boxes_clipped"):
                data[kind] = Tally(**data[kind])
            return cls(**data)
        except (OSError, ValueError, TypeError, KeyError):
            return None  # none, or not this format: the work starts again

    def write(self, path: str) -> None:
        atomic_write_json(path, dataclasses.asdict(self))


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


def own_work_folder(work: str, name: str) -> None:
    """Makes the work folder of the store ``name`` with its marker (:data:`MARKER`, all at once: made aside,
    then renamed), or checks that the folder already there carries it: a folder without it (a store
    someone named ``.partial-NAME``, anything else) is not this command's to resume or remove, an InputError."""
    identity = {"features_work_folder_of": name}
    if not os.path.isdir(work):
        aside = f"{work}.new{os.getpid()}"
        try:
            os.makedirs(aside)
            atomic_write_json(os.path.join(aside, MARKER), identity)
            with contextlib.suppress(OSError):  # (another run made it meanwhile: it is checked below)
                os.rename(aside, work)
        finally:
            shutil.rmtree(aside, ignore_errors=True)
    try:
        with open(os.path.join(work, MARKER), encoding="utf-8") as f:
            mine = json.load(f) == identity
    except (OSError, ValueError):
        mine = False
    if not mine:
        raise InputError(f"{work} is in the way: it is not a work folder this command made for the store {name!r} "
                         f"(it has no {MARKER} naming it), so it is left as it is; move it away, then run the "
                         "command again")


@contextlib.contextmanager
def locked(work: str, name: str):
    """The work folder, made if missing (:func:`own_work_folder`) and locked for this run: an InputError if
    it is not this command's, if another run holds it, or has just renamed it into the finished store."""
    own_work_folder(work, name)
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


def resumable(error: BaseException) -> bool:
    """Whether a run stopped by ``error`` leaves work a rerun goes on from: interrupted (Ctrl-C, a signal),
    the disk full or another I/O error, out of memory, or a source cut short (:class:`KeptWork`). Other
    input errors and failures (a rerun would fail alike) leave none."""
    return isinstance(error, (KeptWork, DiskFullError, OSError, MemoryError)) or not isinstance(error, Exception)


def resumed(work: str, plan: dict) -> Progress:
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
        elif entry not in (LOCK, MARKER) and not (resumed and entry == PROGRESS):
            shutil.rmtree(file) if os.path.isdir(file) else os.remove(file)
    return state
