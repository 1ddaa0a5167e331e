"""The encoder owns the image geometry: one preprocessor (captioning/data/preprocessor.py), which the encoder returns,
resizes and crops for the four paths an image takes into a model, and they see the same pixels of the same JPEG:

* the input pipeline (``make_dataset`` with each ``data.cache`` that keeps pixels, and ``eval_images``),
* the Captioner (``caption``, and the SavedModel, which wraps its function),
* the server, over HTTP on 127.0.0.1,
* the LiteRT graph's crop, converted and run by LiteRT's interpreter.

The pipeline, the Captioner and the LiteRT graph give their pixels, compared exactly (the LiteRT graph resizes in
built-in ops written as TensorFlow's kernel: bit for bit, not within a tolerance). The server answers captions, not
pixels: its log-probabilities and attention weights are compared to the model's on the pipeline's crop, within the
JSON record's rounding (6 and 5 decimals), and the same model on the crop one pixel over (or on another resize)
is shown to move them by far more than that, so a server that cropped otherwise would fail.
"""

import dataclasses
import json

import numpy as np
import pytest
import tensorflow as tf

from captioning.benchmarks.serve import post
from captioning.config.sections import DataConfig
from captioning.data.preprocessor import ImagePreprocessor


@pytest.fixture(scope="module")
def trained(trained_attention_dir):
    from captioning.inference import load

    return load(trained_attention_dir)


@pytest.fixture(scope="module")
def photo(trained):
    """The first val image of the fixture's records: its id and JPEG bytes (a shapes image, wider than high or
    higher than wide: the squash is not a plain scale)."""
    from captioning.data.reading import parsed_images

    example = next(iter(parsed_images(trained.config.data, "val", training=False, max_images=1)))
    jpeg = example["encoded"].numpy()
    height, width = tf.io.extract_jpeg_shape(jpeg).numpy()[:2]
    assert height != width
    return int(example["image_id"]), jpeg


def pipeline_crops(cfg, preprocessor, cache: str, cache_dir: str) -> set[bytes]:
    """Every distinct image the evaluation input (``make_dataset``) hands the model with ``data.cache: cache``."""
    from captioning.data.pipeline import make_dataset

    ds = make_dataset(dataclasses.replace(cfg, cache=cache), "val", training=False, batch_size=4, cache_dir=cache_dir,
                      preprocessor=preprocessor)
    return {image.tobytes() for batch in ds for image in batch["image"].numpy()}


def test_the_encoder_returns_the_preprocessor_and_its_normalisation(trained):
    encoder = trained.model.image_encoder
    preprocessor = trained.preprocessor
    assert preprocessor == encoder.preprocessor(36) == ImagePreprocessor(32, 36) == ImagePreprocessor.of(DataConfig(
        image_size=32, resize_size=36))
    assert preprocessor.normalise == encoder.preprocess  # small_cnn: None (it rescales inside its backbone)
    with pytest.raises(ValueError, match="cannot be cropped"):
        ImagePreprocessor(40, 36)


@pytest.fixture(scope="module")
def pipeline_crop(trained, photo, tmp_path_factory):
    """The photo's crop as the input pipeline gives it to the model: evaluation's (``eval_images``), which
    ``make_dataset`` gives too through each ``data.cache`` that keeps pixels."""
    from captioning.data.reading import eval_images

    cfg, preprocessor = trained.config.data, trained.preprocessor
    crops = {int(i): image for batch in eval_images(cfg, "val", 4, preprocessor=preprocessor)
             for i, image in zip(batch["image_id"].numpy(), batch["image"].numpy())}
    for cache in ("none", "memory", "disk"):
        assert pipeline_crops(cfg, preprocessor, cache, str(tmp_path_factory.mktemp("cache"))) == {
            c.tobytes() for c in crops.values()}, cache
    crop = crops[photo[0]]
    assert crop.shape == (32, 32, 3)
    return crop


@pytest.mark.slow
def test_the_pipeline_the_captioner_and_the_litert_graph_see_the_same_pixels_of_a_jpeg(trained, photo, pipeline_crop,
                                                                                       tmp_path):
    from ai_edge_litert.interpreter import Interpreter

    from captioning.inference import Captioner
    from captioning.inference.litert import LiteRTGraph

    jpeg, preprocessor = photo[1], trained.preprocessor
    # the Captioner (and the SavedModel, which serves its function): the crops it encoded
    captioner = Captioner(trained)
    np.testing.assert_array_equal(captioner.decode(tf.constant([jpeg]))["images"].numpy()[0], pipeline_crop)
    # the LiteRT graph's crop (what LiteRTGraph._state encodes), in LiteRT's interpreter, from the pixels an app
    # decodes (as the records are decoded)
    graph = LiteRTGraph(captioner)
    pixels = tf.function(lambda image: {"crop": graph.pixels(image)[preprocessor]}, autograph=False,
                         input_signature=[tf.TensorSpec([None, None, 3], tf.uint8, name="image")])
    tf.saved_model.save(tf.Module(), str(tmp_path), signatures={"serving_default": pixels.get_concrete_function()})
    run = Interpreter(model_content=tf.lite.TFLiteConverter.from_saved_model(str(tmp_path)).convert()
                      ).get_signature_runner("serving_default")
    decoded = tf.io.decode_jpeg(jpeg, channels=3, dct_method="INTEGER_FAST").numpy()
    np.testing.assert_array_equal(run(image=decoded)["crop"], pipeline_crop)


@pytest.mark.slow  # a server on a socket (the Makefile's slow loop)
def test_the_server_answers_over_http_as_the_model_on_the_pipelines_pixels(trained, photo, pipeline_crop):
    from captioning.inference import Captioner
    from captioning.inference.serve import start

    jpeg, preprocessor = photo[1], trained.preprocessor
    running = start(Captioner(trained), port=0)
    try:
        status, body = post(running.url + "caption", [("image", "photo.jpg", jpeg)])
    finally:
        running.stop()
    assert status == 200, body
    served = json.loads(body)[0]["captions"][0]
    # the model on the pipeline's crop, and on crops a path one pixel off, or resized otherwise, would have read
    captioner = Captioner(trained)
    resized = preprocessor.resized(tf.io.decode_jpeg(jpeg, channels=3, dct_method="INTEGER_FAST")).numpy()
    assert np.array_equal(resized[2:34, 2:34], pipeline_crop)  # the central 32 of 36
    otherwise = preprocessor.cropped(tf.image.resize(tf.io.decode_jpeg(jpeg, channels=3), [37, 37])).numpy()
    seen, *others = [best(captioner, image) for image in (pipeline_crop, resized[3:35, 2:34], resized[2:34, 3:35],
                                                          otherwise)]
    assert served["caption"] == seen["caption"]
    assert abs(served["log_prob"] - seen["log_prob"]) <= 2e-6  # the record's 6 decimals
    assert np.abs(np.array(served["attention"]) - seen["attention"]).max() <= 2e-5  # its 5 decimals
    for other in others:  # each moves the answer by far more than the rounding: a server that read it would fail
        moved = max(abs(other["log_prob"] - seen["log_prob"]),
                    np.abs(other["attention"][:len(seen["attention"])] - seen["attention"]).max()
                    if other["caption"] == seen["caption"] else 1.0)
        assert moved > 1e-3, moved


def best(captioner, image) -> dict:
    """The best caption of the model on ``uint8 [S, S, 3]`` pixels as they are: its words, log-probability and
    attention (``[words, cells]``)."""
    from captioning.model.decode import ids_to_text

    out = captioner.decode_batch({"image": tf.constant(image[None].astype(np.uint8))})
    length = int(out["lengths"][0, 0])
    return {"caption": ids_to_text(captioner.trained.vocab, out["ids"], out["lengths"])[0][0],
            "log_prob": float(out["log_probs"][0, 0]), "attention": out["attention"].numpy()[0, 0, :length]}
