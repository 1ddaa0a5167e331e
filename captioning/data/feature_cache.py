"""``data.cache: features``: the frozen encoder runs once per image; its outputs are kept on disk as
float16 and every later epoch and run reads them instead of decoding and encoding again.

Pooled features (Show and Tell) are ``[D]`` per image; grid features (attention) ``[cells, D]``. On
disk each image is one record of a TFRecord file (``image/id``, the captions' ids and lengths as in the
prepared records, and the features' float16 bytes). Bytes per image, float16:

=============================  ===========  ===================  =============================
encoder (image size)           features     per image            COCO (123,287 images)
=============================  ===========  ===================  =============================
Inception v3 pooled (299)      2,048        4 KB                 0.5 GB
Inception v3 grid (299)        8 × 8 × 2,048  256 KB             31.6 GB
ResNet-50 grid (224)           7 × 7 × 2,048  196 KB             24.2 GB
``small_cnn`` grid (64)        4 × 4 × 128    4 KB               0.5 GB
=============================  ===========  ===================  =============================

(float16 halves float32 and changes a feature by at most 2⁻¹¹ of its size; the model casts it back
to its compute dtype on the device, so the host sends half the bytes.)

The file is written as ``NAME.tmp`` while the encoder runs over the split (one batch at a time: memory
stays flat however large the split), then renamed: a killed run leaves no file that is ever read. Its
name holds a hash of everything the features depend on — the prepared dataset's identity, the split,
the image sizes, the input pipeline's share, ``max_images``, and ``feature_key``, which names the encoder
*and its weights* (:func:`encoder_key`) — so features of another encoder, other weights or other data
are never read. Writers take the same lock as ``data.cache: disk`` (:func:`captioning.data.disk_cache.claim`).
"""

from __future__ import annotations

import hashlib
import os
from typing import Callable

import numpy as np
import tensorflow as tf
from tensorflow.autograph.experimental import do_not_convert

from captioning.data import disk_cache
from captioning.config.sections import DataConfig
from captioning.data.prepared import PreparedDataset
from captioning.fileio import disk_full_error
from captioning.data.integrity import ShardReader
from captioning.data.preprocessor import ImagePreprocessor
from captioning.data.reading import eval_images, reads_text

FORMAT_VERSION = 1


def encoder_key(encoder) -> str:
    """A name for a Keras encoder and its weights: its name, and a hash of every weight's place in the
    encoder's weight list, own name (``kernel``, ``gamma``), shape and bytes (Inception v3's 22M weights hash in
    about 0.1 s). Not the weights' paths: Keras names a layer built without a name after how many of its kind
    the process built before (``normalization`` in a process's first EfficientNet, ``normalization_1`` in its
    second), so a second model in one process (``benchmark train --compare``'s rounds) would find another key
    for the same weights and fill the cache again. The same seeded model gives the same key in every process
    and every build (tests/test_disk_cache.py)."""
    digest = hashlib.sha256(encoder.name.encode())
    for i, variable in enumerate(encoder.weights):
        value = np.ascontiguousarray(variable.numpy())
        digest.update(f"{i}:{variable.name}:{value.shape}:{value.dtype}".encode())
        digest.update(value.tobytes())
    return f"{encoder.name}-{digest.hexdigest()[:16]}"


def features_dataset(cfg: DataConfig, split: str, feature_fn: Callable, feature_key: str, cache_dir: str, *,
                     input_context=None, max_images: int | None = None, dataset: PreparedDataset,
                     shards: ShardReader, batch_size: int = 64,
                     preprocessor: ImagePreprocessor | None = None, tokenizer=None) -> tf.data.Dataset:
    """One element per image: ``{"features": float16 [...], "image_id", "captions": ragged [(C), (T)]}``,
    from the cache file (written first if it is not there; see the module docstring). ``feature_fn``
    maps a batch of ``uint8`` central crops (``preprocessor``'s: the encoder's; default: the data settings')
    to features. The file's name holds the preprocessor's sizes, and the identity of a ``tokenizer`` that wrote the
    captions' ids from their text (:func:`captioning.data.reading.image_dataset`'s)."""
    preprocessor = preprocessor or ImagePreprocessor.of(cfg)
    n, i = (input_context.num_input_pipelines, input_context.input_pipeline_id) if input_context else (1, 0)
    prefix, key = disk_cache.cache_prefix(cache_dir, dataset.identity, split, preprocessor.resize_size,
                                          cfg.skip_corrupt, i, n, max_images,
                                          tokenizer.identity if reads_text(tokenizer) else None)
    key = {**key, "image_size": preprocessor.image_size, "features": feature_key, "format": FORMAT_VERSION}
    name = hashlib.sha256(repr(sorted(key.items())).encode()).hexdigest()[:16]
    prefix = os.path.join(cache_dir, f"features-{split}-{name}-{i}of{n}")
    path = prefix + ".tfrecord"
    disk_cache.claim(prefix, key, complete=".tfrecord", leftovers=(".tfrecord.tmp",), what="data.cache: features")
    if not os.path.exists(path):
        images = eval_images(cfg, split, batch_size, input_context=input_context, max_images=max_images,
                             dataset=dataset, shards=shards, preprocessor=preprocessor, tokenizer=tokenizer)
        try:
            with tf.io.TFRecordWriter(path + ".tmp") as writer:
                shape = None
                for batch in images:
                    features = np.asarray(feature_fn(batch["image"]), np.float16)
                    if shape is None:  # the first record: the features' shape per image
                        shape = features.shape[1:]
                        writer.write(_example({"shape": _ints(shape)}))
                    for row, (image_id, captions) in enumerate(zip(batch["image_id"].numpy(),
                                                                   batch["captions"].to_list())):
                        writer.write(_example({
                            "image/id": _ints([image_id]),
                            "features": tf.train.Feature(bytes_list=tf.train.BytesList(value=[features[row].tobytes()])),
                            "caption/ids": _ints([t for c in captions for t in c]),
                            "caption/length": _ints([len(c) for c in captions])}))
                if shape is None:  # no image in this share: the shape still goes first
                    size = preprocessor.image_size
                    writer.write(_example({"shape": _ints(np.shape(feature_fn(tf.zeros([1, size, size, 3], tf.uint8)))[1:])}))
            os.replace(path + ".tmp", path)
        except (OSError, tf.errors.OpError) as e:
            raise disk_full_error(e, cache_dir, "the features cache (data.cache: features)") or e
    return _read(path)


def _ints(values) -> tf.train.Feature:
    return tf.train.Feature(int64_list=tf.train.Int64List(value=[int(v) for v in values]))


def _example(feature: dict) -> bytes:
    return tf.train.Example(features=tf.train.Features(feature=feature)).SerializeToString()


def _read(path: str) -> tf.data.Dataset:
    records = tf.data.TFRecordDataset(path)
    first = next(iter(records.take(1)))
    shape = tf.io.parse_single_example(first, {"shape": tf.io.VarLenFeature(tf.int64)})["shape"].values.numpy()
    spec = {"image/id": tf.io.FixedLenFeature([], tf.int64), "features": tf.io.FixedLenFeature([], tf.string),
            "caption/ids": tf.io.RaggedFeature(tf.int64, value_key="caption/ids",
                                               partitions=[tf.io.RaggedFeature.RowLengths("caption/length")])}

    @do_not_convert
    def parse(serialized):
        ex = tf.io.parse_example(serialized, spec)
        features = tf.reshape(tf.io.decode_raw(ex["features"], tf.float16), [-1, *shape])
        return {"features": features, "image_id": ex["image/id"], "captions": ex["caption/ids"]}

    return records.skip(1).batch(256).map(parse, num_parallel_calls=tf.data.AUTOTUNE).unbatch()
