"""``train.accumulate_steps``: K micro-batches per optimizer step give the update of one batch K times larger (to
float tolerance: grouped captions with split padding, SGD and Adam, 2 replicas one of which gets an empty
micro-batch), and the step counter, the logs and the learning-rate schedule count optimizer steps.

The 2-replica check (tests/harness/scenarios.py's ``accumulate``) runs in the process of conftest's
``distributed_runs`` (logical CPU devices must be configured before TensorFlow starts), as the scenario
``mirrored/accumulate``."""

import os

import numpy as np
import pytest

from tests.harness.scenarios import GROUPED, grouped_batches, joined
from tests.harness.training import restore, snapshot
from tests.helpers import REPO, distributed_result, run_cli, small_train_config


@pytest.mark.slow
def test_an_accumulated_step_equals_one_step_on_the_joined_batch(prepared_dir, tmp_path):
    """From the same weights and optimizer state, 2 micro-batches of 2 images (about 10 captions of their own
    lengths, split padding) update the weights as one step on the 4 images joined, with SGD and Adam; the
    step counter and the optimizer's iterations advance once."""
    import tensorflow as tf

    from captioning.experiment import for_training
    from captioning.train import Trainer

    for optimizer in ("sgd", "adam"):
        cfg = small_train_config(prepared_dir, *GROUPED, f"train.optimizer={optimizer}", "train.learning_rate=0.05",
                                 "train.batch_size=10", "train.accumulate_steps=2")
        trainer = Trainer(for_training(cfg), str(tmp_path / optimizer), strategy=tf.distribute.OneDeviceStrategy("/cpu:0"))
        first, second = grouped_batches(cfg, 2, images=2)
        tokens = [float(tf.reduce_sum(b["mask"])) for b in (first, second)]
        assert tokens[0] != tokens[1]  # a mean of the micro-batches' means would weigh their tokens wrongly
        start, trained = snapshot(trainer), [v.numpy() for v in trainer.model.trainable_variables]

        big = tf.data.Dataset.from_tensors(joined(first, second))
        one_step = trainer._compiled(trainer._train_step, big)  # the single step, as accumulate_steps: 1 runs it
        expected = {k: float(v) for k, v in one_step(joined(first, second)).items()}
        after_one = [v.numpy() for v in trainer.model.trainable_variables]
        restore(trainer, start)

        micro = tf.data.Dataset.from_tensors(first).concatenate(tf.data.Dataset.from_tensors(second))
        got = {k: float(v) for k, v in trainer.train_step_for(micro)([first, second]).items()}
        assert got["weight"] == expected["weight"] == sum(tokens)
        assert got["loss"] == pytest.approx(expected["loss"], rel=1e-6)
        assert got["gradient_norm"] == pytest.approx(expected["gradient_norm"], rel=1e-5)
        assert got["gradient_norm"] > 0.05  # clipped
        for v, want in zip(trainer.model.trainable_variables, after_one):
            np.testing.assert_allclose(v.numpy(), want, rtol=1e-5, atol=1e-7, err_msg=f"{optimizer} {v.name}")
        moved = max(float(np.max(np.abs(v.numpy() - s))) for v, s in zip(trainer.model.trainable_variables, trained))
        assert moved > 1e-3  # the step did update the weights
        assert int(trainer.step.numpy()) == int(trainer.optimizer.iterations.numpy()) == 1


@pytest.mark.slow
def test_steps_counted_in_optimizer_steps_and_k_steps_a_call(prepared_dir, tmp_path):
    """An epoch of 4 micro-batches a step is a quarter of the batches; the schedule decays per optimizer steps;
    ``train.steps`` counts optimizer steps (one TensorBoard point, one checkpoint number, one optimizer update
    each); ``train.steps_per_execution: 2`` (each step reading its micro-batches inside the call) trains the same
    as single calls. With ``train.ema_decay`` the weight average moves once per optimizer step: the one-call run's
    average recomputed from the weights each of its steps saved (tests/harness/averages.py)."""
    from captioning.experiment import for_training
    from captioning.train import Trainer
    from tests.harness.training import scalars
    from tests.harness.averages import (assert_same, averaged_positions, averages, checkpoint_averages, next_average,
                                        raw, statistics_positions)
    from tests.harness.scenarios import DECAY

    common = ("data.random_crop=false", "train.steps=2", "train.batch_size=8", "train.accumulate_steps=4",
              "train.optimizer=adam", "train.learning_rate=0.01", "train.lr_schedule=step",
              "train.lr_decay_epochs=2", "train.lr_decay_factor=0.5", f"train.ema_decay={DECAY}")
    runs, start = {}, None
    for k in (1, 2):  # single calls save each step (for the average's check): a call never runs past a save
        saves = ("train.checkpoint_every_steps=1",) if k == 1 else ()
        trainer = Trainer(for_training(small_train_config(prepared_dir, *common, *saves,
                                                          f"train.steps_per_execution={k}")), str(tmp_path / f"k{k}"))
        start = start or averages(trainer)  # the average starts from the initial weights (the same for both)
        runs[k] = trainer, trainer.run(progress=False)
    (one, single), (two, several) = runs[1], runs[2]
    # 32 training images x 5 captions / 8 = 20 batches an epoch: 5 optimizer steps; the rate halves every 10
    assert one.steps_per_epoch == 5 and one.optimizer._learning_rate.decay_steps == 10
    assert "4 micro-batches a step" in one.plan.describe() and one.plan.step_captions == 32  # examples/s counts 32
    assert single.step == several.step == 2 and len(single.losses) == len(several.losses) == 2
    assert int(one.optimizer.iterations.numpy()) == int(two.optimizer.iterations.numpy()) == 2
    np.testing.assert_allclose(several.losses, single.losses, rtol=1e-5)
    for a, b in zip(two.model.variables, one.model.variables):
        np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-4, atol=1e-6, err_msg=a.name)
    assert sorted(scalars(tmp_path / "k1" / "logs" / "train", "loss")) == [1, 2]
    for k, saved in ((1, ["ckpt-1.index", "ckpt-2.index"]), (2, ["ckpt-2.index"])):
        assert sorted(p.name for p in (tmp_path / f"k{k}").iterdir() if p.name.endswith(".index")) == saved

    # the average: 2 optimizer steps of 4 micro-batches each, one move a step
    positions, expected = averaged_positions(one.model), start
    for number in (1, 2):
        one.checkpoint.restore(str(tmp_path / "k1" / f"ckpt-{number}")).expect_partial()
        expected = next_average(expected, raw(one.model, positions), statistics_positions(one.model))
    assert_same(checkpoint_averages(str(tmp_path / "k1" / "ckpt-2")), expected)
    assert_same(checkpoint_averages(str(tmp_path / "k2" / "ckpt-2")), expected, rtol=1e-4)


@pytest.mark.slow
def test_two_replicas_with_an_empty_micro_batch_equal_one_device(distributed_runs):
    """Mirrored over 2 logical CPUs, 2 micro-batches, the second of which leaves replica 1 without an example:
    the loss, the gradient norm and the weights after the update are one device's on the 3 batches joined."""
    got = np.load(os.path.join(distributed_result(distributed_runs, "mirrored", "accumulate"), "mirrored.npz"))
    assert got["replicas"] == 2 and got["empty_captions"] == 0
    assert got["two_weight"] == got["one_weight"] > 0
    assert float(got["two_loss"]) == pytest.approx(float(got["one_loss"]), rel=1e-6)
    assert float(got["two_norm"]) == pytest.approx(float(got["one_norm"]), rel=1e-5)
    names = [k[len("one/"):] for k in got.files if k.startswith("one/")]
    assert names
    for name in names:
        np.testing.assert_allclose(got[f"two/{name}"], got[f"one/{name}"], rtol=1e-5, atol=1e-7, err_msg=name)
    assert int(got["two_step"]) == 1


@pytest.mark.slow
def test_the_issue_command_trains_with_accumulation(prepared_dir, tmp_path):
    """``captioning train --config experiments/shapes.yaml --set train.ema_decay=0.999 --set
    train.accumulate_steps=4 --model-dir runs/ema``, on the fixture for 2 steps (4 s: the quick loop's check
    of accumulation)."""
    model_dir = tmp_path / "ema"
    result = run_cli("train", "--config", os.path.join(REPO, "experiments", "shapes.yaml"), "--set",
                     "train.ema_decay=0.999", "--set", "train.accumulate_steps=4", "--model-dir", str(model_dir),
                     "--set", f"data.dir={prepared_dir}", "--set", "train.steps=2", "--set", "train.batch_size=8",
                     "--set", "model.embedding_size=32", "--set", "model.lstm_units=32", "--set",
                     "train.eval_every_steps=0")
    assert result.returncode == 0, result.stderr[-3000:]
    # 160 captions / 8 = 20 micro-batches an epoch, 4 a step
    assert "4 micro-batches a step" in result.stderr and "5 steps per epoch" in result.stderr, result.stderr[-2000:]
    assert (model_dir / "ckpt-2.index").exists() and not (model_dir / "ckpt-8.index").exists()
    import tensorflow as tf

    saved = tf.train.load_checkpoint(str(model_dir / "ckpt-2"))  # 2 updates of 4 micro-batches, and the average
    assert saved.get_tensor("step/.ATTRIBUTES/VARIABLE_VALUE") == 2
    assert saved.get_tensor("optimizer/_iterations/.ATTRIBUTES/VARIABLE_VALUE") == 2
    assert any(name.startswith("ema/") for name in saved.get_variable_to_shape_map())

