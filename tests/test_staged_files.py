"""StagedDirectory: a set of files lands whole or not at all, in a new directory or over an existing one."""

from __future__ import annotations

from pathlib import Path

import pytest

from condcomp.staged_files import StagedDirectory


def listing(directory: Path) -> dict[str, str]:
    return {p.name: p.read_text() for p in sorted(directory.parent.rglob("*")) if p.is_file()}


def test_files_land_in_a_new_directory_in_one_step(tmp_path: Path) -> None:
    target = tmp_path / "ckpt"
    with StagedDirectory(target) as stage:
        stage.path("a.bin").write_text("A")
        assert not target.exists()  # built beside it until the block ends
        stage.path("manifest.json").write_text("M")
    assert listing(target) == {"a.bin": "A", "manifest.json": "M"}


def test_an_error_leaves_the_old_files_and_no_temporaries(tmp_path: Path) -> None:
    target = tmp_path / "ckpt"
    target.mkdir()
    (target / "a.bin").write_text("old A")
    (target / "opt.bin").write_text("old opt")
    with pytest.raises(RuntimeError, match="disk full"), StagedDirectory(target, remove=["opt.bin"]) as stage:
        stage.path("a.bin").write_text("new A")
        raise RuntimeError("disk full")
    assert listing(target) == {"a.bin": "old A", "opt.bin": "old opt"}


def test_an_error_in_a_new_directory_leaves_nothing(tmp_path: Path) -> None:
    with pytest.raises(RuntimeError), StagedDirectory(tmp_path / "ckpt") as stage:
        stage.path("a.bin").write_text("A")
        raise RuntimeError
    assert list(tmp_path.iterdir()) == []


def test_overwriting_replaces_staged_files_and_removes_the_named_ones(tmp_path: Path) -> None:
    target = tmp_path / "ckpt"
    target.mkdir()
    (target / "a.bin").write_text("old A")
    (target / "opt.bin").write_text("old opt")
    with StagedDirectory(target, remove=["opt.bin", "absent.bin"]) as stage:
        stage.path("a.bin").write_text("new A")
    assert listing(target) == {"a.bin": "new A"}
