"""The COCO caption metrics: identical to pycocoevalcap's COCOEvalCap, to the last digit."""

import json
import os

import numpy as np
import pytest

from captioning.errors import InputError
from captioning.evaluation.metrics import METRICS, coco_metrics, score_files
from data_prep.synth import load_split
from tests.helpers import run_cli


class NoSpice:
    """Stands in for SPICE inside COCOEvalCap only (SPICE downloads CoreNLP models on first use)."""

    def compute_score(self, gts, res):
        return 0.0, [0.0] * len(res)

    def method(self):
        return "SPICE"


@pytest.fixture(scope="module")
def fixture_files(shapes_dir, tmp_path_factory):
    """COCO annotations (the shapes val split) and a results file of imperfect captions for 3 of its 4
    images: one image's own first caption, one with a wrong colour, one reference of another image."""
    root = tmp_path_factory.mktemp("score")
    data = load_split(shapes_dir, "val")
    ann_path = root / "captions_val.json"
    ann_path.write_text(json.dumps(data))
    ids = [im["id"] for im in data["images"]]
    first = {i: next(a["caption"] for a in data["annotations"] if a["image_id"] == i) for i in ids}
    results = [{"image_id": ids[0], "caption": first[ids[0]]},
               {"image_id": ids[1], "caption": first[ids[1]].replace("red", "blue").replace("green", "purple")},
               {"image_id": ids[2], "caption": first[ids[3]]}]
    res_path = root / "results.json"
    res_path.write_text(json.dumps(results))
    return str(ann_path), str(res_path)


@pytest.fixture(scope="module")
def our_scores(fixture_files):
    """score_files on the fixture's files, once for the tests that compare other scorings with it."""
    return score_files(*fixture_files)


def reference_scores(ann_path, res_path, monkeypatch):
    """pycocoevalcap's own COCOEvalCap.evaluate() on the result images, SPICE stubbed out. Its METEOR is a JVM
    of pycocoevalcap's own, started as pycocoevalcap starts it (not the one this process keeps, whose arguments are
    the project's: a difference they made would show)."""
    import pycocoevalcap.eval as cocoeval
    from pycocotools.coco import COCO

    monkeypatch.setattr(cocoeval, "Spice", NoSpice)
    coco = COCO(ann_path)
    res = coco.loadRes(res_path)
    evaluator = cocoeval.COCOEvalCap(coco, res)
    evaluator.params["image_id"] = res.getImgIds()
    evaluator.evaluate()
    return {k: v for k, v in evaluator.eval.items() if k != "SPICE"}


@pytest.mark.slow
def test_score_equals_pycocoevalcap_to_the_last_digit(fixture_files, our_scores, monkeypatch):
    ann_path, res_path = fixture_files
    ours = our_scores
    theirs = reference_scores(ann_path, res_path, monkeypatch)
    assert set(ours) == set(METRICS) == set(theirs)
    assert ours == theirs  # exact float equality
    assert 0.0 < ours["Bleu_4"] < 1.0 and ours["CIDEr"] > 0.0


@pytest.mark.slow
def test_score_cli_writes_the_same_numbers(fixture_files, our_scores, tmp_path):
    ann_path, res_path = fixture_files
    out = tmp_path / "scores.json"
    result = run_cli("score", "--annotations", ann_path, "--results", res_path, "--json", str(out))
    assert result.returncode == 0, result.stderr
    assert "CIDEr" in result.stdout and "Bleu_4" in result.stdout
    assert json.loads(out.read_text()) == {"metrics": our_scores}


@pytest.mark.slow
def test_perfect_and_wrong_captions_order_the_scores():
    refs = {1: ["a red circle above a blue square", "a small red circle over a big blue square"],
            2: ["a green triangle in the top left corner", "there is a green triangle at the top left"]}
    perfect = coco_metrics(refs, {1: "a red circle above a blue square", 2: "a green triangle in the top left corner"})
    wrong = coco_metrics(refs, {1: "a yellow triangle", 2: "two purple squares"})
    for metric in METRICS:
        assert perfect[metric] > wrong[metric]
    assert perfect["Bleu_1"] == pytest.approx(1.0)


@pytest.mark.slow
def test_meteor_works_under_a_decimal_comma_locale(monkeypatch):
    """A JVM in a German locale makes METEOR print nothing to parse; the scorer forces en_US."""
    refs = {1: ["a red circle above a blue square"]}
    plain = coco_metrics(refs, {1: "a red circle over a square"})
    monkeypatch.setenv("JAVA_TOOL_OPTIONS", "-Duser.language=de -Duser.country=DE")
    assert coco_metrics(refs, {1: "a red circle over a square"}) == plain
    assert os.environ["JAVA_TOOL_OPTIONS"] == "-Duser.language=de -Duser.country=DE"  # restored


def test_bad_results_are_one_line_errors(fixture_files, tmp_path):
    ann_path, _ = fixture_files
    unknown = tmp_path / "unknown.json"
    unknown.write_text(json.dumps([{"image_id": 987654, "caption": "a cat"}]))
    with pytest.raises(InputError, match="not in"):
        score_files(ann_path, str(unknown))
    shape = tmp_path / "shape.json"
    shape.write_text(json.dumps({"image_id": 1}))
    with pytest.raises(InputError, match="list of"):
        score_files(ann_path, str(shape))
    result = run_cli("score", "--annotations", ann_path, "--results", str(unknown))
    assert result.returncode == 2 and "Traceback" not in result.stderr


def test_missing_java_is_one_clear_line(fixture_files, tmp_path):
    ann_path, res_path = fixture_files
    env_path = str(tmp_path)  # a PATH with no java on it
    result = run_cli("score", "--annotations", ann_path, "--results", res_path, env={"PATH": env_path})
    assert result.returncode == 2
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert lines == ["captioning score: error: pycocoevalcap needs Java for PTB tokenization and METEOR, and "
                     "`java` is not on PATH: install a Java runtime (e.g. apt-get install default-jre-headless)"]


@pytest.mark.slow
def test_spice_without_its_models_is_skipped_with_a_clear_warning(caplog):
    refs = {1: ["a red circle above a blue square"]}
    with caplog.at_level("WARNING", logger="captioning.evaluation.metrics"):
        scores = coco_metrics(refs, {1: "a red circle"}, spice=True)
    assert set(scores) == set(METRICS)  # the seven metrics, no SPICE, no download attempted
    assert any("SPICE skipped" in r.getMessage() and "CoreNLP" in r.getMessage() for r in caplog.records)


# --- diversity (captioning/evaluation/diversity.py): known values, not ranges (issue 30, items 5, 6 and 20) ---

def test_mbleu_4_of_known_captions():
    from captioning.evaluation.diversity import mbleu_4

    long = "a big red circle above a small blue square"
    # identical captions: BLEU-4 1 each (pycocoevalcap adds 1e-15 / 1e-9 to its n-gram counts: 1 - 3e-10)
    assert mbleu_4({1: [long] * 3, 2: [long.upper() + ".", long]}) == pytest.approx(1.0, abs=1e-9)
    # "a b c d e" against "a b c d f" (and back): n-gram precisions 4/5, 3/4, 2/3, 1/2, equal lengths
    assert mbleu_4({7: ["a b c d e", "a b c d f"]}) == pytest.approx((4 / 5 * 3 / 4 * 2 / 3 * 1 / 2) ** 0.25, abs=1e-6)
    # no shared word: ~0; an image with one caption has no mBLEU and does not count in the average
    assert mbleu_4({1: ["a b c d", "e f g h"], 2: [long]}) == pytest.approx(0.0, abs=1e-6)
    assert mbleu_4({1: [long]}) is None


def test_novel_captions_and_distinct_n_of_known_captions():
    from captioning.evaluation.diversity import diversity

    training = ["A red circle above a blue square.", "a green star"]
    # the best captions: a training caption (written otherwise) is not novel, a new one is
    found = diversity({1: ["a red circle above a blue square"], 2: ["a red circle below a blue square"],
                       3: ["A green star!"], 4: ["a purple star"]}, vocabulary_size=14, training=training)
    assert found["novel_captions"] == 0.5
    # Li et al. 2016: distinct n-grams / generated words; per bigram: / bigrams
    # words 7 + 7 + 3 + 3 = 20, distinct words: a red circle above blue square below green star purple = 10
    # bigrams 6 + 6 + 2 + 2 = 16, distinct: 6 + 2 (circle below, below a) + 2 + 2 (a purple, purple star) = 12
    assert found["distinct_1"] == 10 / 20 and found["words_used"] == 10 and found["vocabulary_usage"] == 1.0
    assert found["distinct_2"] == 12 / 20 and found["distinct_2_per_bigram"] == 12 / 16
    assert "mbleu_4" not in found  # one caption per image
    among = diversity({1: ["a red circle", "a red circle", "a blue star"]}, vocabulary_size=14, training=training)
    # 9 words, bigrams: a red, red circle, a blue, blue star = 4 distinct of 6
    assert among["local_distinct_2"] == 4 / 9 and among["local_distinct_2_per_bigram"] == 4 / 6
    assert among["local_distinct_1"] == 5 / 9 and among["captions_per_image"] == 3


def test_beam_search_placeholders_are_not_counted_as_captions():
    """A beam search that finds fewer complete captions than top_k fills the rest with placeholders (an empty
    caption, log p -1e9): evaluation counts the real captions only (item 5)."""
    import keras

    from captioning.evaluation.diversity import diversity
    from captioning.evaluation.results import real_captions
    from captioning.model import build_model
    from captioning.model.decode import beam_search, ids_to_text
    from captioning.vocab import RESERVED, Vocabulary
    from tests.helpers import model_config

    keras.utils.set_random_seed(0)
    vocab = Vocabulary(RESERVED + ("w",))  # one word: "" and "w" are the only captions of at most 1 word
    assert len(vocab) == 5
    cfg = model_config(encoder="small_cnn", embedding_size=8, lstm_units=8, dropout=0.0)
    model = build_model(len(vocab), cfg, 16, seed=0).build_all()
    images = np.random.default_rng(0).integers(0, 256, (2, 16, 16, 3)).astype("uint8")
    out = beam_search(model, model.encode(images, training=False), beam_size=3, max_length=1, top_k=3)
    texts = ids_to_text(vocab, out["ids"], out["lengths"])
    assert (out["log_probs"].numpy() < -1e8).any()  # the search returned placeholders
    real = real_captions(texts, out["log_probs"])
    for image_texts, image_real in zip(texts, real):
        assert len(image_texts) == 3 and "w" in image_real and len(image_real) < 3
        assert sorted(image_real) == sorted(set(image_real)) and set(image_real) <= {"", "w"}  # each caption once
        assert image_real[0] == image_texts[0]  # the best caption is kept first
    found = diversity(dict(enumerate(real)), vocabulary_size=len(vocab), training=[])
    assert found["captions_per_image"] == max(len(r) for r in real) < 3
