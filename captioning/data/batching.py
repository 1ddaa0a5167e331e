"""Batching: images with their captions → padded batches of (image, caption) examples, grouped by length
(:func:`length_grouped_batches`), or batches of whole images with all their captions
(:func:`grouped_batches`, ``data.captions_per_image: grouped``).

The last stage of the input pipeline (:func:`captioning.data.pipeline.make_dataset`). Padding and masks,
for a caption ``<start> a red circle <end>`` (ids 1 4 6 5 2) in a batch whose longest caption has 6 input
ids::

    input_ids    1  4  6  5  0  0      (caption[:-1], padded with <pad>=0)
    target_ids   4  6  5  2  0  0      (caption[1:]: each position predicts the next word)
    mask         1  1  1  1  0  0      (target_ids != <pad>: only real words count in the loss)

Why windows and not ``bucket_by_sequence_length``: every per-example dataset op costs CPU, and a
captioning pipeline has five examples per image. Fanning out with ``flat_map`` and bucketing with
``bucket_by_sequence_length`` cost ~1.5 ms of CPU per image (0.3 ms per caption), a third of what
decoding a 640×480 JPEG costs; sorting a window of ``length_window`` batches' worth of captions and
gathering each batch in one op costs almost nothing, and pads less (``captioning benchmark input``
measures both; ``benchmarks/RESULTS.md``).
"""

from __future__ import annotations

import math

import tensorflow as tf
from tensorflow.autograph.experimental import do_not_convert

from captioning.config.sections import DataConfig
from captioning.data.seeds import WINDOWS, seeded
from captioning.vocab import PAD_ID

AUTOTUNE = tf.data.AUTOTUNE


def epoch_captions_per_image(cfg: DataConfig, stored: float) -> float:
    """Captions a training epoch gives each image, on average, when the split stores ``stored`` per image:
    all of them (``all``; ``grouped``), one (``sample``), or ``data.group_captions`` (``grouped``, k ≥ 1;
    fewer for an image that has fewer).

    >>> from captioning.config.sections import DataConfig
    >>> [epoch_captions_per_image(DataConfig(captions_per_image=c, group_captions=k), 5.2)
    ...  for c, k in (("all", 0), ("sample", 0), ("grouped", 0), ("grouped", 3), ("grouped", 7))]
    [5.2, 1.0, 5.2, 3.0, 5.2]
    """
    if cfg.captions_per_image == "sample":
        return 1.0
    if cfg.captions_per_image == "grouped" and cfg.group_captions:
        return min(float(cfg.group_captions), stored)
    return stored


def images_per_batch(batch_size: int, captions_per_image: float) -> int:
    """Images in a grouped batch of ``batch_size`` captions (a replica's share), each with all its
    captions: ``round(batch_size / captions_per_image)``, at least one (so a batch size below one image's
    captions still gives whole images, one per batch).

    >>> images_per_batch(32, 5.0), images_per_batch(3, 5.0), images_per_batch(1, 5.0)
    (6, 1, 1)
    """
    return max(1, round(batch_size / captions_per_image))


def sample_captions(captions: tf.RaggedTensor, k: int, seed: tf.Tensor) -> tf.RaggedTensor:
    """``k`` of each image's captions (ragged ``[images, (captions), (ids)]``), drawn without replacement
    in random order (from the stateless ``seed``); all of them, shuffled, for an image with ``k`` or fewer."""
    rows = tf.cast(captions.value_rowids(), tf.int64)
    # sorting by (image, random key) shuffles each image's captions and keeps the images in order
    order = tf.argsort(tf.cast(rows, tf.float64) + tf.random.stateless_uniform(tf.shape(rows), seed, 0.0, 0.5,
                                                                                tf.float64))
    starts = tf.cast(captions.row_starts(), tf.int64)
    position = tf.range(tf.size(rows, out_type=tf.int64)) - tf.gather(starts, tf.gather(rows, order))
    picked = tf.boolean_mask(order, position < k)
    lengths = tf.minimum(captions.row_lengths(), tf.cast(k, captions.row_splits.dtype))
    return tf.RaggedTensor.from_row_lengths(tf.gather(captions.values, picked), lengths)


def length_grouped_batches(ds: tf.data.Dataset, keys: tuple[str, ...], cfg: DataConfig, training: bool,
                           batch_size: int, captions_per_image: float, finish=None,
                           input_context=None) -> tf.data.Dataset:
    """Images with their captions → padded batches of (image, caption) examples, grouped by length.

    Each window of images carrying about ``length_window`` batches' worth of captions is handled in a
    few batched ops: every caption (or, with ``captions_per_image: sample``, one random caption per
    image) becomes an example; the examples are sorted by length (ties in random order when training)
    and cut into batches of ``batch_size``, which come out in random order; each batch gathers its
    images and pads its captions to its longest (or up to the next of ``bucket_boundaries``). Per
    example there is no dataset op at all — a ``flat_map`` over captions and ``bucket_by_sequence_length``
    cost ~0.3 ms of CPU per example, a third of a 640×480 JPEG's decode. Training drops each window's
    last partial batch; evaluation keeps it and sees every caption once. ``captions_per_image`` is how many
    examples an image gives on average (1 with ``sample`` in training), which sizes the windows.

    ``keys`` are what each image brings into its examples (``("image",)``, ``("features",)``, or the
    regions and their boxes); ``finish`` (optional) maps each batch once gathered: the regions, of
    different numbers per image, come ragged and leave padded with a mask
    (:func:`captioning.data.region_input.padded`). Each window's random choices are drawn from its own
    stateless seed (:func:`~captioning.data.seeds.seeded`; ``input_context``: this input pipeline's).
    """
    # Enough images for length_window batches on average (at least one batch: a window too small for
    # one would give training nothing).
    per_window = max(1, math.ceil(cfg.length_window * batch_size / captions_per_image))
    boundaries = tf.constant(sorted(cfg.bucket_boundaries) or [0], tf.int64)

    def batches_of(window, seed):
        draws = tf.unstack(tf.random.experimental.stateless_split(seed, 4))
        captions = window["captions"]  # ragged [images, (captions), (ids)]
        owner = captions.value_rowids()  # the image of each caption
        flat = captions.values  # ragged [examples, (ids)]
        if training and cfg.captions_per_image == "sample":
            counts = tf.cast(captions.row_lengths(), tf.int64)
            pick = tf.cast(tf.random.stateless_uniform(tf.shape(counts), draws[0]) * tf.cast(counts, tf.float32),
                           tf.int64)
            flat = tf.gather(flat, tf.cast(captions.row_starts(), tf.int64) + tf.minimum(pick, counts - 1))
            owner = tf.range(tf.shape(counts, out_type=tf.int64)[0])
        lengths = tf.cast(flat.row_lengths(), tf.float32)
        count = tf.shape(lengths, out_type=tf.int64)[0]
        if training:
            # The partial batch's worth of examples left out is a random choice, not the longest ones;
            # ties in length are broken at random too.
            keep = tf.random.experimental.stateless_shuffle(tf.range(count), draws[1])
            keep = keep[:count // batch_size * batch_size]
            kept = tf.gather(lengths, keep)
            order = tf.gather(keep, tf.argsort(kept + tf.random.stateless_uniform(tf.shape(kept), draws[2], 0.0, 0.5)))
            count = tf.size(order, out_type=tf.int64)
            starts = tf.random.experimental.stateless_shuffle(tf.range(0, count, batch_size), draws[3])
        else:
            order = tf.argsort(lengths, stable=True)
            starts = tf.range(0, count, batch_size)

        @do_not_convert
        def batch_at(start):
            picked = tf.gather(order, tf.range(start, tf.minimum(start + batch_size, count)))
            images = _gather(window, keys, tf.gather(owner, picked), finish)
            return {**images, **_padded(tf.gather(flat, picked), boundaries)}

        return tf.data.Dataset.from_tensor_slices(starts).map(batch_at)

    windows = _windows(ds, per_window, cfg.deterministic or not training, finish)
    return windows.enumerate().flat_map(seeded(batches_of, cfg.seed, WINDOWS, input_context))


def _windows(ds: tf.data.Dataset, size: int, deterministic: bool, finish) -> tf.data.Dataset:
    """Windows of ``size`` images; ragged where images bring different numbers of rows (``finish`` given)."""
    if finish is not None:
        return ds.ragged_batch(size)
    return ds.batch(size, num_parallel_calls=AUTOTUNE, deterministic=deterministic)


def _gather(window: dict, keys: tuple[str, ...], rows, finish) -> dict:
    """The ``keys`` of a window's images at ``rows``, finished (padded) if ``finish`` is given."""
    out = {key: tf.gather(window[key], rows) for key in keys}
    return finish(out) if finish is not None else out


def _padded(caption: tf.RaggedTensor, boundaries: tf.Tensor) -> dict:
    """``input_ids``, ``target_ids`` and ``mask`` of a batch of captions (ragged ``[N, (ids)]``), padded to
    the longest (or up to the next bucket boundary)."""
    longest = tf.cast(tf.reduce_max(caption.row_lengths()), tf.int64) - 1
    bucket = tf.gather(boundaries, tf.minimum(tf.searchsorted(boundaries, [longest], out_type=tf.int64)[0],
                                              tf.size(boundaries, out_type=tf.int64) - 1))
    shape = tf.stack([caption.nrows(out_type=tf.int64), tf.maximum(longest, bucket)])
    input_ids = caption[:, :-1].to_tensor(PAD_ID, shape=shape)
    target_ids = caption[:, 1:].to_tensor(PAD_ID, shape=shape)
    return {"input_ids": input_ids, "target_ids": target_ids,
            "mask": tf.cast(tf.not_equal(target_ids, PAD_ID), tf.float32)}


def grouped_batches(ds: tf.data.Dataset, keys: tuple[str, ...], cfg: DataConfig, batch_size: int,
                    captions_per_image: float, finish=None, input_context=None) -> tf.data.Dataset:
    """Training batches of whole images (``data.captions_per_image: grouped``): each batch holds
    ``round(batch_size / captions_per_image)`` images (at least one) and *all* their captions, about
    ``batch_size`` examples, so the encoder runs once per image and the image crosses to the device once,
    not once per caption. With ``data.group_captions: k`` an image brings ``k`` of its captions, drawn
    afresh each epoch (:func:`sample_captions`), and ``captions_per_image`` is ``k``. ``image_index [N]`` gives each caption's row in the images' ``keys`` (as :func:`length_grouped_batches`' ``keys`` and
    ``finish``); the model repeats the
    image's features per caption (:meth:`captioning.model.base.CaptionModel.call`)::

        image        [B, S, S, 3]      B images (or "features" [B, D])
        image_index  [N]               0 0 0 0 0 1 1 1 1 1 1 2 …   (N ≈ batch_size captions)
        input_ids    [N, T]            every caption of the B images, padded to the batch's longest
        target_ids   [N, T], mask [N, T]

    Images are grouped by the length of their longest caption within windows of ``length_window``
    batches (ties at random), batches come out in random order, and each window's partial batch of
    images is left out at random, as in :func:`length_grouped_batches`. The trade: a batch pads every
    caption of an image to the batch's longest, and an image's captions differ in length, so padding
    efficiency is lower than sorting single captions (``captioning benchmark input`` reports both)."""
    per_batch = images_per_batch(batch_size, captions_per_image)
    boundaries = tf.constant(sorted(cfg.bucket_boundaries) or [0], tf.int64)

    def batches_of(window, seed):  # the window's draws from its own seed, as in length_grouped_batches
        draws = tf.unstack(tf.random.experimental.stateless_split(seed, 4))
        captions = window["captions"]  # ragged [images, (captions), (ids)]
        if cfg.group_captions:
            captions = sample_captions(captions, cfg.group_captions, draws[0])
        # each image's longest caption (every image has at least one: prepare skips those without)
        longest = tf.math.segment_max(captions.values.row_lengths(), captions.value_rowids())
        count = tf.shape(longest, out_type=tf.int64)[0]
        keep = tf.random.experimental.stateless_shuffle(tf.range(count), draws[1])[:count // per_batch * per_batch]
        kept = tf.cast(tf.gather(longest, keep), tf.float32)
        order = tf.gather(keep, tf.argsort(kept + tf.random.stateless_uniform(tf.shape(kept), draws[2], 0.0, 0.5)))
        starts = tf.random.experimental.stateless_shuffle(tf.range(0, tf.size(order, out_type=tf.int64), per_batch),
                                                          draws[3])

        @do_not_convert
        def batch_at(start):
            picked = order[start:start + per_batch]
            mine = tf.gather(captions, picked)  # ragged [B, (captions), (ids)]
            return {**_gather(window, keys, picked, finish), "image_index": tf.cast(mine.value_rowids(), tf.int32),
                    **_padded(mine.values, boundaries)}

        return tf.data.Dataset.from_tensor_slices(starts).map(batch_at)

    windows = _windows(ds, max(1, cfg.length_window * per_batch), cfg.deterministic, finish)
    return windows.enumerate().flat_map(seeded(batches_of, cfg.seed, WINDOWS, input_context))
