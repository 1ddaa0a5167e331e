"""``data.tokenizer: words``: the prepared dataset's word vocabulary (:class:`captioning.vocab.Vocabulary`) as a
tokenizer.

It *is* the vocabulary (a subclass: every use of a vocabulary keeps working, ``vocab.txt`` and its equality
included), and the input pipeline reads the ids ``prepare`` wrote into the records (``caption/ids``) as before:
nothing is tokenized while training. Every piece is a whole word, so every piece starts a word.

:meth:`WordsTokenizer.caption_ids` tokenizes in the graph for callers that hold only text: the normalisation of
:func:`captioning.data.tokenizers.base.normalized`, split on spaces, each word looked up (``<unk>`` for a word the
vocabulary lacks). On a plain caption (lowercase words, no punctuation inside a word) it gives the ids
``prepare`` gave; ``<unk>`` reads as the word ``<unk>`` (:meth:`~WordsTokenizer.decode`, ``detokenize``, as
captions always showed it), though its piece, never proposed, is empty like every reserved id's. ``prepare``'s
tokenizer (:func:`captioning.text.tokenize_caption`, nltk's) splits some words
the normalisation keeps whole (``"zebra's"`` → ``zebra 's``): the records' ids are the ones training reads.
"""

from __future__ import annotations

import hashlib
import os

from captioning.data.tokenizers.base import Tokenizer, before_end, normalized, with_start_and_end
from captioning.vocab import END_ID, PAD_ID, START_ID, UNK_ID, Vocabulary

VOCAB = "vocab.txt"  # its file in a model folder (the prepared dataset's name for it too)


class WordsTokenizer(Vocabulary, Tokenizer):
    """The word vocabulary as a :class:`~captioning.data.tokenizers.base.Tokenizer` (module docstring)."""

    kind = "words"
    __eq__ = Vocabulary.__eq__  # equal to a Vocabulary of the same words, either way round
    __hash__ = None

    @classmethod
    def of(cls, vocabulary: Vocabulary) -> "WordsTokenizer":
        return vocabulary if isinstance(vocabulary, WordsTokenizer) else cls(vocabulary.words)

    @classmethod
    def load_from(cls, folder: str) -> "WordsTokenizer | None":
        """The ``vocab.txt`` of ``folder``, or None when there is none (InputError naming it when damaged)."""
        path = os.path.join(folder, VOCAB)
        return cls(Vocabulary.load(path).words) if os.path.exists(path) else None

    @property
    def identity(self) -> str:
        return "words-" + hashlib.sha256("\n".join(self.words).encode()).hexdigest()[:16]

    def _tables(self):
        """The word → id lookup and the id → word table, made once, on first use."""
        tables = getattr(self, "_made", None)
        if tables is None:
            import tensorflow as tf

            with tf.init_scope():  # eager, even when first asked inside a traced function or a tf.data map
                words = tf.constant(list(self.words))
                lookup = tf.lookup.StaticHashTable(
                    tf.lookup.KeyValueTensorInitializer(words, tf.range(len(self.words), dtype=tf.int64)), UNK_ID)
            tables = self._made = (lookup, words)
        return tables

    def caption_ids(self, texts):
        import tensorflow as tf

        lookup, _ = self._tables()
        words = tf.strings.split(normalized(texts), sep=" ")  # "" (an empty caption) splits into no word
        words = tf.ragged.boolean_mask(words, tf.not_equal(words, ""))
        return with_start_and_end(tf.ragged.map_flat_values(lookup.lookup, words))

    def image_captions(self, ids, texts):
        return ids  # the records' own: prepare wrote them with this vocabulary

    def detokenize(self, ids):
        import tensorflow as tf

        _, words = self._tables()
        ids = tf.cast(ids, tf.int64)
        keep = before_end(ids) & tf.not_equal(ids, PAD_ID) & tf.not_equal(ids, START_ID)
        return tf.strings.reduce_join(tf.ragged.boolean_mask(tf.gather(words, ids), keep), axis=-1, separator=" ")

    def text(self, ids) -> str:
        return " ".join(self.words[w] for w in ids)  # what ids_to_text always wrote: <unk> as the word <unk>

    def pieces(self) -> list[str]:
        return ["" if i in (PAD_ID, START_ID, END_ID, UNK_ID) else " " + word for i, word in enumerate(self.words)]

    def save_to(self, folder: str) -> None:
        self.save(os.path.join(folder, VOCAB))

    def fits(self, dataset) -> bool:
        return dataset.vocabulary() == self
