"""Self-critical sequence training: sampling in the graph (checked against teacher forcing), the policy
gradient and its baselines, determinism across replicas, starting from a cross-entropy model (a new
folder or the same one), resuming, and MirroredStrategy / MultiWorkerMirroredStrategy."""

import logging
import os
import re

import numpy as np
import pytest
import tensorflow as tf

from captioning.config import load_config
from captioning.errors import InputError
from captioning.train.objectives.scst import ScstSettings
from captioning.vocab import END_ID, PAD_ID, START_ID
from tests.helpers import distributed_result, small_train_config, model_config

V = 40


@pytest.fixture(scope="module")
def model():

    from captioning.model import build_model

    return build_model(V, model_config(encoder="small_cnn", embedding_size=16, lstm_units=16, dropout=0.0), 32,
                       seed=3).build_all()


def images(n, seed=0):
    return np.random.default_rng(seed).integers(0, 256, (n, 32, 32, 3), dtype=np.uint8)


def test_samples_stop_at_end_and_their_log_probability_is_the_models(model):
    """Every sampled caption is words, then <end> (or max_length words), then <pad>; its summed
    log-probability equals the teacher-forced model's for the same words and <end> (over the words it
    may choose: never <pad> or <start>)."""
    from captioning.train.objectives.scst import sample_captions

    state = model.initial_state(model.encode(images(4)))
    state = [tf.repeat(s, 8, axis=0) for s in state]
    drawn = sample_captions(model, state, max_length=6, temperature=1.0, seed=tf.constant([1, 2]))
    ids, log_prob, ended = drawn["ids"].numpy(), drawn["log_prob"].numpy(), drawn["ended"].numpy()
    assert ids.shape == (32, 6)
    assert not np.isin(ids, (START_ID,)).any()
    for row in range(32):
        stop = np.flatnonzero(ids[row] == END_ID)
        assert ended[row] == bool(stop.size)
        if stop.size:
            assert (ids[row, stop[0] + 1:] == PAD_ID).all() and (ids[row, :stop[0]] > END_ID).all()
        else:
            assert (ids[row] > END_ID).all()
    assert len({tuple(r) for r in ids}) > 8  # the 8 samples of an image differ
    # teacher forcing the same rows: <start> then the sampled words
    inputs = np.concatenate([np.full((32, 1), START_ID), ids[:, :-1]], axis=1)
    features = tf.repeat(model.encode(images(4)), 8, axis=0)
    logits = model({"features": features, "input_ids": inputs}).numpy()
    logits[..., [PAD_ID, START_ID]] = -np.inf
    logp = tf.nn.log_softmax(logits).numpy()
    counted = (np.cumsum(ids == END_ID, axis=1) - (ids == END_ID)) == 0  # words and the <end>, not after it
    counted &= ids != PAD_ID
    expected = np.where(counted, np.take_along_axis(logp, ids[..., None], axis=2)[..., 0], 0.0).sum(axis=1)
    np.testing.assert_allclose(log_prob, expected, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("name", sorted(__import__("captioning.model", fromlist=["DECODERS"]).DECODERS))
def test_the_teacher_forced_pass_has_the_sampling_loops_log_probability_and_gradient(name):
    """What the policy gradient goes through (one teacher-forced pass over the drawn captions) equals the
    log-probability the sampling loop adds up, and so does its gradient, for every decoder."""
    from captioning.train.objectives.scst import sample_captions, sequence_log_prob
    from tests.harness.models import inputs, tiny

    model = tiny(name, seed=3)
    pixels, _ = inputs(seed=5)
    advantage = tf.constant(np.random.default_rng(1).normal(size=6), tf.float32)
    with tf.GradientTape(persistent=True) as tape:
        state = tf.nest.map_structure(lambda s: tf.repeat(s, 2, axis=0), model.initial_state(model.encode(pixels)))
        drawn = sample_captions(model, state, 6, 0.8, tf.constant([1, 3]))
        again = sequence_log_prob(model, state, drawn["ids"], 0.8)
        through_loop, teacher_forced = (tf.reduce_sum(advantage * lp) for lp in (drawn["log_prob"], again))
    np.testing.assert_allclose(again.numpy(), drawn["log_prob"].numpy(), rtol=1e-4, atol=1e-4)
    for a, b, v in zip(tape.gradient(through_loop, model.trainable_variables),
                       tape.gradient(teacher_forced, model.trainable_variables), model.trainable_variables):
        a, b = (np.zeros(v.shape) if g is None else tf.convert_to_tensor(g).numpy() for g in (a, b))
        np.testing.assert_allclose(b, a, rtol=1e-3, atol=1e-5 * max(1.0, float(np.abs(a).max())), err_msg=v.name)
    empty = tf.nest.map_structure(lambda s: s[:0], state)
    assert sequence_log_prob(model, empty, tf.zeros([0, 6], tf.int32), 0.8).shape == (0,)  # an empty replica
    # the pass stops at the longest caption's <end>: what a full-length pass gives, padding columns or not
    short = np.array([[5, 6, END_ID] + [PAD_ID] * 5, [END_ID] + [PAD_ID] * 7] * 3, np.int32)
    inputs_ = np.concatenate([np.full([6, 1], START_ID), short[:, :-1]], axis=1)
    logits, _ = model.teacher_forced(state, tf.constant(inputs_), training=False)
    logp = tf.nn.log_softmax(logits / 0.8 + tf.reduce_sum(tf.one_hot([PAD_ID, START_ID], model.vocab_size), 0) * -1e9)
    full = np.take_along_axis(logp.numpy(), short[..., None], axis=2)[..., 0]
    expected = np.where(np.cumsum(short == END_ID, axis=1) - (short == END_ID) == 0, full, 0).sum(axis=1)
    for ids in (short, short[:, :3]):
        np.testing.assert_allclose(sequence_log_prob(model, state, tf.constant(ids), 0.8).numpy(), expected,
                                   rtol=1e-5, atol=1e-5)
    # scst.xla_sampling: the loop compiled with XLA draws the same captions (integers only, no log_prob)
    with tf.GradientTape() as tape:  # a tape does not follow it into the loop
        compiled = sample_captions(model, state, 6, 0.8, tf.constant([1, 3]), xla=True)
    assert sorted(compiled) == ["ended", "ids"]
    np.testing.assert_array_equal(compiled["ids"].numpy(), drawn["ids"].numpy())
    np.testing.assert_array_equal(compiled["ended"].numpy(), drawn["ended"].numpy())
    assert sample_captions(model, empty, 6, 0.8, tf.constant([1, 3]), xla=True)["ids"].shape == (0, 6)


def test_samples_are_a_function_of_the_seed_and_the_global_row(model):
    from captioning.train.objectives.scst import sample_captions

    state = [tf.repeat(s, 4, axis=0) for s in model.initial_state(model.encode(images(3)))]
    a = sample_captions(model, state, 5, 1.0, tf.constant([0, 7]))["ids"].numpy()
    b = sample_captions(model, state, 5, 1.0, tf.constant([0, 7]))["ids"].numpy()
    c = sample_captions(model, state, 5, 1.0, tf.constant([0, 8]))["ids"].numpy()
    np.testing.assert_array_equal(a, b)
    assert (a != c).any()


def test_policy_gradient_and_baselines(memorised):
    """loss = −Σ (r − b) log p / samples, with b the mean of the image's other samples, or its greedy
    caption's reward (scored as a sample is: with its <end> when the reward counts it); reported reward,
    baseline and ended are per-sample means. With scst.end_in_reward on and off, on a model whose greedy
    captions end with <end> (where the two differ)."""
    from captioning.model.decode import beam_search
    from captioning.train.cider import CiderD, document_frequencies
    from captioning.train.objectives.scst import SelfCritical, references_of, sample_captions

    rng = np.random.default_rng(4)
    refs = [[list(rng.integers(4, V, 5)) for _ in range(2)] for _ in range(3)]
    ids = [[1] + r + [END_ID] for image in refs for r in image]
    width = max(map(len, ids)) - 1
    target = np.array([(r[1:] + [0] * width)[:width] for r in ids])
    batch = {"image": images(3, seed=5), "image_index": np.repeat(np.arange(3), 2).astype(np.int32),
             "input_ids": np.array([(r[:-1] + [0] * width)[:width] for r in ids]), "target_ids": target,
             "mask": (target != 0).astype(np.float32)}
    assert references_of(batch).to_list() == [[[int(w) for w in r] for r in image] for image in refs]
    step, model = tf.Variable(11, dtype=tf.int64), memorised
    for baseline, end in (("mean", False), ("greedy", False), ("mean", True), ("greedy", True)):
        with_end = [[r + [END_ID] for r in image] for image in refs] if end else refs
        frequencies = document_frequencies(with_end, vocab_size=V, end_token=end)
        references = references_of(batch, end_token=end)
        # scst.xla_sampling in one case: its draws are checked against the loop's below (once is enough: the reward,
        # the baselines and the gradient do not depend on how the same captions were drawn; one XLA compile, not two)
        cfg = ScstSettings(samples=4, baseline=baseline, max_length=7, end_in_reward=end,
                           xla_sampling=(baseline, end) == ("mean", False))
        objective = SelfCritical(CiderD(frequencies), cfg, step, seed=2)
        with tf.GradientTape() as tape:
            out = objective.replica_loss(model, batch, training=False)
        grads = tape.gradient(out.loss_sum, model.trainable_variables)
        assert any(g is not None and np.abs(tf.convert_to_tensor(g).numpy()).sum() > 0 for g in grads)
        if (baseline, end) == ("greedy", False):  # the gradient through the sampling loop instead: the same
            model.fast_teacher_forcing = False
            try:
                with tf.GradientTape() as tape:
                    through_loop = objective.replica_loss(model, batch, training=False)
                for a, b in zip(tape.gradient(through_loop.loss_sum, model.trainable_variables), grads):
                    if b is not None:
                        np.testing.assert_allclose(tf.convert_to_tensor(a).numpy(), tf.convert_to_tensor(b).numpy(),
                                                   rtol=1e-3, atol=1e-5)
                assert float(through_loop.loss_sum) == pytest.approx(float(out.loss_sum), rel=1e-4, abs=1e-4)
            finally:
                del model.fast_teacher_forcing
        # the same samples again, by hand: words, and the <end> a sample chose when the reward counts it
        state = [tf.repeat(s, 4, axis=0) for s in model.initial_state(model.encode(batch["image"]))]
        drawn = sample_captions(model, state, 7, 1.0, tf.constant([2, 11]))
        words = drawn["ids"].numpy()
        lengths = np.array([np.sum(np.cumsum(r == END_ID) == 0) for r in words])
        lengths = np.minimum(lengths, [np.sum(r > END_ID) for r in words]) + (drawn["ended"].numpy() if end else 0)
        reward = CiderD(frequencies).scores(words, lengths, references, np.repeat(np.arange(3), 4)).numpy()
        r = reward.reshape(3, 4)
        if baseline == "mean":
            b = ((r.sum(1, keepdims=True) - r) / 3).reshape(-1)
        else:  # beam search's greedy caption: its words, then <end> when it stopped before 7 words
            best = beam_search(model, None, beam_size=1, max_length=7,
                               initial_state=model.initial_state(model.encode(batch["image"])))
            g_words, g_len = best["ids"][:, 0].numpy(), best["lengths"][:, 0].numpy()
            g_ended = g_len < 7
            assert g_ended.all()  # what the test is about: greedy captions that chose <end>
            if end:
                g_words[np.arange(3), g_len] = END_ID
            b = np.repeat(CiderD(frequencies).scores(g_words, g_len + (g_ended if end else 0), references).numpy(), 4)
        expected = -np.sum((reward - b) * drawn["log_prob"].numpy())
        assert float(out.loss_sum) == pytest.approx(expected, rel=1e-4, abs=1e-4)
        assert float(out.weight) == 12
        assert float(out.sums["reward"]) == pytest.approx(reward.sum(), rel=1e-5)
        assert float(out.sums["baseline"]) == pytest.approx(b.sum(), rel=1e-5)
        assert float(out.sums["ended"]) == drawn["ended"].numpy().sum()


def references_batch():
    """3 images with 2 references each, of different lengths (tokens != captions), and their frequencies."""
    from captioning.train.cider import document_frequencies

    rng = np.random.default_rng(6)
    lengths = [3, 5, 4, 6, 2, 5]  # 2 references per image, of different lengths: tokens != captions
    ids = [[1] + list(rng.integers(4, V, n)) + [END_ID] for n in lengths]
    width = max(map(len, ids)) - 1
    target = np.array([(r[1:] + [0] * width)[:width] for r in ids])
    batch = {"image": images(3, seed=5), "image_index": np.repeat(np.arange(3), 2).astype(np.int32),
             "input_ids": np.array([(r[:-1] + [0] * width)[:width] for r in ids]), "target_ids": target,
             "mask": (target != 0).astype(np.float32)}
    return batch, document_frequencies([[r[1:-1] for r in ids[i:i + 2]] for i in (0, 2, 4)], vocab_size=V)


def test_xe_weight_adds_the_references_cross_entropy_per_token(memorised):
    """scst.xe_weight w: loss = SCST's mean per sample + w × the references' cross-entropy mean per real token,
    its gradient SCST's + w × the cross-entropy's, each computed alone on the same samples (the seed and step);
    w = 0 leaves the loss and the parts as they were; the term is reported as the part ``xe``."""
    from captioning.train.cider import CiderD
    from captioning.train.objectives import caption_loss_sum
    from captioning.train.objectives.scst import SelfCritical

    batch, frequencies = references_batch()
    tokens = float(batch["mask"].sum())
    step, model, weights = tf.Variable(11, dtype=tf.int64), memorised, memorised.trainable_variables

    def loss_and_gradient(fn):
        with tf.GradientTape() as tape:
            loss = fn()
        return float(loss), [tf.convert_to_tensor(g).numpy() if g is not None else 0.0
                             for g in tape.gradient(loss, weights)]

    outs = {}

    def scst(w):
        # drawn without XLA (the term is the references' and the reward the samples', however drawn): no compile
        settings = ScstSettings(samples=4, max_length=7, xe_weight=w, xla_sampling=False)
        objective = SelfCritical(CiderD(frequencies), settings, step, seed=2)
        outs[w] = objective, objective.replica_loss(model, batch, training=False)
        return outs[w][1].loss_sum / outs[w][1].weight

    plain, plain_grads = loss_and_gradient(lambda: scst(0.0))
    mixed, mixed_grads = loss_and_gradient(lambda: scst(0.5))
    xe, xe_grads = loss_and_gradient(lambda: caption_loss_sum(model, batch) / tokens)
    assert outs[0.0][0].parts == ("reward", "baseline", "ended") and set(outs[0.0][1].sums) == set(outs[0.0][0].parts)
    assert outs[0.5][0].parts == ("reward", "baseline", "ended", "xe")
    assert float(outs[0.5][1].sums["xe"]) / 12 == pytest.approx(xe, rel=1e-6)  # reported per sample: the mean
    assert float(outs[0.5][1].sums["reward"]) == pytest.approx(float(outs[0.0][1].sums["reward"]))  # same samples
    assert xe > 1.0 and mixed == pytest.approx(plain + 0.5 * xe, rel=1e-5)
    for a, b, c in zip(mixed_grads, plain_grads, xe_grads):
        np.testing.assert_allclose(a, np.asarray(b) + 0.5 * np.asarray(c), rtol=1e-4, atol=1e-6)
    assert max(np.abs(np.asarray(c)).max() for c in xe_grads) > 1e-3  # the term moves the gradient


def test_each_micro_batch_of_an_accumulated_step_draws_its_own_samples():
    """train.accumulate_steps: the batch's micro-batch index is folded into the step's seed from the second
    micro-batch on; the first draws what a single step draws. (An untrained model, whose every word is about
    equally likely: samples of the memorised model, one caption at p ≈ 0.44 or, trained on another CPU,
    higher, could agree under two seeds.)"""
    from captioning.model import build_model
    from captioning.train.cider import CiderD
    from captioning.train.objectives.base import MICRO_BATCH
    from captioning.train.objectives.scst import SelfCritical

    model = build_model(V, model_config(encoder="small_cnn", embedding_size=16, lstm_units=16, dropout=0.0), 32,
                        seed=5).build_all()
    batch, frequencies = references_batch()
    settings = ScstSettings(samples=4, max_length=7, xla_sampling=False)
    objective = SelfCritical(CiderD(frequencies), settings, tf.Variable(11), seed=2)
    drawn = {i: objective.rewards(model, batch if i is None else {**batch, MICRO_BATCH: tf.constant(i)})["ids"].numpy()
             for i in (None, 0, 1)}
    assert len({tuple(row) for row in drawn[None]}) > 6  # 12 samples, nearly all different
    np.testing.assert_array_equal(drawn[0], drawn[None])
    assert (drawn[1] != drawn[None]).any(axis=1).sum() > 6  # most of micro-batch 1's samples are others


@pytest.fixture(scope="module")
def memorised():
    """A tiny Show and Tell trained here (1.5 s) to caption the images of ``images(3, seed=5)`` "5 6 7
    <end>" (p ≈ 0.44: sampled at temperature 1, about half the samples are that caption)."""
    from captioning.model import build_model
    from captioning.train.objectives import caption_loss_sum

    model = build_model(V, model_config(encoder="small_cnn", embedding_size=16, lstm_units=16, dropout=0.0), 32,
                        seed=5).build_all()
    batch = {"features": model.encode(images(3, seed=5)), "input_ids": np.array([[START_ID, 5, 6, 7]] * 3),
             "target_ids": np.array([[5, 6, 7, END_ID]] * 3), "mask": np.ones((3, 4), np.float32)}
    optimizer = tf.keras.optimizers.Adam(0.1)
    for _ in range(15):
        with tf.GradientTape() as tape:
            loss = caption_loss_sum(model, batch)
        optimizer.apply_gradients(zip(tape.gradient(loss, model.decoder_variables()), model.decoder_variables()))
    return model


@pytest.mark.parametrize("end_in_reward", [True, False])
def test_a_sample_identical_to_the_greedy_caption_has_no_advantage(memorised, end_in_reward):
    """The greedy baseline is scored exactly as a sample: a sample of the greedy caption's words (and its
    <end>) gets reward − baseline = 0, whether the reward counts <end> or not; the other samples do not."""
    from captioning.train.cider import CiderD, document_frequencies
    from captioning.train.objectives.scst import SelfCritical

    model, features = memorised, memorised.encode(images(3, seed=5))[:2]  # "5 6 7 <end>", the likeliest caption
    refs = [[[5, 6, 7], [5, 6, 9, 8]], [[10, 11, 7, 8], [4, 6, 7]]]
    flat = [r for image in refs for r in image]
    width = max(map(len, flat)) + 1
    target = np.array([(r + [END_ID] + [0] * width)[:width] for r in flat])
    batch = {"features": features, "image_index": np.repeat(np.arange(2), 2).astype(np.int32),
             "target_ids": target, "mask": (target != 0).astype(np.float32)}
    with_end = [[r + [END_ID] for r in image] for image in refs] if end_in_reward else refs
    frequencies = document_frequencies(with_end, vocab_size=V, end_token=end_in_reward)
    cfg = ScstSettings(samples=16, baseline="greedy", max_length=6, temperature=1.0, end_in_reward=end_in_reward,
                     xla_sampling=False)
    objective = SelfCritical(CiderD(frequencies), cfg, tf.Variable(1, dtype=tf.int64))
    out = {k: v.numpy() for k, v in objective.rewards(model, batch).items()}
    assert out["greedy"].tolist() == [[5, 6, 7, END_ID, PAD_ID, PAD_ID]] * 2  # written as a sample is
    same = (out["ids"] == np.repeat(out["greedy"], 16, axis=0)).all(axis=1)
    assert 0 < same[:16].sum() < 16  # some samples of image 0 are the greedy caption, some are not
    advantage = out["reward"] - out["baseline"]
    np.testing.assert_allclose(advantage[same], 0.0, atol=1e-6)
    assert out["reward"][:16][same[:16]].min() > 1 and np.abs(advantage[~same]).max() > 0.1


def fitted(path=None, overrides=()):
    from captioning.config import validate
    from captioning.model import resolve
    from captioning.train.objectives import fit_config

    cfg = fit_config(resolve(load_config(path, ["data.dir=d", *overrides])))
    validate(cfg)
    return cfg


@pytest.mark.parametrize("overrides, fragment", [
    (["train.objective=scst", "data.captions_per_image=sample"],
     "train.objective: scst needs data.captions_per_image: grouped, but data.captions_per_image is sample (with --set)"),
    (["train.objective=scst", "data.captions_per_image=all"], "data.captions_per_image is all (with --set)"),
    (["train.objective=scst", "data.captions_per_image=grouped", "data.group_captions=3"],
     "train.objective: scst needs data.group_captions: 0, but data.group_captions is 3"),
    (["train.objective=scst", "scst.samples=1"], "scst.samples (1) must be at least 2 with scst.baseline: mean"),
    (["train.objective=scst", "scst.temperature=0"], "config key scst.temperature must be in (0, 100], got 0.0"),
    (["train.objective=scst", "train.jit_compile=true"], "train.jit_compile does not apply to train.objective: scst"),
    (["train.objective=scts"], "config key train.objective must be one of xe, scst, got 'scts'"),
])
def test_scst_config_errors(overrides, fragment):
    with pytest.raises(InputError, match=re.escape(fragment)):
        fitted(overrides=overrides)


def test_choosing_scst_brings_the_grouped_batches_it_needs(tmp_path):
    """A cross-entropy config (its captions_per_image at the default, given in the file or not) with
    train.objective=scst trains on grouped batches; only an explicit other choice is refused (above)."""
    assert fitted(overrides=["train.objective=scst"]).data.captions_per_image == "grouped"
    config = tmp_path / "xe.yaml"
    config.write_text("data:\n  captions_per_image: all\n  group_captions: 0\n")
    cfg = fitted(str(config), ["train.objective=scst"])
    assert (cfg.data.captions_per_image, cfg.data.group_captions) == ("grouped", 0)
    assert fitted(str(config)).data.captions_per_image == "all"  # cross-entropy keeps its own


SCST = ["train.objective=scst", "data.captions_per_image=grouped", "train.optimizer=adam", "train.learning_rate=0.001",
        "scst.samples=3", "train.batch_size=10", "scst.max_length=20"]  # the shapes captions have up to 18 words
TRAINED = ["model.embedding_size=32", "model.lstm_units=32"]  # conftest's trained_model_dir


def test_a_max_length_shorter_than_the_references_is_warned(prepared_dir, tmp_path, caplog):
    """Samples cut at scst.max_length are rewarded cut: training warns when over 1% of references are longer."""
    from captioning.data.prepared import PreparedDataset
    from captioning.train.objectives import RunContext, resolve
    from captioning.train.objectives.scst import SelfCritical

    class Folder:  # what the objective asks of the model folder
        def __init__(self, path):
            self.document_frequencies_file = path

    dataset, step = PreparedDataset.load(prepared_dir), tf.Variable(0, dtype=tf.int64)
    logger = logging.getLogger("captioning.train")
    logger.addHandler(caplog.handler)
    try:
        # the fixture's captions have 6 to 18 words; train.scheduled_sampling is said to be unused under SCST
        for max_length, warned, ss in ((20, False, "0"), (6, True, "0.25")):
            caplog.clear()
            cfg = resolve(small_train_config(prepared_dir, *SCST, f"scst.max_length={max_length}",
                                             f"train.scheduled_sampling.max={ss}"))
            SelfCritical.for_run(RunContext(cfg, step, dataset, None, Folder(str(tmp_path / "df.npz"))))
            said = re.search(rf"(\d+\.\d)% of the train references have more than scst.max_length={max_length} "
                             "words", caplog.text)
            assert bool(said) == warned and (not said or float(said.group(1)) > 50), caplog.text
            unused = "train.scheduled_sampling is not used under train.objective: scst" in caplog.text
            assert unused == (ss != "0"), caplog.text
    finally:
        logger.removeHandler(caplog.handler)


# SCST from a cross-entropy model, in a new folder (--init-from) and in the same one, resumed: one run of each
# in tests/test_train_start.py's test_switching_a_cross_entropy_run_to_scst_with_set_brings_grouped_batches


@pytest.mark.slow
def test_mirrored_scst_equals_one_device(distributed_runs):
    """With scst.xe_weight 0.5 (the references' cross-entropy term reported as the part xe): the same reward,
    term, loss and update on 2 replicas as on one device."""
    r = np.load(os.path.join(distributed_result(distributed_runs, "mirrored", "scst"), "mirrored_scst.npz"))
    assert int(r["images"]) == 4 and float(r["one_tokens"]) == float(r["two_tokens"]) == 12  # 4 images × 3 samples
    assert float(r["one_reward"]) > 0 and float(r["two_reward"]) == pytest.approx(float(r["one_reward"]), abs=1e-6)
    assert float(r["one_xe"]) > 0 and float(r["two_xe"]) == pytest.approx(float(r["one_xe"]), rel=1e-6)
    assert float(r["two_loss"]) == pytest.approx(float(r["one_loss"]), abs=1e-5)
    names = [k[len("one/"):] for k in r.files if k.startswith("one/")]
    for name in names:
        np.testing.assert_allclose(r["two/" + name], r["one/" + name], atol=1e-5, err_msg=name)


@pytest.mark.slow
def test_multi_worker_scst_ends_with_identical_weights(distributed_runs):
    out = distributed_result(distributed_runs, "multi_worker", "scst")
    a, b = np.load(os.path.join(out, "weights-0.npz")), np.load(os.path.join(out, "weights-1.npz"))
    assert int(a["replicas"]) == 2 and len(a["losses"]) == 4
    for name in a.files:
        np.testing.assert_array_equal(a[name], b[name], err_msg=name)
