"""Losing a worker of a MultiWorkerMirroredStrategy cluster: two real `captioning train` processes on
localhost ports; one is killed with SIGKILL. The other must not hang on a collective: it stops within
120 s with one line naming the lost peer (TF's coordination service, configured by
distribute.peer_timeout_s). Both started again resume from the latest checkpoint. A worker whose peer
never starts stops after distribute.startup_timeout_s instead of waiting forever."""

import json
import re
import signal
import time

import pytest

from tests.helpers import free_port
from tests.harness.training import Cli, checkpoint_state, write_config


def start_cluster(tmp_path, config, model_dir, name, ports, indices=(0, 1)):
    workers = {}
    for index in indices:
        tf_config = {"cluster": {"worker": [f"localhost:{p}" for p in ports]}, "task": {"type": "worker", "index": index}}
        workers[index] = Cli(tmp_path, f"{name}{index}", "--config", config, "--model-dir", str(model_dir),
                             env={"TF_CONFIG": json.dumps(tf_config)})
    return workers


def last_line(cli):
    return cli.stderr.strip().splitlines()[-1]


def kill_one(tmp_path, config, model_dir, name, killed, after_step):
    """Starts both workers, SIGKILLs worker ``killed`` once it has logged ``after_step``; asserts that the
    other stops within 120 s with one line naming the lost peer. Returns the workers."""
    ports = [free_port(), free_port()]
    workers = start_cluster(tmp_path, config, model_dir, name, ports)
    survivor = workers[1 - killed]
    try:
        workers[killed].wait_for_step(after_step, timeout=400)
        workers[killed].proc.send_signal(signal.SIGKILL)
        killed_at = time.time()
        code = survivor.wait(timeout=150)
        took = time.time() - killed_at
    finally:
        for w in workers.values():
            w.proc.kill()
    assert code == 1 and took < 120, (code, took, survivor.stderr[-3000:])
    assert "Traceback" not in survivor.stderr, survivor.stderr[-3000:]
    assert re.fullmatch(rf"captioning train: error: lost worker {killed} \(localhost:{ports[killed]}\): it stopped "
                        r"answering \(distribute\.peer_timeout_s=10 s\); this worker stops too\. Start every worker "
                        r"again: training resumes from the latest checkpoint", last_line(survivor)), last_line(survivor)
    return workers


@pytest.mark.slow
def test_a_killed_worker_stops_the_other_with_one_line_and_both_resume(prepared_dir, tmp_path):
    """The non-chief killed; both started again resume, and then the chief is killed; both started again
    resume and finish. One run of the cluster serves as the resume of the first kill and the scene of the
    second (a cluster start-up fewer than a run for each kill)."""
    config = write_config(tmp_path / "c.yaml", prepared_dir, "train.steps=100000", "train.checkpoint_every_steps=2",
                          "distribute.strategy=multi_worker", "distribute.peer_timeout_s=10")
    model_dir = tmp_path / "m"
    kill_one(tmp_path, config, model_dir, "run", killed=1, after_step=5)  # the non-chief
    latest = checkpoint_state(model_dir)
    assert latest is not None
    step = int(latest.split("-")[1])

    again = kill_one(tmp_path, config, model_dir, "again", killed=0, after_step=step + 5)  # then the chief
    assert f"resumed from {model_dir / latest} at step {step}" in again[0].stderr
    latest = checkpoint_state(model_dir)
    assert latest is not None and int(latest.split("-")[1]) >= step
    step = int(latest.split("-")[1])

    ports = [free_port(), free_port()]
    final = start_cluster(tmp_path, write_config(tmp_path / "c2.yaml", prepared_dir, f"train.steps={step + 3}",
                                                 "distribute.strategy=multi_worker"), model_dir, "final", ports)
    try:
        codes = [w.wait(timeout=400) for w in final.values()]
    finally:
        for w in final.values():
            w.proc.kill()
    assert codes == [0, 0], "\n".join(w.stderr[-2000:] for w in final.values())
    assert f"resumed from {model_dir / latest} at step {step}" in final[0].stderr
    assert f"trained to step {step + 3}" in final[0].stdout and f"trained to step {step + 3}" in final[1].stdout


@pytest.mark.slow
def test_a_worker_whose_peer_never_starts_stops_after_the_startup_timeout(prepared_dir, tmp_path):
    config = write_config(tmp_path / "c.yaml", prepared_dir, "train.steps=10", "distribute.strategy=multi_worker",
                          "distribute.startup_timeout_s=4")
    ports = [free_port(), free_port()]
    lonely = start_cluster(tmp_path, config, tmp_path / "m", "alone", ports, indices=(0,))[0]
    started = time.time()
    try:
        code = lonely.wait(timeout=120)
    finally:
        lonely.proc.kill()
    assert code == 1 and time.time() - started < 90, lonely.stderr[-3000:]
    assert "Traceback" not in lonely.stderr
    assert last_line(lonely) == (f"captioning train: error: worker 1 (localhost:{ports[1]}) did not join the cluster "
                                 "within distribute.startup_timeout_s=4 s: start every worker of TF_CONFIG")
