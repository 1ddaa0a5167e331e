"""What a self-critical step spends its time on: :meth:`SelfCritical.breakdown`, which ``captioning benchmark
train`` of an SCST config reports after its run (``parts_ms`` in the JSON, one line in the log).

Each part of :meth:`~captioning.train.objectives.scst.SelfCritical.replica_loss` is compiled alone and timed
on the run's model and one replica's batch of the run (the fastest of ``repeats`` calls after one that
traces and compiles, as the benchmarks keep the best of their rounds), in milliseconds:

==================  ===================================================================================
part                what it times
==================  ===================================================================================
``encode``          the image features and the decoder's start state, repeated ``scst.samples`` times
``sampling``        the sampling loop without gradient, as plain TensorFlow ops
``sampling_xla``    the same loop compiled with XLA (``scst.xla_sampling``): the same samples
``through_loop``    the sampling loop with the backward pass through it: the gradient of Σ log p of the
                    samples, the reference codebases' way, and the way of a decoder without
                    ``fast_teacher_forcing``
``teacher_forced``  the samples scored again in one teacher-forced pass, forward and backward: the other way
``reward``          the reward of every sample: CIDEr-D against its image's references; with ``scst.reward``
                    clip or mix, CLIP-S too, the batch's images embedded once by the preset
``greedy``          the greedy baseline (``scst.baseline: greedy``): a greedy decoding and its reward
``cross_entropy``   for scale, a grouped cross-entropy step's forward and backward on the same batch
==================  ===================================================================================

The step as training runs it is ``encode`` + (``sampling_xla`` or ``sampling``) + ``teacher_forced`` for a
decoder with ``fast_teacher_forcing`` (``through_loop`` for the others) + ``reward`` (+ ``greedy`` with the
greedy baseline), plus the encoder's backward pass and the optimizer's update, which cross-entropy pays too.
The parts run one at a time, each on the whole machine; the model is the run's after its last step.
"""

from __future__ import annotations

import time

import tensorflow as tf

from captioning.train.objectives.base import caption_loss_sum
from captioning.train.objectives.scst_sampling import greedy_captions, sample_captions, sequence_log_prob


def _fastest_ms(fn, args: tuple, repeats: int) -> float:
    tf.nest.map_structure(lambda t: t.numpy(), fn(*args))  # traces (and compiles) once, off the clock
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        tf.nest.map_structure(lambda t: t.numpy(), fn(*args))  # waits for the result
        times.append(time.perf_counter() - start)
    return 1000 * min(times)


def _computed(gradients) -> list:
    """The gradients as tensors to wait for (an embedding's are IndexedSlices: their values)."""
    return [g.values if isinstance(g, tf.IndexedSlices) else g for g in gradients if g is not None]


def breakdown(objective, model, batch: dict, repeats: int = 10) -> dict[str, float]:
    """Each part's fastest milliseconds on ``batch`` (one replica's grouped batch), as the module docstring
    lists them. ``objective`` is the run's :class:`~captioning.train.objectives.scst.SelfCritical`."""
    cfg = objective.cfg
    length, temperature, s = cfg.max_length, cfg.temperature, cfg.samples
    seed = tf.constant([objective.seed, 0], tf.int32)
    weights = model.trainable_variables
    references = objective.references(batch)

    @tf.function(autograph=False)
    def encode(batch):
        features, mask = model.image_features(batch, training=True)
        state = model.initial_state(features, training=False, mask=mask)
        return state, tf.nest.map_structure(lambda x: tf.repeat(x, s, axis=0), state)

    state, repeated = encode(batch)
    drawn = sample_captions(model, repeated, length, temperature, seed)
    ids = drawn["ids"]
    index = tf.repeat(tf.range(tf.shape(references.row_lengths())[0]), s)

    def graph(fn):
        return tf.function(fn, autograph=False)

    def gradient_of(log_prob_fn):
        def fn(*args):
            with tf.GradientTape() as tape:
                loss = -tf.reduce_sum(log_prob_fn(*args))
            return _computed(tape.gradient(loss, weights))
        return graph(fn)

    def reward(ids, rows):  # rows: each caption's image; the CLIP reward's images embedded inside, as the step does
        return objective.score(ids, references, rows, objective.embedded(batch.get("image")))["reward"]

    def greedy(state):
        words = greedy_captions(model, state, length)
        return reward(words, tf.range(tf.shape(words)[0]))

    def cross_entropy(batch):
        with tf.GradientTape() as tape:
            loss = caption_loss_sum(model, batch, training=True)
        return _computed(tape.gradient(loss, weights))

    parts = {
        "encode": (encode, (batch,)),
        "sampling": (graph(lambda r: sample_captions(model, r, length, temperature, seed)["ids"]), (repeated,)),
        "sampling_xla": (graph(lambda r: sample_captions(model, r, length, temperature, seed, xla=True)["ids"]),
                         (repeated,)),
        "through_loop": (gradient_of(lambda r: sample_captions(model, r, length, temperature, seed)["log_prob"]),
                         (repeated,)),
        "teacher_forced": (gradient_of(lambda r, ids: sequence_log_prob(model, r, ids, temperature)), (repeated, ids)),
        "reward": (graph(lambda ids: reward(ids, index)), (ids,)),
        "greedy": (graph(greedy), (state,)),
        "cross_entropy": (graph(cross_entropy), (batch,)),
    }
    return {name: _fastest_ms(fn, args, repeats) for name, (fn, args) in parts.items()}


def describe(parts: dict[str, float], fast_teacher_forcing: bool, xla: bool, greedy: bool) -> str:
    """One line of what :func:`breakdown` measured: the parts the run's step uses, then the others.

    >>> describe({"encode": 2.0, "sampling": 30.0, "sampling_xla": 10.0, "through_loop": 60.0,
    ...           "teacher_forced": 12.0, "reward": 1.0, "greedy": 8.0, "cross_entropy": 15.0}, True, True, False)
    'the SCST step in parts (ms, each alone): encode 2.0 + sampling with XLA 10.0 + teacher-forced scoring and its backward 12.0 + reward 1.0 = 25.0; not used: sampling without XLA 30.0, sampling and the backward through its loop 60.0, greedy baseline 8.0; a cross-entropy forward and backward: 15.0'
    """
    names = {"encode": "encode", "sampling": "sampling without XLA", "sampling_xla": "sampling with XLA",
             "through_loop": "sampling and the backward through its loop",
             "teacher_forced": "teacher-forced scoring and its backward", "reward": "reward",
             "greedy": "greedy baseline"}
    drawn = ["sampling_xla" if xla else "sampling", "teacher_forced"] if fast_teacher_forcing else ["through_loop"]
    used = ["encode", *drawn, "reward"] + (["greedy"] if greedy else [])
    return ("the SCST step in parts (ms, each alone): " + " + ".join(f"{names[k]} {parts[k]:.1f}" for k in used)
            + f" = {sum(parts[k] for k in used):.1f}; not used: "
            + ", ".join(f"{names[k]} {parts[k]:.1f}" for k in names if k not in used)
            + f"; a cross-entropy forward and backward: {parts['cross_entropy']:.1f}")
