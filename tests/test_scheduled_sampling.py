"""``train.scheduled_sampling`` (captioning/model/scheduled_sampling.py, the cross-entropy objective): the mixed
pass of every decoder that takes it, on the tiny models of the decoder contract (tests/test_decoders.py);
the schedule in the graph against the config's; the Transformer refused; the issue's command."""

import os

import numpy as np
import pytest
import tensorflow as tf
import yaml

from captioning.config import load_config
from captioning.config.sections import ScheduledSamplingConfig
from captioning.errors import InputError
from captioning.config import ModelConfig
from captioning.model import DECODERS, build_model
from captioning.model import scheduled_sampling as ss
from captioning.train.objectives import CrossEntropy, caption_loss_sum, fit_config
from captioning.train.objectives.base import step_seed
from captioning.vocab import END_ID, PAD_ID, START_ID, UNK_ID
from tests.helpers import run_cli
from tests.harness.models import V, inputs, npy, region_batch, tiny, tiny_regions

TAKE = sorted(name for name, cls in DECODERS.items() if cls.scheduled_sampling)
SEED = tf.constant([3, 4], tf.int64)


def batch_of(images, ids):
    """A training batch: inputs, the targets (the inputs shifted, <end> as 2) and their mask."""
    targets = np.concatenate([ids[:, 1:], np.zeros_like(ids[:, :1])], axis=1)
    targets[np.arange(len(ids)), (ids != PAD_ID).sum(1) - 1] = 2
    return {"image": images, "input_ids": ids, "target_ids": targets, "mask": (ids != PAD_ID).astype(np.float32)}


def test_the_recurrent_decoders_take_it_and_the_transformer_does_not():
    assert TAKE == ["attention", "show_and_tell", "updown"] and not DECODERS["transformer"].scheduled_sampling


@pytest.mark.parametrize("name", TAKE)
def test_the_mixed_pass_feeds_the_models_own_words_with_the_probability(name):
    """p = 0: exactly the teacher-forced logits (through the model's pass as training calls it); p = 1: every real
    word after <start> is a draw, and the logits are those of the teacher-forced pass fed the drawn words,
    padding kept; the gradients are finite and equal that pass's (none flows through the choice)."""
    model = tiny(name)
    images, ids = inputs(seed=1)
    ids[0, 4:] = PAD_ID  # a shorter caption: its padding stays padding
    full = npy(model({"image": images, "input_ids": ids}))
    none = npy(model.logits_and_penalty({"image": images, "input_ids": ids}, sampling=(0.0, SEED))[0])
    np.testing.assert_array_equal(none, full)
    state = model.initial_state(model.encode(images))
    mixed = ss.mixed_teacher_forced(model, state, tf.constant(ids), 1.0, SEED, training=False)
    words, replaced = npy(mixed.words), npy(mixed.replaced)
    np.testing.assert_array_equal(replaced, (ids != PAD_ID) & (np.arange(ids.shape[1]) >= 1))
    assert (words[:, 0] == ids[:, 0]).all() and (words[0, 4:] == PAD_ID).all()
    assert (words[replaced] != ids[replaced]).mean() > 0.8  # draws from 40 words: mostly not the reference
    fed = npy(model({"image": images, "input_ids": words}))
    np.testing.assert_allclose(npy(mixed.logits), fed, atol=1e-5, rtol=0)
    again = ss.mixed_teacher_forced(model, state, tf.constant(ids), 1.0, SEED, training=False)
    np.testing.assert_array_equal(npy(again.words), words)  # stateless: the same seed, the same draws
    other = ss.mixed_teacher_forced(model, state, tf.constant(ids), 1.0, SEED + 1, training=False)
    assert (npy(other.words) != words).any()

    def gradients(batch, sampling):
        with tf.GradientTape() as tape:
            loss = caption_loss_sum(model, batch, training=False, sampling=sampling)
        return [npy(tf.convert_to_tensor(g)) for g in tape.gradient(loss, model.trainable_variables)]

    by_sampling = gradients(batch_of(images, ids), (1.0, SEED))
    reference = batch_of(images, ids)
    by_feeding = gradients({**reference, "input_ids": words}, None)  # same targets, the drawn words as inputs
    for a, b in zip(by_sampling, by_feeding):
        assert np.isfinite(a).all()
        np.testing.assert_allclose(a, b, atol=1e-6, rtol=1e-4)
    assert max(np.abs(g).max() for g in by_sampling) > 1e-4


def test_the_share_of_replaced_words_and_the_draws_follow_the_probability_and_the_model():
    """At p = 0.25 about a quarter of the replaceable words are replaced over many captions; the words drawn
    after <start> for one image follow the model's own distribution there (over the words decoding proposes)."""
    model = tiny("show_and_tell")
    model.logits.bias.assign(np.random.default_rng(0).normal(0, 1.5, V))  # a distribution far from uniform
    image, caption = inputs(seed=2, batch=1, steps=6)
    one = model.initial_state(model.encode(image))
    rows = 3000
    state = tf.nest.map_structure(lambda s: tf.repeat(s, rows, axis=0), one)
    quarter = ss.mixed_teacher_forced(model, state, tf.constant(np.repeat(caption, rows, 0)), 0.25, SEED,
                                      training=False)
    share = npy(quarter.replaced)[:, 1:].mean()
    assert abs(share - 0.25) < 0.02, share  # 15,000 decisions: one standard deviation is 0.0035
    many = 8000  # the words after <start>: one standard deviation of their shares' total distance ~0.03
    state = tf.nest.map_structure(lambda s: tf.repeat(s, many, axis=0), one)
    everything = ss.mixed_teacher_forced(model, state, tf.constant(np.repeat(caption[:, :2], many, 0)), 1.0, SEED,
                                         training=False)
    logits = model({"image": image, "input_ids": caption[:, :1]})[0]  # [1, V]: the words decoding may propose
    first = tf.nn.softmax(ss.drawable(logits))[0].numpy()
    counts = np.bincount(npy(everything.words)[:, 1], minlength=V) / many
    uniform = np.full(V, 1 / V)
    assert 0.5 * np.abs(first - uniform).sum() > 0.15  # the model's distribution is far from uniform ...
    assert 0.5 * np.abs(counts - first).sum() < 0.06  # ... and the draws follow it


def test_the_draws_never_feed_a_word_decoding_never_proposes():
    """Logits that put almost all of the softmax on ``<pad>``, ``<start>`` and ``<unk>``: the words fed are never
    one of them (decoding's mask, :func:`~captioning.model.search_tools.never_proposed`), and follow the rest of
    the distribution renormalised (here almost all on one word, ``<end>`` still drawn as decoding proposes it)."""
    model = tiny("show_and_tell")
    bias = np.zeros(V, np.float32)
    bias[[PAD_ID, START_ID, UNK_ID]] = 40.0  # exp(40) against exp(8): a full-softmax draw is one of these
    bias[END_ID], bias[7] = 4.0, 8.0  # of the others: word 7 (p 0.98), <end> (p 0.018)
    model.logits.bias.assign(bias)
    model.logits.kernel.assign(model.logits.kernel * 0.01)  # the bias decides
    image, caption = inputs(seed=6, batch=1, steps=5)
    rows = 2000
    state = tf.nest.map_structure(lambda s: tf.repeat(s, rows, axis=0), model.initial_state(model.encode(image)))
    mixed = ss.mixed_teacher_forced(model, state, tf.constant(np.repeat(caption, rows, 0)), 1.0, SEED,
                                    training=False)
    drawn = npy(mixed.words)[:, 1:]
    assert npy(mixed.replaced)[:, 1:].all()
    assert not np.isin(drawn, [PAD_ID, START_ID, UNK_ID]).any(), np.unique(drawn, return_counts=True)
    share = np.bincount(drawn.ravel(), minlength=V) / drawn.size
    assert share[7] > 0.95 and 0.005 < share[END_ID] < 0.04, share  # 8,000 draws: the renormalised softmax
    masked = npy(ss.drawable(tf.constant(bias[None] * 0.0)))[0]  # the mask itself, on equal logits
    assert (masked[[PAD_ID, START_ID, UNK_ID]] < -1e8).all() and (masked[[END_ID, 4, V - 1]] == 0).all()


def test_the_probability_in_the_graph_is_the_configs_at_every_step():
    """The in-graph schedule (from a step variable, inside one tf.function: no retrace as the step moves) equals
    ScheduledSamplingConfig.probability at the start, between and at increases, and at the maximum; off: 0."""
    step = tf.Variable(0, dtype=tf.int64)
    cases = [ScheduledSamplingConfig(start=0.0, increase=0.05, increase_every=500, max=0.25),
             ScheduledSamplingConfig(start=0.1, increase=0.03, increase_every=7, max=0.2),
             ScheduledSamplingConfig(start=0.0, increase=0.05, increase_every=500, max=0.0)]

    def in_graph(section):
        return tf.function(lambda: ss.probability(section, step), autograph=False)

    for section in cases:
        graph = in_graph(section)
        for s in (0, 1, 6, 7, 13, 14, 499, 500, 1200, 2499, 2500, 10 ** 6):
            step.assign(s)
            assert graph().numpy() == np.float32(section.probability(s)), (section, s)
    assert [cases[0].probability(s) for s in (0, 499, 500, 1200, 2500, 10 ** 6)] == [0.0, 0.0, 0.05, 0.1, 0.25, 0.25]


def test_the_objective_reports_the_probability_and_evaluation_stays_teacher_forced():
    """The cross-entropy objective reads the probability from the step counter and reports it as its part
    ``scheduled_sampling`` (per weight: the probability itself); not training, the pass is teacher-forced;
    off, the part is 0 and the loss is today's."""
    model = tiny("show_and_tell")
    model.word_embedding.embeddings.assign(model.word_embedding.embeddings * 30.0)  # the words fed matter
    images, ids = inputs(seed=3)
    batch = batch_of(images, ids)
    step = tf.Variable(1200, dtype=tf.int64)
    section = ScheduledSamplingConfig(start=0.0, increase=0.05, increase_every=500, max=0.25)
    on = CrossEntropy(scheduled_sampling=section, step=step, seed=0)
    out = on.replica_loss(model, batch, training=True)
    assert float(out.sums["scheduled_sampling"] / out.weight) == pytest.approx(0.1)
    plain = CrossEntropy().replica_loss(model, batch, training=True)
    assert float(plain.sums["scheduled_sampling"]) == 0.0 and set(plain.sums) == set(CrossEntropy.parts)
    evaluated = on.replica_loss(model, batch, training=False)
    assert float(evaluated.loss_sum) == float(CrossEntropy().replica_loss(model, batch, training=False).loss_sum)
    step.assign(10 ** 6)  # p = 0.25: the loss is the plain one of the words the mixed pass fed (the same draws)
    mixed = ss.mixed_teacher_forced(model, model.image_state(batch, training=True), tf.constant(ids), 0.25,
                                    ss.replica_seed(step_seed(0, step, batch)), training=True)
    assert npy(mixed.replaced).any()
    fed = CrossEntropy().replica_loss(model, {**batch, "input_ids": npy(mixed.words)}, training=True)
    assert float(on.replica_loss(model, batch, training=True).loss_sum) == pytest.approx(float(fed.loss_sum), rel=1e-6)
    assert abs(float(fed.loss_sum) - float(plain.loss_sum)) > 1e-3  # which the references' loss is not


def test_regions_grouped_captions_and_dropout():
    """Up-Down over regions and grouped captions (one image's state per caption) at p = 0 gives the plain pass;
    with dropout the training-mode steps drop (they differ from inference), as the teacher-forced pass does."""
    model = tiny_regions("updown", seed=3)
    _, ids = inputs(seed=4)
    regions = {**region_batch(seed=4), "input_ids": ids}
    np.testing.assert_array_equal(npy(model.logits_and_penalty(regions, sampling=(0.0, SEED))[0]), npy(model(regions)))
    grouped = {**region_batch(counts=(3, 5), seed=4), "image_index": np.array([0, 1, 1]), "input_ids": ids}
    np.testing.assert_array_equal(npy(model.logits_and_penalty(grouped, sampling=(0.0, SEED))[0]), npy(model(grouped)))
    cfg = ModelConfig(decoder="show_and_tell", encoder="small_cnn", dropout=0.5,
                      options=DECODERS["show_and_tell"].tiny_settings)
    dropping = build_model(V, cfg, 32).build_all()
    images, ids = inputs(seed=5)
    feed = {"image": images, "input_ids": ids}
    trained = npy(dropping.logits_and_penalty(feed, training=True, sampling=(0.0, SEED))[0])
    assert np.abs(trained - npy(dropping(feed))).max() > 1e-3


def test_a_decoder_that_does_not_take_it_is_refused_in_one_line(tmp_path):
    """The Transformer: one line naming the decoder and the key, exit 2, before anything is written; off (max 0),
    or under SCST (whose captions are the model's own samples: it ignores the section), it is accepted."""
    on = ["train.scheduled_sampling.max=0.25", "model.decoder=transformer"]
    with pytest.raises(InputError, match="train.scheduled_sampling does not apply to model.decoder transformer"):
        fit_config(load_config(None, on))
    assert fit_config(load_config(None, ["model.decoder=transformer"])).train.scheduled_sampling.max == 0
    fit_config(load_config(None, [*on, "train.objective=scst"]))
    folder = tmp_path / "ss"
    done = run_cli("train", "--config", "experiments/shapes.yaml", "--set", "model.decoder=transformer",
                   "--set", "train.scheduled_sampling.max=0.25", "--model-dir", folder)
    assert done.returncode == 2 and "Traceback" not in done.stderr
    errors = [line for line in done.stderr.splitlines() if "error" in line]
    assert len(errors) == 1 and "model.decoder transformer" in errors[0] and "train.scheduled_sampling" in errors[0]
    assert "show_and_tell" in errors[0] and not folder.exists()


@pytest.mark.slow
def test_the_issues_command_trains(tmp_path, prepared_dir):
    """The issue's command (on the shapes fixture, two steps, no evaluation) trains with scheduled sampling
    on, and the model folder's config records the section."""
    folder = tmp_path / "runs" / "ss"
    done = run_cli("train", "--config", "experiments/shapes.yaml", "--set", "train.scheduled_sampling.start=0.0",
                   "--set", "train.scheduled_sampling.increase_every=500", "--set", "train.scheduled_sampling.max=0.25",
                   "--model-dir", folder, "--set", f"data.dir={prepared_dir}", "--set", "train.steps=2",
                   "--set", "train.eval_every_steps=0", "--set", "train.batch_size=8", "--set", "data.cache=none")
    assert done.returncode == 0, done.stderr[-3000:]
    assert "trained to step 2" in done.stdout
    with open(os.path.join(folder, "config.yaml"), encoding="utf-8") as f:
        saved = yaml.safe_load(f)
    assert saved["train"]["scheduled_sampling"] == {"start": 0.0, "increase": 0.05, "increase_every": 500,
                                                    "max": 0.25}
