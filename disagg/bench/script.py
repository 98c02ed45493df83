"""What every benchmark script (benchmarks/*.py) shares: its log lines, the facts of its run, and
its result file.

- `log(msg)`: one progress line with the time of day, on stderr (stdout carries the results: the
  tables, the JSON a script prints), flushed at once;
- `run_metadata()`: what a figure needs beside it to be reproduced or doubted: the git commit (and
  whether the working tree had uncommitted changes), the host's CPU model and count, the Python
  version, the date (UTC) and the command line;
- `write_result(path, result)`: the result with `run_metadata()` under "run", as JSON through
  `disagg.files.atomic_write` (a crash or Ctrl-C leaves the old file or none, never half of one).
  NaN and infinities become null, values JSON has no type for (paths, say) their text.

The benchmarks import it like any other project module (`from disagg.bench.script import log`).
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import time
from datetime import datetime, timezone
from functools import cache
from pathlib import Path

from disagg.files import atomic_write, json_safe

CHECKOUT = Path(__file__).resolve().parents[2]  # the repository, when the package runs from one


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def run_metadata(argv: list[str] | None = None) -> dict:
    """The facts of this run; `argv` defaults to this process's command line."""
    return {
        "command": " ".join([sys.executable, *(sys.argv if argv is None else argv)]),
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        **git_state(),
        "cpu_model": cpu_model(), "cpus": os.cpu_count(), "python": platform.python_version(),
    }


def write_result(path: str | os.PathLike[str], result: dict, argv: list[str] | None = None) -> None:
    """`result` and the run's metadata (under "run") as indented JSON, written atomically."""
    with atomic_write(path) as f:
        json.dump(json_safe({**result, "run": run_metadata(argv)}), f, indent=2, default=str)
        f.write("\n")


@cache
def git_state() -> dict:
    """{"git_commit", "git_dirty"} of the checkout the package runs from; None for both outside one."""
    def git(*args: str) -> str | None:
        try:
            out = subprocess.run(["git", "-C", str(CHECKOUT), *args], capture_output=True, text=True, timeout=10)
        except (OSError, subprocess.TimeoutExpired):
            return None
        return out.stdout if out.returncode == 0 else None

    commit = git("rev-parse", "HEAD")
    status = git("status", "--porcelain", "--untracked-files=no") if commit else None
    return {"git_commit": commit.strip() if commit else None, "git_dirty": bool(status) if commit else None}


@cache
def cpu_model() -> str | None:
    """The CPU's model name (Linux's /proc/cpuinfo, else what `platform` knows)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() == "model name":
                    return value.strip()
    except OSError:
        pass
    return platform.processor() or None
