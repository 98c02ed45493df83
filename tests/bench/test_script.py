"""disagg.bench.script: the benchmarks' log line, run metadata and result file."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest

from disagg.bench.script import log, run_metadata, write_result


def test_a_result_carries_the_facts_of_its_run(tmp_path):
    path = tmp_path / "runs" / "result.json"  # the folder is created
    write_result(path, {"p99_ms": math.nan, "trace": Path("data/t.csv"), "rows": [1, 2]}, argv=["bench.py", "--x"])
    got = json.loads(path.read_text())
    assert {k: got[k] for k in ("p99_ms", "trace", "rows")} == {"p99_ms": None, "trace": "data/t.csv", "rows": [1, 2]}
    run = got["run"]
    assert run["command"].endswith("bench.py --x")
    assert re.fullmatch(r"[0-9a-f]{40}", run["git_commit"]) and isinstance(run["git_dirty"], bool)
    assert run["cpus"] >= 1 and run["python"].count(".") == 2 and run["date"].endswith("+00:00")
    assert set(run) == {"command", "date", "git_commit", "git_dirty", "cpu_model", "cpus", "python"}


def test_a_write_that_fails_midway_leaves_the_old_file_whole_and_no_partial_one(tmp_path):
    path = tmp_path / "result.json"
    write_result(path, {"old": True})
    old = path.read_text()
    bad = {"rows": ["x" * 100_000] * 20, "by_pair": {("a", "b"): 1}}  # a tuple key: json.dump fails after the rows
    with pytest.raises(TypeError):
        write_result(path, bad)
    assert path.read_text() == old
    with pytest.raises(TypeError):
        write_result(tmp_path / "new.json", bad)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["result.json"]  # no temporary file, no stub


def test_log_lines_carry_the_time_of_day_and_leave_stdout_to_the_results(capsys):
    log("round 1: 42 tok/s")
    out, err = capsys.readouterr()
    assert out == "" and re.fullmatch(r"\[\d\d:\d\d:\d\d\] round 1: 42 tok/s\n", err)


def test_the_command_line_defaults_to_this_process(monkeypatch):
    monkeypatch.setattr("sys.argv", ["benchmarks/memory.py", "--json", "out.json"])
    assert run_metadata()["command"].endswith("benchmarks/memory.py --json out.json")
