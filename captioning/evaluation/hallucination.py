"""Object hallucination: CHAIR (Rohrbach et al. 2018, "Object Hallucination in Image Captioning") and object recall.

``captioning evaluate --instances FILE`` reads objects from the captions and judges them against what is in
each image. Three numbers, over the captions scored (the best caption of each image):

- ``chair_i`` (CHAIRi) = hallucinated object mentions / all object mentions (None without any mention);
- ``chair_s`` (CHAIRs) = captions with at least one hallucinated mention / all captions (an empty caption,
  or one naming no object, counts as a caption without);
- ``object_recall`` = Σ over images of |objects present that the caption names| / Σ |objects present|
  (None when no image has any): each object of an image once, however often it is present or named.

:func:`load_objects` tells the two kinds of instances file apart by their content:

**COCO** (``instances_train2014.json`` …: no ``attributes``, every category one of COCO's 80). The
mentions are those of :func:`captioning.evaluation.coco_objects.object_mentions` (the synonym table and
rules of the reference ``chair.py``), and the objects present in an image are the categories of its
instances ∪ the objects its reference captions name, as in ``chair.py``. A mention is hallucinated when
its category is not among them. ``chair.py`` does not measure recall; here it is the categories named
among those present. The shapes' grounding (naming, relations, attention) is not measured on such a file:
it reads the colours and sizes only the synthetic data has (the result says so).

**The synthetic shapes** (``captioning synth``'s files: a colour per shape). The caption is read as noun
phrases (:mod:`captioning.evaluation.phrases`, the colours and kinds of the file and of the hard scenes);
a phrase with a kind word ("a small red circle", "three red circles", "a star") is one mention of that
kind, with its colour when it gives one. It is hallucinated when no shape of the image has that kind (and
that colour, when given): "a blue circle" beside a red circle is hallucinated, "a circle" is not. Size,
fill and number words are not judged (grounding's naming accuracy counts numbers). The objects present
are the image's distinct (colour, kind) pairs; one is named by a phrase giving that colour and that kind.

Worked example: an image with a red circle and a blue square, and one with a green triangle::

    >>> from captioning.data.scenes import ShapeBox
    >>> from captioning.evaluation.grounding import ImageShapes, Instances
    >>> box = (0, 0, 10, 10)
    >>> shapes = Instances({1: ImageShapes(99, 99, (ShapeBox("circle", "red", "small", box),
    ...                                             ShapeBox("square", "blue", "large", box))),
    ...                     2: ImageShapes(99, 99, (ShapeBox("triangle", "green", "small", box),))},
    ...                    kinds=("circle", "square", "triangle"), colors=("blue", "green", "red"))
    >>> found = chair(shapes, {1: "a red circle above a red square", 2: "a triangle"})
    >>> found.mentions, found.hallucinated_mentions, found.hallucinated_captions  # "red square" is not there
    (3, 1, 1)
    >>> found.chair_i, found.chair_s, found.objects_present, found.objects_named, found.object_recall
    (0.3333333333333333, 0.5, 3, 1, 0.3333333333333333)

(The triangle is named without its colour: no hallucination, but the green triangle is not recalled.)
"""

from __future__ import annotations

import collections
from dataclasses import asdict, dataclass
from typing import Mapping, Sequence

from captioning.data.scenes import HARD_COLORS, HARD_KINDS
from captioning.errors import InputError
from captioning.evaluation.coco_objects import CATEGORIES, object_mentions
from captioning.evaluation.grounding import Instances, image_of, parse_shapes, read_instances_file
from captioning.evaluation.phrases import noun_phrases
from captioning.text import tokenize_caption

SCALARS = ("chair_i", "chair_s", "object_recall")  # the result's keys, and TensorBoard's tags
COCO_NOTE = ("a COCO instances file: CHAIR over COCO's 80 categories; the shapes' grounding (naming, relations, "
             "attention) needs the synthetic data's colours and sizes and is not measured")


@dataclass(frozen=True)
class CocoObjects:
    """A COCO instances file: each image's categories (COCO's names), those of its instances."""

    images: Mapping[int, frozenset[str]]


def load_objects(instances: str) -> CocoObjects | Instances:
    """The instances file ``instances``: a COCO one (no ``attributes``, COCO's categories) as
    :class:`CocoObjects`, else a shapes one (:func:`captioning.evaluation.grounding.parse_shapes`). A file that
    is neither is an :class:`InputError` naming ``instances`` in one line."""
    data = read_instances_file(instances)
    coco = _coco_objects(data)
    if isinstance(coco, CocoObjects):
        return coco
    return parse_shapes(data, instances, also=f" (nor a COCO instances file: {coco})")


def shapes_of(objects: CocoObjects | Instances | None) -> Instances | None:
    """The shapes grounding reads, or None (no instances file, or COCO's)."""
    return objects if isinstance(objects, Instances) else None


def _coco_objects(data) -> CocoObjects | str:
    """``data`` as a COCO instances file, or why it is not one."""
    try:
        names = {int(c["id"]): str(c["name"]) for c in data["categories"]}
        images = {int(im["id"]): set() for im in data["images"]}
        annotations = list(data["annotations"])
        if any(isinstance(ann, dict) and "attributes" in ann for ann in annotations):
            return "its annotations have attributes"
        unknown = sorted(set(names.values()) - set(CATEGORIES))
        if unknown or not names:
            return f"category {unknown[0]!r} is not one of COCO's 80" if unknown else "no categories"
        for ann in annotations:
            image_id, category = int(ann["image_id"]), int(ann["category_id"])
            if image_id not in images or category not in names:
                return f"annotation {ann.get('id')} names image {image_id} or category {category}, which are not listed"
            images[image_id].add(names[category])
    except KeyError as e:
        return f"no {e}"
    except (TypeError, ValueError, AttributeError) as e:
        return str(e)
    return CocoObjects({i: frozenset(found) for i, found in images.items()})


@dataclass(frozen=True)
class Chair:
    """:func:`chair`'s counts; ``chair_i``, ``chair_s`` and ``object_recall`` are their ratios."""

    objects: str  # "coco" or "shapes"
    captions: int
    mentions: int
    hallucinated_mentions: int
    hallucinated_captions: int
    objects_present: int
    objects_named: int
    hallucinated: tuple[tuple[str, int], ...] = ()  # the most often hallucinated objects, with their counts

    @property
    def chair_i(self) -> float | None:
        return self.hallucinated_mentions / self.mentions if self.mentions else None

    @property
    def chair_s(self) -> float | None:
        return self.hallucinated_captions / self.captions if self.captions else None

    @property
    def object_recall(self) -> float | None:
        return self.objects_named / self.objects_present if self.objects_present else None

    def to_result(self, instances: str) -> dict:
        """The evaluation result's keys: ``chair_i``, ``chair_s``, ``object_recall`` and the counts under
        ``hallucination``."""
        counts = {**asdict(self), "instances": instances, "hallucinated": [list(p) for p in self.hallucinated]}
        if self.objects == "coco":
            counts["note"] = COCO_NOTE
        return {"chair_i": self.chair_i, "chair_s": self.chair_s, "object_recall": self.object_recall,
                "hallucination": counts}


def chair(objects: CocoObjects | Instances, captions: Mapping[int, str],
          references: Mapping[int, Sequence[str]] | None = None) -> Chair:
    """CHAIRi, CHAIRs and object recall (module docstring) of ``captions`` (image id → caption) on the images of
    ``objects`` (:func:`load_objects`); ``references`` (image id → its reference captions) add the objects they
    name to those present, for a COCO file."""
    coco = isinstance(objects, CocoObjects)
    judge = _coco_judge(objects, references or {}) if coco else _shapes_judge(objects)
    totals, missed = collections.Counter(), collections.Counter()
    for image_id, caption in captions.items():
        if not isinstance(caption, str):
            raise InputError(f"`captions` has {caption!r} for image {image_id}, not a caption", params=("captions",))
        present, mentions = judge(image_id, tokenize_caption(caption))
        wrong = [name for name, right, _ in mentions if not right]
        missed.update(wrong)
        named = {key for _, right, key in mentions if right and key is not None}
        totals.update(captions=1, mentions=len(mentions), hallucinated_mentions=len(wrong),
                      hallucinated_captions=int(bool(wrong)), objects_present=len(present),
                      objects_named=len(named))
    fields = ("captions", "mentions", "hallucinated_mentions", "hallucinated_captions", "objects_present",
              "objects_named")
    return Chair("coco" if coco else "shapes", *(int(totals[f]) for f in fields),
                 hallucinated=tuple(sorted(missed.items(), key=lambda p: (-p[1], p[0]))[:10]))


# A judge: (image id, the caption's words) -> (the objects present, the caption's mentions as (what it names, whether
# it is right, the object present it recalls or None)).


def _coco_judge(objects: CocoObjects, references: Mapping[int, Sequence[str]]):
    def judge(image_id, words):
        present = set(image_of(objects, image_id, "captions"))
        for text in references.get(image_id, ()):
            present.update(node for _, node in object_mentions(tokenize_caption(text)))
        return present, [(node, node in present, node) for _, node in object_mentions(words)]
    return judge


def _shapes_judge(instances: Instances):
    colors = tuple(sorted(set(instances.colors) | set(HARD_COLORS)))
    kinds = tuple(dict.fromkeys(instances.kinds + HARD_KINDS))

    def judge(image_id, words):
        shapes = image_of(instances, image_id, "captions").shapes
        present = {(s.color, s.kind) for s in shapes}
        mentions = []
        for phrase in noun_phrases(words, colors, kinds):
            if phrase.kind is None:
                continue  # a colour alone ("a red one") names no object
            if phrase.color is None:  # right when that kind is there; recalls no (colour, kind)
                mentions.append((phrase.kind, any(s.kind == phrase.kind for s in shapes), None))
            else:
                pair = (phrase.color, phrase.kind)
                mentions.append((f"{phrase.color} {phrase.kind}", pair in present, pair))
        return present, mentions
    return judge


def describe(result: Mapping) -> str:
    """CHAIR in plain words, for ``captioning evaluate``'s summary ("" without it)."""
    found = result.get("hallucination")
    if not found:
        return ""
    what = "COCO's 80 objects" if found["objects"] == "coco" else "shapes by kind and colour"

    def share(value):
        return "-" if value is None else f"{value:.3f}"

    lines = [f"hallucination ({what}): CHAIRi {share(result['chair_i'])} ({found['hallucinated_mentions']} of "
             f"{found['mentions']} object mentions name an object the image lacks), CHAIRs "
             f"{share(result['chair_s'])} ({found['hallucinated_captions']} of {found['captions']} captions), "
             f"object recall {share(result['object_recall'])} ({found['objects_named']} of {found['objects_present']} "
             "objects present named)"]
    if found.get("hallucinated"):
        lines.append("  most hallucinated: " + ", ".join(f"{name} {n}" for name, n in found["hallucinated"]))
    if found.get("note"):
        lines.append(f"  ({found['note']})")
    return "\n".join(lines)

