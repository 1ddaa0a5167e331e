"""``captioning benchmark decode``: batched beam search against captioning one image at a time.

Both go through :class:`captioning.inference.captioner.Captioner`'s compiled function — the code ``caption``,
``evaluate`` and the exported SavedModel run: JPEG bytes in, decode and crop, encoder, beam search
(beam 3, at most 20 words by default). ``single`` calls it with one image per call, ``batched`` with
``--batch-size`` images per call. Without ``--model-dir`` a small untrained model is built (the shapes
demo's architecture: ``small_cnn``, LSTM 256, on 32² crops, with a 1,000-word vocabulary); an
untrained model rarely ends a caption early, so every caption runs the full length: the worst case for
both.

``saved_model_vs_captioner``: the exported SavedModel (:mod:`captioning.inference.export`), loaded with plain
``tf.saved_model.load``, against the in-process captioner on the same images and batch, timed in turn (goal:
at least 0.9; its signature also joins the words into strings).

``cache_speedup``: the same batched search against one whose decoder keeps no state between words and
re-reads the caption at every step (:class:`PrefixRecomputer`: the teacher-forced pass over the words chosen
so far, padded to ``max_length``, whose logits at the new word's position pick the next word) — what a
decoder without a key/value cache does if it pads to a fixed length. ``cache_speedup_prefix``: against the
fairer such decoder, which recomputes only the ``t`` words so far at step ``t`` (:class:`GrowingPrefix`:
``1 + 2 + … + max_length`` word positions in all instead of ``max_length²``), as a cacheless Transformer
decoding loop written without padding does. ``--config`` and ``--set`` choose the untrained model
(``--config experiments/shapes_transformer.yaml``, or ``--set model.decoder=attention``).

``--ensemble-with MODEL_DIR`` (repeatable, with ``--model-dir``) times the ensembles of ``--model-dir`` and the
first 1, 2, … of these the same way (``options["ensemble of 2"]``, ``["ensemble of 3"]``, …).

``--option decode.KEY=VALUE[,decode.KEY=VALUE…]`` (repeatable) also times the batched call with each of
those decoding settings (``decode.method=sample,decode.top_k=5``, ``decode.block_ngrams=3``,
``decode.beam_groups=3,decode.diversity=0.5``) against plain beam search, side by side in the same run:
``options`` holds each one's captions/s and its ratio to plain beam search.

On a CPU the batched search is compute-bound: each step multiplies ``batch × beam`` rows through the
LSTM and the vocabulary projection, and a 2-core machine does that at its matmul peak, so the gain over
one image at a time (whose cost is per-op overhead) is capped by the ratio of the two — see
``benchmarks/RESULTS.md``. An accelerator runs the batched steps at nearly the cost of single ones.
``batched_parts_ms`` says where a batched call's time goes, each part compiled and timed alone on the
same batch: ``images`` (JPEG decode and crop), ``encoder``, ``search`` (beam search from the encoder's
features) and, inside the search, ``decoder_steps`` (the decoder's ``max_length`` steps for ``batch ×
beam`` rows — one row per image for greedy decoding —, without the search's choosing and reordering).
``search_overhead`` is ``search / decoder_steps``. Each of those steps is fed ``<start>`` once the previous
step's logits are computed (a comparison on them, not a choice), because a search's next step waits for its
words: fed ``<start>`` without waiting, as before 2026-11-26, a step's vocabulary projection ran on the second
core beside the next step, which no search can do (Show and Tell, 128 images, 20 steps: 14.6 ms without the
wait, 21.8 ms with it, 2 cores).
"""

from __future__ import annotations

import io
import logging

import numpy as np

from captioning.benchmarks import common
from captioning.errors import InputError

log = logging.getLogger("captioning.benchmark")

TARGET_SPEEDUP = 10.0  # the performance issue's goal for Show and Tell (the first benchmark asked 20x)
TARGET_SAVED_MODEL = 0.9  # the SavedModel in plain TensorFlow captions at least this share of the captioner's rate
# the search's time over its decoder's own steps (batched_parts_ms' search / decoder_steps): beams, and one beam
TARGET_SEARCH_OVERHEAD = {"beam": 1.3, "greedy": 1.15}
ROUNDS = 3  # default rounds (--rounds): the SavedModel and the captioner, and the cache's three decoders, are timed in
# turn, this many times each: the best of each counts


class PrefixRecomputer:
    """A decoder without a cache, for comparison: ``step`` writes the word into the caption so far and runs
    the model's teacher-forced pass over all of it (``steps`` words, padded) from the image's initial state,
    keeping only the logits at the new word's position. Exact for any decoder (causal: later, padded words
    do not change earlier logits); its cost grows with the caption, a cached step's does not."""

    attends = False

    def __init__(self, model, steps: int):
        self.model, self.steps, self.vocab_size = model, steps, model.vocab_size

    def initial_state(self, features, training=False, mask=None):
        import tensorflow as tf

        rows = tf.shape(features)[0]
        return {"image": self.model.initial_state(features, training, mask), "ids": tf.zeros([rows, self.steps], tf.int32),
                "t": tf.zeros([rows], tf.int32)}

    def reserve(self, state, steps):
        return state

    def step(self, token_ids, state):
        import tensorflow as tf

        t = state["t"]
        ids = state["ids"] + tf.one_hot(t, self.steps, dtype=tf.int32) * token_ids[:, None]
        logits, _ = self.model.teacher_forced(state["image"], ids, training=False)
        return tf.gather(logits, tf.minimum(t, self.steps - 1), batch_dims=1), {**state, "ids": ids, "t": t + 1}


class GrowingPrefix(PrefixRecomputer):
    """A decoder without a cache that recomputes only the words so far: at step ``t`` the teacher-forced pass
    over the ``t + 1`` words read (``<start>`` and the ``t`` chosen), from the image's initial state, its last
    logits picking the next word. Exact for any decoder, as :class:`PrefixRecomputer`; its step ``t`` costs
    ``t + 1`` word positions, not ``max_length``."""

    def step(self, token_ids, state):
        import tensorflow as tf

        t = state["t"]
        ids = state["ids"] + tf.one_hot(t, self.steps, dtype=tf.int32) * token_ids[:, None]
        read = tf.minimum(tf.reduce_max(tf.concat([t, [0]], 0)) + 1, self.steps)  # every row is at the same word
        logits, _ = self.model.teacher_forced(state["image"], ids[:, :read], training=False)
        return logits[:, -1], {**state, "ids": ids, "t": t + 1}


def _untrained_model(config: str | None, overrides: tuple[str, ...], vocab_size: int = 1_000):
    """An untrained model of ``config``'s model and data sections (default: the shapes demo's,
    ``small_cnn`` on 32² crops with an LSTM of 256) and a vocabulary of ``vocab_size`` words."""
    from captioning.config import load_config
    from captioning.model import build_model, resolve
    from captioning.model.folder import TrainedModel
    from captioning.vocab import RESERVED, Vocabulary

    defaults = ["data.image_size=32", "data.resize_size=36", "model.encoder=small_cnn", "model.dropout=0",
                "model.embedding_size=256", "model.lstm_units=256"] if config is None else []
    cfg = resolve(load_config(config, overrides, defaults=defaults))  # the LSTM's sizes unread by a Transformer
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
        max_length: int | None = None, length_normalization: float | None = None, config: str | None = None,
        overrides: tuple[str, ...] = (), decode_options: tuple[str, ...] = (), ensemble_with: tuple[str, ...] = (),
        progress: bool = True, rounds: int = ROUNDS) -> dict:
    """``beam_size``, ``max_length``, ``length_normalization``: None takes the model's ``decode:`` config.
    Without ``model_dir``, an untrained model of ``config`` and ``overrides`` (``--set model.decoder=...``).
    ``ensemble_with``: model folders whose ensemble with ``model_dir`` is timed too, beside the options."""
    import tensorflow as tf

    from captioning import inference

    if batch_size < 1 or images < batch_size:
        raise InputError("`batch_size` must be at least 1 and `images` at least `batch_size`",
                         params=("batch_size", "images"))
    if model_dir and (config or overrides):
        raise InputError("give `model_dir` or `config`/`overrides`, not both", params=("model_dir", "config", "overrides"))
    if ensemble_with and not model_dir:
        raise InputError("`ensemble_with` names the other models of an ensemble with `model_dir`: give `model_dir`",
                         params=("ensemble_with", "model_dir"))
    trained = inference.load(model_dir) if model_dir else _untrained_model(config, tuple(overrides))
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
    options = {}
    others = [(spec, lambda s=spec: inference.Captioner(trained, captioner.settings.with_overrides(
        [part.strip() for part in s.split(",") if part.strip()]))) for spec in decode_options]
    for n in range(2, 2 + len(ensemble_with)):  # the ensembles of the first n models, decoding as the first does
        others.append((f"ensemble of {n}", lambda n=n: inference.Captioner(
            inference.load([model_dir, *ensemble_with[:n - 1]]), captioner.settings)))
    for spec, make in others:  # each against plain beam search, the same images and batch
        other = make()

        def other_calls(c=other):
            while True:
                for start in range(0, images - batch_size + 1, batch_size):
                    yield c.decode(tf.constant(data[start:start + batch_size]))

        rate = common.throughput(other_calls(), count, measure=images, warmup=batch_size)["per_s"]
        options[spec] = {"captions_per_s": rate, "vs_beam": rate / batched["per_s"]}
        log.info("%s: %.1f captions/s, %.2f of plain beam search", spec, rate, rate / batched["per_s"])
    served = _saved_model_against_captioner(captioner, data, batch_size, images, rounds)
    log.info("the exported SavedModel in plain TensorFlow: %.1f captions/s against the captioner's %.1f: %.2f",
             served["saved_model"], served["captioner"], served["saved_model"] / served["captioner"])
    cache = _cache_against_recomputing(captioner, data, batch_size, images, rounds)
    parts = _batched_parts(captioner, data[:batch_size], rounds)
    log.info("a batched call in parts (ms, each alone): %s",
             ", ".join(f"{name.replace('_', ' ')} {ms:.1f}" for name, ms in parts.items()))
    overhead = parts["search"] / parts["decoder_steps"]
    kind = "greedy" if beam_size == 1 or captioner.settings.method == "greedy" else "beam"
    log.info("the search over its decoder's steps: %.2fx (target <= %.2fx)", overhead, TARGET_SEARCH_OVERHEAD[kind])
    log.info("batched with the decoder's state: %.1f captions/s; re-reading the caption at every step: %.1f "
             "captions/s padded to max_length, %.1f the words so far only", cache["cached"], cache["recomputed"],
             cache["prefix"])
    return {
        "batched_captions_per_s": batched["per_s"], "single_captions_per_s": single["per_s"],
        "speedup": speedup, "batched_parts_ms": parts, "search_overhead": overhead, "cached_captions_per_s": cache["cached"], "recomputed_captions_per_s": cache["recomputed"],
        "cache_speedup": cache["cached"] / cache["recomputed"], "prefix_captions_per_s": cache["prefix"],
        "cache_speedup_prefix": cache["cached"] / cache["prefix"], "options": options,
        "saved_model_captions_per_s": served["saved_model"], "captioner_captions_per_s": served["captioner"],
        "saved_model_vs_captioner": served["saved_model"] / served["captioner"],
        "settings": {"model_dir": model_dir, "decoder": trained.config.model.decoder, "batch_size": batch_size,
                     "beam_size": beam_size,
                     "max_length": max_length, "vocab_size": len(trained.vocab),
                     "encoder": trained.config.model.encoder, "image_size": trained.config.data.image_size},
        "target": {"speedup": [TARGET_SPEEDUP, speedup >= TARGET_SPEEDUP],
                   "search_overhead": [TARGET_SEARCH_OVERHEAD[kind], overhead <= TARGET_SEARCH_OVERHEAD[kind]],
                   "saved_model_vs_captioner": [TARGET_SAVED_MODEL,
                                                served["saved_model"] / served["captioner"] >= TARGET_SAVED_MODEL]},
        "machine": common.machine(),
    }


def _saved_model_against_captioner(captioner, data: list[bytes], batch_size: int, images: int,
                                   rounds: int = ROUNDS) -> dict:
    """Captions/s of the exported SavedModel (``serving_default``, loaded with plain ``tf.saved_model.load``, as a
    server would) and of the in-process captioner, on the same images and batch, timed in turn
    (:data:`ROUNDS` rounds (``rounds``), the best of each: a burst of other work on the machine lowers one round, not a
    method)."""
    import tempfile

    import tensorflow as tf

    from captioning.inference.export import CaptionServer

    with tempfile.TemporaryDirectory(prefix="captioning-export-") as folder:
        server = CaptionServer(captioner)
        tf.saved_model.save(server, folder, signatures={"serving_default": server.serve})
        serve = tf.saved_model.load(folder).signatures["serving_default"]
        batches = [tf.constant(data[start:start + batch_size]) for start in range(0, images - batch_size + 1, batch_size)]
        runs = {"saved_model": lambda b: serve(images=b)["log_probs"], "captioner": lambda b: captioner.decode(b)["ids"]}
        best = {name: 0.0 for name in runs}
        for _ in range(rounds):
            for name, run_batch in runs.items():
                def calls(f=run_batch):
                    while True:
                        for b in batches:
                            yield f(b)

                rate = common.throughput(calls(), lambda out: int(out.shape[0]), measure=max(images // 2, batch_size),
                                         warmup=batch_size)["per_s"]
                best[name] = max(best[name], rate)
    return best


def _batched_parts(captioner, data: list[bytes], rounds: int = ROUNDS) -> dict[str, float]:
    """Where a batched call's time goes (module docstring): each part compiled alone and timed on the same
    batch, the fastest of ``rounds`` × 3 calls after one that traces."""
    import time

    import tensorflow as tf

    from captioning.data.reading import model_input
    from captioning.model.decode import generate
    from captioning.model.search_tools import one_loop
    from captioning.vocab import START_ID

    model, settings, cfg = captioner.trained.model, captioner.settings, captioner.trained.config.data
    jpegs = tf.constant(data)
    crop = tf.function(lambda b: tf.map_fn(lambda e: model_input(e, cfg), b, fn_output_signature=tf.TensorSpec(
        [cfg.image_size, cfg.image_size, 3], tf.uint8)), autograph=False)
    encode = tf.function(lambda images: model.encode(images), autograph=False)
    search = tf.function(lambda features: generate(model, model.initial_state(features), settings,
                                                   captioner.bad_endings)["ids"], autograph=False)

    rows = 1 if settings.method == "greedy" else settings.beam_size  # per image, as the search steps them

    def steps(features):  # the decoder's steps alone: each waits for the previous step's logits (module docstring)
        state = tf.nest.map_structure(lambda s: tf.repeat(s, rows, axis=0),
                                      model.reserve(model.initial_state(features), settings.max_length))
        tokens = tf.fill([tf.shape(tf.nest.flatten(state)[0])[0]], START_ID)

        def one_step(v):
            logits, state = model.step(v["tokens"], v["state"])
            # <start> again, once the logits are there
            return {"t": v["t"] + 1, "state": state, "tokens": START_ID + tf.cast(logits[:, 0] > 1e30, tf.int32),
                    "logits": tf.cast(logits, tf.float32)}

        return one_loop(lambda v: v["t"] < settings.max_length, one_step, {
            "t": tf.constant(0), "state": state, "tokens": tokens,
            "logits": tf.zeros([tf.shape(tokens)[0], model.vocab_size])})["logits"]

    crops = crop(jpegs)
    features = encode(crops)
    parts = {"images": (crop, jpegs), "encoder": (encode, crops), "search": (search, features),
             "decoder_steps": (tf.function(steps, autograph=False), features)}
    out = {}
    for name, (fn, arg) in parts.items():
        fn(arg).numpy()  # traces
        times = []
        for _ in range(3 * rounds):
            start = time.perf_counter()
            fn(arg).numpy()
            times.append(time.perf_counter() - start)
        out[name] = 1000 * min(times)
    return out


def _cache_against_recomputing(captioner, data: list[bytes], batch_size: int, images: int,
                               rounds: int = ROUNDS) -> dict:
    """Captions/s of batched beam search on the model (``cached``), on :class:`PrefixRecomputer` of it
    (``recomputed``) and on :class:`GrowingPrefix` of it (``prefix``): no attention weights kept by any, the
    same images, crops computed once; timed in turn, :data:`ROUNDS` rounds (``rounds``), the best of each."""
    import tensorflow as tf

    from captioning.data.reading import model_input
    from captioning.model.decode import generate

    model, settings, cfg = captioner.trained.model, captioner.settings, captioner.trained.config.data
    crops = tf.map_fn(tf.autograph.experimental.do_not_convert(lambda e: model_input(e, cfg)),
                      tf.constant(data[:batch_size]),
                      fn_output_signature=tf.TensorSpec([cfg.image_size, cfg.image_size, 3], tf.uint8))

    class Plain:  # the model itself, without keeping its attention weights: the same work as the other
        attends, vocab_size = False, model.vocab_size
        initial_state, reserve, step = model.initial_state, model.reserve, model.step

    searches = {}
    for name, decoder in (("cached", Plain()), ("recomputed", PrefixRecomputer(model, settings.max_length)),
                          ("prefix", GrowingPrefix(model, settings.max_length))):
        searches[name] = tf.function(lambda images, d=decoder: generate(
            d, d.initial_state(model.encode(images)), settings, captioner.bad_endings)["ids"], autograph=False)
    rates = {name: 0.0 for name in searches}
    for _ in range(rounds):  # in turn, the best of each: a burst of other work lowers one round, not a decoder
        for name, search in searches.items():
            rate = common.throughput(iter(lambda s=search: s(crops), None), lambda out: int(out.shape[0]),
                                     measure=max(images // 2, batch_size), warmup=batch_size)["per_s"]
            rates[name] = max(rates[name], rate)
    return rates


def summary(result: dict) -> str:
    return (f"batched {result['batched_captions_per_s']:.1f} captions/s, one at a time "
            f"{result['single_captions_per_s']:.1f} captions/s: {result['speedup']:.1f}x (target >= {TARGET_SPEEDUP:.0f}x)"
            f"\na batched call in parts (ms, each alone): "
            + ", ".join(f"{k.replace('_', ' ')} {v:.1f}" for k, v in result["batched_parts_ms"].items()) +
            f"; the search is {result['search_overhead']:.2f}x its decoder's steps (target <= "
            f"{result['target']['search_overhead'][0]:.2f}x)"
            f"\n{result['settings']['decoder']}: stepping with its state {result['cached_captions_per_s']:.1f} captions/s, "
            f"re-reading the caption at every step, padded to max_length {result['recomputed_captions_per_s']:.1f}: "
            f"{result['cache_speedup']:.1f}x; the words so far only {result['prefix_captions_per_s']:.1f}: "
            f"{result['cache_speedup_prefix']:.1f}x"
            f"\nthe exported SavedModel in plain TensorFlow: {result['saved_model_captions_per_s']:.1f} captions/s, "
            f"{result['saved_model_vs_captioner']:.2f} of the captioner's {result['captioner_captions_per_s']:.1f} "
            f"(target >= {TARGET_SAVED_MODEL:.2f})"
            + "".join(f"\n{spec}: {o['captions_per_s']:.1f} captions/s, {o['vs_beam']:.2f} of plain beam search"
                      for spec, o in result.get("options", {}).items()))
