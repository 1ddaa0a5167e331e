"""Tokenizers: what turns captions into ids and back, ``data.tokenizer`` (registry :data:`TOKENIZERS`).

``words`` (:mod:`~captioning.data.tokenizers.words`) is the prepared dataset's word vocabulary, the ids
``prepare`` wrote into the records; ``preset`` (:mod:`~captioning.data.tokenizers.preset`) is a keras-hub
preset's own tokenizer (GPT-2's byte-level BPE, Gemma's SentencePiece, …), run in the input pipeline on the
records' caption text, so the same prepared records serve both and nothing is prepared again. ``auto`` (the
default) is the decoder's own: :meth:`captioning.model.base.CaptionModel.tokenizer_preset` names the preset a
decoder reads, and :func:`choose` resolves the setting against it. The interface both implement is
:class:`~captioning.data.tokenizers.base.Tokenizer`.

**One id space.** The reserved ids of :mod:`captioning.vocab` — ``<pad>`` 0, ``<start>`` 1, ``<end>`` 2,
``<unk>`` 3 — are the same for every tokenizer: the search loop, beams, word rules, loss masks and batching keep
using them. A language model's tokenizer id ``i`` is project id ``i + 4`` (``OFFSET = 4``), so a model's
``vocab_size`` is ``4 + the language model's vocabulary size``. END (2) stands for the language model's end
token: a decoder gives it the end token's logit. The language model's own special tokens (its start, end,
padding and unknown tokens and any other special or control token) are never proposed: their project ids
(:meth:`~captioning.data.tokenizers.base.Tokenizer.special_ids`) get the dead score, and like the reserved ids
they add no text to a caption. A caption is ``[START, i₁ + 4, …, iₙ + 4, END]``; padding is 0 as ever. With
GPT-2's tokenizer ``"a red circle"`` becomes the pieces ``Ġa Ġred Ġcircle`` of ids ``a, r, c`` and the project
ids ``[1, a + 4, r + 4, c + 4, 2]``; GPT-2's ``<|endoftext|>`` (its start, end and padding, id 50256) is
project id 50260, never proposed, and ``vocab_size`` is 4 + 50257.

**Words are what is scored.** Everything that scores or reads words (the COCO metrics, CHAIR, diversity, the
bad-ending and n-gram rules, SCST's reward) sees the detokenized caption
(:meth:`~captioning.data.tokenizers.base.Tokenizer.detokenize` in TensorFlow, ``decode``/``text`` in Python): one
caption string scores the same whichever tokenizer wrote it (tests/test_tokenizers.py).
"""

from __future__ import annotations

from captioning.data.tokenizers.base import Tokenizer
from captioning.data.tokenizers.preset import OFFSET, PresetTokenizer
from captioning.data.tokenizers.words import WordsTokenizer
from captioning.errors import InputError

TOKENIZERS = {"words": WordsTokenizer, "preset": PresetTokenizer}


def choose(setting: str, preset: str | None, decoder: str) -> str:
    """``data.tokenizer`` (``auto``, ``words``, ``preset``) resolved for a decoder named ``decoder`` that reads the
    tokenizer of ``preset`` (None: the word vocabulary; :meth:`captioning.model.base.CaptionModel.tokenizer_preset`):
    ``words`` or ``preset``. A setting the decoder cannot read is refused in one line."""
    if setting == "auto":
        return "preset" if preset else "words"
    if setting == "preset" and not preset:
        raise InputError(f"data.tokenizer: preset needs a decoder that reads a language model's preset; model.decoder "
                         f"{decoder} writes the prepared dataset's words: use data.tokenizer: auto or words")
    if setting == "words" and preset:
        raise InputError(f"data.tokenizer: words cannot feed model.decoder {decoder}, which writes captions in its "
                         f"preset's tokenizer ({preset}): use data.tokenizer: auto or preset")
    if setting not in TOKENIZERS:
        raise InputError(f"data.tokenizer must be auto or one of {', '.join(TOKENIZERS)}, got {setting!r}")
    return setting


def build(kind: str, vocabulary=None, preset: str | None = None) -> Tokenizer:
    """The tokenizer of ``kind`` (:func:`choose`'s): ``words`` of ``vocabulary`` (a
    :class:`captioning.vocab.Vocabulary`), ``preset`` of the keras-hub preset ``preset``."""
    if kind == "words":
        return WordsTokenizer.of(vocabulary)
    return PresetTokenizer.from_preset(preset)


def load_tokenizer(folder: str) -> Tokenizer | None:
    """The tokenizer a model folder keeps (:meth:`~captioning.data.tokenizers.base.Tokenizer.save_to`: a
    ``tokenizer/`` folder, or ``vocab.txt``), or None when it keeps none. InputError naming a damaged one."""
    return PresetTokenizer.load_from(folder) or WordsTokenizer.load_from(folder)


def as_tokenizer(vocabulary) -> Tokenizer:
    """``vocabulary`` as a tokenizer: a tokenizer as it is, a plain :class:`captioning.vocab.Vocabulary` as the
    words tokenizer of its words."""
    return vocabulary if isinstance(vocabulary, Tokenizer) else WordsTokenizer.of(vocabulary)


__all__ = ["OFFSET", "TOKENIZERS", "PresetTokenizer", "Tokenizer", "WordsTokenizer", "as_tokenizer", "build",
           "choose", "load_tokenizer"]
