"""The tf.data input pipeline on real prepared TFRecords (the shapes dataset), with no mocks.

Ground truth is read straight from the records with ``schema.parse_batch`` and compared with what
``make_dataset`` yields: bucketing, padding and masks, captions per epoch, caches, features,
per-replica sharding and the crops.
"""

import collections
import glob
import itertools
import json
import math
import os
import shutil

import numpy as np
import pytest
import tensorflow as tf

from captioning.data import schema
from captioning.config.sections import DataConfig
from captioning.data.prepared import PreparedDataset
from captioning.data.pipeline import make_dataset
from captioning.data.preprocessor import ImagePreprocessor
from captioning.data.reading import decode_and_resize
from captioning.vocab import END_ID, PAD_ID, START_ID

IMAGE, RESIZE = 32, 40
OFFSET = (RESIZE - IMAGE) // 2  # the central crop starts at pixel 4
BOUNDARIES = [10, 13, 16]  # the shapes captions have 7..19 input ids


@pytest.fixture(scope="module")
def data_dir(prepared_dir):
    """conftest's prepared_dir (the shapes fixture prepared with the same options), read-only here."""
    with open(os.path.join(prepared_dir, "manifest.json")) as f:
        manifest = json.load(f)
    assert (manifest["splits"]["train"]["images"], manifest["splits"]["train"]["captions"]) == (32, 160)
    assert len(manifest["splits"]["train"]["shards"]) == 4
    return prepared_dir


def read_records(data_dir, split="train"):
    """Every record of ``split``, in file order: id, resized image, captions."""
    files = PreparedDataset.load(data_dir).files(split)
    records = []
    for batch in map(schema.parse_batch, tf.data.TFRecordDataset(files).batch(16)):  # eager: nothing traced
        for i in range(int(tf.shape(batch[schema.IMAGE_ID])[0])):
            resized = decode_and_resize(batch[schema.IMAGE_ENCODED][i], ImagePreprocessor(IMAGE, RESIZE)).numpy()
            records.append({"id": int(batch[schema.IMAGE_ID][i]), "resized": resized,
                            "crop": resized[OFFSET:OFFSET + IMAGE, OFFSET:OFFSET + IMAGE],
                            "captions": [tuple(c) for c in batch[schema.CAPTION_IDS][i].to_list()]})
    return records


@pytest.fixture(scope="module")
def train_records(data_dir):
    records = read_records(data_dir)
    assert len(records) == 32 and sum(len(r["captions"]) for r in records) == 160
    return records


@pytest.fixture(scope="module")
def records_by_file(data_dir, train_records):
    """train_records cut at each shard's end (its records counted straight from the file): the records of
    each shard, as reading that one file gives them, without decoding the split a second time."""
    per_file, start = [], 0
    for path in PreparedDataset.load(data_dir).files("train"):
        count = sum(1 for _ in tf.data.TFRecordDataset([path]))
        per_file.append(train_records[start:start + count])
        start += count
    assert start == len(train_records) and all(per_file)
    return per_file


def config(data_dir, **kw):
    values = dict(dir=data_dir, image_size=IMAGE, resize_size=RESIZE, deterministic=True, random_crop=False, random_flip=False, shuffle_buffer=64,
                  parse_batch_size=8, seed=0)
    values.update(kw)
    return DataConfig(**values)


def batches(ds, limit=None):
    out = []
    for batch in ds.as_numpy_iterator():
        out.append(batch)
        if limit is not None and len(out) == limit:
            break
    return out


def rows(batch_list):
    """Each example of the batches as (full caption ids, input length, the batch's other keys' row)."""
    for b in batch_list:
        for i in range(b["input_ids"].shape[0]):
            length = int(b["mask"][i].sum())
            caption = (int(b["input_ids"][i, 0]),) + tuple(int(x) for x in b["target_ids"][i, :length])
            yield caption, length, {k: v[i] for k, v in b.items()}


def all_captions(records):
    return collections.Counter(c for r in records for c in r["captions"])


def eval_order(per_file):
    """The records in evaluation order: one from each shard in turn (a deterministic interleave)."""
    return [r for group in itertools.zip_longest(*per_file) for r in group if r is not None]


def windows_of(records, per_window):
    """Caption lengths (input ids) of each window of ``per_window`` images, in record order."""
    return [[len(c) - 1 for r in records[i:i + per_window] for c in r["captions"]]
            for i in range(0, len(records), per_window)]


def test_length_grouping_pads_each_batch_to_its_longest_caption(data_dir, train_records, records_by_file):
    lengths = collections.Counter(len(c) - 1 for r in train_records for c in r["captions"])
    assert len(lengths) >= 6  # captions of many lengths
    # Evaluation, length_window 2 with batches of 8: windows of ceil(2 * 8 / 5) = 4 images (20 captions)
    # in record order; each window sorted by length and cut into batches of 8, 8 and 4.
    cfg = config(data_dir, length_window=2)
    got = batches(make_dataset(cfg, "train", training=False, batch_size=8))
    expected = []
    for window in windows_of(eval_order(records_by_file), 4):
        window = sorted(window)
        expected += [window[i:i + 8] for i in range(0, len(window), 8)]
    assert [sorted(b["mask"].sum(axis=1).astype(int).tolist()) for b in got] == expected
    for b in got:
        real = b["mask"].sum(axis=1).astype(int)
        assert b["input_ids"].shape == b["target_ids"].shape == b["mask"].shape == (len(real), real.max())

    # One window of everything: each batch holds the next 8 lengths in sorted order.
    whole = batches(make_dataset(config(data_dir, length_window=100), "train", training=False, batch_size=8))
    ordered = sorted(lengths.elements())
    assert [sorted(b["mask"].sum(axis=1).astype(int).tolist()) for b in whole] == \
        [ordered[i:i + 8] for i in range(0, 160, 8)]

    def efficiency(bs):
        return sum(b["mask"].sum() for b in bs) / sum(b["mask"].size for b in bs)

    unsorted = batches(make_dataset(config(data_dir, length_window=1), "train", training=False, batch_size=8))
    assert efficiency(whole) > 0.97 > efficiency(unsorted)

    # bucket_boundaries: batches are padded up to the next boundary (a few fixed shapes, for XLA).
    for b in batches(make_dataset(config(data_dir, bucket_boundaries=list(BOUNDARIES)), "train", training=False,
                                  batch_size=8)):
        longest = int(b["mask"].sum(axis=1).max())
        width = next((x for x in BOUNDARIES if x >= longest), longest)
        assert b["input_ids"].shape[1] == width

    # Training: full batches only; each window drops its last partial batch; lengths grouped.
    train_ds = make_dataset(config(data_dir, length_window=4), "train", training=True, batch_size=8, repeat=False)
    trained = batches(train_ds)
    assert all(b["input_ids"].shape[0] == 8 for b in trained)
    windows = math.ceil(32 / math.ceil(4 * 8 / 5))
    assert 160 - 7 * windows <= 8 * len(trained) <= 160
    assert efficiency(trained) > efficiency(unsorted)


def test_input_target_and_mask(data_dir, train_records):
    known = all_captions(train_records)
    seen = 0
    for b in batches(make_dataset(config(data_dir), "train", training=False, batch_size=16)):
        inputs, targets, mask = b["input_ids"], b["target_ids"], b["mask"]
        assert inputs.dtype == targets.dtype == np.int64 and mask.dtype == np.float32
        np.testing.assert_array_equal(mask, (targets != PAD_ID).astype(np.float32))
        assert (inputs[:, 0] == START_ID).all()
        for i in range(inputs.shape[0]):
            n = int(mask[i].sum())
            assert n >= 2 and (mask[i, :n] == 1).all() and (mask[i, n:] == 0).all()
            assert targets[i, n - 1] == END_ID
            assert END_ID not in targets[i, :n - 1] and END_ID not in inputs[i, :n]
            np.testing.assert_array_equal(inputs[i, 1:n], targets[i, :n - 1])  # shifted by one word
            assert (inputs[i, n:] == PAD_ID).all() and (targets[i, n:] == PAD_ID).all()
            caption = (int(inputs[i, 0]),) + tuple(int(x) for x in targets[i, :n])
            assert caption in known
            seen += 1
    assert seen == 160


def test_eval_yields_every_caption_exactly_once(data_dir, train_records):
    expected = all_captions(train_records)
    assert sum(expected.values()) == 160
    got = collections.Counter(c for c, _, _ in rows(batches(
        make_dataset(config(data_dir), "train", training=False, batch_size=8))))
    assert got == expected
    val = collections.Counter(c for c, _, _ in rows(batches(
        make_dataset(config(data_dir), "val", training=False, batch_size=8))))
    assert val == all_captions(read_records(data_dir, "val")) and sum(val.values()) == 20


def test_training_all_captions_once_per_epoch(data_dir, train_records):
    ds = make_dataset(config(data_dir, captions_per_image="all"), "train", training=True, batch_size=1,
                      repeat=False)
    got = collections.Counter(c for c, _, _ in rows(batches(ds)))
    assert got == all_captions(train_records)


def test_training_samples_one_caption_per_image(data_dir, train_records):
    crops = {r["crop"].tobytes(): r for r in train_records}
    assert len(crops) == 32
    ds = make_dataset(config(data_dir, captions_per_image="sample"), "train", training=True, batch_size=1,
                      repeat=False)
    examples = list(rows(batches(ds)))
    assert len(examples) == 32
    images = collections.Counter()
    for caption, _, row in examples:
        record = crops[row["image"].tobytes()]  # no augmentation: the central crop names the image
        assert caption in record["captions"]
        images[record["id"]] += 1
    assert images == {r["id"]: 1 for r in train_records}
    assert collections.Counter(c for c, _, _ in examples) <= all_captions(train_records)


def test_caches_give_the_same_examples(data_dir, tmp_path):
    # A private copy of the data, so the shards can be deleted to prove the disk cache is read.
    own = str(tmp_path / "data")
    shutil.copytree(data_dir, own)

    def build(cache, **kw):
        return make_dataset(config(own, cache=cache), "train", training=False, batch_size=8, **kw)

    reference = batches(build("none"))
    assert sum(b["input_ids"].shape[0] for b in reference) == 160

    def assert_same(got):
        assert len(got) == len(reference)
        for a, b in zip(got, reference):
            assert set(a) == set(b) == {"image", "input_ids", "target_ids", "mask"}
            for key in a:
                assert a[key].dtype == b[key].dtype
                np.testing.assert_array_equal(a[key], b[key])

    memory = build("memory")
    assert_same(batches(memory))
    assert_same(batches(memory))  # the second pass reads the in-memory cache

    cache_dir = str(tmp_path / "cache")
    disk = build("disk", cache_dir=cache_dir)
    assert_same(batches(disk))
    assert len(glob.glob(os.path.join(cache_dir, "train-*-0of1.index"))) == 1
    for name in os.listdir(own):  # zeroed, same size: unreadable, yet the manifest's sizes still match
        if name.endswith(".tfrecord"):
            path = os.path.join(own, name)
            with open(path, "r+b") as f:
                f.write(bytes(os.path.getsize(path)))
    assert_same(batches(disk))  # the records are unreadable: only the cache can give these
    assert_same(batches(build("disk", cache_dir=cache_dir)))  # a new pipeline reuses the cache
    with pytest.raises(tf.errors.DataLossError):
        batches(build("none"))  # without the cache the shards really are unreadable

    with pytest.raises(ValueError, match="cache_dir"):
        build("disk")


def test_features_cache_runs_the_encoder_once(data_dir, train_records, tmp_path):
    """cache: features — the encoder runs once over the split; its outputs are kept as float16 on disk
    and read by every epoch and by a new pipeline (a new run); another encoder key gets its own file."""
    calls = []

    def feature_fn(images):
        calls.append(tuple(images.shape))
        return tf.reduce_mean(tf.cast(images, tf.float32), axis=[1, 2])

    cfg = config(data_dir, cache="features", shuffle_buffer=8)
    with pytest.raises(ValueError, match="feature_fn"):
        make_dataset(cfg, "train", training=True, batch_size=16)
    with pytest.raises(ValueError, match="cache_dir"):
        make_dataset(cfg, "train", training=True, batch_size=16, feature_fn=feature_fn)
    cache = str(tmp_path / "cache")
    ds = make_dataset(cfg, "train", training=True, batch_size=16, repeat=True, feature_fn=feature_fn,
                      feature_key="mean-rgb", cache_dir=cache)
    assert len(calls) == math.ceil(32 / 64) == 1
    assert calls[0] == (32, IMAGE, IMAGE, 3)  # every image once, centrally cropped
    files = sorted(os.listdir(cache))
    assert [f for f in files if f.endswith(".tfrecord")] and not [f for f in files if f.endswith(".tmp")]

    expected = np.stack([r["crop"].astype(np.float32).mean(axis=(0, 1)) for r in train_records]).astype(np.float16)
    seen = collections.Counter()
    got = batches(ds, limit=40)  # 640 captions: four epochs of 160
    assert len(calls) == 1  # no epoch runs the encoder again
    for b in got:
        assert set(b) == {"features", "input_ids", "target_ids", "mask"}
        assert b["features"].shape == (16, 3) and b["features"].dtype == np.float16
    for caption, _, row in rows(got):
        distance = np.abs(expected - row["features"]).max(axis=1)
        assert distance.min() == 0  # float16, exactly as written
        record = train_records[int(distance.argmin())]
        assert caption in record["captions"]  # features and captions of the same image
        seen[caption] += 1
    assert sum(seen.values()) == 640
    assert set(seen) == set(all_captions(train_records))  # several epochs: every caption came round

    again = make_dataset(cfg, "train", training=True, batch_size=16, repeat=True, feature_fn=feature_fn,
                         feature_key="mean-rgb", cache_dir=cache)
    batches(again, limit=2)
    assert len(calls) == 1  # a new pipeline (a new run) reads the file
    make_dataset(cfg, "train", training=True, batch_size=16, feature_fn=feature_fn, feature_key="other-weights",
                 cache_dir=cache)
    assert len(calls) == 2  # other weights: other features


@pytest.mark.slow
def test_per_replica_sharding(data_dir, train_records, records_by_file):
    files = PreparedDataset.load(data_dir).files("train")
    expected = all_captions(train_records)
    for pipelines in (2, 3, 5):  # 5 > 4 files: records are sharded instead of files
        union = collections.Counter()
        for i in range(pipelines):
            context = tf.distribute.InputContext(num_input_pipelines=pipelines, input_pipeline_id=i,
                                                 num_replicas_in_sync=pipelines)
            ds = make_dataset(config(data_dir), "train", training=False, batch_size=8, input_context=context)
            got = collections.Counter(c for c, _, _ in rows(batches(ds)))
            assert got, f"pipeline {i} of {pipelines} is empty"
            if pipelines <= len(files):
                assert got == all_captions([r for rs in records_by_file[i::pipelines] for r in rs])
            assert not (union & got), "two pipelines yielded the same caption"
            union += got
        assert union == expected


def test_training_augmentation_crops_and_flips(data_dir, train_records):
    """With a cache the crop is cut from the cached resized image: exactly one of its windows."""
    cfg = config(data_dir, random_crop=True, random_flip=True, cache="memory")
    ds = make_dataset(cfg, "train", training=True, batch_size=4, repeat=False)
    by_caption = collections.defaultdict(list)
    for r in train_records:
        for c in r["captions"]:
            by_caption[c].append(r["resized"])
    positions, flips, count = set(), 0, 0
    for caption, _, row in rows(batches(ds)):
        image = row["image"]
        assert image.shape == (IMAGE, IMAGE, 3) and image.dtype == np.uint8
        match = None
        for resized in by_caption[caption]:
            for y in range(RESIZE - IMAGE + 1):
                for x in range(RESIZE - IMAGE + 1):
                    window = resized[y:y + IMAGE, x:x + IMAGE]
                    if np.array_equal(image, window):
                        match = (y, x, False)
                    elif np.array_equal(image, window[:, ::-1]):
                        match = (y, x, True)
        assert match is not None, "a training image is not a (flipped) window of its resized image"
        positions.add(match[:2])
        flips += match[2]
        count += 1
    assert count % 4 == 0 and count >= 160 - 3 * math.ceil(32 / math.ceil(16 * 4 / 5))  # only partial batches dropped
    assert len(positions) > 10 and 0 < flips < count  # crops really are random, and so are flips


@pytest.mark.parametrize("cache", ["none", "memory"])
def test_a_seeded_runs_batches_are_the_same_in_every_run(data_dir, cache):
    """Every random draw of the pipeline comes from its element's own seed (data.seed and its place in the
    stream: captioning/data/seeds.py), so two runs of the same config see the very same batches — crops and
    flips cut out while decoding (cache none) or from the cached images, captions chosen, ties broken and
    batches ordered at random — past an epoch's repeat, whatever ran before in the process; another
    data.seed gives other batches. (Stateful draws in the parallel map made every run differ.) A stream started
    past its first 17 batches (``skip_batches``: a resumed run's replay) goes on as the whole one does."""
    def stream(seed, skip=0):
        cfg = config(data_dir, random_crop=True, random_flip=True, cache=cache, seed=seed)
        ds = make_dataset(cfg, "train", training=True, batch_size=8, skip_batches=skip)  # 20 batches an epoch
        return [(b["image"], b["input_ids"]) for b in batches(ds, limit=30 - skip)]

    first = stream(3)
    tf.random.uniform([5])  # a draw between the runs: the second sees another global random state
    for (image, ids), (image_again, ids_again) in zip(first, stream(3), strict=True):
        np.testing.assert_array_equal(ids, ids_again)
        np.testing.assert_array_equal(image, image_again)
    for (image, ids), (image_again, ids_again) in zip(first[17:], stream(3, skip=17), strict=True):
        np.testing.assert_array_equal(ids, ids_again)
        np.testing.assert_array_equal(image, image_again)
    other = stream(4)
    assert sum(not np.array_equal(a[0], b[0]) for a, b in zip(first, other)) > 25


def test_training_crops_are_cut_out_while_decoding(data_dir, train_records):
    """Without a cache the random crop is decoded directly (decode_and_crop_jpeg), then resized:
    the same window as resize-then-crop, within interpolation error."""
    cfg = config(data_dir, random_crop=True)
    by_caption = collections.defaultdict(list)
    for r in train_records:
        for c in r["captions"]:
            by_caption[c].append(r["resized"])
    errors = []
    for caption, _, row in rows(batches(make_dataset(cfg, "train", training=True, batch_size=4, repeat=False),
                                        limit=8)):
        image = row["image"].astype(np.float32)
        assert image.shape == (IMAGE, IMAGE, 3)
        errors.append(min(np.abs(image - resized[y:y + IMAGE, x:x + IMAGE]).mean()
                          for resized in by_caption[caption]
                          for y in range(RESIZE - IMAGE + 1) for x in range(RESIZE - IMAGE + 1)))
    assert max(errors) < 12.0, errors  # the best-matching window of the resized image (0..255 scale)


def test_eval_gives_the_central_crop(data_dir, train_records, records_by_file):
    first_file = PreparedDataset.load(data_dir).files("train")[0]
    first = records_by_file[0][0]
    ds = make_dataset(config(data_dir, random_crop=True, random_flip=True), "train", training=False,
                      batch_size=1)
    examples = list(rows(batches(ds)))
    assert len(examples) == 160
    manual = tf.image.crop_to_bounding_box(decode_and_resize(
        tf.constant(open_record_jpeg(first_file)), ImagePreprocessor(IMAGE, RESIZE)), OFFSET, OFFSET, IMAGE, IMAGE).numpy()
    np.testing.assert_array_equal(manual, first["crop"])
    # The first record's captions all come with its central crop.
    with_first = sorted(c for c, _, row in examples if np.array_equal(row["image"], manual))
    assert with_first == sorted(first["captions"])
    assert all(row["image"].shape == (IMAGE, IMAGE, 3) and row["image"].dtype == np.uint8 for _, _, row in examples)
    # Every example is its own image's central crop, never augmented.
    pairs = {(r["crop"].tobytes(), c) for r in train_records for c in r["captions"]}
    assert all((row["image"].tobytes(), c) in pairs for c, _, row in examples)


def open_record_jpeg(path):
    """The encoded JPEG of the first record in ``path``, parsed with plain protobuf (no pipeline code)."""
    serialized = next(iter(tf.data.TFRecordDataset([path]))).numpy()
    example = tf.train.Example.FromString(serialized)
    return example.features.feature[schema.IMAGE_ENCODED].bytes_list.value[0]


@pytest.mark.parametrize("cache", ["none", "memory", "features"])
def test_grouped_batches_hold_whole_images_with_all_their_captions(data_dir, train_records, cache, tmp_path):
    """captions_per_image: grouped — each batch: B images, every caption of each, image_index naming the
    caption's image; one epoch sees each image once (batch_size 10 captions / 5 per image = 2 images)."""
    by_crop = {r["crop"].tobytes(): r for r in train_records}
    by_id = {r["id"]: r for r in train_records}
    cfg = config(data_dir, captions_per_image="grouped", cache=cache, length_window=4)
    feature_fn = None
    if cache == "features":  # a stand-in encoder whose "feature" is the image id, found from the crop
        crops = np.stack([r["crop"] for r in train_records])
        ids = np.array([r["id"] for r in train_records], np.float32)

        def feature_fn(images):
            match = tf.reduce_all(tf.equal(images[:, None], tf.constant(crops)[None]), axis=[2, 3, 4])
            return tf.gather(ids, tf.argmax(tf.cast(match, tf.int32), axis=1))[:, None]

    ds = make_dataset(cfg, "train", training=True, batch_size=10, repeat=False, feature_fn=feature_fn,
                      feature_key="image-id", cache_dir=str(tmp_path / "cache"))
    key = "features" if cache == "features" else "image"
    assert set(ds.element_spec) == {key, "image_index", "input_ids", "target_ids", "mask"}
    seen = collections.Counter()
    for batch in batches(ds):
        images = len(batch[key])
        assert images == 2 and batch["input_ids"].shape[0] == len(batch["image_index"])
        assert batch["input_ids"].shape[1] == batch["mask"].sum(axis=1).max()  # padded to the longest
        owners = [by_crop[im.tobytes()] if key == "image" else by_id[int(im[0])] for im in batch[key]]
        for index, owner in enumerate(owners):
            per_caption = {k: v for k, v in batch.items() if k != key}
            mine = [c for c, _, row in rows([per_caption]) if row["image_index"] == index]
            assert collections.Counter(mine) == collections.Counter(owner["captions"])  # all of them, once
            seen[owner["id"]] += 1
    assert seen == {r["id"]: 1 for r in train_records}  # 32 images, 16 batches of 2: each once


def test_grouped_batches_of_an_odd_batch_size(data_dir, train_records):
    """7 captions a batch at 5 a image: 1 image a batch (never zero); the windows' leftovers are random."""
    cfg = config(data_dir, captions_per_image="grouped", length_window=3)
    got = batches(make_dataset(cfg, "train", training=True, batch_size=7, repeat=False))
    assert len(got) == 32 and all(len(b["image"]) == 1 and len(b["image_index"]) == 5 for b in got)
    assert all(not b["image_index"].any() for b in got)


def test_grouped_batches_with_sampled_captions(data_dir, train_records):
    """data.group_captions: 3 — each image brings 3 distinct captions of its own a epoch, drawn afresh
    every epoch; every batch holds exactly 2 images × 3 captions; k beyond an image's 5 gives all 5."""
    by_crop = {r["crop"].tobytes(): r for r in train_records}
    cfg = config(data_dir, captions_per_image="grouped", group_captions=3, length_window=4)

    def draws(ds, count=None):
        """(image id, the 3 captions it brought) for each image of ``count`` batches."""
        for batch in batches(ds, limit=count):
            assert len(batch["image"]) == 2 and list(batch["image_index"]) == [0, 0, 0, 1, 1, 1]
            per_caption = {k: v for k, v in batch.items() if k != "image"}
            captions = [c for c, _, _ in rows([per_caption])]
            for index, image in enumerate(batch["image"]):
                owner = by_crop[image.tobytes()]
                picked = captions[3 * index:3 * index + 3]
                assert len(set(picked)) == 3 and set(picked) <= set(owner["captions"])
                yield owner["id"], frozenset(picked)

    one_epoch = list(draws(make_dataset(cfg, "train", training=True, batch_size=6, repeat=False)))
    assert collections.Counter(i for i, _ in one_epoch) == {r["id"]: 1 for r in train_records}
    # Epochs of one (repeating) dataset draw afresh — also under a global seed, which makes two datasets
    # built alike draw alike. 4 epochs: an image showing the same 3 of 5 every time has odds 1 in 1,000.
    tf.random.set_seed(7)
    seen = collections.defaultdict(set)
    for image_id, picked in draws(make_dataset(cfg, "train", training=True, batch_size=6, repeat=True), 64):
        seen[image_id].add(picked)
    assert len(seen) == 32 and sum(len(s) > 1 for s in seen.values()) >= 30

    every = config(data_dir, captions_per_image="grouped", group_captions=9, length_window=4)
    got = batches(make_dataset(every, "train", training=True, batch_size=10, repeat=False))
    assert all(len(b["image"]) == 2 and len(b["image_index"]) == 10 for b in got)
