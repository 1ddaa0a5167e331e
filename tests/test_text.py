import doctest

import pytest

import captioning.text as text
import captioning.vocab as vocab_mod
from captioning.errors import InputError
from captioning.text import normalize_caption, tokenize_caption
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
    v = Vocabulary.build(captions, min_word_count=2)
    assert v.words == ("<pad>", "<start>", "<end>", "<unk>", "a", "b")  # a:3, b:2; c, d dropped
    assert (PAD_ID, START_ID, END_ID, UNK_ID) == (0, 1, 2, 3)
    assert v.encode(["a", "c", "b"]) == [START_ID, 4, UNK_ID, 5, END_ID]
    assert v.decode([START_ID, 5, 4, END_ID, 4, PAD_ID]) == ["b", "a"]


def test_vocabulary_ties_are_alphabetical_and_min_count_one_keeps_all():
    v = Vocabulary.build([["z", "y", "x"]], min_word_count=1)
    assert v.words[4:] == ("x", "y", "z")


def test_vocabulary_round_trip(tmp_path):
    v = Vocabulary.build([["red", "circle"], ["red"]], min_word_count=1)
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
