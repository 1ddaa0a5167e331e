"""captioning features import: bottom-up features in the three layouts people have (bottom-up-attention's TSV,
self-critical.pytorch's npz files, the meshed-memory Transformer's HDF5) into a features store, with what
is left out reported, files in those documented formats written here."""

import base64
import contextlib
import json
import os
import shutil
import sys

import h5py
import numpy as np
import pytest

from captioning.data.features_store import FeaturesStore
from captioning.data.prepared import PreparedDataset
from captioning.errors import InputError
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


def store_bytes(data_dir, name):
    """Every file of a store, by name, as bytes (store.json too: it names the source, the same here)."""
    path = os.path.join(data_dir, "features", name)
    return {f: open(os.path.join(path, f), "rb").read() for f in sorted(os.listdir(path))}


@pytest.mark.parametrize("cut", ["inside", "between"])
def test_a_tsv_cut_short_is_an_error_naming_the_line_and_the_completed_file_goes_on(data_dir, ids, tmp_path, cut):
    """A last line without its line end is a download that stopped: an error naming the line, even when
    what is left of it parses ("between": cut at a base64 boundary, a row of fewer features). No store is
    written; the rows before it are kept, and once the file is complete the same command goes on from
    the cut and writes the store an uninterrupted import writes."""
    lines = [tsv_line(i, *regions(i)) for i in ids[:6]]
    path, whole = tmp_path / "cut.tsv", "".join(lines)
    head = "".join(lines[:3])
    last = lines[3].rstrip("\r\n")
    path.write_text(head + (last[:-40] if cut == "inside" else last[:last.rindex("\t") + 1 + 16]))
    done = run_cli("features", "import", "--data-dir", data_dir, "--tsv", str(path), "--checkpoint-every", "2",
                   "--allow-missing")  # (6 of the 40 images)
    assert done.returncode == 2 and "Traceback" not in done.stderr
    line = done.stderr.strip().splitlines()[-1]
    assert line.startswith(f"captioning features: error: --tsv {path} is cut short at line 4 (it has no line end"), line
    assert "the 3 images before it are kept" in line and "the rerun goes on from there" in line
    assert not os.path.exists(os.path.join(data_dir, "features", "regions"))  # no store
    path.write_text(whole)  # the download completed
    again = run_cli("features", "import", "--data-dir", data_dir, "--tsv", str(path), "--checkpoint-every", "2",
                    "--allow-missing")
    assert again.returncode == 0, again.stderr[-2000:]
    check_matches(FeaturesStore.load(data_dir, "regions"), ids[:6])
    assert os.listdir(os.path.join(data_dir, "features")) == ["regions"]  # the work folder went with it
    fresh = tmp_path / "fresh"
    shutil.copytree(os.path.join(data_dir), fresh, ignore=shutil.ignore_patterns("features"))
    assert run_cli("features", "import", "--data-dir", fresh, "--tsv", str(path), "--allow-missing").returncode == 0
    assert store_bytes(fresh, "regions") == store_bytes(data_dir, "regions")


def test_a_tsv_cut_in_its_first_line_keeps_nothing(data_dir, ids, tmp_path):
    path = tmp_path / "cut.tsv"
    path.write_text(tsv_line(ids[0], *regions(ids[0]))[:-30])
    done = run_cli("features", "import", "--data-dir", data_dir, "--tsv", str(path))
    assert done.returncode == 2 and "is cut short at line 1" in done.stderr and "kept" not in done.stderr
    assert not os.path.exists(os.path.join(data_dir, "features"))  # not even the stores' folder


def test_an_interrupted_import_goes_on_where_it_stopped_and_writes_what_one_run_writes(data_dir, ids, tmp_path):
    """write_store stopped by an interrupt at any row (a kill between checkpoints loses the rows since the
    last one; an interrupt too: the shards are cut back to it), then run again: the same bytes as one
    uninterrupted run; a work folder of another source is started again."""
    from data_prep.features_writer import Row, write_store, work_path

    rows = [Row(i, *regions(i), 320, 240) for i in ids]
    source = {"kind": "test"}
    write_store(data_dir, lambda skip: rows[skip:], source=source, name="whole", images_per_shard=5, progress=False)
    expected = store_bytes(data_dir, "whole")
    for stop in (1, 4, 7, len(rows) - 1):
        name, read = f"stopped{stop}", []

        def stopping(skip):
            for row in rows[skip:]:
                if len(read) == stop:
                    raise KeyboardInterrupt
                read.append(row.image_id)
                yield row

        with pytest.raises(KeyboardInterrupt):
            write_store(data_dir, stopping, source=source, name=name, images_per_shard=5, progress=False,
                        checkpoint_every=3)
        assert os.path.exists(os.path.join(work_path(data_dir, name), "progress.json")) == (stop >= 3)
        resumed = []
        write_store(data_dir, lambda skip: (resumed.append(skip), rows[skip:])[1], source=source, name=name,
                    images_per_shard=5, progress=False, checkpoint_every=3)
        assert resumed == [stop // 3 * 3]  # from the last checkpoint
        got = store_bytes(data_dir, name)
        assert {k: v for k, v in got.items() if k != "store.json"} == \
            {k: v for k, v in expected.items() if k != "store.json"}
        assert got["store.json"].replace(name.encode(), b"whole") == expected["store.json"]

    def interrupted(skip):  # after 4 rows, a checkpoint after the third
        yield from rows[skip:skip + 4]
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        write_store(data_dir, interrupted, source=source, name="other", images_per_shard=5, progress=False,
                    checkpoint_every=3)
    skips = []  # another source's work is not resumed: it starts again
    write_store(data_dir, lambda skip: (skips.append(skip), rows[skip:])[1], source={"kind": "another"}, name="other",
                images_per_shard=5, progress=False)
    assert skips == [0]
    got = store_bytes(data_dir, "other")
    assert {k: v for k, v in got.items() if k != "store.json"} == {k: v for k, v in expected.items() if k != "store.json"}


@pytest.mark.slow
def test_an_import_killed_mid_way_goes_on_when_run_again(data_dir, ids, tmp_path):
    """kill -9 of `features import` reading a pipe (``--tsv <(zcat x.tsv.gz)``) while it waits for more
    rows, two checkpoints in; then the same command on a new stream: it skips what was done and writes the
    store one run writes, byte for byte. Two imports into one store at once: while that process writes, an
    import of the same store in this process stops in one line (exit 2) and spoils nothing of its work
    (the process's lock is the one a second process meets; the rerun then goes on from that work)."""
    import json
    import signal
    import threading
    import time

    from data_prep.features_writer import work_path
    from tests.helpers import Background

    rng = np.random.default_rng(0)
    lines = [tsv_line(i, *regions(i)) for i in ids] + [tsv_line(10**6 + k, *regions(k)) for k in range(600)]
    lines = [lines[k] for k in rng.permutation(len(lines))]  # the dataset's images spread among others
    whole = tmp_path / "whole.tsv"
    whole.write_text("".join(lines))
    fifo = tmp_path / "stream.tsv"
    os.mkfifo(fifo)
    release = threading.Event()

    def feed(count):  # the first `count` lines, then (until released) an open pipe with nothing more
        try:
            with open(fifo, "w") as f:
                for line in lines[:count]:
                    f.write(line)
                f.flush()
                release.wait(60)
        except BrokenPipeError:
            pass

    args = ["-q", "features", "import", "--data-dir", data_dir, "--tsv", str(fifo), "--checkpoint-every", "200"]
    feeder = threading.Thread(target=feed, args=(500,), daemon=True)
    feeder.start()
    run = Background(tmp_path, "import", [sys.executable, "-m", "captioning", *args])
    progress = os.path.join(data_dir, "features", ".partial-regions", "progress.json")
    deadline = time.time() + 120
    while time.time() < deadline and run.proc.poll() is None:
        with contextlib.suppress(OSError, ValueError):
            if json.load(open(progress))["done"] == 400:
                break
        time.sleep(0.05)
    (tmp_path / "x.tsv").write_text(tsv_line(ids[0], *regions(ids[0])))
    second = run_cli("features", "import", "--data-dir", data_dir, "--tsv", str(tmp_path / "x.tsv"))
    assert run.proc.poll() is None, run.stderr[-2000:]  # the first still writing
    assert second.returncode == 2 and "another run is writing this features store" in second.stderr, second.stderr
    run.proc.send_signal(signal.SIGKILL)
    assert run.proc.wait() == -signal.SIGKILL, run.stderr[-2000:]
    release.set()
    feeder.join(10)
    assert not os.path.exists(os.path.join(data_dir, "features", "regions"))
    release.clear()
    feeder = threading.Thread(target=feed, args=(len(lines),), daemon=True)
    feeder.start()
    release.set()  # the whole stream, then its end
    again = run_cli(*args)  # in this process: the killed one is what needed a process of its own
    assert again.returncode == 0, again.stderr[-2000:]
    check_matches(FeaturesStore.load(data_dir, "regions"), ids)
    assert not os.path.exists(work_path(data_dir, "regions"))  # the work folder went into the store
    fresh = tmp_path / "fresh"
    shutil.copytree(data_dir, fresh, ignore=shutil.ignore_patterns("features"))
    assert run_cli("-q", "features", "import", "--data-dir", fresh, "--tsv", str(whole)).returncode == 0
    ours, theirs = store_bytes(data_dir, "regions"), store_bytes(fresh, "regions")
    assert ours.pop("store.json").replace(str(fifo).encode(), str(whole).encode()) == theirs.pop("store.json")
    assert ours == theirs


def npz_folders(tmp_path, ids, boxes_of):
    """self-critical.pytorch's layout: ``cocobu_att/<id>.npz`` (``feat``) for every image of ``ids`` and
    ``cocobu_box/<id>.npy`` for those of ``boxes_of``."""
    att, box = tmp_path / "cocobu_att", tmp_path / "cocobu_box"
    att.mkdir()
    box.mkdir()
    for image_id in ids:
        features, boxes = regions(image_id)
        np.savez_compressed(att / str(image_id), feat=features)
        if image_id in boxes_of:
            np.save(box / f"{image_id}.npy", boxes)
    return att, box


def test_npz_files_with_boxes_beside_them(data_dir, ids, tmp_path):
    att, box = npz_folders(tmp_path, ids, boxes_of=ids)
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


def test_an_hdf5_file_with_boxes(data_dir, ids, tmp_path):
    """``<id>_boxes`` beside ``<id>_features``: the boxes are stored with the regions (the sizes are the
    prepared records'); an image whose boxes are missing where the others have them is left out, named."""
    path = tmp_path / "coco_detections.hdf5"
    without = max(ids, key=lambda i: f"{i}_features")  # the last in the file's key order: the first row has boxes
    with h5py.File(path, "w") as f:
        for image_id in ids:
            features, boxes = regions(image_id)
            f[f"{image_id}_features"] = features
            if image_id != without:
                f[f"{image_id}_boxes"] = boxes
    done = run_cli("features", "import", "--data-dir", data_dir, "--hdf5", str(path), "--name", "m2boxes")
    assert done.returncode == 0, done.stderr[-2000:]
    out = done.stdout.splitlines()
    assert out[0].startswith(f"features store m2boxes in {data_dir}/features/m2boxes: {len(ids) - 1} images")
    assert "(no boxes)" not in out[0]
    assert f"image {without}: boxes where the first row had none, or none where it had them" in done.stdout
    store = FeaturesStore.load(data_dir, "m2boxes")
    assert store.has_boxes and store.feature_size == D and store.left["missing"].count == 1
    check_matches(store, [i for i in ids if i != without], sizes=None, boxes=True)


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


def test_store_names_starting_with_a_dot_are_refused_and_a_folder_the_command_did_not_make_is_never_removed(
        data_dir, ids, tmp_path):
    """`--name .partial-x` is refused (hidden folders beside the stores are work folders); a complete store
    that sits where the work folder of `x` goes (named so before this rule) is refused in one line and left
    byte for byte, not taken for an interrupted import and removed."""
    path = tmp_path / "a.tsv"
    path.write_text("".join(tsv_line(i, *regions(i)) for i in ids))
    done = run_cli("features", "import", "--data-dir", data_dir, "--tsv", str(path), "--name", ".partial-x")
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert done.stderr.strip().splitlines()[-1] == (
        "captioning features: error: --name must be letters, digits, '_', '.' or '-', not starting with '.' (a folder "
        "name; hidden folders in DATA/features/ are work folders), got '.partial-x'")
    assert not os.path.exists(os.path.join(data_dir, "features"))
    assert run_cli("features", "import", "--data-dir", data_dir, "--tsv", str(path), "--name", "y").returncode == 0
    hidden = os.path.join(data_dir, "features", ".partial-x")
    os.rename(os.path.join(data_dir, "features", "y"), hidden)  # a complete store, as an older version allowed
    before = store_bytes(data_dir, ".partial-x")
    h5 = tmp_path / "f.hdf5"
    with h5py.File(h5, "w") as f:
        for image_id in ids:
            f[f"{image_id}_features"] = regions(image_id)[0]
    done = run_cli("features", "import", "--data-dir", data_dir, "--hdf5", str(h5), "--name", "x")
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert done.stderr.strip().splitlines()[-1] == (
        f"captioning features: error: {hidden} is in the way: it is not a work folder this command made for the store "
        "'x' (it has no work.json naming it), so it is left as it is; move it away, then run the command again")
    assert store_bytes(data_dir, ".partial-x") == before
    assert sorted(os.listdir(os.path.join(data_dir, "features"))) == [".partial-x"]


def test_a_failure_a_rerun_cannot_go_on_from_leaves_no_work_folder(data_dir, ids):
    """A failure that would repeat (here a ValueError after a checkpoint) leaves no work folder; an
    interrupt leaves it for the rerun."""
    from data_prep.features_writer import Row, work_path, write_store

    rows = [Row(i, *regions(i), 320, 240) for i in ids]

    def failing(error):
        def rows_from(skip):
            yield from rows[skip:skip + 5]
            raise error
        return rows_from

    with pytest.raises(ValueError):
        write_store(data_dir, failing(ValueError("a bug")), source={"kind": "test"}, progress=False,
                    checkpoint_every=2)
    assert not os.path.exists(work_path(data_dir, "regions"))
    with pytest.raises(KeyboardInterrupt):
        write_store(data_dir, failing(KeyboardInterrupt()), source={"kind": "test"}, progress=False,
                    checkpoint_every=2)
    assert json.load(open(os.path.join(work_path(data_dir, "regions"), "progress.json")))["done"] == 4


def test_an_hdf5_key_that_is_a_group_is_a_malformed_row_naming_it(data_dir, ids, tmp_path):
    path = tmp_path / "coco_detections.hdf5"
    with h5py.File(path, "w") as f:
        for image_id in ids[1:]:
            f[f"{image_id}_features"] = regions(image_id)[0]
        f.create_group(f"{ids[0]}_features")["x"] = np.zeros(3)
    done = run_cli("features", "import", "--data-dir", data_dir, "--hdf5", str(path), "--name", "m2")
    assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr[-2000:]
    assert done.stdout.splitlines()[-1] == (f"malformed: 1 rows that could not be read (e.g. {ids[0]}_features: "
                                            f"ValueError: {ids[0]}_features is a group, not a dataset (an array))")
    check_matches(FeaturesStore.load(data_dir, "m2"), ids[1:], sizes=None, boxes=False)


def test_a_file_that_is_not_text_given_as_tsv_says_so(data_dir, ids, tmp_path):
    """A gzip file, or binary bytes with a bare \\r early (which once read as a line "cut short at line 1"),
    given as --tsv: one line saying it is not text."""
    import gzip

    zipped = tmp_path / "features.tsv.gz"
    zipped.write_bytes(gzip.compress("".join(tsv_line(i, *regions(i)) for i in ids).encode()))
    binary = tmp_path / "features.bin"
    binary.write_bytes(b"\x00\x01\r\x02" + bytes(range(256)) * 4)
    for path, kind, byte in ((zipped, "a gzip file (give --tsv <(zcat FILE))", "byte 0 is 0x1f"),
                             (binary, "not text", "byte 0 is 0x00")):
        done = run_cli("features", "import", "--data-dir", data_dir, "--tsv", str(path))
        assert done.returncode == 2 and "Traceback" not in done.stderr and "cut short" not in done.stderr
        assert done.stderr.strip().splitlines()[-1] == (
            f"captioning features: error: --tsv {path} is not a TSV of text: {byte}; it looks like {kind}")
    assert not os.path.exists(os.path.join(data_dir, "features"))


def test_a_store_of_a_source_without_a_path_is_named_in_the_refusal(data_dir, ids, tmp_path):
    from data_prep.features_writer import Row, write_store

    write_store(data_dir, lambda skip: [Row(i, *regions(i), 320, 240) for i in ids][skip:],
                source={"kind": "extract", "model": "/models/m", "checkpoint": 40}, progress=False)
    path = tmp_path / "a.tsv"
    path.write_text("".join(tsv_line(i, *regions(i)) for i in ids))
    done = run_cli("features", "import", "--data-dir", data_dir, "--tsv", str(path))
    assert done.returncode == 2 and "(from None)" not in done.stderr
    assert done.stderr.strip().splitlines()[-1] == (
        f"captioning features: error: {data_dir}/features/regions holds a features store already (extracted with "
        "the model in /models/m); pass --overwrite to replace it, or give another --name")


def test_an_import_that_keeps_few_images_is_refused_unless_allow_missing(data_dir, ids, tmp_path):
    """--boxes-dir missing all but one file: 1 of the 40 images kept is under half, so nothing is written
    and the command exits 2 saying so; --allow-missing writes the store (and its report says what is missing)."""
    att, box = npz_folders(tmp_path, ids, boxes_of=ids[:1])
    args = ["features", "import", "--data-dir", data_dir, "--npz-dir", str(att), "--boxes-dir", str(box)]
    done = run_cli(*args)
    assert done.returncode == 2 and "Traceback" not in done.stderr
    line = done.stderr.strip().splitlines()[-1]
    assert line.startswith(f"captioning features: error: --npz-dir {att} has features of only 1 of the 40 images of "
                           f"{data_dir} (2.5%; a store needs at least 50% of them): 39 missing (e.g. {ids[1]}, ")
    assert "39 rows could not be read" in line and line.endswith(
        "nothing was written: complete the source, or pass --allow-missing to write the store anyway")
    assert not os.path.exists(os.path.join(data_dir, "features"))
    done = run_cli(*args, "--allow-missing")
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.splitlines()[1].startswith("missing: 39 dataset images without features")
    check_matches(FeaturesStore.load(data_dir, "regions"), ids[:1], sizes=None)


def test_boxes_are_clipped_to_the_image_and_degenerate_ones_dropped_and_counted(data_dir, ids, tmp_path):
    """One rule (clean_boxes) on import: a box reaching outside its 262 x 263 image is clipped to it; an
    inverted, an empty and a non-finite box are dropped with their regions; an image left with no box is a
    malformed row; both counts are reported and kept in store.json; no stored box has a negative size."""
    from captioning.model.base import box_geometry

    odd, nan, none = ids[:3]
    features = np.arange(4 * D, dtype=np.float32).reshape(4, D)
    lines = [tsv_line(odd, features, np.array([[-50, -50, 786, 789], [10, 10, 5, 5], [10, 10, 10, 10],
                                               [1, 2, 30, 40]], np.float32), 262, 263),
             tsv_line(nan, features[:2], np.array([[np.nan, 1, 2, 3], [1, 2, 3, 4]], np.float32)),
             tsv_line(none, features[:1], np.array([[5, 5, 1, 9]], np.float32))]
    lines += [tsv_line(i, *regions(i)) for i in ids[3:]]
    path = tmp_path / "boxes.tsv"
    path.write_text("".join(lines))
    done = run_cli("features", "import", "--data-dir", data_dir, "--tsv", str(path))
    assert done.returncode == 0, done.stderr[-2000:]
    out = done.stdout.splitlines()
    assert out[1:] == [f"missing: 1 dataset images without features (e.g. {none})",
                       f"malformed: 1 rows that could not be read (e.g. image {none}: none of its 1 boxes has an area "
                       "inside its 320x240 image)",
                       "boxes: 3 dropped (a coordinate not finite, or no area inside the image; e.g. image "
                       f"{odd}: 2; image {nan}: 1)",
                       f"boxes: 1 clipped to the image (e.g. image {odd}: 1)"]
    store = FeaturesStore.load(data_dir, "regions")
    assert (store.left["boxes_dropped"].count, store.left["boxes_clipped"].count) == (3, 1)
    got = store.read([odd, nan])
    np.testing.assert_array_equal(got[odd].boxes, [[0, 0, 262, 263], [1, 2, 30, 40]])
    np.testing.assert_array_equal(got[odd].features, features[[0, 3]].astype(np.float16))
    np.testing.assert_array_equal(got[nan].boxes, [[1, 2, 3, 4]])
    np.testing.assert_array_equal(got[nan].features, features[1:2].astype(np.float16))
    boxes = np.concatenate([r.boxes / [r.width, r.height, r.width, r.height] for r in store.read().values()])
    assert (box_geometry(boxes).numpy()[:, 4] > 0).all() and (boxes[:, 2:] > boxes[:, :2]).all()


def test_every_size_the_import_takes_has_a_bound_checked_before_any_work(data_dir, ids, tmp_path):
    from captioning.cli import features as cli
    from data_prep import features_writer
    from data_prep.features_import import import_features

    assert (cli.MAX_IMAGES_PER_SHARD, cli.MAX_CHECKPOINT_EVERY) == (features_writer.MAX_IMAGES_PER_SHARD,
                                                                    features_writer.MAX_CHECKPOINT_EVERY)
    path = tmp_path / "a.tsv"
    path.write_text("".join(tsv_line(i, *regions(i)) for i in ids))
    for flag, value, bound in (("--images-per-shard", "100001", "[1, 100,000]"),
                               ("--checkpoint-every", "0", "[1, 1,000,000]")):
        done = run_cli("features", "import", "--data-dir", data_dir, "--tsv", str(path), flag, value)
        assert done.returncode == 2 and done.stderr.strip().splitlines() == [
            f"captioning features: error: argument {flag}: must be an integer in {bound}, got {value} (see captioning "
            "features import --help)"]
    with pytest.raises(InputError, match=r"`images_per_shard` must be an integer in \[1, 100,000\], got 1000000"):
        import_features(data_dir, tsv=str(path), images_per_shard=10**6, progress=False)
    assert not os.path.exists(os.path.join(data_dir, "features"))
