"""``captioning serve``: a real server on a free port of 127.0.0.1, real HTTP requests with real JPEG and PNG bytes.

One server a model for the module (the soft-attention fixture model, whose answers carry attention pictures, and
Show and Tell), started in a thread with :func:`captioning.inference.serve.start`; bad requests of every kind go to
the same server, which must still answer at the end. The real command runs once in a process of its own, in
tests/test_serve_clients.py (start, requests, SIGTERM with requests in flight, exit 0); its errors (a port in use,
a bad host or folder) are in-process here, as they come before the model loads.
"""

import base64
import html
import http.client
import io
import json
import os
import re
import threading
import urllib.request

import numpy as np
import pytest
from PIL import Image

from captioning.benchmarks.serve import form_body, post
from tests.helpers import REPO, encode, gradient, run_main

LIMITS = {"max_upload_mb": 1, "max_images": 4}  # small, so the 413s cost little


# real servers on sockets: the slow loop, as the Makefile defines it (servers, exports, signals)
pytestmark = pytest.mark.slow

def _start(model_dir, **kwargs):
    from captioning import inference
    from captioning.inference.serve import start
    from captioning.inference.serve_api import Limits

    return start(inference.Captioner(inference.load(model_dir)), port=0, limits=Limits(**LIMITS), **kwargs)


@pytest.fixture(scope="module")
def attention_server(trained_attention_dir):
    running = _start(trained_attention_dir)
    yield running
    running.stop()


@pytest.fixture(scope="module")
def photos(shapes_dir, tmp_path_factory):
    """Two shapes JPEGs, a PNG drawing, a corrupt JPEG and a text file, on disk."""
    folder = tmp_path_factory.mktemp("uploads")
    names = sorted(os.listdir(os.path.join(shapes_dir, "images")))
    for i, name in enumerate(names[:2]):
        with open(os.path.join(shapes_dir, "images", name), "rb") as f:
            (folder / f"photo{i}.jpg").write_bytes(f.read())
    (folder / "drawing.png").write_bytes(encode(gradient(size=(90, 60)), "PNG"))
    noisy = encode(Image.fromarray(np.random.default_rng(0).integers(0, 255, (64, 64, 3), dtype=np.uint8)), "JPEG")
    (folder / "truncated.jpg").write_bytes(noisy[: len(noisy) // 2])
    (folder / "notes.txt").write_bytes(b"just some text")
    return folder


def images(folder, *names):
    return [("image", name, (folder / name).read_bytes()) for name in names]


def call(running, fields):
    status, body = post(running.url + "caption", fields)
    return status, json.loads(body)


def raw(running, method, path, body=b"", headers=None, send_body=True):
    """A request by hand (http.client): the status and the answer's JSON or text."""
    connection = http.client.HTTPConnection("127.0.0.1", int(running.url.rsplit(":", 1)[1].strip("/")), timeout=30)
    try:
        connection.putrequest(method, path)
        for key, value in (headers or {}).items():
            connection.putheader(key, value)
        connection.endheaders(body if send_body else None)
        answer = connection.getresponse()
        data = answer.read()
        return answer.status, json.loads(data) if answer.getheader("Content-Type", "").startswith(
            "application/json") else data.decode()
    finally:
        connection.close()


def cli_records(model_dir, paths, *flags, html_out=None):
    """``captioning caption --json`` (in-process): its records by file name, and the gallery with ``html_out``."""
    extra = ("--html", str(html_out)) if html_out else ()
    code, out, err = run_main("caption", "--model-dir", model_dir, *map(str, paths), "--json", *flags, *extra)
    assert code == 0, err
    return {os.path.basename(r["image"]): r for r in map(json.loads, out.splitlines())}


def test_served_captions_are_caption_jsons_records_and_pictures_its_gallerys(attention_server, trained_attention_dir,
                                                                              photos, tmp_path):
    names = ["photo0.jpg", "drawing.png"]
    gallery = tmp_path / "gallery.html"
    expected = cli_records(trained_attention_dir, [photos / n for n in names], "--beam-size", "2", "--top-k", "2",
                           html_out=gallery)
    status, records = call(attention_server, images(photos, *names) + [("decode.beam_size", None, b"2"),
                                                                       ("decode.top_k", None, b"2"),
                                                                       ("pictures", None, b"1")])
    assert status == 200 and [r["image"] for r in records] == names  # the uploaded names, in order
    for record in records:
        pictures = record.pop("pictures")
        want = dict(expected[record["image"]], image=record["image"])
        assert record == want  # the same record: captions, log-probabilities, attention, grid
        assert len(record["captions"]) == 2 and record["grid"] == [2, 2]
        words = record["captions"][0]["caption"].split()
        assert [p["word"] for p in pictures] == words
        # the gallery's pictures of this image, in word order: the same PNGs
        card, = [c for c in gallery.read_text().split("<figure>") if f"{html.escape(record['image'])}</b>" in c]
        shown = re.findall(r'<img src="(data:image/png;base64,[^"]+)" alt="attention for', card)
        assert len(shown) == len(pictures) == len(words)
        for a, b in zip(shown, [p["src"] for p in pictures]):  # the same pictures (up to the last bit of a weight)
            a, b = (np.asarray(Image.open(io.BytesIO(base64.b64decode(x.split(",", 1)[1]))), np.int16) for x in (a, b))
            assert a.shape == b.shape == (72, 72, 3) and np.abs(a - b).max() <= 1, np.abs(a - b).max()


def test_show_and_tell_is_served_as_caption_gives_it(trained_model_dir, photos):
    running = _start(trained_model_dir)
    try:
        status, records = call(running, images(photos, "photo1.jpg") + [("pictures", None, b"1")])
    finally:
        running.stop()
    expected = cli_records(trained_model_dir, [photos / "photo1.jpg"])["photo1.jpg"]
    assert status == 200 and records == [expected | {"image": "photo1.jpg"}]
    assert "pictures" not in records[0] and "attention" not in records[0]["captions"][0]  # no attention to show


def test_decoding_options_as_form_fields_and_bad_ones_refused(attention_server, photos):
    photo = images(photos, "photo0.jpg")
    status, records = call(attention_server, photo + [("decode.beam_size", None, b"4"), ("decode.top_k", None, b"3")])
    assert status == 200 and len(records[0]["captions"]) == 3
    scores = [c["log_prob"] for c in records[0]["captions"]]
    assert scores == sorted(scores, reverse=True)
    status, records = call(attention_server, photo + [("decode.method", None, b"greedy")])
    assert status == 200 and len(records[0]["captions"]) == 1
    refused = {"decode.beam_size=500": "decode.beam_size must be in [1, 50], got 500",
               "decode.beam_sise=2": "decode.beam_size",  # the nearest key named
               "decode.method=fast": "decode.method",
               "decode.bad_endings=zzzqqq": "zzzqqq",  # a word the vocabulary lacks
               "decode.top_k=9": "decode.top_k must be between 1 and decode.beam_size"}
    for option, said in refused.items():
        key, _, value = option.partition("=")
        status, answer = call(attention_server, photo + [(key, None, value.encode())])
        assert status == 400 and said in answer["error"] and "\n" not in answer["error"], (option, answer)
    status, answer = call(attention_server, photo + [("colour", None, b"red")])
    assert status == 400 and "unknown field 'colour'" in answer["error"]


def test_an_image_that_cannot_be_read_gets_its_own_error(attention_server, photos):
    status, records = call(attention_server, images(photos, "notes.txt", "photo1.jpg", "truncated.jpg"))
    assert status == 200 and [r["image"] for r in records] == ["notes.txt", "photo1.jpg", "truncated.jpg"]
    assert records[0] == {"image": "notes.txt", "error": "not an image (unrecognised format)"}
    assert records[2]["error"].startswith("corrupt image") and records[1]["captions"]
    status, answer = call(attention_server, images(photos, "notes.txt"))  # nothing usable
    assert status == 400 and answer["error"].startswith("no usable image: notes.txt: not an image")
    assert answer["results"] == [{"image": "notes.txt", "error": "not an image (unrecognised format)"}]
    status, answer = call(attention_server, [("pictures", None, b"1")])
    assert status == 400 and answer["error"].startswith("no image")


def test_oversized_requests_are_refused_before_their_body_is_read(attention_server, photos):
    status, answer = call(attention_server, images(photos, *["photo0.jpg"] * 5))  # 5 images, at most 4
    assert status == 413 and answer["error"] == "5 images: at most 4 a request (--max-images)"
    big = 3 * 1024 * 1024
    body, content_type = form_body([("image", "big.jpg", b"\0" * 16)])
    for expect in ({}, {"Expect": "100-continue"}):  # curl asks first for uploads over 1 MB
        # the headers alone: the server answers without waiting for the 3 MB it was promised
        status, answer = raw(attention_server, "POST", "/caption", headers={
            "Content-Type": content_type, "Content-Length": str(big), **expect}, send_body=False)
        assert status == 413 and answer["error"] == "the request is 3.0 MB: at most 1 MB (--max-upload-mb)"
    status, answer = raw(attention_server, "POST", "/caption", headers={"Content-Type": content_type,
                                                                        "Transfer-Encoding": "chunked"},
                         send_body=False)
    assert status == 411 and "Content-Length" in answer["error"]


def test_malformed_bodies_wrong_paths_and_methods(attention_server, photos):
    photo = (photos / "photo0.jpg").read_bytes()
    body, content_type = form_body([("image", "photo0.jpg", photo)])
    cut = body[: len(body) // 2]  # no closing boundary: an upload cut short
    for data, kind in ((cut, content_type), (b"garbage", content_type), (body, "multipart/form-data"),
                       (body, "image/jpeg")):
        status, answer = raw(attention_server, "POST", "/caption", data, {"Content-Type": kind,
                                                                           "Content-Length": str(len(data))})
        assert status == 400 and "\n" not in answer["error"], (kind, answer)
    status, answer = raw(attention_server, "POST", "/caption", cut, {"Content-Type": content_type,
                                                                     "Content-Length": str(len(cut))})
    assert answer["error"].startswith("malformed multipart/form-data body")
    assert raw(attention_server, "GET", "/nowhere")[0] == 404
    assert raw(attention_server, "POST", "/", b"", {"Content-Length": "0"})[0] == 405
    assert raw(attention_server, "GET", "/caption")[0] == 405
    assert raw(attention_server, "DELETE", "/caption")[0] == 405


def test_concurrent_requests_share_model_calls_and_get_their_own_captions(attention_server, photos):
    names = ["photo0.jpg", "photo1.jpg", "drawing.png"]
    alone = {}
    for name in names:  # one at a time: one call each
        calls = attention_server.batcher.calls
        status, records = call(attention_server, images(photos, name))
        assert status == 200 and attention_server.batcher.calls == calls + 1
        alone[name] = records[0]
    batcher, order = attention_server.batcher, names * 2  # six requests at once
    answers, wait = [None] * len(order), batcher.wait
    batcher.wait = 1.0  # a second for the six to arrive (a shared machine is slow to start threads)
    try:
        calls, sizes = batcher.calls, dict(batcher.batches)
        threads = [threading.Thread(target=lambda i=i, n=n: answers.__setitem__(i, call(attention_server,
                                                                                           images(photos, n))))
                   for i, n in enumerate(order)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        batcher.wait = wait
    made = batcher.calls - calls
    assert made <= 2 < len(order)  # batched: six requests, one or two model calls
    assert max(size for size, n in batcher.batches.items() if n > sizes.get(size, 0)) >= 3
    for name, (status, records) in zip(order, answers):
        assert status == 200 and records[0]["image"] == name
        got, want = records[0]["captions"][0], alone[name]["captions"][0]
        assert got["caption"] == want["caption"]  # each request's own image's caption
        assert got["log_prob"] == pytest.approx(want["log_prob"], abs=1e-4)  # a batch's sums may differ last


def test_the_page_keeps_the_dom_contract_and_loads_nothing_from_outside(attention_server):
    from captioning.config.sections import DecodeConfig
    from captioning.config.settings import keys_of

    with urllib.request.urlopen(attention_server.url, timeout=30) as answer:
        assert answer.status == 200 and answer.headers["Content-Type"] == "text/html; charset=utf-8"
        page = answer.read().decode()
    for mark in ('<input type="file" id="images" accept="image/*" multiple>', 'id="drop"', 'id="caption"',
                 '<form id="options">', '<div id="results">', '<div id="status" data-state="idle">',
                 '"result"', '"thumb"', '"caption"', '"score"', '"alternatives"', '"attention"', '"word-attention"',
                 '"attention for "', '"error"', '"busy"', '"done"'):
        assert mark in page, mark
    form = page.split('<form id="options">')[1].split("</form>")[0]
    assert sorted(re.findall(r'name="(decode\.\w+)"', form)) == sorted(f"decode.{k}" for k in keys_of(DecodeConfig))
    assert '<input type="number" name="decode.beam_size" value="3" data-default="3" step="1" min="1" max="50"' in form
    assert "{{" not in page and not re.search(r"(src|href)=\"?(https?:)?//", page)  # no CDN, no web font
    assert "@import" not in page and "url(" not in page


def test_cli_errors_come_before_the_model_loads(attention_server, trained_attention_dir, tmp_path):
    port = attention_server.url.rsplit(":", 1)[1].strip("/")
    code, out, err = run_main("serve", "--model-dir", trained_attention_dir, "--port", port)
    assert code == 2 and err.strip() == f"captioning serve: error: --port {port} is in use on 127.0.0.1: stop what " \
                                        "listens there or choose another (--port 0: any free port)"
    code, _, err = run_main("serve", "--model-dir", trained_attention_dir, "--host", "no-such-host.invalid")
    assert code == 2 and "error: --host 'no-such-host.invalid' is not an address" in err and len(err.splitlines()) == 1
    code, _, err = run_main("serve", "--model-dir", str(tmp_path / "nothing"), "--port", "0")
    assert code == 2 and len(err.strip().splitlines()) == 1 and "nothing" in err
    code, _, err = run_main("serve", "--model-dir", trained_attention_dir, "--max-upload-mb", "5000")
    assert code == 2 and "--max-upload-mb: must be an integer in [1, 1,024], got 5000" in err


def test_benchmark_serve_reports_latency_throughput_and_batching(trained_model_dir, tmp_path):
    out = tmp_path / "serve.json"
    code, stdout, err = run_main("benchmark", "serve", "--model-dir", trained_model_dir, "--requests", "12",
                                 "--concurrency", "4", "--work-dir", str(tmp_path), "--json", str(out))
    assert code == 0, err
    result = json.loads(out.read_text())
    for phase, concurrency in (("sequential", 1), ("concurrent", 4)):
        r = result[phase]
        assert (r["requests"], r["failed"], r["concurrency"]) == (12, 0, concurrency)
        assert 0 < r["p50_ms"] <= r["p99_ms"] and r["images_per_s"] > 0
    assert result["sequential"]["model_calls"] == 12 and result["concurrent"]["model_calls"] < 12
    assert "concurrent / sequential throughput" in stdout


def test_the_page_is_package_data():
    import configparser

    from captioning.inference import serve

    setup = configparser.ConfigParser()
    setup.read(os.path.join(REPO, "setup.cfg"))
    assert os.path.basename(serve.PAGE) in setup["options.package_data"]["captioning.inference"].split()
    assert os.path.isfile(serve.PAGE)


def test_the_server_still_answers_after_all_the_bad_requests(attention_server, photos):
    status, records = call(attention_server, images(photos, "photo1.jpg"))
    assert status == 200 and records[0]["captions"]
    assert attention_server.thread.is_alive() and attention_server.batcher._thread.is_alive()
