"""What a decoding step may propose, shared by the search strategies (:mod:`captioning.model.beams`,
:mod:`captioning.model.greedy`, :mod:`captioning.model.sampling`): the dead score that rules a word out, n-gram blocking, bad endings
(``decode.bad_endings``, its word lists, and the check of its words against the vocabulary) and the rule that
``<end>`` is not the first word (``min_length``)."""

from __future__ import annotations

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


def bad_ending_ids(words, vocab) -> tuple[int, ...]:
    """The ids of ``words`` (``decode.bad_endings``; a name of :data:`BAD_ENDING_LISTS`, ``english``, stands for
    its list, whose words the vocabulary lacks are left out). A word that is neither in the vocabulary nor a
    list's name is an InputError (a misspelt word would otherwise block nothing, silently)."""
    import difflib

    from captioning.errors import InputError

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
