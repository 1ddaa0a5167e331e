"""The mapping networks of ``model.decoder: prefix_lm`` (captioning/model/mappers/): an encoder's tokens and mask into
``[B, L, width]``, an empty batch, padding that changes nothing, one seed one mapper, the parameter counts their
docstrings give, the Q-Former running keras-hub's own layers, mixed precision and XLA. Tiny sizes throughout."""

import dataclasses
import random

import keras
import numpy as np
import pytest
import tensorflow as tf

from captioning.errors import InputError
from captioning.model.base import untracked
from captioning.model.mappers import MAPPERS, MLPMapper, QFormerMapper, TransformerMapper
from captioning.model.prefix_lm import PrefixLMSettings

NAMES = ("mlp", "transformer", "qformer")
W, D, N = 8, 6, 5  # the LM's width, the tokens' size, the tokens per image


def Settings(**changes) -> PrefixLMSettings:
    """The decoder's settings, tiny (a mapper reads prefix_length, query_tokens, mapper_layers and mapper_heads)."""
    return dataclasses.replace(PrefixLMSettings(prefix_length=3, query_tokens=4, mapper_layers=2, mapper_heads=2),
                               **changes)


SETTINGS = Settings()
_BUILT = {}


def mapper(name, seed=0, width=W, dim=D, **settings):
    """A built mapper (the ones of the default settings shared by the file)."""
    key = (name, seed, width, dim, tuple(sorted(settings.items())))
    if key not in _BUILT:
        m = MAPPERS[name](Settings(**settings), width, seed=seed)
        m.build((None, None, dim))
        _BUILT[key] = m
    return _BUILT[key]


def tokens(batch=3, count=N, seed=0):
    return np.random.default_rng(seed).normal(size=(batch, count, D)).astype(np.float32)


def npy(x):
    return np.asarray(keras.ops.convert_to_numpy(x), dtype=np.float32)


def test_the_registry_and_each_mappers_output():
    assert set(MAPPERS) == set(NAMES) and all(MAPPERS[k].key == k for k in NAMES)
    assert (MAPPERS["mlp"].output_length(SETTINGS), MAPPERS["transformer"].output_length(SETTINGS),
            MAPPERS["qformer"].output_length(SETTINGS)) == (3, 3, 4)
    x = tokens()
    for name in NAMES:
        out = mapper(name)(x, np.ones(x.shape[:2], np.float32))
        assert tuple(out.shape) == (3, MAPPERS[name].output_length(SETTINGS), W) and out.dtype == "float32", name
        assert np.isfinite(npy(out)).all() and npy(out).std() > 1e-3, name
        assert not np.allclose(npy(out)[0], npy(out)[1], atol=1e-4), name  # each image its own prefix


@pytest.mark.parametrize("name", NAMES)
def test_an_empty_batch_gives_an_empty_prefix(name):
    m = mapper(name)
    length = m.output_length(SETTINGS)
    assert tuple(m(np.zeros((0, N, D), np.float32)).shape) == (0, length, W)
    assert tuple(m(np.zeros((0, N, D), np.float32), np.zeros((0, N), np.float32)).shape) == (0, length, W)


@pytest.mark.parametrize("name", NAMES)
def test_padding_tokens_change_nothing(name):
    """An image's prefix is the same alone and in a batch where it is padded (mask 0) with tokens of any value
    (large ones, NaN) among or after its real tokens; no mask and a mask of ones are the same; the mask is read
    (a real token masked out changes the prefix)."""
    m = mapper(name)
    x = tokens(batch=2)
    ones = np.ones((2, N), np.float32)
    alone = npy(m(x, ones))
    np.testing.assert_array_equal(npy(m(x)), alone)
    padded = np.concatenate([x, np.full((2, 4, D), 1e4, np.float32)], axis=1)
    padded[:, -1] = np.nan
    padded = padded[:, [0, 5, 1, 2, 6, 3, 4, 7, 8]]  # padding among the real tokens and after them
    mask = np.concatenate([ones, np.zeros((2, 4), np.float32)], axis=1)[:, [0, 5, 1, 2, 6, 3, 4, 7, 8]]
    np.testing.assert_allclose(npy(m(padded, mask)), alone, atol=1e-5)
    np.testing.assert_allclose(npy(m(padded, mask.astype(bool))), alone, atol=1e-5)
    # images of different numbers of real tokens in one batch: the second keeps only its first 3
    ragged = np.array([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]], np.float32)
    together = npy(m(x, ragged))
    np.testing.assert_allclose(together[0], alone[0], atol=1e-5)
    np.testing.assert_allclose(together[1], npy(m(x[1:, :3]))[0], atol=1e-5)
    assert not np.allclose(together[1], alone[1], atol=1e-3)


def weights(m):
    return {v.path: npy(v) for v in m.weights}


def test_one_seed_gives_one_mapper_and_each_projection_its_own_start():
    state = random.getstate()
    for name in NAMES:
        a, b, c = mapper(name, seed=0), MAPPERS[name](SETTINGS, W, seed=0), mapper(name, seed=1)
        b.build((None, None, D))
        wa, wb, wc = weights(a), weights(b), weights(c)
        assert len(wa) > 3 and wa.keys() == wb.keys() == wc.keys(), name
        for path in wa:
            np.testing.assert_array_equal(wa[path], wb[path], err_msg=path)
        starts = [v for p, v in wa.items() if v.std() > 0]  # every drawn start differs between seeds and between
        assert all(not np.array_equal(wa[p], wc[p]) for p in wa if wa[p].std() > 0), name  # its projections
        flat = [tuple(v.ravel()[:4]) for v in starts]
        assert len(set(flat)) == len(flat), name
        np.testing.assert_array_equal(npy(a(tokens())), npy(b(tokens())))
    assert random.getstate() == state  # Python's random left as it was


def test_the_parameter_counts_are_the_docstrings():
    # by hand, for k = 3, Q = 4, w = 8, D = 6, two layers (h = 12 for the MLP; 4 * 8 = 32 for the Q-Former's i)
    assert MLPMapper.parameter_count(SETTINGS, W, D) == 6 * 12 + 12 + 12 * 24 + 24 == 396
    assert TransformerMapper.parameter_count(SETTINGS, W, D) == 6 * 8 + 8 + 3 * 8 + 2 * (8 * 64 + 11 * 8) == 1280
    assert QFormerMapper.parameter_count(SETTINGS, W, D) == (4 * 8 + 2 * 8 + 2 * (4 * 64 + 2 * 8 * 32 + 9 * 8 + 32)
                                                             + 1 * (2 * 64 + 2 * 6 * 8 + 6 * 8) + 8 * 8 + 8) == 2136
    # ClipCap's MLP for CLIP ViT-B/32 (512) into GPT-2 (768) with k = 10: its ~32M trainable parameters
    assert MLPMapper.parameter_count(Settings(prefix_length=10), 768, 512) == 31_468_800
    assert QFormerMapper.attention_width(SETTINGS, 2560) == 768 and QFormerMapper.attention_width(SETTINGS, W) == W
    cases = [(W, D, dict()), (12, 10, dict(mapper_layers=1, prefix_length=2)),
             (12, 10, dict(mapper_layers=3, query_tokens=2, mapper_heads=4))]  # 2 and 3 layers: 1 and 2 crossing
    for name in NAMES:
        for width, dim, settings in cases:
            m = mapper(name, width=width, dim=dim, **settings)
            counted = sum(int(np.prod(v.shape)) for v in m.trainable_weights)
            assert counted == m.count_params() == MAPPERS[name].parameter_count(Settings(**settings), width, dim), \
                (name, settings, width, dim)
    assert mapper("qformer").qformer.hidden_dim == W  # a width under 768 is the Q-Former's own


def test_every_trainable_weight_reaches_the_prefix():
    x = tokens()
    for name in NAMES:
        m = mapper(name)
        with tf.GradientTape() as tape:
            out = m(x, np.ones(x.shape[:2], np.float32))
            loss = tf.reduce_sum(out * tf.constant(np.random.default_rng(1).normal(size=out.shape), out.dtype))
        grads = tape.gradient(loss, m.trainable_weights)
        dead = [v.path for v, g in zip(m.trainable_weights, grads) if g is None or not np.any(npy(g))]
        assert dead == [], name


def test_the_qformer_runs_keras_hubs_layers_and_its_queries_differ():
    """Without a mask the mapper's loop equals keras-hub's BLIP2QFormer's own call; its queries start from BLIP-2's
    normal(0, 0.02) (keras-hub's are zeros, which would make every prefix vector the same)."""
    m = mapper("qformer")
    x = tokens()
    np.testing.assert_allclose(npy(m.run(tf.constant(x))), npy(m.qformer(x)), atol=1e-6)
    queries = npy(m.qformer.query_tokens)
    assert queries.shape == (1, 4, W) and 0.005 < queries.std() < 0.05
    out = npy(m(x))
    assert not np.allclose(out[:, 0], out[:, 1], atol=1e-4)
    assert [layer.has_cross_attention for layer in mapper("qformer", mapper_layers=3).qformer.transformer_layers] == \
        [True, False, True]  # BLIP-2's every other layer


def test_mixed_precision_computes_in_bfloat16_with_float32_variables():
    """Constructed under mixed_bfloat16 and built after the policy is back to float32 (the model's policy applies
    while it is constructed): the prefix comes in bfloat16, close to the float32 mapper of the same seed."""
    x = tokens()
    mask = np.array([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0], [1, 0, 1, 1, 1]], np.float32)
    for name in NAMES:
        keras.mixed_precision.set_global_policy("mixed_bfloat16")
        try:
            m = MAPPERS[name](SETTINGS, W, seed=0)
        finally:
            keras.mixed_precision.set_global_policy("float32")
        out = m(x, mask)
        assert out.dtype == "bfloat16" and all(v.dtype == "float32" for v in m.weights), name
        # every layer computes in bfloat16 (keras-hub's functional BLIP2QFormer and its input aside: the mapper runs
        # its layers)
        computing = [(layer.name, layer.compute_dtype) for layer in m._flatten_layers()
                     if not isinstance(layer, (keras.Model, keras.layers.InputLayer))]
        assert len(computing) > 2 and {dtype for _, dtype in computing} == {"bfloat16"}, (name, computing)
        reference = npy(mapper(name)(x, mask))
        np.testing.assert_allclose(npy(out), reference, atol=0.1 * np.abs(reference).max(), err_msg=name)


def test_built_and_run_under_xla_the_prefix_is_the_eager_one():
    """A mapper built by its first call inside an XLA-compiled function (its weights made while the call is traced)
    has the weights of the one built eagerly with its seed, and gives its prefix; an empty batch too."""
    x = tokens()
    mask = np.array([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0], [1, 0, 1, 1, 1]], np.float32)
    for name in NAMES:
        m = MAPPERS[name](SETTINGS, W, seed=0)
        compiled = tf.function(lambda t, k: m(t, k), jit_compile=True, input_signature=[
            tf.TensorSpec([None, None, D], tf.float32), tf.TensorSpec([None, None], tf.float32)])
        eager = mapper(name)
        np.testing.assert_allclose(npy(compiled(x, mask)), npy(eager(x, mask)), atol=1e-5, err_msg=name)
        assert tuple(compiled(x[:0], mask[:0]).shape) == (0, m.output_length(SETTINGS), W)
        assert weights(m).keys() == weights(eager).keys()


def test_a_checkpoint_round_trips_every_weight(tmp_path):
    """tf.train.Checkpoint (the model folder's) finds every weight, keras-hub's Q-Former layers included: a mapper
    of another seed restored from it gives the same prefix."""
    x = tokens()
    for name in NAMES:
        saved, other = mapper(name), MAPPERS[name](SETTINGS, W, seed=1)
        other.build((None, None, D))
        assert untracked(saved) == [], name
        path = tf.train.Checkpoint(mapper=saved).write(str(tmp_path / name))
        tf.train.Checkpoint(mapper=other).read(path).assert_consumed()
        np.testing.assert_array_equal(npy(other(x)), npy(saved(x)))


def test_settings_a_mapper_cannot_use_are_refused_in_one_line():
    with pytest.raises(InputError, match=r"model.mapper_heads \(3\) must divide the language model's width \(8\)"):
        TransformerMapper(Settings(mapper_heads=3), W)
    with pytest.raises(InputError, match=r"model.mapper_heads \(5\) must divide the qformer mapper's width \(768\)"):
        QFormerMapper(Settings(mapper_heads=5), 1280)
    for cls in (TransformerMapper, QFormerMapper):
        with pytest.raises(InputError, match="model.mapper_layers must be >= 1"):
            cls(Settings(mapper_layers=0), W)
    assert tuple(MLPMapper(Settings(mapper_layers=0, mapper_heads=3), W)(tokens()).shape) == (3, 3, W)
