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

The shard list comes from the dataset's manifest (:class:`captioning.data.prepared.PreparedDataset`), checked
by the command's :class:`captioning.data.integrity.ShardReader`.

im2txt's colour distortions (``data.color_jitter``) are not here: they run on the device, in the
training step (:mod:`captioning.data.augment`), where they cost a fraction of what they cost the CPU.

A data source that reads a features store (``features: regions``, handed in as ``source``: a
:class:`captioning.model.data_sources.base.DataSource`, whose registry comes after this stage) replaces the image
stages with the store's regions (:mod:`captioning.data.region_input`): no JPEG is decoded; batches carry ``regions``, ``boxes`` and
``region_mask`` instead of ``image``, padded per batch to its largest number of regions.

``cache: features`` replaces the image stages: the frozen encoder runs once over every image (central
crop, batched) and the pipeline serves its features (pooled, or the grid for attention) from a float16
file on disk (:mod:`captioning.data.feature_cache`), so no epoch or later run runs the CNN again. It needs a
frozen encoder and no augmentation (:func:`captioning.config.validate`).

The last stage, windows of captions sorted by length and cut into padded batches (with the padding and
mask diagram), is :mod:`captioning.data.batching`.

The resize and the crops are the encoder's preprocessor's (:class:`captioning.data.preprocessor.ImagePreprocessor`:
its stage 1 before the cache, stage 2 after it), handed in as ``preprocessor`` (training and evaluation pass
their model's; without one, the data settings' geometry). Images leave the pipeline as ``uint8`` (4× less
host-to-device traffic than float32); the model casts them and its encoder's first layer normalises them
(the preprocessor's stage 3).

Reading the records and decoding the images (the stages up to one element per image) is
:mod:`captioning.data.reading`, which evaluation and the feature cache share.
"""

from __future__ import annotations

import functools
from typing import Callable

import tensorflow as tf
from tensorflow.autograph.experimental import do_not_convert

from captioning.config.sections import DataConfig
from captioning.data import disk_cache
from captioning.data.batching import epoch_captions_per_image, grouped_batches, length_grouped_batches
from captioning.data.feature_cache import features_dataset
from captioning.data.integrity import ShardReader
from captioning.data.prepared import PreparedDataset
from captioning.data.region_input import KEYS as REGION_KEYS, padded, region_images
from captioning.data.preprocessor import ImagePreprocessor
from captioning.data.reading import image_dataset, pipeline_images, reads_text, sources_of, train_crop
from captioning.data.seeds import CROPS, seeded
from captioning.errors import InputError

AUTOTUNE = tf.data.AUTOTUNE


def make_dataset(cfg: DataConfig, split: str, *, training: bool, batch_size: int, input_context=None,
                 feature_fn: Callable | None = None, feature_key: str = "", cache_dir: str | None = None,
                 repeat: bool | None = None, max_images: int | None = None,
                 dataset: PreparedDataset | None = None, shards: ShardReader | None = None,
                 service_job: str | None = None, skip_batches: int = 0,
                 preprocessor: ImagePreprocessor | None = None, source=None, tokenizer=None) -> tf.data.Dataset:
    """Batches of ``{"image" | "features" | "regions", "boxes", "region_mask"; "input_ids", "target_ids",
    "mask"}`` (see the module docstring).

    ``batch_size`` is per input pipeline (per replica under a distribution strategy). Training
    repeats, shuffles, augments and drops the last partial batch of each bucket; evaluation does none of
    that and sees every caption once. ``feature_fn`` (the frozen encoder) and ``feature_key`` (its name
    and weights, :func:`captioning.data.feature_cache.encoder_key`) are required for ``cache: features``;
    ``cache_dir`` is the folder of ``cache: disk``'s and ``cache: features``' files (:mod:`captioning.data.disk_cache`,
    :mod:`captioning.data.feature_cache`). ``max_images`` limits evaluation to the first images (``image_dataset``'s). ``dataset`` and ``shards`` are the command's
    :class:`~captioning.data.prepared.PreparedDataset` and :class:`~captioning.data.integrity.ShardReader` (new ones
    when not given; the reader then stays with the returned dataset, as ``.shard_reader``). ``preprocessor``: the
    encoder's (:meth:`captioning.model.encoders.base.ImageEncoder.preprocessor`), which resizes and crops the
    images; default: the geometry of ``data.image_size`` and ``data.resize_size``
    (:meth:`~captioning.data.preprocessor.ImagePreprocessor.of`). ``source``: the data source
    (:func:`captioning.model.data_sources.data_source`), asked for the features store read instead of the images
    (:meth:`~captioning.model.data_sources.base.DataSource.features_store`); None: the images. ``tokenizer``: the
    run's (:mod:`captioning.data.tokenizers`), whose ids the captions are in: the words tokenizer (or None) reads
    the records' ``caption/ids``, a subword tokenizer tokenizes their ``caption/text`` as the records are parsed
    (before any cache, whose files it keys; a features store holds word ids only, and is refused).
    ``skip_batches``: batches made and dropped first (a resumed run's replay, ``train.lifecycle.replayed_steps``).

    **Through the tf.data service** (``data.service``, training only): all of the above, the cache too,
    runs on the service's workers and batches arrive here (:func:`captioning.data.service.distribute`).
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
    dataset, shards = sources_of(cfg, dataset, shards)
    preprocessor = preprocessor or ImagePreprocessor.of(cfg)
    store = source.features_store(dataset) if source is not None else None
    if store is not None and reads_text(tokenizer):
        raise InputError(f"data.features: regions reads the features store's caption ids, which are words of "
                         f"{dataset.path}'s vocabulary: data.tokenizer {tokenizer.kind} needs data.features: images")
    if training:
        _check_every_pipeline_has_an_image(split, dataset, store, input_context)
    images_of = functools.partial(image_dataset, cfg, split, training=training, input_context=input_context,
                                  max_images=max_images, dataset=dataset, shards=shards, preprocessor=preprocessor,
                                  tokenizer=tokenizer)
    repeat = training if repeat is None else repeat
    key = "regions" if store is not None else "features" if cfg.cache == "features" else "image"
    cropped = False
    if store is not None:
        ds = _region_elements(cfg, split, store, training=training, repeat=repeat, input_context=input_context,
                              max_images=max_images)
    elif cfg.cache == "none":
        cropped = training and cfg.random_crop  # cut out while decoding
        ds = images_of(shuffle=training, repeat=repeat, random_crop=cropped)
    else:
        ds = _cached_elements(cfg, split, images_of, training=training, repeat=repeat, feature_fn=feature_fn,
                              feature_key=feature_key, cache_dir=cache_dir, input_context=input_context,
                              max_images=max_images, dataset=dataset, shards=shards, preprocessor=preprocessor,
                              tokenizer=tokenizer)
    if key == "image" and not cropped:  # once per image and epoch, before the image is shared by its captions
        ds = _cropped(ds, cfg, preprocessor, training=training, input_context=input_context)
    ds = _caption_batches(ds, key, cfg, split, training=training, batch_size=batch_size, dataset=dataset,
                          input_context=input_context)
    ds = ds.with_options(_options(cfg, training))
    if served:  # distributed_epoch: an epoch is one iteration of the job, so the trainer repeats
        from captioning.data.service import distribute

        ds = distribute(ds, cfg.service, cfg.service_mode, service_job, timeout_s=cfg.service_timeout_s,
                        compression=cfg.service_compression)
        ds = ds.repeat() if wanted and cfg.service_mode == "distributed_epoch" else ds
    ds = ds.skip(skip_batches) if skip_batches else ds
    ds = ds.prefetch(AUTOTUNE)
    ds.shard_reader = shards  # it must live as long as the dataset: it owns any salvaged shards' scratch files
    return ds


def _check_every_pipeline_has_an_image(split: str, dataset: PreparedDataset, store, input_context) -> None:
    """Training never hands a replica an empty batch (an empty batch would put a padded row into batch-norm
    statistics, see CaptionModel.encode): each pipeline repeats forever, so it only needs one image of its own
    (of the features ``store``'s, when it reads regions). An InputError when one has none."""
    info = store.split(split) if store is not None else dataset.split(split)
    if info.shard_records and pipeline_images(list(info.shard_records), input_context) == 0:
        where = f" with regions in {store.path}" if store is not None else ""
        if input_context is None or input_context.num_input_pipelines == 1:
            raise InputError(f"the {split!r} split has no image{where}: there is nothing to train on")
        raise InputError(f"the {split!r} split has {info.images} image(s){where}, too few for "
                         f"{input_context.num_input_pipelines} input pipelines (one per worker): each "
                         "needs at least one image")


def _region_elements(cfg: DataConfig, split: str, store, *, training: bool, repeat: bool, input_context,
                     max_images: int | None) -> tf.data.Dataset:
    """One element per image of the features ``store``'s regions; ``cache: memory`` caches them, then repeats
    and shuffles on every pass, as it does images."""
    ds = region_images(cfg, split, store, training=training, input_context=input_context,
                       shuffle=training and cfg.cache == "none", repeat=repeat and cfg.cache == "none",
                       max_images=max_images)
    if cfg.cache == "memory":  # then repeated and shuffled on every pass, as the images are
        ds = ds.cache().repeat() if repeat else ds.cache()
        ds = ds.shuffle(cfg.shuffle_buffer, seed=cfg.seed, reshuffle_each_iteration=True) if training else ds
    return ds


def _cached_elements(cfg: DataConfig, split: str, images_of: Callable, *, training: bool, repeat: bool,
                     feature_fn: Callable | None, feature_key: str, cache_dir: str | None, input_context,
                     max_images: int | None, dataset: PreparedDataset, shards: ShardReader,
                     preprocessor: ImagePreprocessor, tokenizer=None) -> tf.data.Dataset:
    """One element per image through ``data.cache`` (``features``: the encoder's features; ``memory``, ``disk``:
    the decoded, resized images ``images_of`` gives), then repeated and, in training, shuffled again on every
    pass (the cache holds the first epoch's order)."""
    if cfg.cache == "features":
        if feature_fn is None or not cache_dir:
            raise ValueError("cache: features needs the encoder as feature_fn and a cache_dir")
        ds = features_dataset(cfg, split, feature_fn, feature_key, cache_dir, input_context=input_context,
                              max_images=max_images, dataset=dataset, shards=shards, preprocessor=preprocessor,
                              tokenizer=tokenizer)
    elif cfg.cache == "memory":
        ds = images_of().cache()
    else:
        if not cache_dir:
            raise ValueError("cache: disk needs a cache_dir")
        pipelines, pipeline_id = ((input_context.num_input_pipelines, input_context.input_pipeline_id)
                                  if input_context else (1, 0))
        prefix, cache_key = disk_cache.cache_prefix(cache_dir, dataset.identity, split, preprocessor.resize_size,
                                                    cfg.skip_corrupt, pipeline_id, pipelines, max_images,
                                                    tokenizer.identity if reads_text(tokenizer) else None)
        disk_cache.claim(prefix, cache_key)  # files named by what they hold; a killed run's never read
        ds = images_of().cache(prefix)
    if repeat:
        ds = ds.repeat()
    if training:  # the cache holds the first epoch's order: shuffle again on every pass
        ds = ds.shuffle(cfg.shuffle_buffer, seed=cfg.seed, reshuffle_each_iteration=True)
    return ds


def _cropped(ds: tf.data.Dataset, cfg: DataConfig, preprocessor: ImagePreprocessor, *, training: bool,
             input_context) -> tf.data.Dataset:
    """Each image cut to ``image_size``², once per image and epoch: a central crop in evaluation, in training
    a random crop and flip from each image's own draws (data/seeds.py)."""
    order = cfg.deterministic or not training
    if not training:
        return ds.map(do_not_convert(lambda ex: {**ex, "image": preprocessor.cropped(ex["image"])}),
                      num_parallel_calls=AUTOTUNE, deterministic=order)
    crop = functools.partial(train_crop, cfg=cfg, preprocessor=preprocessor)
    return ds.enumerate().map(seeded(lambda ex, seed: {**ex, "image": crop(ex["image"], seed=seed)},
                                     cfg.seed, CROPS, input_context), num_parallel_calls=AUTOTUNE,
                              deterministic=order)


def _caption_batches(ds: tf.data.Dataset, key: str, cfg: DataConfig, split: str, *, training: bool,
                     batch_size: int, dataset: PreparedDataset, input_context) -> tf.data.Dataset:
    """The images' captions cut into padded batches (:mod:`captioning.data.batching`), each carrying its
    images' ``key`` (``image``, ``features``, or the regions' keys, padded per batch)."""
    per_image = dataset.split(split).captions_per_image
    if training:
        per_image = epoch_captions_per_image(cfg, per_image)
    keys, finish = ((REGION_KEYS, functools.partial(padded, multiple=cfg.region_pad_multiple)) if key in REGION_KEYS
                    else ((key,), None))
    if training and cfg.captions_per_image == "grouped":  # evaluation sees every caption once either way
        return grouped_batches(ds, keys, cfg, batch_size, per_image, finish, input_context)
    return length_grouped_batches(ds, keys, cfg, training, batch_size, per_image, finish, input_context)


def _options(cfg: DataConfig, training: bool) -> tf.data.Options:
    """Autotuning on, determinism as ``data.deterministic`` asks (always in evaluation), tf.data's own sharding
    off (the shards are divided when read)."""
    options = tf.data.Options()
    options.autotune.enabled = True
    options.deterministic = cfg.deterministic or not training
    options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.OFF  # sharded above
    return options
