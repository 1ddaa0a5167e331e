"""``captioning benchmark litert``: the ``.tflite`` export (:mod:`captioning.inference.litert`) at each
quantization against the SavedModel (:mod:`captioning.inference.export`), one image per call, as a phone
app captions: per-image latency (median and mean over the images, after one warm-up call), file sizes and
their ratio to ``none``, and how many best captions agree with the SavedModel's.

The images are synthetic shapes scenes (``captioning synth``, made once in ``work_dir``), 220-260 px JPEGs.
The SavedModel takes each JPEG's bytes (it decodes inside); the ``.tflite`` file takes the pixels TensorFlow
decodes them to (decoded before the clock starts: an app decodes with the platform's decoder), so both
caption the same pixels. The interpreter runs with LiteRT's default CPU settings (XNNPACK).

Beside the agreement, each file's ``log_prob_change_mean`` and ``_max``: how far its best caption's
log-probability lies from the SavedModel's, over the images where the two agree (a measure of the rounding that
moves less from model to model than the count of flipped near-ties). And for ``none``, ``pillow_agreement``: the
same count with the pixels Pillow decodes (docs/litert.md's snippet), whose JPEG decoder is not TensorFlow's
``INTEGER_FAST`` one.
"""

from __future__ import annotations

import io
import os
import statistics
import tempfile
import time

import numpy as np
import tensorflow as tf

from captioning.benchmarks.common import machine
from captioning.inference.captioner import Captioner, load
from captioning.inference.export import export
from captioning.inference.litert import QUANTIZE, convert


def _images(work_dir: str, count: int, progress: bool) -> list[bytes]:
    from data_prep.synth import synthesize

    folder = os.path.join(work_dir, f"litert_shapes_{count}")
    if not os.path.isdir(os.path.join(folder, "images")):
        synthesize(folder, num_images=count, seed=11, overwrite=True, progress=progress)
    images = os.path.join(folder, "images")
    return [open(os.path.join(images, f), "rb").read() for f in sorted(os.listdir(images))[:count]]


def _timed(call, inputs) -> tuple[list, list[float]]:
    call(inputs[0])  # warm-up: the first call builds what later calls reuse
    outputs, ms = [], []
    for item in inputs:
        start = time.perf_counter()
        outputs.append(call(item))
        ms.append((time.perf_counter() - start) * 1000)
    return outputs, ms


def _agreement(captions: list[str], reference: list[str]) -> float:
    return round(float(np.mean([a == b for a, b in zip(captions, reference)])), 4)


def _latency(ms: list[float]) -> dict:
    return {"ms_p50": round(statistics.median(ms), 3), "ms_mean": round(statistics.fmean(ms), 3)}


def run(model_dir: str, images: int = 200, work_dir: str = "runs/benchmarks", progress: bool = True) -> dict:
    from ai_edge_litert.interpreter import Interpreter

    os.makedirs(work_dir, exist_ok=True)
    jpegs = _images(work_dir, images, progress)
    pixels = [tf.io.decode_jpeg(j, channels=3, dct_method="INTEGER_FAST").numpy() for j in jpegs]
    captioner = Captioner(load(model_dir))
    result = {"machine": machine(), "model_dir": os.path.abspath(model_dir), "images": len(jpegs),
              "decode": dict(captioner.options), "litert": {}}
    with tempfile.TemporaryDirectory(dir=work_dir, prefix="litert-") as tmp:
        serve = tf.saved_model.load(export(captioner, os.path.join(tmp, "savedmodel"), model_dir)).signatures[
            "serving_default"]
        out, ms = _timed(lambda jpeg: serve(images=tf.constant([jpeg])), jpegs)
        reference = [o["captions"][0, 0].numpy().decode() for o in out]
        reference_log_probs = [float(o["log_probs"][0, 0]) for o in out]
        result["savedmodel"] = _latency(ms)
        for quantize in QUANTIZE:
            start = time.perf_counter()
            data = convert(captioner, quantize)
            seconds = time.perf_counter() - start
            runner = Interpreter(model_content=data).get_signature_runner("serving_default")

            def caption(image):
                got = runner(image=image)
                return b" ".join(got["words"][0, :got["lengths"][0]]).decode(), float(got["log_probs"][0])

            out, ms = _timed(caption, pixels)
            changes = [abs(lp - ref) for (text, lp), want, ref in zip(out, reference, reference_log_probs)
                       if text == want]
            result["litert"][quantize] = {
                "bytes": len(data), "convert_s": round(seconds, 1), **_latency(ms),
                "agreement": _agreement([text for text, _ in out], reference),
                "log_prob_change_mean": round(float(np.mean(changes)), 5) if changes else None,
                "log_prob_change_max": round(float(np.max(changes)), 5) if changes else None}
            if quantize == "none":  # the snippet's pixels: Pillow's decode
                from PIL import Image

                pillow = [caption(np.asarray(Image.open(io.BytesIO(j)).convert("RGB")))[0] for j in jpegs]
                result["litert"][quantize]["pillow_agreement"] = _agreement(pillow, reference)
    none = result["litert"]["none"]["bytes"]
    for entry in result["litert"].values():
        entry["size_ratio"] = round(entry["bytes"] / none, 3)
    return result


def summary(result: dict) -> str:
    lines = [f"SavedModel, one image per call: {result['savedmodel']['ms_p50']:.2f} ms median "
             f"({result['savedmodel']['ms_mean']:.2f} mean) over {result['images']} images"]
    for quantize, entry in result["litert"].items():
        lines.append(f".tflite {quantize}: {entry['ms_p50']:.2f} ms median ({entry['ms_mean']:.2f} mean), "
                     f"{entry['bytes']:,} bytes ({entry['size_ratio']:.3f}x of none), best captions as the "
                     f"SavedModel's on {entry['agreement']:.1%} (log p moved by {entry['log_prob_change_mean']} on "
                     f"average, {entry['log_prob_change_max']} at most)"
                     + (f"; on Pillow's pixels {entry['pillow_agreement']:.1%}" if "pillow_agreement" in entry else ""))
    return "\n".join(lines)
