"""What a training run logs: a line and TensorBoard scalars every ``train.log_every_steps``, and the
validation loss with sample captions at every evaluation.

TensorBoard, ``MODEL_DIR/logs``::

    train/   loss, perplexity, gradient_norm, learning_rate, skipped_batches, examples_per_second, the
             objective's parts (cross_entropy, penalty: the attention decoder's regulariser),
             time/ingestion_ms, time/train_step_ms, time/ingestion_share (iteration time = ingestion +
             train step, the seeds' definition), sample_captions (text)
    eval/    loss, perplexity of the validation references

At every evaluation, sample captions of the first validation images: as text beside their first
reference, and as images (``samples/<i>``: the crop the model saw, the caption in the description;
for an attention decoder ``attention/<i>``: a tile per word, lit where the model looked; under
``train.objective: scst`` each caption's CIDEr-D reward beside it). Each run
also records its config in TensorBoard's HParams tab (every ``section.key``, lists as text), so runs
can be compared and filtered by setting.

Only the chief writes (the other workers of a cluster get no-op writers).
"""

from __future__ import annotations

import logging
import math
import os
from dataclasses import dataclass, field

import numpy as np
import tensorflow as tf

from captioning.model.pictures import word_strip
from captioning.train.objectives import perplexity

log = logging.getLogger("captioning.train")


@dataclass
class Window:
    """Sums over the steps between two log lines; loss, weight and norm over the finite steps only."""

    loss: float = 0.0
    weight: float = 0.0
    norm: float = 0.0
    finite: int = 0
    ingest_s: float = 0.0
    step_s: float = 0.0
    steps: int = 0
    parts: dict = field(default_factory=dict)  # the objective's parts (per weight), summed × weight

    def add(self, loss: float, weight: float, norm: float, finite: bool, ingest_s: float, step_s: float,
            parts: dict | None = None) -> None:
        if finite:
            self.loss += loss * weight
            self.weight += weight
            self.norm += norm
            self.finite += 1
            for name, value in (parts or {}).items():
                self.parts[name] = self.parts.get(name, 0.0) + value * weight
        self.ingest_s += ingest_s
        self.step_s += step_s
        self.steps += 1

    @property
    def mean_loss(self) -> float:
        return self.loss / max(self.weight, 1.0)

    def mean(self, part: str) -> float:
        return self.parts.get(part, 0.0) / max(self.weight, 1.0)


@dataclass
class Progress:
    """What a training run's loop accumulates: its result (``captioning.train.result.TrainResult``), the
    summaries' writer, the progress bar, when it started and the steps since the last log line."""

    record: object
    summaries: "Summaries"
    bar: object
    start: float
    window: Window = field(default_factory=Window)

    def account(self, outs: list[dict], step: int, times: tuple[float, float, float], scaled: bool, log_every: int,
                non_finite, learning_rate) -> None:
        """Each of one call's steps (``outs``, the last at ``step``; ``times``: the call's start, the end of its
        ingestion, its end) at its own step: a step whose loss or gradient norm is not finite (the norm only
        without loss scaling, ``scaled``) applied no update and is told to ``non_finite(step, loss, norm,
        skipped)``; a log line at every ``log_every``-th step but the call's last (the loop's own)."""
        (t0, t1, t2), calls, record = times, len(outs), self.record
        for i, out in enumerate(outs):
            at = step - calls + 1 + i
            loss, norm, weight = out.pop("loss"), out.pop("gradient_norm"), out.pop("weight")
            record.losses.append(loss)
            record.ingestion_s.append((t1 - t0) / calls)
            record.step_s.append((t2 - t1) / calls)
            record.elapsed_s.append(t1 - self.start + (t2 - t1) * (i + 1) / calls)
            finite = math.isfinite(loss) and (math.isfinite(norm) or scaled)
            if not finite:
                non_finite(at, loss, norm, record.skipped_steps)
            self.window.add(loss, weight, norm, finite, (t1 - t0) / calls, (t2 - t1) / calls, out)
            self.bar.update(1)
            if at < step and at % log_every == 0:
                self.summaries.window(self.window, at, learning_rate(at), len(record.skipped_steps))
                self.window = Window()


@dataclass
class Sample:
    """A sample caption at an evaluation: the image, the greedy caption, the first reference, the crop
    the model saw (``uint8 [S, S, 3]``) and, for an attention decoder, each word's weights and where the tokens
    sit (the encoder's layout; None: a bar per token)."""

    image_id: int
    caption: str
    reference: str
    image: np.ndarray | None  # None for a model reading regions (its batches hold no pixels)
    attention: np.ndarray | None = None
    layout: object = None  # captioning.model.layout.TokenLayout, or None
    note: str | None = None  # what the objective says of it (SCST: its CIDEr-D reward)


def greedy_samples(model, vocab, batch: dict, notes=None, references=None) -> list[Sample]:
    """Greedy captions of a batch of eval images (``eval_images``' ``image``, ``image_id``, ``captions``)
    with their first references, the crops, each word's attention weights (attention decoder) and, given
    ``notes`` (a function of the beam search's output and the references: the objective's
    :meth:`~captioning.train.objectives.Objective.sample_notes`), a note each. ``vocab``: the model's tokenizer
    (:mod:`captioning.data.tokenizers`); ``references``: the vocabulary of the batch's caption ids (the records'
    words; default: ``vocab``)."""
    from captioning.model.decode import beam_search, ids_to_text

    longest = min(20, model.max_caption_length(model.settings) or 20)  # the decoder's bound, if it has one
    best = beam_search(model, None, beam_size=1, max_length=longest, initial_state=model.image_state(batch))
    captions = ids_to_text(vocab, best["ids"], best["lengths"])
    layout = model.token_layout if model.attends else None
    noted = notes(best, batch["captions"], batch.get("image")) if notes else None
    out = []
    for i, (caption,) in enumerate(captions):
        reference = " ".join((references or vocab).decode(batch["captions"][i][0].numpy()))
        weights = best["attention"][i, 0, :best["lengths"][i, 0]].numpy() if "attention" in best else None
        image = batch["image"][i].numpy() if "image" in batch else None  # regions: no picture
        out.append(Sample(int(batch["image_id"][i]), caption, reference, image, weights, layout,
                          None if noted is None else noted[i]))
    return out


def hparams(config_dict: dict) -> dict[str, object]:
    """A config as HParams values: ``section.key`` → a bool, number or string (lists become text).

    >>> hparams({"train": {"steps": 8, "profile_steps": []}, "model": {"decoder": "attention"}})
    {'train.steps': 8, 'train.profile_steps': '[]', 'model.decoder': 'attention'}
    """
    flat = {}
    for section, values in config_dict.items():
        for key, value in values.items():
            flat[f"{section}.{key}"] = value if isinstance(value, (bool, int, float, str)) else str(value)
    return flat


class Summaries:
    """The run's log lines and TensorBoard writers (no-op writers off the chief)."""

    def __init__(self, model_dir: str, chief: bool, batch_size: int, parts: tuple[str, ...] = ()):
        """``parts``: what the objective reports besides its loss (its declared ``parts``), in order."""
        logs = os.path.join(model_dir, "logs")
        self.train_dir = os.path.join(logs, "train")
        make = tf.summary.create_file_writer if chief else (lambda _: tf.summary.create_noop_writer())
        self.train, self.eval = make(self.train_dir), make(os.path.join(logs, "eval"))
        self.batch_size, self.parts = batch_size, tuple(parts)

    def window(self, window: Window, step: int, learning_rate: float, skipped_so_far: int) -> None:
        n = max(window.steps, 1)
        iteration = (window.ingest_s + window.step_s) / n
        examples_per_s = self.batch_size * n / max(window.ingest_s + window.step_s, 1e-9)
        with self.train.as_default(step=step):
            if window.finite:
                tf.summary.scalar("loss", window.mean_loss)
                # perplexity is of the cross-entropy alone (an objective may add a penalty)
                ce = window.mean("cross_entropy") if "cross_entropy" in window.parts else window.mean_loss
                tf.summary.scalar("perplexity", perplexity(ce))
                tf.summary.scalar("gradient_norm", window.norm / window.finite)
                for name in self.parts:
                    tf.summary.scalar(name, window.mean(name))
            tf.summary.scalar("learning_rate", learning_rate)
            tf.summary.scalar("skipped_batches", skipped_so_far)  # in this run, so far
            tf.summary.scalar("examples_per_second", examples_per_s)
            tf.summary.scalar("time/ingestion_ms", 1000 * window.ingest_s / n)
            tf.summary.scalar("time/train_step_ms", 1000 * window.step_s / n)
            tf.summary.scalar("time/ingestion_share", window.ingest_s / n / max(iteration, 1e-9))
        if not window.finite:
            log.info("step %d: all %d steps since the last log line skipped (non-finite loss)", step, window.steps)
            return
        # the loss's parts, when it has more than the cross-entropy (a penalty that is not zero)
        more = any(window.mean(name) for name in self.parts if name != "cross_entropy")
        parts = ", ".join(f"{name.replace('_', ' ')} {window.mean(name):.4f}" for name in self.parts)
        log.info("step %d: loss %.4f%s, %.0f examples/s, ingestion %.1f ms + step %.1f ms", step, window.mean_loss,
                 f" ({parts})" if more else "", examples_per_s, 1000 * window.ingest_s / n, 1000 * window.step_s / n)

    def config(self, config_dict: dict) -> None:
        """The run's config in TensorBoard's HParams tab (once per run, at its start)."""
        from tensorboard.plugins.hparams import api as hp

        with self.train.as_default():
            hp.hparams(hparams(config_dict))

    def evaluation(self, step: int, loss, samples: list[Sample]) -> None:
        """The validation loss (an :class:`~captioning.train.steps.EvaluationLoss`) and sample captions."""
        with self.eval.as_default(step=step):
            tf.summary.scalar("loss", loss.loss)
            tf.summary.scalar("perplexity", loss.perplexity)
        if samples:
            text = "\n\n".join(f"image {s.image_id}: **{s.caption}**" +
                                 (f" ({s.note})" if s.note else "") +
                                 f" (reference: {s.reference})" for s in samples)
            with self.train.as_default(step=step):
                tf.summary.text("sample_captions", text)
                for i, s in enumerate(samples):
                    if s.image is None:  # a model reading regions: the captions above, no picture
                        continue
                    description = f"image {s.image_id}: {s.caption} (reference: {s.reference})"
                    tf.summary.image(f"samples/{i}", s.image[None], description=description)
                    if s.attention is not None and len(s.attention):
                        strip = word_strip(s.image, s.caption.split(), s.attention, s.layout)
                        tf.summary.image(f"attention/{i}", strip[None], description=description)
        log.info("step %d: validation loss %.4f, perplexity %.2f%s", step, loss.loss, loss.perplexity,
                 f"; e.g. \"{samples[0].caption}\"" if samples else "")

    def flush(self) -> None:
        self.train.flush()
        self.eval.flush()
