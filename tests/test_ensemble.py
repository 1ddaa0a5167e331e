"""Ensembles (captioning.model.ensemble): every step averages the models' word probabilities.

The model-level tests build one tiny model of every registered decoder (so a new decoder joins the
ensemble tests with no new code): the ensemble's step is the log of the averaged softmaxes, beam search over
it returns the captions' log-probabilities under that average, its greedy caption is the argmax of the
average at every step, and teacher forcing equals stepping. An ensemble of a model with a copy of itself is
the model. The command-line tests run ``caption``, ``evaluate`` and ``export`` over two trained folders of
different decoders."""

import json
import math
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest
import tensorflow as tf

from captioning.model import DECODERS
from captioning.model.ensemble import Ensemble
from tests.helpers import copies, run_cli
from tests.harness.files import LOADER
from tests.harness.models import B, inputs, npy, tiny


NAMES = sorted(DECODERS)


def averaged(models, logits):
    """log(mean softmax) of each model's logits, computed in numpy."""
    p = np.mean([np.exp(npy(tf.nn.log_softmax(x))) for x in logits], axis=0)
    return np.log(p)


def rescored(model, images, rows) -> list[float]:
    """Each row's summed log-probability under ``model`` (its words, then <end>), by stepping all rows as one batch
    (row i reading ``images[i]``; after a row's <end>, <end>s that count nothing): tests/harness/models.py's
    ``rescore`` with one eager step a word for all rows instead of one a word of each caption."""
    from captioning.vocab import END_ID, START_ID

    steps = max(map(len, rows)) + 1
    tokens = np.full((len(rows), steps), END_ID, np.int32)  # what each step reads
    tokens[:, 0] = START_ID
    for i, row in enumerate(rows):
        tokens[i, 1:len(row) + 1] = row
    state = model.reserve(model.image_state({"image": tf.constant(images)}), steps)
    totals = [0.0] * len(rows)
    for t in range(steps):
        logits, state = model.step(tf.constant(tokens[:, t]), state)
        logp = npy(tf.nn.log_softmax(logits))
        for i, row in enumerate(rows):
            if t <= len(row):  # word t of the row, or its <end>
                totals[i] += float(logp[i, row[t] if t < len(row) else END_ID])
    return totals


@pytest.fixture(scope="module")
def mixed():
    """One tiny model of every registered decoder, each of another seed: a mixed ensemble."""
    return [tiny(name, seed=3 + i) for i, name in enumerate(NAMES)]


def test_each_step_is_the_log_of_the_models_averaged_probabilities(mixed):
    from captioning.vocab import START_ID

    ensemble = Ensemble(mixed)
    images, ids = inputs(seed=4)
    state = ensemble.reserve(ensemble.image_state({"image": images}), 5)
    states = [m.reserve(m.image_state({"image": images}), 5) for m in mixed]
    tokens = tf.fill([B], START_ID)
    stepped = []
    for t in range(5):
        logits, state = ensemble.step(tokens, state)
        alone = [m.step(tokens, s) for m, s in zip(mixed, states)]
        states = [s for _, s in alone]
        np.testing.assert_allclose(npy(logits), averaged(mixed, [x for x, _ in alone]), atol=1e-5)
        np.testing.assert_allclose(npy(tf.reduce_logsumexp(logits, axis=-1)), 0.0, atol=1e-5)  # a distribution
        stepped.append(npy(logits))
        tokens = tf.constant(ids[:, t + 1].astype(np.int32))
    # teacher forcing the same words gives the same distributions (evaluation's perplexity reads these)
    forced, penalty = ensemble.logits_and_penalty({"image": images, "input_ids": ids[:, :5]})
    np.testing.assert_allclose(npy(forced), np.stack(stepped, axis=1), atol=1e-4)
    assert npy(penalty).shape == (B,) and not npy(penalty).any()


def test_beam_search_and_greedy_decoding_over_an_ensemble(mixed):
    from captioning.model.decode import beam_search
    from captioning.vocab import END_ID, PAD_ID, START_ID, UNK_ID

    ensemble = Ensemble(mixed)
    images, _ = inputs(seed=11)
    state = ensemble.image_state({"image": images})
    greedy = beam_search(ensemble, None, beam_size=1, max_length=6, initial_state=state)
    assert "attention" not in greedy  # the models' grids need not be alike: no weights reported
    states = [m.reserve(m.image_state({"image": images}), 6) for m in mixed]  # greedy by hand, in numpy
    tokens, manual, done = tf.fill([B], START_ID), np.zeros((B, 6), np.int64), np.zeros(B, bool)
    for t in range(6):
        alone = [m.step(tokens, s) for m, s in zip(mixed, states)]
        states = [s for _, s in alone]
        logp = averaged(mixed, [x for x, _ in alone])
        logp[:, [PAD_ID, START_ID, UNK_ID]] = -np.inf
        tokens = tf.constant(logp.argmax(axis=1).astype(np.int32))
        for row in range(B):
            if not done[row]:
                done[row] = int(tokens[row]) == END_ID
                manual[row, t] = 0 if done[row] else int(tokens[row])
    np.testing.assert_array_equal(npy(greedy["ids"])[:, 0], manual)

    best = tf.function(lambda s: beam_search(ensemble, None, beam_size=3, max_length=6, top_k=3,
                                             initial_state=s), autograph=False)(state)
    ids, lengths, log_probs = (npy(best[k]) for k in ("ids", "lengths", "log_probs"))
    expected = rescored(ensemble, np.concatenate([images] * 3), [ids[i, k, :lengths[i, k]] for k in range(3)
                                                                  for i in range(B)])
    for k in range(3):
        for i in range(B):
            if lengths[i, k] < 6:  # ended with <end>: its log-probability counts it
                assert log_probs[i, k] == pytest.approx(expected[k * B + i], abs=1e-4)


@pytest.mark.parametrize("name", NAMES)
def test_an_ensemble_of_a_model_with_a_copy_of_itself_is_the_model(name, mixed):
    """The model is the mixed ensemble's of its decoder (only read here); its copy, built of another seed, is
    given its weights."""
    from captioning.config import DecodeConfig
    from captioning.model.decode import generate

    model, copy = mixed[NAMES.index(name)], tiny(name, seed=8)
    copy.set_weights(model.get_weights())
    ensemble = Ensemble([model, copy])
    images, _ = inputs(seed=2)
    keys = tf.constant([5, 6, 7], tf.int64)
    for settings in (DecodeConfig(beam_size=3, top_k=2, max_length=6),
                     DecodeConfig(method="sample", top_k=2, max_length=6, seed=3, temperature=0.7)):
        alone = generate(model, model.image_state({"image": images}), settings, keys=keys)
        both = generate(ensemble, ensemble.image_state({"image": images}), settings, keys=keys)
        np.testing.assert_array_equal(npy(both["ids"]), npy(alone["ids"]))
        np.testing.assert_allclose(npy(both["log_probs"]), npy(alone["log_probs"]), atol=1e-4)


def test_models_of_different_vocabulary_sizes_cannot_be_one_ensemble(mixed):
    from captioning.config import ModelConfig
    from captioning.model import build_model

    other = build_model(41, ModelConfig(encoder="small_cnn", dropout=0.0, options={"lstm_units": 8,
                                                                               "embedding_size": 8}), 32)
    with pytest.raises(ValueError, match="vocabulary sizes differ"):
        Ensemble([mixed[0], other])
    with pytest.raises(ValueError, match="at least 2 models"):
        Ensemble([mixed[0]])


# ------------------------------------------------------------------------------------------------ the commands


@pytest.fixture(scope="module")
def two_models(trained_model_dir, trained_attention_dir):
    """Two trained folders of one vocabulary: Show and Tell (60 steps) and soft attention (40 steps)."""
    return [trained_model_dir, trained_attention_dir]


@pytest.mark.slow
def test_caption_and_export_an_ensemble_of_two_decoders(two_models, tmp_path):
    from PIL import Image

    from tests.helpers import encode, gradient

    photos = []
    for i, size in enumerate([(48, 40), (64, 64), (30, 50)]):
        path = tmp_path / f"p{i}.png"
        path.write_bytes(encode(gradient(size=size).rotate(40 * i), "PNG"))
        photos.append(str(path))
    args = [a for m in two_models for a in ("--model-dir", m)]
    cli = run_cli("caption", *args, *photos, "--json", "--top-k", "2", "--html", str(tmp_path / "g.html"))
    assert cli.returncode == 0, cli.stderr[-2000:]
    captioned = [json.loads(line) for line in cli.stdout.splitlines()]
    assert [c["image"] for c in captioned] == photos and all(len(c["captions"]) == 2 for c in captioned)
    # the captions are the ensemble's: the best one's log-probability is its score under the two models' average
    from captioning import inference
    from captioning.data.reading import model_input

    trained = inference.load(two_models)
    crops = np.stack([npy(model_input(tf.constant(open(photo, "rb").read()), trained.preprocessor))
                      for photo in photos])
    best = [[trained.vocab.id(w) for w in c["captions"][0]["caption"].split()] for c in captioned]
    for c, words, log_prob in zip(captioned, best, rescored(trained.model, crops, best)):
        if len(words) < trained.config.decode.max_length:  # ended with <end>
            assert c["captions"][0]["log_prob"] == pytest.approx(log_prob, abs=1e-4)

    out = tmp_path / "export"
    exported = run_cli("export", *args, "--output", str(out), "--top-k", "2")
    assert exported.returncode == 0, exported.stderr[-2000:]
    marker = json.loads((out / "captioning_export.json").read_text())
    assert [m["model_dir"] for m in marker["members"]] == [os.path.abspath(m) for m in two_models]
    again = run_cli("export", *args, "--output", str(out), "--top-k", "2")  # the same ensemble: a no-op
    assert again.returncode == 0 and json.loads((out / "captioning_export.json").read_text()) == marker
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    loaded = subprocess.run([sys.executable, "-c", LOADER, str(out), *photos], capture_output=True, text=True,
                            cwd=str(tmp_path), env={**env, "TF_CPP_MIN_LOG_LEVEL": "2"}, timeout=300)
    assert loaded.returncode == 0, loaded.stderr[-3000:]
    served = json.loads(loaded.stdout.splitlines()[-1])
    for s, c in zip(served, captioned):  # without the project, the same captions as `caption`
        assert s["captions"] == [x["caption"] for x in c["captions"]]
        assert s["log_probs"] == pytest.approx([x["log_prob"] for x in c["captions"]], abs=1e-4)


@pytest.mark.slow
def test_evaluate_an_ensemble_keeps_it_in_the_first_folder(two_models, tmp_path):
    from captioning.config import DataConfig
    from captioning.data.pipeline import make_dataset
    from captioning.evaluation.evaluate import evaluate
    from captioning.inference import load
    from captioning.train import evaluation_loss

    dirs = copies(two_models, tmp_path)
    cli = run_cli("evaluate", "--model-dir", dirs[0], "--model-dir", dirs[1], "--beam-size", "2")
    assert cli.returncode == 0, cli.stderr[-2000:]
    assert cli.stdout.startswith("test: 4 images, an ensemble of 2 models, beam 2, perplexity ")
    names = [n for n in os.listdir(os.path.join(dirs[0], "eval")) if "-ensemble2-" in n and n.endswith(".json")]
    assert len(names) == 2 and not os.path.exists(os.path.join(dirs[1], "eval", names[0]))  # and its predictions
    result = json.load(open(os.path.join(dirs[0], "eval", sorted(names)[0])))
    members = [load(d) for d in dirs]
    checkpoints = [m.checkpoint for m in members]
    assert result["members"] == [os.path.realpath(c) for c in checkpoints]
    # Jensen: -log of the averaged probability is at most the models' mean -log p, token by token
    data = DataConfig(dir=result["data_dir"], image_size=32, resize_size=36, cache="none")
    losses = [evaluation_loss(m.model, make_dataset(data, "test", training=False, batch_size=8)).loss
              for m in members]
    assert result["loss"] <= sum(losses) / 2 + 1e-6 and result["perplexity"] == pytest.approx(math.exp(result["loss"]))
    stamp = os.stat(os.path.join(dirs[0], "eval", sorted(names)[0])).st_mtime_ns
    again = evaluate([dirs[0], dirs[1]], split="test", beam_size=2, progress=False)  # the stored result
    assert again == result and os.stat(os.path.join(dirs[0], "eval", sorted(names)[0])).st_mtime_ns == stamp
    reversed_order = evaluate([dirs[1], dirs[0]], split="test", beam_size=2, progress=False, max_images=2)
    assert reversed_order.members == [os.path.realpath(c) for c in checkpoints[::-1]]
    assert any("-ensemble2-" in n for n in os.listdir(os.path.join(dirs[1], "eval")))


def test_an_ensemble_is_refused_in_one_line_when_its_models_cannot_be_one(two_models, tmp_path):
    dirs = copies(two_models, tmp_path)
    other_vocab = tmp_path / "other_vocab"
    shutil.copytree(dirs[1], other_vocab)
    words = (other_vocab / "vocab.txt").read_text().splitlines()
    (other_vocab / "vocab.txt").write_text("\n".join(words[:-2] + words[-1:-3:-1]) + "\n")  # two words swapped
    other_size = tmp_path / "other_size"
    shutil.copytree(dirs[1], other_size)
    config = (other_size / "config.yaml").read_text()
    assert "  image_size: 32\n" in config
    (other_size / "config.yaml").write_text(config.replace("  image_size: 32\n", "  image_size: 28\n"))
    photo = tmp_path / "p.png"
    from tests.helpers import encode, gradient

    photo.write_bytes(encode(gradient(size=(40, 40)), "PNG"))
    cases = [
        (("caption", str(photo), "--model-dir", dirs[0], "--model-dir", str(other_vocab)),
         f"the models in {dirs[0]} and {other_vocab} have different vocabularies ({len(words)} and {len(words)} "
         f"words; word {len(words) - 2}: {words[-2]!r} against {words[-1]!r}): an ensemble averages word "
         "probabilities, so its models must share one vocabulary (prepare their data with the same `--vocab`)"),
        (("evaluate", "--model-dir", dirs[0], "--model-dir", str(other_size)),
         f"the models in {dirs[0]} and {other_size} read different inputs (data.image_size 32 against 28): an "
         "ensemble is evaluated over one input; caption or export it instead, where each model reads the images "
         "its own way"),
        (("evaluate", "--model-dir", dirs[0], "--model-dir", dirs[1], "--checkpoint", dirs[0] + "/ckpt-60"),
         "--checkpoint names one model's checkpoint: an ensemble of several model folders uses each one's latest "
         "complete checkpoint"),
        (("evaluate", "--model-dir", dirs[0], "--model-dir", dirs[1], "--output", dirs[1] + "/config.yaml"),
         f"--output {dirs[1]}/config.yaml is a file of the model folder {dirs[1]}, which only `captioning train` "
         "writes; give a file name outside it, or a new name"),
        (("export", "--model-dir", dirs[0], "--model-dir", dirs[0] + "/", "--output", str(tmp_path / "e")),
         f"--model-dir {dirs[0]}/ is given twice (as {dirs[0]}): an ensemble's models are different folders"),
    ]
    for args, message in cases:
        done = run_cli(*args)
        assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr[-2000:]
        assert done.stderr.strip().splitlines()[-1] == f"captioning {args[0]}: error: {message}"
    evaluated = os.listdir(os.path.join(dirs[0], "eval")) if os.path.isdir(os.path.join(dirs[0], "eval")) else []
    assert not os.path.exists(tmp_path / "e") and not any("-ensemble" in n for n in evaluated)  # nothing written
