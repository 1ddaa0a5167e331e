"""Training survives signals, kill -9, NaNs and folders of other models: real `captioning train`
processes, real signals, and assertions on what is left on disk."""

import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from captioning.config import load_config, save_config
from tests.helpers import REPO, copy_model, free_port, run_cli, small_train_config
from tests.harness.training import EXPLODE, Cli, checkpoint_state, read_checkpoint, scalars, write_config

@pytest.fixture(scope="module")
def data_dir(prepared_dir):
    return prepared_dir


def model_weights(path):
    return {k: v for k, v in read_checkpoint(path).items() if k.startswith("model/")}


# ---- SIGTERM / SIGINT ----------------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("signum, decoder", [(signal.SIGTERM, "attention"), (signal.SIGINT, "show_and_tell")],
                         ids=["SIGTERM-attention", "SIGINT-show_and_tell"])
def test_signal_finishes_the_step_saves_and_exits_0(data_dir, tmp_path, signum, decoder):
    """Either decoder: the step under way finishes, is saved, exit 0; the same command resumes there."""
    config = write_config(tmp_path / "c.yaml", data_dir, "train.steps=100000", "train.checkpoint_every_steps=1000",
                          f"model.decoder={decoder}", *(["model.attention_size=16"] if decoder == "attention" else []))
    model_dir = tmp_path / "m"
    cli = Cli(tmp_path, "run", "--config", config, "--model-dir", str(model_dir))
    cli.wait_for_step(3)
    cli.proc.send_signal(signum)
    assert cli.wait() == 0, cli.stderr[-3000:]
    match = re.fullmatch(r"interrupted at step (\d+): saved (\S+); run the same command to resume\n", cli.stdout)
    assert match, cli.stdout + cli.stderr[-2000:]
    step = int(match.group(1))
    assert match.group(2) == str(model_dir / f"ckpt-{step}")
    assert 3 <= step < 1000  # a step after the signal, long before the first periodic checkpoint
    assert max(cli.logged_steps()) == step  # the step under way was finished, no further one started
    assert checkpoint_state(model_dir) == f"ckpt-{step}"
    assert int(read_checkpoint(model_dir / f"ckpt-{step}")["step/.ATTRIBUTES/VARIABLE_VALUE"]) == step
    assert "Traceback" not in cli.stderr and f"{signal.Signals(signum).name}: finishing the current step" in cli.stderr

    if signum == signal.SIGTERM:  # the same command resumes at that step
        result = run_cli("train", "--config", config, "--model-dir", str(model_dir), "--set", f"train.steps={step + 2}")
        assert result.returncode == 0, result.stderr[-2000:]
        assert f"resumed from {model_dir / f'ckpt-{step}'} at step {step}" in result.stderr
        assert f"trained to step {step + 2}" in result.stdout


SECOND_SIGNAL = """
import os, signal, sys, time
from captioning.train import StopOnSignal
previous = signal.getsignal(signal.SIGTERM)
with StopOnSignal() as stop:
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(0.1)  # Python runs the handler between bytecodes
    assert stop.signal_name == "SIGTERM", stop.signal_name
    print("first signal noted", flush=True)
assert signal.getsignal(signal.SIGTERM) is previous  # given back on exit
with StopOnSignal() as stop:
    os.kill(os.getpid(), signal.SIGINT)
    time.sleep(0.1)
    print("noted", stop.signal_name, flush=True)
    os.kill(os.getpid(), signal.SIGTERM)  # the second signal: the default action, at once
    time.sleep(5)
    print("survived the second signal", flush=True)
"""


@pytest.mark.slow
def test_a_second_signal_kills_at_once():
    result = subprocess.run([sys.executable, "-c", SECOND_SIGNAL], capture_output=True, text=True, timeout=120,
                            env=dict(os.environ, PYTHONPATH=REPO, TF_CPP_MIN_LOG_LEVEL="2"))
    assert result.stdout == "first signal noted\nnoted SIGINT\n", result.stderr[-2000:]
    # ended at once, with the exit code a shell reports for a process killed by SIGTERM, and one line
    assert result.returncode == 128 + signal.SIGTERM
    assert result.stderr.strip().splitlines()[-1] == "SIGTERM again: exiting at once, without saving"
    assert "race condition" not in result.stderr


@pytest.mark.slow
def test_sigterm_to_one_multi_worker_process_stops_both_at_one_step(data_dir, tmp_path):
    """Two MultiWorkerMirroredStrategy workers (the real CLI, TF_CONFIG); the non-chief gets SIGTERM.
    PreemptionCheckpointHandler makes both finish the same step, save it and exit 0."""
    config = write_config(tmp_path / "c.yaml", data_dir, "train.steps=100000", "train.checkpoint_every_steps=1000",
                          "distribute.strategy=multi_worker")
    model_dir = tmp_path / "m"
    ports = [free_port(), free_port()]
    workers = []
    for index in range(2):
        tf_config = {"cluster": {"worker": [f"localhost:{p}" for p in ports]},
                     "task": {"type": "worker", "index": index}}
        workers.append(Cli(tmp_path, f"worker{index}", "--config", config, "--model-dir", str(model_dir),
                           env={"TF_CONFIG": json.dumps(tf_config)}))
    try:
        workers[1].wait_for_step(3, timeout=400)
        workers[1].proc.send_signal(signal.SIGTERM)
        codes = [w.wait(timeout=180) for w in workers]
    finally:
        for w in workers:
            w.proc.kill()
    assert codes == [0, 0], "\n".join(w.stderr[-2500:] for w in workers)
    steps = []
    for w in workers:
        match = re.fullmatch(r"interrupted at step (\d+): saved (\S+); run the same command to resume\n", w.stdout)
        assert match, w.stdout + w.stderr[-2000:]
        steps.append(int(match.group(1)))
        assert max(w.logged_steps()) == steps[-1]
    assert steps[0] == steps[1] and 3 <= steps[0] < 1000
    step = steps[0]
    assert "interrupted by SIGTERM" in workers[1].stderr
    assert "interrupted by another worker's signal" in workers[0].stderr
    for w, port in zip(workers, ports):  # each says its own server is open (docs/distributed.md, "Trust model")
        assert f"the multi-worker gRPC server of this worker listens on every network interface at port {port} " \
               "without authentication" in w.stderr
    assert checkpoint_state(model_dir) == f"ckpt-{step}"  # the chief wrote it into the model folder
    assert int(read_checkpoint(model_dir / f"ckpt-{step}")["step/.ATTRIBUTES/VARIABLE_VALUE"]) == step
    assert not [n for n in os.listdir(model_dir) if n.startswith(".")]  # no scratch or handler folders left
    assert not any("Traceback" in w.stderr or "total_run_calls" in w.stderr for w in workers)


# ---- kill -9 ------------------------------------------------------------------------------------------
def kill_during_a_save(cli, model_dir, timeout=300):
    """SIGKILLs ``cli`` as soon as a checkpoint is being written (CheckpointManager writes ckpt-N_temp/
    first). Returns True if the half-written checkpoint was still there after the kill."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        try:
            names = os.listdir(model_dir)
        except FileNotFoundError:
            names = []
        temp = [n for n in names if n.endswith("_temp")]
        if temp and "checkpoint" in names:
            cli.proc.send_signal(signal.SIGKILL)
            cli.wait()
            return (model_dir / temp[0]).exists()
        assert cli.proc.poll() is None, cli.stderr[-3000:]
        time.sleep(0.0005)
    raise AssertionError("no save seen")


def leftovers(model_dir, latest_step):
    """What an interrupted save left: ckpt-N_temp/ folders and ckpt-N files newer than the latest."""
    return sorted(n for n in os.listdir(model_dir) if n.endswith("_temp")
                  or (n.startswith("ckpt-") and int(re.match(r"ckpt-(\d+)", n).group(1)) > latest_step))


@pytest.mark.slow
def test_kill_9_at_random_moments_then_resume(data_dir, tmp_path):
    """SIGKILL in the middle of a save (a checkpoint every step), then of the resumed run at a random
    moment: each restart resumes from the latest complete checkpoint, at most checkpoint_every_steps
    steps are lost, and a checkpoint cut short never becomes the latest (its leftovers are removed at the
    next start, the randomly killed run's; the last run, in this process, finishes from there). Two
    killed processes, not three: the random kill is of a resumed run, whose start cleaned up the save's."""
    rng = random.Random(1234)
    model_dir = tmp_path / "m"
    every = 1
    config = write_config(tmp_path / "c.yaml", data_dir, "train.steps=100000", f"train.checkpoint_every_steps={every}")
    resumed_from, left = None, []
    plan, killed_mid_save, attempt = ["save", "random"], False, 0
    while plan:
        how, attempt = plan.pop(0), attempt + 1
        cli = Cli(tmp_path, f"run{attempt}", "--config", config, "--model-dir", str(model_dir))
        if how == "random":
            cli.wait_for_step((resumed_from or 0) + 2)
            time.sleep(rng.uniform(0.0, 1.5))
            cli.proc.send_signal(signal.SIGKILL)
            cli.wait()
        else:
            cli.wait_for_step((resumed_from or 0) + 1)
            killed_mid_save = kill_during_a_save(cli, model_dir)
        assert cli.proc.returncode == -signal.SIGKILL
        if resumed_from is not None:
            assert f"resumed from {model_dir / f'ckpt-{resumed_from}'} at step {resumed_from}" in cli.stderr
        if left:  # the previous kill's half-written checkpoint was cleaned up at this start
            assert "removed the leftovers of an interrupted save" in cli.stderr
        latest = checkpoint_state(model_dir)
        assert latest is not None
        latest_step = int(latest.split("-")[1])
        weights = read_checkpoint(model_dir / latest)  # complete: every tensor reads
        assert int(weights["step/.ATTRIBUTES/VARIABLE_VALUE"]) == latest_step
        assert all(np.all(np.isfinite(v)) for v in weights.values() if v.dtype.kind == "f")
        logged = cli.logged_steps()
        assert logged and max(logged) - latest_step <= every  # at most checkpoint_every_steps lost
        left = leftovers(model_dir, latest_step)
        if how == "save" and not (killed_mid_save and left):  # the save ended first: that was a random kill
            assert attempt < 6, "no kill landed inside a save"
            plan.insert(0, "save")
        resumed_from = latest_step

    result = run_cli("train", "--config", config, "--model-dir", str(model_dir), "--set",
                     f"train.steps={resumed_from + 3}", "--set", "train.checkpoint_every_steps=1000")
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"resumed from {model_dir / f'ckpt-{resumed_from}'} at step {resumed_from}" in result.stderr
    assert f"trained to step {resumed_from + 3}" in result.stdout
    assert checkpoint_state(model_dir) == f"ckpt-{resumed_from + 3}"
    assert ("removed the leftovers of an interrupted save" in result.stderr) == bool(left)
    assert not leftovers(model_dir, resumed_from + 3)


# ---- NaN and Inf --------------------------------------------------------------------------------------
# EXPLODE (tests/harness/training.py): step 1 is finite, its update makes the next losses NaN.
@pytest.mark.slow
def test_nan_loss_stops_with_exit_1_and_keeps_the_last_good_checkpoint(data_dir, tmp_path):
    config = write_config(tmp_path / "c.yaml", data_dir, "train.steps=6", "train.checkpoint_every_steps=1", *EXPLODE)
    model_dir = tmp_path / "m"
    result = run_cli("train", "--config", config, "--model-dir", str(model_dir))
    assert result.returncode == 1, result.stderr[-3000:]
    errors = [line for line in result.stderr.splitlines() if "error:" in line]
    assert len(errors) == 1 and "Traceback" not in result.stderr
    match = re.search(r"captioning train: error: non-finite loss (nan|inf) \(gradient norm \w+\) at step (\d+): "
                      r"stopped without saving; the latest checkpoint, ckpt-(\d+), is the last good one", errors[0])
    assert match and "train.nan_policy=skip" in errors[0], errors[0]
    bad, good = int(match.group(2)), int(match.group(3))
    assert bad >= 2 and good == bad - 1  # a checkpoint every step: the last one is the step before
    assert checkpoint_state(model_dir) == f"ckpt-{good}"
    assert not [n for n in os.listdir(model_dir) if n.startswith("ckpt-") and int(re.match(r"ckpt-(\d+)", n)[1]) > good]
    weights = read_checkpoint(model_dir / f"ckpt-{good}")
    assert all(np.all(np.isfinite(v)) for v in weights.values() if v.dtype.kind == "f")


@pytest.mark.slow
def test_nan_policy_skip_applies_no_update_and_counts(data_dir, tmp_path):
    """In-process on one device: run()'s result, the TensorBoard count, and checkpoints showing that the
    skipped steps changed nothing (weights, batch-norm statistics, optimizer iterations)."""
    from captioning.experiment import for_training
    from captioning.train import Trainer

    model_dir = tmp_path / "m"
    cfg = small_train_config(data_dir, "train.steps=5", "train.checkpoint_every_steps=1", "train.nan_policy=skip",
                             *EXPLODE)
    result = Trainer(for_training(cfg), str(model_dir)).run(progress=False)
    skipped = result["skipped_steps"]
    assert result["step"] == 5 and skipped and skipped[0] >= 2 and skipped == list(range(skipped[0], 6))
    good = skipped[0] - 1  # the last step whose update was applied
    assert np.isfinite(result["losses"][:good]).all() and not np.isfinite(result["losses"][good:]).any()
    assert result["interrupted"] is None and result["checkpoint"] == str(model_dir / "ckpt-5")
    assert scalars(model_dir / "logs" / "train", "skipped_batches") == {s: max(0, s - good) for s in range(1, 6)}
    before, after = read_checkpoint(model_dir / f"ckpt-{good}"), read_checkpoint(model_dir / "ckpt-5")
    assert any("moving_mean" in k for k in before)  # the trainable encoder's batch norm is compared too
    for name, value in before.items():
        if name.startswith("model/") or name.startswith("optimizer/"):
            np.testing.assert_array_equal(after[name], value, err_msg=name)
            assert value.dtype.kind != "f" or np.all(np.isfinite(value)), name
    assert int(after["optimizer/_iterations/.ATTRIBUTES/VARIABLE_VALUE"]) == good  # skipped steps: no iteration


@pytest.mark.slow
def test_nan_policy_skip_under_mirrored_strategy(distributed_runs):
    """The same through the CLI on a MirroredStrategy of 2 logical CPUs: the skip is decided inside the
    compiled step from all-reduced values, so both replicas skip together (tests/harness/scenarios.py's
    ``nan_skip``)."""
    from tests.helpers import distributed_result, main_result

    out = distributed_result(distributed_runs, "mirrored", "nan_skip")
    model_dir, result = os.path.join(out, "m"), main_result(out, "train")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "2 replica(s)" in result.stderr
    match = re.search(rf"trained to step 4 in {re.escape(str(model_dir))} \((\d) batches skipped: non-finite loss\)",
                      result.stdout)
    assert match, result.stdout
    count = int(match[1])
    assert 1 <= count <= 3
    assert len(re.findall(r"step \d: non-finite loss .*: batch skipped, no update applied", result.stderr)) == count
    before, after = model_weights(f"{model_dir}/ckpt-{4 - count}"), model_weights(f"{model_dir}/ckpt-4")
    for name, value in before.items():
        np.testing.assert_array_equal(after[name], value, err_msg=name)
        assert value.dtype.kind != "f" or np.all(np.isfinite(value)), name


# ---- folders of other models --------------------------------------------------------------------------
# conftest's trained_model_dir's config (small_cnn at 32 px, embedding/LSTM 32, Adam, ckpt-60): its copies are the
# folders the runs below are refused in (the suite's model, not one trained again for this file)
TRAINED = ("model.embedding_size=32", "model.lstm_units=32", "train.optimizer=adam", "train.learning_rate=0.01",
           "train.checkpoint_every_steps=60")


@pytest.mark.parametrize("case", ["file", "no_config", "no_vocab", "other_vocab", "state_without_files",
                                  "small_cnn_image_size", "checkpoint_of_another_model"])
def test_model_dir_that_does_not_fit_exits_2_before_any_step(data_dir, trained_model_dir, tmp_path, case):
    """A copy of trained_model_dir (ckpt-60) damaged or met with another config; train.steps=70 would train."""
    model_dir = tmp_path / "m"
    copy_model(trained_model_dir, model_dir)
    overrides = [*TRAINED, "train.steps=70"]
    expected = {
        "file": "is a file, not a folder",
        "no_config": "holds checkpoints but no config.yaml",
        "no_vocab": "holds checkpoints but no vocab.txt",
        "other_vocab": "was trained with another vocabulary",
        "state_without_files": "names ckpt-60, whose files are missing",
        "small_cnn_image_size": "holds a model with other data.image_size",
        "checkpoint_of_another_model": "ckpt-60 does not fit the model this config builds",
    }[case]
    if case == "file":
        shutil.rmtree(model_dir)
        model_dir.write_text("not a folder\n")
    elif case == "no_config":
        os.remove(model_dir / "config.yaml")
    elif case == "no_vocab":
        os.remove(model_dir / "vocab.txt")
    elif case == "other_vocab":
        with open(model_dir / "vocab.txt", "a") as f:
            f.write("zebra\n")
    elif case == "state_without_files":
        for name in os.listdir(model_dir):
            if name.startswith("ckpt-60."):
                os.remove(model_dir / name)
    elif case == "small_cnn_image_size":
        overrides += ["data.image_size=64", "data.resize_size=72"]  # a 4x4 grid instead of 2x2
    elif case == "checkpoint_of_another_model":
        # config.yaml says LSTM 24 (as if edited, or the checkpoints were copied from another folder)
        old = load_config(str(model_dir / "config.yaml"))
        old.model.options["lstm_units"] = 24
        save_config(old, str(model_dir / "config.yaml"))
        overrides += ["model.lstm_units=24"]
    before = sorted(os.listdir(model_dir)) if model_dir.is_dir() else None
    config = write_config(tmp_path / "c.yaml", data_dir, *overrides)
    result = run_cli("train", "--config", config, "--model-dir", str(model_dir))
    assert result.returncode == 2, result.stderr[-3000:]
    errors = [line for line in result.stderr.splitlines() if line.startswith("captioning train: error:")]
    assert len(errors) == 1 and expected in errors[0], result.stderr[-3000:]
    assert result.stderr.strip().splitlines()[-1] == errors[0]  # the last word, no warnings after it
    assert "Traceback" not in result.stderr and "training from step" not in result.stderr
    if before is not None:
        assert sorted(os.listdir(model_dir)) == before  # nothing written, no step taken
