"""``benchmark decode`` on a ``prefix_lm`` model: this project's cached decoding against keras-hub's own
``CausalLM.generate`` on the same backbone (``keras_hub_generate`` in the JSON).

The same work on both sides: greedy decoding after a prompt of ``prompt_length`` tokens, ``new_tokens`` tokens
generated for every row (no row stops early: keras-hub's generate is given no stop token, ours bans ``<end>``
until ``new_tokens`` words, ``decode.min_length``), for a batch of 1 and of 32. ``same_tokens``: all four calls
below chose the same tokens, up to the first end (or other special) token keras-hub chose, where ours, which may not
end yet, parts from it by design. Both read the prompt once (the prefill: ``prompt_length`` positions) and then one
position a step from their key/value cache.

* **keras-hub**: the backbone's own task (``GPT2CausalLM`` for a ``GPT2Backbone``: the class named after the
  backbone's) over the very backbone object the model holds, without a preprocessor, compiled with
  ``sampler="greedy"``, fed ``{"token_ids", "padding_mask"}`` of ``prompt_length + new_tokens`` columns with the
  prompt in front. Compiled twice: with XLA (``jit_compile=True``: what keras-hub's default ``"auto"`` gives on a
  GPU or TPU) and without (what ``"auto"`` gives on a machine with only CPUs, where Keras turns XLA off;
  ``keras_hub_default_xla`` records which one the default chose here).
* **this project**: the one word-by-word loop (:func:`captioning.model.search_loop.search`) with the
  :class:`~captioning.model.greedy.Greedy` strategy over :class:`~captioning.model.prefix_lm.PrefixLM`'s
  ``step``, from the state :meth:`~captioning.model.prefix_lm.PrefixLM.initial_state` makes of a prefix — here the
  prompt's embedded tokens stand for the prefix, so both read the same vectors —, in one ``tf.function`` of any
  batch size, as ``caption``, ``evaluate`` and the SavedModel run it: with ``decode.jit_compile`` (the state
  read from the prefix and the search, one program XLA compiles, as the :class:`~captioning.inference.Captioner`
  compiles them) and without (the default).

Tokens/s is ``batch × new_tokens`` over the best of ``rounds`` timed calls (each call compiled and warmed first, the
four timed in turn). ``xla`` pairs the two compiled by XLA, ``no_xla`` the two without; ``ratio`` (ours over
keras-hub's) is the ``xla`` pair's, each side at its fastest: at least 1.0 is the goal (``target``)."""

from __future__ import annotations

import logging
import time

import numpy as np

from captioning.errors import InputError
from captioning.model.prefix_lm import OFFSET

log = logging.getLogger("captioning.benchmark")

BATCHES = (1, 32)
TARGET_RATIO = 1.0


def _task(backbone, jit_compile):
    """keras-hub's causal-LM task of ``backbone``'s family, over that backbone (no preprocessor), its ``generate``
    compiled with ``jit_compile`` (True, False or keras' ``"auto"``)."""
    import keras_hub

    name = type(backbone).__name__.replace("Backbone", "CausalLM")
    cls = getattr(keras_hub.models, name, None)
    if cls is None:
        raise InputError(f"keras-hub has no {name} to compare {type(backbone).__name__} with")
    task = cls(backbone=backbone, preprocessor=None)
    task.compile(sampler="greedy", jit_compile=jit_compile)
    return task


def _best(call, rounds: int) -> float:
    best = float("inf")
    for _ in range(rounds):
        start = time.perf_counter()
        call()
        best = min(best, time.perf_counter() - start)
    return best


def _ours(model, prompt_length: int, new_tokens: int, jit_compile: bool):
    """Our greedy search after a prompt (LM ids ``[B, prompt_length]``, any ``B``): a compiled function of the
    prompt returning the chosen words, traced once and called with every batch's prompt, as the captioner's is."""
    import tensorflow as tf

    from captioning.model.greedy import Greedy
    from captioning.model.search_loop import search

    def captions(prefix):  # as the Captioner's: the state read from the prefix, then the search (one XLA program)
        strategy = Greedy(model, new_tokens, min_length=new_tokens)
        return search(model, model.state_before_start(prefix), strategy, new_tokens)[0]

    compiled = tf.function(captions, jit_compile=True, autograph=False) if jit_compile else captions

    @tf.function(autograph=False,
                 input_signature=[tf.TensorSpec([None, prompt_length], tf.int32)])  # as the captioner's: any batch
    def call(ids):
        return compiled(tf.cast(model.lm.embed(ids), model.backbone.compute_dtype))  # (the encoder's features)

    return call


def _same_tokens(ours: np.ndarray, theirs: np.ndarray, special: np.ndarray) -> bool:
    """Whether both chose the same tokens up to each row's first special token keras-hub chose (its end token: ours
    never proposes one before ``new_tokens``, so the two part there by design)."""
    for a, b in zip(ours, theirs):
        stop = next((i for i, token in enumerate(b) if token < len(special) and special[token]), len(b))
        if not np.array_equal(a[:stop], b[:stop]):
            return False
    return True


def against_keras_hub(model, prompt_length: int = 16, new_tokens: int = 32, rounds: int = 3,
                      batches=BATCHES) -> dict:
    """Tokens/s of keras-hub's ``generate`` and of this project's search on ``model``'s backbone (module docstring)."""
    import tensorflow as tf

    if not hasattr(model, "lm") or not hasattr(model, "backbone"):
        raise InputError("the comparison with keras-hub's generate needs a model.decoder: prefix_lm model")
    tasks = {xla: _task(model.backbone, xla) for xla in (True, False)}
    searches = {xla: _ours(model, prompt_length, new_tokens, xla) for xla in (True, False)}  # traced once: any batch
    rng = np.random.default_rng(0)
    end = int(model.end_token)
    out = {"prompt_length": prompt_length, "new_tokens": new_tokens, "backbone": type(model.backbone).__name__,
           "keras_hub_default_xla": bool(_task(model.backbone, "auto").jit_compile)}
    for batch in batches:
        ids = rng.integers(0, model.lm.vocabulary_size, (batch, prompt_length)).astype("int32")
        ids[ids == end] = (end + 1) % model.lm.vocabulary_size
        total = prompt_length + new_tokens
        inputs = {"token_ids": tf.constant(np.pad(ids, [[0, 0], [0, new_tokens]])),
                  "padding_mask": tf.constant(np.arange(total)[None].repeat(batch, 0) < prompt_length)}
        calls = {}
        for xla, pair in ((True, "xla"), (False, "no_xla")):
            calls[pair, "keras_hub"] = lambda task=tasks[xla]: task.generate(inputs, stop_token_ids=None)
            calls[pair, "ours"] = lambda search=searches[xla], prompt=tf.constant(ids): search(prompt)
        chosen = {key: f() for key, f in calls.items()}  # compiled and warmed
        special = model.special.numpy()
        same = all(_same_tokens(np.asarray(chosen[pair, "ours"]["ids"]).reshape(batch, -1)[:, :new_tokens] - OFFSET,
                                np.asarray(chosen[pair, "keras_hub"]["token_ids"])[:, prompt_length:], special)
                   for pair in ("xla", "no_xla")) and np.array_equal(
            np.asarray(chosen["xla", "ours"]["ids"]), np.asarray(chosen["no_xla", "ours"]["ids"]))
        times = {key: [] for key in calls}
        for _ in range(rounds):  # in turn
            for key, f in calls.items():
                times[key].append(_best(f, 1))
        rates = {key: batch * new_tokens / min(t) for key, t in times.items()}
        entry = {"same_tokens": same}
        for pair in ("xla", "no_xla"):
            theirs, ours = rates[pair, "keras_hub"], rates[pair, "ours"]
            entry[pair] = {"keras_hub_tokens_per_s": theirs, "ours_tokens_per_s": ours, "ratio": ours / theirs}
            log.info("greedy, batch %d, %d + %d tokens, %s: keras-hub generate %.0f tokens/s, ours %.0f: %.2fx",
                     batch, prompt_length, new_tokens, pair.replace("_", " "), theirs, ours, ours / theirs)
        entry.update(entry["xla"])
        log.info("the same tokens: %s", same)
        out[f"batch_{batch}"] = entry
    out["target"] = [TARGET_RATIO, all(out[f"batch_{b}"]["ratio"] >= TARGET_RATIO for b in batches)]
    return out


def summary(result: dict | None) -> str:
    """The comparison's lines of ``benchmark decode``'s summary ("" without one)."""
    if not result:
        return ""
    return "".join(f"\ngreedy {result['prompt_length']} + {result['new_tokens']} tokens, batch {key[6:]}, both "
                   f"compiled by XLA: {r['ours_tokens_per_s']:.0f} tokens/s against keras-hub's generate "
                   f"{r['keras_hub_tokens_per_s']:.0f}: {r['ratio']:.2f}x (target >= {TARGET_RATIO:.1f}x); without XLA: "
                   f"{r['no_xla']['ours_tokens_per_s']:.0f} against {r['no_xla']['keras_hub_tokens_per_s']:.0f}: "
                   f"{r['no_xla']['ratio']:.2f}x (the same tokens: {r['same_tokens']})"
                   for key, r in result.items() if key.startswith("batch_"))
