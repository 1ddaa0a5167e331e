"""The compiled steps: one training step for every objective and strategy, and the evaluation loss.

**The training step.** Each replica computes its objective's loss sum on its share of the global batch
(:mod:`captioning.train.objectives`) and divides it by the weight of the *whole global batch*, counted
with an all-reduce, so summing the replicas' gradients gives exactly the gradient of the global mean, for
any number of replicas and any split of the examples between them.

Gradient clipping by global norm must see the summed gradient. Keras 3 optimizers clip before they
all-reduce (per replica, which is wrong under data parallelism), so the step all-reduces the gradients
itself, clips the global gradient, and hands each replica ``g / replicas`` to ``optimizer.apply``, whose
own sum restores ``g``. (That costs a second all-reduce of the gradients; exact for 2^k replicas, within
an ulp otherwise.)

A step whose global loss or gradient norm is not finite applies no update: ``tf.cond`` in cross-replica
context around ``optimizer.apply``, as Keras' LossScaleOptimizer does, so it works under every strategy;
batch-norm moving statistics changed by that forward pass are put back with ``tf.where``. The verdict is
the same on every replica and worker, as it is computed from all-reduced values. Under loss scaling
(``mixed_float16``) overflowing gradients are the loss scaler's business; only a non-finite loss counts.

With ``data.color_jitter`` the step first applies im2txt's colour distortions to the batch on the device
(:mod:`captioning.data.augment`).

**Evaluation** (:func:`evaluation_loss`) is always the cross-entropy of the reference captions, whatever
the training objective: ``train``'s validation and ``evaluate``'s perplexity are the same function.
"""

from __future__ import annotations

from dataclasses import dataclass

import keras
import tensorflow as tf

from captioning.data.augment import color_jitter
from captioning.model import all_layers
from captioning.tf_internals import install_backward_walk
from captioning.train.objectives import Objective, caption_loss_sum, perplexity


def training_batch_norms(model) -> list:
    """The batch-norm layers that train, each once (a frozen encoder's run in inference mode and stay put)."""
    found = {}
    for layer in all_layers(model):
        if isinstance(layer, keras.layers.BatchNormalization) and layer.trainable:
            found[id(layer)] = layer
    return list(found.values())


def forward_state(model) -> list:
    """The variables a training forward pass assigns: the moving statistics of batch-norm layers that
    train (:func:`training_batch_norms`)."""
    return [v for layer in training_batch_norms(model) for v in (layer.moving_mean, layer.moving_variance)]


class Compiled:
    """Steps as ``tf.function``\\ s traced once per dataset element_spec: batches of every caption length
    share one graph instead of one trace per length."""

    def __init__(self):
        self._steps: dict = {}

    def __call__(self, make, dataset):
        key = (make.__name__, repr(dataset.element_spec))
        if key not in self._steps:
            self._steps[key] = tf.function(make(), input_signature=[dataset.element_spec], autograph=False)
        return self._steps[key]


def dense(grads, variables):
    """Gradients as dense tensors (an embedding's arrive as IndexedSlices), zeros for a variable the loss does not
    reach (None: a fine-tuned keras-hub DINOv2's mask token, used only for masked-image pretraining)."""
    return [tf.zeros_like(v) if g is None else tf.convert_to_tensor(g) for g, v in zip(grads, variables)]


def loss_sum_gradients(model, optimizer, objective: Objective):
    """``replica_gradients(batch)``: a replica's loss sum, weight, the gradients of its (scaled, under loss
    scaling) loss sum and the objective's sums, not divided by any weight: what ``train.jit_compile`` compiles
    and what gradient accumulation (:mod:`captioning.train.accumulate`) adds up over micro-batches."""
    scaled = isinstance(optimizer, keras.optimizers.LossScaleOptimizer)

    def replica_gradients(batch):
        with tf.GradientTape() as tape:
            out = objective.replica_loss(model, batch, training=True)
            loss_sum = optimizer.scale_loss(out.loss_sum) if scaled else out.loss_sum
        grads = dense(tape.gradient(loss_sum, model.trainable_variables), model.trainable_variables)
        return out.loss_sum, out.weight, grads, out.sums

    return replica_gradients


def make_update(model, optimizer, strategy, step_counter: tf.Variable, clip_gradient_norm: float,
                after_update: tuple = ()):
    """The second half of every training step, one optimizer update: ``replica_update(grads, loss_sum,
    global_weight, sums, before)`` in replica context (the replica's gradients already divided by the global
    weight, still scaled under loss scaling; its loss sum and sums; the batch-norm statistics as they were
    before the step's forward passes) all-reduces, clips the global gradient and decides whether the step is
    finite; ``finish(per_replica)`` in cross-replica context applies the update (or not), calls each of
    ``after_update`` (in cross-replica context, after a step that updated the weights, never a skipped one: the
    weight average of :mod:`captioning.train.ema`), increments ``step_counter`` and returns the step's outputs
    (:func:`make_train_step`). Its replica-context all-reduces (and synchronized batch norm's) trace with
    :func:`captioning.tf_internals.install_backward_walk`'s graph walk (TensorFlow's own is quadratic)."""
    install_backward_walk()
    scaled = isinstance(optimizer, keras.optimizers.LossScaleOptimizer)
    moving = forward_state(model)
    variables = model.trainable_variables

    def replica_update(grads, loss_sum, global_weight, sums, before):
        ctx = tf.distribute.get_replica_context()
        # the global gradient, loss and reported sums, on every replica
        names = sorted(sums)
        reduced = ctx.all_reduce(tf.distribute.ReduceOp.SUM, grads + [loss_sum] + [sums[k] for k in names])
        grads, global_loss_sum = reduced[:len(grads)], reduced[len(grads)]
        global_sums = dict(zip(names, reduced[len(grads) + 1:]))
        if scaled:
            grads = [g / optimizer.dynamic_scale for g in grads]
        norm = tf.linalg.global_norm(grads)
        finite = tf.math.is_finite(global_loss_sum)
        if not scaled:
            finite = tf.logical_and(finite, tf.math.is_finite(norm))
        for v, old in zip(moving, before):  # a skipped step leaves batch norm as it was
            v.assign(tf.where(finite, v.value, old))
        if clip_gradient_norm > 0:
            grads, _ = tf.clip_by_global_norm(grads, clip_gradient_norm, use_norm=norm)
        share = 1.0 / ctx.num_replicas_in_sync  # optimizer.apply sums over replicas again
        if scaled:
            share = share * optimizer.dynamic_scale
        grads = [g * share for g in grads]
        applied = finite  # whether the weights are updated
        if scaled:  # it applies only finite gradients itself (and lowers its scale otherwise)
            applied = optimizer.check_finite(grads)  # its own test, on what it is given
            optimizer.apply(grads, variables)
            grads = []
        return global_loss_sum, global_weight, norm, finite, grads, global_sums, applied

    def apply(grads):
        optimizer.apply(grads, variables)

    def run_after_update():
        for hook in after_update:
            hook()

    def finish(per_replica):
        total, weight, norm, finite, grads, sums, applied = per_replica
        if not scaled:
            # A cond in cross-replica context around strategy.run: optimizer.apply merge_calls, which a
            # cond inside the replica function cannot hold (Keras' LossScaleOptimizer does the same).
            tf.cond(strategy.experimental_local_results(finite)[0],
                    lambda: strategy.run(apply, args=(grads,)), lambda: None)
        if after_update:  # after the update above (they read the variables it wrote), only when there was one
            tf.cond(strategy.experimental_local_results(applied)[0], run_after_update, lambda: None)
        step_counter.assign_add(1)
        # The replicas all-reduced the loss, the weight and the sums already: any replica's copy is global.
        total, weight, norm = (strategy.experimental_local_results(x)[0] for x in (total, weight, norm))
        means = {k: strategy.experimental_local_results(v)[0] / tf.maximum(weight, 1.0) for k, v in sums.items()}
        return {"loss": total / tf.maximum(weight, 1.0), "gradient_norm": norm, "weight": weight, **means}

    return replica_update, finish


def make_train_step(model, optimizer, strategy, objective: Objective, step_counter: tf.Variable,
                    clip_gradient_norm: float, jitter: bool, jit_compile: bool = False, after_update: tuple = ()):
    """The training step for a distributed batch: returns ``{"loss": the global mean loss, "gradient_norm":
    the global gradient norm, "weight": the global weight (real tokens for xe), and each of the
    objective's ReplicaLoss.sums over the global weight}``; increments ``step_counter``.

    ``jit_compile`` (``train.jit_compile``) compiles each replica's forward and backward pass with XLA:
    the gradients of the replica's loss *sum*, divided by the global weight after the all-reduce of the
    weights (the same gradient as differentiating ``loss_sum / global weight``). XLA compiles once per
    batch shape, so fix the shapes with ``data.bucket_boundaries``; the cuDNN LSTM kernel is not used
    under XLA. (``train.accumulate_steps`` > 1: :mod:`captioning.train.accumulate`'s step instead, the
    same update over several micro-batches.) ``after_update``: as :func:`make_update`'s."""
    scaled = isinstance(optimizer, keras.optimizers.LossScaleOptimizer)
    moving = forward_state(model)
    compiled_gradients = tf.function(loss_sum_gradients(model, optimizer, objective), jit_compile=True, autograph=False)
    replica_update, finish = make_update(model, optimizer, strategy, step_counter, clip_gradient_norm, after_update)

    def replica_step(batch):
        if jitter and "image" in batch:  # im2txt's colour distortions, on the device (captioning.data.augment)
            batch = {**batch, "image": color_jitter(batch["image"])}
        ctx = tf.distribute.get_replica_context()
        variables = model.trainable_variables
        before = [tf.identity(v.value) for v in moving]  # the forward pass moves these
        if jit_compile:
            loss_sum, weight, grads, sums = compiled_gradients(batch)
            global_weight = ctx.all_reduce(tf.distribute.ReduceOp.SUM, weight)
            grads = [g / tf.maximum(global_weight, 1.0) for g in grads]
        else:
            with tf.GradientTape() as tape:
                out = objective.replica_loss(model, batch, training=True)
                global_weight = ctx.all_reduce(tf.distribute.ReduceOp.SUM, out.weight)
                loss = out.loss_sum / tf.maximum(global_weight, 1.0)
                if scaled:
                    loss = optimizer.scale_loss(loss)
            # Dense gradients (the embedding's arrive as IndexedSlices): they are all-reduced and scaled.
            grads = dense(tape.gradient(loss, variables), variables)
            loss_sum, sums = out.loss_sum, out.sums
        return replica_update(grads, loss_sum, global_weight, sums, before)

    def train_step(batch):
        return finish(strategy.run(replica_step, args=(batch,)))

    return train_step


def make_multi_step(step_from, stop_at_non_finite: bool, scaled: bool):
    """Up to ``n`` training steps inside one call (``train.steps_per_execution``): ``multi_step(iterator, n)``
    runs ``step_from(iterator)`` ``n`` times, each one optimizer step reading its own batch from ``iterator``
    (a distributed iterator; ``lambda it: train_step(next(it))`` for :func:`make_train_step`'s step, or
    :meth:`captioning.train.accumulate.Accumulation.step_from`, which reads ``train.accumulate_steps``),
    returning each step's outputs stacked (``[steps run]`` per key). With ``stop_at_non_finite``
    (``train.nan_policy: stop``) the call ends after the first step whose loss or gradient norm is not finite
    (that step applied no update), so the host finds it at its own step with no step after it applied; under
    loss scaling only the loss counts, as on the host."""

    def finite(out):
        ok = tf.math.is_finite(out["loss"])
        return ok if scaled else ok & tf.math.is_finite(out["gradient_norm"])

    def multi_step(iterator, n):
        first = step_from(iterator)
        arrays = {k: tf.TensorArray(v.dtype, size=0, dynamic_size=True).write(0, v) for k, v in first.items()}

        def one_step(i, going, arrays):
            out = step_from(iterator)
            return (i + 1, finite(out) if stop_at_non_finite else going,
                    {k: arrays[k].write(i, out[k]) for k in arrays})

        going = finite(first) if stop_at_non_finite else tf.constant(True)
        _, _, arrays = tf.while_loop(lambda i, going, arrays: tf.logical_and(i < n, going), one_step,
                                     (tf.constant(1), going, arrays))
        return {k: a.stack() for k, a in arrays.items()}

    return multi_step


def steps_in_call(cfg, done: int) -> int:
    """How many steps the next call runs after ``done`` steps (``cfg``: the train section):
    ``steps_per_execution``, fewer to end at the next checkpoint, evaluation, the last step, or the edges
    of the profiled steps.

    >>> from captioning.config.sections import TrainConfig
    >>> cfg = TrainConfig(steps=100, steps_per_execution=8, checkpoint_every_steps=20, eval_every_steps=0)
    >>> [steps_in_call(cfg, done) for done in (0, 8, 16, 20, 96)]
    [8, 8, 4, 8, 4]
    """
    n = min(cfg.steps_per_execution, cfg.steps - done)
    for every in (cfg.checkpoint_every_steps, cfg.eval_every_steps):
        if every:
            n = min(n, every - done % every)
    if cfg.profile_steps:
        start, stop = cfg.profile_steps
        n = min(n, start - 1 - done) if done < start - 1 else min(n, stop - done) if done < stop else n
    return max(n, 1)


@dataclass
class EvaluationLoss:
    """Mean cross-entropy per real token of the reference captions, its perplexity, and the token count.
    Also readable as ``result["loss"]``."""

    loss: float
    perplexity: float
    tokens: int

    def __getitem__(self, key: str):
        return getattr(self, key)


def make_eval_step(model, strategy):
    def eval_step(batch):
        def replica(b):
            return caption_loss_sum(model, b, training=False), tf.reduce_sum(b["mask"])

        loss_sum, tokens = strategy.run(replica, args=(batch,))
        return (strategy.reduce(tf.distribute.ReduceOp.SUM, loss_sum, axis=None),
                strategy.reduce(tf.distribute.ReduceOp.SUM, tokens, axis=None))

    return eval_step


def evaluation_loss(model, dataset, strategy=None, max_batches: int | None = None,
                    compiled: Compiled | None = None) -> EvaluationLoss:
    """The references' cross-entropy over ``dataset`` (a distributed dataset of ``strategy``, or a plain one
    on the default strategy), at most ``max_batches`` batches. Empty replica batches count nothing."""
    strategy = strategy or tf.distribute.get_strategy()
    compiled = compiled or Compiled()

    def make():
        return make_eval_step(model, strategy)

    make.__name__ = "eval_step"
    step = compiled(make, dataset)
    total = count = 0.0
    for i, batch in enumerate(dataset):
        if max_batches and i >= max_batches:
            break
        loss_sum, tokens = step(batch)
        total, count = total + float(loss_sum), count + float(tokens)
    loss = total / max(count, 1.0)
    return EvaluationLoss(loss, perplexity(loss), int(count))
