"""``data.cache: disk``: decoded images cached in files named by what they hold.

TensorFlow's file cache (``Dataset.cache(prefix)``) reads ``prefix.index`` when it exists and otherwise
writes the cache while the first pass runs: into ``prefix_<n>.*`` files, merged into ``prefix.index`` /
``prefix.data-*`` only when the pass completes, with ``prefix.lockfile`` held while it writes. So a pass
cut short (a killed run) never yields a readable cache; it leaves a lockfile that makes the next writer
fail. What TF leaves to its user, and this module does:

* **The name says what the cache holds.** ``{split}-{key}-{i}of{n}`` where ``key`` hashes everything the
  cached elements depend on: the dataset's identity (:attr:`captioning.data.prepared.PreparedDataset.identity`:
  the fingerprint ``prepare`` recorded, or for older datasets a hash of their manifest), the split, the
  cached image size
  (the encoder's preprocessor's ``resize_size``, ``data.resize_size``: the preprocessor's stage 1 is what the
  cache holds), the decoding (:data:`CACHE_VERSION`, bumped when a stage before the cache
  changes), ``data.skip_corrupt`` (which records are read) and the input pipeline's share of the split
  (``i`` of ``n`` pipelines; and ``max_images`` when only the first images are read). Another dataset, split, size or sharding gets another file: a cache that
  does not match is never read. ``prefix.json`` says the same in words, for people listing the folder.
* **A stale lockfile is told from a live writer.** The process that uses a cache prefix holds an
  exclusive POSIX lock on ``prefix.lock`` for as long as it lives (the kernel drops it when the process
  dies, however it dies). If a complete cache is there, it is read. If not, and the lock is free, any
  lockfile and partial files are a killed run's leftovers and are removed before TF writes afresh; if
  another live process holds the lock, it is writing this very cache and the command stops with one line
  (two writers would both write it).
"""

from __future__ import annotations

import glob
import hashlib
import json
import os

from captioning.errors import InputError

CACHE_VERSION = 1  # bump when what a cached element holds changes for the same key
_held: dict[str, int] = {}  # prefix -> fd holding its lock, for this process's lifetime (see the docstring)


def cache_prefix(cache_dir: str, dataset_identity: str, split: str, resize_size: int, skip_corrupt: bool,
                 pipeline: int = 0, pipelines: int = 1, max_images: int | None = None,
                 tokenizer: str | None = None) -> tuple[str, dict]:
    """The file prefix of the cache of one split's decoded images (the first ``max_images`` of them, when
    given), and the key it was made from. ``dataset_identity`` is
    :attr:`captioning.data.prepared.PreparedDataset.identity`; ``tokenizer`` the identity of a tokenizer that
    wrote the cached captions' ids from their text (None: the records' word ids, and the key as it always was)."""
    key = {"dataset": dataset_identity, "split": split, "resize_size": resize_size,
           "skip_corrupt": skip_corrupt, "pipeline": pipeline, "pipelines": pipelines, "max_images": max_images,
           "version": CACHE_VERSION}
    if tokenizer is not None:
        key["tokenizer"] = tokenizer
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    return os.path.join(cache_dir, f"{split}-{digest}-{pipeline}of{pipelines}"), key


def check_folder(folder: str) -> None:
    """Creates the cache folder if needed; InputError (naming ``data.cache_dir``) when that fails or it
    cannot be written: a file, a path under a file, a read-only place."""
    try:
        os.makedirs(folder, exist_ok=True)
    except OSError as e:
        raise InputError(f"data.cache_dir {folder}: cannot create it ({e.strerror})") from None
    if not os.access(folder, os.W_OK | os.X_OK):
        raise InputError(f"data.cache_dir {folder}: cannot write into it (permission denied)")


def claim(prefix: str, key: dict, complete: str = ".index", leftovers: tuple[str, ...] = ("_*", ".lockfile"),
          what: str = "data.cache: disk") -> None:
    """Readies ``prefix`` for ``Dataset.cache``: creates the folder, and unless a complete cache is there
    (``prefix + complete``), takes the prefix's lock and removes a killed run's leftovers (``prefix +``
    each of ``leftovers``, glob patterns). Raises InputError when the folder cannot be written or another
    live process is writing this cache. (:mod:`captioning.data.feature_cache` claims its files the same way.)"""
    check_folder(os.path.dirname(prefix))
    if os.path.exists(prefix + complete) or prefix in _held:
        return  # complete (it is read), or this process holds it already
    try:
        import fcntl
    except ImportError:  # no POSIX locks (Windows): a lockfile is taken for stale, as before
        fcntl = None
    fd = os.open(prefix + ".lock", os.O_RDWR | os.O_CREAT, 0o644)
    if fcntl is not None:
        try:
            fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            raise InputError(f"another process is writing the cache {prefix} ({what}); wait until it "
                             "has read the split once, or set another data.cache_dir") from None
    _held[prefix] = fd
    for stale in [p for pattern in leftovers for p in glob.glob(glob.escape(prefix) + pattern)]:
        os.remove(stale)  # a killed run's partial cache: never complete, never read
    from captioning.fileio import atomic_write_json

    atomic_write_json(prefix + ".json", key)
