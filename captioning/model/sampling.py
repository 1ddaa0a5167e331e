"""Sampling captions from a decoder, two strategies of the one word-by-word loop
(:func:`captioning.model.search_loop.search`). ``decode.method: sample`` (:class:`Sampling`, :func:`sample_search`)
draws each caption word by word from the model's distribution, reshaped by :func:`filtered` (temperature, top-k,
then top-p over the renormalised top k, as Hugging Face orders them), with the blocking rules and ``min_length`` of
:mod:`captioning.model.word_rules`, and returns captions in :func:`captioning.model.decode.beam_search`'s format.
Draws are seeded per image (:func:`_uniform`), so an image's samples never depend on its batch.
:func:`captioning.model.decode.generate` calls it. SCST's draws (:class:`GivenDraws`) take their uniform numbers
from the trainer, drawn before the loop."""

from __future__ import annotations

import tensorflow as tf

from captioning.model.search_loop import Strategy, search
from captioning.model.search_tools import never_proposed
from captioning.model.word_rules import DEAD, WordRules, blocked_words, end_banned
from captioning.vocab import END_ID, PAD_ID, START_ID


def _uniform(seed: int, keys, t):
    """A uniform number in (0, 1) per row from ``seed``, the row's ``keys [N]`` (int64: its image's key and
    its sample's number) and the step ``t``: a hash of the four, so a row's draws never depend on which other
    rows share its batch."""
    text = tf.strings.join([tf.strings.as_string(tf.constant(seed, tf.int64)), tf.strings.as_string(keys[:, 0]),
                            tf.strings.as_string(keys[:, 1]), tf.strings.as_string(tf.cast(t, tf.int64))], "/")
    buckets = 2 ** 31 - 1
    return (tf.cast(tf.strings.to_hash_bucket_fast(text, buckets), tf.float32) + 0.5) / buckets


def filtered(logp, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0):
    """Log-probabilities ``[N, V]`` → the sampling distribution's log-probabilities: divided by ``temperature``,
    only the ``top_k`` most likely words kept (0: all) and renormalised over them, then the fewest most likely
    words whose probability (in that renormalised distribution, as Hugging Face's top-k then top-p order
    measures it) reaches ``top_p`` (nucleus sampling; the most likely word always stays), renormalised.

    >>> p = filtered(tf.math.log([[0.5, 0.3, 0.15, 0.05]]), top_p=0.75)
    >>> [round(float(x), 3) for x in tf.exp(p)[0]]
    [0.625, 0.375, 0.0, 0.0]
    >>> p = filtered(tf.math.log([[0.5, 0.3, 0.15, 0.05]]), top_k=2, top_p=0.6)  # 0.5 / 0.8 = 0.625 >= 0.6
    >>> [round(float(x), 3) for x in tf.exp(p)[0]]
    [1.0, 0.0, 0.0, 0.0]
    """
    logp = tf.nn.log_softmax(logp / temperature)
    vocab = logp.shape[-1]
    if top_k and top_k < vocab:
        kth = tf.math.top_k(logp, k=top_k).values[:, -1:]
        logp = tf.nn.log_softmax(tf.where(logp < kth, DEAD, logp))  # renormalised over the top k
    if top_p < 1.0:
        order = tf.argsort(logp, direction="DESCENDING", stable=True)
        sorted_p = tf.exp(tf.gather(logp, order, batch_dims=1))
        before = tf.cumsum(sorted_p, axis=1, exclusive=True)  # probability of the more likely words
        keep_sorted = before < top_p
        keep = tf.scatter_nd(tf.stack([tf.repeat(tf.range(tf.shape(order)[0]), vocab), tf.reshape(order, [-1])], 1),
                             tf.reshape(keep_sorted, [-1]), tf.shape(order))
        logp = tf.where(keep, logp, DEAD)
    return tf.nn.log_softmax(logp)


class Sampling(Strategy):
    """``samples`` rows per image, each drawn from the model (:func:`filtered`) with the rules of
    :mod:`captioning.model.word_rules`, seeded by ``seed`` and its row's key (:func:`_uniform`). Loop variables:
    ``going [rows]`` (no ``<end>`` yet), the words ``ids [rows, max_length]``, ``lengths``, the model's own summed
    ``log_prob`` (temperature 1, unfiltered, ``<end>``'s too) and the ``attention`` weights of each word kept."""

    not_compiled = "its draws hash each row's seed as text (tf.strings), which XLA has no kernel for"

    def __init__(self, model, max_length: int, samples: int = 1, temperature: float = 1.0, sample_top_k: int = 0,
                 sample_top_p: float = 1.0, seed: int = 0, keys=None, block_ngrams: int = 0, bad_endings=(),
                 min_length: int = 0, words=None):
        self.rows_per_image, self.max_length, self.keys = samples, max_length, keys
        self.vocab, self.attends = model.vocab_size, model.attends
        # over a subword tokenizer's words (words: its WordTable), in word_-keyed loop variables
        self.word_rules = WordRules.of(words, self.vocab, max_length, block_ngrams, bad_endings)
        if self.word_rules:
            block_ngrams, bad_endings = 0, ()
        self.filter = dict(temperature=temperature, top_k=sample_top_k, top_p=sample_top_p)
        self.seed, self.block_ngrams, self.bad_endings, self.min_length = seed, block_ngrams, bad_endings, min_length

    def start(self, batch, state):
        samples, rows = self.rows_per_image, batch * self.rows_per_image
        keys = tf.zeros([batch], tf.int64) if self.keys is None else tf.cast(self.keys, tf.int64)
        self.batch, self.never = batch, never_proposed(self.vocab, 0)[0]  # <pad>, <start>, <unk>
        self.row_keys = tf.stack([tf.repeat(keys, samples), tf.tile(tf.range(samples, dtype=tf.int64), [batch])], 1)
        cells = tf.shape(state["attention"])[1] if self.attends else None
        words = self.word_rules.start(rows) if self.word_rules else {}
        return {**words, "ids": tf.zeros([rows, self.max_length], tf.int32), "going": tf.ones([rows], tf.bool),
                "lengths": tf.zeros([rows], tf.int32), "log_prob": tf.zeros([rows]),
                "attention": tf.zeros([rows, self.max_length, cells]) if self.attends else tf.zeros([0])}

    def next_words(self, t, tokens, logits, state, chosen):
        model_logp = tf.nn.log_softmax(logits)
        logp = model_logp + self.never
        if self.min_length:
            logp += end_banned(self.vocab, t, self.min_length)
        if self.block_ngrams or self.bad_endings:
            logp += blocked_words(chosen["ids"], t, self.vocab, self.block_ngrams, self.bad_endings) * DEAD
        if self.word_rules:
            logp += self.word_rules.ruled_out(chosen)
        cdf = tf.cumsum(tf.exp(filtered(logp, **self.filter)), axis=1)
        draw = _uniform(self.seed, self.row_keys, t)
        word = tf.minimum(tf.reduce_sum(tf.cast(cdf < draw[:, None] * cdf[:, -1:], tf.int32), axis=1), self.vocab - 1)
        going = chosen["going"]
        is_word = going & tf.not_equal(word, END_ID)
        at_step = tf.one_hot(t, self.max_length, dtype=tf.int32)[None, :]
        out = {"going": is_word, "ids": chosen["ids"] + tf.where(is_word, word, 0)[:, None] * at_step,
               "lengths": chosen["lengths"] + tf.cast(is_word, tf.int32), "attention": chosen["attention"],
               # as beam search reports it
               "log_prob": chosen["log_prob"] + tf.where(going, tf.gather(model_logp, word, batch_dims=1), 0.0)}
        if self.word_rules:
            out.update(self.word_rules.advanced(chosen, word))
        if self.attends:
            weights = tf.cast(state["attention"], tf.float32) * tf.cast(is_word, tf.float32)[:, None]
            out["attention"] += weights[:, None, :] * tf.one_hot(t, self.max_length)[None, :, None]
        return word, out, None, tf.logical_not(tf.reduce_any(is_word))  # (no draw changes an ended row)

    def finish(self, chosen, ran):
        batch, samples, steps = self.batch, self.rows_per_image, self.max_length
        out = {"ids": tf.reshape(chosen["ids"], [batch, samples, steps]),
               "lengths": tf.reshape(chosen["lengths"], [batch, samples]),
               "log_probs": tf.reshape(chosen["log_prob"], [batch, samples])}
        if self.attends:
            out["attention"] = tf.reshape(chosen["attention"], [batch, samples, steps, -1])
        out["scores"] = out["log_probs"]
        _, order = tf.math.top_k(out["scores"], k=samples)  # most likely first
        return {key: tf.gather(value, order, batch_dims=1) for key, value in out.items()}


def sample_search(model, initial_state, max_length: int = 20, samples: int = 1, temperature: float = 1.0,
                  sample_top_k: int = 0, sample_top_p: float = 1.0, seed: int = 0, keys=None, block_ngrams: int = 0,
                  bad_endings=(), min_length: int = 0, words=None) -> dict:
    """``samples`` captions per image drawn from the model (:func:`filtered`: temperature, top-k, top-p; the
    blocking rules and ``min_length`` of :func:`beam_search` apply too), as :func:`beam_search` returns them, most
    likely first:
    ``log_probs`` and ``scores`` are the captions' log-probabilities under the model itself (temperature 1,
    unfiltered). Seeded: ``keys [B]`` (int64, e.g. image ids or a hash of the image's bytes) name the images, and
    the same ``seed`` and keys give the same captions under any batch size and order. (:class:`Sampling` in the one
    loop; ``words``: a subword tokenizer's :class:`~captioning.model.word_rules.WordTable`, for the rules over its
    words.)"""
    strategy = Sampling(model, max_length, samples, temperature, sample_top_k, sample_top_p, seed, keys, block_ngrams,
                        bad_endings, min_length, words)
    return search(model, initial_state, strategy, max_length)[0]


class GivenDraws(Strategy):
    """SCST's sampling (:func:`captioning.train.objectives.scst_sampling.sample_captions`): one row per row of the
    state, each word drawn from ``softmax(logits / temperature)`` with ``<pad>`` and ``<start>`` excluded, by the
    uniform numbers ``draws [max_length, rows]`` drawn before the loop; every step runs. Loop variables: ``going``,
    the words ``ids`` (a TensorArray a step: words, then ``<end>``, then ``<pad>``) and the summed ``log_prob`` under
    that distribution (differentiable). Its captions: ``ids [rows, max_length]``, ``log_prob``, ``ended``."""

    def __init__(self, model, max_length: int, temperature: float, draws):
        self.vocab, self.max_length, self.temperature, self.draws = model.vocab_size, max_length, temperature, draws

    def start(self, batch, state):
        self.never = tf.reduce_sum(tf.one_hot([PAD_ID, START_ID], self.vocab), axis=0) * DEAD
        rows = tf.shape(self.draws)[1]  # (its own: XLA needs the shapes of its inputs)
        return {"going": tf.ones([rows], tf.bool), "log_prob": tf.zeros([rows]),
                "ids": tf.TensorArray(tf.int32, size=self.max_length)}

    def next_words(self, t, tokens, logits, state, chosen):
        logp = tf.nn.log_softmax(logits / self.temperature + self.never)
        cdf = tf.cumsum(tf.exp(logp), axis=1)
        word = tf.minimum(tf.reduce_sum(tf.cast(cdf < self.draws[t][:, None] * cdf[:, -1:], tf.int32), axis=1),
                          self.vocab - 1)
        going = chosen["going"]
        word = tf.where(going, word, PAD_ID)
        return word, {"ids": chosen["ids"].write(t, word), "going": going & tf.not_equal(word, END_ID),
                      "log_prob": chosen["log_prob"] + tf.where(going, tf.gather(logp, word, batch_dims=1), 0.0)
                      }, None, tf.constant(False)

    def finish(self, chosen, ran):
        ids = tf.transpose(chosen["ids"].stack())
        return {"ids": ids, "log_prob": chosen["log_prob"], "ended": tf.reduce_any(tf.equal(ids, END_ID), axis=1)}
