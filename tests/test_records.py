"""The TensorFlow-free writer side of the record format equals TensorFlow's, byte for byte."""

import subprocess
import sys

import numpy as np
import tensorflow as tf

from captioning.data import schema
from data_prep import records


def _tf_example(image_id, filename, jpeg, height, width, captions, caption_ids) -> bytes:
    def ints(v):
        return tf.train.Feature(int64_list=tf.train.Int64List(value=v))

    def strings(v):
        return tf.train.Feature(bytes_list=tf.train.BytesList(value=v))

    feature = {
        schema.IMAGE_ID: ints([image_id]), schema.IMAGE_FILENAME: strings([filename.encode()]),
        schema.IMAGE_ENCODED: strings([jpeg]), schema.IMAGE_HEIGHT: ints([height]), schema.IMAGE_WIDTH: ints([width]),
        schema.CAPTION_TEXT: strings([c.encode() for c in captions]),
        schema.CAPTION_IDS: ints([i for ids in caption_ids for i in ids]),
        schema.CAPTION_LENGTH: ints([len(ids) for ids in caption_ids]),
    }
    return tf.train.Example(features=tf.train.Features(feature=feature)).SerializeToString(deterministic=True)


def _random_records(count: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    for i in range(count):
        n = int(rng.integers(1, 8))
        ids = [[1] + rng.integers(0, 2**40 if i % 3 == 0 else 200, int(rng.integers(0, 25))).tolist() + [2]
               for _ in range(n)]
        yield dict(image_id=int(rng.integers(0, 2**62)) if i % 2 else i, filename=f"ü{i}.jpg",
                   jpeg=rng.bytes(int(rng.integers(0, 300000 if i == 0 else 3000))), height=int(rng.integers(1, 9000)),
                   width=int(rng.integers(1, 9000)), captions=[f"caption {j} ✓" for j in range(n)], caption_ids=ids)


def test_examples_equal_tensorflows_deterministic_serialisation():
    for fields in _random_records(40):
        assert records.encode_example(**fields) == _tf_example(**fields)


def test_features_of_every_kind_and_edge_value_equal_tensorflows():
    for values in ([], [0], [-1], [2**63 - 1], [-(2**63)], [127, 128, 16383, 16384]):
        expected = tf.train.Feature(int64_list=tf.train.Int64List(value=values)).SerializeToString()
        assert records.int64_feature(values) == expected
    for values in ([], [b""], [b"a" * 200], [bytes(range(256)), b"x"]):
        expected = tf.train.Feature(bytes_list=tf.train.BytesList(value=values)).SerializeToString()
        assert records.bytes_feature(values) == expected


def test_record_files_equal_tfrecordwriters(tmp_path):
    data = [records.encode_example(**fields) for fields in _random_records(12, seed=1)] + [b""]
    ours, theirs = tmp_path / "ours.tfrecord", tmp_path / "theirs.tfrecord"
    with records.RecordWriter(str(ours)) as writer:
        for record in data:
            writer.write(record)
    with tf.io.TFRecordWriter(str(theirs)) as writer:
        for record in data:
            writer.write(record)
    assert ours.read_bytes() == theirs.read_bytes()
    assert [r.numpy() for r in tf.data.TFRecordDataset(str(ours))] == data


def test_the_writer_side_never_imports_tensorflow(tmp_path):
    """prepare's worker processes start in a fraction of a second because of this."""
    script = f"""
import sys
from data_prep.writer import Item, ShardTask, write_shard
from PIL import Image
import io
buf = io.BytesIO(); Image.new("RGB", (20, 10), (200, 0, 0)).save(buf, "JPEG")
task = ShardTask("train", {str(tmp_path / 'train-00000-of-00001.tfrecord')!r}, {str(tmp_path / 's.json')!r},
                 [Item(7, "a.jpg", None, ["a red box"], [[1, 4, 2]])], None, 95, data=[buf.getvalue()])
stats = write_shard(task)
assert stats["images"] == 1, stats
assert "tensorflow" not in sys.modules, "the writer imported TensorFlow"
"""
    subprocess.run([sys.executable, "-c", script], check=True, timeout=60)
    parsed = next(iter(tf.data.TFRecordDataset(str(tmp_path / "train-00000-of-00001.tfrecord")).batch(1)
                       .map(schema.parse_batch)))
    assert int(parsed[schema.IMAGE_ID][0]) == 7
    assert parsed[schema.CAPTION_IDS].to_list() == [[[1, 4, 2]]]
