"""The hard scenes (``captioning synth --scenes hard``): a synthetic dataset that tells decoders apart.

On the shapes data (data_prep/shapes.py) attention with SCST names the colour of 99% and the kind of 98%
of the shapes in three-shape images: a better decoder has nothing left to show. Here every part is
harder:

- three to six shapes per image, which may overlap (their centres are at least 0.6 of their radii
  apart) and, in about a third of the images, one small shape sits inside a large one;
- six kinds (circle, square, triangle, star, diamond, hexagon), eight colours (pink beside red, brown
  beside orange), three sizes (0.16, 0.25 and 0.34 of the shorter side across) and three fills:
  solid, striped (diagonal stripes inside the outline) and outlined;
- clutter on the background: faint lines, dots and specks in muted colours;
- in about half the images two or three shapes share colour and kind, so captions count them.

Five captions per image, at most 20 words each, from templates that need more than naming: counts
("three red circles and a striped blue star"), a relation between two shapes named once each ("a green
square to the left of a large yellow triangle"; above, below, left of, right of, next to, inside,
around, by the rule of :func:`captioning.data.scenes.relations` on the two shapes' boxes), the largest
shape ("the largest shape is a striped purple hexagon") and the whole scene ("five shapes: ...")::

    Two pink stars, a striped blue hexagon and an outlined green circle.
    a small brown diamond inside a large outlined orange square
    The largest shape is a hollow yellow triangle
    there is a striped red star next to a pink circle
    four shapes: two pink stars, a blue hexagon and a small green circle

The files are those of the shapes data (data_prep/synth.py); each annotation's ``attributes`` also
holds the shape's ``fill``.
"""

from __future__ import annotations

import io
import itertools

import numpy as np
from PIL import Image, ImageDraw

from captioning.data.scenes import (FILL_WORDS, HARD_COLORS, HARD_KINDS, NUMBERS, PLURALS, RELATION_WORDS,
                                    SIZE_WORDS, ShapeBox, relations)
from captioning.text import tokenize_caption
from data_prep.shapes import background, coco_surface

CATEGORIES = [{"id": i, "name": kind, "supercategory": "shape"} for i, kind in enumerate(HARD_KINDS, 1)]
DESCRIPTION = "hard scenes: three to six overlapping shapes of six kinds, eight colours, three sizes and fills"
RGB = {"red": (215, 35, 35), "green": (40, 155, 50), "blue": (35, 70, 215), "yellow": (235, 205, 25),
       "purple": (135, 45, 170), "orange": (240, 125, 20), "pink": (240, 110, 190), "brown": (125, 75, 35)}
DIAMETER = {"small": 0.16, "medium": 0.25, "large": 0.34}  # share of the image's shorter side
FILL_ODDS = {"solid": 0.5, "striped": 0.25, "outlined": 0.25}
PICTURE = ("an image of", "a picture of", "a drawing of")
MAX_WORDS = 20


class _Shape:
    def __init__(self, kind: str, color: str, size: str, fill: str, r: float, x: float = 0.0, y: float = 0.0):
        self.kind, self.color, self.size, self.fill, self.r, self.x, self.y = kind, color, size, fill, r, x, y

    def outline(self) -> list[tuple[float, float]]:
        """The polygon drawn (a circle's box corners for the ellipse)."""
        x, y, r = self.x, self.y, self.r
        if self.kind == "circle":
            return [(x - r, y - r), (x + r, y + r)]
        if self.kind == "square":
            return [(x - 0.8 * r, y - 0.8 * r), (x + 0.8 * r, y - 0.8 * r), (x + 0.8 * r, y + 0.8 * r),
                    (x - 0.8 * r, y + 0.8 * r)]
        if self.kind == "triangle":
            return [(x, y - r), (x + r * 0.9, y + r * 0.7), (x - r * 0.9, y + r * 0.7)]
        if self.kind == "diamond":
            return [(x, y - r), (x + 0.75 * r, y), (x, y + r), (x - 0.75 * r, y)]
        if self.kind == "hexagon":
            return [(x + 0.95 * r * np.cos(a), y + 0.95 * r * np.sin(a)) for a in np.arange(6) * np.pi / 3]
        angles = -np.pi / 2 + np.arange(10) * np.pi / 5  # star: five points, inner radius 0.45 r
        return [(x + (r if i % 2 == 0 else 0.45 * r) * np.cos(a), y + (r if i % 2 == 0 else 0.45 * r) * np.sin(a))
                for i, a in enumerate(angles)]

    def box(self) -> tuple[float, float, float, float]:
        xs, ys = zip(*self.outline())
        x0, y0, x1, y1 = (float(v) for v in (min(xs), min(ys), max(xs), max(ys)))
        return round(x0, 2), round(y0, 2), round(x1 - x0, 2), round(y1 - y0, 2)

    def annotation(self) -> ShapeBox:
        return ShapeBox(self.kind, self.color, self.size, self.box(), self.fill)


def _clutter(image: Image.Image, rng: np.random.Generator) -> None:
    """Faint lines, dots and specks in muted colours, under the shapes."""
    draw, (w, h) = ImageDraw.Draw(image), image.size
    for _ in range(int(rng.integers(15, 41))):
        grey = rng.integers(110, 200)
        color = tuple(int(np.clip(grey + rng.integers(-25, 26), 0, 255)) for _ in range(3))
        x, y = float(rng.uniform(0, w)), float(rng.uniform(0, h))
        what = rng.integers(3)
        if what == 0:
            length, angle = rng.uniform(8, 40), rng.uniform(0, np.pi)
            draw.line([(x, y), (x + length * np.cos(angle), y + length * np.sin(angle))], fill=color,
                      width=int(rng.integers(1, 3)))
        elif what == 1:
            r = float(rng.uniform(1, 3.5))
            draw.ellipse([(x - r, y - r), (x + r, y + r)], fill=color)
        else:
            s = float(rng.uniform(2, 6))
            draw.rectangle([(x, y), (x + s, y + s * rng.uniform(0.5, 1.5))], fill=color)


def _draw(image: Image.Image, s: _Shape, rng: np.random.Generator) -> None:
    color = tuple(int(np.clip(c + rng.integers(-12, 13), 0, 255)) for c in RGB[s.color])
    width = max(2, int(round(s.r * 0.14)))
    mask = Image.new("L", image.size, 0)
    shape_draw = ImageDraw.Draw(mask)
    if s.fill == "outlined":
        if s.kind == "circle":
            shape_draw.ellipse(s.outline(), outline=255, width=width)
        else:
            shape_draw.polygon(s.outline(), outline=255, width=width)
    else:
        (shape_draw.ellipse if s.kind == "circle" else shape_draw.polygon)(s.outline(), fill=255)
        if s.fill == "striped":  # keep diagonal bands of the inside, and a thin outline
            period = max(5.0, s.r * 0.4)
            yy, xx = np.mgrid[0:image.size[1], 0:image.size[0]]
            bands = ((xx + yy) % period) < period / 2
            inside = np.asarray(mask) > 0
            edge = Image.new("L", image.size, 0)
            edge_draw = ImageDraw.Draw(edge)
            (edge_draw.ellipse if s.kind == "circle" else edge_draw.polygon)(s.outline(), outline=255,
                                                                            width=max(1, width // 2))
            mask = Image.fromarray(((inside & bands) | (np.asarray(edge) > 0)).astype(np.uint8) * 255, "L")
    image.paste(Image.new("RGB", image.size, color), (0, 0), mask)


def _attributes(rng: np.random.Generator, count: int) -> tuple[list[_Shape], tuple[int, int] | None]:
    """Kinds, colours, sizes and fills of ``count`` shapes (unplaced), and the (inner, outer) indices of
    a shape inside another, if any. Shapes outside a counted group differ in colour or kind."""
    pick = lambda options: options[rng.integers(len(options))]  # noqa: E731
    fills = list(FILL_ODDS)
    fill = lambda: fills[rng.choice(len(fills), p=list(FILL_ODDS.values()))]  # noqa: E731
    shapes: list[_Shape] = []
    group = int(rng.integers(2, min(3, count - 1) + 1)) if rng.random() < 0.5 else 0
    if group:
        kind, color = pick(HARD_KINDS), pick(HARD_COLORS)
        shapes += [_Shape(kind, color, pick(tuple(DIAMETER)), fill(), 0.0) for _ in range(group)]
    taken = {(s.kind, s.color) for s in shapes}
    while len(shapes) < count:
        kind, color = pick(HARD_KINDS), pick(HARD_COLORS)
        if (kind, color) not in taken:
            taken.add((kind, color))
            shapes.append(_Shape(kind, color, pick(tuple(DIAMETER)), fill(), 0.0))
    inside = None
    singles = list(range(group, count))
    if len(singles) >= 2 and rng.random() < 0.35:
        outer, inner = (int(i) for i in rng.choice(singles, size=2, replace=False))
        if shapes[outer].color != shapes[inner].color and shapes[outer].kind in ("circle", "square", "hexagon"):
            shapes[outer].size, shapes[inner].size = "large", "small"
            inside = inner, outer
    return shapes, inside


def _place(rng: np.random.Generator, w: int, h: int, count: int) -> tuple[list[_Shape], tuple[int, int] | None]:
    side = min(w, h)
    while True:
        shapes, inside = _attributes(rng, count)
        for s in shapes:
            s.r = side * DIAMETER[s.size] / 2 * rng.uniform(0.92, 1.08)
        placed: list[_Shape] = []
        for i, s in enumerate(shapes):
            if inside and i == inside[0]:
                continue  # placed at its outer shape's centre below
            for _attempt in range(60):
                s.x, s.y = rng.uniform(s.r + 2, w - s.r - 2), rng.uniform(s.r + 2, h - s.r - 2)
                if all(np.hypot(s.x - o.x, s.y - o.y) > 0.6 * (s.r + o.r) for o in placed):
                    break
            else:
                break
            placed.append(s)
        else:
            if inside:
                inner, outer = shapes[inside[0]], shapes[inside[1]]
                inner.r = min(inner.r, 0.38 * outer.r)
                inner.x, inner.y = outer.x, outer.y
            # only the planned pair may sit one inside the other's box
            pairs, boxes = itertools.permutations(range(count), 2), [s.box() for s in shapes]
            if all("inside" not in relations(boxes[a], boxes[b]) or (a, b) == inside for a, b in pairs):
                return shapes, inside


class _Words:
    """Random wording for one caption: synonyms chosen afresh each time."""

    def __init__(self, rng: np.random.Generator):
        self.rng = rng

    def pick(self, options):
        return options[self.rng.integers(len(options))]

    def noun(self, s: _Shape, article: bool = True, plain: bool = False) -> str:
        words = [s.color, s.kind]
        if not plain and self.rng.random() < (0.15 if s.fill == "solid" else 0.85):
            words.insert(0, self.pick(FILL_WORDS[s.fill]))
        if not plain and self.rng.random() < 0.5:
            words.insert(0, self.pick(SIZE_WORDS[s.size]))
        phrase = " ".join(words)
        return (("an " if phrase[0] in "aeiou" else "a ") + phrase) if article else phrase

    def group(self, shapes: list[_Shape]) -> str:
        return f"{NUMBERS[len(shapes)]} {shapes[0].color} {PLURALS[shapes[0].kind]}"

    def relation(self, a: _Shape, b: _Shape) -> str:
        return self.pick(RELATION_WORDS[self.pick(sorted(relations(a.box(), b.box())))])


def _listing(items: list[str]) -> str:
    return items[0] if len(items) == 1 else ", ".join(items[:-1]) + " and " + items[-1]


def _templates(shapes: list[_Shape], inside, p: _Words) -> list:
    """Caption makers for this image; each returns a caption or None where it does not apply."""
    by_name: dict[tuple[str, str], list[_Shape]] = {}
    for s in sorted(shapes, key=lambda s: s.x):  # listed left to right
        by_name.setdefault((s.kind, s.color), []).append(s)
    groups = [g for g in by_name.values() if len(g) > 1]
    singles = [g[0] for g in by_name.values() if len(g) == 1]
    areas = sorted(shapes, key=lambda s: -s.box()[2] * s.box()[3])
    largest = areas[0] if areas[0].box()[2] * areas[0].box()[3] >= 1.25 * areas[1].box()[2] * areas[1].box()[3] \
        and len(by_name[areas[0].kind, areas[0].color]) == 1 else None
    number = NUMBERS[len(shapes)]

    def everything(plain: bool):
        items = [p.group(g) if len(g) > 1 else p.noun(g[0], plain=plain) for g in by_name.values()]
        return f"{p.pick((number + ' shapes:', 'there are ' + number + ' shapes:'))} {_listing(items)}"

    def pair():
        if len(singles) < 2:
            return None
        a, b = (singles[i] for i in p.rng.choice(len(singles), size=2, replace=False))
        return a, b

    def related(prefix: str = ""):
        chosen = pair()
        return chosen and f"{prefix}{p.noun(chosen[0])} {p.relation(*chosen)} {p.noun(chosen[1])}"

    def counted():
        if not groups:
            return None
        rest = [p.noun(s) for s in singles[:2]]
        return _listing([p.group(g) for g in groups] + rest)

    def biggest():
        if largest is None:
            return None
        return p.pick((f"the largest shape is {p.noun(largest)}", f"{p.noun(largest)} is the largest shape",
                       f"{number} shapes, the biggest {p.noun(largest)}"))

    def nested():
        if inside is None:
            return None
        inner, outer = shapes[inside[0]], shapes[inside[1]]
        if p.rng.random() < 0.7:
            return f"{p.noun(inner)} {p.pick(RELATION_WORDS['inside'])} {p.noun(outer)}"
        return f"{p.noun(outer)} {p.pick(RELATION_WORDS['around'])} {p.noun(inner)}"

    return [lambda: everything(False), lambda: everything(True), related, lambda: related("there is "),
            lambda: related(p.pick(PICTURE) + " "), counted, biggest, nested]


def _captions(rng: np.random.Generator, shapes: list[_Shape], inside, count: int = 5) -> list[str]:
    words = _Words(rng)
    templates = _templates(shapes, inside, words)
    captions: list[str] = []
    for attempt in range(60):  # applicable templates in random order, again if fewer than `count` apply
        caption = templates[rng.integers(len(templates))]()
        if caption is None or len(tokenize_caption(caption)) > MAX_WORDS or (caption in captions and attempt < 50):
            continue
        captions.append(caption)
        if len(captions) == count:
            break
    while len(captions) < count:  # never reached in practice: every image can be listed plainly in 20 words
        captions.append(f"{NUMBERS[len(shapes)]} shapes")
    return [coco_surface(rng, caption) for caption in captions]


def make_scene(rng: np.random.Generator) -> tuple[bytes, int, int, list[str], list[ShapeBox]]:
    """One hard scene for ``captioning synth --scenes hard``: (JPEG bytes, width, height, five captions,
    each shape's annotation)."""
    w, h = (int(v) for v in rng.integers(200, 321, size=2))
    image = background(rng, w, h)
    _clutter(image, rng)
    shapes, inside = _place(rng, w, h, int(rng.integers(3, 7)))
    order = sorted(range(len(shapes)), key=lambda i: (inside is not None and i == inside[0], rng.random()))
    for i in order:  # a random stacking, the inner shape last
        _draw(image, shapes[i], rng)
    buf = io.BytesIO()
    image.save(buf, format="JPEG", quality=90)
    return buf.getvalue(), w, h, _captions(rng, shapes, inside), [s.annotation() for s in shapes]


def make_captions(rng: np.random.Generator) -> list[str]:
    """One hard scene's five captions alone (``captioning synth --text-only``): the scene is drawn as
    :func:`make_scene` draws it, its pixels are not (so the same ``rng`` gives another scene than
    :func:`make_scene`, from the same distribution)."""
    w, h = (int(v) for v in rng.integers(200, 321, size=2))
    shapes, inside = _place(rng, w, h, int(rng.integers(3, 7)))
    return _captions(rng, shapes, inside)
