"""Devices and ``tf.distribute`` strategies: one device, several GPUs, several machines, TPUs.

:func:`configure_devices` must run before TensorFlow creates its runtime (before the first op), which
is why the ``train`` command calls it first. ``distribute.logical_cpus: N`` splits the one physical CPU
into N logical devices, so the same MirroredStrategy code that runs over GPUs runs on a laptop (and in
this project's tests) with N replicas.

=================  ==================================================================================
``strategy``       what runs
=================  ==================================================================================
``auto``           MirroredStrategy over all GPUs when there is more than one, or over the logical
                   CPUs when ``logical_cpus`` > 1; otherwise the default (one-device) strategy
``default``        the default strategy: one device, no replication
``mirrored``       MirroredStrategy over all GPUs, or over the logical CPUs when there is no GPU
``multi_worker``   MultiWorkerMirroredStrategy; the cluster comes from ``TF_CONFIG``
``tpu``            TPUStrategy on ``distribute.tpu`` (a name or grpc:// address)
=================  ==================================================================================
"""

from __future__ import annotations

import json
import logging
import os
import re

import tensorflow as tf

from captioning import tf_internals
from captioning.config.sections import DistributeConfig
from captioning.errors import InputError, PeerLostError

log = logging.getLogger("captioning.distribute")


def configure_devices(cfg: DistributeConfig) -> None:
    """Splits the CPU into logical devices and lets GPU memory grow; call before any TF op."""
    try:
        for gpu in tf.config.list_physical_devices("GPU"):
            tf.config.experimental.set_memory_growth(gpu, True)
        if cfg.logical_cpus > 1:
            cpu = tf.config.list_physical_devices("CPU")[0]
            tf.config.set_logical_device_configuration(
                cpu, [tf.config.LogicalDeviceConfiguration() for _ in range(cfg.logical_cpus)])
    except RuntimeError as e:  # the runtime already started: only the first call can change devices
        current = len(tf.config.list_logical_devices("CPU"))
        if cfg.logical_cpus > 1 and current != cfg.logical_cpus:
            raise RuntimeError(f"distribute.logical_cpus={cfg.logical_cpus} must be set before TensorFlow "
                               f"starts (it has {current} CPU devices already): {e}") from None


def _mirrored(devices: list[str]) -> tf.distribute.Strategy:
    cpu_only = all("CPU" in d.upper() for d in devices)
    # NCCL all-reduce is for GPUs; on CPUs gradients are reduced on one device and broadcast.
    cross_device_ops = tf.distribute.ReductionToOneDevice() if cpu_only else None
    return tf.distribute.MirroredStrategy(devices=devices, cross_device_ops=cross_device_ops)


def make_strategy(cfg: DistributeConfig) -> tf.distribute.Strategy:
    name = cfg.strategy
    if name not in ("multi_worker", "tpu"):
        # Listing logical devices starts TF's runtime, after which MultiWorkerMirroredStrategy can no longer
        # configure its collective ops ("Collective ops must be configured at program startup").
        gpus = [d.name for d in tf.config.list_logical_devices("GPU")]
        cpus = [d.name for d in tf.config.list_logical_devices("CPU")]
    if name == "auto":
        name = "mirrored" if len(gpus) > 1 or (not gpus and len(cpus) > 1) else "default"
    if name == "default":
        strategy = tf.distribute.get_strategy()
    elif name == "mirrored":
        strategy = _mirrored(gpus or cpus)
    elif name == "multi_worker":
        if "TF_CONFIG" not in os.environ:
            raise InputError("distribute.strategy multi_worker needs the cluster in the TF_CONFIG environment "
                             "variable (docs/distributed.md, \"Devices and distribution\")")
        try:
            tf_config = json.loads(os.environ["TF_CONFIG"])
        except json.JSONDecodeError as e:
            raise InputError(f"TF_CONFIG is not valid JSON: {e}") from None
        _configure_coordination_service(tf_config.get("cluster", {}), cfg)
        try:
            strategy = tf.distribute.MultiWorkerMirroredStrategy()
        except tf.errors.OpError as e:
            raise peer_error(e, cfg) or e from None
        _warn_if_exposed(tf_config)
    elif name == "tpu":
        resolver = tf.distribute.cluster_resolver.TPUClusterResolver(tpu=cfg.tpu or None)
        tf.config.experimental_connect_to_cluster(resolver)
        tf.tpu.experimental.initialize_tpu_system(resolver)
        strategy = tf.distribute.TPUStrategy(resolver)
    else:  # pragma: no cover - config choices prevent it
        raise InputError(f"unknown distribute.strategy {name!r}")
    log.info("strategy: %s with %d replica(s)", type(strategy).__name__, strategy.num_replicas_in_sync)
    return strategy


def _warn_if_exposed(tf_config: dict) -> None:
    """One warning line when this worker's gRPC server (TF's, at its TF_CONFIG address's port, on every
    interface: docs/distributed.md, "Trust model") can be reached from other machines."""
    from captioning.data.service_probe import warn_if_exposed

    task = tf_config.get("task", {})
    try:
        port = int(tf_config["cluster"][task["type"]][task["index"]].rsplit(":", 1)[1])
    except (KeyError, IndexError, TypeError, ValueError):
        return
    warn_if_exposed("multi-worker gRPC server of this worker", port, log)


def _configure_coordination_service(cluster: dict, cfg: DistributeConfig) -> None:
    """TF's coordination service with our timeouts, before MultiWorkerMirroredStrategy starts it.

    MultiWorkerMirroredStrategy starts the service itself with TF's defaults: a peer killed mid-run is
    then noticed after 10 s without heartbeats, but a peer that never starts keeps the others waiting
    forever. Configured here (through :func:`captioning.tf_internals.configure_coordination_service`:
    TF has no public API for it), heartbeats time out after ``distribute.peer_timeout_s``, and every
    worker waits at most ``distribute.startup_timeout_s`` for all to register. Either way the survivors
    get a ``tf.errors.OpError`` naming the task, which :func:`peer_error` turns into one line. Must run
    before TensorFlow's runtime starts."""
    jobs = {job: len(cluster[job]) for job in ("chief", "worker") if cluster.get(job)}
    leader = "/job:chief/replica:0/task:0" if cluster.get("chief") else "/job:worker/replica:0/task:0"
    tf_internals.configure_coordination_service(leader, jobs, cfg.peer_timeout_s, cfg.startup_timeout_s)


_TASK = re.compile(r"/job:(\w+)/replica:\d+/task:(\d+)")
# What a collective or the coordination service raises when a peer is gone, or never came.
PEER_ERRORS = (tf.errors.UnavailableError, tf.errors.DeadlineExceededError, tf.errors.CancelledError,
               tf.errors.AbortedError, tf.errors.InternalError)


def peer_error(error: BaseException, cfg: DistributeConfig) -> InputError | None:
    """One line for a lost (or missing) worker of a multi-worker cluster, naming it by index and address
    from ``TF_CONFIG``; None when ``error`` does not name another task of the cluster."""
    if not isinstance(error, PEER_ERRORS):
        return None
    try:
        tf_config = json.loads(os.environ.get("TF_CONFIG", "{}"))
    except json.JSONDecodeError:
        return None
    cluster, me = tf_config.get("cluster", {}), tf_config.get("task", {})
    text = str(getattr(error, "message", error))
    timed_out = text.split("timed out task names:", 1)[-1] if "timed out task names:" in text else text
    others = [(job, int(i)) for job, i in _TASK.findall(timed_out)
              if (job, int(i)) != (me.get("type"), me.get("index")) and int(i) < len(cluster.get(job, []))]
    if not others:
        return None
    job, index = others[0]
    who = f"{job} {index} ({cluster[job][index]})"
    if isinstance(error, tf.errors.DeadlineExceededError) and "register" in text.lower():
        return PeerLostError(f"{who} did not join the cluster within distribute.startup_timeout_s="
                             f"{cfg.startup_timeout_s} s: start every worker of TF_CONFIG")
    return PeerLostError(f"lost {who}: it stopped answering (distribute.peer_timeout_s={cfg.peer_timeout_s} s); "
                         "this worker stops too. Start every worker again: training resumes from the latest "
                         "checkpoint")


def is_chief(strategy: tf.distribute.Strategy) -> bool:
    """True on the worker that writes checkpoints and summaries (always, without multi-worker)."""
    resolver = getattr(strategy, "cluster_resolver", None)
    if resolver is None or not resolver.task_type:
        return True
    return resolver.task_type == "chief" or (resolver.task_type == "worker" and resolver.task_id == 0
                                             and "chief" not in resolver.cluster_spec().as_dict())


def is_multi_worker(strategy: tf.distribute.Strategy) -> bool:
    """True for a MultiWorkerMirroredStrategy of a cluster (several processes)."""
    resolver = getattr(strategy, "cluster_resolver", None)
    return isinstance(strategy, tf.distribute.MultiWorkerMirroredStrategy) and resolver is not None and bool(
        resolver.cluster_spec().jobs)


def worker_id(strategy: tf.distribute.Strategy) -> str:
    resolver = getattr(strategy, "cluster_resolver", None)
    if resolver is None or not resolver.task_type:
        return "chief"
    return f"{resolver.task_type}-{resolver.task_id}"


def mixed_precision_policy() -> str:
    """``mixed_float16`` on GPUs (with loss scaling), ``mixed_bfloat16`` on CPUs and TPUs (none needed)."""
    return "mixed_float16" if tf.config.list_logical_devices("GPU") else "mixed_bfloat16"
