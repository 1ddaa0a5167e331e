"""A trained model from its folder, and captions for encoded images: what ``evaluate``, ``caption`` and
``export`` share.

:func:`load` rebuilds the model from ``config.yaml`` and ``vocab.txt`` and restores a checkpoint (the
latest complete one by default: :class:`captioning.model.folder.ModelDir`). The encoder is built without its
ImageNet weights (the checkpoint holds the trained ones), so loading never downloads. :class:`Captioner` turns a batch of JPEG/PNG bytes into captions with
one ``tf.function``: decode and crop as at evaluation (:func:`captioning.data.pipeline.model_input`),
encode, beam search. The SavedModel export wraps that same function.
"""

from __future__ import annotations

import dataclasses

import tensorflow as tf

from captioning.model.decode import beam_search, ids_to_text
from captioning.config import DecodeConfig
from captioning.data.reading import model_input
from captioning.model.folder import ModelDir, TrainedModel


def load(model_dir: str, checkpoint: str | None = None) -> TrainedModel:
    """The model of ``model_dir`` at ``checkpoint`` (default: the latest complete one)."""
    return ModelDir(model_dir).load(checkpoint)


class Captioner:
    """Captions for batches of encoded images, beam search inside one ``tf.function``."""

    def __init__(self, trained: TrainedModel, decode: DecodeConfig | None = None):
        """``decode``: the beam search's settings (default: the model's ``decode:`` config)."""
        self.trained = trained
        self.settings = (decode or trained.config.decode).check()
        self.options = dataclasses.asdict(self.settings)  # beam_search's keyword arguments
        self.decode = tf.function(self.decode_encoded, input_signature=[tf.TensorSpec([None], tf.string)])

    def decode_encoded(self, encoded: tf.Tensor) -> dict:
        """Encoded images ``[B]`` → :func:`captioning.decode.beam_search`'s outputs (with ``attention`` for an
        attention decoder), and ``images``: the ``uint8`` crops the model saw."""
        cfg = self.trained.config.data
        size = cfg.image_size
        images = tf.map_fn(lambda e: model_input(e, cfg), encoded,
                           fn_output_signature=tf.TensorSpec([size, size, 3], tf.uint8))
        features = self.trained.model.encode(images, training=False)
        return {**beam_search(self.trained.model, features, **self.options), "images": images}

    def decode_images(self, images: tf.Tensor) -> dict:
        """Already cropped ``uint8`` images ``[B, S, S, 3]`` → beam search outputs."""
        return beam_search(self.trained.model, self.trained.model.encode(images, training=False), **self.options)

    @property
    def grid_shape(self) -> tuple[int, int] | None:
        """(rows, columns) of the attention grid, or None for a decoder without attention."""
        model = self.trained.model
        return model.grid_shape if model.attends else None

    def caption(self, encoded: list[bytes]) -> list[list[Caption]]:
        """Per image, the ``top_k`` captions, best first (with each word's attention weights and the crop
        the model saw, for an attention decoder)."""
        out = self.decode(tf.constant(encoded, dtype=tf.string))
        texts = ids_to_text(self.trained.vocab, out["ids"], out["lengths"])
        log_probs, lengths = out["log_probs"].numpy(), out["lengths"].numpy()
        weights = out["attention"].numpy() if "attention" in out else None
        images = out["images"].numpy()
        return [[Caption(text, float(lp), weights[i, j, :lengths[i, j]] if weights is not None else None,
                         images[i] if weights is not None else None)
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

    def __iter__(self):
        return iter((self.text, self.log_prob))
