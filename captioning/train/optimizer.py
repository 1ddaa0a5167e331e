"""The optimizer and its learning-rate schedule, from ``train.*``.

SGD (the paper's and im2txt's: 2.0, halved every 8 epochs, gradients clipped at 5; ``train.momentum``
for heavy-ball momentum), Adam, or AdamW (``train.weight_decay``), with linear warm-up and a constant,
step, exponential, cosine or noam schedule. Under ``mixed_float16`` the optimizer is
wrapped in Keras' dynamic loss scaling. Gradient clipping is not the optimizer's: Keras 3 clips per
replica before its own all-reduce, so the training step clips the global gradient itself
(:mod:`captioning.train.steps`).
"""

from __future__ import annotations

import math

import keras
import tensorflow as tf

from captioning import config as config_lib
from captioning.config.sections import TrainConfig
from dataclasses import dataclass

from captioning.data.batching import epoch_captions_per_image, images_per_batch


class LearningRate(keras.optimizers.schedules.LearningRateSchedule):
    """Linear warm-up, then constant, step (staircase), exponential or cosine decay.

    ``step``: multiply by ``factor`` every ``decay_steps`` (im2txt: 0.5 every 8 epochs);
    ``exponential``: the same, continuously; ``cosine``: from the base rate to 0 at ``total_steps``;
    ``noam`` (Vaswani et al.): up linearly to the base rate at ``warmup_steps``, then down as
    ``sqrt(warmup_steps / step)`` — the paper's ``d_model^-0.5 · min(step^-0.5, step · warmup^-1.5)``
    with its peak, ``(d_model · warmup)^-0.5``, as the base rate (self-critical.pytorch's Transformer:
    d_model 512, 20,000 warm-up steps, a peak of 3.1e-4).

    >>> noam = LearningRate(1.0, "noam", decay_steps=1, factor=1.0, total_steps=100, warmup_steps=4)
    >>> [round(float(noam(step)), 3) for step in (0, 1, 3, 15, 99)]
    [0.25, 0.5, 1.0, 0.5, 0.2]
    """

    def __init__(self, base: float, kind: str, decay_steps: int, factor: float, total_steps: int,
                 warmup_steps: int = 0):
        self.base, self.kind, self.decay_steps, self.factor = base, kind, max(1, decay_steps), factor
        self.total_steps, self.warmup_steps = max(1, total_steps), warmup_steps

    def __call__(self, step):
        step = tf.cast(step, tf.float32)
        progress = tf.maximum(step - self.warmup_steps, 0.0)
        if self.kind == "noam":  # step counts from 0: the first update is step 1's
            return self.base * tf.minimum((step + 1.0) / self.warmup_steps,
                                          tf.sqrt(self.warmup_steps / (step + 1.0)))
        if self.kind == "step":
            rate = self.base * self.factor ** tf.floor(progress / self.decay_steps)
        elif self.kind == "exponential":
            rate = self.base * self.factor ** (progress / self.decay_steps)
        elif self.kind == "cosine":
            span = max(1, self.total_steps - self.warmup_steps)
            rate = self.base * 0.5 * (1.0 + tf.cos(math.pi * tf.minimum(progress / span, 1.0)))
        else:
            rate = tf.constant(self.base, tf.float32)
        if self.warmup_steps:
            rate = rate * tf.minimum(1.0, (step + 1.0) / self.warmup_steps)
        return rate

    def get_config(self):
        return {"base": self.base, "kind": self.kind, "decay_steps": self.decay_steps, "factor": self.factor,
                "total_steps": self.total_steps, "warmup_steps": self.warmup_steps}


def _tf_variable(variable):
    return variable.value if isinstance(variable, keras.Variable) else variable


def _handle(variable):
    """The resource handle a fused kernel updates: in a strategy's update call, the current device's copy."""
    return _tf_variable(variable).handle


class _ScaledRates:
    """A Keras optimizer whose learning rate is multiplied by a factor for some variables (``scales``: a
    variables at one factor; the others at 1), in its update and in AdamW's decoupled decay, which both scale
    with the rate. Keyed as Keras keys a variable's slots (``_var_key``), so under a distribution strategy each
    replica's copy finds its factor. The optimizer's variables are those of the class it extends: a checkpoint
    does not tell them apart.

    AdamW's decay reads the learning rate once per step (Keras' own evaluates the schedule again for every
    variable: a noam schedule's ten operations, times the variables, in every traced step)."""

    def set_rate_scales(self, variables, factor: float, *groups) -> None:
        """``variables`` at ``factor`` times the rate, and each further ``(variables, factor)`` of ``groups``."""
        self._rate_scales = {self._var_key(v): float(f) for vs, f in ((variables, factor), *groups) for v in vs
                             if float(f) != 1.0}

    def _scaled(self, learning_rate, variable):
        factor = getattr(self, "_rate_scales", {}).get(self._var_key(variable))
        if factor is None:
            return learning_rate
        if getattr(self, "_step_scalars", None) is None:
            return learning_rate * factor
        return self._scalar(("scaled", factor), None, lambda: learning_rate * factor, of=learning_rate)  # once a step

    def update_step(self, gradient, variable, learning_rate):
        return super().update_step(gradient, variable, self._scaled(learning_rate, variable))

    def _apply_weight_decay(self, variables):
        if self.weight_decay is None:
            return
        learning_rate = self.learning_rate  # the schedule, once

        def decay(distribution, variables, **kwargs):  # Keras' own, with each variable's rate
            def decay_one(variable):
                if self._use_weight_decay(variable):
                    rate = tf.cast(self._scaled(learning_rate, variable), variable.dtype)
                    variable.assign_sub(variable * tf.cast(self.weight_decay, variable.dtype) * rate)

            for variable in variables:
                distribution.extended.update(_tf_variable(variable), decay_one, group=False)

        tf.__internal__.distribute.interim.maybe_merge_call(decay, self._distribution_strategy, variables)


class _FusedUpdates:
    """Keras' update of a variable as TensorFlow's fused kernel for it: one ``ResourceApply*`` operation a
    variable (``ResourceApplyAdam``, ``ResourceApplyKerasMomentum``, ``ResourceApplyGradientDescent``: the
    kernels ``tf.keras`` 2 optimizers ran) instead of the element-wise operations Keras 3 writes for each (about 30 for
    Adam, 7 for SGD with momentum), with the step's scalars (the cast learning rate, Adam's ``beta ** t``) computed
    once a step rather than once a variable. The formula and the slot variables are Keras' own, so checkpoints do
    not change. SGD's kernels give Keras' bits; Adam's computes ``1 - beta_2`` in float32 (0.00099998713, not
    0.001), so its second moments differ from Keras' in the fifth digit. Anything else (an ``IndexedSlices``
    gradient, a dtype the kernel lacks, AMSGrad, Nesterov) takes Keras' update.

    Under a distribution strategy each replica's kernel updates its own copy: Keras calls ``update_step``
    inside ``strategy.extended.update``, where a mirrored variable's ``handle`` is the current device's.
    A smaller graph is cheaper to trace and to optimize: the step of ``experiments/shapes_transformer.yaml``
    (Adam) has 7,929 graph nodes instead of 12,473, and its first step took 6.7 to 11.2 s instead of 11.3 to
    16.7 s (docs/training.md has the runs and the command)."""

    _KERNEL_DTYPES = (tf.float16, tf.bfloat16, tf.float32, tf.float64)

    def _backend_update_step(self, grads, trainable_variables, learning_rate):
        self._step_scalars = {}  # (name, dtype, id) -> (kept object, tensor), for the update being traced
        try:
            super()._backend_update_step(grads, trainable_variables, learning_rate)
        finally:
            self._step_scalars = None

    def _scalar(self, name, dtype, make, of=None):
        """``make()``, made once for the update being traced; ``of``: the value it derives from (the step's
        learning rate, a tensor or variable), told apart by identity and kept alive with it."""
        cache = getattr(self, "_step_scalars", None)
        if cache is None:
            return make()
        key = (name, dtype, id(of))
        if key not in cache:
            cache[key] = (of, make())
        return cache[key][1]

    def update_step(self, gradient, variable, learning_rate):
        if not self._fusable(gradient, variable):
            return super().update_step(gradient, variable, learning_rate)
        dtype = variable.dtype
        lr = self._scalar("learning_rate", dtype, lambda: tf.cast(learning_rate, dtype), of=learning_rate)
        self._fused_update(tf.cast(gradient, dtype), variable, lr)

    def _fusable(self, gradient, variable) -> bool:
        return (not isinstance(gradient, tf.IndexedSlices) and tf.as_dtype(variable.dtype) in self._KERNEL_DTYPES
                and self._kernel_applies())


class _FusedAdam(_FusedUpdates):
    def _kernel_applies(self) -> bool:  # ResourceApplyAdam has no AMSGrad
        return not self.amsgrad

    def _fused_update(self, gradient, variable, lr):
        dtype = variable.dtype

        def powers():
            step = tf.cast(self.iterations + 1, dtype)
            return tf.pow(tf.cast(self.beta_1, dtype), step), tf.pow(tf.cast(self.beta_2, dtype), step)

        beta_1_power, beta_2_power = self._scalar("beta_powers", dtype, powers)
        index = self._get_variable_index(variable)
        tf.raw_ops.ResourceApplyAdam(
            var=_handle(variable), m=_handle(self._momentums[index]), v=_handle(self._velocities[index]),
            beta1_power=beta_1_power, beta2_power=beta_2_power, lr=lr,
            beta1=self._scalar("beta_1", dtype, lambda: tf.cast(self.beta_1, dtype)),
            beta2=self._scalar("beta_2", dtype, lambda: tf.cast(self.beta_2, dtype)),
            epsilon=self._scalar("epsilon", dtype, lambda: tf.cast(self.epsilon, dtype)),
            grad=gradient, use_locking=False)


class _FusedSGD(_FusedUpdates):
    def _kernel_applies(self) -> bool:  # Nesterov (no config key asks for it) keeps Keras' update
        return not self.nesterov

    def _fused_update(self, gradient, variable, lr):
        if self.momentum == 0:
            tf.raw_ops.ResourceApplyGradientDescent(var=_handle(variable), alpha=lr, delta=gradient, use_locking=False)
            return
        dtype = variable.dtype
        tf.raw_ops.ResourceApplyKerasMomentum(
            var=_handle(variable), accum=_handle(self.momentums[self._get_variable_index(variable)]), lr=lr,
            grad=gradient, momentum=self._scalar("momentum", dtype, lambda: tf.cast(self.momentum, dtype)),
            use_locking=False, use_nesterov=False)


_FUSED = {"SGD": _FusedSGD, "Adam": _FusedAdam, "AdamW": _FusedAdam}
# named as Keras names them; keyed by (name, fused)
_CLASSES = {(name, fused): type(name, (_ScaledRates, *([_FUSED[name]] if fused else []),
                                       getattr(keras.optimizers, name)), {})
            for name in ("SGD", "Adam", "AdamW") for fused in (True, False)}


def make_optimizer(t: TrainConfig, steps_per_epoch: int, mixed_float16: bool, scaled=(),
                   scale: float = 1.0, fused: bool = True, lm=()):
    """The optimizer of ``train.*``; the learning rate of the ``scaled`` variables is ``scale`` times the others'
    (a fine-tuned encoder's at ``train.encoder_lr_scale``: im2txt's second stage and BLIP's fine-tuning train
    the image encoder slower than the decoder), and that of the ``lm`` variables (a prefix_lm's fine-tuned language
    model or its LoRA adapters) ``train.lm_lr_scale`` times the others'. ``fused``: each variable's update as one
    TensorFlow kernel
    (:class:`_FusedUpdates`, ``train.fused_updates``); False gives Keras' own element-wise update, the reference
    the tests hold the fused one to."""
    schedule = LearningRate(t.learning_rate, t.lr_schedule, round(t.lr_decay_epochs * steps_per_epoch),
                            t.lr_decay_factor, t.steps, t.warmup_steps)
    if t.optimizer == "sgd":
        optimizer = _CLASSES["SGD", fused](learning_rate=schedule, momentum=t.momentum)
    elif t.optimizer == "adamw":  # the decay scales with the learning rate, as Keras (and PyTorch) apply it
        optimizer = _CLASSES["AdamW", fused](learning_rate=schedule, weight_decay=t.weight_decay)
    else:
        optimizer = _CLASSES["Adam", fused](learning_rate=schedule)
    optimizer.set_rate_scales(scaled, scale, (lm, t.lm_lr_scale))
    return keras.optimizers.LossScaleOptimizer(optimizer) if mixed_float16 else optimizer


@dataclass(frozen=True)
class EpochPlan:
    """What one training batch holds and how many optimizer steps make an epoch (the schedule's epochs count
    these). ``images`` is None for per-caption batches (``batch_size`` captions, each with its image).
    ``micro_batches``: batches per optimizer step (``train.accumulate_steps``), each as described."""

    batch_size: int
    captions: float  # captions a global batch holds (on average)
    images: int | None  # grouped batches: whole images a global batch holds
    steps_per_epoch: int  # optimizer steps
    micro_batches: int = 1

    def describe(self) -> str:
        if self.images is None:
            batch = f"global batch {self.batch_size} captions"
        else:
            batch = (f"global batch {self.images} image{'s' if self.images != 1 else ''} with all their captions "
                     f"(about {self.captions:.0f} captions; train.batch_size {self.batch_size})")
        return batch if self.micro_batches == 1 else f"{self.micro_batches} micro-batches a step, each a {batch}"

    @property
    def step_captions(self) -> float:
        """Captions an optimizer step trains on: its micro-batches' (examples per second count these)."""
        return self.captions * self.micro_batches


def epoch_plan(dataset, cfg: config_lib.Config, replicas: int = 1, held: int | None = None) -> EpochPlan:
    """The :class:`EpochPlan` of training ``cfg`` on ``dataset``'s (a PreparedDataset) training split over
    ``replicas``. Per-caption batches: every caption once an epoch (``all``), one per image (``sample``).
    Grouped batches hold whole images, each replica :func:`~captioning.data.batching.images_per_batch` of its
    share of ``train.batch_size``: with 5 captions per image, a batch size of 3 still holds one image and
    its 5 captions, and an epoch is one step per image (not per 3 captions). ``held``: the split's images
    training reads, when fewer than all (``data.features: regions``: those with regions in the store); their
    captions are counted at the split's mean per image.

    >>> class Split: images, captions, captions_per_image = 100, 500, 5.0
    >>> class Data:
    ...     def split(self, name): return Split()
    >>> cfg = config_lib.load_config(None, ["data.captions_per_image=grouped", "train.batch_size=3"])
    >>> plan = epoch_plan(Data(), cfg); (plan.images, plan.captions, plan.steps_per_epoch)
    (1, 5.0, 100)
    >>> plan.describe()
    'global batch 1 image with all their captions (about 5 captions; train.batch_size 3)'
    >>> epoch_plan(Data(), cfg, held=60).steps_per_epoch  # regions of 60 of the 100 images
    60

    With ``train.accumulate_steps`` K an epoch is its batches / K optimizer steps (the step counter, the
    schedule and the logs count optimizer steps):

    >>> cfg = config_lib.load_config(None, ["train.batch_size=10", "train.accumulate_steps=4"])
    >>> plan = epoch_plan(Data(), cfg); (plan.steps_per_epoch, plan.describe())
    (12, '4 micro-batches a step, each a global batch 10 captions')
    """
    split = dataset.split(cfg.data.train_split)
    per_image = epoch_captions_per_image(cfg.data, split.captions_per_image)
    batch, k = cfg.train.batch_size, cfg.train.accumulate_steps
    read = split.images if held is None else min(held, split.images)
    if cfg.data.captions_per_image != "grouped":
        captions = round(read * split.captions_per_image) if cfg.data.captions_per_image == "all" else read
        return EpochPlan(batch, float(batch), None, max(1, captions // batch // k), k)
    images = replicas * images_per_batch(batch // replicas, per_image)
    return EpochPlan(batch, images * per_image, images, max(1, read // images // k), k)
