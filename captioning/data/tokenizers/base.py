"""``Tokenizer``: the interface every tokenizer implements (the id rule is the package's docstring,
:mod:`captioning.data.tokenizers`), and the in-graph normalisation a caption's text goes through first.

A tokenizer duck-types :class:`captioning.vocab.Vocabulary` where the code used a vocabulary (``len``,
``decode``, ``==``), and adds what a subword tokenizer needs:

====================  ==============================================================================================
``kind``              its registry name (``words``, ``preset``): ``data.tokenizer`` as the run resolved it
``identity``          a string naming exactly what it does: two tokenizers are equal when their kinds and identities are
``caption_ids``       TensorFlow: texts ``[N]`` → ragged int64 ``[N, (T)]`` = ``[START, pieces…, END]``, inside tf.data
``image_captions``    TensorFlow: a parsed record batch's captions as this tokenizer's ids, ragged ``[B, (C), (T)]``
``detokenize``        TensorFlow: project ids ``[B, T]`` → caption strings ``[B]`` (up to END, reserved ids skipped)
``decode``, ``text``  Python: one caption's ids → its words, its text (``" ".join`` of its words)
``pieces``            for each project id the text it adds to a caption ("" for reserved and special ids; bytes for
                      a piece that is part of a character)
``starts_word``       for each project id whether its piece begins a new word
``special_ids``       the project ids that are never proposed besides the reserved ones (a language model's own
                      start, end, padding, unknown and other special tokens)
``save_to``           writes itself into a model folder (:func:`captioning.data.tokenizers.load_tokenizer` reads it)
``fits``              whether a prepared dataset's records can be read with it (evaluate refuses one that cannot)
====================  ==============================================================================================

:func:`normalized` is the in-graph normalisation of a caption before a subword tokenizer splits it: lowercased
(UTF-8, every script), every run of characters that are neither letters, digits nor apostrophes one space, the
ends stripped. ``"A  Red-Circle, left!"`` → ``"a red circle left"``. It keeps what the word vocabulary keeps of a
plain caption (``prepare``'s :func:`captioning.text.tokenize_caption` drops punctuation too), so the same words
reach every tokenizer and the scores compare.
"""

from __future__ import annotations

import abc

import numpy as np

from captioning.vocab import END_ID, START_ID


def normalized(texts):
    """Captions ``[N]`` (tf.string) lowercased, each run of characters other than letters, digits and
    apostrophes made one space, stripped (the module docstring)."""
    import tensorflow as tf

    texts = tf.strings.lower(texts, encoding="utf-8")
    return tf.strings.strip(tf.strings.regex_replace(texts, r"[^\p{L}\p{N}']+", " "))


def with_start_and_end(pieces):
    """Ragged ids ``[N, (T)]`` (int64) → ``[START, ids…, END]`` per row (one scatter: no ragged concat and its
    shape assertions)."""
    import tensorflow as tf

    splits = tf.cast(pieces.row_splits, tf.int64)
    rows = tf.shape(splits, out_type=tf.int64)[0] - 1
    framed = splits + 2 * tf.range(rows + 1)  # each row two ids longer
    size = framed[-1]
    inner = tf.cast(pieces.value_rowids(), tf.int64) * 2 + 1 + tf.range(tf.size(pieces.flat_values, out_type=tf.int64))
    ids = tf.scatter_nd(tf.concat([framed[:-1], framed[1:] - 1, inner], 0)[:, None],
                        tf.concat([tf.fill([rows], tf.constant(START_ID, tf.int64)),
                                   tf.fill([rows], tf.constant(END_ID, tf.int64)),
                                   tf.cast(pieces.flat_values, tf.int64)], 0), [size])
    return tf.RaggedTensor.from_row_splits(ids, framed, validate=False)


def before_end(ids):
    """``[B, T]`` bool: the positions before each row's first END."""
    import tensorflow as tf

    ended = tf.cumsum(tf.cast(tf.equal(ids, END_ID), tf.int32), axis=-1)
    return tf.equal(ended, 0)


class Tokenizer(abc.ABC):
    """What turns captions into project ids and back (module docstring). Subclasses set :attr:`kind`."""

    kind: str = ""

    @abc.abstractmethod
    def __len__(self) -> int:
        """The model's vocabulary size: every project id, the reserved ones included."""

    @property
    @abc.abstractmethod
    def identity(self) -> str:
        """A string that differs between tokenizers that split or number any caption differently."""

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Tokenizer) and (self.kind, self.identity) == (other.kind, other.identity)

    __hash__ = None  # equal by value, like a Vocabulary

    @abc.abstractmethod
    def caption_ids(self, texts):
        """TensorFlow (usable inside tf.data, no py_function): captions ``[N]`` → ragged int64 ``[N, (T)]``,
        ``[START, pieces…, END]``."""

    @abc.abstractmethod
    def image_captions(self, ids, texts):
        """TensorFlow: a parsed batch of records' captions (``ids``: the records' ``caption/ids``, ragged int64
        ``[B, (C), (T)]``; ``texts``: their ``caption/text``, ragged ``[B, (C)]``) → this tokenizer's ids, ragged
        int64 ``[B, (C), (T)]``."""

    @abc.abstractmethod
    def detokenize(self, ids):
        """TensorFlow: project ids ``[B, T]`` (any int dtype) → ``[B]`` strings: the caption's words joined by one
        space, up to the first END, reserved and special ids skipped."""

    @abc.abstractmethod
    def decode(self, ids) -> list[str]:
        """One caption's project ids → its words, up to the first END, reserved and special ids skipped."""

    def text(self, ids) -> str:
        """One caption's ids (without START and END) → its text, the words :meth:`decode` gives joined by a space."""
        return " ".join(self.decode(ids))

    @abc.abstractmethod
    def pieces(self) -> list[str | bytes]:
        """For each project id the text its piece adds to a caption ("" for reserved and special ids); a piece
        that begins a word starts with a space; a piece that is only part of a character (a byte-level piece) is
        its ``bytes``."""

    def starts_word(self) -> np.ndarray:
        """``bool [len(self)]``: whether each project id's piece begins a new word (its text starts with a space)."""
        return np.array([piece.startswith(" ") for piece in self.pieces()], bool)

    def special_ids(self) -> tuple[int, ...]:
        """The project ids never proposed besides the reserved ones: the language model's own special tokens."""
        return ()

    @abc.abstractmethod
    def save_to(self, folder: str) -> None:
        """Writes itself into the model folder ``folder`` (atomically)."""

    def fits(self, dataset) -> bool:
        """Whether the records of ``dataset`` (a :class:`~captioning.data.prepared.PreparedDataset`) can be read
        with this tokenizer."""
        return True
