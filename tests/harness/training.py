"""Training as the tests run it in processes of its own: ``captioning train`` in the background (:class:`Cli`,
polled through its log), its config, checkpoints and TensorBoard scalars; the two workers of a localhost cluster
running tests/distributed_worker.py; a Trainer's variables taken and put back (:func:`snapshot`, :func:`restore`)."""

import json
import os
import re
import subprocess
import sys
import time

from captioning.config import save_config
from tests.helpers import REPO, Background, free_port, small_train_config

STEP_LINE = re.compile(r"step (\d+): loss")

def snapshot(trainer):
    """A Trainer's model and optimizer variables and its step counter, as arrays (:func:`restore` puts them back)."""
    return [v.numpy() for v in trainer.model.variables + list(trainer.optimizer.variables)] + [trainer.step.numpy()]


def restore(trainer, values):
    for v, value in zip(trainer.model.variables + list(trainer.optimizer.variables) + [trainer.step], values):
        v.assign(value)


def write_config(path, data_dir, *overrides):
    save_config(small_train_config(data_dir, *overrides), str(path))
    return str(path)

class Cli(Background):
    """``captioning train`` running in the background, its output going to files we can poll."""

    def __init__(self, tmp_path, name, *args, env=None):
        super().__init__(tmp_path, name, [sys.executable, "-m", "captioning", "train", *args], env=env)

    def logged_steps(self):
        return [int(s) for s in STEP_LINE.findall(self.stderr)]

    def wait_for_step(self, step, timeout=300):
        """Polls the log until training logged ``step`` (log_every_steps=1): it is under way."""
        deadline = time.time() + timeout
        while time.time() < deadline:
            if any(s >= step for s in self.logged_steps()):
                return
            assert self.proc.poll() is None, f"exited {self.proc.returncode} early:\n{self.stderr[-3000:]}"
            time.sleep(0.05)
        raise AssertionError(f"no step {step} within {timeout} s:\n{self.stderr[-3000:]}")

    def wait(self, timeout=120):
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            raise AssertionError(f"did not exit within {timeout} s:\n{self.stderr[-3000:]}") from None

def checkpoint_state(model_dir):
    """The ``checkpoint`` state file's latest checkpoint name, e.g. 'ckpt-12' (None without one)."""
    import tensorflow as tf

    state = tf.train.get_checkpoint_state(str(model_dir))
    return os.path.basename(state.model_checkpoint_path) if state else None

def read_checkpoint(path):
    """Every tensor of a checkpoint (reading them all fails on a partly written one)."""
    import tensorflow as tf

    reader = tf.train.load_checkpoint(str(path))
    return {name: reader.get_tensor(name) for name in reader.get_variable_to_shape_map()
            if name != "_CHECKPOINTABLE_OBJECT_GRAPH"}


def scalars(event_dir, tag):
    import tensorflow as tf

    found = {}
    for name in os.listdir(event_dir):
        for event in tf.compat.v1.train.summary_iterator(os.path.join(event_dir, name)):
            for value in event.summary.value:
                if value.tag == tag:
                    found[event.step] = float(tf.make_ndarray(value.tensor))
    return found


# No clipping and a learning rate of 1e30: step 1 is finite, its update makes the next losses NaN.
EXPLODE = ("train.learning_rate=1e30", "train.clip_gradient_norm=0")


WORKER = os.path.join(REPO, "tests", "distributed_worker.py")

def run_worker(args, env=None, timeout=600):
    env = dict(os.environ, PYTHONPATH=REPO, TF_CPP_MIN_LOG_LEVEL="2", **(env or {}))
    return subprocess.Popen([sys.executable, WORKER, *args], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)

def run_two_workers(args):
    """``tests/distributed_worker.py ARGS`` as the two workers of a localhost cluster (TF_CONFIG); waits for
    both and asserts that both exit 0."""
    ports = [free_port(), free_port()]
    procs = []
    for index in range(2):
        tf_config = {"cluster": {"worker": [f"localhost:{p}" for p in ports]}, "task": {"type": "worker", "index": index}}
        procs.append(run_worker(args, env={"TF_CONFIG": json.dumps(tf_config)}))
    outputs = []
    try:
        for proc in procs:
            outputs.append(proc.communicate(timeout=600)[0])
    finally:
        for proc in procs:
            proc.kill()
    assert [p.returncode for p in procs] == [0, 0], "\n".join(o[-2500:] for o in outputs)
