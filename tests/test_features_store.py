"""captioning features import: bottom-up features in the three layouts people have (bottom-up-attention's TSV,
self-critical.pytorch's npz files, the meshed-memory Transformer's HDF5) into a features store, with what
is left out reported, files in those documented formats written here."""

import base64
import os

import h5py
import numpy as np
import pytest

from captioning.data.features_store import FeaturesStore
from captioning.data.prepared import PreparedDataset
from tests.helpers import run_cli

D = 8  # features a region


@pytest.fixture(scope="module")
def ids(prepared_dir):
    return sorted(PreparedDataset.load(prepared_dir).image_sizes())


@pytest.fixture()
def data_dir(prepared_dir, tmp_path):
    """A copy of the prepared fixture (the store is written inside the dataset's folder)."""
    import shutil

    copy = tmp_path / "data"
    shutil.copytree(prepared_dir, copy)
    return str(copy)


def regions(image_id):
    """Deterministic regions of an image: 1 to 4 boxes, features that name the image."""
    rng = np.random.default_rng(image_id)
    n = 1 + image_id % 4
    x1, y1 = rng.uniform(0, 100, (2, n))
    boxes = np.stack([x1, y1, x1 + rng.uniform(5, 50, n), y1 + rng.uniform(5, 50, n)], axis=1).astype(np.float32)
    return rng.normal(size=(n, D)).astype(np.float32), boxes


def tsv_line(image_id, features, boxes, w=320, h=240):
    b64 = lambda a: base64.b64encode(np.ascontiguousarray(a, "<f4").tobytes()).decode()  # noqa: E731
    return "\t".join(map(str, (image_id, w, h, len(features), b64(boxes), b64(features)))) + "\r\n"


def check_matches(store, image_ids, sizes=(320, 240), boxes=True):
    """The store holds ``image_ids``' regions as the source gave them, the image sizes the source gave (None:
    the prepared records' sizes) and each image's captions as the prepared dataset holds them."""
    got = store.read()
    records = PreparedDataset.load(os.path.dirname(os.path.dirname(store.path))).image_records()
    assert sorted(got) == sorted(image_ids)
    for image_id in image_ids:
        features, expected_boxes = regions(image_id)
        np.testing.assert_array_equal(got[image_id].features, features.astype(np.float16))
        assert got[image_id].features.dtype == np.float16
        np.testing.assert_array_equal(got[image_id].boxes, expected_boxes if boxes else np.zeros_like(expected_boxes))
        record = records[image_id]
        assert (got[image_id].width, got[image_id].height) == (sizes or (record.width, record.height))
        assert got[image_id].captions == record.captions and len(record.captions) >= 1


def test_a_tsv_with_gaps_extra_and_a_bad_row(data_dir, ids, tmp_path):
    kept = ids[2:]
    lines = [tsv_line(i, *regions(i)) for i in kept]
    lines.insert(3, tsv_line(999999, *regions(5)))  # an image the dataset does not have
    lines.insert(5, "17\t320\t240\t2\tnot-base64!\tAAAA\r\n")  # malformed in the middle
    path = tmp_path / "bottomup.tsv"
    path.write_text("".join(lines))
    done = run_cli("features", "import", "--data-dir", data_dir, "--tsv", str(path), "--name", "bottomup",
                   "--images-per-shard", "7")
    assert done.returncode == 0, done.stderr[-2000:]
    out = done.stdout.splitlines()
    assert out[0].startswith(f"features store bottomup in {data_dir}/features/bottomup: {len(kept)} images")
    assert out[1] == f"missing: 2 dataset images without features (e.g. {ids[0]}; {ids[1]})"
    assert out[2] == "extra: 1 images not in the dataset (e.g. 999999)"
    assert out[3].startswith("malformed: 1 rows that could not be read (e.g. line 6:")
    store = FeaturesStore.load(data_dir, "bottomup")
    assert (store.feature_size, store.images, store.has_boxes) == (D, len(kept), True)
    sizes = PreparedDataset.load(data_dir).image_sizes()
    for split, info in store.splits.items():  # per split, runs of 7 of its sorted ids
        members = [i for i in ids if sizes[i][0] == split]
        assert len(info.shards) == -(-len(members) // 7) and info.shards[0] == f"{split}-00000-of-{len(info.shards):05d}.tfrecord"
        assert info.images == sum(1 for i in members if i in kept) == sum(info.shard_records)
    assert store.regions == sum(len(regions(i)[0]) for i in kept)
    check_matches(store, kept)
    for image_id in kept:  # each image is in the shard store.json says
        assert image_id in store.read([image_id])
        assert len(store.files(sizes[image_id][0])) == len(store.split(sizes[image_id][0]).shards)
    again = run_cli("features", "import", "--data-dir", data_dir, "--tsv", str(path), "--name", "bottomup")
    assert again.returncode == 0 and "imported already" in again.stdout.splitlines()[0]


def test_a_tsv_cut_short_is_an_error_naming_the_line_and_writes_nothing(data_dir, ids, tmp_path):
    text = "".join(tsv_line(i, *regions(i)) for i in ids[:4])
    path = tmp_path / "cut.tsv"
    path.write_text(text[:-40])  # the last line stops inside its features
    done = run_cli("features", "import", "--data-dir", data_dir, "--tsv", str(path))
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert done.stderr.strip().splitlines()[-1].startswith(f"captioning features: error: --tsv {path} is cut short "
                                                          "at line 4")
    assert not os.path.exists(os.path.join(data_dir, "features"))  # not even the stores' folder


def test_npz_files_with_boxes_beside_them(data_dir, ids, tmp_path):
    att, box = tmp_path / "cocobu_att", tmp_path / "cocobu_box"
    att.mkdir()
    box.mkdir()
    for image_id in ids:
        features, boxes = regions(image_id)
        np.savez_compressed(att / str(image_id), feat=features)
        np.save(box / f"{image_id}.npy", boxes)
    (att / "readme.txt").write_text("not features")
    (att / f"{ids[0]}.npz").write_bytes(b"broken")
    done = run_cli("features", "import", "--data-dir", data_dir, "--npz-dir", str(att), "--boxes-dir", str(box))
    assert done.returncode == 0, done.stderr[-2000:]
    assert f"malformed: 1 rows that could not be read (e.g. {ids[0]}.npz:" in done.stdout
    check_matches(FeaturesStore.load(data_dir, "regions"), ids[1:], sizes=None)


def test_an_hdf5_file_without_boxes(data_dir, ids, tmp_path):
    path = tmp_path / "coco_detections.hdf5"
    with h5py.File(path, "w") as f:
        for image_id in ids:
            f[f"{image_id}_features"] = regions(image_id)[0]
        f[f"{ids[0]}_cls_prob"] = np.zeros(3)  # other datasets of the file are not features
    done = run_cli("features", "import", "--data-dir", data_dir, "--hdf5", str(path), "--name", "m2")
    assert done.returncode == 0, done.stderr[-2000:]
    assert "(no boxes)" in done.stdout.splitlines()[0]
    store = FeaturesStore.load(data_dir, "m2")
    assert not store.has_boxes and store.left["missing"].count == 0
    check_matches(store, ids, sizes=None, boxes=False)


def test_refusals_write_nothing_and_overwrite_replaces_only_when_complete(data_dir, ids, tmp_path):
    path = tmp_path / "a.tsv"
    path.write_text("".join(tsv_line(i, *regions(i)) for i in ids))
    for args, message in (
            ([], "give exactly one of --tsv, --npz-dir or --hdf5"),
            (["--tsv", str(path), "--hdf5", str(path)], "give exactly one of --tsv, --npz-dir or --hdf5 (got tsv, hdf5)"),
            (["--tsv", str(path), "--boxes-dir", str(tmp_path)], "--boxes-dir goes with --npz-dir"),
            (["--tsv", str(tmp_path / "none.tsv")], f"--tsv {tmp_path / 'none.tsv'} does not exist"),
            (["--tsv", str(path), "--name", "../up"], "--name must be letters, digits")):
        done = run_cli("features", "import", "--data-dir", data_dir, *args)
        assert done.returncode == 2 and message in done.stderr, (args, done.stderr)
    assert not os.path.exists(os.path.join(data_dir, "features"))
    assert run_cli("features", "import", "--data-dir", data_dir, "--tsv", str(path)).returncode == 0
    other = tmp_path / "b.tsv"
    other.write_text(tsv_line(999999, *regions(3)))  # none of the dataset's images
    refused = run_cli("features", "import", "--data-dir", data_dir, "--tsv", str(other))
    assert refused.returncode == 2 and "holds a features store already" in refused.stderr
    failed = run_cli("features", "import", "--data-dir", data_dir, "--tsv", str(other), "--overwrite")
    assert failed.returncode == 2 and "has features of none of the" in failed.stderr
    check_matches(FeaturesStore.load(data_dir, "regions"), ids)  # the old store, whole
    assert sorted(os.listdir(os.path.join(data_dir, "features"))) == ["regions"]
