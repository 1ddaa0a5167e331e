"""The encoder contract: what every registered encoder of ``captioning.model.encoders.ENCODERS`` must do, under
every registered decoder: its declarations (:func:`check_encoder_declarations`), and built, its token set, the
decoder's pass over it and its variables (:func:`check_pair`). :func:`run_encoder_test` runs both over one encoder
and every decoder, so that an encoder's own test is a few lines; tests/test_encoders.py runs them over every entry."""

import dataclasses
import weakref

import numpy as np
import pytest
import tensorflow as tf

from captioning.config import ModelConfig
from captioning.config.settings import describe_range, keys_of
from captioning.errors import InputError
from captioning.model import DECODERS, build_encoder
from captioning.model.encoders import ENCODERS
from tests.harness.models import npy, tiny_options
from tests.harness.presets import entry_config

V, B, T = 30, 2, 5
_BUILT = {}
_TOKENS = weakref.WeakKeyDictionary()  # a built encoder → {seed: its token set of probe(encoder, seed)'s images}


def encoder_of(entry, presets, pooled):
    """One built encoder per entry and mode for the whole session (building is the expensive part)."""
    key = (entry, pooled)
    if key not in _BUILT:
        cfg, size = entry_config(entry, presets)
        _BUILT[key] = build_encoder(cfg, size, pooled=pooled)
    return _BUILT[key]


def probe(encoder, seed=0):
    """``B`` random images at ``encoder``'s size, drawn from ``seed``, and its token set of them, computed once
    per encoder and seed: every decoder :func:`check_pair` runs over one built encoder reads the same tokens (an
    ImageNet CNN's forward pass is the expensive part; the encoder does not change in a check)."""
    size = encoder.image_size
    images = np.random.default_rng(seed).integers(0, 256, (B, size, size, 3), dtype=np.uint8)
    seen = _TOKENS.setdefault(encoder, {})
    if seed not in seen:
        seen[seed] = npy(encoder.tokens_model()(images))
    return images, seen[seed]


def check_encoder_declarations(name):
    """Encoder ``name`` declares what the rest of the code asks: ranged settings, its tiny settings and image size,
    whether it can train; its keys collide with no decoder's and no shared model key."""
    cls = ENCODERS[name]
    assert dataclasses.is_dataclass(cls.settings_class) and cls.name == name
    fields = {f.name: f for f in dataclasses.fields(cls.settings_class)}
    for f in fields.values():
        if f.type in (int, float, "int", "float"):
            assert "range" in f.metadata, f"model.{f.name} declares no range"
            describe_range(f.metadata["range"])
    assert set(cls.incompatible_keys) | set(cls.tiny_settings) | set(cls.path_keys) <= set(fields)
    assert isinstance(cls.can_train, bool) and 16 <= cls.tiny_image_size <= 96
    # its keys share the model section with the decoders' and the shared ones: none may collide
    # (a decoder that reads images with this encoder as its own, ``own_encoder``, may share a key with it — vlm's
    # vlm_preset: one preset for both — with the same default)
    decoders = {f.name for d in DECODERS.values() if d.own_encoder != name for f in dataclasses.fields(d.settings_class)}
    assert not set(fields) & (decoders | set(keys_of(ModelConfig)))
    for decoder in (d for d in DECODERS.values() if d.own_encoder == name):
        for f in dataclasses.fields(decoder.settings_class):
            assert f.name not in fields or f.default == fields[f.name].default, f.name


def check_pair(entry, decoder, encoder, seed=0):
    """The contract of ``encoder`` (built) under ``decoder`` (a registered name): its token set and layout, the
    features the decoder reads, stepping against teacher forcing over them, attention weights summing to 1, its
    variables apart from the decoder's and frozen unless trainable. Returns the model."""
    cls = DECODERS[decoder]
    tiny = tiny_options(decoder)  # its tiny settings (and the tiny LM preset of a decoder that reads one)
    cfg = dataclasses.replace(encoder.cfg, decoder=decoder, options={**encoder.cfg.options, **tiny})
    if cls.own_encoder and cls.own_encoder != encoder.name:  # a decoder that reads images with its own encoder only
        with pytest.raises(InputError, match=f"set model.encoder: {cls.own_encoder}") as refused:
            cls(V, cfg, encoder, seed=seed, settings=cls.settings_class(**tiny))
        assert "\n" not in str(refused.value)
        return None
    model = cls(V, cfg, encoder, seed=seed, settings=cls.settings_class(**tiny)).build_all()
    images, tokens = probe(encoder, seed)
    ids = np.random.default_rng(seed).integers(4, V, (B, T), dtype=np.int64)
    ids[:, 0] = 1
    # what it gives: one vector an image, or its token set, whose layout (if declared) accounts for every token
    assert tokens.shape == (B, encoder.tokens, encoder.width), entry
    if encoder.layout is not None:
        assert encoder.layout.tokens == encoder.tokens, f"{entry} declares {encoder.layout} for {encoder.tokens}"
    encoded = model.encode(images)  # once: the encoder's forward pass is the expensive part of an ImageNet CNN
    features = npy(encoded)
    assert features.shape == ((B, encoder.depth) if cls.features == "pooled" else (B, encoder.tokens, encoder.width))
    if cls.features != "pooled":
        np.testing.assert_allclose(features, tokens, atol=1e-5)  # the decoder reads the token set itself
    assert model.token_layout == encoder.layout and model.grid_cells == encoder.tokens
    # the decoder steps over it as it teacher-forces (from the features: what images give, one pass fewer)
    full = npy(model({"features": encoded, "input_ids": ids}))
    state = model.reserve(model.initial_state(encoded), T)
    stepped = []
    for t in range(T):
        logits, state = model.step(tf.constant(ids[:, t]), state)
        stepped.append(npy(logits))
    np.testing.assert_allclose(np.stack(stepped, 1), full, atol=1e-4, rtol=0, err_msg=entry)
    if cls.attends:  # a weight for every token, summing to 1
        weights = npy(state["attention"])
        assert weights.shape == (B, encoder.tokens)
        np.testing.assert_allclose(weights.sum(-1), 1.0, atol=1e-5)
    # its variables apart from the decoder's; frozen unless trainable
    encoder_ids = {id(v) for v in model.encoder.weights}
    assert encoder_ids and not encoder_ids & {id(v) for v in model.decoder_variables()}
    if not encoder.trainable:
        assert not encoder_ids & {id(v) for v in model.trainable_variables}
    return model


def run_encoder_test(entry, presets=None):
    """The contract over encoder ``entry`` (a registered name, or ``keras_hub:FAMILY`` with ``presets``, the
    ``hub_presets`` fixture): its declarations, then :func:`check_pair` under every registered decoder, the
    encoder built with its tiny settings at its tiny image size, pooled for a decoder that reads pooled features.
    Returns ``{decoder: (encoder, model)}`` for the encoder's own further checks."""
    name = entry.partition(":")[0]
    check_encoder_declarations(name)
    checked = {}
    for decoder in sorted(DECODERS):
        cfg, size = entry_config(entry, presets, decoder)
        encoder = build_encoder(cfg, size, pooled=DECODERS[decoder].features == "pooled")
        checked[decoder] = encoder, check_pair(entry, decoder, encoder)
    return checked
