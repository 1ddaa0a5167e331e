"""The mapping networks of ``model.decoder: prefix_lm``: an image encoder's tokens ``[B, N, D]`` (and their mask)
into the prefix ``[B, L, width]`` a causal language model reads before the caption.

:data:`MAPPERS` is the registry ``model.mapper`` chooses from: ``mlp`` (ClipCap's MLP over the tokens' mean),
``transformer`` (ClipCap's Transformer mapper with learned constants) and ``qformer`` (BLIP-2's Q-Former, keras-hub's
``BLIP2QFormer``, and its projection to the LM's width). Each is a :class:`~captioning.model.mappers.base.Mapper`
built ``MAPPERS[name](settings, width, seed=seed)``; ``MAPPERS[name].output_length(settings)`` says ``L``."""

from __future__ import annotations

from captioning.model.mappers.base import Mapper
from captioning.model.mappers.mlp import MLPMapper
from captioning.model.mappers.qformer import QFormerMapper
from captioning.model.mappers.transformer import TransformerMapper

MAPPERS: dict[str, type[Mapper]] = {"mlp": MLPMapper, "transformer": TransformerMapper, "qformer": QFormerMapper}

__all__ = ["MAPPERS", "Mapper", "MLPMapper", "QFormerMapper", "TransformerMapper"]
