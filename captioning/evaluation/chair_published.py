"""CHAIR's objects as the published numbers read them: Rohrbach et al.'s ``utils/chair.py``
(github.com/LisaAnne/Hallucination, with ``pattern==3.6`` and ``nltk==3.2.5`` as its requirements.txt pins),
bug for bug. Published CHAIRi and CHAIRs tables come from that script, so a number called CHAIR here is
its number (as BLEU keeps pycocoevalcap's smoothing); :func:`captioning.evaluation.coco_objects.corrected_mentions`
reads the same captions by the paper's definition, under the result's ``*_corrected`` keys.

:func:`mentions` is ``CHAIR.caption_to_words``:

1. ``caption.lower()``, then nltk's word tokenizer; punctuation tokens stay, and keep the words around
   them apart ("a hot, dog" holds no hot dog);
2. each token through :func:`singularize`: pattern's ``pattern.en.singularize``, from a table of its answers
   for the words that matter (below);
3. pairs of :data:`DOUBLE_WORDS` joined, then "seat" dropped beside "toilet", as in
   :func:`captioning.evaluation.coco_objects.read_objects`;
4. a word is a mention when it is one of :data:`NODE_OF`'s entries, the table split as chair.py splits it.

Its quirks, kept (docs/using.md lists them with the corrected reading's answer):

- pattern takes every final "s" for a plural: "bus", "minibus" and "airbus" become "bu", "minibu", "airbu"
  and name nothing ("buses" does name a bus); "glass" becomes "glas" (chair.py's extra pair "wine glas"
  mends "wine glass"), "tennis" "tenni" and "sports" "sport" (the racket and the ball still count, alone);
- pattern's "-oes" → "-o" and "-ies" → "-y" rules: "canoes" → "cano", "ties" → "ty" (its "^tie"
  exception never matches), "magpies" → "magpy": none of them is a mention; "thieves" → "thieve";
- pattern's list of "-ie" nouns returns the plural unchanged: "collies" and "doggies" name nothing;
- two entries of the table start with a space ("scooter,  motor bike", "cake,  cheesecake") and can
  never match; "iPhone" is never a lowercased caption's word;
- pattern's other rules apply to every word: "kine" is a cow, any word ending in "men" ends in "man";
- pattern's rules match letters case-insensitively, and Python's ``re`` then takes "ſ" for an s and "ı" for
  an i: "dogſ" and "ponıes" name a dog and a pony (such a caption is read with nltk's tokenizer, below);
- a caption without any mention: chair.py divides by zero when no caption of the set has one; here its
  CHAIRi is None, as the corrected reading's.

What is not chair.py's exactly: nltk's ``word_tokenize`` first splits sentences with punkt's English model,
which needs ``nltk.download``; here sentences split at ``.``, ``!`` or ``?`` and a space, as
:func:`captioning.text.tokenize_caption` does. They differ where punkt takes a period for an abbreviation's
("st.", "dr."): such a word keeps its period and names nothing there. The tokenizer is nltk's installed one,
not 3.2.5; their rules differ on quotes and ellipses, not on words.

The table, ``chair_published_words.txt`` beside this module (package data), holds pattern's outputs, not
its rules: "word singular" a line for each word that pattern's ``singularize`` changes and that is, or whose
singular is, one of :data:`WORDS` (the 412 words steps 3 and 4 look at); any other word names nothing
whatever its singular, and :func:`singularize` returns it as it is. pattern is BSD 3-Clause (CLiPS,
University of Antwerp); the table was made on 2026-11-28 by running the ``singularize`` of pattern 3.6's
``pattern/text/en/inflect.py`` (github.com/clips/pattern, commit 647a679, the 3.6 release; the file
unchanged since August 2017) on 2,453,773 candidate words: each word of :data:`WORDS`, and each with any
number of its last letters replaced by any ending that pattern's irregular plurals, "-ie" plurals and
suffix rules consume (1,496 endings, "ſ" and "ı" put for s and i in every way), and "oxen" put for the
"ox" a word starts with (the one rule not at a word's end). pattern rewrites only a word's ending (its
hyphen and apostrophe rules give a hyphen or an apostrophe, which no word of :data:`WORDS` has), so these
are all the words whose singular can be in :data:`WORDS`; 932 of them are kept. Checked the same day: no
other word of 1,960,386 (each word of :data:`WORDS` with up to 3 last letters replaced by any one or two
of 35 characters) reaches :data:`WORDS`; on 450,096 words (pattern's lexicon, spelling, verb, frequency and
entity lists, the table's words with their endings, 200,000 random words ending in each suffix pattern's
rules test, their "ſ"/"ı" forms) :func:`singularize` gives pattern's answer wherever the word or that answer
is in :data:`WORDS`; and :func:`mentions` equals chair.py's ``CHAIR`` class, ported line for line and run
with pattern's own function, on 60,000 random captions of table words, endings and punctuation, 5,000 more
with "ſ" and "ı", and the 74 captions and 124 references of tests/data/chair_fixture.json.
"""

from __future__ import annotations

import functools
import os
import re

from captioning.evaluation.coco_objects import DOUBLE_WORDS, SYNONYMS, read_objects, reading_tokens
from captioning.text import normalize_caption, tokenize_caption

# the table as chair.py builds it: each line stripped, split at ", ", entries as they are (" motor bike", "iPhone")
NODE_OF = {entry: line.strip().split(", ")[0] for line in SYNONYMS.splitlines() for entry in line.strip().split(", ")}
DOUBLE_WORDS = {**DOUBLE_WORDS, "wine glas": "wine glass"}  # chair.py's own pair for pattern's "glas"

# the words chair.py's reading looks at: the table's one-word entries, the words of its pairs, "toilet" and "seat"
WORDS = frozenset({entry for entry in NODE_OF if " " not in entry} | {"toilet", "seat"}
                  | {part for pair in DOUBLE_WORDS for part in pair.split(" ")})
_TABLE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "chair_published_words.txt")  # package data


@functools.cache
def _singulars() -> dict[str, str]:
    """chair_published_words.txt: "word singular" a line, for each word pattern changes that is, or becomes, one of
    :data:`WORDS` (the module docstring says how it was made)."""
    with open(_TABLE, encoding="utf-8") as lines:
        return dict(line.split() for line in lines if line.strip() and not line.startswith("#"))


def singularize(word: str) -> str:
    """``pattern.en.singularize(word)`` of pattern 3.6, quirks and all, for a lowercase ``word`` that is, or whose
    singular is, one of :data:`WORDS`; any other word comes back as it is (it names nothing either way).

    >>> [singularize(w) for w in ("dogs", "people", "buses", "bus", "minibus", "collies", "glass", "kine", "dogſ")]
    ['dog', 'person', 'bus', 'bu', 'minibu', 'collies', 'glas', 'cow', 'dog']
    >>> singularize("ties"), singularize("canoes")  # pattern: "ty", "cano"; neither is, nor becomes, a word of WORDS
    ('ties', 'canoes')
    """
    return _singulars().get(word, word)


_SENTENCE_BREAK = re.compile(r"(?<=[.!?])\s+")  # punkt's stand-in (captioning.text's)


def words(caption: str) -> list[str]:
    """chair.py's tokens of ``caption``: lowercased and split by nltk's word tokenizer, punctuation kept.

    >>> words("A hot, dog. Two DOGS!")
    ['a', 'hot', ',', 'dog', '.', 'two', 'dogs', '!']
    """
    lowered = caption.lower()
    if normalize_caption(lowered) == " ".join(lowered.split()):  # the project's tokenizer gives nltk's tokens
        return tokenize_caption(lowered, keep_punctuation=True)
    from nltk.tokenize import NLTKWordTokenizer  # what NFKC would change stays as chair.py sees it ("ｄｏｇ")

    return [token for sentence in _SENTENCE_BREAK.split(lowered) for token in NLTKWordTokenizer().tokenize(sentence)]


def mentions(caption: str) -> list[tuple[str, str]]:
    """The COCO objects chair.py finds in ``caption``, in order, as (the word, its category) (module docstring).

    >>> mentions("Two buses, a bus and two ties near canoes")
    [('bus', 'bus')]
    >>> mentions("A man with two hot dogs and wine glasses")
    [('man', 'person'), ('hot dog', 'hot dog'), ('wine glass', 'wine glass')]
    """
    lowered = caption.lower()
    tokens = reading_tokens(lowered) if normalize_caption(lowered) == " ".join(lowered.split()) else words(caption)
    return read_objects([singularize(w) for w in tokens], NODE_OF, DOUBLE_WORDS)
