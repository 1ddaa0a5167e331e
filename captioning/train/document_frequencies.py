"""Document frequencies for CIDEr-D: in how many images' references each n-gram occurs, from token ids.

A *document* is one image's set of reference captions, given as word ids (no ``<start>``/``<end>``; see
:mod:`captioning.vocab`); every distinct n-gram (orders 1..4) of any of its references counts once for it.
:func:`frequencies_from_split` counts a prepared split (the *training* references, for an SCST reward);
:func:`document_frequencies` any per-image lists of id lists (e.g. the evaluated references, which is what
pycocoevalcap's ``Cider`` uses). :class:`~captioning.train.cider.CiderD` scores with them.

**Keys.** An n-gram is one int64 (:func:`ngram_key`): the ids as digits ``id + 1`` of base ``V + 1``
(V = vocabulary size), so a k-gram's key lies in [(V+1)^(k-1), (V+1)^k): exact, no collision within or
across orders, and sorting the keys sorts by order first. Up to 4-grams this holds for V ≤ 55,107
(:func:`max_vocab_size`; COCO's vocabulary is ~10k); larger vocabularies are refused.

**Counting** is NumPy over the flat id array: per order one stable sort of the keys (each key's
documents stay in order, so distinct (key, document) pairs are where either changes), no Python per
n-gram. Measured on 2 cores of an AMD EPYC VM (other jobs sharing them): the shapes demo's train split
(4,000 images, 20,000 captions, 41 MB of records) in 0.3–0.9 s from its records, 0.06–0.1 s of it
counting; a synthetic COCO-sized corpus (113,287 images × 5 captions, 10.5 words on average, Zipfian
over 10k words; :func:`benchmark_frequencies`) counts in 3.7–7 s into 5.6M keys (real captions repeat
more: fewer keys). Reading COCO's records comes on top: the shards are read whole (their JPEGs too),
~170 MB/s here from the page cache, so ~17 GB take 1.5–2 minutes or the disk's time; compute once, save.

**The file** is one ``.npz`` (:meth:`DocumentFrequencies.save`, written atomically; read with
``allow_pickle=False``): ``format_version``, ``vocab_size`` (the key base), ``n``, ``num_documents``,
``keys``, ``counts``, ``source`` (what was counted). A damaged or foreign file is one line naming it.
"""

from __future__ import annotations

import dataclasses
import time
import zipfile
from dataclasses import dataclass
from typing import Iterable, Sequence

import numpy as np
import tensorflow as tf
from tensorflow.autograph.experimental import do_not_convert

from captioning.data import schema
from captioning.data.prepared import PreparedDataset
from captioning.errors import InputError
from captioning.fileio import atomic_file, disk_full_error
from captioning.data.integrity import ShardReader
from captioning.vocab import END_ID, PAD_ID, START_ID

FORMAT_VERSION = 1  # of the document-frequency .npz; bump when its arrays change
_FIELDS = ("format_version", "vocab_size", "n", "num_documents", "keys", "counts", "source")


def max_vocab_size(n: int = 4) -> int:
    """The largest vocabulary whose n-grams (up to order ``n``) pack into an int64 (keys < (V+1)^n ≤ 2^63).

    >>> max_vocab_size(4), max_vocab_size(3)
    (55107, 2097151)
    """
    base = int(round(2.0 ** (63 / n))) + 2
    while base ** n > 2 ** 63:
        base -= 1
    return base - 1


def ngram_key(ngram: Sequence[int], vocab_size: int) -> int:
    """The int64 key of an n-gram of word ids: digits ``id + 1`` in base ``vocab_size + 1``, most significant
    first. Every digit is ≥ 1, so a k-gram's key lies in [B^(k-1), B^k): no two n-grams of any orders share
    a key.

    >>> ngram_key([4], 10), ngram_key([4, 5], 10), ngram_key([0, 0], 10), ngram_key([9], 10)
    (5, 61, 12, 10)
    """
    key = 0
    for word in ngram:
        key = key * (vocab_size + 1) + int(word) + 1
    return key


@dataclass(frozen=True, eq=False)
class DocumentFrequencies:
    """For each n-gram (order 1..``n``) of the references, in how many documents (images) it occurs.

    ``keys``: sorted int64 :func:`ngram_key`\\ s; ``counts``: int64 documents per key (1..``num_documents``);
    ``vocab_size``: the base of the keys; ``source``: what they were counted from (free text);
    ``word_counts``: int64, at ``[w]`` the number of references of ``w`` words (``<end>`` not counted;
    empty when unknown), which :meth:`share_longer` reads.

    >>> df = document_frequencies([[[4, 5, 4], [5]], [[4]]], vocab_size=10, n=2)
    >>> df.num_documents, df.count([4]), df.count([5]), df.count([4, 5]), df.count([6])
    (2, 2, 1, 1, 0)
    """

    keys: np.ndarray
    counts: np.ndarray
    num_documents: int
    vocab_size: int
    n: int = 4
    source: str = ""
    word_counts: np.ndarray = dataclasses.field(default_factory=lambda: np.zeros(0, np.int64))

    def __post_init__(self):
        keys, counts = self.keys, self.counts
        if not (isinstance(keys, np.ndarray) and isinstance(counts, np.ndarray) and keys.dtype == np.int64
                and counts.dtype == np.int64 and keys.ndim == 1 and keys.shape == counts.shape):
            raise InputError("keys and counts must be int64 vectors of one length")
        if not 1 <= self.n or not 1 <= self.vocab_size <= max_vocab_size(self.n):
            raise InputError(f"vocabulary size {self.vocab_size} with n-grams up to {self.n} does not pack into "
                             f"int64 keys (at most {max_vocab_size(max(1, self.n))} words)")
        if self.num_documents < 1:
            raise InputError("document frequencies need at least one document")
        if keys.size and (keys[0] < 1 or keys[-1] >= (self.vocab_size + 1) ** self.n or np.any(np.diff(keys) <= 0)):
            raise InputError("n-gram keys must be increasing and within the vocabulary's range")
        if counts.size and (counts.min() < 1 or counts.max() > self.num_documents):
            raise InputError(f"document counts must lie between 1 and {self.num_documents}")

    def share_longer(self, words: int) -> float:
        """The share of the references with more than ``words`` words (0 when the counts are unknown)."""
        total = int(self.word_counts.sum())
        return float(self.word_counts[words + 1:].sum()) / total if total else 0.0

    def count(self, ngram: Sequence[int]) -> int:
        """Documents holding ``ngram`` (0 when none)."""
        key = ngram_key(ngram, self.vocab_size)
        i = int(np.searchsorted(self.keys, key))
        return int(self.counts[i]) if i < self.keys.size and self.keys[i] == key else 0

    def save(self, path: str) -> None:
        """One ``.npz`` (no pickled objects), written atomically; :meth:`load` reads it."""
        try:
            with atomic_file(path) as f:
                np.savez(f, format_version=np.int64(FORMAT_VERSION), vocab_size=np.int64(self.vocab_size),
                         n=np.int64(self.n), num_documents=np.int64(self.num_documents), keys=self.keys,
                         counts=self.counts, source=np.str_(self.source), word_counts=self.word_counts.astype(np.int64))
        except OSError as e:
            raise disk_full_error(e, path, "document frequencies") or InputError(
                f"cannot write document frequencies {path}: {e.strerror or e}") from None

    @classmethod
    def load(cls, path: str) -> "DocumentFrequencies":
        """Reads a file of :meth:`save` (``allow_pickle=False``); one-line InputError naming it otherwise."""
        what = f"document frequencies {path}"
        try:
            with open(path, "rb") as f:
                if f.read(4) != b"PK\x03\x04":  # np.load would try other formats, pickle among them
                    raise InputError(f"{what} is not an .npz file: compute them again")
                f.seek(0)
                data = np.load(f, allow_pickle=False)
                version = data["format_version"] if "format_version" in data.files else None
                if version is None or version.shape != () or int(version) != FORMAT_VERSION:
                    raise InputError(f"{what} is not document frequencies of format version {FORMAT_VERSION} "
                                     f"(it has {version}): compute them again")
                missing = [name for name in _FIELDS if name not in data.files]
                if missing:
                    raise InputError(f"{what} is damaged: it has no {', '.join(missing)}")
                arrays = {name: data[name] for name in _FIELDS}
                # files of before it existed have none
                word_counts = data["word_counts"] if "word_counts" in data.files else np.zeros(0, np.int64)
        except FileNotFoundError:
            raise InputError(f"{what}: no such file") from None
        except OSError as e:
            raise InputError(f"cannot read {what}: {e.strerror or _line(e)}") from None
        except (ValueError, TypeError, EOFError, zipfile.BadZipFile) as e:
            raise InputError(f"{what} is damaged ({_line(e)}): compute them again") from None
        try:
            return cls(arrays["keys"], arrays["counts"], int(arrays["num_documents"]), int(arrays["vocab_size"]),
                       int(arrays["n"]), str(arrays["source"]), word_counts)
        except (InputError, ValueError, TypeError) as e:
            raise InputError(f"{what} is damaged: {_line(e)}") from None


def _line(error: BaseException) -> str:
    return (str(error).splitlines() or [type(error).__name__])[0]


def document_frequencies(references: Iterable[Sequence[Sequence[int]]], vocab_size: int, n: int = 4,
                         source: str = "", end_token: bool = False) -> DocumentFrequencies:
    """Document frequencies of 1..``n``-grams: ``references`` gives per image (document) its reference
    captions as word ids (no ``<start>``/``<end>``; with ``end_token``, each ends with its ``<end>``, as
    ``scst.end_in_reward`` counts it); an n-gram counts once per image that has it in any reference. (The
    worked example is :class:`DocumentFrequencies`'.)"""
    per_image, lengths, flat = [], [], []
    for refs in references:
        per_image.append(len(refs))
        for ref in refs:
            lengths.append(len(ref))
            flat.extend(ref)
    return _count(np.asarray(flat, np.int64).reshape(-1), np.asarray(lengths, np.int64),
                  np.asarray(per_image, np.int64), vocab_size, n, source, end_token)


def frequencies_from_split(dataset: PreparedDataset, split: str = "train", n: int = 4,
                           shards: ShardReader | None = None, end_token: bool = False) -> DocumentFrequencies:
    """Document frequencies of a prepared split's references (``caption/ids`` of its records, read without
    decoding an image; ``<start>`` dropped, and ``<end>`` too unless ``end_token``: then it is the last
    word of every reference, as self-critical.pytorch counts its ``<eos>``). Vectorised NumPy: see
    :func:`benchmark_frequencies`."""
    files = (shards or ShardReader()).files(dataset, split)
    tokens, lengths, per_image = [], [], []
    # the counts do not depend on the order of the records: files are read in parallel, in any order
    records = tf.data.Dataset.from_tensor_slices(files).interleave(
        tf.data.TFRecordDataset, cycle_length=max(1, min(len(files), 4)), num_parallel_calls=tf.data.AUTOTUNE,
        deterministic=False).batch(1024).map(do_not_convert(schema.parse_batch), num_parallel_calls=tf.data.AUTOTUNE)
    for batch in records:
        ids = batch[schema.CAPTION_IDS]  # ragged [images, (captions), (ids)]
        per_image.append(ids.row_lengths().numpy())
        lengths.append(ids.values.row_lengths().numpy())
        tokens.append(ids.flat_values.numpy())
    if not per_image:
        raise InputError(f"split {split} of {dataset.path} has no images to count document frequencies from")
    tokens, lengths = np.concatenate(tokens).astype(np.int64), np.concatenate(lengths).astype(np.int64)
    ends = np.cumsum(lengths)
    if np.any(lengths < 2) or np.any(tokens[ends - lengths] != START_ID) or np.any(tokens[ends - 1] != END_ID):
        raise InputError(f"split {split} of {dataset.path} has a caption not framed by <start> and <end>: "
                         "prepare the dataset again")
    words = np.ones(tokens.size, bool)
    words[ends - lengths] = False
    if not end_token:
        words[ends - 1] = False
    counted = _count(tokens[words], lengths - (1 if end_token else 2), np.concatenate(per_image).astype(np.int64),
                     dataset.vocab_size, n, f"{dataset.identity} {split}" + (" +<end>" if end_token else ""),
                     end_token)
    return dataclasses.replace(counted, word_counts=np.bincount(lengths - 2).astype(np.int64))


def _count(tokens: np.ndarray, lengths: np.ndarray, per_image: np.ndarray, vocab_size: int, n: int,
           source: str, end_token: bool = False) -> DocumentFrequencies:
    """Flat word ids, words per caption, captions per image → document frequencies (one sort per order)."""
    documents = per_image.size
    if not 1 <= vocab_size <= max_vocab_size(max(1, n)):
        raise InputError(f"vocabulary size {vocab_size} with n-grams up to {n} does not pack into int64 keys "
                         f"(at most {max_vocab_size(max(1, n))} words)")
    if tokens.size and (tokens.min() < 0 or tokens.max() >= vocab_size):
        raise InputError(f"word ids must lie in [0, {vocab_size}); got {tokens.min()}..{tokens.max()}")
    if np.isin(tokens, (PAD_ID, START_ID) if end_token else (PAD_ID, START_ID, END_ID)).any():
        raise InputError("references hold <pad>, <start> or <end> ids: give words only")
    document = np.repeat(np.repeat(np.arange(documents, dtype=np.int64), per_image), lengths)
    room = np.repeat(np.cumsum(lengths), lengths) - np.arange(tokens.size)  # words from here to the caption's end
    base, key = vocab_size + 1, tokens + 1
    all_keys, all_counts = [], []
    for k in range(1, n + 1):
        if k > 1:
            key = key[:-1] * base + tokens[k - 1:] + 1
        fits = room[:key.size] >= k
        # a stable sort by key keeps each key's documents in increasing order (the flat order), so a new
        # (key, document) pair starts wherever the key or the document changes
        valid_keys = key[fits]
        order = np.argsort(valid_keys, kind="stable")
        sorted_keys, sorted_documents = valid_keys[order], document[:key.size][fits][order]
        new_key = np.ones(sorted_keys.size, bool)
        new_key[1:] = sorted_keys[1:] != sorted_keys[:-1]
        new_pair = new_key.copy()
        new_pair[1:] |= sorted_documents[1:] != sorted_documents[:-1]
        all_keys.append(sorted_keys[new_key])
        all_counts.append(np.bincount(np.cumsum(new_key)[new_pair] - 1, minlength=all_keys[-1].size).astype(np.int64))
    return DocumentFrequencies(np.concatenate(all_keys).astype(np.int64), np.concatenate(all_counts), documents,
                               vocab_size, n, source)  # orders concatenated in order: k-grams' keys are larger


def benchmark_frequencies(images: int = 113_287, captions: int = 5, mean_words: float = 10.5,
                          vocab_size: int = 10_000, seed: int = 0) -> dict:
    """Times the counting on a synthetic corpus (COCO's train split by default: Zipfian words, Poisson
    lengths): ``{"seconds", "keys", "tokens"}``. Reading a real split's records comes on top (I/O)."""
    rng = np.random.default_rng(seed)
    lengths = np.maximum(1, rng.poisson(mean_words, images * captions)).astype(np.int64)
    tokens = np.minimum(rng.zipf(1.2, int(lengths.sum())) + 2, vocab_size - 1).astype(np.int64)
    start = time.perf_counter()
    df = _count(tokens, lengths, np.full(images, captions, np.int64), vocab_size, 4, "synthetic")
    return {"seconds": round(time.perf_counter() - start, 2), "keys": int(df.keys.size), "tokens": int(tokens.size)}
