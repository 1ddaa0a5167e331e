"""What a training run hands back: :class:`TrainResult`, and :class:`NonFiniteError`, the error that stops
a run whose numbers stopped being finite (``train.nan_policy: stop``); :class:`Interrupted`, a signal
before the first step."""

from __future__ import annotations

import os
from dataclasses import dataclass, field


class NonFiniteError(Exception):
    """The loss, the gradient norm or the weights stopped being finite (``train.nan_policy: stop``).
    Nothing was saved; the command line prints the message and exits 1."""

    exit_code = 1

    @classmethod
    def at(cls, what: str, step: int, latest: str | None) -> "NonFiniteError":
        """The error for ``what`` happening at ``step``, ``latest`` the folder's latest checkpoint (or None).

        >>> print(NonFiniteError.at("non-finite loss nan (gradient norm nan)", 7, "runs/m/ckpt-5"))  # doctest: +ELLIPSIS
        non-finite loss nan (gradient norm nan) at step 7: stopped without saving; the latest checkpoint, ckpt-5, ...
        """
        kept = (f"the latest checkpoint, {os.path.basename(latest)}, is the last good one" if latest
                else "there is no checkpoint yet")
        return cls(f"{what} at step {step}: stopped without saving; {kept}. Lower train.learning_rate, set "
                   "train.clip_gradient_norm, or set train.nan_policy=skip to skip such batches")


class Interrupted(Exception):
    """A signal ended the run before its first step (while it waited for a tf.data dispatcher): nothing was
    trained or written. The message is the line ``captioning train`` prints; it exits 0, as after a signal
    during training."""


@dataclass
class TrainResult:
    """What a run did. ``ingestion_s`` and ``step_s`` are each iteration's time waiting for the batch and
    running the step, in seconds; ``skipped_steps`` the steps whose batch was skipped for a non-finite
    loss (``train.nan_policy: skip``; their ``losses`` are NaN or Inf); ``interrupted`` the signal's
    name (or ``"another worker's signal"``) when one ended the run early; ``checkpoint`` the path of the
    folder's latest checkpoint when the run ended (None if there is none); ``replicas`` the replicas in
    sync. Also readable as
    ``result["step"]``."""

    step: int
    losses: list[float] = field(default_factory=list)
    ingestion_s: list[float] = field(default_factory=list)
    step_s: list[float] = field(default_factory=list)
    skipped_steps: list[int] = field(default_factory=list)
    interrupted: str | None = None
    checkpoint: str | None = None
    replicas: int = 1  # replicas in sync (all workers')
    elapsed_s: list[float] = field(default_factory=list)  # wall clock from the run's start to each step's end

    @property
    def trained_steps(self) -> int:
        return len(self.losses)

    def __getitem__(self, key: str):
        return getattr(self, key)
