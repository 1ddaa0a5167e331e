"""The output folder of ``prepare``: is it complete, interrupted, or someone else's run; the lock; what
a killed run left behind.

::

    OUTPUT/
      train-00000-of-00004.tfrecord …   finished shards (renamed into place when complete)
      NAME.tmp                          a shard being written (a killed run's is removed by the next run)
      vocab.txt                         written before the shards
      manifest.json                     written last (captioning.data.prepared): the folder is complete
      .partial/                         while a run is under way:
        lock                              two POSIX record locks 
        plan.json                         the run's fingerprint (what --resume compares)
        NAME.json                         each finished shard's statistics

:func:`prepare_output_dir` applies ``overwrite`` / ``resume`` to that folder and returns the shards an
interrupted run of the same plan finished; :func:`complete_dataset` tells a ``resume`` of a finished run
(a no-op). Errors name the parameters (``overwrite=True``, ``resume=True``).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import time

from captioning.data.prepared import MANIFEST, VOCAB, PreparedDataset
from captioning.errors import InputError
from captioning.fileio import atomic_write_json
from captioning.data.schema import is_shard_name
from data_prep.writer import RUN_LOCK_BYTE, WRITERS_LOCK_BYTE, ShardTask

log = logging.getLogger("captioning.prepare")

PARTIAL = ".partial"
LOCK = "lock"  # in PARTIAL


class OutputLock:
    """One ``prepare`` per output folder, and none while workers of a killed one still write.

    ``.partial/lock`` carries two POSIX record locks, which the kernel drops when their process dies
    however it dies: byte 0 is held exclusively by the running ``prepare`` (a second one stops at once
    with an error), byte 1 shared by each of its worker processes (:func:`data_prep.writer.init_worker`).
    A new run takes byte 1 exclusively for a moment, so it waits (up to ``wait_s``) until no worker of
    an earlier run is left, before it removes or rewrites anything. Where ``fcntl`` does not exist
    (Windows) the lock does nothing; workers still exit with their parent.
    """

    def __init__(self, path: str, out: str, wait_s: float = 60.0):
        self.fd = None
        try:
            import fcntl
        except ImportError:
            return
        self.fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            try:
                fcntl.lockf(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB, 1, RUN_LOCK_BYTE)
            except OSError:
                raise InputError(f"another `captioning prepare` is writing into {out}: wait for it to end, or "
                                 "stop it first") from None
            deadline, told = time.monotonic() + wait_s, False
            while True:
                try:
                    fcntl.lockf(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB, 1, WRITERS_LOCK_BYTE)
                    fcntl.lockf(self.fd, fcntl.LOCK_UN, 1, WRITERS_LOCK_BYTE)
                    break
                except OSError:
                    if time.monotonic() > deadline:
                        raise InputError(f"worker processes of an earlier `captioning prepare` still write into "
                                         f"{out} after {wait_s:.0f} s: stop them first") from None
                    if not told:
                        log.info("waiting for the worker processes of an interrupted run to exit")
                        told = True
                    time.sleep(0.05)
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)  # releases both locks
            self.fd = None


def _clear_partial(partial: str) -> None:
    """Empties ``.partial/`` but for the lock file, which must keep its inode while it is held."""
    for name in os.listdir(partial):
        if name != LOCK:
            path = os.path.join(partial, name)
            shutil.rmtree(path) if os.path.isdir(path) else os.remove(path)


def discard(out: str, tasks: list[ShardTask]) -> None:
    """Removes what a failed run wrote into ``out``: its shards, vocab.txt and .partial/. (The lock file
    goes too: this run writes nothing more, and a new run may start as soon as it has raised.)"""
    for path in [t.path for t in tasks] + [os.path.join(out, VOCAB)]:
        if os.path.exists(path):
            os.remove(path)
    shutil.rmtree(os.path.join(out, PARTIAL), ignore_errors=True)


def kept_shard(out: str, partial: str, name: str) -> bool:
    """A shard of the interrupted run is kept when its statistics exist and give its size."""
    try:
        with open(os.path.join(partial, name + ".json"), encoding="utf-8") as f:
            stats = json.load(f)
        size = os.path.getsize(os.path.join(out, name))
    except (OSError, ValueError):
        return False
    return stats.get("bytes", size) == size  # statistics from before "bytes" existed: trusted as before


def complete_dataset(opts: PrepareOptions, fingerprint: str) -> PreparedDataset | None:
    """With ``--resume``, the dataset of a finished run of the same sources and options, if the output
    folder holds one (then nothing is left to do, and nothing is touched); else None."""
    if not opts.resume or not os.path.isfile(PreparedDataset.manifest_path(opts.output_dir)):
        return None
    try:
        dataset = PreparedDataset.load(opts.output_dir)
    except InputError:
        return None  # unreadable: prepare_output_dir refuses it
    if dataset.fingerprint != fingerprint:
        return None
    log.info("%s already holds this dataset, complete (same sources and options): nothing to do", opts.output_dir)
    return dataset


def prepare_output_dir(opts: PrepareOptions, fingerprint: str, stack: contextlib.ExitStack) -> set[str]:
    """Locks the output folder (held until ``stack`` closes), checks it against ``overwrite`` and
    ``resume``; returns the shards already complete."""
    out = opts.output_dir
    partial = os.path.join(out, PARTIAL)
    manifest = PreparedDataset.manifest_path(out)
    if os.path.exists(manifest) and not opts.overwrite:
        if opts.resume:
            raise InputError(f"{out} already holds a complete dataset ({MANIFEST}) prepared from other sources "
                             "or options; pass the same ones, or `overwrite=True` to replace it", params=("overwrite",))
        raise InputError(f"{out} already holds a prepared dataset ({MANIFEST}); pass `overwrite=True` to replace it",
                         params=("overwrite",))
    had_partial = os.path.isdir(partial)
    os.makedirs(partial, exist_ok=True)
    stack.callback(OutputLock(os.path.join(partial, LOCK), out).close)  # nothing is removed before this
    if had_partial and not (opts.overwrite or opts.resume):
        raise InputError(f"an interrupted prepare left partial output in {out}: pass `resume=True` to finish it "
                         "or `overwrite=True` to start again", params=("resume", "overwrite"))
    if opts.overwrite:
        if os.path.exists(manifest):
            os.remove(manifest)  # first, so the folder never looks complete while it is rewritten
        for name in os.listdir(out):
            if is_shard_name(name) or name == VOCAB:
                os.remove(os.path.join(out, name))
        _clear_partial(partial)
    for name in os.listdir(out):  # leftovers of a killed run are never valid
        if (name.endswith(".tmp") and is_shard_name(name[:-4])) or name.startswith(VOCAB + ".tmp") or \
                name.startswith(MANIFEST + ".tmp"):
            os.remove(os.path.join(out, name))

    plan_path = os.path.join(partial, "plan.json")
    done: set[str] = set()
    if opts.resume and os.path.exists(plan_path):
        with open(plan_path, encoding="utf-8") as f:
            previous = json.load(f).get("fingerprint")
        if previous != fingerprint:
            raise InputError(f"cannot `resume=True` in {out}: the sources or options differ from the interrupted "
                             "run's; pass the same ones, or `overwrite=True` to start again",
                             params=("resume", "overwrite"))
        for name in os.listdir(out):
            if is_shard_name(name) and kept_shard(out, partial, name):
                done.add(name)
        log.info("resuming: %d complete shard(s) kept", len(done))
    elif opts.resume:
        log.info("nothing to resume in %s; starting a fresh run", out)
    if not done:  # stale shards of another plan must not survive next to the new ones
        for name in os.listdir(out):
            if is_shard_name(name):
                os.remove(os.path.join(out, name))
        _clear_partial(partial)
    atomic_write_json(plan_path, {"fingerprint": fingerprint})
    return done
