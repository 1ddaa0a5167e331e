"""The decoder contract: what every registered decoder must do, run over every entry of
``captioning.model.DECODERS`` (and any decoder registered with ``--decoder FILE:NAME``), so a new
decoder is tested by these with no new test code.

Each test builds the decoder with its ``tiny_settings`` on ``small_cnn`` at 32 px (a 2 × 2 grid) and
random images or random regions: stepping word by word equals the teacher-forced pass (over the grid and over
regions); padding regions with anything changes nothing; with ``model.box_geometry`` the regions' boxes change
the logits, without it they change nothing; an empty replica batch gives empty logits and zero gradients;
split padding changes nothing; grouped captions equal a copy of the image per caption; beam search returns
its captions best first with the model's own log-probabilities (and an attending decoder's weights per word);
mixed precision keeps the logits and variables in float32; a checkpoint round-trips and one of other shapes is
refused; the SavedModel captions as the captioner does; two mirrored replicas compute what one device
computes."""

import dataclasses
import functools
import os
import pathlib
import re
import shutil
import subprocess
import sys

import keras
import numpy as np
import pytest
import tensorflow as tf

from captioning.config import ModelConfig
from captioning.model.layout import TokenLayout
from captioning.config.settings import describe_range
from captioning.model import DECODERS, architecture_diff, build_model, resolve
from tests.helpers import REPO, run_distributed_worker

V, B, T, SIZE = 40, 3, 7, 32
NAMES = sorted(DECODERS)


def tiny(name, seed=0, trainable=True, **changes):
    cls = DECODERS[name]
    cfg = ModelConfig(decoder=name, encoder="small_cnn", encoder_trainable=trainable, dropout=0.0,
                      options={**cls.tiny_settings, **changes})
    return build_model(V, cfg, SIZE, seed=seed).build_all()


@functools.lru_cache(maxsize=None)
def shared_tiny(name):
    """``tiny(name)``, built once for the tests that only read it (calls, gradients, steps; no weight set):
    one build a decoder instead of one a test. The empty-batch test checks that calls move no variable."""
    return tiny(name)


def inputs(seed=0, batch=B, steps=T):
    rng = np.random.default_rng(seed)
    ids = rng.integers(4, V, (batch, steps), dtype=np.int64)
    ids[:, 0] = 1  # <start>
    return rng.integers(0, 256, (batch, SIZE, SIZE, 3), dtype=np.uint8), ids


def npy(x):
    return x.numpy() if hasattr(x, "numpy") else np.asarray(x)


def loss_and_grads(model, batch, **kw):
    """The training loss (the decoder's penalty included, if it has one) and its gradients."""
    from captioning.train.objectives import caption_loss_sum

    with tf.GradientTape() as tape:
        loss = caption_loss_sum(model, batch, training=False, penalty=True, **kw)
    grads = tape.gradient(loss, model.trainable_variables)
    return npy(loss), [None if g is None else npy(tf.convert_to_tensor(g)) for g in grads]


def same_gradient(actual, desired):
    """Equal up to float32 rounding: 1e-4 relative, and 1e-5 absolute per unit of the gradient's largest
    element (a Transformer's gradients reach ~10, an LSTM's stay under 1, where this is 1e-5). The absolute part
    covers elements that are small sums of large terms added in another order (a gather's gradient against the
    copies'): at 1e-6 one element in 147,456 of a Transformer's was 4.6e-6 over, 2026-11-26. A real difference
    (a caption read with another image, a mask dropped) moves the gradients by their own size."""
    np.testing.assert_allclose(actual, desired, rtol=1e-4, atol=1e-5 * max(1.0, float(np.abs(desired).max())))


@pytest.mark.parametrize("name", NAMES)
def test_a_decoder_declares_what_the_rest_of_the_code_asks(name):
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
    model = shared_tiny(name)
    assert model.settings == cls.settings_class(**{**dataclasses.asdict(cls.settings_class()), **cls.tiny_settings})
    assert model.token_layout == model.image_encoder.layout == TokenLayout(2, 2)  # small_cnn's map at 32 px
    for v in model.decoder_variables():
        assert any(v is w for w in model.trainable_variables), v.path  # the decoder's own, trained
    assert not {id(v) for v in model.decoder_variables()} & {id(v) for v in model.encoder.weights}


@pytest.mark.parametrize("name", NAMES)
def test_stepping_word_by_word_equals_the_teacher_forced_pass(name):
    model = shared_tiny(name)
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


R = 12  # region features


def tiny_regions(name, seed=0, geometry=False):
    """A tiny model of decoder ``name`` reading regions of R features (data.features: regions)."""
    cls = DECODERS[name]
    cfg = ModelConfig(decoder=name, encoder="small_cnn", dropout=0.0, region_feature_size=R, box_geometry=geometry,
                      options=dict(cls.tiny_settings))
    return build_model(V, cfg, SIZE, seed=seed).build_all()


def region_batch(counts=(3, 5, 1), extra=0, seed=0, garbage=0):
    """Regions of B images (``counts`` each), padded to the most plus ``extra`` columns holding ``garbage``
    (a seed: random values where the mask is 0; 0: zeros), with boxes and the mask."""
    rng = np.random.default_rng(seed)
    n = max(counts)
    mask = (np.arange(n)[None, :] < np.array(counts)[:, None]).astype(np.float32)
    regions = rng.normal(size=(len(counts), n, R)) * mask[..., None]
    corner = rng.uniform(0, 0.5, (len(counts), n, 2))
    boxes = np.concatenate([corner, corner + rng.uniform(0.1, 0.5, (len(counts), n, 2))], axis=-1) * mask[..., None]
    pad = [[0, 0], [0, extra], [0, 0]]
    regions, boxes, mask = np.pad(regions, pad), np.pad(boxes, pad), np.pad(mask, pad[:2])
    if garbage:
        noise = np.random.default_rng(garbage)
        regions = regions + noise.normal(size=regions.shape) * (1 - mask[..., None])
        boxes = boxes + noise.uniform(size=boxes.shape) * (1 - mask[..., None])
    return {"regions": regions.astype(np.float16), "boxes": boxes.astype(np.float32), "region_mask": mask}


@pytest.mark.parametrize("name", NAMES)
def test_padding_regions_with_anything_changes_nothing(name):
    """A model reading regions respects the mask: the same images' regions padded further, with any values in
    the padding, give the same logits, penalty and captions; a batch of no image gives empty logits."""
    from captioning.model.decode import beam_search

    model = tiny_regions(name, seed=3, geometry=True)
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


@pytest.mark.parametrize("name", NAMES)
def test_box_geometry_makes_the_boxes_count_and_without_it_they_do_not(name):
    """model.box_geometry appends each region's box (and its area) to its features: the same regions with other
    boxes give other logits with it, and the very same logits without it."""
    _, ids = inputs(seed=2)
    batch = region_batch(seed=4)
    moved = {**batch, "boxes": region_batch(seed=5)["boxes"]}  # the same regions and mask, only other boxes
    assert np.array_equal(moved["regions"], batch["regions"]) and not np.allclose(moved["boxes"], batch["boxes"])
    for geometry in (True, False):
        model = tiny_regions(name, seed=3, geometry=geometry)
        logits, other = (npy(model({**b, "input_ids": ids})) for b in (batch, moved))
        assert np.abs(logits).max() > 1e-3
        if geometry:
            assert np.abs(other - logits).max() > 1e-4, "the boxes changed no logit with model.box_geometry"
        else:
            np.testing.assert_array_equal(other, logits)


@pytest.mark.parametrize("name", NAMES)
def test_a_model_reading_regions_steps_as_it_teacher_forces(name):
    model = tiny_regions(name, seed=1)
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


@pytest.mark.parametrize("name", NAMES)
def test_an_empty_replica_batch_gives_empty_logits_zero_loss_and_zero_gradients(name):
    model = shared_tiny(name)
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


@pytest.mark.parametrize("name", NAMES)
def test_split_padding_gives_the_same_logits_loss_and_gradients(name):
    """Each batch of caption lengths (mixed, all full, all equal, one caption, all short, empty) on one
    model of the decoder: a model built once for the six."""
    model = shared_tiny(name)
    for lengths in ([7, 7, 3, 2, 6], [2, 7, 1, 7, 7, 3], [4, 4, 4], [7], [1, 1, 2], []):
        split_padding_matches(model, lengths)


def split_padding_matches(model, lengths):
    from captioning.model.base import split_point

    images, _ = inputs(seed=7, batch=max(len(lengths), 1))
    images = images[:len(lengths)]
    rng = np.random.default_rng(8)
    ids = rng.integers(4, V, (len(lengths), T), dtype=np.int64)
    ids[:, 0] = 1
    for row, n in enumerate(lengths):
        ids[row, n:] = 0
    mask = (ids != 0).astype(np.float32)
    batch = {"image": images, "input_ids": ids, "target_ids": np.roll(ids, -1, axis=1), "mask": mask}

    def run(split):
        loss, grads = loss_and_grads(model, batch, split_padding=split)
        return npy(model({"image": images, "input_ids": ids}, split_padding=split)), loss, grads

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


@pytest.mark.parametrize("name", NAMES)
def test_grouped_captions_equal_one_copy_of_the_image_per_caption(name):
    model = shared_tiny(name)
    images, _ = inputs(seed=3, batch=2)
    _, ids = inputs(seed=4, batch=5)
    index = np.array([0, 0, 1, 1, 1], np.int32)
    mask = np.ones((5, T), np.float32)
    mask[1, 4:] = mask[3, 2:] = 0.0
    grouped = {"image": images, "image_index": index, "input_ids": ids, "target_ids": np.roll(ids, -1, axis=1),
               "mask": mask}
    copied = {**{k: v for k, v in grouped.items() if k != "image_index"}, "image": images[index]}
    np.testing.assert_allclose(npy(model({k: grouped[k] for k in ("image", "image_index", "input_ids")})),
                               npy(model({k: copied[k] for k in ("image", "input_ids")})), atol=1e-5)
    (a, ga), (b, gb) = loss_and_grads(model, grouped), loss_and_grads(model, copied)
    assert a == pytest.approx(b, rel=1e-6)
    for x, y in zip(ga, gb):
        if x is not None:
            same_gradient(x, y)


def rescore(model, images, captions):
    """Each caption's summed log-probability (its words, then <end> if it has room), by stepping."""
    from captioning.vocab import END_ID, START_ID

    totals = []
    for image, words in zip(images, captions):
        state = model.reserve(model.image_state({"image": image[None]}), len(words) + 1)
        total, token = 0.0, START_ID
        for word in list(words) + [END_ID]:
            logits, state = model.step(tf.constant([token]), state)
            total += float(tf.nn.log_softmax(logits)[0, word])
            token = word
        totals.append(total)
    return totals


@pytest.mark.parametrize("name", NAMES)
def test_beam_search_returns_its_best_captions_first_with_the_models_log_probabilities(name):
    from captioning.model.decode import beam_search
    from captioning.vocab import END_ID, PAD_ID, START_ID, UNK_ID

    model = tiny(name, seed=5)
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

    best = beam_search(model, features, beam_size=3, max_length=6, top_k=3)
    ids, lengths, scores, log_probs = (npy(best[k]) for k in ("ids", "lengths", "scores", "log_probs"))
    assert ids.shape == (B, 3, 6) and np.all(np.diff(scores, axis=1) <= 1e-6)  # best first
    for k in range(3):
        captions = [ids[i, k, :lengths[i, k]] for i in range(B)]
        ended = lengths[:, k] < 6
        expected = rescore(model, images, captions)
        got = [lp if e else None for lp, e in zip(log_probs[:, k], ended)]
        for e, (x, y) in zip(ended, zip(got, expected)):
            if e:  # a caption cut at max_length has no <end> in its log-probability
                assert x == pytest.approx(y, abs=1e-4)
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
            for k in range(3):
                n = lengths[i, k]
                np.testing.assert_allclose(weights[i, k, :n].sum(axis=-1), 1.0, atol=1e-5)
                assert not weights[i, k, n:].any()


@pytest.mark.parametrize("name", NAMES)
def test_mixed_precision_keeps_logits_and_variables_in_float32(name):
    keras.mixed_precision.set_global_policy("mixed_bfloat16")
    try:
        model = tiny(name)
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


@pytest.mark.parametrize("name", NAMES)
def test_a_checkpoint_round_trips_and_one_of_other_shapes_is_refused(name, tmp_path):
    from captioning.errors import InputError
    from captioning.model.folder import ModelDir

    model = shared_tiny(name)  # tiny(name, seed=0), only read here
    images, ids = inputs(seed=6)
    expected = npy(model({"image": images, "input_ids": ids}))
    path = tf.train.Checkpoint(model=model).save(str(tmp_path / "ckpt"))
    other = tiny(name, seed=1)
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
        cfg = {"decoder": name, "encoder": "small_cnn"}
        old = resolve(_config(cfg, model.settings))
        new = resolve(_config(cfg, dataclasses.replace(model.settings, **changed)))
        assert architecture_diff(old, new) == [f"model.{key}"]
        with pytest.raises(InputError, match="does not fit the model this config builds"):
            ModelDir.restore(path, {"model": tiny(name, **changed)})


def _config(model_cfg, settings):
    from captioning.config import Config

    cfg = Config()
    cfg.model = ModelConfig(**model_cfg, options=dataclasses.asdict(settings))
    return cfg


@pytest.mark.slow
@pytest.mark.parametrize("name", NAMES)
def test_an_xla_compiled_training_step_equals_the_plain_one(name, mirrored_runs):
    """train.jit_compile: the replica's forward and backward pass compiled by XLA (fixed shapes from
    data.bucket_boundaries) gives the same loss, gradient norm and update as without (a trainable encoder
    with batch norm, clipping active). Both steps, from the same weights and batch, are mirrored_runs' (the
    plain one is the one-device step the mirrored replicas are held to)."""
    r = mirrored_result(mirrored_runs, name)
    assert float(r["one_norm"]) > 0.05 and float(r["xla_norm"]) == pytest.approx(float(r["one_norm"]), rel=1e-4)
    assert float(r["xla_loss"]) == pytest.approx(float(r["one_loss"]), rel=1e-5)
    names = [k[len("one/"):] for k in r.files if k.startswith("one/")]
    assert len(names) > 20 and sorted(names) == sorted(k[len("xla/"):] for k in r.files if k.startswith("xla/"))
    for key in names:
        np.testing.assert_allclose(r["xla/" + key], r["one/" + key], atol=1e-5, err_msg=key)


@pytest.mark.slow
@pytest.mark.parametrize("name", NAMES)
def test_the_saved_model_captions_as_the_captioner_does(name, tmp_path, shapes_dir):
    from captioning.config import Config, DecodeConfig
    from captioning.inference import Captioner
    from captioning.inference.export import export
    from captioning.model.folder import TrainedModel
    from captioning.vocab import RESERVED, Vocabulary

    cfg = Config()
    cfg.data.image_size, cfg.data.resize_size = SIZE, 36
    model = tiny(name, seed=2)
    cfg.model = model.cfg
    vocab = Vocabulary(list(RESERVED) + [f"w{i}" for i in range(V - len(RESERVED))])
    trained = TrainedModel(model, cfg, vocab, step=0, checkpoint="(untrained)", model_dir=str(tmp_path))
    captioner = Captioner(trained, DecodeConfig(beam_size=2, max_length=5, top_k=2))
    files = sorted(os.listdir(os.path.join(shapes_dir, "images")))[:2]
    encoded = [open(os.path.join(shapes_dir, "images", f), "rb").read() for f in files]
    expected = captioner.caption(encoded)
    out = export(captioner, str(tmp_path / "export"), str(tmp_path / "model"))
    served = tf.saved_model.load(out).signatures["serving_default"](images=tf.constant(encoded))
    texts = [[c.decode() for c in row] for row in served["captions"].numpy()]
    assert texts == [[c.text for c in captions] for captions in expected]
    np.testing.assert_allclose(served["log_probs"].numpy(), [[c.log_prob for c in cs] for cs in expected], atol=1e-4)
    assert ("attention" in served) == model.attends


MIRRORED = ("test_two_mirrored_replicas_compute_what_one_device_computes",
            "test_an_xla_compiled_training_step_equals_the_plain_one")


@pytest.fixture(scope="module")
def mirrored_runs(prepared_dir, tmp_path_factory, request):
    """Every selected decoder's one-device, mirrored and XLA-compiled steps, in one process (TensorFlow starts
    once with two devices)."""
    names = sorted({item.callspec.params["name"] for item in request.session.items
                    if getattr(item, "originalname", None) in MIRRORED})
    out = tmp_path_factory.mktemp("mirrored")
    registered = [a for spec in request.config.getoption("--decoder") for a in ("--decoder", spec)]
    run_distributed_worker("mirrored_decoder", prepared_dir, str(out), ",".join(names), *registered, timeout=900)
    return out


def mirrored_result(mirrored_runs, name):
    error = mirrored_runs / f"mirrored-{name}.error"
    if error.exists():
        pytest.fail(error.read_text())
    return np.load(mirrored_runs / f"mirrored-{name}.npz")


@pytest.mark.slow
@pytest.mark.parametrize("name", NAMES)
def test_two_mirrored_replicas_compute_what_one_device_computes(name, mirrored_runs):
    r = mirrored_result(mirrored_runs, name)
    assert int(r["one_replicas"]) == 1 and int(r["two_replicas"]) == 2
    assert r["tokens_first_half"] != r["tokens_second_half"]  # an uneven split of the words
    assert float(r["one_norm"]) > 0.05  # so clipping at 0.05 was active (on the global gradient)
    assert float(r["two_loss"]) == pytest.approx(float(r["one_loss"]), abs=1e-5)
    names = [k[len("one/"):] for k in r.files if k.startswith("one/")]
    assert len(names) > 20  # the encoder's and the decoder's weights, batch-norm statistics alike
    for key in names:
        np.testing.assert_allclose(r["two/" + key], r["one/" + key], atol=1e-5, err_msg=key)


@pytest.mark.slow
def test_a_new_decoder_is_tested_by_the_contract_with_no_new_test_code(tmp_path, request):
    """A decoder from a file outside the project (tests/data/toy_decoder.py), registered as one entry:
    every contract test pytest collects for a registered decoder runs on it and passes; the same decoder with
    a subtle bug fails them."""
    toy = str(tmp_path / "toy_decoder.py")  # a file outside the project, as a user would write one
    shutil.copy(os.path.join(REPO, "tests", "data", "toy_decoder.py"), toy)
    # the same decoder with its subtle bug switched on (BROKEN=1), registered beside it as "broken": one pytest
    # process runs the toy's contract and the broken one's stepping test
    source = open(toy).read()
    assert source.count('os.environ.get("BROKEN")') == 1
    broken_file = str(tmp_path / "broken_decoder.py")
    with open(broken_file, "w") as f:
        f.write(source.replace('os.environ.get("BROKEN")', "True"))
    here = [sys.executable, "-m", "pytest", os.path.join(REPO, "tests", "test_decoders.py"), "-p", "no:cacheprovider",
            "-m", "not slow"]
    args = [*here, "-v", "--decoder", f"{toy}:toy", "--decoder", f"{broken_file}:broken", "-k",
            "toy and not mirrored or broken and stepping_word_by_word"]
    env = dict(os.environ, PYTHONPATH=REPO, TF_CPP_MIN_LOG_LEVEL="2")
    env.pop("BROKEN", None)
    # the contract as pytest collects it for a decoder of the project (this module collected again by pytest's
    # own collector, in this process: its quick tests of show_and_tell), its name put in the toy's place
    module = pytest.Module.from_parent(request.session, path=pathlib.Path(__file__))
    listed = [item.name for item in module.collect() if isinstance(item, pytest.Function)
              and item.get_closest_marker("slow") is None and "[show_and_tell" in item.name and "mirrored" not in item.name]
    contract = {re.sub(r"\[show_and_tell(?=[-\]])", "[toy", name) for name in listed}
    # 11 since the split-padding and shared-model checks became one test a decoder each (b56da82, 5131e66)
    assert len(contract) >= 11 and all("[toy" in test for test in contract), sorted(contract)
    done = subprocess.run(args, capture_output=True, text=True, cwd=REPO, env=env, timeout=600)
    # exit 1: the broken decoder's stepping test fails (the contract catches the bug), and it alone
    assert done.returncode == 1, done.stdout[-3000:]
    passed = {m.group(1) for m in re.finditer(r"^tests/test_decoders\.py::(\S+) PASSED", done.stdout, re.M)}
    assert passed == contract, (sorted(contract - passed), sorted(passed - contract))
    # the bug is in stepping: the contract test that compares it with the teacher-forced pass catches it
    failed = set(re.findall(r"^FAILED (tests/test_decoders\.py::\S+)", done.stdout, re.M))
    assert failed == {"tests/test_decoders.py::test_stepping_word_by_word_equals_the_teacher_forced_pass[broken]"}, \
        done.stdout[-3000:]
