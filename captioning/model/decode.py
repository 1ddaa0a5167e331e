"""Turning a trained model's step function into captions: batched beam search (greedy is beam size 1).

It runs for a whole batch of images at once inside TensorFlow (wrap them in ``tf.function``), calling
the decoder's ``step`` (:class:`captioning.model.CaptionModel`) once per word for all beams of all images
together. The decoder's state is any nest of batch-major tensors: every tensor of it is repeated per beam
and reordered with the beams, so any decoder works unchanged. im2txt ran its beam search in Python, one
session call per step and one image at a time (~0.3 s per image).

Beam search, as im2txt defined it (so that a beam of 1 is exactly greedy decoding):

* each live caption is extended only by its ``beam_size`` most likely next words (im2txt's later code
  expanded almost the whole vocabulary by mistake); ``<pad>`` and ``<start>`` are never proposed;
* an extension by ``<end>`` completes the caption; the ``beam_size`` best other extensions stay live;
* live captions that reach ``max_length`` words without ``<end>`` are complete at that length;
* complete captions are ranked by ``log_prob / length ** length_normalization`` (``length`` counts the
  ``<end>`` token; factor 0, the default, ranks by the summed log-probability itself).

Worked example (beam 2): if after "a" the model gives ``red`` -0.2, ``<end>`` -1.9, ``big`` -2.3, the
live captions become "a red" and "a big" (``<end>`` is not among this caption's top 2 words, so "a" does
not complete here).
"""

from __future__ import annotations

import tensorflow as tf

from captioning.vocab import END_ID, PAD_ID, START_ID

_DEAD = -1e9  # the score of an empty beam slot (finite, so arithmetic never makes NaN)


def _merge(best, candidates, n: int):
    """Keeps the ``n`` best of two sets of complete captions (dicts of [B, M, ...] tensors)."""
    joined = {k: tf.concat([best[k], candidates[k]], axis=1) for k in best}
    _, index = tf.math.top_k(joined["scores"], k=n)
    return {k: tf.gather(v, index, batch_dims=1) for k, v in joined.items()}


def beam_search(model, features, beam_size: int = 3, max_length: int = 20, length_normalization: float = 0.0,
                top_k: int = 1, initial_state=None) -> dict:
    """Captions for a batch of encoder ``features`` ``[B, D]`` (or from the decoder's ``initial_state``
    for them, when given; ``features`` is then unused).

    Returns ``{"ids": int32 [B, top_k, max_length] (words only, 0-padded), "lengths": int32 [B, top_k]
    (words), "log_probs": float32 [B, top_k] (summed log-probabilities of the words and of <end> when the
    caption completed), "scores": float32 [B, top_k] (the ranking score)}``, best first. A decoder that
    ``attends`` (its state a dict whose ``attention`` entry holds the weights of the step just taken,
    ``[B, G]``) also gets ``"attention": float32 [B, top_k, max_length, G]``: for each word of each caption, the weights
    it was chosen with (kept per beam and reordered with the beams; zeros after the caption's end).
    """
    if not 1 <= top_k <= beam_size:
        raise ValueError(f"top_k must be between 1 and beam_size ({beam_size}), got {top_k}")
    k, n, steps = beam_size, top_k, max_length
    if initial_state is None:
        initial_state = model.initial_state(features, training=False)
    initial_state = model.reserve(initial_state, steps)  # room for the words' cached keys and values
    batch = tf.shape(tf.nest.flatten(initial_state)[0])[0]
    vocab = model.vocab_size
    kw = min(k, vocab)  # words proposed per live caption
    # every state tensor [B*K, ...]: image-major, beam-minor
    state = tf.nest.map_structure(lambda s: tf.repeat(s, k, axis=0), initial_state)
    state_shapes = tf.nest.map_structure(lambda s: tf.TensorShape([None]).concatenate(s.shape[1:]), state)
    tokens = tf.fill([batch * k], tf.constant(START_ID, tf.int32))
    alive_logp = tf.tile(tf.constant([[0.0] + [_DEAD] * (k - 1)]), [batch, 1])  # one live beam at first
    alive_ids = tf.zeros([batch, k, steps], tf.int32)
    done = {"ids": tf.zeros([batch, n, steps], tf.int32), "lengths": tf.zeros([batch, n], tf.int32),
            "log_probs": tf.fill([batch, n], _DEAD), "scores": tf.fill([batch, n], _DEAD)}
    never = tf.reduce_sum(tf.one_hot([PAD_ID, START_ID], vocab), axis=0) * _DEAD  # words never proposed
    rows = tf.range(batch)[:, None] * k
    attends = model.attends
    if attends:  # the weights behind each word of each live caption
        cells = tf.shape(state["attention"])[1]
        alive_attention = tf.zeros([batch, k, steps, cells])
        done["attention"] = tf.zeros([batch, n, steps, cells])
    else:
        alive_attention = tf.zeros([0])

    for t in tf.range(steps):
        tf.autograph.experimental.set_loop_options(
            shape_invariants=list(zip(tf.nest.flatten(state), tf.nest.flatten(state_shapes))))
        logits, state = model.step(tokens, state)
        if attends:  # word t of every live caption is chosen with this step's weights
            weights = tf.reshape(tf.cast(state["attention"], tf.float32), [batch, k, 1, cells])
            alive_attention = alive_attention + weights * tf.one_hot(t, steps)[None, None, :, None]
        logp = tf.nn.log_softmax(tf.cast(logits, tf.float32)) + never
        top_logp, top_words = tf.math.top_k(tf.reshape(logp, [batch, k, vocab]), k=kw)  # [B, K, kw]
        total = alive_logp[:, :, None] + top_logp
        is_end = tf.equal(top_words, END_ID)
        alive_mask = alive_logp[:, :, None] > _DEAD / 2
        # complete captions: live beams whose top words include <end>
        end_logp = tf.where(is_end & alive_mask, total, _DEAD)
        end_logp = tf.reduce_max(end_logp, axis=2)  # at most one <end> per beam
        length = tf.cast(t + 1, tf.float32)  # t words + <end>
        finished = {"ids": alive_ids, "lengths": tf.fill([batch, k], t),
                    "log_probs": end_logp,
                    "scores": tf.where(end_logp > _DEAD / 2, end_logp / length ** length_normalization, _DEAD)}
        if attends:  # its t words, without the weights <end> was chosen with
            finished["attention"] = alive_attention * tf.cast(tf.range(steps) < t, tf.float32)[None, None, :, None]
        done = _merge(done, finished, n)
        # live captions: the best K extensions by a word other than <end>
        flat = tf.reshape(tf.where(is_end | ~alive_mask, _DEAD, total), [batch, k * kw])
        alive_logp, index = tf.math.top_k(flat, k=k)
        parent = index // kw
        words = tf.gather(tf.reshape(top_words, [batch, k * kw]), index, batch_dims=1)
        alive_ids = tf.gather(alive_ids, parent, batch_dims=1)
        alive_ids = alive_ids + words[:, :, None] * tf.one_hot(t, steps, dtype=tf.int32)[None, None, :]
        if attends:
            alive_attention = tf.gather(alive_attention, parent, batch_dims=1)
        state = tf.nest.map_structure(lambda s: tf.gather(s, tf.reshape(rows + parent, [-1])), state)
        tokens = tf.reshape(words, [-1])

    # live captions that reached max_length words complete there
    truncated = {"ids": alive_ids, "lengths": tf.fill([batch, k], steps), "log_probs": alive_logp,
                 "scores": tf.where(alive_logp > _DEAD / 2,
                                    alive_logp / float(steps) ** length_normalization, _DEAD)}
    if attends:
        truncated["attention"] = alive_attention
    return _merge(done, truncated, n)


def ids_to_text(vocab, ids, lengths) -> list[list[str]]:
    """Captions as strings from :func:`beam_search`'s ``ids`` and ``lengths`` (numpy or tensors)."""
    ids, lengths = getattr(ids, "numpy", lambda: ids)(), getattr(lengths, "numpy", lambda: lengths)()
    return [[" ".join(vocab.words[w] for w in row[:length]) for row, length in zip(image_ids, image_lengths)]
            for image_ids, image_lengths in zip(ids, lengths)]
