"""How varied generated captions are, beside how right (``captioning evaluate`` stores these as ``diversity``).

Captions are lower-cased and split into words as the metrics' tokenizer leaves them (punctuation apart).
Over the split's best captions, one per image:

- ``distinct_1``, ``distinct_2``: distinct words (bigrams) / all words (bigrams) of all the captions;
- ``vocabulary_usage``: the words used at least once / the words of the model's vocabulary (``<pad>``,
  ``<start>``, ``<end>`` and ``<unk>`` not counted), and ``words_used`` their number;
- ``novel_captions``: the share of captions that are none of the training split's captions.

With several captions per image (``decode.top_k`` > 1: beams or samples), among each image's captions,
averaged over the images (diverse-captioning papers' numbers, lower mBLEU is more diverse):

- ``mbleu_4``: each caption's BLEU-4 against the image's other captions as references (pycocoevalcap's
  BLEU, per caption), averaged;
- ``local_distinct_1``, ``local_distinct_2``: distinct n-grams / n-grams of the image's captions.

>>> captions = {1: ["a red circle", "a red square"], 2: ["a red circle", "a blue star"]}
>>> d = diversity(captions, vocabulary_size=10, training=["a red circle"])
>>> d["distinct_1"], d["distinct_2"], d["novel_captions"], d["words_used"]
(0.5, 0.5, 0.0, 3)
>>> round(d["local_distinct_1"], 3), d["local_distinct_2"]
(0.75, 0.875)
"""

from __future__ import annotations

import re
from typing import Iterable, Mapping, Sequence

_WORD = re.compile(r"[a-z0-9']+")


def words(caption: str) -> list[str]:
    """A caption's words, lower-cased, punctuation dropped."""
    return _WORD.findall(caption.lower())


def _grams(tokens: Sequence[str], n: int) -> list[tuple[str, ...]]:
    return [tuple(tokens[i:i + n]) for i in range(len(tokens) - n + 1)]


def distinct(captions: Iterable[Sequence[str]], n: int) -> float | None:
    """Distinct n-grams / n-grams over ``captions`` (lists of words); None without any n-gram."""
    grams = [g for c in captions for g in _grams(c, n)]
    return len(set(grams)) / len(grams) if grams else None


def mbleu_4(captions: Mapping[object, Sequence[str]]) -> float | None:
    """Each caption's BLEU-4 against its image's other captions, averaged (None: no image has two)."""
    from pycocoevalcap.bleu.bleu import Bleu

    gts, res = {}, {}
    for image, texts in captions.items():
        if len(texts) < 2:
            continue
        for i, text in enumerate(texts):
            key = f"{image}/{i}"
            res[key] = [" ".join(words(text)) or "."]
            gts[key] = [" ".join(words(t)) or "." for j, t in enumerate(texts) if j != i]
    if not res:
        return None
    _, per_caption = Bleu(4).compute_score(gts, res, verbose=0)
    fourth = per_caption[3]
    return float(sum(fourth) / len(fourth))


def diversity(captions: Mapping[object, Sequence[str]], vocabulary_size: int, training: Iterable[str]) -> dict:
    """The module docstring's numbers for ``captions`` (image → its captions, best first), a model of
    ``vocabulary_size`` words (reserved ones included) and the ``training`` split's captions."""
    best = [words(texts[0]) for texts in captions.values() if texts]
    seen = {" ".join(words(t)) for t in training}
    used = {w for c in best for w in c}
    out = {"distinct_1": distinct(best, 1), "distinct_2": distinct(best, 2),
           "vocabulary_usage": len(used) / max(1, vocabulary_size - 4), "words_used": len(used),
           "novel_captions": (sum(" ".join(c) not in seen for c in best) / len(best)) if best else None}
    several = {image: list(texts) for image, texts in captions.items() if len(texts) > 1}
    if several:
        local = {n: [d for texts in several.values() if (d := distinct([words(t) for t in texts], n)) is not None]
                 for n in (1, 2)}
        out.update({"mbleu_4": mbleu_4(several),
                    "local_distinct_1": sum(local[1]) / len(local[1]) if local[1] else None,
                    "local_distinct_2": sum(local[2]) / len(local[2]) if local[2] else None,
                    "captions_per_image": max(len(t) for t in several.values())})
    return out


def describe_diversity(found: dict) -> str:
    """The diversity numbers of an evaluation (:func:`diversity`), as one or two lines of text."""
    def cell(value):
        return "-" if value is None else f"{value:.3f}"

    line = (f"diversity: distinct-1 {cell(found['distinct_1'])}, distinct-2 {cell(found['distinct_2'])}, "
            f"vocabulary usage {cell(found['vocabulary_usage'])} ({found['words_used']} words), novel captions "
            f"{cell(found['novel_captions'])}")
    if "mbleu_4" in found:
        line += (f"\namong each image's {found['captions_per_image']} captions: mBLEU-4 {cell(found['mbleu_4'])}, "
                 f"distinct-1 {cell(found['local_distinct_1'])}, distinct-2 {cell(found['local_distinct_2'])}")
    return line
