"""Atomic writes: whole or nothing, no accidental overwrite, ordinary permissions."""

import os

import pytest

from ompmoe.io import OutputExistsError, atomic_path


def test_atomic_file_and_directory_get_umask_permissions(tmp_path):
    plain = tmp_path / "plain.txt"
    plain.write_text("x")
    (tmp_path / "plain_dir").mkdir()
    with atomic_path(tmp_path / "file.txt") as tmp:
        tmp.write_text("x")
    with atomic_path(tmp_path / "dir", directory=True) as tmp:
        (tmp / "inner").write_text("x")
    assert os.stat(tmp_path / "file.txt").st_mode == os.stat(plain).st_mode
    assert os.stat(tmp_path / "dir").st_mode == os.stat(tmp_path / "plain_dir").st_mode


def test_failure_leaves_nothing_and_existing_output_is_kept(tmp_path):
    with pytest.raises(RuntimeError, match="boom"):
        with atomic_path(tmp_path / "out", directory=True) as tmp:
            (tmp / "half").write_text("x")
            raise RuntimeError("boom")
    assert list(tmp_path.iterdir()) == []
    (tmp_path / "keep.txt").write_text("old")
    with pytest.raises(OutputExistsError, match="keep.txt already exists; pass overwrite=True"):
        with atomic_path(tmp_path / "keep.txt"):
            pass
    with pytest.raises(RuntimeError):
        with atomic_path(tmp_path / "keep.txt", overwrite=True) as tmp:
            tmp.write_text("new")
            raise RuntimeError("fail")
    assert (tmp_path / "keep.txt").read_text() == "old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["keep.txt"]
