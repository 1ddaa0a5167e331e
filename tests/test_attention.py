"""The soft-attention decoder (Show, Attend and Tell): exact sizes, attention weights, step-by-step
decoding against teacher forcing, the doubly stochastic penalty, split padding and beam search keeping
each word's weights; Up-Down's wiring of its two LSTMs. No data needed: random uint8 images."""

import numpy as np
import pytest
import tensorflow as tf

from captioning.config import ModelConfig
from captioning.model import build_model
from captioning.model.layout import TokenLayout
from captioning.train.objectives import caption_loss_sum
from tests.helpers import model_config

V, B, T, SIZE = 50, 3, 7, 64  # small_cnn at 64 px: a 4 x 4 grid of 128 features
E, U, A = 16, 24, 20


def cfg(**kw):
    values = dict(decoder="attention", encoder="small_cnn", embedding_size=E, lstm_units=U, attention_size=A,
                  dropout=0.0)
    values.update(kw)
    return model_config(**values)


def model_of(seed=0, **kw):
    return build_model(V, cfg(**kw), SIZE, seed=seed).build_all()


def inputs(seed=0, batch=B, steps=T):
    rng = np.random.default_rng(seed)
    return (rng.integers(0, 256, (batch, SIZE, SIZE, 3), dtype=np.uint8),
            rng.integers(4, V, (batch, steps), dtype=np.int64))


def size(variables):
    return sum(int(np.prod(v.shape)) for v in variables)


def npy(x):
    return x.numpy() if hasattr(x, "numpy") else np.asarray(x)


def test_parameter_counts_and_shapes():
    model = model_of()
    assert (model.grid_cells, model.feature_size, model.token_layout) == (16, 128, TokenLayout(4, 4))
    D = 128
    expected = {
        "init_h": D * U + U, "init_c": D * U + U,
        "attention_features": D * A + A, "attention_state": U * A, "attention_score": A + 1, "gate": U + 1,
        "word_embedding": V * E, "lstm": 4 * ((E + D + U) * U + U),
        "output_state": U * E, "output_context": D * E, "logits": E * V + V,
    }
    for name, count in expected.items():
        assert size(getattr(model, name).weights) == count, name
    assert size(model.decoder_variables()) == sum(expected.values()) == 29_604
    assert {id(v) for v in model.trainable_variables} == {id(v) for v in model.decoder_variables()}  # frozen encoder
    images, ids = inputs()
    features = model.encode(images)
    assert tuple(features.shape) == (B, 16, 128)
    state = model.initial_state(features)
    assert set(state) == {"h", "c", "features", "projected", "mask", "attention", "coverage"}
    assert tuple(state["h"].shape) == tuple(state["c"].shape) == (B, U)
    assert tuple(state["projected"].shape) == (B, 16, A)
    logits, state = model.step(tf.constant(ids[:, 0]), state)
    assert tuple(logits.shape) == (B, V) and logits.dtype == "float32"
    assert tuple(state["attention"].shape) == (B, 16)
    assert tuple(model({"image": images, "input_ids": ids}).shape) == (B, T, V)


def test_inception_grid_parameter_counts():
    """Inception v3 at 299 px: 8 x 8 cells of 2,048; with the paper-sized decoder (512 everywhere)."""
    model = build_model(10_000, ModelConfig(decoder="attention", encoder="inception_v3"), 299).build_all()
    assert (model.grid_cells, model.feature_size, model.token_layout) == (64, 2048, TokenLayout(8, 8))
    D, U, E, A, V = 2048, 512, 512, 512, 10_000
    assert size(model.lstm.weights) == 4 * ((E + D + U) * U + U) == 6_293_504
    assert size(model.attention_features.weights) == D * A + A == 1_049_088
    assert size(model.decoder_variables()) == (2 * (D * U + U) + D * A + A + U * A + A + 1 + U + 1 + V * E
                                               + 4 * ((E + D + U) * U + U) + U * E + D * E + E * V + V)


def test_weights_sum_to_one_and_step_by_step_equals_teacher_forcing():
    model = model_of(dropout=0.0)
    images, ids = inputs(seed=1)
    ids[1, 4:] = 0  # a shorter caption, padded
    full = npy(model({"image": images, "input_ids": ids}))
    state = model.initial_state(model.encode(images))
    stepped, weights = [], []
    for t in range(T):
        logits, state = model.step(tf.constant(ids[:, t]), state)
        stepped.append(npy(logits))
        weights.append(npy(state["attention"]))
    weights = np.stack(weights, axis=1)  # [B, T, 16]
    assert (weights >= 0).all()
    np.testing.assert_allclose(weights.sum(-1), 1.0, atol=1e-5)
    assert weights.std(axis=-1).max() > 1e-4  # not uniform: the weights depend on the image and the words
    np.testing.assert_allclose(np.stack(stepped, axis=1), full, atol=1e-5)
    assert np.abs(full).max() > 1e-3
    # the teacher-forced state's coverage: the weights summed over the real words (not <pad>)
    _, final = model.forward(model.encode(images), tf.constant(ids))
    real = (ids != 0)[..., None]
    np.testing.assert_allclose(npy(final["coverage"]), (weights * real).sum(1), atol=1e-5)


def test_penalty_is_the_doubly_stochastic_regulariser():
    """training loss = cross-entropy + λ Σ_i (1 − Σ_t α_ti)² per caption; evaluation leaves it out."""
    model = model_of(attention_l1=0.7)
    images, ids = inputs(seed=2)
    ids[0, 5:] = 0
    mask = (ids != 0).astype(np.float32)
    batch = {"image": images, "input_ids": ids, "target_ids": np.roll(ids, -1, axis=1), "mask": mask}
    state = model.initial_state(model.encode(images))
    coverage = np.zeros((B, 16))
    for t in range(T):
        _, state = model.step(tf.constant(ids[:, t]), state)
        coverage += npy(state["attention"]) * mask[:, t:t + 1]
    expected = 0.7 * ((1.0 - coverage) ** 2).sum()
    plain = float(caption_loss_sum(model, batch))
    with_penalty = float(caption_loss_sum(model, batch, penalty=True))
    assert with_penalty - plain == pytest.approx(expected, rel=1e-4) and expected > 1.0
    off = model_of(attention_l1=0.0)
    assert float(caption_loss_sum(off, batch, penalty=True)) == pytest.approx(float(caption_loss_sum(off, batch)))




def test_up_down_wires_its_two_lstms_as_the_paper_does():
    """Up-Down (Anderson et al. 2018, eq. 2-7): the attention LSTM reads [h² of the last step ; the mean
    feature v̄ ; the word], the language LSTM [the attended feature v̂ ; h¹]. Checked by hand from a state
    whose LSTMs are not at zero, and by perturbing one input at a time: h² and v̄ change h¹; the features
    attended over (their scores' projection held) change h² but not h¹."""
    from tests.harness.models import inputs as small_inputs
    from tests.harness.models import tiny

    model = tiny("updown", seed=1)  # small_cnn at 32 px: a 2 x 2 grid
    images, ids = small_inputs(seed=6)
    features = model.encode(images)
    state = model.initial_state(features)
    np.testing.assert_allclose(npy(state["mean"]), npy(tf.reduce_mean(model.feature_embedding(features), 1)),
                               atol=1e-6)  # v̄: the mean of the embedded features
    rng = np.random.default_rng(0)
    units = model.settings.lstm_units
    state = {**state, **{k: tf.constant(rng.normal(0, 0.5, (B, units)), tf.float32) for k in ("h1", "c1", "h2", "c2")}}
    token = tf.constant(ids[:, 0])
    logits, after = model.step(token, state)
    # by hand
    h1, (_, c1) = model.attention_lstm(tf.concat([state["h2"], state["mean"], model.word_embedding(token)], -1),
                                       [state["h1"], state["c1"]])
    scores = model.attention_score(tf.tanh(model.attention_features(state["features"])
                                           + model.attention_state(h1)[:, None]))[..., 0]
    alpha = tf.nn.softmax(scores, axis=-1)
    attended = tf.reduce_sum(alpha[..., None] * state["features"], axis=1)
    h2, (_, c2) = model.language_lstm(tf.concat([attended, h1], -1), [state["h2"], state["c2"]])
    for name, value in (("h1", h1), ("c1", c1), ("attention", alpha), ("h2", h2), ("c2", c2)):
        np.testing.assert_allclose(npy(after[name]), npy(value), atol=1e-5, err_msg=name)
    np.testing.assert_allclose(npy(logits), npy(model.logits(h2)), atol=1e-5)

    def changed(key, value):
        """How much h¹ and h² of the step move when the state's ``key`` is ``value``."""
        _, moved = model.step(token, {**state, key: value})
        return [float(np.abs(npy(moved[h]) - npy(after[h])).max()) for h in ("h1", "h2")]

    for key in ("h2", "mean"):  # into the attention LSTM (and through h¹ into the language LSTM)
        assert min(changed(key, state[key] + 0.5)) > 1e-3, key
    h1_moved, h2_moved = changed("features", state["features"] * 2.0)  # v̂ alone: into the language LSTM only
    assert h1_moved == 0.0 and h2_moved > 1e-3
