"""``captioning evaluate``: perplexity and the COCO caption metrics of a trained model on a split.

Every image of the split (or the first ``max_images``) is captioned by beam search, in batches, and
scored against all its reference captions (the raw captions stored in the records) with
:func:`captioning.metrics.coco_metrics`. Perplexity is the exponential of the mean cross-entropy per
real word over every caption of the split (or of those images).

Writes into the model folder (each under a temporary name, then renamed):

* ``metrics.json``: ``{"metrics": {Bleu_1 … CIDEr}, "split", "checkpoint_step", "num_images",
  "beam_size", "loss", "perplexity"}`` (plus ``"baseline"`` with ``--baseline``);
* ``predictions.json``: the captions in COCO results format, ``[{"image_id", "caption"}]``;
* TensorBoard scalars under ``logs/eval_<split>`` at the checkpoint's step.

``--baseline`` also scores a constant caption, the most frequent (normalised) caption of the training
split, given for every image: the floor any model must clear.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import math
import os

import tensorflow as tf
from tqdm import tqdm

from captioning import inference, metrics, schema
from captioning.fileio import atomic_write_json
from captioning.decode import ids_to_text
from captioning.input_pipeline import eval_images, make_dataset, references
from captioning.integrity import data_errors
from captioning.model import caption_loss_sum
from captioning.text import tokenize_caption

log = logging.getLogger("captioning.evaluate")


def most_frequent_caption(texts) -> str:
    """The most common caption after normalisation (ties: alphabetical), e.g. for a constant baseline."""
    counts = collections.Counter(" ".join(tokenize_caption(t)) for t in texts)
    counts.pop("", None)
    return min(counts, key=lambda c: (-counts[c], c))


@data_errors()  # a damaged shard: one line naming it (InputError), not a DataLossError traceback
def evaluate(model_dir: str, split: str = "test", beam_size: int = 3, max_images: int | None = None,
             max_length: int = 20, length_normalization: float = 0.0, batch_size: int = 32,
             data_dir: str | None = None, spice: bool = False, baseline: bool = False,
             output: str | None = None, progress: bool = True) -> dict:
    metrics.check_java()  # fail before an hour of decoding, not after
    trained = inference.load(model_dir)
    # one pass over the split: nothing to cache; --data-dir points at the records if they moved
    cfg = dataclasses.replace(trained.config.data, cache="none", dir=data_dir or trained.config.data.dir)
    manifest = schema.read_manifest(cfg.dir)
    schema.split_files(cfg.dir, manifest, split)
    captioner = inference.Captioner(trained, beam_size=beam_size, max_length=max_length,
                                    length_normalization=length_normalization)
    total = manifest["splits"][split]["images"]
    if max_images:
        total = min(total, max_images)

    # captions for every image
    images = eval_images(cfg, split, batch_size, max_images=max_images)
    decode = tf.function(captioner.decode_images)
    candidates = {}
    bar = tqdm(total=total, desc=f"caption {split}", unit="img", disable=None if progress else True)
    for batch in images:
        out = decode(batch["image"])
        for image_id, (text,) in zip(batch["image_id"].numpy(), ids_to_text(trained.vocab, out["ids"], out["lengths"])):
            candidates[int(image_id)] = text
        bar.update(len(batch["image_id"]))
    bar.close()
    refs = references(cfg, split)

    # perplexity over the same images' captions
    loss = _loss(trained, cfg, split, max_images, batch_size)
    log.info("scoring %d captions with pycocoevalcap (PTB tokenizer, BLEU, METEOR, ROUGE-L, CIDEr)", len(candidates))
    scores = metrics.coco_metrics(refs, candidates, spice=spice)
    result = {"metrics": scores, "split": split, "checkpoint_step": trained.step, "num_images": len(candidates),
              "beam_size": beam_size, "loss": loss, "perplexity": math.exp(min(loss, 50.0))}
    if baseline:
        train_texts = [t for texts in references(cfg, trained.config.data.train_split).values() for t in texts]
        constant = most_frequent_caption(train_texts)
        log.info("baseline: the most frequent training caption for every image: %r", constant)
        result["baseline"] = metrics.coco_metrics(refs, {i: constant for i in candidates})
        result["baseline_caption"] = constant

    atomic_write_json(os.path.join(model_dir, "metrics.json"), result)
    atomic_write_json(os.path.join(model_dir, "predictions.json"),
                 [{"image_id": i, "caption": c} for i, c in sorted(candidates.items())])
    if output:
        atomic_write_json(output, result)
    with tf.summary.create_file_writer(os.path.join(model_dir, "logs", f"eval_{split}")).as_default(step=trained.step):
        for name, value in scores.items():
            tf.summary.scalar(f"metrics/{name}", value)
        tf.summary.scalar("perplexity", result["perplexity"])
    return result


def _loss(trained, cfg, split: str, max_images: int | None, batch_size: int) -> float:
    """Mean cross-entropy per real word over every caption of the (first ``max_images``) images."""
    model = trained.model
    dataset = make_dataset(cfg, split, training=False, batch_size=batch_size, max_images=max_images)

    @tf.function(input_signature=[dataset.element_spec])  # one graph for every bucket length
    def step(batch):
        return caption_loss_sum(model, batch, training=False), tf.reduce_sum(batch["mask"])

    total = count = 0.0
    for batch in dataset:
        loss_sum, tokens = step(batch)
        total, count = total + float(loss_sum), count + float(tokens)
    return total / max(count, 1.0)
