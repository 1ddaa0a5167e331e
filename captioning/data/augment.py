"""im2txt's colour distortions, applied to a whole batch on the accelerator inside the training step.

im2txt distorted every image on the host: brightness ±32/255, saturation ×[0.5, 1.5], hue ±0.032,
contrast ×[0.5, 1.5], in that order, then clipped to [0, 1]. On a 299² image that is ~3 ms of CPU
(float conversion, two HSV round trips) — as much as decoding the 640×480 JPEG — so on the host it
halves the input pipeline's throughput (``captioning benchmark input``). Here the same four
distortions run in the training step on the batch as it arrives on the device, with one random draw
per image (``tf.image.random_*`` would draw one per batch), where they cost a fraction of the CNN's
forward pass. The pipeline keeps the cheap per-image work: crop and flip.

One deliberate difference: values are clipped to [0, 1] after the brightness shift too, so the HSV
conversion always sees valid colours (``tf.image.adjust_saturation`` on out-of-range values is undefined
by its docs).
"""

from __future__ import annotations

import tensorflow as tf

BRIGHTNESS = 32.0 / 255.0
SATURATION = (0.5, 1.5)
HUE = 0.032
CONTRAST = (0.5, 1.5)


def color_jitter(images: tf.Tensor, seed: tf.Tensor | None = None) -> tf.Tensor:
    """``uint8 [B, H, W, 3]`` → distorted ``uint8 [B, H, W, 3]``, one random draw per image.

    ``seed`` (shape [2] int) makes the draws stateless and reproducible; without it they are stateful.
    """
    n = tf.shape(images)[0]

    def uniform(i, low, high):
        shape = [n, 1, 1, 1]
        if seed is None:
            return tf.random.uniform(shape, low, high)
        return tf.random.stateless_uniform(shape, seed + tf.constant([0, 1], seed.dtype) * i, low, high)

    x = tf.cast(images, tf.float32) / 255.0
    x = tf.clip_by_value(x + uniform(1, -BRIGHTNESS, BRIGHTNESS), 0.0, 1.0)
    hsv = tf.image.rgb_to_hsv(x)
    hue = tf.math.floormod(hsv[..., :1] + uniform(3, -HUE, HUE), 1.0)
    saturation = tf.clip_by_value(hsv[..., 1:2] * uniform(2, *SATURATION), 0.0, 1.0)
    x = tf.image.hsv_to_rgb(tf.concat([hue, saturation, hsv[..., 2:]], axis=-1))
    mean = tf.reduce_mean(x, axis=[1, 2], keepdims=True)
    x = (x - mean) * uniform(4, *CONTRAST) + mean
    return tf.saturate_cast(tf.round(tf.clip_by_value(x, 0.0, 1.0) * 255.0), tf.uint8)
