"""The one atomic-write helper (captioning.fileio): a file or folder is absent, old, or complete."""

import os

import pytest

from captioning.fileio import atomic_file, atomic_folder, atomic_write_json


def test_atomic_file_replaces_only_when_complete(tmp_path):
    path = tmp_path / "out.txt"
    path.write_text("old")
    with pytest.raises(RuntimeError):
        with atomic_file(str(path), "w") as f:
            f.write("half of the new")
            raise RuntimeError("killed mid-write")
    assert path.read_text() == "old"
    assert os.listdir(tmp_path) == ["out.txt"]  # the temporary file went with the failure
    with atomic_file(str(path), "w") as f:
        f.write("new")
    assert path.read_text() == "new" and os.listdir(tmp_path) == ["out.txt"]


def test_atomic_file_with_a_fixed_temporary_name(tmp_path):
    """prepare's shards use NAME.tmp (a crash leaves it for the next run to find)."""
    path = tmp_path / "s.tfrecord"
    with atomic_file(str(path), tmp=str(path) + ".tmp") as f:
        f.write(b"abc")
        assert sorted(os.listdir(tmp_path)) == ["s.tfrecord.tmp"] and f.tell() == 3
    assert path.read_bytes() == b"abc" and os.listdir(tmp_path) == ["s.tfrecord"]


def test_atomic_folder_swaps_in_a_complete_folder_and_keeps_the_old_on_failure(tmp_path):
    target = tmp_path / "export"
    with atomic_folder(str(target)) as tmp:
        assert os.listdir(tmp) == [] and not target.exists()
        atomic_write_json(os.path.join(tmp, "a.json"), {"v": 1})
    assert os.listdir(target) == ["a.json"]
    with pytest.raises(OSError):
        with atomic_folder(str(target)) as tmp:
            atomic_write_json(os.path.join(tmp, "b.json"), {"v": 2})
            raise OSError(28, "No space left on device")
    assert os.listdir(target) == ["a.json"]  # untouched
    assert sorted(os.listdir(tmp_path)) == ["export"]  # no temporary or old folder left
    with atomic_folder(str(target)) as tmp:
        atomic_write_json(os.path.join(tmp, "b.json"), {"v": 2})
    assert os.listdir(target) == ["b.json"] and sorted(os.listdir(tmp_path)) == ["export"]
