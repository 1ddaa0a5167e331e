"""The Show-and-Tell model (Vinyals et al. 2015): a CNN encoder and an LSTM decoder, in Keras 3.

The image is embedded once and fed as the LSTM's first input; the words follow. Training sees the
whole caption at once (teacher forcing); decoding calls :meth:`ShowAndTell.step` one word at a time::

    time step        -1          0          1          2          3
    LSTM input     image      <start>      a          red       circle
    predicts       (ignored)    a          red       circle      <end>

With im2txt's sizes (Inception v3, embedding 512, LSTM 512) the decoder's parts have exactly::

    image_embedding   2048 × 512 (no bias)              = 1,048,576
    lstm              4 × ((512 + 512) × 512 + 512)      = 2,099,200
    word_embedding    V × 512
    logits            512 × V + V

All decoder kernels and embeddings start uniform in ±``init_scale`` (0.08); biases start at 0 (the
LSTM's forget-gate bias at 1, Keras's ``unit_forget_bias``). Dropout (rate 0.3, im2txt's keep
probability 0.7) is applied to the LSTM's inputs and outputs. The logits layer always computes in
float32, so mixed precision never puts the softmax in half precision.

The encoder (:mod:`captioning.model.encoders`) gives pooled features ``[B, D]``; the state is the LSTM's
``[h, c]``. ``model.decoder: show_and_tell``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import keras
from keras import layers

from captioning.config import ModelConfig
from captioning.config.settings import MAX_INIT_SCALE, MAX_WIDTH, between
from captioning.model.encoders.base import ImageEncoder
from captioning.model.base import CaptionModel


@dataclass
class ShowAndTellSettings:
    """``model.decoder: show_and_tell``'s own keys (``model.embedding_size``, ...)."""

    embedding_size: int = field(default=512, metadata=between(1, MAX_WIDTH))  # image and word embeddings
    lstm_units: int = field(default=512, metadata=between(1, MAX_WIDTH))
    # decoder kernels and embeddings start uniform in [-init_scale, init_scale]
    init_scale: float = field(default=0.08, metadata=between(0.0, MAX_INIT_SCALE, low_open=True))


class ShowAndTell(CaptionModel):
    """Encoder + LSTM decoder (see the module docstring and :class:`CaptionModel`'s interface)."""

    settings_class = ShowAndTellSettings
    tiny_settings = {"embedding_size": 16, "lstm_units": 24}
    incompatible_keys = ("embedding_size", "lstm_units")
    features = "pooled"
    # stepping in training mode is its teacher-forced pass one word at a time: it takes scheduled sampling (whose
    # pass runs word by word instead of the LSTM layer's loop over the caption: cuDNN's kernel on a GPU)
    scheduled_sampling = True

    def __init__(self, vocab_size: int, cfg: ModelConfig, encoder: ImageEncoder, seed: int = 0,
                 settings: ShowAndTellSettings | None = None, **kwargs):
        super().__init__(**kwargs)
        self.setup(vocab_size, cfg, encoder, settings)
        s = self.settings

        def init(offset):
            return keras.initializers.RandomUniform(-s.init_scale, s.init_scale, seed=seed + offset)

        # Attribute names are the checkpoints' variable paths: renaming one breaks every trained model.
        self.image_embedding = layers.Dense(s.embedding_size, use_bias=False, kernel_initializer=init(1),
                                            name="image_embedding")
        self.word_embedding = layers.Embedding(vocab_size, s.embedding_size, embeddings_initializer=init(2),
                                               name="word_embedding")
        self.lstm = layers.LSTM(s.lstm_units, return_sequences=True, return_state=True,
                                kernel_initializer=init(3), recurrent_initializer=init(4), name="lstm")
        self.input_dropout = layers.Dropout(cfg.dropout, seed=seed + 5, name="lstm_input_dropout")
        self.output_dropout = layers.Dropout(cfg.dropout, seed=seed + 6, name="lstm_output_dropout")
        self.logits = layers.Dense(vocab_size, kernel_initializer=init(7), dtype="float32", name="logits")

    def initial_state(self, features, training=False, mask=None):
        """The LSTM state after it has read the image embedding (time step -1). (Pooled features: regions
        come as their masked mean, so ``mask`` is always None.)"""
        embedded = self.image_embedding(features)[:, None, :]
        _, h, c = self.lstm(self.input_dropout(embedded, training=training), training=training)
        return [h, c]

    def step(self, token_ids, state, training=False):
        """One decoding step: ``token_ids [batch]``, ``state [h, c]`` → ``logits [batch, vocab]``, new state."""
        embedded = self.input_dropout(self.word_embedding(token_ids), training=training)
        output, new_state = self.lstm.cell(embedded, state, training=training)
        return self.logits(self.output_dropout(output, training=training)), list(new_state)

    def teacher_forced(self, state, input_ids, training=False):
        words = self.input_dropout(self.word_embedding(input_ids), training=training)
        # No mask is needed: captions are right-padded and the LSTM is causal, so padding never changes
        # the outputs at real positions (and the loss masks padded positions). This keeps cuDNN usable.
        outputs, h, c = self.lstm(words, initial_state=state, training=training)
        return self.logits(self.output_dropout(outputs, training=training)), [h, c]

    def decoder_variables(self) -> list:
        return [v for layer in (self.image_embedding, self.word_embedding, self.lstm, self.logits)
                for v in layer.weights]
