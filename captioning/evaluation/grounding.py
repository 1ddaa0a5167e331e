"""Grounding on the synthetic data: does a caption name the shapes drawn, and does the model look at them?

``captioning synth`` writes, beside each captions file, a COCO instances file: a box, a colour, a size
and (hard scenes) a fill per shape (``annotations/instances_{split}.json``; data_prep/synth.py).
:func:`load_instances` reads it; two pure functions score generated captions against it (a third, for
relations, is :mod:`captioning.evaluation.relations`). They split their numbers by the number of
shapes in the image (groups ``"1"``, ``"2"``, ``"3"``, any other count present, and ``"all"``; a group
with nothing in it gives None).

**Naming** (:func:`naming_accuracy`). Each caption is plain text, tokenised with
:func:`captioning.text.tokenize_caption` and read as noun phrases (:mod:`captioning.evaluation.phrases`:
"a small red circle", "three red circles", "a star"), each naming its count of shapes (1 without a
number word). For an image with shapes S:

- colour hits = Σ over colours c of min(number of shapes of colour c, number of times the caption names
  c): multiplicity counts, two red shapes need "red" twice or "two red ...";
- kind hits, the same over kinds;
- both hits = Σ over (c, k) of min(number of shapes that are a c k, number of phrases "c k" in the
  caption): the colour word right before the kind word, so "a small red circle" holds "red circle"
  (size and fill words are allowed and not judged).

A group's accuracy is Σ hits / Σ |S| over its images: a mean over shapes, each shape counting once.
It is a recall: naming a shape that is not there costs nothing here (attention counts it as unmatched).

**Attention** (:func:`attention_localisation`). A decoder's attention weights for one word are a
distribution over a grid of h × w cells (cell index row * w + col) laid evenly over what the model
sees: the W × H image squashed to R × R (``resize_size``, aspect not kept), then the central S × S
window (``image_size``, offset (R − S) // 2 on each axis). A box maps there by the same scaling and
shift (:func:`box_coverage`). For a word naming a shape:

- mass = Σ_cells α_cell × (fraction of the cell's area the box covers): the attention inside the box;
- area = the box's share of the S × S crop: the mass uniform attention would give.

A model reading **regions** (``regions``: each image's region boxes) attends over its regions instead
of a grid: a region's coverage is the fraction of *its* area that the named shape's box covers, the mass
Σ_regions α_region × coverage, and the area the mean coverage over the image's regions (what uniform
attention over them gives). A whole-image region covers the shape by the shape's share of the image; an
oracle box of the shape covers it wholly.

The caption's words are read as the same phrases. A phrase naming exactly one shape of the image
(colour and kind, those it gives, equal, a fill word picking among several; no number word) scores its
colour and kind words on that shape; its words are otherwise skipped as *unmatched* (no such shape: "blue circle" for a red one) or
*ambiguous* (several: "circle" beside two circles, or "two circles"), or as *outside* when the box lies
wholly outside the crop. Per group and per word type
(colour words, kind words): the mean mass, the mean area, their ratio (ratio of means) and the mean of
each word's mass / area (mean ratio). A ratio of 1 is attention no better than uniform.

Worked example: a red circle in the top-left quarter of a 100 × 100 image, seen whole (R = S = 100) on
a 2 × 2 grid; the caption names it, and a blue square that is not there::

    >>> shapes = Instances({7: ImageShapes(100, 100, (ShapeBox("circle", "red", "small", (0, 0, 50, 50)),))},
    ...                    kinds=("circle", "square"), colors=("blue", "red"))
    >>> naming_accuracy(shapes, {7: "A red circle and a blue square."}).groups["1"]
    NamingGroup(images=1, shapes=1, color=1.0, kind=1.0, both=1.0)
    >>> words = ["a", "red", "circle", "and", "a", "blue", "square"]
    >>> alpha = [[.25, .25, .25, .25], [.7, .1, .1, .1], [.4, .2, .2, .2]] + [[.25] * 4] * 4
    >>> result = attention_localisation(shapes, {7: (words, alpha)}, grid=(2, 2), resize_size=100,
    ...                                 image_size=100)
    >>> red = result.color["all"]  # "red": 0.7 of its attention on a quarter of the crop; "blue" names nothing
    >>> red.words, red.mean_mass, red.mean_area, red.ratio_of_means, red.skipped_unmatched
    (1, 0.7, 0.25, 2.8, 1)
    >>> result.kind["1"].mean_mass, result.kind["1"].skipped_unmatched  # "circle" 0.4; "square" names nothing
    (0.4, 1)
"""

from __future__ import annotations

import collections
import json
from dataclasses import asdict, dataclass
from typing import Mapping, Sequence

import numpy as np

from captioning.data.scenes import ShapeBox
from captioning.evaluation.coverage import box_coverage, region_coverage
from captioning.errors import InputError
from captioning.evaluation.phrases import named, noun_phrases
from captioning.text import tokenize_caption

GROUPS = ("1", "2", "3")  # always reported, with "all"; images with other counts add their own group


@dataclass(frozen=True)
class ImageShapes:
    """An image's stored size and its shapes."""

    width: int
    height: int
    shapes: tuple[ShapeBox, ...]


@dataclass(frozen=True)
class Instances:
    """An instances file: the images by id, the kinds (category names in id order) and the colours
    (those its annotations use, sorted): the words :func:`attention_localisation` reads as naming a
    shape. (A colour no shape of the file has is then an ordinary word; ``dataclasses.replace`` sets
    another list.)"""

    images: Mapping[int, ImageShapes]
    kinds: tuple[str, ...]
    colors: tuple[str, ...]


def load_instances(instances: str) -> Instances:
    """Reads a COCO instances file with ``attributes`` ``{"color", "size"}`` per annotation, as
    ``captioning synth`` writes it. A missing, unreadable or garbled file is an :class:`InputError`
    naming ``instances``. (:func:`captioning.evaluation.hallucination.load_objects` also takes COCO's own.)"""
    return parse_shapes(read_instances_file(instances), instances)


def read_instances_file(instances: str):
    """The JSON document of the file ``instances``; an :class:`InputError` naming ``instances`` if it cannot
    be read or is not JSON."""
    try:
        with open(instances, encoding="utf-8") as f:
            return json.load(f)
    except OSError as e:
        raise InputError(f"`instances` {instances}: cannot read it ({e.strerror or e})",
                         params=("instances",)) from None
    except ValueError as e:  # JSONDecodeError, UnicodeDecodeError
        raise InputError(f"`instances` {instances} is not JSON ({e})", params=("instances",)) from None


def parse_shapes(data, instances: str, also: str = "") -> Instances:
    """``data``, the document of the file ``instances``, read as a shapes instances file; an
    :class:`InputError` naming ``instances`` if it is not one (``also``: words added to its reason)."""
    try:
        return _parse_instances(data)
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        reason = f"no {e}" if isinstance(e, KeyError) else str(e)
        raise InputError(f"`instances` {instances} is not a shapes instances file: {reason}{also}",
                         params=("instances",)) from None


def check_covers(instances: Instances, image_ids, split: str, path: str) -> None:
    """An InputError naming ``instances`` (at ``path``) unless it lists every image (``image_ids``) of
    ``split``: the wrong split's file is found before the split is decoded and scored."""
    ids = sorted(int(i) for i in image_ids)
    missing = [i for i in ids if i not in instances.images]
    if not missing:
        return
    which = "none" if len(missing) == len(ids) else f"{len(ids) - len(missing)}"  # the number it lists
    raise InputError(f"`instances` {path} lists {which} of the {len(ids)} images of split {split} (e.g. image "
                     f"{missing[0]}): give that split's instances file (captioning synth writes "
                     f"annotations/instances_{split}.json)", params=("instances",))


def _parse_instances(data: dict) -> Instances:
    kinds = {int(c["id"]): str(c["name"]) for c in data["categories"]}
    sizes = {int(im["id"]): (int(im["width"]), int(im["height"])) for im in data["images"]}
    if any(w <= 0 or h <= 0 for w, h in sizes.values()):
        raise ValueError("an image has no pixels")
    shapes: dict[int, list[ShapeBox]] = {image_id: [] for image_id in sizes}
    for ann in data["annotations"]:
        image_id, category = int(ann["image_id"]), int(ann["category_id"])
        if image_id not in sizes or category not in kinds:
            raise ValueError(f"annotation {ann.get('id')} names image {image_id} or category {category}, "
                             "which are not listed")
        bbox = tuple(float(v) for v in ann["bbox"])
        if len(bbox) != 4 or bbox[2] < 0 or bbox[3] < 0:
            raise ValueError(f"annotation {ann.get('id')} has the bbox {ann['bbox']}, not [x, y, width, height]")
        attributes = ann["attributes"]
        fill = attributes.get("fill")
        shapes[image_id].append(ShapeBox(kinds[category], str(attributes["color"]), str(attributes["size"]), bbox,
                                         None if fill is None else str(fill)))
    images = {i: ImageShapes(w, h, tuple(shapes[i])) for i, (w, h) in sizes.items()}
    colors = tuple(sorted({s.color for image in images.values() for s in image.shapes}))
    return Instances(images, tuple(kinds[i] for i in sorted(kinds)), colors)


def image_of(instances: Instances, image_id, param: str) -> ImageShapes:
    try:
        return instances.images[image_id]
    except (KeyError, TypeError):
        raise InputError(f"`{param}` has image {image_id!r}, which the instances file does not list",
                         params=(param,)) from None


def checked_caption(image_id, caption) -> str:
    """``caption``, the caption given for ``image_id`` in ``captions``; an InputError when it is not a string."""
    if not isinstance(caption, str):
        raise InputError(f"`captions` has {caption!r} for image {image_id}, not a caption", params=("captions",))
    return caption


def group_names(images: list[ImageShapes]) -> list[str]:
    counts = {str(len(image.shapes)) for image in images} | set(GROUPS)
    return sorted(counts, key=int) + ["all"]


@dataclass(frozen=True)
class NamingGroup:
    """Naming accuracy over one group of images: shares of their shapes (None when it has none)."""

    images: int
    shapes: int
    color: float | None
    kind: float | None
    both: float | None


@dataclass(frozen=True)
class NamingAccuracy:
    """:func:`naming_accuracy`'s result: ``groups["1"]`` … ``groups["all"]``."""

    groups: dict[str, NamingGroup]

    def to_json(self) -> dict:
        return {name: asdict(group) for name, group in self.groups.items()}


def naming_hits(words: Sequence[str], shapes: Sequence[ShapeBox], colors: Sequence[str] | None = None,
                kinds: Sequence[str] | None = None) -> tuple[int, int, int]:
    """(colour, kind, both) hits of a tokenised caption on an image's shapes (module docstring); the
    colour and kind words are ``colors`` and ``kinds`` (by default those of ``shapes``).

    >>> red_circle, red_square = ShapeBox("circle", "red", "small", (0, 0, 1, 1)), ShapeBox("square", "red",
    ...     "large", (2, 2, 1, 1))
    >>> naming_hits("a red circle and a big blue square".split(), [red_circle, red_square], ("blue", "red"))
    (1, 2, 1)
    >>> naming_hits("two red squares".split(), [red_circle, red_square])  # a count names that many
    (2, 1, 1)
    """
    colors = sorted({s.color for s in shapes}) if colors is None else colors
    kinds = sorted({s.kind for s in shapes}) if kinds is None else kinds
    said, pairs = collections.Counter(), collections.Counter()
    for phrase in noun_phrases(words, colors, kinds):
        said[phrase.color] += phrase.count
        said[phrase.kind] += phrase.count
        pairs[phrase.color, phrase.kind] += phrase.count
    hits = lambda counts, spoken: sum(min(n, spoken[key]) for key, n in counts.items())  # noqa: E731
    return (hits(collections.Counter(s.color for s in shapes), said),
            hits(collections.Counter(s.kind for s in shapes), said),
            hits(collections.Counter((s.color, s.kind) for s in shapes), pairs))


def naming_accuracy(instances: Instances, captions: Mapping[int, str]) -> NamingAccuracy:
    """Colour, kind and both accuracy (module docstring) of ``captions`` (image id → generated caption;
    from a COCO results file: ``{p["image_id"]: p["caption"] for p in results}``), by number of shapes."""
    totals, images = {}, []
    for image_id, caption in captions.items():
        image = image_of(instances, image_id, "captions")
        caption = checked_caption(image_id, caption)
        images.append(image)
        row = np.array([1, len(image.shapes), *naming_hits(tokenize_caption(caption), image.shapes,
                                                            instances.colors, instances.kinds)])
        for name in (str(len(image.shapes)), "all"):
            totals[name] = totals.get(name, 0) + row
    groups = {}
    for name in group_names(images):
        n_images, n_shapes, *hits = (int(v) for v in totals.get(name, [0] * 5))
        groups[name] = NamingGroup(n_images, n_shapes, *(h / n_shapes if n_shapes else None for h in hits))
    return NamingAccuracy(groups)


@dataclass(frozen=True)
class LocalisationGroup:
    """Attention on the named shape, over one group's words of one type (means None without words)."""

    words: int
    mean_mass: float | None
    mean_area: float | None
    ratio_of_means: float | None
    mean_ratio: float | None
    skipped_unmatched: int
    skipped_ambiguous: int
    skipped_outside: int


@dataclass(frozen=True)
class Localisation:
    """:func:`attention_localisation`'s result: ``color["1"]`` … ``color["all"]``, the same for ``kind``."""

    color: dict[str, LocalisationGroup]
    kind: dict[str, LocalisationGroup]

    def to_json(self) -> dict:
        return {"color": {k: asdict(g) for k, g in self.color.items()},
                "kind": {k: asdict(g) for k, g in self.kind.items()}}


def _check_geometry(grid, resize_size: int, image_size: int) -> tuple[int, int]:
    if not (isinstance(grid, (tuple, list)) and len(grid) == 2
            and all(isinstance(n, (int, np.integer)) and n > 0 for n in grid)):
        raise InputError(f"`grid` must be (rows, columns), two positive integers; got {grid!r}", params=("grid",))
    if not 0 < image_size <= resize_size:
        raise InputError(f"`image_size` ({image_size}) must be positive and at most `resize_size` ({resize_size})",
                         params=("image_size", "resize_size"))
    return int(grid[0]), int(grid[1])


def _weights(image_id, words: Sequence[str], weights, grid: tuple[int, int] | None, regions: int = 0,
             prefix: int = 0) -> np.ndarray:
    """The words' weights ``[words, rows * cols]`` over the map (the ``prefix`` tokens before it, placeless, left
    out: their share is on no shape), checked."""
    alpha = np.asarray(weights, dtype=np.float64)
    cells = grid[0] * grid[1] + prefix if grid else regions
    if grid and alpha.ndim == 3 and alpha.shape[1:] == grid:
        alpha = alpha.reshape(len(alpha), cells)
    if alpha.shape != (len(words), cells):
        where = f"on a {grid[0]}x{grid[1]} grid" if grid else f"over {regions} regions"
        raise InputError(f"`attention` of image {image_id}: weights of shape {alpha.shape} for {len(words)} words "
                         f"{where}; expected ({len(words)}, {cells})", params=("attention",))
    if not np.isfinite(alpha).all() or (alpha < 0).any() or (np.abs(alpha.sum(axis=1) - 1) > 1e-3).any():
        raise InputError(f"`attention` of image {image_id}: each word's weights must be >= 0 and sum to 1",
                         params=("attention",))
    return alpha[:, prefix:]


def attention_localisation(instances: Instances, attention: Mapping[int, tuple[Sequence[str], object]],
                           grid: tuple[int, int] | None = None, resize_size: int = 0, image_size: int = 0,
                           regions: Mapping[int, object] | None = None, prefix: int = 0) -> Localisation:
    """How much of each shape-naming word's attention falls on the shape it names (module docstring).

    ``attention``: image id → (the caption's words, their weights ``[len(words), rows * cols]``, or
    ``[len(words), rows, cols]``, or over the image's regions ``[len(words), n]``), each row summing to 1;
    ``grid`` = (rows, cols), after ``prefix`` tokens that have no place (a ViT's class token: weights
    ``[len(words), prefix + rows * cols]``, whose share on the prefix is on no shape); ``resize_size`` and ``image_size`` as the model's ``data.resize_size`` and
    ``data.image_size``; or, for a model reading regions, ``regions``: image id → its boxes ``[n, 4]``
    (x1, y1, x2, y2 as fractions of the image)."""
    if regions is None:
        grid = _check_geometry(grid, resize_size, image_size)
    scored = {part: collections.defaultdict(list) for part in ("color", "kind")}  # group -> [(mass, area)]
    skipped = {part: collections.Counter() for part in ("color", "kind")}  # (group, reason) -> words
    images = []
    for image_id, (words, weights) in attention.items():
        images.append(image := image_of(instances, image_id, "attention"))
        if regions is None:
            alpha = _weights(image_id, words := list(words), weights, grid, prefix=prefix)
        else:
            boxes = np.asarray(regions[image_id], dtype=np.float64).reshape(-1, 4)
            alpha = _weights(image_id, words := list(words), weights, None, len(boxes))
        groups = (str(len(image.shapes)), "all")
        for phrase in noun_phrases(words, instances.colors, instances.kinds):
            fits = named(phrase, image.shapes)  # a counted phrase ("two circles") names several: ambiguous
            coverage = None
            if len(fits) == 1 and phrase.count == 1:
                coverage = (box_coverage(fits[0].bbox, image.width, image.height, grid, resize_size, image_size)
                            if regions is None else region_coverage(fits[0].bbox, image.width, image.height, boxes))
            for p in phrase.heads:
                part = "color" if words[p] in instances.colors else "kind"
                for group in groups:
                    if coverage is None:
                        skipped[part][group, "unmatched" if not fits else "ambiguous"] += 1
                    elif coverage.sum() == 0:
                        skipped[part][group, "outside"] += 1
                    else:
                        scored[part][group].append((float(alpha[p] @ coverage), float(coverage.mean())))
    names = group_names(images)
    return Localisation(*({name: _localisation_group(scored[part][name], skipped[part], name) for name in names}
                          for part in ("color", "kind")))


def _localisation_group(pairs: list[tuple[float, float]], skipped: collections.Counter, name: str):
    counts = [skipped[name, reason] for reason in ("unmatched", "ambiguous", "outside")]
    if not pairs:
        return LocalisationGroup(0, None, None, None, None, *counts)
    mass, area = np.array(pairs).T
    means = [float(mass.mean()), float(area.mean())]
    return LocalisationGroup(len(pairs), *means, means[0] / means[1], float((mass / area).mean()), *counts)
