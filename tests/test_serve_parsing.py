"""``captioning serve``'s pieces that need no server: the multipart parse's memory and CPU (real JPEG bytes, a
part of newlines), what tells decoding option sets apart, which errors are an image's, the page's number ranges.

The requests through a real server (the 503 for a new option set, the 500 of a failing model) are in
tests/test_serve_options.py."""

import io
import re

import numpy as np
import pytest
from PIL import Image

from captioning.benchmarks.serve import form_body, parse_cost
from captioning.config.sections import DecodeConfig
from captioning.inference.serve_api import ApiError, parse_multipart

MB = 2**20


@pytest.fixture(scope="module")
def photo():
    """A real JPEG of about 2 MB (noise does not compress)."""
    pixels = np.random.default_rng(0).integers(0, 255, (1300, 1300, 3), dtype=np.uint8)
    data = io.BytesIO()
    Image.fromarray(pixels).save(data, "JPEG", quality=95)
    assert 1.5 * MB < len(data.getvalue()) < 3 * MB
    return data.getvalue()


@pytest.mark.parametrize("kind", ["jpeg", "newlines"])
def test_the_parse_holds_about_the_upload_once(photo, kind):
    """Python's email parser held 10.5x a 2 MB JPEG upload and 14x a part of newlines (docs/serving.md); the
    figures come from the benchmark's own measure (``captioning benchmark serve`` prints them)."""
    payload = photo if kind == "jpeg" else b"\n" * (4 * MB)
    body, content_type = form_body([("decode.beam_size", None, b"2"), ("image", "x.jpg", payload)])
    cost = parse_cost(content_type, body)
    assert cost["parts"] == [("decode.beam_size", None, b"2"), ("image", "x.jpg", payload)]
    assert cost["peak_x"] < 1.5  # the part's own bytes and a chunk
    pieces = [body[i:i + MB] for i in range(0, len(body), MB)]  # as the server reads it: the same parts
    assert parse_multipart(content_type, pieces) == cost["parts"]


def test_a_body_that_is_not_a_form_is_refused_early_without_holding_it():
    body = b"\n" * (8 * MB)  # no boundary anywhere
    cost = parse_cost("multipart/form-data; boundary=abc", body)
    assert cost["error"].startswith("malformed multipart/form-data body (no boundary")
    assert cost["peak_x"] * len(body) < MB  # the first chunk's search, not the body


def test_malformed_bodies_are_400_in_one_line():
    body, content_type = form_body([("image", "a.jpg", b"\xff\xd8 some bytes")])
    cases = {"it ends before its closing boundary": (content_type, body[: len(body) // 2]),
             "malformed multipart/form-data body": (content_type, b"garbage"),
             "no boundary in its Content-Type": ("multipart/form-data", body),
             "not image/jpeg": ("image/jpeg", body),
             "a part without Content-Disposition": (content_type, body.replace(b'; name="image"', b"")),
             "a part without Content-Disposition: form-data": (content_type, body.replace(b"form-data;", b"inline;")),
             "(no parts)": (content_type, f"--{content_type.split('=')[1]}--\r\n".encode())}
    for said, (kind, data) in cases.items():
        with pytest.raises(ApiError) as caught:
            parse_multipart(kind, data)
        assert caught.value.status == 400 and said in str(caught.value) and "\n" not in str(caught.value), said


def test_option_sets_are_told_apart_by_what_the_search_reads():
    from captioning.inference.serve_batching import Batcher

    key = Batcher.key
    beam = DecodeConfig()
    assert key(beam) == key(DecodeConfig(seed=12345)) == key(DecodeConfig(temperature=0.5, sample_top_p=0.3))
    assert key(beam) != key(DecodeConfig(beam_size=4))
    assert key(DecodeConfig(method="greedy", beam_size=2)) == key(DecodeConfig(method="greedy", beam_size=5))
    sample = DecodeConfig(method="sample")
    assert key(sample) != key(DecodeConfig(method="sample", seed=1))  # what sampling reads
    assert key(sample) == key(DecodeConfig(method="sample", length_normalization=0.7))
    assert key(DecodeConfig(bad_endings=["a", "the"])) == key(DecodeConfig(bad_endings=["the", "a"])) != key(beam)


def a_jpeg() -> bytes:
    good = io.BytesIO()
    Image.new("RGB", (8, 6)).save(good, "JPEG")
    return good.getvalue()


def test_only_an_images_error_is_an_images():
    import tensorflow as tf

    from captioning.inference.caption import caption_each

    def call(items):  # TensorFlow's own JPEG decoder on each item; a real error for bytes that are not a JPEG
        return [[int(tf.shape(tf.io.decode_jpeg(item))[0])] for item in items]

    out = caption_each(call, [a_jpeg(), b"not a jpeg"])
    assert out[0] == ([6], None) and out[1][0] is None and out[1][1].startswith("cannot decode: ")


@pytest.mark.slow  # (0.01 CPU s, but TensorFlow's allocator waits 10 s for memory before it refuses)
def test_running_out_of_memory_is_not_an_images_error():
    """The model running out of memory is the server's error, not the image's: it is raised, not reported as a
    caption that failed."""
    import tensorflow as tf

    from captioning.inference.caption import caption_each

    def exhausted(items):  # 4 TiB: TensorFlow's allocator refuses it, as when the model runs out of memory
        return [[float(tf.reduce_sum(tf.fill(tf.constant([2**40], tf.int64), 1.0)))] for _ in items]

    with pytest.raises(tf.errors.ResourceExhaustedError):
        caption_each(exhausted, [a_jpeg()])


def test_the_pages_number_controls_refuse_what_the_server_refuses():
    from captioning.inference.serve import option_controls
    from captioning.config.settings import fields_of, in_range

    controls = option_controls(DecodeConfig())
    assert re.search(r'name="decode.temperature"[^>]* min="5e-324"', controls)
    for name, f in fields_of(DecodeConfig).items():
        if "range" not in f.metadata:
            continue
        control = re.search(rf'<input type="number" name="decode.{name}"[^>]*>', controls)[0]
        low, low_open, high, high_open = f.metadata["range"]
        least = float(re.search(r' min="([^"]+)"', control)[1])
        assert in_range(least, f.metadata["range"]) and (least > low if low_open else least == low), name
        if high is not None:
            most = float(re.search(r' max="([^"]+)"', control)[1])
            assert in_range(most, f.metadata["range"]) and (most < high if high_open else most == high), name
