"""Every output is written under a temporary name and renamed when complete, and a full disk is one
clear line (prepare, train, evaluate, score, caption and export all use these)."""

from __future__ import annotations

import errno
import json
import os

from captioning.errors import DiskFullError, InputError

# What a write into a full file system (or past a quota or a file-size limit) fails with.
_DISK_FULL = {errno.ENOSPC: "no space left on the device", errno.EDQUOT: "the disk quota is exceeded",
              errno.EFBIG: "the file is too large for this file system or process limit"}
_DISK_FULL_TEXT = {"No space left on device": errno.ENOSPC, "Disk quota exceeded": errno.EDQUOT,
                   "File too large": errno.EFBIG}


def disk_full_error(error: BaseException, path: str, what: str,
                    then: str = "run the same command again") -> DiskFullError | None:
    """The one-line error for ``error`` when it means the disk (or a quota, or the process's file-size
    limit) is full while writing ``what`` to ``path``; None for any other error. TensorFlow's own file
    writers (checkpoints, SavedModels, tf.data caches) raise ``tf.errors.OpError``\\ s whose message
    carries the system's text, so both kinds are recognised. ``then`` says what to do once space is free."""
    code = getattr(error, "errno", None)
    if code not in _DISK_FULL:
        message = str(getattr(error, "message", None) or error)
        code = next((c for text, c in _DISK_FULL_TEXT.items() if text in message), None)
    if code is None:
        return None
    return DiskFullError(f"cannot write {what} to {path}: {_DISK_FULL[code]}; free space there (or write "
                         f"somewhere else), then {then}")


def atomic_write_bytes(path: str, data: bytes) -> None:
    """Writes ``data`` to ``path`` so that ``path`` is either absent, the old file, or complete: a
    temporary file beside it, flushed and fsynced, renamed over it. On any failure the temporary file
    is removed and the error raised."""
    tmp = f"{path}.tmp{os.getpid()}"
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.remove(tmp)
        except OSError:
            pass
        raise


def atomic_write_text(path: str, text: str) -> None:
    atomic_write_bytes(path, text.encode("utf-8"))


def atomic_write_json(path: str, obj, indent: int | None = 1) -> None:
    """JSON with sorted keys (same object, same bytes), written atomically."""
    atomic_write_text(path, json.dumps(obj, indent=indent, sort_keys=True, ensure_ascii=False) + "\n")


def make_dirs(path: str, what: str) -> None:
    """``os.makedirs(path, exist_ok=True)``, or one line naming ``what`` (e.g. ``--output-dir``) and why
    not: a file in the way, a path under a file or under ``/proc`` or ``/sys``, no permission."""
    if os.path.exists(path) and not os.path.isdir(path):
        raise InputError(f"{what} {path} is a file, not a folder")
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as e:
        raise InputError(f"{what} {path}: cannot create it ({e.strerror or e})") from None


def check_output_file(path: str, what: str) -> None:
    """Makes sure ``path`` can be written *before* the work that produces it: not a folder, its folder
    created if missing, and a file really can be written there (a probe of a few KiB, removed at once:
    only trying tells a read-only or pseudo file system, even for root, or a disk already full). One line
    naming ``what`` otherwise (:class:`DiskFullError` for a full disk)."""
    if os.path.isdir(path):
        raise InputError(f"{what} {path} is a folder; give a file name")
    make_dirs(os.path.dirname(os.path.abspath(path)), f"{what} {path}: its folder")
    probe = f"{path}.tmp{os.getpid()}"
    try:
        with open(probe, "wb") as f:
            f.write(bytes(4096))
            f.flush()
            os.fsync(f.fileno())
    except OSError as e:
        if os.path.exists(probe):
            os.remove(probe)
        raise disk_full_error(e, path, what) or InputError(f"{what} {path}: cannot write it ({e.strerror or e})") \
            from None
    os.remove(probe)
