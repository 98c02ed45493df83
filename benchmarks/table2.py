"""One command for the Table-II comparison on the CPU profile: our policies and Ray Serve LLM's P/D app.

Usage (from the repository root, nothing else running; the Azure traces in $DISAGG_TRACE_DIR):

    disagg calibrate --config deployments/local.yaml --out runs/cpu-calibrated.yaml
    .venv/bin/python benchmarks/table2.py --cost-model runs/cpu-calibrated.yaml --rate 3 \
        --max-requests 120 --sim --out runs/table2

It starts the CPU profile (deployments/local.yaml: router, 1 prefill + 2 decode vLLM engines of
the offline tiny model, NIXL between them) on a local Ray cluster, points its router at
`--cost-model`, deploys Ray Serve LLM's own P/D app (`build_pd_openai_app`, its power-of-two
replica choice; the same engine settings, the same topology, the same NIXL connector) on the
same cluster under /raylm, then runs `disagg bench` once over three traces: the two Azure traces
and a generated bursty mix (`mixed_bursty`, written into the output folder) — every policy of
ours, then Ray Serve LLM, on each trace in turn, with every gate (`--sim`: the simulator too, on
the same slices with the same constants: the sim-vs-live table). Everything it started is
stopped at the end, even on failure or Ctrl-C. Rerunning the command with the same settings
resumes the bench where it stopped.

Outputs, in --out: results.md (the table: goodput per policy or system and trace, mean ± std
across traces; TTFT/TPOT percentiles per run), results.json, requests.jsonl, goodput.png,
ttft_cdf.png.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))

RAYLM = "ray_serve_llm"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default=str(ROOT / "deployments" / "local.yaml"))
    ap.add_argument("--cost-model",
                    help="the router's constants and the SLO targets goodput is judged by (a calibrated file; "
                         "default: fitted on this machine once the stack is up, as `make run` does)")
    ap.add_argument("--policies", default="round_robin,least_loaded,length_heuristic,marginal_cost")
    ap.add_argument("--traces", default="azure_conv_2023,azure_code_2023",
                    help="trace names in $DISAGG_TRACE_DIR (or paths); a generated bursty mix is added")
    ap.add_argument("--generated", type=int, default=200, help="requests in the generated trace (0: none)")
    group = ap.add_mutually_exclusive_group(required=True)
    group.add_argument("--rate", type=float)
    group.add_argument("--saturation", action="store_true", help="live saturation search first (slow)")
    ap.add_argument("--max-requests", type=int, default=200)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--start-timeout", type=float, default=900.0)
    ap.add_argument("--no-realtime", action="store_true", help="do not run the generator under SCHED_FIFO")
    ap.add_argument("--sim", action="store_true",
                    help="also simulate the same slices with --cost-model (the sim-vs-live table)")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args(argv)

    from serving_throughput import deploy_raylm

    from disagg.app_client import AppClient
    from disagg.bench.harness import BenchConfig, BenchError, GateFailed, run_bench
    from disagg.bench.script import log
    from disagg.core.cost_model import load_profile
    from disagg.sim.traces import write_native
    from disagg.sim.workloads import generate
    from disagg.user_input import UsageError, parse_policies, resolve_trace
    from serve_app.launch import LocalStack, ray_running
    from serve_app.tiny_model import build_tiny_model

    # every input is checked before anything starts
    try:
        traces = [str(resolve_trace(t.strip())) for t in args.traces.split(",") if t.strip()]
        policies = tuple(parse_policies(args.policies))
    except UsageError as e:
        log(f"error: {e}")
        return 2
    if args.cost_model is not None:
        load_profile(args.cost_model)
    if ray_running():
        log("a Ray cluster is already running on 127.0.0.1:6379; stop it first")
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    if args.generated:
        path = args.out / "mixed_bursty.csv"
        if not path.exists():  # the same file on resume
            write_native(path, generate("mixed_bursty", args.generated, 4.0, args.seed))
        traces.append(str(path))

    stack = LocalStack(args.config, log=lambda m: log(f"stack: {m}"), ready_timeout_s=args.start_timeout)
    app = stack.apps[0][1]
    try:
        stack.start()
        if args.cost_model is None:
            [(fitted, _)] = stack.fit_host()
            log(f"router constants: fitted on this machine, {fitted}")
        else:
            with AppClient(stack.base_url) as router:
                log(f"router constants: {router.set_cost_model(args.cost_model)}")
        # the same logical CPU reservation per engine as ours: three engines of 0.5 beside our app
        # do not fit on 2 CPUs, and Serve would wait for resources forever
        deploy_raylm(str(build_tiny_model()), args.start_timeout, prefill_replicas=app.prefill.num_replicas,
                     decode_replicas=app.decode.num_replicas, engine_cpus=app.decode.num_cpus)
        cfg = BenchConfig(out=args.out / "bench", traces=tuple(traces), policies=policies, url=stack.base_url,
                          rate=args.rate, saturation=args.saturation, max_requests=args.max_requests or None,
                          seed=args.seed, cost_model=args.cost_model, realtime=not args.no_realtime, sim=args.sim,
                          baselines=((RAYLM, f"{stack.base_url}/raylm"),))
        results = run_bench(cfg)
    except GateFailed as e:
        log(str(e))
        return 1
    except BenchError as e:
        log(f"error: {e}")
        return 2
    finally:
        log("stopping: serve shutdown (both applications), this stack's engines, ray stop ...")
        stack.stop()
    print((args.out / "bench" / "results.md").read_text())
    return 0 if all(g["passed"] for g in results["gates"]) else 1


def _interrupt(*_) -> None:
    raise KeyboardInterrupt


if __name__ == "__main__":
    os.environ.setdefault("DISAGG_RUN_DIR", os.getcwd())
    # SIGTERM (`timeout`, a supervisor) and Ctrl-C both end in the teardown of everything started
    signal.signal(signal.SIGTERM, _interrupt)
    signal.signal(signal.SIGINT, _interrupt)
    sys.exit(main())
