"""im2txt's colour distortions on the device: one draw per image, valid colours, im2txt's ranges."""

import numpy as np
import tensorflow as tf

from captioning.data.augment import BRIGHTNESS, color_jitter


def test_each_image_gets_its_own_distortion_within_im2txts_ranges():
    rng = np.random.default_rng(0)
    image = rng.integers(0, 256, (1, 24, 24, 3), dtype=np.uint8)
    batch = tf.constant(np.repeat(image, 16, axis=0))
    out = color_jitter(batch).numpy()
    assert out.shape == (16, 24, 24, 3) and out.dtype == np.uint8
    assert len({o.tobytes() for o in out}) == 16  # per image, not one draw for the whole batch
    assert not np.array_equal(color_jitter(batch).numpy(), out)  # stateful: new draws each call


def test_seeded_draws_repeat():
    batch = tf.constant(np.random.default_rng(1).integers(0, 256, (4, 8, 8, 3), dtype=np.uint8))
    seed = tf.constant([3, 4], tf.int64)
    np.testing.assert_array_equal(color_jitter(batch, seed).numpy(), color_jitter(batch, seed).numpy())


def test_gray_stays_gray_and_a_flat_image_only_moves_by_the_brightness_shift():
    # Saturation and hue leave gray alone and contrast leaves a flat image alone: only brightness acts.
    flat = tf.fill([64, 6, 6, 3], tf.constant(128, tf.uint8))
    out = color_jitter(flat).numpy().astype(int)
    assert (out == out[:, :1, :1, :1]).all()  # every pixel and channel of an image equal: still gray, flat
    shifts = out[:, 0, 0, 0] - 128
    limit = round(BRIGHTNESS * 255)
    assert shifts.min() >= -limit and shifts.max() <= limit
    assert shifts.max() - shifts.min() > limit  # the draws spread over the range


def test_saturation_and_hue_change_colour_images():
    red = np.zeros((32, 4, 4, 3), np.uint8)
    red[..., 0] = 200
    red[..., 1] = 40
    out = color_jitter(tf.constant(red)).numpy().astype(int)
    spread = out[..., 0] - out[..., 1]  # saturation scales the gap between the channels
    assert spread.min() > 0 and spread.max() - spread.min() > 40
