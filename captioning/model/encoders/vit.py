"""``model.encoder: vit``: a Vision Transformer trained from pixels (Dosovitskiy et al. 2021), built with
keras-hub's ``ViTBackbone``.

The image is cut into ``vit_patch_size``-pixel patches, each embedded to ``vit_width`` with a position, a
class token put first (``vit_class_token``), and ``vit_layers`` pre-norm Transformer layers of
``vit_heads`` heads and an MLP of ``vit_mlp_size`` run over them. Its tokens are the class token and the
patches row by row (at 64 px with 8-pixel patches: 1 + 8 × 8 = 65 tokens); pooled, the class token (or the
patches' mean without one), as ViT and CLIP pool. Pixels are scaled to [-1, 1]. The defaults are sized like
``small_cnn`` for these CPUs (about 240,000 parameters at 64 px, small_cnn's 240,000 and change), not
like ViT-B/16 (86 million: ``model.vit_width: 768``, ``vit_layers: 12``, ``vit_heads: 12``,
``vit_mlp_size: 3072``, ``vit_patch_size: 16``). For pretrained ViT, CLIP, SigLIP or DINOv2 weights use
``model.encoder: keras_hub`` (:mod:`.keras_hub`). ``data.image_size`` must divide by the patch size.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import keras

from captioning.config.settings import MAX_HEADS, MAX_IMAGE_SIZE, MAX_LAYERS, MAX_WIDTH, between
from captioning.errors import InputError
from captioning.model.encoders.base import ImageEncoder
from captioning.model.layout import TokenLayout


@dataclass
class ViTSettings:
    """``model.encoder: vit``'s own keys (``model.vit_layers``, ...)."""

    vit_patch_size: int = field(default=8, metadata=between(1, MAX_IMAGE_SIZE))  # pixels a side
    vit_layers: int = field(default=3, metadata=between(1, MAX_LAYERS))
    vit_width: int = field(default=96, metadata=between(1, MAX_WIDTH))  # each token's size, a multiple of the heads
    vit_heads: int = field(default=4, metadata=between(1, MAX_HEADS))
    vit_mlp_size: int = field(default=192, metadata=between(1, 4 * MAX_WIDTH))
    vit_class_token: bool = True


class ViT(ImageEncoder):
    """keras-hub's ViTBackbone from random weights (module docstring)."""

    settings_class = ViTSettings
    incompatible_keys = ("vit_patch_size", "vit_layers", "vit_width", "vit_heads", "vit_mlp_size", "vit_class_token")
    tiny_settings = {"vit_patch_size": 8, "vit_layers": 1, "vit_width": 16, "vit_heads": 2, "vit_mlp_size": 24}

    @classmethod
    def shapes_follow_image_size(cls, settings, pooled: bool) -> bool:
        return True  # a position embedding a patch

    def check(self) -> None:
        s = self.settings
        if (self.cfg.encoder_weights or "none") not in ("none",):
            raise InputError("model.encoder_weights: vit trains from random weights (none); for pretrained ViT "
                             "weights use model.encoder: keras_hub with model.encoder_preset")
        if self.image_size % s.vit_patch_size:
            raise InputError(f"data.image_size ({self.image_size}) must divide by model.vit_patch_size "
                             f"({s.vit_patch_size})")
        if s.vit_width % s.vit_heads:
            raise InputError(f"model.vit_width ({s.vit_width}) must divide by model.vit_heads ({s.vit_heads})")

    def preprocess(self, pixels):
        return pixels / 127.5 - 1.0

    def backbone(self, pooled: bool) -> keras.Model:
        import keras_hub

        s = self.settings
        return keras_hub.models.ViTBackbone(
            image_shape=(self.image_size, self.image_size, 3), patch_size=s.vit_patch_size, num_layers=s.vit_layers,
            num_heads=s.vit_heads, hidden_dim=s.vit_width, mlp_dim=s.vit_mlp_size,
            use_class_token=s.vit_class_token, name="vit")

    def layout_of(self, tokens: int) -> TokenLayout | None:
        side = self.image_size // self.settings.vit_patch_size
        return TokenLayout.of(tokens, side, side)

    def pool(self, tokens):
        if self.settings.vit_class_token:
            return keras.layers.Lambda(lambda t: t[:, 0], name="class_token")(tokens)
        return super().pool(tokens)
