"""``captioning prepare``: captions and images in, sharded TFRecords, ``vocab.txt`` and ``manifest.json`` out.

The steps, in order:

1. Read the source (:mod:`data_prep.sources`) into lists of images with their raw captions, per split.
2. Normalise and tokenize every caption (:mod:`captioning.text`); drop empty ones; clip to
   ``max_caption_length`` words (default 20, the ``<start>``/``<end>`` ids come on top). An image left
   with no caption is skipped.
3. Build the vocabulary from the ``train`` split's captions (or load ``--vocab``). It is counted from the
   annotations, before images are read, so it never depends on which image files happen to be broken.
4. Plan the shards: images in a seeded shuffle (file sources; TFDS keeps its own, already shuffled
   order), cut into ``--shards`` contiguous pieces, by default ``max(4, ceil(images / 1000))`` (about
   150 MB per shard for COCO: large enough for fast sequential reads, many enough for interleave and for
   one file per reader under multi-worker training). Tiny splits get one shard per image at most.
5. Write the shards with ``workers`` processes (:mod:`data_prep.writer`); each shard appears under its
   final name only when complete. ``vocab.txt`` is written before, ``manifest.json`` last, so a folder
   with a manifest is a complete dataset.

``.partial/`` in the output folder holds the plan's fingerprint and each finished shard's statistics
while a run is under way. ``--resume`` keeps the finished shards of an interrupted run (same sources,
same options — checked through the fingerprint; a kept shard's size must equal its statistics') and
writes the rest; the result equals a clean run, byte for byte. The manifest records the same fingerprint,
so ``--resume`` of a run that already finished says so, exits 0 and changes nothing (a scheduler may
re-run a step "with --resume until it succeeds"); other sources or options are refused as ever.

Killed at any moment (SIGKILL included), a run leaves no shard under its final name that is not
complete: shards are renamed into place after they are synced, statistics first. Its worker processes
exit as soon as it is gone (:func:`data_prep.writer.init_worker`). ``.partial/lock`` keeps two runs
out of one folder (:class:`OutputLock`): a second run while one is writing stops with an error, and
a run started while workers of a killed one still live waits for them to exit before it removes their
``NAME.tmp`` files.

The manifest records each shard's record count and size (``shard_records``, ``shard_bytes``, lists
parallel to ``shards``): readers refuse or repair a shard that was cut short or grew
(:mod:`captioning.integrity`).
"""

from __future__ import annotations

import concurrent.futures as futures
import contextlib
import hashlib
import json
import logging
import math
import multiprocessing
import os
import shutil
import time
from dataclasses import asdict, dataclass, field

import numpy as np
from tqdm import tqdm

from captioning import vocab as vocab_lib
from captioning.dataset import MANIFEST, VOCAB, PreparedDataset, SplitInfo
from captioning.errors import InputError
from captioning.fileio import atomic_write_json, disk_full_error, make_dirs
from captioning.text import tokenize_caption
from data_prep import sources as sources_lib
from data_prep.writer import (RUN_LOCK_BYTE, WRITERS_LOCK_BYTE, Item, ShardTask, init_worker, run_in_worker,
                              write_shard)

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


@dataclass
class PrepareOptions:
    """Every option of ``captioning prepare`` (the CLI's ``--help`` explains each)."""

    output_dir: str
    split: list[str] = field(default_factory=list)  # COCO files: NAME=ANNOTATIONS.json:IMAGES_DIR
    karpathy_json: str | None = None
    images_root: str | None = None
    tfds: str | None = None
    tfds_data_dir: str | None = None
    keep_restval: bool = False
    shards: dict[str, int] = field(default_factory=dict)
    images_per_shard: int = 1000
    min_word_count: int = 4
    max_caption_length: int = 20
    keep_punctuation: bool = False
    vocab: str | None = None
    shorter_side: int | None = None
    jpeg_quality: int = 95
    seed: int = 0
    workers: int = field(default_factory=lambda: os.cpu_count() or 1)
    strict: bool = False
    overwrite: bool = False
    resume: bool = False

    def check(self) -> None:
        kinds = [bool(self.split), bool(self.karpathy_json), bool(self.tfds)]
        if sum(kinds) != 1:
            raise InputError("give exactly one source: --split (COCO files), --karpathy-json, or --tfds")
        if self.karpathy_json and not self.images_root:
            raise InputError("--karpathy-json needs --images-root (image path = ROOT/filepath/filename)")
        if self.overwrite and self.resume:
            raise InputError("--overwrite and --resume contradict each other; pass one")
        for name, value, low in [("--min-word-count", self.min_word_count, 1),
                                 ("--max-caption-length", self.max_caption_length, 1),
                                 ("--images-per-shard", self.images_per_shard, 1),
                                 ("--workers", self.workers, 1)]:
            if value < low:
                raise InputError(f"{name} must be at least {low}, got {value}")
        if not 1 <= self.jpeg_quality <= 100:
            raise InputError(f"--jpeg-quality must be in 1..100, got {self.jpeg_quality}")
        if self.shorter_side is not None and self.shorter_side < 8:
            raise InputError(f"--shorter-side must be at least 8 pixels, got {self.shorter_side}")
        for name, count in self.shards.items():
            if count < 1:
                raise InputError(f"--shards {name}={count}: a split needs at least one shard")


def make_source(opts: PrepareOptions):
    if opts.split:
        return sources_lib.CocoSource(opts.split)
    if opts.karpathy_json:
        return sources_lib.KarpathySource(opts.karpathy_json, opts.images_root, opts.keep_restval)
    return sources_lib.TfdsSource(opts.tfds, opts.tfds_data_dir, opts.keep_restval)


def default_num_shards(num_images: int, images_per_shard: int = 1000) -> int:
    """``max(min(4, images), ceil(images / images_per_shard))``.

    >>> default_num_shards(113287), default_num_shards(1600), default_num_shards(2)
    (114, 4, 2)
    """
    return max(min(4, num_images), math.ceil(num_images / images_per_shard))


def _tokenize(splits, opts) -> tuple[dict, list, dict]:
    """Fills ``entry.tokens``; returns usable entries, images skipped for captions, caption counts."""
    usable, skipped, counts = {}, [], {}
    for name, entries in splits.items():
        kept, empty, clipped = [], 0, 0
        for entry in entries:
            tokens = []
            captions = []
            for caption in entry.captions:
                words = tokenize_caption(caption, opts.keep_punctuation)
                if not words:
                    empty += 1
                    continue
                if len(words) > opts.max_caption_length:
                    clipped += 1
                    words = words[:opts.max_caption_length]
                tokens.append(words)
                captions.append(caption.strip())
            entry.tokens, entry.captions = tokens, captions
            if tokens:
                kept.append(entry)
            else:
                skipped.append({"image": entry.filename, "reason": "no usable caption"})
        usable[name] = kept
        counts[name] = {"empty_captions": empty, "clipped_captions": clipped}
    return usable, skipped, counts


def _check_image_files(usable: dict) -> None:
    """A split none of whose image files exists is refused before anything is written (a wrong images
    folder, the usual cause); single missing files are skipped later, with the reason, like any
    unreadable image."""
    for name, entries in usable.items():
        if not any(os.path.isfile(e.path) for e in entries):
            raise InputError(f"split {name!r}: none of its {len(entries)} image files exists (e.g. "
                             f"{entries[0].path}); check the images folder")


def _discard(out: str, tasks: list[ShardTask]) -> None:
    """Removes what a failed run wrote into ``out``: its shards, vocab.txt and .partial/. (The lock file
    goes too: this run writes nothing more, and a new run may start as soon as it has raised.)"""
    for path in [t.path for t in tasks] + [os.path.join(out, VOCAB)]:
        if os.path.exists(path):
            os.remove(path)
    shutil.rmtree(os.path.join(out, PARTIAL), ignore_errors=True)


def _plan(usable, opts, streamed: bool, vocab) -> list[ShardTask]:
    from captioning.schema import shard_name

    out = opts.output_dir
    tasks = []
    for name in usable:
        entries = list(usable[name])
        if not streamed:
            rng = np.random.default_rng([opts.seed, sum(name.encode())])
            entries = [entries[i] for i in rng.permutation(len(entries))]
        count = opts.shards.get(name) or default_num_shards(len(entries), opts.images_per_shard)
        count = min(count, len(entries))
        bounds = np.linspace(0, len(entries), count + 1).round().astype(int)
        for i in range(count):
            shard = shard_name(name, i, count)
            items = [Item(e.image_id, e.filename, e.path, e.captions, [vocab.encode(t) for t in e.tokens])
                     for e in entries[bounds[i]:bounds[i + 1]]]
            tasks.append(ShardTask(name, os.path.join(out, shard), os.path.join(out, PARTIAL, shard + ".json"),
                                   items, opts.shorter_side, opts.jpeg_quality))
    return tasks


def _fingerprint(tasks: list[ShardTask], opts: PrepareOptions, source_desc: dict) -> str:
    """The identity of what a run writes: sources, the options that change a byte, and the plan (every
    shard's name and images, with their captions and ids). Not the output folder: a dataset moved
    elsewhere keeps its identity. ``--resume`` compares it; the manifest records it."""
    ignored = ("output_dir", "workers", "strict", "overwrite", "resume")
    relevant = {k: v for k, v in asdict(opts).items() if k not in ignored}
    h = hashlib.sha256(json.dumps([relevant, source_desc], sort_keys=True).encode())
    for task in tasks:
        h.update(json.dumps([os.path.basename(task.path), [asdict(item) for item in task.items]]).encode())
    return h.hexdigest()


def _kept_shard(out: str, partial: str, name: str) -> bool:
    """A shard of the interrupted run is kept when its statistics exist and give its size."""
    try:
        with open(os.path.join(partial, name + ".json"), encoding="utf-8") as f:
            stats = json.load(f)
        size = os.path.getsize(os.path.join(out, name))
    except (OSError, ValueError):
        return False
    return stats.get("bytes", size) == size  # statistics from before "bytes" existed: trusted as before


def _complete_dataset(opts: PrepareOptions, fingerprint: str) -> PreparedDataset | None:
    """With ``--resume``, the dataset of a finished run of the same sources and options, if the output
    folder holds one (then nothing is left to do, and nothing is touched); else None."""
    if not opts.resume or not os.path.isfile(PreparedDataset.manifest_path(opts.output_dir)):
        return None
    try:
        dataset = PreparedDataset.load(opts.output_dir)
    except InputError:
        return None  # unreadable: _prepare_output_dir refuses it
    if dataset.fingerprint != fingerprint:
        return None
    log.info("%s already holds this dataset, complete (same sources and options): nothing to do", opts.output_dir)
    return dataset


def _prepare_output_dir(opts: PrepareOptions, fingerprint: str, stack: contextlib.ExitStack) -> set[str]:
    """Locks the output folder (held until ``stack`` closes), checks it against --overwrite/--resume;
    returns the shards already complete."""
    from captioning.schema import is_shard_name

    out = opts.output_dir
    partial = os.path.join(out, PARTIAL)
    manifest = PreparedDataset.manifest_path(out)
    if os.path.exists(manifest) and not opts.overwrite:
        if opts.resume:
            raise InputError(f"{out} already holds a complete dataset ({MANIFEST}) prepared from other sources "
                             "or options; pass the same ones, or --overwrite to replace it")
        raise InputError(f"{out} already holds a prepared dataset ({MANIFEST}); pass --overwrite to replace it")
    had_partial = os.path.isdir(partial)
    os.makedirs(partial, exist_ok=True)
    stack.callback(OutputLock(os.path.join(partial, LOCK), out).close)  # nothing is removed before this
    if had_partial and not (opts.overwrite or opts.resume):
        raise InputError(f"an interrupted prepare left partial output in {out}: pass --resume to finish it "
                         "or --overwrite to start again")
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
            raise InputError(f"cannot --resume in {out}: the sources or options differ from the interrupted "
                             "run's; pass the same ones, or --overwrite to start again")
        for name in os.listdir(out):
            if is_shard_name(name) and _kept_shard(out, partial, name):
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


def _with_streamed_bytes(source, tasks: list[ShardTask]):
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


def _run(tasks, total: int, workers: int, progress: bool, on_done, lock_path: str | None = None) -> None:
    """Writes ``tasks`` (an iterable, possibly lazy) with ``workers`` processes, in-process for one."""
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


def prepare(opts: PrepareOptions, progress: bool = True) -> PreparedDataset:
    """Runs ``prepare`` (see the module docstring) and returns the dataset it wrote. A full disk is one
    line (:class:`~captioning.errors.DiskFullError`): the shards completed so far are kept, and the same
    command with ``--resume`` finishes the run once there is space."""
    try:
        with contextlib.ExitStack() as stack:  # holds the output folder's lock while it runs
            return _prepare(opts, progress, stack)
    except OSError as e:
        error = disk_full_error(e, opts.output_dir, "the prepared dataset",
                                "run the same command with --resume: the complete shards are kept")
        if error is None:
            raise
        raise error from None


def _prepare(opts: PrepareOptions, progress: bool, stack: contextlib.ExitStack) -> dict:

    opts.check()
    make_dirs(opts.output_dir, "--output-dir")  # a file, under a file, /proc, no permission: before any work
    source = make_source(opts)
    log.info("reading annotations (%s)", source.describe()["kind"])
    splits = source.load()
    for name in opts.shards:
        if name not in splits:
            raise InputError(f"--shards names split {name!r}, but the source has {', '.join(sorted(splits))}")
    usable, skipped, caption_counts = _tokenize(splits, opts)
    for name, entries in usable.items():
        if not entries:
            raise InputError(f"split {name!r}: no image has a usable caption")
    if skipped and opts.strict:
        raise InputError(f"--strict: {skipped[0]['image']} skipped ({skipped[0]['reason']})")
    if not source.streamed:
        _check_image_files(usable)

    if opts.vocab:
        vocab = vocab_lib.Vocabulary.load(opts.vocab)
        log.info("vocabulary: %d tokens from %s", len(vocab), opts.vocab)
    elif "train" in usable:
        vocab = vocab_lib.Vocabulary.build((t for e in usable["train"] for t in e.tokens), opts.min_word_count)
        log.info("vocabulary: %d tokens (words seen at least %d times in the train captions)",
                 len(vocab), opts.min_word_count)
    else:
        raise InputError(f"no 'train' split to build the vocabulary from (splits: {', '.join(sorted(usable))}); "
                         "name one train, or pass --vocab")

    tasks = _plan(usable, opts, source.streamed, vocab)
    fingerprint = _fingerprint(tasks, opts, source.describe())
    complete = _complete_dataset(opts, fingerprint)
    if complete is not None:  # --resume of a run that finished: a no-op
        return complete
    done = _prepare_output_dir(opts, fingerprint, stack)
    vocab.save(os.path.join(opts.output_dir, VOCAB))

    results = {}
    for task in tasks:
        name = os.path.basename(task.path)
        if name in done:
            with open(task.stats_path, encoding="utf-8") as f:
                results[name] = json.load(f)
    todo = [t for t in tasks if os.path.basename(t.path) not in done]
    workers = min(opts.workers, max(1, len(todo)))
    log.info("writing %d shard(s) of %d image(s) with %d worker(s) into %s", len(todo),
             sum(len(t.items) for t in todo), workers, opts.output_dir)

    def on_done(stats):
        results[stats["shard"]] = stats
        log.info("wrote %s: %d images, %d skipped", stats["shard"], stats["images"], len(stats["skipped"]))
        if stats["skipped"] and opts.strict:
            first = stats["skipped"][0]
            raise InputError(f"--strict: {first['image']} skipped ({first['reason']})")

    if source.streamed:
        todo_names = {os.path.basename(t.path) for t in todo}
        stream = (t for t in _with_streamed_bytes(source, tasks) if os.path.basename(t.path) in todo_names)
    else:
        stream = todo
    _run(stream, sum(len(t.items) for t in todo), workers, progress, on_done,
         os.path.join(opts.output_dir, PARTIAL, LOCK))

    splits = {}
    all_skipped = list(skipped)
    for name in usable:
        split_tasks = [t for t in tasks if t.split == name]
        stats = [results[os.path.basename(t.path)] for t in split_tasks]
        images = sum(s["images"] for s in stats)
        split_skipped = [x for s in stats for x in s["skipped"]]
        all_skipped.extend(split_skipped)
        if images == 0:
            # Nothing this run wrote can be used (nor resumed): remove it, so the folder does not look
            # like an interrupted run with 0-record shards under final names.
            _discard(opts.output_dir, tasks)
            first = split_skipped[0] if split_skipped else {"image": "?", "reason": "?"}
            raise InputError(f"split {name!r}: no usable image is left ({len(split_skipped)} skipped; "
                             f"first: {first['image']}: {first['reason']})")
        splits[name] = SplitInfo(
            name, images, sum(s["captions"] for s in stats), tuple(os.path.basename(t.path) for t in split_tasks),
            # per shard, for readers' integrity checks (captioning/integrity.py)
            tuple(s["images"] for s in stats),
            tuple(s["bytes"] if s.get("bytes") is not None else os.path.getsize(t.path)
                  for s, t in zip(stats, split_tasks)),
            caption_counts[name]["empty_captions"], caption_counts[name]["clipped_captions"])
    dataset = PreparedDataset.create(opts.output_dir, splits, len(vocab), all_skipped,
                                     {**asdict(opts), "source": source.describe()}, fingerprint)
    dataset.write()  # last: a folder with a manifest is a complete dataset
    shutil.rmtree(os.path.join(opts.output_dir, PARTIAL), ignore_errors=True)
    return dataset


def summarize(dataset: PreparedDataset) -> str:
    """A plain-text table of a prepared dataset, as ``prepare`` prints it at the end."""
    lines = [f"{'split':<10} {'images':>8} {'captions':>9} {'shards':>7}"]
    for name, s in dataset.splits.items():
        lines.append(f"{name:<10} {s.images:>8} {s.captions:>9} {len(s.shards):>7}")
    lines.append(f"vocabulary: {dataset.vocab_size} tokens; skipped images: {len(dataset.skipped)}")
    for item in dataset.skipped[:5]:
        lines.append(f"  skipped {item['image']}: {item['reason']}")
    if len(dataset.skipped) > 5:
        lines.append(f"  ... and {len(dataset.skipped) - 5} more (see {MANIFEST})")
    return "\n".join(lines)
