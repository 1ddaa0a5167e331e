"""The Transformer decoder (Vaswani et al. 2017), as captioning uses it: ``model.decoder: transformer``.

The encoder's grid ``[B, cells, D]`` is projected to ``d_model``, given a learned embedding per cell (the
cells' positions: captions say "left of", "above"), and refined by ``encoder_layers`` of self-attention
and feed-forward; that is the *memory*. Each of ``decoder_layers`` layers then runs, over the words so
far, causal self-attention, cross-attention over the memory, and a feed-forward block, each wrapped in a
residual connection with layer normalisation before (``norm: pre``, the default, as self-critical.pytorch's
Transformer) or after it (``post``, the paper's). Words enter as embeddings scaled by √d_model plus their
positions (``positions: sinusoidal`` or ``learned``, up to ``max_positions`` words); the output is a
linear layer to the vocabulary, in float32. Every attention is a :class:`keras.layers.MultiHeadAttention`
(its projections; :class:`CachedAttention` adds the cache), every normalisation a
:class:`keras.layers.LayerNormalization`.

**Incremental decoding.** A word attends to the keys and values of the words before it, which do not
change once computed, so the state caches them: per decoder layer, ``k<l>`` and ``v<l>`` ``[B, S, heads,
key_size]`` and ``t`` ``[B]``, the words cached so far. :meth:`Transformer.reserve` allocates room for
``S`` words (beam search and sampling call it with their ``max_length``), :meth:`Transformer.step` writes
the new word's keys and values at ``t`` and attends over the cache (masked after ``t``): one word's
projections per step instead of the whole prefix's; a step with no reserved slot left is an error.
:meth:`Transformer.teacher_forced` computes any number of words at once from any state, writing their keys
and values at slots ``t`` on (from the initial state: ordinary causal self-attention; after a first piece of
the caption: the rest of it, which is how split padding continues; on a state :meth:`Transformer.reserve`
sized: into the reserved slots), so slot ``i`` always holds word ``i`` and stepping word by word, or on from
a teacher-forced piece, equals the teacher-forced pass (the contract tests: 1e-5). Positions go up to
``max_positions − 1``: :meth:`Transformer.max_caption_length` is ``max_positions`` words, and
``decode.max_length`` and ``scst.max_length`` above it are refused before a command starts.
The memory's keys and values for cross-attention are projected once, in the initial state (``mk<l>``,
``mv<l>``).

**Attention shown**: the state's ``attention`` is the cross-attention weights over the cells of the
layer ``attention_layer`` (1 for the first, 0 for the last: the default), averaged over heads, of the
last word read — what beam search keeps per word, ``caption --html`` draws and grounding measures.

Parameters, with ``d = d_model``, ``f = ff_size``, feature depth ``D``, vocabulary ``V``, cells ``G``::

    features (projection)    D × d + d;  cell positions  G × d
    encoder layer            attention 4 (d × d + d) + feed-forward 2 d f + f + d + 2 layer norms 4 d
    decoder layer            2 attentions 8 (d × d + d) + feed-forward + 3 layer norms 6 d
    words                    V × d (+ max_positions × d, learned positions);  output  d × V + V
    final layer norms        2 d each for the encoder and the decoder (pre-norm only)

Dropout (``model.dropout``) on the embeddings, after each attention and feed-forward block and on the
attention weights. Settings: :class:`TransformerSettings` (``model.d_model``, ``model.heads``, ...).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import keras
import numpy as np
import tensorflow as tf
from keras import layers

from captioning.config import ModelConfig
from captioning.config.settings import MAX_HEADS, MAX_LAYERS, MAX_POSITIONS, MAX_WIDTH, between, choices
from captioning.errors import InputError
from captioning.model.encoders.base import ImageEncoder
from captioning.model.base import CaptionModel


@dataclass
class TransformerSettings:
    """``model.decoder: transformer``'s own keys."""

    d_model: int = field(default=512, metadata=between(1, MAX_WIDTH))  # the width of every layer
    heads: int = field(default=8, metadata=between(1, MAX_HEADS))  # attention heads; they must divide d_model
    ff_size: int = field(default=2048, metadata=between(1, 4 * MAX_WIDTH))  # the feed-forward blocks' inner width
    # refining the grid (0: its projection only)
    encoder_layers: int = field(default=6, metadata=between(0, MAX_LAYERS))
    decoder_layers: int = field(default=6, metadata=between(1, MAX_LAYERS))
    # pre: layer norm before each block (and one at the end: stable without warm-up tricks); post: after
    norm: str = field(default="pre", metadata=choices("pre", "post"))
    positions: str = field(default="sinusoidal", metadata=choices("sinusoidal", "learned"))
    # the longest caption decoded, in words (decode.max_length and scst.max_length may not be more)
    max_positions: int = field(default=64, metadata=between(2, MAX_POSITIONS))
    # the decoder layer whose cross-attention is shown (caption, export, pictures, grounding): 1 is the
    # first, 0 the last
    attention_layer: int = field(default=0, metadata=between(0, MAX_LAYERS))

    def check(self, prefix: str = "model.") -> None:
        if self.d_model % self.heads:
            raise InputError(f"{prefix}d_model ({self.d_model}) must be a multiple of {prefix}heads ({self.heads})")
        if self.attention_layer > self.decoder_layers:
            raise InputError(f"{prefix}attention_layer ({self.attention_layer}) names no layer: there are "
                             f"{prefix}decoder_layers={self.decoder_layers} (0: the last)")


class CachedAttention(layers.MultiHeadAttention):
    """Keras' multi-head attention, with its key and value projections usable apart: projected once and
    cached, then attended over by any number of queries. The arithmetic is the layer's own (scaled dot
    product, softmax over the keys — in float32 under mixed precision —, dropout on the weights)."""

    def project(self, value):
        """Keys and values ``[B, S, heads, key_size]`` of ``value`` ``[B, S, d]``."""
        return self.key_dense(value), self.value_dense(value)

    def attend(self, query, keys, values, mask, training=False):
        """``query [B, T, d]`` over ``keys``/``values`` ``[B, S, heads, key_size]`` where ``mask [B, T, S]``
        (or broadcastable) is true: (output ``[B, T, d]``, weights ``[B, heads, T, S]`` in float32)."""
        q = self.query_dense(query)
        scores = tf.einsum("bsnh,btnh->bnts", tf.cast(keys, tf.float32), tf.cast(q, tf.float32))
        scores = scores / math.sqrt(self.key_dim) + (1.0 - tf.cast(mask, tf.float32)[:, None]) * -1e9
        weights = tf.nn.softmax(scores, axis=-1)
        dropped = self._dropout_layer(weights, training=training) if self.dropout else weights
        out = tf.einsum("bnts,bsnh->btnh", tf.cast(dropped, values.dtype), values)
        return self.output_dense(out), weights


def _sinusoids(length: int, width: int) -> np.ndarray:
    """The paper's position encodings ``[length, width]``: sin and cos of position / 10000^(2i / width)."""
    position = np.arange(length)[:, None]
    rates = 1.0 / np.power(10000.0, (2 * (np.arange(width) // 2)) / width)
    angles = position * rates[None, :]
    return np.where(np.arange(width) % 2 == 0, np.sin(angles), np.cos(angles)).astype(np.float32)


class _Block(layers.Layer):
    """One residual block — ``x + dropout(f(norm(x)))`` (pre) or ``norm(x + dropout(f(x)))`` (post)."""

    def __init__(self, pre: bool, dropout: float, seed: int, **kwargs):
        super().__init__(**kwargs)
        self.pre = pre
        self.norm = layers.LayerNormalization(epsilon=1e-6, name="norm")
        self.drop = layers.Dropout(dropout, seed=seed, name="dropout")

    def inner(self, x):
        return self.norm(x) if self.pre else x

    def outer(self, x, update, training):
        y = x + self.drop(update, training=training)
        return y if self.pre else self.norm(y)


class _FeedForward(_Block):
    def __init__(self, d_model: int, ff_size: int, pre: bool, dropout: float, seed: int, init, **kwargs):
        super().__init__(pre, dropout, seed, **kwargs)
        self.inside = layers.Dense(ff_size, activation="relu", kernel_initializer=init, name="inside")
        self.out = layers.Dense(d_model, kernel_initializer=init, name="out")

    def call(self, x, training=False):
        return self.outer(x, self.out(self.inside(self.inner(x))), training)


class Transformer(CaptionModel):
    """Grid features → Transformer encoder → memory; words → Transformer decoder (module docstring)."""

    settings_class = TransformerSettings
    # (max_positions too, with learned positions: the restore's shape check refuses that checkpoint)
    incompatible_keys = ("d_model", "heads", "ff_size", "encoder_layers", "decoder_layers", "positions")
    features = "grid"
    attends = True
    tiny_settings = {"d_model": 16, "heads": 2, "ff_size": 24, "encoder_layers": 1, "decoder_layers": 2}
    caption_length_setting = "max_positions"

    @classmethod
    def max_caption_length(cls, settings) -> int:
        """``max_positions``: decoding ``n`` words reads positions 0 (``<start>``) to ``n − 1``."""
        return settings.max_positions

    def __init__(self, vocab_size: int, cfg: ModelConfig, encoder: ImageEncoder, seed: int = 0,
                 settings: TransformerSettings | None = None, **kwargs):
        super().__init__(**kwargs)
        self.setup(vocab_size, cfg, encoder, settings)
        s = self.settings
        d, pre, rate = s.d_model, s.norm == "pre", cfg.dropout
        self.key_size = d // s.heads

        def init(offset):  # seeded: the same seed gives the same model
            return keras.initializers.GlorotUniform(seed=seed + 1000 + offset)

        def uniform(offset):
            return keras.initializers.RandomUniform(-0.05, 0.05, seed=seed + 2000 + offset)

        def attention(name, offset):
            mha = CachedAttention(s.heads, self.key_size, dropout=rate, seed=seed + offset, name=name,
                                  kernel_initializer=init(offset))
            mha.build((None, None, d), (None, None, d))  # its projections exist before the first call
            return mha

        # Attribute names are the checkpoints' variable paths: renaming one breaks every trained model. The
        # layers of each stack are attributes of their own (``self_attention_0``, ...): TF checkpoints do
        # not follow Keras' tracked lists.
        self.project_features = layers.Dense(d, kernel_initializer=init(0), name="project_features")
        # a grid's cells have places; regions are a set (their places are in their boxes: model.box_geometry)
        self.cell_positions = layers.Embedding(self.grid_cells, d, embeddings_initializer=uniform(0),
                                               name="cell_positions") if self.source.tokens_have_places else None
        self.memory_dropout = layers.Dropout(rate, seed=seed + 1, name="memory_dropout")
        for i in range(s.encoder_layers):
            setattr(self, f"encoder_attention_{i}", attention(f"encoder_attention_{i}", 10 + i))
            setattr(self, f"encoder_attention_block_{i}", _Block(pre, rate, seed + 20 + i,
                                                                name=f"encoder_attention_block_{i}"))
            setattr(self, f"encoder_ff_{i}", _FeedForward(d, s.ff_size, pre, rate, seed + 30 + i,
                                                          init(30 + i), name=f"encoder_ff_{i}"))
        self.encoder_norm = layers.LayerNormalization(epsilon=1e-6, name="encoder_norm") if pre else None
        self.word_embedding = layers.Embedding(vocab_size, d, embeddings_initializer=uniform(1), name="word_embedding")
        self.word_positions = layers.Embedding(s.max_positions, d, embeddings_initializer=uniform(2),
                                               name="word_positions") if s.positions == "learned" else None
        self.sinusoids = tf.constant(_sinusoids(s.max_positions, d))
        self.word_dropout = layers.Dropout(rate, seed=seed + 2, name="word_dropout")
        n = s.decoder_layers
        for i in range(n):
            setattr(self, f"self_attention_{i}", attention(f"self_attention_{i}", 40 + i))
            setattr(self, f"self_block_{i}", _Block(pre, rate, seed + 50 + i, name=f"self_block_{i}"))
            setattr(self, f"cross_attention_{i}", attention(f"cross_attention_{i}", 60 + i))
            setattr(self, f"cross_block_{i}", _Block(pre, rate, seed + 70 + i, name=f"cross_block_{i}"))
            setattr(self, f"ff_{i}", _FeedForward(d, s.ff_size, pre, rate, seed + 80 + i, init(80 + i), name=f"ff_{i}"))
        self.decoder_norm = layers.LayerNormalization(epsilon=1e-6, name="decoder_norm") if pre else None
        self.logits = layers.Dense(vocab_size, kernel_initializer=init(99), dtype="float32", name="logits")
        self.shown = (s.attention_layer or n) - 1  # the layer whose cross-attention is shown

    # ---- the memory --------------------------------------------------------------------------------
    def initial_state(self, features, training=False, mask=None):
        """The memory (the refined grid, or regions: padding masked out everywhere), each decoder layer's
        cross-attention keys and values of it, and an empty self-attention cache."""
        x = self.project_features(features)
        if self.cell_positions is not None:
            x = x + self.cell_positions(tf.range(tf.shape(features)[1]))[None]
        x = self.memory_dropout(x, training=training)
        mask = tf.ones(tf.shape(x)[:2]) if mask is None else tf.cast(mask, tf.float32)
        everywhere = mask[:, None, :]  # [B, 1, G]: the cells (real regions) each cell may attend to
        for i in range(self.settings.encoder_layers):
            mha, block, ff = (getattr(self, f"{kind}_{i}") for kind in ("encoder_attention", "encoder_attention_block",
                                                                        "encoder_ff"))
            inner = block.inner(x)
            keys, values = mha.project(inner)
            update, _ = mha.attend(inner, keys, values, everywhere, training)
            x = ff(block.outer(x, update, training), training=training)
        memory = self.encoder_norm(x) if self.encoder_norm is not None else x
        rows, cells = tf.shape(memory)[0], tf.shape(memory)[1]
        state = {"t": tf.zeros([rows], tf.int32), "attention": tf.zeros([rows, cells], tf.float32),
                 "memory_mask": mask}
        empty = tf.zeros([rows, 0, self.settings.heads, self.key_size], self.compute_dtype)
        for i in range(self.settings.decoder_layers):
            state[f"mk{i}"], state[f"mv{i}"] = getattr(self, f"cross_attention_{i}").project(memory)
            state[f"k{i}"], state[f"v{i}"] = empty, empty
        return state

    def reserve(self, state, steps):
        """Room for ``steps`` more words' keys and values after the ``t`` cached (zeros, masked)."""
        room = tf.maximum(tf.reduce_max(state["t"]) + steps - tf.shape(state["k0"])[1], 0)
        padded = {k: tf.pad(v, [[0, 0], [0, room], [0, 0], [0, 0]]) for k, v in state.items()
                  if k[0] in "kv" and k[1:].isdigit()}
        return {**state, **padded}

    # ---- the words ---------------------------------------------------------------------------------
    def _embed(self, input_ids, start, training):
        """Word embeddings × √d_model plus the positions ``start + [0, T)`` ``[B, T, d]``."""
        positions = start[:, None] + tf.range(tf.shape(input_ids)[1])[None, :]
        positions = tf.minimum(positions, self.settings.max_positions - 1)
        words = self.word_embedding(input_ids) * tf.cast(math.sqrt(self.settings.d_model), self.compute_dtype)
        if self.word_positions is not None:
            place = self.word_positions(positions)
        else:
            place = tf.cast(tf.gather(self.sinusoids, positions), self.compute_dtype)
        return self.word_dropout(words + place, training=training)

    def _decode(self, x, state, visible, write, training):
        """The decoder layers over the words ``x [B, T, d]``: ``write(cache, new)`` puts the new words' keys
        or values into a layer's cache, ``visible [B, T, S]`` says which cached slots each word sees.
        Returns (logits ``[B, T, V]``, the new state)."""
        state = dict(state)
        memory_mask = state["memory_mask"][:, None, :]
        shown = None
        for i in range(self.settings.decoder_layers):
            attention, block = getattr(self, f"self_attention_{i}"), getattr(self, f"self_block_{i}")
            inner = block.inner(x)
            keys, values = attention.project(inner)
            state[f"k{i}"], state[f"v{i}"] = write(state[f"k{i}"], keys), write(state[f"v{i}"], values)
            update, _ = attention.attend(inner, state[f"k{i}"], state[f"v{i}"], visible, training)
            x = block.outer(x, update, training)
            attention, block = getattr(self, f"cross_attention_{i}"), getattr(self, f"cross_block_{i}")
            update, weights = attention.attend(block.inner(x), state[f"mk{i}"], state[f"mv{i}"], memory_mask, training)
            x = getattr(self, f"ff_{i}")(block.outer(x, update, training), training=training)
            if i == self.shown:
                shown = tf.reduce_mean(weights, axis=1)  # [B, T, G], heads averaged
        if self.decoder_norm is not None:
            x = self.decoder_norm(x)
        state["attention"] = shown[:, -1]
        return self.logits(x), state

    def step(self, token_ids, state):
        """One word: its keys and values written into the reserved cache at ``t``, attention over the cache up
        to ``t`` (:meth:`reserve` first: a step with no reserved slot left is an error, not a word silently
        left out of the cache)."""
        t = state["t"]
        slots = tf.shape(state["k0"])[1]
        tf.debugging.assert_less(tf.reduce_max(t), slots, message="Transformer.step: no room left in the cache for "
                                 "the word (reserve(state, steps) first, for every step taken)")
        # [B, S, 1, 1]; expand_dims, not [:, :, None, None]: LiteRT's built-in strided slice adds no axes
        at = tf.expand_dims(tf.expand_dims(tf.one_hot(t, slots, dtype=self.compute_dtype), -1), -1)

        def write(cache, new):  # new: [B, 1, heads, key_size] at slot t
            return cache * (1 - at) + new * at

        visible = tf.expand_dims(tf.range(slots)[None, :] <= t[:, None], 1)  # [B, 1, S]
        x = self._embed(token_ids[:, None], t, training=False)
        logits, state = self._decode(x, state, visible, write, training=False)
        return logits[:, 0], {**state, "t": t + 1}

    def teacher_forced(self, state, input_ids, training=False):
        """All of ``input_ids [B, T]`` at once after the ``t`` words cached: their keys and values written at
        slots ``t … t + T − 1`` (the cache grows by ``T`` slots; the slots after ``t + T`` are zeros, room a
        later :meth:`step` writes into), each word seeing the cached ones and the new ones up to itself. The
        state it returns is the one :meth:`step` would have left, so stepping on from it equals a full pass,
        whether or not :meth:`reserve` sized the cache before."""
        t = state["t"]
        cached, steps = tf.shape(state["k0"])[1], tf.shape(input_ids)[1]
        slot = tf.range(cached + steps)[None, :]  # [1, S + T]
        offset = slot - t[:, None]  # [B, S + T]: which new word slot t + offset holds
        # where each slot's keys come from in [cache ; new]: the cached words before t, the new words after them
        index = tf.minimum(tf.where(offset >= 0, cached + offset, slot), cached + steps - 1)
        used = tf.cast(offset < steps, self.compute_dtype)[:, :, None, None]  # after t + T: zeros

        def write(cache, new):
            joined = tf.concat([cache, tf.cast(new, cache.dtype)], axis=1)
            return tf.gather(joined, index, batch_dims=1) * tf.cast(used, cache.dtype)

        word = t[:, None, None] + tf.range(steps)[None, :, None]  # [B, T, 1]: each word's position
        visible = slot[:, None, :] <= word  # [B, T, S + T]
        x = self._embed(input_ids, t, training)
        logits, state = self._decode(x, state, visible, write, training)
        return logits, {**state, "t": t + steps}

    def decoder_variables(self) -> list:
        encoder = {id(v) for v in self.encoder.weights}
        return [v for v in self.weights if id(v) not in encoder]
