"""A trained model from its folder, and captions for encoded images: what ``evaluate``, ``caption`` and
``export`` share.

:func:`load` rebuilds the model from ``config.yaml`` and ``vocab.txt`` and restores a checkpoint (the
latest complete one by default: :class:`captioning.model.folder.ModelDir`). The encoder is built without its
ImageNet weights (the checkpoint holds the trained ones), so loading never downloads. :class:`Captioner` turns a batch of JPEG/PNG bytes into captions with
one ``tf.function``: decode, then each model's own preprocessor crops as at evaluation
(:func:`captioning.data.reading.model_input`, :attr:`captioning.model.folder.TrainedModel.preprocessor`), encode,
beam search. The SavedModel export wraps that same function. A model reading regions
(``data.features: regions``, pooled by its own encoder: ``model.regions_from_encoder``) takes each image's
boxes too: :meth:`Captioner.decode_with_boxes` squashes the whole image to the model's size, encodes it and
pools each box and the whole image from the grid (:func:`captioning.inference.regions.boxes_to_regions`),
as ``captioning features extract`` pooled the regions the model was trained on.
"""

from __future__ import annotations

import dataclasses
import logging

import numpy as np
import tensorflow as tf
from tensorflow.autograph.experimental import do_not_convert

from captioning.model.decode import bad_ending_ids, generate, ids_to_text
from captioning.model.word_rules import word_table
from captioning.config.sections import DecodeConfig
from captioning.data.reading import model_input, squash
from captioning.inference.regions import boxes_to_regions
from captioning.errors import InputError
from captioning.model import check_caption_length
from captioning.model.base import IMAGE_INPUTS
from captioning.model.data_sources import data_source
from captioning.model.ensemble import TrainedEnsemble, load_ensemble, model_dirs
from captioning.model.folder import ModelDir, TrainedModel

log = logging.getLogger(__name__)


def load(model_dir, checkpoint: str | None = None, weights: str | None = None) -> TrainedModel | TrainedEnsemble:
    """The model of ``model_dir`` at ``checkpoint`` (default: the latest complete one); with several folders
    (a list), the ensemble of their latest complete checkpoints (:mod:`captioning.model.ensemble`). ``weights``:
    ``"ema"``, the weight average (``train.ema_decay``), or ``"raw"``; None: the average of a checkpoint that has
    one (each model of an ensemble its own), else the raw weights."""
    dirs = model_dirs(model_dir)
    if len(dirs) == 1:
        return ModelDir(dirs[0]).load(checkpoint, weights=weights)
    if checkpoint:
        raise InputError("`checkpoint` names one model's checkpoint: an ensemble of several model folders uses each "
                         "one's latest complete checkpoint", params=("checkpoint",))
    return load_ensemble(dirs, weights)


def check_boxes(cfg, model_dir: str) -> None:
    """An InputError when the model of ``cfg`` (in ``model_dir``) cannot caption new images from their boxes: its
    data source's check (:meth:`~captioning.model.data_sources.base.DataSource.check_boxes`; regions imported from
    a detector this project cannot run)."""
    data_source(cfg).check_boxes(model_dir)


def image_keys(encoded):
    """Sampling keys of encoded images ``[B]``: a hash of each image's bytes, so an image's samples do not depend
    on the batch it is in."""
    return tf.strings.to_hash_bucket_fast(encoded, 2 ** 62)


class Captioner:
    """Captions for batches of encoded images, beam search inside one ``tf.function``, by one trained model
    or an ensemble of them (:class:`captioning.model.ensemble.TrainedEnsemble`)."""

    def __init__(self, trained: TrainedModel, decode: DecodeConfig | None = None):
        """``decode``: the beam search's settings (default: the (first) model's ``decode:`` config). A setting
        that does nothing with the others gets one warning line each; a ``decode.bad_endings`` word the
        vocabulary lacks is an InputError."""
        self.trained = trained
        self.settings = (decode or trained.config.decode).check()
        for member in trained.members:  # every decoder of an ensemble can decode that many words
            check_caption_length(member.config.model, "decode.max_length (--max-length)", self.settings.max_length)
        self.options = dataclasses.asdict(self.settings)  # what an export records
        self.bad_endings = bad_ending_ids(self.settings.bad_endings, trained.vocab)
        self.words = word_table(trained.vocab)  # a subword tokenizer's words, which the decoding rules read
        for line in self.settings.ineffective():
            log.warning("%s", line)
        # the members' initial states and the search, from their features: with decode.jit_compile (greedy) one
        # program XLA compiles per batch size (the language model's reading of the prefix with the words after it)
        self._captions = tf.function(self._captions_of, jit_compile=True, autograph=False) if (
            self.settings.jit_compile) else self._captions_of
        self.decode = tf.function(self.decode_encoded, input_signature=[tf.TensorSpec([None], tf.string)],
                                  autograph=False)
        self.decode_boxes = tf.function(self.decode_with_boxes, input_signature=[
            tf.TensorSpec([None], tf.string), tf.TensorSpec([None, None, 4], tf.float32)], autograph=False)

    def decode_encoded(self, encoded: tf.Tensor) -> dict:
        """Encoded images ``[B]`` → :func:`captioning.decode.beam_search`'s outputs (with ``attention`` for an
        attention decoder), and ``images``: the ``uint8`` crops the model saw (an ensemble's: its first
        model's)."""
        features, images, _ = self._image_features(encoded)
        return {**self._captions(features, image_keys(encoded)), "images": images}

    def _captions_of(self, features, keys) -> dict:
        """Captions as :attr:`settings` say (:func:`captioning.model.decode.generate`) from each member's
        ``(features, mask)`` (:meth:`~captioning.model.base.CaptionModel.image_features`): its initial state, then the
        search (an ensemble's: each member's state, as a tuple)."""
        states = tuple(member.model.initial_state(f, training=False, mask=mask)
                       for member, (f, mask) in zip(self.trained.members, features))
        return generate(self.trained.model, states[0] if len(states) == 1 else states, self.settings,
                        self.bad_endings, keys, self.words)

    def _generate(self, initial_state, keys) -> dict:
        """Captions as :attr:`settings` say from the decoder's ``initial_state``, the search in TensorFlow's own ops
        whatever ``decode.jit_compile`` says (the LiteRT file's search: its converter compiles it)."""
        settings = dataclasses.replace(self.settings, jit_compile=False)
        return generate(self.trained.model, initial_state, settings, self.bad_endings, keys, self.words)

    def _image_features(self, encoded, boxes=None):
        """What each model's encoder gives of encoded images ``[B]`` (``(features, mask)``, one per member of an
        ensemble), the first model's images and, with ``boxes``, the regions' boxes. Each model sees the images as
        it was trained to: the central crop of its own sizes, or (reading regions) the whole image squashed to its
        size with each box and the whole image pooled from its grid."""
        features, crops, seen, regions = [], {}, None, None
        for member in self.trained.members:
            model = member.model
            if model.source.takes_boxes:
                images, sizes = self._squashed(encoded, model.image_size)
                inputs = boxes_to_regions(model, images, boxes, sizes)
                features.append(model.image_features(inputs))
                regions = inputs["boxes"] if regions is None else regions
            else:
                preprocessor = member.preprocessor
                if preprocessor not in crops:  # models of the same sizes share the decoding
                    crops[preprocessor] = tf.map_fn(
                        lambda e, p=preprocessor: model_input(e, p), encoded,
                        fn_output_signature=tf.TensorSpec([preprocessor.image_size] * 2 + [3], tf.uint8))
                images = crops[preprocessor]
                features.append(model.image_features({"image": images}))
            seen = images if seen is None else seen
        return tuple(features), seen, regions

    @staticmethod
    def _squashed(encoded, size: int):
        @do_not_convert
        def one(data):
            image = tf.io.decode_image(data, channels=3, expand_animations=False)
            return squash(image, size), tf.shape(image)[:2]

        return tf.map_fn(one, encoded, fn_output_signature=(tf.TensorSpec([size, size, 3], tf.uint8),
                                                            tf.TensorSpec([2], tf.int32)))

    def decode_with_boxes(self, encoded: tf.Tensor, boxes: tf.Tensor) -> dict:
        """A model reading regions (``model.regions_from_encoder``): encoded images ``[B]`` and their boxes
        ``[B, N, 4]`` (x, y, width, height pixels; no width or height: padding) → beam search outputs (the
        attention over each image's regions, the boxes last), ``images`` (the whole images squashed to the
        model's size, as the regions were pooled from them) and ``boxes`` (the regions' corners as
        fractions of the image, the whole image last). An ensemble's models that read the grid ignore the
        boxes."""
        features, images, regions = self._image_features(encoded, boxes)
        return {**self._captions(features, image_keys(encoded)), "images": images, "boxes": regions}

    def decode_batch(self, batch: dict) -> dict:
        """A batch as the model reads it (``image``, or ``regions``, ``boxes`` and ``region_mask``; ``image_id``
        keys the images' samples) → the captions' outputs; for a model reading regions the attention is over
        each image's (padded) regions."""
        inputs = {key: batch[key] for key in IMAGE_INPUTS if key in batch}
        features = tuple(member.model.image_features(inputs) for member in self.trained.members)
        return self._captions(features, batch.get("image_id"))

    @property
    def token_layout(self):
        """Where the tokens the decoder attends over sit (a :class:`~captioning.model.layout.TokenLayout`), or None
        for a decoder without attention, one reading regions, or an encoder that declares no layout."""
        model = self.trained.model
        return model.token_layout if model.attends else None

    @property
    def attention_absent(self) -> str | None:
        """Why the captions come without attention weights, for a decoder that is a language model fed a visual prefix
        (its captions written in a preset's pieces: ``model.decoder: prefix_lm``), which ``caption --json`` and
        ``serve`` say in the record; None for every other model (an attending decoder shows its weights; a recurrent
        one without attention never had any)."""
        model = self.trained.model
        if model.attends or getattr(self.trained.vocab, "kind", "words") == "words":
            return None
        decoder = self.trained.config.model.decoder  # (an ensemble's: its first model's; they share a tokenizer)
        return (f"model.decoder {decoder} is a language model reading the image as a prefix: keras-hub's "
                "attention layers do not return their weights, so its attention over the prefix cannot be read")

    @property
    def takes_boxes(self) -> bool:
        """Whether a model (of an ensemble, any) reads regions (its data source's
        :attr:`~captioning.model.data_sources.base.DataSource.takes_boxes`): :meth:`caption` then needs each
        image's boxes."""
        return any(member.model.source.takes_boxes for member in self.trained.members)

    def check_boxes(self) -> None:
        """An InputError when the model (of an ensemble, any) reads regions it cannot pool from new images
        (imported features)."""
        for member in self.trained.members:
            member.model.source.check_boxes(member.model_dir)

    def caption(self, encoded: list[bytes], boxes: list | None = None) -> list[list[Caption]]:
        """Per image, the ``top_k`` captions, best first (with each word's attention weights and the crop
        the model saw, for an attention decoder). A model reading regions takes ``boxes``: per image an
        array ``[n, 4]`` (x, y, width, height pixels; n may be 0), and gives each caption's regions' boxes."""
        if self.takes_boxes:
            self.check_boxes()
            boxes = [np.asarray(b, np.float32).reshape(-1, 4) for b in (boxes or [()] * len(encoded))]
            most = max([len(b) for b in boxes] + [0])
            padded = np.zeros((len(encoded), most, 4), np.float32)
            for i, b in enumerate(boxes):
                padded[i, :len(b)] = b
            out = self.decode_boxes(tf.constant(encoded, dtype=tf.string), tf.constant(padded))
            regions = [out["boxes"].numpy()[i][np.r_[np.arange(len(b)), most]] for i, b in enumerate(boxes)]
        else:
            out = self.decode(tf.constant(encoded, dtype=tf.string))
            regions = None
        texts = ids_to_text(self.trained.vocab, out["ids"], out["lengths"])
        log_probs, lengths = out["log_probs"].numpy(), out["lengths"].numpy()
        weights = out["attention"].numpy() if "attention" in out else None
        images = out["images"].numpy()

        def attention(i, j):
            if weights is None:
                return None
            w = weights[i, j, :lengths[i, j]]
            return w if regions is None else w[:, np.r_[np.arange(len(regions[i]) - 1), w.shape[1] - 1]]

        return [[Caption(text, float(lp), attention(i, j), images[i] if weights is not None else None,
                         regions[i] if regions is not None else None)
                 for j, (text, lp) in enumerate(zip(image_texts, image_lps))]
                for i, (image_texts, image_lps) in enumerate(zip(texts, log_probs))]


@dataclasses.dataclass
class Caption:
    """One caption of an image: its text, summed log-probability, and for an attention decoder each
    word's weights over the grid (``float32 [words, cells]``) and the ``uint8 [S, S, 3]`` crop they
    refer to. Unpacks as ``(text, log_prob)``."""

    text: str
    log_prob: float
    attention: "np.ndarray | None" = None
    image: "np.ndarray | None" = None
    boxes: "np.ndarray | None" = None  # a model reading regions: the regions' x1, y1, x2, y2 (fractions of the image)

    def __iter__(self):
        return iter((self.text, self.log_prob))
