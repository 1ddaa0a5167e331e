"""data.features: regions — the input pipeline reads a features store (no JPEG decoded), pads each batch's
regions with a mask, and the decoders train, decode, evaluate and ground over regions, from a store that
`features extract` pooled (new images' boxes are pooled as it did) or one imported without boxes."""

import json
import math
import os
import re
import shutil

import numpy as np
import pytest
import tensorflow as tf

from captioning.config import Config, load_config
from captioning.data.features_store import FeaturesStore
from captioning.data.pipeline import make_dataset
from captioning.data.prepared import PreparedDataset
from captioning.data.region_input import eval_regions, store_of
from captioning.errors import InputError
from captioning.model.data_sources import data_source
from tests.helpers import assert_scst_update_as_one_device, distributed_result, run_cli, small_train_config

SPLITS = ("train", "val", "test")


def instances_files(shapes_dir):
    return [os.path.join(shapes_dir, "annotations", f"instances_{s}.json") for s in SPLITS]


# region_data (the oracle store) is conftest's: the 2-replica scenarios over regions (distributed_runs) read it too
ATTENTION = ("model.decoder=attention", "model.attention_size=16", "model.embedding_size=32", "model.lstm_units=32",
             "train.optimizer=adam", "train.learning_rate=0.01")


def regions_trainer(data_dir, model_dir, *extra):
    from captioning.experiment import for_training
    from captioning.train import Trainer

    cfg = region_config(data_dir, *ATTENTION, "train.steps=30", "train.checkpoint_every_steps=30",
                        "train.eval_every_steps=30", "train.eval_batches=1", "train.sample_captions=2", *extra)
    return Trainer(for_training(cfg), model_dir)


def train_regions(data_dir, model_dir, *extra):
    return regions_trainer(data_dir, model_dir, *extra).run(progress=False)


@pytest.fixture(scope="module")
def region_model(region_data, tmp_path_factory):
    """An attention model trained 30 steps on the oracle regions (no evaluation during training: the
    geometry-grouped training of test_train_and_evaluate_an_attention_model_on_regions_with_grounding evaluates
    with sample captions over regions; traced here too, it cost a second of CPU and no test read it)."""
    model_dir = str(tmp_path_factory.mktemp("region_model") / "model")
    result = train_regions(region_data[0], model_dir, "train.eval_every_steps=0")
    assert result.step == 30 and np.isfinite(result.losses).all() and result.losses[-1] < result.losses[0]
    return model_dir


@pytest.fixture(scope="module")
def region_captioner(region_model):
    """:func:`region_model`'s Captioner, loaded once for the tests that decode with it in this process."""
    from captioning.inference.captioner import Captioner, load

    return Captioner(load(region_model))


@pytest.fixture(scope="module")
def pooling_encoder(trained_attention_dir):
    """The encoder weights (arrays) of the attention fixture, whose encoder pooled the oracle store's regions."""
    from captioning.inference.captioner import load

    return [w.numpy() for w in load(trained_attention_dir).model.encoder.weights]


def region_config(data_dir, *extra):
    return small_train_config(data_dir, "data.features=regions", "data.features_store=oracle", *extra)


@pytest.fixture(scope="module")
def captioned_test_images(region_model, shapes_dir, tmp_path_factory):
    """``caption --detections INSTANCES --json --html GALLERY`` with :func:`region_model` over the test images (the
    instances file's boxes): ``(the command's CompletedProcess, the gallery's path)``, one command that the
    SavedModel test and the ensemble test both read."""
    test = json.load(open(instances_files(shapes_dir)[2]))
    files = [os.path.join(shapes_dir, "images", image["file_name"]) for image in test["images"]]
    html = tmp_path_factory.mktemp("captioned") / "gallery.html"
    done = run_cli("caption", "--model-dir", region_model, "--detections", instances_files(shapes_dir)[2], "--json",
                   "--html", str(html), *files)
    return done, html


IMPORTED = 16  # features a region of the imported store


@pytest.fixture(scope="module")
def imported_data(prepared_dir, tmp_path_factory):
    """A copy of the prepared fixture with the store "bottomup", imported (`captioning features import --hdf5`)
    from an HDF5 file written here as the meshed-memory Transformer's: ``<id>_features`` only, no boxes, 2 to 5
    regions an image whose features depend on its captions' words; the first test image left out."""
    import h5py

    data_dir = str(tmp_path_factory.mktemp("imported_data") / "data")
    shutil.copytree(prepared_dir, data_dir)
    records = PreparedDataset.load(data_dir).image_records()
    left_out = min(i for i, r in records.items() if r.split == "test")
    path = os.path.join(os.path.dirname(data_dir), "coco_detections.hdf5")
    with h5py.File(path, "w") as f:
        for image_id, record in sorted(records.items()):
            if image_id != left_out:
                rng = np.random.default_rng(image_id)
                words = sorted({w for c in record.captions for w in c})
                meaning = np.bincount(np.array(words) % IMPORTED, minlength=IMPORTED).astype(np.float32)
                f[f"{image_id}_features"] = meaning + rng.normal(0, 0.1, (2 + image_id % 4, IMPORTED))
    done = run_cli("features", "import", "--data-dir", data_dir, "--hdf5", path, "--name", "bottomup")
    assert done.returncode == 0, done.stderr[-2000:]
    assert "(no boxes)" in done.stdout.splitlines()[0]
    return data_dir, left_out


@pytest.mark.parametrize("multiple", [1, 4])
def test_batches_carry_each_images_regions_padded_with_a_mask(region_data, multiple):
    """Padded to the batch's most regions (``data.region_pad_multiple: 1``), or that rounded up to a multiple."""
    data_dir, left_out = region_data
    store = FeaturesStore.load(data_dir, "oracle")
    held = store.read()
    cfg = load_config(overrides=[f"data.dir={data_dir}", "data.features=regions", "data.features_store=oracle",
                                 f"data.region_pad_multiple={multiple}"]).data
    seen = {}
    for batch in eval_regions(cfg, "train", store_of(cfg, PreparedDataset.load(data_dir)), 5):
        regions, boxes, mask = batch["regions"].numpy(), batch["boxes"].numpy(), batch["region_mask"].numpy()
        counts = [len(held[int(i)].features) for i in batch["image_id"].numpy()]
        assert regions.dtype == np.float16 and regions.shape[1] == -(-max(counts) // multiple) * multiple
        assert mask.shape == regions.shape[:2] and boxes.shape[1] == regions.shape[1]
        np.testing.assert_array_equal(mask.sum(axis=1), counts)
        for row, image_id in enumerate(batch["image_id"].numpy()):
            r, n = held[int(image_id)], counts[row]
            np.testing.assert_array_equal(regions[row, :n], r.features)
            assert not regions[row, n:].any() and not boxes[row, n:].any()
            np.testing.assert_allclose(boxes[row, :n], r.boxes / [r.width, r.height, r.width, r.height], atol=1e-6)
            assert (boxes[row, :n] >= 0).all() and (boxes[row, :n] <= 1).all()
            assert batch["captions"][row].to_list() == r.captions
            seen[int(image_id)] = n
    train = [i for i, r in PreparedDataset.load(data_dir).image_records().items() if r.split == "train"]
    assert sorted(seen) == sorted(set(train) - {left_out})  # every image with regions once; none without

    training = make_dataset(cfg, "train", training=True, batch_size=8, source=data_source(Config(data=cfg)))
    for batch in training.take(3):
        assert set(batch) >= {"regions", "boxes", "region_mask", "input_ids"} and "image" not in batch
        assert batch["regions"].shape[0] == batch["input_ids"].shape[0] == 8  # a copy per caption
        assert batch["regions"].shape[1] % multiple == 0 and batch["region_mask"].shape == batch["regions"].shape[:2]


def test_region_padding_to_a_multiple_changes_no_caption_or_weight(region_data, region_captioner):
    """The padding that ``data.region_pad_multiple`` adds is masked: a model captions a batch padded to 16 regions
    as the batch padded to its largest count, with the same log-probabilities and attention over the real ones
    (and none over the padding)."""
    data_dir, captioner = region_data[0], region_captioner
    out = {}
    for multiple in (1, 16):
        cfg = load_config(overrides=[f"data.dir={data_dir}", "data.features=regions", "data.features_store=oracle",
                                     f"data.region_pad_multiple={multiple}"]).data
        batch = next(iter(eval_regions(cfg, "test", store_of(cfg, PreparedDataset.load(data_dir)), 8)))
        out[multiple] = (captioner.decode_batch(batch), batch["region_mask"].numpy())
    (tight, mask), (wide, wide_mask) = out[1], out[16]
    assert mask.shape[1] < 16 == wide_mask.shape[1] and (wide_mask[:, :mask.shape[1]] == mask).all()
    np.testing.assert_array_equal(wide["ids"].numpy(), tight["ids"].numpy())
    np.testing.assert_allclose(wide["log_probs"].numpy(), tight["log_probs"].numpy(), atol=1e-5)
    n = mask.shape[1]
    np.testing.assert_allclose(wide["attention"].numpy()[..., :n], tight["attention"].numpy(), atol=1e-6)
    assert not wide["attention"].numpy()[..., n:].any()


def test_a_store_of_another_dataset_version_or_missing_is_one_line(region_data, tmp_path):
    data_dir, _ = region_data
    cfg = load_config(overrides=[f"data.dir={data_dir}", "data.features=regions", "data.features_store=none"]).data
    with pytest.raises(InputError, match="has no features store 'none'"):
        make_dataset(cfg, "train", training=True, batch_size=4, source=data_source(Config(data=cfg)))
    copy = tmp_path / "data"
    shutil.copytree(data_dir, copy)
    manifest = copy / "features" / "oracle" / "store.json"
    document = json.loads(manifest.read_text())
    manifest.write_text(json.dumps({**document, "dataset": "another"}))
    cfg = load_config(overrides=[f"data.dir={copy}", "data.features=regions", "data.features_store=oracle"]).data
    with pytest.raises(InputError, match="written for another version"):
        make_dataset(cfg, "train", training=True, batch_size=4, source=data_source(Config(data=cfg)))


@pytest.mark.parametrize("extra", [(), ("model.box_geometry=true", "data.captions_per_image=grouped")],
                         ids=["plain", "geometry-grouped"])
@pytest.mark.slow
def test_train_and_evaluate_an_attention_model_on_regions_with_grounding(region_data, region_model, shapes_dir,
                                                                         region_captioner, pooling_encoder, tmp_path,
                                                                         extra):
    from captioning.evaluation.evaluate import evaluate
    from captioning.inference.captioner import load
    from captioning.model.folder import ModelDir

    data_dir, _ = region_data
    model_dir = region_model
    trained = region_captioner.trained  # region_model, loaded once for the file
    if extra:  # 12 steps, an evaluation with sample captions at the end
        model_dir = str(tmp_path / "model")
        result = train_regions(data_dir, model_dir, *extra, "train.steps=12", "train.eval_every_steps=12",
                               "train.checkpoint_every_steps=12")
        assert result.step == 12 and np.isfinite(result.losses).all() and result.losses[-1] < result.losses[0]
    saved = ModelDir(model_dir).read_config()
    geometry = "model.box_geometry=true" in extra
    size = FeaturesStore.load(data_dir, "oracle").feature_size  # small_cnn's 128 channels
    assert (saved.data.features, saved.model.region_feature_size, saved.model.box_geometry,
            saved.model.regions_from_encoder) == ("regions", size, geometry, True)
    # the encoder, never trained here, is the one that pooled the regions
    encoder = (load(model_dir) if extra else trained).model.encoder.weights
    assert len(encoder) == len(pooling_encoder) > 0
    for a, b in zip(encoder, pooling_encoder):
        np.testing.assert_array_equal(a.numpy(), b)
    if extra:  # evaluation reads regions the same way with or without geometry: once is enough
        return
    out = evaluate(model_dir, split="test", progress=False, instances=instances_files(shapes_dir)[2])
    assert out.num_images == 4 and np.isfinite(out.perplexity) and out.metrics["CIDEr"] >= 0
    assert set(out.grounding["attention"]) == {"color", "kind"}  # judged over the regions' boxes
    assert set(out.grounding["naming"]) and set(out.grounding["relations"])


@pytest.mark.slow
def test_updown_trains_on_an_imported_store_and_evaluate_captions_the_stores_test_images(imported_data, shapes_dir,
                                                                                        tmp_path):
    """A store imported from an HDF5 without boxes: Up-Down trains on it (the config fitted to the store:
    its feature size; no encoder pooled these regions), and `captioning evaluate` captions each test image
    the store holds, once, with a finite loss; `caption` refuses new images for such a model."""
    from captioning.model.folder import ModelDir
    from captioning.experiment import for_training
    from captioning.train import Trainer

    data_dir, left_out = imported_data
    model_dir = str(tmp_path / "model")
    cfg = region_config(data_dir, "data.features_store=bottomup", "model.decoder=updown", "model.embedding_size=16",
                        "model.lstm_units=16", "model.attention_size=8", "train.optimizer=adam",
                        "train.learning_rate=0.01", "train.steps=12", "train.checkpoint_every_steps=12")
    result = Trainer(for_training(cfg), model_dir).run(progress=False)
    assert result.step == 12 and np.isfinite(result.losses).all() and result.losses[-1] < result.losses[0]
    saved = ModelDir(model_dir).read_config()
    assert (saved.model.decoder, saved.model.region_feature_size, saved.model.box_geometry,
            saved.model.regions_from_encoder) == ("updown", IMPORTED, False, False)
    metrics = tmp_path / "metrics.json"
    done = run_cli("evaluate", "--model-dir", model_dir, "--split", "test", "--beam-size", "2", "--output", metrics)
    assert done.returncode == 0, done.stderr[-2000:]
    store = FeaturesStore.load(data_dir, "bottomup")
    held = sorted(store.read(i for i, r in PreparedDataset.load(data_dir).image_records().items()
                             if r.split == "test"))
    assert len(held) == store.split("test").images == 3 and left_out not in held
    assert done.stdout.startswith("test: 3 images, checkpoint step 12, beam 2, perplexity ")
    out = json.loads(metrics.read_text())
    assert (out["num_images"], out["checkpoint_step"], out["split"]) == (3, 12, "test")
    assert math.isfinite(out["loss"]) and out["loss"] > 0 and out["perplexity"] == pytest.approx(math.exp(out["loss"]))
    assert all(math.isfinite(v) and v >= 0 for v in out["metrics"].values()) and "CIDEr" in out["metrics"]
    eval_dir = os.path.join(model_dir, "eval")
    [predictions] = [n for n in os.listdir(eval_dir) if n.endswith(".predictions.json")]
    predictions = json.load(open(os.path.join(eval_dir, predictions)))
    vocab = set(open(os.path.join(model_dir, "vocab.txt"), encoding="utf-8").read().split())
    assert sorted(p["image_id"] for p in predictions) == held  # one caption per test image of the store
    assert all(isinstance(p["caption"], str) and set(p["caption"].split()) <= vocab for p in predictions)
    test = json.load(open(instances_files(shapes_dir)[2]))
    image = os.path.join(shapes_dir, "images", test["images"][0]["file_name"])
    done = run_cli("caption", "--model-dir", model_dir, "--detections", instances_files(shapes_dir)[2], image)
    assert done.returncode == 2 and "which were not pooled by its encoder" in done.stderr


def test_box_geometry_over_a_store_without_boxes_is_refused_before_any_step(imported_data, tmp_path):
    from captioning.experiment import for_training
    from captioning.train import Trainer

    data_dir, _ = imported_data
    model_dir = tmp_path / "model"
    with pytest.raises(InputError) as refused:
        Trainer(for_training(region_config(data_dir, "data.features_store=bottomup", "model.box_geometry=true")), str(model_dir))
    message = str(refused.value)
    assert "\n" not in message and message.startswith("model.box_geometry appends each region's box to its features")
    assert f"the features store {data_dir}/features/bottomup holds no boxes" in message
    assert not model_dir.exists() or not os.listdir(model_dir)  # nothing written, no step taken


def test_attention_over_regions_is_judged_by_the_named_shapes_box():
    """A word's attention over regions: its mass on the named shape is Σ α × the share of each region's area
    the shape's box covers; uniform attention over the regions is the baseline."""
    from captioning.data.scenes import ShapeBox
    from captioning.evaluation.grounding import ImageShapes, Instances, attention_localisation

    shapes = Instances({7: ImageShapes(100, 100, (ShapeBox("circle", "red", "small", (0, 0, 50, 50)),
                                                  ShapeBox("square", "blue", "small", (50, 50, 50, 50))))},
                       kinds=("circle", "square"), colors=("blue", "red"))
    boxes = [[0, 0, 0.5, 0.5], [0.5, 0.5, 1, 1], [0, 0, 1, 1]]  # the two shapes' oracle boxes and the whole image
    words = ["a", "red", "circle", "and", "a", "blue", "square"]
    alpha = [[1 / 3] * 3, [0.8, 0.1, 0.1], [0.5, 0.0, 0.5], [1 / 3] * 3, [1 / 3] * 3, [0.0, 0.0, 1.0], [0.1, 0.9, 0.0]]
    result = attention_localisation(shapes, {7: (words, alpha)}, regions={7: boxes})
    color, kind = result.color["all"], result.kind["all"]
    # red: 0.8 × 1 + 0.1 × 0 + 0.1 × 0.25; blue: the whole image only, 0.25; uniform: (1 + 0 + 0.25) / 3
    assert color.words == 2 and color.mean_mass == pytest.approx((0.825 + 0.25) / 2)
    assert kind.mean_mass == pytest.approx((0.5 + 0.125 + 0.9) / 2)
    assert color.mean_area == pytest.approx(1.25 / 3)
    with pytest.raises(InputError, match=r"over 3 regions; expected \(7, 3\)"):
        attention_localisation(shapes, {7: (words, np.ones((7, 4)) / 4)}, regions={7: boxes})


@pytest.mark.slow
def test_caption_and_the_saved_model_pool_new_images_boxes_as_the_store_did(region_data, region_model, shapes_dir,
                                                                            captioned_test_images, region_captioner,
                                                                            tmp_path):
    """caption --detections and the SavedModel pool each image's boxes from the model's encoder as extraction
    pooled the store's regions: the captions are those evaluate gives from the store; the regions' boxes in
    --json and in the SavedModel's `regions` are the store's; the SavedModel's attention is over them (none
    on padding boxes) and is --json's; the gallery names (data-region) the region each word weighed most."""
    from captioning.evaluation.evaluate import evaluate
    from captioning.inference.export import export

    data_dir, _ = region_data
    stored = evaluate(region_model, split="test", progress=False)
    predictions = os.path.join(region_model, "eval", [n for n in os.listdir(os.path.join(region_model, "eval"))
                                                      if n.endswith(".predictions.json")][0])
    expected = {p["image_id"]: p["caption"] for p in json.load(open(predictions))}
    test = json.load(open(instances_files(shapes_dir)[2]))
    files = [os.path.join(shapes_dir, "images", image["file_name"]) for image in test["images"]]
    done, html = captioned_test_images  # caption --detections --json --html over these files
    assert done.returncode == 0, done.stderr[-2000:]
    lines = [json.loads(line) for line in done.stdout.splitlines()]
    boxes = {image["id"]: [a["bbox"] for a in test["annotations"] if a["image_id"] == image["id"]]
             for image in test["images"]}
    for image, line in zip(test["images"], lines):
        assert line["captions"][0]["caption"] == expected[image["id"]]
        assert len(line["regions"]) == len(boxes[image["id"]]) + 1 and line["regions"][-1] == [0, 0, 1, 1]
        words = line["captions"][0]["caption"].split()
        # (a model trained 30 steps may say nothing: no word, no weights)
        assert np.array(line["captions"][0]["attention"]).reshape(-1, len(line["regions"])).shape == \
            (len(words), len(line["regions"]))
    assert html.read_text().count('alt="attention for') == sum(len(line["captions"][0]["caption"].split())
                                                                for line in lines)
    assert stored.num_images == 4
    # the SavedModel: images and boxes (padded with empty boxes) in, the same captions out
    output = export(region_captioner, str(tmp_path / "export"), region_model)
    loaded = tf.saved_model.load(output)  # once, for both signatures
    serve = loaded.signatures["serving_default"]
    most = max(len(b) for b in boxes.values())
    padded = np.zeros((len(files), most, 4), np.float32)
    for i, image in enumerate(test["images"]):
        padded[i, :len(boxes[image["id"]])] = boxes[image["id"]]
    out = serve(images=tf.constant([open(f, "rb").read() for f in files]), boxes=tf.constant(padded))
    assert [c.decode() for c in out["captions"][:, 0].numpy()] == [expected[i["id"]] for i in test["images"]]
    # the tf.Example signature: image bytes under image/encoded, boxes flattened under image/boxes (an image
    # without boxes: none), the same outputs
    examples = [tf.train.Example(features=tf.train.Features(feature={
        "image/encoded": tf.train.Feature(bytes_list=tf.train.BytesList(value=[open(f, "rb").read()])),
        "image/boxes": tf.train.Feature(float_list=tf.train.FloatList(value=np.ravel(boxes[image["id"]])))}))
        for f, image in zip(files, test["images"])]
    from_examples = loaded.signatures["serving_examples"](
        examples=tf.constant([e.SerializeToString() for e in examples]))
    assert sorted(from_examples) == sorted(out)
    for key in out:
        np.testing.assert_array_equal(from_examples[key].numpy(), out[key].numpy())
    # the boxes as the store holds them (x1, y1, x2, y2 fractions, the whole image last): in --json's regions
    # and in the SavedModel's, whose padding boxes are zeros and get no attention
    held = FeaturesStore.load(data_dir, "oracle").read(boxes)
    served, weights, exact = out["regions"].numpy(), out["attention"].numpy(), []
    assert served.shape == (len(files), most + 1, 4)
    assert weights.shape[0] == len(files) and weights.shape[2] == most + 1  # [images, words, regions]
    for i, (image, line) in enumerate(zip(test["images"], lines)):
        r, n = held[image["id"]], len(boxes[image["id"]])
        stored = r.boxes / [r.width, r.height, r.width, r.height]
        np.testing.assert_allclose(line["regions"], stored, atol=1e-5)
        np.testing.assert_allclose(served[i, :n], stored[:n], atol=1e-6)
        assert not served[i, n:most].any() and served[i, most].tolist() == [0, 0, 1, 1]
        words = len(line["captions"][0]["caption"].split())
        np.testing.assert_allclose(weights[i, :words].sum(axis=1), 1.0, atol=1e-5)
        assert not weights[i, :, n:most].any() and not weights[i, words:].any()
        exact.append(weights[i, :words][:, list(range(n)) + [most]])  # over --json's regions, unrounded
        np.testing.assert_allclose(exact[-1], np.reshape(line["captions"][0]["attention"], (words, n + 1)), atol=1e-4)
    # the gallery outlines, and names in data-region, the region each word of the best caption weighed most
    marked = [int(k) for k in re.findall(r'alt="attention for [^"]*" data-region="(\d+)"', html.read_text())]
    weighed = [np.reshape(line["captions"][0]["attention"], (-1, len(line["regions"]))) for line in lines]
    assert len(marked) == sum(len(w) for w in weighed) == sum(len(w) for w in exact)
    for k, w, unrounded in zip(marked, (w for image in weighed for w in image), (w for image in exact for w in image)):
        # the largest of --json's weights (rounded to 5 decimals there: a weakly trained model's nearly uniform
        # weights may tie), and the largest of the same weights unrounded
        assert w[k] == w.max() and k == int(np.argmax(unrounded)), (k, w, unrounded)


def test_new_images_boxes_pool_the_regions_the_store_holds(region_data, region_captioner, shapes_dir, monkeypatch):
    """What caption --detections pools for the test images (through the captioner, from the files' bytes
    and the boxes the detections file gives them) equals the store's regions of those images: features to
    float16 precision, boxes as fractions of the image, the whole image last; padding boxes pool nothing."""
    import captioning.inference.captioner as captioner_module
    from captioning.inference import regions as regions_module
    from captioning.inference.caption import detections_for, read_for_model

    data_dir, _ = region_data
    test = json.load(open(instances_files(shapes_dir)[2]))
    files = [os.path.join(shapes_dir, "images", image["file_name"]) for image in test["images"]]
    found = detections_for(files, [instances_files(shapes_dir)[2]])  # as caption --detections matches them
    pooled = []

    def recorded(*args):
        pooled.append(regions_module.boxes_to_regions(*args))
        return pooled[-1]

    monkeypatch.setattr(captioner_module, "boxes_to_regions", recorded)
    most = max(len(b) for b in found)
    padded = np.zeros((len(files), most, 4), np.float32)
    for i, b in enumerate(found):
        padded[i, :len(b)] = b
    region_captioner.decode_with_boxes(tf.constant([read_for_model(f) for f in files]),
                                       tf.constant(padded))  # eager: the pooled values are seen
    assert len(pooled) == 1
    regions, boxes, mask = (pooled[0][k].numpy() for k in ("regions", "boxes", "region_mask"))
    held = FeaturesStore.load(data_dir, "oracle").read([image["id"] for image in test["images"]])
    assert regions.shape[:2] == (len(files), most + 1) and regions.dtype == np.float16
    for i, image in enumerate(test["images"]):
        r, n = held[image["id"]], len(found[i])
        assert len(r.features) == n + 1 >= 2  # the image's shapes and the whole image
        real = list(range(n)) + [most]
        np.testing.assert_array_equal(mask[i], [1.0] * n + [0.0] * (most - n) + [1.0])
        assert np.abs(r.features).max() > 0.1
        np.testing.assert_allclose(regions[i, real].astype(np.float32), r.features.astype(np.float32),
                                   rtol=1e-3, atol=1e-3)  # float16 keeps 11 bits: 1 in 2048
        np.testing.assert_allclose(boxes[i, real], r.boxes / [r.width, r.height, r.width, r.height], atol=1e-6)
        assert not regions[i, n:most].any() and not boxes[i, n:most].any()


@pytest.mark.slow
def test_an_ensemble_with_a_model_of_regions_pools_the_boxes_for_it(region_data, region_model, shapes_dir,
                                                                    trained_attention_dir, captioned_test_images,
                                                                    tmp_path):
    """caption over an ensemble holding a model of extracted regions: that model pools each image's boxes
    (an ensemble of it and a copy of itself captions as it does), a model of the grid beside it reads the
    image; evaluate refuses the mix in one line (it reads each image once)."""
    test = json.load(open(instances_files(shapes_dir)[2]))
    files = [os.path.join(shapes_dir, "images", image["file_name"]) for image in test["images"]]
    copy = tmp_path / "copy"
    shutil.copytree(region_model, copy)
    detections = ("--detections", instances_files(shapes_dir)[2], "--json", *files)
    alone = captioned_test_images[0]  # the model alone: the same command with --html (the JSON lines the same)
    twice, mixed = (run_cli("caption", *(a for m in models for a in ("--model-dir", m)), *detections)
                    for models in ([region_model, str(copy)], [region_model, trained_attention_dir]))
    assert alone.returncode == twice.returncode == mixed.returncode == 0, (twice.stderr[-2000:], mixed.stderr[-2000:])
    alone, twice, mixed = ([json.loads(line) for line in done.stdout.splitlines()] for done in (alone, twice, mixed))
    for a, t, m in zip(alone, twice, mixed):
        assert t["captions"][0]["caption"] == a["captions"][0]["caption"]
        assert t["captions"][0]["log_prob"] == pytest.approx(a["captions"][0]["log_prob"], abs=1e-4)
        assert "attention" not in t["captions"][0] or t["captions"][0]["attention"] is None
        np.testing.assert_allclose(m["regions"], a["regions"], atol=1e-5)  # the boxes, as fractions, the whole image last
    done = run_cli("evaluate", "--model-dir", region_model, "--model-dir", trained_attention_dir)
    assert done.returncode == 2 and done.stderr.strip().splitlines()[-1].startswith(
        f"captioning evaluate: error: the models in {region_model} and {trained_attention_dir} read different inputs "
        "(data.features 'regions' against 'images', data.features_store 'oracle' against None, data.image_size None "
        "against 32, data.resize_size None against 36)")


def test_caption_refusals(region_model, trained_attention_dir, shapes_dir):
    image = os.path.join(shapes_dir, "images", json.load(open(instances_files(shapes_dir)[2]))["images"][0]["file_name"])
    done = run_cli("caption", "--model-dir", region_model, image)
    assert done.returncode == 2 and "reads regions: give each image's boxes with --detections" in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1
    done = run_cli("caption", "--model-dir", trained_attention_dir, "--detections", instances_files(shapes_dir)[2], image)
    assert done.returncode == 2 and "reads its encoder's grid, not regions" in done.stderr
    from captioning.inference.captioner import check_boxes
    from captioning.model.folder import ModelDir

    cfg = ModelDir(region_model).read_config()
    check_boxes(cfg, region_model)  # its regions were pooled by its own encoder
    cfg.model.regions_from_encoder = False  # as for imported regions
    with pytest.raises(InputError, match="which were not pooled by its encoder"):
        check_boxes(cfg, region_model)


def test_caption_names_the_images_without_a_box_drops_a_nan_box_and_refuses_no_detections(region_model, shapes_dir,
                                                                                         tmp_path):
    """caption --detections A B with detections of A only, one of them a NaN box (which once failed A's
    decode, "Graph execution error", blaming a valid image): both captioned, a line names B as captioned
    from its whole image alone and one counts the box dropped; an empty detections file is refused."""
    test = json.load(open(instances_files(shapes_dir)[2]))
    first, second = test["images"][:2]
    files = [os.path.join(shapes_dir, "images", image["file_name"]) for image in (first, second)]
    dets = tmp_path / "det.json"
    dets.write_text(json.dumps([{"image_id": first["id"], "bbox": [float("nan"), 1, 2, 3], "score": 0.9},
                                {"image_id": first["id"], "bbox": [2, 3, 40, 30], "score": 0.9},
                                {"image_id": 10**6, "bbox": [2, 3, 40, 30], "score": 0.9}]))
    instances = tmp_path / "names.json"  # the files' names, as an instances file gives them
    instances.write_text(json.dumps({"images": [{"id": i["id"], "file_name": i["file_name"]} for i in (first, second)],
                                     "annotations": [{"image_id": 10**6, "bbox": [1, 1, 2, 2]}]}))
    done = run_cli("caption", "--model-dir", region_model, "--detections", str(dets), "--detections", str(instances),
                   "--json", *files)
    assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr[-2000:]
    lines = [json.loads(line) for line in done.stdout.splitlines()]
    assert [len(line["regions"]) for line in lines] == [2, 1]  # A's box and its whole image; B's whole image
    said = [line.split(" ", 1)[1] for line in done.stderr.splitlines() if "detections: " in line]
    assert said == [f"detections: 1 of 2 images have no box, each captioned from its whole image alone: {files[1]}",
                    f"detections: 1 boxes dropped (a coordinate not finite, or no area inside the image; e.g. "
                    f"{files[0]}: 1)"]
    empty = tmp_path / "empty.json"
    empty.write_text("[]")
    done = run_cli("caption", "--model-dir", region_model, "--detections", str(empty), *files)
    assert done.returncode == 2 and done.stderr.strip().splitlines() == [
        f"captioning caption: error: --detections {empty} holds no detection ([]): give the detector's results for "
        "the images"]


def test_refusals(region_data, tmp_path):
    from captioning.experiment import for_training
    from captioning.train import Trainer

    data_dir, _ = region_data
    with pytest.raises(InputError, match="model.box_geometry adds the regions' boxes"):
        Trainer(for_training(small_train_config(data_dir, "model.box_geometry=true")), str(tmp_path / "a"))
    with pytest.raises(InputError, match="use data.cache: none or memory"):
        Trainer(for_training(region_config(data_dir, "data.cache=disk")), str(tmp_path / "b"))
    with pytest.raises(InputError, match="holds regions of 128 features: leave the key out"):
        Trainer(for_training(region_config(data_dir, "model.region_feature_size=64")), str(tmp_path / "c"))
    assert not os.path.exists(tmp_path / "a") or not os.listdir(tmp_path / "a")


@pytest.mark.slow
def test_mirrored_scst_over_regions_equals_one_device(distributed_runs):
    """SCST (grouped batches) over regions (tests/helpers.py's REGIONS) under two replicas, each with its own
    batch of images and its own number of regions, updates the model exactly as one device given both
    batches (padded to the larger). Run with the other files' 2-replica scenarios (conftest's distributed_runs)."""
    out = distributed_result(distributed_runs, "mirrored", "scst_regions")
    r = np.load(os.path.join(out, "mirrored_scst.npz"))
    assert int(r["images"]) == 4 and float(r["one_tokens"]) == float(r["two_tokens"]) == 12
    assert int(r["regions_first"]) >= 2 and int(r["regions_second"]) >= 2
    assert float(r["two_reward"]) == pytest.approx(float(r["one_reward"]), abs=1e-6)
    assert_scst_update_as_one_device(r)


@pytest.mark.slow
def test_multi_worker_training_over_regions_ends_with_identical_weights(distributed_runs):
    out = distributed_result(distributed_runs, "multi_worker", "regions")
    a, b = np.load(os.path.join(out, "weights-0.npz")), np.load(os.path.join(out, "weights-1.npz"))
    assert int(a["replicas"]) == 2 and len(a["losses"]) == 4 and np.isfinite(a["losses"]).all()
    for name in a.files:
        np.testing.assert_array_equal(a[name], b[name], err_msg=name)


@pytest.mark.slow
def test_the_input_benchmark_measures_regions_beside_jpegs(region_data, tmp_path):
    data_dir, _ = region_data
    out = tmp_path / "input.json"
    done = run_cli("-q", "benchmark", "input", "--data", data_dir, "--regions", "oracle", "--measure-images", "24",
                   "--rounds", "1", "--set", "train.batch_size=8", "--set", "data.image_size=32", "--set",
                   "data.resize_size=36", "--set", "model.encoder=small_cnn", "--json", str(out))
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(out.read_text())
    assert result["regions_store"] == "oracle" and result["regions_img_per_s"] > 0
    assert result["regions_vs_pipeline"] == pytest.approx(result["regions_img_per_s"] / result["pipeline_img_per_s"])
    assert result["cpu_ms_per_image"]["regions"] > 0
    assert "from the features store 'oracle' (no JPEG decoded)" in done.stdout


@pytest.mark.slow
def test_extract_with_a_configs_encoder_then_a_model_of_that_encoder_captions_from_boxes(region_data, shapes_dir,
                                                                                         tmp_path):
    """features extract --config: a config's encoder with a weights file pools the regions; a model trained on
    them with the same encoder, weights and size builds that very encoder (regions_from_encoder); with random
    weights it cannot. That model trains through the tf.data service: the region pipeline runs on a worker (a
    process of `captioning data-service`), which reads the features store at the same path, and the trainer gets
    batches of regions (the dispatcher, which only hands out the job, is TensorFlow's in this process, as
    `captioning data-service dispatcher` without a work dir starts it: a TensorFlow process fewer)."""
    import keras
    import yaml

    from captioning.config import ModelConfig
    from captioning.inference.captioner import load
    from captioning.model.encoders import build_encoder
    from captioning.model.folder import ModelDir
    from tests.harness.data_service import worker
    from tests.helpers import free_port

    data_dir = str(tmp_path / "data")
    shutil.copytree(region_data[0], data_dir)
    keras.utils.set_random_seed(3)
    weights = str(tmp_path / "encoder.weights.h5")
    build_encoder(ModelConfig(encoder="small_cnn"), 32).model.get_layer("small_cnn").save_weights(weights)
    config = tmp_path / "encoder.yaml"
    config.write_text(yaml.safe_dump({"model": {"encoder": "small_cnn", "encoder_weights": weights},
                                      "data": {"image_size": 32, "resize_size": 36}}))
    done = run_cli("features", "extract", "--data-dir", data_dir, "--images", os.path.join(shapes_dir, "images"),
                   "--config", str(config), "--grid-cells", "2", "--name", "configured")
    assert done.returncode == 0, done.stderr[-2000:]
    store = FeaturesStore.load(data_dir, "configured")
    assert store["source"]["encoder"] == {"encoder": "small_cnn", "encoder_weights": weights, "image_size": 32}
    assert {len(r.features) for r in store.read().values()} == {5}  # 2 x 2 cells and the whole image
    model_dir = str(tmp_path / "model")
    port = free_port()
    dispatcher = tf.data.experimental.service.DispatchServer(tf.data.experimental.service.DispatcherConfig(port=port))
    try:
        w1 = worker(tmp_path / "cluster", "w1", port, free_port())
        try:
            w1.wait_for(rf"worker localhost:\d+ serving dispatcher localhost:{port}\n")
            result = train_regions(data_dir, model_dir, "data.features_store=configured",
                                   f"model.encoder_weights={weights}", f"data.service=localhost:{port}",
                                   "train.steps=6", "train.eval_every_steps=0")
        finally:
            w1.kill()
    finally:
        dispatcher.stop()
    assert result.step == 6 and np.isfinite(result.losses).all()
    assert ModelDir(model_dir).read_config().model.regions_from_encoder
    expected = build_encoder(ModelConfig(encoder="small_cnn", encoder_weights=weights), 32).model.weights
    for a, b in zip(load(model_dir).model.encoder.weights, expected):
        np.testing.assert_array_equal(a.numpy(), b.numpy())
    # the encoder's own random weights: not the extractor's (the Trainer writes config.yaml when it takes the
    # folder: no step needs to run for it)
    regions_trainer(data_dir, str(tmp_path / "random"), "data.features_store=configured", "train.steps=2",
                    "train.eval_every_steps=0").folder.release()
    assert not ModelDir(str(tmp_path / "random")).read_config().model.regions_from_encoder
    done = run_cli("features", "extract", "--data-dir", data_dir, "--images", os.path.join(shapes_dir, "images"),
                   "--grid-cells", "2", "--name", "neither")
    assert done.returncode == 2 and "exactly one of --model-dir" in done.stderr
