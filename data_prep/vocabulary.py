"""Building the vocabulary from the training captions: the writing half of ``vocab.txt``
(:class:`captioning.vocab.Vocabulary` reads, saves and uses it).

Words are counted over the tokenised train captions; those seen at least ``min_word_count`` times are
kept (im2txt's default is 4), most frequent first, ties in alphabetical order, after the reserved tokens
(``<pad>``, ``<start>``, ``<end>``, ``<unk>``: ids 0–3). Every other word becomes ``<unk>``.

>>> vocab = build_vocabulary([["a", "red", "circle"], ["a", "blue", "circle"], ["a", "red", "square"]],
...                          min_word_count=2)
>>> vocab.words[4:], len(vocab), vocab.encode(["a", "blue", "circle"])
(('a', 'circle', 'red'), 7, [1, 4, 3, 5, 2])
"""

from __future__ import annotations

import collections
from typing import Iterable, Sequence

from captioning.vocab import RESERVED, Vocabulary


def build_vocabulary(captions: Iterable[Sequence[str]], min_word_count: int) -> Vocabulary:
    """Counts the tokens of ``captions`` and keeps those seen at least ``min_word_count`` times."""
    counts = collections.Counter(token for caption in captions for token in caption)
    kept = sorted((w for w, n in counts.items() if n >= min_word_count and w not in RESERVED),
                  key=lambda w: (-counts[w], w))
    return Vocabulary(RESERVED + tuple(kept))
