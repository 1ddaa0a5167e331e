"""A ``prefix_lm`` model used (issue 50, item 3): ``caption --json/--html`` (words, and the record saying there is no
attention, and why), ``serve``, ``evaluate`` with every metric, the SavedModel with its tokenizer in the graph
(loaded by plain TensorFlow in a process without this project, TensorFlow Text or keras-hub) and the LiteRT file.

Every test reads the session's ``trained_prefix_lm_dir`` (tests/conftest.py: a tiny GPT-2 preset's LM fed an MLP
mapper's prefix, 30 steps). The comparisons decode with beam 3, the best 2 and bigram blocking: the 30-step model's
greedy caption repeats one one-piece word, while blocking makes it spell words of several pieces (``aee``,
``squaree``), which detokenization must join."""

import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

from captioning.inference.caption import Result, json_record
from captioning.inference.captioner import Caption
from tests.harness.files import LOADER
from tests.helpers import run_cli

DECODE = ["--top-k", "2", "--beam-size", "3", "--set", "decode.block_ngrams=2"]
# the loader of tests/test_inference.py, with the language-model libraries made unimportable first: the SavedModel
# must need TensorFlow alone
NO_TEXT_LIBRARIES = "import sys\nsys.modules.update(tensorflow_text=None, keras_hub=None, keras_nlp=None)\n"


@pytest.fixture(scope="module")
def photos(shapes_dir, tmp_path_factory):
    """``photo.jpg`` (a real JPEG: a shapes image as written) and another JPEG and a PNG, in a folder of their own."""
    from PIL import Image

    folder = tmp_path_factory.mktemp("plm_photos")
    names = sorted(os.listdir(os.path.join(shapes_dir, "images")))
    shutil.copy(os.path.join(shapes_dir, "images", names[0]), folder / "photo.jpg")
    shutil.copy(os.path.join(shapes_dir, "images", names[-1]), folder / "other.jpg")
    Image.open(folder / "photo.jpg").convert("RGB").resize((90, 70)).save(folder / "small.png")
    return folder


@pytest.fixture(scope="module")
def captioner(trained_prefix_lm_dir):
    """The model's Captioner, decoding as :data:`DECODE` says (what ``caption`` and ``export`` build of its flags)."""
    from captioning import inference

    trained = inference.load(trained_prefix_lm_dir)
    decode = trained.config.decode.override(top_k=2, beam_size=3).with_overrides(["decode.block_ngrams=2"])
    return inference.Captioner(trained, decode)


@pytest.fixture(scope="module")
def exported(trained_prefix_lm_dir, tmp_path_factory):
    """``export`` of the model with :data:`DECODE`, once for the module (read-only)."""
    output = str(tmp_path_factory.mktemp("plm_export") / "export")
    result = run_cli("export", "--model-dir", trained_prefix_lm_dir, "--output", output, *DECODE)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip().splitlines()[-1] == f"exported to {output}"
    return output


def texts(captioner, paths):
    """What ``caption`` gives for ``paths`` (its reading of the files, then the Captioner): per image its captions."""
    from captioning.inference.caption import read_for_model

    return [[c.text for c in captions] for captions in captioner.caption([read_for_model(str(p)) for p in paths])]


def test_the_record_of_a_model_without_readable_attention_says_so():
    record = json_record(Result("a.jpg", captions=[Caption("a red circle", -1.5)], attention_absent="no weights"))
    assert record == {"image": "a.jpg", "captions": [{"caption": "a red circle", "log_prob": -1.5}],
                      "attention": None, "attention_absent": "no weights"}


@pytest.mark.slow  # a model loaded and traced (the CLI in this process)
def test_caption_json_as_the_issue_types_it_gives_words_and_says_there_is_no_attention(trained_prefix_lm_dir, photos,
                                                                                       captioner, tmp_path):
    os.makedirs(tmp_path / "runs")
    os.symlink(trained_prefix_lm_dir, tmp_path / "runs" / "plm")
    shutil.copy(photos / "photo.jpg", tmp_path / "photo.jpg")
    result = run_cli("caption", "--model-dir", "runs/plm", "--json", "photo.jpg", cwd=str(tmp_path))
    assert result.returncode == 0, result.stderr[-2000:]
    (record,) = [json.loads(line) for line in result.stdout.splitlines()]
    assert record["image"] == "photo.jpg"
    assert record["attention"] is None and "prefix_lm" in record["attention_absent"]
    assert "keras-hub's attention layers do not return their weights" in record["attention_absent"]
    assert all("attention" not in c for c in record["captions"])
    (caption,) = [c["caption"] for c in record["captions"]]  # the model's own decode: top_k 1
    # words: the pieces detokenized (no byte-level marks, one space between words), as the tokenizer decodes them
    tokenizer = captioner.trained.vocab
    assert caption and caption == " ".join(caption.split()) and "\u0120" not in caption
    from captioning import inference

    (own,) = inference.Captioner(captioner.trained).caption([(photos / "photo.jpg").read_bytes()])
    assert caption == own[0].text
    ids = tokenizer.caption_ids([caption]).to_list()[0]  # the caption read back: the same words
    assert tokenizer.text(ids[1:-1]) == caption


@pytest.mark.slow  # a model loaded and traced
def test_the_gallery_shows_words_and_says_why_there_are_no_attention_pictures(captioner, photos):
    from captioning.inference.caption import caption_files, gallery_html

    results = caption_files(captioner, [str(photos / "photo.jpg")], progress=False)
    (result,) = results
    assert not result.attends and "prefix_lm" in result.attention_absent
    page = gallery_html(results)
    assert "No attention is shown: model.decoder prefix_lm is a language model" in page
    assert 'class="attention"' not in page
    import html

    assert all(html.escape(c.text) in page for c in result.captions)
    assert [c.text for c in result.captions] == texts(captioner, [photos / "photo.jpg"])[0]


def tokenizer_pieces(captioner, word):
    """The pieces ``word`` is spelt in (without START and END)."""
    return captioner.trained.vocab.caption_ids([word]).to_list()[0][1:-1]


@pytest.mark.slow  # an export, and a process that loads it
def test_the_savedmodel_detokenizes_in_the_graph_and_loads_with_tensorflow_alone(trained_prefix_lm_dir, exported,
                                                                                 captioner, photos, tmp_path):
    marker = json.load(open(os.path.join(exported, "captioning_export.json")))
    assert marker["signatures"] == ["serving_default", "serving_examples"]
    assert (marker["decode"]["top_k"], marker["decode"]["beam_size"], marker["decode"]["block_ngrams"]) == (2, 3, 2)
    paths = [str(photos / n) for n in ("photo.jpg", "other.jpg", "small.png")]
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["TF_CPP_MIN_LOG_LEVEL"] = "2"
    loaded = subprocess.run([sys.executable, "-c", NO_TEXT_LIBRARIES + LOADER, exported, *paths], capture_output=True,
                            text=True, cwd=str(tmp_path), env=env, timeout=300)
    assert loaded.returncode == 0, loaded.stderr[-3000:]
    served = json.loads(loaded.stdout.splitlines()[-1])
    expected = captioner.caption([open(p, "rb").read() for p in paths])
    for s, captions in zip(served, expected):
        assert s["captions"] == [c.text for c in captions]
        assert s["log_probs"] == pytest.approx([c.log_prob for c in captions], abs=1e-4)
    assert any(len(tokenizer_pieces(captioner, w)) > 1 for s in served for c in s["captions"] for w in c.split())
    # the same export again: a no-op, said in the last line; the marker untouched
    before = os.stat(os.path.join(exported, "captioning_export.json")).st_mtime_ns
    again = run_cli("export", "--model-dir", trained_prefix_lm_dir, "--output", exported, *DECODE)
    assert again.returncode == 0, again.stderr[-2000:]
    assert again.stdout.strip().splitlines()[-1].startswith(f"already exported to {exported} (unchanged")
    assert os.stat(os.path.join(exported, "captioning_export.json")).st_mtime_ns == before


@pytest.mark.slow  # a LiteRT conversion
def test_the_litert_file_converts_with_built_in_ops_and_captions_as_the_savedmodel(trained_prefix_lm_dir, exported,
                                                                                  photos, tmp_path):
    import tensorflow as tf
    from ai_edge_litert import schema_py_generated as schema
    from ai_edge_litert.interpreter import Interpreter

    output = str(tmp_path / "plm.tflite")
    result = run_cli("export", "--model-dir", trained_prefix_lm_dir, "--format", "litert", "--output", output, *DECODE)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "built-in ops only" in result.stdout
    data = open(output, "rb").read()
    model = schema.Model.GetRootAs(data, 0)
    names = {v: k for k, v in vars(schema.BuiltinOperator).items() if not k.startswith("_")}
    ops = {names[max(model.OperatorCodes(i).BuiltinCode(), model.OperatorCodes(i).DeprecatedBuiltinCode())]
           for i in range(model.OperatorCodesLength())}
    assert "DYNAMIC_UPDATE_SLICE" in ops and "CUSTOM" not in ops  # the cache's writes; no Flex op
    run = Interpreter(model_content=data).get_signature_runner("serving_default")
    serve = tf.saved_model.load(exported).signatures["serving_default"]
    for name in ("photo.jpg", "other.jpg"):
        pixels = tf.io.decode_jpeg((photos / name).read_bytes(), channels=3, dct_method="INTEGER_FAST").numpy()
        out = run(image=pixels)
        assert "words" not in out
        captions = [" ".join(b"".join(out["pieces"][j, :out["lengths"][j]]).decode("utf-8", "replace").split())
                    for j in range(2)]
        saved = serve(images=tf.constant([tf.io.encode_png(pixels).numpy()]))
        assert captions == [c.decode() for c in saved["captions"].numpy()[0]]
        np.testing.assert_allclose(out["log_probs"], saved["log_probs"].numpy()[0], rtol=1e-3)
        assert all(b"".join(out["pieces"][j, out["lengths"][j]:]) == b"" for j in range(2))
    # dynamic_int8: the language model's weights, read before the search's loop and inside it, quantized in both
    int8 = str(tmp_path / "plm_int8.tflite")
    result = run_cli("export", "--model-dir", trained_prefix_lm_dir, "--format", "litert", "--quantize", "dynamic_int8",
                     "--output", int8, *DECODE)
    assert result.returncode == 0, result.stderr[-2000:]
    assert os.path.getsize(int8) < 0.6 * len(data)
    out = Interpreter(model_path=int8).get_signature_runner("serving_default")(image=pixels)
    assert " ".join(b"".join(out["pieces"][0, :out["lengths"][0]]).decode().split()) == captions[0]
    assert abs(float(out["log_probs"][0]) - float(saved["log_probs"].numpy()[0, 0])) < 0.1


@pytest.mark.slow  # a real server on a socket
def test_serve_answers_a_prefix_lm_models_captions(captioner, photos):
    from captioning.benchmarks.serve import post
    from captioning.inference.serve import start

    running = start(captioner, port=0)
    try:
        assert running.url.startswith("http://127.0.0.1:")
        status, body = post(running.url + "caption", [("image", "photo.jpg", (photos / "photo.jpg").read_bytes())])
    finally:
        running.stop()
    assert status == 200, body[:500]
    (record,) = json.loads(body)  # the records caption --json prints
    assert [c["caption"] for c in record["captions"]] == texts(captioner, [photos / "photo.jpg"])[0]
    assert record["attention"] is None and "prefix_lm" in record["attention_absent"]


@pytest.mark.slow  # an evaluation (pycocoevalcap's Java scorers)
def test_evaluate_gives_every_metric_on_words_and_says_grounding_has_no_attention(trained_prefix_lm_dir, shapes_dir,
                                                                                  caplog):
    import logging
    import math

    from captioning.evaluation.evaluate import evaluate
    from captioning.evaluation.metrics import METRICS

    instances = os.path.join(shapes_dir, "annotations", "instances_test.json")
    with caplog.at_level(logging.INFO, logger="captioning"):
        result = evaluate(trained_prefix_lm_dir, split="test", instances=instances, baseline=True, progress=False)
    assert set(result["metrics"]) == set(METRICS) == set(result["baseline"])
    assert all(math.isfinite(v) and v >= 0 for v in result["metrics"].values())
    assert result["num_images"] == 4 and result["checkpoint_step"] == 30
    assert math.isfinite(result["perplexity"]) and result["perplexity"] > 1
    assert {"chair_i", "chair_s", "object_recall", "hallucination"} <= set(result)
    assert 0 <= result["chair_s"] <= 1 and 0 <= result["object_recall"] <= 1
    assert set(result["diversity"]) >= {"distinct_1", "distinct_2", "vocabulary_usage"}
    assert set(result["grounding"]) == {"instances", "naming", "relations"}  # no attention to localise
    assert any("attention on the named shapes: not available, model.decoder prefix_lm" in r.getMessage()
               for r in caplog.records)
    files = [n for n in os.listdir(os.path.join(trained_prefix_lm_dir, "eval")) if n.endswith(".predictions.json")]
    (name,) = [n for n in files if n.startswith("test-step30-")]
    predictions = json.load(open(os.path.join(trained_prefix_lm_dir, "eval", name)))
    assert len(predictions) == 4
    assert all(p["caption"] and p["caption"] == " ".join(p["caption"].split()) and "\u0120" not in p["caption"]
               for p in predictions)
