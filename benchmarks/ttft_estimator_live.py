"""The TTFT estimator's error on real engines under load, through the multi-model router's alias.

Usage (from the repository root, with no other Ray cluster on the machine):

    .venv/bin/python benchmarks/ttft_estimator_live.py --rates 2 4 8 --requests 60 \
        --json runs/ttft_estimator_live.json
    # with the constants of this host, shared cores included, fitted once the stack is up:
    .venv/bin/python benchmarks/ttft_estimator_live.py --fit-host --rates 2 4 --json runs/ttft_estimator_host.json
    # against a multi-model app already up (its request log must be readable here):
    .venv/bin/python benchmarks/ttft_estimator_live.py --url http://127.0.0.1:8000 --log runs/multi-requests.jsonl

It serves deployments/local-multi.yaml (tiny:tiny and tiny:small, one colocated vLLM engine each)
with `serve_app.launch.LocalStack`, and drives `model: auto` open-loop: at each rate, `--requests`
streaming completions with Poisson arrivals (seeded), prompts of 16–1,500 tokens (log-uniform),
`--tokens` output tokens (ignore_eos), random token ids (no prefix-cache hits), each with a TTFT limit drawn from `--limits-ms` and λ = 0,
so the alias trades the accurate small model against the fast tiny one request by request.

At routing time the router logs, per request, the estimated TTFT of the instance it chose
(`estimated_ttft_s`, the engine-simulating estimator run on the router's snapshot of that
instance) next to three measurements of the same first token:
- engine: `decode_engine_first_s`, inside the engine replica from the call to the first output;
- router: `ttft_s`, from the router's decision to the first token back from the replica;
- client: send → the first SSE event carrying a choice (adds the HTTP proxy and parsing).
The estimator models the engine, so *engine* is its truth; *router* shows what the hop to the
replica adds on top. *client* is compared with the estimate plus the model's serving overhead
(`serving_overhead_s`: HTTP proxy, router, Serve hops), the constant of the cost model the router
prices with when calibrated through the app (`disagg calibrate --url`, `--fit-host`), else measured
here before the first rate: the median of client TTFT − engine first token over
`--overhead-requests` lone requests, one at a time. The
results carry the overhead used and its source. For each, the absolute percentage error |est − measured| / measured:
its mean (MAPE), median and p10/p90 across requests, and the median signed error (bias).
It also reports the share of queries whose measured TTFT met their limit, per rate and per model.
And where the engine's time went (the request log's `decode_engine_timeline`, vLLM's own request
events), as medians for short and long prompts: the call's way into the engine core's scheduler,
its wait there, the steps to its first token, and the token's way back to the replica.

Bounded: every request has a timeout, every rate a deadline; the stack is always torn down.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from disagg.app_client import COMPLETIONS, ROUTE_HEADER, AppError, AsyncAppClient  # noqa: E402
from disagg.bench.script import write_result  # noqa: E402
from disagg.stats import percentile  # noqa: E402

SHORT_PROMPT = 100  # prompt tokens: below it the fixed parts of the engine's time dominate


def prompt_of(rng: random.Random, tokens: int) -> list[int]:
    # token ids: exact prompt lengths, and random ones so that the prefix cache never hits
    # (both models share the tiny models' tokenizer; ids 3.. skip its special tokens)
    return [rng.randrange(3, 2000) for _ in range(tokens)]


async def one(app: AsyncAppClient, body: dict, headers: dict, timeout_s: float) -> dict:
    t0 = time.perf_counter()
    out = {"client_ttft_s": None, "id": None, "status": None, "error": None}
    try:
        async with asyncio.timeout(timeout_s):
            async with app.stream(COMPLETIONS, body, headers) as s:
                out["status"] = 200
                out["route"] = s.headers.get(ROUTE_HEADER)
                async for chunk in s:
                    out["id"] = out["id"] or chunk.get("id")
                    if out["client_ttft_s"] is None and chunk.get("choices"):
                        out["client_ttft_s"] = time.perf_counter() - t0
    except TimeoutError as e:
        out["error"] = f"{type(e).__name__}: {e}"
    except AppError as e:
        out["status"], out["error"] = e.status, e.message[:200]
    return out


async def drive(url: str, rate: float, n: int, args, seed: int) -> list[dict]:
    rng = random.Random(seed)
    lo, hi = math.log(16), math.log(1500)
    plan = []
    t = 0.0
    for i in range(n):
        t += rng.expovariate(rate)
        p = int(math.exp(rng.uniform(lo, hi)))
        limit = rng.choice(args.limits_ms)
        plan.append((t, p, limit))
    async with AsyncAppClient(url, timeout_s=args.timeout, max_connections=n) as app:
        start = time.perf_counter()

        async def at(t_send, p, limit):
            await asyncio.sleep(max(0.0, start + t_send - time.perf_counter()))
            body = {"model": "auto", "prompt": prompt_of(rng_prompts, p), "max_tokens": args.tokens,
                    "ignore_eos": True, "temperature": 0.0, "stream": True}
            res = await one(app, body, {"X-TTFT-Limit-Ms": str(limit), "X-Route-Lambda": "0"}, args.timeout)
            return {**res, "limit_s": limit / 1e3, "prompt_words": p, "rate": rate}

        rng_prompts = random.Random(seed + 1)
        return await asyncio.wait_for(asyncio.gather(*(at(*x) for x in plan)),
                                      timeout=plan[-1][0] + args.timeout + 30)


def configured_overheads(url: str) -> dict[str, float]:
    """Each served model's `serving_overhead_s` in the cost model its router prices with now (0: not
    calibrated through the app)."""
    from disagg.app_client import AppClient
    from disagg.core.cost_model import CostModel

    with AppClient(url) as app:
        models = app.state()["models"]
    return {m: CostModel.from_dict(s["cost_model_constants"]).serving_overhead_s for m, s in models.items()}


async def lone_requests(url: str, n: int, args, seed: int) -> list[dict]:
    """`n` lone 64-token requests, one at a time after one unmeasured: the unloaded serving path."""
    rng = random.Random(seed)
    out = []
    async with AsyncAppClient(url, timeout_s=args.timeout, max_connections=1) as app:
        for i in range(n + 1):
            body = {"model": "auto", "prompt": prompt_of(rng, 64), "max_tokens": 2, "ignore_eos": True,
                    "temperature": 0.0, "stream": True}
            res = await one(app, body, {"X-TTFT-Limit-Ms": "1000", "X-Route-Lambda": "0"}, args.timeout)
            if i:  # the first one wakes an idle path up
                out.append(res)
    return out


def serving_overheads(url: str, log: Path, args) -> dict[str, dict]:
    """Per served model, the serving overhead added to client-side estimates, and where it came from."""
    configured = configured_overheads(url)
    measured = None
    if args.overhead_requests and not all(configured.values()):
        sent = asyncio.run(lone_requests(url, args.overhead_requests, args, seed=args.seed + 555))
        logged = read_log(log, {r["id"] for r in sent if r["id"]})
        gaps = [r["client_ttft_s"] - logged[r["id"]]["decode_engine_first_s"] for r in sent
                if r["id"] in logged and r["client_ttft_s"] and logged[r["id"]].get("decode_engine_first_s")]
        measured = max(statistics.median(gaps), 0.0) if gaps else None
    out = {}
    for m, s in configured.items():
        if s > 0:
            out[m] = {"seconds": s, "source": "cost model"}
        elif measured is not None:
            out[m] = {"seconds": measured, "source": f"measured: median of {len(gaps)} lone requests"}
        else:
            out[m] = {"seconds": 0.0, "source": "none"}
    return out


def read_log(path: Path, ids: set[str], deadline_s: float = 15.0) -> dict[str, dict]:
    end = time.monotonic() + deadline_s
    found: dict[str, dict] = {}
    while time.monotonic() < end:
        if path.exists():
            for line in path.read_text().splitlines():
                rec = json.loads(line)
                if rec.get("id") in ids:
                    found[rec["id"]] = rec
        if len(found) == len(ids):
            break
        time.sleep(0.5)
    return found


def errors(rows: list[dict], key: str, estimate: str = "estimated_ttft_s") -> dict:
    pairs = [(r[estimate], r[key]) for r in rows if r.get(key) and r.get(estimate) is not None]
    if not pairs:
        return {"n": 0}
    ape = [abs(e - m) / m for e, m in pairs]
    signed = [(e - m) / m for e, m in pairs]
    return {"n": len(pairs), "mape": statistics.fmean(ape), "median_ape": statistics.median(ape),
            "p10_ape": percentile(ape, 10), "p90_ape": percentile(ape, 90), "median_signed": statistics.median(signed),
            "median_measured_ms": 1e3 * statistics.median(m for _, m in pairs),
            "median_estimated_ms": 1e3 * statistics.median(e for e, _ in pairs)}


def timeline(rows: list[dict]) -> dict:
    """Medians of where the engine's time to the first token went (vLLM's request events, as the
    request log carries them): the call's way into the engine core's scheduler, the wait there for a
    step, the steps to the first token, and the token's way back to the replica; beside the estimate."""
    parts = {"into_core": [], "queued": [], "steps": [], "back": [], "estimate": [], "measured": []}
    for r in rows:
        t, m = r.get("decode_engine_timeline"), r.get("decode_engine_first_s")
        if not t or not m or r.get("estimated_ttft_s") is None:
            continue
        parts["into_core"].append(t["queued_s"])
        parts["queued"].append(t["scheduled_s"] - t["queued_s"])
        parts["steps"].append(t["first_token_s"] - t["scheduled_s"])
        parts["back"].append(m - t["first_token_s"])
        parts["estimate"].append(r["estimated_ttft_s"])
        parts["measured"].append(m)
    n = len(parts["measured"])
    return {"n": n, **({f"{k}_ms": 1e3 * statistics.median(v) for k, v in parts.items()} if n else {})}


def summarize(rows: list[dict], per_model: bool = True) -> dict:
    ok = [r for r in rows if r.get("estimated_ttft_s") is not None]
    met = [r for r in ok if r.get("client_ttft_s") is not None]
    models = sorted({r["model"] for r in ok})
    return {
        **({"per_model": {m: summarize([r for r in ok if r["model"] == m], False) for m in models}}
           if per_model else {}),
        "requests": len(rows), "served": len(ok),
        "by_model": {m: sum(1 for r in ok if r["model"] == m) for m in models},
        "engine": errors(ok, "decode_engine_first_s"), "router": errors(ok, "ttft_s"),
        "client": errors(ok, "client_ttft_s", "client_estimated_ttft_s"),
        "timeline": {"short": timeline([r for r in ok if r["prompt_tokens"] < SHORT_PROMPT]),
                     "long": timeline([r for r in ok if r["prompt_tokens"] >= SHORT_PROMPT])},
        "met_limit_client": (sum(r["client_ttft_s"] <= r["limit_s"] for r in met) / len(met)) if met else None,
        "met_limit_router": (sum(r["ttft_s"] <= r["limit_s"] for r in ok) / len(ok)) if ok else None,
        "chosen_feasible": (sum(bool(r["feasible"]) for r in ok) / len(ok)) if ok else None,
    }


def markdown_per_model(results: dict) -> str:
    out = ["| rate req/s | model | requests | engine TTFT median | estimate median | MAPE (engine) | "
           "median signed |", "|---|---|---|---|---|---|---|"]
    for rate, s in results["rates"].items():
        for m, pm in s.get("per_model", {}).items():
            e = pm["engine"]
            if e.get("n"):
                out.append(f"| {rate} | {m} | {pm['served']} | {e['median_measured_ms']:.1f} ms | "
                           f"{e['median_estimated_ms']:.1f} ms | {e['mape']:.0%} | {e['median_signed']:+.0%} |")
    return "\n".join(out)


def markdown_timeline(results: dict) -> str:
    out = ["| rate req/s | prompts | requests | into the core | queued | steps | back | measured | estimate |",
           "|---|---|---|---|---|---|---|---|---|"]
    for rate, s in results["rates"].items():
        for size, t in s["timeline"].items():
            if t["n"]:
                label = f"< {SHORT_PROMPT}" if size == "short" else f">= {SHORT_PROMPT}"
                out.append(f"| {rate} | {label} | {t['n']} | " + " | ".join(
                    f"{t[k + '_ms']:.1f} ms" for k in ("into_core", "queued", "steps", "back", "measured", "estimate"))
                    + " |")
    return "\n".join(out)


def markdown(results: dict) -> str:
    out = ["| rate req/s | served | tiny / small | measured | MAPE | median APE | p10–p90 APE | median signed | "
           "met limit |", "|---|---|---|---|---|---|---|---|---|"]
    for rate, s in results["rates"].items():
        bm = s["by_model"]
        for key in ("engine", "router", "client"):
            e = s[key]
            if not e.get("n"):
                continue
            met = s["met_limit_router"] if key != "client" else s["met_limit_client"]
            out.append(f"| {rate} | {s['served']}/{s['requests']} | {bm.get('tiny-qwen2', 0)} / {bm.get('small-qwen2', 0)} | "
                       f"{key} (median {e['median_measured_ms']:.1f} ms, est. {e['median_estimated_ms']:.1f} ms) | "
                       f"{e['mape']:.0%} | {e['median_ape']:.0%} | {e['p10_ape']:.0%}–{e['p90_ape']:.0%} | "
                       f"{e['median_signed']:+.0%} | {met:.0%} |")
    return "\n".join(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rates", type=float, nargs="+", default=[2.0, 4.0, 8.0], help="requests per second")
    ap.add_argument("--requests", type=int, default=60, help="requests per rate")
    ap.add_argument("--tokens", type=int, default=32, help="output tokens per request (ignore_eos)")
    ap.add_argument("--limits-ms", type=float, nargs="+", default=[40.0, 150.0, 1000.0])
    ap.add_argument("--timeout", type=float, default=120.0, help="per request, seconds")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--warmup", type=int, default=6, help="unmeasured requests before the first rate")
    ap.add_argument("--config", default=str(ROOT / "deployments" / "local-multi.yaml"))
    ap.add_argument("--url", help="use a running multi-model app instead of starting one")
    ap.add_argument("--log", help="its request log (with --url)")
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--fit-host", action="store_true",
                    help="fit the host's constants once the stack is up, as `make run` does (`disagg calibrate "
                         "--live --quick --host --apply` per model), and estimate with them")
    ap.add_argument("--overhead-requests", type=int, default=8,
                    help="lone requests that measure the serving overhead when a cost model has none (0: none)")
    args = ap.parse_args(argv)
    if any(r <= 0 for r in args.rates) or args.requests < 1 or args.requests > 2000:
        ap.error("rates must be > 0 and --requests in 1..2000")
    if not 0 <= args.overhead_requests <= 100:
        ap.error("--overhead-requests must be in 0..100")

    def run(url: str, log: Path) -> dict:
        asyncio.run(drive(url, 2.0, args.warmup, args, seed=args.seed + 999))  # engines warm, predictor fed
        overhead = serving_overheads(url, log, args)
        print("serving overhead: " + ", ".join(f"{m} {o['seconds'] * 1e3:.1f} ms ({o['source']})"
                                               for m, o in overhead.items()), flush=True)
        results = {"config": args.config, "tokens": args.tokens, "limits_ms": args.limits_ms, "rates": {},
                   "requests_per_rate": args.requests, "serving_overhead": overhead}
        for k, rate in enumerate(args.rates):
            t0 = time.monotonic()
            sent = asyncio.run(drive(url, rate, args.requests, args, seed=args.seed + k))
            ids = {r["id"] for r in sent if r["id"]}
            logged = read_log(log, ids)
            rows = [{**logged[r["id"]], **r} for r in sent if r["id"] in logged]
            for r in rows:  # what the client should see: the engine estimate plus the serving path
                if r.get("estimated_ttft_s") is not None and r.get("model") in overhead:
                    r["client_estimated_ttft_s"] = r["estimated_ttft_s"] + overhead[r["model"]]["seconds"]
            results["rates"][f"{rate:g}"] = s = summarize(rows)
            results.setdefault("requests", []).extend(
                {k: r.get(k) for k in ("rate", "model", "prompt_tokens", "limit_s", "estimated_ttft_s",
                                       "client_estimated_ttft_s", "decode_engine_first_s", "decode_engine_timeline",
                                       "ttft_s", "client_ttft_s", "feasible")}
                for r in rows)
            s["failed"] = [r["error"] for r in sent if r["error"]][:5]
            print(f"rate {rate:g}/s: {s['served']}/{s['requests']} served in {time.monotonic() - t0:.0f} s, "
                  f"engine MAPE {s['engine'].get('mape', float('nan')):.1%}, met limit (client) "
                  f"{s['met_limit_client'] or 0:.0%}, by model {s['by_model']}", flush=True)
            time.sleep(2.0)  # drain between rates
        return results

    if args.url:
        if not args.log:
            ap.error("--url needs --log (the app's request log)")
        results = run(args.url, Path(args.log))
    else:
        import tempfile

        import yaml

        from serve_app.launch import LocalStack

        with tempfile.TemporaryDirectory() as run_dir:
            os.environ["DISAGG_RUN_DIR"] = run_dir
            log_rel = yaml.safe_load(Path(args.config).read_text())["applications"][0]["args"]["router"]["request_log"]
            with LocalStack(args.config, log=lambda m: print(f"[stack] {m}", flush=True)) as stack:
                fitted = []
                if args.fit_host:
                    for path, summary in stack.fit_host():
                        print(summary, flush=True)
                        fitted.append(yaml.safe_load(path.read_text()))
                results = run(stack.base_url, Path(run_dir) / log_rel)
                results["fitted_cost_models"] = fitted
    print()
    print(markdown(results))
    print()
    print(markdown_per_model(results))
    print()
    print(markdown_timeline(results))
    if args.json:
        write_result(args.json, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
