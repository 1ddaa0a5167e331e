"""What the tf.data service takes off the trainer (``captioning benchmark input --service N``).

The service exists to move input work — reading, parsing, decoding, cropping, batching — off the machine
that trains. On one machine that can only be seen by keeping the two apart: the dispatcher and its N workers
run in processes of their own (``captioning data-service``), pinned to the cores the trainer does not use
(``os.sched_setaffinity``; with 2 cores, one each), and this process, the trainer's side, pinned to the
other. Then, side by side in one run (``rounds`` times each, interleaved, the best kept):

- ``local``: the training pipeline (:func:`captioning.data.pipeline.make_dataset`) in this process, on its
  core — what the trainer pays for its input without the service;
- ``service``: the same pipeline on the service's workers, this process only receiving the batches
  (``data.service_compression`` none, then snappy: each compression choice is reported);
- ``local_grouped`` and ``service_grouped`` (unless the config groups already): both with
  ``data.captions_per_image: grouped``, whose batches carry each image once instead of once per caption —
  a fifth of the bytes on COCO-like data (``grouped_trainer_cpu_ratio``).

Reported per variant: images/s received, the trainer process's CPU ms per image (``getrusage`` of this
process: the servers' CPU is theirs), and the bytes per image that cross gRPC (the batches' tensors: the
crops as ``uint8`` at ``data.image_size``, the captions' ids). ``service_trainer_cpu_ratio`` is the
service's trainer CPU per image over the local pipeline's (goal: at most 0.3): what the trainer still
pays per image for receiving it.

Example, 2 cores::

    captioning benchmark input --service 1 --json runs/benchmarks/offload.json
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import socket
import subprocess
import sys

import tensorflow as tf

from captioning.benchmarks import common
from captioning.data.pipeline import make_dataset
from captioning.data.service_probe import wait_for_dispatcher

log = logging.getLogger("captioning.benchmark")

TARGET_TRAINER_CPU_RATIO = 0.3
COMPRESSIONS = ("none", "snappy")


def split_cores() -> tuple[set[int], set[int]]:
    """(the trainer's cores, the service's): the first core this process may use, and the others (with one
    core, both share it)."""
    cores = sorted(os.sched_getaffinity(0))
    return {cores[0]}, set(cores[1:]) or {cores[0]}


@contextlib.contextmanager
def pinned(cores: set[int]):
    """This process on ``cores`` while the block runs."""
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, cores)
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)


@contextlib.contextmanager
def service_processes(workers: int, cores: set[int], log_dir: str):
    """A dispatcher and ``workers`` workers (``captioning data-service``) in processes pinned to ``cores``;
    yields the dispatcher's ``HOST:PORT`` once a worker serves. Their output goes to ``log_dir``."""
    with socket.socket() as probe:  # a free port for the dispatcher
        probe.bind(("localhost", 0))
        port = probe.getsockname()[1]
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the project, importable
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2",
               PYTHONPATH=os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p))

    logs = []

    def start(name, *args):
        logs.append(open(os.path.join(log_dir, f"offload-{name}.log"), "w"))
        out = logs[-1]
        return subprocess.Popen([sys.executable, "-m", "captioning", "data-service", *args], stdout=out,
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
                                preexec_fn=lambda: os.sched_setaffinity(0, cores))

    procs = [start("dispatcher", "dispatcher", "--port", str(port))]
    try:
        procs += [start(f"worker{i}", "worker", "--dispatcher", f"localhost:{port}") for i in range(workers)]
        wait_for_dispatcher(f"localhost:{port}", 60.0, need_worker=True)
        yield f"localhost:{port}"
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
        for out in logs:
            out.close()


def batch_bytes(batch) -> int:
    """Bytes of a batch's tensors: what crosses gRPC for it."""
    return sum(int(tf.size(t)) * t.dtype.size for t in tf.nest.flatten(batch))


def measure(data_cfg, split: str, batch: int, measure_images: int, rounds: int, workers: int, count,
            log_dir: str, built: dict | None = None) -> dict:
    """The local pipeline against the service's (per compression), with the trainer and the service on
    separate cores (see the module docstring). ``count(batch)``: the images in a batch. A variant's bytes per image
    are its first batch's, taken in the first round's warm-up (no pipeline started again for them, no service job
    more). ``built``: the local variants the caller has built already (``"local"``, ``"local_grouped"``: the
    training pipeline of ``data_cfg``, and with grouped captions), used instead of building them again (each
    construction traces the pipeline's functions; iterating a dataset again starts it afresh)."""
    built = built or {}
    trainer, served_on = split_cores()
    log.info("offload: the trainer on core(s) %s, the tf.data service (%d worker(s)) on %s", sorted(trainer),
             workers, sorted(served_on))
    with service_processes(workers, served_on, log_dir) as address:
        local = built.get("local")
        variants = {"local": make_dataset(data_cfg, split, training=True, batch_size=batch) if local is None else local}
        for compression in COMPRESSIONS:
            served = dataclasses.replace(data_cfg, service=address, service_mode="parallel_epochs",
                                         service_compression=compression)
            variants[f"service_{compression}"] = make_dataset(served, split, training=True, batch_size=batch)
        if data_cfg.captions_per_image != "grouped":  # sending each image once, not once per caption
            grouped = dataclasses.replace(data_cfg, captions_per_image="grouped")
            local_grouped = built.get("local_grouped")
            variants["local_grouped"] = (make_dataset(grouped, split, training=True, batch_size=batch)
                                         if local_grouped is None else local_grouped)
            variants["service_grouped"] = make_dataset(dataclasses.replace(
                grouped, service=address, service_mode="parallel_epochs", service_compression="none"), split,
                training=True, batch_size=batch)
        best: dict[str, dict] = {}
        sizes = {}

        def counted(name):  # count, and each variant's bytes per image from its first batch (in the warm-up)
            def images(b):
                if name not in sizes:
                    sizes[name] = batch_bytes(b) / max(count(b), 1)
                return count(b)
            return images

        with pinned(trainer):
            for r in range(rounds):
                for name, ds in variants.items():
                    m = common.throughput(iter(ds), counted(name), measure_images, warmup=min(300, measure_images))
                    log.info("offload round %d: %-14s %7.1f images/s, %.3f trainer CPU ms per image", r + 1, name,
                             m["per_s"], m["cpu_ms_per_unit"])
                    if name not in best or m["cpu_ms_per_unit"] < best[name]["cpu_ms_per_unit"]:
                        best[name] = m
    local = best["local"]["cpu_ms_per_unit"]
    out = {name: {"img_per_s": m["per_s"], "trainer_cpu_ms_per_image": m["cpu_ms_per_unit"],
                  "bytes_per_image": sizes[name]} for name, m in best.items()}
    service = min((n for n in out if n.startswith("service_") and n != "service_grouped"),
                  key=lambda n: out[n]["trainer_cpu_ms_per_image"])
    ratio = out[service]["trainer_cpu_ms_per_image"] / local
    grouped = ({"grouped_trainer_cpu_ratio": out["service_grouped"]["trainer_cpu_ms_per_image"]
                / out["local_grouped"]["trainer_cpu_ms_per_image"]} if "service_grouped" in out else {})
    return {"variants": out, "best_service": service, "service_trainer_cpu_ratio": ratio, **grouped,
            "trainer_cores": sorted(trainer), "service_cores": sorted(served_on), "workers": workers,
            "target": [TARGET_TRAINER_CPU_RATIO, ratio <= TARGET_TRAINER_CPU_RATIO]}


def summary(found: dict) -> str:
    lines = [f"the tf.data service on core(s) {found['service_cores']}, the trainer on {found['trainer_cores']}:"]
    for name, v in found["variants"].items():
        lines.append(f"  {name:15} {v['img_per_s']:8.1f} images/s, trainer {v['trainer_cpu_ms_per_image']:.3f} CPU ms "
                     f"per image, {v['bytes_per_image'] / 1000:.1f} KB per image")
    lines.append(f"  the trainer's CPU per image with the service ({found['best_service']}): "
                 f"{found['service_trainer_cpu_ratio']:.2f} of the local pipeline's (target <= {TARGET_TRAINER_CPU_RATIO})")
    if "grouped_trainer_cpu_ratio" in found:
        lines.append(f"  with grouped captions (each image sent once): {found['grouped_trainer_cpu_ratio']:.2f}")
    return "\n".join(lines)
