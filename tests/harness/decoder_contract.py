"""The decoder contract: what every registered decoder must do, one ``check_...`` function a promise, each over
one decoder of ``captioning.model.DECODERS`` built with its ``tiny_settings`` (and ``settings``: the contract under
other values of the decoder's own settings) on ``small_cnn`` at 32 px (tests/harness/models.py).

tests/test_decoders.py runs each check over every registered decoder (and any registered with ``--decoder
FILE:NAME``), one test a check; :func:`run_decoder_test` runs every quick one over one decoder, so that a decoder's
own test is a line."""

import dataclasses
import functools
import os
import types

import keras
import numpy as np
import pytest
import tensorflow as tf

from captioning.config import ModelConfig
from captioning.config.settings import describe_range
from captioning.model import DECODERS, architecture_diff, resolve
from captioning.model.layout import TokenLayout
from tests.harness.models import (
    B, R, SIZE, T, V, encoder_of, inputs, loss_and_grads, npy, region_batch, rescore, same_gradient, shared_tiny,
    tiny, tiny_options, tiny_regions)


@functools.lru_cache(maxsize=None)
def shared_regions(name, seed, geometry, **settings):
    """``tiny_regions(...)``, built once for the region checks, which only read it (calls, steps; no weight set)."""
    return tiny_regions(name, seed=seed, geometry=geometry, **settings)


def loss_grads_and_logits(model, batch, **options):
    """:func:`loss_and_grads` (the training loss and its gradients) and the logits ``[N, T, V]`` the loss came from
    (``model(batch, **options)``'s: :meth:`call` gives ``logits_and_penalty``'s): one forward pass for the three."""
    kept = []
    recorded = types.SimpleNamespace(trainable_variables=model.trainable_variables, logits_and_penalty=lambda *a, **o:
                                     kept.append(model.logits_and_penalty(*a, **o)) or kept[-1])
    loss, grads = loss_and_grads(recorded, batch, **options)
    return loss, grads, npy(kept[-1][0])


def check_declarations(name, **settings):
    """It declares what the rest of the code asks: ranged settings with defaults, its features, its longest
    caption; its variables are its own and trained, apart from the encoder's."""
    cls = DECODERS[name]
    fields = {f.name: f for f in dataclasses.fields(cls.settings_class)}
    for f in fields.values():  # every setting has a default, and a number its range
        assert f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING, f.name
        if f.type in (int, float, "int", "float"):
            assert "range" in f.metadata, f"model.{f.name} declares no range"
            describe_range(f.metadata["range"])
    assert set(cls.incompatible_keys) <= set(fields) and set(cls.tiny_settings) <= set(fields)
    assert cls.features in ("pooled", "grid") and (not cls.attends or cls.features == "grid")
    assert isinstance(cls.fast_teacher_forcing, bool)
    longest = cls.max_caption_length(cls.settings_class())  # a bound on the words it decodes names its setting
    assert longest is None or (isinstance(longest, int) and longest >= 1 and cls.caption_length_setting in fields)
    model = shared_tiny(name, **settings)
    assert model.settings == cls.settings_class(**{**dataclasses.asdict(cls.settings_class()),
                                                   **tiny_options(name, **settings)})
    assert model.token_layout == model.image_encoder.layout == TokenLayout(2, 2)  # small_cnn's map at 32 px
    for v in model.decoder_variables():
        assert any(v is w for w in model.trainable_variables), v.path  # the decoder's own, trained
    assert not {id(v) for v in model.decoder_variables()} & {id(v) for v in model.encoder.weights}


def check_stepping(name, **settings):
    """Stepping word by word equals the teacher-forced pass (from a teacher-forced first piece too, its state
    reserved before or after it), in float32; cached features give what images give."""
    model = shared_tiny(name, **settings)
    images, ids = inputs(seed=1)
    full = npy(model({"image": images, "input_ids": ids}))
    state = model.reserve(model.initial_state(model.encode(images)), T)  # room for T words, as beam search makes
    stepped = []
    for t in range(T):
        logits, state = model.step(tf.constant(ids[:, t]), state)
        assert logits.dtype == tf.float32
        stepped.append(npy(logits))
    stepped = np.stack(stepped, axis=1)
    assert stepped.shape == full.shape == (B, T, V) and np.abs(full).max() > 1e-3
    np.testing.assert_allclose(stepped, full, atol=1e-5, rtol=0)
    # a teacher-forced first piece, then steps, from a state reserved before or after it: the full pass again
    for reserved_first in (True, False):
        state = model.initial_state(model.encode(images))
        state = model.reserve(state, T) if reserved_first else state
        first, state = model.teacher_forced(state, tf.constant(ids[:, :3]))
        state = state if reserved_first else model.reserve(state, T - 3)
        rest = []
        for t in range(3, T):
            logits, state = model.step(tf.constant(ids[:, t]), state)
            rest.append(npy(logits))
        np.testing.assert_allclose(np.concatenate([npy(first), np.stack(rest, axis=1)], axis=1), full, atol=1e-5,
                                   rtol=0, err_msg=f"reserved {'before' if reserved_first else 'after'}")
    # cached features (data.cache: features) give what images give
    np.testing.assert_allclose(npy(model({"features": model.encode(images), "input_ids": ids})), full, atol=1e-5)


def refuses_regions(name, **settings) -> bool:
    """For a decoder that reads images with its own encoder (``own_encoder``: a vision-language preset's tower), whose
    language model takes that tower's tokens only: asserts that a model of it reading regions is refused in one line
    naming ``data.features``, and says so (the region checks then end there); False for every other decoder."""
    from captioning.errors import InputError

    if not DECODERS[name].own_encoder:
        return False
    with pytest.raises(InputError, match="data.features: images") as refused:
        tiny_regions(name, **settings)
    assert "\n" not in str(refused.value)
    return True


def check_region_padding(name, **settings):
    """A model reading regions respects the mask: the same images' regions padded further, with any values in
    the padding, give the same logits, penalty and captions; a batch of no image gives empty logits."""
    if refuses_regions(name, **settings):
        return
    from captioning.model.decode import beam_search

    model = shared_regions(name, 3, True, **settings)
    _, ids = inputs(seed=2)
    tight = region_batch(seed=4)
    padded = region_batch(seed=4, extra=3, garbage=9)
    logits, penalty = (npy(x) for x in model.logits_and_penalty({**tight, "input_ids": ids}))
    assert np.abs(logits).max() > 1e-3
    other, other_penalty = (npy(x) for x in model.logits_and_penalty({**padded, "input_ids": ids}))
    np.testing.assert_allclose(other, logits, atol=1e-5, rtol=0)
    np.testing.assert_allclose(other_penalty, penalty, atol=1e-5, rtol=0)
    searched = [beam_search(model, None, beam_size=2, max_length=5, initial_state=model.image_state(batch))
                for batch in (tight, padded)]
    np.testing.assert_array_equal(npy(searched[0]["ids"]), npy(searched[1]["ids"]))
    if model.attends:  # no weight on the padding
        weights = npy(searched[1]["attention"])
        assert weights.shape[-1] == 8 and np.abs(weights[..., 5:]).max() < 1e-6
        assert np.abs(weights[0, ..., 3:]).max() < 1e-6 and np.abs(weights[2, ..., 1:]).max() < 1e-6
    # the regions count: other regions give other logits
    moved = npy(model({**region_batch(seed=5), "input_ids": ids}))
    assert np.abs(moved - logits).max() > 1e-4
    empty = {"regions": np.zeros((0, 0, R), np.float16), "boxes": np.zeros((0, 0, 4), np.float32),
             "region_mask": np.zeros((0, 0), np.float32), "input_ids": np.zeros((0, 4), np.int64)}
    assert model(empty).shape == (0, 4, V)


def check_box_geometry(name, **settings):
    """model.box_geometry appends each region's box (and its area) to its features: the same regions with other
    boxes give other logits with it, and the very same logits without it."""
    if refuses_regions(name, **settings):
        return
    _, ids = inputs(seed=2)
    batch = region_batch(seed=4)
    moved = {**batch, "boxes": region_batch(seed=5)["boxes"]}  # the same regions and mask, only other boxes
    assert np.array_equal(moved["regions"], batch["regions"]) and not np.allclose(moved["boxes"], batch["boxes"])
    for geometry in (True, False):
        model = shared_regions(name, 3, geometry, **settings)
        logits, other = (npy(model({**b, "input_ids": ids})) for b in (batch, moved))
        assert np.abs(logits).max() > 1e-3
        if geometry:
            assert np.abs(other - logits).max() > 1e-4, "the boxes changed no logit with model.box_geometry"
        else:
            np.testing.assert_array_equal(other, logits)


def check_region_stepping(name, **settings):
    """A model reading regions steps as it teacher-forces; its encoder (for new images' regions) is frozen."""
    if refuses_regions(name, **settings):
        return
    model = shared_regions(name, 3, False, **settings)  # box geometry's without it
    _, ids = inputs(seed=1)
    batch = region_batch(seed=2, extra=1)
    full = npy(model({**batch, "input_ids": ids}))
    state = model.reserve(model.image_state(batch), T)
    stepped = []
    for t in range(T):
        logits, state = model.step(tf.constant(ids[:, t]), state)
        stepped.append(npy(logits))
    assert np.abs(full).max() > 1e-3
    np.testing.assert_allclose(np.stack(stepped, axis=1), full, atol=1e-5, rtol=0)
    assert not model.encoder.trainable  # the encoder is for new images' regions, not trained on stored ones


def check_empty_batch(name, **settings):
    """An empty replica batch gives empty logits, zero loss and zero gradients, and calls move no variable."""
    model = shared_tiny(name, **settings)
    stats = [npy(v).copy() for v in model.non_trainable_variables]
    for rows, steps in ((0, 0), (0, 5)):
        batch = {"image": tf.zeros([rows, SIZE, SIZE, 3], tf.uint8), "input_ids": tf.zeros([rows, steps], tf.int64),
                 "target_ids": tf.zeros([rows, steps], tf.int64), "mask": tf.zeros([rows, steps])}
        assert model({"image": batch["image"], "input_ids": batch["input_ids"]}).shape == (rows, steps, V)
        loss, grads = loss_and_grads(model, batch)
        assert float(loss) == 0.0 and all(g is None or not g.any() for g in grads)
    for before, after in zip(stats, model.non_trainable_variables):  # inference mode moved nothing
        np.testing.assert_array_equal(before, npy(after))
    images, ids = inputs()
    full = npy(model({"image": images, "input_ids": ids}))
    np.testing.assert_allclose(npy(model({"image": images[:1], "input_ids": ids[:1]})), full[:1], atol=1e-5)


def check_split_padding(name, **settings):
    """Split padding gives the same logits, loss and gradients, for each batch of caption lengths (mixed, all
    full, all equal, one caption, all short, empty) on one model of the decoder."""
    model = shared_tiny(name, **settings)
    for lengths in ([7, 7, 3, 2, 6], [2, 7, 1, 7, 7, 3], [4, 4, 4], [7], [1, 1, 2], []):
        split_padding_matches(model, lengths)


def split_padding_matches(model, lengths):
    from captioning.model.base import split_point

    images, _ = inputs(seed=7, batch=max(len(lengths), 1))
    images = images[:len(lengths)]
    rng = np.random.default_rng(8)
    ids = rng.integers(4, V, (len(lengths), T), dtype=np.int64)
    ids[:, 0] = 1
    for row, length in enumerate(lengths):
        ids[row, length:] = 0
    mask = (ids != 0).astype(np.float32)
    batch = {"image": images, "input_ids": ids, "target_ids": np.roll(ids, -1, axis=1), "mask": mask}

    def run(split):
        loss, grads, logits = loss_grads_and_logits(model, batch, split_padding=split)
        return logits, loss, grads

    (whole, a, ga), (split, b, gb) = run(False), run(True)
    assert split.shape == whole.shape == (len(lengths), T, V)
    real = mask.astype(bool)
    np.testing.assert_allclose(split[real], whole[real], atol=1e-5, err_msg=str(lengths))
    if lengths:
        cut = int(split_point(tf.constant(lengths), T))
        assert not split[~mask[:, cut:].any(axis=1)][:, cut:].any(), lengths  # finished captions' later steps: zeros
    assert b == pytest.approx(a, rel=1e-5, abs=1e-6), lengths
    for x, y in zip(ga, gb):
        if x is not None:
            same_gradient(y, x)


def check_grouped_captions(name, **settings):
    """Grouped captions (an image index a caption) equal one copy of the image per caption: logits, loss and
    gradients."""
    model = shared_tiny(name, **settings)
    images, _ = inputs(seed=3, batch=2)
    _, ids = inputs(seed=4, batch=5)
    index = np.array([0, 0, 1, 1, 1], np.int32)
    mask = np.ones((5, T), np.float32)
    mask[1, 4:] = mask[3, 2:] = 0.0
    grouped = {"image": images, "image_index": index, "input_ids": ids, "target_ids": np.roll(ids, -1, axis=1),
               "mask": mask}
    copied = {**{k: v for k, v in grouped.items() if k != "image_index"}, "image": images[index]}
    (a, ga, logits), (b, gb, expected) = (loss_grads_and_logits(model, batch) for batch in (grouped, copied))
    assert logits.shape == (5, T, V)
    np.testing.assert_allclose(logits, expected, atol=1e-5)
    assert a == pytest.approx(b, rel=1e-6)
    for x, y in zip(ga, gb):
        if x is not None:
            same_gradient(x, y)


def check_beam_search(name, **settings):
    """Beam search returns its best captions first with the model's own log-probabilities; beam 1 is greedy (by
    hand: argmax, <pad>, <start> and <unk> left out), and the same compiled by XLA; an attending decoder's weights a
    word sum to 1, are those of stepping, and are the same compiled."""
    from captioning.model.decode import beam_search
    from captioning.vocab import END_ID, PAD_ID, START_ID, UNK_ID

    model = tiny(name, seed=5, **settings)
    images, _ = inputs(seed=9)
    features = model.encode(images)
    greedy = beam_search(model, features, beam_size=1, max_length=6)
    state = model.reserve(model.initial_state(features), 6)  # greedy by hand: argmax; <pad>, <start>, <unk> out
    tokens, manual, done = tf.fill([B], START_ID), np.zeros((B, 6), np.int64), np.zeros(B, bool)
    for t in range(6):
        logits, state = model.step(tokens, state)
        logits = npy(logits)
        logits[:, [PAD_ID, START_ID, UNK_ID]] = -np.inf
        tokens = tf.constant(logits.argmax(axis=1))
        for row in range(B):
            if not done[row]:
                done[row] = int(tokens[row]) == END_ID
                manual[row, t] = 0 if done[row] else int(tokens[row])
    np.testing.assert_array_equal(npy(greedy["ids"])[:, 0], manual)
    xla = beam_search(model, features, beam_size=1, max_length=6, jit_compile=True)  # decode.jit_compile: all alike
    assert sorted(xla) == sorted(greedy)  # (tests/test_decode.py compiles greedy only with the rules, which add ops)
    for key in greedy:  # ids, lengths, log_probs, scores, and attention if it attends
        np.testing.assert_allclose(npy(xla[key]), npy(greedy[key]), atol=1e-5, err_msg=key)

    best = beam_search(model, features, beam_size=3, max_length=6, top_k=3)
    ids, lengths, scores, log_probs = (npy(best[key]) for key in ("ids", "lengths", "scores", "log_probs"))
    assert ids.shape == (B, 3, 6) and np.all(np.diff(scores, axis=1) <= 1e-6)  # best first
    # every caption rescored by stepping, one batch (a caption cut at max_length has no <end> in its log-probability)
    expected = rescore(model, np.repeat(images, 3, axis=0), [ids[i, rank, :lengths[i, rank]] for i in range(B)
                                                             for rank in range(3)], (lengths < 6).reshape(-1))
    np.testing.assert_allclose(log_probs, np.reshape(expected, (B, 3)), atol=1e-4)
    assert ("attention" in best) == model.attends
    if model.attends:  # beam 1 is greedy: its weights are those of stepping through the greedy caption
        state, tokens = model.reserve(model.initial_state(features), 6), tf.fill([B], START_ID)
        for t in range(6):
            _, state = model.step(tokens, state)
            for i in range(B):
                if t < npy(greedy["lengths"])[i, 0]:
                    np.testing.assert_allclose(npy(greedy["attention"])[i, 0, t], npy(state["attention"])[i],
                                               atol=1e-6)
            tokens = tf.constant(npy(greedy["ids"])[:, 0, t], tf.int32)
        compiled = tf.function(lambda f: beam_search(model, f, beam_size=3, max_length=6, top_k=3),
                               autograph=False)(features)
        np.testing.assert_allclose(npy(compiled["attention"]), npy(best["attention"]), atol=1e-5)
        weights = npy(best["attention"])
        assert weights.shape[:3] == (B, 3, 6) and weights.shape[3] == model.token_layout.tokens == model.grid_cells
        for i in range(B):
            for rank in range(3):
                length = lengths[i, rank]
                np.testing.assert_allclose(weights[i, rank, :length].sum(axis=-1), 1.0, atol=1e-5)
                assert not weights[i, rank, length:].any()


def check_mixed_precision(name, **settings):
    """Built under mixed_bfloat16 (the policy applies while building only), it computes in bfloat16 and keeps its
    logits, variables and attention in float32."""
    keras.mixed_precision.set_global_policy("mixed_bfloat16")
    try:
        model = tiny(name, **settings)
    finally:
        keras.mixed_precision.set_global_policy("float32")
    assert keras.mixed_precision.global_policy().name == "float32"  # the policy applies while building only
    images, ids = inputs(seed=3)
    logits = model({"image": images, "input_ids": ids})
    assert logits.dtype == tf.float32 and np.isfinite(npy(logits)).all()
    assert all(v.dtype == "float32" for v in model.decoder_variables())
    assert any(layer.compute_dtype == "bfloat16" for layer in model._flatten_layers())  # it does compute in it
    step_logits, state = model.step(tf.constant(ids[:, 0]), model.reserve(model.initial_state(model.encode(images)), 1))
    assert step_logits.dtype == tf.float32
    if model.attends:
        assert state["attention"].dtype == tf.float32


def check_checkpoint(name, folder, **settings):
    """A checkpoint (written in ``folder``) round-trips every weight, and one of other shapes (each of the
    decoder's ``incompatible_keys`` changed) is refused in one line naming the key."""
    from captioning.errors import InputError
    from captioning.model.folder import ModelDir

    model = shared_tiny(name, **settings)  # tiny(name, seed=0), only read here
    images, ids = inputs(seed=6)
    expected = npy(model({"image": images, "input_ids": ids}))
    path = tf.train.Checkpoint(model=model).save(os.path.join(str(folder), "ckpt"))
    other = tiny(name, seed=1, **settings)
    for weight in other.weights:  # every float weight moved (a preset's weights are the same in every build)
        if "float" in str(weight.dtype):
            weight.assign(weight * 1.5 + 0.01)
    assert not np.allclose(npy(other({"image": images, "input_ids": ids})), expected)
    ModelDir.restore(path, {"model": other})
    np.testing.assert_array_equal(npy(other({"image": images, "input_ids": ids})), expected)
    for a, b in zip(model.weights, other.weights):
        np.testing.assert_array_equal(npy(a), npy(b))
    cls = DECODERS[name]
    fields = {f.name: f for f in dataclasses.fields(cls.settings_class)}
    for key in cls.incompatible_keys:
        value = dataclasses.asdict(model.settings)[key]
        options = fields[key].metadata.get("choices")
        changed = {key: next(c for c in options if c != value) if options else value * 2}
        cfg = {"decoder": name, "encoder": encoder_of(name)}
        old = resolve(_config(cfg, model.settings))
        new = resolve(_config(cfg, dataclasses.replace(model.settings, **changed)))
        assert architecture_diff(old, new) == [f"model.{key}"]
        with pytest.raises(InputError, match="does not fit the model this config builds"):
            ModelDir.restore(path, {"model": tiny(name, **{**settings, **changed})})


def _config(model_cfg, settings):
    from captioning.config import Config

    cfg = Config()
    cfg.model = ModelConfig(**model_cfg, options=dataclasses.asdict(settings))
    return cfg


def check_saved_model(name, folder, images_dir, **settings):
    """The SavedModel exported (into ``folder``) from an untrained tiny model captions two images of
    ``images_dir`` as the captioner does: the same captions, log-probabilities, and attention if it attends."""
    from captioning.config import Config, DecodeConfig
    from captioning.inference import Captioner
    from captioning.inference.export import export
    from captioning.model.folder import TrainedModel
    from captioning.vocab import RESERVED, Vocabulary

    cfg = Config()
    cfg.data.image_size, cfg.data.resize_size = SIZE, 36
    model = tiny(name, seed=2, **settings)
    cfg.model = model.cfg
    vocab = Vocabulary(list(RESERVED) + [f"w{i}" for i in range(V - len(RESERVED))])
    trained = TrainedModel(model, cfg, vocab, step=0, checkpoint="(untrained)", model_dir=str(folder))
    captioner = Captioner(trained, DecodeConfig(beam_size=2, max_length=5, top_k=2))
    files = sorted(os.listdir(images_dir))[:2]
    encoded = [open(os.path.join(images_dir, f), "rb").read() for f in files]
    expected = captioner.caption(encoded)
    out = export(captioner, os.path.join(str(folder), "export"), os.path.join(str(folder), "model"))
    served = tf.saved_model.load(out).signatures["serving_default"](images=tf.constant(encoded))
    texts = [[c.decode() for c in row] for row in served["captions"].numpy()]
    assert texts == [[c.text for c in captions] for captions in expected]
    np.testing.assert_allclose(served["log_probs"].numpy(), [[c.log_prob for c in cs] for cs in expected], atol=1e-4)
    assert ("attention" in served) == model.attends


# every quick check, in the order tests/test_decoders.py runs them
DECODER_CHECKS = (check_declarations, check_stepping, check_region_padding, check_box_geometry, check_region_stepping,
                  check_empty_batch, check_split_padding, check_grouped_captions, check_beam_search,
                  check_mixed_precision, check_checkpoint)


def run_decoder_test(name, folder, images_dir=None, **settings):
    """Every quick check of the contract over decoder ``name`` (registered in ``captioning.model.DECODERS``) with
    its ``tiny_settings`` and ``settings``: declarations, stepping against teacher forcing (over a grid and over
    regions), padding, boxes, an empty batch, split padding, grouped captions (a training step's loss and
    gradients), beam search, mixed precision, a checkpoint's round trip in ``folder``; and with ``images_dir`` (a
    folder of JPEGs) the SavedModel against the captioner. Raises AssertionError at the first promise broken."""
    for check in DECODER_CHECKS:
        if check is check_checkpoint:
            check(name, folder, **settings)
        else:
            check(name, **settings)
    if images_dir is not None:
        check_saved_model(name, folder, images_dir, **settings)
