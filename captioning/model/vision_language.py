"""The keras-hub image-text causal language models that ``model.decoder: vlm`` fine-tunes, read through one small
adapter per family, keyed by the backbone's class name in :data:`FAMILIES` (keras-hub 0.32).

A family adapter splits its model where this project's stages meet, so that the project's input pipeline, decoding
toolbox and training loop drive a pretrained vision-language model as they drive a captioner of their own::

    tokens = family.vision(pixels)          preprocessed pixels [B, S, S, 3] → image tokens [B, N, width]
    x = family.text.embed(ids)              LM token ids [B, T] → input vectors [B, T, width]
    hidden, cache = family.prefix(x, cache)           the image tokens and the prompt, [B, P, width], read at
                                                      positions 0 … P − 1 with the family's prefix attention
    hidden, cache = family.text.run(x, cache, index)  pieces after them, causal (the cache's keys and values)
    logits = family.text.logits(hidden)     [B, T, LM vocabulary]

``family.text`` is a :class:`captioning.model.language_models.LanguageModel` (the prefix decoder's adapters), so
caching, growing the cache and the logits are the same code for both decoders.

**The prefix.** What the model reads before a caption is its image tokens, then its start token and the prompt
(``family.start_ids()``, then ``model.prompt``'s pieces), as the family's own preprocessor packs them:

* **PaliGemma** (1 and 2): image tokens, ``<bos>``, the prompt (``caption en\\n``: "caption" is one of its
  pre-training tasks), then the caption and ``<eos>``. The prefix attends both ways (PaliGemma's prefix-LM mask:
  every image and prompt token sees every other), the caption causally; :meth:`PaliGemma.prefix` passes the
  decoder layers a padding mask of ones over the prefix, which is how keras-hub's ``PaliGemmaCausalLM`` seeds its
  cache in ``generate``.

Reading the prefix's last vector again, at its own position, from the cache of the whole prefix gives exactly what
the prefix pass gave there (it sees the same positions, whose keys and values the cache holds, in every layer):
the decoder so reads the prompt's last piece at ``<start>`` (its output gives the first word), and the
:class:`~captioning.model.prefix_lm.PrefixLM` stepping (one piece a position) is the family's generation.

A backbone of another class is refused in one line naming the families (:func:`family_of`).
"""

from __future__ import annotations

import keras
from keras import ops

from captioning.errors import InputError
from captioning.model.language_models import Gemma, LanguageModel


class PaliGemmaText(Gemma):
    """PaliGemma's decoder layers over input vectors: Gemma's embedding scale, rotary positions and RMS norms; a
    ``prefix`` pass attends both ways (a padding mask of ones over it: keras-hub's block attention)."""

    def layer(self, layer, x, cache, index, training, prefix=False):
        mask = ops.ones(ops.shape(x)[:2], "int32") if prefix else None
        return layer(x, padding_mask=mask, cache=cache, cache_update_index=index)


class VisionLanguage:
    """A keras-hub image-text backbone read as ``model.decoder: vlm`` needs it (module docstring)."""

    prompt: str = ""  # the family's captioning prompt (model.prompt's default)
    text_class: type[LanguageModel] = LanguageModel

    def __init__(self, backbone):
        self.backbone = backbone
        self.text = self.text_class(backbone)
        self.width = self.text.width

    def vision(self) -> keras.Model:
        """The Keras model from preprocessed pixels to the image tokens the language model reads ``[B, N, width]``
        (the backbone's own layers: a checkpoint and the backbone share them)."""
        raise NotImplementedError

    def start_ids(self, tokenizer) -> list[int]:
        """The LM token ids the text starts with, before the prompt (its start token)."""
        start = getattr(tokenizer, "start_token_id", None)
        return [] if start is None else [int(start)]

    def prefix(self, x, cache, training=False):
        """The prefix's input vectors ``x [B, P, width]`` read at positions ``0 … P − 1`` into ``cache`` (``P``
        slots): the final hidden states ``[B, P, width]`` and the cache. Causal unless the family says otherwise."""
        return self.text.run(x, cache, 0, training)

    def vision_layers(self) -> list:
        """The vision tower's layers (frozen unless ``model.encoder_trainable``)."""
        return [self.vision()]


class PaliGemma(VisionLanguage):
    """PaliGemma 1 and 2 (``PaliGemmaBackbone``): a SigLIP ViT whose last dense layer projects its patches to the
    language model's width, a Gemma (Gemma 2 for PaliGemma 2) reading them before the text."""

    prompt = "caption en\n"
    text_class = PaliGemmaText

    def vision(self):
        return self.backbone.vit_encoder

    def prefix(self, x, cache, training=False):
        return self.text.run(x, cache, 0, training, prefix=True)


FAMILIES: dict[str, type[VisionLanguage]] = {"PaliGemmaBackbone": PaliGemma}


def family_of(backbone, preset: str = "") -> VisionLanguage:
    """The adapter of ``backbone``'s family; an InputError (one line) naming the families otherwise."""
    name = type(backbone).__name__
    if name not in FAMILIES:
        where = f" ({preset})" if preset else ""
        raise InputError(f"model.vlm_preset{where} holds a {name}; model.decoder: vlm reads the image-text models "
                         f"{', '.join(sorted(FAMILIES))}")
    return FAMILIES[name](backbone)
