"""The encoder interface: what the decoders, training, region pooling and export know of an image encoder.

An encoder class (a subclass of :class:`ImageEncoder`, registered in :data:`captioning.model.encoders.ENCODERS`
under ``model.encoder``'s name) declares, as class attributes and methods:

* :attr:`~ImageEncoder.settings_class` — a dataclass of its own settings, ``model.<name>`` keys beside the
  decoder's (``model.vit_layers``, ``model.encoder_preset``), typed and checked as the config loads into the
  model stage (:func:`captioning.model.resolve`), each with its default and range;
* :attr:`~ImageEncoder.incompatible_keys` — which of them change its variables' shapes (a model folder
  refuses a config that changes them), and :meth:`~ImageEncoder.shapes_follow_image_size` — whether
  ``data.image_size`` does (``small_cnn`` flattens its map when pooled; a ViT's position embeddings);
* :attr:`~ImageEncoder.can_train` — whether ``model.encoder_trainable: true`` may fine-tune it, and
  :meth:`~ImageEncoder.random_weights` — whether nothing would bring its weights;
* :attr:`~ImageEncoder.tiny_settings` and :attr:`~ImageEncoder.tiny_image_size` — an instance small enough
  for the contract tests (tests/test_encoders.py) to build and step with every decoder in a second;
* :meth:`~ImageEncoder.check` — the rules between its settings and the image size (one-line errors);
* :meth:`~ImageEncoder.preprocess` — pixels (float, 0 to 255) to what its backbone reads (its own
  normalisation, and a resize when it reads a size of its own); every encoder gets from it and its image size
  :meth:`~ImageEncoder.preprocessor`, its :class:`~captioning.data.preprocessor.ImagePreprocessor` (resize, crop,
  normalise), which every path an image takes into the model uses;
* :meth:`~ImageEncoder.backbone` — the Keras model from preprocessed pixels to its feature map
  ``[B, h, w, D]`` or its tokens ``[B, N, D]`` (or, ``pooled``, a vector ``[B, D]``);
* :meth:`~ImageEncoder.layout_of` — where its ``N`` tokens sit (a :class:`~captioning.model.layout.TokenLayout`:
  prefix tokens such as a class token, then rows × columns), or None.

An instance is built once, by :func:`captioning.model.encoders.build_encoder` from ``model.encoder``, and
handed to the decoder, which reads :attr:`ImageEncoder.model` (pixels ``[B, S, S, 3]`` in [0, 255] →
pooled ``[B, D]`` or tokens ``[B, N, D]``, as the decoder's ``features`` asks) and the token set's
:attr:`~ImageEncoder.tokens`, :attr:`~ImageEncoder.width` and :attr:`~ImageEncoder.layout`. Whatever the
decoder reads, :meth:`ImageEncoder.tokens_model` gives the token set of the same weights: what region
pooling (``captioning features extract --model-dir``) reads, a Show and Tell model's included.

A frozen encoder (``model.encoder_trainable: false``) always runs in inference mode, so its batch-norm
statistics never move. A trainable encoder's batch norm computes its statistics over the global batch under
data parallelism (``model.sync_batch_norm``, on by default): with 32 images split over 8 GPUs, 4 images per
replica would give useless statistics.
"""

from __future__ import annotations

import dataclasses
import os

import keras
import numpy as np
from keras import layers

from captioning.config import ModelConfig
from captioning.config.settings import section_from
from captioning.data.preprocessor import ImagePreprocessor
from captioning.errors import InputError
from captioning.model.layout import TokenLayout


@dataclasses.dataclass
class NoSettings:
    """The settings of a component that has none of its own."""


def all_layers(model):
    """Every layer of ``model``, nested models' layers included (public ``.layers`` only)."""
    for layer in model.layers:
        yield layer
        if isinstance(layer, keras.Model):
            yield from all_layers(layer)


class ImageEncoder:
    """Base class of every image encoder (see the module docstring). ``name`` is set by the registry."""

    name: str = ""
    settings_class: type = NoSettings
    incompatible_keys: tuple[str, ...] = ()
    can_train: bool = True
    tiny_settings: dict = {}
    tiny_image_size: int = 32

    def __init__(self, cfg: ModelConfig, image_size: int, settings=None, pooled: bool = False,
                 restoring: bool = False):
        """``pooled``: :attr:`model` gives one vector an image (a decoder of pooled features), else the token
        set. ``restoring``: a checkpoint brings the weights, so none are loaded (nothing downloads)."""
        self.cfg, self.image_size, self.pooled, self.restoring = cfg, image_size, pooled, restoring
        if settings is None and cfg.typed:
            settings = cfg.encoder_settings
        elif settings is None:  # a model section not typed yet (built alone): its own keys, typed by its class
            own = {f.name for f in dataclasses.fields(self.settings_class)}
            settings = section_from(self.settings_class, {k: v for k, v in cfg.options.items() if k in own}, "model.")
        self.settings = settings
        self.trainable = cfg.encoder_trainable
        if self.trainable and not self.can_train:
            raise InputError(f"model.encoder {self.name} cannot be trained: set model.encoder_trainable: false")
        self.check()
        self._backbone = self.backbone(pooled)
        self._backbone.trainable = self.trainable
        if self.trainable and cfg.sync_batch_norm:
            for layer in all_layers(self._backbone):
                if isinstance(layer, layers.BatchNormalization):
                    layer.synchronized = True  # read at call time: all-reduced moments across replicas
        # the token set first: its size from one image (a static shape may not know it: keras-hub's SigLIP)
        trunk = self._trunk()
        self._map_shape = tuple(trunk.output.shape[1:3]) if len(trunk.output.shape) == 4 else None
        tokens_model = self._assemble(trunk, pooled=False)
        probe = tokens_model(np.zeros((1, image_size, image_size, 3), "uint8"), training=False)
        self.tokens, self.width = int(probe.shape[1]), int(probe.shape[2])
        self.layout = self.layout_of(self.tokens)
        self.model = self._assemble(self._backbone, pooled) if pooled else tokens_model
        self._tokens_model = tokens_model
        self.depth = int(self.model.output.shape[-1])  # of what the decoder reads: a token, or the pooled vector

    # ---- what a subclass declares ----------------------------------------------------------------------
    path_keys: tuple[str, ...] = ()  # settings naming files or folders: made absolute when a run starts

    @classmethod
    def random_weights(cls, cfg: ModelConfig, settings) -> bool:
        """Whether it would be built with random weights: no file, ImageNet download or preset brings them (the
        default: ``model.encoder_weights: none``). ``captioning features extract --config`` refuses such an
        encoder (its regions would be noise)."""
        return (cfg.encoder_weights or "none") == "none"

    @classmethod
    def shapes_follow_image_size(cls, settings, pooled: bool) -> bool:
        """Whether its variables' shapes follow ``data.image_size`` (a checkpoint then fits one size only)."""
        return False

    def check(self) -> None:
        """The rules between its settings and ``self.image_size``: an InputError (one line) when broken."""

    # Float pixels ``[B, S, S, 3]`` in [0, 255] → what the backbone reads: a method of the subclass, or None when
    # the backbone reads them as they are (or normalises them itself).
    preprocess = None

    def backbone(self, pooled: bool) -> keras.Model:
        """The Keras model from preprocessed pixels to its map ``[B, h, w, D]`` or tokens ``[B, N, D]``, or with
        ``pooled`` (allowed to) a vector ``[B, D]``: a vector is pooled by :meth:`pool` otherwise."""
        raise NotImplementedError

    def layout_of(self, tokens: int) -> TokenLayout | None:
        """Where its ``tokens`` tokens sit (the default: the map the backbone gave, when it gave one)."""
        return self._map_shape and TokenLayout.of(tokens, *self._map_shape)

    def pool(self, tokens):
        """Tokens ``[B, N, D]`` → one vector ``[B, D]`` (the default: their mean; a class token's encoder
        takes the class token, as ViT and CLIP do)."""
        return layers.GlobalAveragePooling1D(name="pool")(tokens)

    # ---- what every encoder gets -------------------------------------------------------------------------
    def preprocessor(self, resize_size: int) -> ImagePreprocessor:
        """Its image preprocessor (:mod:`captioning.data.preprocessor`): images squashed to ``resize_size``
        (``data.resize_size``, the data's margin around the crop), cropped to its image size, normalised by its
        :meth:`preprocess` (the first layer of :attr:`model`). The input pipeline, the captioner, the server, the
        SavedModel and the LiteRT graph all crop with it."""
        return ImagePreprocessor(self.image_size, resize_size, self.preprocess)

    def _assemble(self, backbone: keras.Model, pooled: bool) -> keras.Model:
        inputs = keras.Input((self.image_size, self.image_size, 3), name="image")
        x = layers.Lambda(lambda t: keras.ops.cast(t, "float32"), name="to_float")(inputs)
        if self.preprocess is not None:  # the preprocessor's normalisation (its sizes do not enter it)
            x = layers.Lambda(self.preprocessor(self.image_size).normalised, name="preprocess")(x)
        # A frozen encoder is called in inference mode, so batch norm keeps its statistics.
        features = backbone(x, training=None if self.trainable else False)
        if len(features.shape) == 4 and not pooled:  # [batch, h, w, D] → [batch, h·w, D], row by row
            features = layers.Reshape((-1, features.shape[-1]), name="cells")(features)
        if pooled and len(features.shape) == 3:
            features = self.pool(features)
        return keras.Model(inputs, features, name=f"encoder_{self.name}")

    def _trunk(self) -> keras.Model:
        """The backbone up to its last layer whose output is a map or tokens (itself when that is its output)."""
        backbone = self._backbone
        if len(backbone.output.shape) in (3, 4):
            return backbone
        inner = next((layer.output for layer in reversed(backbone.layers) if len(layer.output.shape) in (3, 4)), None)
        if inner is None:
            raise InputError(f"model.encoder {self.name} gives no feature map or tokens")
        return keras.Model(backbone.input, inner, name=f"{backbone.name}_map")

    def tokens_model(self) -> keras.Model:
        """Pixels → the token set ``[B, N, D]``, of the same weights as :attr:`model` (region pooling reads it)."""
        return self._tokens_model

    @classmethod
    def source(cls, cfg: ModelConfig, image_size: int, settings) -> dict:
        """What a features store records of the encoder its regions were pooled with: the encoder, its weights
        (a file by its absolute path), the image size and its own settings. Two equal ones build the same
        encoder (random weights, ``none``, are never the same twice)."""
        weights = cfg.encoder_weights or "none"
        if weights not in ("none", "imagenet"):
            weights = os.path.abspath(weights)
        return {"encoder": cfg.encoder, "encoder_weights": weights, "image_size": image_size,
                **dataclasses.asdict(settings)}

    def describe(self) -> dict:
        """:meth:`source` of this encoder."""
        return self.source(self.cfg, self.image_size, self.settings)

    @classmethod
    def same_tokens(cls, pooled_a: bool, pooled_b: bool) -> bool:
        """Whether the token sets of two models of this encoder with equal weights are the same, one built for a
        decoder of pooled features or not (``pooled_a``) and the other (``pooled_b``): a model reading regions
        pooled from one can pool new images' regions with the other."""
        return True
