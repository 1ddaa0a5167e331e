"""captioning features extract: a model's encoder grid pooled inside a detector's boxes (ROI align), from COCO
detection results or instances files (oracle boxes on the synthetic data), with jitter, into a features store."""

import json
import os
import shutil

import numpy as np
import pytest
import tensorflow as tf

from captioning.data.features_store import FeaturesStore
from captioning.data.prepared import PreparedDataset
from captioning.errors import InputError
from captioning.inference.regions import Jitter, pool_regions, read_detections
from tests.helpers import run_cli


def test_the_whole_image_is_the_grids_mean_and_a_box_reads_its_own_cells():
    rng = np.random.default_rng(0)
    grid = tf.constant(rng.normal(size=(3, 5, 4)), tf.float32)
    whole = pool_regions(grid, tf.constant([[0.0, 0.0, 1.0, 1.0]]))
    np.testing.assert_allclose(whole.numpy()[0], grid.numpy().mean(axis=(0, 1)), atol=1e-6)
    halves = tf.concat([tf.ones([4, 2, 1]), tf.zeros([4, 2, 1])], axis=1)  # left columns 1, right 0
    left, right = pool_regions(halves, tf.constant([[0.0, 0.0, 1.0, 0.3], [0.0, 0.7, 1.0, 1.0]])).numpy().ravel()
    assert left == pytest.approx(1.0) and right == pytest.approx(0.0)


def test_detections_from_results_and_instances_files(tmp_path):
    results = tmp_path / "dets.json"
    results.write_text(json.dumps([
        {"image_id": 1, "bbox": [0, 0, 10, 10], "score": 0.9, "category_id": 1},
        {"image_id": 1, "bbox": [5, 5, 10, 10], "score": 0.1, "category_id": 1},  # under min_score
        {"image_id": 1, "bbox": [1, 1, 20, 20], "score": 0.95, "category_id": 2},
        {"image_id": 1, "bbox": [2, 2, 5, 5], "score": 0.5, "category_id": 2},
        {"image_id": 2, "bbox": [3, 3, 0, 4], "score": 0.9, "category_id": 1}]))  # empty box
    instances = tmp_path / "instances.json"
    instances.write_text(json.dumps({"images": [], "annotations": [{"image_id": 3, "bbox": [1, 2, 3, 4],
                                                                    "category_id": 1}]}))
    found = read_detections([str(results), str(instances)], min_score=0.2, max_boxes=2)
    assert sorted(found) == [1, 3]
    np.testing.assert_array_equal(found[1], [[1, 1, 20, 20], [0, 0, 10, 10]])  # the best two, best first
    np.testing.assert_array_equal(found[3], [[1, 2, 3, 4]])
    (tmp_path / "bad.json").write_text('{"annotations": [{"image_id": 1}]}')
    with pytest.raises(InputError, match="neither COCO detection results"):
        read_detections([str(tmp_path / "bad.json")])


def test_jitter_is_seeded_clipped_and_spoils_as_asked():
    boxes = np.array([[10, 10, 20, 20], [50, 40, 30, 30]], np.float32)
    assert Jitter().apply(boxes, 7, 100, 80) is boxes
    shifted = Jitter(shift=0.3, seed=1).apply(boxes, 7, 100, 80)
    assert shifted.shape == (2, 4) and not np.allclose(shifted, boxes)
    np.testing.assert_array_equal(shifted, Jitter(shift=0.3, seed=1).apply(boxes, 7, 100, 80))
    assert not np.allclose(shifted, Jitter(shift=0.3, seed=2).apply(boxes, 7, 100, 80))
    assert len(Jitter(miss=1.0).apply(boxes, 7, 100, 80)) == 0
    false = Jitter(miss=1.0, false_boxes=20).apply(boxes, 7, 100, 80)
    assert len(false) > 5 and (false[:, 0] >= 0).all() and (false[:, 0] + false[:, 2] <= 100).all()
    assert (false[:, 1] + false[:, 3] <= 80).all()
    with pytest.raises(InputError, match="jitter"):
        Jitter(shift=1.5)


@pytest.fixture()
def data_dir(prepared_dir, tmp_path):
    copy = tmp_path / "data"
    shutil.copytree(prepared_dir, copy)
    return str(copy)


@pytest.fixture(scope="module")
def attention_model(trained_attention_dir):
    """The trained attention fixture's model, loaded once for the tests that run its encoder in this process."""
    from captioning.inference.captioner import load

    return load(trained_attention_dir).model


def test_extract_oracle_boxes_from_an_attention_model(trained_attention_dir, attention_model, shapes_dir, data_dir):
    from captioning.data.reading import squash

    instances = [os.path.join(shapes_dir, "annotations", f"instances_{s}.json") for s in ("train", "val", "test")]
    args = ["features", "extract", "--data-dir", data_dir, "--images", os.path.join(shapes_dir, "images"),
            "--model-dir", trained_attention_dir, "--name", "oracle"] + [a for p in instances for a in ("--detections", p)]
    done = run_cli(*args)
    assert done.returncode == 0, done.stderr[-2000:]
    store = FeaturesStore.load(data_dir, "oracle")
    regions = store.read()
    assert len(regions) == 40 and store.has_boxes and store.left["missing"].count == 0
    shapes = {}
    for path in instances:
        for ann in json.load(open(path))["annotations"]:
            shapes.setdefault(ann["image_id"], []).append(ann["bbox"])
    model = attention_model
    files = {i: r.file_name for i, r in PreparedDataset.load(data_dir).image_records().items()}
    for image_id, r in list(regions.items())[:6]:
        x, y, w, h = np.array(shapes[image_id]).T
        np.testing.assert_allclose(r.boxes[:-1], np.stack([x, y, x + w, y + h], 1), atol=1e-3)  # in the file's order
        np.testing.assert_array_equal(r.boxes[-1], [0, 0, r.width, r.height])  # and the whole image last
        image = tf.io.decode_image(open(os.path.join(shapes_dir, "images", files[image_id]), "rb").read(), channels=3)
        assert (r.width, r.height) == (image.shape[1], image.shape[0])
        grid = model.encode(squash(image, model.image_size)[None]).numpy()[0]
        np.testing.assert_allclose(r.features[-1], grid.mean(axis=0), rtol=1e-3, atol=2e-3)  # as float16 keeps it
    again = run_cli(*args)
    assert again.returncode == 0 and "extracted already" in again.stdout
    jittered = run_cli(*args[:-len(instances) * 2], *args[-len(instances) * 2:], "--shift", "0.3", "--overwrite")
    assert jittered.returncode == 0, jittered.stderr[-2000:]
    moved = FeaturesStore.load(data_dir, "oracle").read()
    some = next(iter(moved))
    assert len(moved[some].boxes) == len(regions[some].boxes) and not np.allclose(moved[some].boxes[:-1],
                                                                                  regions[some].boxes[:-1])


def test_a_show_and_tell_folder_gives_its_encoders_map(trained_model_dir, shapes_dir, data_dir):
    """Show and Tell reads pooled features, but its encoder has a map (small_cnn's, before it is flattened):
    extraction pools it, so each image's last region (the whole image) is the mean of that map's cells."""
    from captioning.data.reading import squash
    from captioning.model.folder import ModelDir

    done = run_cli("features", "extract", "--data-dir", data_dir, "--images", os.path.join(shapes_dir, "images"),
                   "--model-dir", trained_model_dir, "--detections",
                   os.path.join(shapes_dir, "annotations", "instances_test.json"))
    assert done.returncode == 0, done.stderr[-2000:]
    regions = FeaturesStore.load(data_dir, "regions").read()
    encoder = ModelDir(trained_model_dir).load().model.image_encoder
    assert encoder.layout.tokens == 4 and encoder.depth == 512  # a 2 x 2 map of 128 at 32 px; pooled 512
    records = PreparedDataset.load(data_dir).image_records()
    image_id = sorted(regions)[0]
    pixels = tf.io.decode_image(tf.io.read_file(os.path.join(shapes_dir, "images", records[image_id].file_name)),
                                channels=3, expand_animations=False)
    cells = encoder.tokens_model()(squash(pixels, 32)[None], training=False).numpy()[0]
    assert regions[image_id].features.shape[1] == 128
    np.testing.assert_allclose(regions[image_id].features[-1], cells.mean(axis=0), rtol=2e-2, atol=2e-2)


def test_an_image_that_cannot_be_read_is_counted_and_the_others_extracted(trained_attention_dir, shapes_dir, data_dir,
                                                                          tmp_path):
    images = tmp_path / "images"
    shutil.copytree(os.path.join(shapes_dir, "images"), images)
    names = sorted(os.listdir(images))
    (images / names[0]).write_bytes(b"not a jpeg")  # corrupt
    os.remove(images / names[1])  # missing
    done = run_cli("features", "extract", "--data-dir", data_dir, "--images", str(images), "--model-dir",
                   trained_attention_dir, "--grid-cells", "2", "--name", "cells")
    assert done.returncode == 0, done.stderr[-2000:]
    store = FeaturesStore.load(data_dir, "cells")
    assert store.images == len(names) - 2 and store.left["malformed"].count == 2
    assert any(names[0] in example for example in store.left["malformed"].examples)
    assert any(names[1] in example for example in store.left["malformed"].examples)
    assert done.stdout.splitlines()[-1].startswith("malformed: 2 rows that could not be read")


def test_extraction_rows_come_in_id_order_so_a_rerun_can_skip_those_done(attention_model, shapes_dir, data_dir,
                                                                         tmp_path):
    """region_features yields one row a dataset image, in the order of the ids, an unreadable image at its
    place: what a resumed extraction skips (``skip``) is exactly the rows an earlier run wrote."""
    from captioning.inference.regions import region_features

    images = tmp_path / "images"
    shutil.copytree(os.path.join(shapes_dir, "images"), images)
    dataset = PreparedDataset.load(data_dir)
    records = sorted(dataset.image_records().items())
    (images / records[3][1].file_name).write_bytes(b"not a jpeg")
    os.remove(images / records[20][1].file_name)
    model = attention_model
    cells = {i: np.array([[0, 0, r.width / 2, r.height / 2]], np.float32) for i, r in records}
    rows = list(region_features(model, dataset, str(images), cells, batch_size=8))
    assert [i for i, _ in rows] == [i for i, _ in records]
    assert [k for k, (_, r) in enumerate(rows) if isinstance(r, str)] == [3, 20]
    for skip in (2, 4, 21, len(rows)):
        later = list(region_features(model, dataset, str(images), cells, batch_size=8, skip=skip))
        assert [i for i, _ in later] == [i for i, _ in rows[skip:]]
        for (_, a), (_, b) in zip(later, rows[skip:]):
            assert a == b if isinstance(a, str) else np.array_equal(a.features, b.features)


def test_detections_that_match_few_or_none_of_the_images_are_reported(trained_attention_dir, shapes_dir, data_dir,
                                                                      tmp_path):
    args = ["features", "extract", "--data-dir", data_dir, "--images", os.path.join(shapes_dir, "images"),
            "--model-dir", trained_attention_dir]
    test = os.path.join(shapes_dir, "annotations", "instances_test.json")
    done = run_cli(*args, "--detections", test, "--name", "test_only")
    assert done.returncode == 0, done.stderr[-2000:]
    held = len(json.load(open(test))["images"])
    without = [line for line in done.stdout.splitlines() if line.startswith("detections: ")]
    assert len(without) == 1 and without[0].startswith(f"detections: {40 - held} images without a box (their "
                                                       "whole image only; e.g. ")
    other = tmp_path / "other.json"
    other.write_text(json.dumps([{"image_id": 10**7 + k, "bbox": [1, 2, 3, 4], "score": 0.9} for k in range(3)]))
    refused = run_cli(*args, "--detections", str(other), "--name", "other")
    assert refused.returncode == 2 and "Traceback" not in refused.stderr
    assert refused.stderr.strip().splitlines()[-1] == (
        f"captioning features: error: --detections name none of the dataset's 40 images (e.g. image {10**7}): "
        "are they of another dataset?")
    assert sorted(os.listdir(os.path.join(data_dir, "features"))) == ["test_only"]


def test_one_rule_for_boxes_and_box_geometry_gives_an_inverted_box_no_area():
    from captioning.data.features_store import clean_boxes
    from captioning.model.base import box_geometry

    clean = clean_boxes([[-50, -50, 786, 789], [10, 10, 5, 5], [10, 10, 10, 10], [np.inf, 1, 2, 3], [5, 6, 7, 300],
                         [300, 1, 400, 2]], 262, 263)
    np.testing.assert_array_equal(clean.boxes, [[0, 0, 262, 263], [5, 6, 7, 263]])
    assert clean.kept.tolist() == [True, False, False, False, True, False] and (clean.clipped, clean.dropped) == (2, 4)
    assert box_geometry(tf.constant([[0.5, 0.5, 0.25, 0.75]])).numpy()[0, 4] == 0.0  # not (-0.25) x (0.25) ...
    assert box_geometry(tf.constant([[0.75, 0.75, 0.25, 0.25]])).numpy()[0, 4] == 0.0  # ... nor (-0.5) x (-0.5)


def test_detections_drop_what_is_not_a_box_and_refuse_a_file_with_none(tmp_path):
    results = tmp_path / "dets.json"
    results.write_text(json.dumps([
        {"image_id": 1, "bbox": [1, 1, 20, 20], "score": 0.9},
        {"image_id": 1, "bbox": [float("nan"), 1, 2, 3], "score": 0.9},  # json writes NaN, and reads it
        {"image_id": 2, "bbox": [3, 3, 0, 4], "score": 0.9},
        {"image_id": 2, "bbox": [3, 3, -5, 4], "score": 0.1}]))  # under min_score: not counted
    found = read_detections([str(results)])
    assert sorted(found) == [1] and found.dropped == {1: 1, 2: 1}
    np.testing.assert_array_equal(found[1], [[1, 1, 20, 20]])
    empty, instances, low = tmp_path / "empty.json", tmp_path / "instances.json", tmp_path / "low.json"
    empty.write_text("[]")
    instances.write_text(json.dumps({"images": [{"id": 1, "file_name": "a.jpg"}], "annotations": []}))
    low.write_text(json.dumps([{"image_id": 1, "bbox": [1, 1, 2, 2], "score": 0.1}]))
    for path in (empty, instances):
        with pytest.raises(InputError, match=f"`detections` {path} holds no detection"):
            read_detections([str(path)])
    with pytest.raises(InputError, match=r"none of the 1 detections of `detections` .* scores at least `min_score` 0.2"):
        read_detections([str(low)])
    with pytest.raises(InputError, match=r"`max_boxes` must be an integer in \[1, 100\], got 101"):
        read_detections([str(results)], max_boxes=101)


def test_extract_refuses_a_configs_encoder_of_random_weights_in_one_line(tmp_path):
    """Issue 48 item 14: --config with model.encoder_weights: none pooled an untrained encoder without a word.
    Refused before any work (the registry's random_weights: a ViT always, a keras_hub preset never); a key no chosen
    component reads is refused as train refuses it (item 13)."""
    from captioning.config import ModelConfig
    from captioning.model import typed_model
    from captioning.model.encoders import ENCODERS

    config = tmp_path / "encoder.yaml"
    config.write_text("model:\n  encoder: small_cnn\ndata:\n  image_size: 32\n  resize_size: 36\n")
    data_dir = tmp_path / "data"
    base = ["features", "extract", "--data-dir", data_dir, "--images", tmp_path, "--grid-cells", "2", "--config", config]
    for extra, said in (
            ([], "--config: model.encoder small_cnn would pool regions from random weights (model.encoder_weights: "
                 "none): give model.encoder_weights (imagenet or a weights file), a keras_hub preset, or a trained "
                 "model with --model-dir"),
            (["--set", "model.encoder_weights=imagenet", "--set", "model.vit_patch_size=4"],
             "model.vit_patch_size is read by the vit encoder, not small_cnn: leave it out (given with --set), or "
             "choose model.encoder: vit")):
        done = run_cli(*base, *extra)
        assert (done.returncode, [line for line in done.stderr.splitlines() if "error" in line]) == (
            2, [f"captioning features: error: {said}"]), done.stderr[-2000:]
    assert not data_dir.exists()

    def random(name, **values):
        cfg = ModelConfig(encoder=name, **values)
        return ENCODERS[name].random_weights(cfg, typed_model(cfg).encoder_settings)

    assert random("vit") and random("mobilenet_v2") and not random("mobilenet_v2", encoder_weights="imagenet")
    assert not random("small_cnn", encoder_weights=str(config)) and not random("keras_hub")


def test_every_size_extract_takes_has_a_bound_checked_before_any_work(tmp_path):
    """--grid-cells 100000 (killed for memory) and --false-boxes 1e9 (a 14.9 GiB allocation) among them: one
    line, exit 2, before a model or dataset is read (neither exists here)."""
    from captioning.cli import features as cli
    from captioning.inference import regions

    assert (cli.MAX_BOXES, cli.MAX_GRID_CELLS, cli.MAX_FALSE_BOXES, cli.MAX_SEED) == (
        regions.MAX_BOXES, regions.MAX_GRID_CELLS, regions.MAX_FALSE_BOXES, regions.MAX_SEED)
    base = ["features", "extract", "--data-dir", str(tmp_path / "none"), "--images", str(tmp_path),
            "--model-dir", str(tmp_path / "none")]
    for flags, said in ((["--grid-cells", "100000"], "--grid-cells: must be an integer in [1, 10], got 100000"),
                        (["--grid-cells", "3", "--false-boxes", "1e9"],
                         "--false-boxes: must be a number in [0, 100], got 1e9"),
                        (["--grid-cells", "3", "--max-boxes", "1000"], "--max-boxes: must be an integer in [1, 100], got 1000"),
                        (["--grid-cells", "3", "--seed", str(2**32)],
                         f"--seed: must be an integer in [0, 4,294,967,295], got {2**32}")):
        done = run_cli(*base, *flags)
        assert done.returncode == 2 and done.stderr.strip().splitlines() == [
            f"captioning features: error: argument {said} (see captioning features extract --help)"], done.stderr
    with pytest.raises(InputError, match=r"`false_boxes` in \[0, 100\]"):
        Jitter(false_boxes=1e9)
    with pytest.raises(InputError, match=r"`grid_cells` must be an integer in \[1, 10\]"):
        regions.grid_boxes(100, 100, 100000)


@pytest.mark.slow
def test_extract_clips_drops_and_counts_bad_boxes_and_refuses_an_empty_detections_file(trained_attention_dir,
                                                                                       shapes_dir, data_dir, tmp_path):
    """A NaN box (once a CropAndResize traceback that left features/.partial-x behind), an inverted one, one
    of no area and one reaching outside the image: the rule of the imports (clean_boxes), counted in the
    report; an empty detections file ([]) is refused in one line and leaves nothing."""
    records = sorted(PreparedDataset.load(data_dir).image_records().items())
    (a, ra), (b, rb) = records[0], records[1]
    dets = tmp_path / "dets.json"
    dets.write_text(json.dumps([
        {"image_id": a, "bbox": [float("nan"), 1, 2, 3], "score": 0.9},
        {"image_id": a, "bbox": [10, 10, -5, -5], "score": 0.9},
        {"image_id": a, "bbox": [10, 10, 0, 0], "score": 0.9},
        {"image_id": a, "bbox": [-20, 5, 60, 30], "score": 0.8},
        {"image_id": b, "bbox": [ra.width + 10, 5, 20, 20], "score": 0.9},  # outside a (and b's) image
        {"image_id": b, "bbox": [2, 3, 10, 10], "score": 0.5}]))
    args = ["features", "extract", "--data-dir", data_dir, "--images", os.path.join(shapes_dir, "images"),
            "--model-dir", trained_attention_dir, "--name", "x3"]
    done = run_cli(*args, "--detections", str(dets))
    assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr[-2000:]
    out = done.stdout.splitlines()
    assert f"boxes: 4 dropped (a coordinate not finite, or no area inside the image; e.g. image {a}: 3; image {b}: 1)" \
        in out and f"boxes: 1 clipped to the image (e.g. image {a}: 1)" in out
    got = FeaturesStore.load(data_dir, "x3").read([a, b])
    np.testing.assert_array_equal(got[a].boxes, [[0, 5, 40, 35], [0, 0, got[a].width, got[a].height]])
    np.testing.assert_array_equal(got[b].boxes, [[2, 3, 12, 13], [0, 0, got[b].width, got[b].height]])
    assert os.listdir(os.path.join(data_dir, "features")) == ["x3"]
    empty = tmp_path / "empty.json"
    empty.write_text("[]")
    done = run_cli(*args[:-1], "empty", "--detections", str(empty))
    assert done.returncode == 2 and done.stderr.strip().splitlines()[-1] == (
        f"captioning features: error: --detections {empty} holds no detection ([]): give the detector's results for "
        "the images")
    assert os.listdir(os.path.join(data_dir, "features")) == ["x3"]


def test_caption_names_images_without_a_box_and_counts_boxes_dropped_or_clipped(shapes_dir, tmp_path):
    """caption --detections' side (before the model): each file's boxes by the same rule in the pixels of
    the image the model is given, what was dropped (a NaN box included) or clipped counted, the images left
    without a box named; an empty detections file refused."""
    from PIL import Image

    from captioning.inference.caption import Result, boxes_report, clean_file_boxes, detections_for, read_for_model

    paths = []
    for k, size in enumerate([(100, 80), (60, 50), (70, 70)]):
        paths.append(str(tmp_path / f"photo_{k + 1}.png"))
        Image.new("RGB", size, "red").save(paths[-1])
    dets = tmp_path / "dets.json"
    dets.write_text(json.dumps([{"image_id": 1, "bbox": [float("nan"), 1, 2, 3], "score": 0.9},
                                {"image_id": 1, "bbox": [90, 70, 20, 20], "score": 0.9},
                                {"image_id": 1, "bbox": [200, 5, 20, 20], "score": 0.9},
                                {"image_id": 2, "bbox": [5, 6, 7, 8], "score": 0.9}]))
    found = detections_for(paths, [str(dets)])
    assert [len(b) for b in found] == [2, 1, 0] and found.unusable == [1, 0, 0]
    results = [Result(p, boxes=b, data=read_for_model(p)) for p, b in zip(paths, found)]
    for result, unusable in zip(results, found.unusable):
        clean_file_boxes(result, unusable)
    np.testing.assert_array_equal(results[0].boxes, [[90, 70, 10, 10]])  # clipped to the 100 x 80 image
    np.testing.assert_array_equal(results[1].boxes, [[5, 6, 7, 8]])
    assert boxes_report(results) == [
        f"detections: 1 of 3 images have no box, each captioned from its whole image alone: {paths[2]}",
        f"detections: 2 boxes dropped (a coordinate not finite, or no area inside the image; e.g. {paths[0]}: 2)",
        f"detections: 1 boxes clipped to the image (e.g. {paths[0]}: 1)"]
    empty = tmp_path / "empty.json"
    empty.write_text("[]")
    with pytest.raises(InputError, match="holds no detection"):
        detections_for(paths, [str(empty)])
