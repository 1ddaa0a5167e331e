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
without a ``Content-Length`` (chunked) is 411, a ``Content-Length`` that is not ASCII digits 400. More than
``--max-images`` images (default 32) is 413. The connections' deadlines and bounds are
:mod:`captioning.inference.serve_connections`'s: a whole request within 30 s of its first byte (then 408), its
body read before it waits for one of the 32 model slots (then 503 after 30 s), at most 256 connections open
(then 503 at once). The bodies held at once are at most ``max_in_flight x --max-upload-mb`` bytes (more: 503).

**Security.** It binds 127.0.0.1 by default: only this machine can reach it. There is no authentication, so
``--host`` with another address (``0.0.0.0``) lets anyone who reaches the port caption images, and the command
says so in a warning line (as TF Serving and Gradio leave access control to what is in front of them). A
``Host`` that is not the served address (or an ``--allowed-host``) and a cross-origin ``POST`` are 403
(:class:`~captioning.inference.serve_connections.Addresses`).

**The page's DOM** (tests/test_browser.py drives it in a real browser; keep these ids and classes):

- ``<input type="file" id="images" accept="image/*" multiple>`` and a drop zone ``id="drop"``; picking or
  dropping files captions them at once; the button ``id="caption"`` captions the chosen images again with the
  current options;
- the option controls inside ``<form id="options">``, each ``name`` a ``decode.*`` key (``decode.beam_size``),
  made from :class:`~captioning.config.sections.DecodeConfig`'s fields (:func:`option_controls`), each holding the
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
import html
import inspect
import io
import json
import logging
import os
import signal
import threading
import tokenize
from http.server import BaseHTTPRequestHandler
from urllib.parse import urlsplit

from captioning.config.sections import DecodeConfig
from captioning.errors import InputError
from captioning.inference.serve_api import (ApiError, Form, Limits, check_usable, decode_options, parse_multipart,
                                            read_images, records)
from captioning.inference.serve_batching import Batcher, ModelError, OptionSetsBusy
from captioning.inference.serve_connections import (Addresses, Budget, Connections, DeadlineReader, Late, Server,
                                                    declared_length, read_body)
from captioning.inference.serve_connections import bind as _bind
from captioning.inference.serve_connections import is_loopback  # noqa: F401 (the command's import)
from captioning.config.settings import closed_range, describe_range, fields_of, type_hints

log = logging.getLogger("captioning.serve")

PAGE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "serve_page.html")  # package data (setup.cfg)
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

    def setup(self):  # the socket read through the connection's deadlines
        super().setup()
        self.rfile = io.BufferedReader(DeadlineReader(self.connection, self.server))

    def handle_one_request(self):
        """One request, whole within its deadline (else 408 and the connection closed); none once stopping."""
        self.command, self.request_version, self.requestline = "", self.default_request_version, ""
        self.rfile.raw.next_request()
        try:
            super().handle_one_request()
        except Late as e:
            self.close_connection = True
            self._json(408, {"error": str(e)}, close=True)
        if self.server.stopping:
            self.close_connection = True

    def parse_request(self) -> bool:  # then, before any route: Host and Origin (403 unless this server's)
        return super().parse_request() and self._addressed()

    def _addressed(self) -> bool:
        addresses: Addresses = self.server.addresses
        said = addresses.refuses_host(self.headers.get("Host"))
        if not said and self.command not in ("GET", "HEAD"):
            said = addresses.refuses_origin(self.headers.get("Origin"), self.headers.get("Host"))
        if said:
            self._json(403, {"error": said}, close=True)
        return not said

    def log_message(self, format, *args):  # one debug line a request (-v), not stderr noise
        log.debug("%s %s", self.address_string(), format % args)

    def _send(self, status: int, body: bytes, content_type: str, close: bool = False, allow: str | None = None):
        self.connection.settimeout(self.server.connections.request_timeout)  # for a client that does not read
        close = close or self.server.stopping
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
        body = []  # read before a model slot is taken: a slow client holds a connection, never a slot
        try:
            body = read_body(self.rfile, declared_length(self.headers, self.server.limits), self.server.budget)
            if not self.server.in_flight.acquire(timeout=self.server.connections.busy_wait):
                raise ApiError(503, "the server is busy: try again")
            try:
                status, answer, close = self._caption(body)
            finally:
                self.server.in_flight.release()
        except ApiError as e:  # with the body not read whole, the connection closes (the rest is not a request)
            status, answer, close = e.status, {"error": str(e), **({"results": e.results} if e.results else {})}, \
                e.status in (408, 411, 413) or not body
        except (Late, ConnectionError):  # 408 (handle_one_request); a client gone: its connection ends
            raise
        except Exception as e:  # a fault of the server's own: this request fails in one line, the server goes on
            log.exception("POST /caption failed")
            said = str(e).splitlines()[0][:200] if str(e) else repr(e)
            status, answer, close = 500, {"error": f"internal error: {said}"}, True
        finally:
            self.server.budget.give(sum(map(len, body)))
        self._json(status, answer, close=close)

    def _not_allowed(self):
        if self._route():  # a served path, another method
            self._json(405, {"error": f"{self.command}: not allowed"}, close=True)

    do_PUT = do_DELETE = do_PATCH = do_OPTIONS = _not_allowed

    def handle_expect_100(self):
        """``Expect: 100-continue`` (curl's, for uploads over 1 MB): the address and the size are refused before
        the body comes."""
        if urlsplit(self.path).path == "/caption" and self.command == "POST":
            if not self._addressed():
                return False
            try:
                declared_length(self.headers, self.server.limits)
            except ApiError as e:
                self._json(e.status, {"error": str(e)}, close=True)
                return False
        return super().handle_expect_100()

    def _caption(self, body: list[bytes]) -> tuple[int, list, bool]:
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
            r.captioned(captions, error, captioner.token_layout, captioner.attention_absent)
        return 200, records(results, form.pictures), False


def bind(host: str = "127.0.0.1", port: int = 0) -> Server:
    """The listening server (not serving yet); an InputError naming ``host`` or ``port`` when it cannot bind."""
    return _bind(host, port, _Handler)


@dataclasses.dataclass
class Running:
    """A server running in a thread: ``url`` (``http://HOST:PORT/``), ``batcher`` (its model calls), ``stop()``."""

    server: Server
    thread: threading.Thread
    batcher: Batcher
    url: str

    def stop(self) -> None:
        """Stops accepting, answers each request in flight (within its deadline), then stops the model thread."""
        self.server.stop()
        self.batcher.stop()
        self.thread.join()


def start(captioner, host: str = "127.0.0.1", port: int = 0, limits: Limits = Limits(), max_batch: int = 16,
          batch_wait_ms: float = 5.0, server: Server | None = None, title: str = "captioning",
          connections: Connections = Connections(), allowed_hosts=()) -> Running:
    """Serves ``captioner`` (a :class:`~captioning.inference.captioner.Captioner`: a model or an ensemble, and the
    server's decoding options, which a request's ``decode.*`` fields override) in a thread of this process;
    ``server``: one :func:`bind` made (default: bound here to ``host`` and ``port``); ``connections``: the
    deadlines and bounds (:mod:`~captioning.inference.serve_connections`); ``allowed_hosts``: the names besides
    its address a request's ``Host`` may give (``--allowed-host``)."""
    refusals = [member.model.source.serve_refusal for member in captioner.trained.members]  # its data source's
    if any(refusals):
        raise InputError(next(why for why in refusals if why))
    server = server or bind(host, port)
    batcher = Batcher(captioner, max_batch=max_batch, wait_ms=batch_wait_ms)
    address, real_port = server.server_address[:2]
    server.batcher, server.limits, server.connections = batcher, limits, connections
    server.page, server.in_flight = page(batcher, limits, title), threading.BoundedSemaphore(connections.max_in_flight)
    server.budget = Budget(connections.max_in_flight * limits.max_bytes)
    server.addresses = Addresses(server.host, address, real_port, allowed_hosts)
    server.socket.listen(max(server.request_queue_size, connections.max_connections))  # the backlog: the bound
    thread = threading.Thread(target=server.serve_forever, name="captioning-serve", daemon=True)
    thread.start()
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
