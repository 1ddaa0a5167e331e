"""What share of each grid cell, or of each region, a shape's box covers: the weights by which
:func:`captioning.evaluation.grounding.attention_localisation` counts a word's attention as falling on the
shape it names (the module docstring of :mod:`captioning.evaluation.grounding` explains the geometry)."""

from __future__ import annotations

from typing import Sequence

import numpy as np


def box_coverage(bbox: Sequence[float], width: int, height: int, grid: tuple[int, int], resize_size: int,
                 image_size: int) -> np.ndarray:
    """The fraction of each grid cell's area (cell index row * w + col) that ``bbox`` (x, y, width,
    height in pixels of the ``width`` × ``height`` image) covers once the image is squashed to
    ``resize_size`` squared and its central ``image_size`` square cropped. Its mean is the box's share of
    the crop. A 200 × 100 image squashed to 120 (x × 0.6, y × 1.2), cropped to 100 from (10, 10): the
    box (50, 25, 100, 50) becomes 20–80 on both axes, 30 of each 50-px cell's side::

        >>> box_coverage((50, 25, 100, 50), 200, 100, grid=(2, 2), resize_size=120, image_size=100)
        array([0.36, 0.36, 0.36, 0.36])
        >>> box_coverage((0, 0, 75, 50), 100, 100, grid=(2, 2), resize_size=100, image_size=100)
        array([1. , 0.5, 0. , 0. ])
    """
    rows, cols = grid
    x, y, w, h = bbox
    offset = (resize_size - image_size) // 2

    def axis(start: float, end: float, scale: float, cells: int) -> np.ndarray:
        lo, hi = (np.clip(v * scale - offset, 0, image_size) for v in (start, end))
        edges = np.linspace(0.0, image_size, cells + 1)
        overlap = np.minimum(hi, edges[1:]) - np.maximum(lo, edges[:-1])
        return np.clip(overlap, 0, None) / (image_size / cells)

    along_y = axis(y, y + h, resize_size / height, rows)
    along_x = axis(x, x + w, resize_size / width, cols)
    return np.outer(along_y, along_x).ravel()


def region_coverage(bbox: Sequence[float], width: int, height: int, regions) -> np.ndarray:
    """The fraction of each region's area that ``bbox`` (x, y, width, height in pixels of the ``width`` ×
    ``height`` image) covers; ``regions [n, 4]`` are x1, y1, x2, y2 as fractions of the image. A region of
    no area is covered if its point lies in the box.

        >>> region_coverage((0, 0, 50, 50), 100, 100, [[0, 0, 0.5, 0.5], [0, 0, 1, 1], [0.25, 0.25, 0.75, 0.75]])
        array([1.  , 0.25, 0.25])
    """
    regions = np.asarray(regions, dtype=np.float64).reshape(-1, 4)
    x, y, w, h = bbox
    box = np.array([x / width, y / height, (x + w) / width, (y + h) / height])
    lo = np.maximum(regions[:, :2], box[:2])
    hi = np.minimum(regions[:, 2:], box[2:])
    overlap = np.prod(np.clip(hi - lo, 0, None), axis=1)
    area = np.prod(regions[:, 2:] - regions[:, :2], axis=1)
    inside = np.all((regions[:, :2] >= box[:2]) & (regions[:, :2] <= box[2:]), axis=1).astype(np.float64)
    return np.where(area > 0, overlap / np.where(area > 0, area, 1.0), inside)
