"""The keras-hub causal language models ``model.decoder: prefix_lm`` decodes with: one small adapter per backbone
family, keyed by the backbone's class name in :data:`FAMILIES`.

Each adapter repeats its family's ``CausalLM.call_with_cache`` layer loop (keras-hub 0.32), split where a visual
prefix must enter: the loop reads input *vectors*, not token ids, so the decoder can put the mapper's prefix vectors
before the embedded caption pieces::

    x = lm.embed(ids)                      LM token ids [B, T] → [B, T, width] (Gemma's √width scale included)
    hidden, cache = lm.run(x, cache, index, training)   the layers over x written at positions index … index + T − 1
    logits = lm.logits(hidden)             [B, T, lm vocabulary] (the tied embedding; Gemma 2's final soft cap)
    cache = lm.empty_cache(batch, length, dtype)   zeros [B, layers, 2, length, kv_heads, head_dim]

``index`` is one scalar for the whole batch, as keras-hub's (every row of a decoding state is at the same place).
Positions are the model's own: GPT-2's learned position embedding is added in :meth:`run` (to prefix vectors as to
pieces, as ClipCap's ``inputs_embeds`` get them), the rotary families rotate keys and queries by ``index`` inside
their attention. The cache is always one tensor ``[B, layers, 2, S, kv_heads, head_dim]`` (the layout of GPT-2's,
Gemma's and Llama's caches); Gemma 3's layers take a ``(key, value)`` tuple each, which :class:`Gemma3` splits
from it and stacks back. :attr:`LanguageModel.max_length` is the most positions the model can read (GPT-2's
``max_sequence_length``), None for rotary positions (no hard bound: past the length it was trained on its quality
drops, nothing fails).

Families: ``GPT2Backbone``; ``GemmaBackbone`` (Gemma 1 and 2: Gemma 2's attention soft cap and sliding windows are
inside its layers, its final logit soft cap in the tied embedding's reverse call); ``Gemma3Backbone`` (text only: a
preset with a vision encoder is refused); ``Llama3Backbone`` (and ``LlamaBackbone``, its parent); ``Qwen3Backbone``;
``SmolLM3Backbone``. Any other backbone is refused in one line naming these (:func:`adapter`).
"""

from __future__ import annotations

import keras
import tensorflow as tf
from keras import ops
from tensorflow.compiler.tf2xla.ops import gen_xla_ops

from captioning.errors import InputError


def _dynamic_update_slice_gradient(op, grad):
    """The gradient TensorFlow lacks for ``XlaDynamicUpdateSlice``, the op Keras' ``ops.slice_update`` is on
    TensorFlow and keras-hub's attention layers write their caches with: the operand gets the gradient but where
    the update went (zeros), the update gets that slice of it (the indices are always in bounds here). Training
    differentiates through the cache: a caption's gradient reaches the prefix, and the mapper, through the keys
    and values cached for it."""
    _, update, indices = op.inputs
    operand = gen_xla_ops.xla_dynamic_update_slice(grad, tf.zeros_like(update), indices)
    return operand, tf.slice(grad, indices, tf.shape(update)), None


try:
    tf.RegisterGradient("XlaDynamicUpdateSlice")(_dynamic_update_slice_gradient)
except KeyError:  # registered already (a TensorFlow that has one)
    pass


class LanguageModel:
    """A keras-hub causal-LM backbone read as the prefix decoder needs it (module docstring)."""

    max_length: int | None = None  # the most positions it reads (None: rotary, no bound)

    def __init__(self, backbone):
        self.backbone = backbone
        self.width = int(backbone.hidden_dim)
        self.layers = int(backbone.num_layers)
        self.vocabulary_size = int(backbone.vocabulary_size)
        self.kv_heads, self.head_dim = self.heads()

    def heads(self) -> tuple[int, int]:
        """(key/value heads, head size) of a layer's cache."""
        b = self.backbone
        return int(b.num_key_value_heads), int(getattr(b, "head_dim", None) or b.hidden_dim // b.num_query_heads)

    def embed(self, ids):
        """LM token ids ``[B, T]`` → input vectors ``[B, T, width]``."""
        return self.backbone.token_embedding(ids)

    def layer(self, layer, x, cache, index, training):
        """One decoder layer over ``x`` with its cache ``[B, 2, S, kv_heads, head_dim]`` → (x, cache)."""
        return layer(x, self_attention_cache=cache, self_attention_cache_update_index=index, training=training)

    def inputs(self, x, index, training):
        """What the first layer reads of input vectors ``x`` written from position ``index``."""
        return x

    def norm(self, x):
        return self.backbone.layer_norm(x)

    def run(self, x, cache, index, training=False, **options):
        """The layers over ``x [B, T, width]`` at positions ``index …``, their keys and values written into
        ``cache`` there: (final hidden states ``[B, T, width]``, the cache). ``options`` go to :meth:`layer` (a
        vision-language family's prefix attention: :mod:`captioning.model.vision_language`)."""
        x = self.inputs(x, index, training)
        caches = []
        for i, layer in enumerate(self.backbone.transformer_layers):
            x, new = self.layer(layer, x, cache[:, i, ...], index, training, **options)
            caches.append(new)
        return self.norm(x), ops.stack(caches, axis=1)

    def logits(self, hidden):
        """Final hidden states → LM logits ``[..., vocabulary]`` (the tied embedding, reversed)."""
        return self.backbone.token_embedding(hidden, reverse=True)

    def empty_cache(self, batch, length, dtype):
        return ops.zeros([batch, self.layers, 2, length, self.kv_heads, self.head_dim], dtype=dtype)


class GPT2(LanguageModel):
    """GPT-2: learned positions (up to ``max_sequence_length``), multi-head attention, a final layer norm."""

    def __init__(self, backbone):
        super().__init__(backbone)
        self.max_length = int(backbone.max_sequence_length)

    def heads(self):
        return int(self.backbone.num_heads), int(self.backbone.hidden_dim // self.backbone.num_heads)

    def inputs(self, x, index, training):
        """``x`` plus the learned positions ``index …``; a position past the last reads the last (as the
        Transformer decoder's: a training caption longer than the model is read, not refused mid-run)."""
        b = self.backbone
        positions = ops.minimum(index + ops.arange(ops.shape(x)[1]), self.max_length - 1)
        x = b.embeddings_add((x, b.position_embedding(x, positions=positions)))
        return b.embeddings_dropout(x, training=training)


class Gemma(LanguageModel):
    """Gemma 1 and 2: embeddings scaled by √width, rotary positions, RMS norms."""

    def embed(self, ids):
        x = self.backbone.token_embedding(ids)
        return x * ops.cast(ops.sqrt(self.backbone.hidden_dim), x.dtype)

    def layer(self, layer, x, cache, index, training):
        return layer(x, cache=cache, cache_update_index=index, training=training)


class Gemma3(Gemma):
    """Gemma 3's text decoder: its layers' caches are ``(key, value)`` tuples, split from our one tensor."""

    def __init__(self, backbone):
        if getattr(backbone, "vision_encoder", None) is not None:
            raise InputError("model.decoder_preset: a Gemma 3 preset with a vision encoder; prefix_lm reads a "
                             "text-only Gemma 3 (the image side is model.encoder's)")
        super().__init__(backbone)

    def layer(self, layer, x, cache, index, training):
        x, (key, value) = layer(x, cache=(cache[:, 0], cache[:, 1]), cache_update_index=index, training=training)
        return x, ops.stack([key, value], axis=1)


class Llama(LanguageModel):
    """Llama 3 (and Llama): rotary positions, grouped-query attention, RMS norms."""


class Qwen3(LanguageModel):
    """Qwen 3: as Llama, with its own head size and query/key norms inside its attention."""


class SmolLM3(LanguageModel):
    """SmolLM3: as Llama (some layers without rotary positions, inside them); its final norm is ``norm``."""

    def heads(self):
        b = self.backbone
        return int(b.num_key_value_heads), int(b.hidden_dim // b.num_attention_heads)

    def norm(self, x):
        return self.backbone.norm(x)


FAMILIES: dict[str, type[LanguageModel]] = {
    "GPT2Backbone": GPT2, "GemmaBackbone": Gemma, "Gemma3Backbone": Gemma3, "Llama3Backbone": Llama,
    "LlamaBackbone": Llama, "Qwen3Backbone": Qwen3, "SmolLM3Backbone": SmolLM3}


def adapter(backbone, preset: str = "") -> LanguageModel:
    """The adapter of ``backbone``'s family; an InputError (one line) naming the families that can take a prefix
    for any other backbone."""
    name = type(backbone).__name__
    if name not in FAMILIES:
        where = f" ({preset})" if preset else ""
        raise InputError(f"model.decoder_preset{where} holds a {name}, which cannot take a visual prefix: "
                         f"prefix_lm reads {', '.join(sorted(FAMILIES))}")
    return FAMILIES[name](backbone)


def freeze(backbone: keras.Model) -> None:
    """Every weight of ``backbone`` untrainable (the frozen LM, ClipCap's default)."""
    backbone.trainable = False
