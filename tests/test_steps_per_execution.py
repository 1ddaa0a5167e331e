"""``train.steps_per_execution``: k training steps inside one compiled call, exact to the step — the same
losses, weights, checkpoints and TensorBoard points as k single steps; a non-finite step still stops the
run at that step (no later step applied) or is skipped; a signal saves at the end of the call under way."""

import re
import signal

import numpy as np
import pytest

from tests.helpers import small_train_config
from tests.harness.training import EXPLODE, Cli, checkpoint_state, read_checkpoint, scalars, write_config


def train(data_dir, model_dir, *extra):
    from captioning.experiment import for_training
    from captioning.train import Trainer

    trainer = Trainer(for_training(small_train_config(data_dir, *extra)), str(model_dir))
    return trainer, trainer.run(progress=False)


@pytest.mark.slow
def test_k_steps_a_call_equal_k_single_steps(prepared_dir, tmp_path):
    common = ("data.random_crop=false", "train.steps=13", "train.checkpoint_every_steps=5", "train.log_every_steps=2", "train.optimizer=adam",
              "train.learning_rate=0.01", "train.keep_checkpoints=10")
    runs = {k: train(prepared_dir, tmp_path / f"k{k}", *common, f"train.steps_per_execution={k}") for k in (1, 4)}
    (one, single), (four, several) = runs[1], runs[4]
    assert single.step == several.step == 13 and len(several.losses) == 13
    np.testing.assert_allclose(several.losses, single.losses, rtol=1e-5)
    for a, b in zip(four.model.variables, one.model.variables):
        np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-4, atol=1e-6, err_msg=a.name)
    for k in (1, 4):  # checkpoints at the same steps (a call never runs past one), TensorBoard points per step
        names = sorted(int(p.name[len("ckpt-"):-len(".index")]) for p in (tmp_path / f"k{k}").iterdir()
                       if p.name.startswith("ckpt-") and p.name.endswith(".index"))
        assert names == [5, 10, 13], (k, names)
    lossess = [scalars(tmp_path / f"k{k}" / "logs" / "train", "loss") for k in (1, 4)]
    assert sorted(lossess[1]) == sorted(lossess[0]) == [2, 4, 6, 8, 10, 12, 13]
    assert lossess[1] == pytest.approx(lossess[0], rel=1e-5)
    assert int(four.optimizer.iterations.numpy()) == 13


@pytest.mark.slow
@pytest.mark.parametrize("policy", ["stop", "skip"])
def test_a_non_finite_step_is_found_at_its_step(prepared_dir, tmp_path, policy):
    from captioning.train import NonFiniteError

    found = {}
    for k in (1, 4):
        extra = ("train.steps=6", "train.checkpoint_every_steps=100", f"train.nan_policy={policy}",
                 f"train.steps_per_execution={k}", *EXPLODE)
        if policy == "stop":
            from captioning.experiment import for_training
            from captioning.train import Trainer

            trainer = Trainer(for_training(small_train_config(prepared_dir, *extra)), str(tmp_path / f"k{k}"))
            with pytest.raises(NonFiniteError) as e:
                trainer.run(progress=False)
            bad = int(re.search(r"at step (\d+)", str(e.value))[1])
            # the call stopped after the bad step: it applied no update, and no step after it ran
            assert trainer.current_step() == bad and int(trainer.optimizer.iterations.numpy()) == bad - 1
            found[k] = bad
        else:
            trainer, result = train(prepared_dir, tmp_path / f"k{k}", *extra)
            assert result.step == 6 and result.skipped_steps
            found[k] = result.skipped_steps
    assert found[4] == found[1]


@pytest.mark.slow
def test_a_signal_saves_at_the_end_of_the_call_under_way(prepared_dir, tmp_path):
    config = write_config(tmp_path / "c.yaml", prepared_dir, "train.steps=100000", "train.checkpoint_every_steps=1000",
                          "train.steps_per_execution=5")
    model_dir = tmp_path / "m"
    cli = Cli(tmp_path, "run", "--config", config, "--model-dir", str(model_dir))
    cli.wait_for_step(7)
    cli.proc.send_signal(signal.SIGTERM)
    assert cli.wait() == 0, cli.stderr[-3000:]
    match = re.fullmatch(r"interrupted at step (\d+): saved (\S+); run the same command to resume\n", cli.stdout)
    assert match, cli.stdout + cli.stderr[-2000:]
    step = int(match.group(1))
    assert step % 5 == 0 and 10 <= step < 1000 and max(cli.logged_steps()) == step  # a call's end, every step logged
    assert sorted(cli.logged_steps()) == list(range(1, step + 1))
    assert checkpoint_state(model_dir) == f"ckpt-{step}"
    assert int(read_checkpoint(model_dir / f"ckpt-{step}")["step/.ATTRIBUTES/VARIABLE_VALUE"]) == step
