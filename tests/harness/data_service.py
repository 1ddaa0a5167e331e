"""The tf.data service as the tests start it: dispatcher and worker processes of the command line on localhost
ports (:class:`Proc`, polled through its output), and a :class:`Cluster` of them."""

import re
import socket
import sys
import time

from tests.helpers import Background, free_port

HOST = re.escape(socket.gethostname())

class Proc(Background):
    """A server or consumer process in the background, its output going to files we can poll."""

    def __init__(self, folder, name, argv):
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "worker.txt").write_text(name)  # read by the dataset's map when this process is a worker
        super().__init__(folder, name, argv, cwd=folder)

    def wait_for(self, pattern, timeout=90, stream="stderr"):
        """Polls the output until ``pattern`` appears; returns the match."""
        deadline = time.time() + timeout
        while time.time() < deadline:
            exited = self.proc.poll() is not None  # before reading: what it wrote before exiting is read
            match = re.search(pattern, getattr(self, stream), re.M)
            if match:
                return match
            assert not exited, f"{self.name} exited {self.proc.returncode}:\n{self.stderr[-3000:]}"
            time.sleep(0.1)
        raise AssertionError(f"{self.name}: no {pattern!r} within {timeout} s:\n{self.stderr[-3000:]}")

    def elements(self):
        """(x, square, worker) of every ELEMENT line so far."""
        return [(int(x), int(sq), w) for x, sq, w in re.findall(r"^ELEMENT (\d+) (\d+) (\S+)$", self.stdout, re.M)]

    def wait_for_elements(self, count, timeout=90):
        self.wait_for(rf"(?:^ELEMENT .*\n){{{count}}}", timeout, stream="stdout")

    def stop(self, signum, timeout=15):
        """Sends ``signum``; returns (exit code, seconds it took to exit)."""
        sent = time.time()
        self.proc.send_signal(signum)
        return self.proc.wait(timeout=timeout), time.time() - sent

    def kill(self):
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

def dispatcher(folder, port, *args):
    return Proc(folder / f"dispatcher-{port}", "dispatcher", [sys.executable, "-m", "captioning", "data-service",
                                                              "dispatcher", "--port", str(port), *args])

def worker(folder, name, dispatcher_port, port, *args):
    return Proc(folder / name, name, [sys.executable, "-m", "captioning", "data-service", "worker", "--dispatcher",
                                      f"localhost:{dispatcher_port}", "--port", str(port), *args])

class Cluster:
    """A dispatcher and workers w1, w2, ... on fixed localhost ports, all started at once (the workers wait
    for the dispatcher); ``start_workers=False``: the dispatcher alone, until :meth:`start_workers`."""

    def __init__(self, folder, workers=2, dispatcher_args=(), worker_args=(), start_workers=True):
        self.folder, self.port, self.dispatcher_args, self.worker_args = folder, free_port(), dispatcher_args, worker_args
        self.service = f"localhost:{self.port}"
        self.dispatcher = dispatcher(folder, self.port, *dispatcher_args)
        self.worker_ports = {f"w{i + 1}": free_port() for i in range(workers)}
        self.workers = {}
        if start_workers:
            self.start_workers(wait=False)  # at once, while the dispatcher starts
        self.dispatcher.wait_for(rf"dispatcher listening on grpc://{HOST}:{self.port} ")
        if start_workers:
            self.start_workers()

    def start_workers(self, wait=True):
        """Starts the workers not started yet; ``wait``: and waits until each serves the dispatcher."""
        self.workers.update({name: worker(self.folder, name, self.port, port, *self.worker_args)
                             for name, port in self.worker_ports.items() if name not in self.workers})
        for name, w in self.workers.items() if wait else ():
            w.wait_for(rf"worker localhost:{self.worker_ports[name]} serving dispatcher localhost:{self.port}\n")

    def restart_worker(self, name):
        self.workers[name].kill()
        self.workers[name] = worker(self.folder, name, self.port, self.worker_ports[name], *self.worker_args)
        self.workers[name].wait_for(rf"worker localhost:{self.worker_ports[name]} serving")

    def restart_dispatcher(self, *args):
        self.dispatcher.kill()
        self.dispatcher = dispatcher(self.folder, self.port, *args)
        self.dispatcher.wait_for(rf"dispatcher listening on grpc://{HOST}:{self.port} ")

    def close(self):
        for p in [self.dispatcher, *self.workers.values()]:
            p.kill()
