"""n-gram blocking and bad endings over the words of subword pieces (captioning.model.word_rules' WordTable and
WordRules) in real searches — greedy, beams, sampling — against rules written here over the caption's text, with the
tiny GPT-2 (one space-led piece a scene word) and Gemma (SentencePiece: words in several pieces, some starting with
a bare "▁") presets' tokenizers, and a scripted decoder whose logits favour a repeating or badly ending caption."""

import numpy as np
import pytest
import tensorflow as tf

from captioning.data.tokenizers import PresetTokenizer
from captioning.errors import InputError
from captioning.model.decode import beam_search
from captioning.model.sampling import sample_search
from captioning.model.word_rules import (ENGLISH_BAD_ENDINGS, WordRules, WordTable, bad_ending_ids, word_key,
                                         word_table)
from captioning.vocab import END_ID, PAD_ID, RESERVED, START_ID, UNK_ID, Vocabulary

NEVER = (PAD_ID, START_ID, UNK_ID)


class Pieces:
    """A preset tokenizer (captioning.data.tokenizers' PresetTokenizer) and what the tests read of it: ``pieces()`` and
    ``starts_word()`` (so that ``word_table`` takes it as it takes the tokenizer), ``special`` (the language model's
    own special ids, never proposed), ``size``, ``ids(text)`` (a caption's pieces) and ``text(ids)``."""

    def __init__(self, tokenizer):
        self.tokenizer, self.texts = tokenizer, tokenizer.pieces()
        self.special, self.size = set(tokenizer.special_ids()), len(tokenizer)

    def pieces(self):
        return self.texts

    def starts_word(self):
        return self.tokenizer.starts_word()

    def ids(self, text):
        return [int(i) for i in self.tokenizer.caption_ids(tf.constant([text])).to_list()[0][1:-1]]

    def text(self, ids):  # as bytes (a piece that is part of a character is its bytes)
        pieces = [self.texts[i] for i in ids if i != END_ID]
        return b"".join(p if isinstance(p, bytes) else p.encode() for p in pieces)


@pytest.fixture(scope="module")
def tokenizers(lm_presets):
    """The session's tiny presets' tokenizers (tests/conftest.py's ``lm_presets``), each as :class:`Pieces`."""
    return {name: Pieces(PresetTokenizer.from_preset(folder)) for name, folder in lm_presets.items()}


class Scripted:
    """A decoder meeting the search loop's inference contract (``vocab_size``, ``attends``, ``reserve``, ``step``)
    whose logits at step t are ``table[t]`` plus ``noise[piece fed]``: row t favours ``script[t]`` (then ``<end>``),
    with seeded random alternatives; the special pieces get the dead score, as a language-model decoder gives them."""

    attends = False

    def __init__(self, size, script, dead=(), steps=16, seed=0, favour=6.0):
        rng = np.random.default_rng(seed)
        table = rng.normal(0.0, 1.0, (steps + 1, size))
        for t, piece in enumerate(list(script) + [END_ID] * (steps + 1 - len(script))):
            table[t, piece] += favour
        table[:, list(dead)] = -1e9
        self.vocab_size, self.table = size, table.astype(np.float32)
        self.noise = (rng.normal(0.0, 0.3, (size, size))).astype(np.float32)

    def initial_state(self, rows):
        return {"t": tf.zeros([rows], tf.int32)}

    def reserve(self, state, steps):
        return state

    def step(self, tokens, state):
        return tf.gather(self.table, state["t"]) + tf.gather(self.noise, tokens), {"t": state["t"] + 1}

    def logits(self, t, token):
        return self.table[t] + self.noise[token]


def allowed(text: bytes, piece: int, starts, block_ngrams=0, bad_endings=()) -> bool:
    """The rules over the caption's text, written independently: a piece that starts a word, or <end>, completes
    the current word (the text after the last space, when there is any: words are separated by spaces, which only
    a piece that starts a word begins with); it may not when that word equals the one
    before it (n >= 1) or when the caption's last n words, that one included, occurred before (n >= 2); <end> may not
    follow a last word that is a bad ending."""
    completes = piece == END_ID or starts[piece]
    words = [word for word in text.split(b" ") if word]  # (a byte piece of other whitespace is within a word)
    if piece == END_ID and words and words[-1].decode("utf-8", "replace") in bad_endings:
        return False
    if not completes or not text or text[-1:] == b" " or not block_ngrams:
        return True
    if len(words) >= 2 and words[-1] == words[-2]:
        return False
    n = block_ngrams
    earlier = {tuple(words[i:i + n]) for i in range(len(words) - n)}
    return not (n >= 2 and len(words) >= n and tuple(words[-n:]) in earlier)


def reference_greedy(model, tok, rows, max_length, block_ngrams=0, bad_endings=(), min_length=0):
    """Greedy decoding by hand: each step's likeliest allowed piece (never the reserved or special ones)."""
    starts = tok.starts_word()
    out = []
    for _ in range(rows):
        token, chosen = START_ID, []
        for t in range(max_length):
            logits = model.logits(t, token).astype(np.float64)
            logits[list(NEVER) + sorted(tok.special)] = -np.inf
            if t < min_length:
                logits[END_ID] = -np.inf
            text = tok.text(chosen)
            for piece in np.argsort(-logits, kind="stable"):
                if allowed(text, int(piece), starts, block_ngrams, bad_endings):
                    token = int(piece)
                    break
            if token == END_ID:
                break
            chosen.append(token)
        out.append(chosen)
    return out


def captions(found):
    """The ids of every caption of a search's output ``[B, K, T]`` with its ``lengths``."""
    return [list(ids[:n]) for row, lengths in zip(found["ids"].numpy(), found["lengths"].numpy())
            for ids, n in zip(row, lengths)]


def obeys(tok, ids, ended, block_ngrams, bad_endings):
    """Whether every piece of a caption (and its <end>, when it ended) was allowed after the ones before it."""
    starts = tok.starts_word()
    steps = list(ids) + ([END_ID] if ended else [])
    return all(allowed(tok.text(steps[:i]), piece, starts, block_ngrams, bad_endings)
               for i, piece in enumerate(steps))


CASES = [  # the favourite caption, block_ngrams, bad endings
    ("a red red circle", 1, ()),
    ("a red circle a red circle a red", 2, ()),
    ("a red circle and a red circle and", 3, ()),
    ("a big surfboard", 0, ("surfboard",)),
    ("a red circle on the", 2, ENGLISH_BAD_ENDINGS),
]


@pytest.mark.parametrize("name", ["gpt2", "gemma"])
@pytest.mark.parametrize("text, block_ngrams, bad_endings", CASES)
def test_greedy_beams_and_sampling_follow_the_word_rules_over_pieces(tokenizers, name, text, block_ngrams,
                                                                     bad_endings):
    """Greedy decoding with the rules equals a hand-written greedy loop applying them to the caption's text, and
    differs from decoding without them (they bite: the scripted favourite breaks them); every caption of a beam of
    4, of 4 samples per image and of diverse beams (2 groups) obeys them. (Compiled by XLA: the next test.)"""
    tok = tokenizers[name]
    script = tok.ids(text)
    model = Scripted(tok.size, script, dead=sorted(tok.special), seed=len(text), favour=9.0)
    table = word_table(tok)
    assert table is not None
    rules = dict(block_ngrams=block_ngrams, bad_endings=bad_endings, words=table)
    state = model.initial_state(2)
    greedy = tf.function(lambda s: beam_search(model, None, beam_size=1, max_length=16, initial_state=s, **rules),
                         autograph=False)(state)
    expected = reference_greedy(model, tok, 2, 16, block_ngrams, bad_endings)
    assert captions(greedy) == expected
    plain = beam_search(model, None, beam_size=1, max_length=16, initial_state=state)
    assert captions(plain)[0] == script  # the favourite breaks the rules...
    assert not obeys(tok, script, True, block_ngrams, bad_endings)
    assert expected[0] != script  # ...which change it
    wide = beam_search(model, None, beam_size=4, top_k=4, max_length=16, initial_state=state, **rules)
    drawn = sample_search(model, state, max_length=16, samples=4, seed=3, temperature=0.5, **rules)
    diverse = beam_search(model, None, beam_size=4, top_k=2, beam_groups=2, diversity=0.5, max_length=16,
                          initial_state=state, **rules)
    for found in (wide, drawn, diverse):
        for ids in captions(found):
            assert obeys(tok, ids, len(ids) < 16, block_ngrams, bad_endings), tok.text(ids)
    unruled = (beam_search(model, None, beam_size=4, top_k=4, max_length=16, initial_state=state),
               sample_search(model, state, max_length=16, samples=4, seed=3, temperature=0.5))
    for found in unruled:  # without them some caption breaks them
        assert not all(obeys(tok, ids, len(ids) < 16, block_ngrams, bad_endings) for ids in captions(found))


class Rows:
    """:class:`Scripted` decoders as one, row r stepping ``models[r]`` (greedy decoding keeps each row in its place):
    one search over all their scripts."""

    attends = False

    def __init__(self, models):
        self.vocab_size, self.rows = models[0].vocab_size, len(models)
        self.table, self.noise = (tf.constant(np.stack([getattr(m, key) for m in models])) for key in ("table", "noise"))

    def reserve(self, state, steps):
        return state

    def step(self, tokens, state):
        row = tf.range(self.rows)
        return (tf.gather_nd(self.table, tf.stack([row, state["t"]], axis=1))
                + tf.gather_nd(self.noise, tf.stack([row, tokens], axis=1))), {"t": state["t"] + 1}


def test_greedy_decoding_compiled_by_xla_follows_the_word_rules_over_pieces(tokenizers):
    """decode.jit_compile: greedy decoding with the rules over the tiny GPT-2's pieces, compiled by XLA, equals the
    hand-written greedy loop; one program, a row for each case's scripted favourite (the previous test's models), under
    rules that take every branch of WordRules.ruled_out (n-gram blocking with n = 2, which holds n = 1's no word after
    itself, and bad endings: the English ones and "surfboard"); each row's favourite breaks them; the n-gram blocking
    alone changes the first three rows' captions and leaves the last two, which the bad endings alone change.
    (Gemma's tables: the same ops.)"""
    tok = tokenizers["gpt2"]
    scripts = [tok.ids(text) for text, _, _ in CASES]
    models = [Scripted(tok.size, script, dead=sorted(tok.special), seed=len(text), favour=9.0)
              for script, (text, _, _) in zip(scripts, CASES)]
    bad = (*ENGLISH_BAD_ENDINGS, "surfboard")
    model = Rows(models)
    xla = beam_search(model, None, beam_size=1, max_length=16, initial_state={"t": tf.zeros([len(models)], tf.int32)},
                      jit_compile=True, block_ngrams=2, bad_endings=bad, words=word_table(tok))
    expected = [reference_greedy(m, tok, 1, 16, 2, bad)[0] for m in models]
    assert captions(xla) == expected
    for row, (m, script) in enumerate(zip(models, scripts)):
        assert not obeys(tok, script, True, 2, bad) and expected[row] != script
        blocked, ended = (reference_greedy(m, tok, 1, 16, *rules)[0] for rules in ((2, ()), (0, bad)))
        assert (blocked != script) if row < 3 else (blocked == script and ended != script), row


@pytest.mark.parametrize("method", ["greedy", "beam", "sample"])
def test_min_length_still_holds_with_the_word_rules(tokenizers, method):
    """A scripted decoder whose likeliest first pieces are <end> still gives captions of min_length pieces at least
    when the word rules run beside it (greedy: exactly the hand-written loop's)."""
    tok = tokenizers["gemma"]
    model = Scripted(tok.size, [END_ID, END_ID, END_ID], dead=sorted(tok.special), seed=7)
    state = model.initial_state(3)
    rules = dict(block_ngrams=2, bad_endings=("a",), words=word_table(tok), min_length=3)
    if method == "sample":
        found = sample_search(model, state, max_length=8, samples=3, seed=1, **rules)
    else:
        found = beam_search(model, None, beam_size=1 if method == "greedy" else 3, top_k=1 if method == "greedy" else 3,
                            max_length=8, initial_state=state, **rules)
    lengths = found["lengths"].numpy()
    assert (lengths >= 3).all(), lengths
    if method == "greedy":
        assert captions(found) == reference_greedy(model, tok, 3, 8, 2, ("a",), min_length=3)


WORDS = ("a", "red", "circle", "on", "the", "big")


def word_vocabulary_pieces():
    words = RESERVED + WORDS
    return ["" if i < len(RESERVED) else " " + word for i, word in enumerate(words)], Vocabulary(words)


def test_a_word_vocabulary_keeps_the_rules_over_ids():
    """Over a word vocabulary (every piece a word) there is no table: the rules are exactly today's over ids. And the
    rules over words, forced onto those whole-word pieces, end captions exactly where the rules over ids do (bad
    endings: the same rule; greedy, beams, sampling)."""
    pieces, vocab = word_vocabulary_pieces()
    starts = np.array([bool(p) for p in pieces])
    assert WordTable.of(pieces, starts) is None
    forced = WordTable(pieces, starts)
    script = [vocab.id(w) for w in ("a", "big", "red", "circle", "on", "the")]
    model = Scripted(len(pieces), script, seed=3, favour=4.0)
    state = model.initial_state(4)
    for searched in (
            lambda **r: beam_search(model, None, beam_size=1, max_length=8, initial_state=state, **r),
            lambda **r: beam_search(model, None, beam_size=3, top_k=3, max_length=8, initial_state=state, **r),
            lambda **r: sample_search(model, state, max_length=8, samples=3, seed=2, **r)):
        by_ids = searched(bad_endings=bad_ending_ids(["english"], vocab))
        by_words = searched(bad_endings=tuple(ENGLISH_BAD_ENDINGS), words=forced)
        for key in ("ids", "lengths", "log_probs"):
            np.testing.assert_array_equal(by_ids[key].numpy(), by_words[key].numpy())
        assert not all(ids[-1] not in bad_ending_ids(["english"], vocab) for ids in captions(searched()) if ids)


def test_word_keys_are_built_piece_by_piece():
    """A word's key from its pieces in the graph (h(ab) = h(a)·B^len(b) + h(b), per modulus) equals the key of its
    whole text, whatever the split; different words differ."""
    pieces = [b"", b"", b"", b"", b" sur", b"f", b"bo", b"ard", b" surf", b"board", b" ", b"surfboard", b"s"]
    table = WordTable(pieces, [p.startswith(b" ") for p in pieces])
    rules = WordRules(table, len(pieces), 8, block_ngrams=1)
    for split in ([4, 5, 6, 7], [8, 9], [10, 11]):
        state = rules.start(1)
        for piece in split:
            state = rules.advanced(state, tf.constant([piece]))
        state = rules.advanced(state, tf.constant([END_ID]))
        assert int(state["word_done"][0, 0]) == word_key("surfboard"), split
    assert len({word_key(w) for w in ("surfboard", "surfboards", "surf", "board", "a", "an")}) == 6


def test_bad_ending_ids_of_a_subword_tokenizer_are_words(tokenizers):
    """A subword tokenizer spells any word: bad endings are the words' texts (the English list whole); a "word" with
    a space or none at all is refused in one line. A word vocabulary still refuses a word it lacks."""
    tok = tokenizers["gemma"]
    assert bad_ending_ids(["english", "xyzzy"], tok) == tuple(sorted(set(ENGLISH_BAD_ENDINGS) | {"xyzzy"}))
    for bad in ("two words", " "):
        with pytest.raises(InputError, match="not one word"):
            bad_ending_ids([bad], tok)
    _, vocab = word_vocabulary_pieces()
    with pytest.raises(InputError, match="not a word of the model's vocabulary"):
        bad_ending_ids(["xyzzy"], vocab)
