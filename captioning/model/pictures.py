"""Pictures of where an attention decoder looked: one image per word, the crop the model saw lit by that
word's weights, or (over regions) with the region it weighed most outlined. ``caption --html`` and
TensorBoard's training samples both draw them here.

Where the encoder declares a layout (:class:`~captioning.model.layout.TokenLayout`), a word's weights over
the ``rows × cols`` map are upsampled (bilinear) to the crop, scaled so the most attended point is 1, and the
crop is shown at ``0.25 + 0.75 × weight`` of its brightness, with a warm tint where the weight is high:
bright where the model looked, dim elsewhere (the spotlight of Xu et al.'s figures). Weights of one word
sum to 1 over the tokens; the scaling per word keeps a word that looked everywhere a little from vanishing,
and :func:`peak_share` says how concentrated it was. The prefix tokens (a ViT's class token) have no place:
their share of the word's weight is drawn apart, as a bar along the picture's foot (full width: all of it).
Where there is no layout, the picture is a plain bar per token, as tall as its weight.

>>> import numpy as np
>>> from captioning.model.layout import TokenLayout
>>> crop = np.full((8, 8, 3), 200, np.uint8)
>>> lit = spotlight(crop, np.array([1.0, 0.0, 0.0, 0.0]), TokenLayout(2, 2), size=8)
>>> lit.shape, int(lit[1, 1].mean()) > int(lit[6, 6].mean())   # the top-left cell is the bright one
((8, 8, 3), True)
"""

from __future__ import annotations

import numpy as np
from PIL import Image, ImageDraw, ImageFont

from captioning.model.layout import TokenLayout

PREFIX_BAR = 4  # pixels: the bar of the prefix tokens' share along a picture's foot


def upsample(weights: np.ndarray, grid: tuple[int, int], size: int) -> np.ndarray:
    """A word's weights ``[cells]`` (row by row over ``grid``) as a ``size × size`` float map."""
    cells = np.asarray(weights, np.float32).reshape(grid)
    return np.asarray(Image.fromarray(cells, mode="F").resize((size, size), Image.BILINEAR))


def peak_share(weights: np.ndarray) -> float:
    """The largest cell's share of a word's weights (1 / cells when it looked everywhere alike)."""
    weights = np.asarray(weights, np.float64)
    return float(weights.max() / max(weights.sum(), 1e-12))


def spotlight(image: np.ndarray, weights: np.ndarray, layout: TokenLayout | None,
              size: int | None = None) -> np.ndarray:
    """The crop ``uint8 [S, S, 3]`` lit by one word's weights over the map of ``layout``, ``size`` pixels a side
    (default S), the prefix tokens' share as a bar along its foot; without a layout, :func:`token_bars`."""
    size = size or image.shape[0]
    if layout is None:
        return token_bars(weights, size)
    base = np.asarray(Image.fromarray(image).resize((size, size), Image.BILINEAR), np.float32)
    light = upsample(layout.grid(weights), (layout.rows, layout.cols), size)
    light = light / max(float(light.max()), 1e-12)
    tint = np.array([255.0, 190.0, 60.0], np.float32)
    out = base * (0.25 + 0.75 * light[..., None]) * (1 - 0.25 * light[..., None]) + tint * 0.25 * light[..., None]
    out = np.clip(out, 0, 255).astype(np.uint8)
    if layout.prefix:
        out[-PREFIX_BAR:] = (40, 40, 40)
        out[-PREFIX_BAR:, :round(layout.prefix_share(weights) * size)] = (255, 190, 60)
    return out


def token_bars(weights: np.ndarray, size: int) -> np.ndarray:
    """A ``size × size`` picture of one word's weights over tokens that have no places: a bar per token, left
    to right, as tall as its weight over the largest one's.

    >>> bars = token_bars(np.array([0.5, 0.25, 0.25]), 6)
    >>> int(bars[:, 0:2, 0].min()), int(bars[:3, 2:4, 0].max()), int(bars[3:, 2:4, 0].min())  # full; half
    (255, 40, 255)
    """
    weights = np.asarray(weights, np.float64).ravel()
    picture = np.full((size, size, 3), 40, np.uint8)
    heights = np.round(weights / max(weights.max(), 1e-12) * size).astype(int)
    edges = np.linspace(0, size, len(weights) + 1).round().astype(int)
    for i, h in enumerate(heights):
        picture[size - h:, edges[i]:max(edges[i + 1], edges[i] + 1)] = (255, 190, 60)
    return picture


def outlined(image: np.ndarray, box, size: int) -> np.ndarray:
    """``image`` (uint8 ``[S, S, 3]``) at ``size`` pixels a side with ``box`` (x1, y1, x2, y2 as fractions of
    the image) outlined in red, 2 pixels wide: the region a word attended to most.

    >>> picture = outlined(np.full((8, 8, 3), 128, np.uint8), (0.0, 0.0, 0.5, 0.5), 11)
    >>> picture[0, 3].tolist(), picture[8, 8].tolist()   # on the outline, and outside it
    ([255, 0, 0], [128, 128, 128])
    """
    picture = Image.fromarray(image).resize((size, size))
    x1, y1, x2, y2 = (float(v) * (size - 1) for v in box)
    ImageDraw.Draw(picture).rectangle([x1, y1, x2, y2], outline=(255, 0, 0), width=2)
    return np.asarray(picture)


def word_strip(image: np.ndarray, words: list[str], weights: np.ndarray, layout: TokenLayout | None,
               tile: int = 96) -> np.ndarray:
    """One row of tiles, a tile per word (its :func:`spotlight`, the word written under it):
    ``uint8 [tile + 14, tile × words, 3]`` (the TensorBoard picture of a caption)."""
    font = ImageFont.load_default()
    strip = Image.new("RGB", (tile * max(len(words), 1), tile + 14), (255, 255, 255))
    draw = ImageDraw.Draw(strip)
    for i, (word, w) in enumerate(zip(words, weights)):
        strip.paste(Image.fromarray(spotlight(image, w, layout, tile)), (i * tile, 0))
        draw.text((i * tile + 2, tile + 1), word[:14], fill=(0, 0, 0), font=font)
    return np.asarray(strip)
