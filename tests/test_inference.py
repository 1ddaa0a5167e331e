"""What researchers do with a trained model: evaluate it, caption their own images, export it."""

import json
import math
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest
from PIL import Image

from captioning.model.layout import TokenLayout
from captioning.inference.caption import Result, gallery_html
from captioning.evaluation.evaluate import evaluate, most_frequent_caption
from captioning.evaluation.metrics import METRICS
from tests.helpers import REPO as REPO_ROOT
from tests.harness.files import LOADER
from tests.helpers import copy_model, encode, gradient, huge_jpeg, run_cli


@pytest.fixture(scope="module")
def evaluation(trained_model_dir):
    return evaluate(trained_model_dir, split="test", beam_size=2, baseline=True, progress=False)


def data_key(prepared_dir):
    """The dataset part of an evaluation's key."""
    from captioning.data.prepared import PreparedDataset

    return "data" + PreparedDataset.load(prepared_dir).identity[:8]


@pytest.mark.slow
def test_evaluate_writes_every_metric(evaluation, trained_model_dir, prepared_dir):
    key = data_key(prepared_dir)
    on_disk = json.load(open(os.path.join(trained_model_dir, "eval", f"test-step60-beam2-len20-norm0-all-{key}.json")))
    assert on_disk == json.loads(json.dumps(evaluation))
    assert set(on_disk["metrics"]) == set(METRICS) == set(on_disk["baseline"])
    assert all(math.isfinite(v) and v >= 0 for v in on_disk["metrics"].values())
    assert (on_disk["split"], on_disk["num_images"], on_disk["beam_size"], on_disk["checkpoint_step"]) == \
        ("test", 4, 2, 60)
    assert on_disk["perplexity"] == pytest.approx(math.exp(on_disk["loss"]))
    assert 1.0 < on_disk["perplexity"] < 50.0
    predictions = json.load(open(os.path.join(trained_model_dir, "eval",
                                              f"test-step60-beam2-len20-norm0-all-{key}.predictions.json")))
    from captioning.config import DataConfig
    from captioning.data.reading import references

    manifest_ids = set(references(DataConfig(dir=prepared_dir), "test"))
    assert {p["image_id"] for p in predictions} == manifest_ids
    # a model trained 60 steps says little (numerics differ between CPUs), but every caption has a word of the
    # vocabulary (<end> is never the first word), and the best is the first of the image's captions
    vocab = set(open(os.path.join(trained_model_dir, "vocab.txt"), encoding="utf-8").read().split())
    assert all(set(p) == {"image_id", "caption", "captions"} and p["captions"] == [p["caption"]] for p in predictions)
    assert all(p["caption"].split() and set(p["caption"].split()) <= vocab for p in predictions)
    events = os.listdir(os.path.join(trained_model_dir, "logs", "eval_test"))
    assert any(name.startswith("events.out.tfevents") for name in events)


def test_baseline_is_the_most_frequent_training_caption():
    assert most_frequent_caption(["A red circle.", "a red circle", "A blue square", "a  RED circle!"]) == \
        "a red circle"
    assert most_frequent_caption(["b thing", "a thing"]) == "a thing"  # ties: alphabetical


@pytest.mark.slow
def test_evaluate_max_images_and_cli(trained_model_dir, prepared_dir):
    result = run_cli("evaluate", "--model-dir", trained_model_dir, "--split", "val", "--max-images", "2",
                     "--beam-size", "1")
    assert result.returncode == 0, result.stderr[-2000:]
    assert "val: 2 images" in result.stdout and "CIDEr" in result.stdout
    saved = json.load(open(os.path.join(trained_model_dir, "eval",
                                        f"val-step60-beam1-len20-norm0-first2-{data_key(prepared_dir)}.json")))
    assert (saved["split"], saved["num_images"], saved["beam_size"]) == ("val", 2, 1)


@pytest.fixture(scope="module")
def user_images(tmp_path_factory, shapes_dir):
    """A folder as a user has it: JPEGs, a 20000x10000 JPEG (past Pillow's decompression-bomb limit), a
    PNG, a PNG with alpha, a WebP, an animated GIF, a broken and a truncated .jpg, a text file named .png,
    an empty file, and a file whose name needs HTML escaping."""
    folder = tmp_path_factory.mktemp("photos")
    shapes = sorted(os.listdir(os.path.join(shapes_dir, "images")))
    for i, name in enumerate(shapes[:2]):
        with open(os.path.join(shapes_dir, "images", name), "rb") as src:
            (folder / f"photo{i}.jpg").write_bytes(src.read())
    (folder / "drawing.png").write_bytes(encode(gradient(size=(90, 60)), "PNG"))
    translucent = gradient(size=(64, 48)).convert("RGBA")
    translucent.putalpha(Image.linear_gradient("L").resize((64, 48)))
    (folder / "alpha.png").write_bytes(encode(translucent, "PNG"))
    (folder / "modern.webp").write_bytes(encode(gradient(size=(70, 50)), "WEBP"))
    frames = [gradient("P", size=(40, 40)), gradient("P", size=(40, 40)).rotate(90)]
    (folder / "anim.gif").write_bytes(encode(frames[0], "GIF", save_all=True, append_images=frames[1:],
                                             duration=100, loop=0))
    (folder / "huge.jpg").write_bytes(huge_jpeg(20000, 10000))
    (folder / '<b>"evil" & co.png').write_bytes(encode(gradient(size=(30, 30)), "PNG"))
    (folder / "broken.jpg").write_bytes(b"\xff\xd8\xff\xe0 not really a jpeg")
    noisy = encode(Image.fromarray(np.random.default_rng(0).integers(0, 255, (64, 64, 3), dtype=np.uint8)), "JPEG")
    (folder / "truncated.jpg").write_bytes(noisy[: len(noisy) // 2])
    (folder / "notes.png").write_bytes(b"just some text")
    (folder / "empty.jpg").write_bytes(b"")
    (folder / "README.txt").write_text("not an image extension: skipped when a folder is given")
    return folder


def test_caption_a_folder_with_broken_files(trained_model_dir, user_images, tmp_path):
    gallery = tmp_path / "gallery.html"
    # the folder, and a file named on its own (taken whatever its extension)
    result = run_cli("caption", "--model-dir", trained_model_dir, str(user_images), str(user_images / "README.txt"),
                     "--json", "--top-k", "2", "--html", str(gallery))
    assert result.returncode == 1  # some files failed, the rest were captioned
    lines = [json.loads(line) for line in result.stdout.splitlines()]
    captioned = [os.path.basename(x["image"]) for x in lines]
    good = {"photo0.jpg", "photo1.jpg", "drawing.png", "alpha.png", "modern.webp", "anim.gif", "huge.jpg",
            '<b>"evil" & co.png'}
    assert sorted(captioned) == sorted(good)  # each once, the huge JPEG downscaled and captioned
    for x in lines:
        assert len(x["captions"]) == 2 and x["captions"][0]["log_prob"] >= x["captions"][1]["log_prob"]
        assert all(isinstance(c["caption"], str) for c in x["captions"])  # (a tiny model's may be empty)
        assert x["captions"][0]["caption"] != x["captions"][1]["caption"]  # two different captions
    errors = [line for line in result.stderr.splitlines() if "error:" in line]
    assert all(line.startswith("captioning caption: error: ") for line in errors)
    reasons = {line.split(": ")[2].rsplit("/", 1)[-1]: line.split(": ", 3)[3] for line in errors}
    assert len(errors) == len(reasons) == 5  # one line per bad file, naming it
    assert set(reasons) == {"broken.jpg", "truncated.jpg", "notes.png", "empty.jpg", "README.txt"}
    assert reasons["empty.jpg"] == "empty file" and reasons["truncated.jpg"].startswith("corrupt image")
    assert reasons["README.txt"] == reasons["notes.png"] == "not an image (unrecognised format)"
    assert "Traceback" not in result.stderr
    page = gallery.read_text()
    assert "&lt;b&gt;&quot;evil&quot; &amp; co.png" in page and "<b>" + '"evil' not in page
    assert 'alt="&lt;b&gt;&quot;evil&quot; &amp; co.png"' in page  # the attribute cannot be closed early
    assert page.count("<figure>") == 13 and page.count("data:image/jpeg;base64,") == 8


def test_gallery_escapes_every_caption_and_name():
    png = encode(gradient(size=(8, 8)), "PNG")
    page = gallery_html([Result("dir/<img src=x onerror=alert(1)>.png", [("a <script>alert('x')</script> & cat", -1.5)],
                                data=png),
                         Result("bad\"quote'.jpg", error="corrupt <image>")], title="<title>")
    assert "<script>" not in page and "onerror=alert(1)>" not in page
    assert "&lt;script&gt;alert(&#x27;x&#x27;)&lt;/script&gt; &amp; cat" in page
    assert "corrupt &lt;image&gt;" in page and "bad&quot;quote&#x27;.jpg" in page
    assert "&lt;title&gt;" in page


def test_the_gallery_of_a_region_model_outlines_and_names_the_region_each_word_attended_to_most():
    """Over regions, each word's picture is the image with the region of its largest weight outlined in red,
    and says which (``data-region``: the index in the image's regions); the legend says so. Over a grid,
    pictures are lit where the model looked and name no region."""
    import base64
    import io
    import re

    from captioning.inference.captioner import Caption

    crop = np.full((32, 32, 3), 128, np.uint8)
    boxes = np.array([[0.0, 0.0, 0.5, 0.5], [0.5, 0.25, 1.0, 0.75], [0.25, 0.5, 0.75, 1.0], [0, 0, 1, 1]], np.float32)
    weights = np.array([[0.1, 0.6, 0.2, 0.1], [0.05, 0.05, 0.8, 0.1], [0.7, 0.1, 0.1, 0.1], [0.2, 0.1, 0.1, 0.6]],
                       np.float32)
    png = encode(gradient(size=(8, 8)), "PNG")
    regions = Result("regions.png", [Caption("a red big circle", -2.0, weights, crop, boxes)], data=png, attends=True)
    page = gallery_html([regions])
    tiles = re.findall(r'<img src="data:image/png;base64,([^"]+)" alt="attention for ([^"]*)" data-region="(\d+)">',
                       page)
    assert [(word, int(k)) for _, word, k in tiles] == [("a", 1), ("red", 2), ("big", 0), ("circle", 3)]
    for (picture, _, k), w in zip(tiles, weights):
        assert int(k) == int(np.argmax(w))
        pixels = np.asarray(Image.open(io.BytesIO(base64.b64decode(picture))).convert("RGB")).astype(int)
        red = np.argwhere((pixels[..., 0] > 200) & (pixels[..., 1] < 60) & (pixels[..., 2] < 60))
        assert len(red) > 0
        (top, left), (bottom, right) = red.min(axis=0), red.max(axis=0)  # the outline's extent, in 72 px
        np.testing.assert_allclose([left, top, right, bottom], boxes[int(k)] * 71, atol=2)
    assert "the box outlined in red is the region that word attended to most" in page
    assert "lit where it looked" not in page
    grid = Result("grid.png", [Caption("a circle", -1.0, weights[:2], crop)], data=png, attends=True,
                  layout=TokenLayout(2, 2))
    page = gallery_html([grid])
    assert page.count('alt="attention for') == 2 and "data-region" not in page
    assert "lit where it looked" in page and "outlined" not in page and "class token" not in page


def tiles_of(page):
    import base64
    import io
    import re

    return [np.asarray(Image.open(io.BytesIO(base64.b64decode(p))).convert("RGB")).astype(int)
            for p in re.findall(r'<img src="data:image/png;base64,([^"]+)" alt="attention for', page)]


def test_the_gallery_draws_a_class_token_apart_and_tokens_without_a_layout_as_bars():
    """A ViT's tokens: a class token, then 2 x 2 patches. A word's picture lights the patches and shows the class
    token's share as a bar along its foot (its width the share); tokens without a layout are a bar each."""
    from captioning.inference.captioner import Caption

    crop = np.full((32, 32, 3), 128, np.uint8)
    png = encode(gradient(size=(8, 8)), "PNG")
    weights = np.array([[0.5, 0.5, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0, 1.0]], np.float32)
    vit = Result("vit.png", [Caption("a circle", -1.0, weights, crop)], data=png, attends=True,
                 layout=TokenLayout(2, 2, prefix=1))
    page = gallery_html([vit])
    first, second = tiles_of(page)
    foot = first[-2]  # the bar's row: half of it lit (the class token had half the weight)
    lit = np.flatnonzero((foot[:, 0] > 200) & (foot[:, 1] > 150))
    assert 0.45 * 72 <= len(lit) <= 0.55 * 72 and lit[0] == 0
    assert first[10, 10].mean() > first[60, 60].mean() + 20  # the top-left patch had the other half
    assert not ((second[-2, :, 0] > 200) & (second[-2, :, 1] > 150)).any()  # no weight on the class token
    assert second[60, 60].mean() > second[10, 10].mean() + 20  # all of it on the bottom-right patch
    assert "no place in the image (a class token)" in page

    bars = Result("bars.png", [Caption("a circle", -1.0, np.array([[0.5, 0.25, 0.25]], np.float32), crop)],
                  data=png, attends=True, layout=None)
    page = gallery_html([bars])
    (picture,) = tiles_of(page)[:1]
    lit = (picture[..., 0] > 200) & (picture[..., 1] > 150)
    heights = [lit[:, c].sum() for c in (10, 36, 60)]  # one column in each of the three bars
    assert heights[0] == 72 and abs(heights[1] - 36) <= 1 and abs(heights[2] - 36) <= 1
    assert "a bar per token" in page


@pytest.fixture(scope="module")
def exported(trained_model_dir, tmp_path_factory):
    """``export --top-k 2`` of the trained model, once for the two tests below (read-only: a test that exports
    over it works on a copy)."""
    export_dir = str(tmp_path_factory.mktemp("exported") / "export")
    result = run_cli("export", "--model-dir", trained_model_dir, "--output", export_dir, "--top-k", "2")
    assert result.returncode == 0, result.stderr[-2000:]
    return export_dir


@pytest.mark.slow
def test_export_round_trip_in_a_process_without_the_project(trained_model_dir, exported, user_images, tmp_path):
    export_dir = exported
    assert os.path.exists(os.path.join(export_dir, "saved_model.pb"))
    again = run_cli("export", "--model-dir", trained_model_dir, "--output", export_dir)  # other settings
    assert again.returncode == 2 and "--overwrite" in again.stderr

    paths = [str(user_images / n) for n in ("photo0.jpg", "photo1.jpg", "drawing.png")]
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["TF_CPP_MIN_LOG_LEVEL"] = "2"
    loaded = subprocess.run([sys.executable, "-c", LOADER, export_dir, *paths], capture_output=True, text=True,
                            cwd=str(tmp_path), env=env, timeout=300)
    assert loaded.returncode == 0, loaded.stderr[-3000:]
    served = json.loads(loaded.stdout.splitlines()[-1])

    cli = run_cli("caption", "--model-dir", trained_model_dir, *paths, "--json", "--top-k", "2")
    assert cli.returncode == 0, cli.stderr[-2000:]
    captioned = [json.loads(line) for line in cli.stdout.splitlines()]
    for s, c in zip(served, captioned):
        assert s["captions"] == [x["caption"] for x in c["captions"]]
        assert s["log_probs"] == pytest.approx([x["log_prob"] for x in c["captions"]], abs=1e-4)


def test_export_never_replaces_what_it_did_not_write(trained_model_dir, tmp_path):
    """--overwrite replaces only an earlier export: not the model folder, a folder above it, the working
    directory, a folder of a user's files, or a file; those are refused in one line, before any work."""
    model_dir = tmp_path / "model"
    copy_model(trained_model_dir, model_dir)
    home = tmp_path / "home"
    (home / "sub").mkdir(parents=True)
    (home / "thesis.tex").write_text("\\documentclass{article}")
    (home / "sub" / "data.csv").write_text("a,b\n1,2\n")
    (home / "notes.txt").write_text("a file, not a folder")
    before = {p: sorted(os.listdir(p)) for p in (model_dir, home, home / "sub")}
    cases = [(str(model_dir), str(REPO_ROOT), "is the model folder or a folder above it"),
             (str(tmp_path), str(REPO_ROOT), "is the model folder or a folder above it"),
             (".", str(home), "is the working directory or a folder above it"),
             ("..", str(home / "sub"), "is the working directory or a folder above it"),
             (str(home / "sub"), str(REPO_ROOT), "holds other files, not an export of this command"),
             (str(home / "notes.txt"), str(REPO_ROOT), "is a file; export writes a folder"),
             (str(home / "no" / "such" / "place"), str(REPO_ROOT), "does not exist")]
    for output, cwd, message in cases:
        result = run_cli("export", "--model-dir", str(model_dir), "--output", output, "--overwrite", cwd=cwd)
        assert result.returncode == 2, (output, result.stderr[-2000:])
        lines = result.stderr.strip().splitlines()
        assert message in lines[-1] and "Traceback" not in result.stderr, (output, result.stderr[-2000:])
        assert {p: sorted(os.listdir(p)) for p in before} == before  # nothing deleted, nothing written


@pytest.mark.slow
def test_export_again_is_a_no_op_and_overwrite_swaps_in_a_complete_export(trained_model_dir, exported, tmp_path):
    """On a copy of the module's export (--top-k 2)."""
    out = tmp_path / "export"
    shutil.copytree(exported, out)
    marker = json.loads((out / "captioning_export.json").read_text())
    assert marker["step"] == 60 and marker["decode"]["beam_size"] == 3 and marker["decode"]["top_k"] == 2
    stamp = os.stat(out / "saved_model.pb").st_mtime_ns
    again = run_cli("export", "--model-dir", trained_model_dir, "--output", str(out), "--top-k", "2")  # the same
    assert again.returncode == 0 and os.stat(out / "saved_model.pb").st_mtime_ns == stamp  # checkpoint, settings
    other = run_cli("export", "--model-dir", trained_model_dir, "--output", str(out), "--beam-size", "2",
                    "--overwrite")
    assert other.returncode == 0, other.stderr[-2000:]
    assert json.loads((out / "captioning_export.json").read_text())["decode"]["beam_size"] == 2
    assert sorted(os.listdir(tmp_path)) == ["export"]  # no temporary or old folder left beside it


@pytest.mark.slow
def test_decoding_follows_the_models_decode_section_and_flags_override_it(trained_model_dir, user_images, tmp_path):
    """config.yaml's decode: section is how the model decodes; a flag overrides one setting for one call.
    An impossible combination is named by parameter in the library and by flag on the command line."""
    import yaml

    from captioning import inference
    from captioning.config import DecodeConfig
    from captioning.errors import InputError

    model_dir = tmp_path / "model"
    copy_model(trained_model_dir, model_dir)
    config = yaml.safe_load((model_dir / "config.yaml").read_text())
    assert config["decode"] == {"beam_size": 3, "max_length": 20, "length_normalization": 0.0, "top_k": 1,
                                "method": "beam", "length_penalty": "avg", "beam_groups": 1, "diversity": 0.0,
                                "block_ngrams": 0, "bad_endings": [], "temperature": 1.0, "sample_top_k": 0,
                                "sample_top_p": 1.0, "seed": 0, "jit_compile": False}
    config["decode"].update(beam_size=2, top_k=2)
    (model_dir / "config.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
    photo = str(user_images / "photo0.jpg")

    def captions(*flags):
        result = run_cli("caption", "--model-dir", str(model_dir), photo, "--json", *flags)
        assert result.returncode == 0, result.stderr[-2000:]
        return json.loads(result.stdout.splitlines()[0])["captions"]

    assert len(captions()) == 2  # the model's top_k, no flag given
    assert len(captions("--top-k", "1")) == 1
    refused = run_cli("caption", "--model-dir", str(model_dir), photo, "--top-k", "3")
    assert refused.returncode == 2
    assert refused.stderr.strip().splitlines()[-1] == (
        "captioning caption: error: --top-k must be between 1 and --beam-size (2), got 3")
    with pytest.raises(InputError, match=r"^`top_k` must be between 1 and `beam_size` \(2\), got 3$") as e:
        inference.Captioner(inference.load(str(model_dir)), DecodeConfig(beam_size=2, top_k=3))
    assert {"top_k", "beam_size"} <= set(e.value.params)
    # --set decode.KEY=VALUE: any decoding setting for one call; sampling is seeded by the image's bytes
    sampled = captions("--set", "decode.method=sample", "--set", "decode.top_k=4", "--set", "decode.temperature=1.5")
    assert len(sampled) == 4 and sampled == captions("--set", "decode.method=sample", "--set", "decode.top_k=4",
                                                     "--set", "decode.temperature=1.5")
    assert [c["log_prob"] for c in sampled] == sorted((c["log_prob"] for c in sampled), reverse=True)
    blocked = captions("--set", "decode.block_ngrams=1", "--set", "decode.bad_endings=[english]")
    for c in blocked:
        words = c["caption"].split()
        assert all(a != b for a, b in zip(words, words[1:])) and (not words or words[-1] not in ("a", "the"))
    refused = run_cli("caption", "--model-dir", str(model_dir), photo, "--set", "train.steps=3")
    assert refused.returncode == 2 and "must look like decode.KEY=VALUE" in refused.stderr


@pytest.mark.slow  # 18 s alone (2026-11-27, a slow VM), its fixture 5 s more: two evaluations
def test_evaluate_with_other_decoding_settings_is_another_evaluation(trained_model_dir, tmp_path):
    """--set decode.KEY=VALUE in evaluate: the settings are kept in the result, whose key they change (a plain
    beam search result is never replaced by a sampled one)."""
    from captioning.evaluation.evaluate import evaluate

    model_dir = tmp_path / "model"
    copy_model(trained_model_dir, model_dir)
    plain = evaluate(str(model_dir), split="test", max_images=2, progress=False)
    sampled = evaluate(str(model_dir), split="test", max_images=2, progress=False,
                       decode_overrides=("decode.method=sample", "decode.top_k=3", "decode.seed=4"))
    assert plain.decode["method"] == "beam" and sampled.decode == {**plain.decode, "method": "sample", "top_k": 3,
                                                                   "seed": 4, "beam_size": None}  # no beam ran
    names = sorted(n for n in os.listdir(model_dir / "eval")
                   if n.startswith("test-") and n.endswith("first2-data" + plain.dataset[:8] + ".json"))
    assert len(names) == 2 and sum("-sample-" in n for n in names) == 1, names
    again = evaluate(str(model_dir), split="test", max_images=2, progress=False,
                     decode_overrides=("decode.method=sample", "decode.top_k=3", "decode.seed=4"))
    assert again == sampled  # the stored result: same seed, same captions, nothing decoded again
    # diversity: over the best captions always; among each image's captions when there are several
    assert set(plain.diversity) == {"distinct_1", "distinct_2", "distinct_2_per_bigram", "vocabulary_usage",
                                    "words_used", "novel_captions"}
    # (a model trained 60 steps may say nothing on another CPU: then there is no n-gram to count, None)
    plain_name = next(n for n in names if "-sample-" not in n)
    best = json.load(open(model_dir / "eval" / plain_name.replace(".json", ".predictions.json")))
    words = [w for p in best for w in p["caption"].split()]
    assert plain.diversity["distinct_1"] == (pytest.approx(len(set(words)) / len(words)) if words else None)
    assert 0 <= plain.diversity["novel_captions"] <= 1
    assert sampled.diversity["captions_per_image"] == 3 and 0 <= sampled.diversity["mbleu_4"] <= 1
    assert sampled.diversity["local_distinct_1"] is None or 0 < sampled.diversity["local_distinct_1"] <= 1
    # three beams per image: the best is scored as before, the three count among each image's captions
    beams = evaluate(str(model_dir), split="test", max_images=2, progress=False, decode_overrides=("decode.top_k=3",))
    assert beams.metrics == plain.metrics and beams.diversity["captions_per_image"] == 3 and "mbleu_4" in beams.diversity
    assert len([n for n in os.listdir(model_dir / "eval")
                if n.startswith("test-") and n.endswith("first2-data" + plain.dataset[:8] + ".json")]) == 3


def test_a_decoding_size_beyond_its_bound_is_refused_before_anything_loads(tmp_path):
    """caption --set decode.beam_size=100000 was killed for memory: one line, exit 2, before the model folder
    (here, not even a model folder) or the images are read; the flags too (argparse, exit 2)."""
    for args in (["--set", "decode.beam_size=100000"], ["--beam-size", "51"], ["--max-length", "101"],
                 ["--set", "decode.top_k=51"]):
        for command in (["caption", str(tmp_path / "nope.jpg")], ["evaluate"], ["export", "--output", tmp_path / "x"]):
            result = run_cli(*command, "--model-dir", tmp_path / "nothing", *args)
            assert result.returncode == 2, (command, args, result.stderr)
            lines = result.stderr.strip().splitlines()
            assert len(lines) == 1 and ("in [1, 50]" in lines[0] or "in [1, 100]" in lines[0]), lines
            assert "does not exist" not in lines[0]


def test_text_output_a_missing_path_a_misspelt_bad_ending_and_settings_that_do_nothing(trained_model_dir,
                                                                                       user_images):
    """caption's text output (the image's path, then its caption) from the call whose settings do nothing with the
    others (one warning line each); a missing path and a misspelt bad ending are one line, exit 2."""
    photo = str(user_images / "photo0.jpg")
    missing = run_cli("caption", "--model-dir", trained_model_dir, str(user_images / "nope.jpg"))
    assert missing.returncode == 2 and "does not exist" in missing.stderr
    refused = run_cli("caption", "--model-dir", trained_model_dir, photo, "--set", "decode.bad_endings=[englsh]")
    assert refused.returncode == 2 and refused.stdout == ""
    assert refused.stderr.strip().splitlines()[-1] == (
        "captioning caption: error: decode.bad_endings: 'englsh' is not a word of the model's vocabulary nor a list "
        "(english); did you mean english?")
    result = run_cli("caption", "--model-dir", trained_model_dir, photo, "--length-normalization", "0.7",
                     "--set", "decode.length_penalty=none", "--set", "decode.temperature=0.5",
                     "--set", "decode.diversity=0.5", "--set", "decode.bad_endings=[english,circle]")
    assert result.returncode == 0
    out = result.stdout.splitlines()
    assert out[0].endswith("photo0.jpg") and len(out) == 2 and out[1].strip()
    warned = [line.split(" ", 1)[1] for line in result.stderr.splitlines() if "does nothing" in line]
    assert [line.split(" ")[0] for line in warned] == ["decode.temperature", "decode.diversity",
                                                       "decode.length_normalization"]


@pytest.mark.slow  # a trained prefix_lm model captioned four ways and exported: about 10 CPU s
def test_decode_jit_compile_captions_as_greedy_decoding_without_it(trained_prefix_lm_dir, user_images, tmp_path):
    """``decode.jit_compile``: the decoder's initial state and the greedy search, one program XLA compiles, give the
    captions and log-probabilities of greedy decoding without it, for a batch of three and of one, on ``caption``'s
    path, the evaluation's and the SavedModel's (which calls the compiled program); beam search with it is refused
    in one line. A language model reading its prefix: the state (the LM's pass over the prefix, the cache it
    reserves) is compiled with the search; every decoder's search alone, attention weights included, is the decoder
    contract's (tests/harness/decoder_contract.py, check_beam_search)."""
    import tensorflow as tf

    from captioning.config import DecodeConfig
    from captioning.inference import Captioner, load
    from captioning.inference.export import export

    model_dir = trained_prefix_lm_dir
    refused = run_cli("caption", "--model-dir", model_dir, str(user_images / "photo0.jpg"),
                      "--set", "decode.jit_compile=true")  # the model's decode.method: beam
    assert refused.returncode == 2 and refused.stderr.strip().splitlines()[-1].startswith(
        "captioning caption: error: decode.jit_compile compiles greedy decoding only")

    images = [(user_images / n).read_bytes() for n in ("photo0.jpg", "photo1.jpg", "drawing.png")]
    trained = load(model_dir)
    plain, xla = (Captioner(trained, DecodeConfig(method="greedy", max_length=8, jit_compile=jit)) for jit in (0, 1))
    for batch in (images, images[2:]):
        a, b = plain.caption(batch), xla.caption(batch)
        assert [c[0].text for c in a] == [c[0].text for c in b] and all(c[0].text for c in a)
        np.testing.assert_allclose([c[0].log_prob for c in a], [c[0].log_prob for c in b], atol=1e-4)
    crops = plain.decode(tf.constant(images))["images"]
    # evaluate's path: decode_batch in a tf.function, its batch keyed by image ids; traced for batches of any size,
    # it calls the compiled search caption's path traced (its program for 3 images: not compiled again)
    batch = {"image": crops, "image_id": tf.constant([7, 8, 9], tf.int64)}
    spec = [tf.nest.map_structure(lambda t: tf.TensorSpec([None, *t.shape[1:]], t.dtype), batch)]
    batches = [tf.function(c.decode_batch, input_signature=spec, autograph=False)(batch) for c in (plain, xla)]
    np.testing.assert_array_equal(batches[0]["ids"].numpy(), batches[1]["ids"].numpy())
    out = export(xla, str(tmp_path / "export"), model_dir)
    served = tf.saved_model.load(out).signatures["serving_default"](images=tf.constant(images))
    assert [row[0].decode() for row in served["captions"].numpy()] == [c[0].text for c in plain.caption(images)]
