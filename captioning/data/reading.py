"""Reading a prepared dataset's records: shard files → parsed records → decoded images, the decoding and
cropping every stage shares (training's input pipeline, evaluation, feature extraction, ``caption`` and the
exported SavedModel), and the references.

:func:`image_dataset` gives one element per image; :func:`eval_images` batches of central crops, the
images as decoding, evaluation and feature extraction see them; :func:`references` the captions as
annotated, parsed without decoding a single image; :func:`model_input` the one decode of a user's image.
The training pipeline built on these is :mod:`captioning.data.pipeline`.

Decoding per image in a parallel map, or batched in a ``map_fn``, measured within run-to-run noise of
each other (shapes → 72²: ~4,600 images/s either way; 640×480 photos → 346²: ~550; ``tf.io.decode_jpeg``
is a scalar op, so a "batched" decode is a loop inside one map call). The pipeline keeps the
per-example map: as fast, simpler, and the autotuner spreads images over however many cores there are.
"""

from __future__ import annotations

import tensorflow as tf
from tensorflow.autograph.experimental import do_not_convert

from captioning.config_sections import DataConfig
from captioning.data import schema
from captioning.data.integrity import ShardReader
from captioning.data.prepared import PreparedDataset
from captioning.data.seeds import CROPS, seeded

AUTOTUNE = tf.data.AUTOTUNE


def _decode_jpeg(encoded: tf.Tensor) -> tf.Tensor:
    return tf.io.decode_jpeg(encoded, channels=3, dct_method="INTEGER_FAST")


def squash(image: tf.Tensor, size: int) -> tf.Tensor:
    """Any ``[H, W, 3]`` image → ``uint8 [size, size, 3]``, squashed to the square as the pipeline resizes."""
    return _resize(image, size)


def _resize(image: tf.Tensor, size: int) -> tf.Tensor:
    image = tf.image.resize(image, [size, size], method="bilinear", antialias=False)
    return tf.cast(tf.clip_by_value(tf.round(image), 0.0, 255.0), tf.uint8)


def decode_and_resize(encoded: tf.Tensor, size: int) -> tf.Tensor:
    """JPEG bytes → ``uint8 [size, size, 3]`` (squashed to a square, as im2txt resized to 346²)."""
    return _resize(_decode_jpeg(encoded), size)


def decode_random_crop(encoded: tf.Tensor, resize: int, size: int, seed: tf.Tensor) -> tf.Tensor:
    """The random ``size²`` crop of the image resized to ``resize²`` — without decoding or resizing the
    pixels outside it; its window drawn from ``seed`` (stateless: :func:`~captioning.data.seeds.seeded`).

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
    for_y, for_x = tf.unstack(tf.random.experimental.stateless_split(seed, 2))
    y = tf.random.stateless_uniform([], for_y, 0, height - crop_h + 1, dtype=tf.int32)
    x = tf.random.stateless_uniform([], for_x, 0, width - crop_w + 1, dtype=tf.int32)
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


def input_files(files: list[str], input_context) -> tuple[list[str], bool]:
    """This input pipeline's files, and whether records must be sharded instead (too few files)."""
    if input_context is None or input_context.num_input_pipelines == 1:
        return files, False
    n, i = input_context.num_input_pipelines, input_context.input_pipeline_id
    if len(files) >= n:
        return files[i::n], False
    return files, True


def pipeline_images(shard_records: list[int], input_context) -> int:
    """How many images (records) one input pipeline reads from a split whose shards hold
    ``shard_records``, under :func:`input_files`' sharding: whole files when there are at least as
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
    files, shard_records = input_files(dataset.files(split), input_context)
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
    @do_not_convert
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
    dataset, shards = sources_of(cfg, dataset, shards)
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
    dataset, shards = sources_of(cfg, dataset, shards)
    ds = parsed_images(cfg, split, training=training, input_context=input_context, shuffle=shuffle, repeat=repeat,
                       max_images=max_images, dataset=dataset, shards=shards)
    order = cfg.deterministic or not training
    if random_crop:
        def decode(example, seed):
            crop, flip = tf.unstack(tf.random.experimental.stateless_split(seed, 2))
            image = decode_random_crop(example["encoded"], cfg.resize_size, cfg.image_size, crop)
            image = tf.image.stateless_random_flip_left_right(image, flip) if cfg.random_flip else image
            return {"image": image, "image_id": example["image_id"], "captions": example["captions"]}

        ds = ds.enumerate().map(seeded(decode, cfg.seed, CROPS, input_context), num_parallel_calls=AUTOTUNE,
                             deterministic=order)
    else:
        @do_not_convert
        def decode(example):
            return {"image": decode_and_resize(example["encoded"], cfg.resize_size), "image_id": example["image_id"],
                    "captions": example["captions"]}

        ds = ds.map(decode, num_parallel_calls=AUTOTUNE, deterministic=order)
    ds.shard_reader = shards  # it must live as long as the dataset: it owns any salvaged shards' scratch files
    return ds


def sources_of(cfg: DataConfig, dataset: PreparedDataset | None,
             shards: ShardReader | None) -> tuple[PreparedDataset, ShardReader]:
    """The prepared dataset of ``cfg.dir`` and the shard reader a command passed, or new ones."""
    return dataset or PreparedDataset.load(cfg.dir), shards or ShardReader(cfg.skip_corrupt)


def references(cfg: DataConfig, split: str, dataset: PreparedDataset | None = None,
               shards: ShardReader | None = None) -> dict[int, list[str]]:
    """Image id → its captions as annotated (the references the metrics compare against). Parses the
    records without decoding a single image."""
    dataset, shards = sources_of(cfg, dataset, shards)
    files = shards.files(dataset, split)
    out = {}
    parse = do_not_convert(schema.parse_batch)
    for batch in tf.data.TFRecordDataset(files).batch(256).map(parse, num_parallel_calls=AUTOTUNE):
        for image_id, texts in zip(batch[schema.IMAGE_ID].numpy(), batch[schema.CAPTION_TEXT].to_list()):
            out[int(image_id)] = [t.decode("utf-8") for t in texts]
    return out


def center_crop(image: tf.Tensor, size: int) -> tf.Tensor:
    """The central ``size × size`` window (evaluation and feature extraction)."""
    offset_h = (tf.shape(image)[0] - size) // 2
    offset_w = (tf.shape(image)[1] - size) // 2
    return tf.image.crop_to_bounding_box(image, offset_h, offset_w, size, size)


def train_crop(image: tf.Tensor, cfg: DataConfig, seed: tf.Tensor) -> tf.Tensor:
    """Training crop and flip of one image, drawn from ``seed`` (stateless: :func:`~captioning.data.seeds.seeded`)."""
    size = cfg.image_size
    crop, flip = tf.unstack(tf.random.experimental.stateless_split(seed, 2))
    if cfg.random_crop:
        image = tf.image.stateless_random_crop(image, [size, size, 3], crop)
    else:
        image = center_crop(image, size)
    if cfg.random_flip:
        image = tf.image.stateless_random_flip_left_right(image, flip)
    return image  # data.color_jitter is applied on the device, in the training step (captioning.augment)


def eval_images(cfg: DataConfig, split: str, batch_size: int, *, input_context=None, max_images: int | None = None,
                dataset: PreparedDataset | None = None, shards: ShardReader | None = None) -> tf.data.Dataset:
    """Batches of ``{"image": uint8 [B, S, S, 3] central crops, "image_id", "captions"}``: the images as
    decoding, evaluation and feature extraction see them."""
    images = image_dataset(cfg, split, training=False, input_context=input_context, max_images=max_images,
                           dataset=dataset, shards=shards)
    return images.map(do_not_convert(lambda ex: {**ex, "image": center_crop(ex["image"], cfg.image_size)}),
                      num_parallel_calls=AUTOTUNE).batch(batch_size).prefetch(AUTOTUNE)
