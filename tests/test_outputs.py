"""What a command writes lands only where it may: a regular file or nothing (never a device, a FIFO or a
symbolic link), never one of its inputs, never a model folder's own files, and an export replaces only
its own earlier export (issue 19's items 3, 4, 5, 11 and 15)."""

import json
import os
import shutil
import stat

import pytest

from tests.helpers import copy_model, encode, gradient, run_main


@pytest.fixture()
def photos(shapes_dir, tmp_path):
    images = sorted(os.listdir(os.path.join(shapes_dir, "images")))[:2]
    paths = []
    for name in images:
        shutil.copy(os.path.join(shapes_dir, "images", name), tmp_path / name)
        paths.append(str(tmp_path / name))
    return paths


def one_error(code, out, err, command, expected):
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2 and lines and lines[-1].startswith(f"captioning {command}: error: "), err
    assert expected in lines[-1], lines[-1]
    assert "Traceback" not in err
    return lines[-1]


def special_files(tmp_path):
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    link = tmp_path / "link.html"
    (tmp_path / "target.html").write_text("<!DOCTYPE html>\n")
    os.symlink(tmp_path / "target.html", link)
    return {"a character device": "/dev/full", "a FIFO": str(fifo), "a symbolic link": str(link)}


def kinds(paths):
    return {p: stat.S_IFMT(os.lstat(p).st_mode) for p in paths}


def test_outputs_that_are_not_regular_files_are_refused_and_left_as_they_are(trained_model_dir, photos, tmp_path,
                                                                            prepared_dir, shapes_dir):
    special = special_files(tmp_path)
    before = kinds(special.values())
    annotations = os.path.join(shapes_dir, "annotations", "captions_test.json")
    results = tmp_path / "results.json"
    results.write_text(json.dumps([{"image_id": 0, "caption": "a red circle"}]))
    for kind, path in special.items():
        expected = f"{path} is {kind}, not a regular file: writing it would replace it"
        one_error(*run_main("caption", "--model-dir", trained_model_dir, "--html", path, photos[0]), "caption",
                  f"--html {expected}")
        one_error(*run_main("evaluate", "--model-dir", trained_model_dir, "--output", path), "evaluate",
                  f"--output {expected}")
        one_error(*run_main("score", "--annotations", annotations, "--results", results, "--json", path), "score",
                  f"--json {expected}")
        one_error(*run_main("benchmark", "decode", "--json", path), "benchmark", f"--json {expected}")
    assert kinds(special.values()) == before  # the device, the FIFO, the link: all still what they were
    assert (tmp_path / "target.html").read_text() == "<!DOCTYPE html>\n"


def test_an_output_that_is_an_input_is_refused(trained_model_dir, photos, shapes_dir, tmp_path):
    first, second = photos
    data = open(first, "rb").read()
    # --html used as if it took no value: the first photo would become the gallery
    line = one_error(*run_main("caption", "--model-dir", trained_model_dir, "--html", first, second), "caption",
                     f"--html {first} exists and is a JPEG image, not HTML this command wrote")
    assert "--html takes the name of the HTML file to write" in line
    one_error(*run_main("caption", "--model-dir", trained_model_dir, "--html", first, first), "caption",
              f"--html {first} exists and is a JPEG image")
    annotations = os.path.join(shapes_dir, "annotations", "captions_test.json")
    copy = tmp_path / "annotations.json"
    shutil.copy(annotations, copy)
    results = tmp_path / "results.json"
    results.write_text(json.dumps([{"image_id": 0, "caption": "a red circle"}]))
    one_error(*run_main("score", "--annotations", copy, "--results", results, "--json", copy), "score",
              f"--json {copy} is also an input ({copy}): writing it would overwrite that input")
    assert open(first, "rb").read() == data and copy.read_bytes() == open(annotations, "rb").read()
    # an earlier gallery is an output of this command: replacing it is what the command is for
    gallery = tmp_path / "gallery.html"
    code, _, err = run_main("caption", "--model-dir", trained_model_dir, "--html", gallery, first)
    assert code == 0, err
    code, _, err = run_main("caption", "--model-dir", trained_model_dir, "--html", gallery, second)
    assert code == 0 and gallery.read_text().count("<figure>") == 1 and os.path.basename(second) in gallery.read_text()


def test_nothing_but_train_writes_the_model_folders_own_files(trained_model_dir, photos, tmp_path):
    model = tmp_path / "model"
    copy_model(trained_model_dir, model)
    [index] = [n for n in os.listdir(model) if n.endswith(".index")][-1:]
    own = {name: (model / name).read_bytes() for name in (index, "config.yaml", "vocab.txt", "checkpoint")}
    for flag, command, path in (("--output", "evaluate", model / index), ("--html", "caption", model / "config.yaml"),
                                ("--html", "caption", model / "logs" / "page.html"),
                                ("--output", "evaluate", model / "checkpoint")):
        args = [command, "--model-dir", model, flag, path] + ([photos[0]] if command == "caption" else [])
        one_error(*run_main(*args), command, f"{flag} {path} is a file of the model folder {model}, which only "
                                              "`captioning train` writes")
    one_error(*run_main("export", "--model-dir", model, "--output", model / "eval"), "export",
              f"--output {model / 'eval'} is a file of the model folder")
    assert {name: (model / name).read_bytes() for name in own} == own
    # a new name inside the folder is not one of its files
    code, _, err = run_main("caption", "--model-dir", model, "--html", model / "gallery.html", photos[0])
    assert code == 0, err


def test_export_somewhere_it_cannot_write_is_one_line(trained_model_dir, tmp_path):
    one_error(*run_main("export", "--model-dir", trained_model_dir, "--output", "/proc/exp"), "export",
              "--output /proc/exp: cannot create a folder in /proc")
    locked = tmp_path / "locked"
    locked.mkdir()
    (locked / "file").write_text("x")
    one_error(*run_main("export", "--model-dir", trained_model_dir, "--output", locked / "file" / "exp"), "export",
              "its parent folder")


@pytest.mark.slow
def test_export_overwrite_never_takes_a_users_files_and_cleans_what_a_killed_export_left(trained_model_dir,
                                                                                       tmp_path):
    out = tmp_path / "export"
    code, said, err = run_main("export", "--model-dir", trained_model_dir, "--output", out)
    assert code == 0 and said == f"exported to {out}\n", err
    marker_file = out / "captioning_export.json"
    before = os.stat(marker_file)
    # the same export again writes nothing, and says so instead of "exported to" (issue 48, item 21)
    code, said, err = run_main("export", "--model-dir", trained_model_dir, "--output", out)
    assert code == 0 and said == f"already exported to {out} (unchanged: the same model, checkpoint and settings)\n"
    assert os.stat(marker_file).st_ino == before.st_ino
    marker = json.loads(marker_file.read_text())
    assert sorted(marker["files"]) == sorted(os.listdir(out))
    (out / "NOTES.txt").write_text("mine")
    one_error(*run_main("export", "--model-dir", trained_model_dir, "--output", out, "--overwrite", "--beam-size",
                        "1"), "export", f"--output {out} holds files the export did not write (NOTES.txt), which "
                                        "--overwrite would delete with it: move them out first")
    assert (out / "NOTES.txt").read_text() == "mine"
    os.remove(out / "NOTES.txt")
    # what `kill -9` in the middle of an export leaves beside it: its temporary folder, and (killed between
    # the two renames) the old export moved aside while the new one is not in place yet
    dead = 2 ** 22 + 12345  # above the default pid_max: no such process
    (tmp_path / f"export.tmp{dead}").mkdir()
    (tmp_path / f"export.tmp{dead}" / "saved_model.pb").write_text("half")
    code, _, err = run_main("export", "--model-dir", trained_model_dir, "--output", out, "--overwrite",
                            "--beam-size", "1")
    assert code == 0, err
    assert sorted(os.listdir(tmp_path)) == ["export"]
    os.rename(out, tmp_path / f"export.old{dead}")  # killed after moving the old export aside
    from captioning.fileio import clean_folder_leftovers

    assert clean_folder_leftovers(str(out)) == [f"export.old{dead}"] and (out / "saved_model.pb").exists()


# ---- one rule over every output path of the command line (issue 48, items 1 and 11) ----------------------------

@pytest.fixture()
def world(trained_model_dir, prepared_dir, shapes_dir, hub_presets, tmp_path):
    """Copies of every kind of input a command reads, in ``tmp_path/inputs`` (whose bytes each case checks
    untouched): a prepared dataset, the shapes' images and annotations, a keras-hub preset, a config, and a
    JSON file of somebody else; and a model folder whose config.yaml reads that dataset and that preset (the
    refusals come before any model loads, so its checkpoint need not match the preset)."""
    from captioning.config import save_config
    from captioning.model import resolve
    from tests.helpers import small_train_config

    root = tmp_path / "inputs"
    shutil.copytree(prepared_dir, root / "records")
    shutil.copytree(shapes_dir, root / "shapes")
    shutil.copytree(hub_presets["vit"], root / "preset")
    (root / "other.json").write_text('{"mine": true}\n')
    save_config(resolve(small_train_config(str(root / "records"), "train.steps=1")), str(root / "config.yaml"))
    model = copy_model(trained_model_dir, tmp_path / "model")
    config = (tmp_path / "model" / "config.yaml").read_text().replace(prepared_dir, str(root / "records"))
    config = config.replace("encoder: small_cnn", f"encoder: keras_hub\n  encoder_preset: {root / 'preset'}", 1)
    (tmp_path / "model" / "config.yaml").write_text(config)
    return {"root": root, "model": model, "records": str(root / "records"), "preset": str(root / "preset"),
            "annotations": str(root / "shapes" / "annotations"), "images": str(root / "shapes" / "images"),
            "instances": str(root / "shapes" / "annotations" / "instances_test.json"),
            "config": str(root / "config.yaml"), "other": str(root / "other.json"), "tmp": tmp_path}


def _tree(root) -> dict:
    return {os.path.relpath(os.path.join(d, n), root): open(os.path.join(d, n), "rb").read()
            for d, _, names in os.walk(root) for n in names}


# (command line, the flag, the words of its refusal): the command line's every output flag at least once
REFUSALS = {
    "evaluate --output DATA/manifest.json": (
        lambda w: ["evaluate", "--model-dir", w["model"], "--output", f"{w['records']}/manifest.json"], "--output",
        "lies inside the prepared dataset"),
    "evaluate --output --data-dir's file": (
        lambda w: ["evaluate", "--model-dir", w["model"], "--data-dir", w["records"], "--output",
                   f"{w['records']}/vocab.txt"], "--output", "lies inside the prepared dataset"),
    "evaluate --output PRESET/config.json": (
        lambda w: ["evaluate", "--model-dir", w["model"], "--output", f"{w['preset']}/config.json"], "--output",
        "lies inside model.encoder_preset"),
    "evaluate --output a JSON file of others": (
        lambda w: ["evaluate", "--model-dir", w["model"], "--output", w["other"]], "--output",
        "is not a result this command wrote (no metrics, split, checkpoint_step in it)"),
    "evaluate --output the instances file": (
        lambda w: ["evaluate", "--model-dir", w["model"], "--instances", w["instances"], "--output", w["instances"]],
        "--output", "is also an input"),
    "evaluate --output ''": (
        lambda w: ["evaluate", "--model-dir", w["model"], "--output", ""], "--output", "--output is empty"),
    "score --json a JSON file of others": (
        lambda w: ["score", "--annotations", f"{w['annotations']}/captions_test.json", "--results", w["other"],
                   "--json", f"{w['records']}/manifest.json"], "--json", "is not a result this command wrote"),
    "caption --html ''": (
        lambda w: ["caption", "--model-dir", w["model"], "--html", "", w["images"]], "--html", "--html is empty"),
    "score --json ''": (
        lambda w: ["score", "--annotations", f"{w['annotations']}/captions_test.json", "--results", w["other"],
                   "--json", ""], "--json", "--json is empty"),
    "caption --html PRESET/gallery.html": (
        lambda w: ["caption", "--model-dir", w["model"], "--html", f"{w['preset']}/gallery.html", w["images"]],
        "--html", "lies inside model.encoder_preset"),
    "export --output ''": (
        lambda w: ["export", "--model-dir", w["model"], "--output", ""], "--output", "--output is empty"),
    "export --output PRESET": (
        lambda w: ["export", "--model-dir", w["model"], "--output", w["preset"]], "--output",
        "is model.encoder_preset"),
    "export --format litert --output ''": (
        lambda w: ["export", "--model-dir", w["model"], "--format", "litert", "--output", ""], "--output",
        "--output is empty"),
    "export --format litert --output PRESET/model.tflite": (
        lambda w: ["export", "--model-dir", w["model"], "--format", "litert", "--output",
                   f"{w['preset']}/model.tflite"], "--output", "lies inside model.encoder_preset"),
    "train --model-dir DATA": (
        lambda w: ["train", "--config", w["config"], "--model-dir", w["records"]], "--model-dir",
        "is the prepared dataset"),
    "train --model-dir CONFIG": (
        lambda w: ["train", "--config", w["config"], "--model-dir", w["config"]], "--model-dir", "is also an input"),
    "prepare --output-dir the images": (
        lambda w: ["prepare", "--split", f"train={w['annotations']}/captions_train.json:{w['images']}",
                   "--output-dir", w["images"]], "--output-dir", "is also an input"),
    "prepare --output-dir ''": (
        lambda w: ["prepare", "--split", f"train={w['annotations']}/captions_train.json:{w['images']}",
                   "--output-dir", ""], "--output-dir", "--output-dir is empty"),
    "synth --output-dir a file": (
        lambda w: ["synth", "--output-dir", w["other"], "--num-images", "3"], "--output-dir", "is a file"),
    "benchmark decode --json PRESET/config.json": (
        lambda w: ["benchmark", "decode", "--model-dir", w["model"], "--json", f"{w['preset']}/config.json"], "--json",
        "lies inside model.encoder_preset"),
    "benchmark input --json DATA/manifest.json": (
        lambda w: ["benchmark", "input", "--data", w["records"], "--json", f"{w['records']}/manifest.json"], "--json",
        "lies inside the prepared dataset"),
    "benchmark quality --model-dir DATA": (
        lambda w: ["benchmark", "quality", "--config", w["config"], "--data", w["records"], "--model-dir",
                   w["records"]], "--model-dir", "is the prepared dataset"),
    "lm train --output DATA/lm": (
        lambda w: ["lm", "train", "--text", w["records"], "--output", f"{w['records']}/lm"], "--output",
        "lies inside the prepared dataset"),
    "clip train --output DATA/clip": (
        lambda w: ["clip", "train", "--records", w["records"], "--output", f"{w['records']}/clip"], "--output",
        "lies inside the prepared dataset"),
    "data-service dispatcher --work-dir a file": (
        lambda w: ["data-service", "dispatcher", "--port", "1", "--work-dir", w["other"]], "--work-dir", "is a file"),
}
# each benchmark: its required flags; each writes --json, and most make photos in --work-dir
BENCHMARKS = {"input": [], "train": ["--config", "config"], "quality": ["--config", "config"], "decode": [],
              "serve": ["--model-dir", "model"], "litert": ["--model-dir", "model"], "prepare": []}
for _name, _needs in BENCHMARKS.items():
    def _args(w, name=_name, needs=_needs):
        return ["benchmark", name] + [w[word] if i % 2 else word for i, word in enumerate(needs)]

    REFUSALS[f"benchmark {_name} --json a JSON file of others"] = (
        lambda w, args=_args: args(w) + ["--json", w["other"]], "--json", "is not a result this command wrote")
    if _name not in ("quality", "decode"):
        REFUSALS[f"benchmark {_name} --work-dir a file"] = (
            lambda w, args=_args: args(w) + ["--work-dir", w["other"]], "--work-dir", "is a file")
# the flags naming a file or folder that a command only reads (`features` writes only DATA/features/NAME, NAME a
# folder name: captioning.data.features_store.check_name; `serve` writes nothing)
INPUT_FLAGS = {
    "prepare --split", "prepare --karpathy-json", "prepare --images-root", "prepare --tfds-data-dir",
    "prepare --vocab", "train --config", "train --init-from", "evaluate --model-dir", "evaluate --data-dir",
    "evaluate --checkpoint", "evaluate --instances", "caption --model-dir",
    "caption --detections", "export --model-dir", "serve --model-dir", "features import --data-dir",
    "features import --tsv", "features import --npz-dir", "features import --boxes-dir", "features import --hdf5",
    "features extract --data-dir", "features extract --images", "features extract --model-dir",
    "features extract --config", "features extract --detections", "benchmark input --data",
    "benchmark input --config", "benchmark train --config", "benchmark train --data", "benchmark quality --config",
    "benchmark quality --data", "benchmark decode --model-dir", "benchmark decode --config",
    "benchmark decode --ensemble-with", "benchmark serve --model-dir", "benchmark litert --model-dir",
    "lm train --text", "clip train --records", "evaluate --clip-preset",
}


def _path_flags():
    """Every flag of the command line that takes a file or a folder: ``"COMMAND --flag"``."""
    import argparse
    import re

    from captioning.cli import build_parser

    def walk(parser, prefix):
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for name, sub in action.choices.items():
                    yield from walk(sub, prefix + [name])
            elif action.option_strings and action.nargs != 0:
                yield " ".join(prefix), action

    found = set()
    for command, action in walk(build_parser(), []):
        flag = action.option_strings[-1]
        if re.search(r"(-dir|output|json|html|-out|log|file|path|from|config)$", flag) or \
                re.search(r"FILE|DIR|OUT|PATH|ROOT|\.json", str(action.metavar or "")):
            found.add(f"{command} {flag}")
    return found


def test_every_output_flag_is_in_the_table_of_refusals():
    """A new flag naming a file or folder is either an input (INPUT_FLAGS) or an output with a case in
    REFUSALS: the one rule cannot miss a command."""
    import itertools

    outputs = {" ".join(itertools.takewhile(lambda word: not word.startswith("-"), make(_FAKE))) + " " + flag
               for make, flag, _ in REFUSALS.values()}
    assert _path_flags() == outputs | INPUT_FLAGS, (_path_flags() - outputs - INPUT_FLAGS,
                                                    (outputs | INPUT_FLAGS) - _path_flags())


_FAKE = {key: f"/nonexistent/{key}" for key in ("root", "model", "records", "preset", "annotations", "images",
                                                 "instances", "config", "other", "tmp")}


@pytest.mark.parametrize("case", list(REFUSALS))
def test_no_command_writes_over_its_inputs_or_files_it_did_not_write(case, world):
    """Every command taking an output path refuses, in one line and before any work, an output that is one of
    its inputs (a model's files, the dataset, a preset, a config, images, an instances file), lies in a
    folder it reads, is empty, or is an existing file it did not write; every input stays as it was."""
    make, flag, words = REFUSALS[case]
    before = _tree(world["root"]), _tree(world["model"])
    code, out, err = run_main(*make(world))
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2 and len(lines) == 1 and lines[0].startswith("captioning "), err
    assert flag in lines[0] and words in lines[0], lines[0]
    assert (_tree(world["root"]), _tree(world["model"])) == before


def test_an_output_inside_a_language_models_preset_is_refused(trained_prefix_lm_dir, lm_presets, tmp_path):
    """The decoder's preset folder (``model.decoder_preset``, prefix_lm's language model) is an input like the
    encoder's: caption's gallery, evaluate's and export's outputs inside it are refused in one line before any work,
    and it stays as it was."""
    preset = tmp_path / "lm"
    shutil.copytree(lm_presets["gpt2"], preset)
    model = copy_model(trained_prefix_lm_dir, tmp_path / "model")
    config = (tmp_path / "model" / "config.yaml").read_text()
    assert lm_presets["gpt2"] in config
    (tmp_path / "model" / "config.yaml").write_text(config.replace(lm_presets["gpt2"], str(preset)))
    photo = tmp_path / "photo.png"
    photo.write_bytes(encode(gradient(), "PNG"))
    before = _tree(preset)
    for args in (["caption", "--model-dir", model, "--html", f"{preset}/gallery.html", str(photo)],
                 ["evaluate", "--model-dir", model, "--output", f"{preset}/config.json"],
                 ["export", "--model-dir", model, "--output", str(preset)]):
        code, out, err = run_main(*args)
        lines = [line for line in err.splitlines() if line.strip()]
        assert code == 2 and len(lines) == 1 and "model.decoder_preset" in lines[0], (args, err)
    assert _tree(preset) == before
