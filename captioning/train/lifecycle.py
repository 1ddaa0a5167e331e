"""What a training run does around its steps: signals, preemption across workers, the profiler.

* :class:`StopOnSignal` — the first SIGINT or SIGTERM asks the loop to stop after the step under way (it
  then saves and exits 0); the second kills the process at once (the previous checkpoint stays intact).
* :func:`preemption_handler` — under MultiWorkerMirroredStrategy every worker must stop after the *same*
  step, so TF's ``tf.distribute.experimental.PreemptionCheckpointHandler`` agrees on it through the
  cluster's coordination service: its ``TerminationConfig`` polls our signal flag (SIGINT as well as
  SIGTERM; TF alone would only hook SIGTERM), saves through the loop's save function (the chief into the
  model folder, the others into scratch folders) and, instead of TF's default ``sys.exit(42)``, raises
  :class:`Preempted` back into the loop, so each worker exits 0. The handler keeps its own run counter in
  a separate, never-saved checkpoint object, so our checkpoints keep their layout. (On Google Cloud
  CPU/TPU VMs the handler disables itself; there signals keep their default action and a killed worker
  resumes from the last periodic checkpoint.)
* :func:`quiet_tf_watcher_threads` — when a worker is lost, TF's handler threads fail as the training
  step does; the step's error is the one reported (one line), theirs goes to the debug log.
* :class:`StepProfiler` — ``train.profile_steps: [start, stop]``.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import threading

import tensorflow as tf

from captioning import tf_internals
from captioning.train.distribute import PEER_ERRORS

log = logging.getLogger("captioning.train")


class Preempted(Exception):
    """Raised by the PreemptionCheckpointHandler's exit_fn once the checkpoint is saved on every worker."""


class StopOnSignal:
    """While active (a context manager), the first SIGINT or SIGTERM sets :attr:`signal_name` and makes
    both signals' next delivery take the operating system's default action (the process dies at once).
    Signal handlers can only be installed from the main thread; elsewhere it does nothing."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self):
        self.signal_name: str | None = None
        self._previous: dict = {}

    def __enter__(self) -> "StopOnSignal":
        if threading.current_thread() is threading.main_thread():
            for signum in self.SIGNALS:
                self._previous[signum] = signal.signal(signum, self._handle)
        return self

    def _handle(self, signum, frame) -> None:
        if self.signal_name is not None:
            return
        self.signal_name = signal.Signals(signum).name
        for other in self.SIGNALS:
            signal.signal(other, signal.SIG_DFL)
        log.warning("%s: finishing the current step, then saving a checkpoint and exiting "
                    "(a second SIGINT/SIGTERM exits at once, without saving)", self.signal_name)

    def release(self) -> None:
        """Gives the signals back to their previous handlers."""
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous = {}

    def __exit__(self, *exc) -> None:
        self.release()


def _hide_handler_deprecation(record: logging.LogRecord) -> bool:
    """PreemptionCheckpointHandler calls its own deprecated ``total_run_calls`` when it saves, which logs
    advice meant for its callers ("Track steps using a tf.Variable...", which we do)."""
    return "total_run_calls" not in record.getMessage()


def _raise_preempted() -> None:
    raise Preempted()


def preemption_handler(strategy, stop: StopOnSignal, save, model_dir: str):
    """TF's PreemptionCheckpointHandler when this process is one worker of a multi-worker cluster, else None.
    ``save()`` saves the current step's checkpoint."""
    resolver = getattr(strategy, "cluster_resolver", None)
    if (not isinstance(strategy, tf.distribute.MultiWorkerMirroredStrategy) or resolver is None
            or not resolver.cluster_spec().jobs):
        return None
    config = tf.distribute.experimental.TerminationConfig(
        termination_watcher_fn=lambda: stop.signal_name is not None,  # polled every second
        exit_fn=_raise_preempted, grace_period=0, save_fn=save)
    # The handler adds its run counter to the checkpoint it is given and restores it from that manager's
    # folder: it gets an empty checkpoint object of its own, in a folder that never holds any, so every
    # worker's counter starts at 0 and our checkpoints keep their layout.
    bookkeeping = tf.train.CheckpointManager(tf.train.Checkpoint(), os.path.join(model_dir, ".preemption"),
                                             max_to_keep=1)
    handler = tf.distribute.experimental.PreemptionCheckpointHandler(resolver, bookkeeping, termination_config=config)
    logging.getLogger("tensorflow").addFilter(_hide_handler_deprecation)
    platform = tf_internals.preemption_platform(handler)
    if platform in ("GCE_CPU", "GCE_TPU"):  # TF's handler does nothing there
        log.warning("PreemptionCheckpointHandler is disabled on %s: SIGTERM/SIGINT keep their default "
                    "action; a restart resumes from the last periodic checkpoint", platform)
        stop.release()
        return None
    return handler


def close_preemption_handler(handler) -> None:
    if handler is not None:
        tf_internals.stop_preemption_handler(handler)  # its watcher threads must not outlive the run


@contextlib.contextmanager
def quiet_tf_watcher_threads():
    """While training: a peer error in one of TF's own failure-handling threads (the
    PreemptionCheckpointHandler polls the coordination service) is logged at debug level instead of
    printing a thread traceback. When a worker is lost, that thread fails like the training step does,
    and the step's error is the one reported (one line, :func:`captioning.train.distribute.peer_error`)."""
    previous = threading.excepthook

    def hook(args):
        if isinstance(args.exc_value, PEER_ERRORS) and tf_internals.raised_in_tf_failure_handling(args.exc_traceback):
            log.debug("TF's %s thread stopped: %s", getattr(args.thread, "name", "?"),
                      str(args.exc_value).splitlines()[0])
            return
        previous(args)

    threading.excepthook = hook
    try:
        yield
    finally:
        threading.excepthook = previous


class StepProfiler:
    """``train.profile_steps: [start, stop]``: a TensorFlow profiler trace of those steps (ingestion and
    train step, with step markers) into ``logdir``, where TensorBoard's Profile tab finds it
    (``logdir/plugins/profile/<run>/*.xplane.pb``; the tab comes with ``pip install
    tensorboard-plugin-profile``). It shows per op where a step's time goes and, in its input-pipeline
    analyser, whether the device waited for data. Only the chief traces."""

    def __init__(self, steps: list[int], logdir: str, enabled: bool = True):
        self.start, self.stop = (steps if steps and enabled else (0, -1))
        self.logdir, self.active, self._trace = logdir, False, None

    def before(self, step: int) -> None:
        if step == self.start and not self.active:
            tf.profiler.experimental.start(self.logdir)
            self.active = True
            log.info("profiling steps %d to %d into %s", self.start, self.stop, self.logdir)
        if self.active:
            self._trace = tf_internals.step_trace("train", step)
            self._trace.__enter__()

    def after(self, step: int) -> None:
        self._end_trace()
        if self.active and step >= self.stop:
            self.close()

    def _end_trace(self) -> None:
        if self._trace is not None:
            self._trace.__exit__(None, None, None)
            self._trace = None

    def close(self) -> None:
        self._end_trace()
        if self.active:
            tf.profiler.experimental.stop()
            self.active = False
            log.info("profiler trace written under %s (TensorBoard: Profile tab)", self.logdir)


def service_watch(data_cfg):
    """``data.service``: TensorFlow waits forever for a tf.data dispatcher that is gone; the watch ends the
    run with one line (exit 1) once it has not answered for ``data.service_timeout_s``
    (:func:`captioning.data_service.watch_dispatcher`). A no-op without a service."""
    import contextlib
    import os
    import sys

    if not data_cfg.service:
        return contextlib.nullcontext()
    from captioning.data_service import watch_dispatcher

    def lost(error):
        sys.stderr.write(f"captioning train: error: {error}; resume from the latest checkpoint once it is back\n")
        sys.stderr.flush()
        os._exit(error.exit_code)  # the main thread waits inside TensorFlow: no exception reaches it

    return watch_dispatcher(data_cfg.service, timeout_s=data_cfg.service_timeout_s, on_lost=lost)


# A change of these between runs in one folder starts a new optimizer (the model and step are restored).
NEW_OPTIMIZER_KEYS = (("model", "encoder_trainable"), ("train", "optimizer"), ("train", "objective"))


def restore_run(folder, latest, previous, cfg, source, model, step, optimizer) -> None:
    """Where a run starts: the folder's ``latest`` checkpoint (model, step, optimizer); the model and the
    step only, with a fresh optimizer, when a key of :data:`NEW_OPTIMIZER_KEYS` changed since the
    ``previous`` config; another folder's weights (``source``, ``--init-from``) in a folder without a
    checkpoint; else nothing (step 0)."""
    import logging

    log = logging.getLogger("captioning.train")
    changed = [f"{section}.{key}" for section, key in NEW_OPTIMIZER_KEYS if previous is not None and
               getattr(getattr(previous, section), key) != getattr(getattr(cfg, section), key)]
    if latest and changed:
        # Keras optimizers track their variables by position, so when the set of trained variables
        # changes (fine-tuning the encoder after training with it frozen) the saved optimizer state no
        # longer lines up; another optimizer or objective (SCST after cross-entropy) starts its own state
        # too: restore the model and the step, and start the optimizer afresh.
        folder.restore(latest, {"model": model, "step": step})
        log.info("resumed the model from %s at step %d with a new optimizer (%s changed)", latest,
                 int(step.numpy()), ", ".join(changed))
    elif not latest and source is not None:
        start = source.latest_checkpoint()
        folder.restore(start, {"model": model})
        log.info("initialised the model from %s (step 0 of this folder)", start)
    elif latest:
        folder.restore(latest, {"model": model, "step": step}, {"optimizer": optimizer})
        log.info("resumed from %s at step %d", latest, int(step.numpy()))
