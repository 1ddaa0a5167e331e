"""The keras-hub image-text causal language models that ``model.decoder: vlm`` fine-tunes, read through one small
adapter per family, keyed by the backbone's class name in :data:`FAMILIES` (keras-hub 0.32).

A family adapter splits its model where this project's stages meet, so that the project's input pipeline, decoding
toolbox and training loop drive a pretrained vision-language model as they drive a captioner of their own::

    tokens = family.vision()(pixels)        preprocessed pixels [B, S, S, 3] → image tokens [B, N, width]
    ids = family.prefix_ids(tokenizer, prompt)        the prefix's text ids (image placeholders where images go)
    x = family.join(tokens, family.text.embed(ids), ids)   the prefix's input vectors [B, P, width]
    hidden, cache = family.prefix(x, cache, ids)      read at positions 0 … P − 1 with the family's prefix attention
    hidden, cache = family.text.run(x, cache, index)  pieces after them, causal (the cache's keys and values)
    logits = family.text.logits(hidden)     [B, T, LM vocabulary]

``family.text`` is a :class:`captioning.model.language_models.LanguageModel` (the prefix decoder's adapters), so
caching, growing the cache and the logits are the same code for both decoders.

**The prefix.** What the model reads before a caption is its image tokens, then its start token and the prompt
(``family.prefix_ids()``: its start token and ``model.prompt``'s pieces), as the family's own preprocessor packs them:

* **PaliGemma** (1 and 2): image tokens, ``<bos>``, the prompt (``caption en\\n``: "caption" is one of its
  pre-training tasks), then the caption and ``<eos>``. The prefix attends both ways (PaliGemma's prefix-LM mask:
  every image and prompt token sees every other), the caption causally; :meth:`PaliGemma.prefix` passes the
  decoder layers a padding mask of ones over the prefix, which is how keras-hub's ``PaliGemmaCausalLM`` seeds its
  cache in ``generate``.
* **Gemma 3** (with its vision encoder): ``<bos>``, then the prompt with its ``<start_of_image>`` expanded as its
  preprocessor expands it (``\n\n<start_of_image>``, ``<img>`` × N, ``<end_of_image>\n\n``), the ``<img>``
  placeholders replaced by the image tokens (``Gemma3InterleaveEmbeddings``' splice). Text attends causally, the
  image tokens both ways among themselves (its ``vision_mask``). The default prompt is a plain instruction after
  the image; a prompt without ``<start_of_image>`` gets one first.
* **BLIP-2** (OPT): the Q-Former's query tokens (projected to OPT's width), ``</s>``, the prompt ("a photo of", the
  paper's), the caption and OPT's newline end token, causal all through; OPT's learned positions run from 2 over
  the whole sequence. BLIP-2 over Flan-T5 (an encoder-decoder) is refused.

Reading the prefix's last vector again, at its own position, from the cache of the whole prefix gives exactly what
the prefix pass gave there (it sees the same positions, whose keys and values the cache holds, in every layer):
the decoder so reads the prompt's last piece at ``<start>`` (its output gives the first word), and the
:class:`~captioning.model.prefix_lm.PrefixLM` stepping (one piece a position) is the family's generation.

A backbone of another class is refused in one line naming the families (:func:`family_of`).
"""

from __future__ import annotations

import keras
import tensorflow as tf
from keras import ops

from captioning.errors import InputError
from captioning.model.language_models import Gemma, Gemma3, LanguageModel


class PaliGemmaText(Gemma):
    """PaliGemma's decoder layers over input vectors: Gemma's embedding scale, rotary positions and RMS norms; a
    ``prefix`` pass attends both ways (a padding mask of ones over it: keras-hub's block attention)."""

    def layer(self, layer, x, cache, index, training, prefix=False):
        mask = ops.ones(ops.shape(x)[:2], "int32") if prefix else None
        return layer(x, padding_mask=mask, cache=cache, cache_update_index=index)


class Gemma3Text(Gemma3):
    """Gemma 3's decoder layers with its vision encoder present (the prefix decoder's Gemma 3 refuses one); a
    ``vision_mask [B, T]`` lets the image tokens attend both ways among themselves."""

    def __init__(self, backbone):
        LanguageModel.__init__(self, backbone)

    def layer(self, layer, x, cache, index, training, vision_mask=None):
        x, (key, value) = layer(x, cache=(cache[:, 0], cache[:, 1]), cache_update_index=index,
                                vision_mask=vision_mask, training=training)
        return x, ops.stack([key, value], axis=1)


class VisionLanguage:
    """A keras-hub image-text backbone read as ``model.decoder: vlm`` needs it (module docstring)."""

    prompt: str = ""  # the family's captioning prompt (model.prompt's default)
    text_class: type[LanguageModel] = LanguageModel

    def __init__(self, backbone):
        self.backbone = backbone
        self.text = self.text_class(backbone)
        self.width = self.text.width

    def vision(self) -> keras.Model:
        """The Keras model from preprocessed pixels ``[B, S, S, 3]`` to the image tokens the language model reads
        ``[B, N, width]`` (the backbone's own layers: a checkpoint and the backbone share them)."""
        raise NotImplementedError

    def grid(self) -> tuple[int, int] | None:
        """Where the image tokens sit: rows × columns of the image, or None."""
        return None

    def prefix_ids(self, tokenizer, prompt: str) -> list[int]:
        """The LM token ids of the prefix's text: its start token and ``prompt``'s pieces (image placeholders where
        the family puts the image tokens among them)."""
        return _start(tokenizer) + _pieces(tokenizer, prompt)

    def join(self, tokens, text, ids: list[int]):
        """The prefix's input vectors ``[B, P, width]`` from the image tokens ``[B, N, width]`` and the embedded
        :meth:`prefix_ids` ``[B, T, width]``."""
        return tf.concat([tokens, text], axis=1)

    def prefix(self, x, cache, ids: list[int], training=False):
        """The prefix ``x [B, P, width]`` read at positions ``0 … P − 1`` into ``cache`` (``P`` slots): the final
        hidden states ``[B, P, width]`` and the cache. Causal unless the family says otherwise."""
        return self.text.run(x, cache, 0, training)


def _start(tokenizer) -> list[int]:
    start = getattr(tokenizer, "start_token_id", None)
    return [] if start is None else [int(start)]


def _pieces(tokenizer, text: str) -> list[int]:
    if not text:
        return []
    return [int(i) for i in tf.reshape(tokenizer(text), [-1]).numpy()]


class PaliGemma(VisionLanguage):
    """PaliGemma 1 and 2 (``PaliGemmaBackbone``): a SigLIP ViT whose last dense layer projects its patches to the
    language model's width, a Gemma (Gemma 2 for PaliGemma 2) reading them before the text, the prefix both ways."""

    prompt = "caption en\n"
    text_class = PaliGemmaText

    def vision(self):
        return self.backbone.vit_encoder

    def grid(self):
        side = int(self.backbone.image_size) // int(self.backbone.vit_patch_size)
        return side, side

    def prefix(self, x, cache, ids, training=False):
        return self.text.run(x, cache, 0, training, prefix=True)


class Gemma3VisionLanguage(VisionLanguage):
    """Gemma 3 with its vision encoder (``Gemma3Backbone`` whose ``vision_encoder`` is set): a SigLIP ViT, its
    patches average-pooled and projected to the language model's width, spliced into the text at ``<img>``."""

    prompt = "<start_of_image>Describe this image in one sentence.\n"
    text_class = Gemma3Text

    def __init__(self, backbone):
        super().__init__(backbone)
        self.tokens = int(backbone.vision_encoder.num_vision_tokens_per_image)

    def vision(self):
        encoder = self.backbone.vision_encoder
        size = int(encoder.image_size)
        pixels = keras.Input((size, size, 3), name="image")
        one = keras.layers.Lambda(lambda t: ops.expand_dims(t, 1), name="one_image")(pixels)  # [B, 1, S, S, 3]
        return keras.Model(pixels, encoder(one), name="gemma3_vision")

    def grid(self):
        side = int(round(self.tokens ** 0.5))
        return (side, side) if side * side == self.tokens else None

    def prefix_ids(self, tokenizer, prompt):
        image = "<start_of_image>"
        if image not in prompt:
            prompt = image + prompt
        expanded = prompt.replace(image, f"\n\n{image}{'<img>' * self.tokens}<end_of_image>\n\n", 1)
        ids = _start(tokenizer) + _pieces(tokenizer, expanded)
        self.placeholder = int(tokenizer.image_placeholder_id)  # <img>
        if ids.count(self.placeholder) != self.tokens:
            raise InputError(f"model.prompt: a Gemma 3 prompt holds one <start_of_image> (where the image goes); got "
                             f"{prompt!r}")
        return ids

    def join(self, tokens, text, ids):
        first = ids.index(self.placeholder)
        return tf.concat([text[:, :first], tf.cast(tokens, text.dtype), text[:, first + self.tokens:]], axis=1)

    def prefix(self, x, cache, ids, training=False):
        mask = tf.tile(tf.constant([[i == self.placeholder for i in ids]]), [tf.shape(x)[0], 1])
        return self.text.run(x, cache, 0, training, vision_mask=mask)


class OPTText(LanguageModel):
    """BLIP-2's OPT (``BLIP2CustomOPT``): learned positions from 2 (OPT's offset) over the whole sequence, the query
    tokens' first; multi-head attention, a final layer norm, the tied embedding. A position past its last reads the
    last (as the prefix decoder's GPT-2: a longer caption is read, not refused mid-run)."""

    OFFSET = 2  # OPT's position offset (keras-hub's OPT_POSITION_OFFSET)

    def __init__(self, opt):
        super().__init__(opt)
        self.positions = int(opt.max_sequence_length) + self.OFFSET
        self.max_length = int(opt.max_sequence_length)

    def heads(self):
        return int(self.backbone.num_heads), int(self.backbone.hidden_dim // self.backbone.num_heads)

    def inputs(self, x, index, training):
        at = ops.minimum(self.OFFSET + index + ops.arange(ops.shape(x)[1]), self.positions - 1)
        return x + ops.cast(self.backbone.embeddings_layer.position_embedding(at[None]), x.dtype)

    def layer(self, layer, x, cache, index, training):
        return layer(x, self_attention_cache=cache, self_attention_cache_update_index=index, training=training)


class BLIP2(VisionLanguage):
    """BLIP-2 with OPT (``BLIP2Backbone`` over a ``BLIP2CustomOPT``): its ViT's patches read by the Q-Former's query
    tokens, projected to OPT's width, before ``</s>`` and the prompt ("a photo of", the BLIP-2 paper's captioning
    prompt); causal attention all through (OPT's, the query tokens' too)."""

    prompt = "a photo of"
    text_class = OPTText

    def __init__(self, backbone):
        self.backbone = backbone
        self.text = OPTText(backbone.language_model)
        self.width = self.text.width

    def vision(self):
        b = self.backbone
        size = b.vision_encoder.image_size
        size = tuple(size) if isinstance(size, (tuple, list)) else (size, size)
        pixels = keras.Input((*size, 3), name="image")
        queries = b.qformer(b.vision_encoder(pixels))
        return keras.Model(pixels, b.language_model.language_projection(queries), name="blip2_vision")


class _Families(dict):
    """:data:`FAMILIES`, where a ``Gemma3Backbone`` or ``BLIP2Backbone`` is an image-text model only with its vision
    encoder, and a BLIP-2 only over OPT (its Flan-T5 is an encoder-decoder)."""

    def get_family(self, backbone):
        name = type(backbone).__name__
        if name in ("Gemma3Backbone", "BLIP2Backbone") and getattr(backbone, "vision_encoder", None) is None:
            return None  # text only
        if name == "BLIP2Backbone" and not hasattr(backbone.language_model, "embeddings_layer"):
            return None  # BLIP-2 over Flan-T5, an encoder-decoder: not a causal LM
        return self.get(name)


FAMILIES = _Families({"PaliGemmaBackbone": PaliGemma, "Gemma3Backbone": Gemma3VisionLanguage, "BLIP2Backbone": BLIP2})


def family_of(backbone, preset: str = "") -> VisionLanguage:
    """The adapter of ``backbone``'s family; an InputError (one line) naming the families otherwise."""
    family = FAMILIES.get_family(backbone)
    if family is None:
        where = f" ({preset})" if preset else ""
        name = type(backbone).__name__
        what = name + ("" if name not in FAMILIES else " without a vision encoder" if getattr(
            backbone, "vision_encoder", None) is None else " over a language model that is not OPT")
        raise InputError(f"model.vlm_preset{where} holds a {what}; model.decoder: vlm reads the image-text models "
                         f"{', '.join(sorted(FAMILIES))}")
    return family(backbone)
