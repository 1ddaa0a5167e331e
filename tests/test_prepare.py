"""prepare end to end: real COCO/Karpathy/TFDS inputs → real TFRecords, read back with the shared schema."""

import glob
import json
import os

import pytest
import tensorflow as tf

from captioning.data import schema
from captioning.errors import InputError
from captioning.text import tokenize_caption
from data_prep.vocabulary import build_vocabulary
from captioning.vocab import UNK_ID, Vocabulary
from data_prep import output_folder
from data_prep import prepare as prepare_mod
from data_prep.prepare import PrepareOptions, prepare, summarize
from data_prep.synth import load_split
from tests.helpers import coco_split_args, encode, gradient, run_cli

REQUIRED_MANIFEST_KEYS = {"format_version", "splits", "vocab_size", "skipped", "config"}


def read_records(out_dir, split):
    """All records of a split, parsed with the schema's batched parser, as a list of plain dicts."""
    files = sorted(glob.glob(os.path.join(out_dir, f"{split}-*.tfrecord")))
    records = []
    for batch in tf.data.TFRecordDataset(files).batch(7).map(schema.parse_batch):
        for i in range(int(tf.shape(batch[schema.IMAGE_ID])[0])):
            records.append({
                "id": int(batch[schema.IMAGE_ID][i]),
                "filename": batch[schema.IMAGE_FILENAME][i].numpy().decode(),
                "jpeg": batch[schema.IMAGE_ENCODED][i].numpy(),
                "height": int(batch[schema.IMAGE_HEIGHT][i]), "width": int(batch[schema.IMAGE_WIDTH][i]),
                "captions": [c.decode() for c in batch[schema.CAPTION_TEXT][i].numpy()],
                "ids": batch[schema.CAPTION_IDS][i].to_list(),
            })
    return records


def shard_bytes(out_dir):
    return {os.path.basename(p): open(p, "rb").read() for p in sorted(glob.glob(os.path.join(out_dir, "*.tfrecord")))}


def opts(out, **kw):
    kw.setdefault("workers", 1)
    return PrepareOptions(output_dir=str(out), **kw)


@pytest.fixture(scope="module")
def prepared(shapes_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("prepared")
    manifest = prepare(opts(out, split=coco_split_args(shapes_dir)), progress=False)
    return str(out), manifest


def test_manifest(prepared, shapes_dir):
    out, manifest = prepared
    with open(os.path.join(out, "manifest.json"), encoding="utf-8") as f:
        on_disk = json.load(f)
    assert on_disk == json.loads(json.dumps(manifest))
    assert REQUIRED_MANIFEST_KEYS <= set(on_disk)
    assert on_disk["format_version"] == schema.FORMAT_VERSION
    assert on_disk["skipped"] == []
    for split, images in [("train", 32), ("val", 4), ("test", 4)]:
        s = on_disk["splits"][split]
        assert (s["images"], s["captions"]) == (images, images * 5)
        assert s["shards"] == [schema.shard_name(split, i, 4) for i in range(4)]
        assert all(os.path.exists(os.path.join(out, name)) for name in s["shards"])
    with open(os.path.join(out, "vocab.txt"), encoding="utf-8") as f:
        assert on_disk["vocab_size"] == len(f.read().splitlines())
    config = on_disk["config"]
    for key in ("min_word_count", "max_caption_length", "shorter_side", "jpeg_quality", "workers", "seed",
                "shards", "keep_punctuation", "strict", "source"):
        assert key in config
    assert config["min_word_count"] == 4 and config["source"]["kind"] == "coco"
    assert not os.path.exists(os.path.join(out, ".partial"))
    assert "train" in summarize(manifest) and "vocabulary" in summarize(manifest)
    for split in on_disk["splits"].values():  # per shard, for readers' integrity checks
        assert split["shard_bytes"] == [os.path.getsize(os.path.join(out, n)) for n in split["shards"]]
        assert split["shard_records"] == [sum(1 for _ in tf.data.TFRecordDataset(os.path.join(out, n)))
                                          for n in split["shards"]]


def test_records_round_trip(prepared, shapes_dir):
    out, _ = prepared
    vocab = Vocabulary.load(os.path.join(out, "vocab.txt"))
    for split in ("train", "val", "test"):
        coco = load_split(shapes_dir, split)
        expected = {im["id"]: im for im in coco["images"]}
        records = read_records(out, split)
        assert sorted(r["id"] for r in records) == sorted(expected)
        for r in records:
            image = expected[r["id"]]
            assert r["filename"] == image["file_name"]
            original = open(os.path.join(shapes_dir, "images", image["file_name"]), "rb").read()
            assert r["jpeg"] == original  # an RGB JPEG is stored as it was
            pixels = tf.io.decode_jpeg(r["jpeg"], channels=3)
            assert pixels.shape == (image["height"], image["width"], 3) == (r["height"], r["width"], 3)
            anns = sorted((a for a in coco["annotations"] if a["image_id"] == r["id"]), key=lambda a: a["id"])
            assert r["captions"] == [a["caption"] for a in anns]
            assert r["ids"] == [vocab.encode(tokenize_caption(a["caption"])) for a in anns]


def test_vocabulary_comes_from_train_only(shapes_dir, tmp_path):
    val = load_split(shapes_dir, "val")
    for ann in val["annotations"][:6]:
        ann["caption"] += " zebra"  # six times in val, never in train
    val_path = tmp_path / "captions_val.json"
    val_path.write_text(json.dumps(val))
    train = load_split(shapes_dir, "train")
    out = tmp_path / "out"
    prepare(opts(out, split=[coco_split_args(shapes_dir, ["train"])[0],
                             f"val={val_path}:{shapes_dir}/images"]), progress=False)
    vocab = Vocabulary.load(str(out / "vocab.txt"))
    expected = build_vocabulary([tokenize_caption(a["caption"]) for a in train["annotations"]], 4)
    assert vocab == expected and "zebra" not in vocab.words
    zebra_rows = [ids for r in read_records(str(out), "val") for text, ids in zip(r["captions"], r["ids"])
                  if text.endswith(" zebra")]
    assert len(zebra_rows) == 6 and all(ids[-2] == UNK_ID for ids in zebra_rows)  # "zebra" is <unk>


def make_quirky_coco(root):
    """A COCO split with every kind of trouble prepare must survive, with real COCO's extra keys."""
    images_dir = os.path.join(root, "imgs")
    os.makedirs(images_dir)
    exif = __import__("PIL.Image", fromlist=["Exif"]).Exif()
    exif[0x0112] = 8
    files = {
        "good.jpg": encode(gradient(), "JPEG"),
        "gray.jpg": encode(gradient("L"), "JPEG"),
        "cmyk.jpg": encode(gradient("CMYK"), "JPEG"),
        "palette.png": encode(gradient("P"), "PNG"),
        "rgba.png": encode(gradient("RGBA"), "PNG"),
        "png_named.jpg": encode(gradient(), "PNG"),
        "rotated.jpg": encode(gradient(), "JPEG", exif=exif.tobytes()),
        "corrupt.jpg": b"\xff\xd8\xff\xe0 definitely not a jpeg body",
        "truncated.jpg": encode(gradient(size=(64, 64)), "JPEG")[:200],
        "empty.jpg": b"",
        "nocaption.jpg": encode(gradient(), "JPEG"),
        "blankcaptions.jpg": encode(gradient(), "JPEG"),
        "long.jpg": encode(gradient(), "JPEG"),
    }
    for name, data in files.items():
        with open(os.path.join(images_dir, name), "wb") as f:
            f.write(data)
    os.makedirs(os.path.join(images_dir, "folder.jpg"))
    names = list(files) + ["missing.jpg", "folder.jpg"]
    images = [{"id": 100 + i, "file_name": n, "width": 48, "height": 32, "license": 3, "date_captured": "2013",
               "coco_url": f"http://images.cocodataset.org/x/{n}", "flickr_url": "http://farm.example/x"}
              for i, n in enumerate(names)]
    anns, next_id = [], 1
    for image in images:
        if image["file_name"] == "nocaption.jpg":
            continue
        texts = ["A Photo of a GRADIENT.", "   ", "a colourful gradient image"]
        if image["file_name"] == "blankcaptions.jpg":
            texts = ["", "  \t ", "..."]
        if image["file_name"] == "long.jpg":
            texts = [" ".join(["gradient"] * 40)]
        for text in texts:
            anns.append({"id": next_id, "image_id": image["id"], "caption": text})
            next_id += 1
    data = {"info": {"year": 2014, "version": "1.0"}, "licenses": [{"id": 3, "name": "x", "url": ""}],
            "images": images, "annotations": anns}
    path = os.path.join(root, "captions_train.json")
    with open(path, "w") as f:
        json.dump(data, f)
    return f"train={path}:{images_dir}"


def test_quirky_images_and_captions(tmp_path):
    split = make_quirky_coco(str(tmp_path))
    out = tmp_path / "out"
    manifest = prepare(opts(out, split=[split], min_word_count=1), progress=False)
    reasons = {s["image"]: s["reason"] for s in manifest["skipped"]}
    assert set(reasons) == {"corrupt.jpg", "truncated.jpg", "empty.jpg", "missing.jpg", "folder.jpg",
                            "nocaption.jpg", "blankcaptions.jpg"}
    assert reasons["missing.jpg"] == "missing file"
    assert reasons["empty.jpg"] == "empty file"
    assert reasons["nocaption.jpg"] == reasons["blankcaptions.jpg"] == "no usable caption"
    assert reasons["corrupt.jpg"].startswith("corrupt image")
    assert reasons["truncated.jpg"].startswith("corrupt image")
    assert reasons["folder.jpg"].startswith("not a file")
    train = manifest["splits"]["train"]
    assert train["images"] == 8  # good, gray, cmyk, palette, rgba, png_named, rotated, long
    assert train["empty_captions"] == 12 + 3  # one blank caption on 12 listed images, 3 on blankcaptions
    assert train["clipped_captions"] == 1
    records = {r["filename"]: r for r in read_records(str(out), "train")}
    assert set(records) == {"good.jpg", "gray.jpg", "cmyk.jpg", "palette.png", "rgba.png", "png_named.jpg",
                            "rotated.jpg", "long.jpg"}
    for r in records.values():
        pixels = tf.io.decode_jpeg(r["jpeg"], channels=3).numpy()
        assert pixels.shape == (r["height"], r["width"], 3)
        assert r["jpeg"][:3] == b"\xff\xd8\xff"
    assert (records["rotated.jpg"]["height"], records["rotated.jpg"]["width"]) == (48, 32)
    assert records["good.jpg"]["captions"] == ["A Photo of a GRADIENT.", "a colourful gradient image"]
    assert len(records["long.jpg"]["ids"][0]) == 20 + 2  # clipped to 20 words plus <start> and <end>

    with pytest.raises(InputError, match="strict=True") as refused:
        prepare(opts(tmp_path / "strict", split=[split], strict=True), progress=False)
    assert refused.value.params == ("strict",)  # the command line prints it as --strict


def karpathy_from_shapes(shapes_dir, tmp_path, restval=4):
    with open(os.path.join(shapes_dir, "annotations", "dataset_shapes.json")) as f:
        data = json.load(f)
    train = [im for im in data["images"] if im["split"] == "train"]
    for image in train[:restval]:
        image["split"] = "restval"
    path = tmp_path / "dataset_coco.json"
    path.write_text(json.dumps(data))
    return str(path), {im["cocoid"] for im in train[:restval]}


def test_karpathy_restval_joins_train_unless_kept(shapes_dir, tmp_path):
    path, restval_ids = karpathy_from_shapes(shapes_dir, tmp_path)
    merged = prepare(opts(tmp_path / "a", karpathy_json=path, images_root=shapes_dir), progress=False)
    assert {k: v["images"] for k, v in merged["splits"].items()} == {"train": 32, "val": 4, "test": 4}
    train_ids = {r["id"] for r in read_records(str(tmp_path / "a"), "train")}
    assert restval_ids < train_ids
    kept = prepare(opts(tmp_path / "b", karpathy_json=path, images_root=shapes_dir, keep_restval=True),
                   progress=False)
    assert {k: v["images"] for k, v in kept["splits"].items()} == {"train": 28, "restval": 4, "val": 4, "test": 4}
    assert {r["id"] for r in read_records(str(tmp_path / "b"), "restval")} == restval_ids
    # the same images and captions through either source give the same vocabulary as the COCO files
    coco = prepare(opts(tmp_path / "c", split=coco_split_args(shapes_dir)), progress=False)
    assert open(tmp_path / "a" / "vocab.txt").read() == open(tmp_path / "c" / "vocab.txt").read()
    assert coco["vocab_size"] == merged["vocab_size"]


def test_tfds_source_with_mock_data(shapes_dir, tmp_path):
    """TFDS coco_captions, mocked with tfds.testing.mock_data (no download): examples are what TFDS
    yields with SkipDecoding on the image: JPEG bytes, image/id, image/filename, captions/{id,text}."""
    import tensorflow_datasets as tfds

    splits = {s: load_split(shapes_dir, s) for s in ("train", "val", "test")}
    splits["restval"] = {"images": splits["train"]["images"][:3], "annotations": splits["train"]["annotations"]}
    splits["train"] = {"images": splits["train"]["images"][3:], "annotations": splits["train"]["annotations"]}
    requested = []

    def as_dataset(self, split, decoders=None, read_config=None, shuffle_files=False, **kwargs):
        requested.append(split)
        data = splits[split]
        examples = []
        for image in data["images"]:
            anns = [a for a in data["annotations"] if a["image_id"] == image["id"]]
            examples.append({
                "image": open(os.path.join(shapes_dir, "images", image["file_name"]), "rb").read(),
                "image/id": image["id"], "image/filename": image["file_name"],
                "captions": {"id": [a["id"] for a in anns], "text": [a["caption"] for a in anns]},
            })
        return tf.data.Dataset.from_generator(lambda: iter(examples), output_signature={
            "image": tf.TensorSpec([], tf.string), "image/id": tf.TensorSpec([], tf.int64),
            "image/filename": tf.TensorSpec([], tf.string),
            "captions": {"id": tf.TensorSpec([None], tf.int64), "text": tf.TensorSpec([None], tf.string)}})

    with tfds.testing.mock_data(as_dataset_fn=as_dataset):
        manifest = prepare(opts(tmp_path / "out", tfds="coco_captions", tfds_data_dir=str(tmp_path / "tfds")),
                           progress=False)
    assert {"train", "restval", "val", "test"} <= set(requested)
    assert {k: v["images"] for k, v in manifest["splits"].items()} == {"train": 32, "val": 4, "test": 4}
    assert manifest["config"]["source"] == {"kind": "tfds", "name": "coco_captions",
                                            "data_dir": str(tmp_path / "tfds"), "keep_restval": False}
    records = read_records(str(tmp_path / "out"), "train")
    train_ids = {im["id"] for im in load_split(shapes_dir, "train")["images"]}
    assert {r["id"] for r in records} == train_ids
    for r in records:
        assert tf.io.decode_jpeg(r["jpeg"], channels=3).shape == (r["height"], r["width"], 3)
        assert len(r["captions"]) == 5 == len(r["ids"])


def test_parallel_workers_write_the_same_records(shapes_dir, tmp_path):
    prepare(opts(tmp_path / "one", split=coco_split_args(shapes_dir), workers=1), progress=False)
    prepare(opts(tmp_path / "two", split=coco_split_args(shapes_dir), workers=2), progress=False)
    one, two = shard_bytes(tmp_path / "one"), shard_bytes(tmp_path / "two")
    assert len(one) == 12 and one == two


def test_shard_counts(shapes_dir, tmp_path):
    manifest = prepare(opts(tmp_path / "o", split=coco_split_args(shapes_dir), shards={"train": 3, "val": 1}),
                       progress=False)
    assert len(manifest["splits"]["train"]["shards"]) == 3
    assert len(manifest["splits"]["val"]["shards"]) == 1
    assert len(manifest["splits"]["test"]["shards"]) == 4
    assert len(read_records(str(tmp_path / "o"), "train")) == 32
    assert prepare_mod.default_num_shards(113287) == 114 and prepare_mod.default_num_shards(2) == 2


class Interrupt(BaseException):
    pass


def test_resume_after_interruption_equals_a_clean_run(shapes_dir, tmp_path, monkeypatch):
    args = coco_split_args(shapes_dir)
    prepare(opts(tmp_path / "clean", split=args), progress=False)

    real = prepare_mod.write_shard.__globals__["process_image"]
    calls = {"n": 0}

    def dies_after_20(*a, **k):  # the 21st image "crashes" the run, mid-shard
        calls["n"] += 1
        if calls["n"] > 20:
            raise Interrupt()
        return real(*a, **k)

    monkeypatch.setitem(prepare_mod.write_shard.__globals__, "process_image", dies_after_20)
    out = tmp_path / "resumed"
    with pytest.raises(Interrupt):
        prepare(opts(out, split=args), progress=False)
    left = sorted(os.listdir(out))
    assert "manifest.json" not in left and ".partial" in left
    assert len([n for n in left if n.endswith(".tfrecord")]) == 2  # 8 images per train shard: 2 complete
    assert len([n for n in left if n.endswith(".tfrecord.tmp")]) == 1  # the one being written
    with pytest.raises(InputError, match="resume=True") as refused:
        prepare(opts(out, split=args), progress=False)
    assert refused.value.params == ("resume", "overwrite")  # the command line prints --resume, --overwrite

    monkeypatch.setitem(prepare_mod.write_shard.__globals__, "process_image", real)
    calls["n"] = 0
    manifest = prepare(opts(out, split=args, resume=True), progress=False)
    assert shard_bytes(out) == shard_bytes(tmp_path / "clean")
    clean = json.load(open(tmp_path / "clean" / "manifest.json"))
    assert {k: v for k, v in manifest.items() if k != "config"} == {k: v for k, v in clean.items() if k != "config"}
    assert sorted(os.listdir(out)) == sorted(os.listdir(tmp_path / "clean"))


def test_resume_refuses_other_options(shapes_dir, tmp_path):
    out = tmp_path / "o"
    os.makedirs(out / ".partial")
    (out / ".partial" / "plan.json").write_text(json.dumps({"fingerprint": "from another run"}))
    with pytest.raises(InputError, match="differ from the interrupted run"):
        prepare(opts(out, split=coco_split_args(shapes_dir), resume=True), progress=False)


def test_complete_output_is_refused_unless_overwrite(shapes_dir, tmp_path):
    out = tmp_path / "o"
    prepare(opts(out, split=coco_split_args(shapes_dir), shards={"train": 5}), progress=False)
    (out / "notes.txt").write_text("a researcher's file")
    with pytest.raises(InputError, match="overwrite=True") as refused:
        prepare(opts(out, split=coco_split_args(shapes_dir)), progress=False)
    assert refused.value.params == ("overwrite",)
    with pytest.raises(InputError, match="overwrite=True") as refused:
        prepare(opts(out, split=coco_split_args(shapes_dir), resume=True), progress=False)
    assert refused.value.params == ("overwrite",)
    manifest = prepare(opts(out, split=coco_split_args(shapes_dir), overwrite=True), progress=False)
    assert len(manifest["splits"]["train"]["shards"]) == 4
    assert not os.path.exists(out / schema.shard_name("train", 0, 5))  # the old plan's shards are gone
    assert (out / "notes.txt").read_text() == "a researcher's file"  # other files are left alone


def tree(folder):
    """Every file under ``folder`` with its bytes and modification time."""
    out = {}
    for root, _, names in os.walk(folder):
        for name in names:
            path = os.path.join(root, name)
            with open(path, "rb") as f:
                out[os.path.relpath(path, folder)] = (f.read(), os.stat(path).st_mtime_ns)
    return out


def test_resume_of_a_finished_run_is_a_no_op(shapes_dir, tmp_path):
    """A scheduler re-running "prepare --resume until it succeeds" must not break on the run that did."""
    out = tmp_path / "o"
    args = ["prepare", "--output-dir", str(out), "--workers", "1", *(f"--split={a}" for a in coco_split_args(shapes_dir))]
    assert run_cli(*args).returncode == 0
    before = tree(out)
    assert json.loads(before["manifest.json"][0])["fingerprint"]
    result = run_cli(*args, "--resume")
    assert result.returncode == 0, result.stderr
    assert "already holds this dataset, complete (same sources and options): nothing to do" in result.stderr
    assert "train" in result.stdout  # the summary of the dataset that is there
    assert tree(out) == before  # not a byte, not a timestamp changed
    result = run_cli(*args, "--resume", "--min-word-count", "2")  # another dataset: refused as before
    assert result.returncode == 2 and "prepared from other sources or options" in result.stderr
    assert "Traceback" not in result.stderr and tree(out) == before


def test_given_vocabulary_is_used(prepared, shapes_dir, tmp_path):
    out, _ = prepared
    manifest = prepare(opts(tmp_path / "o", split=coco_split_args(shapes_dir, ["test"]),
                            vocab=os.path.join(out, "vocab.txt")), progress=False)
    assert open(tmp_path / "o" / "vocab.txt").read() == open(os.path.join(out, "vocab.txt")).read()
    assert manifest["splits"]["test"]["images"] == 4


@pytest.mark.parametrize("case, message", [
    ("malformed", "is not valid JSON"),
    ("unknown_image", "refers to unknown image id 999999"),
    ("missing_file", "does not exist"),
    ("empty", "is empty"),
    ("instances", "has no 'caption'"),
    ("duplicate_image", "appears twice"),
    ("no_train", "no 'train' split"),
    ("bad_split_arg", "must look like NAME=ANNOTATIONS.json:IMAGES_DIR"),
    ("two_sources", "exactly one source"),
])
def test_bad_input_is_one_clear_error(case, message, shapes_dir, tmp_path):
    train = load_split(shapes_dir, "train")
    path = tmp_path / "captions.json"
    images = f"{shapes_dir}/images"
    extra = {}
    if case == "malformed":
        path.write_text('{"images": [1, 2')
    elif case == "unknown_image":
        train["annotations"].append({"id": 1, "image_id": 999999, "caption": "a red circle"})
    elif case == "empty":
        train["images"], train["annotations"] = [], []
    elif case == "instances":
        train["annotations"] = [{"id": 1, "image_id": train["images"][0]["id"], "bbox": [0, 0, 1, 1]}]
    elif case == "duplicate_image":
        train["images"].append(dict(train["images"][0]))
    elif case == "two_sources":
        extra = {"tfds": "coco_captions"}
    if case not in ("malformed",):
        path.write_text(json.dumps(train))
    split = f"train={path}:{images}"
    if case == "missing_file":
        split = f"train={tmp_path / 'nope.json'}:{images}"
    elif case == "no_train":
        split = f"val={path}:{images}"
    elif case == "bad_split_arg":
        split = str(path)
    out = tmp_path / "out"
    with pytest.raises(InputError, match=message):
        prepare(opts(out, split=[split], **extra), progress=False)
    assert not os.path.exists(out / "manifest.json")


# ---- the real `captioning prepare` process, killed with SIGKILL -------------------------------------------------
def _children(pid):
    """Pids of ``pid``'s child processes (Linux /proc)."""
    kids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid:
                kids.append(int(entry))
    return kids


def _running(pid):
    """Alive and not a zombie (an orphan's zombie waits for init to reap it: it does nothing)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _final_shards(out):
    return sorted(n for n in os.listdir(out) if schema.is_shard_name(n))


def _assert_final_shards_complete(out):
    """Every file under a final shard name reads without error, with as many records as its statistics."""
    for name in _final_shards(out):
        path = os.path.join(out, name)
        with open(os.path.join(out, ".partial", name + ".json")) as f:  # written before the rename
            stats = json.load(f)
        count = sum(1 for _ in tf.data.TFRecordDataset(path))  # raises DataLossError on a cut shard
        assert count == stats["images"] and os.path.getsize(path) == stats["bytes"], name


@pytest.fixture(scope="module")
def kill_dataset(tmp_path_factory):
    from data_prep.synth import synthesize

    root = str(tmp_path_factory.mktemp("shapes600"))
    synthesize(root, num_images=600, seed=3, progress=False)
    return root


@pytest.mark.slow
@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="finds worker processes through /proc")
def test_sigkill_at_any_moment_leaves_only_complete_shards_and_resume_equals_a_clean_run(kill_dataset, tmp_path):
    import signal
    import subprocess
    import sys
    import time

    from tests.helpers import REPO, run_cli

    splits = coco_split_args(kill_dataset)
    # --shorter-side re-encodes every image: slower shards (wider windows to kill in), and Pillow's output too
    # must come out byte-identical
    flags = ["--shards", "train=8", "--min-word-count", "1", "--shorter-side", "100"]
    clean = tmp_path / "clean"
    prepare(opts(clean, split=splits, shards={"train": 8}, min_word_count=1, shorter_side=100), progress=False)
    out = str(tmp_path / "killed")
    command = [sys.executable, "-m", "captioning", "-q", "prepare", *[f"--split={s}" for s in splits],
               "--output-dir", out, *flags, "--workers", "2"]
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", PYTHONPATH=REPO)
    moments = [  # (what is happening, when to kill given the finished shards before the run started)
        ("the first shard is being written", lambda before: any(n.endswith(".tmp") for n in os.listdir(out))),
        ("a shard was just renamed into place", lambda before: len(_final_shards(out)) > before),
        ("two more shards are done, others being written", lambda before: len(_final_shards(out)) >= before + 2),
    ]
    workers = []
    try:
        for i, (what, ready) in enumerate(moments):
            before = len(_final_shards(out)) if os.path.isdir(out) else 0
            proc = subprocess.Popen(command + (["--resume"] if i else []), env=env, stdin=subprocess.DEVNULL,
                                    stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
            while not (os.path.isdir(out) and ready(before)):
                assert proc.poll() is None, f"prepare ended before {what}: {proc.stderr.read()[-2000:]}"
                time.sleep(0.005)
            kids = _children(proc.pid)
            workers += kids
            proc.send_signal(signal.SIGKILL)
            proc.wait()
            proc.stderr.close()
            deadline = time.monotonic() + 20
            while any(_running(k) for k in kids) and time.monotonic() < deadline:
                time.sleep(0.05)
            assert not any(_running(k) for k in kids), f"worker processes outlived prepare killed when {what}"
            assert not os.path.exists(os.path.join(out, "manifest.json"))
            _assert_final_shards_complete(out)
        result = run_cli("-q", "prepare", *[f"--split={s}" for s in splits], "--output-dir", out, *flags,
                         "--workers", "2", "--resume")
        assert result.returncode == 0, result.stderr[-2000:]
    finally:
        for pid in workers:  # only if the assertion above failed: never leave a test's processes behind
            if _running(pid):
                os.kill(pid, signal.SIGKILL)
    assert shard_bytes(out) == shard_bytes(clean) and len(shard_bytes(out)) == 16
    manifest, clean_manifest = (json.load(open(os.path.join(d, "manifest.json"))) for d in (out, clean))
    assert {k: v for k, v in manifest.items() if k != "config"} == \
        {k: v for k, v in clean_manifest.items() if k != "config"}
    assert sorted(os.listdir(out)) == sorted(os.listdir(clean))  # no .tmp, no .partial left


def test_a_second_prepare_into_the_same_folder_is_refused(tmp_path):
    """The running prepare's lock (held here by another process) stops a second one at once."""
    import subprocess
    import sys

    from tests.helpers import REPO

    out = tmp_path / "o"
    os.makedirs(out / ".partial")
    holder = subprocess.Popen(
        [sys.executable, "-c", "import fcntl, os, sys, time; fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT); "
         "fcntl.lockf(fd, fcntl.LOCK_EX, 1, 0); print('locked', flush=True); time.sleep(60)",
         str(out / ".partial" / "lock")], stdout=subprocess.PIPE, text=True, cwd=REPO)
    try:
        assert holder.stdout.readline().strip() == "locked"
        with pytest.raises(InputError, match="another `captioning prepare` is writing into"):
            output_folder.OutputLock(str(out / ".partial" / "lock"), str(out))
    finally:
        holder.kill()
        holder.wait()


def test_a_new_run_waits_for_workers_of_a_killed_one(tmp_path):
    """A worker that outlives its prepare (holding the writers' lock, as init_worker takes it) delays
    the next run until it exits."""
    import subprocess
    import sys
    import time

    from tests.helpers import REPO

    lock = tmp_path / "lock"
    lock.write_bytes(b"")
    worker = subprocess.Popen(
        [sys.executable, "-c", "import sys, time; from data_prep import writer; writer._hold_writers_lock(sys.argv[1]); "
         "print('locked', flush=True); time.sleep(1.5)", str(lock)], stdout=subprocess.PIPE, text=True, cwd=REPO,
        env=dict(os.environ, PYTHONPATH=REPO))
    try:
        assert worker.stdout.readline().strip() == "locked"
        start = time.monotonic()
        held = output_folder.OutputLock(str(lock), str(tmp_path), wait_s=30)
        waited = time.monotonic() - start
        assert worker.poll() is not None and waited > 0.5  # it got the lock only once the worker was gone
        held.close()
        with pytest.raises(InputError, match="still write into"):
            blocker = subprocess.Popen(
                [sys.executable, "-c", "import sys, time; from data_prep import writer; "
                 "writer._hold_writers_lock(sys.argv[1]); print('locked', flush=True); time.sleep(30)", str(lock)],
                stdout=subprocess.PIPE, text=True, cwd=REPO, env=dict(os.environ, PYTHONPATH=REPO))
            try:
                assert blocker.stdout.readline().strip() == "locked"
                output_folder.OutputLock(str(lock), str(tmp_path), wait_s=0.3)
            finally:
                blocker.kill()
                blocker.wait()
    finally:
        worker.kill()
        worker.wait()
