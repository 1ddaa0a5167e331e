"""Files the tests damage or run: TFRecord shards damaged in place (:func:`damage`), the script that loads an
export in a process without the project (:data:`LOADER`), and the Python snippet of docs/litert.md."""

import os
import re
import struct

import tensorflow as tf

from tests.helpers import REPO

def offsets(path):
    """Start offset of every record, from the length fields (independent of the code under test)."""
    data = open(path, "rb").read()
    out, pos = [], 0
    while pos < len(data):
        out.append(pos)
        pos += 12 + struct.unpack("<Q", data[pos:pos + 8])[0] + 4
    assert pos == len(data)
    return out

def framed(payload: bytes) -> bytes:
    """``payload`` as one TFRecord frame with valid CRCs, written by TensorFlow itself."""
    path = "/tmp/_one_record_%d.tfrecord" % os.getpid()
    with tf.io.TFRecordWriter(path) as w:
        w.write(payload)
    data = open(path, "rb").read()
    os.remove(path)
    return data

def damage(path, kind, record=2):
    """Damages the shard at ``path`` in place; returns the indices of the records that are lost."""
    data = open(path, "rb").read()
    starts = offsets(path)
    n = len(starts)
    ends = starts[1:] + [len(data)]
    if kind == "truncated":  # cut 20 bytes into record 3's data
        data = data[:starts[3] + 12 + 20]
        lost = list(range(3, n))
    elif kind == "flipped":  # one byte inside the record's data: its data CRC no longer matches
        i = starts[record] + 12 + 50
        data = data[:i] + bytes([data[i] ^ 0x40]) + data[i + 1:]
        lost = [record]
    elif kind == "length_flipped":  # record 4's length header: framing is lost until the next record
        i = starts[4] + 1
        data = data[:i] + bytes([data[i] ^ 0x01]) + data[i + 1:]
        lost = [4]
    elif kind == "hole":  # 100 bytes cut out of record 3's data: the next record starts early
        data = data[:starts[3] + 12 + 30] + data[starts[3] + 12 + 130:]
        lost = [3]
    elif kind == "appended":
        data = data + b"\x00garbage appended by a botched cat\n" * 3
        lost = []
    elif kind == "empty":
        data = b""
        lost = list(range(n))
    elif kind == "unparsable":  # record 5 replaced by a validly framed record of the same size
        length = ends[5] - starts[5] - 16
        data = data[:starts[5]] + framed(b"\xff" * length) + data[ends[5]:]
        lost = [5]
    else:
        raise ValueError(kind)
    with open(path, "wb") as f:
        f.write(data)
    return lost


LOADER = r"""
import json, sys
import tensorflow as tf
loaded = tf.saved_model.load(sys.argv[1])  # once, for both signatures
serve = loaded.signatures["serving_default"]
paths = sys.argv[2:]
data = [open(p, "rb").read() for p in paths]
out = serve(images=tf.constant(data))
# the tf.Example signature, as TF Serving / TFX clients send: the same outputs for the same images
examples = [tf.train.Example(features=tf.train.Features(feature={"image/encoded": tf.train.Feature(
    bytes_list=tf.train.BytesList(value=[d]))})).SerializeToString() for d in data]
assert sorted(loaded.signatures) == ["serving_default", "serving_examples"], sorted(loaded.signatures)
from_examples = loaded.signatures["serving_examples"](examples=tf.constant(examples))
assert sorted(from_examples) == sorted(out), (sorted(from_examples), sorted(out))
assert all((from_examples[k].numpy() == out[k].numpy()).all() for k in out)
try:  # an example without the image key fails the call with TensorFlow's own message
    loaded.signatures["serving_examples"](examples=tf.constant([tf.train.Example().SerializeToString()]))
    raise SystemExit("an example without image/encoded was accepted")
except tf.errors.InvalidArgumentError as e:
    assert "image/encoded" in str(e), str(e)
assert not any(m.startswith("captioning") or m.startswith("data_prep") for m in sys.modules), "imported the project"
print(json.dumps([{"image": p, "captions": [c.decode() for c in caps], "log_probs": [float(x) for x in lps]}
                  for p, caps, lps in zip(paths, out["captions"].numpy(), out["log_probs"].numpy())]))
"""


def doc_snippet() -> str:
    text = open(os.path.join(REPO, "docs", "litert.md"), encoding="utf-8").read()
    blocks = re.findall(r"```python\n(.*?)```", text, re.S)
    assert len(blocks) == 1, "docs/litert.md: one Python snippet"
    return blocks[0]
