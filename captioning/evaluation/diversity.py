"""How varied generated captions are, beside how right (``captioning evaluate`` stores these as ``diversity``).

Captions are lower-cased and split into words as the metrics' tokenizer leaves them (punctuation apart).
Over the split's best captions, one per image:

- ``distinct_1``, ``distinct_2``: distinct words (bigrams) / all words of all the captions, Li et al. 2016's
  distinct-n (the number of distinct n-grams scaled by the number of generated tokens);
- ``distinct_2_per_bigram``: distinct bigrams / all bigrams (what this project called ``distinct_2`` before;
  distinct-1 is the same under both);
- ``vocabulary_usage``: the words used at least once / the words of the model's vocabulary (``<pad>``,
  ``<start>``, ``<end>`` and ``<unk>`` not counted), and ``words_used`` their number;
- ``novel_captions``: the share of captions that are none of the training split's captions.

With several captions per image (``decode.top_k`` > 1: beams or samples), among each image's captions,
averaged over the images (diverse-captioning papers' numbers, lower mBLEU is more diverse):

- ``mbleu_4``: each caption's BLEU-4 against the image's other captions as references (pycocoevalcap's
  BLEU, per caption), averaged. Identical captions give 1 (to 1e-9: pycocoevalcap's BLEU adds 1e-15 and
  1e-9 to each n-gram count, so they give 0.9999999997); a caption of fewer than 4 words has no 4-gram
  and a BLEU-4 near 0 even against itself;
- ``local_distinct_1``, ``local_distinct_2`` (and ``local_distinct_2_per_bigram``): as above, among the
  image's captions.

An image's captions are its real ones only: a beam search that found fewer complete captions than
``decode.top_k`` fills the rest with placeholders that ``evaluate`` leaves out
(:func:`captioning.evaluation.results.real_captions`); ``captions_per_image`` is the most any image has.

>>> captions = {1: ["a red circle", "a red square"], 2: ["a red circle", "a blue star"]}
>>> d = diversity(captions, vocabulary_size=10, training=["a red circle"])
>>> d["distinct_1"], round(d["distinct_2"], 3), d["distinct_2_per_bigram"], d["novel_captions"], d["words_used"]
(0.5, 0.333, 0.5, 0.0, 3)
>>> round(d["local_distinct_1"], 3), round(d["local_distinct_2"], 3), d["local_distinct_2_per_bigram"]
(0.75, 0.583, 0.875)
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
    """Li et al. 2016's distinct-n: distinct n-grams / words over ``captions`` (lists of words); None without
    any n-gram.

    >>> distinct([["a", "red", "circle"], ["a", "red", "square"]], 2)  # 3 distinct bigrams, 6 words
    0.5
    """
    captions = list(captions)
    grams = {g for c in captions for g in _grams(c, n)}
    return len(grams) / sum(len(c) for c in captions) if grams else None


def distinct_per_gram(captions: Iterable[Sequence[str]], n: int) -> float | None:
    """Distinct n-grams / n-grams over ``captions`` (lists of words); None without any n-gram.

    >>> distinct_per_gram([["a", "red", "circle"], ["a", "red", "square"]], 2)  # 3 distinct of 4 bigrams
    0.75
    """
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
           "distinct_2_per_bigram": distinct_per_gram(best, 2),
           "vocabulary_usage": len(used) / max(1, vocabulary_size - 4), "words_used": len(used),
           "novel_captions": (sum(" ".join(c) not in seen for c in best) / len(best)) if best else None}
    several = {image: list(texts) for image, texts in captions.items() if len(texts) > 1}
    if several:
        def local(measure, n):
            found = [d for texts in several.values() if (d := measure([words(t) for t in texts], n)) is not None]
            return sum(found) / len(found) if found else None

        out.update({"mbleu_4": mbleu_4(several),
                    "local_distinct_1": local(distinct, 1), "local_distinct_2": local(distinct, 2),
                    "local_distinct_2_per_bigram": local(distinct_per_gram, 2),
                    "captions_per_image": max(len(t) for t in several.values())})
    return out


def describe_diversity(found: dict) -> str:
    """The diversity numbers of an evaluation (:func:`diversity`), as one or two lines of text."""
    def cell(value):
        return "-" if value is None else f"{value:.3f}"

    per_bigram = (f" (per bigram {cell(found['distinct_2_per_bigram'])})"
                  if "distinct_2_per_bigram" in found else "")
    line = (f"diversity: distinct-1 {cell(found['distinct_1'])}, distinct-2 {cell(found['distinct_2'])}{per_bigram}, "
            f"vocabulary usage {cell(found['vocabulary_usage'])} ({found['words_used']} words), novel captions "
            f"{cell(found['novel_captions'])}")
    if "mbleu_4" in found:
        line += (f"\namong each image's {found['captions_per_image']} captions: mBLEU-4 {cell(found['mbleu_4'])}, "
                 f"distinct-1 {cell(found['local_distinct_1'])}, distinct-2 {cell(found['local_distinct_2'])}")
    return line
