"""Image encoders behind one registry: ``model.encoder`` names one of :data:`ENCODERS`.

An encoder is a class (:class:`~captioning.model.encoders.base.ImageEncoder`, whose docstring has the interface)
in a module of this package, plus one entry here; nothing outside its module names it. :func:`build_encoder` is
the one place an encoder is built, for :func:`captioning.model.build_model` (which hands it to the decoder) and
for region extraction. tests/test_encoders.py runs the contract over every entry × every decoder, and registers
a toy encoder written in a temporary folder.

======================  ==========================================================  ===================
``model.encoder``       what it is                                                  tokens (its layout)
======================  ==========================================================  ===================
``small_cnn``           four strided convolutions, for CPU work                     4 × 4 at 64 px
``inception_v3``        keras.applications (im2txt's encoder)                       8 × 8 at 299 px
``resnet50``            keras.applications                                          7 × 7 at 224 px
``efficientnet_b0``     keras.applications                                          7 × 7 at 224 px
``mobilenet_v2``        keras.applications                                          7 × 7 at 224 px
``vit``                 a Vision Transformer trained from pixels (keras-hub)        1 + 8 × 8 at 64 px
``keras_hub``           a keras-hub preset: ViT, CLIP, SigLIP, DINOv2 vision towers 1 + 14 × 14 (B/16)
``vlm``                 an image-text preset's vision tower (PaliGemma's SigLIP)    16 × 16 at 224 px
======================  ==========================================================  ===================
"""

from __future__ import annotations

import contextlib
import random

from captioning.config import ModelConfig
from captioning.model.encoders.applications import EfficientNetB0, InceptionV3, MobileNetV2, ResNet50
from captioning.model.encoders.base import ImageEncoder, NoSettings, all_layers
from captioning.model.encoders.keras_hub import KerasHub
from captioning.model.encoders.small_cnn import SmallCnn
from captioning.model.encoders.vision_language import VisionLanguageEncoder
from captioning.model.encoders.vit import ViT
from captioning.config.settings import registered

ENCODERS: dict[str, type[ImageEncoder]] = {
    "inception_v3": InceptionV3, "resnet50": ResNet50, "efficientnet_b0": EfficientNetB0,
    "mobilenet_v2": MobileNetV2, "small_cnn": SmallCnn, "vit": ViT, "keras_hub": KerasHub,
    "vlm": VisionLanguageEncoder}


def register(name: str, cls: type[ImageEncoder]) -> None:
    """Adds encoder ``cls`` as ``model.encoder: name`` (what an entry above is; tests register a toy one)."""
    cls.name = name
    ENCODERS[name] = cls


for _name, _cls in list(ENCODERS.items()):
    register(_name, _cls)


def encoder_class(name: str) -> type[ImageEncoder]:
    """The registered encoder ``name``; an InputError naming ``model.encoder`` and the choices otherwise."""
    return registered(ENCODERS, "model.encoder", name)


def build_encoder(cfg: ModelConfig, image_size: int, settings=None, pooled: bool = False,
                  restoring: bool = False, seed: int | None = None) -> ImageEncoder:
    """The encoder ``cfg.encoder`` names, built: its :attr:`~ImageEncoder.model` gives pooled features
    ``[B, D]`` with ``pooled``, else its token set ``[B, N, D]``. ``settings``: its own (default: read from
    ``cfg.options``); ``restoring``: a checkpoint brings the weights (none are loaded).

    ``seed``: the initial weights' (those no file or checkpoint brings). Keras gives a layer built without
    a seed (every layer of keras.applications, keras-hub and small_cnn) one drawn from Python's ``random``,
    whose state depends on all the process did before; with ``seed`` that draw is seeded for the build (and
    the state restored after), so one seed gives one encoder in every process and every build:

    >>> from captioning.config import ModelConfig
    >>> def kernel(seed):
    ...     encoder = build_encoder(ModelConfig(encoder="small_cnn"), 32, seed=seed)
    ...     return encoder.model.get_layer("small_cnn").get_layer("conv0").kernel.numpy()
    >>> import numpy as np; (np.array_equal(kernel(1), kernel(1)), np.array_equal(kernel(1), kernel(2)))
    (True, False)
    """
    with python_random_seeded(seed):
        return encoder_class(cfg.encoder)(cfg, image_size, settings=settings, pooled=pooled, restoring=restoring)


@contextlib.contextmanager
def python_random_seeded(seed: int | None):
    """Python's ``random`` seeded with ``seed`` inside the block and its state restored after; nothing
    when ``seed`` is None."""
    if seed is None:
        yield
        return
    state = random.getstate()
    random.seed(seed)
    try:
        yield
    finally:
        random.setstate(state)


__all__ = ["ENCODERS", "ImageEncoder", "NoSettings", "all_layers", "build_encoder", "encoder_class", "register"]
