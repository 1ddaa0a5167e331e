"""Bad endings as a metric: the share of captions that stop on a word no English caption ends with.

The failure self-critical training is known for (captions ending in "with a", "of the"): ``captioning evaluate``
reports ``bad_ending_rate`` = captions whose last word is in the English list of ``decode.bad_endings``
(:data:`captioning.model.word_rules.ENGLISH_BAD_ENDINGS`: articles, prepositions, possessives …) / all
captions scored (the best caption of each image), whatever ``decode.bad_endings`` the decoding used, so
that runs with and without it compare. The last word is that of
:func:`captioning.text.tokenize_caption` (punctuation dropped); an empty caption has no last word and does
not count as a bad ending. ``bad_endings`` gives how often each such word ended a caption.

    >>> found = bad_endings(["a man riding a horse", "a dog with a", "two cats on the.", ""])
    >>> found["bad_ending_rate"], found["bad_endings"]
    (0.5, {'a': 1, 'the': 1})
"""

from __future__ import annotations

import collections
from typing import Iterable

from captioning.model.word_rules import BAD_ENDING_LISTS
from captioning.text import tokenize_caption

BAD_ENDINGS = frozenset(BAD_ENDING_LISTS["english"])


def bad_endings(captions: Iterable[str]) -> dict:
    """``{"bad_ending_rate": share of captions ending badly (None without captions), "bad_endings": {word:
    captions it ended}}`` (module docstring)."""
    total, ended = 0, collections.Counter()
    for caption in captions:
        total += 1
        words = tokenize_caption(caption)
        if words and words[-1] in BAD_ENDINGS:
            ended[words[-1]] += 1
    return {"bad_ending_rate": sum(ended.values()) / total if total else None,
            "bad_endings": dict(sorted(ended.items(), key=lambda p: (-p[1], p[0])))}


def describe(result) -> str:
    """The bad endings in plain words, for ``captioning evaluate``'s summary ("" without them)."""
    rate = result.get("bad_ending_rate")
    if rate is None:
        return ""
    words = result.get("bad_endings") or {}
    detail = ", ".join(f'"{w}" {n}' for w, n in words.items())
    return (f"bad endings: {rate:.3f} of the captions end in a word like \"with\" or \"a\""
            + (f" ({detail})" if detail else ""))
