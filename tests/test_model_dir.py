"""The model folder as later commands meet it: damaged files, results of several evaluations, the record
of how the model was trained, relative paths, and a folder that a training run is writing into."""

import glob
import json
import os
import re
import shutil
import signal

import pytest
import yaml

from captioning.config import save_config
from tests.helpers import coco_split_args, copy_model, run_cli, small_train_config
from tests.harness.training import Cli, scalars


@pytest.fixture
def model(trained_model_dir, tmp_path):
    out = tmp_path / "model"
    copy_model(trained_model_dir, out)
    return out


def assert_one_line(result, command, *fragments):
    assert result.returncode == 2, (result.returncode, result.stderr[-2000:])
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith(f"captioning {command}: error:"), result.stderr[-2000:]
    for fragment in fragments:
        assert fragment in last, last


DAMAGE = {
    "config_garbage": ("config.yaml", lambda text: b"\x00\xff\xfe{[ not yaml", "config.yaml is damaged"),
    "config_cut_short": ("config.yaml", lambda text: text[: len(text) // 2], "config.yaml is damaged"),
    "vocab_not_utf8": ("vocab.txt", lambda text: text + b"\xff\xfe\n", "vocab.txt is not UTF-8 text"),
    "vocab_cut_short": ("vocab.txt", lambda text: b"\n".join(text.split(b"\n")[:20]) + b"\n", "vocab.txt"),
    "state_garbage": ("checkpoint", lambda text: b"\x00\xff garbage {{{", "checkpoint is damaged"),
    "state_empty": ("checkpoint", lambda text: b"", "checkpoint is damaged"),
    "state_cut_short": ("checkpoint", lambda text: text[:25], "checkpoint is damaged"),
}


# every command meets one damage of each file; the others are checked with evaluate alone
ALL_COMMANDS = {"config_cut_short", "vocab_not_utf8", "state_garbage"}


@pytest.mark.parametrize("case", sorted(DAMAGE))
def test_a_damaged_file_in_the_model_folder_is_one_line_naming_it(case, model, prepared_dir, shapes_dir, tmp_path):
    name, damage, message = DAMAGE[case]
    path = model / name
    path.write_bytes(damage(path.read_bytes()))
    def files():  # training.lock aside: a refused train takes the folder's lock before it reads it
        return {n: (model / n).read_bytes() for n in os.listdir(model) if (model / n).is_file() and n != "training.lock"}

    before = files()
    image = os.path.join(shapes_dir, "images", sorted(os.listdir(os.path.join(shapes_dir, "images")))[0])
    config = tmp_path / "c.yaml"
    save_config(small_train_config(prepared_dir, "train.steps=70", "train.optimizer=adam", "model.embedding_size=32",
                                   "model.lstm_units=32"), str(config))
    commands = (("caption", [image]), ("evaluate", ["--max-images", "1"]), ("train", ["--config", str(config)]))
    for command, args in commands if case in ALL_COMMANDS else commands[1:2]:
        result = run_cli(command, "--model-dir", str(model), *args)
        assert_one_line(result, command, message)
        if case != "vocab_cut_short":  # that one is told apart by what it does not fit
            assert str(path) in result.stderr.strip().splitlines()[-1] or str(model) in result.stderr
    assert files() == before  # nothing rewritten, no step trained over the damaged folder


def test_an_objectives_section_cut_short_stops_train_and_not_what_reads_the_model(model, prepared_dir, tmp_path):
    """config.yaml ends with the scst: section, which the training stage types (the model stage keeps it as
    written): a file cut there still gives evaluate and caption their model, and stops train as damage,
    before anything is written."""
    from captioning.model.folder import ModelDir

    path = model / "config.yaml"
    lines = path.read_text().splitlines(keepends=True)
    assert lines[-1] == "  clip_weight: 1.0\n"
    path.write_text("".join(lines[:-1]))
    assert ModelDir(str(model)).read_config().model.decoder == "show_and_tell"  # what evaluate and caption read
    before = {n: (model / n).read_bytes() for n in os.listdir(model) if (model / n).is_file()}
    config = tmp_path / "c.yaml"
    save_config(small_train_config(prepared_dir, "train.steps=70", "train.optimizer=adam", "model.embedding_size=32",
                                   "model.lstm_units=32"), str(config))
    result = run_cli("train", "--model-dir", str(model), "--config", str(config))
    assert_one_line(result, "train", f"{path} is damaged: the scst section lacks 1 of its keys (scst.clip_weight): "
                                     "it is cut short or damaged")
    assert {n: (model / n).read_bytes() for n in os.listdir(model) if (model / n).is_file()} == before


def test_evaluate_refuses_records_of_another_vocabulary(model, shapes_dir, tmp_path):
    from data_prep.prepare import PrepareOptions, prepare

    other = str(tmp_path / "other")
    prepare(PrepareOptions(output_dir=other, split=coco_split_args(shapes_dir), workers=1, min_word_count=3),
            progress=False)
    before = sorted(os.listdir(model / "eval")) if (model / "eval").exists() else []
    result = run_cli("evaluate", "--model-dir", str(model), "--data-dir", other, "--max-images", "1")
    assert_one_line(result, "evaluate", "was prepared with another vocabulary", "--vocab")
    assert (sorted(os.listdir(model / "eval")) if (model / "eval").exists() else []) == before  # nothing written


@pytest.mark.slow
def test_each_evaluation_is_kept_once_and_never_replaced_by_a_partial_one(model, caplog):
    from captioning.evaluation.evaluate import evaluate

    def run(**kw):
        return evaluate(str(model), split="test", beam_size=1, progress=False, **kw)

    result = run()
    from captioning.data.prepared import PreparedDataset

    key = "data" + PreparedDataset.load(result["data_dir"]).identity[:8]
    full = model / "eval" / f"test-step60-beam1-len20-norm0-all-{key}.json"
    stamp, content = os.stat(full).st_mtime_ns, full.read_text()
    assert json.loads(content) == json.loads(json.dumps(result)) and result["all_images"] is True
    run(max_images=2)
    run(max_length=8)
    events = model / "logs" / "eval_test"
    n_events = sum(1 for _ in _events(events))
    with caplog.at_level("INFO", logger="captioning.evaluation.evaluate"):
        assert run() == json.loads(content)  # the same evaluation: the stored result, a no-op
    assert "evaluated already" in caplog.text
    assert os.stat(full).st_mtime_ns == stamp and full.read_text() == content  # the full result is untouched
    assert sum(1 for _ in _events(events)) == n_events  # and no new point
    assert sorted(os.path.basename(p) for p in glob.glob(str(model / "eval" / "test-step60-beam1-*.json"))) == [
        f"test-step60-beam1-len20-norm0-{images}-{key}{end}" for images in ("all", "first2") for end in
        (".json", ".predictions.json")] + [f"test-step60-beam1-len8-norm0-all-{key}{end}" for end in
                                           (".json", ".predictions.json")]
    cider = {tag: scalars(events, f"{tag}/CIDEr") for tag in ("beam1-len20-norm0", "beam1-len20-norm0-first2",
                                                              "beam1-len8-norm0")}
    assert all(list(points) == [60] for points in cider.values())  # one point each, at the checkpoint's step
    assert cider["beam1-len20-norm0"][60] == pytest.approx(json.loads(content)["metrics"]["CIDEr"], rel=1e-6)


def _events(folder):
    import tensorflow as tf

    for name in os.listdir(folder):
        yield from tf.compat.v1.train.summary_iterator(os.path.join(folder, name))


@pytest.mark.slow
def test_a_relative_data_dir_works_from_any_directory_and_a_moved_one_is_named(prepared_dir, tmp_path):
    work = tmp_path / "work"
    shutil.copytree(prepared_dir, work / "records")
    config = tmp_path / "c.yaml"
    save_config(small_train_config("records", "train.steps=2"), str(config))
    result = run_cli("train", "--config", str(config), "--model-dir", str(tmp_path / "m"), cwd=str(work))
    assert result.returncode == 0, result.stderr[-2000:]
    recorded = yaml.safe_load((tmp_path / "m" / "config.yaml").read_text())["data"]["dir"]
    assert recorded == str(work / "records")  # absolute
    ok = run_cli("evaluate", "--model-dir", str(tmp_path / "m"), "--max-images", "1", "--beam-size", "1",
                 cwd=str(tmp_path))
    assert ok.returncode == 0, ok.stderr[-2000:]
    shutil.move(str(work / "records"), str(tmp_path / "moved"))
    moved = run_cli("evaluate", "--model-dir", str(tmp_path / "m"), "--max-images", "1")
    assert_one_line(moved, "evaluate", str(work / "records"), "data.dir in", "--data-dir")
    ok = run_cli("evaluate", "--model-dir", str(tmp_path / "m"), "--max-images", "1", "--beam-size", "1",
                 "--data-dir", str(tmp_path / "moved"))
    assert ok.returncode == 0, ok.stderr[-2000:]


@pytest.mark.slow
def test_no_eval_split_is_needed_without_evaluation(shapes_dir, tmp_path):
    from captioning.errors import InputError
    from captioning.experiment import for_training
    from captioning.train import Trainer
    from data_prep.prepare import PrepareOptions, prepare

    records = str(tmp_path / "records")
    prepare(PrepareOptions(output_dir=records, split=coco_split_args(shapes_dir, ("train", "test")), workers=1,
                           min_word_count=1), progress=False)
    assert Trainer(for_training(small_train_config(records, "train.steps=2", "train.eval_every_steps=0")),
                   str(tmp_path / "m")).run(progress=False)["step"] == 2
    with pytest.raises(InputError, match="split 'val' is not in"):
        Trainer(for_training(small_train_config(records, "train.steps=4", "train.eval_every_steps=2")), str(tmp_path / "m2"))


@pytest.mark.slow
def test_the_record_of_how_a_model_was_trained_is_kept(model, prepared_dir):
    """The first run is conftest's trained_model_dir (60 steps with adam), copied: its record is one entry."""
    from captioning.experiment import for_training
    from captioning.train import Trainer

    def trainer(*overrides):
        return Trainer(for_training(small_train_config(  # trained_model_dir's config, then the overrides
            prepared_dir, "model.embedding_size=32", "model.lstm_units=32", "train.optimizer=adam",
            "train.learning_rate=0.01", "train.checkpoint_every_steps=60", *overrides)), str(model))

    model_dir = model
    config = (model_dir / "config.yaml").read_text()
    # a smaller train.steps in the finished folder: nothing to train, nothing rewritten
    assert trainer("train.steps=2").run(progress=False)["trained_steps"] == 0
    assert (model_dir / "config.yaml").read_text() == config
    # another optimizer from step 60 on: config.yaml says so, history.yaml keeps both
    trainer("train.steps=62", "train.optimizer=sgd").run(progress=False)
    assert yaml.safe_load((model_dir / "config.yaml").read_text())["train"]["optimizer"] == "sgd"
    history = yaml.safe_load((model_dir / "history.yaml").read_text())
    assert [(h["started_at_step"], h["config"]["train"]["optimizer"], h["config"]["train"]["steps"])
            for h in history] == [(0, "adam", 60), (60, "sgd", 62)]
    # the same config again (a resume): no new entry
    trainer("train.steps=62", "train.optimizer=sgd").run(progress=False)
    assert len(yaml.safe_load((model_dir / "history.yaml").read_text())) == 2


@pytest.mark.slow
def test_while_training_writes_readers_load_a_complete_checkpoint_and_a_second_train_is_refused(prepared_dir,
                                                                                               shapes_dir, tmp_path):
    """A checkpoint every step and only the last one kept: training replaces the checkpoint under the
    readers' feet all the time. Each reader loads a complete one and says which step it used. Two runs in
    one folder both trained and overwrote each other's checkpoints: a second `train` there is refused while
    the first runs, and works once it has stopped. (One training run for both: a process start-up fewer.)"""
    model_dir = tmp_path / "m"
    config = tmp_path / "c.yaml"
    save_config(small_train_config(prepared_dir, "train.steps=100000", "train.checkpoint_every_steps=1",
                                   "train.keep_checkpoints=1"), str(config))
    trainer = Cli(tmp_path, "train", "--config", str(config), "--model-dir", str(model_dir))
    try:
        trainer.wait_for_step(3)
        image = os.path.join(shapes_dir, "images", sorted(os.listdir(os.path.join(shapes_dir, "images")))[0])
        steps = []
        result = run_cli("caption", "--model-dir", str(model_dir), image)
        assert result.returncode == 0, result.stderr[-3000:]
        steps.append(int(re.search(r"restored \S+ckpt-(\d+) \(step (\d+)\)", result.stderr).group(2)))
        result = run_cli("evaluate", "--model-dir", str(model_dir), "--split", "test", "--beam-size", "1",
                         "--max-images", "2")
        assert result.returncode == 0, result.stderr[-3000:]
        steps.append(int(re.search(r"checkpoint step (\d+)", result.stdout).group(1)))
        assert steps == sorted(steps) and steps[0] >= 3 and steps[-1] > steps[0]  # newer and newer
        second = run_cli("train", "--config", str(config), "--model-dir", str(model_dir))
        assert_one_line(second, "train", f"another `captioning train` (process {trainer.proc.pid}) is training in "
                                         f"{model_dir}")
        assert "training from step" not in second.stderr
        assert trainer.proc.poll() is None  # training went on all along, undisturbed
    finally:
        trainer.proc.send_signal(signal.SIGTERM)
        trainer.wait()
    assert trainer.proc.returncode == 0
    again = run_cli("train", "--config", str(config), "--model-dir", str(model_dir), "--set", "train.steps=1")
    assert again.returncode == 0, again.stderr[-2000:]  # the lock went with the first run
