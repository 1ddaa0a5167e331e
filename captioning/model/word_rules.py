"""What a decoding step may propose, shared by the search strategies (:mod:`captioning.model.beams`,
:mod:`captioning.model.greedy`, :mod:`captioning.model.sampling`): the dead score that rules a word out, n-gram blocking, bad endings
(``decode.bad_endings``, its word lists, and the check of its words against the vocabulary) and the rule that
``<end>`` is not the first word (``min_length``).

Over a word vocabulary the rules read the caption's ids (:func:`blocked_words`). Over a subword tokenizer's pieces
they read the words the pieces spell (:class:`WordTable`, built once from the tokenizer's ``pieces()`` and
``starts_word()``; :class:`WordRules`, whose loop variables a strategy carries per row): a piece that starts a word,
or ``<end>``, completes the current word, and is what n-gram blocking blocks; ``<end>`` is blocked after a last word
that is a bad ending, however it was split. Whole-word pieces keep the rules over ids, which then rule exactly alike
for bad endings and block one step earlier for n-grams (a whole word is complete when chosen)."""

from __future__ import annotations

import numpy as np
import tensorflow as tf

from captioning.vocab import END_ID, PAD_ID, START_ID, UNK_ID

DEAD = -1e9  # the score of a word ruled out, or of an empty beam slot (finite, so arithmetic never makes NaN)


def blocked_words(ids, t, vocab: int, block_ngrams: int = 0, bad_endings=()):
    """``[..., V]`` 1.0 where a word may not follow the ``t`` words of each caption ``ids [..., S]`` (int32):
    with ``block_ngrams`` n ≥ 1 the last word itself and (n ≥ 2) every word that would complete an n-gram
    the caption has already; with ``bad_endings`` (ids), ``<end>`` after one of them.

    >>> ids = tf.constant([[5, 6, 5, 0, 0]])  # "x y x": with bigrams blocked, "y" may not follow "x" again
    >>> blocked = blocked_words(ids, tf.constant(3), 8, block_ngrams=2).numpy()[0]
    >>> [w for w in range(8) if blocked[w]]
    [5, 6]
    """
    lead = tf.shape(ids)[:-1]
    steps = ids.shape[-1]
    out = tf.zeros(tf.concat([lead, [vocab]], 0))
    last = tf.gather(ids, tf.maximum(t - 1, 0), axis=-1)
    if block_ngrams >= 1:
        out = tf.maximum(out, tf.one_hot(last, vocab) * tf.cast(t >= 1, tf.float32))
    if block_ngrams >= 2 and steps >= block_ngrams:
        gram = block_ngrams  # words in an n-gram
        starts = steps - gram + 1  # windows ids[j : j + gram], j < starts
        match = tf.range(starts) + gram - 1 < t  # the window's last word is among the t words
        for offset in range(gram - 1):  # its first gram - 1 words equal the caption's last gram - 1
            word = tf.gather(ids, tf.maximum(t - gram + 1 + offset, 0), axis=-1)
            match = match & tf.equal(ids[..., offset:starts + offset], word[..., None])
        match = match & (t >= gram - 1)
        follower = ids[..., gram - 1:]  # the word each matching window goes on with: banned now
        flat = tf.reshape(follower, [-1, starts])
        rows = tf.repeat(tf.range(tf.shape(flat)[0]), starts)
        index = tf.stack([rows, tf.reshape(flat, [-1])], axis=1)
        hits = tf.scatter_nd(index, tf.reshape(tf.cast(match, tf.float32), [-1]),
                             tf.stack([tf.shape(flat)[0], vocab]))
        out = tf.maximum(out, tf.reshape(tf.minimum(hits, 1.0), tf.shape(out)))
    if bad_endings:
        bad = tf.reduce_any(tf.equal(last[..., None], tf.constant(list(bad_endings), last.dtype)), axis=-1)
        out = tf.maximum(out, tf.one_hot(END_ID, vocab) * tf.cast(bad & (t >= 1), tf.float32)[..., None])
    return out


def end_banned(vocab: int, t, min_length: int):
    """``[V]``: the dead score on ``<end>`` while fewer than ``min_length`` words are chosen (``t`` of them)."""
    return tf.one_hot(END_ID, vocab) * DEAD * tf.cast(t < min_length, tf.float32)


# self-critical.pytorch's remove_bad_endings list, with "the" and "and": words an English caption does not end on
ENGLISH_BAD_ENDINGS = ("a", "an", "the", "with", "in", "on", "of", "at", "to", "for", "this", "his", "her", "that",
                       "and")


# the names decode.bad_endings takes for a list of words
BAD_ENDING_LISTS = {"english": ENGLISH_BAD_ENDINGS}


def bad_ending_ids(words, vocab) -> tuple:
    """The ids of ``words`` (``decode.bad_endings``; a name of :data:`BAD_ENDING_LISTS`, ``english``, stands for
    its list, whose words the vocabulary lacks are left out). A word that is neither in the vocabulary nor a
    list's name is an InputError (a misspelt word would otherwise block nothing, silently).

    For a subword tokenizer (:func:`word_table` is not None), which spells any word, the words' texts instead (a
    list's words all kept), for :class:`WordRules`; a "word" that is empty or holds a space could never be a
    caption's last word, and is an InputError.

    >>> bad_ending_ids(["english"], type("T", (), {"pieces": lambda s: ["", "", "", "", " a", "n"],
    ...                                            "starts_word": lambda s: [False] * 4 + [True, False]})())[:3]
    ('a', 'an', 'and')
    """
    import difflib

    from captioning.errors import InputError

    if hasattr(vocab, "pieces") and hasattr(vocab, "starts_word") and _subword(vocab.pieces(), vocab.starts_word()):
        for word in words:
            if not word.strip() or len(word.split()) > 1:
                raise InputError(f"decode.bad_endings: {word!r} is not one word")
        return tuple(sorted({w for word in words for w in BAD_ENDING_LISTS.get(word, (word,))}))
    special = {vocab.words[i] for i in (PAD_ID, START_ID, END_ID, UNK_ID)}
    known = [w for w in vocab.words if w not in special]
    for word in words:
        if word not in BAD_ENDING_LISTS and (word in special or vocab.id(word) == UNK_ID):
            near = difflib.get_close_matches(word, list(BAD_ENDING_LISTS) + known, n=3, cutoff=0.6)
            hint = f"; did you mean {', '.join(near)}?" if near else ""
            raise InputError(f"decode.bad_endings: {word!r} is not a word of the model's vocabulary nor a list "
                             f"({', '.join(BAD_ENDING_LISTS)}){hint}")
    wanted = [w for word in words for w in BAD_ENDING_LISTS.get(word, (word,))]
    return tuple(sorted({vocab.id(w) for w in wanted if vocab.id(w) != UNK_ID}))


# ---- the rules over words of subword pieces ------------------------------------------------------------------
# A word's identity in the graph: two polynomial hashes of its UTF-8 bytes (digits byte + 1), each modulo a prime
# below 2^31, so that a hash times a power stays below 2^62 in int64; a word's key packs both (h1 · 2^31 + h2). Two
# different words share a key with probability about 2^-62 (any two of a caption's few words).
_MODULI = (2_147_483_647, 2_147_483_629)
_BASES = (1_000_003, 742_938_295)


def _hashed(data: bytes) -> tuple[tuple[int, int], tuple[int, int]]:
    """``((h1, h2), (B1^len, B2^len))`` of ``data``: h(ab) = h(a)·B^len(b) + h(b) mod P, piece by piece."""
    hashes, powers = [], []
    for base, modulus in zip(_BASES, _MODULI):
        value = 0
        for byte in data:
            value = (value * base + byte + 1) % modulus
        hashes.append(value)
        powers.append(pow(base, len(data), modulus))
    return tuple(hashes), tuple(powers)


def word_key(word: str | bytes) -> int:
    """The int64 key of a word's text, as :class:`WordRules` computes it in the graph piece by piece.

    >>> word_key("circle") == word_key(b"circle") != word_key("circles")
    True
    """
    (first, second), _ = _hashed(word.encode("utf-8") if isinstance(word, str) else word)
    return first * 2 ** 31 + second


class WordTable:
    """What the word rules need of a subword tokenizer, built once from its ``pieces()`` (each project id's text:
    ``str``, or ``bytes`` for a piece that is part of a character) and ``starts_word()`` (bool ``[V]``): per id the
    hashes of the text it adds to the current word (a piece that starts a word: its text after its leading
    whitespace), ``B^length`` of that text, whether it starts a word and whether it adds any text. A word is the text
    between spaces: the pieces from one that starts a word to the next one that does (or ``<end>``); a piece's text
    after its leading whitespace is taken to lie within one word. :meth:`of` gives None for a word vocabulary (every
    piece that adds text starts a word): the rules over ids are then exactly the word rules."""

    def __init__(self, pieces, starts_word):
        starts = np.asarray(starts_word, bool)
        if starts.shape != (len(pieces),):
            raise ValueError(f"starts_word() has shape {starts.shape}, pieces() {len(pieces)} entries")
        digits, powers, texts = [], [], []
        for piece, start in zip(pieces, starts):
            data = piece.encode("utf-8") if isinstance(piece, str) else bytes(piece)
            if start:
                data = data.lstrip()
            hashed, power = _hashed(data)
            digits.append(hashed)
            powers.append(power)
            texts.append(bool(data))
        self.size = len(pieces)
        self.digits, self.powers = np.asarray(digits, np.int64), np.asarray(powers, np.int64)  # [V, 2]
        self.starts, self.texts = starts, np.asarray(texts, bool)

    @classmethod
    def of(cls, pieces, starts_word) -> "WordTable | None":
        """The table, or None when every piece that adds text starts a word (a word vocabulary)."""
        return cls(pieces, starts_word) if _subword(pieces, starts_word) else None


def _subword(pieces, starts_word) -> bool:
    """Whether a piece that adds text does not start a word (so words are spelt in several pieces)."""
    return any(not start and len(piece) > 0 for piece, start in zip(pieces, starts_word))


def word_table(tokenizer) -> WordTable | None:
    """:meth:`WordTable.of` a tokenizer's ``pieces()`` and ``starts_word()``; None for a word vocabulary (a
    :class:`captioning.vocab.Vocabulary` has neither, and a words tokenizer's pieces are whole words)."""
    if not hasattr(tokenizer, "pieces") or not hasattr(tokenizer, "starts_word"):
        return None
    return WordTable.of(tokenizer.pieces(), tokenizer.starts_word())


class WordRules:
    """``block_ngrams`` and ``bad_endings`` over the words of subword pieces, for one search of ``max_length`` steps
    (the rows' loop variables come from :meth:`start`, prefixed ``word_``; a strategy carries them, reorders them with
    its rows, adds :meth:`ruled_out` to its logits and feeds each row's chosen piece to :meth:`advanced`):

    * ``word_done [rows, max_length]`` int64: the keys of the caption's complete words; ``word_count [rows]``;
    * ``word_now [rows, 2]`` int64: the hashes of the current word (the pieces since the last that started a word);
      ``word_open [rows]``: whether it has any text yet.

    A piece that starts a word, or ``<end>``, completes the current word. ``block_ngrams`` n blocks every such piece
    when the current word equals the last complete one (no word follows itself) or (n ≥ 2) when the word n-gram it
    would complete (the last n - 1 complete words and the current one) is one the caption's complete words hold
    already, as :func:`blocked_words` rules over whole words; so a continuing piece
    (one that does not start a word) is the only way on: the word is not finished yet and may become another word.
    ``bad_endings`` (words' texts) blocks ``<end>`` after a caption whose last word is one of them, whatever pieces
    spelt it. Use :meth:`of`: None when there is nothing to rule."""

    PREFIX = "word_"

    def __init__(self, table: WordTable, vocab: int, max_length: int, block_ngrams: int = 0, bad_endings=()):
        if table.size != vocab:
            raise ValueError(f"the word table covers {table.size} ids, the decoder {vocab}")
        if any(not isinstance(word, str) for word in bad_endings):
            raise ValueError("bad_endings of a subword tokenizer are words' texts (bad_ending_ids gives them)")
        self.vocab, self.max_length, self.block_ngrams = vocab, max_length, block_ngrams
        self.bad = tf.constant(sorted({word_key(word) for word in bad_endings}) or [0], tf.int64)
        self.has_bad = bool(bad_endings)
        self.digits, self.powers = tf.constant(table.digits), tf.constant(table.powers)
        self.starts = tf.constant(table.starts)
        self.texts = tf.constant(table.texts)
        # the pieces that complete the current word: those that start a word, and <end>
        completing = tf.cast(tf.logical_or(self.starts, tf.cast(tf.one_hot(END_ID, vocab), tf.bool)), tf.float32)
        self.dead = tf.stack([completing, tf.one_hot(END_ID, vocab)]) * DEAD  # [2, V]: what each rule rules out
        self.moduli = tf.constant(_MODULI, tf.int64)

    @classmethod
    def of(cls, table, vocab: int, max_length: int, block_ngrams: int = 0, bad_endings=()) -> "WordRules | None":
        """The rules, or None without a table (a word vocabulary: the rules over ids) or without rules."""
        if table is None or not (block_ngrams or bad_endings):
            return None
        return cls(table, vocab, max_length, block_ngrams, bad_endings)

    def start(self, rows) -> dict:
        """The loop variables of ``rows`` empty captions."""
        p = self.PREFIX
        return {p + "done": tf.zeros([rows, self.max_length], tf.int64), p + "count": tf.zeros([rows], tf.int32),
                p + "now": tf.zeros([rows, 2], tf.int64), p + "open": tf.zeros([rows], tf.bool)}

    @staticmethod
    def _key(hashes):
        return hashes[..., 0] * 2 ** 31 + hashes[..., 1]

    def ruled_out(self, state: dict):
        """``[rows, V]``: the dead score on the pieces the rules forbid next (twice it where both rules do), 0 on the
        others: each row's two flags (a completing piece repeats an n-gram; ``<end>`` follows a bad ending) times
        the pieces each flag rules out, in one product: one pass over the vocabulary, not one per rule."""
        p = self.PREFIX
        done, count, now, is_open = state[p + "done"], state[p + "count"], self._key(state[p + "now"]), state[p + "open"]

        def complete(back):  # the complete word ``back`` words before the current one (1: the last), or 0
            return tf.gather(done, tf.maximum(count - back, 0), batch_dims=1)

        repeated = bad = tf.zeros_like(is_open)
        n = self.block_ngrams
        if n >= 1:
            repeated = (count >= 1) & tf.equal(complete(1), now)  # no word follows itself
            if n >= 2:
                gram = [complete(n - 1 - offset) for offset in range(n - 1)] + [now]  # oldest first
                starts = self.max_length - n + 1  # windows done[j : j + n], j < starts
                match = tf.range(starts)[None, :] + n - 1 < count[:, None]  # the window lies among the complete
                for offset in range(n):
                    match &= tf.equal(done[:, offset:starts + offset], gram[offset][:, None])
                repeated |= (count >= n - 1) & tf.reduce_any(match, axis=1)
            repeated &= is_open
        if self.has_bad:
            last = tf.where(is_open, now, complete(1))
            has_last = is_open | (count >= 1)
            bad = has_last & tf.reduce_any(tf.equal(last[:, None], self.bad[None, :]), axis=1)
        flags = tf.cast(tf.stack([repeated, bad], axis=1), tf.float32)  # [rows, 2]
        return tf.matmul(flags, self.dead)

    def advanced(self, state: dict, pieces) -> dict:
        """The loop variables after each row's caption took ``pieces [rows]`` (int32)."""
        p = self.PREFIX
        done, count, now, is_open = state[p + "done"], state[p + "count"], state[p + "now"], state[p + "open"]
        starts = tf.gather(self.starts, pieces)
        push = is_open & (starts | tf.equal(pieces, END_ID))
        at = tf.cast(tf.one_hot(count, self.max_length), tf.bool) & push[:, None]
        digits, powers = tf.gather(self.digits, pieces), tf.gather(self.powers, pieces)
        continued = tf.math.floormod(now * powers + digits, self.moduli[None, :])
        texts = tf.gather(self.texts, pieces)
        return {p + "done": tf.where(at, self._key(now)[:, None], done), p + "count": count + tf.cast(push, tf.int32),
                p + "now": tf.where(starts[:, None], digits, continued),
                p + "open": tf.where(starts, texts, is_open | texts)}

    def reordered(self, state: dict, rows) -> dict:
        """The loop variables of the rows ``rows [rows]`` (a beam's parents)."""
        return {key: tf.gather(value, rows) for key, value in state.items() if key.startswith(self.PREFIX)}
