"""The Show-and-Tell model: exact sizes, shapes, step-by-step decoding, frozen encoders, init, mixed
precision, local encoder weights and checkpoints. No data needed: random uint8 images."""

import keras
import numpy as np
import pytest
import tensorflow as tf

from captioning.config import ModelConfig
from captioning.errors import InputError
from captioning.model import ShowAndTell, build_encoder
from tests.conftest import model_config

V, B, T, SIZE = 50, 3, 7, 32


def small_cfg(**kw):
    values = dict(encoder="small_cnn", embedding_size=16, lstm_units=24, dropout=0.0)
    values.update(kw)
    return model_config(**values)


def small_model(seed=0, **kw):
    return ShowAndTell(vocab_size=V, cfg=small_cfg(**kw), image_size=SIZE, seed=seed).build_all()


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
    return ShowAndTell(vocab_size=11520, cfg=ModelConfig(encoder="inception_v3", encoder_weights="none"),
                       image_size=299).build_all()


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


def test_step_by_step_equals_full_forward_pass():
    model = small_model()
    images, ids = inputs(seed=1)
    full = npy(model({"image": images, "input_ids": ids}))
    state = model.initial_state(model.encode(images))
    stepped = []
    for t in range(T):
        logits, state = model.step(tf.constant(ids[:, t]), state)
        stepped.append(npy(logits))
    stepped = np.stack(stepped, axis=1)
    assert stepped.shape == full.shape == (B, T, V)
    np.testing.assert_allclose(stepped, full, atol=1e-5, rtol=0)
    assert np.abs(full).max() > 1e-3  # not trivially equal


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
    model = ShowAndTell(vocab_size=V, cfg=small_cfg(embedding_size=64, lstm_units=64, init_scale=0.05),
                        image_size=SIZE).build_all()
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
    again = ShowAndTell(vocab_size=V, cfg=small_cfg(embedding_size=64, lstm_units=64, init_scale=0.05),
                        image_size=SIZE).build_all()
    np.testing.assert_array_equal(npy(again.logits.kernel), values["logits"])


@pytest.fixture
def mixed_bfloat16():
    keras.mixed_precision.set_global_policy("mixed_bfloat16")
    try:
        yield
    finally:
        keras.mixed_precision.set_global_policy("float32")


def test_mixed_precision(mixed_bfloat16):
    model = small_model()
    images, ids = inputs(seed=3)
    logits = model({"image": images, "input_ids": ids})
    assert logits.dtype == "float32" and tuple(logits.shape) == (B, T, V)
    for variable in model.lstm.weights + model.decoder_variables():
        assert variable.dtype == "float32", variable.path
    assert model.lstm.compute_dtype == "bfloat16"
    assert model.logits.compute_dtype == "float32"
    state = model.initial_state(model.encode(images))
    step_logits, _ = model.step(tf.constant(ids[:, 0]), state)
    assert step_logits.dtype == "float32"
    assert np.isfinite(npy(logits)).all()


def test_float32_policy_is_back():
    assert keras.mixed_precision.global_policy().name == "float32"


def test_encoder_loads_a_local_weights_file(tmp_path):
    source = build_encoder(small_cfg(), SIZE)
    backbone = source.get_layer("small_cnn")
    rng = np.random.default_rng(4)
    for layer in backbone.layers:  # non-default batch-norm statistics must travel too
        if isinstance(layer, keras.layers.BatchNormalization):
            layer.moving_mean.assign(rng.normal(size=layer.moving_mean.shape).astype("float32"))
            layer.moving_variance.assign(rng.uniform(0.5, 2.0, size=layer.moving_variance.shape).astype("float32"))
    path = str(tmp_path / "w.weights.h5")
    backbone.save_weights(path)

    images, _ = inputs(seed=5)
    loaded = build_encoder(small_cfg(encoder_weights=path), SIZE)
    fresh = build_encoder(small_cfg(), SIZE)
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


def test_checkpoint_round_trip(tmp_path):
    model = small_model(seed=0)
    images, ids = inputs(seed=6)
    expected = npy(model({"image": images, "input_ids": ids}))
    path = tf.train.Checkpoint(model=model).save(str(tmp_path / "ckpt"))

    other = small_model(seed=1)
    assert not np.allclose(npy(other({"image": images, "input_ids": ids})), expected)
    status = tf.train.Checkpoint(model=other).restore(path)
    status.assert_consumed()
    np.testing.assert_array_equal(npy(other({"image": images, "input_ids": ids})), expected)
    for a, b in zip(model.weights, other.weights):
        np.testing.assert_array_equal(npy(a), npy(b))


def test_an_empty_batch_gives_empty_logits_zero_loss_and_zero_gradients():
    """The last batch of a split that does not divide by the replicas leaves a replica with no example:
    images [0, S, S, 3] and input_ids [0, 0]. Keras' LSTM raises on zero rows or zero steps and TF's
    convolution mis-shapes an empty batch; the model must give [0, 0, V] logits and zero gradients."""
    from captioning.train import caption_loss_sum

    model = small_model(encoder_trainable=True)
    stats = [npy(v).copy() for v in model.non_trainable_variables]
    for rows, steps in ((0, 0), (0, 5)):
        batch = {"image": tf.zeros([rows, SIZE, SIZE, 3], tf.uint8),
                 "input_ids": tf.zeros([rows, steps], tf.int64), "target_ids": tf.zeros([rows, steps], tf.int64),
                 "mask": tf.zeros([rows, steps])}
        assert model({"image": batch["image"], "input_ids": batch["input_ids"]}).shape == (rows, steps, V)
        assert model.encode(batch["image"]).shape == (rows, model.feature_size)
        with tf.GradientTape() as tape:
            loss = caption_loss_sum(model, batch, training=False)
        grads = tape.gradient(loss, model.trainable_variables)
        assert float(loss) == 0.0
        assert all(g is None or not np.any(npy(tf.convert_to_tensor(g))) for g in grads)
    for before, after in zip(stats, model.non_trainable_variables):  # inference mode moved nothing
        np.testing.assert_array_equal(before, npy(after))
    # a real batch is unchanged by the padding logic
    images, ids = inputs()
    full = npy(model({"image": images, "input_ids": ids}))
    np.testing.assert_allclose(npy(model({"image": images[:1], "input_ids": ids[:1]})), full[:1], atol=1e-5)


def test_checkpoint_paths_stay_those_trained_models_have(tmp_path):
    """Variable paths in a checkpoint follow attribute names and layer order: moving code around must not
    rename them, or every trained model folder stops loading. tests/data holds the paths a checkpoint of
    this model had when written by an earlier version (small_cnn, trainable, as train saves it)."""
    import os

    expected = open(os.path.join(os.path.dirname(__file__), "data", "show_and_tell_checkpoint_keys.txt")).read().split()
    model = ShowAndTell(vocab_size=V, cfg=small_cfg(encoder_trainable=True), image_size=SIZE).build_all()
    path = tf.train.Checkpoint(model=model).write(str(tmp_path / "ckpt"))
    assert sorted(k for k, _ in tf.train.list_variables(path) if k.startswith("model/")) == sorted(expected)


def test_grouped_captions_equal_one_copy_of_the_image_per_caption():
    """image_index: 2 images encoded once, features gathered for their 5 captions — the same logits, loss
    and gradients (encoder included) as 5 rows each holding a copy of its image."""
    from captioning.train.objectives import caption_loss_sum

    model = small_model(encoder_trainable=True)
    images, ids = inputs(seed=3, batch=2)
    _, caption_ids = inputs(seed=4, batch=5)
    index = np.array([0, 0, 1, 1, 1], np.int32)
    mask = np.ones((5, T), np.float32)
    mask[1, 4:] = mask[3, 2:] = 0.0
    grouped = {"image": images, "image_index": index, "input_ids": caption_ids,
               "target_ids": np.roll(caption_ids, -1, axis=1), "mask": mask}
    copied = {**{k: v for k, v in grouped.items() if k != "image_index"}, "image": images[index]}

    def loss_and_grads(batch):
        with tf.GradientTape() as tape:
            loss = caption_loss_sum(model, batch, training=False)
        return npy(loss), [npy(tf.convert_to_tensor(g)) for g in tape.gradient(loss, model.trainable_variables)]

    np.testing.assert_allclose(npy(model({k: grouped[k] for k in ("image", "image_index", "input_ids")})),
                               npy(model({k: copied[k] for k in ("image", "input_ids")})), atol=1e-5)
    (a, ga), (b, gb) = loss_and_grads(grouped), loss_and_grads(copied)
    assert a == pytest.approx(b, rel=1e-6) and len(ga) == len(gb) == len(model.trainable_variables)
    for x, y in zip(ga, gb):
        np.testing.assert_allclose(x, y, rtol=1e-4, atol=1e-6)
    empty = {"image": images[:0], "image_index": index[:0], "input_ids": caption_ids[:0]}
    assert model(empty).shape == (0, T, V)  # a replica with no example


def padded_captions(lengths, steps, seed=0):
    """Input ids [len(lengths), steps]: `<start>`, random words, then <pad> after each length."""
    rng = np.random.default_rng(seed)
    ids = rng.integers(4, V, (len(lengths), steps), dtype=np.int64)
    ids[:, 0] = 1
    for row, n in enumerate(lengths):
        ids[row, n:] = 0
    mask = (ids != 0).astype(np.float32)
    return ids, mask


@pytest.mark.parametrize("lengths", [[7, 7, 3, 2, 6], [2, 7, 1, 7, 7, 3], [4, 4, 4], [7], [1, 1, 2], []])
def test_split_padding_gives_the_same_logits_loss_and_gradients(lengths):
    """split_padding: the captions run to the cut, only the longer ones on from their state — the logits
    at real positions, the loss and every gradient equal the one-piece pass (rows in any order, equal
    lengths, one row, an empty batch)."""
    from captioning.model.base import split_point
    from captioning.train.objectives import caption_loss_sum

    model = small_model(encoder_trainable=True)
    images, _ = inputs(seed=7, batch=max(len(lengths), 1))
    images = images[:len(lengths)]
    ids, mask = padded_captions(lengths, T, seed=8)
    batch = {"image": images, "input_ids": ids, "target_ids": np.roll(ids, -1, axis=1), "mask": mask}

    def run(split):
        with tf.GradientTape() as tape:
            loss = caption_loss_sum(model, batch, training=False, split_padding=split)
        logits = npy(model({"image": images, "input_ids": ids}, split_padding=split))
        return logits, npy(loss), [npy(tf.convert_to_tensor(g)) for g in tape.gradient(loss, model.trainable_variables)]

    (whole, a, ga), (split, b, gb) = run(False), run(True)
    assert split.shape == whole.shape == (len(lengths), T, V)
    real = mask.astype(bool)
    np.testing.assert_allclose(split[real], whole[real], atol=1e-5)
    if len(lengths):
        cut = int(split_point(tf.constant(lengths), T))
        longer = mask[:, cut:].any(axis=1)
        assert not split[~longer][:, cut:].any()  # finished captions' later steps: zeros, never computed
    assert b == pytest.approx(a, rel=1e-5, abs=1e-6)
    for x, y in zip(ga, gb):
        np.testing.assert_allclose(y, x, rtol=1e-4, atol=1e-6)


def test_split_point_minimises_the_steps_computed():
    from captioning.model.base import split_point

    rng = np.random.default_rng(9)
    for _ in range(30):
        steps = int(rng.integers(1, 12))
        lengths = rng.integers(1, steps + 1, int(rng.integers(1, 9)))
        cost = {cut: len(lengths) * cut + int((lengths > cut).sum()) * (steps - cut) for cut in range(1, steps + 1)}
        best = min(cost.values())
        assert int(split_point(tf.constant(lengths), steps)) == min(c for c, v in cost.items() if v == best)
