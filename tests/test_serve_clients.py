"""``captioning serve`` under slow, bursting and hostile clients: real sockets on 127.0.0.1 against the real server.

One server for the module (the soft-attention fixture model, in a thread of this process), its connection limits
scaled down (:class:`~captioning.inference.serve_connections.Connections`: a 5 s request deadline, 4 model slots,
48 connections) so that slow clients and bursts cost seconds; the real command in its own process once (the
only one of the serve tests), for SIGTERM with requests in flight.
"""

import dataclasses
import json
import os
import re
import select
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest

from captioning.benchmarks.serve import form_body
from tests.helpers import REPO

pytestmark = pytest.mark.slow  # real servers on sockets (the Makefile's slow loop)

DEADLINE = 5.0  # the module server's request_timeout, seconds


@pytest.fixture(scope="module")
def photo(shapes_dir):
    name = sorted(os.listdir(os.path.join(shapes_dir, "images")))[0]
    with open(os.path.join(shapes_dir, "images", name), "rb") as f:
        return f.read()


@pytest.fixture(scope="module")
def server(trained_attention_dir, photo):
    from captioning import inference
    from captioning.inference.serve import start
    from captioning.inference.serve_api import Limits
    from captioning.inference.serve_connections import Connections

    running = start(inference.Captioner(inference.load(trained_attention_dir)), port=0,
                    limits=Limits(max_upload_mb=1, max_images=4), allowed_hosts=("captions.lan",),
                    connections=Connections(request_timeout=DEADLINE, idle_timeout=DEADLINE, max_connections=48,
                                            max_in_flight=4, busy_wait=20))
    running.port = int(running.url.rsplit(":", 1)[1].strip("/"))
    assert exchange(running.port, request(running.port, photo))[0] == 200  # traced before any test
    yield running
    running.stop()


def request(port: int, photo: bytes, headers=None, host=None) -> bytes:
    """A whole ``POST /caption`` with one image, as bytes: ``headers`` added (or replacing the defaults)."""
    body, content_type = form_body([("image", "photo.jpg", photo)])
    fields = {"Host": host or f"127.0.0.1:{port}", "Content-Type": content_type, "Content-Length": str(len(body)),
              **(headers or {})}
    head = "POST /caption HTTP/1.1\r\n" + "".join(f"{k}: {v}\r\n" for k, v in fields.items()) + "\r\n"
    return head.encode("latin-1") + body


def read_answer(sock: socket.socket) -> tuple[int, dict | str]:
    """The answer on ``sock``, read whole: its status and its JSON (or text); (0, reason) for no HTTP answer."""
    data, length = b"", None
    try:
        while length is None or len(data) < length:
            chunk = sock.recv(65536)
            if not chunk:
                break
            data += chunk
            head, sep, _ = data.partition(b"\r\n\r\n")
            if sep and length is None:
                length = len(head) + 4 + int(re.search(rb"Content-Length: (\d+)", head, re.I).group(1))
    except OSError as e:
        return 0, f"{type(e).__name__} after {len(data)} bytes"
    if length is None or len(data) < length:
        return 0, f"no whole answer: {data[:80]!r}"
    head, _, body = data.partition(b"\r\n\r\n")
    status = int(head.split(b" ", 2)[1])
    return status, json.loads(body) if b"application/json" in head else body.decode()


def exchange(port: int, data: bytes) -> tuple[int, dict | str]:
    with socket.create_connection(("127.0.0.1", port), timeout=40) as sock:
        sock.sendall(data)
        return read_answer(sock)


def trickle(sockets: list[socket.socket], every: float, until: float, answers: dict) -> None:
    """A byte to each socket every ``every`` seconds until it is answered (or ``until``, a monotonic time), each
    answer into ``answers`` by index as it comes. The byte continues a header for a socket that sent part of its
    headers, a body otherwise."""
    while len(answers) < len(sockets) and time.monotonic() < until:
        for i, sock in enumerate(sockets):
            if i in answers:
                continue
            if select.select([sock], [], [], 0)[0]:
                answers[i] = read_answer(sock)
                continue
            try:
                sock.send(b"a")
            except OSError:  # closed by the server: its answer (if any) is waiting
                answers[i] = read_answer(sock)
        time.sleep(every)


def slow_clients(port: int, count: int) -> list[socket.socket]:
    """``count`` connections, half stopped inside their headers, half inside a body they promised."""
    sockets = []
    for i in range(count):
        sock = socket.create_connection(("127.0.0.1", port), timeout=30)
        if i % 2:
            sock.sendall(f"POST /caption HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nX-Slow: ".encode())
        else:
            sock.sendall(f"POST /caption HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Type: multipart/form-data; "
                         f"boundary=b\r\nContent-Length: 100000\r\n\r\n--b".encode())
        sockets.append(sock)
    return sockets


def test_slow_clients_hold_no_model_slot_and_get_408_at_the_deadline(server, photo):
    """Item 2: 32 clients trickling a byte every 0.2 s (8 times the 4 model slots), inside their headers or their
    bodies, and 4 that send nothing: a normal request is captioned meanwhile, each slow one gets 408 at the
    request's deadline, and the silent ones are closed at the idle deadline."""
    sockets = slow_clients(server.port, 32)
    silent = [socket.create_connection(("127.0.0.1", server.port), timeout=30) for _ in range(4)]
    answers = {}
    try:
        feeder = threading.Thread(target=trickle, args=(sockets, 0.2, time.monotonic() + 4 * DEADLINE, answers))
        feeder.start()
        time.sleep(0.5)
        status, records = exchange(server.port, request(server.port, photo))
        cut_before = len(answers)
        feeder.join()
        closed = [sock.recv(1) for sock in silent]  # never sent a byte: closed at the idle deadline, no answer
    finally:
        for sock in sockets + silent:
            sock.close()
    assert status == 200 and records[0]["captions"][0]["caption"], records
    assert cut_before == 0  # captioned while every slow client was still connected
    assert closed == [b""] * 4
    assert sorted(answers) == list(range(32)), f"{32 - len(answers)} slow clients never answered"
    for status, answer in answers.values():
        assert status == 408 and answer == {"error": f"the request did not arrive within {DEADLINE:g} s"}, answer


def test_connections_past_the_bound_get_503_at_once(server, photo):
    """Item 2: with every one of the (here) 8 connections open, one more is answered 503 and closed at once."""
    bound = dataclasses.replace(server.server.connections, max_connections=8)
    server.server.connections, kept = bound, server.server.connections
    sockets = slow_clients(server.port, 8)
    try:
        time.sleep(0.3)
        status, answer = exchange(server.port, request(server.port, photo))
        assert status == 503 and answer == {"error": "the server has too many connections open: try again"}
    finally:
        for sock in sockets:
            sock.close()
        server.server.connections = kept
    time.sleep(0.5)  # the 8 threads see their connections closed
    assert exchange(server.port, request(server.port, photo))[0] == 200


def test_bodies_held_past_the_budget_get_503(server, photo):
    """The bodies read and not yet answered are bounded (max_in_flight x --max-upload-mb): past it, 503."""
    from captioning.inference.serve_connections import Budget

    data, kept = request(server.port, photo), server.server.budget
    server.server.budget = Budget(len(photo))  # less than this request's body
    try:
        status, answer = exchange(server.port, data)
    finally:
        server.server.budget = kept
    assert status == 503 and answer == {"error": "the server holds too many uploads at once: try again"}
    assert exchange(server.port, data)[0] == 200 and kept.held == 0


def test_a_burst_of_posts_is_answered_every_one(server, photo):
    """Item 9: the listen backlog is the connection bound, and 64 POSTs connecting at once (16 times the model
    slots), twice, each get an HTTP answer, none a reset or a timeout."""
    listing = subprocess.run(["ss", "-Hltn", f"sport = :{server.port}"], capture_output=True, text=True).stdout
    assert int(listing.split()[2]) >= server.server.connections.max_connections, listing  # LISTEN 0 BACKLOG ...
    for _ in range(2):
        burst(server.port, request(server.port, photo), 64)


def burst(port: int, data: bytes, count: int) -> None:
    answers, go = [None] * count, threading.Barrier(count)

    def client(i):
        go.wait()
        try:
            answers[i] = exchange(port, data)
        except OSError as e:
            answers[i] = (0, repr(e))

    threads = [threading.Thread(target=client, args=(i,)) for i in range(count)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    failed = [a for a in answers if a[0] not in (200, 503)]
    assert failed == [], failed
    assert all(a[1][0]["captions"] for a in answers if a[0] == 200) and sum(a[0] == 200 for a in answers) >= 4


def test_content_length_is_ascii_digits(server, photo):
    """Item 6 and item 21's wording: a Unicode digit or a negative length is 400 in one line (with or without
    ``Expect: 100-continue``); no length at all is still 411."""
    cases = {"\u00b2": "'\u00b2'", "-5": "'-5'", "1_0": "'1_0'", "+5": "'+5'", "0x10": "'0x10'"}
    for value, shown in cases.items():
        for expect in ({}, {"Expect": "100-continue"}):
            status, answer = exchange(server.port, request(server.port, photo, {"Content-Length": value, **expect}))
            assert status == 400, (value, expect, answer)
            assert answer == {"error": f"invalid Content-Length {shown}: it must be one number of bytes, in ASCII "
                                       "digits"}, answer
    status, answer = exchange(server.port, b"POST /caption HTTP/1.1\r\nHost: 127.0.0.1:%d\r\n\r\n" % server.port)
    assert status == 411 and answer == {"error": "send a Content-Length (a chunked body is not read)"}
    assert exchange(server.port, request(server.port, photo))[0] == 200


def test_other_hosts_and_cross_origin_posts_are_refused(server, photo):
    """Item 7: a ``Host`` other than the served address (DNS rebinding) or a POST from another site's page is 403,
    in one line; the served address, ``localhost``, an ``--allowed-host`` name and the page's own origin pass."""
    port = server.port
    for host in (f"evil.example:{port}", f"127.0.0.1:{port + 1}", "127.0.0.1", f"localhost.evil.example:{port}",
                 "[::1"):
        for data in (request(port, photo, host=host), f"GET / HTTP/1.1\r\nHost: {host}\r\n\r\n".encode()):
            status, answer = exchange(port, data)
            assert status == 403 and answer["error"].startswith(f"Host {host!r} is not this server's address ("), \
                (host, answer)
            assert "--allowed-host NAME" in answer["error"] and "\n" not in answer["error"]
    for host in (f"localhost:{port}", f"LOCALHOST:{port}", "captions.lan", "captions.lan:443"):
        status, page = exchange(port, f"GET / HTTP/1.1\r\nHost: {host}\r\n\r\n".encode())
        assert status == 200 and "<form id=\"options\">" in page, host
    for origin in ("http://evil.example", f"http://localhost.evil.example:{port}", "null", f"https://127.0.0.1:{port}"):
        for expect in ({}, {"Expect": "100-continue"}):
            status, answer = exchange(port, request(port, photo, {"Origin": origin, **expect}))
            assert status == 403 and answer == {"error": f"a cross-origin request from {origin!r} is refused: the "
                                                         "page must be this server's own (or its name given with "
                                                         "--allowed-host)"}, (origin, answer)
    for origin, host in ((f"http://127.0.0.1:{port}", None), (f"http://localhost:{port}", f"localhost:{port}"),
                         ("https://captions.lan", "captions.lan")):
        status, records = exchange(port, request(port, photo, {"Origin": origin}, host=host))
        assert status == 200 and records[0]["captions"], (origin, records)


def test_allowed_host_is_checked_and_bounded(trained_attention_dir):
    from tests.helpers import run_main

    code, _, err = run_main("serve", "--model-dir", trained_attention_dir, "--allowed-host", "evil.com:80")
    assert code == 2 and len(err.strip().splitlines()) == 1
    assert "--allowed-host: must be a host name or an IP address without a port (captions.lan), got 'evil.com:80'" \
        in err
    many = [arg for i in range(17) for arg in ("--allowed-host", f"h{i}.lan")]
    code, _, err = run_main("serve", "--model-dir", trained_attention_dir, *many)
    assert code == 2 and err.strip() == "captioning serve: error: --allowed-host given 17 times: at most 16"


def test_sigterm_answers_every_request_in_flight_then_exits_0(trained_attention_dir, photo):
    """Item 8: the real command in its own process, on every interface (it warns and says its URL), answers; with
    6 requests in flight (their bodies half sent), SIGTERM: it stops accepting, each of the 6 gets its whole 200
    once its body is complete, and the process prints "stopped" and exits 0."""
    process = subprocess.Popen([sys.executable, "-m", "captioning", "serve", "--model-dir", trained_attention_dir,
                                "--port", "0", "--host", "0.0.0.0"], cwd=REPO, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True, env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2"))
    sockets = []
    try:
        line = process.stdout.readline()  # once the model is loaded and the server answers
        match = re.search(r"on http://0\.0\.0\.0:(\d+)/ ", line)
        assert match, line + process.stderr.read() if process.poll() is not None else line
        port = int(match[1])
        assert exchange(port, request(port, photo))[0] == 200  # traced: the slow ones wait for no trace
        data = request(port, photo)
        for _ in range(6):
            sock = socket.create_connection(("127.0.0.1", port), timeout=60)
            sock.sendall(data[: len(data) // 2])
            sockets.append(sock)
        time.sleep(0.5)  # every request's first bytes have been read
        process.send_signal(signal.SIGTERM)
        time.sleep(1.0)
        with pytest.raises(ConnectionRefusedError):  # no longer accepting
            socket.create_connection(("127.0.0.1", port), timeout=5).close()
        answers = []
        for sock in sockets:
            sock.sendall(data[len(data) // 2:])
            answers.append(read_answer(sock))
        out, err = process.communicate(timeout=60)
    finally:
        for sock in sockets:
            sock.close()
        if process.poll() is None:
            process.kill()
            process.communicate()
    for status, records in answers:
        assert status == 200 and records[0]["image"] == "photo.jpg" and records[0]["captions"][0]["caption"], records
    assert process.returncode == 0 and out.strip() == "stopped" and "Traceback" not in err, err
    assert "listening on 0.0.0.0: anyone who can reach this port can caption images (there is no authentication)" \
        in err


def test_the_docs_connection_table_is_the_defaults():
    """docs/serving.md's "Connections" table states the defaults of Connections and the body budget."""
    from captioning.inference.serve_connections import Connections, Server

    text = open(os.path.join(REPO, "docs", "serving.md"), encoding="utf-8").read()
    table = text.split("## Connections")[1].split("\n\n")[2]
    rows = {cells[1].strip(): cells[2].strip() for cells in (row.split("|") for row in table.splitlines()[2:])}
    d = Connections()
    assert list(rows.values()) == [f"{d.request_timeout:g} s", f"{d.idle_timeout:g} s", str(d.max_connections),
                                   str(Server.request_queue_size), str(d.max_in_flight),
                                   f"{d.max_in_flight} × `--max-upload-mb`"]
    assert f"| a request waits up to {d.busy_wait:g} s, then 503 |" in table


def test_a_client_gone_mid_body_is_no_server_error(server, photo, caplog):
    """A connection reset halfway through its body ends that connection with a debug line, not an error logged
    with a traceback as if the server had failed; nothing of the body stays held."""
    import struct

    data = request(server.port, photo)
    with caplog.at_level("DEBUG", logger="captioning.serve"):
        sock = socket.create_connection(("127.0.0.1", server.port), timeout=30)
        sock.sendall(data[: len(data) // 2])
        time.sleep(0.3)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))  # close with a reset
        sock.close()
        time.sleep(0.5)
        assert exchange(server.port, data)[0] == 200
    errors = [r for r in caplog.records if r.levelname in ("ERROR", "WARNING")]
    assert errors == [] and server.server.budget.held == 0, [r.getMessage() for r in errors]
