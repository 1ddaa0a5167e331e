"""Image validation and normalisation, shared by ``prepare`` and ``caption``.

``prepare`` stores an RGB baseline JPEG for whatever comes in; ``caption`` hands the model JPEG or PNG
bytes (lossless for everything that is not already a JPEG), decoded by the same TensorFlow code as the
training records and the exported SavedModel.

Every image is fully decoded (a truncated file fails here, not in the middle of training). A file that
already is an RGB JPEG with upright EXIF orientation and needs no resize is stored byte for byte, so no
quality is lost. Anything else (grayscale, CMYK, palette, RGBA, 16-bit, PNG or WebP bytes behind a .jpg
name, a rotated EXIF orientation) is converted to RGB, turned upright and re-encoded as JPEG. Transparent
pixels are composited onto white, as a browser shows them.

``shorter_side`` (off by default) downscales images whose shorter side is larger, keeping the aspect
ratio; images are never upscaled. For JPEGs it uses libjpeg's DCT scaling (``Image.draft``) first, which
decodes at 1/2, 1/4 or 1/8 size for a fraction of the cost, and then a bicubic resize to the exact size.
"""

from __future__ import annotations

import io
import warnings

from PIL import Image, ImageOps, UnidentifiedImageError

EXIF_ORIENTATION = 0x0112
_IMAGE_MAGIC = (b"\xff\xd8\xff", b"\x89PNG", b"GIF8", b"RIFF", b"BM", b"II*\x00", b"MM\x00*")


class ImageError(Exception):
    """An image that cannot be used; the message is the reason recorded in the manifest."""


def _to_rgb(image: Image.Image) -> Image.Image:
    if image.mode == "RGB":
        return image
    if image.mode in ("I;16", "I;16B", "I;16L", "I", "F"):  # high bit depth grayscale: scale to 8 bits
        import numpy as np
        arr = np.asarray(image, dtype=np.float64)
        top = arr.max() or 1.0
        image = Image.fromarray((arr * (255.0 / top if top > 255 else 1.0)).clip(0, 255).astype("uint8"), "L")
    if image.mode == "P":
        image = image.convert("RGBA")
    if image.mode in ("RGBA", "LA", "PA", "RGBa", "La"):
        image = image.convert("RGBA")
        background = Image.new("RGBA", image.size, (255, 255, 255, 255))
        return Image.alpha_composite(background, image).convert("RGB")
    return image.convert("RGB")


def target_size(width: int, height: int, shorter_side: int | None) -> tuple[int, int]:
    """Size after an optional downscale so the shorter side is ``shorter_side``.

    >>> target_size(640, 480, 342)
    (456, 342)
    >>> target_size(200, 100, 342)
    (200, 100)
    """
    if not shorter_side or min(width, height) <= shorter_side:
        return width, height
    scale = shorter_side / min(width, height)
    return max(1, round(width * scale)), max(1, round(height * scale))


def process_image(data: bytes, shorter_side: int | None = None, quality: int = 95, *, keep=("JPEG",),
                  output: str = "JPEG", max_side: int | None = None) -> tuple[bytes, int, int]:
    """Validates ``data`` and returns ``(image_bytes, height, width)``; raises :class:`ImageError`.

    Bytes in one of the ``keep`` formats, already RGB, upright and of the right size, are returned as
    they are; anything else is converted and encoded as ``output`` (JPEG at ``quality``, or PNG).
    ``max_side`` downscales images whose longer side is larger (huge user photos), ``shorter_side``
    those whose shorter side is.
    """
    if not data:
        raise ImageError("empty file")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            image = Image.open(io.BytesIO(data))
            fmt = image.format
            orientation = image.getexif().get(EXIF_ORIENTATION, 1)
            width, height = image.size
            size = target_size(width, height, shorter_side)
            if max_side and max(size) > max_side:
                scale = max_side / max(size)
                size = (max(1, round(size[0] * scale)), max(1, round(size[1] * scale)))
            if fmt == "JPEG" and size != (width, height):
                image.draft("RGB", size)  # decode at a reduced DCT scale, still >= size
            image.load()
    except UnidentifiedImageError:
        if data.startswith(_IMAGE_MAGIC):
            raise ImageError("corrupt image: the header of a known format, but unreadable") from None
        raise ImageError("not an image (unrecognised format)") from None
    except (Image.DecompressionBombError, Image.DecompressionBombWarning):
        raise ImageError("image too large (decompression bomb limit)") from None
    except (OSError, SyntaxError, ValueError, EOFError) as e:
        raise ImageError(f"corrupt image: {e}") from None

    if fmt in keep and image.mode == "RGB" and orientation == 1 and size == (width, height):
        return data, height, width
    try:
        image = ImageOps.exif_transpose(image)  # rotates and drops the orientation tag
        image = _to_rgb(image)
        if orientation in (5, 6, 7, 8):  # a quarter turn swapped width and height
            size = (size[1], size[0])
        if image.size != size:
            image = image.resize(size, Image.BICUBIC)
        out = io.BytesIO()
        image.save(out, format=output, **({"quality": quality} if output == "JPEG" else {}))
    except (OSError, ValueError) as e:
        raise ImageError(f"cannot convert image: {e}") from None
    return out.getvalue(), image.height, image.width
