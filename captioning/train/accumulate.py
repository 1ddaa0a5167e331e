"""Gradient accumulation (``train.accumulate_steps`` K > 1): K micro-batches per optimizer step, the update
exactly that of one batch K times larger.

The single-batch step (:mod:`captioning.train.steps`) divides every replica's loss sum by the weight of the
whole global batch. Accumulation does the same over K micro-batches: each micro-batch adds, per replica, its
loss sum, its weight, the objective's sums and the gradients of its (scaled) loss sum to accumulators that stay
on the replica's device (``ON_READ`` variables: no communication per micro-batch); after the K-th, one update
(:func:`~captioning.train.steps.make_update`, the single step's own) all-reduces them once, divides the gradient
by the total weight of the K global micro-batches, clips the global gradient, checks finiteness once, applies
once and increments the step counter once. So the loss is the mean over every real token (xe) or sample (SCST)
of the K micro-batches, however they differ in size, and a replica whose share of a micro-batch holds no example
adds zero. The objective's reported sums (SCST's reward, baseline, ended) are weighted means over the K
micro-batches.

The batch-norm moving statistics are saved before the first micro-batch's forward pass and put back when the
step is not finite (each micro-batch's forward pass moves them, as K forward passes of Keras' own accumulation
do). Under loss scaling each micro-batch's loss sum is scaled by the same loss scale (it only changes when the
update applies), and Keras' LossScaleOptimizer checks the summed gradient. With ``train.jit_compile`` each
micro-batch's forward and backward pass is the XLA-compiled function of the single step.

Keras 3 optimizers have ``gradient_accumulation_steps``, which averages the K micro-batches' *mean* gradients
(each micro-batch weighs the same whatever its token count) and clips per replica; self-critical.pytorch has
no accumulation. Here the micro-batches are weighted by what they hold, so the update equals the large batch's
(tested to float tolerance: split padding, grouped captions, SGD and Adam, 2 replicas with one left empty).

The schedule counts optimizer steps: the step counter, ``train.steps``, the checkpoint, evaluation and log
intervals, ``train.steps_per_execution`` and the learning-rate schedule (an epoch is its batches / K optimizer
steps: :func:`captioning.train.optimizer.epoch_plan`). ``train.batch_size`` is each micro-batch's global size.
"""

from __future__ import annotations

import tensorflow as tf

from captioning.data.augment import color_jitter
from captioning.train.objectives.base import MICRO_BATCH
from captioning.train.steps import forward_state, loss_sum_gradients, make_update


class Accumulation:
    """One optimizer step over ``steps`` micro-batches. :meth:`read` takes a step's micro-batches from the
    host's iterator, :meth:`step_for` gives the step that takes them (one compiled call per micro-batch and
    one for the update), and :meth:`step_from` is the step that reads its micro-batches itself inside a
    compiled call (``train.steps_per_execution``). Both return what the single step returns
    (:func:`captioning.train.steps.make_train_step`); ``after_update`` as there, once per optimizer step."""

    def __init__(self, model, optimizer, strategy, objective, step_counter: tf.Variable, clip_gradient_norm: float,
                 jitter: bool, jit_compile: bool, steps: int, after_update: tuple = ()):
        self.steps, self.strategy, self.jitter = steps, strategy, jitter
        self.variables = model.trainable_variables
        self.moving = forward_state(model)
        gradients = loss_sum_gradients(model, optimizer, objective)
        self.gradients = tf.function(gradients, jit_compile=True, autograph=False) if jit_compile else gradients
        self.replica_update, self.finish = make_update(model, optimizer, strategy, step_counter, clip_gradient_norm,
                                                         after_update)
        self.parts = tuple(objective.parts)

        def local(value, aggregation=tf.VariableAggregation.SUM):  # one copy per replica, never synchronised
            return tf.Variable(value, trainable=False, synchronization=tf.VariableSynchronization.ON_READ,
                               aggregation=aggregation)

        with strategy.scope():
            self.sums = [local(tf.zeros(v.shape, v.dtype)) for v in self.variables]
            self.totals = {name: local(0.0) for name in ("loss_sum", "weight", *self.parts)}
            self.saved = [local(tf.zeros(v.shape, v.dtype), tf.VariableAggregation.ONLY_FIRST_REPLICA)
                          for v in self.moving]
        self._compiled: dict = {}

    # ---- one micro-batch and the update, in replica context --------------------------------------------
    def _replica_add(self, batch, index):
        """Adds the replica's share of micro-batch ``index`` of the step; the first replaces what the
        accumulators hold and saves the batch-norm statistics. The batch carries its index to the objective
        (``MICRO_BATCH``: its random draws, SCST's samples, are seeded per micro-batch)."""
        first = tf.equal(index, 0)
        batch = {**batch, MICRO_BATCH: index}
        if self.jitter and "image" in batch:  # im2txt's colour distortions, as the single step applies them
            batch = {**batch, "image": color_jitter(batch["image"])}
        for v, saved in zip(self.moving, self.saved):
            saved.assign(tf.where(first, v.value, saved))
        loss_sum, weight, grads, sums = self.gradients(batch)
        unknown = set(sums) - set(self.parts)
        if unknown:
            raise ValueError(f"the objective reports {sorted(unknown)}, which are not among its parts {self.parts}")
        added = {"loss_sum": loss_sum, "weight": weight, **sums}
        for name, total in self.totals.items():
            value = tf.cast(added.get(name, 0.0), tf.float32)
            total.assign(tf.where(first, value, total + value))
        for total, g in zip(self.sums, grads):
            total.assign(tf.where(first, g, total + g))

    def _replica_update(self):
        ctx = tf.distribute.get_replica_context()
        totals = {name: tf.identity(total) for name, total in self.totals.items()}  # this replica's copies
        global_weight = ctx.all_reduce(tf.distribute.ReduceOp.SUM, totals["weight"])
        grads = [tf.identity(total) / tf.maximum(global_weight, 1.0) for total in self.sums]
        sums = {name: totals[name] for name in self.parts}
        before = [tf.identity(saved) for saved in self.saved]
        return self.replica_update(grads, totals["loss_sum"], global_weight, sums, before)

    def _add(self, batch, index):
        self.strategy.run(self._replica_add, args=(batch, index))
        return tf.constant(0)  # something to wait for

    def _update(self):
        return self.finish(self.strategy.run(self._replica_update))

    # ---- the step -----------------------------------------------------------------------------------------
    def read(self, next_batch) -> list:
        """A step's micro-batches: ``next_batch()`` called ``steps`` times."""
        return [next_batch() for _ in range(self.steps)]

    def step_for(self, dataset):
        """The step for micro-batches of ``dataset`` (a distributed dataset): ``step(batches)`` with the
        ``steps`` batches :meth:`read` took; each micro-batch's call is traced once per element_spec."""
        key = repr(dataset.element_spec)
        if key not in self._compiled:
            add = tf.function(self._add, input_signature=[dataset.element_spec, tf.TensorSpec([], tf.int32)],
                              autograph=False)
            self._compiled[key] = add, tf.function(self._update, autograph=False)
        add, update = self._compiled[key]

        def step(batches):
            assert len(batches) == self.steps, (len(batches), self.steps)
            for i, batch in enumerate(batches):
                add(batch, tf.constant(i, tf.int32))
            return update()

        return step

    def step_from(self, iterator):
        """One optimizer step reading its ``steps`` micro-batches from ``iterator`` (a distributed
        iterator), inside a compiled call."""
        def add(i):
            self._add(next(iterator), i)
            return i + 1

        with tf.control_dependencies(tf.while_loop(lambda i: i < self.steps, add, [tf.constant(0)])):
            return self._update()
