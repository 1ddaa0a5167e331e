"""Reading a prepared dataset's records: shard files → parsed records → decoded images, the decoding every
stage shares (training's input pipeline, evaluation, feature extraction, ``caption`` and the exported
SavedModel), and the references. The images' geometry (resize, crops) is the encoder's preprocessor's
(:class:`~captioning.data.preprocessor.ImagePreprocessor`), which the functions here are handed (by default
the one of the data settings, :meth:`~captioning.data.preprocessor.ImagePreprocessor.of`).

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

from captioning.config.sections import DataConfig
from captioning.data import schema
from captioning.data.integrity import ShardReader
from captioning.data.prepared import PreparedDataset
from captioning.data.preprocessor import ImagePreprocessor, resize
from captioning.data.seeds import CROPS, seeded

AUTOTUNE = tf.data.AUTOTUNE


def _decode_jpeg(encoded: tf.Tensor) -> tf.Tensor:
    return tf.io.decode_jpeg(encoded, channels=3, dct_method="INTEGER_FAST")


def squash(image: tf.Tensor, size: int) -> tf.Tensor:
    """Any ``[H, W, 3]`` image → ``uint8 [size, size, 3]``, squashed to the square with the preprocessor's resize
    (:func:`captioning.data.preprocessor.resize`): a model reading regions sees the whole image so."""
    return resize(image, size)


def decode_and_resize(encoded: tf.Tensor, preprocessor: ImagePreprocessor) -> tf.Tensor:
    """JPEG bytes → ``uint8 [R, R, 3]``: decoded, then the preprocessor's stage 1 (squashed to a square, as
    im2txt resized to 346²)."""
    return preprocessor.resized(_decode_jpeg(encoded))


def decode_random_crop(encoded: tf.Tensor, preprocessor: ImagePreprocessor, seed: tf.Tensor) -> tf.Tensor:
    """The preprocessor's random ``S²`` crop of the image resized to ``R²``, without decoding or resizing the
    pixels outside it; its window drawn from ``seed`` (stateless: :func:`~captioning.data.seeds.seeded`).

    The window of source pixels that becomes the crop
    (:meth:`~captioning.data.preprocessor.ImagePreprocessor.crop_window`) is cut out while decoding
    (``decode_and_crop_jpeg``: libjpeg skips the rows below it and the IDCT outside it) and only S² pixels are
    resized instead of R². For im2txt's 346 → 299 on a 640×480 photo that skips 25% of the decode and resize
    work.
    """
    shape = tf.io.extract_jpeg_shape(encoded)  # the header only
    window = preprocessor.crop_window(shape[0], shape[1], seed)
    image = tf.io.decode_and_crop_jpeg(encoded, window, channels=3, dct_method="INTEGER_FAST")
    return preprocessor.window_resized(image)


def decoded(encoded: tf.Tensor) -> tf.Tensor:
    """JPEG, PNG, GIF or BMP bytes → ``uint8 [H, W, 3]``, upright: the one decode of a user's image. JPEGs are
    decoded exactly as the training records are. A JPEG tagged with another EXIF orientation than 1 (a phone
    photo; ``caption`` and ``serve`` give the model such a photo upright, as a PNG Pillow decoded) is decoded as
    Pillow decodes it (libjpeg's accurate integer DCT: the same pixels, measured on 218 JPEGs) and turned upright
    (:func:`upright`), so the SavedModel sees the pixels ``caption`` sees."""
    return tf.cond(tf.io.is_jpeg(encoded), lambda: _decode_upright(encoded),
                   lambda: tf.io.decode_image(encoded, channels=3, expand_animations=False))


def model_input(encoded: tf.Tensor, preprocessor: ImagePreprocessor) -> tf.Tensor:
    """JPEG, PNG, GIF or BMP bytes → the ``uint8 [S, S, 3]`` central crop the model sees at evaluation:
    :func:`decoded`, then the preprocessor's :meth:`~captioning.data.preprocessor.ImagePreprocessor.pixels`.
    ``caption``, ``serve`` and the exported SavedModel all call this, so they give the same captions."""
    return preprocessor.pixels(decoded(encoded))


def _decode_upright(encoded: tf.Tensor) -> tf.Tensor:
    orientation = exif_orientation(encoded)
    image = tf.cond(tf.equal(orientation, 1), lambda: _decode_jpeg(encoded),
                    lambda: tf.io.decode_jpeg(encoded, channels=3, dct_method="INTEGER_ACCURATE"))
    return upright(image, orientation)


EXIF_HEAD = 1 << 17  # the bytes of a JPEG searched for its EXIF segment: APP0 and a full APP2 (64 KiB) before it
EXIF_SEGMENTS = 16  # the markers walked before the EXIF segment
EXIF_ENTRIES = 64  # the IFD0 entries read (a camera's IFD0 holds 10-20)


def exif_orientation(encoded: tf.Tensor) -> tf.Tensor:
    """A JPEG's EXIF orientation (the tag 0x0112 of IFD0, ``int32`` 1-8), read in TensorFlow ops as Pillow's
    ``getexif()`` reads it: the markers after SOI are walked (at most :data:`EXIF_SEGMENTS`, within the first
    :data:`EXIF_HEAD` bytes, stopping at the image data) to the APP1 segment starting ``Exif\\0\\0``, whose TIFF
    header gives the byte order (``II`` or ``MM``) and IFD0's offset; the first :data:`EXIF_ENTRIES` entries of
    IFD0 inside the segment are searched for the tag (type SHORT, or LONG). Anything else (no such segment, a
    truncated or malformed one, a value outside 1-8, the tag only in a later IFD) is 1, never an error: every
    index is clipped into the bytes read, which end with zeros."""
    data = tf.pad(tf.cast(tf.io.decode_raw(tf.strings.substr(encoded, 0, EXIF_HEAD), tf.uint8), tf.int64), [[0, 16]])
    last = tf.size(data, out_type=tf.int64) - 1  # a zero

    def at(index):
        return tf.gather(data, tf.clip_by_value(index, 0, last))

    def walk(position, tiff, end):  # one marker: the Exif APP1 (its TIFF header's position, its end), or the next
        length = at(position + 2) * 256 + at(position + 3)
        exif = tf.logical_and(tf.equal(at(position + 1), 0xE1), tf.reduce_all(tf.equal(
            at(position + 4 + tf.range(6, dtype=tf.int64)), tf.constant([0x45, 0x78, 0x69, 0x66, 0, 0], tf.int64))))
        return (position + 2 + length, tf.where(exif, position + 10, tiff),
                tf.where(exif, position + 2 + length, end))

    def more(position, tiff, end):  # a marker (0xFF, not SOS or EOI) within the bytes read, and none found yet
        marker = at(position + 1)
        return tf.reduce_all([tf.less(tiff, 0), tf.less(position + 4, EXIF_HEAD), tf.equal(at(position), 0xFF),
                              tf.not_equal(marker, 0xDA), tf.not_equal(marker, 0xD9)])

    start = tf.constant(2, tf.int64), tf.constant(-1, tf.int64), tf.constant(0, tf.int64)
    _, tiff, end = tf.while_loop(more, walk, start, maximum_iterations=EXIF_SEGMENTS)
    little = tf.logical_and(tf.equal(at(tiff), 0x49), tf.equal(at(tiff + 1), 0x49))  # "II"; "MM": big-endian
    big = tf.logical_and(tf.equal(at(tiff), 0x4D), tf.equal(at(tiff + 1), 0x4D))

    def number(index, size):  # unsigned, in the TIFF header's byte order, at each of ``index``
        digits = at(index[..., None] + tf.range(size, dtype=tf.int64))
        low_first = tf.constant([256 ** i for i in range(size)], tf.int64)  # two constants: a reversed slice
        high_first = tf.constant([256 ** i for i in reversed(range(size))], tf.int64)  # trips grappler's layout pass
        return tf.where(little, tf.reduce_sum(digits * low_first, -1), tf.reduce_sum(digits * high_first, -1))

    ifd = tiff + tf.minimum(number(tiff + 4, 4), EXIF_HEAD)
    entries = ifd + 2 + 12 * tf.range(EXIF_ENTRIES, dtype=tf.int64)
    kinds = number(entries + 2, 2)  # SHORT (3), as the standard says, or LONG (4), as some writers store it
    values = tf.where(tf.equal(kinds, 3), number(entries + 8, 2), number(entries + 8, 4))
    wanted = tf.reduce_all([tf.equal(number(entries, 2), 0x0112), tf.logical_or(tf.equal(kinds, 3), tf.equal(kinds, 4)),
                            tf.less(tf.range(EXIF_ENTRIES, dtype=tf.int64), number(ifd, 2)),
                            tf.less_equal(entries + 12, end)], axis=0)
    value = tf.gather(values, tf.argmax(tf.cast(wanted, tf.int32)))
    valid = tf.reduce_all([tiff >= 0, tf.logical_or(little, big), tf.equal(number(tiff + 2, 2), 42),
                           tf.reduce_any(wanted), value >= 1, value <= 8])
    return tf.cast(tf.where(valid, value, 1), tf.int32)


def upright(image: tf.Tensor, orientation: tf.Tensor) -> tf.Tensor:
    """``image [H, W, C]`` as shown under the EXIF ``orientation`` (1-8), as Pillow's ``ImageOps.exif_transpose``
    turns it: 5-8 transpose it first, then 2, 3, 6, 7 reverse its columns and 3, 4, 7, 8 its rows."""
    image = tf.cond(orientation >= 5, lambda: tf.transpose(image, [1, 0, 2]), lambda: image)
    columns = tf.reduce_any(tf.equal(orientation, [2, 3, 6, 7]))
    image = tf.cond(columns, lambda: tf.reverse(image, [1]), lambda: image)
    return tf.cond(tf.reduce_any(tf.equal(orientation, [3, 4, 7, 8])), lambda: tf.reverse(image, [0]), lambda: image)


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


def reads_text(tokenizer) -> bool:
    """Whether ``tokenizer`` (a :class:`captioning.data.tokenizers.base.Tokenizer`, or None: the records' word ids)
    tokenizes the records' caption text instead of reading their ``caption/ids``."""
    return tokenizer is not None and tokenizer.kind != "words"


def _parsed(records: tf.data.Dataset, cfg: DataConfig, tokenizer=None) -> tf.data.Dataset:
    """Batches of parsed records, ``captions`` in ``tokenizer``'s ids: the records' own (the words tokenizer, or
    None), or their text tokenized here, a parse batch at a time (a subword tokenizer: ``data.tokenizer: preset``)."""
    @do_not_convert
    def parse(serialized):
        batch = schema.parse_batch(serialized)
        captions = batch[schema.CAPTION_IDS]
        if reads_text(tokenizer):
            captions = tokenizer.image_captions(captions, batch[schema.CAPTION_TEXT])
        return {"encoded": batch[schema.IMAGE_ENCODED], "image_id": batch[schema.IMAGE_ID], "captions": captions}

    return records.batch(cfg.parse_batch_size).map(parse, num_parallel_calls=AUTOTUNE)


def parsed_images(cfg: DataConfig, split: str, *, training: bool, input_context=None, shuffle: bool = False,
                  repeat: bool = False, max_images: int | None = None, dataset: PreparedDataset | None = None,
                  shards: ShardReader | None = None, tokenizer=None) -> tf.data.Dataset:
    """One element per image, not decoded: ``{"encoded": JPEG bytes, "image_id", "captions"}`` (the
    arguments as :func:`image_dataset`'s)."""
    dataset, shards = sources_of(cfg, dataset, shards)
    records = _records(dataset, split, shards, cfg, training, input_context, shuffle, repeat)
    ds = _parsed(records, cfg, tokenizer).unbatch()
    if max_images:
        ds = ds.take(max_images)
    ds.shard_reader = shards
    return ds


def image_dataset(cfg: DataConfig, split: str, *, training: bool, input_context=None, shuffle: bool = False,
                  repeat: bool = False, max_images: int | None = None, random_crop: bool = False,
                  dataset: PreparedDataset | None = None, shards: ShardReader | None = None,
                  preprocessor: ImagePreprocessor | None = None, tokenizer=None) -> tf.data.Dataset:
    """One element per image: ``{"image": uint8 [R, R, 3], "image_id", "captions": ragged [(C), (T)]}``,
    R = ``resize_size``, resized by ``preprocessor`` (the encoder's; default: the data settings',
    :meth:`~captioning.data.preprocessor.ImagePreprocessor.of`); not cropped. ``shuffle`` and ``repeat`` act on the serialised records;
    ``max_images`` keeps only the first images (in evaluation order). Images may have different numbers
    of captions (COCO: 5 to 7): the ragged ``captions`` batch; the raw texts come from :func:`references`.

    ``random_crop=True`` gives the preprocessor's training crop instead, ``image_size`` square, decoding only the crop
    window (:func:`decode_random_crop`), and flipped at random when ``random_flip``: one map, the
    whole per-image training work.

    ``dataset`` is ``cfg.dir``'s :class:`~captioning.dataset.PreparedDataset` (loaded when not given);
    ``shards`` the command's :class:`~captioning.integrity.ShardReader` (a new one when not given). ``captions``
    are ``tokenizer``'s ids (:mod:`captioning.data.tokenizers`; None: the records' word ids, as the words
    tokenizer reads them)."""
    dataset, shards = sources_of(cfg, dataset, shards)
    preprocessor = preprocessor or ImagePreprocessor.of(cfg)
    ds = parsed_images(cfg, split, training=training, input_context=input_context, shuffle=shuffle, repeat=repeat,
                       max_images=max_images, dataset=dataset, shards=shards, tokenizer=tokenizer)
    order = cfg.deterministic or not training
    if random_crop:
        def decode(example, seed):
            crop, flip = tf.unstack(tf.random.experimental.stateless_split(seed, 2))
            image = decode_random_crop(example["encoded"], preprocessor, crop)
            image = tf.image.stateless_random_flip_left_right(image, flip) if cfg.random_flip else image
            return {"image": image, "image_id": example["image_id"], "captions": example["captions"]}

        ds = ds.enumerate().map(seeded(decode, cfg.seed, CROPS, input_context), num_parallel_calls=AUTOTUNE,
                             deterministic=order)
    else:
        @do_not_convert
        def decode(example):
            return {"image": decode_and_resize(example["encoded"], preprocessor), "image_id": example["image_id"],
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


def train_crop(image: tf.Tensor, cfg: DataConfig, preprocessor: ImagePreprocessor, seed: tf.Tensor) -> tf.Tensor:
    """Training crop (the preprocessor's random window with ``data.random_crop``, else its central one) and flip
    of one resized image, drawn from ``seed`` (stateless: :func:`~captioning.data.seeds.seeded`)."""
    crop, flip = tf.unstack(tf.random.experimental.stateless_split(seed, 2))
    if cfg.random_crop:
        image = preprocessor.random_cropped(image, crop)
    else:
        image = preprocessor.cropped(image)
    if cfg.random_flip:
        image = tf.image.stateless_random_flip_left_right(image, flip)
    return image  # data.color_jitter is applied on the device, in the training step (captioning.augment)


def eval_images(cfg: DataConfig, split: str, batch_size: int, *, input_context=None, max_images: int | None = None,
                dataset: PreparedDataset | None = None, shards: ShardReader | None = None,
                preprocessor: ImagePreprocessor | None = None, tokenizer=None) -> tf.data.Dataset:
    """Batches of ``{"image": uint8 [B, S, S, 3] central crops, "image_id", "captions"}``: the images as
    decoding, evaluation and feature extraction see them, cropped by ``preprocessor`` (the encoder's; default:
    the data settings'), the captions in ``tokenizer``'s ids (as :func:`image_dataset`'s)."""
    preprocessor = preprocessor or ImagePreprocessor.of(cfg)
    images = image_dataset(cfg, split, training=False, input_context=input_context, max_images=max_images,
                           dataset=dataset, shards=shards, preprocessor=preprocessor, tokenizer=tokenizer)
    return images.map(do_not_convert(lambda ex: {**ex, "image": preprocessor.cropped(ex["image"])}),
                      num_parallel_calls=AUTOTUNE).batch(batch_size).prefetch(AUTOTUNE)
