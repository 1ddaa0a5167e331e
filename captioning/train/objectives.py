"""Training objectives: what one replica's loss is on its share of the global batch.

The training step (:mod:`captioning.train.steps`) is the same for every objective: each replica calls
:meth:`Objective.replica_loss`, the step all-reduces the weights and divides every replica's loss sum by
the *global* weight, so the summed gradients are those of the global mean whatever the split between
replicas (and a replica with no example contributes nothing). A new objective is a new class here (or a
module) and a value of ``train.objective``.

``xe`` (:class:`CrossEntropy`): the masked cross-entropy of the reference captions (teacher forcing),
weighted by real target tokens: the mean per token over the global batch (plus the decoder's penalty,
if it has one: :meth:`captioning.model.base.CaptionModel.penalty`). Evaluation always measures
this one (:func:`perplexity` of the references), whatever the training objective.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import tensorflow as tf


@dataclass
class ReplicaLoss:
    """A replica's contribution: ``loss_sum / global weight`` is what it differentiates. ``sums`` are other
    quantities to report, summed over the replicas and divided by the global weight (e.g. a reward)."""

    loss_sum: tf.Tensor
    weight: tf.Tensor
    sums: dict[str, tf.Tensor] = field(default_factory=dict)


class Objective:
    name = ""

    def replica_loss(self, model, batch: dict, training: bool) -> ReplicaLoss:
        raise NotImplementedError


def caption_loss_sum(model, batch: dict, training: bool = False, split_padding: bool = False,
                     penalty: bool = False, parts: bool = False):
    """Cross-entropy summed over the real (unmasked) target words of ``batch``; training divides it by
    the global batch's word count, evaluation by the split's (perplexity = exp(mean)). ``split_padding``:
    the decoder skips most padded steps (:mod:`captioning.model.base`; the same value). ``penalty``: plus
    the decoder's per-caption penalty summed over the captions (the attention decoder's doubly
    stochastic regularisation), which training adds and evaluation leaves out. Both sums are divided by
    the same token count, so a per-caption penalty weighs against each caption's summed cross-entropy
    as in the papers that average both per caption. ``parts``: returns ``(cross-entropy sum, penalty
    sum)`` instead of one number."""
    inputs = {k: batch[k] for k in ("image", "features", "image_index", "input_ids") if k in batch}
    logits, extra = model.logits_and_penalty(inputs, training=training, split_padding=split_padding)
    ce = tf.nn.sparse_softmax_cross_entropy_with_logits(labels=batch["target_ids"], logits=logits)
    total = tf.reduce_sum(ce * batch["mask"])
    if parts:
        return total, tf.reduce_sum(extra)
    return total + tf.reduce_sum(extra) if penalty else total


class CrossEntropy(Objective):
    name = "xe"

    def __init__(self, split_padding: bool = False):
        self.split_padding = split_padding

    def replica_loss(self, model, batch, training):
        ce, penalty = caption_loss_sum(model, batch, training=training, split_padding=self.split_padding, parts=True)
        # reported apart: perplexity is of the cross-entropy alone
        return ReplicaLoss(ce + penalty, tf.reduce_sum(batch["mask"]), {"cross_entropy": ce, "penalty": penalty})


OBJECTIVES: dict[str, type[Objective]] = {"xe": CrossEntropy}  # scst: captioning.train.scst


def make_objective(cfg, step, dataset, shards, frequencies_file: str, chief: bool) -> Objective:
    """The run's objective (``train.objective``). ``scst`` reads the CIDEr-D document frequencies from
    ``frequencies_file`` (the model folder's), counting them from the training split's references first
    when the file is missing or was counted from other data (written by the ``chief`` only)."""
    if cfg.train.objective == "scst":
        from captioning.train.scst import SelfCritical

        return SelfCritical.for_run(cfg, step, dataset, shards, frequencies_file, chief)
    # split padding needs shapes that vary per batch, which XLA cannot compile
    return CrossEntropy(split_padding=cfg.train.split_padding and not cfg.train.jit_compile)


def perplexity(loss_per_token: float) -> float:
    """``exp(mean cross-entropy per token)``, capped at exp(50) so a diverged model reports a number."""
    return math.exp(min(loss_per_token, 50.0))
