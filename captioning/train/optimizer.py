"""The optimizer and its learning-rate schedule, from ``train.*``.

SGD (the paper's and im2txt's: 2.0, halved every 8 epochs, gradients clipped at 5; ``train.momentum``
for heavy-ball momentum) or Adam, with linear
warm-up and a constant, step, exponential or cosine schedule. Under ``mixed_float16`` the optimizer is
wrapped in Keras' dynamic loss scaling. Gradient clipping is not the optimizer's: Keras 3 clips per
replica before its own all-reduce, so the training step clips the global gradient itself
(:mod:`captioning.train.steps`).
"""

from __future__ import annotations

import math

import keras
import tensorflow as tf

from captioning import config as config_lib
from captioning.batching import epoch_captions_per_image


class LearningRate(keras.optimizers.schedules.LearningRateSchedule):
    """Linear warm-up, then constant, step (staircase), exponential or cosine decay.

    ``step``: multiply by ``factor`` every ``decay_steps`` (im2txt: 0.5 every 8 epochs);
    ``exponential``: the same, continuously; ``cosine``: from the base rate to 0 at ``total_steps``.
    """

    def __init__(self, base: float, kind: str, decay_steps: int, factor: float, total_steps: int,
                 warmup_steps: int = 0):
        self.base, self.kind, self.decay_steps, self.factor = base, kind, max(1, decay_steps), factor
        self.total_steps, self.warmup_steps = max(1, total_steps), warmup_steps

    def __call__(self, step):
        step = tf.cast(step, tf.float32)
        progress = tf.maximum(step - self.warmup_steps, 0.0)
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


def make_optimizer(t: config_lib.TrainConfig, steps_per_epoch: int, mixed_float16: bool):
    schedule = LearningRate(t.learning_rate, t.lr_schedule, round(t.lr_decay_epochs * steps_per_epoch),
                            t.lr_decay_factor, t.steps, t.warmup_steps)
    if t.optimizer == "sgd":
        optimizer = keras.optimizers.SGD(learning_rate=schedule, momentum=t.momentum)
    else:
        optimizer = keras.optimizers.Adam(learning_rate=schedule)
    return keras.optimizers.LossScaleOptimizer(optimizer) if mixed_float16 else optimizer


def examples_per_epoch(dataset, cfg: config_lib.Config) -> int:
    """Examples (captions) in one epoch of ``dataset``'s (a PreparedDataset) training split: every caption
    (``all``, ``grouped``), one per image (``sample``), or about ``data.group_captions`` per image."""
    split = dataset.split(cfg.data.train_split)
    if cfg.data.captions_per_image == "all" or (cfg.data.captions_per_image == "grouped" and not cfg.data.group_captions):
        return split.captions
    return round(split.images * epoch_captions_per_image(cfg.data, split.captions_per_image))
