"""A deterministic stand-in for COCO photos: textured JPEGs with COCO-like captions, in COCO format.

The shapes dataset is too easy on the input pipeline (small, flat JPEGs decode ten times faster than
photos), so the input and prepare benchmarks run on images that cost what COCO's cost: 640×480 by
default, with a natural image's 1/f ("pink") luminance spectrum, smooth colour casts and a few hard-edged
objects, saved at JPEG quality 90 — about 100–200 KB each, like COCO's (mean ~160 KB).

Each image is a random crop of one of a few large noise canvases, flipped, re-coloured and overdrawn
with random shapes, so thousands of distinct images cost ~15 ms each to make. Captions are five
strings of made-up words, with COCO's caption-length distribution (8–20 words, mostly 9–12) and
Zipf-distributed words, so bucketing and padding see realistic lengths.

>>> import tempfile
>>> out = write_photos(tempfile.mkdtemp(), {"train": 3, "val": 2}, (64, 48), progress=False)
>>> [s.split("=")[0] for s in out["splits"]]
['train', 'val']
"""

from __future__ import annotations

import io
import os

import numpy as np
from PIL import Image, ImageDraw
from tqdm import tqdm

from captioning.fileio import atomic_write_bytes, atomic_write_json

# COCO (Karpathy train) caption lengths in words, 8..20, roughly.
_LENGTHS = np.arange(8, 21)
_LENGTH_P = np.array([9, 20, 21, 15, 11, 7, 5, 3.5, 2.5, 2, 1.5, 1.3, 1.2], dtype=np.float64)
_LENGTH_P /= _LENGTH_P.sum()
_SYLLABLES = ["ba", "ko", "ri", "tu", "me", "sa", "lo", "ni", "da", "pe", "gu", "zi", "fa", "mo", "ve", "ta"]


def _canvas(rng: np.random.Generator, size: int) -> np.ndarray:
    """Unit-variance luminance noise with amplitude falling 0.84× per octave (≈ 1/f)."""
    acc = np.zeros((size, size), np.float32)
    side, amp = 4, 1.0
    while side <= size:
        noise = rng.standard_normal((side, side)).astype(np.float32)
        if side < size:
            noise = np.asarray(Image.fromarray(noise).resize((size, size), Image.BICUBIC))
        acc += amp * noise
        amp *= 0.84
        side *= 2
    return (acc - acc.mean()) / acc.std()


def _vocabulary(rng: np.random.Generator, count: int = 2000) -> list[str]:
    words: set[str] = set()
    while len(words) < count:
        words.add("".join(rng.choice(_SYLLABLES, size=rng.integers(1, 4))))
    return sorted(words)


def _image(rng, canvases, width, height) -> bytes:
    canvas = canvases[rng.integers(len(canvases))]
    y, x = rng.integers(0, canvas.shape[0] - height + 1), rng.integers(0, canvas.shape[1] - width + 1)
    lum = canvas[y:y + height, x:x + width]
    if rng.random() < 0.5:
        lum = lum[:, ::-1]
    # A smooth colour cast: a 2×2 colour grid stretched over the image.
    cast = rng.uniform(50, 200, (2, 2, 3)).astype(np.float32)
    cast = np.stack([np.asarray(Image.fromarray(cast[..., c]).resize((width, height), Image.BILINEAR))
                  for c in range(3)], -1)
    pixels = np.clip(cast + rng.uniform(35, 60) * lum[..., None], 0, 255).astype(np.uint8)
    image = Image.fromarray(pixels)
    draw = ImageDraw.Draw(image)
    for _ in range(rng.integers(2, 7)):  # objects: hard edges, as photos have
        x0, y0 = rng.integers(0, width), rng.integers(0, height)
        box = [x0, y0, x0 + rng.integers(width // 10, width // 2), y0 + rng.integers(height // 10, height // 2)]
        fill = tuple(int(v) for v in rng.integers(0, 256, 3))
        (draw.ellipse if rng.random() < 0.5 else draw.rectangle)(box, fill=fill)
    # Texture over the objects too.
    pixels = np.asarray(image, np.float32) + rng.uniform(15, 30) * lum[..., None]
    out = io.BytesIO()
    Image.fromarray(np.clip(pixels, 0, 255).astype(np.uint8)).save(out, format="JPEG", quality=90)
    return out.getvalue()


def write_photos(out_dir: str, num_images: int | dict[str, int], size: tuple[int, int] = (640, 480),
                 seed: int = 0, progress: bool = True) -> dict:
    """Writes ``images/`` and ``annotations/captions_<split>.json`` (COCO captions format) into
    ``out_dir``; ``num_images`` is a count (one ``train`` split) or ``{split: count}``. Returns
    ``{"images": dir, "splits": ["NAME=ANNOTATIONS:IMAGES", ...]}`` (``captioning prepare --split``
    arguments). The same arguments give the same bytes; each annotations file is written last."""
    width, height = size
    counts = {"train": num_images} if isinstance(num_images, int) else dict(num_images)
    rng = np.random.default_rng(seed)
    images_dir = os.path.join(out_dir, "images")
    os.makedirs(images_dir, exist_ok=True)
    os.makedirs(os.path.join(out_dir, "annotations"), exist_ok=True)
    side = 2 * max(width, height)
    canvases = [_canvas(rng, 1 << (side - 1).bit_length()) for _ in range(3)]
    words = _vocabulary(rng)
    zipf = 1.0 / np.arange(1, len(words) + 1)
    zipf /= zipf.sum()
    bar = tqdm(total=sum(counts.values()), desc="photos", unit="img", disable=None if progress else True)
    splits, next_id = [], 1
    for split, count in counts.items():
        coco = {"info": {"description": "captioning benchmark photos"}, "licenses": [], "images": [],
                "annotations": []}
        for _ in range(count):
            image_id, name = next_id, f"photo_{next_id:06d}.jpg"
            next_id += 1
            # each image complete or absent; the annotations, written last, commit the set
            atomic_write_bytes(os.path.join(images_dir, name), _image(rng, canvases, width, height))
            coco["images"].append({"id": image_id, "file_name": name, "width": width, "height": height})
            for j in range(5):
                caption = " ".join(rng.choice(words, size=rng.choice(_LENGTHS, p=_LENGTH_P), p=zipf))
                coco["annotations"].append({"id": 5 * image_id + j, "image_id": image_id, "caption": caption})
            bar.update(1)
        annotations = os.path.join(out_dir, "annotations", f"captions_{split}.json")
        atomic_write_json(annotations, coco)
        splits.append(f"{split}={annotations}:{images_dir}")
    bar.close()
    return {"images": images_dir, "splits": splits}


def cached_photos(work_dir: str, counts: dict[str, int], size: tuple[int, int] = (640, 480), seed: int = 0,
                  progress: bool = True) -> dict:
    """:func:`write_photos` into a folder of ``work_dir`` named after its arguments, unless a complete
    earlier run is there already. Returns what :func:`write_photos` returns, plus ``"root"``."""
    name = "-".join(f"{split}{count}" for split, count in counts.items())
    root = os.path.join(work_dir, f"photos-{size[0]}x{size[1]}-{name}-seed{seed}")
    out = os.path.join(root, "photos")
    annotations = [os.path.join(out, "annotations", f"captions_{split}.json") for split in counts]
    images_dir = os.path.join(out, "images")
    if all(os.path.exists(a) for a in annotations):
        return {"root": root, "images": images_dir,
                "splits": [f"{split}={a}:{images_dir}" for split, a in zip(counts, annotations)]}
    return {"root": root, **write_photos(out, counts, size, seed, progress=progress)}
