"""``train.objective: xe``: the masked cross-entropy of the reference captions (teacher forcing), weighted
by real target tokens: the mean per token over the global batch, plus the decoder's penalty if it has one
(:meth:`captioning.model.base.CaptionModel.penalty`). Evaluation always measures the cross-entropy alone
(:func:`~captioning.train.objectives.base.perplexity` of the references), whatever the objective."""

from __future__ import annotations

import tensorflow as tf

from captioning.train.objectives.base import Objective, ReplicaLoss, RunContext, caption_loss_sum


class CrossEntropy(Objective):
    name = "xe"
    parts = ("cross_entropy", "penalty")  # reported apart: perplexity is of the cross-entropy alone

    def __init__(self, split_padding: bool = False):
        self.split_padding = split_padding

    @classmethod
    def for_run(cls, context: RunContext) -> "CrossEntropy":
        train = context.cfg.train
        # split padding needs shapes that vary per batch, which XLA cannot compile
        return cls(split_padding=train.split_padding and not train.jit_compile)

    def replica_loss(self, model, batch, training):
        ce, penalty = caption_loss_sum(model, batch, training=training, split_padding=self.split_padding, parts=True)
        return ReplicaLoss(ce + penalty, tf.reduce_sum(batch["mask"]), {"cross_entropy": ce, "penalty": penalty})
