"""Greedy decoding: the :class:`Greedy` strategy of the one word-by-word loop
(:func:`captioning.model.search_loop.search`), a beam of one (:func:`captioning.model.decode.beam_search`'s output,
``top_k`` 1) in a few ops a step beside the decoder's own: each step's likeliest word allowed, ``<end>`` completing the
caption, and no step after every caption ended (but the one the loop's lag allows). A caption's length is how many
words it kept (a word is never ``<pad>``: id 0)."""

from __future__ import annotations

import tensorflow as tf

from captioning.model.beams import length_penalty
from captioning.model.search_loop import Strategy
from captioning.model.search_tools import log_normalizer, never_proposed
from captioning.model.word_rules import DEAD, WordRules, blocked_words
from captioning.vocab import END_ID


class Greedy(Strategy):
    """One row per image. Loop variables: ``live [B, 1]`` (the caption had not ended), ``log_probs [B, 1]`` (its
    summed log p, ``<end>``'s too), and written a column a step into buffers of ``max_length`` columns (their shapes
    fixed: XLA compiles the loop), the ``words`` (0 once the caption ended; n-gram blocking reads them) and the
    attention ``weights`` each was chosen with (zeros once it ended)."""

    def __init__(self, model, max_length: int, length_normalization: float = 0.0, length_penalty_form: str = "avg",
                 block_ngrams: int = 0, bad_endings=(), min_length: int = 0, words=None):
        self.vocab, self.attends, self.max_length = model.vocab_size, model.attends, max_length
        # over a subword tokenizer's words (words: its WordTable), in word_-keyed loop variables
        self.word_rules = WordRules.of(words, self.vocab, max_length, block_ngrams, bad_endings)
        if self.word_rules:
            block_ngrams, bad_endings = 0, ()
        self.penalty_form, self.alpha, self.min_length = length_penalty_form, length_normalization, min_length
        self.block_ngrams, self.bad_endings = block_ngrams, tuple(bad_endings)
        self.tracks_ids = block_ngrams >= 1

    def start(self, batch, state):
        self.never = never_proposed(self.vocab, self.min_length)
        words = self.word_rules.start(batch) if self.word_rules else {}
        return {**words, "live": tf.ones([batch, 1], tf.bool), "log_probs": tf.zeros([batch, 1]),
                "words": tf.zeros([batch, self.max_length], tf.int32),
                "weights": tf.zeros([batch, self.max_length, tf.shape(state["attention"])[1]]) if self.attends
                else tf.zeros([0])}

    def _likeliest(self, t, tokens, logits, ids, chosen):
        """The likeliest word allowed ``[B, 1]`` (the first of equal ones: the next step waits only for it, the
        softmax runs beside it) and its log p."""
        bias = self.never[tf.cast(t < self.min_length, tf.int32)] if self.min_length else self.never[0]
        if self.word_rules:
            rules = self.word_rules.ruled_out(chosen)
            word = tf.argmax(logits + bias + rules, axis=1, output_type=tf.int32)[:, None]
            return word, tf.gather(tf.nn.log_softmax(logits), word, batch_dims=1)
        if self.tracks_ids or self.bad_endings:
            rules = blocked_words(ids, t, self.vocab, self.block_ngrams, self.bad_endings) if self.tracks_ids else (
                blocked_words(tokens[:, None], tf.minimum(t, 1), self.vocab, 0, self.bad_endings))  # the last word's
            word = tf.argmax(logits + bias + rules * DEAD, axis=1, output_type=tf.int32)[:, None]
            return word, tf.gather(tf.nn.log_softmax(logits), word, batch_dims=1)
        # the likeliest of all words, or where it is never proposed (rare), of the others: no sum over them all
        likeliest = tf.argmax(logits, axis=1, output_type=tf.int32)
        word = tf.cond(tf.reduce_any(tf.gather(bias, likeliest) < 0.0),
                       lambda: tf.argmax(logits + bias, axis=1, output_type=tf.int32), lambda: likeliest)[:, None]
        return word, tf.gather(logits, word, batch_dims=1) - log_normalizer(logits, likeliest, of_all=True)[:, None]

    def next_words(self, t, tokens, logits, state, chosen):
        word, word_logp = self._likeliest(t, tokens, logits, chosen["words"], chosen)
        live = chosen["live"] & tf.not_equal(word, END_ID)
        kept = tf.where(live, word, 0)
        at = tf.one_hot(t, self.max_length, dtype=tf.int32)[None, :]  # step t's column: the buffers keep their shape
        out = {"live": live, "log_probs": chosen["log_probs"] + tf.where(chosen["live"], word_logp, 0.0),
               "words": chosen["words"] + kept * at, "weights": chosen["weights"]}
        if self.word_rules:
            out.update(self.word_rules.advanced(chosen, tf.reshape(word, [-1])))
        if self.attends:
            weights = tf.where(live, tf.cast(state["attention"], tf.float32), 0.0)
            out["weights"] = chosen["weights"] + weights[:, None, :] * tf.cast(at, tf.float32)[:, :, None]
        return tf.reshape(word, [-1]), out, None, tf.logical_not(tf.reduce_any(live))

    def finish(self, chosen, ran):
        words, log_probs = chosen["words"], chosen["log_probs"]
        lengths = tf.reduce_sum(tf.cast(words > 0, tf.int32), axis=1, keepdims=True)
        counted = tf.cast(tf.where(lengths < self.max_length, lengths + 1, lengths), tf.float32)  # <end> when it came
        out = {"ids": words[:, None], "lengths": lengths,
               "log_probs": log_probs,
               "scores": log_probs / length_penalty(counted, self.penalty_form, self.alpha)}
        if self.attends:
            out["attention"] = chosen["weights"][:, None]
        return out
