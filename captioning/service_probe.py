"""Where a tf.data service server listens and whether a dispatcher answers: ``HOST:PORT`` addresses,
free ports, waiting (boundedly) for a dispatcher, and watching it during a run. Plain Python and gRPC,
no TensorFlow: :mod:`captioning.data_service` uses these before TensorFlow loads, so a wrong address is
answered in a second.

A dispatcher is asked with one gRPC call, its own ``GetVersion``
(:func:`captioning.tf_internals.dispatcher_version`), not with a TCP connect: a TCP probe also accepts a
worker's port or any other server, after which TensorFlow would wait forever; the gRPC call tells "not a
dispatcher" apart and has a deadline.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import socket
import sys
import threading
import time

import grpc

from captioning import tf_internals
from captioning.errors import InputError, ServiceLostError

ADDRESS = re.compile(r"(?:grpc://)?(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9](?:[A-Za-z0-9._-]*[A-Za-z0-9])?):(\d{1,5})")


def parse_address(text: str, param: str = "service") -> tuple[str, int]:
    """``HOST:PORT`` (``grpc://`` allowed in front, IPv6 hosts in brackets) as ``(host, port)``; an
    :class:`InputError` naming ``param`` otherwise.

    >>> parse_address("grpc://data0:5050")
    ('data0', 5050)
    >>> parse_address("[::1]:5050", "dispatcher")
    ('[::1]', 5050)
    >>> parse_address("data0", "dispatcher")
    Traceback (most recent call last):
    ...
    captioning.errors.InputError: `dispatcher` must look like HOST:PORT, e.g. data0:5050, got 'data0'
    """
    match = ADDRESS.fullmatch(text.strip())
    if not match or not 1 <= int(match[2]) <= 65535:
        raise InputError(f"`{param}` must look like HOST:PORT, e.g. data0:5050, got {text!r}", params=(param,))
    return match[1], int(match[2])


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


def wait_for_dispatcher(service: str, timeout_s: float = 60.0, param: str = "service",
                        stop: threading.Event | None = None) -> str | None:
    """Waits until a tf.data dispatcher answers at ``service`` (``HOST:PORT``), at most ``timeout_s``;
    returns its target ``grpc://HOST:PORT``, or None if ``stop`` was set meanwhile. An
    :class:`InputError` naming ``param`` when ``service`` is malformed, when a gRPC server that is not a
    dispatcher answers (at once), or when nothing answered in time (the line says why: connection refused,
    unknown host, no answer)."""
    host, port = parse_address(service, param)
    if not timeout_s > 0:
        raise InputError(f"`timeout_s` must be more than 0 s, got {timeout_s}", params=("timeout_s",))
    address, reason = f"{host}:{port}", "no answer"
    pause = stop if stop is not None else threading.Event()
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            tf_internals.dispatcher_version(address, max(0.1, min(deadline - time.monotonic(), 5.0)))
            return f"grpc://{address}"
        except grpc.RpcError as e:
            detail = e.details() or ""
            if e.code() == grpc.StatusCode.UNIMPLEMENTED:
                raise InputError(f"{address} answers, but it is not a tf.data dispatcher ({detail or 'unimplemented'}):"
                                 f" `{param}` must be the address the dispatcher logs, not a worker's",
                                 params=(param,)) from None
            if "refused" in detail.lower():
                reason = "connection refused"
            elif "resolv" in detail.lower() or "lookup" in detail.lower():
                reason = f"unknown host {host}"
        if pause.wait(0.5):  # set: stopped by a signal
            return None
        if time.monotonic() >= deadline:
            raise InputError(f"no tf.data dispatcher answered at {address} within {timeout_s:g} s ({reason}): start one "
                             f"there (captioning data-service dispatcher --port {port}), or correct `{param}`",
                             params=(param,))


def is_loopback(host: str) -> bool:
    """Whether ``host`` (as :func:`parse_address` returns it) names this machine's loopback interface."""
    return host.strip("[]") in ("localhost", "::1") or host.startswith("127.")


def _exit_with(error: ServiceLostError) -> None:
    sys.stderr.write(f"captioning: error: {error}\n")
    sys.stderr.flush()
    os._exit(error.exit_code)  # the main thread waits inside TensorFlow, where no exception reaches it


@contextlib.contextmanager
def watch_dispatcher(service: str, timeout_s: float = 60.0, interval_s: float = 5.0, on_lost=_exit_with):
    """While active, asks the dispatcher at ``service`` every ``interval_s`` whether it answers; once it
    has not for ``timeout_s``, calls ``on_lost(ServiceLostError)``, which by default prints
    ``captioning: error: lost the tf.data dispatcher at HOST:PORT: ...`` and ends the process with exit
    code 1: TensorFlow raises nothing when the dispatcher is gone, its iterator waits forever, and a
    thread blocked in it cannot be interrupted. A dispatcher back within ``timeout_s`` (from its work
    dir) is not reported: the stream resumes. ::

        with watch_dispatcher("data0:5050", timeout_s=120):
            for batch in distribute(dataset, "data0:5050", "distributed_epoch", "train"): ...
    """
    host, port = parse_address(service)
    stop = threading.Event()

    def watch():
        silent_since = None
        while not stop.wait(interval_s):
            try:
                tf_internals.dispatcher_version(f"{host}:{port}", min(interval_s, 10.0))
                silent_since = None
            except grpc.RpcError:
                silent_since = silent_since or time.monotonic()
                if time.monotonic() - silent_since >= timeout_s and not stop.is_set():
                    on_lost(ServiceLostError(
                        f"lost the tf.data dispatcher at {host}:{port}: no answer for {timeout_s:g} s (TensorFlow "
                        "would wait for it forever); restart it on its port from its work dir and run this again"))
                    return

    thread = threading.Thread(target=watch, name="tf.data dispatcher watch", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
