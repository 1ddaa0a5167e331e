"""Up-Down (Anderson et al. 2018): a top-down attention LSTM and a language LSTM over image features.

The paper attends over "bottom-up" region features; the decoder itself reads any set of feature
vectors, here the encoder's grid cells ``v [B, G, D]``. The features are first embedded,
``v_i ← ReLU(W_v v_i + b_v)`` (self-critical.pytorch's ``att_embed``, size U), and their mean ``v̄``
taken once per image. Step *t*, reading the previous word ``y``::

    h¹, c¹ = LSTM¹([h²_{t-1} ; v̄ ; E y], (h¹, c¹))     the attention LSTM: what to look at next
    a_i    = w · tanh(W_a v_i + U_a h¹) + b             one score per cell
    α      = softmax(a)                                  the attention weights over the cells
    v̂      = Σ_i α_i v_i                                 the attended feature
    h², c² = LSTM²([v̂ ; h¹], (h², c²))                  the language LSTM
    p(w)   = softmax(W_p h² + b_p)

Both LSTMs start from zeros (the image enters through ``v̄`` at every step, as in the paper). ``W_a v_i``
is computed once per image. The state is a dict: ``h1, c1, h2, c2``, the embedded features, their
mean, projection and ``mask`` (constant; beam search repeats them per beam; no weight falls where the
mask is 0, the padding of regions) and ``attention`` (the step's ``α
[B, G]``, shown and measured as the soft-attention decoder's).

Parameters, with embedding ``E``, LSTM ``U``, attention ``A``, feature depth ``D``, vocabulary ``V``::

    feature_embedding       D × U + U
    word_embedding          V × E
    attention_lstm          4 × ((U + U + E + U) × U + U)
    attention_features      U × A + A
    attention_state         U × A
    attention_score         A + 1
    language_lstm           4 × ((U + U + U) × U + U)
    logits                  U × V + V

Dropout (``model.dropout``) on the word embedding entering the attention LSTM and on ``h²`` before
the logits. Kernels and embeddings start uniform in ±``init_scale``, biases at 0 (the LSTMs'
forget-gate biases at 1). Scores, weights and logits are float32 under mixed precision.
``model.decoder: updown``; ``experiments/updown_coco.yaml`` is self-critical.pytorch's recipe.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import keras
import tensorflow as tf
from keras import layers

from captioning.config import ModelConfig
from captioning.config.settings import MAX_INIT_SCALE, MAX_WIDTH, between
from captioning.model.encoders.base import ImageEncoder
from captioning.model.base import CaptionModel, masked_mean, masked_scores


@dataclass
class UpDownSettings:
    """``model.decoder: updown``'s own keys."""

    embedding_size: int = field(default=512, metadata=between(1, MAX_WIDTH))  # word embedding E
    lstm_units: int = field(default=512, metadata=between(1, MAX_WIDTH))  # U: both LSTMs and the embedded features
    # kernels start uniform in ±init_scale
    init_scale: float = field(default=0.08, metadata=between(0.0, MAX_INIT_SCALE, low_open=True))
    attention_size: int = field(default=512, metadata=between(1, MAX_WIDTH))  # the hidden size A of the attention MLP


class UpDown(CaptionModel):
    """Encoder grid + the attention LSTM and the language LSTM (see the module docstring)."""

    settings_class = UpDownSettings
    # at ±0.08 a tiny model's two stacked LSTMs from zero states give logits of ~1e-4, too small for the
    # contract's comparisons to mean anything
    tiny_settings = {"embedding_size": 16, "lstm_units": 24, "attention_size": 20, "init_scale": 0.3}
    incompatible_keys = ("embedding_size", "lstm_units", "attention_size")
    features = "grid"
    attends = True
    # its teacher-forced pass steps word by word as decoding does: SCST differentiates through its sampling
    # (measured on the shapes: 1.34x a cross-entropy step per image that way, 1.75x with a second pass)
    fast_teacher_forcing = False
    scheduled_sampling = True  # stepping in training mode is its teacher-forced pass one word at a time

    def __init__(self, vocab_size: int, cfg: ModelConfig, encoder: ImageEncoder, seed: int = 0,
                 settings: UpDownSettings | None = None, **kwargs):
        super().__init__(**kwargs)
        self.setup(vocab_size, cfg, encoder, settings)
        s = self.settings

        def init(offset):
            return keras.initializers.RandomUniform(-s.init_scale, s.init_scale, seed=seed + offset)

        units = s.lstm_units
        # Attribute names are the checkpoints' variable paths: renaming one breaks every trained model.
        self.feature_embedding = layers.Dense(units, activation="relu", kernel_initializer=init(1),
                                              name="feature_embedding")
        self.word_embedding = layers.Embedding(vocab_size, s.embedding_size, embeddings_initializer=init(2),
                                               name="word_embedding")
        self.attention_lstm = layers.LSTMCell(units, kernel_initializer=init(3), recurrent_initializer=init(4),
                                              name="attention_lstm")
        self.attention_features = layers.Dense(s.attention_size, kernel_initializer=init(5),
                                               name="attention_features")
        self.attention_state = layers.Dense(s.attention_size, use_bias=False, kernel_initializer=init(6),
                                            name="attention_state")
        self.attention_score = layers.Dense(1, kernel_initializer=init(7), name="attention_score")
        self.language_lstm = layers.LSTMCell(units, kernel_initializer=init(8), recurrent_initializer=init(9),
                                             name="language_lstm")
        self.input_dropout = layers.Dropout(cfg.dropout, seed=seed + 10, name="input_dropout")
        self.output_dropout = layers.Dropout(cfg.dropout, seed=seed + 11, name="output_dropout")
        self.logits = layers.Dense(vocab_size, kernel_initializer=init(12), dtype="float32", name="logits")

    def initial_state(self, features, training=False, mask=None):
        """Zero LSTM states; the embedded features, their mean (of the real cells) and attention projection,
        computed once; the mask."""
        embedded = self.feature_embedding(features)
        rows, cells = tf.shape(features)[0], tf.shape(features)[1]
        zeros = tf.zeros([rows, self.settings.lstm_units], self.attention_lstm.compute_dtype)
        return {"h1": zeros, "c1": zeros, "h2": zeros, "c2": zeros, "features": embedded,
                "mean": masked_mean(embedded, mask), "projected": self.attention_features(embedded),
                "mask": tf.ones([rows, cells], tf.float32) if mask is None else tf.cast(mask, tf.float32),
                "attention": tf.zeros([rows, cells], tf.float32)}

    def _recur(self, words, state, training):
        """One step of both LSTMs from the embedded ``words [B, E]``: the new state."""
        lstm_in = tf.concat([state["h2"], state["mean"], self.input_dropout(words, training=training)], axis=-1)
        h1, (h1, c1) = self.attention_lstm(lstm_in, [state["h1"], state["c1"]], training=training)
        hidden = tf.tanh(state["projected"] + self.attention_state(h1)[:, None, :])
        # a 2-D matmul: a Dense over [B, G, A] is a tensordot, whose gradient XLA cannot compile in a loop
        flat = self.attention_score(tf.reshape(hidden, [-1, hidden.shape[-1]]))
        scores = tf.reshape(tf.cast(flat, tf.float32), tf.shape(hidden)[:2])
        alpha = tf.nn.softmax(masked_scores(scores, state["mask"]), axis=-1)
        features = state["features"]
        attended = tf.reduce_sum(tf.expand_dims(tf.cast(alpha, features.dtype), -1) * features, axis=1)
        h2, (h2, c2) = self.language_lstm(tf.concat([tf.cast(attended, h1.dtype), h1], axis=-1),
                                          [state["h2"], state["c2"]], training=training)
        return {**state, "h1": h1, "c1": c1, "h2": h2, "c2": c2, "attention": alpha}

    def step(self, token_ids, state, training=False):
        """One decoding step; the new state's ``attention`` holds the weights the word was chosen with."""
        state = self._recur(self.word_embedding(token_ids), state, training=training)
        return self.logits(self.output_dropout(state["h2"], training=training)), state

    def teacher_forced(self, state, input_ids, training=False):
        """The caption word by word (a ``tf.while_loop``); the logits once over all steps afterwards."""
        words = self.word_embedding(input_ids)  # [B, T, E]
        steps = tf.shape(input_ids)[1]
        outputs = tf.TensorArray(self.language_lstm.compute_dtype, size=steps)

        def body(t, state, outputs):
            state = self._recur(words[:, t], state, training)
            return t + 1, state, outputs.write(t, state["h2"])

        shapes = tf.nest.map_structure(lambda s: tf.TensorShape([None]).concatenate(s.shape[1:]), state)
        _, state, outputs = tf.while_loop(  # maximum_iterations: XLA (train.jit_compile) needs the bound
            lambda t, *_: t < steps, body, (tf.constant(0), state, outputs), maximum_iterations=steps,
            shape_invariants=(tf.TensorShape([]), shapes, tf.TensorShape(None)))
        h2_all = tf.transpose(outputs.stack(), [1, 0, 2])
        return self.logits(self.output_dropout(h2_all, training=training)), state

    def decoder_variables(self) -> list:
        return [v for layer in (self.feature_embedding, self.word_embedding, self.attention_lstm,
                                self.attention_features, self.attention_state, self.attention_score,
                                self.language_lstm, self.logits)
                for v in layer.weights]
