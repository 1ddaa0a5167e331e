"""``train.objective: xe``: the masked cross-entropy of the reference captions (teacher forcing), weighted
by real target tokens: the mean per token over the global batch (label-smoothed with
``train.label_smoothing``), plus the decoder's penalty if it has one
(:meth:`captioning.model.base.CaptionModel.penalty`). Evaluation always measures the cross-entropy alone
(:func:`~captioning.train.objectives.base.perplexity` of the references), whatever the objective."""

from __future__ import annotations

import tensorflow as tf

from captioning.train.objectives.base import Objective, ReplicaLoss, RunContext, caption_loss_sum


class CrossEntropy(Objective):
    name = "xe"
    parts = ("cross_entropy", "penalty")  # reported apart: perplexity is of the cross-entropy alone

    def __init__(self, split_padding: bool = False, label_smoothing: float = 0.0):
        self.split_padding, self.label_smoothing = split_padding, label_smoothing

    @classmethod
    def for_run(cls, context: RunContext) -> "CrossEntropy":
        train = context.cfg.train
        # split padding needs shapes that vary per batch, which XLA cannot compile
        return cls(split_padding=train.split_padding and not train.jit_compile, label_smoothing=train.label_smoothing)

    def replica_loss(self, model, batch, training):
        ce, penalty, smoothed = caption_loss_sum(model, batch, training=training, split_padding=self.split_padding,
                                                 parts=True, label_smoothing=self.label_smoothing)
        # the loss is the smoothed cross-entropy; reported apart: the plain one, whose exp is the perplexity
        return ReplicaLoss(smoothed + penalty, tf.reduce_sum(batch["mask"]), {"cross_entropy": ce, "penalty": penalty})
