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
- the serving path live above its idle rate against `request_cpu_s` × requests + `token_cpu_s` ×
  tokens, and its idle rate against `idle_cores`;
- the host's cores in use live (every part, over the run's window) against its `cores`.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from memory import cluster_pids, kind, ppid_map, ray_session  # noqa: E402  (benchmarks/memory.py)

from disagg.bench.harness import COST_MODEL_FILE, RECORDS_FILE, BenchConfig, BenchError, run_bench  # noqa: E402
from disagg.bench.records import LIVE  # noqa: E402
from disagg.bench.refit import app_refit, before_run  # noqa: E402
from disagg.bench.report import RESULTS_JSON  # noqa: E402
from disagg.bench.script import log, write_result  # noqa: E402
from disagg.bench.validate import simulate_live_run  # noqa: E402
from disagg.core.cost_model import load_profile  # noqa: E402

TICK_S = 1.0 / os.sysconf("SC_CLK_TCK")
ROLES = ("prefill", "decode")
PARTS = ("prefill_steps", "decode_steps", "serving")


def part_of(k: str) -> str:
    """The part of a process of `kind` (benchmarks/memory.py); vLLM's of an unknown replica are a decode's."""
    if "EngineCore" not in k and not k.startswith("vLLM"):
        return "serving"
    return "prefill_steps" if k.startswith("prefill") else "decode_steps"


def cpu_by_part() -> dict[str, float]:
    """CPU seconds so far of every process of the Ray session, by part, and this client's own."""
    session, node_id = ray_session()
    parents = ppid_map()
    out = dict.fromkeys(PARTS, 0.0)
    for pid in cluster_pids(session, node_id, exclude={os.getpid()}):
        try:
            with open(f"/proc/{pid}/stat") as f:
                stat = f.read()
        except OSError:  # gone meanwhile
            continue
        fields = stat[stat.rfind(")") + 2:].split()
        out[part_of(kind(pid, parents))] += (int(fields[11]) + int(fields[12])) * TICK_S
    out["serving"] += time.process_time()  # the load generator shares the cores too
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
    serving_model = host["request_cpu_s"] * requests + host["token_cpu_s"] * tokens
    serving_live = cpu["serving"] - idle["serving"] * window
    return {
        "requests": requests, "tokens": tokens, "window_s": round(window, 2),
        "sim_makespan_s": round(sim["engine_time"]["makespan_s"], 2),
        **{f"{r}_steps_live_s": round(steps_live[r], 2) for r in ROLES},
        **{f"{r}_work_sim_s": round(work[r], 2) for r in ROLES},
        **{f"{r}_live_over_sim": round(steps_live[r] / work[r], 2) if work[r] > 0 else None for r in ROLES},
        "sim_mean_stretch": round(stepping / sum(work.values()), 2) if sum(work.values()) > 0 else None,
        "serving_live_s": round(serving_live, 2), "serving_model_s": round(serving_model, 2),
        "serving_live_over_model": round(serving_live / serving_model, 2) if serving_model > 0 else None,
        "idle_live_cores": round(sum(idle.values()), 3), "idle_model_cores": host["idle_cores"],
        "host_cores_live": round(sum(cpu[p] for p in PARTS) / window, 2), "host_cores": host["cores"],
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--url", required=True)
    ap.add_argument("--trace", action="append", required=True)
    ap.add_argument("--policies", default="colocated,slo_goodput")
    ap.add_argument("--rates", default="1.5,3,6")
    ap.add_argument("--max-requests", type=int, default=80)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--idle-s", type=float, default=15.0)
    ap.add_argument("--realtime", action="store_true", help="the generator under SCHED_FIFO (as disagg bench)")
    ap.add_argument("--refit", metavar="DIR", help="fit the router's constants on the live engines before each rate")
    ap.add_argument("--out", required=True)
    ap.add_argument("--json", help="the comparison (default: OUT/host_cpu.json)")
    args = ap.parse_args()
    out, policies = Path(args.out), tuple(args.policies.split(","))
    rates = [float(r) for r in args.rates.split(",")]
    refit = app_refit(args.url, Path(args.refit), log) if args.refit else None
    rows = []
    for rate in rates:
        live_dir, sim_dir = out / f"rate-{rate:g}", out / "sim" / f"rate-{rate:g}"
        if refit is not None and before_run(live_dir, refit, log) is not None:
            raise BenchError(f"{live_dir} holds a finished run without its idle window: remove it to measure again")
        idle = idle_rates(args.idle_s)
        log(f"{rate:g} req/s: idle {', '.join(f'{p} {c:.3f}' for p, c in idle.items())} cores")
        run_bench(BenchConfig(out=live_dir, traces=tuple(args.trace), policies=policies, url=args.url, rate=rate,
                              max_requests=args.max_requests, seed=args.seed, realtime=args.realtime),
                  log=log, meter=cpu_by_part)
        slices = {"traces": list(args.trace), "policies": list(policies), "max_requests": args.max_requests,
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
    write_result(args.json or str(out / "host_cpu.json"), {"settings": vars(args), "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
