"""The ``tf.data`` input pipeline: prepared TFRecords → bucketed, padded caption batches.

One function, :func:`make_dataset`, serves training, validation, benchmarks and tests, so what is
measured is what trains. The stages, in order::

    shard files ─ [shard per input pipeline] ─ shuffle files ─ interleave(TFRecordDataset)
      ─ [repeat ─ shuffle records]                  ← no cache: shuffle the small serialised records
      ─ batch records ─ parse_example (one vectorised call per batch, schema.parse_batch)
      ─ decode JPEG + resize (parallel map) ─ one element per image
            training without a cache: only the random crop window is decoded and resized
      ─ [cache: memory | disk ─ repeat ─ shuffle]   ← after the expensive work, before the random work
      ─ random crop + flip | central crop           (once per image and epoch, to image_size²)
      ─ windows of images ─ their captions sorted by length, cut into batches, batches shuffled
            (one caption sampled per image, or all of them; padded to the batch's longest)
            or, with captions_per_image: grouped, batches of whole images with all their captions
      ─ prefetch

The shard list comes from the dataset's manifest (:class:`captioning.dataset.PreparedDataset`), checked
by the command's :class:`captioning.integrity.ShardReader`.

im2txt's colour distortions (``data.color_jitter``) are not here: they run on the device, in the
training step (:mod:`captioning.augment`), where they cost a fraction of what they cost the CPU.

``cache: features`` replaces the image stages: the frozen encoder runs once over every image (central
crop, batched) and the pipeline serves its features (pooled, or the grid for attention) from a float16
file on disk (:mod:`captioning.feature_cache`), so no epoch or later run runs the CNN again. It needs a
frozen encoder and no augmentation (:func:`captioning.config.validate`).

The last stage, windows of captions sorted by length and cut into padded batches (with the padding and
mask diagram), is :mod:`captioning.batching`.

Images leave the pipeline as ``uint8`` (4× less host-to-device traffic than float32); the model casts
and applies its encoder's preprocessing.

Decoding per image in a parallel map, or batched in a ``map_fn``, measured within run-to-run noise of
each other (shapes → 72²: ~4,600 images/s either way; 640×480 photos → 346²: ~550; ``tf.io.decode_jpeg``
is a scalar op, so a "batched" decode is a loop inside one map call). The pipeline keeps the
per-example map: as fast, simpler, and the autotuner spreads images over however many cores there are.
"""

from __future__ import annotations

import functools
import math
from typing import Callable

import tensorflow as tf

from captioning import disk_cache, schema
from captioning.batching import epoch_captions_per_image, grouped_batches, length_grouped_batches
from captioning.config import DataConfig
from captioning.dataset import PreparedDataset
from captioning.errors import InputError
from captioning.feature_cache import features_dataset
from captioning.integrity import ShardReader

AUTOTUNE = tf.data.AUTOTUNE


def _decode_jpeg(encoded: tf.Tensor) -> tf.Tensor:
    return tf.io.decode_jpeg(encoded, channels=3, dct_method="INTEGER_FAST")


def _resize(image: tf.Tensor, size: int) -> tf.Tensor:
    image = tf.image.resize(image, [size, size], method="bilinear", antialias=False)
    return tf.cast(tf.clip_by_value(tf.round(image), 0.0, 255.0), tf.uint8)


def decode_and_resize(encoded: tf.Tensor, size: int) -> tf.Tensor:
    """JPEG bytes → ``uint8 [size, size, 3]`` (squashed to a square, as im2txt resized to 346²)."""
    return _resize(_decode_jpeg(encoded), size)


def decode_random_crop(encoded: tf.Tensor, resize: int, size: int) -> tf.Tensor:
    """The random ``size²`` crop of the image resized to ``resize²`` — without decoding or resizing the
    pixels outside it.

    Resizing an H×W image to R×R and cropping S×S at (y, x) is the same as cropping the window of
    H·S/R × W·S/R source pixels at (y·H/R, x·W/R) and resizing that to S×S, so the window is cut out
    while decoding (``decode_and_crop_jpeg``: libjpeg skips the rows below it and the IDCT outside it)
    and only S² pixels are resized instead of R². For im2txt's 346 → 299 on a 640×480 photo that skips
    25% of the decode and resize work.
    """
    shape = tf.io.extract_jpeg_shape(encoded)  # the header only
    height, width = shape[0], shape[1]
    crop_h = tf.clip_by_value(tf.cast(tf.round(tf.cast(height * size, tf.float32) / resize), tf.int32), 1, height)
    crop_w = tf.clip_by_value(tf.cast(tf.round(tf.cast(width * size, tf.float32) / resize), tf.int32), 1, width)
    y = tf.random.uniform([], 0, height - crop_h + 1, dtype=tf.int32)
    x = tf.random.uniform([], 0, width - crop_w + 1, dtype=tf.int32)
    image = tf.io.decode_and_crop_jpeg(encoded, tf.stack([y, x, crop_h, crop_w]), channels=3,
                                       dct_method="INTEGER_FAST")
    return _resize(image, size)


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


def pipeline_images(shard_records: list[int], input_context) -> int:
    """How many images (records) one input pipeline reads from a split whose shards hold
    ``shard_records``, under :func:`_input_files`' sharding: whole files when there are at least as
    many files as pipelines, else every n-th record of the whole split.

    >>> class Ctx: num_input_pipelines, input_pipeline_id = 2, 1
    >>> pipeline_images([3], Ctx()), pipeline_images([1], Ctx()), pipeline_images([2, 0, 5], Ctx())
    (1, 0, 0)
    """
    if input_context is None or input_context.num_input_pipelines == 1:
        return sum(shard_records)
    n, i = input_context.num_input_pipelines, input_context.input_pipeline_id
    if len(shard_records) >= n:
        return sum(shard_records[i::n])
    return len(range(i, sum(shard_records), n))


def _records(dataset: PreparedDataset, split: str, shards: ShardReader, cfg: DataConfig, training: bool,
             input_context, shuffle: bool, repeat: bool) -> tf.data.Dataset:
    files, shard_records = _input_files(dataset.files(split), input_context)
    # a stat per file against the manifest, or with data.skip_corrupt a scan once per reader (integrity.py)
    files = shards.files(dataset, split, files)
    ds = tf.data.Dataset.from_tensor_slices(files)
    if shard_records:
        # Fewer files than pipelines: every pipeline reads the whole split in one fixed order and keeps
        # every n-th record, so the pipelines partition the split evenly (an image each before any gets a
        # second; a file-by-file split would leave pipelines empty whenever files hold fewer records than
        # there are pipelines). Records are shuffled after the split, when training.
        n, i = input_context.num_input_pipelines, input_context.input_pipeline_id
        ds = ds.interleave(tf.data.TFRecordDataset, cycle_length=min(len(files), 8), block_length=1,
                           num_parallel_calls=AUTOTUNE, deterministic=True).shard(n, i)
    else:
        if training:
            ds = ds.shuffle(len(files), seed=cfg.seed, reshuffle_each_iteration=True)
        ds = ds.interleave(tf.data.TFRecordDataset, cycle_length=min(len(files), 8), block_length=1,
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


def parsed_images(cfg: DataConfig, split: str, *, training: bool, input_context=None, shuffle: bool = False,
                  repeat: bool = False, max_images: int | None = None, dataset: PreparedDataset | None = None,
                  shards: ShardReader | None = None) -> tf.data.Dataset:
    """One element per image, not decoded: ``{"encoded": JPEG bytes, "image_id", "captions"}`` (the
    arguments as :func:`image_dataset`'s)."""
    dataset, shards = _sources(cfg, dataset, shards)
    ds = _parsed(_records(dataset, split, shards, cfg, training, input_context, shuffle, repeat), cfg).unbatch()
    if max_images:
        ds = ds.take(max_images)
    ds.shard_reader = shards
    return ds


def image_dataset(cfg: DataConfig, split: str, *, training: bool, input_context=None, shuffle: bool = False,
                  repeat: bool = False, max_images: int | None = None, random_crop: bool = False,
                  dataset: PreparedDataset | None = None, shards: ShardReader | None = None) -> tf.data.Dataset:
    """One element per image: ``{"image": uint8 [R, R, 3], "image_id", "captions": ragged [(C), (T)]}``,
    R = ``resize_size``; not cropped. ``shuffle`` and ``repeat`` act on the serialised records;
    ``max_images`` keeps only the first images (in evaluation order). Images may have different numbers
    of captions (COCO: 5 to 7): the ragged ``captions`` batch; the raw texts come from :func:`references`.

    ``random_crop=True`` gives the training crop instead, ``image_size`` square, decoding only the crop
    window (:func:`decode_random_crop`), and flipped at random when ``random_flip``: one map, the
    whole per-image training work.

    ``dataset`` is ``cfg.dir``'s :class:`~captioning.dataset.PreparedDataset` (loaded when not given);
    ``shards`` the command's :class:`~captioning.integrity.ShardReader` (a new one when not given)."""
    dataset, shards = _sources(cfg, dataset, shards)
    ds = parsed_images(cfg, split, training=training, input_context=input_context, shuffle=shuffle, repeat=repeat,
                       max_images=max_images, dataset=dataset, shards=shards)
    if random_crop:
        def image_of(encoded):
            image = decode_random_crop(encoded, cfg.resize_size, cfg.image_size)
            return tf.image.random_flip_left_right(image) if cfg.random_flip else image
    else:
        image_of = functools.partial(decode_and_resize, size=cfg.resize_size)

    def decode(example):
        return {"image": image_of(example["encoded"]), "image_id": example["image_id"],
                "captions": example["captions"]}

    ds = ds.map(decode, num_parallel_calls=AUTOTUNE, deterministic=cfg.deterministic or not training)
    ds.shard_reader = shards  # it must live as long as the dataset: it owns any salvaged shards' scratch files
    return ds


def _sources(cfg: DataConfig, dataset: PreparedDataset | None,
             shards: ShardReader | None) -> tuple[PreparedDataset, ShardReader]:
    """The prepared dataset of ``cfg.dir`` and the shard reader a command passed, or new ones."""
    return dataset or PreparedDataset.load(cfg.dir), shards or ShardReader(cfg.skip_corrupt)


def references(cfg: DataConfig, split: str, dataset: PreparedDataset | None = None,
               shards: ShardReader | None = None) -> dict[int, list[str]]:
    """Image id → its captions as annotated (the references the metrics compare against). Parses the
    records without decoding a single image."""
    dataset, shards = _sources(cfg, dataset, shards)
    files = shards.files(dataset, split)
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


def _augment(image: tf.Tensor, cfg: DataConfig, cropped: bool = False) -> tf.Tensor:
    """Training crop (unless ``cropped`` already) and flip of one image."""
    size = cfg.image_size
    if not cropped:
        image = tf.image.random_crop(image, [size, size, 3]) if cfg.random_crop else center_crop(image, size)
    if cfg.random_flip:
        image = tf.image.random_flip_left_right(image)
    return image  # data.color_jitter is applied on the device, in the training step (captioning.augment)


def eval_images(cfg: DataConfig, split: str, batch_size: int, *, input_context=None, max_images: int | None = None,
                dataset: PreparedDataset | None = None, shards: ShardReader | None = None) -> tf.data.Dataset:
    """Batches of ``{"image": uint8 [B, S, S, 3] central crops, "image_id", "captions"}``: the images as
    decoding, evaluation and feature extraction see them."""
    images = image_dataset(cfg, split, training=False, input_context=input_context, max_images=max_images,
                           dataset=dataset, shards=shards)
    return images.map(lambda ex: {**ex, "image": center_crop(ex["image"], cfg.image_size)},
                      num_parallel_calls=AUTOTUNE).batch(batch_size).prefetch(AUTOTUNE)


def make_dataset(cfg: DataConfig, split: str, *, training: bool, batch_size: int, input_context=None,
                 feature_fn: Callable | None = None, feature_key: str = "", cache_dir: str | None = None,
                 repeat: bool | None = None, max_images: int | None = None,
                 dataset: PreparedDataset | None = None, shards: ShardReader | None = None,
                 service_job: str | None = None) -> tf.data.Dataset:
    """Batches of ``{"image" | "features", "input_ids", "target_ids", "mask"}`` (see the module docstring).

    ``batch_size`` is per input pipeline (per replica under a distribution strategy). Training
    repeats, shuffles, augments and drops the last partial batch of each bucket; evaluation does none of
    that and sees every caption once. ``feature_fn`` (the frozen encoder) and ``feature_key`` (its name
    and weights, :func:`captioning.feature_cache.encoder_key`) are required for ``cache: features``;
    ``cache_dir`` is the folder of ``cache: disk``'s and ``cache: features``' files
    (:mod:`captioning.disk_cache`, :mod:`captioning.feature_cache`). ``max_images`` limits evaluation to the first
    images (the same ones ``image_dataset`` gives). ``dataset`` and ``shards`` are the command's
    :class:`~captioning.dataset.PreparedDataset` and :class:`~captioning.integrity.ShardReader` (new ones
    when not given; the reader then stays with the returned dataset, as ``.shard_reader``).

    **Through the tf.data service** (``data.service``, training only): all of the above, the cache too,
    runs on the service's workers and batches arrive here (:func:`captioning.data_service.distribute`).
    ``service_job`` names the job the trainers of one run share, each building the whole split's
    pipeline (the service, not the input context, divides the work). ``parallel_epochs``: every worker
    runs the repeating pipeline; ``distributed_epoch``: each epoch's shards are split among them.
    """
    if max_images and training:
        raise ValueError("max_images is for evaluation")
    served = training and bool(cfg.service)
    if served:  # the service splits the work between trainers and workers, not the input context
        input_context = None
        wanted = training if repeat is None else repeat
        repeat = wanted and cfg.service_mode == "parallel_epochs"  # distributed_epoch: repeated below
    dataset, shards = _sources(cfg, dataset, shards)
    if training:
        # Training never hands a replica an empty batch (an empty batch would put a padded row into
        # batch-norm statistics, see CaptionModel.encode): each pipeline repeats forever, so it only
        # needs one image of its own.
        info = dataset.split(split)
        if info.shard_records and pipeline_images(list(info.shard_records), input_context) == 0:
            raise InputError(f"the {split!r} split has {info.images} image(s), too few for "
                             f"{input_context.num_input_pipelines} input pipelines (one per worker): each "
                             "needs at least one image")
    images_of = functools.partial(image_dataset, cfg, split, training=training, input_context=input_context,
                                  max_images=max_images, dataset=dataset, shards=shards)
    repeat = training if repeat is None else repeat
    key = "features" if cfg.cache == "features" else "image"
    order = cfg.deterministic or not training
    cropped = False
    if cfg.cache == "none":
        cropped = training and cfg.random_crop  # cut out while decoding
        ds = images_of(shuffle=training, repeat=repeat, random_crop=cropped)
    else:
        if cfg.cache == "features":
            if feature_fn is None or not cache_dir:
                raise ValueError("cache: features needs the encoder as feature_fn and a cache_dir")
            ds = features_dataset(cfg, split, feature_fn, feature_key, cache_dir, input_context=input_context,
                                  max_images=max_images, dataset=dataset, shards=shards)
        elif cfg.cache == "memory":
            ds = images_of().cache()
        else:
            if not cache_dir:
                raise ValueError("cache: disk needs a cache_dir")
            n, i = (input_context.num_input_pipelines, input_context.input_pipeline_id) if input_context else (1, 0)
            prefix, cache_key = disk_cache.cache_prefix(cache_dir, dataset.identity, split, cfg.resize_size,
                                                        cfg.skip_corrupt, i, n, max_images)
            disk_cache.claim(prefix, cache_key)  # files named by what they hold; a killed run's never read
            ds = images_of().cache(prefix)
        if repeat:
            ds = ds.repeat()
        if training:  # the cache holds the first epoch's order: shuffle again on every pass
            ds = ds.shuffle(cfg.shuffle_buffer, seed=cfg.seed, reshuffle_each_iteration=True)

    if key == "image":  # once per image and epoch, before the image is shared by its captions
        if not training:
            crop = functools.partial(center_crop, size=cfg.image_size)
        elif cropped:  # cut out and flipped while decoding
            crop = None
        else:
            crop = functools.partial(_augment, cfg=cfg, cropped=cropped)
        if crop:
            ds = ds.map(lambda ex: {**ex, "image": crop(ex["image"])}, num_parallel_calls=AUTOTUNE,
                        deterministic=order)
    per_image = dataset.split(split).captions_per_image
    if training:
        per_image = epoch_captions_per_image(cfg, per_image)
    if training and cfg.captions_per_image == "grouped":  # evaluation sees every caption once either way
        ds = grouped_batches(ds, key, cfg, batch_size, per_image)
    else:
        ds = length_grouped_batches(ds, key, cfg, training, batch_size, per_image)
    options = tf.data.Options()
    options.autotune.enabled = True
    options.deterministic = cfg.deterministic or not training
    options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.OFF  # sharded above
    ds = ds.with_options(options)
    if served:  # distributed_epoch: an epoch is one iteration of the job, so the trainer repeats
        from captioning.data_service import distribute

        ds = distribute(ds, cfg.service, cfg.service_mode, service_job, timeout_s=cfg.service_timeout_s,
                        compression=cfg.service_compression)
        ds = ds.repeat() if wanted and cfg.service_mode == "distributed_epoch" else ds
    ds = ds.prefetch(AUTOTUNE)
    ds.shard_reader = shards  # it must live as long as the dataset: it owns any salvaged shards' scratch files
    return ds
