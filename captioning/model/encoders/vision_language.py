"""``model.encoder: vlm``: the vision tower of a keras-hub image-text model (``model.vlm_preset``: PaliGemma, Gemma 3;
the families of :mod:`captioning.model.vision_language`), whose image tokens are already at its language model's width.

It is the encoder ``model.decoder: vlm`` reads (that decoder refuses any other): the preset is loaded once, here,
and the decoder takes its language model from this encoder (:attr:`VisionLanguageEncoder.family`), so the weights
are in memory once and a checkpoint holds each of them once. Any other decoder can read its tokens too (a
Transformer over PaliGemma's SigLIP patches, projected to Gemma's width).

The preset's image converter (``image_converter.json``) gives its image size and normalisation (PaliGemma: 224 px
scaled to [-1, 1]), applied inside the encoder as ``model.encoder: keras_hub`` does: pixels are resized to the
preset's size when ``data.image_size`` differs (set it to the preset's to skip that). Frozen by default
(``model.encoder_trainable: false``: the issue's and keras-hub's PaliGemma guide's choice; the vision tower's
weights stay bit-identical through training); with ``model.encoder_trainable: true`` it is fine-tuned at
``train.encoder_lr_scale`` times the learning rate.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import keras

from captioning.errors import InputError
from captioning.model.encoders.keras_hub import (KerasHub, check_preset_folder, image_converter,
                                                 load_backbone)
from captioning.model.layout import TokenLayout
from captioning.model.vision_language import family_of

log = logging.getLogger("captioning.model")


@dataclass
class VisionTowerSettings:
    """``model.encoder: vlm``'s own key (``model.decoder: vlm`` reads it too: one preset for both)."""

    # a keras-hub image-text preset folder (save_to_preset's) or preset name
    vlm_preset: str = ""


def check_vlm_preset(preset: str) -> None:
    """An InputError (one line) for no preset, or a folder that is none."""
    if not preset:
        raise InputError("model.vlm_preset is not set: a keras-hub PaliGemma preset folder (save_to_preset's) or "
                         "preset name, e.g. --set model.vlm_preset=runs/paligemma")
    check_preset_folder(preset, "vlm_preset")


class VisionLanguageEncoder(KerasHub):
    """The vision tower of an image-text preset (module docstring)."""

    settings_class = VisionTowerSettings
    incompatible_keys = ()  # another preset of other shapes: the restore's shape check
    path_keys = ("vlm_preset",)
    tiny_settings = {}  # the tests write a tiny preset into a temporary folder

    def check(self) -> None:
        check_vlm_preset(self.settings.vlm_preset)
        if (self.cfg.encoder_weights or "none") != "none":
            raise InputError("model.encoder_weights: a vlm encoder's weights are its preset's (model.vlm_preset); "
                             "leave model.encoder_weights: none")

    def _load(self):
        preset = self.settings.vlm_preset
        # under the run's precision policy: mixed precision keeps float32 variables
        backbone = load_backbone(preset, "vlm_preset", load_weights=not self.restoring,
                                 dtype=keras.config.dtype_policy().name)
        self.family = family_of(backbone, preset)
        vision = self.family.vision()
        _, scale, offset = image_converter(preset, "vlm_preset")
        size = tuple(int(s) for s in vision.inputs[0].shape[1:3])  # the only size its position embeddings take
        return vision, size, scale, offset

    def backbone(self, pooled: bool) -> keras.Model:
        vision, self.preset_size, self.scale, self.offset = self._load()
        if tuple(self.preset_size) != (self.image_size, self.image_size):
            log.info("model.vlm_preset reads %s px: data.image_size %d is resized to it inside the encoder",
                     " × ".join(map(str, self.preset_size)), self.image_size)
        return vision

    def layout_of(self, tokens: int) -> TokenLayout | None:
        grid = self.family.grid()
        return None if grid is None else TokenLayout.of(tokens, *grid)

    def pool(self, tokens):
        return keras.layers.GlobalAveragePooling1D(name="pool")(tokens)  # no class token: the patches' mean
