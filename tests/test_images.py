"""Every image quirk prepare must survive, each made for real with Pillow and decoded by TensorFlow."""

import io

import numpy as np
import pytest
import tensorflow as tf
from PIL import Image

from captioning.images import ImageError, process_image, target_size
from tests.conftest import encode, gradient


def decode(jpeg: bytes) -> np.ndarray:
    return tf.io.decode_jpeg(jpeg, channels=3).numpy()


def test_rgb_jpeg_is_kept_byte_for_byte():
    data = encode(gradient(), "JPEG", quality=90)
    out, h, w = process_image(data)
    assert out == data and (h, w) == (32, 48)


def exif_rotated_jpeg() -> bytes:
    exif = Image.Exif()
    exif[0x0112] = 6  # "rotate 90 CW to display"
    return encode(gradient(), "JPEG", exif=exif.tobytes())


def rgba_png() -> bytes:
    image = gradient().convert("RGBA")
    alpha = Image.new("L", image.size, 0)  # fully transparent: must come out white
    image.putalpha(alpha)
    return encode(image, "PNG")


QUIRKS = {
    "grayscale jpeg": (lambda: encode(gradient("L"), "JPEG"), (32, 48)),
    "cmyk jpeg": (lambda: encode(gradient("CMYK"), "JPEG"), (32, 48)),
    "palette png": (lambda: encode(gradient("P"), "PNG"), (32, 48)),
    "rgba png": (rgba_png, (32, 48)),
    "png bytes (named .jpg)": (lambda: encode(gradient(), "PNG"), (32, 48)),
    "gif": (lambda: encode(gradient("P"), "GIF"), (32, 48)),
    "webp": (lambda: encode(gradient(), "WEBP"), (32, 48)),
    "16-bit png": (lambda: encode(Image.fromarray((np.arange(48 * 32).reshape(32, 48) * 40).astype(np.uint16)),
                                  "PNG"), (32, 48)),
    "exif orientation 6": (exif_rotated_jpeg, (48, 32)),  # turned upright: height and width swap
    "progressive jpeg": (lambda: encode(gradient(), "JPEG", progressive=True), (32, 48)),
}


@pytest.mark.parametrize("name", sorted(QUIRKS))
def test_quirky_images_become_rgb_jpegs(name):
    make, (height, width) = QUIRKS[name]
    out, h, w = process_image(make())
    assert (h, w) == (height, width)
    with Image.open(io.BytesIO(out)) as im:
        assert im.format == "JPEG" and im.mode == "RGB"
        assert im.getexif().get(0x0112, 1) == 1
    assert decode(out).shape == (height, width, 3)


def test_transparent_pixels_become_white():
    out, _, _ = process_image(rgba_png())
    assert decode(out).min() > 245


def test_exif_rotation_moves_the_pixels():
    image = Image.new("RGB", (40, 20), (0, 0, 255))
    image.paste((255, 0, 0), (0, 0, 10, 20))  # red band on the left edge
    exif = Image.Exif()
    exif[0x0112] = 6
    out, h, w = process_image(encode(image, "JPEG", exif=exif.tobytes(), quality=95))
    pixels = decode(out)
    assert (h, w) == (40, 20)
    assert pixels[2, 10, 0] > 200 and pixels[2, 10, 2] < 60  # rotated clockwise: the band is now on top
    assert pixels[37, 10, 2] > 200


@pytest.mark.parametrize("data, reason", [
    (b"", "empty file"),
    (b"this is not an image at all", "not an image"),
    (b"\xff\xd8\xff\xe0" + b"\x00" * 64, "corrupt"),
])
def test_broken_bytes_are_rejected_with_a_reason(data, reason):
    with pytest.raises(ImageError, match=reason):
        process_image(data)


def test_truncated_jpeg_is_rejected():
    noisy = Image.fromarray(np.random.default_rng(0).integers(0, 255, (64, 64, 3), dtype=np.uint8))
    data = encode(noisy, "JPEG")
    with pytest.raises(ImageError, match="corrupt image"):
        process_image(data[: len(data) // 2])


def test_shorter_side_downscales_but_never_upscales():
    big = encode(gradient(size=(640, 480)), "JPEG")
    out, h, w = process_image(big, shorter_side=342, quality=90)
    assert (h, w) == (342, 456) and decode(out).shape == (342, 456, 3)
    small = encode(gradient(size=(200, 100)), "JPEG")
    out, h, w = process_image(small, shorter_side=342)
    assert out == small and (h, w) == (100, 200)


def test_target_size_keeps_aspect_ratio():
    assert target_size(480, 640, 342) == (342, 456)
    assert target_size(1000, 1000, 100) == (100, 100)
    assert target_size(10, 10, None) == (10, 10)
