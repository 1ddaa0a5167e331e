"""The Show-and-Tell model: exact sizes, shapes, step-by-step decoding, frozen encoders, init, mixed
precision, local encoder weights and checkpoints. No data needed: random uint8 images."""

import keras
import numpy as np
import pytest
import tensorflow as tf

from captioning.config import ModelConfig
from captioning.errors import InputError
from captioning.model import build_encoder, build_model
from tests.helpers import model_config

V, B, T, SIZE = 50, 3, 7, 32


def small_cfg(**kw):
    values = dict(encoder="small_cnn", embedding_size=16, lstm_units=24, dropout=0.0)
    values.update(kw)
    return model_config(**values)


def small_model(seed=0, **kw):
    return build_model(V, small_cfg(**kw), SIZE, seed=seed).build_all()


def inputs(seed=0, batch=B, steps=T):
    rng = np.random.default_rng(seed)
    images = rng.integers(0, 256, (batch, SIZE, SIZE, 3), dtype=np.uint8)
    ids = rng.integers(1, V, (batch, steps), dtype=np.int64)
    return images, ids


def npy(x):
    """A variable or tensor as a NumPy array."""
    return x.numpy() if hasattr(x, "numpy") else np.asarray(x)


def size(variable):
    return int(np.prod(variable.shape))


@pytest.fixture(scope="module")
def im2txt_model():
    return build_model(11520, ModelConfig(encoder="inception_v3", encoder_weights="none"), 299).build_all()


def test_im2txt_parameter_counts(im2txt_model):
    m, vocab = im2txt_model, 11520
    assert m.feature_size == 2048
    assert sum(size(v) for v in m.image_embedding.weights) == 2048 * 512 == 1_048_576
    assert sum(size(v) for v in m.lstm.weights) == 4 * ((512 + 512) * 512 + 512) == 2_099_200
    assert sum(size(v) for v in m.word_embedding.weights) == vocab * 512 == 5_898_240
    assert sum(size(v) for v in m.logits.weights) == 512 * vocab + vocab == 5_909_760
    decoder = m.decoder_variables()
    assert len(decoder) == 1 + 3 + 1 + 2  # kernel; kernel, recurrent kernel, bias; embeddings; kernel, bias
    assert sum(size(v) for v in decoder) == 1_048_576 + 2_099_200 + 5_898_240 + 5_909_760 == 14_955_776
    # The encoder is frozen by default: the trainable variables are exactly the decoder's.
    assert {id(v) for v in m.trainable_variables} == {id(v) for v in decoder}
    assert len(m.trainable_variables) == 7
    assert sum(size(v) for v in m.trainable_variables) == 14_955_776
    assert m.encoder.trainable_variables == []
    # Keras' InceptionV3 without its top has 21,802,784 parameters.
    assert sum(size(v) for v in m.encoder.weights) == 21_802_784
    assert m.count_params() == 21_802_784 + 14_955_776


def test_output_shapes():
    model = small_model()
    images, ids = inputs()
    logits = model({"image": images, "input_ids": ids})
    assert tuple(logits.shape) == (B, T, V) and logits.dtype == "float32"
    features = model.encode(images)
    # small_cnn keeps its final grid: 32 px / 2^4 = 2 × 2 cells × 128 channels
    assert tuple(features.shape) == (B, 2 * 2 * 128) and model.feature_size == 512
    state = model.initial_state(features)
    assert len(state) == 2 and [tuple(s.shape) for s in state] == [(B, 24), (B, 24)]
    step_logits, new_state = model.step(tf.constant(ids[:, 0]), state)
    assert tuple(step_logits.shape) == (B, V) and step_logits.dtype == "float32"
    assert [tuple(s.shape) for s in new_state] == [(B, 24), (B, 24)]
    assert not np.allclose(new_state[0], state[0])
    # Precomputed features give the same logits as images (the cache: features path).
    np.testing.assert_allclose(model({"features": features, "input_ids": ids}), logits, atol=1e-6)


def bn_statistics(model):
    backbone = model.encoder.get_layer("small_cnn")
    return [npy(v) for layer in backbone.layers if isinstance(layer, keras.layers.BatchNormalization)
            for v in (layer.moving_mean, layer.moving_variance)]


def test_frozen_encoder_keeps_batch_norm_statistics():
    model = small_model()
    assert model.encoder.weights and model.encoder.trainable_variables == []
    assert not any(v.trainable for v in model.encoder.weights)
    assert all(v.trainable for v in model.decoder_variables())
    before = bn_statistics(model)
    assert len(before) == 2 * 5  # four conv blocks and the features' batch norm
    images, ids = inputs(seed=2)
    model({"image": images, "input_ids": ids}, training=True)
    for a, b in zip(before, bn_statistics(model)):
        np.testing.assert_array_equal(a, b)

    trainable = small_model(encoder_trainable=True)
    encoder_vars = trainable.encoder.trainable_variables
    assert len(encoder_vars) == 4 + 2 * 5  # conv kernels, batch-norm gammas and betas
    assert {id(v) for v in trainable.trainable_variables} == \
        {id(v) for v in encoder_vars} | {id(v) for v in trainable.decoder_variables()}
    before = bn_statistics(trainable)
    trainable({"image": images, "input_ids": ids}, training=True)
    after = bn_statistics(trainable)
    assert all(not np.array_equal(a, b) for a, b in zip(before, after))  # a trainable encoder does learn


def test_uniform_initialisation():
    model = build_model(V, small_cfg(embedding_size=64, lstm_units=64, init_scale=0.05), SIZE).build_all()
    weights = {
        "image_embedding": model.image_embedding.kernel,
        "word_embedding": model.word_embedding.embeddings,
        "lstm_kernel": model.lstm.cell.kernel,
        "lstm_recurrent": model.lstm.cell.recurrent_kernel,
        "logits": model.logits.kernel,
    }
    values = {}
    for name, variable in weights.items():
        w = npy(variable)
        assert w.size >= 3200, name
        assert np.abs(w).max() <= 0.05, name
        assert w.max() > 0.045 and w.min() < -0.045, name  # uses the whole range
        assert abs(w.std() - 0.05 / np.sqrt(3)) < 0.003, name  # uniform, not normal or constant
        assert abs(w.mean()) < 0.004, name
        values[name] = w
    np.testing.assert_array_equal(npy(model.logits.bias), 0)
    # Each layer has its own seed: no two share their values.
    firsts = {name: tuple(w.ravel()[:8]) for name, w in values.items()}
    assert len(set(firsts.values())) == len(firsts)
    # The same seed gives the same decoder.
    again = build_model(V, small_cfg(embedding_size=64, lstm_units=64, init_scale=0.05), SIZE).build_all()
    np.testing.assert_array_equal(npy(again.logits.kernel), values["logits"])


def test_encoder_loads_a_local_weights_file(tmp_path):
    source = build_encoder(small_cfg(), SIZE, pooled=True).model
    backbone = source.get_layer("small_cnn")
    rng = np.random.default_rng(4)
    for layer in backbone.layers:  # non-default batch-norm statistics must travel too
        if isinstance(layer, keras.layers.BatchNormalization):
            layer.moving_mean.assign(rng.normal(size=layer.moving_mean.shape).astype("float32"))
            layer.moving_variance.assign(rng.uniform(0.5, 2.0, size=layer.moving_variance.shape).astype("float32"))
    path = str(tmp_path / "w.weights.h5")
    backbone.save_weights(path)

    images, _ = inputs(seed=5)
    loaded = build_encoder(small_cfg(encoder_weights=path), SIZE, pooled=True).model
    fresh = build_encoder(small_cfg(), SIZE, pooled=True).model
    for a, b in zip(source.weights, loaded.weights):
        np.testing.assert_array_equal(npy(a), npy(b))
    np.testing.assert_array_equal(npy(loaded(images)), npy(source(images)))
    assert not np.allclose(npy(fresh(images)), npy(source(images)))
    assert not loaded.trainable_variables  # still frozen

    for weights in (str(tmp_path / "missing.weights.h5"), str(tmp_path)):
        with pytest.raises(InputError, match="encoder_weights"):
            build_encoder(small_cfg(encoder_weights=weights), SIZE)
    with pytest.raises(InputError, match="imagenet"):
        build_encoder(small_cfg(encoder_weights="imagenet"), SIZE)


def test_checkpoint_paths_stay_those_trained_models_have(tmp_path):
    """Variable paths in a checkpoint follow attribute names and layer order: moving code around must not
    rename them, or every trained model folder stops loading. tests/data holds the paths a checkpoint of
    this model had when written by an earlier version (small_cnn, trainable, as train saves it)."""
    import os

    expected = open(os.path.join(os.path.dirname(__file__), "data", "show_and_tell_checkpoint_keys.txt")).read().split()
    model = build_model(V, small_cfg(encoder_trainable=True), SIZE).build_all()
    path = tf.train.Checkpoint(model=model).write(str(tmp_path / "ckpt"))
    assert sorted(k for k, _ in tf.train.list_variables(path) if k.startswith("model/")) == sorted(expected)


def test_split_point_minimises_the_steps_computed():
    from captioning.model.base import split_point

    rng = np.random.default_rng(9)
    for _ in range(30):
        steps = int(rng.integers(1, 12))
        lengths = rng.integers(1, steps + 1, int(rng.integers(1, 9)))
        cost = {cut: len(lengths) * cut + int((lengths > cut).sum()) * (steps - cut) for cut in range(1, steps + 1)}
        best = min(cost.values())
        assert int(split_point(tf.constant(lengths), steps)) == min(c for c, v in cost.items() if v == best)
