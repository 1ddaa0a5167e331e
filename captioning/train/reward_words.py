"""SCST's CIDEr-D reward on *words* for a subword tokenizer (a language model's pieces): the sampled pieces become
the prepared dataset's word ids inside the graph, so that :class:`captioning.train.cider.CiderD` scores words, with
the references and the document frequencies a word decoder's reward uses.

**The words** of a caption of pieces: the tokenizer's :meth:`~captioning.data.tokenizers.base.Tokenizer.detokenize`
(up to ``<end>``, reserved and special ids skipped), normalised as every caption is before a subword tokenizer
splits it (:func:`captioning.data.tokenizers.base.normalized`: lowercased, runs of characters other than letters,
digits and apostrophes one space), split at the spaces. Each word is looked up in the prepared dataset's vocabulary
(a ``tf.lookup.StaticHashTable`` from word to id, the reserved entries left out):

* a reference's word the vocabulary lacks is ``<unk>``, as ``prepare`` wrote it into the records' ``caption/ids``:
  the references are then the records' own word ids (for the captions whose normalised words are ``prepare``'s
  tokens — every plain caption, all of the synthetic scenes'), and the document frequencies are the word
  decoder's, counted from them (:func:`captioning.train.document_frequencies.frequencies_from_split`);
* a candidate's word the vocabulary lacks gets a fresh id that no reference and no document frequency holds:
  ``len(vocabulary) + r``, r its rank among the caption's distinct unknown words (the same word the same id). It
  counts as a word of its own that matches nothing (idf log(documents), as pycocoevalcap counts an n-gram of no
  reference), never as ``<unk>`` (which would match a reference's rare word, or another unknown word).
  :class:`~captioning.train.cider.CiderD` takes ``extra_ids`` for them (the n-gram keys' base grows by that much).

So the reward is exactly CIDEr-D of the caption's words against the references' words as the prepared vocabulary
spells them: a caption string scores the same whichever tokenizer produced it (a word decoder can only write
vocabulary words; tests/test_reward_words.py). What it cannot credit is a rare word of a reference (below
``prepare``'s minimum count: ``<unk>`` in the records), which a word decoder cannot write either. With
``scst.end_in_reward`` every reference ends with ``<end>`` and a candidate that chose ``<end>`` has it after its
words, as for a word decoder.
"""

from __future__ import annotations

import tensorflow as tf

from captioning.data.tokenizers.base import normalized
from captioning.vocab import END_ID, RESERVED, UNK_ID


class RewardWords:
    """Pieces → word ids for the reward (module docstring). ``tokenizer``: the run's subword tokenizer (its
    ``detokenize``); ``words``: the prepared dataset's vocabulary words (``Vocabulary.words``, reserved first);
    ``extra``: fresh ids for a candidate's unknown words (``scst.max_length``: a caption has no more words than
    pieces when, as in GPT-2's and SentencePiece's vocabularies, only a piece's start may begin a word; beyond it
    the last fresh id is shared)."""

    def __init__(self, tokenizer, words, extra: int):
        self.detokenize, self.size, self.extra = tokenizer.detokenize, len(words), max(1, int(extra))
        known = list(words[len(RESERVED):])
        self.table = tf.lookup.StaticHashTable(tf.lookup.KeyValueTensorInitializer(
            tf.constant(known or [""], tf.string),
            tf.constant(list(range(len(RESERVED), len(words))) or [-1], tf.int64)), -1)

    @property
    def id_space(self) -> int:
        """Word ids run below it: the vocabulary's and the fresh ones."""
        return self.size + self.extra

    def words(self, ids) -> tf.RaggedTensor:
        """Captions of project ids ``[N, T]`` → their words, ragged strings ``[N, (W)]``."""
        words = tf.strings.split(normalized(self.detokenize(ids)), sep=" ")
        return tf.ragged.boolean_mask(words, tf.not_equal(words, ""))

    def candidates(self, ids, end_in_reward: bool):
        """Sampled captions (pieces, then ``<end>`` or ``<pad>``: ``[N, T]``) → ``(word ids int32 [N, W], lengths
        [N])``: their words' ids, unknown words fresh ids, then ``<end>`` when the caption chose it and
        ``end_in_reward``."""
        ids = tf.convert_to_tensor(ids)
        words = self.words(ids)
        lengths = tf.cast(words.row_lengths(), tf.int32)
        # a column more than the longest caption's words: never empty (an argmax over no words is an error)
        text = tf.pad(words.to_tensor(""), [[0, 0], [0, 1]])
        known = tf.pad(tf.ragged.map_flat_values(self.table.lookup, words).to_tensor(-1), [[0, 0], [0, 1]],
                       constant_values=-1)
        width = tf.shape(text)[1]
        valid = tf.range(width)[None, :] < lengths[:, None]
        unknown = valid & (known < 0)
        same = tf.equal(text[:, :, None], text[:, None, :]) & valid[:, None, :]  # [N, W, W]
        first = tf.argmax(tf.cast(same, tf.int32), axis=2, output_type=tf.int32)  # a word's first place
        new = unknown & tf.equal(first, tf.range(width)[None, :])  # an unknown word's first occurrence
        rank = tf.gather(tf.cumsum(tf.cast(new, tf.int32), axis=1, exclusive=True), first, batch_dims=1)
        out = tf.where(unknown, self.size + tf.minimum(rank, self.extra - 1), tf.cast(known, tf.int32))
        out = tf.where(valid, out, 0)
        if end_in_reward:
            ended = tf.reduce_any(tf.equal(ids, END_ID), axis=1)
            out = tf.pad(out, [[0, 0], [0, 1]])
            out = tf.where(tf.equal(tf.range(width + 1)[None, :], lengths[:, None]) & ended[:, None], END_ID, out)
            lengths += tf.cast(ended, tf.int32)
        return out, lengths

    def references(self, pieces: tf.RaggedTensor, end_token: bool) -> tf.RaggedTensor:
        """References of pieces ``[B, (C), (L)]`` (without ``<start>``; an ``<end>`` ends one) → word ids
        ``[B, (C), (W)]`` int32, unknown words ``<unk>``, each followed by ``<end>`` when ``end_token``."""
        captions = pieces.values  # [B·C, (L)]
        words = self.words(captions.to_tensor(0))
        ids = tf.ragged.map_flat_values(self.table.lookup, words)
        ids = tf.ragged.map_flat_values(lambda x: tf.cast(tf.where(x < 0, tf.constant(UNK_ID, tf.int64), x), tf.int32),
                                        ids)
        if end_token:
            ends = tf.RaggedTensor.from_tensor(tf.fill([tf.shape(ids.row_lengths())[0], 1], END_ID))
            ids = tf.concat([ids, ends], axis=1)
        return tf.RaggedTensor.from_row_splits(ids, pieces.row_splits)


def reward_words(tokenizer, dataset, max_length: int) -> RewardWords | None:
    """The reward's words for a run whose captions are ``tokenizer``'s (None: the words tokenizer or a
    vocabulary, whose ids are the words already) over ``dataset`` (its vocabulary), sampling ``max_length``
    pieces."""
    if tokenizer is None or getattr(tokenizer, "kind", "words") == "words":
        return None
    return RewardWords(tokenizer, dataset.vocabulary().words, max_length)
