"""``captioning benchmark serve``: the served model under load, concurrent requests against one at a time.

It starts ``captioning serve``'s server in this process on 127.0.0.1 (a free port: nothing outside this machine
is reached), and sends real HTTP requests (``POST /caption``, multipart, one COCO-like 640 x 480 JPEG each by
default, made once in ``--work-dir``): first ``--requests`` one after another, then ``--requests`` from
``--concurrency`` client threads at once. Each phase stops at its count or after ``--seconds``, whichever comes
first. For each it reports the latency of a request (p50, p99, in milliseconds), the images captioned a second,
the failed requests (any answer but 200 with a caption for every image: must be 0) and the model calls made:
fewer calls than requests is the batching at work (:mod:`captioning.inference.serve_batching`).

A warm-up (a request alone and a burst at the concurrency, not counted) traces the model first. Then
:func:`parse_cost`: what parsing one upload costs (peak Python memory and CPU seconds a MB), for a noise JPEG of
about 2 MB and a part of 8 MB of newlines.

>>> body, content_type = form_body([("image", "a.jpg", b"\\xff\\xd8"), ("decode.beam_size", None, b"2")])
>>> content_type.startswith("multipart/form-data; boundary="), body.count(b"Content-Disposition")
(True, 2)
"""

from __future__ import annotations

import json
import os
import threading
import time
import urllib.error
import urllib.request
import uuid

import numpy as np

from captioning.benchmarks.common import cpu_seconds, machine
from captioning.benchmarks.photos import cached_photos

PHOTOS = 16  # distinct photos the requests cycle through


def form_body(fields: list[tuple[str, str | None, bytes]]) -> tuple[bytes, str]:
    """A ``multipart/form-data`` body of ``(name, file name or None, bytes)`` fields, and its Content-Type (what
    ``curl -F`` sends)."""
    boundary = uuid.uuid4().hex
    out = []
    for name, filename, data in fields:
        disposition = f'form-data; name="{name}"' + (f'; filename="{filename}"' if filename else "")
        kind = "Content-Type: application/octet-stream\r\n" if filename else ""
        out.append(f"--{boundary}\r\nContent-Disposition: {disposition}\r\n{kind}\r\n".encode() + data + b"\r\n")
    out.append(f"--{boundary}--\r\n".encode())
    return b"".join(out), f"multipart/form-data; boundary={boundary}"


def post(url: str, fields: list[tuple[str, str | None, bytes]], timeout: float = 120.0) -> tuple[int, bytes]:
    """``POST`` a form to ``url``: the status and the body of the answer."""
    body, content_type = form_body(fields)
    request = urllib.request.Request(url, data=body, headers={"Content-Type": content_type}, method="POST")
    try:
        with urllib.request.urlopen(request, timeout=timeout) as answer:
            return answer.status, answer.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def parse_cost(content_type: str, body: bytes) -> dict:
    """Parsing ``body`` (:func:`~captioning.inference.serve_api.parse_multipart`): the peak of the Python memory
    it allocates (``tracemalloc``) as a multiple of the body, and its CPU seconds a MB; ``parts`` what it returned
    (or ``error``, an ApiError's line)."""
    import tracemalloc

    from captioning.inference.serve_api import ApiError, parse_multipart

    tracemalloc.start()
    started = time.process_time()
    try:
        out = {"parts": parse_multipart(content_type, body)}
    except ApiError as e:
        out = {"error": str(e)}
    cpu = time.process_time() - started
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    return {**out, "body_mb": round(len(body) / 2**20, 2), "peak_x": round(peak / len(body), 2),
            "cpu_s_per_mb": round(cpu / (len(body) / 2**20), 4)}


def upload_costs() -> dict:
    """:func:`parse_cost` of a noise JPEG of about 2 MB (noise does not compress) and of a part of 8 MB of
    newlines (Python's ``email`` parser, used before, held 10.5x and 14.4x them: docs/serving.md)."""
    import io

    from PIL import Image

    pixels = np.random.default_rng(0).integers(0, 255, (1300, 1300, 3), dtype=np.uint8)
    jpeg = io.BytesIO()
    Image.fromarray(pixels).save(jpeg, "JPEG", quality=95)
    out = {}
    for name, payload in (("jpeg", jpeg.getvalue()), ("newlines", b"\n" * (8 * 2**20))):
        body, content_type = form_body([("image", "upload.jpg", payload)])
        out[name] = {k: v for k, v in parse_cost(content_type, body).items() if k != "parts"}
    return out


def _ok(status: int, body: bytes, images: int) -> bool:
    if status != 200:
        return False
    records = json.loads(body)
    return len(records) == images and all(r.get("captions") for r in records)


def _phase(url: str, photos: list[bytes], requests: int, concurrency: int, per_request: int, seconds: float,
           batcher) -> dict:
    """``requests`` requests from ``concurrency`` threads (stopping after ``seconds``): latencies, rate, calls."""
    lock, sent, latencies, failed = threading.Lock(), [0], [], [0]
    deadline = time.perf_counter() + seconds
    calls0, images0 = batcher.calls, batcher.images

    def client():
        while True:
            with lock:
                if sent[0] >= requests or time.perf_counter() > deadline:
                    return
                i = sent[0]
                sent[0] += 1
            fields = [("image", f"photo{(i * per_request + j) % len(photos)}.jpg",
                       photos[(i * per_request + j) % len(photos)]) for j in range(per_request)]
            start = time.perf_counter()
            try:
                status, body = post(url, fields)
                good = _ok(status, body, per_request)
            except OSError:
                good = False
            took = time.perf_counter() - start
            with lock:
                latencies.append(took)
                failed[0] += not good

    cpu0, t0 = cpu_seconds(), time.perf_counter()
    threads = [threading.Thread(target=client) for _ in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall, cpu = time.perf_counter() - t0, cpu_seconds() - cpu0
    ms = np.asarray(latencies) * 1000.0
    calls = batcher.calls - calls0
    return {"concurrency": concurrency, "requests": len(latencies), "failed": failed[0],
            "stopped_by_time": len(latencies) < requests, "seconds": round(wall, 3),
            "p50_ms": round(float(np.percentile(ms, 50)), 2), "p99_ms": round(float(np.percentile(ms, 99)), 2),
            "images_per_s": round(len(latencies) * per_request / wall, 2), "model_calls": calls,
            "images_per_call": round((batcher.images - images0) / max(calls, 1), 2),
            "cpu_ms_per_image": round(1000.0 * cpu / max(len(latencies) * per_request, 1), 2)}


def run(model_dir: str, requests: int = 300, concurrency: int = 8, images_per_request: int = 1,
        seconds: float = 120.0, max_batch: int = 16, batch_wait_ms: float = 5.0, work_dir: str = "runs/benchmarks",
        progress: bool = True) -> dict:
    """The two phases (module docstring) against one server; returns their figures and the machine's."""
    from captioning import inference
    from captioning.inference.serve import start
    from captioning.inference.serve_api import Limits

    made = cached_photos(work_dir, {"serve": PHOTOS}, progress=progress)
    names = sorted(os.listdir(made["images"]))
    photos = []
    for name in names[:PHOTOS]:
        with open(os.path.join(made["images"], name), "rb") as f:
            photos.append(f.read())
    running = start(inference.Captioner(inference.load(model_dir)), port=0, max_batch=max_batch,
                    batch_wait_ms=batch_wait_ms, limits=Limits(max_images=max(images_per_request, Limits().max_images)))
    try:
        url = running.url + "caption"
        _phase(url, photos, 2, 1, images_per_request, seconds, running.batcher)  # warm-up: traces the model
        _phase(url, photos, concurrency, concurrency, images_per_request, seconds, running.batcher)
        sequential = _phase(url, photos, requests, 1, images_per_request, seconds, running.batcher)
        concurrent = _phase(url, photos, requests, concurrency, images_per_request, seconds, running.batcher)
    finally:
        running.stop()
    return {"model_dir": model_dir, "images_per_request": images_per_request, "max_batch": max_batch,
            "batch_wait_ms": batch_wait_ms, "photo_size": [640, 480], "sequential": sequential,
            "concurrent": concurrent,
            "speedup": round(concurrent["images_per_s"] / max(sequential["images_per_s"], 1e-9), 2),
            "upload_parse": upload_costs(), "machine": machine()}


def summary(result: dict) -> str:
    lines = [f"captioning serve on 127.0.0.1, {result['images_per_request']} image(s) of 640x480 a request, "
             f"--max-batch {result['max_batch']}, --batch-wait-ms {result['batch_wait_ms']:g}"]
    for name in ("sequential", "concurrent"):
        r = result[name]
        lines.append(f"  {name:<10} concurrency {r['concurrency']:>2}: {r['requests']} requests"
                     f"{' (stopped by --seconds)' if r['stopped_by_time'] else ''}, {r['failed']} failed, "
                     f"p50 {r['p50_ms']:.1f} ms, p99 {r['p99_ms']:.1f} ms, {r['images_per_s']:.1f} images/s, "
                     f"{r['model_calls']} model calls ({r['images_per_call']:.2f} images a call)")
    lines.append(f"  concurrent / sequential throughput: {result['speedup']:.2f}x")
    for name, r in result.get("upload_parse", {}).items():
        lines.append(f"  parsing an upload ({name}, {r['body_mb']:.1f} MB): peak {r['peak_x']:.2f}x its size in "
                     f"Python memory, {r['cpu_s_per_mb']:.4f} CPU s a MB")
    return "\n".join(lines)
