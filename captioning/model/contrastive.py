"""A contrastive image-text model's two towers, frozen: a keras-hub CLIP or SigLIP preset read as its own
preprocessor and image converter read it (:class:`ContrastiveModel`). The reference-free metrics
(:mod:`captioning.evaluation.clip_score`, whose docstring says how text is packed and pooled) and SCST's CLIP reward
(:mod:`captioning.train.clip_reward`) share it, and the metrics and ``clip train`` share one text-to-image recall
(:func:`recall_at`).
"""

from __future__ import annotations

import numpy as np

from captioning.errors import InputError
from captioning.model.encoders.keras_hub import check_preset_folder, load_backbone

FAMILIES = ("CLIPBackbone", "SigLIPBackbone")
MAX_TEXTS = 4096  # texts embedded per call (a split's references are embedded in such chunks)


def normalised(x) -> np.ndarray:
    x = np.asarray(x, np.float64)
    norm = np.linalg.norm(x, axis=-1, keepdims=True)
    return x / np.where(norm > 0, norm, 1.0)


def recall_at(queries: np.ndarray, owners: np.ndarray, images: np.ndarray, ks=(1, 5)) -> dict[str, float]:
    """Text-to-image recall@K: the share of ``queries`` (embeddings) whose own image (``owners[i]``, a row of
    ``images``) is among the K closest images; an image as close as its own counts as closer (ties against)."""
    if not len(queries):
        return {f"recall@{k}": 0.0 for k in ks}
    sims = queries @ images.T
    own = sims[np.arange(len(queries)), owners]
    rank = np.sum(sims >= own[:, None], axis=1)  # 1: only its own image is that close
    return {f"recall@{k}": float(np.mean(rank <= k)) for k in ks}


def packed(preprocessor, texts):
    """``texts`` (a string tensor; TensorFlow ops, so a tf.data map may call it) packed as a keras-hub CLIP or SigLIP
    ``preprocessor`` packs them: lower-cased or canonicalized, its start and end tokens, padded to its length."""
    import tensorflow as tf

    p = preprocessor
    if getattr(p, "to_lower", False):
        texts = tf.strings.lower(texts)
    if getattr(p, "canonicalize_text", False):
        texts = p.canonicalize_inputs(texts)
    ids, _ = p.packer(p.tokenizer(texts), add_start_value=p.add_start_token, add_end_value=p.add_end_token)
    return ids


class ContrastiveModel:
    """A keras-hub CLIP or SigLIP preset's two towers (see the module docstring). ``key``: the option that named
    the preset, for the one-line errors."""

    def __init__(self, preset: str, key: str = "--clip-preset"):
        import keras_hub

        if not preset:
            raise InputError(f"{key}: give a keras-hub CLIP or SigLIP preset (a folder or a preset name)")
        param = key.lstrip("-").replace("-", "_")
        check_preset_folder(preset, param)
        self.preset = preset
        self.backbone = load_backbone(preset, param)
        self.family = type(self.backbone).__name__
        if self.family not in FAMILIES:
            raise InputError(f"{key}: {preset} holds a {self.family}; a CLIP or SigLIP preset is needed "
                             f"({', '.join(FAMILIES)})")
        m = keras_hub.models
        cls = m.CLIPPreprocessor if self.family == "CLIPBackbone" else m.SigLIPPreprocessor
        try:
            self.preprocessor = cls.from_preset(preset)
        except (ValueError, FileNotFoundError, OSError):  # no preprocessor.json: the family's defaults
            self.preprocessor = cls(tokenizer=keras_hub.models.Tokenizer.from_preset(preset))
        self.preprocessor.build(None)
        self.converter = keras_hub.layers.ImageConverter.from_preset(preset)

    # ---- the towers ---------------------------------------------------------------------------------
    def token_ids(self, texts: list[str]) -> np.ndarray:
        """``texts`` packed as the preset's preprocessor packs them: ``[N, sequence length]`` int32."""
        import tensorflow as tf

        return np.asarray(packed(self.preprocessor, tf.constant(list(texts), tf.string)), np.int32)

    def embed_texts(self, texts: list[str]) -> np.ndarray:
        """``[N, D]`` L2-normalised text embeddings (CLIP's pooled at the end-of-text token)."""
        out = [self._texts(list(texts[i:i + MAX_TEXTS])) for i in range(0, len(texts), MAX_TEXTS)]
        return normalised(np.concatenate(out)) if out else np.zeros([0, 0])

    def _texts(self, texts: list[str]) -> np.ndarray:
        return np.asarray(self.text_features(self.token_ids(texts)))

    def text_features(self, token_ids):
        """The text tower over packed ``token_ids`` ``[N, L]`` (TensorFlow ops, not normalised): CLIP's encoder
        read at the first end-of-text token and projected, SigLIP's at its last position."""
        import tensorflow as tf

        b = self.backbone
        if self.family == "SigLIPBackbone":
            return b.get_text_embeddings(token_ids)
        end = int(self.preprocessor.tokenizer.end_token_id)
        at = tf.argmax(tf.cast(tf.equal(token_ids, end), tf.int32), axis=1)  # the packing always ends with one
        hidden = b.text_encoder({"token_ids": token_ids})
        return b.text_projection(tf.gather(hidden, at, batch_dims=1))

    def packing(self) -> dict:
        """How the preprocessor packs a text's pieces: ``length``, ``start`` (an id, or None), ``end``, ``pad``."""
        p = self.preprocessor
        return {"length": int(p.sequence_length), "end": int(p.tokenizer.end_token_id),
                "start": int(p.tokenizer.start_token_id) if p.add_start_token else None,
                "pad": int(p.tokenizer.pad_token_id)}

    def pieces(self, text: str) -> list[int]:
        """The tokenizer's pieces of ``text`` alone (lower-cased or canonicalized as the preprocessor does), no
        start, end or padding."""
        ids = self.token_ids([text])[0].tolist()
        packing = self.packing()
        if packing["start"] is not None:
            ids = ids[1:]
        return ids[:ids.index(packing["end"])]

    def embed_images(self, images) -> np.ndarray:
        """``[N, D]`` L2-normalised image embeddings of ``images`` (``[N, H, W, 3]`` pixels in 0–255, any size)."""
        return self.embed_converted(self.converter(np.asarray(images, np.float32)))

    def embed_converted(self, pixels) -> np.ndarray:
        """:meth:`embed_images` of images the preset's converter has read already."""
        return normalised(np.asarray(self.backbone.get_vision_embeddings(pixels)))

    def split_embeddings(self, cfg, split: str, image_ids, dataset, shards, batch_size: int = 64) -> np.ndarray:
        """The embeddings of the images ``image_ids`` of the prepared ``split`` (``[N, D]`` in their order), read
        from the records a batch at a time: each image decoded and read by the preset's converter (its size, a
        central crop to its aspect, its normalisation)."""
        import tensorflow as tf

        from captioning.data.reading import decoded, parsed_images

        wanted = {int(i): n for n, i in enumerate(image_ids)}
        convert = self.converter

        @tf.autograph.experimental.do_not_convert
        def read(ex):
            return ex["image_id"], convert(tf.cast(decoded(ex["encoded"]), tf.float32)[None])[0]

        ds = parsed_images(cfg, split, training=False, dataset=dataset, shards=shards).map(
            read, num_parallel_calls=tf.data.AUTOTUNE).batch(batch_size).prefetch(tf.data.AUTOTUNE)
        out = [None] * len(wanted)
        for ids, pixels in ds:
            for i, row in zip(ids.numpy(), self.embed_converted(pixels)):
                if int(i) in wanted:
                    out[wanted[int(i)]] = row
        missing = [i for i, n in wanted.items() if out[n] is None]
        if missing:
            raise InputError(f"the {split!r} split has no image {missing[0]} to score with the CLIP preset")
        return np.stack(out) if out else np.zeros([0, 0])
