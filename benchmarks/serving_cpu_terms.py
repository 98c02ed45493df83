"""What the serving path's CPU follows: tokens, or engine steps and messages? Measured on a running app.

Usage (the CPU profile running on this machine, e.g. `make run`; nothing else on the machine):

    .venv/bin/python benchmarks/serving_cpu_terms.py --url http://127.0.0.1:8000 --rounds 2 \
        --json runs/serving-cpu-terms.json

Each round: an idle window, then windows of streams of 128 tokens at 1, 2, 4, 8 and 16 at once,
then short requests (4 tokens, 8 at a time), all through the app. In each, the serving path's CPU
is the host's (/proc/stat, less this process's) above its idle rate, less the engines' processes'
above theirs (as `disagg calibrate --live --host` reads them), beside what the window served: the
tokens, the messages of tokens the client received, the engines' steps (`/admin/state`'s
`steps`) and the requests. Two models are fitted over every window of every round by
non-negative least squares, and each window's error under each is reported:
- per token: CPU = tokens · a + requests · r (the host model before steps and messages were counted);
- per step and message: CPU = steps · s + messages · e + requests · r (the model now).
The model that holds a constant per unit across concurrencies is the one the host fit can measure
in one set of windows and the simulator can apply at any load.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import urllib.request
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from calibration.fit import nnls  # noqa: E402
from calibration.host import STEPS_SETTLE_S, _cpu_of, _load, engine_processes_running, engine_steps  # noqa: E402
from calibration.live import Fleet  # noqa: E402
from disagg.bench.script import log, write_result  # noqa: E402

TOKENS = 128
STREAMS = (1, 2, 4, 8, 16)
REQUESTS_PER_STREAM = 3
SHORT = (120, 8, 4)  # requests, at once, tokens


def state(url: str) -> dict:
    with urllib.request.urlopen(f"{url}/admin/state", timeout=30) as r:
        return json.load(r)


def steps_so_far(url: str) -> int:
    return engine_steps(state(url)["instances"])


async def window(url: str, model: str, pids: tuple[int, ...], idle: tuple[float, float], requests: int,
                 at_once: int, tokens: int, seed: int) -> dict:
    """One loaded window: what it served and the serving path's CPU above idle."""
    steps0 = steps_so_far(url)
    cpu, engines, wall, (streamed, events) = await _cpu_of(
        lambda: _load(url, model, requests, at_once, tokens, seed), pids)
    await asyncio.sleep(STEPS_SETTLE_S)
    serving = (cpu - idle[0] * wall) - (engines - idle[1] * wall)
    return {"at_once": at_once, "tokens_each": tokens, "requests": requests, "tokens": streamed, "events": events,
            "steps": steps_so_far(url) - steps0, "wall_s": round(wall, 3), "serving_cpu_s": round(serving, 4),
            "tokens_per_event": round(streamed / max(1, events), 2)}


def fit(windows: list[dict], columns: tuple[str, ...]) -> tuple[dict[str, float], list[float]]:
    """Non-negative least squares of the serving CPU on `columns`; (the terms, each window's relative error)."""
    a = np.array([[w[c] for c in columns] for w in windows], dtype=float)
    b = np.array([w["serving_cpu_s"] for w in windows], dtype=float)
    x = np.array(nnls(a, b))
    pred = a @ x
    return dict(zip(columns, map(float, x))), [float((p - y) / y) if y > 0 else float("nan") for p, y in zip(pred, b)]


async def run(url: str, rounds: int, idle_s: float, seed: int) -> dict:
    fleet = Fleet.from_state(state(url), None)
    pids = engine_processes_running(fleet.engine_pids, fleet.replica_pids)
    windows = []
    for r in range(rounds):
        idle_cpu, idle_engines, wall, _ = await _cpu_of(lambda: asyncio.sleep(idle_s), pids)
        idle = (idle_cpu / wall, idle_engines / wall)
        log(f"round {r + 1}: idle {idle[0]:.3f} cores, engines {idle[1]:.3f}")
        plan = [(n * REQUESTS_PER_STREAM, n, TOKENS) for n in STREAMS] + [SHORT]
        for requests, at_once, tokens in plan:
            w = await window(url, fleet.model, pids, idle, requests, at_once, tokens, seed * 1000 + r)
            w["round"] = r + 1
            log(json.dumps(w))
            windows.append(w)
    per_token, token_errors = fit(windows, ("tokens", "requests"))
    per_step, step_errors = fit(windows, ("steps", "events", "requests"))
    for w, e1, e2 in zip(windows, token_errors, step_errors):
        w["error_per_token_model"], w["error_per_step_model"] = round(e1, 3), round(e2, 3)

    def spread(errors: list[float]) -> dict:
        absolute = sorted(abs(e) for e in errors)
        return {"median_abs": round(statistics.median(absolute), 3), "max_abs": round(absolute[-1], 3)}

    return {"windows": windows,
            "per_token_model": {"terms_s": {k: round(v, 7) for k, v in per_token.items()}, **spread(token_errors)},
            "per_step_model": {"terms_s": {k: round(v, 7) for k, v in per_step.items()}, **spread(step_errors)}}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--url", required=True)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--idle-s", type=float, default=6.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", required=True)
    args = ap.parse_args()
    result = asyncio.run(run(args.url, args.rounds, args.idle_s, args.seed))
    for name in ("per_token_model", "per_step_model"):
        log(f"{name}: {json.dumps(result[name])}")
    write_result(args.json, {"settings": vars(args), **result})
    return 0


if __name__ == "__main__":
    sys.exit(main())
