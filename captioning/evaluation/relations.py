"""Relations named correctly: "a green square to the left of a yellow triangle", judged by the boxes.

For each generated caption, every relation mention (:func:`captioning.evaluation.phrases.relation_mentions`:
two noun phrases with only relation words between them) is

- *judged* when each phrase names exactly one shape of the image (:func:`~captioning.evaluation.phrases.named`:
  its colour and kind, a fill word picking among several; no number word), and then *correct* when the relation holds of the first
  shape's box to the second's by :func:`captioning.data.scenes.relations` (the rule the hard scenes'
  captions are written with);
- otherwise skipped as *unresolved*: a phrase names no shape, or several.

Accuracy = correct / judged, per number of shapes in the image (as the naming accuracy of
:mod:`captioning.evaluation.grounding`) and over all images; ``mentions_per_image`` shows how often a
model names a relation at all, since a model that never does has no wrong ones. On the shapes data
(data_prep/shapes.py) the captions' relations come from the shapes' centres rather than their boxes:
a triangle's box centre lies below its centre, so a few near-diagonal pairs of the references
themselves are judged wrong there (97% of them are right, tests/test_relations.py).

    >>> from captioning.data.scenes import ShapeBox
    >>> from captioning.evaluation.grounding import ImageShapes, Instances
    >>> image = ImageShapes(100, 100, (ShapeBox("square", "green", "small", (0, 40, 20, 20)),
    ...                                ShapeBox("triangle", "yellow", "large", (60, 30, 40, 40))))
    >>> shapes = Instances({1: image}, kinds=("square", "triangle"), colors=("green", "yellow"))
    >>> found = relation_accuracy(shapes, {1: "a green square to the left of a yellow triangle below two squares"})
    >>> found.groups["all"]
    RelationGroup(images=1, mentions=2, judged=1, correct=1, unresolved=1, accuracy=1.0, mentions_per_image=2.0)
"""

from __future__ import annotations

import collections
from dataclasses import asdict, dataclass
from typing import Mapping

from captioning.data.scenes import relations
from captioning.evaluation.grounding import Instances, checked_caption, group_names, image_of
from captioning.evaluation.phrases import named, noun_phrases, relation_mentions
from captioning.text import tokenize_caption


@dataclass(frozen=True)
class RelationGroup:
    """Relation mentions over one group of images; ``accuracy`` is None when none was judged."""

    images: int
    mentions: int
    judged: int
    correct: int
    unresolved: int
    accuracy: float | None
    mentions_per_image: float | None


@dataclass(frozen=True)
class RelationAccuracy:
    """:func:`relation_accuracy`'s result: ``groups["3"]`` … ``groups["all"]``."""

    groups: dict[str, RelationGroup]

    def to_json(self) -> dict:
        return {name: asdict(group) for name, group in self.groups.items()}


def relation_accuracy(instances: Instances, captions: Mapping[int, str]) -> RelationAccuracy:
    """How many of the relations ``captions`` (image id → generated caption) name hold (module docstring)."""
    counts: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    images = []
    for image_id, caption in captions.items():
        images.append(image := image_of(instances, image_id, "captions"))
        words = tokenize_caption(checked_caption(image_id, caption))
        tally = collections.Counter(images=1)
        for a, relation, b in relation_mentions(words, noun_phrases(words, instances.colors, instances.kinds)):
            tally["mentions"] += 1
            first, second = named(a, image.shapes), named(b, image.shapes)
            if a.count != 1 or b.count != 1 or len(first) != 1 or len(second) != 1:
                tally["unresolved"] += 1
                continue
            tally["judged"] += 1
            tally["correct"] += relation in relations(first[0].bbox, second[0].bbox)
        for group in (str(len(image.shapes)), "all"):
            counts[group].update(tally)
    groups = {}
    for name in group_names(images):
        c = counts.get(name, collections.Counter())
        groups[name] = RelationGroup(c["images"], c["mentions"], c["judged"], c["correct"], c["unresolved"],
                                     c["correct"] / c["judged"] if c["judged"] else None,
                                     c["mentions"] / c["images"] if c["images"] else None)
    return RelationAccuracy(groups)
