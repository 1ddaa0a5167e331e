"""A full disk under real commands: a checkpoint save, prepare's shards, evaluate's results and export each
stop with one line naming the path and what to do; what was complete stays complete and readable; once
there is space, the same command works in the same folder.

The disk is a small tmpfs mounted for the test where the test may mount one (root with CAP_SYS_ADMIN), and the
commands run in the test's process (no Python, TensorFlow and METEOR start-up to pay again); or else the commands
run in processes of their own under RLIMIT_FSIZE (a file may not grow past the limit: EFBIG), which exercises the
same error paths.
"""

import json
import os
import re
import resource
import shutil
import subprocess
import sys

import pytest

from captioning.config import save_config
from tests.helpers import REPO, coco_split_args, copy_model, run_cli, small_train_config


class SmallDisk:
    """A folder whose disk can be filled (``fill``) and freed again (``free``)."""

    def __init__(self, root):
        self.root, self.limit, self.mounted = str(root), None, False
        os.makedirs(self.root, exist_ok=True)
        if os.geteuid() == 0 and shutil.which("mount") and not os.environ.get("CAPTIONING_TEST_NO_MOUNT"):
            done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64m", "tmpfs", self.root], capture_output=True)
            self.mounted = done.returncode == 0

    def fill(self, leave: int, file_limit: int | None = None) -> None:
        """Leaves about ``leave`` bytes: a filler file on the tmpfs, or else a file-size limit of
        ``file_limit`` (default ``leave``) on every file the command writes."""
        if self.mounted:
            stat = os.statvfs(self.root)
            with open(os.path.join(self.root, ".filler"), "wb") as f:
                f.truncate(0)
                f.write(b"\0" * max(0, stat.f_bavail * stat.f_frsize - leave))
        else:
            self.limit = file_limit or leave

    def free(self) -> None:
        if self.mounted:
            os.remove(os.path.join(self.root, ".filler"))
        self.limit = None

    def run(self, *args, cwd=None):
        """``captioning ARGS``: in this process on the tmpfs (its space is what runs out), else in a process
        of its own, whose files may not grow past the limit."""
        if self.mounted:
            return run_cli(*args, cwd=cwd)
        limit = self.limit

        def cap():
            if limit is not None:
                resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

        env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", PYTHONPATH=REPO)
        return subprocess.run([sys.executable, "-m", "captioning", *args], capture_output=True, text=True,
                              cwd=cwd or REPO, env=env, timeout=600, stdin=subprocess.DEVNULL, preexec_fn=cap)

    def close(self):
        if self.mounted:
            subprocess.run(["umount", "-l", self.root], capture_output=True)


@pytest.fixture
def disk(tmp_path):
    small = SmallDisk(tmp_path / "disk")
    yield small
    small.close()


def assert_disk_full(result, command, *fragments):
    assert result.returncode == 1, (result.returncode, result.stderr[-3000:])
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith(f"captioning {command}: error: cannot write "), result.stderr[-3000:]
    assert re.search(r"no space left on the device|file is too large", last), last
    for fragment in fragments:
        assert fragment in last, last


@pytest.mark.slow
def test_a_checkpoint_save_on_a_full_disk_keeps_the_previous_one(disk, prepared_dir, tmp_path):
    model_dir = os.path.join(disk.root, "m")
    config = tmp_path / "c.yaml"
    save_config(small_train_config(prepared_dir, "train.steps=6", "train.checkpoint_every_steps=2",
                                   "train.log_every_steps=100"), str(config))
    first = disk.run("train", "--config", str(config), "--model-dir", model_dir, "--set", "train.steps=2")
    assert first.returncode == 0, first.stderr[-3000:]
    disk.fill(leave=200_000)  # a checkpoint of this model takes ~1 MB
    full = disk.run("train", "--config", str(config), "--model-dir", model_dir)
    assert_disk_full(full, "train", "checkpoint ckpt-4", model_dir, "resume from ckpt-2", "takes about 1.0 MB")
    import tensorflow as tf

    assert os.path.basename(tf.train.latest_checkpoint(model_dir)) == "ckpt-2"
    reader = tf.train.load_checkpoint(os.path.join(model_dir, "ckpt-2"))  # complete: every tensor reads
    assert all(reader.get_tensor(n) is not None for n in reader.get_variable_to_shape_map())
    disk.free()
    again = disk.run("train", "--config", str(config), "--model-dir", model_dir)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "resumed from" in again.stderr and "ckpt-2 at step 2" in again.stderr
    assert "trained to step 6" in again.stdout
    assert not [n for n in os.listdir(model_dir) if n.endswith("_temp")]


def test_prepare_on_a_full_disk_keeps_complete_shards_and_resumes(disk, shapes_dir, tmp_path):
    out = os.path.join(disk.root, "records")
    args = ["prepare", "--output-dir", out, "--workers", "1", "--shards", "train=8",
            *(f"--split={a}" for a in coco_split_args(shapes_dir))]
    disk.fill(leave=120_000, file_limit=20_000)  # room for a few of the ~40 KB train shards; or for none
    full = disk.run(*args)
    assert_disk_full(full, "prepare", out, "--resume")
    names = os.listdir(out)
    assert "manifest.json" not in names and not [n for n in names if n.endswith(".tmp")]
    import tensorflow as tf

    for name in names:  # every shard under its final name is complete: it reads to the end
        if name.endswith(".tfrecord"):
            assert sum(1 for _ in tf.data.TFRecordDataset(os.path.join(out, name))) > 0
    disk.free()
    resumed = disk.run(*args, "--resume")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    clean = tmp_path / "clean"
    assert run_cli(*args[:2], str(clean), *args[3:]).returncode == 0
    for name in os.listdir(clean):  # the resumed output is the clean run's, byte for byte
        if name.endswith(".tfrecord"):
            assert open(os.path.join(out, name), "rb").read() == open(clean / name, "rb").read(), name


@pytest.mark.slow
def test_evaluate_on_a_full_disk_keeps_earlier_results(disk, trained_model_dir):
    if not disk.mounted:  # a file-size limit also stops AutoGraph's temporary files long before these
        pytest.skip("needs a small tmpfs: evaluate's outputs are a few KB, smaller than TF's own temporary files")
    model_dir = os.path.join(disk.root, "m")
    copy_model(trained_model_dir, model_dir)
    ok = disk.run("evaluate", "--model-dir", model_dir, "--max-images", "1", "--beam-size", "1")
    assert ok.returncode == 0, ok.stderr[-3000:]
    kept = {n: open(os.path.join(model_dir, "eval", n), "rb").read() for n in os.listdir(os.path.join(model_dir, "eval"))}
    disk.fill(leave=1_000)
    full = disk.run("evaluate", "--model-dir", model_dir, "--beam-size", "1")
    assert_disk_full(full, "evaluate", os.path.join(model_dir, "eval"))
    assert "PTBTokenizer" not in full.stderr  # found full before an hour of decoding and scoring
    assert {n: open(os.path.join(model_dir, "eval", n), "rb").read()
            for n in os.listdir(os.path.join(model_dir, "eval"))} == kept  # earlier results intact, nothing partial
    disk.free()
    again = disk.run("evaluate", "--model-dir", model_dir, "--beam-size", "1", "--max-images", "2")
    assert again.returncode == 0, again.stderr[-3000:]
    assert len(os.listdir(os.path.join(model_dir, "eval"))) == len(kept) + 2


@pytest.mark.slow
def test_export_on_a_full_disk_keeps_the_earlier_export(disk, trained_model_dir):
    export = os.path.join(disk.root, "export")
    assert disk.run("export", "--model-dir", trained_model_dir, "--output", export).returncode == 0
    exported = {n: os.path.getsize(os.path.join(export, n)) for n in os.listdir(export)}
    disk.fill(leave=100_000, file_limit=300_000)  # the SavedModel's variables take ~1 MB
    full = disk.run("export", "--model-dir", trained_model_dir, "--output", export, "--beam-size", "2", "--overwrite")
    assert_disk_full(full, "export", export)
    assert {n: os.path.getsize(os.path.join(export, n)) for n in os.listdir(export)} == exported  # whole
    assert json.load(open(os.path.join(export, "captioning_export.json")))["decode"]["beam_size"] == 3
    assert sorted(n for n in os.listdir(disk.root) if not n.startswith(".")) == ["export"]  # no temporary folder
    disk.free()
    again = disk.run("export", "--model-dir", trained_model_dir, "--output", export, "--beam-size", "2", "--overwrite")
    assert again.returncode == 0, again.stderr[-3000:]
    assert json.load(open(os.path.join(export, "captioning_export.json")))["decode"]["beam_size"] == 2


def test_a_read_only_model_folder_is_refused_before_any_decoding(disk, trained_model_dir):
    if not disk.mounted:
        pytest.skip("needs a tmpfs to remount read-only")
    model_dir = os.path.join(disk.root, "m")
    copy_model(trained_model_dir, model_dir)
    subprocess.run(["mount", "-o", "remount,ro", disk.root], check=True)
    result = disk.run("evaluate", "--model-dir", model_dir, "--beam-size", "1")
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr[-3000:]
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("captioning evaluate: error: the evaluation result") and "Read-only file system" in last
    assert "caption test" not in result.stderr and "PTBTokenizer" not in result.stderr  # refused before the work
