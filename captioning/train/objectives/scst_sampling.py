"""Sampling for self-critical training (:mod:`captioning.train.objectives.scst` says how SCST uses it):
captions drawn with a decoder's own step, scored again in one teacher-forced pass, decoded greedily, and a
grouped batch's references. The draws are a function of the seed, the step and the row of the *global*
batch, so every replica count draws the same captions."""

from __future__ import annotations

import tensorflow as tf

from captioning.model.base import pad_rows
from captioning.model.decode import beam_search
from captioning.model.sampling import GivenDraws
from captioning.model.search_loop import search
from captioning.model.word_rules import DEAD
from captioning.vocab import END_ID, PAD_ID, START_ID


def references_of(batch: dict, end_token: bool = False) -> tf.RaggedTensor:
    """A grouped batch's references as word ids ``[images, (captions), (words)]``: each caption's target
    ids without padding (and without their final ``<end>`` unless ``end_token``), grouped by
    ``image_index``."""
    lengths = tf.cast(tf.reduce_sum(batch["mask"], axis=1), tf.int32) - (0 if end_token else 1)
    words = tf.RaggedTensor.from_tensor(tf.cast(batch["target_ids"], tf.int32), lengths=tf.maximum(lengths, 0))
    images = tf.shape(batch[next(key for key in ("image", "features", "regions") if key in batch)])[0]
    return tf.RaggedTensor.from_value_rowids(words, tf.cast(batch["image_index"], tf.int64),
                                             nrows=tf.cast(images, tf.int64))


def _global_rows(rows):
    """(this replica's first row in the global batch, the global batch's rows)."""
    ctx = tf.distribute.get_replica_context()
    replicas = ctx.num_replicas_in_sync
    mine = tf.one_hot(ctx.replica_id_in_sync_group, replicas, dtype=tf.int32) * rows
    counts = ctx.all_reduce(tf.distribute.ReduceOp.SUM, mine) if replicas > 1 else mine
    return tf.reduce_sum(counts * tf.cast(tf.range(replicas) < ctx.replica_id_in_sync_group, tf.int32)), \
        tf.reduce_sum(counts)


def sample_captions(model, state, max_length: int, temperature: float, seed, xla: bool = False) -> dict:
    """``state``'s rows decoded by sampling (see the module docstring; the
    :class:`~captioning.model.sampling.GivenDraws` strategy of the one word-by-word loop); ``seed`` is an int32
    ``[2]`` for the step. Returns ``{"ids": int32 [rows, max_length] (words, then <end> or <pad>), "log_prob":
    float32 [rows] (summed over the words and the <end>, differentiable), "ended": bool [rows]}``.

    ``xla`` (``scst.xla_sampling``) compiles the loop with XLA, to draw without gradient: a step of a small
    decoder is dozens of small ops, whose dispatch XLA fuses away (the shapes Transformer's 20 steps for 65
    rows: 71.7 → 19.0 ms on 2 CPU cores, benchmarks/RESULTS.md). Then there is no ``log_prob``
    (:func:`sequence_log_prob` scores the ids): the compiled call returns integers only, which a gradient
    tape does not follow into the loop. The uniform numbers are drawn before the loop, so the samples are
    the same either way (tested)."""
    state = model.reserve(state, max_length)
    rows = tf.shape(tf.nest.flatten(state)[0])[0]
    offset, total = _global_rows(rows)
    uniforms = tf.stack([tf.random.stateless_uniform([total], seed=tf.random.experimental.stateless_fold_in(seed, t))
                         for t in range(max_length)])[:, offset:offset + rows]  # [max_length, rows]

    def draw(state, uniforms):
        return search(model, state, GivenDraws(model, max_length, temperature, uniforms), max_length)[0]

    if not xla:
        return draw(state, uniforms)
    integers = tf.function(lambda state, uniforms: {k: v for k, v in draw(state, uniforms).items() if k != "log_prob"},
                           jit_compile=True, autograph=False)
    padded = tf.maximum(rows, 1)  # a decoder never sees an empty batch (an empty replica's share)
    out = integers(tf.nest.map_structure(lambda s: pad_rows(s, padded), state),
                   tf.transpose(pad_rows(tf.transpose(uniforms), padded)))
    return {k: v[:rows] for k, v in out.items()}


def sequence_log_prob(model, state, ids, temperature: float):
    """The summed log-probability ``float32 [rows]`` of each row's caption ``ids [rows, T]`` (words, then
    ``<end>`` or ``<pad>``, as :func:`sample_captions` draws them) under ``softmax(logits / temperature)``
    with ``<pad>`` and ``<start>`` excluded, over its words and its ``<end>``: one teacher-forced pass from
    ``state`` (a Transformer's is parallel over the words), differentiable. It equals the log-probability
    the sampling loop adds up (the decoder contract: stepping equals teacher forcing; tested). The pass stops
    at the longest caption's ``<end>``: the padding after it counts for nothing (a trained model's samples
    end long before ``scst.max_length``)."""
    # the words up to and with the first <end>
    counted = tf.equal(tf.cumsum(tf.cast(tf.equal(ids, END_ID), tf.int32), axis=1, exclusive=True), 0)
    longest = tf.maximum(tf.reduce_max(tf.reduce_sum(tf.cast(counted, tf.int32), axis=1)), 1)
    ids, counted = ids[:, :longest], counted[:, :longest]
    rows = tf.shape(ids)[0]
    inputs = tf.concat([tf.fill([rows, 1], START_ID), ids[:, :-1]], axis=1)
    padded = tf.maximum(rows, 1)  # a decoder never sees an empty batch (an empty replica's share)
    state = tf.nest.map_structure(lambda s: pad_rows(s, padded), state)
    logits, _ = model.teacher_forced(state, pad_rows(inputs, padded), training=False)
    never = tf.reduce_sum(tf.one_hot([PAD_ID, START_ID], model.vocab_size), axis=0) * DEAD
    logp = tf.nn.log_softmax(tf.cast(logits[:rows], tf.float32) / temperature + never)
    chosen = tf.gather(logp, ids, batch_dims=2)
    return tf.reduce_sum(tf.where(counted, chosen, 0.0), axis=1)


def as_drawn(ids, lengths) -> tf.Tensor:
    """Captions of a beam search (``ids [rows, max_length]``, words only, and their ``lengths``) written as
    :func:`sample_captions` draws them: the words, then ``<end>`` where the caption chose it (it is shorter
    than ``max_length``: beam search keeps a caption that reached ``max_length`` words without one), then
    ``<pad>``. A greedy caption in this form is scored exactly as a sample that chose the same words.

    >>> as_drawn(tf.constant([[5, 6, 0], [5, 6, 7]]), tf.constant([2, 3])).numpy()
    array([[5, 6, 2],
           [5, 6, 7]], dtype=int32)
    """
    ids, lengths = tf.cast(ids, tf.int32), tf.cast(lengths, tf.int32)
    place = tf.range(tf.shape(ids)[1])[None, :]
    return tf.where(place < lengths[:, None], ids, tf.where(place == lengths[:, None], END_ID, PAD_ID))


def greedy_captions(model, state, max_length: int) -> tf.Tensor:
    """Greedy ids ``int32 [rows, max_length]`` as :func:`sample_captions` draws them (words, then ``<end>``
    if the caption chose it, then ``<pad>``: :func:`as_drawn`), without gradient."""
    state = tf.nest.map_structure(tf.stop_gradient, state)
    best = beam_search(model, None, beam_size=1, max_length=max_length, initial_state=state)
    return as_drawn(best["ids"][:, 0], best["lengths"][:, 0])
