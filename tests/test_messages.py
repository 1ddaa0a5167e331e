"""Error lines say what is wrong in the user's words, short (issue 19's items 12 and 19)."""

import os

import pytest

from captioning.model import DECODERS
from tests.helpers import coco_split_args, run_cli, run_main


def last_line(err):
    return err.strip().splitlines()[-1]


def test_an_unknown_decoder_is_found_before_tensorflows_runtime_starts(tmp_path):
    """`model.decoder=bogus`: one line naming the choices, before any strategy or device is set up (the
    command line's first log line would be "strategy: ...")."""
    done = run_cli("train", "--config", os.path.join("experiments", "shapes.yaml"), "--model-dir",
                   str(tmp_path / "m"), "--set", "model.decoder=bogus")
    assert done.returncode == 2 and done.stderr.strip().splitlines() == [
        f"captioning train: error: config key model.decoder must be one of {', '.join(DECODERS)}, got 'bogus'"]
    assert not (tmp_path / "m").exists()


@pytest.mark.parametrize("override, expected", [
    ("modle=3", "unknown config section 'modle'; did you mean model, decode? sections are data, model, train, "
                "distribute, decode, scst"),
    ("modle.lstm_units=3", "unknown config section 'modle' (in 'modle.lstm_units'); did you mean model, decode?"),
    ("model=3", "config key 'model' names a section: give section.key=value, e.g. model.decoder=..."),
    ("data.service=nohost", "data.service must look like HOST:PORT, e.g. data0:5050, got 'nohost'"),
])
def test_config_errors_name_what_the_user_wrote(override, expected, tmp_path):
    code, _, err = run_main("train", "--config", os.path.join("experiments", "shapes.yaml"), "--model-dir",
                            tmp_path / "m", "--set", override)
    assert code == 2 and expected in last_line(err), err


def test_an_unreachable_service_names_the_config_key(tmp_path, prepared_dir):
    from captioning.config import save_config
    from tests.helpers import free_port, small_train_config

    port = free_port()
    save_config(small_train_config(prepared_dir, f"data.service=localhost:{port}", "data.service_timeout_s=1"),
                str(tmp_path / "c.yaml"))
    code, _, err = run_main("train", "--config", tmp_path / "c.yaml", "--model-dir", tmp_path / "m")
    assert code == 2 and last_line(err) == (
        f"captioning train: error: no tf.data dispatcher answered at localhost:{port} within 1 s (connection refused): "
        f"start one there (captioning data-service dispatcher --port {port}), or correct data.service")


def test_evaluate_help_says_where_results_go():
    code, out, _ = run_main("evaluate", "--help")
    text = " ".join(out.split())
    assert code == 0 and "eval/<key>.json" in text and "eval/<key>.predictions.json" in text
    assert "metrics.json and predictions.json" not in text


def test_a_file_that_is_not_a_vocabulary_is_quoted_in_a_short_line(shapes_dir, tmp_path):
    """`prepare --vocab captions_train.json`: the error quotes the start of the file, not all of it."""
    captions = os.path.join(shapes_dir, "annotations", "captions_train.json")
    code, _, err = run_main("prepare", "--output-dir", tmp_path / "out", "--vocab", captions,
                            *[f"--split={s}" for s in coco_split_args(shapes_dir, ("train",))])
    line = last_line(err)
    assert code == 2 and len(line) < 300 and os.path.getsize(captions) > 3000, line
    assert line.startswith(f"captioning prepare: error: vocabulary {captions} is damaged or not a vocab.txt: a "
                           "vocabulary must start with <pad>, <start>, <end>, <unk>; got '{") and line.endswith("...")
