"""Reference-free caption metrics from a contrastive image-text model (a keras-hub CLIP or SigLIP preset):
CLIPScore and RefCLIPScore (Hessel et al. 2021), PAC-S and RefPAC-S (Sarto et al. 2023), and text-to-image
retrieval as a measure of how well a caption tells its image from the others.

**The embeddings** (:class:`captioning.model.contrastive.ContrastiveModel`): each tower's output L2-normalised, as
Hessel et al.'s code does before every cosine.

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
from captioning.model.contrastive import ContrastiveModel, recall_at  # recall_at: also clip train's

PREFIX = "A photo depicts "
WEIGHTS = {"clip": 2.5, "pac": 2.0}  # Hessel et al.'s w; Sarto et al.'s for PAC-S
log = logging.getLogger("captioning.evaluation.clip_score")


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
