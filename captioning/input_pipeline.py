"""The ``tf.data`` input pipeline: prepared TFRecords → bucketed, padded caption batches.

One function, :func:`make_dataset`, serves training, validation, benchmarks and tests, so what is
measured is what trains. The stages, in order::

    shard files ─ [shard per input pipeline] ─ shuffle files ─ interleave(TFRecordDataset)
      ─ [repeat ─ shuffle records]                  ← no cache: shuffle the small serialised records
      ─ batch records ─ parse_example (one vectorised call per batch, schema.parse_batch)
      ─ decode JPEG + resize to resize_size² (parallel map) ─ one element per image
      ─ [cache: memory | disk ─ repeat ─ shuffle]   ← after the expensive work, before the random work
      ─ captions: every caption of the image, or one sampled per epoch
      ─ random crop + flip (+ colour jitter) | central crop      (crop to image_size²)
      ─ bucket by caption length, pad each batch to its longest caption ─ input/target/mask
      ─ prefetch

``cache: features`` replaces the image stages: the frozen encoder runs once over every image (central
crop, batched) and the pipeline serves its pooled features, so no epoch runs the CNN again. It needs a
frozen encoder and no augmentation (:func:`captioning.config.validate`).

Padding and masks, for a caption ``<start> a red circle <end>`` (ids 1 4 6 5 2) in a batch whose
longest caption has 6 input ids::

    input_ids    1  4  6  5  0  0      (caption[:-1], padded with <pad>=0)
    target_ids   4  6  5  2  0  0      (caption[1:]: each position predicts the next word)
    mask         1  1  1  1  0  0      (target_ids != <pad>: only real words count in the loss)

Images leave the pipeline as ``uint8`` (4× less host-to-device traffic than float32); the model casts
and applies its encoder's preprocessing.

Decoding was measured both ways on this project's 2-core machine (decode + resize of JPEGs held in
memory, best of 3, two runs each):

=====================================  ===================  ====================  ================
images                                 per-example map      batched map_fn        map_fn, 32 par.
=====================================  ===================  ====================  ================
shapes, ~240 px → 72²                  4,619 / 4,489 /s     4,949 / 4,580 /s      4,552 / 4,883 /s
640×480 photos → 346²                  576 / 542 /s         599 / 507 /s          567 / 428 /s
=====================================  ===================  ====================  ================

The two are within run-to-run noise (``tf.io.decode_jpeg`` is a scalar op, so a "batched" decode is
a ``map_fn`` loop inside one map call). The pipeline keeps the per-example parallel map: as fast, simpler,
and the autotuner spreads single images over however many cores a machine has.
"""

from __future__ import annotations

import functools
import glob
import os
from typing import Callable

import tensorflow as tf

from captioning import integrity, schema
from captioning.config import DataConfig
from captioning.vocab import PAD_ID

AUTOTUNE = tf.data.AUTOTUNE


def _decode_jpeg(encoded: tf.Tensor) -> tf.Tensor:
    return tf.io.decode_jpeg(encoded, channels=3, dct_method="INTEGER_FAST")


def _resize(image: tf.Tensor, size: int) -> tf.Tensor:
    image = tf.image.resize(image, [size, size], method="bilinear", antialias=False)
    return tf.cast(tf.clip_by_value(tf.round(image), 0.0, 255.0), tf.uint8)


def decode_and_resize(encoded: tf.Tensor, size: int) -> tf.Tensor:
    """JPEG bytes → ``uint8 [size, size, 3]`` (squashed to a square, as im2txt resized to 346²)."""
    return _resize(_decode_jpeg(encoded), size)


def model_input(encoded: tf.Tensor, cfg: DataConfig) -> tf.Tensor:
    """JPEG, PNG, GIF or BMP bytes → the ``uint8 [image_size, image_size, 3]`` central crop the model sees
    at evaluation. JPEGs are decoded exactly as the training records are; ``caption`` and the exported
    SavedModel both call this, so they give the same captions."""
    image = tf.cond(tf.io.is_jpeg(encoded), lambda: _decode_jpeg(encoded),
                    lambda: tf.io.decode_image(encoded, channels=3, expand_animations=False))
    return center_crop(_resize(image, cfg.resize_size), cfg.image_size)


def _input_files(files: list[str], input_context) -> tuple[list[str], bool]:
    """This input pipeline's files, and whether records must be sharded instead (too few files)."""
    if input_context is None or input_context.num_input_pipelines == 1:
        return files, False
    n, i = input_context.num_input_pipelines, input_context.input_pipeline_id
    if len(files) >= n:
        return files[i::n], False
    return files, True


def _records(files: list[str], cfg: DataConfig, training: bool, input_context, shuffle: bool,
             repeat: bool) -> tf.data.Dataset:
    files, shard_records = _input_files(files, input_context)
    # a stat per file against the manifest, or with data.skip_corrupt a scan once per process (integrity.py)
    files = integrity.readable_files(files, cfg.skip_corrupt)
    ds = tf.data.Dataset.from_tensor_slices(files)
    if training:
        ds = ds.shuffle(len(files), seed=cfg.seed, reshuffle_each_iteration=True)
    read = tf.data.TFRecordDataset
    if shard_records:
        # Fewer files than pipelines: each file's records are split by their position in the file, so
        # the pipelines partition the data whatever order the (non-deterministic) interleave takes.
        n, i = input_context.num_input_pipelines, input_context.input_pipeline_id
        read = lambda f: tf.data.TFRecordDataset(f).shard(n, i)  # noqa: E731
    ds = ds.interleave(read, cycle_length=min(len(files), 8), block_length=1,
                       num_parallel_calls=AUTOTUNE, deterministic=cfg.deterministic or not training)
    if repeat:
        ds = ds.repeat()  # the file list is reshuffled on every pass
    if shuffle:
        ds = ds.shuffle(cfg.shuffle_buffer, seed=cfg.seed, reshuffle_each_iteration=True)
    return ds


def _parsed(records: tf.data.Dataset, cfg: DataConfig) -> tf.data.Dataset:
    def parse(serialized):
        batch = schema.parse_batch(serialized)
        return {"encoded": batch[schema.IMAGE_ENCODED], "image_id": batch[schema.IMAGE_ID],
                "captions": batch[schema.CAPTION_IDS]}

    return records.batch(cfg.parse_batch_size).map(parse, num_parallel_calls=AUTOTUNE)


def image_dataset(cfg: DataConfig, split: str, *, training: bool, input_context=None, shuffle: bool = False,
                  repeat: bool = False, max_images: int | None = None) -> tf.data.Dataset:
    """One element per image: ``{"image": uint8 [R, R, 3], "image_id", "captions": ragged [(C), (T)]}``,
    R = ``resize_size``; not cropped. ``shuffle`` and ``repeat`` act on the serialised records;
    ``max_images`` keeps only the first images (in evaluation order). Images may have different numbers
    of captions (COCO: 5 to 7): the ragged ``captions`` batch; the raw texts come from :func:`references`."""
    manifest = schema.read_manifest(cfg.dir)
    files = schema.split_files(cfg.dir, manifest, split)
    ds = _parsed(_records(files, cfg, training, input_context, shuffle, repeat), cfg).unbatch()
    if max_images:
        ds = ds.take(max_images)
    size = cfg.resize_size

    def decode(example):
        return {"image": decode_and_resize(example["encoded"], size), "image_id": example["image_id"],
                "captions": example["captions"]}

    return ds.map(decode, num_parallel_calls=AUTOTUNE, deterministic=cfg.deterministic or not training)


def references(cfg: DataConfig, split: str) -> dict[int, list[str]]:
    """Image id → its captions as annotated (the references the metrics compare against). Parses the
    records without decoding a single image."""
    files = schema.split_files(cfg.dir, schema.read_manifest(cfg.dir), split)
    files = integrity.readable_files(files, cfg.skip_corrupt)
    out = {}
    for batch in tf.data.TFRecordDataset(files).batch(256).map(schema.parse_batch, num_parallel_calls=AUTOTUNE):
        for image_id, texts in zip(batch[schema.IMAGE_ID].numpy(), batch[schema.CAPTION_TEXT].to_list()):
            out[int(image_id)] = [t.decode("utf-8") for t in texts]
    return out


def center_crop(image: tf.Tensor, size: int) -> tf.Tensor:
    """The central ``size × size`` window (evaluation and feature extraction)."""
    offset_h = (tf.shape(image)[0] - size) // 2
    offset_w = (tf.shape(image)[1] - size) // 2
    return tf.image.crop_to_bounding_box(image, offset_h, offset_w, size, size)


def _augment(image: tf.Tensor, cfg: DataConfig) -> tf.Tensor:
    size = cfg.image_size
    image = tf.image.random_crop(image, [size, size, 3]) if cfg.random_crop else center_crop(image, size)
    if cfg.random_flip:
        image = tf.image.random_flip_left_right(image)
    if cfg.color_jitter:  # im2txt's distortions, in one fixed order
        x = tf.image.convert_image_dtype(image, tf.float32)
        x = tf.image.random_brightness(x, max_delta=32.0 / 255.0)
        x = tf.image.random_saturation(x, lower=0.5, upper=1.5)
        x = tf.image.random_hue(x, max_delta=0.032)
        x = tf.image.random_contrast(x, lower=0.5, upper=1.5)
        image = tf.image.convert_image_dtype(tf.clip_by_value(x, 0.0, 1.0), tf.uint8, saturate=True)
    return image


def eval_images(cfg: DataConfig, split: str, batch_size: int, *, input_context=None,
                max_images: int | None = None) -> tf.data.Dataset:
    """Batches of ``{"image": uint8 [B, S, S, 3] central crops, "image_id", "captions"}``: the images as
    decoding, evaluation and feature extraction see them."""
    images = image_dataset(cfg, split, training=False, input_context=input_context, max_images=max_images)
    return images.map(lambda ex: {**ex, "image": center_crop(ex["image"], cfg.image_size)},
                      num_parallel_calls=AUTOTUNE).batch(batch_size).prefetch(AUTOTUNE)


def extract_features(cfg: DataConfig, split: str, feature_fn: Callable, *, batch_size: int = 64,
                     input_context=None, max_images: int | None = None) -> tf.data.Dataset:
    """Runs ``feature_fn`` (the frozen encoder) once over every image of the split; returns a dataset
    of ``{"features": [D], "image_id", "captions"}`` held in memory."""
    images = eval_images(cfg, split, batch_size, input_context=input_context, max_images=max_images)
    features, ids, captions = [], [], []
    for batch in images:
        features.append(feature_fn(batch["image"]))
        ids.append(batch["image_id"])
        captions.append(batch["captions"])
    return tf.data.Dataset.from_tensor_slices({
        "features": tf.concat(features, 0), "image_id": tf.concat(ids, 0), "captions": tf.concat(captions, 0)})


def make_dataset(cfg: DataConfig, split: str, *, training: bool, batch_size: int, input_context=None,
                 feature_fn: Callable | None = None, cache_path: str | None = None,
                 repeat: bool | None = None, max_images: int | None = None) -> tf.data.Dataset:
    """Batches of ``{"image" | "features", "input_ids", "target_ids", "mask"}`` (see the module docstring).

    ``batch_size`` is per input pipeline (per replica under a distribution strategy). Training
    repeats, shuffles, augments and drops the last partial batch of each bucket; evaluation does none of
    that and sees every caption once. ``feature_fn`` is required for ``cache: features``;
    ``cache_path`` is the file prefix for ``cache: disk``. ``max_images`` limits evaluation to the first
    images (the same ones ``image_dataset`` gives).
    """
    if max_images and training:
        raise ValueError("max_images is for evaluation")
    images_of = functools.partial(image_dataset, cfg, split, training=training, input_context=input_context,
                                  max_images=max_images)
    repeat = training if repeat is None else repeat
    key = "features" if cfg.cache == "features" else "image"
    if cfg.cache == "none":
        ds = images_of(shuffle=training, repeat=repeat)
    else:
        if cfg.cache == "features":
            if feature_fn is None:
                raise ValueError("cache: features needs the encoder as feature_fn")
            ds = extract_features(cfg, split, feature_fn, input_context=input_context, max_images=max_images)
        elif cfg.cache == "memory":
            ds = images_of().cache()
        else:
            if not cache_path:
                raise ValueError("cache: disk needs a cache_path")
            os.makedirs(os.path.dirname(cache_path) or ".", exist_ok=True)
            for stale in glob.glob(cache_path + "*.lockfile"):  # left by a killed run: never valid
                os.remove(stale)
            ds = images_of().cache(cache_path)
        if repeat:
            ds = ds.repeat()
        if training:  # the cache holds the first epoch's order: shuffle again on every pass
            ds = ds.shuffle(cfg.shuffle_buffer, seed=cfg.seed, reshuffle_each_iteration=True)

    def captions_of(example):
        if training and cfg.captions_per_image == "sample":
            pick = tf.random.uniform([], 0, example["captions"].nrows(out_type=tf.int64), dtype=tf.int64)
            return tf.data.Dataset.from_tensors({key: example[key], "caption": example["captions"][pick]})
        return tf.data.Dataset.from_tensor_slices(example["captions"]).map(
            lambda caption: {key: example[key], "caption": caption})

    ds = ds.flat_map(captions_of)

    def to_example(example):
        caption = example["caption"]
        x = example[key]
        if key == "image":
            x = _augment(x, cfg) if training else center_crop(x, cfg.image_size)
        return {key: x, "input_ids": caption[:-1], "target_ids": caption[1:]}

    ds = ds.map(to_example, num_parallel_calls=AUTOTUNE, deterministic=cfg.deterministic or not training)
    boundaries = sorted(cfg.bucket_boundaries)
    ds = ds.bucket_by_sequence_length(
        element_length_func=lambda ex: tf.shape(ex["input_ids"])[0],
        bucket_boundaries=boundaries, bucket_batch_sizes=[batch_size] * (len(boundaries) + 1),
        padding_values={key: tf.constant(0, ds.element_spec[key].dtype), "input_ids": tf.constant(PAD_ID, tf.int64),
                        "target_ids": tf.constant(PAD_ID, tf.int64)},
        drop_remainder=training)
    ds = ds.map(lambda b: {**b, "mask": tf.cast(tf.not_equal(b["target_ids"], PAD_ID), tf.float32)},
                num_parallel_calls=AUTOTUNE)
    options = tf.data.Options()
    options.autotune.enabled = True
    options.deterministic = cfg.deterministic or not training
    options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.OFF  # sharded above
    return ds.with_options(options).prefetch(AUTOTUNE)
