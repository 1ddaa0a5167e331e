"""``model.mapper: transformer``: ClipCap's Transformer mapping network (Mokady et al. 2021, "ClipCap: CLIP Prefix
for Image Captioning", section 3.1), the one ClipCap pairs with a frozen GPT-2.

ClipCap projects the CLIP embedding by a linear layer into ``clip_length`` vectors of the language model's width,
appends ``k`` learned constants (``prefix_const``, ``k`` = ``model.prefix_length``, 10 for COCO), runs 8 layers of
a Transformer encoder with 8 heads over the ``clip_length + k`` vectors, and takes the constants' outputs as the
prefix ``[B, k, width]``. Here the encoder's own tokens ``[B, N, D]`` take the place of the vectors ClipCap makes
from one embedding: each is projected to ``width`` (one Dense), the constants are appended after them, and
``model.mapper_layers`` layers with ``model.mapper_heads`` heads run over the ``N + k`` vectors; padding tokens
(mask 0) are masked out as keys of every layer's self-attention, so the constants never read them (the constants
themselves are always real). A layer is ClipCap's: pre-norm (LayerNorm ε 1e-5 before self-attention and before the
feed-forward block, each in a residual), a ReLU feed-forward block of ``2·width`` (ClipCap's ``mlp_ratio`` 2), no
dropout, no final norm — keras-hub's :class:`keras_hub.layers.TransformerEncoder` with ``normalize_first``. It
differs from ClipCap's in biases: keras' attention projections have them (ClipCap's query, key and value have
none). No positions are added: ClipCap adds none (the constants are distinct by their learned values).
Initial weights: Keras' Glorot-uniform kernels, zero biases, constants from a standard normal (ClipCap's
``torch.randn``)."""

from __future__ import annotations

import keras
from keras import layers, ops

from captioning.model.mappers.base import Mapper


class TransformerMapper(Mapper):
    """ClipCap's Transformer mapper: tokens ``[B, N, D]`` → ``Dense(w)`` → ``[B, N, w]``, ``k`` learned constants
    appended → ``[B, N + k, w]``, ``mapper_layers`` pre-norm encoder layers (self-attention with ``mapper_heads``
    heads, padding masked as keys; ReLU feed-forward of ``2w``), the last ``k`` outputs → ``[B, k, w]``.

    Trainable parameters, with ``L`` = ``mapper_layers``: ``D·w + w`` (the projection) ``+ k·w`` (the constants)
    ``+ L·(8·w² + 11·w)`` (per layer: query, key, value and output projections ``4·w² + 4·w``, two LayerNorms
    ``4·w``, the feed-forward block ``w·2w + 2w + 2w·w + w``)."""

    key = "transformer"

    @classmethod
    def attention_width(cls, settings, width: int) -> int:
        return width

    @classmethod
    def parameter_count(cls, settings, width: int, dim: int) -> int:
        k, w, n = int(settings.prefix_length), int(width), int(settings.mapper_layers)
        return dim * w + w + k * w + n * (8 * w * w + 11 * w)

    def make_layers(self, dim: int) -> None:
        import keras_hub

        w = self.width
        self.project = layers.Dense(w, dtype=self.dtype_policy, name="project")
        self.project.build((None, None, dim))
        self.prefix_const = self.add_weight(shape=(self.length, w), initializer=keras.initializers.RandomNormal(
            stddev=1.0), name="prefix_const")
        # one attribute per layer: TF checkpoints do not follow Keras' tracked lists
        for i in range(int(self.settings.mapper_layers)):
            layer = keras_hub.layers.TransformerEncoder(
                intermediate_dim=2 * w, num_heads=int(self.settings.mapper_heads), dropout=0.0, activation="relu",
                layer_norm_epsilon=1e-5, normalize_first=True, dtype=self.dtype_policy,
                name=f"layer_{i}")
            layer.build((None, None, w))
            setattr(self, f"layer_{i}", layer)

    def map(self, tokens, mask, training):
        batch, count = ops.shape(tokens)[0], ops.shape(tokens)[1]
        constants = ops.cast(self.prefix_const, self.compute_dtype)
        x = ops.concatenate([self.project(tokens),
                             ops.broadcast_to(constants[None], (batch, self.length, self.width))], axis=1)
        padding = None
        if mask is not None:  # keys: the real tokens and every constant
            padding = ops.concatenate([mask > 0, ops.ones((batch, self.length), dtype="bool")], axis=1)
        for i in range(int(self.settings.mapper_layers)):
            x = getattr(self, f"layer_{i}")(x, padding_mask=padding, training=training)
        return x[:, count:, :]
