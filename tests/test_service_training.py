"""Training with its input from a tf.data service (``data.service``): real dispatcher and worker processes
(tests/test_data_service.py's Cluster) feeding the real training pipeline and `captioning train`, with
workers killed and the dispatcher restarted under it."""

import collections
import os
import re
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from captioning.config import load_config
from captioning.errors import InputError
from tests.helpers import REPO, free_port, run_cli, run_main, small_train_config
from tests.harness.data_service import Cluster

@pytest.fixture(scope="module")
def service(tmp_path_factory):
    """The file's dispatcher (with a work dir) before any worker has started: the first test, which needs a
    dispatcher without workers, uses it so (a dispatcher start-up saved); then :func:`cluster`."""
    folder = tmp_path_factory.mktemp("service")
    c = Cluster(folder, dispatcher_args=("--work-dir", str(folder / "journal")), start_workers=False)
    yield c
    c.close()


@pytest.fixture(scope="module")
def cluster(service):
    """The file's dispatcher and its workers w1, w2: the trainers read through it in turn; the last two
    tests to use it kill w2 and the dispatcher (started again from its work dir), then the workers left (two
    cluster start-ups saved)."""
    service.start_workers()
    return service


@pytest.mark.slow
def test_a_dispatcher_without_workers_is_one_line_within_the_timeout(service, prepared_dir, tmp_path):
    """The file's dispatcher before its workers start (this test is the file's first)."""
    from captioning.config import save_config

    assert not service.workers, "the file's workers are started: this test must run before the others"
    save_config(small_train_config(prepared_dir, "train.steps=5", f"data.service={service.service}",
                                   "data.service_timeout_s=2", "train.log_every_steps=1",
                                   "train.checkpoint_every_steps=100000"), str(tmp_path / "c.yaml"))
    started = time.time()  # `train` in this process: the refusal comes before any job
    code, _, err = run_main("train", "--config", str(tmp_path / "c.yaml"), "--model-dir", str(tmp_path / "model"))
    took = time.time() - started
    lines = err.strip().splitlines()
    port = service.port
    assert code == 2 and "Traceback" not in err, err[-2000:]
    assert lines[-1] == (f"captioning train: error: the tf.data dispatcher at localhost:{port} has no workers (none has "
                         f"registered within 2 s): start one there (captioning data-service worker --dispatcher "
                         f"localhost:{port})")
    assert took < 45 and not (tmp_path / "model").exists()  # a refusal writes nothing


def image_captions(prepared_dir):
    """The train split's images, each as the frozen set of its captions' ids."""
    import tensorflow as tf

    from captioning.data.prepared import PreparedDataset
    from captioning.data.schema import CAPTION_IDS, parse_batch

    files = PreparedDataset.load(prepared_dir).files("train")
    return collections.Counter(frozenset(tuple(c) for c in image) for batch in
                               tf.data.TFRecordDataset(files).batch(64).map(parse_batch)
                               for image in batch[CAPTION_IDS].to_list())


@pytest.mark.slow
def test_distributed_epoch_sees_every_training_image_once(cluster, prepared_dir):
    """One epoch of the training pipeline through 2 service workers (distributed_epoch): batches of one
    whole image with its captions, each image exactly once (the workers split the shards)."""
    from captioning.data.pipeline import make_dataset

    cfg = load_config(None, [f"data.dir={prepared_dir}", "data.image_size=32", "data.resize_size=36",
                             "data.captions_per_image=grouped", f"data.service={cluster.service}",
                             "data.service_mode=distributed_epoch", "data.shuffle_buffer=8"]).data
    ds = make_dataset(cfg, "train", training=True, batch_size=5, repeat=False, service_job="epoch-test")
    seen = collections.Counter()
    for batch in ds.as_numpy_iterator():
        assert batch["image"].shape == (1, 32, 32, 3)
        captions = [tuple([1] + [int(t) for t in row[:int(m.sum())]]) for row, m in zip(batch["target_ids"], batch["mask"])]
        seen[frozenset(captions)] += 1
    assert seen == image_captions(prepared_dir)  # 32 images, each once


@pytest.mark.slow
def test_training_through_the_service_learns_like_local_training(cluster, prepared_dir, tmp_path):
    """The same config trained locally and with its input from the service (parallel_epochs, the
    service's workers shuffling on their own) lowers the loss alike."""
    from captioning.experiment import for_training
    from captioning.train import Trainer

    losses = {}
    for name, extra in (("local", []), ("service", [f"data.service={cluster.service}"])):
        cfg = small_train_config(prepared_dir, "train.steps=80", "train.optimizer=adam", "train.learning_rate=0.02",
                                 *extra)
        losses[name] = Trainer(for_training(cfg), str(tmp_path / name)).run(progress=False).losses
    local, served = np.array(losses["local"]), np.array(losses["service"])
    assert served[-10:].mean() < 0.7 * served[:3].mean(), (local, served)  # it learned
    assert abs(served[-10:].mean() - local[-10:].mean()) < 0.15 * local[-10:].mean(), (local, served)  # as locally


@pytest.mark.slow
def test_trainers_of_one_job_split_an_epoch(cluster, prepared_dir):
    """Two trainers' pipelines with one job name (as the replicas and workers of a run build them), read in
    turns: together they see every image of the distributed_epoch exactly once — the work is split, not
    repeated."""
    from captioning.data.pipeline import make_dataset

    cfg = load_config(None, [f"data.dir={prepared_dir}", "data.image_size=32", "data.resize_size=36",
                             "data.captions_per_image=grouped", f"data.service={cluster.service}",
                             "data.service_mode=distributed_epoch", "data.shuffle_buffer=8"]).data
    readers = [iter(make_dataset(cfg, "train", training=True, batch_size=5, repeat=False, service_job="shared-job"))
               for _ in range(2)]
    seen, got, active = collections.Counter(), [0, 0], [0, 1]
    while active:
        for index in list(active):
            batch = next(readers[index], None)
            if batch is None:
                active.remove(index)
                continue
            got[index] += 1
            rows = zip(batch["target_ids"].numpy(), batch["mask"].numpy())
            seen[frozenset(tuple([1] + [int(t) for t in r[:int(m.sum())]]) for r, m in rows)] += 1
    assert seen == image_captions(prepared_dir) and sum(got) == 32 and min(got) > 0  # each image once over both


@pytest.mark.slow
def test_mirrored_training_through_the_service_beyond_an_epoch(cluster, prepared_dir, tmp_path):
    """2 replicas (logical CPUs) share the run's job; distributed_epoch repeats into a second epoch."""
    from captioning.config import save_config

    cfg = small_train_config(prepared_dir, "train.steps=30", f"data.service={cluster.service}",
                             "data.service_mode=distributed_epoch", "distribute.strategy=mirrored",
                             "distribute.logical_cpus=2")
    save_config(cfg, str(tmp_path / "c.yaml"))
    done = run_cli("train", "--config", str(tmp_path / "c.yaml"), "--model-dir", str(tmp_path / "model"))
    assert done.returncode == 0, done.stderr[-3000:]
    assert "2 replica(s)" in done.stderr and "20 steps per epoch" in done.stderr  # 160 captions / 8
    assert (tmp_path / "model" / "ckpt-30.index").exists()


@pytest.mark.slow
def test_multi_worker_trainers_through_the_service(cluster, prepared_dir, tmp_path):
    """2 MultiWorkerMirroredStrategy processes, each reading its share of the run's one job: 30 steps
    (1.5 epochs of distributed_epoch), the same losses and bit-identical weights on both, and learning."""
    from tests.harness.training import run_two_workers

    run_two_workers(["multi_worker_service", prepared_dir, str(tmp_path), cluster.service])
    a, b = np.load(tmp_path / "weights-0.npz"), np.load(tmp_path / "weights-1.npz")
    assert int(a["replicas"]) == 2 and len(a["losses"]) == 30
    assert a["losses"][-5:].mean() < 0.95 * a["losses"][:3].mean()  # SGD 0.5 on the tiny model: ~0.92
    for name in a.files:
        np.testing.assert_array_equal(a[name], b[name], err_msg=name)


def start_training(tmp_path, prepared_dir, service, steps, *extra):
    from captioning.config import save_config

    cfg = small_train_config(prepared_dir, f"train.steps={steps}", f"data.service={service}",
                             "data.service_timeout_s=60", "train.log_every_steps=1", *extra)
    save_config(cfg, str(tmp_path / "c.yaml"))
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", PYTHONPATH=REPO)
    err = open(tmp_path / "train.err", "w")
    proc = subprocess.Popen([sys.executable, "-m", "captioning", "train", "--config", str(tmp_path / "c.yaml"),
                             "--model-dir", str(tmp_path / "model")], stdout=subprocess.DEVNULL, stderr=err, env=env,
                            stdin=subprocess.DEVNULL)
    return proc, tmp_path / "train.err"


def wait_for_step(log, step, proc, timeout=240):
    deadline = time.time() + timeout
    while time.time() < deadline:
        steps = [int(s) for s in re.findall(r"step (\d+): loss", log.read_text())]
        if steps and max(steps) >= step:
            return max(steps)
        assert proc.poll() is None, log.read_text()[-3000:]
        time.sleep(0.2)
    raise AssertionError(f"no step {step} within {timeout} s:\n{log.read_text()[-3000:]}")


@pytest.mark.slow
def test_training_goes_on_after_a_worker_is_killed_and_the_dispatcher_restarts_from_its_work_dir(cluster,
                                                                                                  prepared_dir,
                                                                                                  tmp_path):
    """kill -9 of one of two workers (parallel_epochs): the other keeps the batches coming; then kill -9 of the
    dispatcher, started again from its work dir on its port: training goes on and ends (one run for both, a
    cluster and a training process fewer). The file's cluster; w2 stays dead."""
    proc, log = start_training(tmp_path, prepared_dir, cluster.service, 150)
    try:
        at = wait_for_step(log, 20, proc)
        cluster.workers["w2"].proc.send_signal(signal.SIGKILL)
        going_on = wait_for_step(log, at + 20, proc)  # w1 alone keeps the batches coming
        cluster.restart_dispatcher(*cluster.dispatcher_args)  # kill -9, then again on its port from its work dir
        assert proc.wait(timeout=400) == 0, log.read_text()[-3000:]
        assert max(int(s) for s in re.findall(r"step (\d+): loss", log.read_text())) == 150 > going_on > at
        assert (tmp_path / "model" / "ckpt-150.index").exists()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.mark.slow
def test_an_unreachable_service_is_one_line_within_the_timeout(prepared_dir, tmp_path):
    from captioning.config import save_config

    cfg = small_train_config(prepared_dir, "train.steps=5", f"data.service=localhost:{free_port()}",
                             "data.service_timeout_s=2")
    save_config(cfg, str(tmp_path / "c.yaml"))
    start = time.time()
    # in this process (run_cli would start one for a config naming a service): the refusal comes before any job
    code, _, err = run_main("train", "--config", str(tmp_path / "c.yaml"), "--model-dir", str(tmp_path / "m"))
    took = time.time() - start
    lines = err.strip().splitlines()
    assert code == 2 and "Traceback" not in err, err[-2000:]
    assert lines[-1].startswith("captioning train: error:") and "localhost" in lines[-1]
    assert took < 60


@pytest.mark.parametrize("overrides, fragment", [
    (["data.service=nohost"], "must look like HOST:PORT"),
    (["data.service=localhost:5050", "data.cache=features", "model.encoder_trainable=false", "data.random_crop=false",
      "data.random_flip=false"], "data.cache: features"),
    (["data.service=localhost:5050", "data.service_mode=distributed_epoch", "data.cache=memory"], "parallel_epochs"),
    (["data.service=localhost:5050", "data.skip_corrupt=true"], "data.skip_corrupt"),
    (["data.service=localhost:5050", "data.service_compression=zstd"], "data.service_compression"),
])
def test_service_config_errors(overrides, fragment):
    from captioning.config import validate

    with pytest.raises(InputError, match=re.escape(fragment)):
        validate(load_config(None, ["data.dir=d"] + overrides))


def start(tmp_path, prepared_dir, service, steps, *extra):
    """`captioning train` through the service in the background: (process, its stderr file, stdout file)."""
    from captioning.config import save_config

    cfg = small_train_config(prepared_dir, f"train.steps={steps}", f"data.service={service}",
                             "train.log_every_steps=1", "train.checkpoint_every_steps=100000", *extra)
    save_config(cfg, str(tmp_path / "c.yaml"))
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", PYTHONPATH=REPO)
    out, err = tmp_path / "train.out", tmp_path / "train.err"
    with open(out, "w") as o, open(err, "w") as e:
        proc = subprocess.Popen([sys.executable, "-m", "captioning", "train", "--config", str(tmp_path / "c.yaml"),
                                 "--model-dir", str(tmp_path / "model")], stdout=o, stderr=e, env=env,
                                stdin=subprocess.DEVNULL)
    return proc, err, out


def stalls(log, proc, quiet_s=3.0, timeout=120):
    """Waits until training has logged a step and then no new one for ``quiet_s``: its input has stopped.
    Returns the last step logged."""
    deadline, last, since = time.time() + timeout, None, time.time()
    while time.time() < deadline:
        steps = [int(s) for s in re.findall(r"step (\d+): loss", log.read_text())]
        assert proc.poll() is None, log.read_text()[-3000:]
        if steps and steps[-1] != last:
            last, since = steps[-1], time.time()
        elif last is not None and time.time() - since >= quiet_s:
            return last
        time.sleep(0.2)
    raise AssertionError(f"training did not stall within {timeout} s:\n{log.read_text()[-3000:]}")


@pytest.mark.slow
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_signal_while_waiting_for_the_dispatcher_is_one_line_and_exit_0(prepared_dir, tmp_path, signum):
    """`train` waits up to data.service_timeout_s for its dispatcher before the first step. SIGTERM then (a
    scheduler's stop) is one plain line and exit 0, as a signal during training is, and so is SIGINT;
    nothing is written. The "dispatcher" is a TCP listener that closes every connection: its first
    connection says that the trainer is waiting."""
    import socket
    import threading

    listener = socket.socket()
    listener.bind(("localhost", 0))
    listener.listen()
    port, connected = listener.getsockname()[1], threading.Event()

    def refuse():
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:  # closed
                return
            conn.close()
            connected.set()

    threading.Thread(target=refuse, daemon=True).start()
    try:
        proc, err, out = start(tmp_path, prepared_dir, f"localhost:{port}", 5, "data.service_timeout_s=300")
        assert connected.wait(120), err.read_text()[-3000:]
        time.sleep(0.5)
        proc.send_signal(signum)
        code = proc.wait(timeout=30)
    finally:
        listener.close()
    name, text = signal.Signals(signum).name, err.read_text()
    assert code == 0 and "Traceback" not in text, (code, text[-3000:])
    assert text.strip().splitlines()[-1] == (
        f"captioning train: interrupted by {name} while waiting for the tf.data dispatcher at localhost:{port} and a "
        "live worker: nothing trained; run the same command to start")
    assert text.count(name) == 1 and out.read_text() == ""
    assert not (tmp_path / "model").exists()


@pytest.mark.slow
def test_losing_every_worker_ends_the_run_saving_its_last_step(cluster, prepared_dir, tmp_path):
    """kill -9 of every live worker: TF's iterator waits forever. The run ends within data.service_timeout_s
    with one line, exit 1, and the last step saved; a signal while it waits (SIGINT, SIGTERM) saves and exits
    0 at once. The three runs at once through one dispatcher (each run its own job: the service's job name is
    its model folder's), whose workers one kill -9 each takes from all three: one cluster, not three, and
    the file's: after the test before, its dispatcher restarted from its work dir still lists the w2 that
    test killed, and w1 is the one live worker. A run that has reached step 5 is paused (SIGSTOP) until the
    others have, then all go on (SIGCONT) as the workers are killed: the first ones started do not train
    (and the worker decode) hundreds of steps that nothing reads while the last starts."""
    runs = {}
    try:
        for then in ("timeout", "SIGINT", "SIGTERM"):
            (tmp_path / then).mkdir()
            timeout = 8 if then == "timeout" else 120
            runs[then] = start(tmp_path / then, prepared_dir, cluster.service, 100000, "data.cache=none",
                               f"data.service_timeout_s={timeout}")
        paused, deadline = set(), time.time() + 240
        while len(paused) < len(runs):  # each paused at step 5 (SIGSTOP) until the slowest has started
            assert time.time() < deadline, "no step 5 in every run within 240 s"
            for then, (proc, err, _) in runs.items():
                assert proc.poll() is None, err.read_text()[-3000:]
                if then not in paused and re.search(r"^\S+ step ([5-9]|\d\d+): loss", err.read_text(), re.M):
                    proc.send_signal(signal.SIGSTOP)
                    paused.add(then)
            time.sleep(0.02)
        for proc, _, _ in runs.values():
            proc.send_signal(signal.SIGCONT)
        for w in cluster.workers.values():
            if w.proc.poll() is None:
                w.proc.send_signal(signal.SIGKILL)
        steps, codes, took = {}, {}, {}
        for then, (proc, err, _) in runs.items():  # the timeout's run first: its clock runs from the kill
            steps[then] = stalls(err, proc)
        for then, (proc, err, _) in runs.items():
            sent = time.time()
            if then != "timeout":
                proc.send_signal(getattr(signal, then))
            codes[then] = proc.wait(timeout=90)
            took[then] = time.time() - sent
    finally:
        for proc, _, _ in runs.values():
            if proc.poll() is None:
                proc.kill()
    for then, (proc, err, out) in runs.items():
        step, code, model = steps[then], codes[then], tmp_path / then / "model"
        text = err.read_text()
        assert "Traceback" not in text and "race condition" not in text, text[-3000:]
        if then == "timeout":
            line = text.strip().splitlines()[-1]
            assert code == 1 and line.startswith(f"captioning train: error: the tf.data dispatcher at {cluster.service} "
                                                 "has had no live worker for 8 s (it lists localhost:"), line
            assert line.endswith(f"; saved {model}/ckpt-{step}: run the same command to resume once the "
                                 "service is back")
        else:
            assert code == 0 and took[then] < 15, (then, code, took[then], text[-2000:])
            assert out.read_text() == (f"interrupted by {then} at step {step} while waiting for input: saved "
                                       f"{model}/ckpt-{step}; run the same command to resume\n")
        assert (model / f"ckpt-{step}.index").exists(), then
