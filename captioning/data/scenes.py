"""What the synthetic scenes' annotations mean: the words of their captions and the rule for relations.

Both halves read this module: ``data_prep`` draws scenes and writes their captions with these words
and this rule, and :mod:`captioning.evaluation` reads generated captions back with the same words and
judges them with the same rule. It has no TensorFlow in it.

A shape in an instances file (COCO's detection layout, ``annotations/instances_{split}.json``) is a
:class:`ShapeBox`: its category name (the kind), ``attributes`` ``{"color", "size"}`` and, in the hard
scenes, ``"fill"`` (``solid``, ``striped`` or ``outlined``), and its ``bbox`` ``[x, y, width, height]``
in pixels of the stored image.

**Relations** (:func:`relations`) are read from the two boxes alone, so a caption can be judged
without the pixels:

- ``inside``: a's box lies within b's box; ``around``: b's box lies within a's (neither is then
  above, below, left or right of the other);
- otherwise exactly one direction, along the axis on which the boxes' centres are further apart
  (vertical on a tie): ``above`` / ``below`` (y grows downwards), ``left`` / ``right``;
- and ``next to`` as well when the boxes overlap or the gap between them is under a quarter of the
  smallest side of the two boxes.

Worked example: a box at the left of another, 4 px apart, and a small box inside a large one::

    >>> sorted(relations((0, 0, 20, 20), (24, 2, 20, 20)))
    ['left', 'next to']
    >>> sorted(relations((40, 0, 20, 20), (0, 0, 20, 20)))
    ['right']
    >>> relations((10, 10, 5, 5), (0, 0, 40, 40)), relations((0, 0, 40, 40), (10, 10, 5, 5))
    (frozenset({'inside'}), frozenset({'around'}))
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

SCENES = ("shapes", "hard")  # `captioning synth --scenes`: the first is the default

HARD_KINDS = ("circle", "square", "triangle", "star", "diamond", "hexagon")
PLURALS = {kind: kind + "s" for kind in HARD_KINDS}  # "circles" -> circle, ... (every kind takes an s)
HARD_COLORS = ("red", "green", "blue", "yellow", "purple", "orange", "pink", "brown")
HARD_SIZES = ("small", "medium", "large")
FILLS = ("solid", "striped", "outlined")
SIZE_WORDS = {"small": ("small", "little", "tiny"), "medium": ("medium",), "large": ("large", "big")}
FILL_WORDS = {"solid": ("solid",), "striped": ("striped",), "outlined": ("outlined", "hollow")}
NUMBERS = {2: "two", 3: "three", 4: "four", 5: "five", 6: "six"}
ARTICLES = ("a", "an", "the")
RELATION_WORDS = {
    "above": ("above", "over"),
    "below": ("below", "under", "beneath"),
    "left": ("to the left of", "left of"),
    "right": ("to the right of", "right of"),
    "next to": ("next to", "beside"),
    "inside": ("inside",),
    "around": ("around",),
}
INVERSE = {"above": "below", "below": "above", "left": "right", "right": "left", "next to": "next to",
           "inside": "around", "around": "inside"}
NEXT_TO_GAP = 0.25  # "next to": a gap under this share of the smallest side of the two boxes


@dataclass(frozen=True)
class ShapeBox:
    """One annotated shape: ``bbox`` is ``(x, y, width, height)`` in pixels of the stored image; ``fill``
    is None where the instances file gives none (the shapes scenes)."""

    kind: str
    color: str
    size: str
    bbox: tuple[float, float, float, float]
    fill: str | None = None


def _contains(outer: Sequence[float], inner: Sequence[float]) -> bool:
    ox, oy, ow, oh = outer
    ix, iy, iw, ih = inner
    return ox <= ix and oy <= iy and ix + iw <= ox + ow and iy + ih <= oy + oh


def relations(a: Sequence[float], b: Sequence[float]) -> frozenset[str]:
    """The relations that hold of box ``a`` to box ``b`` (``[x, y, width, height]``; module docstring)."""
    if _contains(b, a):
        return frozenset({"inside"})
    if _contains(a, b):
        return frozenset({"around"})
    (ax, ay, aw, ah), (bx, by, bw, bh) = a, b
    dx, dy = (ax + aw / 2) - (bx + bw / 2), (ay + ah / 2) - (by + bh / 2)
    if abs(dy) >= abs(dx):
        found = {"above" if dy < 0 else "below"}
    else:
        found = {"left" if dx < 0 else "right"}
    gap = max(bx - (ax + aw), ax - (bx + bw), by - (ay + ah), ay - (by + bh))
    if gap < NEXT_TO_GAP * min(aw, ah, bw, bh):
        found.add("next to")
    return frozenset(found)
