"""Every output is written under a temporary name and renamed when complete, and a full disk is one
clear line (prepare, train, evaluate, score, caption and export all use these)."""

from __future__ import annotations

import errno
import json
import os

from captioning.errors import InputError

# What a write into a full file system (or past a quota or a file-size limit) fails with.
_DISK_FULL = {errno.ENOSPC: "no space left on the device", errno.EDQUOT: "the disk quota is exceeded",
              errno.EFBIG: "the file is too large for this file system or process limit"}
_DISK_FULL_TEXT = {"No space left on device": errno.ENOSPC, "Disk quota exceeded": errno.EDQUOT,
                   "File too large": errno.EFBIG}


def disk_full_error(error: BaseException, path: str, what: str) -> InputError | None:
    """The one-line error for ``error`` when it means the disk (or a quota, or the process's file-size
    limit) is full while writing ``what`` to ``path``; None for any other error. TensorFlow's own file
    writers (checkpoints, SavedModels, tf.data caches) raise ``tf.errors.OpError``\\ s whose message
    carries the system's text, so both kinds are recognised."""
    code = getattr(error, "errno", None)
    if code not in _DISK_FULL:
        message = str(getattr(error, "message", None) or error)
        code = next((c for text, c in _DISK_FULL_TEXT.items() if text in message), None)
    if code is None:
        return None
    return InputError(f"cannot write {what} to {path}: {_DISK_FULL[code]}; free space there (or write "
                      "somewhere else) and run the same command again")


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
