"""Generated captions read back: which shapes they name, how many, and how they relate them.

A caption's words (tokenised with :func:`captioning.text.tokenize_caption`) are read left to right.
A **noun phrase** is a colour word with a kind word right after it ("red circle"), or a colour or a
kind word alone, with the words right before it that modify it: articles, a number ("two" … "six"),
size words and fill words (:mod:`captioning.data.scenes`). A kind's plural ("circles") is the kind.
Any other word ends the modifiers, so in "two shapes: a blue circle" the phrase is "a blue circle",
named once. The phrase names ``count`` shapes: its number word's value, else 1.

A **relation mention** is two phrases with only relation words between them (:data:`RELATION_WORDS`,
optionally after "is"): "a green square *to the left of* a large yellow triangle".

    >>> words = "three red circles and a striped blue star to the left of a big green square".split()
    >>> for p in noun_phrases(words, colors=("blue", "green", "red"), kinds=("circle", "square", "star")):
    ...     print(p.count, p.color, p.kind, p.fill, words[p.start:p.end])
    3 red circle None ['three', 'red', 'circles']
    1 blue star striped ['a', 'striped', 'blue', 'star']
    1 green square None ['a', 'big', 'green', 'square']
    >>> [(a.kind, relation, b.kind) for a, relation, b in relation_mentions(words, noun_phrases(
    ...     words, ("blue", "green", "red"), ("circle", "square", "star")))]
    [('star', 'left', 'square')]
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from captioning.data.scenes import ARTICLES, FILL_WORDS, NUMBERS, RELATION_WORDS, SIZE_WORDS, ShapeBox

_NUMBER = {word: n for n, word in NUMBERS.items()}
_FILL = {word: fill for fill, words in FILL_WORDS.items() for word in words}
_SIZE = {word for words in SIZE_WORDS.values() for word in words}
_RELATION = {phrase: relation for relation, phrases in RELATION_WORDS.items() for phrase in phrases}


@dataclass(frozen=True)
class Phrase:
    """A noun phrase: ``words[start:end]``, its colour and kind words at ``heads``."""

    start: int
    end: int
    heads: tuple[int, ...]
    count: int
    color: str | None
    kind: str | None
    fill: str | None = None


def noun_phrases(words: Sequence[str], colors: Sequence[str], kinds: Sequence[str]) -> list[Phrase]:
    """The noun phrases of a tokenised caption (module docstring), in order."""
    kind_of = {kind: kind for kind in kinds} | {kind + "s": kind for kind in kinds}
    phrases: list[Phrase] = []
    start, count, fill = None, 1, None
    i = 0
    while i < len(words):
        word = words[i]
        if word in colors or word in kind_of:
            color = word if word in colors else None
            heads = (i,)
            if color and i + 1 < len(words) and words[i + 1] in kind_of:
                heads = (i, i + 1)
            kind = kind_of.get(words[heads[-1]])
            phrases.append(Phrase(i if start is None else start, heads[-1] + 1, heads, count, color, kind, fill))
            i = heads[-1] + 1
            start, count, fill = None, 1, None
            continue
        if word in ARTICLES or word in _NUMBER or word in _SIZE or word in _FILL:
            start = i if start is None else start
            count = _NUMBER.get(word, count)
            fill = _FILL.get(word, fill)
        else:
            start, count, fill = None, 1, None
        i += 1
    return phrases


def relation_mentions(words: Sequence[str], phrases: Sequence[Phrase]) -> list[tuple[Phrase, str, Phrase]]:
    """(phrase, relation, phrase) for each two consecutive phrases with relation words between them."""
    found = []
    for a, b in zip(phrases, phrases[1:]):
        between = list(words[a.end:b.start])
        if between[:1] == ["is"]:
            between = between[1:]
        relation = _RELATION.get(" ".join(between))
        if relation is not None:
            found.append((a, relation, b))
    return found


def named(phrase: Phrase, shapes: Sequence[ShapeBox]) -> list[ShapeBox]:
    """The shapes of an image that ``phrase`` names: those of its colour and kind (where it gives them);
    its fill word picks among several, and a fill that fits none of them is a wrong detail, not another
    shape (size words are not judged).

    >>> shapes = [ShapeBox("star", "red", "small", (0, 0, 1, 1), "solid"),
    ...           ShapeBox("star", "red", "large", (5, 5, 1, 1), "striped")]
    >>> words = "a striped red star and a hollow red star and a red star".split()
    >>> [len(named(p, shapes)) for p in noun_phrases(words, ("red",), ("star",))]
    [1, 2, 2]
    """
    fits = [s for s in shapes if phrase.color in (None, s.color) and phrase.kind in (None, s.kind)]
    filled = [s for s in fits if s.fill == phrase.fill]
    return filled if phrase.fill is not None and filled else fits
