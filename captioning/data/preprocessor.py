"""The image preprocessor: the one place an image's geometry is written (squashed to a square, cropped) and
where its normalisation is named, for every path an image takes into a model: the training and evaluation
input (:mod:`captioning.data.pipeline` and its caches), the captioner (``caption``, ``serve``, the SavedModel's
signatures) and the LiteRT graph.

**It belongs to the encoder**, as keras-hub's image converter travels with its backbone:
:meth:`captioning.model.encoders.base.ImageEncoder.preprocessor` returns the one of its image size
(``data.image_size``) with its own normalisation (its ``preprocess``), and a trained model's is
:attr:`captioning.model.folder.TrainedModel.preprocessor`. The margin around the crop (``data.resize_size``:
how far training's random crops may move) is the data's setting, handed to the encoder's method.

**Why it is defined here, in the data stage.** The data stage comes before the model stage
(``captioning.STAGES``) and may not import the encoder, yet its pipeline resizes and crops. So the
preprocessor is this small object of the data stage, which the encoder (a later stage) returns and the
pipeline is handed as an argument: ``make_dataset(..., preprocessor=)``, ``image_dataset``, ``eval_images``
(training and evaluation pass their model's). A caller without a model (the input benchmark, the pipeline's
tests) gets the same geometry from the data settings, :meth:`ImagePreprocessor.of`, without a normalisation:
the pipeline never normalises (below).

The stages, in the order an image meets them:

1. :meth:`~ImagePreprocessor.resized`: any ``uint8 [H, W, 3]`` → ``uint8 [R, R, 3]``, R = ``resize_size``,
   squashed to the square (the aspect not kept, as im2txt resized to 346²), bilinear with half-pixel
   centres, rounded and clipped. What ``data.cache: disk`` and ``memory`` hold.
2. :meth:`~ImagePreprocessor.cropped`: the central ``S × S`` window, S = ``image_size`` (evaluation,
   captions, exports, ``data.cache: features``). Training draws its window instead
   (:meth:`~ImagePreprocessor.random_cropped`, or :meth:`~ImagePreprocessor.crop_window` while decoding).
3. :meth:`~ImagePreprocessor.normalised`: float pixels in [0, 255] → what the encoder's backbone reads. It is
   the first layer of the encoder's Keras model (after a cast), so it runs on the device after the host sent
   ``uint8`` (4× fewer bytes than float32) and is inside every graph that encodes (the SavedModel, the
   LiteRT file).

:meth:`~ImagePreprocessor.pixels` is 1 then 2: the ``uint8`` crop every path hands the model to caption it.
The LiteRT graph asks for it with ``builtin_ops=True``: the same resize written in LiteRT built-in ops, to
the same pixels (:func:`resize_in_builtin_ops`). Two preprocessors of the same sizes are equal (their
normalisation aside: it runs inside each model), so models of one ensemble that crop alike share the crop.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import tensorflow as tf


def resize(image: tf.Tensor, size: int) -> tf.Tensor:
    """Any ``[H, W, 3]`` image → ``uint8 [size, size, 3]``: squashed to the square, bilinear (half-pixel centres,
    no antialiasing), rounded and clipped. The one resize kernel: the preprocessor's, and a model reading
    regions squashes the whole image to its size with it."""
    image = tf.image.resize(image, [size, size], method="bilinear", antialias=False)
    return tf.cast(tf.clip_by_value(tf.round(image), 0.0, 255.0), tf.uint8)


def resize_in_builtin_ops(image: tf.Tensor, size: int) -> tf.Tensor:
    """``uint8 [H, W, 3]`` → ``uint8 [size, size, 3]``: :func:`resize` in LiteRT built-in ops, to the same pixels.
    TensorFlow's ``ResizeBilinear`` (half-pixel centres) is written out step by step, in its kernel's order: for
    each output row and column ``at = (i + 0.5) · (H / size) - 0.5``, the neighbours ``max(floor(at), 0)`` and
    ``min(ceil(at), H - 1)``, the weight ``at - floor(at)``; then ``top = tl + (tr - tl)·x``, ``bottom = bl + (br -
    bl)·x``, ``top + (bottom - top)·y``, all float32. Each step is one IEEE operation in either runtime, so the
    rounded pixels are TensorFlow's exactly. LiteRT's own ``RESIZE_BILINEAR`` weighs the four neighbours in another
    order: its float32 results differ in the last bits, and where TensorFlow's value lies at x.5 they round to
    another ``uint8`` (116 of 200 synthetic images had pixels off by one, 2026-11-26), which moved the model's
    log-probabilities by up to 2e-3 and flipped near-tie captions. (The pipeline keeps TensorFlow's kernel: this
    spelling decodes and resizes 640×480 photos to 346² about 30% slower, measured 2026-11-28.)"""
    pixels = tf.cast(image, tf.float32)
    shape = tf.shape(image)

    def axis(length):  # TensorFlow's compute_interpolation_weights with its HalfPixelScaler
        # the divisor is made of the image's size (min(length, 0) is 0): the converter turns a division by a constant
        # into a product with its reciprocal, which rounds differently for 221 of the heights 1-1,999 (measured)
        divisor = tf.cast(tf.minimum(length, 0) + size, tf.float32)
        at = (tf.range(size, dtype=tf.float32) + 0.5) * (tf.cast(length, tf.float32) / divisor) - 0.5
        low = tf.floor(at)
        last = tf.cast(length - 1, tf.float32)
        return (tf.cast(tf.maximum(low, 0.0), tf.int32), tf.cast(tf.minimum(tf.math.ceil(at), last), tf.int32),
                at - low)

    (y0, y1, y), (x0, x1, x) = axis(shape[0]), axis(shape[1])
    x = x[None, :, None]
    top_rows, bottom_rows = tf.gather(pixels, y0), tf.gather(pixels, y1)  # only the rows read: [size, W, 3]
    top_left, top_right = tf.gather(top_rows, x0, axis=1), tf.gather(top_rows, x1, axis=1)
    bottom_left, bottom_right = tf.gather(bottom_rows, x0, axis=1), tf.gather(bottom_rows, x1, axis=1)
    top = top_left + (top_right - top_left) * x
    bottom = bottom_left + (bottom_right - bottom_left) * x
    resized = top + (bottom - top) * y[:, None, None]
    return tf.cast(tf.clip_by_value(tf.round(resized), 0.0, 255.0), tf.uint8)


@dataclasses.dataclass(frozen=True)
class ImagePreprocessor:
    """An encoder's image geometry and normalisation (see the module docstring): ``image_size`` the side of the
    square the encoder reads, ``resize_size`` the side of the square an image is squashed to first (at least
    ``image_size``), ``normalise`` the encoder's own normalisation of float pixels in [0, 255] (None: it reads them
    as they are). Equal preprocessors (their sizes) give equal pixels."""

    image_size: int
    resize_size: int
    normalise: Callable | None = dataclasses.field(default=None, compare=False, repr=False)

    def __post_init__(self):
        if not 1 <= self.image_size <= self.resize_size:
            raise ValueError(f"an image of {self.resize_size}² cannot be cropped to {self.image_size}²")

    @classmethod
    def of(cls, data_cfg) -> ImagePreprocessor:
        """The geometry ``data.image_size`` and ``data.resize_size`` give, without an encoder's normalisation: for
        a caller without a model (an encoder's :meth:`~captioning.model.encoders.base.ImageEncoder.preprocessor`
        of the same settings crops the same pixels)."""
        return cls(data_cfg.image_size, data_cfg.resize_size)

    def resized(self, image: tf.Tensor, builtin_ops: bool = False) -> tf.Tensor:
        """Stage 1: ``[H, W, 3]`` → ``uint8 [R, R, 3]``; ``builtin_ops``: in LiteRT built-in ops (the same pixels)."""
        return (resize_in_builtin_ops if builtin_ops else resize)(image, self.resize_size)

    def cropped(self, image: tf.Tensor) -> tf.Tensor:
        """Stage 2: the central ``S × S`` window of a resized image (``[R, R, 3]``; any ``[H, W, C]`` of at least
        S × S)."""
        top = (tf.shape(image)[0] - self.image_size) // 2
        left = (tf.shape(image)[1] - self.image_size) // 2
        return tf.image.crop_to_bounding_box(image, top, left, self.image_size, self.image_size)

    def pixels(self, image: tf.Tensor, builtin_ops: bool = False) -> tf.Tensor:
        """Stages 1 and 2: a decoded ``uint8 [H, W, 3]`` image → the ``uint8 [S, S, 3]`` central crop a model
        captions (the pipeline's evaluation crop, the captioner's, the server's, the exports')."""
        return self.cropped(self.resized(image, builtin_ops))

    def random_cropped(self, image: tf.Tensor, seed: tf.Tensor) -> tf.Tensor:
        """Training's crop of a resized image: an ``S × S`` window drawn from ``seed`` (stateless)."""
        return tf.image.stateless_random_crop(image, [self.image_size, self.image_size, 3], seed)

    def crop_window(self, height: tf.Tensor, width: tf.Tensor, seed: tf.Tensor) -> tf.Tensor:
        """Training's random ``S × S`` crop of an ``height × width`` image resized to ``R × R``, as the window of the
        image itself (``int32 [y, x, window height, window width]``, drawn from ``seed``): resizing H×W to R×R and
        cropping S×S at (y, x) is cropping the H·S/R × W·S/R window at (y·H/R, x·W/R) and resizing that to S×S
        (:meth:`window_resized`), so a decoder can skip the pixels outside it."""
        def side(length):
            scaled = tf.round(tf.cast(length * self.image_size, tf.float32) / self.resize_size)
            return tf.clip_by_value(tf.cast(scaled, tf.int32), 1, length)

        window_height, window_width = side(height), side(width)
        for_y, for_x = tf.unstack(tf.random.experimental.stateless_split(seed, 2))
        top = tf.random.stateless_uniform([], for_y, 0, height - window_height + 1, dtype=tf.int32)
        left = tf.random.stateless_uniform([], for_x, 0, width - window_width + 1, dtype=tf.int32)
        return tf.stack([top, left, window_height, window_width])

    def window_resized(self, window: tf.Tensor) -> tf.Tensor:
        """A :meth:`crop_window` cut out of an image → ``uint8 [S, S, 3]``."""
        return resize(window, self.image_size)

    def normalised(self, pixels: tf.Tensor) -> tf.Tensor:
        """Stage 3: float pixels in [0, 255] → what the encoder's backbone reads (the first layer of the encoder's
        model applies it: :meth:`captioning.model.encoders.base.ImageEncoder.preprocess`)."""
        return pixels if self.normalise is None else self.normalise(pixels)
