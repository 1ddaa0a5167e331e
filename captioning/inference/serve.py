"""``captioning serve``: a trained model (or an ensemble) behind a web page and a JSON API, on the standard library.

The server is Python's ``http.server.ThreadingHTTPServer`` (a thread per connection, HTTP/1.1), with
Werkzeug's streaming multipart decoder for uploads (:func:`~captioning.inference.serve_api.parse_multipart`):
no web framework, nothing fetched at run time (docs/serving.md weighs uvicorn and Starlette, and Gradio,
measured). Routes::

    GET  /          the page (serve_page.html, shipped with the package): drop or pick images, see captions
    POST /caption   the JSON API (captioning.inference.serve_api): images in, `caption --json` records out

Another method on those paths is 405 (with ``Allow``), another path 404. The request threads read and check
uploads; one thread makes every model call, batching the images of concurrent requests
(:mod:`captioning.inference.serve_batching`). Bad input never ends the server: each request's problem is its
own answer (:mod:`captioning.inference.serve_api`).

**Limits.** A body over ``--max-upload-mb`` (default 32) is refused with 413 from its ``Content-Length``
before a byte of it is read (and before ``100 Continue``, which curl waits for on uploads over 1 MB); a body
without a ``Content-Length`` (chunked) is 411. More than ``--max-images`` images (default 32) is 413. A client
has :data:`READ_TIMEOUT` seconds to send each piece of its request (then 408), and at most
:data:`MAX_IN_FLIGHT` requests are read and captioned at once (the others wait up to :data:`BUSY_WAIT` seconds,
then 503), so memory stays within about ``MAX_IN_FLIGHT x --max-upload-mb``.

**Security.** It binds 127.0.0.1 by default: only this machine can reach it. There is no authentication, so
``--host`` with another address (``0.0.0.0``) lets anyone who reaches the port caption images, and the command
says so in a warning line (as TF Serving and Gradio leave access control to what is in front of them).

**The page's DOM** (tests/test_browser.py drives it in a real browser; keep these ids and classes):

- ``<input type="file" id="images" accept="image/*" multiple>`` and a drop zone ``id="drop"``; picking or
  dropping files captions them at once; the button ``id="caption"`` captions the chosen images again with the
  current options;
- the option controls inside ``<form id="options">``, each ``name`` a ``decode.*`` key (``decode.beam_size``),
  made from :class:`~captioning.config_sections.DecodeConfig`'s fields (:func:`option_controls`), each holding the
  server's value; the page sends only those changed;
- the results in ``<div id="results">``: per image ``<div class="result" data-name="FILE NAME">`` with
  ``<img class="thumb">``, the best caption in ``<p class="caption">``, its log-probability in
  ``<span class="score">``, the top-k list ``<ol class="alternatives"><li>...``, and for an attention decoder
  ``<div class="attention">`` holding one ``<img class="word-attention" alt="attention for WORD">`` per word; an
  image that cannot be read shows ``<p class="error">`` and no thumbnail;
- ``<div id="status">``, whose ``data-state`` is ``busy`` while a request runs and ``done`` (or ``error``) after.

**In a program or a test**, :func:`start` runs the server in a thread (``port=0``: a free port) and returns a
handle with ``url`` and ``stop()``::

    from captioning import inference
    from captioning.inference.serve import start

    running = start(inference.Captioner(inference.load("runs/demo/model")), port=0)   # on 127.0.0.1
    print(running.url)        # http://127.0.0.1:41234/
    ...                       # POST running.url + "caption"
    running.stop()
"""

from __future__ import annotations

import dataclasses
import errno
import html
import inspect
import io
import ipaddress
import json
import logging
import os
import signal
import socket
import threading
import tokenize
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlsplit

from captioning.config_sections import DecodeConfig
from captioning.errors import InputError
from captioning.inference.serve_api import (ApiError, Form, Limits, check_usable, decode_options, parse_multipart,
                                            read_images, records)
from captioning.inference.serve_batching import Batcher, ModelError, OptionSetsBusy
from captioning.settings import closed_range, describe_range, fields_of, type_hints

log = logging.getLogger("captioning.serve")

PAGE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "serve_page.html")  # package data (setup.cfg)
READ_TIMEOUT = 30  # seconds a client may take to send each piece of its request
MAX_IN_FLIGHT = 32  # requests read and captioned at once
BUSY_WAIT = 30  # seconds a request waits for one of them
ROUTES = {"/": "GET", "/caption": "POST"}


def _comments(cls) -> dict[str, str]:
    """The comment above or beside each field of a settings dataclass, in its source: what the key does."""
    said, above = {}, []
    tokens = tokenize.generate_tokens(io.StringIO(inspect.getsource(cls)).readline)
    line_tokens: dict[int, list] = {}
    for token in tokens:
        line_tokens.setdefault(token.start[0], []).append(token)
    for number in sorted(line_tokens):
        kinds = [t for t in line_tokens[number] if t.type not in (tokenize.INDENT, tokenize.DEDENT, tokenize.NL,
                                                                   tokenize.NEWLINE)]
        if kinds and kinds[0].type == tokenize.COMMENT:
            above.append(kinds[0].string.lstrip("# "))
            continue
        if len(kinds) > 1 and kinds[0].type == tokenize.NAME and kinds[1].string == ":":
            beside = [t.string.lstrip("# ") for t in kinds if t.type == tokenize.COMMENT]
            said[kinds[0].string] = " ".join(above + beside)
        above = []
    return said


def _number(x) -> str:
    """A number as an HTML input holds it: integral ones as integers (``2147483647``, never ``2.14748e+09``)."""
    return str(int(x)) if float(x).is_integer() else repr(float(x))


def option_controls(decode: DecodeConfig) -> str:
    """The page's option controls, one per :class:`DecodeConfig` field (its type, choices, range and comment),
    each named ``decode.KEY`` and holding ``decode``'s value (``data-default``: the page sends only changed ones).

    >>> '<select name="decode.method" data-default="beam">' in option_controls(DecodeConfig())
    True
    """
    hints, notes, rows = type_hints(DecodeConfig), _comments(DecodeConfig), []
    for name, f in fields_of(DecodeConfig).items():
        value, kind, key = getattr(decode, name), hints[name], f"decode.{name}"
        if f.metadata.get("choices"):
            options = "".join(f'<option{" selected" if c == value else ""}>{html.escape(c)}</option>'
                              for c in f.metadata["choices"])
            control = f'<select name="{key}" data-default="{html.escape(value)}">{options}</select>'
        elif kind in (int, float):
            low, high = closed_range(f.metadata.get("range", (None, False, None, False)), kind)
            bounds = (f' min="{_number(low)}"' if low is not None else "") + (
                f' max="{_number(high)}"' if high is not None else "")
            step = "1" if kind is int else "any"
            control = (f'<input type="number" name="{key}" value="{_number(value)}" data-default="{_number(value)}" '
                       f'step="{step}"{bounds} required>')
        elif kind is bool:
            control = f'<input type="checkbox" name="{key}" data-default="{str(value).lower()}"' + (
                " checked>" if value else ">")
        else:  # a list of words
            text = ", ".join(value) if isinstance(value, list) else str(value)
            control = f'<input type="text" name="{key}" value="{html.escape(text)}" data-default="{html.escape(text)}">'
        bounds = f" ({describe_range(f.metadata['range'])})" if f.metadata.get("range") else ""
        title = html.escape(notes.get(name, "") + bounds)
        rows.append(f'<label title="{title}"><span>{html.escape(name.replace("_", " "))}</span>{control}</label>')
    return "\n".join(rows)


def page(batcher: Batcher, limits: Limits, title: str) -> bytes:
    """The page with its option controls (the server's options) and limits filled in."""
    with open(PAGE, encoding="utf-8") as f:
        text = f.read()
    values = {"title": html.escape(title), "options": option_controls(batcher.default.settings),
              "max_images": str(limits.max_images), "max_upload_mb": str(limits.max_upload_mb)}
    for key, value in values.items():
        text = text.replace("{{" + key + "}}", value)
    return text.encode("utf-8")


class _Handler(BaseHTTPRequestHandler):
    """Routes (module docstring); the server object carries the batcher, limits and page."""

    protocol_version = "HTTP/1.1"
    server_version = "captioning-serve"
    timeout = READ_TIMEOUT

    def log_message(self, format, *args):  # one debug line a request (-v), not stderr noise
        log.debug("%s %s", self.address_string(), format % args)

    def _send(self, status: int, body: bytes, content_type: str, close: bool = False, allow: str | None = None):
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Cache-Control", "no-store")
        if allow:
            self.send_header("Allow", allow)
        if close:
            self.send_header("Connection", "close")
            self.close_connection = True
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def _json(self, status: int, value, close: bool = False, allow: str | None = None):
        self._send(status, json.dumps(value, ensure_ascii=False).encode("utf-8"), "application/json; charset=utf-8",
                   close, allow)

    def _route(self) -> bool:
        """404 or 405 unless this method and path are served."""
        path = urlsplit(self.path).path
        if path not in ROUTES:
            self._json(404, {"error": f"no such page: {path[:100]} (the page is GET /, the API POST /caption)"},
                       close=True)
            return False
        if ROUTES[path] != self.command and not (self.command == "HEAD" and ROUTES[path] == "GET"):
            self._json(405, {"error": f"{self.command} {path}: use {ROUTES[path]}"}, close=True, allow=ROUTES[path])
            return False
        return True

    def do_GET(self):
        if self._route():
            self._send(200, self.server.page, "text/html; charset=utf-8")

    do_HEAD = do_GET

    def do_POST(self):
        if not self._route():
            return
        if not self.server.in_flight.acquire(timeout=BUSY_WAIT):
            self._json(503, {"error": "the server is busy: try again"}, close=True)
            return
        try:
            status, answer, close = self._caption()
        except ApiError as e:
            status, answer, close = e.status, {"error": str(e), **({"results": e.results} if e.results else {})}, \
                e.status in (408, 411, 413)
        except Exception as e:  # a fault of the server's own: this request fails in one line, the server goes on
            log.exception("POST /caption failed")
            said = str(e).splitlines()[0][:200] if str(e) else repr(e)
            status, answer, close = 500, {"error": f"internal error: {said}"}, True
        finally:
            self.server.in_flight.release()
        self._json(status, answer, close=close)

    def _not_allowed(self):
        if self._route():  # a served path, another method
            self._json(405, {"error": f"{self.command}: not allowed"}, close=True)

    do_PUT = do_DELETE = do_PATCH = do_OPTIONS = _not_allowed

    def _length(self) -> int:
        """The body's declared length; an :class:`ApiError` when absent (411) or over the bound (413)."""
        limits: Limits = self.server.limits
        length = self.headers.get("Content-Length")
        if length is None or not length.strip().isdigit():
            raise ApiError(411, "send a Content-Length (a chunked body is not read)")
        if int(length) > limits.max_bytes:
            raise ApiError(413, f"the request is {int(length) / 2**20:.1f} MB: at most {limits.max_upload_mb} MB "
                                "(--max-upload-mb)")
        return int(length)

    def handle_expect_100(self):
        """``Expect: 100-continue`` (curl's, for uploads over 1 MB): the size is refused before the body comes."""
        if urlsplit(self.path).path == "/caption" and self.command == "POST":
            try:
                self._length()
            except ApiError as e:
                self._json(e.status, {"error": str(e)}, close=True)
                return False
        return super().handle_expect_100()

    def _caption(self) -> tuple[int, list, bool]:
        length = self._length()
        try:
            body = self.rfile.read(length)
        except (TimeoutError, socket.timeout):
            raise ApiError(408, f"the body did not arrive within {READ_TIMEOUT} s") from None
        if len(body) < length:
            raise ApiError(400, f"the body ended after {len(body)} of its {length} bytes")
        form = Form(parse_multipart(self.headers.get("Content-Type", ""), body))
        if not form.images:
            raise ApiError(400, "no image: send each as a field named image (curl -F image=@photo.jpg)")
        limits: Limits = self.server.limits
        if len(form.images) > limits.max_images:
            raise ApiError(413, f"{len(form.images)} images: at most {limits.max_images} a request (--max-images)")
        batcher: Batcher = self.server.batcher
        decode = decode_options(batcher.default.settings, form.options)
        try:
            captioner = batcher.captioner_for(decode)
        except InputError as e:  # e.g. a bad_endings word the vocabulary lacks
            raise ApiError(400, str(e)) from None
        except OptionSetsBusy as e:  # a new trace, with every kept one in use
            raise ApiError(503, str(e)) from None
        results = read_images(form)
        check_usable(results)
        ready = [r for r in results if not r.error]
        try:
            captioned = batcher.caption(captioner, [r.data for r in ready])
        except ModelError as e:  # the server's fault, logged once by the model thread with its cause
            raise ApiError(500, str(e)) from None
        for r, (captions, error) in zip(ready, captioned):
            r.captioned(captions, error, captioner.token_layout)
        return 200, records(results, form.pictures), False


class _Server(ThreadingHTTPServer):
    daemon_threads = True

    def handle_error(self, request, client_address):  # a client gone mid-answer: one debug line, no traceback
        log.debug("connection from %s ended with an error", client_address, exc_info=True)


def bind(host: str = "127.0.0.1", port: int = 0) -> _Server:
    """The listening server (not serving yet); an InputError naming ``host`` or ``port`` when it cannot bind."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except (socket.gaierror, UnicodeError):
        raise InputError(f"`host` {host!r} is not an address or a name of this machine", params=("host",)) from None
    kind = type("_Server", (_Server,), {"address_family": infos[0][0]})  # IPv4 or IPv6, as the host is
    try:
        server = kind(infos[0][4][:2], _Handler)
    except OSError as e:
        if e.errno == errno.EADDRINUSE:
            raise InputError(f"`port` {port} is in use on {host}: stop what listens there or choose another "
                             "(--port 0: any free port)", params=("port",)) from None
        if e.errno in (errno.EACCES, errno.EPERM):
            raise InputError(f"`port` {port}: not allowed to listen there (ports below 1024 need privileges)",
                             params=("port",)) from None
        raise InputError(f"`host` {host!r}: cannot listen there ({e.strerror or e})", params=("host",)) from None
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


@dataclasses.dataclass
class Running:
    """A server running in a thread: ``url`` (``http://HOST:PORT/``), ``batcher`` (its model calls), ``stop()``."""

    server: _Server
    thread: threading.Thread
    batcher: Batcher
    url: str

    def stop(self) -> None:
        """Stops accepting, finishes the captions handed in, closes the socket."""
        self.server.shutdown()
        self.server.server_close()
        self.batcher.stop()
        self.thread.join()


def start(captioner, host: str = "127.0.0.1", port: int = 0, limits: Limits = Limits(), max_batch: int = 16,
          batch_wait_ms: float = 5.0, server: _Server | None = None, title: str = "captioning") -> Running:
    """Serves ``captioner`` (a :class:`~captioning.inference.captioner.Captioner`: a model or an ensemble, and the
    server's decoding options, which a request's ``decode.*`` fields override) in a thread of this process;
    ``server``: one :func:`bind` made (default: bound here to ``host`` and ``port``)."""
    if any(member.model.reads_regions for member in captioner.trained.members):
        raise InputError("the model reads regions, which need each image's boxes from a detector: `captioning "
                         "serve` takes images alone (use `captioning caption --detections`)")
    server = server or bind(host, port)
    batcher = Batcher(captioner, max_batch=max_batch, wait_ms=batch_wait_ms)
    server.batcher, server.limits = batcher, limits
    server.page, server.in_flight = page(batcher, limits, title), threading.BoundedSemaphore(MAX_IN_FLIGHT)
    thread = threading.Thread(target=server.serve_forever, name="captioning-serve", daemon=True)
    thread.start()
    address, real_port = server.server_address[:2]
    shown = f"[{address}]" if ":" in address else address
    return Running(server, thread, batcher, f"http://{shown}:{real_port}/")


def serve_until_stopped(running: Running) -> None:
    """Blocks (in the main thread) until SIGINT (Ctrl-C) or SIGTERM, then stops the server cleanly."""
    stopping = threading.Event()
    previous = {sig: signal.signal(sig, lambda *_: stopping.set()) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        while not stopping.wait(0.5):
            pass
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        log.info("stopping: finishing the requests in flight")
        running.stop()
