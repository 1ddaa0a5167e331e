"""The word vocabulary: reserved ids, ``vocab.txt`` on disk, words to ids and back. (``prepare`` builds
it from the training captions: :func:`data_prep.vocabulary.build_vocabulary`.)

Ids 0–3 are reserved and the same in every vocabulary:

====  ===========  ==========================================================
 id   token        meaning
====  ===========  ==========================================================
 0    ``<pad>``    padding after the end of a caption (masked out of the loss)
 1    ``<start>``  the first input word of every caption
 2    ``<end>``    the last target word of every caption
 3    ``<unk>``    any word seen fewer than ``min_word_count`` times in training
====  ===========  ==========================================================

Words follow, most frequent first (ties alphabetical), so the file is the same on every machine.
``vocab.txt`` holds one token per line and line *i* (from 0) is id *i*, the layout
``tf.keras.layers.StringLookup`` and ``tf.lookup.TextFileInitializer`` read.

Worked example::

    >>> v = Vocabulary(RESERVED + ("a", "circle"))  # "red" and "square" were too rare to keep
    >>> v.words
    ('<pad>', '<start>', '<end>', '<unk>', 'a', 'circle')
    >>> v.encode(["a", "red", "circle"])
    [1, 4, 3, 5, 2]
    >>> v.decode([1, 4, 3, 5, 2, 0, 0])
    ['a', '<unk>', 'circle']
"""

from __future__ import annotations

import collections
from typing import Iterable, Sequence

from captioning.errors import InputError, excerpt
from captioning.fileio import atomic_write_text

PAD, START, END, UNK = "<pad>", "<start>", "<end>", "<unk>"
RESERVED = (PAD, START, END, UNK)
PAD_ID, START_ID, END_ID, UNK_ID = range(len(RESERVED))


class Vocabulary:
    """An immutable id ↔ word mapping whose first four entries are :data:`RESERVED`."""

    def __init__(self, words: Sequence[str]):
        words = tuple(words)
        if words[: len(RESERVED)] != RESERVED:
            raise InputError(f"a vocabulary must start with {', '.join(RESERVED)}; got "
                             f"{excerpt(', '.join(words[:4]))}")
        if len(set(words)) != len(words):
            duplicate = next(w for w, n in collections.Counter(words).items() if n > 1)
            raise InputError(f"the vocabulary lists {excerpt(duplicate)} twice")
        self.words = words
        self._ids = {word: i for i, word in enumerate(words)}

    @classmethod
    def load(cls, path: str) -> "Vocabulary":
        """Reads a ``vocab.txt`` written by :meth:`save`."""
        try:
            with open(path, encoding="utf-8") as f:
                words = [line.rstrip("\n") for line in f]
        except OSError as e:
            raise InputError(f"cannot read vocabulary {path}: {e.strerror}") from None
        except UnicodeDecodeError as e:
            raise InputError(f"vocabulary {path} is not UTF-8 text (byte {e.start}): not a vocab.txt") from None
        try:
            return cls(words)
        except InputError as e:
            raise InputError(f"vocabulary {path} is damaged or not a vocab.txt: {e}") from None

    def save(self, path: str) -> None:
        """Writes one token per line, atomically (a temporary file renamed into place)."""
        atomic_write_text(path, "".join(word + "\n" for word in self.words))

    def __len__(self) -> int:
        return len(self.words)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Vocabulary) and self.words == other.words

    def id(self, word: str) -> int:
        return self._ids.get(word, UNK_ID)

    def encode(self, tokens: Sequence[str]) -> list[int]:
        """``[<start>, ids of tokens..., <end>]``; unknown words become ``<unk>``."""
        return [START_ID] + [self.id(t) for t in tokens] + [END_ID]

    def decode(self, ids: Iterable[int]) -> list[str]:
        """Words of ``ids`` up to the first ``<end>``, without ``<start>`` and padding."""
        words = []
        for i in ids:
            i = int(i)
            if i == END_ID:
                break
            if i in (START_ID, PAD_ID):
                continue
            words.append(self.words[i])
        return words
