"""disagg.files: an output file is the old one or the whole new one, never a mixture or a stub."""

from __future__ import annotations

import json
import math
import os
import stat

import pytest

from disagg.files import SHARED, atomic_write, json_safe, write_json_atomic, write_text_atomic


def _mode(path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_the_target_keeps_its_old_content_while_writing_and_after_a_failure(tmp_path):
    path = tmp_path / "results.json"
    path.write_text("old")
    with pytest.raises(RuntimeError, match="midway"):
        with atomic_write(path) as f:
            f.write("half of the new")
            f.flush()
            assert path.read_text() == "old"  # a reader meanwhile sees the old file whole
            raise RuntimeError("midway")
    assert path.read_text() == "old"
    assert [p.name for p in tmp_path.iterdir()] == ["results.json"]  # no temporary file left behind


def test_a_failed_first_write_leaves_no_file(tmp_path):
    with pytest.raises(KeyboardInterrupt):
        with atomic_write(tmp_path / "new.csv") as f:
            f.write("a,b\n")
            raise KeyboardInterrupt
    assert list(tmp_path.iterdir()) == []


def test_the_data_reaches_the_disk_before_the_rename(tmp_path, monkeypatch):
    calls = []
    real_fsync, real_replace = os.fsync, os.replace
    monkeypatch.setattr(os, "fsync", lambda fd: (calls.append("fsync"), real_fsync(fd)))
    monkeypatch.setattr(os, "replace", lambda a, b: (calls.append("replace"), real_replace(a, b)))
    write_text_atomic(tmp_path / "x.md", "new\n")
    assert calls == ["fsync", "replace"]
    assert (tmp_path / "x.md").read_text() == "new\n"


def test_a_failing_rename_keeps_the_old_file_and_removes_the_temporary_one(tmp_path, monkeypatch):
    path = tmp_path / "trace.csv"
    path.write_text("old")

    def refuse(a, b):
        raise OSError("disk gone")

    monkeypatch.setattr(os, "replace", refuse)
    with pytest.raises(OSError, match="disk gone"):
        write_text_atomic(path, "new")
    assert path.read_text() == "old"
    assert [p.name for p in tmp_path.iterdir()] == ["trace.csv"]


def test_modes_folders_and_bytes(tmp_path):
    private, shared = tmp_path / "a" / "b" / "private.txt", tmp_path / "shared.md"
    write_text_atomic(private, "x")  # missing folders are made
    write_text_atomic(shared, "y", permissions=SHARED)
    assert (private.read_text(), _mode(private)) == ("x", 0o600)  # tempfile.mkstemp's, as before
    assert (shared.read_text(), _mode(shared)) == ("y", 0o644)
    with atomic_write(tmp_path / "blob.png", "wb") as f:
        f.write(b"\x89PNG\x00")
    assert (tmp_path / "blob.png").read_bytes() == b"\x89PNG\x00"
    with pytest.raises(ValueError, match="mode"):
        with atomic_write(tmp_path / "z", "a"):
            pass


def test_newline_is_passed_through_for_csv(tmp_path):
    with atomic_write(tmp_path / "t.csv", newline="") as f:
        f.write("a\r\nb\n")
    assert (tmp_path / "t.csv").read_bytes() == b"a\r\nb\n"


def test_json_is_indented_with_a_final_newline_and_json_safe_nulls_non_finite_numbers(tmp_path):
    path = tmp_path / "r.json"
    write_json_atomic(path, json_safe({"a": [1.5, math.nan], "b": {"c": -math.inf}, "d": "x"}))
    assert path.read_text() == json.dumps({"a": [1.5, None], "b": {"c": None}, "d": "x"}, indent=2) + "\n"
