"""The tf.data service (captioning/data_service.py, `captioning data-service`): real dispatcher and worker
processes of the command line on localhost ports, real trainers' iterators in subprocesses
(tests/data_service_consumer.py: range(N) squared on the workers, each element labelled with the worker
that made it), real SIGTERM, SIGINT and SIGKILL. A consumer whose own exit is not what is checked (it reads to
the end while servers are killed and restarted under it) reads in the test's process instead (:func:`consume`,
:class:`Reader`: the same dataset, no TensorFlow start-up to pay again); one whose error line and exit code are
checked is a process of its own. The assertions are what TensorFlow 2.21 does, as the module docstring of
captioning/data_service.py reports it."""

import collections
import os
import re
import signal
import sys
import threading
import time

import pytest

from captioning.errors import InputError
from tests.helpers import REPO, free_port, run_cli
from tests.harness.data_service import HOST, Cluster, Proc, dispatcher, worker

CONSUMER = os.path.join(REPO, "tests", "data_service_consumer.py")
def consumer(folder, name, service, *args):
    return Proc(folder / name, name, [sys.executable, CONSUMER, "--service", service, *args])


def read_squares(service, n, mode="distributed_epoch", job_name=None, dataset_id=None, timeout_s=60.0):
    """tests/data_service_consumer.py's dataset through the service, built in this process: an iterator of
    (x, square, worker) as a consumer process prints them."""
    from captioning.data import service as data_service
    from tests.data_service_consumer import squares

    dataset = data_service.distribute(squares(n), service, mode, job_name, dataset_id=dataset_id, timeout_s=timeout_s)
    return ((int(x), int(square), worker.numpy().decode()) for x, square, worker in dataset)


def consume(service, n, mode="distributed_epoch"):
    """Every element a consumer reading to the end gets, read here."""
    return list(read_squares(service, n, mode))


class Reader(threading.Thread):
    """A consumer in this process that reads on while the test kills and restarts servers: reads
    :func:`read_squares` to the end in a thread of its own, ``delay`` seconds an element (as a training step),
    into :attr:`elements`; :attr:`error` is what it raised, :attr:`done` that it reached the end."""

    def __init__(self, service, n, delay):
        super().__init__(daemon=True)
        self.service, self.n, self.delay = service, n, delay
        self.elements, self.error, self.done = [], None, False

    def run(self):
        try:
            for element in read_squares(self.service, self.n, timeout_s=60.0):
                self.elements.append(element)
                time.sleep(self.delay)
            self.done = True
        except BaseException as e:  # noqa: BLE001 - re-raised in the test by finish()
            self.error = e

    def wait_for_elements(self, count, timeout=90):
        deadline = time.time() + timeout
        while len(self.elements) < count:
            assert self.error is None and not self.done, (self.error, len(self.elements))
            assert time.time() < deadline, f"no {count} elements within {timeout} s: {len(self.elements)}"
            time.sleep(0.05)

    def finish(self, timeout):
        """Waits for the end of the stream; raises what the reader raised."""
        self.join(timeout)
        assert not self.is_alive(), f"still reading after {timeout} s: {len(self.elements)} elements"
        if self.error is not None:
            raise self.error
        assert self.done


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """One dispatcher (with a work dir) and workers w1, w2 for the whole file: the readers first, then the
    tests that kill a server, each leaving a working cluster for the next (a killed worker is started
    again, a killed dispatcher too), in the file's order; the last kills the dispatcher for good. One
    cluster start-up instead of five."""
    folder = tmp_path_factory.mktemp("cluster")
    c = Cluster(folder, dispatcher_args=("--work-dir", str(folder / "journal")))
    yield c
    c.close()


def one_error_line(proc, code, timeout=90):
    """Waits for ``proc`` to exit with ``code``; returns its stderr, which must be one error line."""
    assert proc.proc.wait(timeout=timeout) == code, proc.stderr[-3000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    return lines[0]


def test_help_explains_each_flag():
    for server, flags in (("dispatcher", ["--port", "--work-dir"]),
                          ("worker", ["--dispatcher", "--port", "--host", "--timeout", "--heartbeat"])):
        result = run_cli("data-service", server, "--help", timeout=60)
        assert result.returncode == 0
        described = re.findall(r"^  (--[a-z-]+) \S*\s+\S", result.stdout, re.M)  # a flag and the start of its text
        assert sorted(described) == sorted(flags), result.stdout


def stops_cleanly(server, signum, what):
    """Sends ``signum`` to ``server``, a dispatcher or worker: it stops within 10 s, exit 0, with plain lines."""
    code, took = server.stop(signum)
    assert code == 0 and took < 10, (server.name, code, took, server.stderr)
    assert f"{signum.name}: stopping the {what}\n" in server.stderr
    assert server.stderr.rstrip().endswith(f"{what} stopped"), server.stderr
    assert "Traceback" not in server.stderr


@pytest.mark.slow
def test_servers_log_their_address_and_stop_cleanly_on_sigterm_and_sigint(tmp_path):
    """A dispatcher and its two workers log their addresses; SIGINT stops one worker, SIGTERM the other and
    then the dispatcher. (SIGINT to a dispatcher: test_a_restarted_dispatcher's without a work dir, which
    is stopped so, a process start fewer here.)"""
    ports = [free_port() for _ in range(3)]
    servers = {"dispatcher-term": dispatcher(tmp_path, ports[0]),
               "worker-int": worker(tmp_path, "worker-int", ports[0], ports[1]),
               "worker-term": worker(tmp_path, "worker-term", ports[0], ports[2])}
    try:
        servers["dispatcher-term"].wait_for(rf"dispatcher listening on grpc://{HOST}:{ports[0]} \(no work dir")
        servers["worker-int"].wait_for(rf"worker localhost:{ports[1]} serving dispatcher localhost:{ports[0]}\n")
        servers["worker-term"].wait_for(rf"worker localhost:{ports[2]} serving dispatcher localhost:{ports[0]}\n")
        for name in ("worker-int", "worker-term", "dispatcher-term"):  # workers first
            stops_cleanly(servers[name], signal.SIGINT if name.endswith("int") else signal.SIGTERM,
                          name.split("-")[0])
    finally:
        for s in servers.values():
            s.kill()


@pytest.mark.slow
def test_distributed_epoch_gives_every_element_exactly_once(cluster):
    n = 101  # not a multiple of the 2 workers
    got = consume(cluster.service, n, "distributed_epoch")
    assert sorted(x for x, _, _ in got) == list(range(n))
    assert all(square == x * x for x, square, _ in got)
    assert {w for _, _, w in got} <= {"w1", "w2"}


@pytest.mark.slow
def test_parallel_epochs_has_each_worker_produce_the_whole_dataset(cluster):
    n = 51
    by_worker = collections.defaultdict(list)
    for x, square, w in consume(cluster.service, n, "parallel_epochs"):
        assert square == x * x
        by_worker[w].append(x)
    assert {w: sorted(xs) for w, xs in by_worker.items()} == {"w1": list(range(n)), "w2": list(range(n))}


@pytest.mark.slow
@pytest.mark.parametrize("how", ["job_name", "dataset_id"])
def test_trainers_sharing_a_job_split_it_between_them(cluster, how):
    """Two trainers (as the workers of a MultiWorkerMirroredStrategy would be) read one distributed_epoch
    job: together they see every element once. ``dataset_id``: register_dataset + from_dataset_id. The two
    read in turns, here (each its own dataset, built by the same code, as two processes would)."""
    n = 201
    shared = {"job_name": f"shared-{how}", "dataset_id": "squares-201" if how == "dataset_id" else None}
    readers = [read_squares(cluster.service, n, **shared) for _ in range(2)]
    got, active = [[], []], [0, 1]
    while active:
        for index in list(active):
            element = next(readers[index], None)
            if element is None:
                active.remove(index)
            else:
                got[index].append(element[0])
    xs = got[0] + got[1]
    assert sorted(xs) == list(range(n))


SERVED = pytest.mark.slow  # the cases that need the file's running servers: the quick loop starts none


@pytest.mark.parametrize("args, pattern", [
    pytest.param(["dispatcher", "--port", "{dispatcher}"], r"--port {dispatcher} is in use on this machine \(another "
                 r"dispatcher or worker\?\): stop that server or choose another port", marks=SERVED),
    pytest.param(["worker", "--dispatcher", "localhost:{dispatcher}", "--port", "{w1}"],
                 r"--port {w1} is in use on this machine", marks=SERVED),
    (["worker", "--dispatcher", "dispatcher-host"],
     r"--dispatcher must look like HOST:PORT, e.g. data0:5050, got 'dispatcher-host'"),
    (["worker", "--dispatcher", "localhost:70000"], r"--dispatcher must look like HOST:PORT, .* got 'localhost:70000'"),
    pytest.param(["worker", "--dispatcher", "localhost:{w1}"], r"localhost:{w1} answers, but it is not a tf.data "
                 r"dispatcher \(.*\): --dispatcher must be the address the dispatcher logs, not a worker's",
                 marks=SERVED),
    (["dispatcher", "--port", "{free}", "--work-dir", "{file}/journal"],
     r"--work-dir {file}/journal cannot be created or written: \[Errno 20\] Not a directory"),
    (["dispatcher", "--port", "65536"], r"argument --port: must be a port number from 1 to 65535, got '65536'"),
], ids=["dispatcher-port-in-use", "worker-port-in-use", "no-port", "port-too-large", "a-worker-not-the-dispatcher",
        "work-dir-under-a-file", "port-out-of-range"])
def test_usage_errors_are_one_line_and_exit_2(request, tmp_path, args, pattern):
    """The file's cluster is started only for the cases that name its servers' ports."""
    (tmp_path / "file").write_text("not a folder")
    values = {"free": free_port(), "file": tmp_path / "file"}
    if any("{dispatcher}" in a or "{w1}" in a for a in args):
        cluster = request.getfixturevalue("cluster")
        values.update(dispatcher=cluster.port, w1=cluster.worker_ports["w1"])
    started = time.time()
    result = run_cli("data-service", *[a.format(**values) for a in args], timeout=60)
    assert result.returncode == 2, result.stderr
    assert re.fullmatch(rf"captioning data-service: error: {pattern.format(**values)}.*\n", result.stderr), result.stderr
    assert time.time() - started < 30  # before TensorFlow loads, or within a few seconds


@pytest.mark.slow
def test_an_unreachable_dispatcher_is_one_line_within_the_timeout(tmp_path):
    port = free_port()
    started = time.time()
    result = run_cli("data-service", "worker", "--dispatcher", f"localhost:{port}", "--timeout", "1", timeout=60)
    took = time.time() - started
    assert result.returncode == 2 and 1 <= took < 20, (took, result.stderr)
    assert result.stderr == (f"captioning data-service: error: no tf.data dispatcher answered at localhost:{port} "
                             f"within 1 s (connection refused): start one there (captioning data-service dispatcher "
                             f"--port {port}), or correct --dispatcher\n")

    started = time.time()  # a trainer: distribute() fails instead of TF's wait forever
    with pytest.raises(InputError) as refused:
        next(read_squares(f"localhost:{port}", 10, timeout_s=2))
    took = time.time() - started
    assert 2 <= took < 60, took
    assert refused.value.exit_code == 2
    assert str(refused.value) == (f"no tf.data dispatcher answered at localhost:{port} within 2 s (connection "
                                  f"refused): start one there (captioning data-service dispatcher --port {port}), "
                                  f"or correct `service`")


@pytest.mark.slow
def test_a_killed_worker_costs_its_splits_but_the_stream_goes_on(cluster):
    """distributed_epoch after ``kill -9`` of one of two workers: the consumer keeps receiving the other
    worker's elements; none repeats (TF's at-most-once for dynamic sharding), the dead worker's splits are
    lost. The epoch's end waits until a worker is back at the dead one's address (the file's cluster: w1
    is started again there, as the next tests need it). The consumer reads in this process (:class:`Reader`):
    what is checked is its stream, not its exit."""
    n = 400
    reader = Reader(cluster.service, n, delay=0.02)
    reader.start()
    reader.wait_for_elements(40)
    cluster.workers["w1"].proc.send_signal(signal.SIGKILL)
    at_kill = len(reader.elements)
    reader.wait_for_elements(at_kill + 100, timeout=60)  # the stream goes on
    count, since = len(reader.elements), time.time()
    while time.time() - since < 3:  # until the survivor has had nothing more for 3 s
        time.sleep(0.2)
        if len(reader.elements) != count:
            count, since = len(reader.elements), time.time()
    assert reader.is_alive() and not reader.done and reader.error is None  # the end of the epoch waits for w1's address
    cluster.restart_worker("w1")
    reader.finish(timeout=90)
    got = [x for x, _, _ in reader.elements]
    assert len(got) == len(set(got)) and set(got) <= set(range(n))  # at most once
    missing = n - len(got)
    assert 0 <= missing < 100, missing  # what w1 had fetched or buffered when it died
    print(f"killed w1 after {at_kill} elements; {missing} elements lost")


@pytest.mark.slow
@pytest.mark.parametrize("work_dir", [True, False], ids=["from-its-work-dir", "without-state"])
def test_a_restarted_dispatcher(cluster, tmp_path, work_dir):
    """``kill -9`` of the dispatcher mid-stream, restarted on its port. From its work dir: the consumer
    started before goes on, and distributed_epoch still gives every element exactly once (it reads in this
    process, :class:`Reader`: its stream is what is checked). Without a work dir: the consumer's job is gone,
    and it stops with one line (TF's NotFoundError), exit 1 (a process of its own). The file's cluster, its
    dispatcher started with a work dir: restarted with it, then (the second case) without it, which SIGINT
    then stops cleanly (a check of the signal test's), and then again from its work dir for the next test (a
    dispatcher without state does not know the workers within seconds; the journal does)."""
    n = 300
    if work_dir:
        reader = Reader(cluster.service, n, delay=0.02)
        reader.start()
        reader.wait_for_elements(40)
        cluster.dispatcher.proc.send_signal(signal.SIGKILL)
        killed = time.time()
        cluster.restart_dispatcher(*cluster.dispatcher_args)
        print(f"dispatcher back after {time.time() - killed:.1f} s")
        reader.finish(timeout=120)
        assert sorted(x for x, _, _ in reader.elements) == list(range(n))
        print(f"consumer done {time.time() - killed:.1f} s after the kill")
        return
    c = consumer(tmp_path, "consumer", cluster.service, "--n", str(n), "--delay", "0.02")
    try:
        c.wait_for_elements(40)
        cluster.dispatcher.proc.send_signal(signal.SIGKILL)
        killed = time.time()
        cluster.restart_dispatcher()
        print(f"dispatcher back after {time.time() - killed:.1f} s")
        line = one_error_line(c, 1, timeout=120)
        # TF's NotFoundError names the trainer's client or the iteration, whichever asked the dispatcher first
        assert re.fullmatch(rf"captioning: error: the tf.data service at localhost:{cluster.port} lost this run's "
                            r"input job \(.*(Unknown iteration client id|Iteration id) \d+.*\): start the "
                            r"dispatcher with a work dir, which keeps jobs across its restarts, then run this "
                            r"again", line), line
        assert re.search(rf"dispatcher listening on grpc://{HOST}:{cluster.port} \(no work dir",
                         cluster.dispatcher.stderr), cluster.dispatcher.stderr
        stops_cleanly(cluster.dispatcher, signal.SIGINT, "dispatcher")
        cluster.restart_dispatcher(*cluster.dispatcher_args)
        print(f"consumer done {time.time() - killed:.1f} s after the kill")
    finally:
        c.kill()


@pytest.mark.slow
def test_a_dispatcher_gone_for_good_ends_a_watched_trainer_with_one_line(cluster, tmp_path):
    """TF's iterator waits forever for a dispatcher that does not come back; watch_dispatcher ends the
    process with one line after its timeout. The file's cluster, last: its dispatcher is not started
    again."""
    c = consumer(tmp_path, "consumer", cluster.service, "--n", "100000", "--delay", "0.01", "--watch", "3")
    try:
        c.wait_for_elements(20)
        cluster.dispatcher.proc.send_signal(signal.SIGKILL)
        killed = time.time()
        line = one_error_line(c, 1, timeout=60)
        took = time.time() - killed
    finally:
        c.kill()
    assert 3 <= took < 15, took
    assert line == (f"captioning: error: lost the tf.data dispatcher at localhost:{cluster.port}: no answer for 3 s "
                    "(TensorFlow would wait for it forever); restart it on its port from its work dir")

