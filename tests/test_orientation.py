"""A phone photo's EXIF orientation: ``caption`` and ``serve`` turn it upright before captioning (Pillow's
``ImageOps.exif_transpose``), and so do the exported SavedModel's signatures, in the graph
(:func:`captioning.data.reading.exif_orientation`, :func:`captioning.data.reading.upright`), and the LiteRT snippet
of docs/litert.md. The quick test checks the graph's reading of the tag against Pillow's on every orientation, both
byte orders and malformed segments; the slow one captions one orientation-6 JPEG all four ways."""

from __future__ import annotations

import io
import json
import os
import struct
import subprocess
import sys

import numpy as np
import pytest
from PIL import Image, ImageOps


def exif_segment(orientation: int, order: str = "II", kind: int = 3) -> bytes:
    """An APP1 Exif payload written by hand: IFD0 with a Make entry, then the orientation (SHORT, or LONG)."""
    e = "<" if order == "II" else ">"
    value = struct.pack(e + "H", orientation) + b"\0\0" if kind == 3 else struct.pack(e + "I", orientation)
    entries = [struct.pack(e + "HHI4s", 0x010F, 2, 4, b"abc\0"), struct.pack(e + "HHI", 0x0112, kind, 1) + value]
    ifd = struct.pack(e + "H", len(entries)) + b"".join(entries) + struct.pack(e + "I", 0)
    return b"Exif\0\0" + order.encode() + struct.pack(e + "HI", 42, 8) + ifd


def jpeg(pixels: np.ndarray, exif: bytes | None = None, **kwargs) -> bytes:
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, "JPEG", quality=95, **({"exif": exif} if exif is not None else {}), **kwargs)
    return out.getvalue()


def test_the_graph_reads_the_orientation_as_pillow_does_and_turns_the_pixels_as_it_does():
    import tensorflow as tf

    from captioning.data.reading import exif_orientation, upright

    read = tf.function(exif_orientation, input_signature=[tf.TensorSpec([], tf.string)], autograph=False)
    turn = tf.function(upright, autograph=False)
    pixels = np.random.default_rng(0).integers(0, 256, (20, 30, 3), dtype=np.uint8)
    for order in ("II", "MM"):
        for kind in (3, 4):
            for orientation in range(10):
                data = jpeg(pixels, exif_segment(orientation, order, kind))
                pillow = Image.open(io.BytesIO(data))
                assert pillow.getexif().get(0x0112) == orientation  # Pillow reads what was written
                got = int(read(tf.constant(data)))
                assert got == (orientation if 1 <= orientation <= 8 else 1), (order, kind, orientation)
                decoded = np.asarray(pillow.convert("RGB"))
                shown = np.asarray(ImageOps.exif_transpose(Image.open(io.BytesIO(data))).convert("RGB"))
                np.testing.assert_array_equal(turn(tf.constant(decoded), tf.constant(got)).numpy(), shown)
    # Pillow's own writer, after a JFIF APP0 segment (Image.Exif: little-endian)
    exif = Image.Exif()
    exif[0x0112] = 6
    assert int(read(tf.constant(jpeg(pixels, exif.tobytes())))) == 6
    # anything unreadable is 1, never an error: no segment, a PNG, cut anywhere, nonsense offsets and counts
    whole = jpeg(pixels, exif_segment(6, "MM"))
    assert int(read(tf.constant(jpeg(pixels)))) == 1
    for data in [whole[:cut] for cut in (0, 1, 3, 10, 20, 30, 40, 60)] + [
            b"\xff\xd8\xff\xe1\xff\xffExif\0\0MM\0*\xff\xff\xff\xff",  # IFD0 far beyond the bytes
            b"\xff\xd8\xff\xe1\x00\x30Exif\0\0II*\0\x08\0\0\0\xff\xff" + b"\x12\x01\x03\0" * 20,  # 65,535 entries
            b"\xff\xd8" + b"\xff\xe0\x00\x02" * 40 + b"\xff\xe1\x00\x30" + exif_segment(6)]:  # past 16 segments
        assert int(read(tf.constant(data))) == 1, data[:40]


def test_a_rotated_jpeg_reaches_the_model_as_caption_gives_it(trained_model_dir):
    """The crops the Captioner (the SavedModel's function) sees of an orientation-6 JPEG are those of what
    ``caption`` gives it for the file (Pillow's decode, turned, as PNG): bit for bit."""
    import tensorflow as tf

    from captioning.inference import Captioner, load
    from captioning.inference.caption import model_bytes

    captioner = Captioner(load(trained_model_dir))
    upright_pixels = np.random.default_rng(1).integers(0, 256, (40, 56, 3), dtype=np.uint8)
    for orientation, stored in ((6, np.rot90(upright_pixels, 1)), (3, upright_pixels[::-1, ::-1]),
                                (8, np.rot90(upright_pixels, -1))):
        data = jpeg(np.ascontiguousarray(stored), exif_segment(orientation, "MM"))
        as_caption = model_bytes(data)
        assert as_caption[:4] == b"\x89PNG"  # caption turned it and handed over a PNG
        seen = captioner.decode(tf.constant([data, as_caption]))["images"].numpy()
        np.testing.assert_array_equal(seen[0], seen[1])
        sideways = captioner.decode(tf.constant([jpeg(np.ascontiguousarray(stored))]))["images"].numpy()
        assert not np.array_equal(sideways[0], seen[0])  # the tag, not the pixels, made the difference


@pytest.mark.slow  # a SavedModel export, a LiteRT export, a server and one process without the project
def test_caption_serve_the_savedmodel_and_the_litert_snippet_caption_a_rotated_photo_alike(
        trained_attention_dir, shapes_dir, tmp_path):
    """An orientation-6 JPEG (stored sideways, tagged "rotate 90° clockwise to show") of a shapes image whose
    sideways caption differs from its upright one: ``caption``, ``serve``'s API, the SavedModel (both signatures)
    and docs/litert.md's snippet all give the upright caption. Before the graph read the tag, the SavedModel
    gave the sideways one (the same function: the Captioner on the sideways pixels)."""
    import tensorflow as tf

    from captioning.benchmarks.serve import post
    from captioning.inference import Captioner, load
    from captioning.inference.export import export
    from captioning.inference.litert import export_litert
    from captioning.inference.serve import start
    from tests.helpers import run_main
    from tests.harness.files import doc_snippet

    model_dir = trained_attention_dir
    captioner = Captioner(load(model_dir))
    folder = os.path.join(shapes_dir, "images")
    photo = None
    for name in sorted(os.listdir(folder))[:40]:  # the first image whose caption the turn changes
        shown = np.asarray(Image.open(os.path.join(folder, name)).convert("RGB"))
        data = jpeg(np.ascontiguousarray(np.rot90(shown, 1)), exif_segment(6))
        decoded = np.asarray(Image.open(io.BytesIO(data)).convert("RGB"))  # stored sideways, as Pillow decodes it
        png = [tf.io.encode_png(p).numpy() for p in (np.rot90(decoded, -1), decoded)]  # upright, sideways
        upright_caption, sideways_caption = (captions[0].text for captions in captioner.caption(png))
        if upright_caption != sideways_caption:
            photo = tmp_path / "photo.jpg"
            photo.write_bytes(data)
            break
    assert photo is not None, "no image of the 40 whose caption the turn changes"
    assert ImageOps.exif_transpose(Image.open(photo)).size == Image.open(os.path.join(folder, name)).size

    code, out, err = run_main("caption", "--model-dir", model_dir, str(photo), "--json")
    assert code == 0, err
    assert json.loads(out.splitlines()[0])["captions"][0]["caption"] == upright_caption

    running = start(captioner, port=0)
    try:
        status, body = post(running.url + "caption", [("image", "photo.jpg", photo.read_bytes())])
    finally:
        running.stop()
    assert status == 200, body
    assert json.loads(body)[0]["captions"][0]["caption"] == upright_caption

    saved = tf.saved_model.load(export(captioner, str(tmp_path / "export"), model_dir))
    served = saved.signatures["serving_default"](images=tf.constant([photo.read_bytes()]))
    assert served["captions"][0, 0].numpy().decode() == upright_caption
    example = tf.train.Example(features=tf.train.Features(feature={"image/encoded": tf.train.Feature(
        bytes_list=tf.train.BytesList(value=[photo.read_bytes()]))})).SerializeToString()
    served = saved.signatures["serving_examples"](examples=tf.constant([example]))
    assert served["captions"][0, 0].numpy().decode() == upright_caption

    snippet_dir = tmp_path / "snippet"
    os.makedirs(snippet_dir / "runs" / "demo")
    export_litert(captioner, str(snippet_dir / "runs" / "demo" / "caption.tflite"), model_dir)
    os.link(photo, snippet_dir / "photo.jpg")
    code = f"ns = {{}}\nexec({doc_snippet()!r}, ns)\nimport sys\nassert 'tensorflow' not in sys.modules\n" \
           "print('CAPTION=' + ns['caption'])"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    done = subprocess.run([sys.executable, "-c", code], cwd=str(snippet_dir), env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert [line[8:] for line in done.stdout.splitlines() if line.startswith("CAPTION=")] == [upright_caption]
