"""The weight average (``train.ema_decay`` d > 0): an exponential moving average of the trainable weights and of
the batch-norm moving statistics training moves (a fine-tuned encoder's ``moving_mean`` and ``moving_variance``),
kept in the checkpoint beside them and read by ``evaluate``, ``caption`` and ``export`` (``--weights ema|raw``,
:meth:`captioning.model.folder.ModelDir.use_weights`).

**Why the statistics too, and at which decay.** Batch norm at inference normalises by its moving statistics,
which should describe the activations of the weights it normalises. They are themselves an exponential moving
average of each training batch's statistics (Keras' ``momentum`` m, 0.99 by default), so they describe the
weights of about m / (1 − m) steps ago (99); the weight average at d describes those of about d / (1 − d)
steps ago (999 at 0.999). The statistics' average makes up the difference: each statistic is averaged at
the decay whose delay is the rest, :func:`statistics_decay` (``train.accumulate_steps`` K: the statistics
move K times a step, so their own delay is m / (1 − m) / K steps); where the weight average is no slower
than the statistics (d ≤ m at K = 1), their average is the raw statistics of the last applied step. Averaged
at d itself they would lag by the two delays together: at d ≈ m, twice the weights' (as TensorFlow's
EfficientNet reference code averages ``moving_mean`` and ``moving_variance``, and timm's ``ModelEmaV2`` the
whole state dict, batch-norm buffers included; docs/training.md has the measurements that chose this). Other
non-trainable variables are not averaged: a frozen encoder's weights and statistics never move, and step
counters and random-number states are no model state. A checkpoint written before the statistics were
averaged holds an average of the trainable weights only: inference then keeps its raw statistics, as it did;
a run resumed from it starts their average from their restored values (the log line of a weight without an
average).

After each optimizer step that updated the weights, each weight's average becomes ::

    average = d × average + (1 − d) × weight

A step that applied no update (a non-finite loss or gradient skipped under ``train.nan_policy: skip``, or
gradients Keras' loss scaling found overflowing) leaves the average as it was. With gradient accumulation
(``train.accumulate_steps``) that is once per optimizer step, not per micro-batch; with
``train.steps_per_execution`` once per step inside the compiled call.

Worked example, d = 0.5, one weight starting at 1.0 that the optimizer moves to 3.0, then 5.0, then (a skipped
step) leaves at 5.0, then moves to 7.0::

    start        average = 1.0                      (the weight the run starts from)
    step 1: 3.0  average = 0.5 × 1.0 + 0.5 × 3.0 = 2.0
    step 2: 5.0  average = 0.5 × 2.0 + 0.5 × 5.0 = 3.5
    step 3: skip average = 3.5
    step 4: 7.0  average = 0.5 × 3.5 + 0.5 × 7.0 = 5.25

**Where it starts.** A new run's average starts from the model's initial weights (the ones ``init_from`` or a
regions encoder put there included); a resumed run restores it from the checkpoint; a run resumed from a
checkpoint without one (``train.ema_decay`` turned on later), or a weight the checkpoint has no average of (the
encoder fine-tuned after training frozen), starts it from the restored weights, and says so in a log line.
Keras' ``use_ema`` (``ema_momentum``) is the same average over the trainable variables after each ``apply``,
except that its first update copies the weights (its average starts at zero with momentum 0 on the first
step), i.e. it starts one step later; ``tf.train.ExponentialMovingAverage`` starts from the initial values as
here. self-critical.pytorch keeps no average. Setting ``train.ema_decay`` to 0 on a resumed run drops the
average from the next checkpoints.

**Distribution.** The averages are created inside the strategy's scope, one copy per replica (mirrored), and
updated in cross-replica context inside the compiled step, right after the optimizer's update: each replica's
copy from its own copy of the weights (``strategy.extended.update``, the way Keras puts an average into a
mirrored model), with no communication. The weights are identical on every replica after the all-reduced
update, so every replica's average is too, bit for bit, and equal to one replica's to float rounding.
Under ``mixed_float16`` the weights, and so their averages, are float32.

**Training's own validation and samples** (``train.eval_every_steps``) use the raw weights, as Keras' ``fit``
evaluates with them (unless ``ema_overwrite_frequency`` writes the average into the model); ``captioning
evaluate`` scores the average by default and the raw weights with ``--weights raw``, as two results.

**The checkpoint** holds the averages as its item ``ema`` (:data:`captioning.model.checkpoints.AVERAGE`), each
under its variable's position in ``model.variables``, which is how inference finds the variable it replaces.
"""

from __future__ import annotations

import logging
import os

import tensorflow as tf

from captioning.model.checkpoints import AVERAGE, CheckpointFiles
from captioning.train.steps import training_batch_norms

log = logging.getLogger("captioning.train")


def statistics_decay(decay: float, momentum: float, micro_batches: int = 1) -> float:
    """The decay at which a batch-norm moving statistic (``momentum``, moved ``micro_batches`` times a step) is
    averaged beside weights averaged at ``decay``: the statistic's delay, momentum / (1 − momentum) /
    micro_batches steps, plus its average's must be the weights' average's, decay / (1 − decay) steps; 0 (the
    raw statistic of the last applied step) where the statistic's own delay is as long.

    >>> statistics_decay(0.99, 0.99), round(statistics_decay(0.999, 0.99), 6), statistics_decay(0.5, 0.9)
    (0.0, 0.99889, 0.0)
    >>> round(statistics_decay(0.99, 0.99, micro_batches=3), 6)  # delays 99 and 33: 66 steps more, 66 / 67
    0.985075
    """
    if momentum >= 1:  # a statistic that never moves: any average of it is itself
        return 0.0
    rest = decay / (1 - decay) - momentum / (1 - momentum) / micro_batches
    return rest / (1 + rest) if rest > 0 else 0.0


class WeightAverage:
    """The exponential moving average of ``model``'s trainable weights at ``decay`` and of the moving statistics
    of its batch-norm layers that train (:func:`~captioning.train.steps.training_batch_norms`), each at
    :func:`statistics_decay` (none at 0: no variables, no checkpoint item, no step hook); ``micro_batches``:
    ``train.accumulate_steps``. Made inside ``strategy.scope()``."""

    def __init__(self, model, decay: float, strategy: tf.distribute.Strategy, micro_batches: int = 1):
        self.decay, self.strategy = float(decay), strategy
        averaged = [] if decay <= 0 else [(v, self.decay) for v in model.trainable_variables] + [
            (v, statistics_decay(self.decay, float(layer.momentum), micro_batches))
            for layer in training_batch_norms(model) for v in (layer.moving_mean, layer.moving_variance)]
        position = {id(v): i for i, v in enumerate(model.variables)}  # the key inference reads them back by
        self.pairs = [
            (v, tf.Variable(tf.convert_to_tensor(v.value), trainable=False, name=f"average_{position[id(v)]}",
                            synchronization=tf.VariableSynchronization.ON_WRITE,
                            aggregation=tf.VariableAggregation.ONLY_FIRST_REPLICA))
            for v, _ in averaged]
        self.decays = [d for _, d in averaged]  # each pair's
        self.holder = tf.Module()  # the checkpoint item: {"averages": {"<position>": average}}
        self.holder.averages = {str(position[id(v)]): average for v, average in self.pairs}

    @property
    def checkpoint_items(self) -> dict:
        """What the run's ``tf.train.Checkpoint`` holds of it: ``{"ema": ...}``, or nothing when off."""
        return {AVERAGE: self.holder} if self.pairs else {}

    @property
    def after_update(self) -> tuple:
        """The step's hooks (:func:`captioning.train.steps.make_update`): :meth:`update`, or none when off."""
        return (self.update,) if self.pairs else ()

    def update(self) -> None:
        """One step of the average, in cross-replica context, after the optimizer's update: each replica's
        copy from the same replica's copy of the weight."""
        def step_at(decay):
            @tf.autograph.experimental.do_not_convert  # (the strategy's update converts what it calls otherwise)
            def step(average, weight):
                return average.assign(decay * average + (1.0 - decay) * weight)
            return step

        for (variable, average), decay in zip(self.pairs, self.decays):
            self.strategy.extended.update(average, step_at(decay), args=(variable.value,), group=False)

    def start(self, latest: str | None) -> None:
        """Where the average starts, once the run's weights are in place: from the checkpoint ``latest`` the
        run resumed from, as far as it holds one; any weight without (all of them without a checkpoint) from
        the weight itself."""
        if not self.pairs:
            return
        for variable, average in self.pairs:
            average.assign(variable.value)
        if not latest:
            return
        held = CheckpointFiles.averaged(latest)
        name = os.path.basename(latest)
        if not held:
            log.info("%s holds no weight average: train.ema_decay's average starts from its weights", name)
            return
        tf.train.Checkpoint(**self.checkpoint_items).restore(latest).expect_partial()
        fresh = len(set(self.holder.averages) - {str(i) for i in held})
        log.info("resumed the weight average (train.ema_decay %g) from %s%s", self.decay, name,
                 f"; {fresh} weights or statistics without one there start from their values" if fresh else "")
