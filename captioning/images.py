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

**Huge images.** By default Pillow's decompression-bomb limit applies (``Image.MAX_IMAGE_PIXELS``, about
89M pixels; the DecompressionBombWarning is turned into a refusal): ``prepare`` skips such an image with
the reason "image too large". ``max_decode_bytes`` (what ``caption`` passes) replaces that limit by a
memory budget for the decode: Pillow's limit is lifted while the image is opened and decoded, the memory
the decode needs is estimated from the header, and only an image over the budget is refused. The estimate
is 4 bytes per decoded pixel (Pillow's RGB/RGBA pixel): for a JPEG the pixels after DCT scaling (so a
20000 × 10000 JPEG brought to a 4096 longer side decodes at 5000 × 2500, never at full size), plus, for a
progressive JPEG, the 2 bytes per full-size pixel and component that libjpeg keeps for its coefficients;
for every other format the full size (a 1 GiB budget admits 2^28 pixels, 16384 × 16384). Once decoded,
an image that is at least twice too big is first box-reduced (``Image.reduce``), so the conversions to
RGB work on a small copy; the peak is about the estimate plus one full-size 4-byte copy for palette,
16-bit and transparent images. Lifting the limit sets Pillow's module global for the duration of the
call: fine for ``caption`` (one thread), not for callers that open images in other threads meanwhile.
"""

from __future__ import annotations

import contextlib
import io
import os
import stat
import warnings

from PIL import Image, ImageOps, UnidentifiedImageError

EXIF_ORIENTATION = 0x0112
_IMAGE_MAGIC = (b"\xff\xd8\xff", b"\x89PNG", b"GIF8", b"RIFF", b"BM", b"II*\x00", b"MM\x00*")


class ImageError(Exception):
    """An image that cannot be used; the message is the reason recorded in the manifest."""


MAX_FILE_BYTES = 1 << 30  # no image file needs more; a bigger "image" is a mistake (or /dev/zero)


def read_image_file(path: str, max_bytes: int = MAX_FILE_BYTES) -> bytes:
    """The bytes of the image file ``path``; :class:`ImageError` (the reason, one line) when it is missing,
    a folder, not a regular file (a FIFO would block forever, a device like /dev/zero never end: it is
    opened without blocking and checked before a byte is read), larger than ``max_bytes``, or unreadable."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    except FileNotFoundError:
        raise ImageError("missing file") from None
    except IsADirectoryError:
        raise ImageError("not a file (a folder)") from None
    except OSError as e:
        raise ImageError(f"unreadable file: {e.strerror}") from None
    info = os.fstat(fd)
    problem = ("not a file (a folder)" if stat.S_ISDIR(info.st_mode) else
               "not a regular file (a device, pipe or socket)" if not stat.S_ISREG(info.st_mode) else
               f"file too large for an image ({info.st_size / 2**30:.1f} GiB)" if info.st_size > max_bytes else None)
    if problem:
        os.close(fd)
        raise ImageError(problem)
    with os.fdopen(fd, "rb") as f:
        try:
            return f.read()
        except OSError as e:
            raise ImageError(f"unreadable file: {e.strerror}") from None


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


@contextlib.contextmanager
def _bomb_limit_lifted(lift: bool):
    """Pillow's decompression-bomb check off for the block (a module global: see the module docstring)."""
    if not lift:
        yield
        return
    saved = Image.MAX_IMAGE_PIXELS
    Image.MAX_IMAGE_PIXELS = None
    try:
        yield
    finally:
        Image.MAX_IMAGE_PIXELS = saved


def decode_bytes(image: Image.Image, full_size: tuple[int, int]) -> int:
    """Memory to decode an opened (and possibly drafted) image: see the module docstring.

    >>> decode_bytes(Image.new("RGB", (100, 50)), (100, 50))
    20000
    """
    width, height = image.size
    need = width * height * 4
    if image.format == "JPEG" and image.info.get("progressive"):
        need += full_size[0] * full_size[1] * getattr(image, "layers", 3) * 2
    return need


def _amount(n: int) -> str:
    return f"{n / 2**30:.1f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


_REDUCIBLE = {"L", "LA", "La", "RGB", "RGBA", "RGBa", "CMYK", "YCbCr", "I", "F"}


def _shrink(image: Image.Image, size: tuple[int, int]) -> Image.Image:
    """A box reduction by the largest whole factor that stays at least ``size``, when that is 2 or more."""
    factor = min(image.width // size[0], image.height // size[1])
    if factor < 2:
        return image
    if image.mode not in _REDUCIBLE:  # palette, 1-bit, 16-bit: reduce() would average indices or refuse
        image = image.convert("I" if image.mode.startswith("I;16") else "L" if image.mode == "1" else "RGBA")
    return image.reduce(factor)


def process_image(data: bytes, shorter_side: int | None = None, quality: int = 95, *, keep=("JPEG",),
                  output: str = "JPEG", max_side: int | None = None,
                  max_decode_bytes: int | None = None) -> tuple[bytes, int, int]:
    """Validates ``data`` and returns ``(image_bytes, height, width)``; raises :class:`ImageError`.

    Bytes in one of the ``keep`` formats, already RGB, upright and of the right size, are returned as
    they are; anything else is converted and encoded as ``output`` (JPEG at ``quality``, or PNG).
    ``max_side`` downscales images whose longer side is larger (huge user photos), ``shorter_side``
    those whose shorter side is. ``max_decode_bytes`` replaces Pillow's decompression-bomb limit by a
    memory budget (see the module docstring); None keeps Pillow's limit.
    """
    if not data:
        raise ImageError("empty file")
    budget = max_decode_bytes is not None
    try:
        with warnings.catch_warnings(), _bomb_limit_lifted(budget):
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            image = Image.open(io.BytesIO(data))
            fmt = image.format
            width, height = image.size
            size = target_size(width, height, shorter_side)
            if max_side and max(size) > max_side:
                scale = max_side / max(size)
                size = (max(1, round(size[0] * scale)), max(1, round(size[1] * scale)))
            if fmt == "JPEG" and size != (width, height):
                image.draft("RGB", size)  # decode at a reduced DCT scale, still >= size
            need = decode_bytes(image, (width, height))
            if budget and need > max_decode_bytes:
                raise ImageError(f"image too large: decoding {width}x{height} pixels would need about "
                                 f"{_amount(need)}, over the {_amount(max_decode_bytes)} limit")
            orientation = image.getexif().get(EXIF_ORIENTATION, 1)  # after the check: a PNG's loads the image
            image.load()
    except UnidentifiedImageError:
        if data.startswith(_IMAGE_MAGIC):
            raise ImageError("corrupt image: the header of a known format, but unreadable") from None
        raise ImageError("not an image (unrecognised format)") from None
    except (Image.DecompressionBombError, Image.DecompressionBombWarning):
        raise ImageError("image too large (decompression bomb limit)") from None
    except MemoryError:
        raise ImageError("image too large: out of memory while decoding it") from None
    except (OSError, SyntaxError, ValueError, EOFError) as e:
        raise ImageError(f"corrupt image: {e}") from None

    if fmt in keep and image.mode == "RGB" and orientation == 1 and size == (width, height):
        return data, height, width
    try:
        if budget:
            image = _shrink(image, size)  # before any full-size copy; size is in the stored orientation
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
