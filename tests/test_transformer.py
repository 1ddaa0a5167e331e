"""The Transformer decoder's own promises (the decoder contract, tests/test_decoders.py, covers the rest):
its parameter count, both normalisations and both kinds of positions stepping as they teacher-force, the
cross-attention layer it shows, a cache that never recomputes the prefix, and its settings' checks."""

import os

import numpy as np
import pytest
import tensorflow as tf

from captioning.config import ModelConfig
from captioning.errors import InputError
from captioning.model import build_model, typed_model
from tests.harness.decoder_contract import check_stepping

V, SIZE = 40, 32


def transformer(seed=0, build=True, **options):
    """The tiny Transformer, its variables created unless ``build`` is false (what its constructor decides only)."""
    settings = {"d_model": 16, "heads": 2, "ff_size": 24, "encoder_layers": 1, "decoder_layers": 2, **options}
    cfg = ModelConfig(decoder="transformer", encoder="small_cnn", encoder_trainable=True, dropout=0.0, options=settings)
    model = build_model(V, cfg, SIZE, seed=seed)
    return model.build_all() if build else model


def inputs(seed=0, batch=3, steps=6):
    rng = np.random.default_rng(seed)
    ids = rng.integers(4, V, (batch, steps), dtype=np.int64)
    ids[:, 0] = 1
    return rng.integers(0, 256, (batch, SIZE, SIZE, 3), dtype=np.uint8), ids


def size(variables):
    return sum(int(np.prod(v.shape)) for v in variables)


@pytest.fixture(scope="module")
def default():
    """:func:`transformer` at its defaults (norm: pre, positions: sinusoidal), built once for the tests that only
    read it (its weights are never changed)."""
    return transformer()


def test_the_parameter_count_is_the_docstrings(default):
    d, f, D, G = 16, 24, 128, 4  # small_cnn at 32 px: a 2 x 2 grid of 128 features
    for norm, positions in (("pre", "sinusoidal"), ("post", "learned")):
        model = default if (norm, positions) == ("pre", "sinusoidal") else transformer(norm=norm, positions=positions)
        attention, ff = 4 * (d * d + d), 2 * d * f + f + d
        expected = (D * d + d + G * d  # the features' projection, the cells' positions
                    + 1 * (attention + ff + 2 * 2 * d)  # one encoder layer: 2 layer norms
                    + 2 * (2 * attention + ff + 3 * 2 * d)  # two decoder layers: 3 layer norms
                    + V * d + d * V + V  # words, output
                    + (64 * d if positions == "learned" else 0)
                    + (2 * 2 * d if norm == "pre" else 0))  # the final encoder and decoder norms
        assert size(model.decoder_variables()) == expected, (norm, positions)


@pytest.mark.parametrize("norm, positions", [("post", "learned"), ("pre", "learned"), ("post", "sinusoidal")])
def test_every_variant_steps_as_it_teacher_forces(norm, positions):
    """The contract's stepping check (from a teacher-forced first piece too, and over cached features) under each
    normalisation and kind of positions, on its tiny settings (those of :func:`transformer`)."""
    check_stepping("transformer", norm=norm, positions=positions)


def test_the_cross_attention_shown_is_the_chosen_layers_heads_averaged():
    """attention_layer k shows layer k's cross-attention (0: the last), averaged over the heads: by hand,
    that layer's query of the word over the memory's keys."""
    assert [transformer(build=False, decoder_layers=3, attention_layer=k).shown for k in (1, 2, 3, 0)] == [0, 1, 2, 2]
    model = transformer(seed=3, decoder_layers=2)
    images, ids = inputs(seed=2)
    shown = {}
    for layer in (0, 1):
        model.shown = layer
        state = model.reserve(model.initial_state(model.encode(images)), 2)
        _, after = model.step(tf.constant(ids[:, 0]), state)
        shown[layer] = after["attention"].numpy()
        np.testing.assert_allclose(shown[layer].sum(-1), 1.0, atol=1e-5)
    assert not np.allclose(shown[0], shown[1])  # each layer looks its own way
    # layer 0 by hand: its input is the word's embedding through the self-attention block
    x = model._embed(tf.constant(ids[:, :1]), state["t"], training=False)
    block, attention = model.self_block_0, model.self_attention_0
    inner = block.inner(x)
    keys, values = attention.project(inner)
    update, _ = attention.attend(inner, keys, values, tf.ones([3, 1, 1]))
    x = block.outer(x, update, training=False)
    _, weights = model.cross_attention_0.attend(model.cross_block_0.inner(x), state["mk0"], state["mv0"],
                                                tf.ones([3, 1, 4]))
    np.testing.assert_allclose(tf.reduce_mean(weights, axis=1)[:, 0].numpy(), shown[0], atol=1e-6)


def test_a_step_costs_one_word_not_the_prefix(default):
    """After reserve, the cache has its final size: a step writes one word's keys and values into it,
    the shapes never grow, and the words before are not computed again (their keys stay as they were)."""
    model = default
    images, ids = inputs(seed=4, steps=5)
    state = model.reserve(model.initial_state(model.encode(images)), 5)
    shapes = {k: tuple(v.shape) for k, v in state.items()}
    history = []
    for t in range(5):
        _, state = model.step(tf.constant(ids[:, t]), state)
        assert {k: tuple(v.shape) for k, v in state.items()} == shapes
        history.append(state["k0"].numpy())
        assert np.abs(history[-1][:, t]).max() > 0 and not history[-1][:, t + 1:].any()
    for t in range(1, 5):  # slot t-1 was written once, at step t-1, and never touched again
        np.testing.assert_array_equal(history[t][:, :t], history[t - 1][:, :t])


def test_the_caches_promises_hold_or_it_refuses(default):
    """teacher_forced on a state reserve sized already writes its words where step reads them (the contract test
    checks the logits); a step with no reserved slot left is an error, not a word left out of the cache."""
    model = default
    images, ids = inputs(seed=4, steps=5)
    state = model.reserve(model.initial_state(model.encode(images)), 5)
    _, after = model.teacher_forced(state, tf.constant(ids[:, :2]))
    _, stepped = model.step(tf.constant(ids[:, 0]), state)
    _, stepped = model.step(tf.constant(ids[:, 1]), stepped)
    assert after["t"].numpy().tolist() == [2, 2, 2]
    np.testing.assert_allclose(after["k1"].numpy()[:, :5], stepped["k1"].numpy(), atol=1e-5)  # slots 0, 1; zeros
    assert not after["k1"].numpy()[:, 2:].any()  # room for the words to come
    state = model.reserve(model.initial_state(model.encode(images)), 2)
    for t in range(2):
        _, state = model.step(tf.constant(ids[:, t]), state)
    with pytest.raises(tf.errors.InvalidArgumentError, match="no room left in the cache"):
        model.step(tf.constant(ids[:, 2]), state)


def test_a_caption_longer_than_the_positions_is_refused_before_decoding_or_training(tmp_path):
    """Words past model.max_positions would all read the last position: decode.max_length and scst.max_length
    are checked against the decoder's max_caption_length (the base class: no bound) in one line."""
    from captioning.config import Config, DataConfig, DecodeConfig, TrainConfig
    from captioning.inference import Captioner
    from captioning.model import DECODERS, check_caption_length
    from captioning.model.folder import TrainedModel
    from captioning.experiment import for_training
    from captioning.train import Trainer
    from captioning.train.objectives.scst import ScstSettings
    from captioning.vocab import RESERVED, Vocabulary

    short = ModelConfig(decoder="transformer", options={"max_positions": 12})
    assert DECODERS["transformer"].max_caption_length(typed_model(short).decoder_settings) == 12
    assert {name: cls.max_caption_length(typed_model(ModelConfig(decoder=name)).decoder_settings) for name, cls in DECODERS.items()
            if name != "transformer"} == {"attention": None, "show_and_tell": None, "updown": None,
                                          "prefix_lm": None, "vlm": None}  # (prefix_lm, no preset named: unknown)
    check_caption_length(short, "decode.max_length", 12)
    message = ("decode.max_length is 13, but model.decoder transformer decodes captions of at most 12 words "
               "(model.max_positions): use at most 12")
    with pytest.raises(InputError) as info:
        check_caption_length(short, "decode.max_length", 13)
    assert str(info.value) == message
    model = transformer(max_positions=12)
    trained = TrainedModel(model, Config(model=model.cfg), Vocabulary(list(RESERVED) + [f"w{i}" for i in range(V - 4)]),
                           step=0, checkpoint="(untrained)", model_dir="")
    assert Captioner(trained, DecodeConfig(max_length=12)).settings.max_length == 12
    with pytest.raises(InputError, match=r"^decode.max_length \(--max-length\) is 20, but .* at most 12 words"):
        Captioner(trained, DecodeConfig(max_length=20))
    scst = {"scst": ScstSettings(max_length=13), "train": TrainConfig(objective="scst")}
    for changes, key in (({"decode": DecodeConfig(max_length=20)}, "decode.max_length"), (scst, "scst.max_length")):
        changes = {"decode": DecodeConfig(max_length=12), **changes}
        cfg = Config(data=DataConfig(dir=str(tmp_path / "none")), model=short, **changes)
        with pytest.raises(InputError, match=rf"^{key} is \d+, but model.decoder transformer"):
            Trainer(for_training(cfg), str(tmp_path / "m"))  # before the data is read: there is none
    assert not os.path.exists(tmp_path / "m")


@pytest.mark.parametrize("options, message", [
    ({"d_model": 10, "heads": 3}, "model.d_model (10) must be a multiple of model.heads (3)"),
    ({"attention_layer": 3}, "model.attention_layer (3) names no layer: there are model.decoder_layers=2 (0: the last)"),
    ({"norm": "middle"}, "config key model.norm must be one of pre, post, got 'middle'"),
])
def test_settings_that_cannot_work_are_one_line(options, message):
    cfg = ModelConfig(decoder="transformer", options={"decoder_layers": 2, **options})
    with pytest.raises(InputError) as info:
        typed_model(cfg)
    assert str(info.value) == message


@pytest.mark.slow
def test_self_critical_training_samples_through_the_cache(prepared_dir, tmp_path):
    """SCST draws its samples by stepping: through the Transformer's cache, under the training loop."""
    from captioning.experiment import for_training
    from captioning.train import Trainer
    from captioning.train.objectives.scst import ScstSettings
    from tests.helpers import small_train_config

    cfg = small_train_config(prepared_dir, "model.decoder=transformer", "model.d_model=16", "model.heads=2",
                             "model.ff_size=24", "model.encoder_layers=0", "model.decoder_layers=1",
                             "train.objective=scst", "scst.samples=3", "scst.max_length=20", "train.optimizer=adam",
                             "train.learning_rate=0.001", "train.batch_size=10", "train.steps=3")
    result = Trainer(for_training(cfg), str(tmp_path / "m")).run(progress=False)
    assert result.step == 3 and np.isfinite(result.losses).all()


@pytest.mark.slow
def test_cached_grid_features_and_init_from_carry_a_transformer(prepared_dir, tmp_path):
    """data.cache: features keeps the encoder's grid on disk (the Transformer's encoder layers run on it);
    --init-from starts another folder from the trained weights; a changed width is refused."""
    from captioning.errors import InputError
    from captioning.experiment import for_training
    from captioning.train import Trainer
    from captioning.train.objectives.scst import ScstSettings
    from tests.helpers import small_train_config

    sizes = ["model.decoder=transformer", "model.d_model=16", "model.heads=2", "model.ff_size=24",
             "model.encoder_layers=1", "model.decoder_layers=1", "train.optimizer=adam", "train.learning_rate=0.003"]
    frozen = ["model.encoder_trainable=false", "data.random_crop=false", "data.random_flip=false"]
    first = Trainer(for_training(small_train_config(prepared_dir, *sizes, *frozen, "data.cache=features", "train.steps=6")),
                    str(tmp_path / "first"))
    assert first.run(progress=False).step == 6
    assert any(name.startswith("features-train-") for name in os.listdir(tmp_path / "first" / "cache"))
    second = Trainer(for_training(small_train_config(prepared_dir, *sizes, "train.steps=2")), str(tmp_path / "second"),
                     init_from=str(tmp_path / "first"))
    for a, b in zip(first.model.decoder_variables(), second.model.decoder_variables()):
        np.testing.assert_array_equal(a.numpy(), b.numpy())
    with pytest.raises(InputError, match="holds a model with other model.d_model"):
        Trainer(for_training(small_train_config(prepared_dir, *sizes, "model.d_model=32", "train.steps=2")), str(tmp_path / "third"),
                init_from=str(tmp_path / "first"))
