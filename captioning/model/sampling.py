"""Sampling captions from a decoder (``decode.method: sample``): :func:`sample_search` draws each caption word
by word from the model's distribution, reshaped by :func:`filtered` (temperature, top-k, then top-p over the
renormalised top k, as Hugging Face orders them), with the blocking rules and ``min_length`` of
:mod:`captioning.model.word_rules`, and returns captions in
:func:`captioning.model.decode.beam_search`'s format. Draws are seeded per image
(:func:`_uniform`), so an image's samples never depend on its batch. :func:`captioning.model.decode.generate`
calls it."""

from __future__ import annotations

import tensorflow as tf

from captioning.model.search_tools import never_proposed, one_loop
from captioning.model.word_rules import DEAD as _DEAD
from captioning.model.word_rules import blocked_words, end_banned
from captioning.vocab import END_ID, START_ID


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
        logp = tf.nn.log_softmax(tf.where(logp < kth, _DEAD, logp))  # renormalised over the top k
    if top_p < 1.0:
        order = tf.argsort(logp, direction="DESCENDING", stable=True)
        sorted_p = tf.exp(tf.gather(logp, order, batch_dims=1))
        before = tf.cumsum(sorted_p, axis=1, exclusive=True)  # probability of the more likely words
        keep_sorted = before < top_p
        keep = tf.scatter_nd(tf.stack([tf.repeat(tf.range(tf.shape(order)[0]), vocab), tf.reshape(order, [-1])], 1),
                             tf.reshape(keep_sorted, [-1]), tf.shape(order))
        logp = tf.where(keep, logp, _DEAD)
    return tf.nn.log_softmax(logp)


def sample_search(model, initial_state, max_length: int = 20, samples: int = 1, temperature: float = 1.0,
                  sample_top_k: int = 0, sample_top_p: float = 1.0, seed: int = 0, keys=None, block_ngrams: int = 0,
                  bad_endings=(), min_length: int = 0) -> dict:
    """``samples`` captions per image drawn from the model (:func:`filtered`: temperature, top-k, top-p; the
    blocking rules and ``min_length`` of :func:`beam_search` apply too), as :func:`beam_search` returns them, most
    likely first:
    ``log_probs`` and ``scores`` are the captions' log-probabilities under the model itself (temperature 1,
    unfiltered). Seeded: ``keys [B]`` (int64, e.g. image ids or a hash of the image's bytes) name the images, and
    the same ``seed`` and keys give the same captions under any batch size and order."""
    steps, n = max_length, samples
    state = model.reserve(initial_state, steps)
    batch = tf.shape(tf.nest.flatten(state)[0])[0]
    keys = tf.zeros([batch], tf.int64) if keys is None else tf.cast(keys, tf.int64)
    rows = batch * n
    state = tf.nest.map_structure(lambda s: tf.repeat(s, n, axis=0), state)
    row_keys = tf.stack([tf.repeat(keys, n), tf.tile(tf.range(n, dtype=tf.int64), [batch])], axis=1)
    vocab = model.vocab_size
    never = never_proposed(vocab, 0)[0]  # <pad>, <start>, <unk>
    attends = model.attends

    def one_step(v):
        t = v["t"]
        logits, state = model.step(v["tokens"], v["state"])
        model_logp = tf.nn.log_softmax(tf.cast(logits, tf.float32))
        logp = model_logp + never
        if min_length:
            logp += end_banned(vocab, t, min_length)
        if block_ngrams or bad_endings:
            logp += blocked_words(v["ids"], t, vocab, block_ngrams, bad_endings) * _DEAD
        cdf = tf.cumsum(tf.exp(filtered(logp, temperature, sample_top_k, sample_top_p)), axis=1)
        u = _uniform(seed, row_keys, t)
        word = tf.minimum(tf.reduce_sum(tf.cast(cdf < u[:, None] * cdf[:, -1:], tf.int32), axis=1), vocab - 1)
        is_word = v["going"] & tf.not_equal(word, END_ID)
        out = {"t": t + 1, "state": state, "tokens": word, "going": is_word,
               "ids": v["ids"] + tf.where(is_word, word, 0)[:, None] * tf.one_hot(t, steps, dtype=tf.int32)[None, :],
               "lengths": v["lengths"] + tf.cast(is_word, tf.int32), "attention": v["attention"],
               # as beam search reports it
               "log_prob": v["log_prob"] + tf.where(v["going"], tf.gather(model_logp, word, batch_dims=1), 0.0)}
        if attends:
            weights = tf.cast(state["attention"], tf.float32) * tf.cast(is_word, tf.float32)[:, None]
            out["attention"] += weights[:, None, :] * tf.one_hot(t, steps)[None, :, None]
        return out

    loop = one_loop(lambda v: v["t"] < steps, one_step, {
        "t": tf.constant(0), "state": state, "tokens": tf.fill([rows], tf.constant(START_ID, tf.int32)),
        "ids": tf.zeros([rows, steps], tf.int32), "going": tf.ones([rows], tf.bool),
        "lengths": tf.zeros([rows], tf.int32), "log_prob": tf.zeros([rows]),
        "attention": tf.zeros([rows, steps, tf.shape(state["attention"])[1]]) if attends else tf.zeros([0])})
    ids, lengths, log_prob, attention = (loop[key] for key in ("ids", "lengths", "log_prob", "attention"))
    out = {"ids": tf.reshape(ids, [batch, n, steps]), "lengths": tf.reshape(lengths, [batch, n]),
           "log_probs": tf.reshape(log_prob, [batch, n])}
    if attends:
        out["attention"] = tf.reshape(attention, [batch, n, steps, -1])
    out["scores"] = out["log_probs"]
    _, order = tf.math.top_k(out["scores"], k=n)  # most likely first
    return {k: tf.gather(v, order, batch_dims=1) for k, v in out.items()}
