"""What a new user types that the happy path never does: numbers that mean nothing (nan, 0, -1), outputs
that cannot be written, files of the wrong kind. Each is one line on stderr, exit code 2, no traceback,
no temporary file left behind, and nothing done before the check."""

import json
import os
import shutil

import pytest

from tests.helpers import coco_split_args, run_cli


def assert_one_line(result, command, *fragments):
    assert result.returncode == 2, (result.returncode, result.stderr[-2000:])
    lines = result.stderr.strip().splitlines()
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    assert lines and lines[-1].startswith(f"captioning {command}: error:"), result.stderr[-2000:]
    assert len([line for line in lines if "error:" in line]) == 1, result.stderr[-2000:]
    for fragment in fragments:
        assert fragment in lines[-1], lines[-1]


@pytest.mark.parametrize("args, flag", [
    (["evaluate", "--model-dir", "m", "--length-normalization", "nan"], "--length-normalization"),
    (["evaluate", "--model-dir", "m", "--length-normalization", "inf"], "--length-normalization"),
    (["evaluate", "--model-dir", "m", "--length-normalization", "-1"], "--length-normalization"),
    (["evaluate", "--model-dir", "m", "--batch-size", "0"], "--batch-size"),
    (["evaluate", "--model-dir", "m", "--beam-size", "0"], "--beam-size"),
    (["evaluate", "--model-dir", "m", "--max-length", "-3"], "--max-length"),
    (["evaluate", "--model-dir", "m", "--max-images", "0"], "--max-images"),
    (["caption", "x.jpg", "--model-dir", "m", "--top-k", "0"], "--top-k"),
    (["caption", "x.jpg", "--model-dir", "m", "--length-normalization", "nan"], "--length-normalization"),
    (["export", "--model-dir", "m", "--output", "o", "--beam-size", "0"], "--beam-size"),
    (["prepare", "--output-dir", "o", "--workers", "0"], "--workers"),
    (["prepare", "--output-dir", "o", "--images-per-shard", "-5"], "--images-per-shard"),
    (["prepare", "--output-dir", "o", "--min-word-count", "0"], "--min-word-count"),
    (["prepare", "--output-dir", "o", "--shorter-side", "3"], "--shorter-side"),
    (["synth", "--output-dir", "o", "--num-images", "2"], "--num-images"),
    (["synth", "--output-dir", "o", "--seed", "-1"], "--seed"),
    (["benchmark", "input", "--rounds", "0"], "--rounds"),
    (["benchmark", "train", "--config", "c.yaml", "--steps", "0"], "--steps"),
    (["benchmark", "train", "--config", "c.yaml", "--warmup", "-1"], "--warmup"),
    (["benchmark", "decode", "--batch-size", "0"], "--batch-size"),
    (["benchmark", "decode", "--beam-size", "nan"], "--beam-size"),
])
def test_numbers_that_mean_nothing_are_one_line_errors(args, flag, tmp_path):
    result = run_cli(*args, cwd=str(tmp_path))
    assert_one_line(result, args[0], flag)
    assert len(result.stderr.strip().splitlines()) == 1
    assert os.listdir(tmp_path) == []  # nothing was done


@pytest.fixture(params=["file", "under_a_file", "proc", "sys", "dev_null"])
def bad_output_dir(request, tmp_path):
    (tmp_path / "a_file").write_text("x")
    return {"file": str(tmp_path / "a_file"), "under_a_file": str(tmp_path / "a_file" / "out"),
            "proc": "/proc/captioning-out", "sys": "/sys/captioning-out",
            "dev_null": "/dev/null/captioning-out"}[request.param]


def test_synth_and_prepare_refuse_an_output_dir_they_cannot_write(bad_output_dir, shapes_dir, tmp_path):
    assert_one_line(run_cli("synth", "--output-dir", bad_output_dir, "--num-images", "3"), "synth", "--output-dir")
    split_args = [f"--split={a}" for a in coco_split_args(shapes_dir)]
    assert_one_line(run_cli("prepare", "--output-dir", bad_output_dir, "--workers", "1", *split_args), "prepare",
                    "--output-dir")
    assert sorted(os.listdir(tmp_path)) == ["a_file"]  # no *.tmp* left anywhere


def test_prepare_vocab_that_is_not_utf8(shapes_dir, tmp_path):
    vocab = tmp_path / "vocab.txt"
    vocab.write_bytes(b"<pad>\n<start>\n<end>\n<unk>\n\xff\xfe caf\xe9\n")
    result = run_cli("prepare", "--output-dir", str(tmp_path / "o"), "--workers", "1", "--vocab", str(vocab),
                     *(f"--split={a}" for a in coco_split_args(shapes_dir)))
    assert_one_line(result, "prepare", "is not UTF-8 text")


@pytest.fixture
def score_files(shapes_dir, tmp_path):
    annotations = os.path.join(shapes_dir, "annotations", "captions_test.json")
    ids = [image["id"] for image in json.load(open(annotations))["images"]]
    good = tmp_path / "results.json"
    good.write_text(json.dumps([{"image_id": i, "caption": "a red circle"} for i in ids]))
    return annotations, str(good), ids


@pytest.mark.parametrize("case, message", [
    ("empty", "holds no captions"),
    ("number", "is not a string"),
    ("latin1", "is not UTF-8 text"),
    ("swapped", "look swapped"),
    ("json_is_a_folder", "is a folder; give a file name"),
    ("json_under_a_file", "is a file, not a folder"),
])
def test_score_refuses_bad_files_before_scoring(case, message, score_files, tmp_path):
    annotations, results, ids = score_files
    args = ["score", "--annotations", annotations, "--results", results]
    if case == "empty":
        (tmp_path / "results.json").write_text("[]")
    elif case == "number":
        (tmp_path / "results.json").write_text(json.dumps([{"image_id": ids[0], "caption": 5}]))
    elif case == "latin1":
        (tmp_path / "results.json").write_bytes(b'[{"image_id": 1, "caption": "caf\xe9"}]')
    elif case == "swapped":
        args = ["score", "--annotations", results, "--results", annotations]
    elif case == "json_is_a_folder":
        args += ["--json", str(tmp_path)]
    else:
        args += ["--json", str(tmp_path / "results.json" / "scores.json")]
    result = run_cli(*args)
    assert_one_line(result, "score", message)
    assert "PTBTokenizer" not in result.stderr and "scoring" not in result.stderr  # refused before any scorer
    assert sorted(os.listdir(tmp_path)) == ["results.json"]


def test_caption_html_that_cannot_be_written_is_refused_before_the_model_loads(trained_model_dir, shapes_dir,
                                                                                tmp_path):
    image = os.path.join(shapes_dir, "images", sorted(os.listdir(os.path.join(shapes_dir, "images")))[0])
    (tmp_path / "a_file").write_text("x")
    for html, message in ((tmp_path, "is a folder"), (tmp_path / "a_file" / "g.html", "is a file, not a folder")):
        result = run_cli("caption", "--model-dir", trained_model_dir, image, "--html", str(html))
        assert_one_line(result, "caption", "--html", message)
        assert "restored" not in result.stderr and not result.stdout
    assert sorted(os.listdir(tmp_path)) == ["a_file"]


def test_each_caption_path_stands_alone_and_the_gallery_tells_files_apart(trained_model_dir, shapes_dir,
                                                                          tmp_path):
    images = sorted(os.listdir(os.path.join(shapes_dir, "images")))[:2]
    for folder in ("a", "b"):  # two files with the same name in different folders
        os.makedirs(tmp_path / folder)
        shutil.copy(os.path.join(shapes_dir, "images", images[0]), tmp_path / folder / "photo.jpg")
    paths = [str(tmp_path / "nope.jpg"), str(tmp_path / "a" / "photo.jpg"), str(tmp_path / "b" / "photo.jpg")]
    result = run_cli("caption", "--model-dir", trained_model_dir, *paths, "--html", str(tmp_path / "g.html"))
    assert result.returncode == 1, result.stderr[-2000:]  # finished, with an error for one input
    errors = [line for line in result.stderr.splitlines() if "error:" in line]
    assert errors == [f"captioning caption: error: {paths[0]}: does not exist"]
    assert paths[1] in result.stdout and paths[2] in result.stdout  # both good files were captioned
    page = (tmp_path / "g.html").read_text()
    assert paths[1] in page and paths[2] in page  # the full paths, not two "photo.jpg"
    assert "log-probability" in page  # the numbers are explained


def test_synth_overwrite_with_fewer_images_leaves_no_stale_ones(tmp_path):
    out = tmp_path / "s"
    assert run_cli("synth", "--output-dir", str(out), "--num-images", "12").returncode == 0
    assert len(os.listdir(out / "images")) == 12
    (out / "images" / "my_notes.txt").write_text("not ours")
    assert run_cli("synth", "--output-dir", str(out), "--num-images", "5", "--overwrite").returncode == 0
    listed = {image["file_name"] for split in ("train", "val", "test")
              for image in json.load(open(out / "annotations" / f"captions_{split}.json"))["images"]}
    assert set(os.listdir(out / "images")) == listed | {"my_notes.txt"} and len(listed) == 5


def test_prepare_without_any_usable_image_leaves_nothing_behind(shapes_dir, tmp_path):
    images = tmp_path / "images"
    images.mkdir()
    args = ["prepare", "--output-dir", str(tmp_path / "o"), "--workers", "1",
            f"--split=train={shapes_dir}/annotations/captions_train.json:{images}"]
    # no image file at all (a wrong images folder): refused before anything is written
    assert_one_line(run_cli(*args), "prepare", "none of its 32 image files exists")
    assert os.listdir(tmp_path / "o") == []
    # every image file there but none readable: refused at the end, and what it wrote is removed
    for name in os.listdir(os.path.join(shapes_dir, "images")):
        (images / name).write_bytes(b"not a jpeg")
    assert_one_line(run_cli(*args), "prepare", "no usable image is left")
    assert os.listdir(tmp_path / "o") == []  # no 0-record shard, no vocab.txt, no .partial/
    # once the images are fixed the same command works, without --resume
    shutil.rmtree(images)
    shutil.copytree(os.path.join(shapes_dir, "images"), images)
    result = run_cli(*args)
    assert result.returncode == 0, result.stderr[-2000:]


def test_a_pipe_or_a_device_is_not_an_image(trained_model_dir, shapes_dir, tmp_path):
    """A FIFO would block the reader forever and /dev/zero never ends: both are refused before a byte is read."""
    fifo = tmp_path / "fifo.jpg"
    os.mkfifo(fifo)
    good = os.path.join(shapes_dir, "images", sorted(os.listdir(os.path.join(shapes_dir, "images")))[0])
    result = run_cli("caption", "--model-dir", trained_model_dir, str(fifo), "/dev/zero", good, timeout=120)
    assert result.returncode == 1, result.stderr[-2000:]
    errors = [line for line in result.stderr.splitlines() if "error:" in line]
    assert errors == [f"captioning caption: error: {fifo}: not a regular file (a device, pipe or socket)",
                      "captioning caption: error: /dev/zero: not a regular file (a device, pipe or socket)"]
    assert good in result.stdout

    from data_prep.prepare import PrepareOptions, prepare
    from data_prep.synth import load_split

    images = tmp_path / "images"
    shutil.copytree(os.path.join(shapes_dir, "images"), images)
    data = load_split(shapes_dir, "train")
    os.remove(images / data["images"][0]["file_name"])
    os.mkfifo(images / data["images"][0]["file_name"])
    manifest = prepare(PrepareOptions(output_dir=str(tmp_path / "o"), workers=1, min_word_count=1, split=[
        f"train={shapes_dir}/annotations/captions_train.json:{images}"]), progress=False)
    assert manifest["skipped"] == [{"image": data["images"][0]["file_name"],
                                    "reason": "not a regular file (a device, pipe or socket)"}]


def test_a_value_that_spells_a_parameter_is_not_turned_into_a_flag(shapes_dir, tmp_path):
    """Library errors mark the parameters they name; the CLI rewrites only those. A dataset folder named
    `overwrite` stays `overwrite` in the line that tells you to pass --overwrite."""
    split = coco_split_args(shapes_dir, splits=("train",))
    first = run_cli("prepare", "--output-dir", "overwrite", "--workers", "1", *sum((["--split", s] for s in split), []),
                    cwd=str(tmp_path))
    assert first.returncode == 0, first.stderr[-2000:]
    again = run_cli("prepare", "--output-dir", "overwrite", "--workers", "1", *sum((["--split", s] for s in split), []),
                    cwd=str(tmp_path))
    assert again.returncode == 2
    assert again.stderr.strip().splitlines()[-1] == (
        "captioning prepare: error: overwrite already holds a prepared dataset (manifest.json); pass --overwrite "
        "to replace it")


def test_every_flag_of_every_command_is_known_by_its_parameter_name():
    """Errors name parameters and the command line writes them as flags (captioning.errors): every option of
    every (sub)command, in argument groups and mutually exclusive groups too, maps back to its flag."""
    import argparse

    from captioning.cli import build_parser

    def parsers(parser):
        yield parser
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for sub in action.choices.values():
                    yield from parsers(sub)

    checked = 0
    for parser in parsers(build_parser()):
        flags = parser.flag_names()
        for action in parser._actions:
            long = [o for o in action.option_strings if o.startswith("--")]
            if long and action.dest != "help":
                assert flags.get(action.dest) == long[0], (parser.prog, action.dest)
                checked += 1
    assert checked > 100
