"""``captioning benchmark decode``: batched beam search against captioning one image at a time.

Both go through :class:`captioning.inference.captioner.Captioner`'s compiled function — the code ``caption``,
``evaluate`` and the exported SavedModel run: JPEG bytes in, decode and crop, encoder, beam search
(beam 3, at most 20 words by default). ``single`` calls it with one image per call, ``batched`` with
``--batch-size`` images per call. Without ``--model-dir`` a small untrained model is built (the shapes
demo's architecture: ``small_cnn``, LSTM 256, on 32² crops, with a 1,000-word vocabulary); an
untrained model rarely ends a caption early, so every caption runs the full length: the worst case for
both.

On a CPU the batched search is compute-bound: each step multiplies ``batch × beam`` rows through the
LSTM and the vocabulary projection, and a 2-core machine does that at its matmul peak (~100 GFLOPS),
so the gain over one image at a time (whose cost is per-op overhead) is capped near 6× for this model —
see ``benchmarks/RESULTS.md``. An accelerator runs the batched steps at nearly the cost of single ones.
"""

from __future__ import annotations

import dataclasses
import io
import logging

import numpy as np

from captioning.benchmarks import common
from captioning.errors import InputError

log = logging.getLogger("captioning.benchmark")

TARGET_SPEEDUP = 20.0


def _small_model(vocab_size: int = 1_000):
    from captioning import config as config_lib
    from captioning.model.folder import TrainedModel
    from captioning.model import build_model
    from captioning.vocab import RESERVED, Vocabulary

    cfg = config_lib.Config()
    cfg.data = dataclasses.replace(cfg.data, image_size=32, resize_size=36)
    cfg.model = dataclasses.replace(cfg.model, encoder="small_cnn", encoder_trainable=True,
                                    options={"embedding_size": 256, "lstm_units": 256})
    vocab = Vocabulary(list(RESERVED) + [f"w{i}" for i in range(vocab_size - len(RESERVED))])
    model = build_model(len(vocab), cfg.model, cfg.data.image_size, seed=0).build_all()
    return TrainedModel(model, cfg, vocab, step=0, checkpoint="(untrained)", model_dir="")


def _jpegs(count: int, size: int, seed: int = 0) -> list[bytes]:
    from PIL import Image

    rng = np.random.default_rng(seed)
    out = []
    for _ in range(count):
        buf = io.BytesIO()
        Image.fromarray(rng.integers(0, 256, (size, size, 3), dtype=np.uint8)).save(buf, "JPEG", quality=90)
        out.append(buf.getvalue())
    return out


def run(model_dir: str | None = None, batch_size: int = 64, images: int = 256, beam_size: int | None = None,
        max_length: int | None = None, length_normalization: float | None = None, progress: bool = True) -> dict:
    """``beam_size``, ``max_length``, ``length_normalization``: None takes the model's ``decode:`` config."""
    import tensorflow as tf

    from captioning import inference

    if batch_size < 1 or images < batch_size:
        raise InputError("`batch_size` must be at least 1 and `images` at least `batch_size`",
                         params=("batch_size", "images"))
    trained = inference.load(model_dir) if model_dir else _small_model()
    captioner = inference.Captioner(trained, trained.config.decode.override(
        beam_size=beam_size, max_length=max_length, length_normalization=length_normalization, top_k=1))
    beam_size, max_length = captioner.settings.beam_size, captioner.settings.max_length
    data = _jpegs(images, trained.config.data.resize_size)
    log.info("decode benchmark: %s, vocabulary %d, beam %d, length %d, %d images", model_dir or "small untrained model",
             len(trained.vocab), beam_size, max_length, images)

    def calls(size):
        while True:
            for start in range(0, images - size + 1, size):
                yield captioner.decode(tf.constant(data[start:start + size]))

    def count(out):
        return int(out["ids"].shape[0])  # .shape of an eager result: the call has finished

    single = common.throughput(calls(1), count, measure=min(images, 64), warmup=4)
    batched = common.throughput(calls(batch_size), count, measure=images, warmup=batch_size)
    log.info("single: %.1f captions/s; batched (%d per call): %.1f captions/s", single["per_s"], batch_size,
             batched["per_s"])
    speedup = batched["per_s"] / single["per_s"]
    return {
        "batched_captions_per_s": batched["per_s"], "single_captions_per_s": single["per_s"],
        "speedup": speedup,
        "settings": {"model_dir": model_dir, "batch_size": batch_size, "beam_size": beam_size,
                     "max_length": max_length, "vocab_size": len(trained.vocab),
                     "encoder": trained.config.model.encoder, "image_size": trained.config.data.image_size},
        "target": {"speedup": [TARGET_SPEEDUP, speedup >= TARGET_SPEEDUP]},
        "machine": common.machine(),
    }


def summary(result: dict) -> str:
    return (f"batched {result['batched_captions_per_s']:.1f} captions/s, one at a time "
            f"{result['single_captions_per_s']:.1f} captions/s: {result['speedup']:.1f}x (target >= {TARGET_SPEEDUP:.0f}x)")
