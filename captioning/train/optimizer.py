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
from captioning.config_sections import TrainConfig
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


class _ScaledRates:
    """A Keras optimizer whose learning rate is multiplied by a factor for some variables (``scales``: a
    variables at one factor; the others at 1), in its update and in AdamW's decoupled decay, which both scale
    with the rate. Keyed as Keras keys a variable's slots (``_var_key``), so under a distribution strategy each
    replica's copy finds its factor. The optimizer's variables are those of the class it extends: a checkpoint
    does not tell them apart."""

    def set_rate_scales(self, variables, factor: float) -> None:
        self._rate_scales = {self._var_key(v): float(factor) for v in variables} if float(factor) != 1.0 else {}

    def _scaled(self, learning_rate, variable):
        factor = getattr(self, "_rate_scales", {}).get(self._var_key(variable))
        return learning_rate if factor is None else learning_rate * factor

    def update_step(self, gradient, variable, learning_rate):
        return super().update_step(gradient, variable, self._scaled(learning_rate, variable))

    def _apply_weight_decay(self, variables):
        if self.weight_decay is None or not getattr(self, "_rate_scales", None):
            return super()._apply_weight_decay(variables)

        def decay(distribution, variables, **kwargs):  # Keras' own, with each variable's rate
            def decay_one(variable):
                if self._use_weight_decay(variable):
                    rate = tf.cast(self._scaled(self.learning_rate, variable), variable.dtype)
                    variable.assign_sub(variable * tf.cast(self.weight_decay, variable.dtype) * rate)

            for variable in variables:
                distribution.extended.update(getattr(variable, "value", variable), decay_one, group=False)

        tf.__internal__.distribute.interim.maybe_merge_call(decay, self._distribution_strategy, variables)


_SCALED = {name: type(name, (_ScaledRates, getattr(keras.optimizers, name)), {})  # named as Keras names it
           for name in ("SGD", "Adam", "AdamW")}


def make_optimizer(t: TrainConfig, steps_per_epoch: int, mixed_float16: bool, scaled=(),
                   scale: float = 1.0):
    """The optimizer of ``train.*``; the learning rate of the ``scaled`` variables is ``scale`` times the others'
    (a fine-tuned encoder's at ``train.encoder_lr_scale``: im2txt's second stage and BLIP's fine-tuning train
    the image encoder slower than the decoder)."""
    schedule = LearningRate(t.learning_rate, t.lr_schedule, round(t.lr_decay_epochs * steps_per_epoch),
                            t.lr_decay_factor, t.steps, t.warmup_steps)
    if t.optimizer == "sgd":
        optimizer = _SCALED["SGD"](learning_rate=schedule, momentum=t.momentum)
    elif t.optimizer == "adamw":  # the decay scales with the learning rate, as Keras (and PyTorch) apply it
        optimizer = _SCALED["AdamW"](learning_rate=schedule, weight_decay=t.weight_decay)
    else:
        optimizer = _SCALED["Adam"](learning_rate=schedule)
    optimizer.set_rate_scales(scaled, scale)
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
