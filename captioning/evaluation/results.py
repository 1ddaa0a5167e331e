"""One evaluation's key and its document: the file name an evaluation is kept under (the split, the
checkpoint, the decoding that ran, the images, the dataset), and :class:`EvaluationResult`, the metrics file's
document with typed access. :mod:`captioning.evaluation.evaluate` writes and reads them; the layout of the
files is in its docstring."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os

from captioning.evaluation.hallucination import holds
from captioning.model.word_rules import DEAD

def result_name(split: str, step: int, beam_size: int, max_length: int, length_normalization: float,
                num_images: int | None, data: str = "", checkpoint: str = "", options: str = "") -> str:
    """The key of one evaluation, as a file name stem: the split, the checkpoint's step, the decoding, the
    images, the dataset (``data``: its identity's first 8 characters) and, for a checkpoint of another
    model folder, a hash of its path (``checkpoint``); ``options``: :func:`options_label` of the other
    decoding settings.

    >>> result_name("test", 8000, 3, 20, 0.0, None, "1a2b3c4d"), result_name("val", 10, 1, 16, 0.7, 5)
    ('test-step8000-beam3-len20-norm0-all-data1a2b3c4d', 'val-step10-beam1-len16-norm0.7-first5')
    >>> result_name("val", 10, None, 16, 0.0, 5)  # sampling: no beam
    'val-step10-sample-len16-norm0-first5'
    """
    images = "all" if num_images is None else f"first{num_images}"
    extra = (f"-data{data}" if data else "") + (f"-from{checkpoint}" if checkpoint else "")
    label = settings_label(beam_size, max_length, length_normalization) + options
    return f"{split}-step{step}-{label}-{images}{extra}"


def settings_label(beam_size: int | None, max_length: int, length_normalization: float) -> str:
    """``beam<B>-len<L>-norm<A>``; ``sample-…`` without a beam (``beam_size`` None: sampling)."""
    beam = "sample" if beam_size is None else f"beam{beam_size}"
    return f"{beam}-len{max_length}-norm{length_normalization:g}"


def used_decoding(decode):
    """``decode`` (a checked :class:`captioning.config.sections.DecodeConfig`) as it runs, and the beam size that runs
    (None: sampling, no beam search). Greedy decoding is a beam of 1 whatever ``beam_size`` says, so its
    result is keyed and recorded as beam 1.

    >>> from captioning.config.sections import DecodeConfig
    >>> used_decoding(DecodeConfig(beam_size=7, method="greedy"))[1], used_decoding(DecodeConfig(beam_size=7))[1]
    (1, 7)
    >>> used_decoding(DecodeConfig(beam_size=7, method="sample", top_k=2))[1] is None
    True
    """
    if decode.method == "greedy":
        decode = dataclasses.replace(decode, beam_size=1)
    return decode, (None if decode.method == "sample" else decode.beam_size)


def real_captions(texts, log_probs) -> list[list[str]]:
    """Each image's real captions, best first: ``texts`` (:func:`captioning.model.decode.ids_to_text` of a
    batch) without the placeholders beam search returns when it found fewer complete captions than
    ``top_k`` (an empty caption whose log-probability is :data:`captioning.model.word_rules.DEAD`, -1e9;
    ``log_probs [B, top_k]``).

    >>> real_captions([["a red circle", "", ""]], [[-3.5, -1e9, -1e9]])
    [['a red circle']]
    """
    log_probs = getattr(log_probs, "numpy", lambda: log_probs)()
    return [[text for text, log_p in zip(image_texts, image_log_probs) if log_p > DEAD / 2]
            for image_texts, image_log_probs in zip(texts, log_probs)]


def options_label(decode) -> str:
    """``""`` when the decoding settings beyond beam, length and normalisation are the defaults (plain beam
    search, one caption per image), else ``-`` and the method and a hash of them (and of ``top_k``: several
    captions per image add their diversity to the result): another decoding is another evaluation.

    >>> from captioning.config.sections import DecodeConfig
    >>> options_label(DecodeConfig()), options_label(DecodeConfig(method="sample", top_k=5))[:8]
    ('', '-sample-')
    """
    plain = {"beam_size", "max_length", "length_normalization", "top_k"}
    defaults = {k: v for k, v in dataclasses.asdict(type(decode)()).items() if k not in plain}
    mine = {k: v for k, v in dataclasses.asdict(decode).items() if k not in plain}
    if mine == defaults and decode.method == "beam" and decode.top_k == 1:
        return ""
    digest = hashlib.sha256(json.dumps({**mine, "top_k": decode.top_k}, sort_keys=True).encode()).hexdigest()[:8]
    return f"-{decode.method}-{digest}"


def _key(name: str) -> property:
    return property(lambda self: self.get(name), doc=f"the document's {name!r}")


class EvaluationResult(dict):
    """One evaluation: the metrics file's document itself (this dict; the module docstring lists its
    keys; ``json.dumps`` of it is the file), with typed attribute access on top (``result.metrics``,
    ``result.perplexity``; ``baseline`` and ``baseline_caption`` are None without ``baseline=True``)."""

    metrics: dict[str, float] = _key("metrics")
    split: str = _key("split")
    checkpoint_step: int = _key("checkpoint_step")
    num_images: int = _key("num_images")
    all_images: bool = _key("all_images")
    beam_size: int | None = _key("beam_size")  # the beam that ran: 1 for greedy, None for sampling
    max_length: int = _key("max_length")
    length_normalization: float = _key("length_normalization")
    loss: float = _key("loss")
    perplexity: float = _key("perplexity")
    baseline: dict[str, float] | None = _key("baseline")
    baseline_caption: str | None = _key("baseline_caption")
    grounding: dict | None = _key("grounding")
    dataset: str = _key("dataset")  # the prepared dataset's identity
    data_dir: str = _key("data_dir")
    checkpoint: str = _key("checkpoint")  # the checkpoint's path
    decode: dict | None = _key("decode")  # every decoding setting (results of before it: None)
    diversity: dict | None = _key("diversity")  # captioning.evaluation.diversity
    members: list[str] | None = _key("members")  # an ensemble: its models' checkpoints (one model: None)
    bad_ending_rate: float | None = _key("bad_ending_rate")  # captioning.evaluation.endings
    # with an instances file (captioning.evaluation.hallucination); for COCO's, chair.py's reading, as published
    chair_i: float | None = _key("chair_i")
    chair_s: float | None = _key("chair_s")
    object_recall: float | None = _key("object_recall")
    hallucination: dict | None = _key("hallucination")  # CHAIR's counts ("rules": "published" for COCO's)
    chair_i_corrected: float | None = _key("chair_i_corrected")  # COCO's file: the corrected reading
    chair_s_corrected: float | None = _key("chair_s_corrected")
    object_recall_corrected: float | None = _key("object_recall_corrected")
    hallucination_corrected: dict | None = _key("hallucination_corrected")


def short_hash(path: str) -> str:
    """Eight hex digits of ``path``'s real path: a checkpoint of another folder in a result's key."""
    return hashlib.sha256(os.path.realpath(path).encode()).hexdigest()[:8]


def ensemble_label(checkpoints: list[str]) -> str:
    """``""`` for one model; for an ensemble ``-ensemble<M>-`` and a hash of its checkpoints (in any order: the
    average does not depend on it).

    >>> ensemble_label(["/m/a/ckpt-5"]), ensemble_label(["/m/a/ckpt-5", "/m/b/ckpt-9"])[:10]
    ('', '-ensemble2')
    """
    if len(checkpoints) == 1:
        return ""
    digest = hashlib.sha256("\n".join(sorted(checkpoints)).encode()).hexdigest()[:8]
    return f"-ensemble{len(checkpoints)}-{digest}"


def stored_result(path: str, baseline: bool, spice: bool, grounded: bool, instances: str | None, dataset: str,
            checkpoints: list[str]) -> dict | None:
    """The result already stored under this key, if it is of the same dataset and checkpoint (the key says
    so; the document is checked too) and holds everything asked for (CHAIR: of the same ``instances`` file)."""
    try:
        with open(path, encoding="utf-8") as f:
            stored = json.load(f)
    except (OSError, ValueError):
        return None
    members = checkpoints if len(checkpoints) > 1 else None  # (one model's result has no "members")
    if not isinstance(stored, dict) or stored.get("dataset") != dataset or stored.get("checkpoint") != checkpoints[0] \
            or stored.get("members") != members:
        return None
    if (baseline and "baseline" not in stored) or (spice and "SPICE" not in stored.get("metrics", {})) or \
            (grounded and "relations" not in stored.get("grounding", {})) or \
            (instances and not holds(stored, instances)) or \
            "distinct_2_per_bigram" not in stored.get("diversity", {}) or "bad_ending_rate" not in stored:
        # (results of before relations, diversity, CHAIR (COCO's: both readings, named) or bad endings were measured,
        # or of distinct_2 per bigram)
        return None
    return stored
