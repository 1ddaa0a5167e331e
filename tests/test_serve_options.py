"""``captioning serve`` against a real server on 127.0.0.1 (the soft-attention fixture model): what a client's
decoding options may cost (a new trace only for options that decode differently, and a bounded number of them),
and a model call that really fails (TensorFlow's allocator refusing a tensor) answered 500 and logged once, not
as an image's error. The parse and the option keys alone are in tests/test_serve_parsing.py."""

import json
import logging
import os

import pytest

from captioning.benchmarks.serve import post

pytestmark = pytest.mark.slow  # real servers on sockets, as tests/test_serve.py


def _start(model_dir, captioner_class=None):
    from captioning import inference
    from captioning.inference.serve import start

    trained = inference.load(model_dir)
    return start((captioner_class or inference.Captioner)(trained), port=0)


@pytest.fixture(scope="module")
def photo(shapes_dir):
    folder = os.path.join(shapes_dir, "images")
    with open(os.path.join(folder, sorted(os.listdir(folder))[0]), "rb") as f:
        return f.read()


@pytest.fixture(scope="module")
def server(trained_attention_dir):
    running = _start(trained_attention_dir)
    yield running
    running.stop()


def call(running, photo, **options):
    status, body = post(running.url + "caption", [("image", "photo.jpg", photo)] +
                        [(f"decode.{key}", None, str(value).encode()) for key, value in options.items()])
    return status, json.loads(body)


def test_a_seed_under_beam_search_makes_no_new_captioner(server, photo):
    batcher = server.batcher
    status, first = call(server, photo)
    traces = batcher.default.decode.experimental_get_tracing_count()
    for seed in range(1, 11):  # more seeds than captioners are kept: each was a new one, and a new trace
        status, records = call(server, photo, seed=seed)
        assert status == 200 and records == first, seed
    assert len(batcher._captioners) == 0  # the server's own decoded them all
    assert batcher.default.decode.experimental_get_tracing_count() == traces
    for seed in range(1, 6):  # options that do decode differently: one captioner for all five seeds
        status, records = call(server, photo, beam_size=2, seed=seed)
        assert status == 200
    assert len(batcher._captioners) == 1


def test_a_new_option_set_is_refused_while_every_kept_one_is_in_use(server, photo):
    batcher = server.batcher
    kept, idle = batcher.max_captioners, batcher.idle_s
    batcher._captioners.clear()
    batcher.max_captioners = 2  # scaled down from 8
    try:
        for beam in (2, 4):
            assert call(server, photo, beam_size=beam)[0] == 200
        status, answer = call(server, photo, beam_size=5)  # a third would need a third trace within a minute
        assert status == 503 and answer["error"].startswith("2 other sets of decoding options were used in the "
                                                            "last 60 s") and "\n" not in answer["error"]
        assert len(batcher._captioners) == 2
        assert call(server, photo, beam_size=2)[0] == 200  # one kept: no new trace, answered
        assert call(server, photo, top_k=1)[0] == 200  # the server's own options
        batcher.idle_s = 0.0  # as if a minute had passed: the least recently used one makes room
        assert call(server, photo, beam_size=5)[0] == 200 and len(batcher._captioners) == 2
    finally:
        batcher.max_captioners, batcher.idle_s = kept, idle


def test_a_model_that_fails_is_a_500_logged_once_not_an_images_error(trained_attention_dir, photo, caplog):
    import tensorflow as tf

    from captioning.inference import Captioner

    class OutOfMemory(Captioner):
        """The real model call, which also asks for a 4 TiB tensor in its graph: TensorFlow's allocator refuses it
        (ResourceExhaustedError), as when a model runs out of memory."""

        def decode_encoded(self, encoded):
            out = super().decode_encoded(encoded)
            waste = tf.fill(tf.shape(encoded, out_type=tf.int64) * 2**40, 0.0)
            return {**out, "log_probs": out["log_probs"] + tf.reduce_sum(waste)}

    running = _start(trained_attention_dir, OutOfMemory)
    try:
        with caplog.at_level(logging.ERROR, logger="captioning.serve"):
            status, answer = call(running, photo)
        assert status == 500, answer
        assert answer == {"error": "the model failed: ResourceExhaustedError: OOM when allocating tensor with shape"
                                   f"{answer['error'].split('with shape', 1)[1]}"}
        logged = [r for r in caplog.records if r.name == "captioning.serve" and r.levelno >= logging.ERROR]
        assert len(logged) == 1 and isinstance(logged[0].exc_info[1], tf.errors.ResourceExhaustedError)
        status, answer = post(running.url + "caption", [("image", "notes.txt", b"just text")])
        assert status == 400 and json.loads(answer)["error"].startswith("no usable image: notes.txt")  # the image's
        assert running.batcher._thread.is_alive()
    finally:
        running.stop()
