"""What a training run does around its steps: signals, preemption across workers, the profiler.

* :class:`StopOnSignal` — the first SIGINT or SIGTERM asks the loop to stop after the step under way (it
  then saves and exits 0); the second ends the process at once (the previous checkpoint stays intact).
  Signals are seen at once even while the loop waits inside TensorFlow for a batch that does not come:
  :class:`Gate` and :func:`end_while_waiting` then save the last step from another thread and exit.
  Before the first step, :func:`wait_for_service` stops waiting for a tf.data dispatcher (nothing saved).
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
import sys
import threading
import time

import tensorflow as tf

from captioning import tf_internals
from captioning.data.service_probe import wait_for_dispatcher, watch_dispatcher
from captioning.train.distribute import PEER_ERRORS
from captioning.train.result import Interrupted

log = logging.getLogger("captioning.train")


class Preempted(Exception):
    """Raised by the PreemptionCheckpointHandler's exit_fn once the checkpoint is saved on every worker."""


class StopOnSignal:
    """While active (a context manager), the first SIGINT or SIGTERM sets :attr:`signal_name` (the loop
    stops after the step under way, saves and exits 0); the second ends the process at once, exit code
    128 + the signal's number, without saving (the latest checkpoint stays the latest), as the operating
    system's default action would.

    Python runs signal handlers only between bytecodes of the main thread, and a main thread waiting
    inside TensorFlow for its next batch (a tf.data service with no live worker) runs none. So the
    signals are watched from a thread of their own through :func:`signal.set_wakeup_fd` (the C-level
    handler writes each signal's number to a pipe): they are seen at once, whatever the main thread is
    doing. After the first, ``when_stuck(signal_name)`` (the loop's: :func:`end_while_waiting`) is called
    from that thread every 0.25 s until it returns True. The Python-level handlers stay installed until
    the end (resetting them to the default action from the first one raced with a second signal already
    pending: "OSError: Signal 15 ignored due to race condition"). Signal handlers can only be installed
    from the main thread; elsewhere it does nothing. The first signal also sets :attr:`stopped`; ``first``
    is what its warning says the run does (None: no warning)."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self, when_stuck=None, first: str | None = "finishing the current step, then saving a checkpoint"):
        self.signal_name: str | None = None
        self.stopped = threading.Event()
        self.when_stuck, self.first = when_stuck, first
        self._previous: dict = {}
        self._pipe: tuple[int, int] | None = None
        self._old_wakeup = -1
        self._closed = threading.Event()

    def __enter__(self) -> "StopOnSignal":
        if threading.current_thread() is threading.main_thread():
            for signum in self.SIGNALS:
                self._previous[signum] = signal.signal(signum, self._handle)
            read, write = os.pipe()
            os.set_blocking(write, False)
            self._pipe = (read, write)
            self._old_wakeup = signal.set_wakeup_fd(write, warn_on_full_buffer=False)
            threading.Thread(target=self._watch, name="signal watch", daemon=True).start()
        return self

    def _handle(self, signum, frame) -> None:
        """The Python-level handler: the watch thread does the work (it sees every delivery)."""

    def _watch(self) -> None:
        read = self._pipe[0]
        seen = 0
        while True:
            data = os.read(read, 64)
            if self._closed.is_set() or not data:
                return
            for signum in data:
                if signum not in [int(s) for s in self.SIGNALS]:
                    continue
                seen += 1
                name = signal.Signals(signum).name
                if seen == 1:
                    self.signal_name = name
                    if self.first:  # None: the caller says what happens
                        log.warning("%s: %s and exiting (a second SIGINT/SIGTERM exits at once, without saving)",
                                    name, self.first)
                    self.stopped.set()
                else:
                    sys.stderr.write(f"{name} again: exiting at once, without saving\n")
                    sys.stderr.flush()
                    os._exit(128 + signum)
            if seen == 1 and self.when_stuck is not None:
                threading.Thread(target=self._rescue, name="signal rescue", daemon=True).start()

    def _rescue(self) -> None:
        while not self._closed.is_set():
            if self.when_stuck(self.signal_name):
                return
            self._closed.wait(0.25)

    def release(self) -> None:
        """Gives the signals back to their previous handlers and stops the watch."""
        if self._pipe is not None:
            self._closed.set()
            signal.set_wakeup_fd(self._old_wakeup)
            os.write(self._pipe[1], b"\0")  # wakes the watch, which sees it is closed
            os.close(self._pipe[1])
            self._pipe = None
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous = {}

    def __exit__(self, *exc) -> None:
        self.release()


def wait_for_service(service: str, timeout_s: float) -> None:
    """:func:`captioning.data.service_probe.wait_for_dispatcher` with a live worker; a SIGINT or SIGTERM meanwhile
    raises :class:`~captioning.train.result.Interrupted` (a second one exits at once, as during training)."""
    with StopOnSignal(first=None) as stop:
        answered = wait_for_dispatcher(service, timeout_s, "data.service", stop.stopped, need_worker=True)
    if answered is None:
        raise Interrupted(f"interrupted by {stop.signal_name} while waiting for the tf.data dispatcher at {service} "
                          "and a live worker: nothing trained; run the same command to start")


class Gate:
    """The loop's iterations and another thread's take-over of the run exclude each other. The loop holds
    the gate from the moment its next batch arrives until it asks for the one after (:meth:`next`), so a
    thread that takes it (:meth:`take`) while the loop waits for a batch knows that no step runs: the
    step counter and the weights are those of the last step, complete, and can be saved."""

    def __init__(self):
        self._lock = threading.Lock()
        self._held = False
        self.waiting_since: float | None = None

    def next(self, batches):
        """The next batch of the iterator ``batches``, waited for without the gate, returned with it."""
        if self._held:
            self._held = False
            self._lock.release()
        self.waiting_since = time.monotonic()
        try:
            batch = next(batches)
        finally:
            self.waiting_since = None
        self._lock.acquire()
        self._held = True
        return batch

    def hold(self) -> None:
        """Holds the gate while steps run that read their own batches (``train.steps_per_execution`` > 1)."""
        if not self._held:
            self._lock.acquire()
            self._held = True

    def close(self) -> None:
        if self._held:
            self._held = False
            self._lock.release()

    def waited(self) -> float:
        """How long the loop has been waiting for its next batch (0 when it is not)."""
        since = self.waiting_since
        return 0.0 if since is None else time.monotonic() - since

    def take(self, timeout_s: float) -> bool:
        """Takes the gate for good (the taker ends the process), waiting at most ``timeout_s`` for the loop
        to finish the step under way."""
        return self._lock.acquire(timeout=timeout_s)


def end_while_waiting(gate: Gate, save, line: str, exit_code: int, after_s: float = 2.0,
                      timeout_s: float = 0.1, stream=None) -> bool:
    """From another thread: when the loop has waited at least ``after_s`` for its next batch (or at once
    when ``after_s`` is 0, waiting up to ``timeout_s`` for a step under way), takes the :class:`Gate`,
    saves the last step with ``save()`` (None: nothing saved), prints ``line`` (``{checkpoint}`` replaced
    by what was saved) and ends the process with ``exit_code``. Returns False, doing nothing, when the
    loop is not stuck: it will act on the signal itself after its step."""
    if after_s and gate.waited() < after_s:
        return False
    if not gate.take(timeout_s):
        return False
    try:
        saved = save() if save is not None else None
    except Exception as e:  # a full disk, a weight that is not finite: say so, and still end
        saved = f"nothing (the save failed: {str(e).splitlines()[0] if str(e) else type(e).__name__})"
    out = stream or sys.stdout
    out.write(line.format(checkpoint=saved or "nothing") + "\n")
    out.flush()
    sys.stderr.flush()
    os._exit(exit_code)


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


def service_watch(data_cfg, gate: Gate, save):
    """``data.service``: TensorFlow waits forever for a tf.data dispatcher that is gone, or for workers
    when none is left alive; the watch ends the run with one line (exit 1) once the dispatcher has not
    answered, or no registered worker has, for ``data.service_timeout_s``
    (:func:`captioning.data.service_probe.watch_dispatcher`), after saving the last step with ``save`` (None:
    nothing saved; multi-worker runs, whose saves need every worker). A no-op without a service."""
    if not data_cfg.service:
        return contextlib.nullcontext()

    def lost(error):
        line = (f"captioning train: error: {error}; saved {{checkpoint}}: run the same command to resume once "
                "the service is back")
        end_while_waiting(gate, save, line, error.exit_code, after_s=0, timeout_s=60, stream=sys.stderr)

    return watch_dispatcher(data_cfg.service, timeout_s=data_cfg.service_timeout_s, on_lost=lost)


def replayed_steps(cfg, step: int) -> int:
    """The optimizer steps of micro-batches a run resumed at ``step`` skips in its training stream, so that it
    trains on the batches an uninterrupted run would (docs/training.md, "Resuming"): all of them with
    ``data.deterministic: true`` (the stream is then the same in every run, pixel for pixel), none otherwise, or
    through the tf.data service (whose stream is not reproducible): the stream then starts again."""
    if not step or not cfg.data.deterministic or cfg.data.service:
        return 0
    batches = step * cfg.train.accumulate_steps
    log.info("resuming at step %d with data.deterministic: true: replaying the input stream past its first %d "
             "batch(es) per replica", step, batches)
    return batches


# A change of these between runs in one folder starts a new optimizer (the model and step are restored).
NEW_OPTIMIZER_KEYS = (("model", "encoder_trainable"), ("train", "optimizer"), ("train", "objective"))


def restore_run(folder, latest, previous, cfg, source, model, step, optimizer) -> None:
    """Where a run starts: the folder's ``latest`` checkpoint (model, step, optimizer); the model and the
    step only, with a fresh optimizer, when a key of :data:`NEW_OPTIMIZER_KEYS` changed since the
    ``previous`` config; another folder's weights (``source``, ``--init-from``) in a folder without a
    checkpoint; else nothing (step 0)."""
    changed = [f"{section}.{key}" for section, key in NEW_OPTIMIZER_KEYS if previous is not None and
               getattr(getattr(previous, section), key) != getattr(getattr(cfg, section), key)]
    if latest and source is not None:  # a rerun of the command that started the folder resumes it
        log.warning("the model folder's own checkpoint %s wins over init_from %s: training resumes from it",
                    os.path.basename(latest), source.path)
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
