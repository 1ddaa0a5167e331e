"""Reference-free caption metrics from a contrastive image-text model (a keras-hub CLIP or SigLIP preset):
CLIPScore and RefCLIPScore (Hessel et al. 2021), PAC-S and RefPAC-S (Sarto et al. 2023), and text-to-image
retrieval as a measure of how well a caption tells its image from the others.

**The embeddings** (:class:`ContrastiveModel`): each tower's output L2-normalised, as Hessel et al.'s code does
before every cosine.

- Text is packed as the preset's preprocessor packs it (its ``preprocessor.json``; without one, keras-hub's
  defaults for the family): CLIP lower-cased, ``<|startoftext|>`` pieces ``<|endoftext|>`` padded to 77; SigLIP
  canonicalized (lower case, no punctuation), pieces and its end token padded to 64. Longer captions are cut, the
  end token kept (Hessel et al. truncate too).
- CLIP's text embedding is its encoder's output **at the end-of-text token**, projected. keras-hub's
  ``CLIPBackbone.get_text_embeddings`` pools at the largest id instead, which is the end-of-text token only when
  that token has the largest id (OpenAI's vocabulary); a preset whose tokenizer puts it elsewhere would be pooled at
  another word. Here the position is the first end-of-text token after the pieces, whatever its id. SigLIP reads
  the last position of its fixed-length packing, as keras-hub's backbone does.
- Images go through the preset's own image converter (its size, resampling and normalisation).

**The metrics** (per image, then their mean, as Hessel et al. report), with ``c`` the caption's embedding after
the prefix ``"A photo depicts "`` (their code prefixes candidates and references alike), ``v`` the image's and
``r_j`` the references':

- ``clip_score`` = w · max(cos(v, c), 0), w = 2.5 (:data:`WEIGHTS`);
- ``ref_clip_score`` = the harmonic mean of ``clip_score`` and max_j cos(c, r_j), the latter not clipped (their
  code); 0 where both are 0 (their code would divide by zero);
- ``pac_score`` / ``ref_pac_score``: the same with w = 2.0, for a preset holding PAC-S's fine-tuned CLIP
  (``--clip-metric pac``: only the weights differ, so the preset's content decides what the number means);
- ``recall@K`` (text to image): the share of captions whose own image is among the K images of the split closest to
  them; ties count against the caption (its image must beat every other image strictly to rank first). The
  references' recall, each reference a query, gives the scale.
"""

from __future__ import annotations

import hashlib
import logging
import os

import numpy as np

from captioning.errors import InputError
from captioning.model.encoders.keras_hub import check_preset_folder, load_backbone

PREFIX = "A photo depicts "
WEIGHTS = {"clip": 2.5, "pac": 2.0}  # Hessel et al.'s w; Sarto et al.'s for PAC-S
FAMILIES = ("CLIPBackbone", "SigLIPBackbone")
MAX_TEXTS = 4096  # texts embedded per call (a split's references are embedded in such chunks)
log = logging.getLogger("captioning.evaluation.clip_score")


def normalised(x) -> np.ndarray:
    x = np.asarray(x, np.float64)
    norm = np.linalg.norm(x, axis=-1, keepdims=True)
    return x / np.where(norm > 0, norm, 1.0)


class ContrastiveModel:
    """A keras-hub CLIP or SigLIP preset's two towers (see the module docstring). ``key``: the option that named
    the preset, for the one-line errors."""

    def __init__(self, preset: str, key: str = "--clip-preset"):
        import keras_hub

        if not preset:
            raise InputError(f"{key}: give a keras-hub CLIP or SigLIP preset (a folder or a preset name)")
        check_preset_folder(preset, key.lstrip("-").replace("-", "_"))
        self.preset = preset
        self.backbone = load_backbone(preset, key.lstrip("-").replace("-", "_"))
        self.family = type(self.backbone).__name__
        if self.family not in FAMILIES:
            raise InputError(f"{key}: {preset} holds a {self.family}; a CLIP or SigLIP preset is needed "
                             f"({', '.join(FAMILIES)})")
        m = keras_hub.models
        cls = m.CLIPPreprocessor if self.family == "CLIPBackbone" else m.SigLIPPreprocessor
        tokenizer = keras_hub.models.Tokenizer.from_preset(preset)
        try:
            self.preprocessor = cls.from_preset(preset)
        except (ValueError, FileNotFoundError, OSError):  # no preprocessor.json: the family's defaults
            self.preprocessor = cls(tokenizer=tokenizer)
        self.preprocessor.build(None)
        self.converter = keras_hub.layers.ImageConverter.from_preset(preset)

    # ---- the towers ---------------------------------------------------------------------------------
    def token_ids(self, texts: list[str]) -> np.ndarray:
        """``texts`` packed as the preset's preprocessor packs them: ``[N, sequence length]`` int32."""
        import tensorflow as tf

        p = self.preprocessor
        prompts = tf.constant(list(texts), tf.string)
        if getattr(p, "to_lower", False):
            prompts = tf.strings.lower(prompts)
        if getattr(p, "canonicalize_text", False):
            prompts = p.canonicalize_inputs(prompts)
        ids, _ = p.packer(p.tokenizer(prompts), add_start_value=p.add_start_token, add_end_value=p.add_end_token)
        return np.asarray(ids, np.int32)

    def embed_texts(self, texts: list[str]) -> np.ndarray:
        """``[N, D]`` L2-normalised text embeddings (CLIP's pooled at the end-of-text token)."""
        out = [self._texts(list(texts[i:i + MAX_TEXTS])) for i in range(0, len(texts), MAX_TEXTS)]
        return normalised(np.concatenate(out)) if out else np.zeros([0, 0])

    def _texts(self, texts: list[str]) -> np.ndarray:
        ids = self.token_ids(texts)
        b = self.backbone
        if self.family == "SigLIPBackbone":
            return np.asarray(b.get_text_embeddings(ids))
        end = int(self.preprocessor.tokenizer.end_token_id)
        at = np.argmax(ids == end, axis=1)  # the first end-of-text token (the packing always ends with one)
        hidden = np.asarray(b.text_encoder({"token_ids": ids}))
        return np.asarray(b.text_projection(hidden[np.arange(len(ids)), at]))

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


# ---- the metrics, from normalised embeddings (numpy: the tests recompute them independently) ----------
def clip_scores(images: np.ndarray, captions: np.ndarray, weight: float = WEIGHTS["clip"]) -> np.ndarray:
    """w · max(cos, 0) of each row's image and caption embeddings."""
    return weight * np.maximum(np.sum(images * captions, axis=-1), 0.0)


def ref_clip_scores(clip: np.ndarray, captions: np.ndarray, references: list[np.ndarray]) -> np.ndarray:
    """The harmonic mean of each caption's ``clip`` score and its largest cosine with its references' embeddings
    (``references[i]``: ``[R_i, D]``, not clipped); 0 where both are 0."""
    best = np.array([float(np.max(r @ c)) if len(r) else 0.0 for c, r in zip(captions, references)])
    total = clip + best
    return np.where(total != 0, 2 * clip * best / np.where(total != 0, total, 1.0), 0.0)


def recall_at(queries: np.ndarray, owners: np.ndarray, images: np.ndarray, ks=(1, 5)) -> dict[str, float]:
    """Text-to-image recall@K: the share of ``queries`` (embeddings) whose own image (``owners[i]``, a row of
    ``images``) is among the K closest images; an image as close as its own counts as closer (ties against)."""
    if not len(queries):
        return {f"recall@{k}": 0.0 for k in ks}
    sims = queries @ images.T
    own = sims[np.arange(len(queries)), owners]
    rank = np.sum(sims >= own[:, None], axis=1)  # 1: only its own image is that close
    return {f"recall@{k}": float(np.mean(rank <= k)) for k in ks}


def scores(model: ContrastiveModel, images, captions: list[str], references: list[list[str]],
           metric: str = "clip") -> dict:
    """Every measure of the module docstring for one caption per image (``images[i]``: pixels, or their
    embeddings from :meth:`ContrastiveModel.split_embeddings`; ``captions[i]``, ``references[i]``):
    ``{"per_image": {"clip_score": [...], ...}, "clip_score": mean, ..., "recall@1", ..., "references_recall@1",
    ...}`` (``pac_*`` names under ``metric`` pac)."""
    if metric not in WEIGHTS:
        raise InputError(f"--clip-metric must be one of {', '.join(WEIGHTS)}, got {metric!r}")
    name = "clip_score" if metric == "clip" else "pac_score"
    images = np.asarray(images)
    v = images if images.ndim == 2 else model.embed_images(images)
    c = model.embed_texts([PREFIX + caption for caption in captions])
    flat = [PREFIX + r for refs in references for r in refs]
    r = model.embed_texts(flat)
    starts = np.cumsum([0] + [len(refs) for refs in references])
    per_ref = [r[starts[i]:starts[i + 1]] for i in range(len(references))]
    clip = clip_scores(v, c, WEIGHTS[metric])
    ref = ref_clip_scores(clip, c, per_ref)
    owners = np.repeat(np.arange(len(references)), [len(refs) for refs in references])
    out = {name: float(np.mean(clip)) if len(clip) else 0.0, "ref_" + name: float(np.mean(ref)) if len(ref) else 0.0,
           **recall_at(c, np.arange(len(c)), v),
           **{"references_" + k: value for k, value in recall_at(r, owners, v).items()}}
    out["per_image"] = {name: clip.tolist(), "ref_" + name: ref.tolist()}
    return out


def measure_split(model: ContrastiveModel, cfg, split: str, dataset, candidates: dict, references: dict,
                  metric: str) -> tuple[dict, dict]:
    """:func:`scores` of an evaluation's best captions (image id → caption; ``references``: image id → texts) with
    the images of the prepared ``split`` (``cfg``: its data section): the result's ``"clip"`` (the preset, the
    metric, the means and recalls) and each image's scores (image id → {name: value})."""
    from captioning.data.integrity import ShardReader

    ids = sorted(candidates)
    log.info("scoring %d captions with the %s preset %s", len(ids), model.family, model.preset)
    with ShardReader(cfg.skip_corrupt) as shards, shards.named_errors():
        images = model.split_embeddings(cfg, split, ids, dataset, shards)
    found = scores(model, images, [candidates[i] for i in ids], [references[i] for i in ids], metric)
    per = found.pop("per_image")
    preset = os.path.abspath(model.preset) if os.path.isdir(model.preset) else model.preset
    return ({"preset": preset, "metric": metric, **found},
            {image_id: {key: values[n] for key, values in per.items()} for n, image_id in enumerate(ids)})


def identity(preset: str) -> str:
    """A short hash of what the preset holds (a folder: its config and weights files' bytes; a name: the name), so
    that results of two presets are kept apart."""
    digest = hashlib.sha256(preset.encode() if not os.path.isdir(preset) else b"")
    for name in ("config.json", "model.weights.h5") if os.path.isdir(preset) else ():
        path = os.path.join(preset, name)
        if os.path.isfile(path):
            with open(path, "rb") as f:
                for block in iter(lambda: f.read(1 << 20), b""):
                    digest.update(block)
    return digest.hexdigest()[:8]


def describe(result) -> str:
    """The summary line of a result's reference-free measures ("" when it has none)."""
    found = result.get("clip")
    if not found:
        return ""
    name = "clip_score" if found["metric"] == "clip" else "pac_score"
    label = "CLIP-S" if name == "clip_score" else "PAC-S"
    return (f"reference-free ({found['preset']}): {label} {found[name]:.4f}, Ref{label} {found['ref_' + name]:.4f}; "
            f"text-to-image recall@1 {found['recall@1']:.3f}, @5 {found['recall@5']:.3f} (the references': "
            f"{found['references_recall@1']:.3f}, {found['references_recall@5']:.3f})")
