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

``keras_hub_generate`` (a ``model.decoder: prefix_lm`` model): its cached greedy decoding against keras-hub's own
``CausalLM.generate`` on the same backbone, batch 1 and 32 (:mod:`captioning.benchmarks.decode_lm`); None for
other decoders.

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
same batch: ``images`` (JPEG decode and crop), ``encoder``, ``search`` (the search from the encoder's features) and,
inside the search, ``decoder_steps`` (the decoder's own steps for ``batch × rows`` rows — a beam's, one row per image
for greedy decoding, the samples' —, without the search's choosing and reordering: the one word-by-word loop with
the :class:`captioning.model.search_loop.DecoderSteps` strategy). The floor runs exactly as many steps as the search
ran on that batch (``steps_ran``: both counts; a trained model's search stops once no step can change its captions,
long before ``max_length``, while an untrained model's rarely does): a ``search_overhead`` below 1.0 is a bug in
the floor. ``search_overhead`` is the median of the ratios of a search call to the decoder-steps call timed right after
it (``rounds`` × 10 pairs): the fastest of each alone (``batched_parts_ms``) can come from different moments of a
busy machine. Each of the floor's steps is fed
``<start>`` once the previous step's logits are computed (a comparison on them, not a choice), because a search's
next step waits for its words: fed ``<start>`` without waiting, as before 2026-11-26, a step's vocabulary projection
ran on the second core beside the next step, which no search can do (Show and Tell, 128 images, 20 steps: 14.6 ms
without the wait, 21.8 ms with it, 2 cores). Measure it on a trained model (``--model-dir``).
"""

from __future__ import annotations

import io
import logging

import numpy as np

from captioning.benchmarks import common, decode_lm
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
    from captioning.experiment import load
    from captioning.model.folder import TrainedModel
    from captioning.vocab import RESERVED, Vocabulary

    defaults = ["data.image_size=32", "data.resize_size=36", "model.encoder=small_cnn", "model.dropout=0",
                "model.embedding_size=256", "model.lstm_units=256"] if config is None else []
    experiment = load(config, overrides, defaults=defaults)  # the LSTM's sizes unread by a Transformer
    if experiment.tokenizer_kind == "words":
        vocab = Vocabulary(list(RESERVED) + [f"w{i}" for i in range(vocab_size - len(RESERVED))])
    else:  # a language model's own tokenizer (prefix_lm)
        vocab = experiment.tokenizer
    model = experiment.build_model(len(vocab), seed=0).build_all()
    return TrainedModel(model, experiment.config, vocab, step=0, checkpoint="(untrained)", model_dir="")


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
    from captioning import inference

    _check_arguments(model_dir, batch_size, images, config, overrides, ensemble_with)
    trained = inference.load(model_dir) if model_dir else _untrained_model(config, tuple(overrides))
    captioner = inference.Captioner(trained, trained.config.decode.override(
        beam_size=beam_size, max_length=max_length, length_normalization=length_normalization, top_k=1))
    beam_size, max_length = captioner.settings.beam_size, captioner.settings.max_length
    data = _jpegs(images, trained.config.data.resize_size)
    log.info("decode benchmark: %s, vocabulary %d, beam %d, length %d, %d images", model_dir or "small untrained model",
             len(trained.vocab), beam_size, max_length, images)
    single = common.throughput(_calls(captioner, data, 1), _count, measure=min(images, 64), warmup=4)
    batched = common.throughput(_calls(captioner, data, batch_size), _count, measure=images, warmup=batch_size)
    log.info("single: %.1f captions/s; batched (%d per call): %.1f captions/s", single["per_s"], batch_size,
             batched["per_s"])
    options = _options_against_beam(trained, captioner, data, batch_size, decode_options, model_dir, ensemble_with,
                                     batched["per_s"])
    served = _saved_model_against_captioner(captioner, data, batch_size, images, rounds)
    log.info("the exported SavedModel in plain TensorFlow: %.1f captions/s against the captioner's %.1f: %.2f",
             served["saved_model"], served["captioner"], served["saved_model"] / served["captioner"])
    cache = _cache_against_recomputing(captioner, data, batch_size, images, rounds)
    parts, steps_ran, overhead = _batched_parts(captioner, data[:batch_size], rounds)
    log.info("a batched call in parts (ms, each alone): %s",
             ", ".join(f"{name.replace('_', ' ')} {ms:.1f}" for name, ms in parts.items()))
    kind = "greedy" if beam_size == 1 or captioner.settings.method == "greedy" else "beam"
    log.info("the search over its decoder's steps: %.2fx (target <= %.2fx), %d steps each", overhead,
             TARGET_SEARCH_OVERHEAD[kind], steps_ran["search"])
    log.info("batched with the decoder's state: %.1f captions/s; re-reading the caption at every step: %.1f "
             "captions/s padded to max_length, %.1f the words so far only", cache["cached"], cache["recomputed"],
             cache["prefix"])
    generate = None
    if getattr(trained.model, "lm", None) is not None:  # a language model decodes: against keras-hub's own generate
        generate = decode_lm.against_keras_hub(trained.model, rounds=rounds)
    return {
        "keras_hub_generate": generate,
        "batched_captions_per_s": batched["per_s"], "single_captions_per_s": single["per_s"],
        "speedup": batched["per_s"] / single["per_s"], "batched_parts_ms": parts, "search_overhead": overhead,
        "steps_ran": steps_ran, "cached_captions_per_s": cache["cached"], "recomputed_captions_per_s": cache["recomputed"],
        "cache_speedup": cache["cached"] / cache["recomputed"], "prefix_captions_per_s": cache["prefix"],
        "cache_speedup_prefix": cache["cached"] / cache["prefix"], "options": options,
        "saved_model_captions_per_s": served["saved_model"], "captioner_captions_per_s": served["captioner"],
        "saved_model_vs_captioner": served["saved_model"] / served["captioner"],
        "settings": {"model_dir": model_dir, "decoder": trained.config.model.decoder, "batch_size": batch_size,
                     "beam_size": beam_size, "method": captioner.settings.method,
                     "max_length": max_length, "vocab_size": len(trained.vocab),
                     "encoder": trained.config.model.encoder, "image_size": trained.config.data.image_size},
        "target": {"speedup": [TARGET_SPEEDUP, batched["per_s"] / single["per_s"] >= TARGET_SPEEDUP],
                   "search_overhead": [TARGET_SEARCH_OVERHEAD[kind], overhead <= TARGET_SEARCH_OVERHEAD[kind]],
                   "saved_model_vs_captioner": [TARGET_SAVED_MODEL,
                                                served["saved_model"] / served["captioner"] >= TARGET_SAVED_MODEL]},
        "machine": common.machine(),
    }


def _check_arguments(model_dir, batch_size: int, images: int, config, overrides, ensemble_with) -> None:
    """An InputError for a combination of :func:`run`'s arguments that cannot be measured."""
    if batch_size < 1 or images < batch_size:
        raise InputError("`batch_size` must be at least 1 and `images` at least `batch_size`",
                         params=("batch_size", "images"))
    if model_dir and (config or overrides):
        raise InputError("give `model_dir` or `config`/`overrides`, not both", params=("model_dir", "config", "overrides"))
    if ensemble_with and not model_dir:
        raise InputError("`ensemble_with` names the other models of an ensemble with `model_dir`: give `model_dir`",
                         params=("ensemble_with", "model_dir"))


def _calls(captioner, data: list[bytes], size: int):
    """The captioner's compiled calls on ``size`` images at a time, round the images, without end."""
    import tensorflow as tf

    while True:
        for start in range(0, len(data) - size + 1, size):
            yield captioner.decode(tf.constant(data[start:start + size]))


def _count(out) -> int:
    return int(out["ids"].shape[0])  # .shape of an eager result: the call has finished


def _options_against_beam(trained, captioner, data: list[bytes], batch_size: int, decode_options, model_dir,
                          ensemble_with, beam_per_s: float) -> dict:
    """Captions/s of each ``--option`` set and each ensemble (of ``model_dir`` and the first 1, 2, … of
    ``ensemble_with``, decoding as the first does), and its ratio to plain beam search's ``beam_per_s``: the same
    images and batch."""
    from captioning import inference

    others = [(spec, lambda s=spec: inference.Captioner(trained, captioner.settings.with_overrides(
        [part.strip() for part in s.split(",") if part.strip()]))) for spec in decode_options]
    for members in range(2, 2 + len(ensemble_with)):
        others.append((f"ensemble of {members}", lambda m=members: inference.Captioner(
            inference.load([model_dir, *ensemble_with[:m - 1]]), captioner.settings)))
    options = {}
    for spec, make in others:
        rate = common.throughput(_calls(make(), data, batch_size), _count, measure=len(data),
                                 warmup=batch_size)["per_s"]
        options[spec] = {"captions_per_s": rate, "vs_beam": rate / beam_per_s}
        log.info("%s: %.1f captions/s, %.2f of plain beam search", spec, rate, rate / beam_per_s)
    return options


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


def _batched_parts(captioner, data: list[bytes], rounds: int = ROUNDS) -> tuple[dict[str, float], dict[str, int], float]:
    """Where a batched call's time goes (module docstring): each part compiled alone and timed on the same batch, the
    fastest of its calls after one that traces (``images`` and ``encoder`` ``rounds`` × 3 calls); the steps each of
    the search and its decoder's own steps ran (``{"search": …, "decoder_steps": …}``: the same); and the search's
    overhead, the median of ``rounds`` × 10 ratios of a search call to the decoder-steps call right after it (a burst
    of other work on the machine lowers one pair, and the median ignores it, where the fastest of each alone can come
    from different moments of a busy machine)."""
    import statistics
    import time

    import tensorflow as tf

    from captioning.data.reading import model_input
    from captioning.model.decode import generate_counted
    from captioning.model.search_loop import DecoderSteps, search

    model, settings, preprocessor = captioner.trained.model, captioner.settings, captioner.trained.preprocessor
    jpegs = tf.constant(data)
    crop = tf.function(lambda b: tf.map_fn(lambda e: model_input(e, preprocessor), b, fn_output_signature=tf.TensorSpec(
        [preprocessor.image_size, preprocessor.image_size, 3], tf.uint8)), autograph=False)
    encode = tf.function(lambda images: model.encode(images), autograph=False)
    rows_per_image = []

    def searched(features):
        captions, ran, rows = generate_counted(model, model.initial_state(features), settings, captioner.bad_endings,
                                               words=captioner.words)
        rows_per_image.append(rows)
        return captions["ids"], ran

    search_call = tf.function(searched, autograph=False)
    crops = crop(jpegs)
    features = encode(crops)
    search_steps = int(search_call(features)[1])  # (traces)
    floor = DecoderSteps(rows_per_image[0], model.vocab_size)  # as many rows per image as the search steps
    steps_call = tf.function(lambda features, steps: search(model, model.initial_state(features), floor,
                                                            settings.max_length, steps), autograph=False)
    steps_of_floor = int(steps_call(features, tf.constant(search_steps))[1])
    parts = {"images": (crop, (jpegs,)), "encoder": (encode, (crops,)), "search": (search_call, (features,)),
             "decoder_steps": (steps_call, (features, tf.constant(search_steps)))}
    times = {name: [] for name in parts}
    for call_round in range(10 * rounds):
        for name, (call, arguments) in parts.items():
            if name in ("images", "encoder") and call_round >= 3 * rounds:
                continue
            start = time.perf_counter()
            tf.nest.map_structure(lambda x: x.numpy(), call(*arguments))
            times[name].append(time.perf_counter() - start)
    overhead = statistics.median(searched_s / steps_s for searched_s, steps_s in zip(times["search"],
                                                                                      times["decoder_steps"]))
    return ({name: 1000 * min(spent) for name, spent in times.items()},
            {"search": search_steps, "decoder_steps": steps_of_floor}, overhead)


def _cache_against_recomputing(captioner, data: list[bytes], batch_size: int, images: int,
                               rounds: int = ROUNDS) -> dict:
    """Captions/s of batched beam search on the model (``cached``), on :class:`PrefixRecomputer` of it
    (``recomputed``) and on :class:`GrowingPrefix` of it (``prefix``): no attention weights kept by any, the
    same images, crops computed once; timed in turn, :data:`ROUNDS` rounds (``rounds``), the best of each."""
    import tensorflow as tf

    from captioning.data.reading import model_input
    from captioning.model.decode import generate

    model, settings, preprocessor = captioner.trained.model, captioner.settings, captioner.trained.preprocessor
    crops = tf.map_fn(tf.autograph.experimental.do_not_convert(lambda e: model_input(e, preprocessor)),
                      tf.constant(data[:batch_size]),
                      fn_output_signature=tf.TensorSpec([preprocessor.image_size] * 2 + [3], tf.uint8))

    class Plain:  # the model itself, without keeping its attention weights: the same work as the other
        attends, vocab_size = False, model.vocab_size
        initial_state, reserve, step = model.initial_state, model.reserve, model.step

    searches = {}
    for name, decoder in (("cached", Plain()), ("recomputed", PrefixRecomputer(model, settings.max_length)),
                          ("prefix", GrowingPrefix(model, settings.max_length))):
        searches[name] = tf.function(lambda images, d=decoder: generate(
            d, d.initial_state(model.encode(images)), settings, captioner.bad_endings, words=captioner.words)["ids"],
            autograph=False)
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
            f"{result['target']['search_overhead'][0]:.2f}x), {result['steps_ran']['search']} steps, its decoder's "
            f"own {result['steps_ran']['decoder_steps']}"
            f"\n{result['settings']['decoder']}: stepping with its state {result['cached_captions_per_s']:.1f} captions/s, "
            f"re-reading the caption at every step, padded to max_length {result['recomputed_captions_per_s']:.1f}: "
            f"{result['cache_speedup']:.1f}x; the words so far only {result['prefix_captions_per_s']:.1f}: "
            f"{result['cache_speedup_prefix']:.1f}x"
            f"\nthe exported SavedModel in plain TensorFlow: {result['saved_model_captions_per_s']:.1f} captions/s, "
            f"{result['saved_model_vs_captioner']:.2f} of the captioner's {result['captioner_captions_per_s']:.1f} "
            f"(target >= {TARGET_SAVED_MODEL:.2f})"
            + "".join(f"\n{spec}: {o['captions_per_s']:.1f} captions/s, {o['vs_beam']:.2f} of plain beam search"
                      for spec, o in result.get("options", {}).items())
            + decode_lm.summary(result.get("keras_hub_generate")))
