"""What a training objective is: the interface every objective implements, and the cross-entropy of the
references that evaluation always measures.

The training step (:mod:`captioning.train.steps`) is the same for every objective: each replica calls
:meth:`Objective.replica_loss`, the step all-reduces the weights and divides every replica's loss sum by
the *global* weight, so the summed gradients are those of the global mean whatever the split between
replicas (and a replica with no example contributes nothing).

An objective class declares what the rest of the code asks about it, so that the loop, the summaries
and the benchmarks never name one:

* ``settings_class`` — its own settings, if it has any: a :class:`~captioning.config.settings.Section` dataclass
  whose fields are the keys of the config section named after it (SCST's ``scst:``), typed and checked by
  :func:`captioning.train.objectives.resolve` (the config loader keeps that section as given);
* ``needs`` — the ``data.*`` settings its batches must have (SCST: whole images with all their
  references, ``{"captions_per_image": "grouped", "group_captions": 0}``); choosing the objective brings
  them (:func:`captioning.train.objectives.fit_config`);
* ``parts`` — the quantities its :class:`ReplicaLoss` reports besides the loss (TensorBoard
  ``train/<part>``, per weight);
* ``xla`` — whether its step can be compiled with XLA (``train.jit_compile``);
* :meth:`Objective.check` — rules between its settings and the rest of the config;
* :meth:`Objective.for_run` — the objective of a training run, from the run's :class:`RunContext`;
* :meth:`Objective.sample_notes` — what it has to say about the greedy sample captions of an evaluation
  (SCST: each one's reward), or nothing;
* :meth:`Objective.measure` and :meth:`Objective.summarize` — extra figures for ``benchmark train``
  (SCST: the reward's share of a step) and a line about them; :meth:`Objective.breakdown` — the step's
  parts timed with the run's model (SCST: sampling, scoring, reward, baseline).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import ClassVar

import tensorflow as tf

from captioning.model.base import IMAGE_INPUTS


@dataclass
class ReplicaLoss:
    """A replica's contribution: ``loss_sum / global weight`` is what it differentiates. ``sums`` are other
    quantities to report, summed over the replicas and divided by the global weight (e.g. a reward)."""

    loss_sum: tf.Tensor
    weight: tf.Tensor
    sums: dict[str, tf.Tensor] = field(default_factory=dict)


@dataclass
class RunContext:
    """What a training run hands an objective: the config, the step counter, the prepared dataset and the
    run's shard reader, the model folder (``captioning.model.folder.ModelDir``), whether this process
    writes it (the chief) and the run's tokenizer."""

    cfg: object
    step: tf.Variable
    dataset: object
    shards: object
    folder: object
    chief: bool = True
    tokenizer: object = None  # data.tokenizer's (captioning.data.tokenizers); None: the dataset's word vocabulary


class Objective:
    """The interface (see the module docstring)."""

    name: ClassVar[str] = ""
    settings_class: ClassVar[type | None] = None  # its config section's dataclass (named ``name``), if any
    needs: ClassVar[dict] = {}
    parts: ClassVar[tuple[str, ...]] = ()
    xla: ClassVar[bool] = True

    @classmethod
    def check(cls, cfg) -> None:
        """InputError when ``cfg`` cannot train with this objective (beyond ``needs``)."""

    @classmethod
    def caption_lengths(cls, cfg) -> dict[str, int]:
        """The captions it decodes itself while training, as ``{config key: words}`` (SCST's samples:
        ``scst.max_length``): checked against the decoder's bound before the run starts. None by default."""
        return {}

    @classmethod
    def for_run(cls, context: RunContext) -> "Objective":
        raise NotImplementedError

    def replica_loss(self, model, batch: dict, training: bool) -> ReplicaLoss:
        raise NotImplementedError

    def sample_notes(self, best: dict, captions, images=None) -> list[str] | None:
        """Per sample caption (a greedy beam search's ``best`` for eval images whose references are
        ``captions``, ragged ids; ``images`` their pixels, None when the batch has none), a note shown beside it in
        TensorBoard; None for none."""
        return None

    @classmethod
    def measure(cls, cfg, images: float, references: float, step_ms: float) -> dict:
        """Extra figures for ``benchmark train`` about a step of ``images`` per replica with ``references``
        each that took ``step_ms``; none by default."""
        return {}

    def breakdown(self, model, batch: dict) -> dict:
        """For ``benchmark train`` after its run: what the step spends its time on, timed on ``batch`` (one
        replica's) with the run's ``model``, as figures for the JSON and under ``"note"`` one line about
        them; nothing by default (SCST: :mod:`captioning.train.objectives.scst_cost`)."""
        return {}

    @classmethod
    def summarize(cls, figures: dict) -> str:
        """One line about what :meth:`measure` gave."""
        return ", ".join(f"{k} {v:.3g}" for k, v in figures.items())


def caption_loss_sum(model, batch: dict, training: bool = False, split_padding: bool = False,
                     penalty: bool = False, parts: bool = False, label_smoothing: float = 0.0, sampling=None):
    """Cross-entropy summed over the real (unmasked) target words of ``batch``; training divides it by
    the global batch's word count, evaluation by the split's (perplexity = exp(mean)). ``split_padding``:
    the decoder skips most padded steps (:mod:`captioning.model.base`; the same value). ``penalty``: plus
    the decoder's per-caption penalty summed over the captions (the attention decoder's doubly
    stochastic regularisation), which training adds and evaluation leaves out. Both sums are divided by
    the same token count, so a per-caption penalty weighs against each caption's summed cross-entropy
    as in the papers that average both per caption. ``parts``: returns ``(cross-entropy sum, penalty
    sum, smoothed cross-entropy sum)`` instead of one number. ``label_smoothing`` ε: the loss against (1 −
    ε) on the reference word and ε spread evenly over the vocabulary, ``(1 − ε) CE + ε · mean_w −log p(w)``
    (the plain cross-entropy is what ``parts`` reports first, for perplexity). ``sampling``: scheduled
    sampling's ``(probability, seed)`` (:meth:`~captioning.model.base.CaptionModel.logits_and_penalty`)."""
    inputs = {k: batch[k] for k in IMAGE_INPUTS + ("image_index", "input_ids") if k in batch}
    logits, extra = model.logits_and_penalty(inputs, training=training, split_padding=split_padding,
                                             sampling=sampling)
    ce = tf.nn.sparse_softmax_cross_entropy_with_logits(labels=batch["target_ids"], logits=logits)
    total = tf.reduce_sum(ce * batch["mask"])
    smoothed = total
    if label_smoothing:
        uniform = -tf.reduce_mean(tf.nn.log_softmax(logits), axis=-1)
        smoothed = tf.reduce_sum(((1.0 - label_smoothing) * ce + label_smoothing * uniform) * batch["mask"])
    if parts:
        return total, tf.reduce_sum(extra), smoothed
    return smoothed + tf.reduce_sum(extra) if penalty else smoothed


MICRO_BATCH = "micro_batch"  # the key train.accumulate_steps adds to a batch: its index in the optimizer step


def step_seed(seed: int, step, batch: dict):
    """The stateless seed (int32 ``[2]``) of a training step's random draws, ``(seed, step)``; with several
    micro-batches a step (:mod:`captioning.train.accumulate`, which sets ``batch[MICRO_BATCH]``) folded with the
    micro-batch's index from the second on, so each micro-batch draws its own numbers and the first the single
    step's."""
    pair = tf.stack([tf.constant(seed, tf.int32), tf.cast(step, tf.int32)])
    if MICRO_BATCH not in batch:
        return pair
    index = tf.cast(batch[MICRO_BATCH], tf.int32)
    return tf.where(index > 0, tf.random.experimental.stateless_fold_in(pair, index), pair)


def perplexity(loss_per_token: float) -> float:
    """``exp(mean cross-entropy per token)``, capped at exp(50) so a diverged model reports a number."""
    return math.exp(min(loss_per_token, 50.0))
