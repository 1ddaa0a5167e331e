"""Object hallucination: CHAIR (Rohrbach et al. 2018, "Object Hallucination in Image Captioning") and object recall.

``captioning evaluate --instances FILE`` reads objects from the captions and judges them against what is in
each image. Three numbers, over the captions scored (the best caption of each image):

- ``chair_i`` (CHAIRi) = hallucinated object mentions / all object mentions (None without any mention);
- ``chair_s`` (CHAIRs) = captions with at least one hallucinated mention / all captions (an empty caption,
  or one naming no object, counts as a caption without);
- ``object_recall`` = Σ over images of |objects present that the caption names| / Σ |objects present|
  (None when no image has any): each object of an image once, however often it is present or named.

:func:`load_objects` tells the two kinds of instances file apart by their content:

**COCO** (``instances_train2014.json`` …: no ``attributes``, every category one of COCO's 80). A
caption's mentions are read by each of the :data:`RULES`: ``"published"``, chair.py's reading bug for bug
(:mod:`captioning.evaluation.chair_published`), whose numbers are ``chair_i``, ``chair_s`` and
``object_recall`` (the published CHAIR tables come from that script: numbers under CHAIR's name stay
comparable with them, as BLEU keeps pycocoevalcap's smoothing); and ``"corrected"``, the paper's definition
(:func:`captioning.evaluation.coco_objects.corrected_mentions`), as ``chair_i_corrected``,
``chair_s_corrected`` and ``object_recall_corrected``, with its counts under ``hallucination_corrected``.
Both cost milliseconds, so a COCO result always holds both (docs/using.md lists every known difference).
The objects present in an image are the categories of its instances ∪ the objects its reference captions
name (read by the same rules), as in ``chair.py``. A mention is hallucinated when its category is not among
them. ``chair.py`` does not measure recall; here it is the categories named among those present. The
shapes' grounding (naming, relations, attention) is not measured on such a file: it reads the colours and
sizes only the synthetic data has (the result says so). :func:`coco_sentences` gives each caption's
mentions and hallucinated objects, as chair.py's per-sentence output.

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
from typing import Callable, Mapping, Sequence

from captioning.data.scenes import HARD_COLORS, HARD_KINDS
from captioning.errors import InputError
from captioning.evaluation import chair_published
from captioning.evaluation.coco_objects import CATEGORIES, corrected_mentions
from captioning.evaluation.grounding import Instances, checked_caption, image_of, parse_shapes, read_instances_file
from captioning.evaluation.phrases import noun_phrases
from captioning.config.settings import registered
from captioning.text import tokenize_caption


@dataclass(frozen=True)
class Rules:
    """One reading of COCO objects in a caption: ``mentions`` (a caption → its (word, category) mentions) and
    ``suffix``, that of its result's keys (``chair_i<suffix>``, ``hallucination<suffix>``)."""

    mentions: Callable[[str], list[tuple[str, str]]]
    suffix: str
    title: str


# the readings of a COCO caption (module docstring), the first the default: chair() takes one by name
RULES = {"published": Rules(chair_published.mentions, "", "chair.py's reading, as published"),
         "corrected": Rules(corrected_mentions, "_corrected", "the corrected reading")}
DEFAULT_RULES = next(iter(RULES))
# the result's keys, and TensorBoard's tags
SCALARS = tuple(f"{key}{rules.suffix}" for rules in RULES.values() for key in ("chair_i", "chair_s", "object_recall"))
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
    rules: str | None = None  # of RULES, for a COCO file (the shapes have one reading)

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
        ``hallucination``, each with its rules' suffix (``chair_i_corrected``; the shapes': none)."""
        counts = {**asdict(self), "instances": instances, "hallucinated": [list(p) for p in self.hallucinated]}
        if self.objects == "coco":
            counts["note"] = COCO_NOTE
        suffix = RULES[self.rules].suffix if self.rules else ""
        return {f"chair_i{suffix}": self.chair_i, f"chair_s{suffix}": self.chair_s,
                f"object_recall{suffix}": self.object_recall, f"hallucination{suffix}": counts}


@dataclass(frozen=True)
class Sentence:
    """One caption as chair.py's per-sentence output has it: its mentions (word, category) in order, and those
    whose category the image lacks; ``present``: the image's objects (instances ∪ references')."""

    mentions: tuple[tuple[str, str], ...]
    hallucinated: tuple[tuple[str, str], ...]
    present: frozenset[str]

    @property
    def chair_i(self) -> float | None:
        return len(self.hallucinated) / len(self.mentions) if self.mentions else None

    @property
    def chair_s(self) -> int:
        return int(bool(self.hallucinated))


def coco_sentences(objects: CocoObjects, captions: Mapping[int, str],
                   references: Mapping[int, Sequence[str]] | None = None,
                   rules: str = DEFAULT_RULES) -> dict[int, Sentence]:
    """Each caption of ``captions`` (image id → caption) read by ``rules`` (a name of :data:`RULES`) and
    judged against its image in ``objects`` and the objects its ``references`` name."""
    read = registered(RULES, "rules", rules).mentions
    found = {}
    for image_id, caption in captions.items():
        caption = checked_caption(image_id, caption)
        present = set(image_of(objects, image_id, "captions"))
        for text in (references or {}).get(image_id, ()):
            present.update(node for _, node in read(text))
        said = tuple(read(caption))
        found[image_id] = Sentence(said, tuple(m for m in said if m[1] not in present), frozenset(present))
    return found


def chair(objects: CocoObjects | Instances, captions: Mapping[int, str],
          references: Mapping[int, Sequence[str]] | None = None, rules: str = DEFAULT_RULES) -> Chair:
    """CHAIRi, CHAIRs and object recall (module docstring) of ``captions`` (image id → caption) on the images of
    ``objects`` (:func:`load_objects`); ``references`` (image id → its reference captions) add the objects they
    name to those present, for a COCO file, read by ``rules`` (a name of :data:`RULES`; the shapes have one
    reading: the default)."""
    coco = isinstance(objects, CocoObjects)
    if not coco and registered(RULES, "rules", rules) is not RULES[DEFAULT_RULES]:
        raise InputError(f"the synthetic shapes are read one way: rules {rules!r} are for a COCO instances file",
                         params=("rules",))
    totals, missed = collections.Counter(), collections.Counter()
    if coco:
        judged = [(s.present, [(node, node in s.present, node) for _, node in s.mentions])
                  for s in coco_sentences(objects, captions, references, rules).values()]
    else:
        judge = _shapes_judge(objects)
        judged = [judge(image_id, caption) for image_id, caption in captions.items()]
    for present, mentions in judged:  # mentions: (what it names, whether it is right, the object it recalls)
        wrong = [name for name, right, _ in mentions if not right]
        missed.update(wrong)
        named = {key for _, right, key in mentions if right and key is not None}
        totals.update(captions=1, mentions=len(mentions), hallucinated_mentions=len(wrong),
                      hallucinated_captions=int(bool(wrong)), objects_present=len(present),
                      objects_named=len(named))
    fields = ("captions", "mentions", "hallucinated_mentions", "hallucinated_captions", "objects_present",
              "objects_named")
    return Chair("coco" if coco else "shapes", *(int(totals[f]) for f in fields),
                 hallucinated=tuple(sorted(missed.items(), key=lambda p: (-p[1], p[0]))[:10]),
                 rules=rules if coco else None)


def results(objects: CocoObjects | Instances, captions: Mapping[int, str],
            references: Mapping[int, Sequence[str]] | None, instances: str) -> dict:
    """The evaluation result's CHAIR keys (:meth:`Chair.to_result`): for a COCO file those of every one of
    :data:`RULES`, for the shapes' their one reading's."""
    found = {}
    for rules in RULES if isinstance(objects, CocoObjects) else (DEFAULT_RULES,):
        found.update(chair(objects, captions, references, rules).to_result(instances))
    return found


def holds(stored: Mapping, instances: str) -> bool:
    """Whether a stored evaluation result has CHAIR of ``instances`` as :func:`results` gives it now: for a
    COCO file every reading's, each under its own name (a result of before the readings were named held the
    corrected one's numbers under the plain keys, unnamed: it is evaluated again, not reused)."""
    found = stored.get("hallucination") or {}
    if found.get("instances") != instances:
        return False
    return found.get("objects") != "coco" or all(
        (stored.get(f"hallucination{r.suffix}") or {}).get("rules") == name and
        stored[f"hallucination{r.suffix}"].get("instances") == instances for name, r in RULES.items())


# The shapes' judge: (image id, caption) -> (the objects present, the caption's mentions as (what it names, whether
# it is right, the object present it recalls or None)).


def _shapes_judge(instances: Instances):
    colors = tuple(sorted(set(instances.colors) | set(HARD_COLORS)))
    kinds = tuple(dict.fromkeys(instances.kinds + HARD_KINDS))

    def judge(image_id, caption):
        words = tokenize_caption(checked_caption(image_id, caption))
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
    """CHAIR in plain words, for ``captioning evaluate``'s summary ("" without it): a line for each reading
    the result holds (COCO: chair.py's, as published, then the corrected one)."""
    if not result.get("hallucination"):
        return ""

    def share(value):
        return "-" if value is None else f"{value:.3f}"

    lines, note = [], None
    for rules in RULES.values():
        found, suffix = result.get(f"hallucination{rules.suffix}"), rules.suffix
        if not found:
            continue
        what = ("shapes by kind and colour" if found["objects"] != "coco" else
                f"COCO's 80 objects, {rules.title if found.get('rules') else 'an earlier reading'}")
        lines.append(f"hallucination ({what}): CHAIRi {share(result[f'chair_i{suffix}'])} "
                     f"({found['hallucinated_mentions']} of {found['mentions']} object mentions name an object the "
                     f"image lacks), CHAIRs {share(result[f'chair_s{suffix}'])} ({found['hallucinated_captions']} of "
                     f"{found['captions']} captions), object recall {share(result[f'object_recall{suffix}'])} "
                     f"({found['objects_named']} of {found['objects_present']} objects present named)")
        if found.get("hallucinated"):
            lines.append("  most hallucinated: " + ", ".join(f"{name} {n}" for name, n in found["hallucinated"]))
        note = found.get("note") or note
    if note:
        lines.append(f"  ({note})")
    return "\n".join(lines)
