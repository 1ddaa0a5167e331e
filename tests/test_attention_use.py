"""The soft-attention decoder downstream of the model: training (TensorBoard pictures and HParams, cached
grid features, resume, 2 mirrored replicas), evaluate, caption --json/--html with each word's weights,
and the SavedModel returning them. The pictures are real PNGs people look at; the weights are checked
against each other across caption, export and beam search."""

import base64
import glob
import io
import json
import os
import re
import subprocess
import sys

import numpy as np
import pytest
from PIL import Image

from tests.helpers import run_cli, small_train_config

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def photos(tmp_path_factory, prepared_dir):
    """Three test images of the shapes fixture, as a user would pass them."""
    import tensorflow as tf

    from captioning.data.prepared import PreparedDataset
    from captioning.data.schema import IMAGE_ENCODED, parse_batch

    folder = tmp_path_factory.mktemp("photos")
    files = PreparedDataset.load(prepared_dir).files("test")
    batch = parse_batch(next(iter(tf.data.TFRecordDataset(files).batch(3))))  # eager: nothing traced
    paths = []
    for i, data in enumerate(batch[IMAGE_ENCODED].numpy()):
        paths.append(str(folder / f"shape{i}.jpg"))
        open(paths[-1], "wb").write(data)
    return paths


def test_training_logs_sample_pictures_and_the_config(trained_attention_dir):
    from tensorboard.backend.event_processing import event_accumulator

    logs = event_accumulator.EventAccumulator(os.path.join(trained_attention_dir, "logs", "train"),
                                              size_guidance={"tensors": 0})
    logs.Reload()
    tags = set(logs.Tags()["tensors"])
    assert {"samples/0", "samples/1", "attention/0", "attention/1", "penalty", "cross_entropy"} <= tags
    import tensorflow as tf

    width, height, png = tf.make_ndarray(logs.Tensors("attention/0")[-1].tensor_proto)[:3]
    strip = np.asarray(Image.open(io.BytesIO(png)))
    assert strip.shape == (int(height), int(width), 3) and int(width) % 96 == 0  # a 96 px tile per word
    sample = np.asarray(Image.open(io.BytesIO(tf.make_ndarray(logs.Tensors("samples/0")[-1].tensor_proto)[2])))
    assert sample.shape == (32, 32, 3)
    assert "_hparams_/session_start_info" in tags  # the run's config, for the HParams tab
    info = logs.Tensors("_hparams_/session_start_info")[0].tensor_proto
    from tensorboard.plugins.hparams import plugin_data_pb2

    content = plugin_data_pb2.HParamsPluginData.FromString(
        logs.summary_metadata["_hparams_/session_start_info"].plugin_data.content)
    hparams = content.session_start_info.hparams
    assert hparams["model.decoder"].string_value == "attention" and hparams["train.steps"].number_value == 40
    assert info is not None


@pytest.fixture(scope="module")
def captioned(trained_attention_dir, photos, tmp_path_factory):
    """``caption --json --top-k 2 --html GALLERY`` of the photos: (the CompletedProcess, the gallery's path), one
    command that the gallery test and the export test (its best captions and their weights) both read."""
    gallery = tmp_path_factory.mktemp("captioned") / "gallery.html"
    done = run_cli("caption", "--model-dir", trained_attention_dir, *photos, "--json", "--top-k", "2",
                   "--html", str(gallery))
    return done, gallery


def test_caption_json_and_gallery_show_where_each_word_looked(captioned):
    done, gallery = captioned
    assert done.returncode == 0, done.stderr[-2000:]
    lines = [json.loads(line) for line in done.stdout.splitlines()]
    assert len(lines) == 3
    words_total = 0
    for line in lines:
        assert line["grid"] == [2, 2]
        for caption in line["captions"]:
            weights = np.array(caption["attention"]).reshape(-1, 4)  # a tiny model's caption may be empty
            assert weights.shape == (len(caption["caption"].split()), 4)
            np.testing.assert_allclose(weights.sum(axis=1), 1.0, atol=1e-3)
        words_total += len(line["captions"][0]["caption"].split())
    page = gallery.read_text()
    # a picture per word of each image's best caption, each a PNG of the crop the model saw
    pictures = re.findall(r'<img src="data:image/png;base64,([^"]+)" alt="attention for ([^"]*)"', page)
    assert len(pictures) == words_total
    for picture, _ in pictures[:1]:
        assert Image.open(io.BytesIO(base64.b64decode(picture))).size == (72, 72)


LOADER = r"""
import json, sys
import tensorflow as tf
serve = tf.saved_model.load(sys.argv[1]).signatures["serving_default"]
out = serve(images=tf.constant([open(p, "rb").read() for p in sys.argv[2:]]))
print(json.dumps({"captions": [[c.decode() for c in row] for row in out["captions"].numpy()],
                  "attention": out["attention"].numpy().tolist()}))
"""


def test_export_returns_the_best_captions_weights(trained_attention_dir, photos, captioned, tmp_path):
    export_dir = str(tmp_path / "export")
    done = run_cli("export", "--model-dir", trained_attention_dir, "--output", export_dir)
    assert done.returncode == 0, done.stderr[-2000:]
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    loaded = subprocess.run([sys.executable, "-c", LOADER, export_dir, *photos], capture_output=True, text=True,
                            cwd=str(tmp_path), env=dict(env, TF_CPP_MIN_LOG_LEVEL="2"), timeout=300)
    assert loaded.returncode == 0, loaded.stderr[-3000:]
    served = json.loads(loaded.stdout.splitlines()[-1])
    attention = np.array(served["attention"])
    assert attention.shape == (3, 20, 2, 2)  # [images, max_length words, grid rows, grid columns]
    cli = captioned[0]  # caption --top-k 2: its first caption is the best, as the export's
    assert cli.returncode == 0, cli.stderr[-2000:]
    for i, line in enumerate(json.loads(x) for x in cli.stdout.splitlines()):
        best = line["captions"][0]
        n = len(best["caption"].split())
        assert served["captions"][i][0] == best["caption"]
        np.testing.assert_allclose(attention[i, :n].reshape(n, 4), np.reshape(best["attention"], (n, 4)), atol=1e-4)
        assert not attention[i, n:].any()


def test_evaluate_an_attention_model_with_grounding(trained_attention_dir, shapes_dir, tmp_path):
    """evaluate --instances: the naming accuracy of the captions by number of shapes, and where each colour
    or kind word looked; stored with the result (and computed again when a stored result lacks it)."""
    from captioning.evaluation.evaluate import evaluate

    plain = evaluate(trained_attention_dir, split="test", beam_size=2, progress=False)
    assert 0 <= plain.metrics["CIDEr"] <= 10 and plain.perplexity > 1 and plain.grounding is None
    instances = os.path.join(shapes_dir, "annotations", "instances_test.json")
    done = run_cli("evaluate", "--model-dir", trained_attention_dir, "--split", "test", "--beam-size", "2",
                   "--instances", instances)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "attention in box / box area" in done.stdout and re.search(r"\n\s+all\s+4\s", done.stdout)
    stored = evaluate(trained_attention_dir, split="test", beam_size=2, progress=False, instances=instances)
    naming, attention = stored.grounding["naming"], stored.grounding["attention"]
    assert naming["all"]["images"] == 4 and sum(naming[g]["images"] for g in ("1", "2", "3")) == 4
    assert all(0 <= naming["all"][k] <= 1 for k in ("color", "kind", "both"))
    assert set(attention) == {"color", "kind"}
    assert "relations right" in done.stdout
    relations = stored.grounding["relations"]["all"]
    assert relations["images"] == 4 and relations["judged"] + relations["unresolved"] == relations["mentions"]
    assert relations["correct"] <= relations["judged"]
    from captioning.evaluation.grounding import load_instances

    shapes = load_instances(instances)
    [predictions] = glob.glob(os.path.join(trained_attention_dir, "eval", "test-*-beam2-*-all-data*.predictions.json"))
    words = [w for p in json.load(open(predictions)) for w in p["caption"].split()]
    for kind, names in (("color", shapes.colors), ("kind", shapes.kinds)):
        group = attention[kind]["all"]
        used = group["words"] + group["skipped_unmatched"] + group["skipped_ambiguous"] + group["skipped_outside"]
        # every colour or kind word the captions hold is counted, used or skipped (a 40-step model may say none)
        assert used == sum(w in names for w in words)
        if group["words"]:
            assert 0 < group["mean_area"] <= 1 and 0 <= group["mean_mass"] <= 1
    assert stored.metrics == plain.metrics  # the same captions
    check_hallucination_and_bad_endings(trained_attention_dir, shapes_dir, stored, done.stdout, predictions, tmp_path)


def check_hallucination_and_bad_endings(model_dir, shapes_dir, stored, stdout, predictions, tmp_path):
    """CHAIR and the bad-ending rate of evaluate --instances: in the stored result, as recomputed from the stored
    captions, in the printed summary and in TensorBoard; then with a COCO instances file of the same images
    (CHAIR over COCO's 80 categories, the shapes' grounding left out)."""
    from tensorboard.backend.event_processing import event_accumulator

    from captioning.evaluation.endings import bad_endings
    from captioning.evaluation.evaluate import evaluate
    from captioning.evaluation.hallucination import chair, load_objects
    from data_prep.synth import load_split

    captions = {p["image_id"]: p["caption"] for p in json.load(open(predictions))}
    shapes_file = stored.hallucination["instances"]
    again = chair(load_objects(shapes_file), captions)
    assert (stored.chair_i, stored.chair_s, stored.object_recall) == (again.chair_i, again.chair_s,
                                                                       again.object_recall)
    assert stored.hallucination["captions"] == 4 and stored.hallucination["objects"] == "shapes"
    assert all(0 <= v <= 1 for v in (stored.chair_s, stored.object_recall) + ((stored.chair_i,) if again.mentions
                                                                               else ()))
    assert stored.bad_ending_rate == bad_endings(captions.values())["bad_ending_rate"]
    assert 0 <= stored.bad_ending_rate <= 1
    assert "hallucination (shapes by kind and colour): CHAIRi" in stdout and "bad endings: " in stdout
    logs = event_accumulator.EventAccumulator(os.path.join(model_dir, "logs", "eval_test"),
                                              size_guidance={"tensors": 0})
    logs.Reload()
    import tensorflow as tf

    logged = {tag.rsplit("/", 1)[1]: float(tf.make_ndarray(logs.Tensors(tag)[-1].tensor_proto))
              for tag in logs.Tags()["tensors"] if tag.startswith("beam2-")}
    for key in ("chair_s", "object_recall", "bad_ending_rate") + (("chair_i",) if again.mentions else ()):
        assert logged[key] == pytest.approx(stored[key], abs=1e-6) and 0 <= logged[key] <= 1
    # the same images with COCO's categories: a person in each; the references' words ("orange") are objects too
    shapes = json.load(open(shapes_file))
    coco = {"images": shapes["images"], "categories": [{"id": 1, "name": "person"}, {"id": 55, "name": "orange"}],
            "annotations": [{"id": n, "image_id": image["id"], "category_id": 1, "bbox": [0, 0, 5, 5]}
                            for n, image in enumerate(shapes["images"])]}
    coco_file = str(tmp_path / "instances_coco.json")
    json.dump(coco, open(coco_file, "w"))
    result = evaluate(model_dir, split="test", beam_size=2, max_images=2, progress=False, instances=coco_file)
    refs = {}
    for ann in load_split(shapes_dir, "test")["annotations"]:
        refs.setdefault(ann["image_id"], []).append(ann["caption"])
    [two] = glob.glob(os.path.join(model_dir, "eval", "test-*-beam2-*-first2-data*.predictions.json"))
    expected = chair(load_objects(coco_file), {p["image_id"]: p["caption"] for p in json.load(open(two))}, refs)
    assert result.hallucination["objects"] == "coco" and result.grounding is None
    assert "not measured" in result.hallucination["note"] and result.hallucination["captions"] == 2
    assert (result.chair_i, result.chair_s, result.object_recall) == (expected.chair_i, expected.chair_s,
                                                                       expected.object_recall)
    assert expected.objects_present >= 2 and 0 <= result.chair_s <= 1 and 0 <= result.object_recall <= 1


def test_cached_grid_features_mixed_precision_and_resume(prepared_dir, tmp_path):
    """cache: features stores the frozen encoder's grid as float16 on disk and trains from it (under
    mixed precision); a second run in the same folder resumes from the checkpoint and reads the file."""
    from captioning.experiment import for_training
    from captioning.train import Trainer

    overrides = ["model.decoder=attention", "model.attention_size=16", "model.encoder_trainable=false",
                 "data.cache=features", "data.random_crop=false", "train.optimizer=adam", "train.learning_rate=0.01",
                 "train.mixed_precision=true"]
    model_dir = str(tmp_path / "model")
    first = Trainer(for_training(small_train_config(prepared_dir, "train.steps=20", *overrides)), model_dir)
    result = first.run(progress=False)
    assert result.step == 20 and np.mean(result.losses[-5:]) < np.mean(result.losses[:3])
    cache = os.path.join(model_dir, "cache")
    files = sorted(f for f in os.listdir(cache) if f.endswith(".tfrecord"))
    assert files  # the train split's grid features (and the validation split's)
    grid_bytes = 4 * 128 * 2  # 2 x 2 cells of 128 float16 features per image
    train_file = [f for f in files if f.startswith("features-train-")][0]
    assert os.path.getsize(os.path.join(cache, train_file)) > 32 * grid_bytes
    stamp = os.path.getmtime(os.path.join(cache, train_file))
    second = Trainer(for_training(small_train_config(prepared_dir, "train.steps=25", *overrides)), model_dir)
    assert second.current_step() == 20  # resumed
    assert second.run(progress=False).step == 25
    assert os.path.getmtime(os.path.join(cache, train_file)) == stamp  # read, not written again


