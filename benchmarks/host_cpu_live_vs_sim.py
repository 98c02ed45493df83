"""Where the shared host's CPU goes under a trace's load, live, against what the model charges for it.

Usage (the CPU profile running on this machine, e.g. `make run`; nothing else on the machine):

    .venv/bin/python benchmarks/host_cpu_live_vs_sim.py --url http://127.0.0.1:8000 \
        --trace azure_conv_2023 --policies colocated,slo_goodput --rates 1.5,3,6 --max-requests 80 \
        --realtime --refit runs --out runs/host-cpu

For each rate: an idle window (`--idle-s`: each part's CPU at rest), then one live `disagg bench`
run (its gates, constants check and records as usual; `--refit DIR` fits the router's constants on
the live engines first, as `disagg validate --refit` does) that reads every process of the Ray
session from /proc around each policy's load, then the simulator on the same requests with the
constants that run judged with (`disagg validate`'s simulation of a live run). Parts:
- `prefill_steps`, `decode_steps`: vLLM's EngineCore and worker processes of the prefill and the
  decode engines, their compute;
- `serving`: the engine replicas (output processing), routers, Serve's proxy, Ray and this client.

Per (rate, policy, trace) it reports, in CPU seconds over the run:
- each role's engine steps live against the compute the simulator's engines of that role asked
  for (their steps' seconds alone) — above 1, the live steps cost more than the fitted step model
  says (per-step work the fit does not see, spinning while a KV hand-off is pending, contention's
  own cost);
- the simulator's steps as stretched by its shared host over the same seconds alone: the stretch it
  applied on average;
- the serving path live above its idle rate against what the shared host's terms charge for the
  run's own counts: `request_cpu_s` × requests + `step_cpu_s` × the engines' steps (as the engines
  counted them, read from `/admin/state` around the run) + `event_cpu_s` × the messages the client
  received + `token_cpu_s` × tokens; and its idle rate against `idle_cores`;
- the host's cores in use live (every part, over the run's window) against its `cores`.

`--at-run-speed` (after a measurement, offline): each run simulated again twice, beside the
simulation at the fitted constants, with TTFT and TPOT p50 and p90 of all four:
- `sim_at_run_speed`: every engine step time scaled by that run's own speed, its engines' CPU live
  over the compute its simulation asked for;
- `sim_at_run_serving`: the serving path's work per step, message and token scaled to what the run
  measured (its serving CPU above idle less the fitted CPU per request, over what the terms charge
  for the same), and the stack's idle cores as the run measured them.
Where one closes the gap, the model's shape holds and what it misses is that term's value under the
run's load; where neither does, the shape is wrong. A diagnosis, not a prediction: the values are
read from the very run they are compared with.
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from memory import cpu_by  # noqa: E402  (benchmarks/memory.py)

from calibration.host import engine_steps  # noqa: E402
from disagg.bench.harness import COST_MODEL_FILE, RECORDS_FILE, BenchConfig, BenchError, run_bench  # noqa: E402
from disagg.bench.records import LIVE  # noqa: E402
from disagg.bench.refit import app_refit, before_run  # noqa: E402
from disagg.bench.report import RESULTS_JSON  # noqa: E402
from disagg.bench.script import log, write_result  # noqa: E402
from disagg.bench.validate import simulate_live_run  # noqa: E402
from disagg.core.cost_model import CostModel, load_profile  # noqa: E402
from disagg.stats import percentile  # noqa: E402
from disagg.user_input import resolve_trace  # noqa: E402

ROLES = ("prefill", "decode")
_STAT_PARTS = (("ttft", 50), ("ttft", 90), ("tpot", 50), ("tpot", 90))
STATS = tuple(f"{m}_p{q}_ms" for m, q in _STAT_PARTS)
PROMPT_SPLIT = 512  # short and long prompts, for where the simulated TTFT parts from the live one
PARTS = ("prefill_steps", "decode_steps", "serving")


def part_of(k: str) -> str:
    """The part of a process of `kind` (benchmarks/memory.py); vLLM's of an unknown replica are a decode's."""
    if "EngineCore" not in k and not k.startswith("vLLM"):
        return "serving"
    return "prefill_steps" if k.startswith("prefill") else "decode_steps"


def cpu_by_part(url: str | None = None) -> dict[str, float]:
    """CPU seconds so far of every process of the Ray session, by part, and this client's own; with
    the app's `url`, the steps its engines have made so far too (`engine_steps`)."""
    out = cpu_by(lambda kind, _comm: part_of(kind), PARTS)
    out["serving"] += time.process_time()  # the load generator shares the cores too
    if url is not None:
        with urllib.request.urlopen(f"{url}/admin/state", timeout=30) as r:
            out["engine_steps"] = float(engine_steps(json.load(r)["instances"]))
    return out


def idle_rates(seconds: float) -> dict[str, float]:
    """Each part's CPU at rest, in cores."""
    c0, t0 = cpu_by_part(), time.monotonic()
    time.sleep(seconds)
    c1 = cpu_by_part()
    dt = time.monotonic() - t0
    return {p: (c1[p] - c0[p]) / dt for p in PARTS}


def compare(live: dict, sim: dict, idle: dict[str, float], records: list[dict], host: dict) -> dict:
    """One run's comparison (module docstring); `live`/`sim` its rows of the bench's results.json,
    `records` its live requests, `host` the shared host's constants it judged with."""
    cpu, window = live["host_cpu_s"], live["host_cpu_s"]["window_s"]
    engines = sim["engine_time"]["engines"]
    work = {r: sum(e["work_s"] for iid, e in engines.items() if iid.startswith(r)) for r in ROLES}
    stepping = sum(e["stepping_s"] for e in engines.values())
    steps_live = {r: cpu[f"{r}_steps"] for r in ROLES}
    tokens = sum(r["output_tokens"] or 0 for r in records if not r.get("error"))
    requests = sum(1 for r in records if not r.get("error"))
    events = sum(r.get("content_events") or 0 for r in records if not r.get("error"))
    steps = cpu.get("engine_steps", 0.0)
    path = host["step_cpu_s"] * steps + host["event_cpu_s"] * events + host["token_cpu_s"] * tokens
    serving_model = host["request_cpu_s"] * requests + path
    serving_live = cpu["serving"] - idle["serving"] * window
    return {
        "requests": requests, "tokens": tokens, "events": events, "engine_steps": int(steps),
        "window_s": round(window, 2),
        "sim_makespan_s": round(sim["engine_time"]["makespan_s"], 2),
        **{f"{r}_steps_live_s": round(steps_live[r], 2) for r in ROLES},
        **{f"{r}_work_sim_s": round(work[r], 2) for r in ROLES},
        **{f"{r}_live_over_sim": round(steps_live[r] / work[r], 2) if work[r] > 0 else None for r in ROLES},
        "sim_mean_stretch": round(stepping / sum(work.values()), 2) if sum(work.values()) > 0 else None,
        "serving_live_s": round(serving_live, 2), "serving_model_s": round(serving_model, 2),
        "serving_path_model_s": round(path, 3),
        "serving_live_over_model": round(serving_live / serving_model, 2) if serving_model > 0 else None,
        "idle_live_cores": round(sum(idle.values()), 3), "idle_model_cores": host["idle_cores"],
        "host_cores_live": round(sum(cpu[p] for p in PARTS) / window, 2), "host_cores": host["cores"],
    }


def scaled(cm: CostModel, factor: float) -> CostModel:
    """`cm` with every engine's step times `factor` times as long."""
    def one(e):
        return e.model_copy(update={k: getattr(e, k) * factor for k in (
            "step_base_s", "decode_seq_s", "prefill_token_s", "prefill_attention_s", "prefill_overhead_s")})
    return cm.model_copy(update={"engine": one(cm.engine), "instances": {k: one(e) for k, e in cm.instances.items()}})


def at_serving(cm: CostModel, row: dict) -> CostModel:
    """`cm` with its shared host's work per step, message and token scaled to what the run of `row`
    measured of them, and its idle cores as the run measured them."""
    host = cm.shared_host
    live = max(0.0, row["serving_live_s"] - host.request_cpu_s * row["requests"])
    factor = live / row["serving_path_model_s"] if row.get("serving_path_model_s") else 1.0
    return cm.model_copy(update={"shared_host": host.model_copy(update={
        **{k: min(getattr(host, k) * factor, 0.1) for k in ("step_cpu_s", "event_cpu_s", "token_cpu_s")},
        "idle_cores": min(row["idle_live_cores"], host.cores)})})


def latency(records: list[dict]) -> dict[str, float | None]:
    """TTFT and TPOT p50 and p90 of finished requests (`STATS`), in ms."""
    ok = [r for r in records if not r.get("error")]
    return {f"{m}_p{q}_ms": (round(percentile([r[f"{m}_s"] for r in ok if r[f"{m}_s"] is not None], q) * 1e3, 1)
                             if ok else None) for m, q in _STAT_PARTS}


def by_prompt(live: list[dict], simulated: list[dict]) -> dict[str, list[float]]:
    """Each request's live TTFT over its simulated one, by prompt length (`PROMPT_SPLIT`), sorted."""
    sim = {r["index"]: r for r in simulated if not r.get("error")}
    out: dict[str, list[float]] = {f"<{PROMPT_SPLIT}": [], f">={PROMPT_SPLIT}": []}
    for r in live:
        s = sim.get(r["index"])
        if s is not None and not r.get("error") and s["ttft_s"]:
            key = f"<{PROMPT_SPLIT}" if r["prompt_tokens"] < PROMPT_SPLIT else f">={PROMPT_SPLIT}"
            out[key].append(r["ttft_s"] / s["ttft_s"])
    return {k: sorted(v) for k, v in out.items()}


def at_run_speed(out: Path) -> list[dict]:
    """`--at-run-speed` (module docstring), from the measurement in `out`."""
    measured = json.loads((out / "host_cpu.json").read_text())
    # each trace's file by the name the bench gives it
    paths = {p.name.split(".")[0]: str(p) for p in map(resolve_trace, measured["settings"]["trace"])}
    rows = []
    for row in measured["rows"]:
        rate, policy, trace = row["rate"], row["policy"], row["trace"]
        live_dir, sim_dir = out / f"rate-{rate:g}", out / "sim" / f"rate-{rate:g}"
        live_steps = sum(row[f"{r}_steps_live_s"] for r in ROLES)
        factor = live_steps / sum(row[f"{r}_work_sim_s"] for r in ROLES)
        fast_dir = out / "sim-at-run-speed" / f"rate-{rate:g}" / f"{policy}-{trace}"
        slices = {"traces": [paths[trace]], "policies": [policy], "max_requests": measured["settings"]["max_requests"],
                  "seed": measured["settings"]["seed"]}
        cm = load_profile(live_dir / COST_MODEL_FILE)
        simulate_live_run(live_dir, slices, scaled(cm, factor), fast_dir, False, log)
        serving_dir = out / "sim-at-run-serving" / f"rate-{rate:g}" / f"{policy}-{trace}"
        simulate_live_run(live_dir, slices, at_serving(cm, row), serving_dir, False, log)

        def mine(folder: Path, system: str) -> list[dict]:
            return [r for r in map(json.loads, (folder / RECORDS_FILE).read_text().splitlines())
                    if r["system"] == system and r["policy"] == policy and r["trace"] == trace]

        got = {"rate": rate, "policy": policy, "trace": trace, "speed": round(factor, 2)}
        live = mine(live_dir, LIVE)
        got["live"] = latency(live)
        for label, folder in (("sim", sim_dir), ("sim_at_run_speed", fast_dir), ("sim_at_run_serving", serving_dir)):
            simulated = mine(folder, "sim")
            got[label] = {**latency(simulated), "live_over_sim_ttft": by_prompt(live, simulated)}
        log(json.dumps(got))
        rows.append(got)
    return rows


def summarize(rows: list[dict]) -> dict:
    """Per simulation: the median error of each latency statistic over the runs, how many of all
    within 15% of live, and the median of live over simulated TTFT per request by prompt length."""
    out = {}
    for label in ("sim", "sim_at_run_speed", "sim_at_run_serving"):
        errors = {k: [(r[label][k] - r["live"][k]) / r["live"][k] for r in rows if r["live"][k] and r[label][k]]
                  for k in STATS}
        every = [e for v in errors.values() for e in v]
        ratios = {b: [x for r in rows for x in r[label]["live_over_sim_ttft"][b]]
                  for b in rows[0][label]["live_over_sim_ttft"]} if rows else {}
        out[label] = {"median_error": {k: round(statistics.median(v), 3) for k, v in errors.items() if v},
                      "within_15pct": f"{sum(abs(e) <= 0.15 for e in every)} of {len(every)}",
                      "live_over_sim_ttft_median": {b: round(statistics.median(v), 2) for b, v in ratios.items() if v}}
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--url")
    ap.add_argument("--trace", action="append")
    ap.add_argument("--policies", default="colocated,slo_goodput")
    ap.add_argument("--rates", default="1.5,3,6")
    ap.add_argument("--max-requests", type=int, default=80)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--idle-s", type=float, default=15.0)
    ap.add_argument("--realtime", action="store_true", help="the generator under SCHED_FIFO (as disagg bench)")
    ap.add_argument("--refit", metavar="DIR", help="fit the router's constants on the live engines before each rate")
    ap.add_argument("--out", required=True)
    ap.add_argument("--json", help="the comparison (default: OUT/host_cpu.json)")
    ap.add_argument("--at-run-speed", action="store_true",
                    help="offline, from a measurement in --out: each run simulated again at its own speed")
    args = ap.parse_args()
    out, policies = Path(args.out), tuple(args.policies.split(","))
    if args.at_run_speed:
        rows = at_run_speed(out)
        summary = summarize(rows)
        print(json.dumps(summary, indent=1))
        write_result(args.json or str(out / "at_run_speed.json"), {"settings": vars(args), "rows": rows,
                                                                    "summary": summary})
        return 0
    if not args.url or not args.trace:
        ap.error("a measurement needs --url and at least one --trace")
    traces = tuple(str(resolve_trace(t)) for t in args.trace)  # a name in the data directory, or a file
    rates = [float(r) for r in args.rates.split(",")]
    refit = app_refit(args.url, Path(args.refit), log) if args.refit else None
    rows, stopped = [], None
    for rate in rates:
        live_dir, sim_dir = out / f"rate-{rate:g}", out / "sim" / f"rate-{rate:g}"
        if refit is not None and before_run(live_dir, refit, log) is not None:
            raise BenchError(f"{live_dir} holds a finished run without its idle window: remove it to measure again")
        idle = idle_rates(args.idle_s)
        log(f"{rate:g} req/s: idle {', '.join(f'{p} {c:.3f}' for p, c in idle.items())} cores")
        try:
            run_bench(BenchConfig(out=live_dir, traces=traces, policies=policies, url=args.url, rate=rate,
                                  max_requests=args.max_requests, seed=args.seed, realtime=args.realtime),
                      log=log, meter=functools.partial(cpu_by_part, args.url))
        except BenchError as e:  # e.g. the constants check refused the fit: the rates measured stand
            log(f"{rate:g} req/s not measured: {e}")
            stopped = f"{rate:g} req/s: {e}"
            break
        slices = {"traces": list(traces), "policies": list(policies), "max_requests": args.max_requests,
                  "seed": args.seed}
        cm = load_profile(live_dir / COST_MODEL_FILE)
        simulate_live_run(live_dir, slices, cm, sim_dir, False, log)
        live_runs = json.loads((live_dir / RESULTS_JSON).read_text())["runs"]
        sim_runs = {(r["policy"], r["trace"]): r for r in json.loads((sim_dir / RESULTS_JSON).read_text())["runs"]}
        records = [json.loads(line) for line in (live_dir / RECORDS_FILE).read_text().splitlines() if line]
        for live in live_runs:
            if live["system"] != LIVE or "host_cpu_s" not in live:
                continue
            mine = [r for r in records if r["system"] == LIVE and r["policy"] == live["policy"]
                    and r["trace"] == live["trace"]]
            row = {"rate": rate, "policy": live["policy"], "trace": live["trace"],
                   **compare(live, sim_runs[(live["policy"], live["trace"])], idle, mine,
                             cm.shared_host.model_dump())}
            log(json.dumps(row))
            rows.append(row)
    write_result(args.json or str(out / "host_cpu.json"), {"settings": vars(args), "rows": rows, "stopped": stopped})
    return 0 if stopped is None else 1


if __name__ == "__main__":
    sys.exit(main())
