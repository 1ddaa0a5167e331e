"""``data.features: regions``: the input pipeline's per-image stage read from a features store.

Instead of decoding JPEGs, the pipeline reads the store ``data.features_store`` of the prepared dataset
(:class:`captioning.data.features_store.FeaturesStore`; written by ``captioning features import`` or
``extract``), whose records carry each image's regions *and* its captions, so nothing is joined::

    store shards of the split ─ [shard per input pipeline] ─ shuffle files ─ interleave(TFRecordDataset)
      ─ [repeat ─ shuffle records] ─ parse (parallel map) ─ one element per image:
            regions  float16 [n, D]     n differs between images (a detector's boxes, 10–100 for bottom-up)
            boxes    float32 [n, 4]     x1, y1, x2, y2 as fractions of the image's width and height
            image_id, captions          as the image stages give them

The batching stages (:mod:`captioning.data.batching`) then pad each batch's regions to the batch's
largest ``n`` rounded up to a multiple of ``data.region_pad_multiple`` (16 by default) and add
``region_mask [B, N]`` (1 for a region, 0 for padding), which every decoder respects
(:meth:`captioning.model.base.CaptionModel.image_features`). A batch of images with 3 and 5 regions, with
``region_pad_multiple: 1`` (the batch's largest) and 4::

    regions      [2, 5, D]     the first image's rows 3 and 4 are zeros
    region_mask  [[1 1 1 0 0],
                  [1 1 1 1 1]]
    regions      [2, 8, D]     (multiple 4) rows 3-7 and 5-7 are zeros
    region_mask  [[1 1 1 0 0 0 0 0],
                  [1 1 1 1 1 0 0 0]]

Why a multiple: a compiled step (``scst.xla_sampling``, ``train.jit_compile``) is compiled again for every
batch shape, about 1.4 s each, and a bottom-up store's images hold 10–100 boxes, so padding to each batch's
largest count compiles up to 91 times; rounded up to multiples of 16 it compiles at most 7 times (16 … 112),
as ``data.bucket_boundaries`` fixes the caption lengths. The padding is masked, so the numbers are those of
the batch's largest (tests/test_region_training.py); it costs the padded regions' share of the attention.
A store whose images all hold 36 boxes (bottom-up's fixed 36) pads them to 48 with 16: set 36 (or 1) there.

Images of the split without features in the store (reported when the store was written) are not
read. The image augmentations (crops, flips, colour jitter) and sizes of ``data:`` do not apply.
"""

from __future__ import annotations

import tensorflow as tf
from tensorflow.autograph.experimental import do_not_convert

from captioning.config.sections import DataConfig
from captioning.data import features_store as store_lib
from captioning.data.features_store import FeaturesStore
from captioning.data.prepared import PreparedDataset
from captioning.data.reading import input_files
from captioning.errors import InputError

AUTOTUNE = tf.data.AUTOTUNE
KEYS = ("regions", "boxes")  # what each image brings into a batch (beside its captions)


def store_of(cfg: DataConfig, dataset: PreparedDataset) -> FeaturesStore:
    """The features store ``cfg.features_store`` of ``dataset``; an InputError when it is missing, damaged,
    or was written for another version of the dataset."""
    store = FeaturesStore.load(dataset.path, cfg.features_store)
    if store.dataset != dataset.identity:
        raise InputError(f"the features store {store.path} was written for another version of {dataset.path} "
                         f"(prepared again since): write it again (`captioning features import` or `extract` "
                         f"with --overwrite)")
    return store


def normalised_boxes(boxes, width, height):
    """Pixel boxes ``[n, 4]`` (x1, y1, x2, y2) of a ``width`` × ``height`` image as fractions of it, in [0, 1]."""
    size = tf.cast(tf.maximum(tf.stack([width, height, width, height]), 1), tf.float32)
    return tf.clip_by_value(boxes / size, 0.0, 1.0)


def region_images(cfg: DataConfig, split: str, store: FeaturesStore, *, training: bool, input_context=None,
                  shuffle: bool = False, repeat: bool = False, max_images: int | None = None) -> tf.data.Dataset:
    """One element per image of ``split`` that has regions: ``{"regions", "boxes", "image_id", "captions"}``
    (module docstring). The arguments as :func:`captioning.data.reading.image_dataset`'s: ``shuffle`` and
    ``repeat`` act on the records, ``max_images`` keeps the first images (in evaluation order)."""
    files, by_record = input_files(store.files(split), input_context)
    ds = tf.data.Dataset.from_tensor_slices(files)
    order = cfg.deterministic or not training
    if by_record:  # fewer files than pipelines: every pipeline reads the split and keeps every n-th record
        ds = ds.interleave(tf.data.TFRecordDataset, cycle_length=min(len(files), 8), block_length=1,
                           num_parallel_calls=AUTOTUNE, deterministic=True)
        ds = ds.shard(input_context.num_input_pipelines, input_context.input_pipeline_id)
    else:
        if training:
            ds = ds.shuffle(max(1, len(files)), seed=cfg.seed, reshuffle_each_iteration=True)
        ds = ds.interleave(tf.data.TFRecordDataset, cycle_length=max(1, min(len(files), 8)), block_length=1,
                           num_parallel_calls=AUTOTUNE, deterministic=order)
    if repeat:
        ds = ds.repeat()
    if shuffle:
        ds = ds.shuffle(cfg.shuffle_buffer, seed=cfg.seed, reshuffle_each_iteration=True)
    size = store.feature_size

    @do_not_convert
    def parse(serialized):
        r = store_lib.parse_regions(serialized)
        return {"regions": tf.ensure_shape(r[store_lib.FEATURES], [None, size]),
                "boxes": normalised_boxes(r[store_lib.BOXES], r[store_lib.WIDTH], r[store_lib.HEIGHT]),
                "image_id": r[store_lib.IMAGE_ID], "captions": r[store_lib.CAPTION_IDS]}

    ds = ds.map(parse, num_parallel_calls=AUTOTUNE, deterministic=order)
    if max_images:
        ds = ds.take(max_images)
    return ds


def padded(batch: dict, multiple: int = 1) -> dict:
    """A batch whose ``regions`` and ``boxes`` are ragged ``[B, (n), ...]`` → dense, zero-padded to the
    batch's largest ``n`` (at least 1) rounded up to a multiple of ``multiple``, with ``region_mask [B, N]``
    float32 (module docstring)."""
    regions = batch["regions"]
    lengths = regions.row_lengths()
    longest = tf.maximum(tf.reduce_max(tf.concat([lengths, [0]], 0)), 1)
    longest = (longest + multiple - 1) // multiple * multiple
    rows = regions.nrows()
    dense = regions.to_tensor(shape=[rows, longest, regions.shape[-1]])
    boxes = batch["boxes"].to_tensor(shape=[rows, longest, 4])
    mask = tf.sequence_mask(lengths, longest, dtype=tf.float32)
    return {**batch, "regions": dense, "boxes": boxes, "region_mask": mask}


def eval_regions(cfg: DataConfig, split: str, store: FeaturesStore, batch_size: int, *, input_context=None,
                 max_images: int | None = None) -> tf.data.Dataset:
    """Batches of ``{"regions", "boxes", "region_mask", "image_id", "captions"}`` in evaluation order: the
    regions counterpart of :func:`captioning.data.reading.eval_images`."""
    ds = region_images(cfg, split, store, training=False, input_context=input_context, max_images=max_images)
    return ds.ragged_batch(batch_size).map(do_not_convert(lambda batch: padded(batch, cfg.region_pad_multiple)),
                                           num_parallel_calls=AUTOTUNE).prefetch(AUTOTUNE)
