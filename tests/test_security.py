"""The servers' exposure (docs/distributed.md, "Trust model"): what TensorFlow binds, what it refuses,
and the warning every server prints; one dispatcher per work dir."""

import pytest
import os
import signal
import socket
import time


from captioning.data.service_probe import exposure, listening_addresses, warn_if_exposed
from tests.helpers import Background, free_port

CLI = [os.sys.executable, "-m", "captioning"]


def wait_for(predicate, timeout=60.0, what="it"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")


def test_listening_addresses_reads_what_the_kernel_reports():
    with socket.socket() as loopback, socket.socket(socket.AF_INET6) as everywhere:
        loopback.bind(("127.0.0.1", 0))
        loopback.listen()
        everywhere.bind(("::", 0))
        everywhere.listen()
        local_port, open_port = loopback.getsockname()[1], everywhere.getsockname()[1]
        assert listening_addresses(local_port) == ["127.0.0.1"] and exposure(local_port) == []
        assert listening_addresses(open_port) == ["::"] and exposure(open_port) == ["::"]
        assert not warn_if_exposed("test server", local_port)
        assert warn_if_exposed("test server", open_port)
    assert listening_addresses(local_port) == []  # closed: nothing listens


@pytest.fixture(scope="module")
def first_dispatcher(tmp_path_factory):
    """One dispatcher on a work dir for the file's two server tests (a process start fewer): the first
    reads what it binds and prints, the second starts others on its work dir, then stops it."""
    folder = tmp_path_factory.mktemp("security")
    work, port = folder / "work", free_port()
    dispatcher = Background(folder, "first", CLI + ["data-service", "dispatcher", "--port", str(port),
                                                    "--work-dir", str(work)])
    try:
        wait_for(lambda: "listening on" in dispatcher.stderr, what="the first dispatcher")
        yield dispatcher, port, work
    finally:
        if dispatcher.proc.poll() is None:
            dispatcher.proc.kill()
            dispatcher.proc.wait()


@pytest.mark.slow
def test_servers_bind_every_interface_warn_once_and_no_protocol_narrows_them(first_dispatcher, tmp_path):
    """The facts docs/distributed.md states, against the installed TensorFlow: the dispatcher and the
    worker listen on every interface whatever --port says, each prints the one warning line, and this
    TensorFlow registers no protocol but plain grpc (grpc+local, which would accept local connections
    only, is refused). A TensorFlow that changes any of these turns this test red. The dispatcher is the
    file's ``first_dispatcher`` (its stop on SIGTERM is checked in the next test)."""
    dispatcher, port, _ = first_dispatcher
    worker_port = free_port()
    worker = Background(tmp_path, "worker", CLI + ["data-service", "worker", "--dispatcher",
                                                   f"localhost:{port}", "--port", str(worker_port)])
    try:
        wait_for(lambda: "serving dispatcher" in worker.stderr, what="the worker")
        for server, what, at in ((dispatcher, "tf.data dispatcher", port), (worker, "tf.data worker", worker_port)):
            assert listening_addresses(at) and set(listening_addresses(at)) <= {"0.0.0.0", "::"}
            lines = [line for line in server.stderr.splitlines() if "without authentication" in line]
            assert len(lines) == 1 and f"the {what} listens on every network interface at port {at}" in lines[0]
            assert 'docs/distributed.md, "Trust model"' in lines[0]
    finally:
        worker.proc.send_signal(signal.SIGTERM)
        worker.proc.wait(30)

    # in a process of its own: a refused server start has crashed a process that had run other servers
    import subprocess

    code = ("import tensorflow as tf\n"
            f"config = tf.data.experimental.service.DispatcherConfig(port={free_port()}, protocol='grpc+local')\n"
            "try:\n    tf.data.experimental.service.DispatchServer(config)\n"
            "except RuntimeError as e:\n    print(str(e).splitlines()[0])\n")
    done = subprocess.run([os.sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2"))
    assert done.stdout.strip() == ("No credentials factory has been registered for protocol grpc+local. The available "
                                   "types are: [ grpc ]"), done.stdout + done.stderr[-2000:]


@pytest.mark.slow
def test_a_second_dispatcher_on_a_work_dir_in_use_is_refused(first_dispatcher, tmp_path):
    """The file's ``first_dispatcher`` holds its work dir: a second is refused; once the first has stopped
    (SIGTERM, exit 0), a third starts there."""
    first, _, work = first_dispatcher
    try:
        second = Background(tmp_path, "second", CLI + ["data-service", "dispatcher", "--port", str(free_port()),
                                                      "--work-dir", str(work)])
        assert second.proc.wait(60) == 2
        assert second.stderr.strip().splitlines() == [
            f"captioning data-service: error: --work-dir {work} is in use by another dispatcher (process "
            f"{first.proc.pid}): two dispatchers would write one journal; stop that one, or give this one a work "
            "dir of its own"]
    finally:
        first.proc.send_signal(signal.SIGTERM)
        assert first.proc.wait(30) == 0
    # once the first has stopped, the work dir is free again (and its journal is what a restart reads)
    again = Background(tmp_path, "again", CLI + ["data-service", "dispatcher", "--port", str(free_port()),
                                                "--work-dir", str(work)])
    try:
        wait_for(lambda: "listening on" in again.stderr, what="the restarted dispatcher")
    finally:
        again.proc.send_signal(signal.SIGTERM)
        assert again.proc.wait(30) == 0
