"""``model.encoder: keras_hub``: a pretrained vision backbone from keras-hub — ViT, the CLIP and SigLIP vision
towers, DINOv2 — read as patch tokens, the image side of every captioner since 2021 (CLIP-ViL, BLIP, GIT,
CoCa, PaliGemma).

``model.encoder_preset`` names a keras-hub preset (``clip_vit_base_patch16``, ``siglip_base_patch16_224``,
``dinov2_base``, ``vit_base_patch16_224_imagenet``: downloaded by keras-hub, for users with internet) or a
local preset folder, as ``save_to_preset`` writes it (offline; a relative path is made absolute when a run
starts). The preset is loaded with keras-hub's own ``Backbone.from_preset``; a CLIP or SigLIP preset is the
two-tower model, of which the vision tower is kept. The preset's image converter (``image_converter.json``)
gives its image size and normalisation, applied inside the encoder: pixels are resized to the preset's size
when ``data.image_size`` differs (set it to the preset's to skip that) and scaled as the preset was trained.
A preset without one reads pixels scaled to [0, 1] at its backbone's image size. A converter whose size is
not its backbone's input size (a preset put together by hand) is read at the backbone's size — the only one
its position embeddings take — with a warning naming both.

Refused in one line before any download: a name that is none of keras-hub's ViT, CLIP, SigLIP and DINOv2
presets (the message lists them all; a ``kaggle://``, ``hf://`` or ``modelscope://`` handle goes to keras-hub
as it is), a folder that does not exist (a preset moved since a model was trained from it) or holds no
``config.json``; after loading, a preset that is not a vision backbone (a text model: its class is named).

The tokens are the backbone's last hidden states: a class token (and DINOv2's registers) first, then the
patches row by row (ViT-B/16 at 224 px: 1 + 14 × 14 = 197 tokens of 768). SigLIP has no class token, and its
attention-pooling head is left out: its 196 patch tokens are read. Pooled (for Show and Tell): the class
token, or the mean of the patches.

Frozen by default (``model.encoder_trainable: false``: its tokens can be cached once, ``data.cache:
features``); with ``model.encoder_trainable: true`` it is fine-tuned at ``train.encoder_lr_scale`` times the
decoder's learning rate. Its weights are the preset's (``model.encoder_weights`` stays ``none``); a model
folder's checkpoints hold them too, and rebuilding a folder reads only the preset's architecture.
"""

from __future__ import annotations

import difflib
import logging
import os
from dataclasses import dataclass

import keras
import numpy as np

from captioning.errors import InputError
from captioning.model.encoders.base import ImageEncoder
from captioning.model.layout import TokenLayout

log = logging.getLogger("captioning.model")


@dataclass
class KerasHubSettings:
    """``model.encoder: keras_hub``'s own key."""

    # a keras-hub preset name (downloads) or a local preset folder (save_to_preset's)
    encoder_preset: str = ""


def _is_path(preset: str) -> bool:
    return os.sep in preset or preset.startswith(".") or os.path.exists(preset)


def check_preset_folder(preset: str, key: str) -> None:
    """For a preset given as a folder: an InputError (one line) naming ``model.KEY`` when the folder does not exist
    (a preset moved since a model was trained from it) or holds no ``config.json``."""
    if _is_path(preset) and not os.path.exists(preset):
        raise InputError(f"model.{key}: the folder {preset} does not exist (moved or deleted?)")
    if _is_path(preset) and not os.path.isfile(os.path.join(preset, "config.json")):
        raise InputError(f"model.{key}: {preset} is not a keras-hub preset folder (no config.json; write one with "
                         "save_to_preset)")


def load_backbone(preset: str, key: str, **kwargs):
    """keras-hub's ``Backbone.from_preset(preset, **kwargs)``; an InputError (one line) naming ``model.KEY`` when it
    cannot be loaded."""
    import keras_hub

    try:
        return keras_hub.models.Backbone.from_preset(preset, **kwargs)
    except (ValueError, FileNotFoundError, OSError) as e:
        raise InputError(f"model.{key}: cannot load keras-hub preset {preset}: "
                         f"{str(e).splitlines()[0][:200]}") from None


def image_converter(preset: str, key: str) -> tuple:
    """``(size, scale, offset)`` of the preset's image converter, the scale and offset as float32 arrays; a preset
    without one reads pixels scaled to [0, 1] at no size of its own (None), which the log says naming ``model.KEY``."""
    import keras_hub

    try:
        converter = keras_hub.layers.ImageConverter.from_preset(preset)
        size, scale, offset = converter.image_size, converter.scale, converter.offset
    except (ValueError, FileNotFoundError, OSError):
        size, scale, offset = None, 1.0 / 255.0, 0.0
        log.info("model.%s %s has no image converter: pixels scaled to [0, 1]", key, preset)
    return (size, np.asarray(1.0 if scale is None else scale, np.float32),
            np.asarray(0.0 if offset is None else offset, np.float32))


FAMILIES = ("ViTBackbone", "CLIPBackbone", "SigLIPBackbone", "DINOV2Backbone")  # keras_hub.models' classes read


def preset_names() -> list[str]:
    """keras-hub's preset names of the vision backbones this encoder reads (ViT, CLIP, SigLIP, DINOv2)."""
    import keras_hub

    return sorted({name for family in FAMILIES for name in getattr(keras_hub.models, family).presets})


class KerasHub(ImageEncoder):
    """A keras-hub vision backbone's tokens (module docstring)."""

    settings_class = KerasHubSettings
    incompatible_keys = ("encoder_preset",)
    path_keys = ("encoder_preset",)
    tiny_settings = {}  # the contract tests write a tiny preset of each family into a temporary folder

    @classmethod
    def random_weights(cls, cfg, settings) -> bool:
        return False  # its preset's

    def check(self) -> None:
        preset = self.settings.encoder_preset
        if not preset:
            raise InputError("model.encoder: keras_hub needs model.encoder_preset: a keras-hub preset name or a "
                             "local preset folder")
        check_preset_folder(preset, "encoder_preset")
        names = [] if _is_path(preset) or "://" in preset else preset_names()
        if names and preset not in names:
            near = difflib.get_close_matches(preset, names, n=1, cutoff=0.6)
            hint = f" (did you mean {near[0]}?)" if near else ""
            raise InputError(f"model.encoder_preset: {preset!r} is not a keras-hub ViT, CLIP, SigLIP or DINOv2 preset"
                             f"{hint}; it must be one of: "
                             f"{', '.join(names)}; a local preset folder; or a kaggle://, hf:// or "
                             "modelscope:// handle")
        if (self.cfg.encoder_weights or "none") != "none":
            raise InputError("model.encoder_weights: a keras_hub encoder's weights are its preset's "
                             "(model.encoder_preset); leave model.encoder_weights: none")

    def _load(self):
        preset = self.settings.encoder_preset
        backbone = load_backbone(preset, "encoder_preset", load_weights=not self.restoring)
        vision = getattr(backbone, "vision_encoder", backbone)  # CLIP, SigLIP: the vision tower
        if len(vision.inputs) != 1 or len(vision.inputs[0].shape) != 4:  # images [B, H, W, C] in
            raise InputError(f"model.encoder_preset: {preset} holds a {type(backbone).__name__}, not a vision backbone "
                             "(the keras_hub encoder reads ViT, CLIP, SigLIP and DINOv2 presets)")
        size, scale, offset = image_converter(preset, "encoder_preset")
        shape = tuple(vision.inputs[0].shape[1:3])  # what the backbone takes (None: any size)
        if size is not None and None not in shape and tuple(size) != shape:
            log.warning("model.encoder_preset %s: its image converter's size is %s px but its backbone reads %s px: "
                        "images are resized to the backbone's %s", preset, " × ".join(map(str, size)),
                        " × ".join(map(str, shape)), " × ".join(map(str, shape)))
            size = shape
        size = tuple(size) if size is not None else shape
        if None in size:
            raise InputError(f"model.encoder_preset: {preset} declares no image size")
        return vision, size, scale, offset

    def backbone(self, pooled: bool) -> keras.Model:
        vision, self.preset_size, self.scale, self.offset = self._load()
        patch = getattr(vision, "patch_size", None)
        self.patch = tuple(patch) if isinstance(patch, (tuple, list)) else (patch, patch) if patch else None
        tokens = next(layer.output for layer in reversed(vision.layers) if len(layer.output.shape) == 3)
        if tuple(self.preset_size) != (self.image_size, self.image_size):
            log.info("model.encoder_preset reads %s px: data.image_size %d is resized to it inside the encoder",
                     " × ".join(map(str, self.preset_size)), self.image_size)
        return keras.Model(vision.inputs, tokens, name="keras_hub")

    def preprocess(self, pixels):
        height, width = self.preset_size
        if (height, width) != (self.image_size, self.image_size):
            pixels = keras.ops.image.resize(pixels, (height, width), interpolation="bilinear")
        return pixels * self.scale + self.offset

    def layout_of(self, tokens: int) -> TokenLayout | None:
        if self.patch is None:
            return None
        return TokenLayout.of(tokens, self.preset_size[0] // self.patch[0], self.preset_size[1] // self.patch[1])

    def pool(self, tokens):
        if self.layout is not None and self.layout.prefix:
            return keras.layers.Lambda(lambda t: t[:, 0], name="class_token")(tokens)
        return super().pool(tokens)
