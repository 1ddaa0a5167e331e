"""The encoder contract: what every registered encoder must do, with every decoder, run over every entry of
``captioning.model.encoders.ENCODERS`` (``keras_hub`` once per family: tiny random ViT, CLIP, SigLIP and DINOv2
backbones saved as keras-hub presets in a temporary folder), so a new encoder is tested with no new test code.

The quick loop runs the declarations and every cheap encoder × every decoder (built once per encoder and mode:
its token set's size and layout, the decoder's teacher-forced pass equal to stepping word by word over it, the
attention over its tokens, its variables apart from the decoder's and frozen unless trainable, a checkpoint
that holds every weight); the full suite adds the ImageNet CNNs (Inception v3 at 75 px, ResNet-50,
EfficientNet-B0, MobileNet v2) and keras-hub's ViT preset with every decoder, and tests/test_encoders_end_to_end.py
(two mirrored replicas, the SavedModel, training, captioning, evaluating and exporting from each keras-hub
family, the issue's commands). A toy encoder written
in a temporary folder (a 2 × 3 map after a class token: not square) is registered and passes the contract;
broken, it fails it."""

import dataclasses
import importlib.util
import os

import keras
import numpy as np
import pytest
import tensorflow as tf

from captioning.config import ModelConfig
from captioning.errors import InputError
from captioning.model import DECODERS, build_encoder, build_model
from captioning.model.encoders import ENCODERS, register
from captioning.model.layout import TokenLayout
from tests.harness.encoder_contract import (V, check_encoder_declarations, check_pair, encoder_of, probe,
                                             run_encoder_test)
from tests.harness.models import npy
from tests.harness.presets import ENTRIES, HEAVY, entry_config, write_preset


@pytest.mark.parametrize("name", sorted(ENCODERS))
def test_an_encoder_declares_what_the_rest_of_the_code_asks(name):
    check_encoder_declarations(name)


# the full suite only: the ImageNet CNNs, and keras-hub's ViT preset (the vit encoder's backbone, read from a folder)
FULL_SUITE = (*HEAVY, "keras_hub:vit")


def pairs(heavy):
    """Every entry with every decoder; a decoder that reads images with an encoder of its own (``own_encoder``) with
    that one, and with small_cnn only to see the refusal of any other (built for nothing with the others)."""
    def paired(entry, decoder):
        own = DECODERS[decoder].own_encoder
        return own is None or entry in (own, "small_cnn")

    return [pytest.param(e, d, id=f"{e}-{d}") for e in ENTRIES for d in sorted(DECODERS)
            if (e in FULL_SUITE) == heavy and paired(e, d)]


@pytest.mark.parametrize("entry,decoder", pairs(heavy=False))
def test_every_encoder_with_every_decoder(entry, decoder, hub_presets):
    encoder = encoder_of(entry, hub_presets, pooled=DECODERS[decoder].features == "pooled")
    check_pair(entry, decoder, encoder)


@pytest.mark.slow
@pytest.mark.parametrize("entry,decoder", pairs(heavy=True))
def test_every_imagenet_cnn_and_the_vit_preset_with_every_decoder(entry, decoder, hub_presets):
    encoder = encoder_of(entry, hub_presets, pooled=DECODERS[decoder].features == "pooled")
    check_pair(entry, decoder, encoder)
    if encoder.pooled and entry in HEAVY:  # a CNN pooled: the global mean of its map, which region pooling reads
        images, tokens = probe(encoder)  # the token set check_pair read, computed once
        np.testing.assert_allclose(npy(encoder.model(images)), tokens.mean(1), rtol=1e-4, atol=1e-4)


TOY = '''
"""A toy encoder that is not part of the project: a 2 x 3 map of patches (not square) after a learned class
token. With BROKEN=1 it declares a layout that misses its class token, and the contract must fail."""
import os

import keras
from keras import layers

from captioning.model.encoders.base import ImageEncoder
from captioning.model.layout import TokenLayout


class ClassToken(layers.Layer):
    def build(self, shape):
        self.token = self.add_weight(shape=(1, 1, shape[-1]), initializer="random_normal", name="token")

    def call(self, x):
        return keras.ops.concatenate([keras.ops.tile(self.token, (keras.ops.shape(x)[0], 1, 1)), x], axis=1)


class Toy(ImageEncoder):
    can_train = False
    tiny_image_size = 32

    def preprocess(self, pixels):
        return pixels / 255.0

    def backbone(self, pooled):
        inputs = keras.Input((self.image_size, self.image_size, 3))
        x = layers.Conv2D(8, (16, 10), strides=(16, 10), name="patches")(inputs)  # 2 rows x 3 columns
        x = ClassToken(name="class_token")(layers.Reshape((-1, 8))(x))
        return keras.Model(inputs, x, name="toy")

    def layout_of(self, tokens):
        return TokenLayout(2, 3, prefix=0 if os.environ.get("BROKEN") else 1)


ENCODER = Toy
'''


def register_toy(tmp_path):
    path = tmp_path / "toy_encoder.py"
    path.write_text(TOY)
    spec = importlib.util.spec_from_file_location("toy_encoder", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    register("toy", module.ENCODER)


def test_a_toy_encoder_written_elsewhere_passes_the_contract_and_a_broken_one_fails(tmp_path, monkeypatch):
    register_toy(tmp_path)
    try:
        checked = run_encoder_test("toy")  # its declarations, and with every decoder
        assert sorted(checked) == sorted(DECODERS)
        for decoder, (encoder, model) in checked.items():
            assert encoder.layout == TokenLayout(2, 3, prefix=1) and encoder.tokens == 7
            assert encoder.image_size == 32 and encoder.pooled == (DECODERS[decoder].features == "pooled")
            assert (model is None) == bool(DECODERS[decoder].own_encoder)  # refused by a decoder of its own encoder
            if model is not None and model.attends:  # what the gallery draws: the class token's share apart, the map lit
                from captioning.model.pictures import spotlight

                weights = np.zeros(7)
                weights[[0, 6]] = 0.5  # half on the class token, half on the bottom-right patch
                picture = spotlight(np.full((32, 32, 3), 128, np.uint8), weights, encoder.layout, 60).astype(int)
                assert picture[45, 50].mean() > picture[10, 5].mean() + 20
                assert 0.45 * 60 <= ((picture[-1, :, 0] > 200) & (picture[-1, :, 1] > 150)).sum() <= 0.55 * 60
        # regions are pooled from its map, the class token left out: the whole image is the mean of the patches
        from captioning.inference.regions import boxes_to_regions

        encoder = build_encoder(ModelConfig(decoder="attention", encoder="toy"), 32)
        images = np.random.default_rng(3).integers(0, 256, (2, 32, 32, 3), np.uint8)
        regions = boxes_to_regions(encoder, images, tf.constant([[[0, 0, 16, 16]], [[0, 0, 0, 0]]], tf.float32),
                                   tf.constant([[32, 32], [32, 32]]))
        patches = npy(encoder.tokens_model()(images))[:, 1:]
        np.testing.assert_allclose(npy(regions["regions"])[:, -1], patches.mean(1), rtol=1e-2, atol=1e-2)
        assert npy(regions["region_mask"]).tolist() == [[1, 1], [0, 1]]
        with pytest.raises(InputError, match="cannot be trained"):
            build_encoder(ModelConfig(encoder="toy", encoder_trainable=True), 32)
        monkeypatch.setenv("BROKEN", "1")
        with pytest.raises(AssertionError, match="declares"):
            check_pair("toy", "attention", build_encoder(ModelConfig(decoder="attention", encoder="toy"), 32))
    finally:
        ENCODERS.pop("toy", None)


def test_settings_are_checked_and_refused_in_one_line(hub_presets, tmp_path, monkeypatch):
    from captioning.model import resolve
    from captioning.config import load_config

    def model_error(*overrides):
        with pytest.raises(InputError) as e:
            cfg = load_config(None, list(overrides))
            resolve(cfg)
            build_model(V, cfg.model, cfg.data.image_size)
        assert "\n" not in str(e.value)
        return str(e.value)

    assert "did you mean vit" in model_error("model.encoder=vitt")
    assert "model.vit_layers" in model_error("model.encoder=vit", "model.vit_layers=0")
    assert "model.vit_layers" in model_error("model.encoder=vit", "model.vit_layers=100000")
    assert "vit_patch_size" in model_error("model.encoder=vit", "data.image_size=30", "data.resize_size=36")
    assert "vit_heads" in model_error("model.encoder=vit", "model.vit_width=10", "model.vit_heads=3", "data.image_size=32",
                                     "data.resize_size=36")
    assert "encoder_preset" in model_error("model.encoder=keras_hub")
    (tmp_path / "empty").mkdir()
    assert "not a keras-hub preset folder (no config.json" in model_error("model.encoder=keras_hub",
                                                                          f"model.encoder_preset={tmp_path / 'empty'}")
    assert "75 px" in model_error("model.encoder=inception_v3", "data.image_size=32", "data.resize_size=36")
    # a relative preset folder is made absolute as a run starts (a model folder is read from anywhere)
    monkeypatch.chdir(os.path.dirname(hub_presets["clip"]))
    cfg = resolve(load_config(None, ["model.encoder=keras_hub", "model.encoder_preset=clip", "model.decoder=attention"]))
    assert cfg.model.components["encoder_preset"] == hub_presets["clip"]


def test_a_preset_reads_its_own_size_and_normalisation(hub_presets, tmp_path):
    """A 32 px preset under data.image_size 48: resized inside the encoder, then scaled as its converter says."""
    import keras_hub

    backbone = keras_hub.models.Backbone.from_preset(hub_presets["vit"])
    cfg, _ = entry_config("keras_hub:vit", hub_presets)
    encoder = build_encoder(cfg, 48)
    images = np.random.default_rng(0).integers(0, 256, (2, 48, 48, 3), np.uint8)
    resized = tf.image.resize(tf.cast(images, tf.float32), (32, 32))
    converter = keras_hub.layers.ImageConverter.from_preset(hub_presets["vit"])
    expected = backbone(resized * np.array(converter.scale, np.float32) + np.array(converter.offset, np.float32))
    np.testing.assert_allclose(npy(encoder.model(images)), npy(expected), atol=1e-4)
    assert encoder.layout == TokenLayout(4, 4, prefix=1)
    # a preset without a converter reads [0, 1] at its backbone's size
    bare = write_preset("vit", str(tmp_path / "bare"), converter=False)
    encoder = build_encoder(dataclasses.replace(cfg, options={**cfg.options, "encoder_preset": bare}), 32)
    np.testing.assert_allclose(npy(encoder.model(images[:, :32, :32])),
                               npy(keras_hub.models.Backbone.from_preset(bare)(images[:, :32, :32] / 255.0)), atol=1e-4)


def hub_error(preset: str) -> str:
    with pytest.raises(InputError) as e:
        build_encoder(ModelConfig(encoder="keras_hub", options={"encoder_preset": preset}), 32)
    return str(e.value)


def test_a_preset_that_cannot_be_read_says_why_in_one_line(tmp_path):
    """Issue 48 item 21: a misspelt name lists every name it may be (not keras-hub's 'must be a one of:' cut
    off); a folder that is not there (moved since) says so; a text model's preset is not a vision backbone."""
    import keras_hub

    m = keras_hub.models
    names = sorted({*m.ViTBackbone.presets, *m.CLIPBackbone.presets, *m.SigLIPBackbone.presets,
                    *m.DINOV2Backbone.presets})
    assert {"clip_vit_base_patch16", "siglip_base_patch16_224", "dinov2_base", "vit_base_patch16_224_imagenet"} <= \
        set(names)
    assert hub_error("clip_vit_base_patch61") == (
        "model.encoder_preset: 'clip_vit_base_patch61' is not a keras-hub ViT, CLIP, SigLIP or DINOv2 preset (did you "
        f"mean clip_vit_base_patch16?); it must be one of: {', '.join(names)}; a local preset folder; or a "
        "kaggle://, hf:// or modelscope:// handle")
    moved = tmp_path / "presets" / "clip"
    assert hub_error(str(moved)) == f"model.encoder_preset: the folder {moved} does not exist (moved or deleted?)"
    text = str(tmp_path / "bert")
    m.BertBackbone(vocabulary_size=20, num_layers=1, num_heads=2, hidden_dim=16, intermediate_dim=24,
                   max_sequence_length=8).save_to_preset(text)
    assert hub_error(text) == (f"model.encoder_preset: {text} holds a BertBackbone, not a vision backbone (the "
                               "keras_hub encoder reads ViT, CLIP, SigLIP and DINOv2 presets)")


def test_a_preset_whose_converter_and_backbone_disagree_is_read_at_the_backbones_size(tmp_path, caplog):
    """Issue 48 item 15: a 32 px ViT whose image converter says 48 px (a preset put together by hand) crashed
    in the backbone; it reads the backbone's 32 px, scaled as the converter says, and a warning names both."""
    import keras_hub

    folder = write_preset("vit", str(tmp_path / "mixed"), size=32, converter=False)
    keras_hub.layers.ImageConverter(image_size=(48, 48), scale=1 / 127.5, offset=-1.0).save_to_preset(folder)
    encoder = build_encoder(ModelConfig(encoder="keras_hub", options={"encoder_preset": folder}), 48)
    assert encoder.layout == TokenLayout(4, 4, prefix=1) and encoder.preset_size == (32, 32)
    images = np.random.default_rng(0).integers(0, 256, (2, 48, 48, 3), np.uint8)
    resized = tf.image.resize(tf.cast(images, tf.float32), (32, 32))
    expected = keras_hub.models.Backbone.from_preset(folder)(resized / 127.5 - 1.0)
    np.testing.assert_allclose(npy(encoder.model(images)), npy(expected), atol=1e-4)
    assert f"model.encoder_preset {folder}: its image converter's size is 48 × 48 px but its backbone reads " \
           "32 × 32 px: images are resized to the backbone's 32 × 32" in [r.getMessage() for r in caplog.records]


@pytest.fixture(scope="module")
def fine_tuned():
    """A model whose small_cnn trains, its first weights and their gradient on one batch, made once for the three
    optimizers and both scales: each update starts from these weights (a build of its own gave the same)."""
    from captioning.train.objectives import caption_loss_sum

    keras.utils.set_random_seed(0)
    cfg = ModelConfig(encoder="small_cnn", encoder_trainable=True, dropout=0.0, options={"lstm_units": 8,
                                                                                          "embedding_size": 8})
    model = build_model(V, cfg, 32, seed=0).build_all()
    rng = np.random.default_rng(0)
    ids = rng.integers(4, V, (4, 5))
    batch = {"image": rng.integers(0, 256, (4, 32, 32, 3), np.uint8), "input_ids": ids, "target_ids": ids,
             "mask": np.ones((4, 5), np.float32)}
    with tf.GradientTape() as tape:
        loss = caption_loss_sum(model, batch, training=False)
    gradients = tape.gradient(loss, model.trainable_variables)
    return model, [v.numpy() for v in model.trainable_variables], gradients


@pytest.mark.parametrize("optimizer", ["sgd", "adam", "adamw"])
def test_a_fine_tuned_encoder_learns_at_its_own_rate(optimizer, fine_tuned):
    """train.encoder_lr_scale: the encoder's update is that share of the one it would get at the decoder's rate
    (SGD exactly; Adam's first step is lr × sign, so the same), the decoder's unchanged; AdamW's decay too. Each
    update is a fresh optimizer's first, from the same weights and their gradient (:func:`fine_tuned`)."""
    from captioning.config.sections import TrainConfig
    from captioning.train.optimizer import make_optimizer

    model, first, gradients = fine_tuned
    deltas = {}
    for scale in (1.0, 0.25):
        for v, w in zip(model.trainable_variables, first, strict=True):
            v.assign(w)
        train = TrainConfig(optimizer=optimizer, learning_rate=0.01, lr_schedule="constant", weight_decay=0.5)
        opt = make_optimizer(train, 10, False, model.encoder.trainable_variables, scale)
        opt.build(model.trainable_variables)
        opt.apply(gradients, model.trainable_variables)
        deltas[scale] = [v.numpy() - b for v, b in zip(model.trainable_variables, first)]
    encoder = {id(v) for v in model.encoder.trainable_variables}
    kinds = ["encoder" if id(v) in encoder else "decoder" for v in model.trainable_variables]
    checked = 0
    for kind, full, scaled in zip(kinds, deltas[1.0], deltas[0.25]):
        if np.abs(full).max() < 1e-7:
            continue
        np.testing.assert_allclose(scaled, full * (0.25 if kind == "encoder" else 1.0), rtol=1e-3, atol=1e-7)
        checked += 1
    assert checked >= 6 and "encoder" in kinds and "decoder" in kinds


@pytest.mark.parametrize("entry", [e for e in ENTRIES if e not in HEAVY])
def test_a_checkpoint_holds_every_weight_of_the_encoder(entry, hub_presets, tmp_path):
    """keras-hub's ViT keeps its Transformer blocks in a plain list, which TensorFlow's checkpoint tracking does not
    follow: a checkpoint of the model alone left them out, and a model folder loaded them random. Every weight
    of the model must come back, whatever the encoder (frozen: trainable ones were in the optimizer's slots too).
    And one seed gives one model, whatever the process's random state (build_encoder's seed)."""
    from captioning.model.folder import ModelDir

    for trainable in (False,):  # frozen, the default: then the optimizer holds no copy of the encoder's weights
        cfg, size = entry_config(entry, hub_presets)
        cfg = dataclasses.replace(cfg, encoder_trainable=trainable)
        keras.utils.set_random_seed(3)
        twin = build_model(V, cfg, size, seed=1).build_all()
        keras.utils.set_random_seed(1)
        model = build_model(V, cfg, size, seed=1).build_all()
        for a, b in zip(model.weights, twin.weights, strict=True):
            np.testing.assert_array_equal(npy(a), npy(b), err_msg=f"{entry}: {a.path} differs in a build of one seed")
        path = tf.train.Checkpoint(model=model).save(str(tmp_path / f"ckpt{trainable}"))
        keras.utils.set_random_seed(2)
        again = build_model(V, cfg, size, seed=2, restoring=True).build_all()
        ModelDir.restore(path, {"model": again})  # a model folder's restore, with its check
        assert len(model.weights) == len(again.weights)
        for a, b in zip(model.weights, again.weights):
            np.testing.assert_array_equal(npy(a), npy(b), err_msg=f"{entry}: {a.path}")
