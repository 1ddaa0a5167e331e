"""ImageNet CNNs from ``keras.applications``: ``inception_v3`` (im2txt's), ``resnet50``, ``efficientnet_b0``,
``mobilenet_v2``; each with its own input preprocessing inside, its final map as tokens (Inception v3 at
299 px: 8 × 8 cells of 2,048; ResNet-50 at 224: 7 × 7 of 2,048), globally average-pooled for a decoder of
pooled features. Weights (``model.encoder_weights``): ``none`` (random), ``imagenet`` (downloads from the
Keras site: for users with internet, never in tests), or a path to a local weights file.
"""

from __future__ import annotations

import os

import keras

from captioning.errors import InputError
from captioning.model.encoders.base import ImageEncoder


class KerasApplication(ImageEncoder):
    """One ``keras.applications`` network: a subclass names its constructor and preprocessing module."""

    constructor: str = ""
    module: str = ""
    min_image_size: int = 32  # the network's smallest input (Keras refuses smaller ones)

    def check(self) -> None:
        weights = self.cfg.encoder_weights or "none"
        if weights not in ("none", "imagenet") and not os.path.isfile(weights):
            raise InputError(f"model.encoder_weights: {weights} is neither none, imagenet nor an existing file")
        if self.image_size < self.min_image_size:
            raise InputError(f"model.encoder {self.name} reads images of at least {self.min_image_size} px: "
                             f"data.image_size is {self.image_size}")

    def preprocess(self, pixels):
        return getattr(keras.applications, self.module).preprocess_input(pixels)

    def backbone(self, pooled: bool) -> keras.Model:
        weights = self.cfg.encoder_weights or "none"
        return getattr(keras.applications, self.constructor)(
            include_top=False, pooling="avg" if pooled else None, input_shape=(self.image_size, self.image_size, 3),
            weights=None if weights == "none" or self.restoring else weights)


class InceptionV3(KerasApplication):
    constructor, module, min_image_size = "InceptionV3", "inception_v3", 75
    tiny_image_size = 75


class ResNet50(KerasApplication):
    constructor, module = "ResNet50", "resnet50"


class EfficientNetB0(KerasApplication):
    constructor, module = "EfficientNetB0", "efficientnet"


class MobileNetV2(KerasApplication):
    constructor, module = "MobileNetV2", "mobilenet_v2"
