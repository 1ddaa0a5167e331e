"""Every image quirk prepare must survive, each made for real with Pillow and decoded by TensorFlow."""

import io
import zlib

import numpy as np
import pytest
import tensorflow as tf
from PIL import Image

from captioning.images import ImageError, decode_bytes, process_image, target_size
from tests.helpers import encode, gradient, huge_jpeg


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


# --- huge images: prepare refuses them, caption (max_decode_bytes) downscales them --------------------------

GiB = 1 << 30
PILLOW_LIMIT = Image.MAX_IMAGE_PIXELS  # about 89M pixels; caption lifts it only while it decodes
CAPTION = dict(keep=("JPEG", "PNG"), output="PNG", max_side=4096, max_decode_bytes=GiB)  # as caption.py


def test_huge_jpeg_is_refused_by_prepare_and_downscaled_by_caption_without_a_full_decode():
    data = huge_jpeg(20000, 10000)
    with pytest.raises(ImageError, match="decompression bomb limit"):
        process_image(data)
    out, h, w = process_image(data, **CAPTION)
    assert (h, w) == (2048, 4096) and Image.MAX_IMAGE_PIXELS == PILLOW_LIMIT  # the limit is back
    with Image.open(io.BytesIO(out)) as im:
        assert im.format == "PNG" and im.size == (4096, 2048)
        pixels = np.asarray(im.convert("RGB")).astype(int)
    assert pixels[1000, 40, 0] < 20 and pixels[1000, 4050, 0] > 235  # the gradient, left to right
    assert pixels[1000, 40, 1] > 235 and abs(pixels[1000, 2048, 2] - 96) < 8
    Image.MAX_IMAGE_PIXELS, saved = None, Image.MAX_IMAGE_PIXELS
    try:
        with Image.open(io.BytesIO(data)) as probe:  # what the budget counted: the 1/4-scale decode only
            probe.draft("RGB", (4096, 2048))
            assert probe.size == (5000, 2500) and decode_bytes(probe, (20000, 10000)) == 5000 * 2500 * 4
    finally:
        Image.MAX_IMAGE_PIXELS = saved


def png_header_only(width: int, height: int) -> bytes:
    """A PNG that claims ``width`` x ``height`` (its pixel data is never reached)."""
    def chunk(kind, body):
        return len(body).to_bytes(4, "big") + kind + body + zlib.crc32(kind + body).to_bytes(4, "big")
    ihdr = width.to_bytes(4, "big") + height.to_bytes(4, "big") + bytes([8, 2, 0, 0, 0])
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"\0" * 16)) + chunk(b"IEND", b"")


def test_non_jpeg_past_the_memory_budget_is_refused_with_the_reason():
    data = png_header_only(70000, 70000)
    with pytest.raises(ImageError, match="decompression bomb limit"):
        process_image(data)
    with pytest.raises(ImageError) as info:
        process_image(data, **CAPTION)
    assert str(info.value) == ("image too large: decoding 70000x70000 pixels would need about 18.3 GiB, "
                               "over the 1.0 GiB limit")
    assert Image.MAX_IMAGE_PIXELS == PILLOW_LIMIT
    with pytest.raises(ImageError, match="image too large: decoding 16385x16384 pixels"):  # 2**28 px fit
        process_image(png_header_only(16385, 16384), **CAPTION)


def test_non_jpeg_past_pillows_limit_but_within_the_budget_is_decoded(monkeypatch):
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 1000)  # a 90x60 PNG now counts as a bomb for Pillow
    data = encode(gradient(size=(90, 60)), "PNG")
    with pytest.raises(ImageError, match="decompression bomb limit"):
        process_image(data)
    out, h, w = process_image(data, **CAPTION)
    assert out == data and (h, w) == (60, 90) and Image.MAX_IMAGE_PIXELS == 1000
    with pytest.raises(ImageError, match=r"decoding 90x60 pixels would need about 0\.0 MiB, over the 0\.0 MiB limit"):
        process_image(data, **dict(CAPTION, max_decode_bytes=90 * 60 * 4 - 1))


def test_progressive_jpeg_budget_counts_full_size_coefficients():
    with Image.open(io.BytesIO(encode(gradient(size=(64, 32)), "JPEG", progressive=True))) as im:
        assert decode_bytes(im, im.size) == 64 * 32 * 4 + 64 * 32 * 3 * 2
    with Image.open(io.BytesIO(encode(gradient(size=(64, 32)), "JPEG"))) as im:
        assert decode_bytes(im, im.size) == 64 * 32 * 4


def big(mode):
    """A 1200x600 image in ``mode`` with a red band on its left edge (so orientation can be checked)."""
    image = Image.new("RGB", (1200, 600), (0, 0, 255))
    image.paste((255, 0, 0), (0, 0, 150, 600))
    if mode == "I;16":
        return Image.fromarray((np.asarray(image.convert("L")).astype(np.uint16) * 200))
    return image.convert(mode)


@pytest.mark.parametrize("mode, fmt", [("RGB", "PNG"), ("RGBA", "PNG"), ("LA", "PNG"), ("P", "GIF"), ("P", "PNG"),
                                       ("1", "BMP"), ("L", "WEBP"), ("I;16", "PNG"), ("CMYK", "TIFF")])
def test_caption_shrinks_big_images_of_every_mode_before_converting(mode, fmt):
    out, h, w = process_image(encode(big(mode), fmt), **dict(CAPTION, max_side=300))
    assert (h, w) == (150, 300)
    with Image.open(io.BytesIO(out)) as im:
        assert im.format == "PNG" and im.mode == "RGB" and im.size == (300, 150)


def test_caption_shrink_keeps_exif_orientation():
    exif = Image.Exif()
    exif[0x0112] = 6  # "rotate 90 CW to display": the left band ends on top
    out, h, w = process_image(encode(big("RGB"), "PNG", exif=exif.tobytes()), **dict(CAPTION, max_side=300))
    assert (h, w) == (300, 150)
    with Image.open(io.BytesIO(out)) as im:
        pixels = np.asarray(im.convert("RGB")).astype(int)
    assert pixels[10, 75, 0] > 200 and pixels[10, 75, 2] < 60 and pixels[290, 75, 2] > 200
