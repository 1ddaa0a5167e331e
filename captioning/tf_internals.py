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
:func:`install_backward_walk`             ``op_selector.get_backward_walk_ops``, replaced by
                                          :func:`backward_walk_ops`, the same walk without its quadratic
                                          cost, which a mirrored step pays at every all-reduce it traces
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


def backward_walk_ops(seed_ops, inclusive=True, within_ops=None, within_ops_fn=None, stop_at_ts=(),
                      control_inputs=False, only_differentiable=False) -> list:
    """TensorFlow's ``op_selector.get_backward_walk_ops`` (same arguments, the same ops, in no set order either):
    every op reached walking back from ``seed_ops`` through op inputs (and control inputs if asked), not past
    ``stop_at_ts`` and only through ops that ``within_ops`` and ``within_ops_fn`` allow. TensorFlow's keeps the
    ops it has reached in a list and asks it, for every input of every op, whether it holds the input's op: a
    walk over n ops costs about n² steps. This one keeps them in a set as well: about n."""
    from tensorflow.python.framework import tensor
    from tensorflow.python.ops import op_selector
    from tensorflow.python.util import object_identity

    control_inputs = control_inputs and not only_differentiable
    seed_ops = list(seed_ops) if op_selector.is_iterable(seed_ops) else [seed_ops]
    if not seed_ops:
        return []
    if isinstance(seed_ops[0], tensor.Tensor):
        seed_ops = op_selector.get_generating_ops(op_selector.make_list_of_t(seed_ops, allow_graph=False))
    seeds = object_identity.ObjectIdentitySet(op_selector.make_list_of_op(seed_ops, allow_graph=False))
    stop = object_identity.ObjectIdentitySet(op_selector.make_list_of_t(stop_at_ts))
    if within_ops:
        within_ops = object_identity.ObjectIdentitySet(op_selector.make_list_of_op(within_ops, allow_graph=False))
        seeds &= within_ops

    def allowed(op):
        return (within_ops is None or op in within_ops) and (within_ops_fn is None or within_ops_fn(op))

    result = list(seeds)
    reached = set(result)
    wave = result
    while wave:
        new_wave = []
        for op in wave:
            inputs = [t.op for t in op.inputs if t not in stop] if not only_differentiable or \
                op_selector.is_differentiable(op) else []
            for new_op in inputs + (list(op.control_inputs) if control_inputs else []):
                if new_op not in reached and allowed(new_op):
                    reached.add(new_op)
                    new_wave.append(new_op)
        result.extend(new_wave)
        wave = new_wave
    return result if inclusive else [op for op in result if op not in seeds]


def install_backward_walk() -> None:
    """Makes ``tf.custom_gradient`` walk the graph with :func:`backward_walk_ops` (idempotent; the walk's result
    is TensorFlow's own, so nothing else changes).

    In a graph, every call of a ``tf.custom_gradient`` function walks back from its outputs to its inputs to
    find the variables in between. A replica-context ``all_reduce`` is one such function (its gradient is an
    all-reduce too), and under MirroredStrategy or MultiWorkerMirroredStrategy its outputs depend on every
    replica's inputs: the walk from each crosses into the other replicas' graphs and covers them. Synchronized
    batch norm (``model.sync_batch_norm``) all-reduces its moments in every layer, and the gradient of each is
    an all-reduce again, so a step walks its whole graph many times over, and TensorFlow's walk is quadratic
    (:func:`backward_walk_ops`). A 20-step ``train`` as 2 mirrored replicas on 2 logical CPUs took 0.82 of the CPU
    it took with TensorFlow's walk (``benchmarks/command_cpu.sh``, benchmarks/RESULTS.md, 2026-11-26)."""
    from tensorflow.python.ops import op_selector

    op_selector.get_backward_walk_ops = backward_walk_ops
