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
features store: :meth:`captioning.model.data_sources.base.DataSource.evaluation_input`). The result is kept in the first
folder, its key marked ``-ensemble<M>-<hash of the checkpoints>`` and its document holding ``"members"``
(each model's checkpoint); ``checkpoint_step`` and the default decoding are the first model's.

The dataset must have been prepared with the model's vocabulary (as ``train`` requires), unless the model reads
a language model's tokenizer (``data.tokenizer: preset``), which tokenizes the records' caption text itself;
``--data-dir`` points at the records when the config's ``data.dir`` is not where they are on this machine. What
is scored is the detokenized caption's words (:mod:`captioning.data.tokenizers`), whichever tokenizer wrote it.

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

``--clip-preset P`` (a keras-hub CLIP or SigLIP preset) adds ``"clip"``: CLIPScore and RefCLIPScore (``--clip-metric
pac``: PAC-S and RefPAC-S, for a preset of PAC-S's weights) and text-to-image recall@1/@5 of the captions and of the
references (:mod:`captioning.evaluation.clip_score`), each image's scores in the predictions file too; the key gets
``-clip<P's hash>`` (``-pac…``), so two presets never share a result.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import os

import tensorflow as tf
from tqdm import tqdm

from captioning import inference
from captioning.model.base import IMAGE_INPUTS
from captioning.evaluation import clip_score, grounding, hallucination, metrics, relations
from captioning.evaluation.endings import bad_endings
from captioning.evaluation.diversity import diversity
from captioning.evaluation.results import (EvaluationResult, ensemble_label, options_label, real_captions,
                                           result_name, settings_label, short_hash, stored_result, used_decoding)
from captioning.data.prepared import PreparedDataset
from captioning.errors import InputError
from captioning.fileio import atomic_write_json, check_output_file, disk_full_error
from captioning.data.pipeline import make_dataset
from captioning.data.tokenizers import as_tokenizer
from captioning.data.reading import references
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
    if not as_tokenizer(trained.vocab).fits(dataset):  # words: the same vocabulary; a preset's reads the text
        raise InputError(f"{folder} was prepared with another vocabulary than the model in {trained.model_dir}: "
                         f"prepare it with `captioning prepare --vocab {model_folder.vocab_file}`")
    return dataset


def evaluate(model_dir: str | list[str], split: str = "test", beam_size: int | None = None, max_images: int | None = None,
             max_length: int | None = None, length_normalization: float | None = None, batch_size: int = 32,
             data_dir: str | None = None, spice: bool = False, baseline: bool = False,
             output: str | None = None, progress: bool = True, checkpoint: str | None = None,
             instances: str | None = None, decode_overrides: tuple[str, ...] = (),
             weights: str | None = None, clip_preset: str | None = None, clip_metric: str = "clip") -> EvaluationResult:
    """Evaluates ``checkpoint`` (default: the latest complete one) of ``model_dir`` on ``split`` (see the
    module docstring). ``beam_size``, ``max_length``, ``length_normalization``: None takes the model's
    ``decode:`` config, as do ``decode_overrides`` (``decode.KEY=VALUE``). ``instances``: an instances file
    of the split (the shapes' or COCO's), for CHAIR and, on the shapes, grounding. Several folders in
    ``model_dir`` (a list): their ensemble, kept in the first's folder (see the module docstring). ``weights``:
    ``"ema"`` (the weight average), ``"raw"``, or None (the average when the checkpoint holds one). ``clip_preset``,
    ``clip_metric``: the reference-free measures (see the module docstring)."""
    metrics.check_java()  # fail before an hour of decoding, not after
    dirs = model_dirs(model_dir)
    if output is not None:  # never over what it reads (models' files, presets, data, instances) nor others' JSON
        for path in dirs + ([os.path.dirname(checkpoint) or "."] if checkpoint else []):
            ModelDir(path).refuse_output(output, "`output`", params=("output",), data=True, data_dir=data_dir)
        check_output_file(output, "`output`", params=("output",), inputs=(instances,) if instances else (),
                          kind="json", keys=RESULT_KEYS)
    objects = hallucination.load_objects(instances) if instances else None  # the synthetic shapes' or COCO's
    shapes = hallucination.shapes_of(objects)  # what grounding reads (None for COCO's)
    if clip_metric not in clip_score.WEIGHTS:
        raise InputError(f"--clip-metric must be one of {', '.join(clip_score.WEIGHTS)}, got {clip_metric!r}",
                         params=("clip_metric",))
    clip = clip_score.ContrastiveModel(clip_preset) if clip_preset is not None else None  # refused before decoding
    trained = inference.load(dirs, checkpoint, weights)  # weights: "ema", "raw", None (the average when there is one)
    check_same_input(trained.members)
    decode = trained.config.decode.override(beam_size=beam_size, max_length=max_length,
                                            length_normalization=length_normalization).with_overrides(decode_overrides)
    scored_by = f"-{clip_metric}{clip_score.identity(clip_preset)}" if clip is not None else ""
    run = _Evaluation.of(trained, ModelDir(dirs[0]), decode, split, max_images, data_dir, scored_by)
    stored = stored_result(run.file(".json"), baseline, spice, shapes is not None,
                     os.path.abspath(instances) if instances else None, run.dataset.identity, run.checkpoints)
    if stored is not None:
        log.info("%s is evaluated already (checkpoint step %d, these settings): the stored result, unchanged",
                 split, trained.step)
        if output:
            atomic_write_json(output, stored)
        return EvaluationResult(stored)
    check_output_file(run.file(".json"), "the evaluation result")  # a read-only model folder: before the decoding
    metrics.start_meteor()  # its JVM loads its tables (~4 s) while the split is captioned
    result, captioned = _caption_and_score(run, objects, instances, spice, max_images, batch_size, progress)
    _add_measures(run, result, captioned, objects, shapes, instances, baseline)
    if clip is not None:  # reference-free, from the CLIP preset
        result["clip"], captioned.per_image = clip_score.measure_split(
            clip, run.data, run.split, run.dataset, captioned.candidates, captioned.refs, clip_metric)
    _write(run, result, captioned, output)
    return result


@dataclasses.dataclass
class _Evaluation:
    """One evaluation's identity: the trained model(s) and the decoding that runs, the dataset and split read,
    and the key its result is kept under (the same data, checkpoint and settings, or a new evaluation)."""

    trained: object
    folder: ModelDir
    decode: object  # the decode: section that runs
    beam_size: int | None  # greedy is beam 1, sampling has no beam
    split: str
    dataset: PreparedDataset
    data: object  # the data: section read (one pass over the split: nothing cached)
    partial: int | None  # the first images of the split only
    checkpoints: list[str]
    label: str  # the decoding options, the weight average and the ensemble, as names and tags carry them
    name: str

    @classmethod
    def of(cls, trained, folder: ModelDir, decode, split: str, max_images: int | None,
           data_dir: str | None, scored_by: str = "") -> "_Evaluation":
        decode, beam_size = used_decoding(decode)
        dataset = _prepared_dataset(trained, folder, data_dir)  # --data-dir points at the records if they moved
        split_images = dataset.split(split).images
        partial = max_images if max_images and max_images < split_images else None
        members = trained.members
        foreign = not folder.owns_checkpoint(trained.checkpoint)
        checkpoints = [os.path.realpath(m.checkpoint) for m in members]
        ensemble = ensemble_label([c + ("#ema" if m.weights == "ema" else "") for c, m in zip(checkpoints, members)])
        averaged = "-ema" if any(m.weights == "ema" for m in members) else ""  # the weight average: another result
        label = options_label(decode) + averaged + ensemble + scored_by  # scored_by: the CLIP preset
        name = result_name(split, trained.step, beam_size, decode.max_length, decode.length_normalization, partial,
                           dataset.identity[:8], short_hash(trained.checkpoint) if foreign else "", label)
        return cls(trained, folder, decode, beam_size, split, dataset,
                   dataclasses.replace(trained.config.data, cache="none", dir=dataset.path), partial, checkpoints,
                   label, name)

    def file(self, suffix: str) -> str:
        return self.folder.file(os.path.join("eval", self.name + suffix))

    @property
    def tag(self) -> str:
        """The TensorBoard tag of its scalars."""
        return (settings_label(self.beam_size, self.decode.max_length, self.decode.length_normalization) + self.label
                + (f"-first{self.partial}" if self.partial else ""))


@dataclasses.dataclass
class _Captioned:
    """What captioning a split gave: the best caption of each image, every caption of it (``decode.top_k``),
    the references' cross-entropy, an attending decoder's weights and, reading regions, their boxes."""

    candidates: dict
    every: dict
    refs: dict
    loss: object
    attention: dict
    boxes: dict | None
    scores: dict
    token_layout: object  # where the encoder's tokens sit (None: no layout, or regions)
    attention_absent: str | None = None  # why a language-model decoder has no attention (Captioner.attention_absent)
    per_image: dict = dataclasses.field(default_factory=dict)  # image id → its scores (the CLIP preset's)


def _caption_and_score(run: _Evaluation, objects, instances, spice: bool, max_images: int | None, batch_size: int,
                       progress: bool) -> tuple[EvaluationResult, _Captioned]:
    """Captions the split and scores the best caption of each image with pycocoevalcap; the others
    (``decode.top_k`` > 1: beams or samples, best first) count in the diversity among each image's captions."""
    captioner = inference.Captioner(run.trained, run.decode)
    total = run.partial or run.dataset.split(run.split).images
    # a damaged shard: one line naming it (InputError), not a DataLossError traceback
    with ShardReader(run.data.skip_corrupt) as shards, shards.named_errors():
        refs = references(run.data, run.split, dataset=run.dataset, shards=shards)  # parsed, not decoded: seconds
        if objects is not None:  # the instances file is checked before the hour of decoding, not after
            grounding.check_covers(objects, refs, run.split, instances)
        candidates, loss, attention, boxes, every = _read_and_caption(
            captioner, run.data, run.dataset, shards, run.split, max_images, batch_size, total, progress)
        refs = {image_id: refs[image_id] for image_id in candidates}
    log.info("scoring %d captions with pycocoevalcap (PTB tokenizer, BLEU, METEOR, ROUGE-L, CIDEr)",
             len(candidates))
    scores = metrics.coco_metrics(refs, candidates, spice=spice)
    trained, decode = run.trained, run.decode
    result = EvaluationResult(
        metrics=scores, split=run.split, checkpoint_step=trained.step, num_images=len(candidates),
        all_images=run.partial is None, beam_size=run.beam_size, max_length=decode.max_length,
        length_normalization=decode.length_normalization, loss=loss.loss, perplexity=loss.perplexity,
        dataset=run.dataset.identity, data_dir=os.path.abspath(run.dataset.path),
        checkpoint=os.path.realpath(trained.checkpoint),
        decode={**dataclasses.asdict(decode), "beam_size": run.beam_size})  # sampling: no beam
    members = trained.members
    result["weights"] = [m.weights for m in members] if len(members) > 1 else members[0].weights  # "ema", "raw"
    if len(members) > 1:
        result["members"] = run.checkpoints
    return result, _Captioned(candidates, every, refs, loss, attention, boxes, scores, captioner.token_layout,
                              captioner.attention_absent)


def _add_measures(run: _Evaluation, result: EvaluationResult, captioned: _Captioned, objects, shapes, instances,
                  baseline: bool) -> None:
    """Diversity, bad endings, CHAIR (``instances``), the most frequent caption's scores (``baseline``) and, on
    the synthetic shapes, grounding: naming, relations and where an attending decoder looked."""
    candidates, refs = captioned.candidates, captioned.refs
    with ShardReader(run.data.skip_corrupt) as shards, shards.named_errors():
        train_refs = references(run.data, run.trained.config.data.train_split, dataset=run.dataset, shards=shards)
    train_texts = [t for texts in train_refs.values() for t in texts]
    # vocabulary usage counts words of the dataset's vocabulary, whichever tokenizer wrote the captions
    result["diversity"] = diversity(captioned.every, len(run.dataset.vocabulary()), train_texts)
    result.update(bad_endings(candidates.values()))
    if objects is not None:
        result.update(hallucination.results(objects, candidates, refs, os.path.abspath(instances)))
    if baseline:
        constant = most_frequent_caption(train_texts)
        log.info("baseline: the most frequent training caption for every image: %r", constant)
        result["baseline"] = metrics.coco_metrics(refs, {i: constant for i in candidates})
        result["baseline_caption"] = constant
    if shapes is None:
        return
    result["grounding"] = {"instances": os.path.abspath(instances),
                           "naming": grounding.naming_accuracy(shapes, candidates).to_json(),
                           "relations": relations.relation_accuracy(shapes, candidates).to_json()}
    layout, attention, boxes = captioned.token_layout, captioned.attention, captioned.boxes
    if attention and (boxes is not None or layout is not None):
        located = grounding.attention_localisation(
            shapes, attention, None if layout is None else (layout.rows, layout.cols), run.data.resize_size,
            run.data.image_size, regions=boxes, prefix=0 if layout is None else layout.prefix)
        result["grounding"]["attention"] = located.to_json()
    elif attention:
        log.info("attention on the named shapes: not measured, model.encoder %s declares no layout of its tokens",
                 run.trained.config.model.encoder)
    elif captioned.attention_absent:  # said, as caption --json says it: not available, not an error
        log.info("attention on the named shapes: not available, %s", captioned.attention_absent)


def _write(run: _Evaluation, result: EvaluationResult, captioned: _Captioned, output: str | None) -> None:
    """The predictions, the result (last: a metrics file means the evaluation is complete), ``output`` and the
    TensorBoard scalars; a full disk or a read-only folder in one line."""
    path = run.file(".json")
    try:
        atomic_write_json(run.file(".predictions.json"),
                          [{"image_id": i, "caption": c, "captions": captioned.every[i],  # the k: mBLEU-4
                            **captioned.per_image.get(i, {})} for i, c in sorted(captioned.candidates.items())])
        atomic_write_json(path, result)
        if output:
            atomic_write_json(output, result)
        with tf.summary.create_file_writer(run.folder.file(os.path.join("logs", f"eval_{run.split}"))).as_default(
                step=run.trained.step):
            for metric, value in captioned.scores.items():
                tf.summary.scalar(f"{run.tag}/{metric}", value)
            tf.summary.scalar(f"{run.tag}/perplexity", result.perplexity)
            for key in ("bad_ending_rate",) + hallucination.SCALARS:
                if result.get(key) is not None:
                    tf.summary.scalar(f"{run.tag}/{key}", result[key])
            for key, value in (result.get("clip") or {}).items():  # its means and recalls
                if isinstance(value, float):
                    tf.summary.scalar(f"{run.tag}/{key}", value)
    except (OSError, tf.errors.OpError) as e:
        full = disk_full_error(e, os.path.dirname(path), "the evaluation results")
        if full is None and not isinstance(e, OSError):
            raise
        raise full or InputError(f"cannot write the evaluation results to {os.path.dirname(path)}: "
                                 f"{e.strerror or e}") from None
    log.info("wrote %s", path)


def _read_and_caption(captioner, cfg, dataset, shards, split: str, max_images: int | None, batch_size: int,
                      total: int, progress: bool) -> tuple[dict[int, str], object, dict, dict | None, dict]:
    """Captions for every image, the references' cross-entropy (perplexity), for an attention decoder each
    caption's words with their weights (image id → (words, [words, cells or regions])), and for a model
    reading regions each image's region boxes (image id → [n, 4]; None otherwise), and every caption of each
    image, best first (its real ones, :func:`captioning.evaluation.results.real_captions`: up to ``decode.top_k``). A model reading regions
    captions the split's images that have regions in its features store."""
    source = captioner.trained.members[0].model.source  # the members read one input (check_same_input)
    batches = source.eval_batches(split, batch_size, max_images=max_images, dataset=dataset, shards=shards,
                                  preprocessor=captioner.trained.preprocessor)
    decode = tf.function(captioner.decode_batch, reduce_retracing=True, autograph=False)
    vocab = captioner.trained.vocab
    candidates, attention, boxes, every = {}, {}, {}, {}
    bar = tqdm(total=total, desc=f"caption {split}", unit="img", disable=None if progress else True)
    for batch in batches:
        out = decode({key: value for key, value in batch.items() if key in IMAGE_INPUTS + ("image_id",)})
        texts = real_captions(ids_to_text(vocab, out["ids"], out["lengths"]), out["log_probs"])
        for row, image_id in enumerate(batch["image_id"].numpy()):
            image_id = int(image_id)
            text = candidates[image_id] = texts[row][0] if texts[row] else ""  # the best caption
            every[image_id] = texts[row]
            seen = source.seen_regions(batch, row)  # reading regions: the boxes of the row's real ones
            if seen is not None:
                boxes[image_id] = seen
            if "attention" in out:
                weights = out["attention"][row, 0, :out["lengths"][row, 0]].numpy()
                attention[image_id] = (text.split(), weights if seen is None else weights[:, :len(seen)])
        bar.update(len(batch["image_id"]))
    bar.close()
    empty = empty_captions_warning(candidates.values())  # never silent (every caption has a word: a bug if any)
    if empty:
        log.warning("%s", empty)
    loss = evaluation_loss(captioner.trained.model, make_dataset(cfg, split, training=False, batch_size=batch_size,
                                                                 max_images=max_images, dataset=dataset,
                                                                 shards=shards,
                                                                 preprocessor=captioner.trained.preprocessor,
                                                                 source=source, tokenizer=vocab))
    return candidates, loss, attention, boxes or None, every
