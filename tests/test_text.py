import doctest
import os
import string
import unicodedata

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

import captioning.text as text
import captioning.vocab as vocab_mod
from captioning.errors import InputError
from captioning.text import normalize_caption, tokenize_caption
from data_prep.vocabulary import build_vocabulary
from captioning.vocab import END_ID, PAD_ID, START_ID, UNK_ID, Vocabulary


def test_docstring_examples():
    for module in (text, vocab_mod):
        assert doctest.testmod(module).failed == 0


@pytest.mark.parametrize("raw, tokens", [
    ("A man riding a wave on top of a surfboard.", ["a", "man", "riding", "a", "wave", "on", "top", "of", "a",
                                                     "surfboard"]),
    ("TWO  DOGS\tPLAYING\n", ["two", "dogs", "playing"]),
    ("A dog. A cat!", ["a", "dog", "a", "cat"]),  # sentence-final punctuation inside the caption
    ("Café crème at the CAFÉ", ["café", "crème", "at", "the", "café"]),
    ("Cafe\u0301", ["café"]),  # combining accent is composed by NFKC
    ("Cafe\u200b\u0301 CAFE\x00\u0301", ["café", "café"]),  # invisible characters go before NFKC composes
    ("ｆｕｌｌｗｉｄｔｈ letters", ["fullwidth", "letters"]),  # NFKC folds compatibility forms
    ("zero\u200bwidth\u00a0space", ["zerowidth", "space"]),
    ("a \"quoted\" word, isn't it?", ["a", "quoted", "word", "is", "n't", "it"]),
    ("🙂 a smiling face", ["a", "smiling", "face"]),  # an emoji is punctuation-like: no letter or digit
    ("", []),
    ("   \t\n ", []),
    ("...!?", []),
])
def test_tokenize(raw, tokens):
    assert tokenize_caption(raw) == tokens


def test_keep_punctuation_keeps_treebank_tokens():
    assert tokenize_caption('A "dog", running.', keep_punctuation=True) == ["a", "``", "dog", "''", ",",
                                                                           "running", "."]


def test_very_long_caption_is_tokenized_whole():
    raw = " ".join(f"word{i}" for i in range(500))
    tokens = tokenize_caption(raw)
    assert len(tokens) == 500 and tokens[-1] == "word499"


def test_normalize_caption_folds_case_and_space():
    assert normalize_caption("  Hello\u00a0\u00a0WORLD \r\n") == "hello world"


def test_vocabulary_build_counts_and_orders():
    captions = [["b", "a"], ["a", "c"], ["a", "b"], ["d"]]
    v = build_vocabulary(captions, min_word_count=2)
    assert v.words == ("<pad>", "<start>", "<end>", "<unk>", "a", "b")  # a:3, b:2; c, d dropped
    assert (PAD_ID, START_ID, END_ID, UNK_ID) == (0, 1, 2, 3)
    assert v.encode(["a", "c", "b"]) == [START_ID, 4, UNK_ID, 5, END_ID]
    assert v.decode([START_ID, 5, 4, END_ID, 4, PAD_ID]) == ["b", "a"]


def test_vocabulary_ties_are_alphabetical_and_min_count_one_keeps_all():
    v = build_vocabulary([["z", "y", "x"]], min_word_count=1)
    assert v.words[4:] == ("x", "y", "z")


def test_vocabulary_round_trip(tmp_path):
    v = build_vocabulary([["red", "circle"], ["red"]], min_word_count=1)
    path = str(tmp_path / "vocab.txt")
    v.save(path)
    assert open(path, encoding="utf-8").read() == "<pad>\n<start>\n<end>\n<unk>\nred\ncircle\n"
    assert Vocabulary.load(path) == v


def test_vocabulary_rejects_bad_files(tmp_path):
    bad = tmp_path / "bad.txt"
    bad.write_text("a\nb\n", encoding="utf-8")
    with pytest.raises(InputError, match="must start with"):
        Vocabulary.load(str(bad))
    with pytest.raises(InputError, match="cannot read vocabulary"):
        Vocabulary.load(str(tmp_path / "missing.txt"))
    dup = tmp_path / "dup.txt"
    dup.write_text("<pad>\n<start>\n<end>\n<unk>\nred\nred\n", encoding="utf-8")
    with pytest.raises(InputError, match="'red' twice"):
        Vocabulary.load(str(dup))


# --- properties: any text at all gives clean tokens, never an exception -----------------------------------

PROPERTY = settings(max_examples=200, deadline=None, derandomize=True)  # seconds, and the same run on CI

# Random code points rarely meet the pieces that interact (a base letter, an invisible character, then a
# combining mark), so captions are strung together from these pieces as well as from any code point
# (lone surrogates, private use and unassigned ones included: JSON can carry "\\ud800").
PIECES = ["e", "A", "I", "\u0130", "\u0131", "\u00df", "\u1e9e", "\ufb01", "\u01c5", "\u03a3", "\u03c2", "\u0390",
          "\uac00", "\u1100", "\u1161", "\uff80", "\uff9e", "\u0301", "\u0308", "\u0316", "\u0307", "\u0345",
          "\u200b", "\u200d", "\u200e", "\u202e", "\ufeff", "\u00ad", "\x00", "\x1f", "\x7f", "\u00a0", "\u00a8",
          "\u2028", "\u3000", "\t", "\n", "\r", " ", "  ", "\U0001f642", "\U0001f469\u200d\U0001f4bb",
          "\u0627\u0644\u0643\u0644\u0628", "\u05db\u05dc\u05d1", "\u00b2", "\u2474", "0", "42", ".", ",", "!", "?",
          "'", '"', "`", "-", "--", "(", "[", "<", "&", "$", "...", "can't", "cannot", "n't", "'s", "word", "Dog",
          "U.S.", "st.", "e-mail", "\ud800", "\ue000"]
CAPTIONS = st.one_of(
    st.lists(st.one_of(st.sampled_from(PIECES), st.characters(codec=None, exclude_categories=())),
             max_size=40).map("".join),
    st.text(),
)
# Characters that carry nothing and are not whitespace: removing them must change nothing.
INVISIBLE = st.sampled_from(["\x00", "\x07", "\x7f", "\u200b", "\u200c", "\u200d", "\u200e", "\u202e",
                             "\u2060", "\ufeff", "\u00ad", "\ud800", "\ue000"])


def alnum(s):
    return "".join(ch for ch in s if ch.isalnum())


@PROPERTY
@given(CAPTIONS)
@example("e\u200b\u0301")  # was "e\u0301" (decomposed), which a second pass composed to "\u00e9"
@example("e\x1b\u0301")
@example("\u0130\u0316")  # lower() leaves "i\u0307\u0316": marks out of canonical order
@example("a\u00a8b")  # NFKC turns the diaeresis into a space and a combining mark
def test_normalize_caption_is_idempotent_nfkc_lowercase_single_spaced(raw):
    out = normalize_caption(raw)
    assert normalize_caption(out) == out
    assert unicodedata.normalize("NFKC", out) == out and out.lower() == out
    assert out == " ".join(out.split())  # no leading, trailing or repeated whitespace; only " "
    assert not any(unicodedata.category(ch)[0] == "C" for ch in out)
    out.encode("utf-8")  # no lone surrogate survives: vocab.txt and the records are UTF-8


@PROPERTY
@given(CAPTIONS, st.booleans())
@example("\u0130\u0316 e\u200b\u0301", False)
@example('0"', True)
def test_tokens_are_clean_words(raw, keep_punctuation):
    tokens = tokenize_caption(raw, keep_punctuation=keep_punctuation)
    assert isinstance(tokens, list)
    for token in tokens:
        assert token and token.split() == [token]  # non-empty, no whitespace of any kind
        assert token.lower() == token and unicodedata.normalize("NFKC", token) == token
        assert not any(unicodedata.category(ch)[0] == "C" for ch in token)
        assert keep_punctuation or not text.is_punctuation(token)
    assert tokenize_caption(normalize_caption(raw), keep_punctuation) == tokens  # normalising twice is harmless


@PROPERTY
@given(CAPTIONS)
def test_dropping_punctuation_only_drops_punctuation_tokens(raw):
    kept = tokenize_caption(raw, keep_punctuation=True)
    assert [t for t in kept if not text.is_punctuation(t)] == tokenize_caption(raw)
    # no letter or digit is ever lost or reordered, whatever the tokenizer splits
    assert alnum("".join(tokenize_caption(raw))) == alnum(normalize_caption(raw))


@PROPERTY
@given(CAPTIONS, st.data())
def test_invisible_characters_and_whitespace_kinds_change_nothing(raw, data):
    tokens = tokenize_caption(raw, keep_punctuation=True)
    noisy = list(raw)
    for _ in range(data.draw(st.integers(0, 5))):
        noisy.insert(data.draw(st.integers(0, len(noisy))), data.draw(INVISIBLE))
    assert tokenize_caption("".join(noisy), keep_punctuation=True) == tokens
    spaced = raw.replace(" ", data.draw(st.sampled_from(["\t", "\n", "\u00a0", "\u3000", " \r\n ", "\u2028"])))
    assert tokenize_caption(spaced, keep_punctuation=True) == tokens


@PROPERTY
@given(st.text(alphabet=string.printable))
def test_ascii_case_does_not_matter(raw):
    assert tokenize_caption(raw.upper()) == tokenize_caption(raw.lower()) == tokenize_caption(raw)


@settings(PROPERTY, max_examples=15)
@given(st.lists(st.sampled_from(PIECES), min_size=1, max_size=12).map("".join), st.integers(200, 2000))
def test_very_long_captions_are_tokenized_whole(piece, repeat):
    raw = " ".join([piece] * repeat)  # up to ~50,000 characters
    tokens = tokenize_caption(raw)
    assert alnum("".join(tokens)) == alnum(normalize_caption(raw))
    assert all(token and token.split() == [token] for token in tokens)


@PROPERTY
@given(st.text(alphabet=string.punctuation + "\u2014\u00bf\u00ab\u00bb\u3002\U0001f642\u2764\u0301 ", min_size=1))
def test_punctuation_symbols_and_emoji_give_no_tokens(raw):
    assert tokenize_caption(raw) == []
    assert all(text.is_punctuation(t) for t in tokenize_caption(raw, keep_punctuation=True))


@PROPERTY
@given(st.text(), st.sampled_from("a\u00e9\u0436\u4e2d\u0627\u05d00\u0669\u00b2"), st.text())
def test_a_letter_or_digit_anywhere_makes_a_token_a_word(before, ch, after):
    assert not text.is_punctuation(before + ch + after)
    assert text.is_punctuation(before) == (alnum(before) == "")


@settings(max_examples=400, deadline=None, derandomize=True)
@given(st.lists(st.one_of(st.sampled_from(["a", "dog", "cannot", "gonna", "wanna", "gimme", "lemme", "gotta", "can",
                                           "3", "10", "x2", "mr", "e", "g"]),
                          st.sampled_from([" ", ", ", ". ", ".", ",", "  ", " , ", "! ", "'s ", "'", "-", ": ", ":",
                                           " : ", ":: "])),
                max_size=14),
       st.booleans())
def test_the_plain_caption_fast_path_equals_nltk(parts, keep):
    from captioning.text import _nltk_tokens, normalize_caption

    caption = "".join(parts)
    text = normalize_caption(caption)
    expected = _nltk_tokens(text, keep) if text else []
    assert tokenize_caption(caption, keep) == expected


def test_nltk_is_imported_only_when_a_caption_takes_the_general_path():
    """Importing nltk imports all of it (scipy.stats among it): about 1 CPU s a process. A process whose captions
    are all plain (the synthetic sets', the models' own) never imports it; the first caption nltk must split does."""
    import subprocess
    import sys

    from tests.helpers import REPO

    program = ("import sys\n"
               "from captioning.text import tokenize_caption\n"
               "print(tokenize_caption('Three shapes: a red circle, a blue square.'), 'nltk' in sys.modules)\n"
               "print(tokenize_caption('I cannot see'), 'nltk' in sys.modules)\n")
    done = subprocess.run([sys.executable, "-c", program], cwd=REPO, capture_output=True, text=True, timeout=60,
                          env=dict(os.environ, PYTHONPATH=REPO))
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.splitlines() == ["['three', 'shapes', 'a', 'red', 'circle', 'a', 'blue', 'square'] False",
                                        "['i', 'can', 'not', 'see'] True"]
