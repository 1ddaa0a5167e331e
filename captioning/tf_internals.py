"""Every use of TensorFlow's private API, one helper each, in this one place.

TensorFlow has no public way to do these; each is used because the alternative is worse (a hang, a
silent wrong result, a file read twice). When a TensorFlow upgrade breaks one, this is the module to
mend. Everything else in the project uses public API only.

========================================  ====================================================================
helper                                    what it touches, and why
========================================  ====================================================================
:func:`tfrecord_random_reader`            ``tensorflow.python.lib.io.tf_record``: reading a damaged TFRecord
                                          file record by record, from byte offsets (no public tf.io name)
:func:`configure_coordination_service`    ``context.configure_coordination_service`` and its config proto's
                                          ``cluster_register_with_barrier``: heartbeat and start-up timeouts
                                          for multi-worker training (MultiWorkerMirroredStrategy starts the
                                          service with no public knob; without them a missing peer hangs)
:func:`step_trace`                        ``tf.profiler.experimental.Trace(..., _r=1)``: the step marker the
                                          profiler's step view and input-pipeline analyser need
:func:`preemption_platform`               ``PreemptionCheckpointHandler._platform_device``: whether TF's
                                          handler switched itself off (Google Cloud VMs)
:func:`stop_preemption_handler`           ``PreemptionCheckpointHandler.__del__``: stops its watcher threads,
                                          which TF otherwise leaves to garbage collection
:func:`raised_in_tf_failure_handling`     the file layout of ``tensorflow/python/distribute/
                                          failure_handling``: telling TF's own watcher threads' errors apart
:func:`worker_port`                       ``WorkerServer._address``: the port a tf.data worker started with
                                          port 0 bound (TF's public API has no property for it)
:func:`dispatcher_version`                the tf.data dispatcher's gRPC method ``/tensorflow.data.
                                          DispatcherService/GetVersion``: asking, with a deadline, whether a
                                          dispatcher answers (TF's own clients retry an absent one forever)
:func:`dispatcher_workers`                its ``GetWorkers``: the workers registered with it (TF's Python API
                                          has no client for it; the dispatcher lists a dead worker until its
                                          heartbeat times out, minutes later)
:func:`worker_answers`                    a tf.data worker's ``/tensorflow.data.WorkerService/GetWorkerTasks``:
                                          whether a registered worker is alive now
:func:`frozen_function`                   ``convert_to_constants.convert_variables_to_constants_v2``: a
                                          function's variables as constants, for the LiteRT converter (it
                                          leaves the variables read inside a ``while`` loop, the caption
                                          search's, as resources the interpreter fails on: measured)
========================================  ====================================================================

TensorFlow is imported inside the helpers that need it, so :func:`dispatcher_version` (plain gRPC) runs
before TensorFlow loads: ``captioning data-service`` answers a wrong address in a second, not after the
seconds TensorFlow takes to import.
"""

from __future__ import annotations

import os


def tfrecord_random_reader(path: str):
    """A reader whose ``read(offset)`` returns ``(record, next_offset)`` and checks both CRCs; raises
    ``tf.errors.DataLossError`` (or ``IndexError`` past the end) at a bad offset."""
    from tensorflow.python.lib.io import tf_record

    return tf_record.tf_record_random_reader(path)


def configure_coordination_service(leader: str, jobs: dict[str, int], heartbeat_timeout_s: int,
                                   register_timeout_s: int) -> None:
    """Configures TF's coordination service before MultiWorkerMirroredStrategy starts it: a peer silent for
    ``heartbeat_timeout_s`` is reported lost; every task waits at most ``register_timeout_s`` for all
    ``jobs`` (name → task count) to register, then fails instead of waiting forever. Must run before
    TensorFlow's runtime starts."""
    from tensorflow.compiler.xla.tsl.protobuf import coordination_config_pb2
    from tensorflow.python.eager import context

    ctx = context.context()
    ctx.configure_coordination_service(
        service_type="standalone", service_leader=leader, heartbeat_timeout_in_ms=heartbeat_timeout_s * 1000,
        cluster_register_timeout_in_ms=register_timeout_s * 1000,
        coordinated_jobs=[coordination_config_pb2.CoordinatedJob(name=name, num_tasks=count)
                          for name, count in jobs.items()])
    ctx._coordination_service_config.cluster_register_with_barrier = True  # a missing peer: an error, not a hang


def step_trace(name: str, step: int):
    """A profiler trace context for one step, marked as a step (``step_num``) for TensorBoard."""
    import tensorflow as tf

    return tf.profiler.experimental.Trace(name, step_num=step, _r=1)


def preemption_platform(handler) -> str:
    """The platform TF's PreemptionCheckpointHandler detected ("GCE_CPU", "GCE_TPU", ... or "")."""
    return getattr(getattr(handler, "_platform_device", None), "name", "") or ""


def stop_preemption_handler(handler) -> None:
    """Stops the handler's watcher threads now (TF relies on ``__del__`` when no preemption came)."""
    handler.__del__()


def raised_in_tf_failure_handling(traceback) -> bool:
    """Whether ``traceback`` passes through TF's failure-handling module (its preemption watcher threads)."""
    marker = f"{os.sep}distribute{os.sep}failure_handling{os.sep}"
    while traceback is not None:
        if marker in traceback.tb_frame.f_code.co_filename:
            return True
        traceback = traceback.tb_next
    return False


def worker_port(server) -> int:
    """The port a ``tf.data.experimental.service.WorkerServer`` listens on (``_address`` is
    ``"localhost:PORT"``)."""
    return int(server._address.rsplit(":", 1)[1])


_GET_VERSION = "/tensorflow.data.DispatcherService/GetVersion"  # TF's dispatcher.proto; GetVersionRequest is empty
_GET_WORKERS = "/tensorflow.data.DispatcherService/GetWorkers"  # GetWorkersRequest is empty
_GET_WORKER_TASKS = "/tensorflow.data.WorkerService/GetWorkerTasks"  # worker.proto; GetWorkerTasksRequest is empty


def _call(address: str, method: str, timeout_s: float) -> bytes:
    """One gRPC call of ``method`` with an empty request (every request here is an empty message) on a
    fresh channel: a reused one stays in gRPC's reconnect backoff after a failure and would report a
    restarted server late. Raises ``grpc.RpcError``."""
    import grpc

    with grpc.insecure_channel(address) as channel:
        call = channel.unary_unary(method, request_serializer=lambda message: message,
                                   response_deserializer=lambda message: message)
        return call(b"", timeout=timeout_s)


def _fields(message: bytes):
    """(field number, wire type, value) of a protobuf message's top-level fields: varints as ints,
    length-delimited fields as bytes (the only two kinds the replies read here hold)."""
    pos = 0

    def varint():
        nonlocal pos
        value, shift = 0, 0
        while True:
            byte = message[pos]
            pos += 1
            value |= (byte & 0x7F) << shift
            shift += 7
            if not byte & 0x80:
                return value

    while pos < len(message):
        key = varint()
        number, wire = key >> 3, key & 7
        if wire == 0:
            yield number, wire, varint()
        elif wire == 2:
            length = varint()
            yield number, wire, message[pos:pos + length]
            pos += length
        elif wire in (1, 5):  # fixed 64 / 32 bits: skipped
            pos += 8 if wire == 1 else 4
        else:
            raise ValueError(f"unexpected protobuf wire type {wire}")


def dispatcher_version(address: str, timeout_s: float) -> int:
    """The data-service version a tf.data dispatcher at ``address`` (``host:port``) reports, asked once
    with a deadline of ``timeout_s``; raises ``grpc.RpcError``: ``UNAVAILABLE`` when nothing listens or the
    host is unknown, ``DEADLINE_EXCEEDED`` when nothing answers in time, ``UNIMPLEMENTED`` when a gRPC
    server that is not a dispatcher (a tf.data worker, say) answers. A fresh channel each call: a reused
    one stays in gRPC's reconnect backoff after a failure and would report a restarted dispatcher late."""
    reply = _call(address, _GET_VERSION, timeout_s)  # GetVersionResponse: version = 1, a varint
    return next((value for number, wire, value in _fields(reply) if number == 1 and wire == 0), 0)


def dispatcher_workers(address: str, timeout_s: float) -> list[str]:
    """The addresses of the workers registered with the tf.data dispatcher at ``address``
    (``GetWorkersResponse``: ``repeated WorkerInfo workers = 1``, ``WorkerInfo``: ``string address = 1``).
    Raises ``grpc.RpcError`` as :func:`dispatcher_version` does."""
    reply = _call(address, _GET_WORKERS, timeout_s)
    workers = [value for number, wire, value in _fields(reply) if number == 1 and wire == 2]
    return [next((v.decode("utf-8", "replace") for n, w, v in _fields(info) if n == 1 and w == 2), "")
            for info in workers]


def worker_answers(address: str, timeout_s: float) -> bool:
    """Whether the tf.data worker at ``address`` answers a ``GetWorkerTasks`` call within ``timeout_s``."""
    import grpc

    try:
        _call(address, _GET_WORKER_TASKS, timeout_s)
        return True
    except grpc.RpcError:
        return False


def frozen_function(concrete):
    """``concrete`` (a ConcreteFunction) with its variables, those read inside loops too, as constants; its
    control flow kept (``while`` stays one op: LiteRT's ``WHILE``)."""
    from tensorflow.python.framework.convert_to_constants import convert_variables_to_constants_v2

    return convert_variables_to_constants_v2(concrete, lower_control_flow=False)
