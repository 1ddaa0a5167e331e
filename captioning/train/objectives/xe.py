"""``train.objective: xe``: the masked cross-entropy of the reference captions (teacher forcing), weighted
by real target tokens: the mean per token over the global batch (label-smoothed with
``train.label_smoothing``), plus the decoder's penalty if it has one
(:meth:`captioning.model.base.CaptionModel.penalty`). Evaluation always measures the cross-entropy alone
(:func:`~captioning.train.objectives.base.perplexity` of the references), whatever the objective.

With ``train.scheduled_sampling`` (``max`` > 0) the training pass feeds the decoder its own sampled previous
word with the schedule's probability at the current optimizer step
(:mod:`captioning.model.scheduled_sampling`), computed in the graph from the step counter; the part
``scheduled_sampling`` reports that probability (TensorBoard ``train/scheduled_sampling``, and the log line
once it is above 0). A decoder that does not take it is refused before the run starts (:meth:`check`). With
``max: 0`` the pass is the plain teacher-forced one, split padding included."""

from __future__ import annotations

import tensorflow as tf

from captioning.errors import InputError
from captioning.model import DECODERS, decoder_class
from captioning.model import scheduled_sampling as ss
from captioning.train.objectives.base import Objective, ReplicaLoss, RunContext, caption_loss_sum, step_seed


class CrossEntropy(Objective):
    name = "xe"
    # reported apart: perplexity is of the cross-entropy alone; scheduled_sampling: the probability (0: off)
    parts = ("cross_entropy", "penalty", "scheduled_sampling")

    def __init__(self, split_padding: bool = False, label_smoothing: float = 0.0, scheduled_sampling=None,
                 step=None, seed: int = 0):
        """``scheduled_sampling``: a :class:`~captioning.config.sections.ScheduledSamplingConfig` that is on
        (None: off), its probability read from the optimizer step counter ``step`` (a variable); ``seed``: the
        run's (``train.seed``), for its draws."""
        self.split_padding, self.label_smoothing = split_padding, label_smoothing
        self.scheduled_sampling, self.step, self.seed = scheduled_sampling, step, seed

    @classmethod
    def check(cls, cfg) -> None:
        """Scheduled sampling only for a decoder that takes it (the recurrent ones), in one line."""
        if cfg.train.scheduled_sampling.enabled and not decoder_class(cfg.model.decoder).scheduled_sampling:
            takes = ", ".join(name for name, c in DECODERS.items() if c.scheduled_sampling)
            raise InputError(f"train.scheduled_sampling does not apply to model.decoder {cfg.model.decoder}: its "
                             f"teacher-forced pass does not run word by word; set train.scheduled_sampling.max: 0 "
                             f"(off), or use a decoder that takes it ({takes})")

    @classmethod
    def for_run(cls, context: RunContext) -> "CrossEntropy":
        train = context.cfg.train
        sampling = train.scheduled_sampling if train.scheduled_sampling.enabled else None
        # split padding needs shapes that vary per batch, which XLA cannot compile
        return cls(split_padding=train.split_padding and not train.jit_compile, label_smoothing=train.label_smoothing,
                   scheduled_sampling=sampling, step=context.step, seed=train.seed)

    def replica_loss(self, model, batch, training):
        probability, sampling = tf.constant(0.0), None
        if self.scheduled_sampling is not None:
            probability = ss.probability(self.scheduled_sampling, self.step)
            if training:  # evaluation's passes are always teacher-forced
                sampling = (probability, ss.replica_seed(step_seed(self.seed, self.step, batch)))
        ce, penalty, smoothed = caption_loss_sum(model, batch, training=training, split_padding=self.split_padding,
                                                 parts=True, label_smoothing=self.label_smoothing, sampling=sampling)
        weight = tf.reduce_sum(batch["mask"])
        # the loss is the smoothed cross-entropy; reported apart: the plain one, whose exp is the perplexity
        return ReplicaLoss(smoothed + penalty, weight, {"cross_entropy": ce, "penalty": penalty,
                                                        "scheduled_sampling": probability * weight})
