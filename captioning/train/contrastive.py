"""``captioning clip train``: a CLIP-shaped contrastive image-text model trained on a prepared dataset's images and
captions, written as a keras-hub CLIP preset (``CLIPBackbone``, ``CLIPTokenizer``, ``CLIPPreprocessor`` with its
image converter) that ``evaluate --clip-preset`` and ``scst.clip_preset`` read offline, as they would read OpenAI's
CLIP converted by keras-hub. It exists because no pretrained CLIP can be downloaded where this project is tested:
the reference-free metrics and CLIP rewards on the synthetic data need a CLIP that knows the synthetic data.

**Sizes** (:data:`SIZES`; ``--size``): ``tiny`` for CPU work; ``base`` is CLIP ViT-B/32's dimensions (for a machine
with a GPU: a user with internet converts OpenAI's weights instead).

**Training** (:func:`train_clip`). Each image of the split once an epoch in a seeded order (``data.seed``'s
stateless draws choose one of its captions each time: :mod:`captioning.data.seeds`), the image squashed to the
size's side and normalised as CLIP normalises (its mean and standard deviation per channel, the converter saved
with the preset), the caption packed by the preset's own preprocessor (lower-cased, ``<|startoftext|>`` pieces
``<|endoftext|>``, padded to the size's text length). The loss is CLIP's: the symmetric cross-entropy of the
batch's image-to-text and text-to-image similarities, scaled by a learned temperature (keras-hub's ``CLIPHead``,
initialised at 1/0.07 as CLIP's). AdamW (weight decay 0.1, gradient norm clipped at 1), a linear warm-up over the
first tenth of the steps (at most 1,000), then cosine decay to a tenth. The tokenizer (:func:`data_prep.lm_text.
train_clip_bpe`) is learnt from the split's captions first; its end-of-text token has the largest id, as in
OpenAI's vocabulary, so keras-hub's pooling at the largest id reads it.

Logged: the loss every tenth of the run, then ``final_loss`` (the mean of the last tenth, at most 100 steps)
against ``chance_loss`` (ln of the batch size: a model that tells nothing apart) and the text-to-image recall@1
of the split's first :data:`RECALL_IMAGES` images' first captions among those images.

**Output**: the preset folder and ``training.json`` (:data:`RECORD`: the settings, the data's identity, the
figures), written in a temporary folder renamed to the output when complete: a killed run leaves nothing and its
rerun starts again.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import time

import numpy as np

from captioning.errors import InputError
from captioning.fileio import atomic_folder, atomic_write_json, read_record
from captioning.model.contrastive import normalised, packed, recall_at

log = logging.getLogger("captioning")

RECORD = "training.json"
RECALL_IMAGES = 500
MEAN, STD = (0.48145466, 0.4578275, 0.40821073), (0.26862954, 0.26130258, 0.27577711)  # CLIP's, per channel
SIZES = {  # vision: image side, patch, width, layers, heads; text: width, layers, heads, length; vocabulary bound
    "tiny": dict(image_size=64, patch=8, vision_width=128, vision_layers=2, vision_heads=4, text_width=128,
                 text_layers=2, text_heads=4, text_length=32, projection=128, vocabulary=2_000),
    "base": dict(image_size=224, patch=32, vision_width=768, vision_layers=12, vision_heads=12, text_width=512,
                 text_layers=12, text_heads=8, text_length=77, projection=512, vocabulary=49_408),
}


@dataclasses.dataclass(frozen=True)
class ClipSettings:
    size: str = "tiny"
    steps: int = 2000
    batch_size: int = 64
    learning_rate: float = 5e-4
    seed: int = 0

    def check(self) -> "ClipSettings":
        if self.size not in SIZES:
            raise InputError(f"`size` must be one of {', '.join(SIZES)}, got {self.size!r}", params=("size",))
        return self


def build_clip(settings: ClipSettings, vocabulary: dict, merges: list):
    """The keras-hub CLIP backbone of the size and its preprocessor (tokenizer and image converter), weights drawn
    from the seed."""
    import keras
    import keras_hub

    keras.utils.set_random_seed(settings.seed)
    s, m = SIZES[settings.size], keras_hub.models
    tokenizer = m.CLIPTokenizer(vocabulary=vocabulary, merges=merges)
    side = s["image_size"]
    vision = m.CLIPVisionEncoder(patch_size=s["patch"], hidden_dim=s["vision_width"], num_layers=s["vision_layers"],
                                 num_heads=s["vision_heads"], intermediate_dim=4 * s["vision_width"],
                                 image_shape=(side, side, 3))
    text = m.CLIPTextEncoder(vocabulary_size=len(vocabulary), embedding_dim=s["text_width"],
                             hidden_dim=s["text_width"], num_layers=s["text_layers"], num_heads=s["text_heads"],
                             intermediate_dim=4 * s["text_width"], max_sequence_length=s["text_length"])
    backbone = m.CLIPBackbone(vision, text, projection_dim=s["projection"])
    converter = keras_hub.layers.CLIPImageConverter(image_size=(side, side), scale=[1 / (255 * d) for d in STD],
                                                    offset=[-a / d for a, d in zip(MEAN, STD)])
    preprocessor = m.CLIPPreprocessor(tokenizer=tokenizer, image_converter=converter,
                                      sequence_length=s["text_length"])
    preprocessor.build(None)
    return backbone, preprocessor


def _image(encoded, converter):
    """A record's image decoded, squashed to the CLIP's side and normalised by its ``converter``."""
    import tensorflow as tf

    from captioning.data.reading import decoded

    side = int(converter.image_size[0])
    return converter(tf.image.resize(tf.cast(decoded(encoded), tf.float32), [side, side], antialias=True)[None])[0]


def _pairs(data_cfg, split: str, references: dict, preprocessor, settings: ClipSettings):
    """The training stream: batches of (converted images, packed token ids), one caption of each image drawn at
    random, every image once an epoch."""
    import tensorflow as tf

    from captioning.data.reading import parsed_images

    ids = sorted(references)
    table = tf.lookup.StaticHashTable(tf.lookup.KeyValueTensorInitializer(
        tf.constant(ids, tf.int64), tf.range(len(ids), dtype=tf.int64)), default_value=-1)
    texts = tf.ragged.constant([list(references[i]) for i in ids], dtype=tf.string)
    base = tf.constant([settings.seed, 1], tf.int64)

    @tf.autograph.experimental.do_not_convert
    def pair(n, ex):
        captions = texts[table.lookup(tf.cast(ex["image_id"], tf.int64))]
        seed = tf.random.experimental.stateless_fold_in(base, n)
        pick = tf.random.stateless_uniform([], seed, 0, tf.shape(captions)[0], tf.int32)
        return _image(ex["encoded"], preprocessor.image_converter), captions[pick]

    @tf.autograph.experimental.do_not_convert
    def pack(images, captions):
        return images, packed(preprocessor, captions)

    # --seed orders the images too, in a fixed order (the captions drawn follow each image's place in it)
    ordered = dataclasses.replace(data_cfg, seed=settings.seed, deterministic=True)
    ds = parsed_images(ordered, split, training=True, shuffle=True, repeat=True).enumerate()
    return ds.map(pair, num_parallel_calls=tf.data.AUTOTUNE).batch(settings.batch_size, drop_remainder=True).map(
        pack).prefetch(tf.data.AUTOTUNE)


def _train_step(backbone, settings: ClipSettings):
    import keras
    import tensorflow as tf

    warm = min(1000, max(1, settings.steps // 10))
    schedule = keras.optimizers.schedules.CosineDecay(0.0, max(1, settings.steps - warm), alpha=0.1,
                                                      warmup_target=settings.learning_rate, warmup_steps=warm)
    optimizer = keras.optimizers.AdamW(schedule, weight_decay=0.1, global_clipnorm=1.0)
    variables = backbone.trainable_variables
    optimizer.build(variables)
    labels = tf.range(settings.batch_size)

    def step(images, token_ids):
        with tf.GradientTape() as tape:
            out = backbone({"images": images, "token_ids": token_ids}, training=True)
            losses = [keras.losses.sparse_categorical_crossentropy(labels, tf.cast(out[k], tf.float32),
                                                                   from_logits=True)
                      for k in ("vision_logits", "text_logits")]
            loss = (tf.reduce_mean(losses[0]) + tf.reduce_mean(losses[1])) / 2
        optimizer.apply(tape.gradient(loss, variables), variables)
        return loss

    return tf.function(step, autograph=False, reduce_retracing=True)


def _recall_at_1(backbone, preprocessor, data_cfg, split: str, references: dict) -> float:
    """Text-to-image recall@1 of the first images' first captions among those images (ties against, as
    ``evaluate --clip-preset``'s)."""
    import tensorflow as tf

    from captioning.data.reading import parsed_images

    images, captions = [], []
    for ex in parsed_images(data_cfg, split, training=False, max_images=RECALL_IMAGES):
        images.append(_image(ex["encoded"], preprocessor.image_converter))
        captions.append(references[int(ex["image_id"])][0])
    token_ids = packed(preprocessor, tf.constant(captions))
    chunks = range(0, len(images), 64)  # a ViT-B's activations for 500 images at once would not be small
    v = normalised(np.concatenate([backbone.get_vision_embeddings(tf.stack(images[i:i + 64])) for i in chunks]))
    t = normalised(np.concatenate([backbone.get_text_embeddings(token_ids[i:i + 64]) for i in chunks]))
    return recall_at(t, np.arange(len(captions)), v, ks=(1,))["recall@1"]  # as evaluate --clip-preset counts it


def train_clip(data_cfg, split: str, parts: dict, settings: ClipSettings, output: str, data: dict,
               progress: bool = True) -> dict:
    """Trains the CLIP ``settings`` describes on the images and captions of ``split`` (``data_cfg``: the prepared
    dataset's data section) with the tokenizer of ``parts`` (``vocabulary``, ``merges``) and writes it with
    :data:`RECORD` (``settings``, ``data``: the dataset's identity and split, the figures) to the preset folder
    ``output`` through a temporary folder. Returns the record."""
    from tqdm import tqdm

    from captioning.data.reading import references as read_references

    settings = settings.check()
    references = read_references(data_cfg, split)
    if len(references) < settings.batch_size:
        raise InputError(f"the {split!r} split has {len(references)} images, fewer than `batch_size` "
                         f"{settings.batch_size}: a contrastive batch needs that many images", params=("batch_size",))
    backbone, preprocessor = build_clip(settings, parts["vocabulary"], parts["merges"])
    log.info("CLIP %s: %s parameters, %s pieces; %s images of %r, batches of %d", settings.size,
             f"{backbone.count_params():,}", f"{len(parts['vocabulary']):,}", f"{len(references):,}", split,
             settings.batch_size)
    step, batches = _train_step(backbone, settings), iter(_pairs(data_cfg, split, references, preprocessor, settings))
    losses, every, started = [], max(1, settings.steps // 10), time.perf_counter()
    bar = tqdm(total=settings.steps, desc="clip train", unit="step", disable=None if progress else True, mininterval=1)
    for n in range(1, settings.steps + 1):
        losses.append(float(step(*next(batches))))
        if not math.isfinite(losses[-1]):
            raise InputError(f"the loss is {losses[-1]} at step {n}: try a smaller `learning_rate`",
                             params=("learning_rate",))
        bar.update(1)
        if n % every == 0 or n == settings.steps:
            log.info("step %d of %d: loss %.3f (chance %.3f; %.1f steps/s)", n, settings.steps,
                     float(np.mean(losses[-every:])), math.log(settings.batch_size), n / (time.perf_counter() - started))
    bar.close()
    last = min(100, max(1, settings.steps // 10))
    figures = {"final_loss": float(np.mean(losses[-last:])), "first_loss": losses[0],
               "chance_loss": math.log(settings.batch_size), "train_seconds": round(time.perf_counter() - started, 1),
               "parameters": int(backbone.count_params()), "vocabulary_size": len(parts["vocabulary"]),
               "recall@1": _recall_at_1(backbone, preprocessor, data_cfg, split, references)}
    log.info("final loss %.3f (chance %.3f); text-to-image recall@1 %.3f among the first %d images of %r",
             figures["final_loss"], figures["chance_loss"], figures["recall@1"],
             min(RECALL_IMAGES, len(references)), split)
    record = {"settings": dataclasses.asdict(settings), "data": data, "figures": figures}
    with atomic_folder(output) as folder:
        backbone.save_to_preset(folder)
        preprocessor.save_to_preset(folder)
        atomic_write_json(os.path.join(folder, RECORD), record)
    return record


def finished(output: str) -> dict | None:
    """The :data:`RECORD` of a preset this command wrote in ``output``, or None."""
    return read_record(os.path.join(output, RECORD), ("settings", "data"))
