"""Tiny random keras-hub backbones of each family the ``keras_hub`` encoder reads (ViT, CLIP, SigLIP, DINOv2),
saved as keras-hub presets with ``save_to_preset`` — the format of a real preset folder, written in a second
instead of downloaded. Each has its image converter (image size and normalisation), as real presets do. And the
encoder contract's entries (every registered encoder, ``keras_hub`` once a family) with their tiny configs."""

from __future__ import annotations

import dataclasses
import os

from captioning.config import ModelConfig
from captioning.model import DECODERS
from captioning.model.encoders import ENCODERS
from tests.harness.models import PRESET_WRITERS

FAMILIES = ("vit", "clip", "siglip", "dinov2")
PATCH = 8


def _backbone(family: str, size: int):
    import keras_hub

    m = keras_hub.models
    shape = (size, size, 3)
    if family == "vit":
        return m.ViTBackbone(image_shape=shape, patch_size=PATCH, num_layers=1, num_heads=2, hidden_dim=16, mlp_dim=24)
    if family == "clip":
        vision = m.CLIPVisionEncoder(patch_size=PATCH, hidden_dim=16, num_layers=1, num_heads=2, intermediate_dim=24,
                                     image_shape=shape)
        text = m.CLIPTextEncoder(vocabulary_size=20, embedding_dim=16, hidden_dim=16, num_layers=1, num_heads=2,
                                 intermediate_dim=24, max_sequence_length=8)
        return m.CLIPBackbone(vision, text, projection_dim=8)
    if family == "siglip":
        vision = m.SigLIPVisionEncoder(patch_size=PATCH, hidden_dim=16, num_layers=1, num_heads=2, intermediate_dim=24,
                                       image_shape=shape)
        text = m.SigLIPTextEncoder(vocabulary_size=20, embedding_dim=16, hidden_dim=16, num_layers=1, num_heads=2,
                                   intermediate_dim=24, max_sequence_length=8)
        return m.SigLIPBackbone(vision, text)
    if family == "dinov2":
        return m.DINOV2Backbone(patch_size=PATCH, num_layers=1, hidden_dim=16, num_heads=2, intermediate_dim=24,
                                image_shape=shape, position_embedding_shape=shape, num_register_tokens=2)
    raise ValueError(family)


def write_preset(family: str, folder: str, size: int = 32, converter: bool = True) -> str:
    """A tiny random ``family`` backbone reading ``size`` px, saved as a keras-hub preset in ``folder``."""
    import keras
    import keras_hub

    keras.utils.set_random_seed(FAMILIES.index(family))
    os.makedirs(folder, exist_ok=True)
    _backbone(family, size).save_to_preset(folder)
    if converter:  # CLIP's normalisation: per channel, as its preset's converter gives it
        mean, std = (0.48, 0.46, 0.41), (0.27, 0.26, 0.28)
        keras_hub.layers.ImageConverter(image_size=(size, size), scale=[1 / (255 * s) for s in std],
                                        offset=[-m / s for m, s in zip(mean, std)]).save_to_preset(folder)
    return folder


HEAVY = ("inception_v3", "resnet50", "efficientnet_b0", "mobilenet_v2")  # ImageNet CNNs: the full suite only
ENTRIES = [n for n in sorted(ENCODERS) if n != "keras_hub"] + [f"keras_hub:{f}" for f in FAMILIES]


def entry_config(entry, presets, decoder="attention", **changes) -> tuple[ModelConfig, int]:
    """The model config of a contract entry (its tiny settings) and its image size."""
    name, _, family = entry.partition(":")
    cls = ENCODERS[name]
    options = {**cls.tiny_settings, **DECODERS[decoder].tiny_settings, **changes}
    for key in {f.name for f in dataclasses.fields(cls.settings_class)} & set(PRESET_WRITERS):
        options.setdefault(key, PRESET_WRITERS[key]())  # an encoder of a preset's (vlm): the tiny one
    if family:
        options["encoder_preset"] = presets[family]
    return ModelConfig(decoder=decoder, encoder=name, dropout=0.0, options=options), cls.tiny_image_size
