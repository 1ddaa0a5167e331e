"""``captioning export --format litert`` (captioning/inference/litert.py): the ``.tflite`` file captions as the
Captioner (the SavedModel's function) does, runs in ai-edge-litert's interpreter in a process that imports
neither this project nor TensorFlow, needs no Flex delegate, and is written safely.

The quick tests share one module fixture: the files of two small models trained 300 steps (and their ensemble, and
Show and Tell's greedy decoding) at each quantization, 200 synthetic shapes images, and ONE subprocess that runs
every file on them (and the docs' snippet) with only ai_edge_litert and numpy (Pillow for the snippet's JPEG)."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from tests.helpers import run_main
from tests.harness.files import doc_snippet

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# runs every file on its images, without this project: imports only ai_edge_litert and numpy (and Pillow in
# the docs' snippet, for the JPEG), and says which modules it imported
WITHOUT_THE_PROJECT = r"""
import json, os, sys
import numpy as np
from ai_edge_litert import schema_py_generated as schema
from ai_edge_litert.interpreter import Interpreter

job = json.load(open(sys.argv[1]))
names = {v: k for k, v in vars(schema.BuiltinOperator).items() if not k.startswith("_")}
out = {}
for name, path in job["files"].items():
    model = schema.ModelT.InitFromPackedBuf(bytearray(open(path, "rb").read()), 0)
    codes = model.operatorCodes
    ops = sorted({names[max(c.builtinCode, c.deprecatedBuiltinCode)] for c in codes})
    custom = [c.customCode.decode() for c in codes if c.customCode]
    run = Interpreter(model_path=path).get_signature_runner("serving_default")
    input_name = run.get_input_details()["image"]["name"]
    images = np.load(job["images"][name])
    results = [run(image=images[f"i{i}"]) for i in range(len(images.files))]
    out[name] = {"ops": ops, "custom": custom, "outputs": sorted(results[0]), "input_name": input_name,
                 "captions": [[" ".join(w.decode() for w in r["words"][j, :r["lengths"][j]])
                               for j in range(len(r["lengths"]))] for r in results],
                 "log_probs": [r["log_probs"].tolist() for r in results],
                 "attention": [r["attention"].tolist() for r in results[:3]] if "attention" in results[0] else None}
os.chdir(job["snippet_dir"])
out["snippet"] = []
for photo in job["snippet_photos"]:  # each file in turn as photo.jpg (Pillow reads what it holds)
    with open(photo, "rb") as f, open("photo.jpg", "wb") as g:
        g.write(f.read())
    namespace = {}
    exec(job["snippet"], namespace)
    out["snippet"].append(namespace["caption"])
try:  # a batch of two: the snippet's conversion names the contract
    namespace["rgb"](np.zeros((2, 8, 8, 3), np.uint8))
except ValueError as e:
    out["snippet_batch"] = str(e)
out["modules"] = sorted({m.split(".")[0] for m in sys.modules})
json.dump(out, open(job["out"], "w"))
"""


def png_of(image) -> bytes:
    out = io.BytesIO()
    image.save(out, "PNG")
    return out.getvalue()


def decoded(jpeg: bytes) -> np.ndarray:
    """The pixels TensorFlow decodes a JPEG to, as the Captioner and the SavedModel do (INTEGER_FAST)."""
    import tensorflow as tf

    return tf.io.decode_jpeg(jpeg, channels=3, dct_method="INTEGER_FAST").numpy()


def without_metadata(data: bytes) -> bytes:
    """A file the export wrote, as convert gave it: without the record with_metadata appended (entry and buffer)."""
    from captioning.inference.litert import METADATA
    from captioning.inference.litert_int8 import packed, unpacked

    model = unpacked(data)
    (entry,) = [m for m in model.metadata if m.name == METADATA.encode()]
    assert entry.buffer == len(model.buffers) - 1
    model.buffers.pop()
    model.metadata.remove(entry)
    return packed(model, len(data))


@pytest.fixture(scope="module")
def decisive_models(prepared_dir, tmp_path_factory):
    """Show and Tell and soft attention at the session fixtures' sizes, trained on 2,400 captions instead of their
    320-480: 75 steps of 32 captions (a step of 32 costs about what one of 8 does here: 2.8 CPU s for Show and Tell
    against 4.0 for 300 steps of 8). Trained 40-60 steps of 8, a model says a few captions for every image, its two
    best often within 0.15 nats of each other, and dynamic_int8's agreement was a draw: 77-98.5% over runs of the same
    recipe. Trained 300 steps of 8: 100% (Show and Tell) and 95-95.5% (attention) over three runs, two of them without
    op determinism, 2026-11-26 (97.5% for attention, 2026-11-28). 75 steps of 32: 100% and 98.5%, with and without op
    determinism; 60 and 90 steps of 32: 100% and 99%, 100% and 99.5% (2026-11-28)."""
    from captioning.experiment import for_training
    from captioning.train import Trainer
    from tests.helpers import small_train_config

    steps = 75
    common = ["train.batch_size=32", f"train.steps={steps}", "train.optimizer=adam", "train.learning_rate=0.01",
              "model.embedding_size=32", "model.lstm_units=32", f"train.checkpoint_every_steps={steps}",
              "train.log_every_steps=25"]  # (a log line a step costs 3 ms of CPU)
    out = []
    for name, extra in (("sat", []), ("att", ["model.decoder=attention", "model.attention_size=16"])):
        folder = str(tmp_path_factory.mktemp(f"decisive_{name}"))
        Trainer(for_training(small_train_config(prepared_dir, *common, *extra)), folder).run(progress=False)
        out.append(folder)
    return out


@pytest.fixture(scope="module")
def litert(decisive_models, tmp_path_factory):
    sat_dir, att_dir = decisive_models
    from data_prep.synth import synthesize
    from captioning.config.sections import DecodeConfig
    from captioning.inference import Captioner, load
    from captioning.inference.caption import model_bytes
    from captioning.inference.litert import export_litert, record_of, with_metadata
    from captioning.inference.litert_int8 import dynamic_int8
    from PIL import Image

    root = tmp_path_factory.mktemp("litert")
    synthesize(str(root / "shapes"), num_images=200, seed=3, progress=False)
    folder = root / "shapes" / "images"
    jpegs = [open(folder / f, "rb").read() for f in sorted(os.listdir(folder))]
    assert len(jpegs) == 200
    pixels = [decoded(j) for j in jpegs]
    decode = DecodeConfig(beam_size=3, max_length=12, top_k=2)
    captioners = {"sat": Captioner(load(sat_dir), decode), "att": Captioner(load(att_dir), decode),
                  "ens": Captioner(load([sat_dir, att_dir]), decode),
                  "grd": Captioner(load(sat_dir), DecodeConfig(method="greedy", max_length=12))}  # greedy's own loop
    counts = {"sat": 200, "att": 200, "ens": 40, "grd": 40}
    expected = {name: c.caption(jpegs[:counts[name]]) for name, c in captioners.items()}
    flags = ["--model-dir", sat_dir, "--format", "litert", "--beam-size", 3, "--max-length", 12, "--top-k", 2]
    code, out, err = run_main("export", *flags, "--output", root / "sat_none.tflite")
    assert code == 0, err
    files = {"sat_none": str(root / "sat_none.tflite")}
    # the float16 file: the command's --overwrite of a copy of the none file, alone in its folder (what
    # test_rerun_is_a_no_op_another_export_needs_overwrite_and_foreign_files_stay checks: one conversion fewer)
    os.makedirs(root / "overwritten")
    files["sat_float16"] = str(root / "overwritten" / "sat_float16.tflite")
    with open(files["sat_none"], "rb") as f, open(files["sat_float16"], "wb") as g:
        g.write(f.read())
    overwritten = run_main("export", *flags, "--output", files["sat_float16"], "--quantize", "float16", "--overwrite")
    overwritten_folder = sorted(os.listdir(root / "overwritten"))
    # Show and Tell's dynamic_int8 file: its none file quantized, with the record the export writes (convert's
    # dynamic_int8 route converts the model a second time, 1.5 CPU s, to a flatbuffer that differs from the first
    # only in its tensors' names; attention's file below takes that route, as test_prefix_lm_use's command does)
    files["sat_dynamic_int8"] = str(root / "sat_dynamic_int8.tflite")
    with open(files["sat_none"], "rb") as f:
        quantized = dynamic_int8(without_metadata(f.read()))
    with open(files["sat_dynamic_int8"], "wb") as f:
        f.write(with_metadata(quantized, record_of(captioners["sat"], sat_dir, "dynamic_int8")))
    for name, model_dir, quantize in [("att_none", att_dir, "none"),
                                      ("att_dynamic_int8", att_dir, "dynamic_int8"),
                                      ("ens_none", [sat_dir, att_dir], "none"),
                                      ("grd_none", sat_dir, "none")]:
        files[name] = export_litert(captioners[name[:3]], str(root / f"{name}.tflite"), model_dir, quantize)
    images = {}
    for name in files:
        images[name] = str(root / f"{name}.npz")
        np.savez(images[name], **{f"i{i}": p for i, p in enumerate(pixels[:counts[name[:3]]])})
    # the docs' snippet, in a folder holding runs/demo/caption.tflite and photo.jpg
    snippet_dir = root / "snippet"
    os.makedirs(snippet_dir / "runs" / "demo")
    os.link(files["sat_none"], snippet_dir / "runs" / "demo" / "caption.tflite")
    # a shapes JPEG, and the same picture as a grey PNG and as an RGBA PNG with transparent pixels
    shown = Image.open(io.BytesIO(jpegs[7])).convert("RGB")
    translucent = shown.convert("RGBA")
    translucent.putalpha(Image.linear_gradient("L").resize(shown.size))
    photos = {"photo.jpg": jpegs[7], "grey.png": png_of(shown.convert("L")), "rgba.png": png_of(translucent)}
    for file_name, data in photos.items():
        (root / file_name).write_bytes(data)
    job = {"files": files, "images": images, "snippet": doc_snippet(), "snippet_dir": str(snippet_dir),
           "snippet_photos": [str(root / f) for f in photos], "out": str(root / "out.json")}
    (root / "job.json").write_text(json.dumps(job))
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    done = subprocess.run([sys.executable, "-c", WITHOUT_THE_PROJECT, str(root / "job.json")], cwd=str(root),
                          env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    # what the snippet should say: for the JPEG, the Captioner on the very pixels Pillow decoded (a PNG: decoded
    # exactly; TensorFlow's fast DCT differs, docs/litert.md); for the PNGs what `caption` gives the model
    pillow = png_of(Image.open(io.BytesIO(jpegs[7])).convert("RGB"))
    inputs = [pillow, model_bytes(photos["grey.png"]), model_bytes(photos["rgba.png"])]
    snippet_expected = [c[0].text for c in captioners["sat"].caption(inputs)]
    return {"root": root, "files": files, "models": {"sat": sat_dir, "att": att_dir},
            "overwritten": (*overwritten, overwritten_folder),
            "expected": expected, "ran": json.load(open(root / "out.json")),
            "snippet_expected": snippet_expected, "captioners": captioners, "jpegs": jpegs}


def agreement(litert, name) -> float:
    expected = litert["expected"][name[:3]]
    got = litert["ran"][name]["captions"]
    assert len(got) == len(expected)
    return sum(g[0] == e[0].text for g, e in zip(got, expected)) / len(expected)


@pytest.mark.slow  # an export (the Makefile's slow loop)
@pytest.mark.parametrize("name, least", [("sat_none", 0.99), ("sat_float16", 0.95), ("sat_dynamic_int8", 0.9),
                                          ("att_none", 0.99), ("att_dynamic_int8", 0.9), ("ens_none", 0.99),
                                          ("grd_none", 0.99)])
def test_best_captions_agree_with_the_captioner(litert, name, least):
    """On 200 images: the same best caption on >= 99% with none (the same pixels and search: only float32's rounding
    in another runtime). float16 rounds each weight by up to 2^-11: a caption's log-probability moves by at most 0.02
    (0.0038 measured, 2026-11-26), and the beam's pruning may then keep another prefix where two were nearly tied, so
    a few images get another best caption (0, 0 and 2 of 200 in three runs; the 2 had their two best 0.22 nats apart):
    >= 95%.
    dynamic_int8 (ai-edge-quantizer's int8 weights computed in float32, the vocabulary projection, word embeddings
    and convolutions float16): these bounds are the tests' for these small fixture models (:func:`decisive_models`),
    not the demo model's figures, which come from `captioning benchmark litert` (docs/litert.md says both). These
    models measured, with an earlier recipe, 100% (Show and Tell) and 95-96.5% (attention, 5% of whose images have
    their two best captions within 0.05 nats, which any rounding flips). Held to 90% here, so a broken recipe still
    fails (the converter's own Optimize.DEFAULT measured 87.5% on an attention model, 77% on a Show and Tell one
    trained 60 steps; on these fixture models, 2026-11-28, it measured 95-96% and 97.5-100%, within the bound, with
    300 steps of 8 captions as with 75 of 32: the bound catches a recipe far worse than that)."""
    ran, expected = litert["ran"][name], litert["expected"][name[:3]]
    assert all(len(captions) == (1 if name.startswith("grd") else 2) for captions in ran["captions"])  # top_k rows
    agree = agreement(litert, name)
    if name.endswith("float16"):
        moved = [abs(log_prob - c.log_prob) for e, texts, log_probs in zip(expected, ran["captions"], ran["log_probs"])
                 for c in e for text, log_prob in zip(texts, log_probs) if text == c.text]
        assert len(moved) >= len(expected) and max(moved) <= 0.02, f"{name}: log p moved by up to {max(moved):.4f}"
    assert agree >= least, f"{name}: the same best caption on {agree:.1%} of the images"
    if name.endswith("none"):  # the same search on the same pixels: the same log-probabilities, to float32's
        # rounding in another runtime (largest difference 1.4e-5 over the four files, 2026-11-26; 1.9e-3 while the
        # resize's pixels were LiteRT's own, which flipped near-ties: see test_the_resize_in_built_in_ops_...)
        same = [i for i, (g, e) in enumerate(zip(ran["captions"], expected)) if g == [c.text for c in e]]
        assert len(same) >= 0.99 * len(expected)
        np.testing.assert_allclose([ran["log_probs"][i] for i in same],
                                   [[c.log_prob for c in expected[i]] for i in same], rtol=0, atol=1e-4)


@pytest.mark.slow  # an export (the Makefile's slow loop)
def test_the_files_need_no_flex_delegate_and_run_without_this_project(litert):
    ran = litert["ran"]
    assert not {"tensorflow", "captioning", "keras", "tf_keras"} & set(ran["modules"]), ran["modules"]
    for name in litert["files"]:
        assert ran[name]["custom"] == [], (name, ran[name]["custom"])  # no Flex (nor any custom) op
        search = {"ARG_MAX", "IF"} if name.startswith("grd") else {"TOPK_V2"}  # greedy: never-proposed words' IF
        assert {"WHILE", "GATHER", "FLOOR", "CEIL"} | search <= set(ran[name]["ops"])  # the search inside
    assert ran["sat_none"]["outputs"] == ["ids", "lengths", "log_probs", "words"]
    assert ran["att_none"]["outputs"] == ["attention", "ids", "lengths", "log_probs", "words"]


@pytest.mark.slow  # an export (the Makefile's slow loop)
def test_an_attention_decoder_gives_the_best_captions_weights_as_the_captioner(litert):
    expected = litert["expected"]["att"][:3]
    for got, captions in zip(litert["ran"]["att_none"]["attention"], expected):
        best = captions[0]
        got = np.asarray(got)  # [max_length, rows, cols]
        words = len(best.text.split())
        np.testing.assert_allclose(got[:words].reshape(words, -1), best.attention, atol=1e-4)
        assert not got[words:].any()
        np.testing.assert_allclose(got[:words].sum((1, 2)), 1.0, atol=1e-4)


@pytest.mark.slow  # an export (the Makefile's slow loop)
def test_the_docs_snippet_captions_a_jpeg_with_ai_edge_litert_and_numpy(litert):
    """The snippet of docs/litert.md, on a JPEG, a grey PNG and an RGBA PNG: the captions `caption` gives the same
    pixels (grey and RGBA converted as `caption` converts them: without the conversion the interpreter fails with
    "RESHAPE ... failed to prepare"); a batch of two is refused naming the contract."""
    assert litert["ran"]["snippet"] == litert["snippet_expected"] and all(litert["snippet_expected"])
    assert "one uint8 image [height, width" in litert["ran"]["snippet_batch"]


@pytest.mark.slow  # an export (the Makefile's slow loop)
def test_the_file_states_its_input_contract(litert):
    """What the file takes is written where tools show it: the input tensor's name and the metadata's "input"."""
    from captioning.inference.litert import INPUT_CONTRACT, INPUT_NAME, read_record

    for name, path in litert["files"].items():
        assert litert["ran"][name]["input_name"] == INPUT_NAME == "image_uint8_height_width_3_upright_rgb"
        assert read_record(path)["input"] == {"image": INPUT_CONTRACT}
    assert "uint8 [height, width, 3]" in INPUT_CONTRACT and "upright" in INPUT_CONTRACT


@pytest.mark.slow  # an export (the Makefile's slow loop)
def test_dynamic_int8_is_at_most_035_of_none_on_a_model_of_the_demos_size(capsys, caplog):
    """The fixture models (32 units) are too small to show the ratio a demo-sized model gets: a model of the
    demo's sizes (256 units), untrained, shows the ratio the converter gives. Its
    193 words are enough for the beam's chunked top-k, padded (search_tools.best_of; the fixtures' few words are ranked
    whole): the `none` file captions an image as the Captioner does, in LiteRT's built-in ops. The int8 file is the
    `none` file quantized (what convert(captioner, "dynamic_int8") does after converting again; that route is the
    fixture's, export_litert's dynamic_int8 files)."""
    from captioning.config import Config, ModelConfig
    from captioning.config.sections import DecodeConfig
    from captioning.inference import Captioner
    from captioning.inference.litert import convert
    from captioning.inference.litert_int8 import dynamic_int8
    from captioning.model import build_model
    from captioning.model.folder import TrainedModel
    from captioning.vocab import RESERVED, Vocabulary

    cfg = Config()
    cfg.data.image_size, cfg.data.resize_size = 32, 36
    model = build_model(193, ModelConfig(decoder="show_and_tell", encoder="small_cnn", dropout=0.0,
                                         options={"embedding_size": 256, "lstm_units": 256}), 32).build_all()
    cfg.model = model.cfg
    vocab = Vocabulary(list(RESERVED) + [f"w{i}" for i in range(193 - len(RESERVED))])
    captioner = Captioner(TrainedModel(model, cfg, vocab, 0, "(untrained)", "/nowhere"), DecodeConfig(max_length=8))
    none_file = convert(captioner, "none")
    int8_file = dynamic_int8(none_file)
    none, int8 = len(none_file), len(int8_file)
    assert none > 3_000_000 and int8 <= 0.35 * none
    # what the recipe keeps (docs/litert.md): every weight int8 but the vocabulary projection, the word-embedding
    # table and the convolutions, float16; all of them dequantized, computed in float32 (no int8 kernel: no
    # activation is quantized); the largest convolution float16 only while the file stays within the bound (this
    # model's 193 words leave no room: 0.323x with it int8, 0.359x float16)
    from ai_edge_litert import schema_py_generated as schema

    from captioning.inference.litert_int8 import FLOAT16_CONV_WEIGHTS, unpacked

    def stored(data):  # the stored weights: (the convolutions' filters, the other constants of 1,024 values or more)
        kinds = {v: k for k, v in vars(schema.TensorType).items() if not k.startswith("_")}
        model = unpacked(data)
        weights = {t.buffer: (kinds[t.type], tuple(int(n) for n in t.shape)) for g in model.subgraphs
                   for t in g.tensors if model.buffers[t.buffer].data is not None and len(model.buffers[t.buffer].data)
                   and (len(t.shape) == 4 or int(np.prod(t.shape)) >= 1024)}.values()
        return (sorted((kind, int(np.prod(shape))) for kind, shape in weights if len(shape) == 4),
                sorted(w for w in weights if len(w[1]) != 4))

    filters, others = stored(int8_file)
    assert filters == [("FLOAT16", 864), ("FLOAT16", 18432), ("FLOAT16", 73728), ("INT8", 147456)], filters
    assert all(size <= FLOAT16_CONV_WEIGHTS for kind, size in filters if kind == "FLOAT16")
    # the vocabulary projection and the embedding table; the LSTM's bias; the image embedding, the LSTM's two kernels
    assert others == [("FLOAT16", (193, 256)), ("FLOAT16", (193, 256)), ("FLOAT32", (1024,)), ("INT8", (256, 512)),
                      ("INT8", (1024, 256)), ("INT8", (1024, 256))], others
    quantized = unpacked(int8_file)
    codes = [max(c.builtinCode, c.deprecatedBuiltinCode) for c in quantized.operatorCodes]
    dense = [op for g in quantized.subgraphs for op in g.operators
             if codes[op.opcodeIndex] in (schema.BuiltinOperator.FULLY_CONNECTED, schema.BuiltinOperator.CONV_2D)]
    assert len(dense) >= 8 and all(g.tensors[i].type == schema.TensorType.FLOAT32 for g in quantized.subgraphs
                                   for op in g.operators if op in dense for i in op.inputs if i >= 0)
    roomier = dynamic_int8(none_file, bound=0.4)  # room for the largest convolution in float16
    assert stored(roomier)[0] == [("FLOAT16", 864), ("FLOAT16", 18432), ("FLOAT16", 73728), ("FLOAT16", 147456)]
    assert int8 < len(roomier) <= 0.4 * none
    from ai_edge_litert.interpreter import Interpreter

    image = np.random.default_rng(0).integers(0, 256, (40, 44, 3), dtype=np.uint8)
    ran = Interpreter(model_content=none_file).get_signature_runner("serving_default")(image=image)
    png = io.BytesIO()
    __import__("PIL.Image").Image.fromarray(image).save(png, "PNG")
    (expected,) = captioner.caption([png.getvalue()])
    assert " ".join(w.decode() for w in ran["words"][0, :ran["lengths"][0]]) == expected[0].text
    # the quantizer's progress bar and its "Serializing model..." line stay out of the command's output
    assert "Applying Transformations" not in capsys.readouterr().err and "Serializing model" not in caplog.text


@pytest.mark.slow  # an export (the Makefile's slow loop)
def test_rerun_is_a_no_op_another_export_needs_overwrite_and_foreign_files_stay(litert, tmp_path):
    from captioning.inference.litert import read_record

    path = litert["files"]["sat_none"]
    before = os.stat(path)
    flags = ["--model-dir", litert["models"]["sat"], "--format", "litert", "--beam-size", 3, "--max-length", 12,
             "--top-k", 2, "--output", path]
    code, out, err = run_main("export", *flags)
    # it says what happened: nothing was written (issue 48, item 21)
    assert code == 0 and out.startswith(f"already exported to {path} (unchanged: the same model, checkpoint"), out
    after = os.stat(path)
    assert (after.st_ino, after.st_mtime_ns) == (before.st_ino, before.st_mtime_ns)  # not written again
    record = read_record(path)
    assert record["quantize"] == "none" and record["flex_delegate"] is False and record["decode"]["beam_size"] == 3
    code, out, err = run_main("export", *flags, "--quantize", "float16")
    assert code == 2 and "holds another export" in err and "--overwrite" in err and "quantize" in err
    assert os.stat(path).st_ino == before.st_ino
    # --overwrite replaces it, through a temporary file renamed into place: nothing else left in the folder (the
    # fixture's float16 file: a copy of the none file, exported over with --quantize float16 --overwrite)
    code, out, err, folder = litert["overwritten"]
    copy = litert["files"]["sat_float16"]
    assert code == 0, err
    assert read_record(copy)["quantize"] == "float16" and folder == ["sat_float16.tflite"]
    assert os.path.getsize(copy) < 0.8 * os.path.getsize(path)
    # a file this command did not write is never replaced, not even with --overwrite
    foreign = tmp_path / "foreign.tflite"
    foreign.write_bytes(b"not ours")
    flags[-1] = str(foreign)
    code, out, err = run_main("export", *flags, "--overwrite")
    assert code == 2 and "did not write" in err and foreign.read_bytes() == b"not ours"
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err


@pytest.mark.parametrize("extra, says", [
    (["--output", "{model}/caption.tflite"], "inside the model folder"),
    (["--output", "{tmp}"], "is a folder"),
    (["--output", "{tmp}/x.tflite", "--set", "decode.method=sample"], "decode.method=sample"),
    (["--output", "{tmp}/x.tflite", "--format", "savedmodel"], "--quantize applies to --format litert only"),
])
def test_refusals_are_one_line_and_write_nothing(extra, says, trained_model_dir, tmp_path):
    extra = [e.format(model=trained_model_dir, tmp=tmp_path) for e in extra]
    if "savedmodel" not in extra:
        extra = ["--format", "litert", *extra]
    else:
        extra = [*extra, "--quantize", "dynamic_int8"]
    before = sorted(os.listdir(trained_model_dir))
    code, out, err = run_main("export", "--model-dir", trained_model_dir, *extra)
    lines = [line for line in err.strip().splitlines() if "error" in line]
    assert code == 2 and len(lines) == 1 and says in lines[0] and "Traceback" not in err, err
    assert os.listdir(tmp_path) == [] and sorted(os.listdir(trained_model_dir)) == before


def test_a_model_reading_regions_is_refused_before_any_work(tmp_path):
    from captioning.config import Config, ModelConfig
    from captioning.errors import InputError
    from captioning.inference import Captioner
    from captioning.inference.litert import export_litert
    from captioning.model import DECODERS, build_model
    from captioning.model.data_sources import data_source
    from captioning.model.folder import TrainedModel
    from captioning.vocab import RESERVED, Vocabulary

    cfg = Config()
    cfg.data.image_size, cfg.data.resize_size = 32, 36
    cfg.data.features, cfg.model = "regions", ModelConfig(decoder="attention", encoder="small_cnn",
                                                          region_feature_size=8, dropout=0.0,
                                                          options=dict(DECODERS["attention"].tiny_settings))
    model = build_model(12, cfg.model, 32, source=data_source(cfg)).build_all()
    cfg.model = model.cfg
    vocab = Vocabulary(list(RESERVED) + [f"w{i}" for i in range(8)])
    captioner = Captioner(TrainedModel(model, cfg, vocab, 0, "(untrained)", str(tmp_path / "m")))
    with pytest.raises(InputError, match=r"reading regions .*crop_and_resize\) is not a LiteRT built-in op"):
        export_litert(captioner, str(tmp_path / "r.tflite"), str(tmp_path / "m"))
    assert os.listdir(tmp_path) == []


@pytest.mark.slow
def test_the_resize_in_built_in_ops_gives_the_pipelines_pixels_in_the_interpreter(tmp_path):
    """resize_in_builtin_ops (the LiteRT graph's resize), converted and run by LiteRT's interpreter (its XNNPACK delegate on), gives squash's pixels
    bit for bit: up- and downscaled, one pixel to a camera frame, on noise and on the flat colours of the synthetic
    images, whose interpolations land on x.5 (LiteRT's RESIZE_BILINEAR was off by one on 116 of 200 of them, and the
    converter's reciprocal for a constant divisor on 221 heights of 1-1,999)."""
    import tensorflow as tf
    from ai_edge_litert.interpreter import Interpreter

    from captioning.data.reading import squash
    from captioning.data.preprocessor import resize_in_builtin_ops as pixels_resized

    sizes = (36, 299)

    @tf.function(input_signature=[tf.TensorSpec([None, None, 3], tf.uint8, name="image")], autograph=False)
    def resized(image):
        return {f"s{size}": pixels_resized(image, size) for size in sizes}

    tf.saved_model.save(tf.Module(), str(tmp_path), signatures={"serving_default": resized.get_concrete_function()})
    run = Interpreter(model_content=tf.lite.TFLiteConverter.from_saved_model(str(tmp_path)).convert()
                      ).get_signature_runner("serving_default")
    rng = np.random.default_rng(0)
    shapes = [(1, 1), (1, 5), (7, 3), (36, 36), (35, 37), (299, 346), (480, 640), (1080, 1920)] + [
        tuple(rng.integers(2, 700, 2)) for _ in range(12)]
    for height, width in shapes:
        for image in (rng.integers(0, 256, (height, width, 3), dtype=np.uint8),
                      (rng.integers(0, 4, (height, width, 3)) * 85).astype(np.uint8)):  # flat colours
            out = run(image=image)
            for size in sizes:
                expected = squash(image, size).numpy()
                np.testing.assert_array_equal(out[f"s{size}"], expected, err_msg=f"{height}x{width} -> {size}")
                np.testing.assert_array_equal(pixels_resized(tf.constant(image), size).numpy(), expected)


# ---- every decoder and encoder: converts, runs in the interpreter, captions as the Captioner (slow) ----

# each decoder and each encoder at least once (the decoders with small_cnn are the quick tests' fixture models, and
# attention, the Transformer and Up-Down come again below with other encoders); the Transformer's encoder and
# decoder stacks (its tiny settings) with Inception v3, the smallest Transformer (no encoder layer, one decoder layer:
# the tokens as the encoder gives them) over the other encoders, whose own ops are what those entries convert
ENTRIES = [("show_and_tell", "small_cnn"), ("attention", "vit"), ("transformer", "inception_v3"), ("updown", "resnet50"),
           ("transformer", "efficientnet_b0"), ("attention", "mobilenet_v2")] + [
           ("transformer", f"keras_hub:{f}") for f in ("vit", "clip", "siglip", "dinov2")]


@pytest.mark.slow
@pytest.mark.parametrize("decoder, encoder", ENTRIES, ids=[f"{d}-{e}" for d, e in ENTRIES])
def test_every_decoder_and_encoder_converts_and_captions_as_the_captioner(decoder, encoder, hub_presets):
    import tensorflow as tf
    from ai_edge_litert.interpreter import Interpreter

    from captioning.config import Config, ModelConfig
    from captioning.config.sections import DecodeConfig
    from captioning.inference import Captioner
    from captioning.inference.litert import convert
    from captioning.model import DECODERS, build_model
    from captioning.model.encoders import ENCODERS
    from captioning.model.folder import TrainedModel
    from captioning.vocab import RESERVED, Vocabulary

    name, _, family = encoder.partition(":")
    size = ENCODERS[name].tiny_image_size
    options = {**ENCODERS[name].tiny_settings, **DECODERS[decoder].tiny_settings}
    if family:
        options["encoder_preset"] = hub_presets[family]
    if decoder == "transformer" and encoder != "inception_v3":  # the smallest: its stacks convert with Inception v3
        options.update(encoder_layers=0, decoder_layers=1)  # (each layer more converts again, ~0.4 CPU s)
    cfg = Config()
    cfg.data.image_size, cfg.data.resize_size = size, size + 4
    model = build_model(12, ModelConfig(decoder=decoder, encoder=name, dropout=0.0, options=options), size,
                        seed=2).build_all()
    cfg.model = model.cfg
    vocab = Vocabulary(list(RESERVED) + [f"w{i}" for i in range(8)])
    captioner = Captioner(TrainedModel(model, cfg, vocab, 0, "(untrained)", "/nowhere"),
                          DecodeConfig(beam_size=3, max_length=6, top_k=2, block_ngrams=2))
    rng = np.random.default_rng(1)
    images = [rng.integers(0, 256, (size + 9, size + 15, 3), dtype=np.uint8) for _ in range(2)]
    expected = captioner.caption([tf.io.encode_png(i).numpy() for i in images])
    interpreter = Interpreter(model_content=convert(captioner, "none"))
    run = interpreter.get_signature_runner("serving_default")
    for image, captions in zip(images, expected):
        out = run(image=image)
        texts = [" ".join(w.decode() for w in out["words"][j, :out["lengths"][j]]) for j in range(2)]
        assert texts == [c.text for c in captions]
        np.testing.assert_allclose(out["log_probs"], [c.log_prob for c in captions], rtol=1e-3)
        assert ("attention" in out) == model.attends
