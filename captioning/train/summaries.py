"""What a training run logs: a line and TensorBoard scalars every ``train.log_every_steps``, and the
validation loss with sample captions at every evaluation.

TensorBoard, ``MODEL_DIR/logs``::

    train/   loss, perplexity, gradient_norm, learning_rate, skipped_batches, examples_per_second,
             time/ingestion_ms, time/train_step_ms, time/ingestion_share (iteration time = ingestion +
             train step, the seeds' definition), sample_captions (text)
    eval/    loss, perplexity of the validation references

Only the chief writes (the other workers of a cluster get no-op writers).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

import tensorflow as tf

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

    def add(self, loss: float, weight: float, norm: float, finite: bool, ingest_s: float, step_s: float) -> None:
        if finite:
            self.loss += loss * weight
            self.weight += weight
            self.norm += norm
            self.finite += 1
        self.ingest_s += ingest_s
        self.step_s += step_s
        self.steps += 1

    @property
    def mean_loss(self) -> float:
        return self.loss / max(self.weight, 1.0)


class Summaries:
    """The run's log lines and TensorBoard writers (no-op writers off the chief)."""

    def __init__(self, model_dir: str, chief: bool, batch_size: int):
        logs = os.path.join(model_dir, "logs")
        self.train_dir = os.path.join(logs, "train")
        make = tf.summary.create_file_writer if chief else (lambda _: tf.summary.create_noop_writer())
        self.train, self.eval = make(self.train_dir), make(os.path.join(logs, "eval"))
        self.batch_size = batch_size

    def window(self, window: Window, step: int, learning_rate: float, skipped_so_far: int) -> None:
        n = max(window.steps, 1)
        iteration = (window.ingest_s + window.step_s) / n
        examples_per_s = self.batch_size * n / max(window.ingest_s + window.step_s, 1e-9)
        with self.train.as_default(step=step):
            if window.finite:
                tf.summary.scalar("loss", window.mean_loss)
                tf.summary.scalar("perplexity", perplexity(window.mean_loss))
                tf.summary.scalar("gradient_norm", window.norm / window.finite)
            tf.summary.scalar("learning_rate", learning_rate)
            tf.summary.scalar("skipped_batches", skipped_so_far)  # in this run, so far
            tf.summary.scalar("examples_per_second", examples_per_s)
            tf.summary.scalar("time/ingestion_ms", 1000 * window.ingest_s / n)
            tf.summary.scalar("time/train_step_ms", 1000 * window.step_s / n)
            tf.summary.scalar("time/ingestion_share", window.ingest_s / n / max(iteration, 1e-9))
        if not window.finite:
            log.info("step %d: all %d steps since the last log line skipped (non-finite loss)", step, window.steps)
            return
        log.info("step %d: loss %.4f, %.0f examples/s, ingestion %.1f ms + step %.1f ms", step, window.mean_loss,
                 examples_per_s, 1000 * window.ingest_s / n, 1000 * window.step_s / n)

    def evaluation(self, step: int, loss, samples: list[tuple[int, str, str]]) -> None:
        """The validation loss (an :class:`~captioning.train.steps.EvaluationLoss`) and sample captions
        ``(image id, caption, reference)``."""
        with self.eval.as_default(step=step):
            tf.summary.scalar("loss", loss.loss)
            tf.summary.scalar("perplexity", loss.perplexity)
        if samples:
            text = "\n\n".join(f"image {i}: **{caption}** (reference: {ref})" for i, caption, ref in samples)
            with self.train.as_default(step=step):
                tf.summary.text("sample_captions", text)
        log.info("step %d: validation loss %.4f, perplexity %.2f%s", step, loss.loss, loss.perplexity,
                 f"; e.g. \"{samples[0][1]}\"" if samples else "")

    def flush(self) -> None:
        self.train.flush()
        self.eval.flush()
