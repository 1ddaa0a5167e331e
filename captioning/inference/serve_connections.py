"""``captioning serve``'s connections: the listening socket, a deadline for each request, a bound on the connections
open at once, the addresses the server answers to, and a stop that answers what is in flight.

- **Deadlines.** A connection has ``idle_timeout`` seconds to send the first byte of a request (after it opens, or
  after its last answer); then it is closed without an answer. From that first byte, the whole request (request
  line, headers and body) must arrive within ``request_timeout`` seconds, however the bytes trickle: a read waits
  only for the time left (:class:`DeadlineReader`), and past it the request is answered 408 and the connection
  closed. The handler reads the body before it waits for one of the ``max_in_flight`` model slots, so a slow
  client holds a connection, never a slot.
- **Connections.** At most ``max_connections`` are open at once (idle, being read, waiting for a slot or being
  captioned), each on its own thread; one more is answered 503 from the accepting thread and closed. The listen
  backlog is the same number (Linux caps it at ``net.core.somaxconn``, 4096 by default), so a burst up to that
  size waits to be accepted instead of being reset.
- **Addresses** (:class:`Addresses`). A request whose ``Host`` is not an address the server is reached by, or a
  ``POST`` whose ``Origin`` is another site, is refused with 403 (against DNS rebinding and cross-site posts).
- **Stop** (:meth:`Server.stop`). The listening socket closes; each request being read or captioned is answered
  (within its deadline); idle connections close; it returns once every connection's thread has ended.

The limits are a :class:`Connections` on the server (``start(..., connections=Connections(...))``), the module's
constants by default; tests scale them down.
"""

from __future__ import annotations

import dataclasses
import errno
import io
import ipaddress
import logging
import re
import socket
import threading
import time
from http.server import ThreadingHTTPServer
from urllib.parse import urlsplit

from captioning.errors import InputError
from captioning.inference.serve_api import ApiError, Limits

log = logging.getLogger("captioning.serve")

REQUEST_TIMEOUT = 30  # seconds from a request's first byte to its last (headers and body); then 408
IDLE_TIMEOUT = 10  # seconds a connection may wait before a request's first byte; then closed without an answer
MAX_CONNECTIONS = 256  # connections open at once, also the listen backlog; one more: 503 and closed
MAX_IN_FLIGHT = 32  # requests (their bodies read) captioned at once
BUSY_WAIT = 30  # seconds a request whose body is read waits for one of those slots; then 503
POLL = 0.25  # seconds between an idle connection's looks at whether the server is stopping
BODY_PIECE = 1024 * 1024  # bytes of a body read (and counted against the server's Budget) at a time


@dataclasses.dataclass(frozen=True)
class Connections:
    """The server's connection limits (module docstring), the module's constants by default."""

    request_timeout: float = REQUEST_TIMEOUT
    idle_timeout: float = IDLE_TIMEOUT
    max_connections: int = MAX_CONNECTIONS
    max_in_flight: int = MAX_IN_FLIGHT
    busy_wait: float = BUSY_WAIT


class Late(Exception):
    """A request not whole within its deadline: answered 408."""


class DeadlineReader(io.RawIOBase):
    """A connection's socket as a raw stream (wrapped in a ``BufferedReader`` as the handler's ``rfile``) whose
    reads keep the deadlines: before a request's first byte, the end of the stream once the idle deadline passes or
    the server stops; from it, :class:`Late` once ``request_timeout`` has passed, however the bytes trickle."""

    def __init__(self, sock: socket.socket, server: "Server"):
        super().__init__()
        self.sock, self.server = sock, server
        self.next_request()

    def next_request(self) -> None:
        """The connection waits for a request: the idle deadline starts now."""
        self.started = None
        self.idle_until = time.monotonic() + self.server.connections.idle_timeout

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        while True:
            now = time.monotonic()
            if self.started is None:
                if self.server.stopping or now >= self.idle_until:
                    return 0
                wait = min(self.idle_until - now, POLL)
            else:
                wait = self.started + self.server.connections.request_timeout - now
                if wait <= 0:
                    raise Late(f"the request did not arrive within {self.server.connections.request_timeout:g} s")
            self.sock.settimeout(wait)
            try:
                n = self.sock.recv_into(buffer)
            except TimeoutError:
                continue
            if n and self.started is None:
                self.started = time.monotonic()
            return n


class Addresses:
    """Whom the server answers: a ``Host`` naming the address it serves at its port (``127.0.0.1:PORT``,
    ``localhost:PORT`` and ``[::1]:PORT`` on a loopback address; any IP address at the port on ``0.0.0.0`` or
    ``::``, as a name would need DNS rebinding; the ``--host`` given), or a name of ``allowed`` (``--allowed-host``,
    at any port: the names a proxy or a hosts file gives it). A request without ``Host`` (no browser sends one)
    passes. A ``POST`` with an ``Origin`` passes when that origin is the page's own (``http://`` + its ``Host``) or
    an allowed name; browsers send ``Origin`` on every ``POST``, so another site's page is refused.

    >>> a = Addresses("127.0.0.1", "127.0.0.1", 8000, ["captions.lan"])
    >>> [a.refuses_host(h) is None for h in ("127.0.0.1:8000", "localhost:8000", "evil.com:8000", "captions.lan")]
    [True, True, False, True]
    >>> a.refuses_origin("http://evil.com", "127.0.0.1:8000") is None, a.refuses_origin(None, "127.0.0.1:8000")
    (False, None)
    """

    def __init__(self, host: str, address: str, port: int, allowed=()):
        self.port, self.allowed = port, {name.lower().strip("[]") for name in allowed}
        bound = ipaddress.ip_address(address)
        self.any_address = bound.is_unspecified
        self.names = {host.lower().strip("[]"), address.lower()}
        if bound.is_loopback or self.any_address:
            self.names |= {"localhost", "127.0.0.1", "::1"}
        shown = [f"[{n}]:{port}" if ":" in n else f"{n}:{port}" for n in sorted(self.names)]
        self.described = ", ".join(shown + (["any IP address at port " + str(port)] if self.any_address else []))

    def _passes(self, name: str | None, port: int | None) -> bool:
        if not name:
            return False
        if name in self.allowed:
            return True
        if port != self.port:
            return False
        if name in self.names:
            return True
        try:
            return self.any_address and bool(ipaddress.ip_address(name))
        except ValueError:
            return False

    @staticmethod
    def _split(authority: str, scheme: str = "http") -> tuple[str | None, int | None]:
        try:
            parts = urlsplit(f"{scheme}://{authority}")
            return (parts.hostname or "").removesuffix("."), parts.port or (443 if scheme == "https" else 80)
        except ValueError:  # a port that is not a number, an unclosed bracket
            return None, None

    def refuses_host(self, host: str | None) -> str | None:
        """Why a request with this ``Host`` header is refused (one line), or None when it passes."""
        if host is None or self._passes(*self._split(host.strip())):
            return None
        return (f"Host {host[:100]!r} is not this server's address ({self.described}): to serve it by another name, "
                "start it with --allowed-host NAME")

    def refuses_origin(self, origin: str | None, host: str | None) -> str | None:
        """Why a ``POST`` with this ``Origin`` (sent to this ``Host``) is refused (one line), or None."""
        if origin is None:
            return None
        origin = origin.strip()
        if host is not None and origin.lower() == f"http://{host.strip().lower()}":
            return None
        parts = urlsplit(origin) if origin.startswith(("http://", "https://")) else None
        if parts is not None and (parts.hostname or "").removesuffix(".") in self.allowed:
            return None
        return (f"a cross-origin request from {origin[:100]!r} is refused: the page must be this server's own "
                "(or its name given with --allowed-host)")


class Server(ThreadingHTTPServer):
    """The HTTP server: a tracked (non-daemon) thread a connection, at most ``connections.max_connections`` of
    them; ``stopping`` once :meth:`stop` was called. ``connections``, ``addresses``, and what the handler reads
    (batcher, limits, page, in-flight slots) are set by ``start``."""

    daemon_threads = False  # each connection's thread is joined by server_close()
    block_on_close = True
    request_queue_size = MAX_CONNECTIONS  # the listen backlog
    connections = Connections()
    addresses: Addresses | None = None
    stopping = False

    def __init__(self, *args, **kwargs):
        self.open, self._open_lock = 0, threading.Lock()
        super().__init__(*args, **kwargs)

    def process_request(self, request, client_address):
        with self._open_lock:
            full = self.open >= self.connections.max_connections
            self.open += not full
        if full:
            self._refuse(request)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:  # no thread for it (the process is out of them)
            with self._open_lock:
                self.open -= 1
            self.shutdown_request(request)
            raise

    def process_request_thread(self, request, client_address):
        try:
            super().process_request_thread(request, client_address)
        finally:
            with self._open_lock:
                self.open -= 1

    def _refuse(self, request: socket.socket) -> None:
        """503 and close, from the accepting thread (never waiting on the client): what has arrived of the request
        is read first, as a close with unread bytes would reset the connection before the answer is read."""
        body = b'{"error": "the server has too many connections open: try again"}'
        answer = (b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json; charset=utf-8\r\n"
                  b"Content-Length: %d\r\nConnection: close\r\nRetry-After: 1\r\n\r\n%s" % (len(body), body))
        try:
            request.setblocking(False)
            try:
                while request.recv(65536):
                    pass
            except (BlockingIOError, InterruptedError):
                pass
            request.send(answer)  # a fresh socket's send buffer takes it whole
        except OSError:
            pass
        self.shutdown_request(request)

    def handle_error(self, request, client_address):  # a client gone mid-answer: one debug line, no traceback
        log.debug("connection from %s ended with an error", client_address,
                  exc_info=True)

    def stop(self) -> None:
        """Stops accepting and closes the listening socket; each request being read or captioned is answered
        (within its deadline) and idle connections close; returns when every connection's thread has ended."""
        self.stopping = True
        self.shutdown()
        self.server_close()


def bind(host: str, port: int, handler) -> Server:
    """The server listening on ``host``:``port`` (not serving yet), its requests handled by ``handler`` (a
    ``BaseHTTPRequestHandler`` class); an InputError naming ``host`` or ``port`` when it cannot bind."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except (socket.gaierror, UnicodeError):
        raise InputError(f"`host` {host!r} is not an address or a name of this machine", params=("host",)) from None
    kind = type("Server", (Server,), {"address_family": infos[0][0]})  # IPv4 or IPv6, as the host is
    try:
        server = kind(infos[0][4][:2], handler)
    except OSError as e:
        if e.errno == errno.EADDRINUSE:
            raise InputError(f"`port` {port} is in use on {host}: stop what listens there or choose another "
                             "(--port 0: any free port)", params=("port",)) from None
        if e.errno in (errno.EACCES, errno.EPERM):
            raise InputError(f"`port` {port}: not allowed to listen there (ports below 1024 need privileges)",
                             params=("port",)) from None
        raise InputError(f"`host` {host!r}: cannot listen there ({e.strerror or e})", params=("host",)) from None
    server.host = host
    return server


def is_loopback(host: str) -> bool:
    """Whether ``host`` only reaches this machine (127.0.0.0/8, ::1, localhost).

    >>> is_loopback("127.0.0.1"), is_loopback("localhost"), is_loopback("0.0.0.0")
    (True, True, False)
    """
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


class Budget:
    """Bytes of request bodies held at once, at most ``limit``: :meth:`take` is False when ``n`` more would not
    fit (the request is then answered 503), :meth:`give` returns them."""

    def __init__(self, limit: int):
        self.limit, self.held, self._lock = limit, 0, threading.Lock()

    def take(self, n: int) -> bool:
        with self._lock:
            if self.held + n > self.limit:
                return False
            self.held += n
            return True

    def give(self, n: int) -> None:
        with self._lock:
            self.held -= n


def declared_length(headers, limits: Limits) -> int:
    """A request's ``Content-Length``; an :class:`ApiError` when absent or with a ``Transfer-Encoding`` (411: a
    chunked body is not read), not ASCII digits (a Unicode digit, a sign) or given twice (400), or over
    ``limits`` (413)."""
    given = headers.get_all("Content-Length") or []
    if not given or headers.get("Transfer-Encoding"):
        raise ApiError(411, "send a Content-Length (a chunked body is not read)")
    length = given[0].strip()
    if len(given) > 1 or not re.fullmatch(r"[0-9]{1,18}", length):
        raise ApiError(400, f"invalid Content-Length {', '.join(given)[:40]!r}: it must be one number of bytes, in "
                            "ASCII digits")
    if int(length) > limits.max_bytes:
        raise ApiError(413, f"the request is {int(length) / 2**20:.1f} MB: at most {limits.max_upload_mb} MB "
                            "(--max-upload-mb)")
    return int(length)


def read_body(rfile, length: int, budget: Budget) -> list[bytes]:
    """A body of ``length`` bytes from ``rfile`` in pieces of :data:`BODY_PIECE`, each taken from ``budget``
    before it is read (the caller gives them back once answered); an :class:`ApiError` when the bodies held would
    pass the budget (503) or the body ends early (400), :class:`Late` past the request's deadline (nothing held
    then)."""
    pieces, held = [], 0
    try:
        while held < length:
            size = min(length - held, BODY_PIECE)
            if not budget.take(size):
                raise ApiError(503, "the server holds too many uploads at once: try again")
            held += size
            pieces.append(rfile.read(size))
            budget.give(size - len(pieces[-1]))
            held -= size - len(pieces[-1])
            if len(pieces[-1]) < size:
                raise ApiError(400, f"the body ended after {held} of its {length} bytes")
    except BaseException:  # an ApiError, Late, a reset connection: nothing held
        budget.give(held)
        raise
    return pieces
