"""``captioning evaluate``: perplexity and the COCO caption metrics of a trained model on a split.

Every image of the split (or the first ``max_images``) is captioned by beam search, in batches, and
scored against all its reference captions (the raw captions stored in the records) with
:func:`captioning.evaluation.metrics.coco_metrics`. Perplexity is the exponential of the mean cross-entropy per
real word over every caption of the split (or of those images).

**One result per evaluation.** A result belongs to a split, a checkpoint, decoding settings and the images
scored, and is kept under that key in the model folder, each file written under a temporary name and
renamed::

    eval/<split>-step<N>-beam<B>-len<L>-norm<A>-<all|firstK>-data<D>[-from<C>].json   the metrics (below)
    eval/<same key>.predictions.json                                                   COCO results format

``<D>`` is the start of the prepared dataset's identity (its fingerprint): evaluating another dataset's
split of the same name is another evaluation, never the stored one. ``-from<C>`` marks a checkpoint of
another model folder (``--checkpoint OTHER/ckpt-N``, accepted only when that folder's config and
vocabulary match this one's). The metrics file holds ``{"metrics": {Bleu_1 … CIDEr}, "split",
"checkpoint_step", "num_images", "all_images", "beam_size", "max_length", "length_normalization",
"loss", "perplexity", "dataset", "data_dir", "checkpoint", "decode", "diversity", "bad_ending_rate",
"bad_endings"}`` (plus ``"baseline"`` with
``--baseline``; ``"chair_i"``, ``"chair_s"``, ``"object_recall"``, ``"hallucination"`` and for the shapes
``"grounding"`` with ``--instances``: below); decoding settings beyond beam, length and normalisation
(``--set decode.KEY=VALUE``) add ``-<method>-<hash>`` to the key. The key and the document hold the decoding that ran
(:func:`captioning.evaluation.results.used_decoding`): greedy decoding is a beam of 1 whatever ``--beam-size`` says (``beam1``,
``"beam_size": 1``), and sampling runs no beam search (``sample`` in place of ``beam<B>``, ``"beam_size"``
null, in ``"decode"`` too). The predictions file holds, beside each image's best caption (``"caption"``),
all its real captions best first (``"captions"``: several with ``decode.top_k`` > 1), so the diversity among
them can be recomputed from it;
a stored result is reused only when its ``dataset`` and ``checkpoint`` are those of this evaluation. Evaluating with other settings or on fewer images never replaces a
full-split result; evaluating the same key again is a no-op that prints the stored result. TensorBoard
gets each result once, under ``logs/eval_<split>`` at the checkpoint's step, its scalars tagged with the
settings (``beam3-len20-norm0/CIDEr``; ``…-first5/CIDEr`` for a partial result), so points of different
settings never pile up on one curve: the COCO metrics, ``perplexity``, ``bad_ending_rate`` and, with
``--instances``, ``chair_i``, ``chair_s`` and ``object_recall``.

**Which weights.** ``--weights ema`` evaluates the checkpoint's weight average (``train.ema_decay``;
:mod:`captioning.train.ema`), ``--weights raw`` its weights as trained; by default the average when the
checkpoint holds one. The average's result is another evaluation: its key gets ``-ema`` after the decoding
(``test-step6000-beam3-len20-norm0-ema-all-…``; the raw weights' key is the one a model without an average has),
its TensorBoard tag too, and the document says ``"weights": "ema"`` or ``"raw"`` (an ensemble: one per model,
each model's default unless ``--weights`` is given, the hash of its key covering which).

**Ensembles.** Several model folders (``--model-dir A --model-dir B``; :mod:`captioning.model.ensemble`) are
evaluated as one model: each step averages their word probabilities, and the perplexity is the averaged
distribution's. They must share a vocabulary and read the same input (the same image sizes, or the same
features store: :meth:`captioning.config.sections.DataConfig.evaluation_input`). The result is kept in the first
folder, its key marked ``-ensemble<M>-<hash of the checkpoints>`` and its document holding ``"members"``
(each model's checkpoint); ``checkpoint_step`` and the default decoding are the first model's.

The dataset must have been prepared with the model's vocabulary (as ``train`` requires); ``--data-dir``
points at the records when the config's ``data.dir`` is not where they are on this machine.

Every result also holds ``"diversity"`` (:mod:`captioning.evaluation.diversity`): distinct-1 and -2,
vocabulary usage and the share of novel captions over the best captions, and with ``decode.top_k`` > 1
mBLEU-4 and distinct-n among each image's captions; and ``"bad_ending_rate"``, the share of the best
captions whose last word is in ``decode.bad_endings``' English list, with ``"bad_endings"`` (each such word:
the captions it ended; :mod:`captioning.evaluation.endings`).

``--baseline`` also scores a constant caption, the most frequent (normalised) caption of the training
split, given for every image: the floor any model must clear.

``--instances FILE`` (an instances file of the split: the shapes' ``instances_test.json`` or COCO's own
``instances_val2014.json``, told apart by their content; it must list every image of the split, checked
before any decoding) adds object hallucination (:mod:`captioning.evaluation.hallucination`): ``"chair_i"``
(CHAIRi), ``"chair_s"`` (CHAIRs) and ``"object_recall"``, with their counts under ``"hallucination"`` (for
COCO's file chair.py's reading, as published, and the corrected one's as ``"chair_i_corrected"`` … under
``"hallucination_corrected"``: :data:`captioning.evaluation.hallucination.RULES`);
and for the shapes' file ``"grounding"``: the share of the images' shapes whose colour and kind the
captions name, by number of shapes, the share of the relations they name between two shapes that hold
(:mod:`captioning.evaluation.relations`), and for an attention decoder how much of each colour or kind
word's attention fell inside the box of the shape it names, against the box's share of the image
(:mod:`captioning.evaluation.grounding`).
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import json
import logging
import os

import tensorflow as tf
from tqdm import tqdm

from captioning import inference
from captioning.model.base import IMAGE_INPUTS
from captioning.evaluation import grounding, hallucination, metrics, relations
from captioning.evaluation.endings import bad_endings
from captioning.evaluation.diversity import diversity
from captioning.evaluation.results import (EvaluationResult, options_label, real_captions, result_name,
                                           settings_label, used_decoding)
from captioning.data.prepared import PreparedDataset
from captioning.errors import InputError
from captioning.fileio import atomic_write_json, check_output_file, disk_full_error
from captioning.data.pipeline import make_dataset
from captioning.data.reading import eval_images, references
from captioning.data.region_input import eval_regions, store_of
from captioning.data.integrity import ShardReader
from captioning.model.decode import empty_captions_warning, ids_to_text
from captioning.model.ensemble import check_same_input, model_dirs
from captioning.model.folder import ModelDir
from captioning.text import tokenize_caption
from captioning.train import evaluation_loss

log = logging.getLogger("captioning.evaluation.evaluate")

# the keys every result holds: how ``--output`` tells an earlier result, which it may replace, from a JSON file of
# others (a dataset's manifest, a preset's config.json), which it refuses (fileio.check_output_file)
RESULT_KEYS = ("metrics", "split", "checkpoint_step")


def most_frequent_caption(texts) -> str:
    """The most common caption after normalisation (ties: alphabetical), e.g. for a constant baseline."""
    counts = collections.Counter(" ".join(tokenize_caption(t)) for t in texts)
    counts.pop("", None)
    return min(counts, key=lambda c: (-counts[c], c))


def _prepared_dataset(trained, model_folder: ModelDir, data_dir: str | None) -> PreparedDataset:
    """The records to evaluate on, checked: prepared, and with the model's vocabulary."""
    folder = data_dir or trained.config.data.dir
    where = "data_dir" if data_dir else f"data.dir in {model_folder.config_file}"
    if not os.path.isfile(PreparedDataset.manifest_path(folder)):
        raise InputError(f"{folder} ({where}) is not a prepared dataset on this machine; pass `data_dir` with "
                         "the folder `captioning prepare` wrote", params=("data_dir",))
    dataset = PreparedDataset.load(folder)
    if dataset.vocabulary() != trained.vocab:
        raise InputError(f"{folder} was prepared with another vocabulary than the model in {trained.model_dir}: "
                         f"prepare it with `captioning prepare --vocab {model_folder.vocab_file}`")
    return dataset


def evaluate(model_dir: str | list[str], split: str = "test", beam_size: int | None = None, max_images: int | None = None,
             max_length: int | None = None, length_normalization: float | None = None, batch_size: int = 32,
             data_dir: str | None = None, spice: bool = False, baseline: bool = False,
             output: str | None = None, progress: bool = True, checkpoint: str | None = None,
             instances: str | None = None, decode_overrides: tuple[str, ...] = (),
             weights: str | None = None) -> EvaluationResult:
    """Evaluates ``checkpoint`` (default: the latest complete one) of ``model_dir`` on ``split`` (see the
    module docstring). ``beam_size``, ``max_length``, ``length_normalization``: None takes the model's
    ``decode:`` config, as do ``decode_overrides`` (``decode.KEY=VALUE``). ``instances``: an instances file
    of the split (the shapes' or COCO's), for CHAIR and, on the shapes, grounding. Several folders in
    ``model_dir`` (a list): their ensemble, kept in the first's folder (see the module docstring). ``weights``:
    ``"ema"`` (the weight average), ``"raw"``, or None (the average when the checkpoint holds one)."""
    metrics.check_java()  # fail before an hour of decoding, not after
    dirs = model_dirs(model_dir)
    folder = ModelDir(dirs[0])
    if output is not None:  # never over what it reads (models' files, presets, data, instances) nor others' JSON
        for path in dirs + ([os.path.dirname(checkpoint) or "."] if checkpoint else []):
            ModelDir(path).refuse_output(output, "`output`", params=("output",), data=True, data_dir=data_dir)
        check_output_file(output, "`output`", params=("output",), inputs=(instances,) if instances else (),
                          kind="json", keys=RESULT_KEYS)
    objects = hallucination.load_objects(instances) if instances else None  # the synthetic shapes' or COCO's
    shapes = hallucination.shapes_of(objects)  # what grounding reads (None for COCO's)
    trained = inference.load(dirs, checkpoint, weights)  # weights: "ema", "raw", None (the average when there is one)
    members = trained.members
    check_same_input(members)
    decode = trained.config.decode.override(beam_size=beam_size, max_length=max_length,
                                            length_normalization=length_normalization).with_overrides(decode_overrides)
    decode, beam_size = used_decoding(decode)  # what runs: greedy is beam 1, sampling has no beam
    max_length, length_normalization = decode.max_length, decode.length_normalization
    # one pass over the split: nothing to cache; --data-dir points at the records if they moved
    dataset = _prepared_dataset(trained, folder, data_dir)
    cfg = dataclasses.replace(trained.config.data, cache="none", dir=dataset.path)
    split_images = dataset.split(split).images
    partial = max_images if max_images and max_images < split_images else None
    # the key: the same data, checkpoint and settings, or a new evaluation
    foreign = not folder.owns_checkpoint(trained.checkpoint)
    checkpoints = [os.path.realpath(m.checkpoint) for m in members]
    ensemble = _ensemble_label([c + ("#ema" if m.weights == "ema" else "") for c, m in zip(checkpoints, members)])
    averaged = "-ema" if any(m.weights == "ema" for m in members) else ""  # the weight average: another result
    name = result_name(split, trained.step, beam_size, max_length, length_normalization, partial,
                       dataset.identity[:8], _short_hash(trained.checkpoint) if foreign else "",
                       options_label(decode) + averaged + ensemble)
    stored = _stored(folder.file(os.path.join("eval", name + ".json")), baseline, spice, shapes is not None,
                     os.path.abspath(instances) if instances else None, dataset.identity, checkpoints)
    if stored is not None:
        log.info("%s is evaluated already (checkpoint step %d, these settings): the stored result, unchanged",
                 split, trained.step)
        if output:
            atomic_write_json(output, stored)
        return EvaluationResult(stored)
    path = folder.file(os.path.join("eval", name + ".json"))
    check_output_file(path, "the evaluation result")  # a read-only model folder: before an hour of decoding
    metrics.start_meteor()  # its JVM loads its tables (~4 s) while the split is captioned
    # the best caption of each image is scored; the others (decode.top_k > 1: beams or samples, best first) count
    # in the diversity among each image's captions
    captioner = inference.Captioner(trained, decode)
    # a damaged shard: one line naming it (InputError), not a DataLossError traceback
    with ShardReader(cfg.skip_corrupt) as shards, shards.named_errors():
        refs = references(cfg, split, dataset=dataset, shards=shards)  # parsed, not decoded: seconds
        if objects is not None:  # the instances file is checked before the hour of decoding, not after
            grounding.check_covers(objects, refs, split, instances)
        candidates, loss, attention, boxes, every = _read_and_caption(
            captioner, cfg, dataset, shards, split, max_images, batch_size, partial or split_images, progress)
        refs = {image_id: refs[image_id] for image_id in candidates}
    log.info("scoring %d captions with pycocoevalcap (PTB tokenizer, BLEU, METEOR, ROUGE-L, CIDEr)",
             len(candidates))
    scores = metrics.coco_metrics(refs, candidates, spice=spice)
    result = EvaluationResult(
        metrics=scores, split=split, checkpoint_step=trained.step, num_images=len(candidates),
        all_images=partial is None, beam_size=beam_size, max_length=max_length,
        length_normalization=length_normalization, loss=loss.loss, perplexity=loss.perplexity,
        dataset=dataset.identity, data_dir=os.path.abspath(dataset.path),
        checkpoint=os.path.realpath(trained.checkpoint),
        decode={**dataclasses.asdict(decode), "beam_size": beam_size})  # sampling: no beam
    result["weights"] = [m.weights for m in members] if len(members) > 1 else members[0].weights  # "ema", "raw"
    if len(members) > 1:
        result["members"] = checkpoints
    with ShardReader(cfg.skip_corrupt) as shards, shards.named_errors():
        train_refs = references(cfg, trained.config.data.train_split, dataset=dataset, shards=shards)
    train_texts = [t for texts in train_refs.values() for t in texts]
    result["diversity"] = diversity(every, len(trained.vocab), train_texts)
    result.update(bad_endings(candidates.values()))
    if objects is not None:
        result.update(hallucination.results(objects, candidates, refs, os.path.abspath(instances)))
    if baseline:
        constant = most_frequent_caption(train_texts)
        log.info("baseline: the most frequent training caption for every image: %r", constant)
        result["baseline"] = metrics.coco_metrics(refs, {i: constant for i in candidates})
        result["baseline_caption"] = constant
    if shapes is not None:
        result["grounding"] = {"instances": os.path.abspath(instances),
                               "naming": grounding.naming_accuracy(shapes, candidates).to_json(),
                               "relations": relations.relation_accuracy(shapes, candidates).to_json()}
        layout = captioner.token_layout
        if attention and (boxes is not None or layout is not None):
            located = grounding.attention_localisation(
                shapes, attention, None if layout is None else (layout.rows, layout.cols), cfg.resize_size,
                cfg.image_size, regions=boxes, prefix=0 if layout is None else layout.prefix)
            result["grounding"]["attention"] = located.to_json()
        elif attention:
            log.info("attention on the named shapes: not measured, model.encoder %s declares no layout of its tokens",
                     trained.config.model.encoder)

    try:
        atomic_write_json(folder.file(os.path.join("eval", name + ".predictions.json")),
                          [{"image_id": i, "caption": c, "captions": every[i]}  # the k captions: mBLEU-4 again
                           for i, c in sorted(candidates.items())])
        atomic_write_json(path, result)  # last: a metrics file means the evaluation is complete
        if output:
            atomic_write_json(output, result)
        with tf.summary.create_file_writer(folder.file(os.path.join("logs", f"eval_{split}"))).as_default(
                step=trained.step):
            tag = (settings_label(beam_size, max_length, length_normalization) + options_label(decode) + averaged
                   + ensemble + (f"-first{partial}" if partial else ""))
            for metric, value in scores.items():
                tf.summary.scalar(f"{tag}/{metric}", value)
            tf.summary.scalar(f"{tag}/perplexity", result.perplexity)
            for key in ("bad_ending_rate",) + hallucination.SCALARS:
                if result.get(key) is not None:
                    tf.summary.scalar(f"{tag}/{key}", result[key])
    except (OSError, tf.errors.OpError) as e:
        full = disk_full_error(e, os.path.dirname(path), "the evaluation results")
        if full is None and not isinstance(e, OSError):
            raise
        raise full or InputError(f"cannot write the evaluation results to {os.path.dirname(path)}: "
                                 f"{e.strerror or e}") from None
    log.info("wrote %s", path)
    return result



def _read_and_caption(captioner, cfg, dataset, shards, split: str, max_images: int | None, batch_size: int,
                      total: int, progress: bool) -> tuple[dict[int, str], object, dict, dict | None, dict]:
    """Captions for every image, the references' cross-entropy (perplexity), for an attention decoder each
    caption's words with their weights (image id → (words, [words, cells or regions])), and for a model
    reading regions each image's region boxes (image id → [n, 4]; None otherwise), and every caption of each
    image, best first (its real ones, :func:`captioning.evaluation.results.real_captions`: up to ``decode.top_k``). A model reading regions
    captions the split's images that have regions in its features store."""
    regions = cfg.features == "regions"
    if regions:
        batches = eval_regions(cfg, split, store_of(cfg, dataset), batch_size, max_images=max_images)
    else:
        batches = eval_images(cfg, split, batch_size, max_images=max_images, dataset=dataset, shards=shards,
                              preprocessor=captioner.trained.preprocessor)
    decode = tf.function(captioner.decode_batch, reduce_retracing=True, autograph=False)
    vocab = captioner.trained.vocab
    candidates, attention, boxes, every = {}, {}, ({} if regions else None), {}
    bar = tqdm(total=total, desc=f"caption {split}", unit="img", disable=None if progress else True)
    for batch in batches:
        out = decode({key: value for key, value in batch.items() if key in IMAGE_INPUTS + ("image_id",)})
        texts = real_captions(ids_to_text(vocab, out["ids"], out["lengths"]), out["log_probs"])
        for row, image_id in enumerate(batch["image_id"].numpy()):
            image_id = int(image_id)
            text = candidates[image_id] = texts[row][0] if texts[row] else ""  # the best caption
            every[image_id] = texts[row]
            real = int(batch["region_mask"][row].numpy().sum()) if regions else None
            if regions:
                boxes[image_id] = batch["boxes"][row, :real].numpy()
            if "attention" in out:
                weights = out["attention"][row, 0, :out["lengths"][row, 0]].numpy()
                attention[image_id] = (text.split(), weights[:, :real] if regions else weights)
        bar.update(len(batch["image_id"]))
    bar.close()
    empty = empty_captions_warning(candidates.values())  # never silent (every caption has a word: a bug if any)
    if empty:
        log.warning("%s", empty)
    loss = evaluation_loss(captioner.trained.model, make_dataset(cfg, split, training=False, batch_size=batch_size,
                                                                 max_images=max_images, dataset=dataset,
                                                                 shards=shards,
                                                                 preprocessor=captioner.trained.preprocessor))
    return candidates, loss, attention, boxes, every


def _short_hash(path: str) -> str:
    return hashlib.sha256(os.path.realpath(path).encode()).hexdigest()[:8]


def _ensemble_label(checkpoints: list[str]) -> str:
    """``""`` for one model; for an ensemble ``-ensemble<M>-`` and a hash of its checkpoints (in any order: the
    average does not depend on it).

    >>> _ensemble_label(["/m/a/ckpt-5"]), _ensemble_label(["/m/a/ckpt-5", "/m/b/ckpt-9"])[:10]
    ('', '-ensemble2')
    """
    if len(checkpoints) == 1:
        return ""
    digest = hashlib.sha256("\n".join(sorted(checkpoints)).encode()).hexdigest()[:8]
    return f"-ensemble{len(checkpoints)}-{digest}"


def _stored(path: str, baseline: bool, spice: bool, grounded: bool, instances: str | None, dataset: str,
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
            (instances and not hallucination.holds(stored, instances)) or \
            "distinct_2_per_bigram" not in stored.get("diversity", {}) or "bad_ending_rate" not in stored:
        # (results of before relations, diversity, CHAIR (COCO's: both readings, named) or bad endings were measured,
        # or of distinct_2 per bigram)
        return None
    return stored
