"""The "shapes" dataset: deterministic synthetic images with COCO-format captions.

Real COCO (20 GB) cannot be fetched everywhere, so every stage of the project runs on this instead.
Each image is a JPEG of random size (200–320 px a side, rarely square) on a varied background (a flat
tint, a two-colour gradient or a noisy texture) with one to three non-overlapping shapes. A shape has
one of three kinds (circle, square, triangle), six colours and two sizes. Five captions per image are
drawn from different templates with synonyms, and every caption names what a model can only learn by
looking: how many shapes, their colours, kinds and sizes, and where they are (a 3×3 grid position for
one shape, "above / below / to the left of / to the right of" between two)::

    A small red circle above a large blue square.
    two shapes: a big blue square and a tiny red circle
    there is a little red circle over a large blue square
    a picture of a blue square below a small red circle
    A small red circle and a big blue square

Output, laid out as COCO ships it::

    D/images/shapes_000001.jpg …
    D/annotations/captions_{train,val,test}.json   # info, licenses, images, annotations
    D/annotations/instances_{train,val,test}.json  # + categories; one box per shape (see below)
    D/annotations/dataset_shapes.json              # Karpathy's dataset_coco.json layout

The instances files are COCO's object-detection layout, as real COCO ships them beside the captions:
the captions file's ``info``, ``licenses`` and ``images``, ``categories`` (the three kinds, ids 1–3 in
:data:`KINDS` order, supercategory ``shape``) and one annotation per shape: ``id``, ``image_id``,
``category_id``, ``bbox`` ``[x, y, width, height]`` (the tight box of the shape as drawn, in pixels of
the stored image, to 1/100 px: :func:`shape_bbox`), ``area`` (the box's), ``iscrowd`` 0 and
``attributes`` ``{"color", "size"}``. They let a caption's words be checked against what is drawn
(``captioning/grounding.py``).

Splits are 80/10/10 of a seeded shuffle. The same ``seed`` and ``num_images`` give byte-identical files
(given the same Pillow/libjpeg build). Generation runs in one process: 2,000 images take a few seconds.
The files are written by data_prep/synth.py, which also draws the hard scenes (data_prep/scenes.py).
"""

from __future__ import annotations

import io
from dataclasses import dataclass

import numpy as np
from PIL import Image, ImageDraw

from captioning.data.scenes import ShapeBox

COLORS = {
    "red": (215, 35, 35),
    "green": (40, 155, 50),
    "blue": (35, 70, 215),
    "yellow": (235, 205, 25),
    "purple": (135, 45, 170),
    "orange": (240, 125, 20),
}
KINDS = ("circle", "square", "triangle")
CATEGORIES = [{"id": i, "name": kind, "supercategory": "shape"} for i, kind in enumerate(KINDS, 1)]
SIZES = {"small": 0.24, "large": 0.40}  # diameter as a fraction of the image's shorter side
SIZE_WORDS = {"small": ("small", "little", "tiny"), "large": ("large", "big")}
RELATION_WORDS = {
    "above": ("above", "over"),
    "below": ("below", "under", "beneath"),
    "left": ("to the left of", "left of"),
    "right": ("to the right of", "right of"),
}
INVERSE = {"above": "below", "below": "above", "left": "right", "right": "left"}
POSITIONS = [  # 3x3 grid, row by row
    ("in the top left corner",), ("at the top", "near the top"), ("in the top right corner",),
    ("on the left", "on the left side"), ("in the center", "in the middle"), ("on the right", "on the right side"),
    ("in the bottom left corner",), ("at the bottom", "near the bottom"), ("in the bottom right corner",),
]
PICTURE = ("an image of", "a picture of", "a drawing of")
NUMBER = {2: "two", 3: "three"}
DESCRIPTION = "shapes: synthetic images of coloured shapes with five captions each"


@dataclass
class Shape:
    kind: str
    color: str
    size: str
    x: float  # centre
    y: float
    r: float  # radius of the bounding circle


def background(rng: np.random.Generator, w: int, h: int) -> Image.Image:
    kind = rng.integers(3)
    base = rng.integers(175, 250, size=3)
    if kind == 0:  # flat tint
        arr = np.broadcast_to(base, (h, w, 3)).astype(np.float32)
    elif kind == 1:  # linear gradient between two pale colours
        other = rng.integers(175, 250, size=3)
        t = np.linspace(0.0, 1.0, w if rng.integers(2) else h, dtype=np.float32)
        t = t[None, :, None] if t.shape[0] == w else t[:, None, None]
        arr = base * (1 - t) + other * t
        arr = np.broadcast_to(arr, (h, w, 3))
    else:  # noisy texture
        arr = base + rng.normal(0.0, 9.0, size=(h, w, 3))
    return Image.fromarray(np.clip(arr, 0, 255).astype(np.uint8), "RGB")


def _place(rng: np.random.Generator, w: int, h: int, count: int) -> list[Shape]:
    side = min(w, h)
    while True:
        shapes: list[Shape] = []
        for _ in range(count):
            size = ("small", "large")[rng.integers(2)]
            r = side * SIZES[size] / 2 * rng.uniform(0.92, 1.08)
            for _attempt in range(50):
                x, y = rng.uniform(r + 2, w - r - 2), rng.uniform(r + 2, h - r - 2)
                if all(np.hypot(x - s.x, y - s.y) > (r + s.r) * 1.15 for s in shapes):
                    break
            else:
                break  # no room: start the whole image again
            shapes.append(Shape(KINDS[rng.integers(3)], list(COLORS)[rng.integers(len(COLORS))], size, x, y, r))
        if len(shapes) == count and len({(s.kind, s.color, s.size) for s in shapes}) == count:
            return shapes


def _outline(s: Shape) -> list[tuple[float, float]]:
    """The points :func:`_draw` draws ``s`` with: a circle's or square's two box corners, a triangle's
    three vertices."""
    if s.kind == "triangle":
        return [(s.x, s.y - s.r), (s.x - s.r * 0.9, s.y + s.r * 0.7), (s.x + s.r * 0.9, s.y + s.r * 0.7)]
    half = s.r if s.kind == "circle" else s.r * 0.8
    return [(s.x - half, s.y - half), (s.x + half, s.y + half)]


def shape_bbox(s: Shape) -> list[float]:
    """The tight box ``[x, y, width, height]`` of ``s`` as drawn, in pixels, to 1/100: circle = centre ± r,
    square = centre ± 0.8 r, triangle = the extent of its three vertices.

    >>> shape_bbox(Shape("triangle", "red", "small", x=100.0, y=50.0, r=20.0))
    [82.0, 30.0, 36.0, 34.0]
    """
    xs, ys = zip(*_outline(s))
    x0, y0, x1, y1 = (float(v) for v in (min(xs), min(ys), max(xs), max(ys)))
    return [round(x0, 2), round(y0, 2), round(x1 - x0, 2), round(y1 - y0, 2)]


def _draw(image: Image.Image, shapes: list[Shape], rng: np.random.Generator) -> None:
    draw = ImageDraw.Draw(image)
    for s in shapes:
        color = tuple(int(np.clip(c + rng.integers(-12, 13), 0, 255)) for c in COLORS[s.color])
        draw_shape = {"circle": draw.ellipse, "square": draw.rectangle, "triangle": draw.polygon}[s.kind]
        draw_shape(_outline(s), fill=color)


def _relation(a: Shape, b: Shape) -> str:
    """Where ``a`` is relative to ``b``, along the axis on which they are further apart."""
    dx, dy = a.x - b.x, a.y - b.y
    if abs(dy) >= abs(dx):
        return "above" if dy < 0 else "below"
    return "left" if dx < 0 else "right"


def _position(s: Shape, w: int, h: int) -> int:
    return min(int(s.y / h * 3), 2) * 3 + min(int(s.x / w * 3), 2)


class _Phrases:
    """Random wording for one caption: synonyms are chosen afresh for each caption."""

    def __init__(self, rng: np.random.Generator, w: int, h: int):
        self.rng, self.w, self.h = rng, w, h

    def pick(self, options):
        return options[self.rng.integers(len(options))]

    def noun(self, s: Shape, article: bool = True) -> str:
        words = [s.color, s.kind]
        if self.rng.random() < 0.85:
            words.insert(0, self.pick(SIZE_WORDS[s.size]))
        phrase = " ".join(words)
        if not article:
            return phrase
        return ("an " if phrase[0] in "aeiou" else "a ") + phrase

    def relation(self, a: Shape, b: Shape) -> str:
        return self.pick(RELATION_WORDS[_relation(a, b)])

    def position(self, s: Shape) -> str:
        return self.pick(POSITIONS[_position(s, self.w, self.h)])


def _templates(shapes: list[Shape], p: _Phrases) -> list:
    """Caption makers for this image; each is called with fresh synonyms."""
    if len(shapes) == 1:
        (a,) = shapes
        return [
            lambda: f"{p.noun(a)} {p.position(a)}",
            lambda: f"there is {p.noun(a)} {p.position(a)}",
            lambda: f"{p.pick(PICTURE)} {p.noun(a)}",
            lambda: f"{p.pick(PICTURE)} {p.noun(a)} {p.position(a)}",
            lambda: f"a single {p.noun(a, article=False)} {p.position(a)}",
            lambda: f"one shape: {p.noun(a)} {p.position(a)}",
        ]
    if len(shapes) == 2:
        a, b = shapes
        return [
            lambda: f"{p.noun(a)} {p.relation(a, b)} {p.noun(b)}",
            lambda: f"{p.noun(b)} {p.relation(b, a)} {p.noun(a)}",
            lambda: f"two shapes: {p.noun(a)} and {p.noun(b)}",
            lambda: f"there is {p.noun(a)} {p.relation(a, b)} {p.noun(b)}",
            lambda: f"{p.pick(PICTURE)} {p.noun(b)} {p.relation(b, a)} {p.noun(a)}",
            lambda: f"{p.noun(a)} and {p.noun(b)}",
            lambda: f"{p.pick(PICTURE)} two shapes, {p.noun(a)} and {p.noun(b)}",
        ]
    a, b, c = sorted(shapes, key=lambda s: s.x)  # listed left to right
    return [
        lambda: f"three shapes: {p.noun(a)}, {p.noun(b)} and {p.noun(c)}",
        lambda: f"{p.noun(a)}, {p.noun(b)} and {p.noun(c)}",
        lambda: f"there are three shapes: {p.noun(a)}, {p.noun(b)} and {p.noun(c)}",
        lambda: f"{p.noun(a)} {p.relation(a, b)} {p.noun(b)} and {p.noun(c)}",
        lambda: f"{p.pick(PICTURE)} three shapes: {p.noun(a)}, {p.noun(b)} and {p.noun(c)}",
        lambda: f"{p.noun(b)} {p.relation(b, c)} {p.noun(c)}, and {p.noun(a)}",
    ]


def _captions(rng: np.random.Generator, shapes: list[Shape], w: int, h: int, count: int = 5) -> list[str]:
    phrases = _Phrases(rng, w, h)
    templates = _templates(shapes, phrases)
    order = rng.permutation(len(templates))[:count]
    captions: list[str] = []
    for i in order:
        for _ in range(20):  # synonyms rarely collide; try again if they do
            caption = templates[i]()
            if caption not in captions:
                break
        captions.append(coco_surface(rng, caption))
    return captions


def coco_surface(rng: np.random.Generator, caption: str) -> str:
    """COCO-like surface: most captions start with a capital (0.7), half end with a period."""
    if rng.random() < 0.7:
        caption = caption[0].upper() + caption[1:]
    if rng.random() < 0.5:
        caption += "."
    return caption


def make_image(rng: np.random.Generator) -> tuple[bytes, int, int, list[str]]:
    """One random image: (JPEG bytes, width, height, five captions)."""
    return _make_image(rng)[:4]


def make_scene(rng: np.random.Generator) -> tuple[bytes, int, int, list[str], list[ShapeBox]]:
    """One image for ``captioning synth`` (data_prep/synth.py): :func:`make_image`, and its shapes' boxes."""
    jpeg, w, h, captions, shapes = _make_image(rng)
    return jpeg, w, h, captions, [ShapeBox(s.kind, s.color, s.size, tuple(shape_bbox(s))) for s in shapes]


def _make_image(rng: np.random.Generator) -> tuple[bytes, int, int, list[str], list[Shape]]:
    """:func:`make_image`, and the shapes drawn."""
    w, h = (int(v) for v in rng.integers(200, 321, size=2))  # aspect ≤ 1.6: models squash to a square
    image = background(rng, w, h)
    shapes = _place(rng, w, h, int(rng.integers(1, 4)))
    _draw(image, shapes, rng)
    buf = io.BytesIO()
    image.save(buf, format="JPEG", quality=90)
    return buf.getvalue(), w, h, _captions(rng, shapes, w, h), shapes


def make_captions(rng: np.random.Generator) -> list[str]:
    """One image's five captions alone (``captioning synth --text-only``): the shapes are drawn as
    :func:`make_image` draws them, the pixels are not (so the same ``rng`` gives another image than
    :func:`make_image`, from the same distribution)."""
    w, h = (int(v) for v in rng.integers(200, 321, size=2))
    return _captions(rng, _place(rng, w, h, int(rng.integers(1, 4))), w, h)
