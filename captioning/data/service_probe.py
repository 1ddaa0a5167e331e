"""Where a tf.data service server listens and whether a dispatcher (and a worker) answers: ``HOST:PORT``
addresses, free ports, waiting (boundedly) for a dispatcher with a live worker, watching both during a
run, and which interfaces a server listens on. Plain Python and gRPC, no TensorFlow:
:mod:`captioning.data.service` and training use these before TensorFlow's runtime starts, so a wrong
address is answered in a second.

A dispatcher is asked with one gRPC call, its own ``GetVersion``
(:func:`captioning.tf_internals.dispatcher_version`), not with a TCP connect: a TCP probe also accepts a
worker's port or any other server, after which TensorFlow would wait forever; the gRPC call tells "not a
dispatcher" apart and has a deadline. Its workers are the ones its ``GetWorkers`` lists *and* that answer
a call of their own: the dispatcher keeps listing a killed worker until the worker's heartbeat times
out, minutes later, while a trainer waits for its elements without a word.

A parameter is named in messages as the library does (```service```, rewritten to the flag by the
command line); a config key (it has a dot: ``data.service``) as it is.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import socket
import sys
import threading
import time

import grpc

from captioning import tf_internals
from captioning.config.addresses import named, params_of, parse_address
from captioning.errors import InputError, ServiceLostError

log = logging.getLogger("captioning.data.service")

def check_port_free(port: int, param: str = "port") -> None:
    """An :class:`InputError` naming ``param`` if something listens on ``port`` on this machine.

    TF's servers cannot say it themselves: gRPC binds with ``SO_REUSEPORT``, so a second dispatcher on a
    busy port starts without complaint and the two share (and split) the connections. Checked by binding
    a plain socket (no ``SO_REUSEPORT``) to the port on all interfaces, IPv6 and IPv4; a server starting
    between this check and TF's own bind is not caught."""
    if not 0 <= port <= 65535:
        raise InputError(f"`{param}` must be a port number up to 65535, got {port}", params=(param,))
    for family, host in ((socket.AF_INET6, "::"), (socket.AF_INET, "0.0.0.0")):
        try:
            probe = socket.socket(family, socket.SOCK_STREAM)
        except OSError:  # no IPv6 here
            continue
        with probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a closed connection's TIME_WAIT is fine
            try:
                probe.bind((host, port))
            except OSError as e:
                if e.errno == errno.EADDRINUSE:
                    raise InputError(f"`{param}` {port} is in use on this machine (another dispatcher or worker?): "
                                     "stop that server or choose another port", params=(param,)) from None
                if e.errno == errno.EACCES:
                    raise InputError(f"`{param}` {port} needs privileges to listen on: choose a port above 1023",
                                     params=(param,)) from None
                if e.errno != errno.EADDRNOTAVAIL:
                    raise


def _listed(workers: list[str]) -> str:
    """``it lists a:1, which does not answer`` / ``it lists a:1, b:2, which do not answer``."""
    return f"it lists {', '.join(workers)}, which {'does' if len(workers) == 1 else 'do'} not answer"


def live_workers(address: str, timeout_s: float = 5.0) -> tuple[list[str], list[str]]:
    """(the workers the dispatcher at ``address`` lists, those of them that answer now). Raises
    ``grpc.RpcError`` when the dispatcher does not answer."""
    listed = tf_internals.dispatcher_workers(address, timeout_s)
    return listed, [w for w in listed if tf_internals.worker_answers(w, min(timeout_s, 5.0))]


def wait_for_dispatcher(service: str, timeout_s: float = 60.0, param: str = "service",
                        stop: threading.Event | None = None, need_worker: bool = False) -> str | None:
    """Waits until a tf.data dispatcher answers at ``service`` (``HOST:PORT``) — and with ``need_worker``
    until one of its workers answers too, saying every 10 s that it waits — at most ``timeout_s``;
    returns its target ``grpc://HOST:PORT``, or None if ``stop`` was set meanwhile. An
    :class:`InputError` naming ``param`` when ``service`` is malformed, when a gRPC server that is not a
    dispatcher answers (at once), or when nothing answered in time (the line says why: connection
    refused, unknown host, no answer, no worker)."""
    host, port = parse_address(service, param)
    if not timeout_s > 0:
        raise InputError(f"`timeout_s` must be more than 0 s, got {timeout_s}", params=("timeout_s",))
    address, reason = f"{host}:{port}", "no answer"
    pause = stop if stop is not None else threading.Event()
    deadline = time.monotonic() + timeout_s
    said = time.monotonic()
    listed: list[str] | None = None
    while True:
        try:
            tf_internals.dispatcher_version(address, max(0.1, min(deadline - time.monotonic(), 5.0)))
            if not need_worker:
                return f"grpc://{address}"
            listed, alive = live_workers(address, max(0.1, min(deadline - time.monotonic(), 5.0)))
            if alive:
                return f"grpc://{address}"
            if time.monotonic() - said >= 10:
                log.info("waiting for a live tf.data worker of the dispatcher at %s (%s)", address,
                         _listed(listed) if listed else "none has registered")
                said = time.monotonic()
        except grpc.RpcError as e:
            detail = e.details() or ""
            if e.code() == grpc.StatusCode.UNIMPLEMENTED:
                raise InputError(f"{address} answers, but it is not a tf.data dispatcher ({detail or 'unimplemented'}):"
                                 f" {named(param)} must be the address the dispatcher logs, not a worker's",
                                 params=params_of(param)) from None
            listed = None
            if "refused" in detail.lower():
                reason = "connection refused"
            elif "resolv" in detail.lower() or "lookup" in detail.lower():
                reason = f"unknown host {host}"
        if pause.wait(0.5):  # set: stopped by a signal
            return None
        if time.monotonic() >= deadline:
            if listed is not None:
                raise InputError(f"the tf.data dispatcher at {address} has no workers ("
                                 + (_listed(listed) if listed else "none has registered") + f" within {timeout_s:g} s): start one there (captioning "
                                 f"data-service worker --dispatcher {address})", params=params_of(param))
            raise InputError(f"no tf.data dispatcher answered at {address} within {timeout_s:g} s ({reason}): start one "
                             f"there (captioning data-service dispatcher --port {port}), or correct {named(param)}",
                             params=params_of(param))


def exit_with(error: ServiceLostError, command: str = "captioning", then: str = "") -> None:
    """Prints ``<command>: error: <error>[; <then>]`` and ends the process with the error's exit code at
    once: the main thread waits inside TensorFlow, where no exception reaches it."""
    sys.stderr.write(f"{command}: error: {error}" + (f"; {then}" if then else "") + "\n")
    sys.stderr.flush()
    os._exit(error.exit_code)


@contextlib.contextmanager
def watch_dispatcher(service: str, timeout_s: float = 60.0, interval_s: float = 5.0, on_lost=exit_with):
    """While active, asks the dispatcher at ``service`` every ``interval_s`` whether it answers and which of
    its workers do; once the dispatcher has not answered, or none of its workers has, for ``timeout_s``,
    calls ``on_lost(ServiceLostError)``, which by default prints ``captioning: error: ...`` and ends the
    process with exit code 1: TensorFlow raises nothing when the dispatcher or every worker is gone, its
    iterator waits forever, and a thread blocked in it cannot be interrupted. A dispatcher back within
    ``timeout_s`` (from its work dir), or a worker back at its address, is not reported: the stream
    resumes. ::

        with watch_dispatcher("data0:5050", timeout_s=120):
            for batch in distribute(dataset, "data0:5050", "distributed_epoch", "train"): ...
    """
    host, port = parse_address(service)
    address = f"{host}:{port}"
    stop = threading.Event()

    def watch():
        silent_since = workerless_since = None
        listed: list[str] = []
        while not stop.wait(interval_s):
            try:
                listed, alive = live_workers(address, min(interval_s, 10.0))
                silent_since = None
                workerless_since = None if alive else (workerless_since or time.monotonic())
            except grpc.RpcError:
                silent_since = silent_since or time.monotonic()
            now = time.monotonic()
            if stop.is_set():
                return
            if silent_since and now - silent_since >= timeout_s:
                on_lost(ServiceLostError(
                    f"lost the tf.data dispatcher at {address}: no answer for {timeout_s:g} s (TensorFlow would wait "
                    "for it forever); restart it on its port from its work dir"))
                return
            if workerless_since and now - workerless_since >= timeout_s:
                on_lost(ServiceLostError(
                    f"the tf.data dispatcher at {address} has had no live worker for {timeout_s:g} s ("
                    + (_listed(listed) if listed else "none is registered")
                    + "; TensorFlow would wait for one forever); start a worker (at the lost one's address, to take "
                    "its task back)"))
                return

    thread = threading.Thread(target=watch, name="tf.data dispatcher watch", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()


# ---- exposure: which interfaces a server listens on ---------------------------------------------------------

def listening_addresses(port: int) -> list[str] | None:
    """The local addresses sockets listen on at TCP ``port`` (``0.0.0.0`` and ``::`` are every interface),
    read from Linux's ``/proc/net/tcp`` and ``tcp6``; None where those do not exist."""
    found, seen = [], False
    for name, size in (("/proc/net/tcp", 4), ("/proc/net/tcp6", 16)):
        try:
            with open(name, encoding="ascii") as f:
                lines = f.read().splitlines()[1:]
        except OSError:
            continue
        seen = True
        for line in lines:
            fields = line.split()
            local, state = fields[1], fields[3]
            hex_address, hex_port = local.split(":")
            if state != "0A" or int(hex_port, 16) != port:  # 0A: LISTEN
                continue
            raw = bytes.fromhex(hex_address)
            # the kernel prints each 32-bit word in host (little-endian) order
            raw = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
            found.append(socket.inet_ntop(socket.AF_INET if size == 4 else socket.AF_INET6, raw))
    return found if seen else None


def exposure(port: int) -> list[str]:
    """The addresses at ``port`` reachable from other machines: every interface (``0.0.0.0``, ``::``) or
    any address that is not loopback. Where listening addresses cannot be read, TensorFlow's own bind
    (every interface: docs/distributed.md#trust-model) is assumed."""
    addresses = listening_addresses(port)
    if addresses is None:
        return ["0.0.0.0"]
    return sorted({a for a in addresses if not (a.startswith("127.") or a in ("::1", "::ffff:127.0.0.1"))})


def warn_if_exposed(what: str, port: int, logger=None) -> bool:
    """One warning line when the server ``what`` listening on ``port`` can be reached from other machines
    (see :func:`exposure`); returns whether it warned."""
    open_on = exposure(port)
    if not open_on:
        return False
    where = "every network interface" if any(a in ("0.0.0.0", "::") for a in open_on) else ", ".join(open_on)
    (logger or log).warning(
        "the %s listens on %s at port %d without authentication: anyone who can reach that port can run code and "
        "read or write files as this user; keep it on a private network or firewall the port "
        "(docs/distributed.md, \"Trust model\")", what, where, port)
    return True
