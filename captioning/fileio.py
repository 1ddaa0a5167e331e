"""Every output is written under a temporary name and renamed when complete (prepare, evaluate,
score, caption all use these)."""

from __future__ import annotations

import json
import os


def atomic_write_bytes(path: str, data: bytes) -> None:
    """Writes ``data`` to ``path`` so that ``path`` is either absent, the old file, or complete."""
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def atomic_write_json(path: str, obj, indent: int | None = 1) -> None:
    """JSON with sorted keys (same object, same bytes), written atomically."""
    text = json.dumps(obj, indent=indent, sort_keys=True, ensure_ascii=False) + "\n"
    atomic_write_bytes(path, text.encode("utf-8"))
