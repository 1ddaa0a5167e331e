"""CIDEr-D as a reward in TensorFlow ops only, for self-critical sequence training (SCST).

SCST (Rennie et al. 2017) rewards each sampled caption with its CIDEr-D against its image's references,
minus the greedy caption's. :class:`CiderD` computes exactly pycocoevalcap 1.2's ``Cider`` (which is
CIDEr-D) for a whole batch as one graph of TensorFlow ops: no Python per sample, no ``py_function``, so
it runs inside the compiled (``tf.function``) training step and under ``tf.distribute`` strategies. The
document frequencies come from the *training* references (:mod:`captioning.train.document_frequencies`,
one ``.npz``). For a candidate c and the references S of its image, with g_k(s) the tf-idf vector of the
k-grams of s (count in s × ``log(documents) - log(max(1, df))``) and σ = 6::

    CIDEr-D(c, S) = 10/|S| Σ_s e^(-δ²/2σ²) · mean_k=1..4 Σ_g min(g_k(c), g_k(s))·g_k(s) / (‖g_k(c)‖‖g_k(s)‖)

the quotient taken only when both norms are non-zero (else the numerator, which is then 0).

**pycocoevalcap's quirks**, reproduced or noted: (1) the "length" in δ counts *bigrams*: ``counts2vec``
adds term frequencies where ``n == 1`` with ``n = len(ngram) - 1``, i.e. ``max(0, words - 1)``. It never
changes a score: when both sentences have words δ is the difference of their word counts, and when one
is empty its vectors are zero and so is the score (the tests compare with the paper's word counts).
(2) ``Cider(n=...)`` cooks 1..4-grams whatever n is (``cook_refs``/``cook_test`` are called without it):
n < 4 crashes with an IndexError, n > 4 averages in zeros. Here ``n`` ≤ 4 means orders 1..n. (3)
``Cider`` counts df over the references of the images it is given and uses log(number of those images):
a score depends on the other images of the call, and one image alone always scores 0.

**Layout.** Every k-gram is one int64 key (:func:`ngram_key`). Per order, candidates ``[N, T]`` and
references ``[B, R, L]`` become key tensors of fixed shape; term frequencies and first occurrences come
from ``[T, T]`` equalities inside each sentence, each candidate n-gram's count in each reference of its
image from one ``[N, R, n, T, L]`` equality. Static shapes, no sort, no branch; cheap because captions
are short (≤ 20 words prepared, 16 in SCST): the cost grows as N·R·T·L and not with the vocabulary.
Reference vectors are computed once per image, not per sample. The idf of a key comes from a
``tf.lookup.StaticHashTable`` (int64 → float64): measured here, 35k lookups in a 2M-key table took
0.56 ms against 10.8 ms for ``tf.searchsorted`` on the sorted keys (7.7 ms searching fences first: a
search in a large array is a chain of cache misses). The table lives on the host CPU (TensorFlow places
lookups there; with GPUs that is ~0.3 MB each way per step); no XLA (``jit_compile``) or TPU, for the
table and the ragged references. Maths is float64, the result float32 (pycocoevalcap's to < 1e-6).

**Speed** (:func:`benchmark`; the table there): a few milliseconds for 300 candidates; on this
project's 2-core CPU about 2% of an SCST step (decoding S samples and a greedy caption, the reward, the
policy gradient) of Show and Tell from cached features, for the shapes and COCO sizes alike.
"""

from __future__ import annotations

import time

import numpy as np
import tensorflow as tf

from captioning.errors import InputError
from captioning.train.document_frequencies import (DocumentFrequencies, document_frequencies,
                                                   frequencies_from_split, max_vocab_size, ngram_key)
from captioning.vocab import END_ID, PAD_ID

# CiderD.scores' arguments for tf.function(input_signature=...): any N, T, B, R, L with one trace
SIGNATURE = [tf.TensorSpec([None, None], tf.int32), tf.TensorSpec([None], tf.int32),
             tf.RaggedTensorSpec([None, None, None], tf.int32, ragged_rank=2), tf.TensorSpec([None], tf.int32)]

__all__ = ["CiderD", "DocumentFrequencies", "SIGNATURE", "benchmark", "caption_lengths", "document_frequencies",
           "frequencies_from_split", "max_vocab_size", "ngram_key", "rebased", "words_of"]


def rebased(keys: np.ndarray, base: int, new_base: int, n: int) -> np.ndarray:
    """The :func:`ngram_key` keys of n-grams up to order ``n`` in ``base`` written in ``new_base`` (≥ ``base``): the
    same n-grams' keys for a larger vocabulary.

    >>> rebased(np.array([ngram_key([4], 10), ngram_key([4, 5], 10)]), 11, 13, 2).tolist() == [
    ...     ngram_key([4], 12), ngram_key([4, 5], 12)]
    True
    """
    if new_base == base:
        return keys
    out, rest, place = np.zeros_like(keys), keys.copy(), 1
    for _ in range(n):  # least significant digit first; a shorter n-gram's higher digits are 0
        out += (rest % base) * place
        rest //= base
        place *= new_base
    return out


def caption_lengths(ids) -> tf.Tensor:
    """Words before the first ``<end>`` or ``<pad>`` of each row of ``ids`` ``[N, T]`` (sampled captions).

    >>> caption_lengths(tf.constant([[4, 5, 2, 6], [4, 0, 0, 0], [2, 4, 4, 4], [4, 4, 4, 4]])).numpy()
    array([2, 1, 0, 4], dtype=int32)
    """
    ids = tf.convert_to_tensor(ids)
    stop = tf.logical_or(tf.equal(ids, END_ID), tf.equal(ids, PAD_ID))
    return tf.reduce_sum(tf.cast(tf.equal(tf.cumsum(tf.cast(stop, tf.int32), axis=1), 0), tf.int32), axis=1)


def words_of(caption_ids: tf.RaggedTensor) -> tf.RaggedTensor:
    """Reference captions as the records hold them (``[B, (C), (T)]``, ``<start> … <end>``) → word ids only."""
    return caption_ids[:, :, 1:-1]


class CiderD:
    """CIDEr-D of candidate captions against references, in TensorFlow ops (see the module docstring).

    ``frequencies``: the document frequencies (orders up to at least ``n``); word ids must be below their
    ``vocab_size``. Build it once, outside the step; :meth:`scores` traces into any ``tf.function``.

    Two samples of image 0 and two of image 1, with the document frequencies of three images' references
    (as pycocoevalcap's ``Cider`` counts them when it scores these three images; its scores for "4 5 6" of
    image 0 and "7 8" of image 1 are 5.8145 and 5.0)::

    >>> df = document_frequencies([[[4, 5, 6], [4, 5]], [[7, 8]], [[6]]], vocab_size=10)
    >>> refs = tf.ragged.constant([[[4, 5, 6], [4, 5]], [[7, 8]]])  # images 0 and 1
    >>> samples = tf.constant([[4, 5, 6], [4, 5, 0], [7, 8, 0], [0, 0, 0]])
    >>> CiderD(df).scores(samples, caption_lengths(samples), refs, image_index=[0, 0, 1, 1]).numpy().round(4)
    array([5.8145, 4.5645, 5.    , 0.    ], dtype=float32)
    """

    def __init__(self, frequencies: DocumentFrequencies, n: int = 4, sigma: float = 6.0, extra_ids: int = 0):
        if not 1 <= n <= frequencies.n:
            raise InputError(f"CIDEr-D of n-grams up to {n} needs document frequencies of orders 1..{n}; "
                             f"these have 1..{frequencies.n}")
        # extra_ids: word ids from the frequencies' vocabulary size on, which no reference holds (a subword
        # tokenizer's unknown words, captioning.train.reward_words): the keys' base grows by as much
        self.n, self.sigma, self.vocab_size = n, float(sigma), frequencies.vocab_size + extra_ids
        if self.vocab_size > max_vocab_size(n):
            raise InputError(f"{frequencies.vocab_size} words and {extra_ids} more do not pack n-grams up to {n} "
                             f"into int64 keys (at most {max_vocab_size(n)})")
        self._base = self.vocab_size + 1
        log_documents = np.log(float(frequencies.num_documents))  # pycocoevalcap's ref_len
        keep = frequencies.keys < (frequencies.vocab_size + 1) ** n
        keys = rebased(frequencies.keys[keep], frequencies.vocab_size + 1, self._base, n)
        idf = log_documents - np.log(np.maximum(1.0, frequencies.counts[keep].astype(np.float64)))
        # an n-gram in no document has df 0 → log(max(1, 0)) = 0: the idf is log(documents)
        self._table = tf.lookup.StaticHashTable(tf.lookup.KeyValueTensorInitializer(
            tf.constant(keys, tf.int64), tf.constant(idf, tf.float64)), float(log_documents))

    def _ngrams(self, ids, lengths, invalid: int):
        """``ids [M, T]``, ``lengths [M]`` → keys ``int64 [M, n, T]`` (position p holds the k-gram starting there;
        ``invalid`` where it does not fit) and that mask."""
        width = tf.shape(ids)[1]
        position = tf.range(width, dtype=tf.int64)[tf.newaxis, :]
        lengths = lengths[:, tf.newaxis]
        digits = tf.pad(tf.where(position < lengths, ids + 1, 0), [[0, 0], [0, self.n - 1]])
        key, keys, valid = digits[:, :width], [], []
        for k in range(1, self.n + 1):
            if k > 1:
                key = key * self._base + digits[:, k - 1:k - 1 + width]
            fits = position + k <= lengths
            keys.append(tf.where(fits, key, tf.constant(invalid, tf.int64)))
            valid.append(fits)
        return tf.stack(keys, axis=1), tf.stack(valid, axis=1)

    def _vector(self, keys, valid):
        """Per position ``[M, n, T]``: its n-gram's count in the sentence, whether it is the first occurrence,
        its idf; and the per-order L2 norms of the tf-idf vectors ``[M, n]``."""
        same = tf.equal(keys[..., :, tf.newaxis], keys[..., tf.newaxis, :])  # [M, n, T, T]
        width = tf.shape(keys)[-1]
        earlier = tf.range(width)[tf.newaxis, :] < tf.range(width)[:, tf.newaxis]  # [p, q]: q < p
        first = tf.logical_and(valid, tf.logical_not(tf.reduce_any(tf.logical_and(same, earlier), axis=-1)))
        term_frequency = tf.cast(tf.reduce_sum(tf.cast(same, tf.int32), axis=-1), tf.float64)
        idf = self._table.lookup(keys)
        weight = tf.where(first, term_frequency * idf, tf.zeros_like(idf))
        return term_frequency, first, idf, tf.sqrt(tf.reduce_sum(tf.square(weight), axis=-1))

    def scores(self, candidates, candidate_lengths, references: tf.RaggedTensor, image_index=None) -> tf.Tensor:
        """CIDEr-D of each candidate, float32 ``[N]``.

        ``candidates``: int32/int64 word ids ``[N, T]`` (what follows ``candidate_lengths`` ``[N]`` is
        ignored; :func:`caption_lengths` finds them in sampled ids). ``references``: ragged word ids
        ``[B, (R), (L)]`` (:func:`words_of` strips the records' ``<start>``/``<end>``). ``image_index``
        ``[N]``: candidate i is scored against ``references[image_index[i]]`` (SCST: S samples of each of
        B images, references once per image); when None, B == N and candidate i has references i. An
        image with no reference scores 0.
        """
        if not isinstance(references, tf.RaggedTensor) or references.ragged_rank != 2:
            raise InputError("references must be a tf.RaggedTensor [images, (references), (words)] of ragged rank 2")
        candidates = tf.cast(candidates, tf.int64)
        lengths = tf.clip_by_value(tf.cast(candidate_lengths, tf.int64), 0, tf.shape(candidates, tf.int64)[1])
        index = tf.range(tf.shape(candidates)[0]) if image_index is None else tf.cast(image_index, tf.int32)
        references = tf.cast(references, tf.int64)
        checks = [tf.debugging.assert_non_negative(values, message="word ids must not be negative")
                  for values in (candidates, references.flat_values)]
        checks += [tf.debugging.assert_less(values, tf.constant(self.vocab_size, tf.int64), message=(
            f"word ids must be below the document frequencies' vocabulary size {self.vocab_size}"))
            for values in (candidates, references.flat_values)]
        with tf.control_dependencies(checks):
            ids = references.to_tensor()  # [B, R, L]
        images, slots, width = tf.unstack(tf.shape(ids))
        ref_lengths = tf.cast(tf.reshape(references.row_lengths(axis=2).to_tensor(), [-1]), tf.int64)
        ref_keys, ref_valid = self._ngrams(tf.reshape(ids, [images * slots, width]), ref_lengths, -2)
        ref_norm = self._vector(ref_keys, ref_valid)[-1]
        keys, valid = self._ngrams(candidates, lengths, -1)
        counts, first, idf, norm = self._vector(keys, valid)
        # each candidate n-gram's count in each reference of its image: [N, R, n, T, L] → [N, R, n, T]
        ref_keys = tf.gather(tf.reshape(ref_keys, [images, slots, self.n, width]), index)
        matches = tf.equal(keys[:, tf.newaxis, :, :, tf.newaxis], ref_keys[:, :, :, tf.newaxis, :])
        in_ref = tf.cast(tf.reduce_sum(tf.cast(matches, tf.int32), axis=-1), tf.float64)
        # Σ_g min(tf_c·idf, tf_s·idf) · tf_s·idf over the candidate's distinct n-grams
        idf = idf[:, tf.newaxis]
        clipped = tf.minimum(counts[:, tf.newaxis] * idf, in_ref * idf) * (in_ref * idf)
        numerator = tf.reduce_sum(tf.where(first[:, tf.newaxis], clipped, tf.zeros_like(clipped)), axis=-1)
        ref_norm = tf.gather(tf.reshape(ref_norm, [images, slots, self.n]), index)  # [N, R, n]
        norms = norm[:, tf.newaxis] * ref_norm
        both = tf.logical_and(norm[:, tf.newaxis] > 0, ref_norm > 0)
        similarity = tf.where(both, numerator / tf.where(both, norms, tf.ones_like(norms)), numerator)
        # pycocoevalcap's "length": the number of bigrams, max(0, words - 1)
        ref_bigrams = tf.gather(tf.reshape(tf.maximum(ref_lengths - 1, 0), [images, slots]), index)
        delta = tf.cast(tf.maximum(lengths - 1, 0)[:, tf.newaxis] - ref_bigrams, tf.float64)
        penalty = tf.exp(-tf.square(delta) / (2.0 * self.sigma ** 2))  # [N, R]
        total = tf.reduce_sum(tf.reduce_mean(similarity, axis=-1) * penalty, axis=-1)
        count = tf.cast(tf.maximum(tf.gather(references.row_lengths(), index), 1), tf.float64)
        return tf.cast(10.0 * total / count, tf.float32)


def benchmark(images: int = 50, samples: int = 5, references: int = 5, length: int = 16, vocab_size: int = 10_000,
              table_keys: int = 2_000_000, rounds: int = 20, seed: int = 0) -> dict:
    """Times :meth:`CiderD.scores` in a ``tf.function`` on random captions: ``images`` × (``samples`` + 1
    greedy) candidates of ``length`` words against ``references`` references of ``length`` words each,
    document frequencies of ``table_keys`` random keys. Returns ``{"ms": best of rounds, "candidates"}``.
    Not a test; e.g. ``python -c "from captioning.train.cider import benchmark; print(benchmark())"``.

    Measured on 2 cores of an ``AMD EPYC`` VM (lscpu: family 25 model 17, AVX-512; TensorFlow 2.21 CPU),
    best of 20 while other jobs shared the cores. Defaults: 50 images × (5 samples + 1 greedy) = 300
    candidates, 5 references, 16 words, 10k words, 2M keys; each line changes one thing:

    ==============================  ============
    setting                         ms per call
    ==============================  ============
    defaults (300 candidates)       5.1
    60 / 1,200 candidates           1.8 / 16.4
    10 / 20 references              8.3 / 13.1
    8 / 30 words (T = L)            3.6 / 12.6
    vocabulary 1k / 50k             5.1 / 5.4
    table of 10k / 6M keys          4.9 / 5.3
    ==============================  ============

    So: linear in candidates and in references (plus ~1 ms of fixed per-call cost), about T·L in the
    caption lengths, flat in the vocabulary and the table's size (hash lookups). Against a whole SCST
    step of Show and Tell from cached features (sampling 16 words for S×B captions and greedy for B, the
    reward, the policy-gradient forward and backward; step timed side by side): shapes sizes (13 images
    × 5 samples, LSTM 256, 53 words) 100 ms a step, reward 2.0 ms (2.0%); COCO sizes (50 images × 5,
    LSTM 512, 10k words) 3.2 s a step, reward 5.1 ms (0.2%).
    """
    rng = np.random.default_rng(seed)
    keys = np.unique(rng.integers(1, (vocab_size + 1) ** 4, table_keys, dtype=np.int64))
    frequencies = DocumentFrequencies(keys, rng.integers(1, 1000, keys.size, dtype=np.int64), 113_287, vocab_size)
    scorer = CiderD(frequencies)
    words = np.minimum(rng.zipf(1.3, size=(images, references + samples + 1, length)) + 3, vocab_size - 1)
    refs = tf.RaggedTensor.from_tensor(tf.constant(words[:, :references], tf.int32), ragged_rank=2)
    candidates = tf.constant(words[:, references:].reshape(-1, length), tf.int32)
    lengths = tf.fill([candidates.shape[0]], length)
    index = tf.constant(np.repeat(np.arange(images), samples + 1), tf.int32)
    fn = tf.function(scorer.scores, input_signature=SIGNATURE, autograph=False)
    fn(candidates, lengths, refs, index).numpy()
    best = float("inf")
    for _ in range(rounds):
        start = time.perf_counter()
        fn(candidates, lengths, refs, index).numpy()
        best = min(best, time.perf_counter() - start)
    return {"ms": round(best * 1000, 3), "candidates": int(candidates.shape[0])}
