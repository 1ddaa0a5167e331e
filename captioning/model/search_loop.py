"""The one word-by-word loop every caption search runs (:func:`search`), and the strategies' interface
(:class:`Strategy`): the loop steps the decoder, a strategy chooses the next words. Beam search and diverse beams
(:class:`captioning.model.beams.BeamSearch`), greedy decoding (:class:`captioning.model.greedy.Greedy`), sampling
(:class:`captioning.model.sampling.Sampling`), SCST's draws (:class:`captioning.model.sampling.GivenDraws`) and the
decoder's own steps that ``benchmark decode`` measures a search against (:class:`DecoderSteps`) are its strategies,
as keras-hub's samplers are one ``Sampler`` loop with a ``get_next_token`` each.

**The inference contract**: what a decoder (a :class:`captioning.model.base.CaptionModel`, an
:class:`captioning.model.ensemble.Ensemble`, or any object with these four) gives the loop:

* ``vocab_size``: the number of word ids (the logits' last axis);
* ``attends``: whether ``step``'s state is a dict whose ``attention`` entry ``[rows, G]`` holds the weights the
  step just took (the strategies keep them per word);
* ``reserve(state, steps)``: the state readied for ``steps`` calls of ``step`` (room for a cache of keys and values);
* ``step(token_ids [rows] int32, state) -> (logits [rows, V], state)``: one word more for every row. The state is
  any nest of row-major tensors whose rows are independent: the loop repeats every tensor for a strategy's rows per
  image and gathers rows when a strategy reorders them (beam search), so any decoder works unchanged.

The loop runs inside TensorFlow (a ``tf.while_loop``: wrap a search in ``tf.function``) for a whole batch at once;
each step feeds the words the strategy chose at the step before (``<start>`` first). A strategy may stop the loop
before ``max_length`` steps once no later step can change its result; the test reads the strategy's answer of the
step before last, so that a step need not wait for it (at most one step runs after the answer turned), and it sits
in the loop's condition, not in a ``break``: a break puts the step inside a conditional, and a LiteRT file then
carries the decoder's weights as unquantized operands of it. A first step apart from the loop would copy the
decoder's step, and its weights into a LiteRT file, twice: one loop runs every step."""

from __future__ import annotations

import tensorflow as tf

from captioning.model.search_tools import one_loop
from captioning.vocab import START_ID


class Strategy:
    """How a search chooses its words (keras-hub's ``Sampler.get_next_token``), over ``rows_per_image`` rows per image
    (a beam's live captions, an image's samples). Its own loop variables are a dict of tensors (or TensorArrays)
    that :meth:`start` makes and :meth:`next_words` returns anew; :attr:`growing` gives the shape invariants of those
    whose shape changes from step to step. A strategy object serves one search: :meth:`start` may keep tensors of the
    batch it is given (its size, the rules' masks) for the steps and :meth:`finish` to read."""

    rows_per_image: int = 1
    growing: dict = {}
    # why XLA cannot compile the strategy's search (None: it can, when nothing grows)
    not_compiled: str | None = None

    def start(self, batch, state) -> dict:
        """The strategy's loop variables before the first step, for ``batch`` images (``state``: the repeated rows')."""
        return {}

    def next_words(self, t, tokens, logits, state, chosen: dict):
        """After step ``t`` read ``tokens [rows]`` and gave ``logits [rows, V]`` (float32) and the new ``state``:
        ``(the words fed next [rows],
        the loop variables, the rows each row continues ([rows] into the rows before, or None: each its own), whether
        no later step can change the result)``."""
        raise NotImplementedError

    def finish(self, chosen: dict, ran) -> dict:
        """The captions from the last loop variables after ``ran`` steps (an int32 scalar)."""
        raise NotImplementedError


def search(model, initial_state, strategy: Strategy, max_length: int, steps=None, jit_compile: bool = False):
    """``(captions, steps ran)``: ``strategy`` run word by word from the decoder's ``initial_state`` for a batch of
    images (see the module docstring for what ``model`` must provide), at most ``max_length`` steps (or ``steps``, an
    int32 scalar: exactly that many, when the strategy never stops early).

    ``jit_compile``: the whole search (the loop, the decoder's steps, the strategy's choices) is one function XLA
    compiles (``decode.jit_compile``), a program for each batch size, called from the graph around it (the image's
    decoding and encoding stay outside). XLA needs every loop variable's shape fixed and every op of its own: a
    strategy whose :attr:`Strategy.growing` is not empty (beam search) or that says why not
    (:attr:`Strategy.not_compiled`) is refused. On one image the step of a small decoder is mostly per-op overhead,
    which XLA fuses away (``benchmark decode``'s comparison with keras-hub's generate)."""
    if jit_compile and (strategy.growing or strategy.not_compiled):
        raise ValueError(f"XLA cannot compile {type(strategy).__name__}'s search: " + (
            strategy.not_compiled or f"its loop variables {sorted(strategy.growing)} grow a step at a time"))
    state = model.reserve(initial_state, max_length)  # (the room it makes may depend on the state's values)
    if strategy.rows_per_image > 1:  # image-major, the image's rows minor
        state = tf.nest.map_structure(lambda s: tf.repeat(s, strategy.rows_per_image, axis=0), state)
    if jit_compile:
        compiled = tf.function(lambda state: _loop(model, state, strategy, max_length, steps), jit_compile=True,
                               autograph=False)
        return compiled(state)
    return _loop(model, state, strategy, max_length, steps)


def _loop(model, state, strategy: Strategy, max_length: int, steps):
    """:func:`search` from the reserved state, repeated for the strategy's rows (the batch read from its shape: XLA
    needs it fixed)."""
    rows = tf.shape(tf.nest.flatten(state)[0])[0]
    batch = rows // strategy.rows_per_image
    limit = max_length if steps is None else tf.minimum(steps, max_length)

    def one_step(loop):
        logits, state = model.step(loop["tokens"], loop["state"])
        tokens, chosen, parents, over = strategy.next_words(loop["t"], loop["tokens"], tf.cast(logits, tf.float32),
                                                            state, loop["chosen"])
        if parents is not None:  # each row goes on from the row it extends
            state = tf.nest.map_structure(lambda s: tf.gather(s, parents), state)
        return {"t": loop["t"] + 1, "over": over, "over_before": loop["over"], "state": state, "tokens": tokens,
                "chosen": chosen}

    chosen = strategy.start(batch, state)
    loop = one_loop(lambda v: (v["t"] < limit) & tf.logical_not(v["over_before"]), one_step, {
        "t": tf.constant(0), "over": tf.constant(False), "over_before": tf.constant(False), "state": state,
        "tokens": tf.fill([rows], tf.constant(START_ID, tf.int32)), "chosen": chosen},
        {"chosen": {key: strategy.growing.get(key) for key in chosen}})
    return strategy.finish(loop["chosen"], loop["t"]), loop["t"]


class DecoderSteps(Strategy):
    """The decoder's own steps, without a search (``benchmark decode``'s floor, ``decoder_steps``): every row fed
    ``<start>`` again, once the step's logits are there (a comparison on them, not a choice: a search's next step waits
    for its words, and a step fed without waiting would run its vocabulary projection on a second core beside the
    next step, which no search can do). ``rows_per_image``: as many rows as the search it is measured against steps.
    Its captions: the last step's logits ``[rows, V]``."""

    def __init__(self, rows_per_image: int, vocab_size: int):
        self.rows_per_image, self.vocab_size = rows_per_image, vocab_size

    def start(self, batch, state):
        return {"logits": tf.zeros([batch * self.rows_per_image, self.vocab_size])}

    def next_words(self, t, tokens, logits, state, chosen):
        return START_ID + tf.cast(logits[:, 0] > 1e30, tf.int32), {"logits": logits}, None, tf.constant(False)

    def finish(self, chosen, ran):
        return chosen["logits"]
