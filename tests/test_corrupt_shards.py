"""Damaged TFRecord shards, made by damaging real prepared shards: cut mid-record, a flipped byte (CRC
mismatch), garbage appended, emptied, a validly framed record that is not an Example, a broken length
header, a deleted file. By default the commands stop with one line naming the shard (exit code 2, no
traceback); with ``data.skip_corrupt: true`` they read every intact record and say how many they skipped.
"""

import glob
import json
import os
import re
import shutil

import pytest
import tensorflow as tf

from captioning.data import integrity, schema
from captioning.config import save_config
from captioning.data.prepared import MANIFEST
from captioning.errors import InputError
from captioning.data.pipeline import make_dataset
from captioning.data.reading import image_dataset, references
from tests.helpers import copy_model, run_cli, small_train_config
from tests.harness.files import damage, offsets

SHARD = "train-00001-of-00004.tfrecord"  # 8 records in the shapes fixture


def ids_in(path):
    return [int(r[schema.IMAGE_ID][0]) for r in
            (schema.parse_batch(tf.reshape(s, [1])) for s in tf.data.TFRecordDataset(path))]


@pytest.fixture
def data_copy(prepared_dir, tmp_path):
    out = tmp_path / "records"
    shutil.copytree(prepared_dir, out)
    return str(out)


def drop_shard_sizes(data_dir):
    """A manifest as prepare wrote it before shard_records / shard_bytes existed."""
    path = os.path.join(data_dir, MANIFEST)
    manifest = json.load(open(path))
    for split in manifest["splits"].values():
        split.pop("shard_records", None)
        split.pop("shard_bytes", None)
    json.dump(manifest, open(path, "w"))


def read_everything(cfg, splits=("train",)):
    """What train and evaluate do with the data, in-process, with one ShardReader and its named_errors()."""
    with integrity.ShardReader(cfg.data.skip_corrupt) as shards, shards.named_errors():
        for split in splits:
            for _ in make_dataset(cfg.data, split, training=False, batch_size=8, shards=shards):
                pass
            references(cfg.data, split, shards=shards)


def test_manifest_records_each_shards_size(prepared_dir):
    manifest = json.load(open(os.path.join(prepared_dir, MANIFEST)))
    for split in manifest["splits"].values():
        assert len(split["shard_records"]) == len(split["shard_bytes"]) == len(split["shards"])
        assert sum(split["shard_records"]) == split["images"]
        for name, records, size in zip(split["shards"], split["shard_records"], split["shard_bytes"]):
            assert os.path.getsize(os.path.join(prepared_dir, name)) == size
            assert len(offsets(os.path.join(prepared_dir, name))) == records


@pytest.mark.parametrize("kind, old_manifest, says", [
    ("truncated", False, r"\d+ bytes where manifest.json says \d+ \(cut short\)"),
    ("appended", False, r"with bytes appended"),
    ("empty", False, r"0 bytes where manifest.json says \d+"),
    ("flipped", False, r"corrupted record \(CRC mismatch\) at byte \d+; 7 of its 8 records readable"),
    ("unparsable", False, r"not a tf.train.Example of this schema at byte \d+; 7 of its 8 records"),
    ("length_flipped", False, r"corrupted record \(CRC mismatch\) at byte \d+"),
    ("truncated", True, r"truncated record at byte \d+"),  # no sizes in the manifest: found while reading
    ("appended", True, r"at byte \d+"),
])
def test_damaged_shard_is_named_in_one_error(data_copy, kind, old_manifest, says):
    path = os.path.join(data_copy, SHARD)
    damage(path, kind)
    if old_manifest:
        drop_shard_sizes(data_copy)
    cfg = small_train_config(data_copy)
    with pytest.raises(InputError) as e:
        read_everything(cfg)
    message = str(e.value)
    assert message.startswith(f"damaged shard {path}: ") and "\n" not in message
    assert re.search(says, message), message
    assert "data.skip_corrupt: true" in message


def test_missing_shard_is_named(data_copy):
    os.remove(os.path.join(data_copy, SHARD))
    with pytest.raises(InputError, match=re.escape(f"damaged shard {os.path.join(data_copy, SHARD)}: the file "
                                                   "is missing")):
        read_everything(small_train_config(data_copy))


def test_other_errors_pass_through_unchanged(data_copy):
    cfg = small_train_config(data_copy)
    with pytest.raises(tf.errors.InvalidArgumentError, match="Could not parse example"):
        # the files are intact: the error is not theirs to explain
        with integrity.ShardReader() as shards, shards.named_errors():
            make_dataset(cfg.data, "train", training=False, batch_size=8, shards=shards)
            raise tf.errors.InvalidArgumentError(None, None, "Could not parse example input (something else)")


def test_intact_data_is_not_scanned(prepared_dir, monkeypatch):
    """The default path costs a stat per shard: no record is read in Python, nothing is scanned."""
    def fail(*a, **k):
        raise AssertionError("scanned on the default path")

    monkeypatch.setattr(integrity, "scan_shard", fail)
    monkeypatch.setattr(integrity, "_fast_count", fail)
    read_everything(small_train_config(prepared_dir), ("train", "val"))


def damage_many(data_dir):
    """Damages every train shard differently, and one val shard; returns the image ids that survive."""
    kinds = {"train-00000-of-00004.tfrecord": "flipped", "train-00001-of-00004.tfrecord": "truncated",
             "train-00002-of-00004.tfrecord": "unparsable", "train-00003-of-00004.tfrecord": "appended",
             "val-00001-of-00004.tfrecord": "empty"}
    kept, lost = {}, {}
    for name, kind in kinds.items():
        path = os.path.join(data_dir, name)
        ids = ids_in(path)
        gone = damage(path, kind)
        kept[name] = [i for k, i in enumerate(ids) if k not in gone]
        lost[name] = len(gone)
    return kept, lost


def test_skip_corrupt_reads_every_intact_record_and_counts_the_rest(data_copy, caplog):
    kept, lost = damage_many(data_copy)
    cfg = small_train_config(data_copy, "data.skip_corrupt=true")
    with caplog.at_level("WARNING", logger="captioning.data"):
        got = [int(ex["image_id"]) for ex in image_dataset(cfg.data, "train", training=False)]
    expected = [i for name in sorted(kept) if name.startswith("train") for i in kept[name]]
    assert sorted(got) == sorted(expected)  # every intact record, once; nothing else
    for name, count in lost.items():
        if name.startswith("train"):
            assert any(name in r.message and f"skipped {count} record(s)" in r.message for r in caplog.records), name
    assert "4 of 4 shard(s) damaged, 7 record(s) skipped in all" in caplog.text
    val = [int(ex["image_id"]) for ex in image_dataset(cfg.data, "val", training=False)]
    assert len(val) == 3 and len(references(cfg.data, "val")) == 3
    # the damaged originals are untouched; scratch copies are read instead
    assert os.path.getsize(os.path.join(data_copy, "val-00001-of-00004.tfrecord")) == 0


def test_header_search_finds_every_record(prepared_dir):
    path = os.path.join(prepared_dir, SHARD)
    found = list(integrity._header_candidates(path, 0, os.path.getsize(path), chunk=4096))  # several chunks
    assert set(offsets(path)) <= set(found) and len(found) < len(offsets(path)) + 3


@pytest.mark.parametrize("kind", ["length_flipped", "hole", "flipped"])
def test_skip_corrupt_reads_on_after_the_damage(data_copy, kind):
    path = os.path.join(data_copy, SHARD)
    ids = ids_in(path)
    lost = damage(path, kind)
    drop_shard_sizes(data_copy)  # resynchronisation, not the manifest, finds the records after it
    scan = integrity.scan_shard(path, salvage_to=os.path.join(data_copy, "salvaged"))
    assert (scan.records, scan.skipped, len(lost)) == (7, 1, 1)
    assert ids_in(os.path.join(data_copy, "salvaged")) == [i for k, i in enumerate(ids) if k not in lost]


def test_skip_corrupt_with_a_missing_shard(data_copy, caplog):
    os.remove(os.path.join(data_copy, SHARD))
    cfg = small_train_config(data_copy, "data.skip_corrupt=true")
    with caplog.at_level("WARNING", logger="captioning.data"):
        assert len(references(cfg.data, "train")) == 24
    assert "skipped 8 record(s), kept 0 (the file is missing)" in caplog.text


# ---- through the real command line --------------------------------------------------------------------------
def write_config(tmp_path, data_dir, *extra):
    path = tmp_path / "config.yaml"
    save_config(small_train_config(data_dir, "train.steps=4", *extra), str(path))
    return str(path)


def assert_one_line_error(result, command, path):
    assert result.returncode == 2, result.stderr[-3000:]
    assert "Traceback" not in result.stderr
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith(f"captioning {command}: error: damaged shard {path}: "), result.stderr[-3000:]
    assert "data.skip_corrupt: true" in last


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["flipped", "unparsable", "truncated"])
def test_train_cli_stops_with_one_line_naming_the_shard(data_copy, tmp_path, kind):
    path = os.path.join(data_copy, SHARD)
    damage(path, kind)
    result = run_cli("train", "--config", write_config(tmp_path, data_copy), "--model-dir", str(tmp_path / "m"))
    assert_one_line_error(result, "train", path)
    assert not [n for n in os.listdir(tmp_path / "m") if n.startswith("ckpt-")]


@pytest.mark.slow
def test_train_cli_skip_corrupt_trains_and_reports(data_copy, tmp_path):
    damage_many(data_copy)
    result = run_cli("train", "--config", write_config(tmp_path, data_copy, "train.eval_every_steps=4"),
                     "--model-dir", str(tmp_path / "m"), "--set", "data.skip_corrupt=true")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "trained to step 4" in result.stdout
    assert f"{os.path.join(data_copy, 'train-00001-of-00004.tfrecord')}: skipped 5 record(s), kept 3" in result.stderr
    assert "4 of 4 shard(s) damaged, 7 record(s) skipped in all" in result.stderr
    assert "val-00001-of-00004.tfrecord: skipped 1 record(s), kept 0" in result.stderr  # evaluation's split


@pytest.fixture
def model_copy(trained_model_dir, tmp_path):
    out = tmp_path / "model"
    copy_model(trained_model_dir, out)
    return str(out)


@pytest.mark.slow
def test_evaluate_cli_stops_then_skips_with_skip_corrupt(data_copy, model_copy):
    path = os.path.join(data_copy, "test-00001-of-00004.tfrecord")  # one image per test shard
    damage(path, "flipped", record=0)
    args = ["evaluate", "--model-dir", model_copy, "--data-dir", data_copy, "--split", "test", "--beam-size", "1"]
    assert_one_line_error(run_cli(*args), "evaluate", path)
    assert not glob.glob(os.path.join(model_copy, "eval", "*.json"))  # no result written

    config = os.path.join(model_copy, "config.yaml")
    text = open(config).read()
    assert "skip_corrupt: false" in text
    open(config, "w").write(text.replace("skip_corrupt: false", "skip_corrupt: true"))
    result = run_cli(*args)
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"{path}: skipped 1 record(s), kept 0" in result.stderr
    (result,) = glob.glob(os.path.join(model_copy, "eval", "test-step60-beam1-*-all-data*[!s].json"))
    assert json.load(open(result))["num_images"] == 3
