"""What every benchmark shares: the machine's description, throughput measurement, JSON output."""

from __future__ import annotations

import contextlib
import datetime
import glob
import os
import platform
import re
import resource
import shutil
import tempfile
import time
from typing import Callable, Iterator

from captioning.fileio import atomic_write_json


def cpu_seconds() -> float:
    """CPU time of this process (user + system), its threads included; its child processes are not counted."""
    own = resource.getrusage(resource.RUSAGE_SELF)
    return own.ru_utime + own.ru_stime


def available_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def machine() -> dict:
    """Cores, CPU model, memory, accelerators and library versions: what the numbers depend on."""
    cpu = platform.processor() or "unknown"
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    except OSError:
        pass
    memory_gb = None
    try:
        memory_gb = round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1)
    except (ValueError, OSError, AttributeError):
        pass
    info = {"cores": available_cores(), "cpu": cpu, "memory_gb": memory_gb, "python": platform.python_version(),
            "platform": platform.platform(), "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds")}
    try:
        import keras
        import tensorflow as tf

        info.update(tensorflow=tf.__version__, keras=keras.__version__,
                    gpus=[d.name for d in tf.config.list_physical_devices("GPU")])
    except ImportError:
        pass
    return info


def throughput(items: Iterator, count: Callable[[object], float], measure: float, warmup: float) -> dict:
    """Pulls from ``items`` until ``warmup`` units (as ``count`` counts them per item) have passed, then
    times the next ``measure`` units. Returns ``{"per_s", "cpu_ms_per_unit", "units", "seconds"}``:
    CPU time per unit, unlike the rate, barely moves when other processes share the machine."""
    done = 0.0
    while done < warmup:
        done += count(next(items))
    done, cpu0, t0 = 0.0, cpu_seconds(), time.perf_counter()
    while done < measure:
        done += count(next(items))
    seconds, cpu = time.perf_counter() - t0, cpu_seconds() - cpu0
    return {"per_s": done / seconds, "cpu_ms_per_unit": 1000.0 * cpu / done, "units": done, "seconds": seconds}


def write_json(path: str | None, result: dict) -> None:
    if path:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        atomic_write_json(path, result)


# the profiler's mark of one XLA compilation's back end, whichever the device (CpuCompiler::RunBackend on a CPU)
_COMPILATION = re.compile(r"^\w*Compiler::RunBackend$")


@contextlib.contextmanager
def counting_xla_compilations() -> Iterator[dict]:
    """``{"xla_compilations": N}`` after the block: how many times XLA compiled in it, by TensorFlow's own profiler
    (host events at level 1, XLA's compiler marks among them, not every op's; tests/test_benchmarks.py counts none
    in a cross-entropy run and SCST's compiled sampling in another). None when a profile is already under way
    (``train.profile_steps``, or another tool), which the profiler allows only one of at a time.

    >>> import tensorflow as tf
    >>> f = tf.function(lambda x: tf.reduce_sum(x * 2.0), jit_compile=True)
    >>> with counting_xla_compilations() as counted:
    ...     _ = [f(tf.ones([n])) for n in (3, 4, 3)]
    >>> counted
    {'xla_compilations': 2}
    """
    import tensorflow as tf
    from tensorflow.tsl.profiler.protobuf import xplane_pb2

    counted: dict = {"xla_compilations": None}
    folder = tempfile.mkdtemp(prefix="captioning-xla-count-")
    try:
        try:
            tf.profiler.experimental.start(folder, options=tf.profiler.experimental.ProfilerOptions(
                host_tracer_level=1, python_tracer_level=0, device_tracer_level=0))
        except (tf.errors.AlreadyExistsError, tf.errors.UnavailableError):  # a profile under way
            yield counted
            return
        try:
            yield counted
        finally:
            tf.profiler.experimental.stop()
        total = 0
        for path in glob.glob(os.path.join(folder, "**", "*.xplane.pb"), recursive=True):
            space = xplane_pb2.XSpace()
            with open(path, "rb") as f:
                space.ParseFromString(f.read())
            for plane in space.planes:  # the marks' few ids first: hundreds of thousands of events, one look-up each
                marks = {key for key, meta in plane.event_metadata.items() if _COMPILATION.match(meta.name)}
                if marks:
                    total += sum(event.metadata_id in marks for line in plane.lines for event in line.events)
        counted["xla_compilations"] = total
    finally:
        shutil.rmtree(folder, ignore_errors=True)
