"""Scheduled sampling (Bengio et al. 2015; ``train.scheduled_sampling``): the teacher-forced pass of a recurrent
decoder with some of its input words replaced by the model's own samples.

Teacher forcing feeds the decoder the reference's previous word at every step, but decoding feeds it its own:
a model never trained on its own mistakes meets them only at test time. :func:`mixed_teacher_forced` runs the
caption word by word with the decoder's :meth:`~captioning.model.base.CaptionModel.step` (in training mode:
dropout as in its teacher-forced pass) and, at each step ``t ≥ 1`` and for each caption independently, with
probability ``p`` feeds the word drawn from the model's distribution at step ``t − 1`` instead of the
reference's word — self-critical.pytorch's ``AttModel._forward`` with ``ss_prob``::

    step t           0          1                2                3
    reference     <start>       a               red             circle
    fed           <start>   a (1 − p)       red (1 − p)      circle (1 − p)
                            or a draw        or a draw        or a draw
                            from p(·|0)      from p(·|0..1)   from p(·|0..2)

The draw is a sample of the softmax of the previous step's logits (torch.multinomial of their exp, as
there) over the words decoding may propose (:func:`drawable`), taken without gradient: the loss
differentiates through what the model computes from the word it was fed, never through which word was
chosen. Three choices of this project where self-critical.pytorch is silent or different: ``<pad>``,
``<start>`` and ``<unk>`` are never drawn (decoding never proposes them: beam search's and sampling's mask,
:func:`~captioning.model.search_tools.never_proposed`; self-critical.pytorch draws from the full softmax),
while ``<end>`` may be, as decoding proposes it (the caption then goes on with the reference's next words);
a caption's padding stays padding (only a real input word, not ``<pad>``, is ever replaced:
self-critical.pytorch replaces padding too and masks the loss there, which changes no loss but would count
padded steps in the attention decoder's coverage); and the draws are stateless random numbers seeded per
call (:func:`replica_seed`: the run's seed, the optimizer step, the micro-batch and the replica), never a
global random state, so a run is reproducible and two replicas or micro-batches draw apart.

The probability follows the optimizer step in the graph: :func:`probability` is
:meth:`~captioning.config.sections.ScheduledSamplingConfig.probability` as TensorFlow ops of the step counter
(``p = min(start + increase × floor(step / increase_every), max)``), so a compiled step needs no retrace as
it rises. Only a decoder whose :attr:`~captioning.model.base.CaptionModel.scheduled_sampling` is true takes it
(the recurrent ones: their teacher-forced pass is a loop over the words anyway); a Transformer's reads every
word of the caption at once, in parallel, and is refused before a run starts.
"""

from __future__ import annotations

from typing import NamedTuple

import tensorflow as tf

from captioning.config.sections import ScheduledSamplingConfig
from captioning.model.search_tools import never_proposed
from captioning.vocab import PAD_ID


class Mixed(NamedTuple):
    """What :func:`mixed_teacher_forced` gives: the logits ``[B, T, V]`` (float32), the state after the last
    step, the words fed ``[B, T]`` and where they were the model's own draw (``replaced [B, T]``, bool)."""

    logits: tf.Tensor
    state: object
    words: tf.Tensor
    replaced: tf.Tensor


def probability(section: ScheduledSamplingConfig, step) -> tf.Tensor:
    """The probability at optimizer step ``step`` (a scalar tensor or variable) as a float32 scalar tensor:
    :meth:`ScheduledSamplingConfig.probability` in TensorFlow ops (computed in float64, as Python does)."""
    if not section.enabled:
        return tf.constant(0.0, tf.float32)
    rises = tf.cast(tf.math.floordiv(tf.cast(step, tf.int64), section.increase_every), tf.float64)
    return tf.cast(tf.minimum(section.start + section.increase * rises, section.max), tf.float32)


def drawable(logits) -> tf.Tensor:
    """``logits [B, V]`` with decoding's dead score on the words it never proposes (``<pad>``, ``<start>``,
    ``<unk>``: :func:`~captioning.model.search_tools.never_proposed`'s row 0), so a draw from their softmax is
    never one of them."""
    return logits + never_proposed(logits.shape[-1], 0)[0]


def replica_seed(step_seed) -> tf.Tensor:
    """The stateless seed ``[2]`` of one replica's draws: the training step's (``train.seed``, the optimizer step
    and the micro-batch: :func:`captioning.train.objectives.base.step_seed`) folded with the replica's number,
    so two replicas draw apart."""
    context = tf.distribute.get_replica_context()
    replica = 0 if context is None else context.replica_id_in_sync_group
    return tf.random.experimental.stateless_fold_in(step_seed, tf.cast(replica, tf.int32))


def mixed_teacher_forced(model, state, input_ids, p, draw_seed, training=True) -> Mixed:
    """The teacher-forced pass of ``input_ids [B, T]`` from ``state`` with each real input word at ``t ≥ 1``
    replaced, with probability ``p`` (a float scalar), by a word drawn from the model's output at ``t − 1``
    (see the module docstring); ``draw_seed [2]``: the stateless seed of the draws (the same seed and inputs,
    the same words). A ``tf.while_loop`` over the steps of the decoder's ``step(ids, state, training)``,
    which XLA compiles (``train.jit_compile``)."""
    input_ids = tf.cast(input_ids, tf.int32)
    rows, steps = tf.shape(input_ids)[0], tf.shape(input_ids)[1]
    # per step and caption: whether to replace (u < p) and where in the previous step's CDF the draw falls
    chance, where = tf.unstack(tf.random.stateless_uniform([2, steps, rows], seed=draw_seed), axis=0)
    replace = (chance < tf.cast(p, tf.float32)) & tf.not_equal(tf.transpose(input_ids), PAD_ID)
    replace = tf.concat([tf.zeros_like(replace[:1]), replace[1:]], axis=0)  # never the first word
    logits_ta = tf.TensorArray(tf.float32, size=steps)
    words_ta = tf.TensorArray(tf.int32, size=steps)

    def body(t, state, previous, logits_ta, words_ta):
        # the inverse CDF of softmax(previous) at a uniform number in [0, 1): a draw from the model's distribution
        # over the words decoding proposes; `<=` skips the words of probability 0 (the masked ones) at 0 too
        cdf = tf.cumsum(tf.nn.softmax(drawable(tf.stop_gradient(previous))), axis=1)
        drawn = tf.reduce_sum(tf.cast(cdf <= where[t][:, None] * cdf[:, -1:], tf.int32), axis=1)
        drawn = tf.minimum(drawn, tf.shape(previous)[1] - 1)
        word = tf.stop_gradient(tf.where(replace[t], drawn, input_ids[:, t]))
        logits, state = model.step(word, state, training=training)
        logits = tf.cast(logits, tf.float32)
        return t + 1, state, logits, logits_ta.write(t, logits), words_ta.write(t, word)

    shapes = tf.nest.map_structure(lambda s: tf.TensorShape([None]).concatenate(s.shape[1:]), state)
    first = tf.zeros([rows, model.vocab_size], tf.float32)
    _, state, _, logits_ta, words_ta = tf.while_loop(  # maximum_iterations: XLA needs the bound
        lambda t, *_: t < steps, body, (tf.constant(0), state, first, logits_ta, words_ta),
        maximum_iterations=steps,
        shape_invariants=(tf.TensorShape([]), shapes, first.shape, tf.TensorShape(None), tf.TensorShape(None)))
    return Mixed(tf.transpose(logits_ta.stack(), [1, 0, 2]), state, tf.transpose(words_ta.stack()),
                 tf.transpose(replace))
