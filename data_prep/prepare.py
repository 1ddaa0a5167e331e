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
out of one folder (:class:`data_prep.output_folder.OutputLock`): a second run while one is writing
stops with an error, and a run started while workers of a killed one still live waits for them to
exit before it removes their ``NAME.tmp`` files.

The manifest records each shard's record count and size (``shard_records``, ``shard_bytes``, lists
parallel to ``shards``): readers refuse or repair a shard that was cut short or grew
(:mod:`captioning.data.integrity`).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import math
import os
import shutil
from dataclasses import asdict, dataclass, field

import numpy as np

from captioning.data.prepared import MANIFEST, VOCAB, PreparedDataset, SplitInfo
from captioning.errors import InputError
from captioning.fileio import disk_full_error, make_dirs
from captioning.data.schema import shard_name
from captioning.text import tokenize_caption
from captioning.vocab import Vocabulary
from data_prep import sources as sources_lib
from data_prep.output_folder import LOCK, PARTIAL, complete_dataset, discard, prepare_output_dir
from data_prep.vocabulary import build_vocabulary
from data_prep.writer import Item, ShardTask, with_streamed_bytes, write_shard, write_shards

log = logging.getLogger("captioning.prepare")

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
        """InputError naming the parameter(s) of the first option that cannot be used."""
        kinds = [bool(self.split), bool(self.karpathy_json), bool(self.tfds)]
        if sum(kinds) != 1:
            raise InputError("give exactly one source: `split` (COCO files), `karpathy_json`, or `tfds`",
                             params=("split", "karpathy_json", "tfds"))
        if self.karpathy_json and not self.images_root:
            raise InputError("`karpathy_json` needs `images_root` (image path = ROOT/filepath/filename)",
                             params=("karpathy_json", "images_root"))
        if self.overwrite and self.resume:
            raise InputError("`overwrite=True` and `resume=True` contradict each other; pass one",
                             params=("overwrite", "resume"))
        for name in ("min_word_count", "max_caption_length", "images_per_shard", "workers"):
            if getattr(self, name) < 1:
                raise InputError(f"`{name}` must be at least 1, got {getattr(self, name)}", params=(name,))
        if not 1 <= self.jpeg_quality <= 100:
            raise InputError(f"`jpeg_quality` must be in 1..100, got {self.jpeg_quality}", params=("jpeg_quality",))
        if self.shorter_side is not None and self.shorter_side < 8:
            raise InputError(f"`shorter_side` must be at least 8 pixels, got {self.shorter_side}",
                             params=("shorter_side",))
        for name, count in self.shards.items():
            if count < 1:
                raise InputError(f"`shards` {name}={count}: a split needs at least one shard", params=("shards",))


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


def _plan(usable, opts, streamed: bool, vocab) -> list[ShardTask]:
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


def prepare(opts: PrepareOptions, progress: bool = True) -> PreparedDataset:
    """Runs ``prepare`` (see the module docstring) and returns the dataset it wrote. A full disk is one
    line (:class:`~captioning.errors.DiskFullError`): the shards completed so far are kept, and the same
    command with ``--resume`` finishes the run once there is space."""
    try:
        with contextlib.ExitStack() as stack:  # holds the output folder's lock while it runs
            return _prepare(opts, progress, stack)
    except OSError as e:
        error = disk_full_error(e, opts.output_dir, "the prepared dataset",
                                "run the same command with `resume=True`: the complete shards are kept",
                                params=("resume",))
        if error is None:
            raise
        raise error from None


def _prepare(opts: PrepareOptions, progress: bool, stack: contextlib.ExitStack) -> PreparedDataset:
    """The steps of the module docstring, in order; ``stack`` holds the output folder's lock."""
    opts.check()
    # a file, under a file, /proc, no permission: before any work
    make_dirs(opts.output_dir, "`output_dir`", params=("output_dir",))
    source = make_source(opts)
    usable, skipped, caption_counts = _usable_captions(opts, source)
    vocab = _vocabulary(opts, usable)
    tasks = _plan(usable, opts, source.streamed, vocab)
    fingerprint = _fingerprint(tasks, opts, source.describe())
    complete = complete_dataset(opts, fingerprint)
    if complete is not None:  # --resume of a run that finished: a no-op
        return complete
    done = prepare_output_dir(opts, fingerprint, stack)
    vocab.save(os.path.join(opts.output_dir, VOCAB))
    results = _write_remaining_shards(opts, source, tasks, done, progress)
    splits, all_skipped = _split_infos(opts, usable, tasks, results, caption_counts, skipped)
    dataset = PreparedDataset.create(opts.output_dir, splits, len(vocab), all_skipped,
                                     {**asdict(opts), "source": source.describe()}, fingerprint)
    dataset.write()  # last: a folder with a manifest is a complete dataset
    shutil.rmtree(os.path.join(opts.output_dir, PARTIAL), ignore_errors=True)
    return dataset


def _usable_captions(opts: PrepareOptions, source) -> tuple[dict, list, dict]:
    """Steps 1 and 2: the source's splits read and tokenized (:func:`_tokenize`'s three results), refused
    when ``shards`` names a split the source lacks, a split has no usable caption, ``strict`` meets a
    skipped image, or (file sources) none of a split's image files exists."""
    log.info("reading annotations (%s)", source.describe()["kind"])
    splits = source.load()
    for name in opts.shards:
        if name not in splits:
            raise InputError(f"`shards` names split {name!r}, but the source has {', '.join(sorted(splits))}",
                             params=("shards",))
    usable, skipped, caption_counts = _tokenize(splits, opts)
    for name, entries in usable.items():
        if not entries:
            raise InputError(f"split {name!r}: no image has a usable caption")
    if skipped and opts.strict:
        raise InputError(f"`strict=True`: {skipped[0]['image']} skipped ({skipped[0]['reason']})", params=("strict",))
    if not source.streamed:
        _check_image_files(usable)
    return usable, skipped, caption_counts


def _vocabulary(opts: PrepareOptions, usable: dict) -> Vocabulary:
    """Step 3: ``opts.vocab`` loaded, or the vocabulary of the ``train`` split's captions."""
    if opts.vocab:
        vocab = Vocabulary.load(opts.vocab)
        log.info("vocabulary: %d tokens from %s", len(vocab), opts.vocab)
    elif "train" in usable:
        vocab = build_vocabulary((t for e in usable["train"] for t in e.tokens), opts.min_word_count)
        log.info("vocabulary: %d tokens (words seen at least %d times in the train captions)",
                 len(vocab), opts.min_word_count)
    else:
        raise InputError(f"no 'train' split to build the vocabulary from (splits: {', '.join(sorted(usable))}); "
                         "name one train, or pass `vocab`", params=("vocab",))
    return vocab


def _write_remaining_shards(opts: PrepareOptions, source, tasks: list[ShardTask], done, progress: bool) -> dict:
    """Step 5: the shards not ``done`` (a resumed run's finished ones) written by the workers; returns every
    shard's statistics by its file name (a finished shard's read from ``.partial/``)."""
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
            raise InputError(f"`strict=True`: {first['image']} skipped ({first['reason']})", params=("strict",))

    if source.streamed:
        todo_names = {os.path.basename(t.path) for t in todo}
        stream = (t for t in with_streamed_bytes(source, tasks) if os.path.basename(t.path) in todo_names)
    else:
        stream = todo
    write_shards(stream, sum(len(t.items) for t in todo), workers, progress, on_done,
                 os.path.join(opts.output_dir, PARTIAL, LOCK))
    return results


def _split_infos(opts: PrepareOptions, usable: dict, tasks: list[ShardTask], results: dict, caption_counts: dict,
                 skipped: list) -> tuple[dict, list]:
    """The manifest's :class:`SplitInfo` of each split from its shards' statistics, and every skipped image
    (``skipped``, those without a usable caption, first). A split left with no image is refused, and what the
    run wrote removed."""
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
            discard(opts.output_dir, tasks)
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
    return splits, all_skipped


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
