"""The training kit Transformers need: the noam schedule, AdamW's decoupled weight decay, label smoothing."""

import os

import keras
import numpy as np
import pytest
import tensorflow as tf

from captioning.config import load_config
from captioning.errors import InputError
from captioning.train.optimizer import LearningRate, make_optimizer
from tests.harness.scenarios import KINDS, SHAPES, optimizer_of, random_gradients, run_updates
from tests.helpers import distributed_result, model_config, small_train_config


def test_noam_rises_linearly_then_falls_as_the_inverse_square_root():
    peak = (512 * 20_000) ** -0.5  # 3.125e-4: self-critical.pytorch's NoamOpt(512, factor 1, warmup 20000)
    noam = LearningRate(peak, "noam", decay_steps=1, factor=0.5, total_steps=10**6, warmup_steps=20_000)
    rates = {step: float(noam(step - 1)) for step in (1, 10_000, 20_000, 80_000, 320_000)}  # the step-th update
    assert rates[20_000] == pytest.approx(peak, rel=1e-6)  # the peak, at the end of the warm-up
    assert rates[10_000] == pytest.approx(peak / 2, rel=1e-5) and rates[80_000] == pytest.approx(peak / 2, rel=1e-5)
    for step, rate in rates.items():  # NoamOpt's d_model^-0.5 · min(s^-0.5, s · w^-1.5), step by step
        assert rate == pytest.approx(512 ** -0.5 * min(step ** -0.5, step * 20_000 ** -1.5), rel=1e-5)
    with pytest.raises(InputError, match="train.lr_schedule: noam rises over train.warmup_steps, which must be at "
                                         "least 1, got 0"):
        load_config(None, ["train.lr_schedule=noam"])


def test_adamw_decays_the_weights_by_the_rate_times_the_decay():
    cfg = load_config(None, ["train.optimizer=adamw", "train.weight_decay=0.1", "train.learning_rate=0.5",
                             "train.lr_schedule=constant"]).train
    optimizer = make_optimizer(cfg, steps_per_epoch=10, mixed_float16=False)
    variable = tf.Variable([2.0, -4.0])
    optimizer.build([variable])
    optimizer.apply([tf.zeros(2)], [variable])  # no gradient: only the decay moves it
    np.testing.assert_allclose(variable.numpy(), np.array([2.0, -4.0]) * (1 - 0.5 * 0.1), rtol=1e-6)
    assert isinstance(make_optimizer(load_config(None, ["train.optimizer=adam"]).train, 10, False), keras.optimizers.Adam)


def test_label_smoothing_is_the_smoothed_cross_entropy_and_perplexity_stays_plain():
    from captioning.model import build_model
    from captioning.train.objectives import caption_loss_sum

    model = build_model(30, model_config(encoder="small_cnn", embedding_size=8, lstm_units=8, dropout=0.0), 32).build_all()
    rng = np.random.default_rng(0)
    ids = rng.integers(4, 30, (3, 6)).astype(np.int64)
    mask = np.ones((3, 6), np.float32)
    mask[2, 3:] = 0
    batch = {"image": rng.integers(0, 256, (3, 32, 32, 3), dtype=np.uint8), "input_ids": ids,
             "target_ids": np.roll(ids, -1, axis=1), "mask": mask}
    plain, _, same = caption_loss_sum(model, batch, parts=True)
    assert float(same) == pytest.approx(float(plain))
    ce, _, smoothed = caption_loss_sum(model, batch, parts=True, label_smoothing=0.1)
    logp = tf.nn.log_softmax(model({"image": batch["image"], "input_ids": ids})).numpy()
    picked = np.take_along_axis(logp, batch["target_ids"][..., None], axis=-1)[..., 0]
    expected = ((0.9 * -picked + 0.1 * -logp.mean(axis=-1)) * mask).sum()
    assert float(smoothed) == pytest.approx(expected, rel=1e-5) and float(ce) == pytest.approx(float(plain))
    assert float(caption_loss_sum(model, batch, label_smoothing=0.1)) == pytest.approx(expected, rel=1e-5)


@pytest.mark.slow
def test_a_transformer_trains_with_the_kit(prepared_dir, tmp_path):
    """noam, AdamW and label smoothing together through the training loop: the loss it minimises is the
    smoothed one, above the plain cross-entropy it reports for perplexity."""
    from captioning.experiment import for_training
    from captioning.train import Trainer

    cfg = small_train_config(prepared_dir, "model.decoder=transformer", "model.d_model=16", "model.heads=2",
                             "model.ff_size=24", "model.encoder_layers=1", "model.decoder_layers=2",
                             "train.optimizer=adamw", "train.lr_schedule=noam", "train.warmup_steps=4",
                             "train.learning_rate=0.003", "train.label_smoothing=0.1", "train.steps=12")
    trainer = Trainer(for_training(cfg), str(tmp_path / "m"))
    assert type(trainer.optimizer).__name__ == "AdamW"
    result = trainer.run(progress=False)
    assert result.step == 12 and np.isfinite(result.losses).all()
    assert np.mean(result.losses[-4:]) < np.mean(result.losses[:4])


# The fused updates (captioning.train.optimizer._FusedUpdates) against Keras' own element-wise ones: every kind the
# config can ask for (tests/harness/scenarios.py's KINDS, the same variables and gradients as its scenario ``fused``).
KERNELS = {"sgd": "ResourceApplyGradientDescent", "momentum": "ResourceApplyKerasMomentum",
           "adam": "ResourceApplyAdam", "adamw": "ResourceApplyAdam"}


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_each_variable_is_updated_by_one_fused_kernel_with_keras_own_result(kind, tmp_path):
    gradients = random_gradients(6)
    fused, fused_opt, fused_ops = run_updates(kind, True, gradients)
    keras_own, keras_opt, keras_ops = run_updates(kind, False, gradients)
    assert fused_ops.count(KERNELS[kind]) == len(SHAPES) and KERNELS[kind] not in keras_ops
    # ops a variable saves: SGD's multiply and subtract, momentum's 7, Adam's 30 (of a 153-op graph)
    assert len(keras_ops) - len(fused_ops) >= len(SHAPES) * {"sgd": 1, "momentum": 6}.get(kind, 25)
    # the same variables, slots included, under the same names: checkpoints are Keras' own
    names = [[v.path.split("/", 1)[1] for v in opt.variables] for opt in (fused_opt, keras_opt)]
    assert names[0] == names[1] and len(names[0]) == 1 + len(SHAPES) * {"sgd": 0, "momentum": 1}.get(kind, 2)
    # SGD's kernels give Keras' bits; Adam's computes 1 - beta_2 in float32 (0.00099998713, not 0.001)
    exact = kind in ("sgd", "momentum")
    for a, b in zip(fused + list(fused_opt.variables), keras_own + list(keras_opt.variables)):
        if exact:
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
        else:
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=5e-5, atol=1e-6)
    assert not np.allclose(fused[0].numpy(), run_updates(kind, True, [])[0][0].numpy())  # they moved
    # a checkpoint of Keras' own optimizer carries on under the fused one, as it would under Keras'
    path = tf.train.Checkpoint(optimizer=keras_opt, variables=keras_own).write(str(tmp_path / "ckpt"))
    more = random_gradients(3, seed=2)
    resumed, _, _ = run_updates(kind, True, more, start=path)
    continued, _, _ = run_updates(kind, False, more, start=path)
    for a, b in zip(resumed, continued):
        np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=5e-5, atol=1e-6)


def test_a_sparse_gradient_takes_keras_own_update():
    """An embedding's gradient as IndexedSlices (Keras' sparse update) beside dense ones, in one apply."""
    results = []
    for fused in (True, False):
        variables = [tf.Variable(np.ones((6, 3), np.float32)), tf.Variable(np.ones(3, np.float32))]
        optimizer = optimizer_of("adam", fused, variables)
        sparse = tf.IndexedSlices(tf.constant([[1.0, 2.0, 3.0]]), tf.constant([4]), tf.constant([6, 3]))
        optimizer.apply([sparse, tf.constant([0.5, -1.0, 0.0])], variables)
        results.append([v.numpy() for v in variables])
    for a, b in zip(*results):
        np.testing.assert_allclose(a, b, rtol=1e-6)
    assert (results[0][0][4] != 1).all() and (results[0][0][:4] == 1).all()


@pytest.mark.slow
@pytest.mark.parametrize("group", ["mirrored", "multi_worker"])
def test_the_fused_updates_under_two_replicas_are_keras_own_on_one_device(group, distributed_runs):
    out = distributed_result(distributed_runs, group, "fused")
    files = sorted(f for f in os.listdir(out) if f.startswith("fused-"))
    assert files == (["fused-one.npz"] if group == "mirrored" else ["fused-0.npz", "fused-1.npz"])
    results = [np.load(os.path.join(out, f)) for f in files]
    r = results[0]
    assert int(r["replicas"]) == 2
    names = [k[len("two/"):] for k in r.files if k.startswith("two/")]
    assert sorted(names) == sorted(k[len("one/"):] for k in r.files if k.startswith("one/"))
    assert {n.split("/")[0] for n in names} == set(KINDS)
    for name in names:
        exact = name.startswith(("sgd/", "momentum/"))
        np.testing.assert_allclose(r["two/" + name], r["one/" + name], rtol=0 if exact else 5e-5,
                                   atol=0 if exact else 1e-6, err_msg=name)
        for other in results[1:]:  # the other worker ends with the same variables
            np.testing.assert_array_equal(other["two/" + name], r["two/" + name], err_msg=name)
