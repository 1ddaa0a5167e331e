"""The command line as a user meets it: real processes, exit codes, one-line errors."""

import json
import os

import pytest

from tests.helpers import coco_split_args, run_cli


def test_help_explains_every_command():
    result = run_cli("--help")
    assert result.returncode == 0
    for command, flag in (("synth", "--output-dir"), ("prepare", "--output-dir"), ("train", "--model-dir")):
        assert command in result.stdout
        sub = run_cli(command, "--help")
        assert sub.returncode == 0 and flag in sub.stdout


def test_every_prepare_flag_has_help_text():
    text = run_cli("prepare", "--help").stdout
    for flag in ("--split", "--karpathy-json", "--images-root", "--tfds", "--tfds-data-dir", "--keep-restval",
                 "--shards", "--images-per-shard", "--shorter-side", "--jpeg-quality", "--seed",
                 "--min-word-count", "--max-caption-length", "--keep-punctuation", "--vocab", "--workers",
                 "--strict", "--overwrite", "--resume"):
        assert flag in text


def test_synth_then_prepare(tmp_path):
    shapes = str(tmp_path / "shapes")
    result = run_cli("synth", "--output-dir", shapes, "--num-images", "20", "--seed", "1")
    assert result.returncode == 0, result.stderr
    assert "train 16 images" in result.stdout
    args = []
    for split in coco_split_args(shapes):
        args += ["--split", split]
    out = str(tmp_path / "records")
    result = run_cli("prepare", *args, "--output-dir", out, "--workers", "2", "--shards", "train=2")
    assert result.returncode == 0, result.stderr
    assert "train" in result.stdout and "vocabulary:" in result.stdout
    manifest = json.load(open(os.path.join(out, "manifest.json")))
    assert manifest["splits"]["train"]["shards"] == ["train-00000-of-00002.tfrecord",
                                                     "train-00001-of-00002.tfrecord"]
    assert manifest["config"]["workers"] == 2
    again = run_cli("prepare", *args, "--output-dir", out)
    assert again.returncode == 2 and "--overwrite" in again.stderr


@pytest.mark.parametrize("args, message", [
    (["prepare", "--output-dir", "x", "--split", "train=missing.json:imgs"], "does not exist"),
    (["prepare", "--output-dir", "x", "--split", "train=BAD.json:."], "is not valid JSON"),
    (["prepare", "--output-dir", "x"], "exactly one source"),
    (["prepare", "--output-dir", "x", "--split", "a=b:c", "--shards", "train=lots"], "NAME=INTEGER"),
    (["synth", "--output-dir", "y", "--num-images", "1"], "in [3, 1,000,000], got 1"),
    (["nonsense"], "invalid choice"),
])
def test_bad_input_exits_2_with_one_line(args, message, tmp_path):
    (tmp_path / "BAD.json").write_text("{not json")
    result = run_cli(*args, cwd=str(tmp_path))
    assert result.returncode == 2
    assert message in result.stderr
    assert "Traceback" not in result.stderr
    error_lines = [line for line in result.stderr.splitlines() if "error:" in line]
    assert len(error_lines) == 1


@pytest.mark.parametrize("args, message", [
    (["train", "--config", "BAD.yaml", "--model-dir", "m"], "unknown config key 'train.stepz'; did you mean train.steps"),
    (["train", "--config", "experiments/shapes.yaml", "--model-dir", "m", "--set", "train.warmup_steps=-5"],
     "config key train.warmup_steps must be in [0, 1000000000], got -5"),
    (["benchmark", "train", "--config", "experiments/shapes.yaml", "--set", "data.cache=nowhere"],
     "config key data.cache must be one of"),
], ids=["file", "set", "benchmark"])
def test_a_bad_config_stops_the_command_before_tensorflow_loads(args, message, tmp_path):
    """docs/training.md: a config error is one line (exit 2) before TensorFlow is imported. The command line
    runs in a fresh process, which then says whether TensorFlow was imported."""
    import subprocess
    import sys

    from tests.helpers import REPO

    bad = tmp_path / "BAD.yaml"
    bad.write_text("base: " + os.path.join(REPO, "experiments", "shapes.yaml") + "\ntrain:\n  stepz: 3\n")
    argv = [str(bad) if a == "BAD.yaml" else os.path.join(REPO, a) if a.startswith("experiments/") else a for a in args]
    code = ("import sys\nfrom captioning.cli import main\ncode = main(sys.argv[1:])\n"
            "print('tensorflow' in sys.modules)\nsys.exit(code)")
    done = subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True, cwd=str(tmp_path),
                          env=dict(os.environ, PYTHONPATH=REPO), timeout=120)
    assert (done.returncode, done.stdout) == (2, "False\n"), done.stdout + done.stderr[-2000:]
    assert done.stderr.count("\n") == 1 and done.stderr.startswith(f"captioning {args[0]}: error: "), done.stderr
    assert message in done.stderr


def test_python_dash_m_and_console_script_agree():
    import shutil
    import subprocess

    exe = shutil.which("captioning", path=os.path.dirname(__import__("sys").executable))
    if exe is None:
        pytest.skip("the console script is installed by `pip install -e .` (make test does)")
    assert subprocess.run([exe, "--version"], capture_output=True, text=True).stdout == \
        run_cli("--version").stdout


HUGE = 10**12


def numeric_flags():
    """(command words, flag, form) of every option of the command line that takes a number: an option whose
    type accepts a small number in one of the forms below (``NAME=N``, ``WxH`` included)."""
    import argparse

    from captioning.cli import build_parser

    forms = ("{}", "x={}", "{}x8")

    def walk(parser, words):
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for name, sub in action.choices.items():
                    yield from walk(sub, words + (name,))
            elif action.option_strings and callable(action.type):
                for form in forms:
                    if any(_accepts(action.type, form.format(n)) for n in (1, 8)):
                        yield words, action.option_strings[-1], form
                        break

    return sorted(set(walk(build_parser(), ())))


def _accepts(kind, text) -> bool:
    import argparse

    try:
        kind(text)
    except (argparse.ArgumentTypeError, ValueError, TypeError):
        return False
    return True


def test_every_number_a_flag_takes_has_an_upper_bound(capsys):
    """docs/reliability.md, "Upper bounds of sizes": every flag that takes a number refuses 10^12 with one line
    naming the flag (exit 2), as the command line is parsed, before any work."""
    from captioning.cli import build_parser

    flags = numeric_flags()
    named = {(" ".join(words), flag) for words, flag, _ in flags}
    assert {("evaluate", "--batch-size"), ("evaluate", "--max-images"), ("prepare", "--shards"),
            ("prepare", "--workers"), ("synth", "--num-images"), ("benchmark input", "--image-size"),
            ("caption", "--length-normalization"), ("data-service worker", "--timeout"),
            ("features extract", "--shift")} <= named and len(flags) > 50
    accepted = []
    for words, flag, form in flags:
        with pytest.raises(SystemExit) as exited:
            build_parser().parse_args([*words, flag, form.format(HUGE)])
        err = capsys.readouterr().err
        if exited.value.code != 2 or "must" not in err:
            accepted.append(f"{' '.join(words)} {flag}")
            continue
        assert err.count("\n") == 1 and err.startswith(f"captioning {words[0]}: error: argument {flag}"), err
    assert accepted == []


@pytest.mark.parametrize("args, said", [
    (["train", "--config", "experiments/shapes.yaml", "--model-dir", "MODEL", "--set", "data.image_size=100000"],
     "captioning train: error: config key data.image_size must be in [1, 1024], got 100000"),
    (["evaluate", "--model-dir", "MODEL", "--batch-size", "100000000"],
     "captioning evaluate: error: argument --batch-size: must be an integer in [1, 1,024], got 100000000 (see "
     "captioning evaluate --help)"),
    (["prepare", "--output-dir", "MODEL", "--split", "train=a.json:.", "--shards", "train=1000000"],
     "captioning prepare: error: argument --shards: 'train=1000000': the integer must be in [1, 100,000] (see "
     "captioning prepare --help)"),
])
def test_a_size_beyond_its_bound_stops_the_command_in_one_line_writing_nothing(args, said, tmp_path):
    from tests.helpers import REPO

    argv = [str(tmp_path / "m") if a == "MODEL" else os.path.join(REPO, a) if a.startswith("experiments/") else a
            for a in args]
    result = run_cli(*argv, cwd=str(tmp_path))
    assert (result.returncode, result.stderr.strip().splitlines()) == (2, [said])
    assert os.listdir(tmp_path) == []


@pytest.mark.slow  # a real process that traces five searches (9 CPU s): end to end
def test_tensorflows_internals_stay_out_of_the_users_log(tmp_path):
    """TensorFlow's C++ lines ("E0000 … oneDNN supports DT_UINT8 only …", "E0000 … layout failed", absl's
    pre-init notice) and its Python retracing warnings are no news to a user: a real ``captioning`` process,
    started as a user starts it (no TF_CPP_MIN_LOG_LEVEL in the environment), logs only the project's own
    lines. ``benchmark decode`` with several decoding settings does what prints them: it decodes JPEGs through
    a SavedModel and traces the captioner's search once a setting (issue 48, item 21). One process, a tiny
    untrained model, 4 images."""
    import re
    import subprocess
    import sys

    from tests.helpers import REPO

    env = {k: v for k, v in os.environ.items() if k != "TF_CPP_MIN_LOG_LEVEL"}
    env["PYTHONPATH"] = REPO
    options = [a for n in range(2, 7) for a in ("--option", f"decode.block_ngrams={n}")]
    done = subprocess.run([sys.executable, "-m", "captioning", "benchmark", "decode", "--images", "4", "--batch-size",
                           "2", "--max-length", "4", "--rounds", "1", *options], capture_output=True, text=True,
                          cwd=tmp_path, env=env, timeout=600, stdin=subprocess.DEVNULL)
    assert done.returncode == 0, done.stderr[-2000:]
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert lines and all(re.match(r"\d\d:\d\d:\d\d \S", line) for line in lines), done.stderr  # the log's own lines
    assert "retracing" not in done.stderr and "E0000" not in done.stderr and "absl" not in done.stderr
