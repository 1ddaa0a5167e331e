"""``model.mapper: mlp``: ClipCap's MLP mapping network (Mokady et al. 2021, "ClipCap: CLIP Prefix for Image
Captioning", section 3.1).

ClipCap maps one CLIP embedding ``[B, D]`` through an MLP with one hidden layer, ``D → (k·width)/2 → k·width``,
tanh between the two linear layers, and reshapes it into ``k`` prefix vectors ``[B, k, width]`` (``k`` =
``model.prefix_length``, ClipCap's 10; ``width`` the language model's hidden size, GPT-2's 768). Here the decoder
hands the encoder's tokens ``[B, N, D]``, so the mapper first pools them itself: the mean of the real tokens
(padding, mask 0, never counts; a pooled encoder's single token is its own mean). The hidden size is ClipCap's
``(k·width) // 2``. Initial weights: Keras' Glorot-uniform kernels and zero biases (PyTorch's default in ClipCap)."""

from __future__ import annotations

from keras import layers, ops

from captioning.model.mappers.base import Mapper


class MLPMapper(Mapper):
    """ClipCap's MLP: masked mean of the tokens ``[B, N, D]`` → ``[B, D]``, ``Dense((k·w)//2, tanh)``,
    ``Dense(k·w)``, reshaped to ``[B, k, w]`` (``k`` = ``prefix_length``, ``w`` = width).

    Trainable parameters, with ``h = (k·w) // 2``: ``D·h + h + h·k·w + k·w`` (two kernels and their biases;
    ClipCap's with CLIP ViT-B/32's ``D`` = 512, GPT-2's ``w`` = 768 and ``k`` = 10: 31,468,800)."""

    key = "mlp"

    @classmethod
    def parameter_count(cls, settings, width: int, dim: int) -> int:
        k, w = int(settings.prefix_length), int(width)
        hidden = k * w // 2
        return dim * hidden + hidden + hidden * k * w + k * w

    def make_layers(self, dim: int) -> None:
        k, w = self.length, self.width
        self.hidden = layers.Dense(k * w // 2, activation="tanh", dtype=self.dtype_policy, name="hidden")
        self.hidden.build((None, dim))
        self.out = layers.Dense(k * w, dtype=self.dtype_policy, name="out")
        self.out.build((None, k * w // 2))

    def map(self, tokens, mask, training):
        if mask is None:
            pooled = ops.mean(tokens, axis=1)
        else:  # the padding is zero already: the sum over real tokens over their count (at least 1)
            count = ops.maximum(ops.sum(mask, axis=1, keepdims=True), ops.ones_like(mask[:, :1]))
            pooled = ops.sum(tokens, axis=1) / count
        return ops.reshape(self.out(self.hidden(pooled)), (-1, self.length, self.width))
