"""Show, Attend and Tell (Xu et al. 2015): an LSTM decoder with soft attention over the encoder's grid.

At every word the decoder looks at the image again. The encoder gives the feature map's cells
``a [B, G, D]`` (Inception v3 at 299 px: 8 × 8 = 64 cells of 2,048; ``small_cnn`` at 64 px: 4 × 4 of
128), and step *t* (reading the previous word ``y``, from the LSTM state ``h, c``)::

    e_i   = w · tanh(W a_i + U h + b) + b'        an additive attention MLP, one score per cell
    α     = softmax(e)                            the attention weights: α_i ≥ 0, Σ_i α_i = 1
    β     = sigmoid(f_β · h + b_β)                the gating scalar: how much the image counts now
    z     = β Σ_i α_i a_i                         the context vector
    h, c  = LSTM([E y ; z], (h, c))               the word embedding and the context go in together
    p(w)  = softmax(L_o (E y + L_h h + L_z z))    the paper's deep output layer

``W a_i`` is computed once per image. The initial state comes from the mean feature,
``h₀ = tanh(W_h ā + b_h)`` and ``c₀ = tanh(W_c ā + b_c)``, so there is no image step before
``<start>`` as in Show and Tell. Training adds the paper's doubly stochastic regularisation,
``λ Σ_i (1 − Σ_t α_ti)²`` per caption over its real words (``model.attention_l1`` is λ; 1 by default):
it pushes the model to look at every part of the image over the course of a caption.

The state is a dict: ``h``, ``c``, the features, their projection ``W a`` and ``mask`` (constant; beam
search repeats them per beam; the mask is 0 for the padding of regions, which no weight falls on), ``attention`` (the step's ``α [B, G]``, which beam search keeps per word) and
``coverage`` (``Σ_t α_t`` over the words read so far that are not ``<pad>``, for the regulariser).

Parameters, with embedding ``E``, LSTM ``U``, attention ``A``, feature depth ``D``, vocabulary ``V``::

    init_h, init_c          2 × (D × U + U)
    attention_features      D × A + A                 (W, b)
    attention_state         U × A                     (U, no bias)
    attention_score         A + 1                     (w, b')
    gate                    U + 1                     (f_β, b_β)
    word_embedding          V × E
    lstm                    4 × ((E + D + U) × U + U)
    output_state            U × E                     (L_h, no bias)
    output_context          D × E                     (L_z, no bias)
    logits                  E × V + V                 (L_o)

Dropout (``model.dropout``) is applied to the word embedding entering the LSTM and to the deep output
before ``L_o``. Kernels and embeddings start uniform in ±``init_scale``, biases at 0 (the LSTM's
forget-gate bias at 1). Scores, weights and logits are computed in float32 under mixed precision.
``model.decoder: attention``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import keras
import tensorflow as tf
from keras import layers

from captioning.config import ModelConfig
from captioning.config.settings import MAX_FACTOR, MAX_INIT_SCALE, MAX_WIDTH, between
from captioning.model.encoders.base import ImageEncoder
from captioning.model.base import CaptionModel, masked_mean, masked_scores
from captioning.vocab import PAD_ID


@dataclass
class AttentionSettings:
    """``model.decoder: attention``'s own keys (``model.attention_size``, ...)."""

    embedding_size: int = field(default=512, metadata=between(1, MAX_WIDTH))  # word embedding E
    lstm_units: int = field(default=512, metadata=between(1, MAX_WIDTH))  # U
    # kernels and embeddings start uniform in [-init_scale, init_scale]
    init_scale: float = field(default=0.08, metadata=between(0.0, MAX_INIT_SCALE, low_open=True))
    attention_size: int = field(default=512, metadata=between(1, MAX_WIDTH))  # the hidden size A of the attention MLP
    # λ of the doubly stochastic regularisation, λ Σ_cells (1 − Σ_words α)² per caption, added to the
    # caption's summed cross-entropy (Xu et al. 2015; 0 turns it off)
    attention_l1: float = field(default=1.0, metadata=between(0.0, MAX_FACTOR))


class ShowAttendTell(CaptionModel):
    """Encoder grid + soft-attention LSTM decoder (see the module docstring)."""

    settings_class = AttentionSettings
    tiny_settings = {"embedding_size": 16, "lstm_units": 24, "attention_size": 20}
    incompatible_keys = ("embedding_size", "lstm_units", "attention_size")
    features = "grid"
    attends = True
    # its teacher-forced pass steps word by word as decoding does: SCST differentiates through its sampling
    # (measured on the shapes: 1.34x a cross-entropy step per image that way, 1.75x with a second pass)
    fast_teacher_forcing = False
    scheduled_sampling = True  # stepping in training mode is its teacher-forced pass one word at a time

    def __init__(self, vocab_size: int, cfg: ModelConfig, encoder: ImageEncoder, seed: int = 0,
                 settings: AttentionSettings | None = None, **kwargs):
        super().__init__(**kwargs)
        self.setup(vocab_size, cfg, encoder, settings)
        s = self.settings

        def init(offset):
            return keras.initializers.RandomUniform(-s.init_scale, s.init_scale, seed=seed + offset)

        units, embedding = s.lstm_units, s.embedding_size
        # Attribute names are the checkpoints' variable paths: renaming one breaks every trained model.
        self.init_h = layers.Dense(units, activation="tanh", kernel_initializer=init(1), name="init_h")
        self.init_c = layers.Dense(units, activation="tanh", kernel_initializer=init(2), name="init_c")
        self.attention_features = layers.Dense(s.attention_size, kernel_initializer=init(3),
                                               name="attention_features")
        self.attention_state = layers.Dense(s.attention_size, use_bias=False, kernel_initializer=init(4),
                                            name="attention_state")
        self.attention_score = layers.Dense(1, kernel_initializer=init(5), name="attention_score")
        self.gate = layers.Dense(1, activation="sigmoid", kernel_initializer=init(6), name="gate")
        self.word_embedding = layers.Embedding(vocab_size, embedding, embeddings_initializer=init(7),
                                               name="word_embedding")
        self.lstm = layers.LSTMCell(units, kernel_initializer=init(8), recurrent_initializer=init(9), name="lstm")
        self.output_state = layers.Dense(embedding, use_bias=False, kernel_initializer=init(10), name="output_state")
        self.output_context = layers.Dense(embedding, use_bias=False, kernel_initializer=init(11),
                                           name="output_context")
        self.input_dropout = layers.Dropout(cfg.dropout, seed=seed + 12, name="lstm_input_dropout")
        self.output_dropout = layers.Dropout(cfg.dropout, seed=seed + 13, name="output_dropout")
        self.logits = layers.Dense(vocab_size, kernel_initializer=init(14), dtype="float32", name="logits")

    def initial_state(self, features, training=False, mask=None):
        """h₀, c₀ from the mean feature (of the real cells); the features and their attention projection,
        computed once; the mask."""
        mean = masked_mean(features, mask)
        grid = tf.shape(features)[:2]
        return {"h": self.init_h(mean), "c": self.init_c(mean), "features": features,
                "projected": self.attention_features(features),
                "mask": tf.ones(grid, tf.float32) if mask is None else tf.cast(mask, tf.float32),
                "attention": tf.zeros(grid, tf.float32), "coverage": tf.zeros(grid, tf.float32)}

    def _attend(self, state):
        """α ``[B, G]`` (float32) and the gated context ``β Σ α a`` ``[B, D]`` from ``h``."""
        hidden = tf.tanh(state["projected"] + self.attention_state(state["h"])[:, None, :])
        # scored as a 2-D matmul: a Dense over [B, G, A] is a tensordot, whose gradient XLA cannot compile
        # inside a loop (train.jit_compile)
        flat = self.attention_score(tf.reshape(hidden, [-1, hidden.shape[-1]]))
        scores = tf.reshape(tf.cast(flat, tf.float32), tf.shape(hidden)[:2])
        alpha = tf.nn.softmax(masked_scores(scores, state["mask"]), axis=-1)
        features = state["features"]
        context = tf.reduce_sum(tf.expand_dims(tf.cast(alpha, features.dtype), -1) * features, axis=1)
        return alpha, self.gate(state["h"]) * tf.cast(context, self.gate.compute_dtype)

    def _recur(self, words, token_ids, state, training):
        """The recurrent part of one step (embedded ``words [B, E]``): the new state and the context."""
        alpha, context = self._attend(state)
        lstm_in = tf.concat([self.input_dropout(words, training=training), tf.cast(context, words.dtype)], axis=-1)
        h, (h, c) = self.lstm(lstm_in, [state["h"], state["c"]], training=training)
        real = tf.cast(tf.not_equal(token_ids, PAD_ID), tf.float32)[:, None]  # <pad> steps do not count
        return {**state, "h": h, "c": c, "attention": alpha, "coverage": state["coverage"] + alpha * real}, context

    def _output(self, words, h, context, training):
        """The deep output layer: logits (float32) from ``E y + L_h h + L_z z`` (any leading shape)."""
        deep = words + self.output_state(h) + self.output_context(tf.cast(context, h.dtype))
        return self.logits(self.output_dropout(deep, training=training))

    def step(self, token_ids, state, training=False):
        """One decoding step; the new state's ``attention`` holds the weights the word was chosen with."""
        words = self.word_embedding(token_ids)
        state, context = self._recur(words, token_ids, state, training=training)
        return self._output(words, state["h"], context, training=training), state

    def teacher_forced(self, state, input_ids, training=False):
        """The caption word by word (a ``tf.while_loop`` over its steps); the output layer runs once over
        all steps afterwards."""
        words = self.word_embedding(input_ids)  # [B, T, E]
        steps = tf.shape(input_ids)[1]
        hs = tf.TensorArray(self.lstm.compute_dtype, size=steps)
        contexts = tf.TensorArray(self.gate.compute_dtype, size=steps)

        def body(t, state, hs, contexts):
            state, context = self._recur(words[:, t], input_ids[:, t], state, training)
            return t + 1, state, hs.write(t, state["h"]), contexts.write(t, context)

        shapes = tf.nest.map_structure(lambda s: tf.TensorShape([None]).concatenate(s.shape[1:]), state)
        _, state, hs, contexts = tf.while_loop(  # maximum_iterations: XLA (train.jit_compile) needs the bound
            lambda t, *_: t < steps, body, (tf.constant(0), state, hs, contexts), maximum_iterations=steps,
            shape_invariants=(tf.TensorShape([]), shapes, tf.TensorShape(None), tf.TensorShape(None)))
        h_all = tf.transpose(hs.stack(), [1, 0, 2])
        context_all = tf.transpose(contexts.stack(), [1, 0, 2])
        return self._output(words, h_all, context_all, training), state

    def penalty(self, state):
        """λ Σ_i (1 − Σ_t α_ti)² per caption over the real cells (the doubly stochastic regularisation)."""
        if not self.settings.attention_l1:
            return None
        return self.settings.attention_l1 * tf.reduce_sum(tf.square(1.0 - state["coverage"]) * state["mask"], axis=-1)

    def decoder_variables(self) -> list:
        return [v for layer in (self.init_h, self.init_c, self.attention_features, self.attention_state,
                                self.attention_score, self.gate, self.word_embedding, self.lstm,
                                self.output_state, self.output_context, self.logits)
                for v in layer.weights]
