"""CLIPScore, RefCLIPScore, PAC-S and text-to-image recall (captioning/evaluation/clip_score.py) over tiny random
CLIP and SigLIP presets written here with ``save_to_preset`` (tests/harness/clip_presets.py), each checked
against a plain recomputation from the same embeddings."""

import math

import numpy as np
import pytest

from captioning.errors import InputError


@pytest.fixture(scope="module")
def presets(tmp_path_factory):
    from tests.harness.clip_presets import write_clip, write_siglip

    root = tmp_path_factory.mktemp("clip_presets")
    return {"clip": write_clip(str(root / "clip")), "clip_end_first": write_clip(str(root / "end"), end_token_last=False),
            "siglip": write_siglip(str(root / "siglip"))}


def cosine(a, b) -> float:
    return sum(x * y for x, y in zip(a, b)) / math.sqrt(sum(x * x for x in a) * sum(y * y for y in b))


def recomputed(v, c, refs, w):
    """Hessel et al.'s per-image CLIP-S and RefCLIP-S, one image at a time in plain Python."""
    clip = w * max(cosine(v, c), 0.0)
    best = max((cosine(c, r) for r in refs), default=0.0)
    return clip, (2 * clip * best / (clip + best) if clip + best else 0.0)


def test_the_metrics_equal_a_plain_recomputation_on_hand_made_cases():
    """A negative cosine is clipped to 0 (its RefCLIP-S then 0 too), a caption equal to a reference has a text
    cosine of 1 (RefCLIP-S = 2c / (c + 1)), no reference counts 0; recall counts ties against the caption."""
    from captioning.evaluation.clip_score import clip_scores, recall_at, ref_clip_scores
    from captioning.model.contrastive import normalised

    v = normalised([[1.0, 0.0, 0.0], [0.0, 1.0, 0.0], [0.6, 0.8, 0.0]])
    c = normalised([[-1.0, 0.2, 0.0], [0.1, 1.0, 0.3], [0.6, 0.8, 0.0]])
    refs = [normalised([[0.0, 0.0, 1.0]]), normalised([[0.1, 1.0, 0.3], [1.0, 0.0, 0.0]]), np.zeros([0, 3])]
    for w in (2.5, 2.0):
        clip = clip_scores(v, c, w)
        ref = ref_clip_scores(clip, c, refs)
        for i in range(3):
            want_clip, want_ref = recomputed(v[i], c[i], refs[i], w)
            assert clip[i] == pytest.approx(want_clip, abs=1e-12) and ref[i] == pytest.approx(want_ref, abs=1e-12)
        assert clip[0] == 0.0 and ref[0] == 0.0  # cos(v, c) < 0: clipped
        assert ref[1] == pytest.approx(2 * clip[1] / (clip[1] + 1.0))  # the caption is its first reference
        assert clip[2] == pytest.approx(w) and ref[2] == 0.0  # identical to its image; no reference: 0
    # caption 1 is as close to image 2 as to its own (a tie): it ranks second, not first
    tie = normalised([[0.0, 0.0, 1.0], [0.6, 0.8, 0.0], [0.6, 0.8, 0.0]])
    images = normalised([[0.0, 0.0, 1.0], [0.6, 0.8, 0.0], [0.6, 0.8, 0.0]])
    assert recall_at(tie, np.arange(3), images, ks=(1, 2)) == {"recall@1": 1 / 3, "recall@2": 1.0}
    assert recall_at(np.zeros([0, 3]), np.arange(0), images) == {"recall@1": 0.0, "recall@5": 0.0}


@pytest.mark.parametrize("family", ["clip", "siglip"])
@pytest.mark.parametrize("metric", ["clip", "pac"])
def test_scores_of_a_preset_equal_a_recomputation_from_its_embeddings(presets, family, metric):
    """Every measure over a preset (an empty caption among the captions, a caption equal to its reference, images of
    another size than the preset's) equals the plain recomputation from the model's own embeddings of the prefixed
    texts and the images; PAC-S is the same form with w = 2.0 and its own names."""
    from captioning.evaluation.clip_score import PREFIX, scores
    from captioning.model.contrastive import ContrastiveModel

    model = ContrastiveModel(presets[family])
    images = np.random.RandomState(0).randint(0, 256, [4, 40, 52, 3]).astype(np.uint8)
    captions = ["a red circle", "", "two blue squares", "a big green triangle above a circle"]
    references = [["a red circle", "one circle"], ["a shape"], ["two squares", "blue squares", "two blue squares"],
                  ["a triangle"]]
    got = scores(model, images, captions, references, metric=metric)
    name, w = ("clip_score", 2.5) if metric == "clip" else ("pac_score", 2.0)
    v = model.embed_images(images)
    per = [recomputed(v[i], model.embed_texts([PREFIX + captions[i]])[0],
                      model.embed_texts([PREFIX + r for r in references[i]]), w) for i in range(4)]
    np.testing.assert_allclose(got["per_image"][name], [p[0] for p in per], atol=1e-9)
    np.testing.assert_allclose(got["per_image"]["ref_" + name], [p[1] for p in per], atol=1e-9)
    assert got[name] == pytest.approx(np.mean([p[0] for p in per])) and got["per_image"]["ref_" + name][0] > 0
    assert got["ref_" + name] == pytest.approx(np.mean([p[1] for p in per]))
    c = model.embed_texts([PREFIX + x for x in captions])
    sims = c @ v.T
    ranks = [1 + sum(sims[i, j] >= sims[i, i] for j in range(4) if j != i) for i in range(4)]
    assert got["recall@1"] == pytest.approx(np.mean([r <= 1 for r in ranks]))
    assert got["recall@5"] == 1.0 and 0.0 <= got["references_recall@1"] <= 1.0


def test_clip_pools_at_the_end_of_text_token_whatever_its_id(presets):
    """CLIP's text embedding is the encoder's output at the end-of-text token, projected: what keras-hub's
    backbone gives when that token has the largest id, and not when it does not (keras-hub pools at the largest id:
    there, another word)."""
    from captioning.model.contrastive import ContrastiveModel, normalised

    texts = ["a red circle", "two squares left of a triangle"]
    for name, keras_hub_agrees in (("clip", True), ("clip_end_first", False)):
        model = ContrastiveModel(presets[name])
        ids = model.token_ids(texts)
        end = int(model.preprocessor.tokenizer.end_token_id)
        hidden = np.asarray(model.backbone.text_encoder({"token_ids": ids}))
        at = [list(row).index(end) for row in ids]
        assert at == [len(np.asarray(model.preprocessor.tokenizer(t))) + 1 for t in texts]  # start, pieces, end
        by_hand = normalised(model.backbone.text_projection(hidden[np.arange(2), at]))
        np.testing.assert_allclose(model.embed_texts(texts), by_hand, atol=1e-6)
        keras_hubs = normalised(model.backbone.get_text_embeddings(ids))
        assert np.allclose(keras_hubs, by_hand, atol=1e-6) == keras_hub_agrees, name


def test_a_preset_of_another_kind_or_none_is_refused_in_one_line(tmp_path):
    from captioning.model.contrastive import ContrastiveModel
    from tests.harness.presets import write_preset

    vit = write_preset("vit", str(tmp_path / "vit"))
    for preset, message in ((vit, r"holds a ViTBackbone; a CLIP or SigLIP preset is needed"),
                            (str(tmp_path / "nowhere"), r"clip_preset: the folder .* does not exist"),
                            ("", r"--clip-preset: give a keras-hub CLIP or SigLIP preset")):
        with pytest.raises(InputError, match=message) as refused:
            ContrastiveModel(preset)
        assert "\n" not in str(refused.value)


@pytest.mark.slow  # three evaluations (METEOR's JVM)
def test_evaluate_with_a_clip_preset_scores_every_image_under_the_presets_own_key(presets, trained_model_dir,
                                                                                   prepared_dir, tmp_path):
    """``evaluate --clip-preset P``: the result's ``clip`` and the predictions' per-image scores equal a
    recomputation from the records' JPEGs (decoded by ``tf.io.decode_jpeg``, read by the preset's converter) and the
    references; the summary prints them; another preset (SigLIP) and ``--clip-metric pac`` are other results, each
    under its own key, and the first evaluation again is a no-op."""
    import glob
    import json
    import os

    import tensorflow as tf

    from captioning.config import load_config
    from captioning.data.reading import parsed_images, references
    from captioning.evaluation.clip_score import PREFIX, identity
    from captioning.model.contrastive import ContrastiveModel
    from tests.helpers import copy_model, run_main

    model_dir = copy_model(trained_model_dir, tmp_path / "model")
    flags = ("evaluate", "--model-dir", model_dir, "--max-images", "5", "--beam-size", "1")
    code, out, err = run_main(*flags, "--clip-preset", presets["clip"])
    assert code == 0, err[-3000:]
    assert f"reference-free ({presets['clip']}): CLIP-S " in out and "text-to-image recall@1" in out, out
    key = f"-clip{identity(presets['clip'])}"
    [result_file] = [p for p in glob.glob(os.path.join(model_dir, "eval", f"*{key}*.json")) if "predictions" not in p]
    document = json.load(open(result_file))
    result = document["clip"]
    predictions = json.load(open(result_file[:-len(".json")] + ".predictions.json"))
    assert result["preset"] == presets["clip"] and result["metric"] == "clip"
    assert len(predictions) == document["num_images"] == 4  # the fixture's test split, all of it
    clip = ContrastiveModel(presets["clip"])
    data = load_config(None, [f"data.dir={prepared_dir}"]).data
    pixels = {int(ex["image_id"]): clip.converter(tf.cast(tf.io.decode_jpeg(ex["encoded"], channels=3),
                                                          tf.float32)[None])[0]
              for ex in parsed_images(data, "test", training=False)}
    refs = references(data, "test")
    per = [recomputed(clip.embed_converted(pixels[p["image_id"]][None])[0], clip.embed_texts([PREFIX + p["caption"]])[0],
                      clip.embed_texts([PREFIX + r for r in refs[p["image_id"]]]), 2.5) for p in predictions]
    for p, (want_clip, want_ref) in zip(predictions, per):
        assert p["clip_score"] == pytest.approx(want_clip, abs=1e-5) and p["ref_clip_score"] == pytest.approx(
            want_ref, abs=1e-5)
    assert result["clip_score"] == pytest.approx(np.mean([x[0] for x in per]), abs=1e-5)
    assert result["ref_clip_score"] == pytest.approx(np.mean([x[1] for x in per]), abs=1e-5)
    assert 0 <= result["recall@1"] <= result["recall@5"] <= 1

    for extra, name in ((("--clip-preset", presets["siglip"]), "clip_score"),
                        (("--clip-preset", presets["clip"], "--clip-metric", "pac"), "pac_score")):
        code, out, err = run_main(*flags, *extra)
        assert code == 0 and ("PAC-S" in out) == (name == "pac_score"), err[-3000:]
    results = [p for p in glob.glob(os.path.join(model_dir, "eval", "*.json")) if "predictions" not in p]
    assert len(results) == 3  # each preset and metric its own result
    pac = json.load(open(next(p for p in results if f"-pac{identity(presets['clip'])}" in p)))["clip"]
    assert pac["pac_score"] == pytest.approx(result["clip_score"] * 2.0 / 2.5)  # the same cosines, w = 2.0
    code, out, err = run_main(*flags, "--clip-preset", presets["clip"])
    assert code == 0 and "evaluated already" in err and f"CLIP-S {result['clip_score']:.4f}" in out


@pytest.mark.slow  # a training run of 80 steps, and its reruns
def test_clip_train_writes_a_preset_evaluate_reads_and_a_rerun_is_a_no_op(prepared_dir, tmp_path):
    """``captioning clip train --records DIR --split train --steps N --output P``: a CLIP preset (backbone, CLIP BPE
    tokenizer learnt from the captions, preprocessor and CLIP's image converter) whose contrastive loss falls below
    chance on the split; ``ContrastiveModel`` reads it; the same command again is a no-op, other settings are
    refused in one line without ``--overwrite``, and a batch larger than the split too."""
    import json
    import os

    from captioning.model.contrastive import ContrastiveModel
    from tests.helpers import run_main

    output = str(tmp_path / "clip")
    command = ("clip", "train", "--records", prepared_dir, "--split", "train", "--steps", "80", "--batch-size", "8",
               "--learning-rate", "0.001", "--output", output)
    code, out, err = run_main(*command)
    assert code == 0, err[-3000:]
    figures = json.load(open(os.path.join(output, "training.json")))["figures"]
    assert figures["final_loss"] < figures["chance_loss"] == pytest.approx(math.log(8)), figures
    assert f"CLIP tiny in {output}: final loss {figures['final_loss']:.3f}" in out
    model = ContrastiveModel(output)
    assert model.family == "CLIPBackbone" and model.preprocessor.sequence_length == 32
    ids = model.token_ids(["A red circle"])[0]
    end = int(model.preprocessor.tokenizer.end_token_id)
    assert end == int(ids.max()) == model.preprocessor.tokenizer.vocabulary_size() - 1  # OpenAI's order
    assert 0 < list(ids).index(end) <= 4  # start, a few pieces, end
    code, out, err = run_main(*command)
    assert code == 0 and "already holds this CLIP" in out
    code, out, err = run_main(*command[:-2], "--seed", "1", "--output", output)
    assert code == 2 and "holds a CLIP trained with other settings or data; pass --overwrite" in err.strip().splitlines()[-1]
    code, out, err = run_main("clip", "train", "--records", prepared_dir, "--batch-size", "8192", "--output",
                              str(tmp_path / "other"))
    assert code == 2 and "fewer than --batch-size 8192" in err.strip().splitlines()[-1], err[-500:]
    assert not os.path.exists(tmp_path / "other")


@pytest.mark.parametrize("family", ["clip", "siglip"])
def test_the_in_graph_clip_reward_equals_the_evaluations_clip_score(presets, family):
    """SCST's CLIP reward (captioning/train/clip_reward.py) packs word-id captions into the preset's ids exactly as
    its preprocessor packs the prefixed text (a caption cut at the text length keeps its end token; an empty
    caption is the prefix alone), and its CLIP-S of each caption and image equals ``evaluate``'s."""
    import tensorflow as tf

    from captioning.evaluation.clip_score import PREFIX, clip_scores
    from captioning.model.contrastive import ContrastiveModel
    from captioning.train.clip_reward import ClipReward, vocabulary_words
    from captioning.vocab import RESERVED, Vocabulary
    from tests.harness.lm_presets import WORDS

    vocab = Vocabulary(RESERVED + WORDS)
    model = ContrastiveModel(presets[family])
    reward = ClipReward(model, vocabulary_words(vocab))
    captions = [["a", "red", "circle"], [], ["two", "blue", "squares", "left", "of", "a", "big", "green", "triangle",
                                             "and", "three", "circles", "above", "the", "largest", "shape"]]
    width = max(map(len, captions)) + 2
    ids = np.array([[vocab.id(w) for w in c] + [2] + [0] * (width - len(c) - 1) for c in captions], np.int32)
    lengths = np.array([len(c) for c in captions], np.int32)
    texts = [PREFIX + " ".join(c) for c in captions]
    np.testing.assert_array_equal(reward.token_ids(ids, lengths).numpy(), model.token_ids(texts))
    images = np.random.RandomState(1).randint(0, 256, [3, 32, 32, 3]).astype(np.uint8)
    compiled = tf.function(lambda pixels, i, n: reward(reward.image_embeddings(pixels), i, n), autograph=False)
    got = compiled(tf.constant(images), tf.constant(ids), tf.constant(lengths)).numpy()  # in a graph, as in a step
    want = clip_scores(model.embed_images(images), model.embed_texts(texts))
    np.testing.assert_allclose(got, want, atol=1e-5)
    assert got.max() > 0


@pytest.mark.slow  # SCST steps with the CLIP reward, and an accumulated one
def test_scst_rewards_each_sample_with_its_clip_score_and_trains(presets, prepared_dir, tmp_path):
    """``scst.reward: mix``: each sample's ``clip_s`` is ``evaluate``'s CLIP-S of its words with its image's pixels,
    its reward CIDEr-D + ``scst.clip_weight`` · CLIP-S; the steps train (``clip_s`` reported), with
    ``train.accumulate_steps`` too, and ``benchmark train``'s step in parts times them; ``clip`` rewards CLIP-S
    alone; no preset, ``data.cache: features`` or a data source without pixels (regions) is refused in one line."""
    from captioning.evaluation.clip_score import PREFIX, clip_scores
    from captioning.experiment import for_training
    from captioning.model.contrastive import ContrastiveModel
    from captioning.train import Trainer
    from tests.helpers import small_train_config

    scst = ("train.objective=scst", "data.captions_per_image=grouped", "scst.samples=3", "scst.max_length=8",
            "train.batch_size=10", f"scst.clip_preset={presets['clip']}")
    cfg = small_train_config(prepared_dir, *scst, "scst.reward=mix", "scst.clip_weight=0.5")
    trainer = Trainer(for_training(cfg), str(tmp_path / "mix"))
    objective, model = trainer.objective, ContrastiveModel(presets["clip"])
    dataset = trainer.distributed_dataset("train", training=True)
    batch = next(iter(dataset))
    out = objective.rewards(trainer.model, batch)
    texts = [PREFIX + " ".join(trainer.vocab.decode(row)) for row in out["ids"].numpy()]
    images = np.repeat(batch["image"].numpy(), 3, axis=0)
    np.testing.assert_allclose(out["clip_s"], clip_scores(model.embed_images(images), model.embed_texts(texts)),
                               atol=1e-5)
    index = np.repeat(np.arange(len(batch["image"])), 3)
    cider = objective.cider.scores(out["ids"], objective.scored_lengths(out["ids"]), objective.references(batch),
                                   index)
    np.testing.assert_allclose(out["reward"], cider + 0.5 * out["clip_s"], atol=1e-5)
    assert float(np.max(out["clip_s"])) > 0 and "clip_s" in objective.parts
    step, batches = trainer.train_step_for(dataset), iter(dataset)
    outs = [{k: float(v) for k, v in step(next(batches)).items()} for _ in range(2)]
    assert all(np.isfinite(o["loss"]) and o["clip_s"] >= 0 for o in outs), outs
    # `benchmark train`'s step in parts times the CLIP reward with the images' embedding (and the greedy baseline's)
    parts = objective.breakdown(trainer.model, batch)
    assert sorted(parts["parts_ms"]) == ["cross_entropy", "encode", "greedy", "reward", "sampling", "sampling_xla",
                                         "teacher_forced", "through_loop"]
    assert all(v > 0 for v in parts["parts_ms"].values()) and "reward " in parts["note"]

    clip_only = Trainer(for_training(small_train_config(prepared_dir, *scst, "scst.reward=clip")), str(tmp_path / "c"))
    drawn = clip_only.objective.rewards(clip_only.model, batch)
    np.testing.assert_array_equal(drawn["reward"], drawn["clip_s"])
    accumulated = small_train_config(prepared_dir, *scst, "scst.reward=mix", "train.accumulate_steps=2",
                                     "train.steps=1", "train.checkpoint_every_steps=1")
    assert Trainer(for_training(accumulated), str(tmp_path / "acc")).run(progress=False).step == 1

    for extra, message in ((("scst.reward=clip", "scst.clip_preset="), "scst.reward clip needs scst.clip_preset"),
                           (("scst.reward=mix", "data.cache=features", "model.encoder_trainable=false",
                             "data.random_crop=false"), "reads the images, and data.cache: features holds none")):
        with pytest.raises(InputError, match=message):
            Trainer(for_training(small_train_config(prepared_dir, *scst, *extra)), str(tmp_path / "refused"))
    from captioning.train.objectives import resolve
    from captioning.train.objectives.scst import SelfCritical

    regions = resolve(small_train_config(prepared_dir, *scst, "scst.reward=mix", "data.features=regions"))
    with pytest.raises(InputError, match="reads the images, and data.features: regions holds none"):
        SelfCritical._clip_reward(regions, None)  # asked of the data source (no pixels), before any preset is read


@pytest.mark.slow
def test_mirrored_scst_with_the_clip_reward_equals_one_device(distributed_runs):
    """``scst.reward: mix`` under two replicas, each with its own images, updates the model as one device given
    both batches: each replica embeds its own images for the CLIP reward. Run with the other 2-replica scenarios
    (conftest's distributed_runs)."""
    import os

    from tests.helpers import assert_scst_update_as_one_device, distributed_result

    assert_scst_update_as_one_device(np.load(os.path.join(distributed_result(distributed_runs, "mirrored", "scst_clip"),
                                                          "mirrored_scst.npz")))
