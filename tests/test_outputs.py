"""What a command writes lands only where it may: a regular file or nothing (never a device, a FIFO or a
symbolic link), never one of its inputs, never a model folder's own files, and an export replaces only
its own earlier export (issue 19's items 3, 4, 5, 11 and 15)."""

import json
import os
import shutil
import stat

import pytest

from tests.helpers import copy_model, run_main


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
    assert run_main("export", "--model-dir", trained_model_dir, "--output", out)[0] == 0
    marker = json.loads((out / "captioning_export.json").read_text())
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
