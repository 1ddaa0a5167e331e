"""Writes one shard: read each image, validate it, encode a record, rename the file when complete.

A shard is written to ``NAME.tmp`` and renamed to ``NAME`` only after it is closed and synced, so a
file under a final shard name is always complete. Before the rename, the shard's statistics (images,
captions, skipped files, size in bytes) are written beside it in the output's ``.partial/`` folder;
``--resume`` trusts a shard only when both exist and the sizes agree. :func:`write_shard` runs in
worker processes (see :mod:`data_prep.prepare`), so its task and result are plain picklable data.

Worker processes never outlive the ``prepare`` that started them (:func:`init_worker`): a worker whose
parent was killed (SIGKILL, the OOM killer) would otherwise finish its shard, rename it into place, and
then wait forever for work, possibly racing a ``--resume`` that writes the same ``NAME.tmp``. Each
worker also holds a shared lock on the output's lock file while it lives, which the next ``prepare``
waits for before touching the folder (see :class:`data_prep.output_folder.OutputLock`).
"""

from __future__ import annotations

import concurrent.futures as futures
import multiprocessing
import os
import threading
from dataclasses import dataclass
from typing import Callable

from captioning.errors import InputError
from captioning.fileio import atomic_file, atomic_write_json
from captioning.images import ImageError, process_image, read_image_file


@dataclass
class Item:
    image_id: int
    filename: str
    path: str | None  # None: bytes are in ShardTask.data
    captions: list[str]
    caption_ids: list[list[int]]


@dataclass
class ShardTask:
    split: str
    path: str  # final shard path
    stats_path: str
    items: list[Item]
    shorter_side: int | None
    jpeg_quality: int
    data: list[bytes] | None = None  # encoded images of a streamed source, one per item


def _read(item: Item, data: bytes | None) -> bytes:
    return data if data is not None else read_image_file(item.path)


def write_shard(task: ShardTask, report: Callable[[int], None] = lambda n: None) -> dict:
    """Writes ``task``'s records and returns ``{"images", "captions", "skipped": [{"image", "reason"}]}``.
    Never imports TensorFlow (:mod:`data_prep.records`), so a worker process starts in a fraction of
    a second."""
    stats = {"split": task.split, "shard": os.path.basename(task.path), "images": 0, "captions": 0, "skipped": []}
    # NAME.tmp (not per process): a crash leaves it for the next run to remove. On an error (a full disk)
    # atomic_file removes it at once, freeing what it took.
    with atomic_file(task.path, tmp=task.path + ".tmp") as f:
        _write_records(task, f, stats, report)
        stats["bytes"] = f.tell()  # the manifest records it: readers detect a cut or grown shard
        atomic_write_json(task.stats_path, stats)
    return stats


def _write_records(task: ShardTask, f, stats: dict, report) -> None:
    from data_prep import records

    pending = 0
    with records.RecordWriter(f) as writer:
        for i, item in enumerate(task.items):
            try:
                data = _read(item, task.data[i] if task.data is not None else None)
                jpeg, height, width = process_image(data, task.shorter_side, task.jpeg_quality)
            except ImageError as e:
                stats["skipped"].append({"image": item.filename, "reason": str(e)})
            else:
                writer.write(records.encode_example(
                    image_id=item.image_id, filename=item.filename, jpeg=jpeg, height=height, width=width,
                    captions=item.captions, caption_ids=item.caption_ids))
                stats["images"] += 1
                stats["captions"] += len(item.captions)
            pending += 1
            if pending == 16:
                report(pending)
                pending = 0
    report(pending)


_progress_queue = None
_lock_fd = None

# Byte ranges of the output folder's lock file (POSIX record locks, released by the kernel when the
# process holding them dies): RUN_LOCK_BYTE is held exclusively by the running prepare, WRITERS_LOCK_BYTE
# shared by each of its worker processes.
RUN_LOCK_BYTE, WRITERS_LOCK_BYTE = 0, 1


def _exit_with_parent() -> None:
    """Ends this worker as soon as the process that spawned it is gone (for any reason, SIGKILL
    included): ``parent_process()`` watches a pipe that only the parent holds open."""
    parent = multiprocessing.parent_process()
    if parent is None:
        return

    def watch():
        parent.join()
        os._exit(70)  # mid-shard: the NAME.tmp left behind is removed by the next run

    threading.Thread(target=watch, name="exit-with-parent", daemon=True).start()


def _hold_writers_lock(lock_path: str | None) -> None:
    global _lock_fd
    if lock_path is None:
        return
    try:
        import fcntl
    except ImportError:  # no POSIX record locks (Windows): _exit_with_parent is the only guard
        return
    _lock_fd = os.open(lock_path, os.O_RDWR)
    fcntl.lockf(_lock_fd, fcntl.LOCK_SH, 1, WRITERS_LOCK_BYTE)  # held until this process exits


def init_worker(queue, lock_path: str | None = None) -> None:
    """Process-pool initializer: exits with the parent, holds the writers' lock and remembers where to
    report progress."""
    global _progress_queue
    _exit_with_parent()
    _hold_writers_lock(lock_path)
    _progress_queue = queue


def run_in_worker(task: ShardTask) -> dict:
    return write_shard(task, report=_progress_queue.put)


def with_streamed_bytes(source, tasks: list[ShardTask]):
    """Fills each task's ``data`` from the source's stream, one shard at a time (bounded memory)."""
    by_split: dict[str, list[ShardTask]] = {}
    for task in tasks:
        by_split.setdefault(task.split, []).append(task)
    for split, split_tasks in by_split.items():
        stream = source.stream(split)
        for task in split_tasks:
            wanted = [item.image_id for item in task.items]
            data = []
            for image_id, encoded in stream:
                if len(data) < len(wanted) and image_id == wanted[len(data)]:
                    data.append(encoded)
                    if len(data) == len(wanted):
                        break
            if len(data) != len(wanted):
                raise InputError(f"the {split!r} stream of {source.name} ended early or changed order "
                                 f"while shard {os.path.basename(task.path)} was read")
            task.data = data
            yield task


def write_shards(tasks, total: int, workers: int, progress: bool, on_done, lock_path: str | None = None) -> None:
    """Writes ``tasks`` (an iterable, possibly lazy) with ``workers`` processes, in-process for one."""
    from tqdm import tqdm  # the parent's progress bar: worker processes, which import this module, never need it

    bar = tqdm(total=total, desc="prepare", unit="img", disable=None if progress else True, smoothing=0.1,
               mininterval=0.5)
    try:
        if workers == 1:
            for task in tasks:
                on_done(write_shard(task, report=bar.update))
            return
        ctx = multiprocessing.get_context("spawn")  # never fork a process that may hold TF threads
        queue = ctx.Queue()
        with futures.ProcessPoolExecutor(workers, mp_context=ctx, initializer=init_worker,
                                         initargs=(queue, lock_path)) as pool:
            task_iter = iter(tasks)
            pending = set()

            def submit_more():
                while len(pending) < workers + 1:
                    task = next(task_iter, None)
                    if task is None:
                        return
                    pending.add(pool.submit(run_in_worker, task))

            submit_more()
            try:
                while pending:
                    done, _ = futures.wait(pending, timeout=0.2, return_when=futures.FIRST_COMPLETED)
                    while not queue.empty():
                        bar.update(queue.get())
                    for future in done:
                        pending.discard(future)
                        on_done(future.result())
                    submit_more()
            except BaseException:
                for future in pending:
                    future.cancel()
                raise
            while not queue.empty():
                bar.update(queue.get())
    finally:
        bar.close()
