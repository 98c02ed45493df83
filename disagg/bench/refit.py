"""Fitting the app's constants again between live runs (`disagg validate --refit`,
`benchmarks/live_repeats.py --refit`).

A shared host drifts: two fits of one CPU host within an hour put its engines on 0.84 and 1.08
cores, and a run half an hour after the app's start-up fit can find its engines 1.5× slower than
fitted (docs/results.md). A study that runs for an hour then judges its later runs against
constants that no longer describe the host. Fitting again before each run judges every run
against constants minutes old. A run already finished is kept as it is; one begun and not finished
cannot resume under other constants (the bench refuses), so it is named rather than overwritten.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Callable

from disagg.bench.harness import SETTINGS_FILE, BenchError
from disagg.bench.report import RESULTS_JSON
from disagg.cli.common import as_typed, live_fit_argv

FIT_TIMEOUT_S = 600.0


def finished(out: Path) -> dict | None:
    """The results of the finished bench run in `out`, or None (not begun, or not finished)."""
    try:
        return json.loads((out / RESULTS_JSON).read_text())
    except (OSError, ValueError):
        return None


def before_run(out: Path, refit: Callable[[], None], log: Callable[[str], None]) -> dict | None:
    """The results of the bench run in `out` if it has finished (it is not run again: resumed, it
    would meet the later fit's constants); else fit again before it and None. BenchError when it
    was begun and not finished: it would resume against other constants than it began with."""
    done = finished(out)
    if done is not None:
        return done
    if (out / SETTINGS_FILE).exists():
        raise BenchError(f"{out} was begun with constants the app has since re-fitted: remove the folder to run "
                         "it again after a fresh fit, or resume it without --refit")
    log(f"re-fitting the app's constants on its live engines before {out}")
    refit()
    return None


def app_refit(url: str, into: Path, log: Callable[[str], None]) -> Callable[[], None]:
    """A function that fits every served model's constants on the app's live engines and has the
    routers price with them (`live_fit_argv`, the start-up fit of `make run`), into `into` (the
    router's `cost_model_dir`); BenchError naming the model and the command when a fit fails."""
    def refit() -> None:
        from disagg.app_client import AppClient, AppError

        try:
            with AppClient(url, timeout_s=60.0) as app:
                models = app.state()["models"]
        except (AppError, KeyError) as e:
            raise BenchError(f"--refit: reading the app's models: {e}") from None
        into.mkdir(parents=True, exist_ok=True)
        for name, m in models.items():
            shared = (m.get("cost_model_constants") or {}).get("shared_host") is not None
            cmd = live_fit_argv(url, name, str(into / f"refit-{name}.yaml"), shared, 30)
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=FIT_TIMEOUT_S)
            if proc.returncode != 0:
                why = (proc.stderr.strip().splitlines() or ["no output"])[-1]
                raise BenchError(f"--refit: fitting {name} failed ({why}); the runs so far are kept. "
                                 f"Alone: {as_typed(cmd)}")
            for line in proc.stdout.splitlines():
                if line.startswith(("held-out", "shared host", "SLO")):
                    log(f"  {name}: {line}")
    return refit
