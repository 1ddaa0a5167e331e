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
========================================  ====================================================================
"""

from __future__ import annotations

import os

import tensorflow as tf


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
