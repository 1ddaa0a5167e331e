"""CLIP-S of sampled captions inside the compiled step (Cho et al. 2022's CLIP reward): what SCST's
``scst.reward: clip | mix`` is to reward, from a frozen CLIP or SigLIP preset
(:class:`captioning.model.contrastive.ContrastiveModel`), equal to ``evaluate --clip-preset``'s ``clip_score`` for
the same caption and image (:mod:`captioning.evaluation.clip_score`; tests/test_clip_score.py checks it).

**Words to the preset's pieces, in the graph.** CLIP's tokenizer splits a text into words before its BPE (and
SigLIP's SentencePiece does not merge across spaces), so a caption of the project's words is the concatenation of
each word's pieces. :class:`ClipReward` asks the preset's own tokenizer once, on the host, for the pieces of every
word of the vocabulary (the reserved ids: none) and of the prefix ``"A photo depicts"``; a sample's word ids then
gather their pieces, and the packing is the preprocessor's: ``<|startoftext|>`` (CLIP), the prefix and the
caption's pieces cut to the text length with the end-of-text token kept, padding. The text tower reads that; the
image tower reads the batch's images (pixels in 0–255, resized and normalised by the preset's converter), once per
image, whatever the samples per image.
"""

from __future__ import annotations

import tensorflow as tf

from captioning.model.contrastive import ContrastiveModel
from captioning.vocab import END, PAD, START

PREFIX = "A photo depicts"  # Hessel et al.'s prefix (clip_score.PREFIX without its trailing space: a word boundary)


class ClipReward:
    """CLIP-S = ``weight`` · max(cos(image, caption), 0) of word-id captions (see the module docstring). ``words``:
    the vocabulary, id → word ("" for the reserved ids, which have no pieces)."""

    def __init__(self, model: ContrastiveModel, words: list[str], weight: float = 2.5):
        self.model, self.weight = model, float(weight)
        pieces = [model.pieces(w) if w else [] for w in words] + [[]]  # the last row: what a non-word gathers
        self.table = tf.RaggedTensor.from_row_lengths(
            tf.constant([p for word in pieces for p in word], tf.int32), [len(word) for word in pieces])
        self.empty = len(words)
        self.prefix = tf.constant(model.pieces(PREFIX), tf.int32)
        self.pack = model.packing()

    def token_ids(self, word_ids, lengths):
        """The packed ids ``[N, L]`` of captions ``word_ids [N, T]`` whose first ``lengths [N]`` are words."""
        word_ids = tf.convert_to_tensor(word_ids, tf.int32)
        rows = tf.shape(word_ids)[0]
        real = tf.sequence_mask(lengths, tf.shape(word_ids)[1])
        ids = tf.where(real & (word_ids >= 0) & (word_ids < self.empty), word_ids, self.empty)
        caption = tf.gather(self.table, ids).merge_dims(1, 2)  # [N, (pieces)]
        body = tf.concat([tf.RaggedTensor.from_tensor(tf.tile(self.prefix[None], [rows, 1])), caption], axis=1)
        start = self.pack["start"]
        body = body[:, :self.pack["length"] - 1 - (start is not None)]  # room for the end (and start) tokens
        end = tf.fill([rows, 1], self.pack["end"])
        parts = ([tf.fill([rows, 1], start)] if start is not None else []) + [body, end]
        packed = tf.concat([tf.RaggedTensor.from_tensor(p) if isinstance(p, tf.Tensor) else p for p in parts], axis=1)
        return packed.to_tensor(self.pack["pad"], shape=[None, self.pack["length"]])

    def image_embeddings(self, images):
        """``[B, D]`` L2-normalised embeddings of ``images`` ``[B, H, W, 3]`` (pixels in 0–255)."""
        pixels = self.model.converter(tf.cast(images, tf.float32))
        return tf.math.l2_normalize(tf.cast(self.model.backbone.get_vision_embeddings(pixels), tf.float32), -1)

    def __call__(self, image_embeddings, word_ids, lengths):
        """CLIP-S ``[N]`` of each caption with its image's embedding (``image_embeddings [N, D]``, a row per
        caption: repeat an image's for its samples)."""
        text = self.model.text_features(self.token_ids(word_ids, lengths))
        text = tf.math.l2_normalize(tf.cast(text, tf.float32), -1)
        return self.weight * tf.maximum(tf.reduce_sum(image_embeddings * text, axis=-1), 0.0)


def vocabulary_words(vocab) -> list[str]:
    """Id → word of a words vocabulary (:class:`captioning.vocab.Vocabulary`): "" for ``<pad>``, ``<start>`` and
    ``<end>``; ``<unk>`` stays the word ``<unk>``, as the caption's text (and so ``evaluate``) has it."""
    return ["" if w in (PAD, START, END) else w for w in vocab.words]
