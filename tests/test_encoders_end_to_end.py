"""The encoder contract end to end (the full suite): two mirrored replicas against one device over every cheap
encoder, training, captioning, evaluating and exporting from a tiny keras-hub preset of each family, and the
commands of issue 31 through the command line. The contract itself is tests/test_encoders.py."""

import os

import numpy as np
import pytest
import tensorflow as tf

from captioning.model import DECODERS
from captioning.model.layout import TokenLayout
from tests.harness.presets import FAMILIES
from tests.harness.scenarios import MIRRORED_PAIRS, contract_result, pair_label


@pytest.mark.slow
@pytest.mark.parametrize("entry,decoder", MIRRORED_PAIRS)
def test_two_mirrored_replicas_compute_what_one_device_computes_over_every_encoder(entry, decoder, mirrored_contracts):
    """tests/harness/scenarios.py's MIRRORED_PAIRS, two mirrored replicas against one device, each encoder trainable
    (its batch norm, if any, synchronised): conftest's mirrored_contracts, one process (TensorFlow starts once with
    two logical CPUs) for them, beside the one of tests/test_decoders.py's decoders."""
    r = contract_result(mirrored_contracts, "encoders", pair_label(entry, decoder))
    assert int(r["one_replicas"]) == 1 and int(r["two_replicas"]) == 2
    assert float(r["two_loss"]) == pytest.approx(float(r["one_loss"]), abs=1e-5)
    names = [k[len("one/"):] for k in r.files if k.startswith("one/")]
    assert len(names) > 10  # the encoder's weights and the decoder's
    for key in names:
        np.testing.assert_allclose(r["two/" + key], r["one/" + key], atol=1e-5, err_msg=key)


def tiny_flags(*classes, **more):
    """Classes' tiny settings (and ``more``) as ``--set model.KEY=VALUE`` flags."""
    settings = {k: v for c in classes for k, v in c.tiny_settings.items()} | more
    return [a for k, v in settings.items() for a in ("--set", f"model.{k}={v}")]


def short_flags(prepared_dir):
    """The issue's commands shortened: the shapes records, two steps, no evaluation, no cache."""
    return ["--set", f"data.dir={prepared_dir}", "--set", "train.steps=2", "--set", "train.eval_every_steps=0",
            "--set", "train.checkpoint_every_steps=2", "--set", "data.cache=none"]


@pytest.fixture(scope="module")
def clip_command(prepared_dir, hub_presets, tmp_path_factory):
    """Issue 31's second command, run once: the Transformer config (64 px) over the 32 px CLIP preset, resized
    inside the encoder, trained from the images (the smallest Transformer). Its model folder and the command's
    result: test_the_issues_commands_train_a_vit_and_a_preset_caption_and_export captions it from the command
    line, and it is the CLIP case of test_train_caption_evaluate_and_export_from_a_keras_hub_preset (a training
    of its own was one more trace of every stage), whose evaluation is stored in the folder."""
    from tests.helpers import run_cli

    hub = tmp_path_factory.mktemp("clip_command") / "hub"
    done = run_cli("train", "--config", "experiments/shapes_transformer.yaml", "--set", "model.encoder=keras_hub",
                   "--set", f"model.encoder_preset={hub_presets['clip']}", "--model-dir", hub,
                   *short_flags(prepared_dir), *tiny_flags(DECODERS["transformer"], decoder_layers=1, encoder_layers=0))
    return hub, done


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
def test_train_caption_evaluate_and_export_from_a_keras_hub_preset(family, hub_presets, prepared_dir, shapes_dir,
                                                                    tmp_path, request):
    """A frozen keras-hub backbone of each family: its tokens cached once (float16), a Transformer trained over
    them, captions with attention over its tokens (a class token apart), an evaluation with grounding, and a
    SavedModel that captions as the captioner does, with its attention split as the layout says. The smallest
    Transformer (one decoder layer over the tokens as the encoder gives them, no encoder layers: its stacks are
    tests/test_decoders.py's), as what is checked here is the family's tokens through every stage, and each
    layer more is traced again in training, captioning, the export and the evaluation (a third of the cost).
    CLIP's model is :func:`clip_command`'s (the issue's command: 64 px, trained from the images, the preset resized
    inside the encoder): the feature cache does not depend on the family (ViT's tokens have CLIP's class token)."""
    from captioning.config.sections import DecodeConfig
    from captioning.evaluation.evaluate import evaluate
    from captioning.inference import Captioner, load
    from captioning.inference.export import export
    from captioning.experiment import for_training
    from captioning.train import Trainer
    from tests.helpers import small_train_config

    if family == "clip":
        model_dir, done = request.getfixturevalue("clip_command")
        assert done.returncode == 0, done.stderr[-2000:]
        model_dir = str(model_dir)
    else:
        model_dir = str(tmp_path / "model")
        cfg = small_train_config(prepared_dir, "model.decoder=transformer", "model.encoder=keras_hub",
                                 f"model.encoder_preset={hub_presets[family]}", "model.encoder_trainable=false",
                                 "data.random_crop=false",
                                 "data.cache=features", "train.steps=2", "train.checkpoint_every_steps=2",
                                 *(f"model.{k}={v}" for k, v in DECODERS["transformer"].tiny_settings.items()),
                                 "model.decoder_layers=1", "model.encoder_layers=0")
        Trainer(for_training(cfg), model_dir).run(progress=False)
    captioner = Captioner(load(model_dir), DecodeConfig(beam_size=2, max_length=4))
    layout = captioner.token_layout
    assert layout == TokenLayout(4, 4, prefix={"vit": 1, "clip": 1, "siglip": 0, "dinov2": 3}[family])
    files = sorted(os.listdir(os.path.join(shapes_dir, "images")))[:2]
    encoded = [open(os.path.join(shapes_dir, "images", f), "rb").read() for f in files]
    captions = captioner.caption(encoded)
    assert all(np.asarray(c[0].attention).shape[-1] == layout.tokens for c in captions)
    out = export(captioner, str(tmp_path / "export"), model_dir)
    served = tf.saved_model.load(out).signatures["serving_default"](images=tf.constant(encoded))
    assert [[t.decode() for t in row] for row in served["captions"].numpy()] == [[c.text for c in cs] for cs in captions]
    assert tuple(served["attention"].shape[2:]) == (4, 4)
    assert ("attention_prefix" in served) == bool(layout.prefix)
    if layout.prefix:
        total = served["attention"].numpy().sum((2, 3)) + served["attention_prefix"].numpy().sum(-1)
        first = captions[0][0]
        np.testing.assert_allclose(total[0, :len(first.text.split())], 1.0, atol=1e-4)
    result = evaluate(model_dir, "test", instances=os.path.join(shapes_dir, "annotations", "instances_test.json"),
                      progress=False, beam_size=1, max_length=4)
    assert "CIDEr" in result["metrics"] and "attention" in result["grounding"]


@pytest.mark.slow
def test_the_issues_commands_train_a_vit_and_a_preset_caption_and_export(prepared_dir, shapes_dir, clip_command,
                                                                          tmp_path):
    """The commands of issue 31, on the shapes fixture and for two steps: a ViT under soft attention from the
    shapes config (32 px: 4 x 4 patches and a class token), and the Transformer config (64 px) over a 32 px CLIP
    preset, resized inside the encoder; captions with --json and --html (the SavedModel of a preset's model:
    test_train_caption_evaluate_and_export_from_a_keras_hub_preset). The models at their tiny sizes (``--set``: the
    ViT's and the attention decoder's tiny settings, the smallest Transformer): the configs' widths and layers are not
    what is checked (the grid, the class token, a weight a token are), and each layer more is traced again."""
    import json

    from captioning.model.encoders import ENCODERS
    from tests.helpers import run_cli

    vit = tmp_path / "vit"
    done = run_cli("train", "--config", "experiments/shapes.yaml", "--set", "model.encoder=vit", "--set",
                   "model.decoder=attention", "--model-dir", vit, *short_flags(prepared_dir),
                   *tiny_flags(ENCODERS["vit"], DECODERS["attention"]))
    assert done.returncode == 0, done.stderr[-2000:]
    hub, done = clip_command  # the Transformer config's command (a fixture: the CLIP case of the preset test)
    assert done.returncode == 0, done.stderr[-2000:]
    image = os.path.join(shapes_dir, "images", sorted(os.listdir(os.path.join(shapes_dir, "images")))[0])
    for folder, grid in ((vit, [4, 4]), (hub, [4, 4])):
        gallery = tmp_path / f"{folder.name}.html"
        done = run_cli("caption", "--model-dir", folder, "--json", "--html", gallery, image)
        assert done.returncode == 0, done.stderr[-2000:]
        line = json.loads(done.stdout.strip().splitlines()[-1])
        assert (line["grid"], line["prefix_tokens"]) == (grid, 1)
        assert all(len(word) == 17 for word in line["captions"][0]["attention"])
        assert 'alt="attention for' in gallery.read_text() and "class token" in gallery.read_text()
