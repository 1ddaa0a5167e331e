"""Caption text: normalisation and tokenization, shared by `prepare`, decoding and evaluation.

Every caption goes through the same two steps, so that the words a model is trained on are the words it
is later asked to produce:

1. :func:`normalize_caption` — control and zero-width characters removed, Unicode NFKC, lowercased,
   runs of whitespace folded to one space, ends stripped. It is idempotent: a normalised caption
   normalises to itself.
2. :func:`tokenize_caption` — nltk's ``NLTKWordTokenizer`` (the Penn-Treebank-style tokenizer that
   ``nltk.word_tokenize`` applies to each sentence). ``word_tokenize`` itself first splits sentences
   with punkt, which needs ``nltk.download``; we never download at run time, so sentences are split on
   ``. ! ?`` followed by whitespace instead. Tokens made only of punctuation are dropped by default, as
   in Karpathy's split (the COCO metrics drop punctuation anyway, so a model that spends steps on "."
   gains nothing); ``keep_punctuation=True`` keeps them, as im2txt did.

Worked example::

    >>> tokenize_caption("  A man riding a WAVE on top of a surfboard. ")
    ['a', 'man', 'riding', 'a', 'wave', 'on', 'top', 'of', 'a', 'surfboard']
    >>> tokenize_caption("Two dogs, playing!", keep_punctuation=True)
    ['two', 'dogs', ',', 'playing', '!']
    >>> tokenize_caption("   ")
    []
"""

from __future__ import annotations

import functools
import re
import unicodedata

_SENTENCE_BREAK = re.compile(r"(?<=[.!?])\s+")
# Plain captions — lowercase words and digits, a comma, period or colon only at the end of a word — are what
# COCO mostly holds. For them the Treebank tokenizer only splits those marks off, so the words are the
# text's words: a fast path (~2 µs instead of ~190 µs per caption; COCO's 616k captions in 1 s instead of
# 2 minutes), checked against nltk by a property test. Words nltk splits ("cannot" → "can not",
# "gonna", ...) take the slow path.
_PLAIN = re.compile(r"(?:[a-z0-9]+[.,:]? )*[a-z0-9]+[.,:]?")
_NLTK_SPLITS = frozenset({"cannot", "gimme", "gonna", "gotta", "lemme", "wanna"})


def normalize_caption(text: str) -> str:
    """Returns ``text`` in NFKC, lowercased, without control characters, with single spaces.

    >>> normalize_caption("  A\\u00a0Red\\tCIRCLE\\u200b  ")
    'a red circle'
    """
    # Control (Cc) and format (Cf, e.g. zero-width space) characters carry no words, nor do the other
    # C categories (lone surrogates from JSON "\ud800", private use, unassigned), so the result always
    # encodes as UTF-8; whitespace controls (tab, newline) become spaces and are folded below. They go
    # *before* NFKC: removed after it, "e<ZWSP><combining acute>" would leave a decomposed "é" that a
    # second pass composes, so the same word could reach the vocabulary in two spellings.
    text = "".join(
        " " if ch.isspace() else ch for ch in text if ch.isspace() or unicodedata.category(ch)[0] != "C"
    )
    # NFKC again after lowercasing: lower() can put combining marks out of canonical order
    # ("\u0130\u0316" lowercases to "i\u0307\u0316", whose NFKC is "i\u0316\u0307").
    text = unicodedata.normalize("NFKC", unicodedata.normalize("NFKC", text).lower())
    return " ".join(text.split())


def is_punctuation(token: str) -> bool:
    """True for tokens with no letter or digit in them (".", ",", "``", "--")."""
    return not any(ch.isalnum() for ch in token)


def tokenize_caption(text: str, keep_punctuation: bool = False) -> list[str]:
    """Normalises ``text`` and splits it into word tokens (see the module docstring)."""
    text = normalize_caption(text)
    if not text:
        return []
    if _PLAIN.fullmatch(text) and (not keep_punctuation or not any(ch in text for ch in ".,:")):
        words = text.replace(",", "").replace(".", "").replace(":", "").split()
        if _NLTK_SPLITS.isdisjoint(words):
            return words
    return _nltk_tokens(text, keep_punctuation)


@functools.cache
def _word_tokenizer():
    """nltk's Treebank word tokenizer, imported when a caption first takes the general path: importing nltk
    imports all of it (scipy.stats among it), 0.85-1.0 CPU s a process (2 cores, 2026-11-26), and plain
    captions, nearly all of COCO's and all of the synthetic sets', never need it."""
    from nltk.tokenize import NLTKWordTokenizer

    return NLTKWordTokenizer()


def _nltk_tokens(text: str, keep_punctuation: bool) -> list[str]:
    """The general path of :func:`tokenize_caption`, for normalised ``text``."""
    tokens: list[str] = []
    for sentence in _SENTENCE_BREAK.split(text):
        tokens.extend(_word_tokenizer().tokenize(sentence))
    if not keep_punctuation:
        tokens = [token for token in tokens if not is_punctuation(token)]
    return tokens
