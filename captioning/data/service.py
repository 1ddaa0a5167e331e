"""TensorFlow's tf.data service: input processing on other machines, with one dispatcher and any number
of workers (``tf.data.experimental.service``; this module starts TF's servers, it is not a service of
its own). A trainer hands the dataset's remaining work to the workers with :func:`distribute` and
receives finished elements over gRPC.

Several machines: the dispatcher on ``data0`` (its work dir on storage that outlives the machine, so a
restarted dispatcher resumes), workers on ``data1`` and ``data2`` (each with a fixed port: a worker
restarted at the same address takes its old task back), trainers anywhere::

    data0$ captioning data-service dispatcher --port 5050 --work-dir /shared/ds-work
    12:00:01 dispatcher listening on grpc://data0:5050 (work dir /shared/ds-work)
    data1$ captioning data-service worker --dispatcher data0:5050 --port 5051
    12:00:04 worker data1:5051 serving dispatcher data0:5050
    data2$ captioning data-service worker --dispatcher data0:5050 --port 5051
    train1$ python my_trainer.py    # dataset = distribute(dataset, "data0:5050", "distributed_epoch", "train")

SIGTERM or SIGINT stops a server cleanly (exit 0). What TensorFlow 2.21 did when this project's tests
(``tests/test_data_service.py``) broke things on purpose:

=====================================  ================================================================
event                                  what the trainer's iterator does
=====================================  ================================================================
a worker killed (``kill -9``)          keeps receiving the other workers' elements. ``distributed_epoch``
                                       is then at-most-once (as TF documents for dynamic sharding): no
                                       element repeats, the splits the dead worker held are lost. The
                                       epoch ends only when a worker comes back at the dead one's
                                       address (same host and ``port``) and finishes its task; until
                                       then the end of the epoch waits, TF retrying the dead address.
the dispatcher killed, restarted       goes on: with a work dir, ``distributed_epoch`` delivered every
on its port from its work dir          element exactly once; the stream pauses while the dispatcher is
                                       away (``parallel_epochs`` workers keep serving what they have).
the dispatcher restarted without       raises ``tf.errors.NotFoundError`` ("Unknown iteration client
its state (no or another work dir)     id", or "Iteration id ... not found" when a worker asks first):
                                       :func:`service_error` makes it one line.
the dispatcher gone for good           raises nothing: it waits forever (TF retries with backoff, logging
                                       warnings). :func:`watch_dispatcher` ends such a run with one line.
no dispatcher at the address           TF's ``distribute`` waits forever; :func:`distribute` checks first
                                       and fails within ``timeout_s`` (one line).
=====================================  ================================================================

Reachability is checked with one gRPC call, the dispatcher's own ``GetVersion``, not a TCP connect
(:mod:`captioning.data.service_probe` says why; it holds the address and port checks and the watch, in plain
Python and gRPC, so ``captioning data-service`` answers a wrong address before TensorFlow loads).
"""

from __future__ import annotations

import logging
import os
import re
import signal
import socket
import threading

from captioning import tf_internals
from captioning.errors import InputError, ServiceLostError
from captioning.config.addresses import ADDRESS, is_loopback, parse_address
from captioning.data.service_probe import check_port_free, wait_for_dispatcher, warn_if_exposed, watch_dispatcher

__all__ = ["MODES", "run_dispatcher", "run_worker", "distribute", "service_error", "watch_dispatcher",
           "wait_for_dispatcher", "parse_address", "check_port_free"]

log = logging.getLogger("captioning.data.service")

MODES = ("parallel_epochs", "distributed_epoch")


class _StopOnSignal:
    """While active, SIGINT and SIGTERM set :attr:`event` (from the main thread only; elsewhere they keep
    their handlers and only :attr:`event` stops the server)."""

    def __init__(self, what: str):
        self.what, self.event, self.signal_name, self._previous = what, threading.Event(), None, {}

    def __enter__(self) -> "_StopOnSignal":
        if threading.current_thread() is threading.main_thread():
            for signum in (signal.SIGINT, signal.SIGTERM):
                self._previous[signum] = signal.signal(signum, self._handle)
        return self

    def _handle(self, signum, frame) -> None:
        if not self.event.is_set():
            self.signal_name = signal.Signals(signum).name
            log.info("%s: stopping the %s", self.signal_name, self.what)
            self.event.set()

    def wait(self) -> None:
        while not self.event.wait(0.5):  # a timed wait, so Python runs the signal handlers
            pass

    def __exit__(self, *exc) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)


def _tensorflow(text_ops: bool = False):
    """TensorFlow, imported without its C++ start-up lines unless debug logging is on; ``text_ops``: with TensorFlow
    Text's ops (0.16 CPU s), for the servers: a pipeline that tokenizes with a preset's tokenizer (``data.tokenizer:
    preset``) runs them on a worker, and a dispatcher reads its graph."""
    if not log.isEnabledFor(logging.DEBUG):
        from captioning.tf_import import import_tensorflow_quietly

        import_tensorflow_quietly()
    import tensorflow as tf

    if text_ops:
        try:
            import tensorflow_text  # noqa: F401
        except ImportError:  # no wheels on Windows, where keras-hub's tokenizers cannot run at all
            pass
    return tf


def _first_line(error: BaseException) -> str:
    text = str(getattr(error, "message", error)).strip()
    text = re.sub(r"^\{\{function_node [^}]*\}\}\s*", "", text)  # the op's location TF puts in front
    return text.splitlines()[0] if text else type(error).__name__


def _make_work_dir(work_dir: str, gfile=None) -> None:
    """Creates ``work_dir`` and checks that a file can be written there: a local folder with ``os``
    (before TensorFlow loads), a URL (``gs://...``) with ``gfile`` (``tf.io.gfile``)."""
    files = gfile or os
    probe = os.path.join(work_dir, f".write-test-{os.getpid()}")
    try:
        if gfile:
            gfile.makedirs(work_dir)
            with gfile.GFile(probe, "w") as f:
                f.write("")
        else:
            os.makedirs(work_dir, exist_ok=True)
            with open(probe, "w"):
                pass
        files.remove(probe)
    except Exception as e:  # OSError, or TensorFlow's OpError for a URL
        raise InputError(f"`work_dir` {work_dir} cannot be created or written: {_first_line(e)}",
                         params=("work_dir",)) from None


WORK_DIR_LOCK = ".captioning-dispatcher.lock"


def _lock_work_dir(work_dir: str) -> int | None:
    """Takes ``work_dir`` for this dispatcher: an exclusive POSIX lock on a file in it, held while the
    process lives. Two dispatchers writing one journal would corrupt each other's state, and TF does not
    notice; a second one is an InputError naming the first's process id. None where there are no POSIX
    locks (or for a URL: object stores have none)."""
    try:
        import fcntl
    except ImportError:
        return None
    fd = os.open(os.path.join(work_dir, WORK_DIR_LOCK), os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        holder = os.read(fd, 32).decode("ascii", "replace").strip() or "?"
        os.close(fd)
        raise InputError(f"`work_dir` {work_dir} is in use by another dispatcher (process {holder}): two dispatchers "
                         "would write one journal; stop that one, or give this one a work dir of its own",
                         params=("work_dir",)) from None
    os.ftruncate(fd, 0)
    os.write(fd, f"{os.getpid()}\n".encode())
    return fd


def run_dispatcher(port: int, work_dir: str | None = None) -> None:
    """Runs a tf.data dispatcher on ``port`` (all interfaces) until SIGTERM or SIGINT, then stops it.

    With ``work_dir`` the dispatcher is fault tolerant (TF's ``fault_tolerant_mode``): before answering
    any request it journals its state there (registered datasets, jobs, iterations, tasks, the splits
    handed out in ``distributed_epoch``), so a dispatcher restarted on the same port with the same work
    dir carries on: workers register again, trainers' iterators continue. It does *not* keep the service
    up: while it is down no new job starts, trainers' heartbeats fail, and ``distributed_epoch`` pauses
    once the workers need splits; nothing restarts it for you (run it under systemd or Kubernetes); it
    must come back at the same host and port; a trainer's position in its stream is not a checkpoint
    (a restarted trainer starts a new job). Without ``work_dir`` a restarted dispatcher knows no job, and
    the trainers get ``tf.errors.NotFoundError``.

    The dispatcher listens on every network interface, unauthenticated (TensorFlow's choice: see
    docs/distributed.md, "Trust model"); it says so in one warning line when it starts.

    ``InputError`` naming the parameter: a port in use, a work dir that cannot be created or written, or
    that another dispatcher uses.
    """
    if port == 0:
        raise InputError("`port` must be a fixed port (1 to 65535): workers and trainers need to know it",
                         params=("port",))
    check_port_free(port, "port")
    url = work_dir and "://" in work_dir
    lock = None
    if work_dir and not url:
        _make_work_dir(work_dir)
        lock = _lock_work_dir(work_dir)
    with _StopOnSignal("dispatcher") as stop:
        tf = _tensorflow(text_ops=True)
        if url:
            _make_work_dir(work_dir, tf.io.gfile)
        config = tf.data.experimental.service.DispatcherConfig(port=port, work_dir=work_dir or None,
                                                                fault_tolerant_mode=bool(work_dir))
        server = tf.data.experimental.service.DispatchServer(config, start=False)
        try:
            server.start()  # with a work dir: replays the journal first
        except tf.errors.OpError as e:
            raise InputError(f"the dispatcher could not start on `port` {port}"
                             + (f" from `work_dir` {work_dir}" if work_dir else "") + f": {_first_line(e)}",
                             params=("port", "work_dir")) from None
        log.info("dispatcher listening on grpc://%s:%d (%s)", socket.gethostname(), port,
                 f"work dir {work_dir}" if work_dir else "no work dir: a restart forgets every job")
        warn_if_exposed("tf.data dispatcher", port, log)
        stop.wait()
        server.stop()
    if lock is not None:
        os.close(lock)
    log.info("dispatcher stopped")


def run_worker(dispatcher: str, port: int = 0, host: str | None = None, timeout_s: float = 60.0,
               heartbeat_s: float | None = None) -> None:
    """Runs a tf.data worker for the dispatcher at ``dispatcher`` (``HOST:PORT``) until SIGTERM or SIGINT.

    ``port``: where it serves elements (0: any free port; give a fixed one so that a restarted worker comes
    back at the same address and takes its old task back). ``host``: the name trainers reach this worker
    by, which the dispatcher hands them (default ``localhost`` when the dispatcher is on this machine's
    loopback, else this machine's host name). Waits at most ``timeout_s`` for the dispatcher to answer
    (TF's own worker would wait forever). ``heartbeat_s``: how often it reports its tasks and that it
    is alive to the dispatcher (default: TF's, 30 s).

    ``InputError`` naming the parameter: a malformed address, a port in use, no dispatcher within
    ``timeout_s``.
    """
    dispatcher_host, dispatcher_port = parse_address(dispatcher, "dispatcher")
    if port:
        check_port_free(port, "port")
    host = host or ("localhost" if is_loopback(dispatcher_host) else socket.gethostname())
    if not ADDRESS.fullmatch(f"{host}:1"):
        raise InputError(f"`host` must be a host name or address, got {host!r}", params=("host",))
    if heartbeat_s is not None and not heartbeat_s > 0:
        raise InputError(f"`heartbeat_s` must be more than 0 s, got {heartbeat_s}", params=("heartbeat_s",))
    with _StopOnSignal("worker") as stop:
        if wait_for_dispatcher(dispatcher, timeout_s, "dispatcher", stop.event) is None:
            log.info("worker stopped before the dispatcher answered")
            return
        tf = _tensorflow(text_ops=True)
        config = tf.data.experimental.service.WorkerConfig(
            dispatcher_address=f"{dispatcher_host}:{dispatcher_port}", worker_address=f"{host}:%port%", port=port,
            heartbeat_interval_ms=int(heartbeat_s * 1000) if heartbeat_s else None,
            data_transfer_address=f"{host}:%dts_port%")
        server = tf.data.experimental.service.WorkerServer(config, start=False)
        server.start()  # registers with the dispatcher (it answered just now); blocks until it has
        bound = tf_internals.worker_port(server)
        log.info("worker %s:%d serving dispatcher %s:%d", host, bound, dispatcher_host, dispatcher_port)
        warn_if_exposed("tf.data worker", bound, log)
        stop.wait()
        server.stop()
    log.info("worker stopped")


COMPRESSIONS = {"none": None, "snappy": "SNAPPY", "auto": "AUTO"}  # names here → TF's ``compression``


def distribute(dataset, service: str, mode: str = "distributed_epoch", job_name: str | None = None, *,
               dataset_id: str | None = None, timeout_s: float = 60.0, compression: str = "none"):
    """``dataset`` with its work done by the tf.data service at ``service`` (``HOST:PORT``): iterating it
    starts a job whose workers run ``dataset`` and send the elements here; transformations applied to
    the result run locally.

    ``mode``: ``"distributed_epoch"`` splits the dataset's source (``range``, ``from_tensor_slices``,
    ``list_files``) among the workers: each element once per epoch; ``"parallel_epochs"`` has every
    worker produce the whole dataset (shuffle differently per worker), for datasets that cannot be split.
    ``job_name``: trainers using the same name share one job (elements first come, first served), e.g.
    the workers of a ``MultiWorkerMirroredStrategy`` (TF then switches off its own auto-sharding). A
    name is good for one run of a service: a finished job's name gives an empty stream.

    Which way: without ``dataset_id`` each trainer registers its own dataset graph (TF's
    ``distribute``); trainers share a job only if their graphs are identical, which holds when they run
    the same code. With ``dataset_id`` (e.g. ``"coco-train-v1"``) the first trainer registers the
    dataset under that name and every trainer reads that dataset (``register_dataset`` +
    ``from_dataset_id``): use it when the trainers' graphs may differ (a seed per trainer, files listed
    in another order) or only one of them should define the input.

    ``compression``: how the workers compress elements for the trip (``"none"``, ``"snappy"``, or
    ``"auto"``: TF's default, snappy unless its runtime decides otherwise). Decoded images barely shrink
    and compressing costs CPU on both ends (``captioning benchmark input --service 1``: 0.42 of the
    in-process pipeline with ``auto``, 0.59 with none; benchmarks/RESULTS.md), so the default is none.

    The dispatcher must answer within ``timeout_s`` (checked before the job is made, as TF would wait
    forever), else an ``InputError`` naming ``service``. Later failures are in the module docstring.
    """
    if mode not in MODES:
        raise InputError(f"`mode` must be one of {', '.join(MODES)}, got {mode!r}", params=("mode",))
    if compression not in COMPRESSIONS:
        raise InputError(f"`compression` must be one of {', '.join(COMPRESSIONS)}, got {compression!r}",
                         params=("compression",))
    if job_name == "" or dataset_id == "":
        raise InputError("`job_name` and `dataset_id` must not be empty (None: none)", params=("job_name", "dataset_id"))
    target = wait_for_dispatcher(service, timeout_s, "service")
    service_api = _tensorflow().data.experimental.service
    if dataset_id is None:
        return dataset.apply(service_api.distribute(processing_mode=mode, service=target, job_name=job_name,
                                                    compression=COMPRESSIONS[compression]))
    registered = service_api.register_dataset(target, dataset, dataset_id=dataset_id,
                                              compression=COMPRESSIONS[compression])
    return service_api.from_dataset_id(mode, target, dataset_id=registered, element_spec=dataset.element_spec,
                                       job_name=job_name)


# What TF's iterator raises (tf.errors.NotFoundError) when the dispatcher answers again but no longer knows
# the trainer's job: the trainer's heartbeat ("Failed to get tasks: Unknown iteration client id 3000") or a
# worker asking for the next split ("Failed to get split: Iteration id 2000 not found"), whichever comes first.
_SERVICE_ERRORS = ("Unknown iteration client id", "Failed to get tasks", "Failed to get split")


def service_error(error: BaseException, service: str) -> ServiceLostError | None:
    """One line for an error a trainer's iterator raised because the tf.data service lost its job (the
    dispatcher restarted without its state: ``tf.errors.NotFoundError``, "Unknown iteration client id"
    or "Iteration id ... not found"); None for any other error. Typical use around the training loop::

        try:
            for batch in dataset: ...
        except tf.errors.OpError as e:
            raise data_service.service_error(e, service) or e from None
    """
    import tensorflow as tf

    if not isinstance(error, tf.errors.OpError) or not any(m in str(error) for m in _SERVICE_ERRORS):
        return None
    host, port = parse_address(service)
    return ServiceLostError(f"the tf.data service at {host}:{port} lost this run's input job "
                            f"({_first_line(error)}): start the dispatcher with a work dir, which keeps jobs "
                            "across its restarts, then run this again")
