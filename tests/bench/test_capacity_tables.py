"""benchmarks/capacity_tables.py: the capacity tables' command, on a small generated trace."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "capacity_tables.py"


def _run(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=300,
                          cwd=tmp_path)


def test_one_table_per_trace_with_the_ratio_to_the_best_baseline(tmp_path):
    proc = _run(tmp_path, "--traces", "short_chat:0.9", "--topologies", "1P2D", "--seeds", "0,1",
                "--policies", "round_robin,least_loaded,slo_goodput", "--generated-requests", "300",
                "--capacity-steps", "2", "--jobs", "1", "--json", "out.json", "--markdown", "out.md")
    assert proc.returncode == 0, proc.stderr
    data = json.loads((tmp_path / "out.json").read_text())
    caps = {(r["seed"], r["policy"]): r["capacity_rps"] for r in data["results"]}
    assert len(caps) == 6 and all(c and c > 0 for c in caps.values())
    table = (tmp_path / "out.md").read_text().splitlines()
    assert table[0] == "`short_chat` at 90% attainment, req/s:"
    assert table[2] == "| policy | 1P2D seed 0 | 1P2D seed 1 |"
    ratio = table[-2].split(" | ")[1:]
    for seed, cell in zip((0, 1), ratio):
        best = max(caps[(seed, "round_robin")], caps[(seed, "least_loaded")])
        assert cell.startswith(f"{caps[(seed, 'slo_goodput')] / best:.2f}× "), cell


def test_an_unknown_trace_is_refused_before_any_search_and_writes_nothing(tmp_path):
    proc = _run(tmp_path, "--traces", "no_such_trace", "--json", "out.json", "--markdown", "out.md")
    assert proc.returncode == 2 and "no_such_trace" in proc.stderr
    assert not (tmp_path / "out.json").exists() and not (tmp_path / "out.md").exists()
