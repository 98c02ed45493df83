"""Serving throughput and TTFT: our graph vs the same engines' limit vs Ray Serve LLM's own P/D app.

Usage (from the repository root, with nothing else running on the machine):

    # Serve's fast path (HAProxy ingress, gRPC between replicas; what `make run` uses) for A and C,
    # Ray Serve LLM with its direct streaming
    .venv/bin/python benchmarks/serving_throughput.py --mode direct --rounds 7 --sequential 16 \
        --json runs/serving_throughput-direct.json
    # Serve's defaults for A and C (Ray Serve LLM as shipped): cluster env vars differ, a separate run
    .venv/bin/python benchmarks/serving_throughput.py --mode shipped --rounds 7 --sequential 16 \
        --json runs/serving_throughput-shipped.json

Three systems run 1 prefill + 1 decode vLLM engine (CPU build) of the offline tiny model each, KV
moved over NIXL, and are driven with the same load: `--streams` concurrent streaming requests
(default 16), each `--tokens` output tokens (64, ignore_eos, temperature 0), distinct short
prompts (new ones every round, the same set for every system within a round):

* A — our graph: deployments/bench-1p1d.yaml deployed with `serve_app.launch.LocalStack`
  (router ingress → prefill replica → decode replica, tokens back through the router), driven
  over HTTP (`POST /v1/completions`, SSE) with the project's client (`disagg.app_client`).
* B — the same engines' limit: two `serve_app.engine.VllmEngine` objects (prefill, decode) in
  *this* process, outside Ray; per request `prefill()` then `decode()` with the prefill's
  `kv_transfer_params`. No HTTP, no tokenization in the timed path (prompts are tokenized before
  the round), no Serve hop: a stricter limit than two bare vLLM API servers.
* C — Ray Serve LLM's P/D app (`ray.serve.llm.build_pd_openai_app`), configured for this CPU
  machine as measured for this project, deployed into the same Ray cluster as a
  second Serve application on `/raylm` (ingress → decode replica → prefill replica).
  The cluster's Serve settings apply to A and C alike, so each mode is a separate run:
  `--mode direct` starts Ray with Serve's fast path (`RAY_SERVE_ENABLE_HA_PROXY=1`,
  `RAY_SERVE_THROUGHPUT_OPTIMIZED=1`, as `make run` does) and `RAY_SERVE_LLM_ENABLE_DIRECT_STREAMING=1`;
  `--mode shipped` starts it with Serve's defaults (both switched off).

Rounds are interleaved (A, B, C, A, B, C, ...) after one unmeasured warm-up round per system;
all three systems are up at once (6 engines, ~16 GB). After the rounds, `--sequential` single
requests per system, one at a time and interleaved, give the unloaded TTFT.
Per round and system: output tokens/s = total output tokens / wall time of the round (first send
to last byte); client TTFT = send → first SSE event carrying a choice (A, C) or first token
chunk (B). TTFT percentiles pool every measured request of every round.

For A it also joins each request with the router's request log (runs/bench-requests.jsonl under
DISAGG_RUN_DIR, by response id) and reports
* hop overhead = client TTFT − (prefill_engine_s + decode_engine_first_s): everything on the
  path that is not the two engines' own time (proxy, router, Serve handle calls, the NIXL pull
  is inside decode_engine_first_s);
* proxy + HTTP cost = client TTFT − router ttft_s (ttft_s is measured inside the router, from the
  router's arrival to the first token).

Every wait is bounded in time; every loop in count. Teardown always runs: B's engines are shut
down, then LocalStack.stop (serve shutdown of both applications, no engine process left, ray stop).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from disagg.app_client import COMPLETIONS, AppClient, AppError, AsyncAppClient
from disagg.bench.script import log, write_result
from disagg.stats import percentile

ROOT = Path(__file__).resolve().parents[1]
MODEL = "tiny-qwen2"
BASE_URL = "http://127.0.0.1:8000"
RAYLM_PREFIX = "/raylm"
KV_BYTES = 64 << 20
MODE_ENV = {
    "direct": {"RAY_SERVE_LLM_ENABLE_DIRECT_STREAMING": "1", "RAY_SERVE_ENABLE_HA_PROXY": "1",
               "RAY_SERVE_THROUGHPUT_OPTIMIZED": "1"},
    "shipped": {"RAY_SERVE_LLM_ENABLE_DIRECT_STREAMING": "0", "RAY_SERVE_ENABLE_HA_PROXY": "0",
                "RAY_SERVE_THROUGHPUT_OPTIMIZED": "0"},
}
OFFLINE_ENV = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}

WORDS = ("model token request prefill decode cache memory engine router latency throughput batch "
         "queue prompt output input length budget cost price signal pressure block transfer network "
         "server replica cluster node worker process thread core machine deploy scale config policy "
         "schedule estimate predict measure simulate calibrate route serve stream answer question").split()


def prompts_for_round(round_tag: str, n: int) -> list[str]:
    """n distinct short prompts (about 20-30 tokens); distinct across rounds via the tag."""
    out = []
    for i in range(n):
        words = [WORDS[(i * 7 + j * 3) % len(WORDS)] for j in range(12 + i % 5)]
        out.append(f"Request {round_tag}-{i}: " + " ".join(words) + ".")
    return out


@dataclass
class Result:
    system: str
    request_id: str | None
    ttft_s: float | None
    tokens: int
    t_start: float
    t_end: float
    error: str | None = None


@dataclass
class Round:
    system: str
    index: int  # -1: warm-up
    wall_s: float
    tokens: int
    tok_s: float
    ttft_s: list[float]
    errors: list[str] = field(default_factory=list)
    short_requests: int = 0  # requests that produced fewer tokens than asked


# ------------------------------------------------------------------------------------------------
# Clients
# ------------------------------------------------------------------------------------------------

async def http_stream(app: AsyncAppClient, system: str, path: str, prompt: str, tokens: int) -> Result:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": tokens, "temperature": 0.0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    rid, ttft, usage_tokens, events = None, None, None, 0
    try:
        async with app.stream(path, body) as s:
            async for obj in s:
                rid = rid or obj.get("id")
                if obj.get("choices"):
                    if ttft is None:
                        ttft = time.perf_counter() - t0
                    events += 1
                if obj.get("usage"):
                    usage_tokens = obj["usage"].get("completion_tokens")
    except Exception as e:  # a failed request is reported (an AppError names the status), the round goes on
        return Result(system, rid, ttft, usage_tokens or 0, t0, time.perf_counter(), f"{type(e).__name__}: {e}")
    if usage_tokens is None:
        return Result(system, rid, ttft, 0, t0, time.perf_counter(),
                      f"no usage in the stream ({events} choice events)")
    return Result(system, rid, ttft, usage_tokens, t0, time.perf_counter())


async def engine_request(P, D, rid: str, ids: list[int], tokens: int) -> Result:
    sampling = {"max_tokens": tokens, "temperature": 0.0, "ignore_eos": True}
    t0 = time.perf_counter()
    ttft, n = None, 0
    try:
        pre = await P.prefill(rid, ids, sampling)
        async for chunk in D.decode(rid, ids, sampling, pre.kv_transfer_params):
            if chunk.token_ids and ttft is None:
                ttft = time.perf_counter() - t0
            n += len(chunk.token_ids)
    except Exception as e:
        return Result("B", rid, ttft, n, t0, time.perf_counter(), f"{type(e).__name__}: {e}")
    return Result("B", rid, ttft, n, t0, time.perf_counter())


# ------------------------------------------------------------------------------------------------
# System C: Ray Serve LLM's P/D app
# ------------------------------------------------------------------------------------------------

def raylm_llm_config(model_path: str, engine_cpus: float = 0.5) -> dict:
    """One LLMConfig for Ray Serve LLM on this CPU machine (CPU-STACK.md), engine settings as ours."""
    from serve_app.engine_args import nixl_reserved_cpus

    env = {
        # the two CPU tunings: OpenMP on the core NixlConnector pins the worker to; the NIXL agent
        # without its busy-polling progress thread comes from serve_app.vllm_plugin, a vLLM
        # general plugin installed in this venv, so it is live in Ray Serve LLM's engines too.
        "VLLM_CPU_OMP_THREADS_BIND": ",".join(str(c) for c in nixl_reserved_cpus()),
        "VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1",
        **OFFLINE_ENV,
    }
    return {
        "model_loading_config": {"model_id": MODEL, "model_source": model_path},
        "accelerator_config": {"kind": "cpu"},
        # a logical reservation, not a speed limit: it must fit beside our app on Ray's 2 CPUs
        "placement_group_config": {"bundles": [{"CPU": engine_cpus}]},
        "deployment_config": {"ray_actor_options": {"num_cpus": 0}},
        "engine_kwargs": {
            "max_model_len": 2048, "max_num_seqs": 64, "max_num_batched_tokens": 2048,
            "kv_cache_memory_bytes": KV_BYTES, "enforce_eager": True, "seed": 0,
            "kv_transfer_config": {"kv_connector": "NixlConnector", "kv_role": "kv_both",
                                   "kv_buffer_device": "cpu"},
        },
        "runtime_env": {"env_vars": env},
    }


_DEPLOY_RAYLM = r"""
import json, sys
import ray
from ray import serve
from ray.serve.llm import build_pd_openai_app
args = json.loads(sys.argv[1])
ray.init(address="127.0.0.1:6379", logging_level="WARNING")
app = build_pd_openai_app(args["pd"])
serve.run(app, name="raylm", route_prefix=args["prefix"], blocking=False)
print("deployed", flush=True)
"""


def deploy_raylm(model_path: str, timeout_s: float, direct: bool = False, prefill_replicas: int = 1,
                 decode_replicas: int = 1, engine_cpus: float = 0.5) -> None:
    from serve_app.launch import RAY_ENV  # loopback only: without it ray.init hangs on the eth0 address

    cfg = raylm_llm_config(model_path, engine_cpus)
    pd = {"prefill_config": cfg, "decode_config": json.loads(json.dumps(cfg))}
    pd["prefill_config"]["deployment_config"]["num_replicas"] = prefill_replicas
    pd["decode_config"]["deployment_config"]["num_replicas"] = decode_replicas
    if not direct:  # direct streaming has no separate ingress deployment (and rejects this option)
        # Serve's default reservation of 1 CPU for the ingress replica does not fit next to our
        # app on 2 logical CPUs; the same 0.1 as our router (a reservation, not a speed limit).
        pd["ingress_deployment_config"] = {"ray_actor_options": {"num_cpus": 0.1}}
    log("deploying Ray Serve LLM's P/D app on /raylm ...")
    r = subprocess.run([sys.executable, "-c", _DEPLOY_RAYLM, json.dumps({"pd": pd, "prefix": RAYLM_PREFIX})],
                       capture_output=True, text=True, timeout=timeout_s, env={**os.environ, **RAY_ENV})
    if r.returncode != 0:
        raise RuntimeError(f"deploying Ray Serve LLM failed (rc {r.returncode}):\n{r.stderr[-3000:]}")
    deadline = time.monotonic() + timeout_s
    last = None
    with AppClient(BASE_URL + RAYLM_PREFIX) as raylm:  # the same OpenAI API as ours
        while time.monotonic() < deadline:  # bounded: a served completion, not just RUNNING
            try:
                answer = raylm.complete({"model": MODEL, "prompt": "hello", "max_tokens": 2})
                log(f"Ray Serve LLM ready: {str(answer)[:120]}")
                return
            except AppError as e:
                last = str(e)
            time.sleep(3.0)
    raise TimeoutError(f"Ray Serve LLM did not serve within {timeout_s:.0f} s (last: {last})")


# ------------------------------------------------------------------------------------------------
# The benchmark
# ------------------------------------------------------------------------------------------------

class RequestLogTail:
    """Reads the router's request log from where it was at construction (records are appended)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.offset = path.stat().st_size if path.exists() else 0

    def records(self, ids: set[str], timeout_s: float = 15.0) -> dict[str, dict]:
        """The records of `ids` appended since the last call; waits (bounded) for all of them."""
        found: dict[str, dict] = {}
        deadline = time.monotonic() + timeout_s
        while True:
            if self.path.exists():
                with open(self.path, "rb") as f:
                    f.seek(self.offset)
                    data = f.read()
                end = data.rfind(b"\n") + 1  # whole lines only
                for line in data[:end].splitlines():
                    rec = json.loads(line)
                    if rec.get("id") in ids:
                        found[rec["id"]] = rec
                self.offset += end
            if ids <= found.keys() or time.monotonic() > deadline:
                return found
            time.sleep(0.2)


def join_log(tail: RequestLogTail, res: list[Result], index: int, into: list[dict]) -> int:
    """Join A's client-side results with the router's request log records (by response id)."""
    ids = {r.request_id for r in res if r.request_id}
    recs = tail.records(ids)
    for r in res:
        rec = recs.get(r.request_id)
        if rec is None or r.ttft_s is None or r.error:
            continue
        pe, de, rt = rec.get("prefill_engine_s"), rec.get("decode_engine_first_s"), rec.get("ttft_s")
        into.append({
            "round": index, "id": r.request_id, "client_ttft_s": r.ttft_s, "router_ttft_s": rt,
            "prefill_engine_s": pe, "decode_engine_first_s": de,
            "hop_overhead_s": (r.ttft_s - pe - de) if pe is not None and de is not None else None,
            "proxy_http_s": (r.ttft_s - rt) if rt is not None else None,
            "router_internal_s": (rt - pe - de) if None not in (rt, pe, de) else None,
        })
    return len(recs)


async def run_round(system: str, index: int, prompts: list[str], tokens: int, ctx: dict,
                    timeout_s: float) -> tuple[Round, list[Result]]:
    if system == "B":
        P, D, tok = ctx["B"]
        ids = [tok.encode(p) for p in prompts]  # outside the timed section
        coros = [engine_request(P, D, f"b{index}-{i}-{time.monotonic_ns()}", x, tokens) for i, x in enumerate(ids)]
    else:
        path = COMPLETIONS if system.startswith("A") else RAYLM_PREFIX + COMPLETIONS
        coros = [http_stream(ctx["http"], system, path, p, tokens) for p in prompts]
    t0 = time.perf_counter()
    results = await asyncio.wait_for(asyncio.gather(*coros), timeout_s)
    wall = max(r.t_end for r in results) - t0
    total = sum(r.tokens for r in results)
    rnd = Round(system, index, wall, total, total / wall if wall > 0 else 0.0,
                [r.ttft_s for r in results if r.ttft_s is not None and r.error is None],
                [r.error for r in results if r.error],
                sum(1 for r in results if r.tokens < tokens))
    return rnd, results


async def short_burst(system: str, n: int, concurrency: int, ctx: dict, timeout_s: float) -> dict:
    """`n` distinct short prompts, 1 output token each, `concurrency` in flight: completed requests/s."""
    prompts = prompts_for_round(f"short-{system}-{time.monotonic_ns()}", n)
    gate = asyncio.Semaphore(concurrency)

    async def one(i: int, prompt: str) -> Result:
        async with gate:
            if system == "B":
                P, D, tok = ctx["B"]
                return await engine_request(P, D, f"bs-{i}-{time.monotonic_ns()}", tok.encode(prompt), 1)
            path = COMPLETIONS if system.startswith("A") else RAYLM_PREFIX + COMPLETIONS
            return await http_stream(ctx["http"], system, path, prompt, 1)

    t0 = time.perf_counter()
    results = await asyncio.wait_for(asyncio.gather(*(one(i, p) for i, p in enumerate(prompts))), timeout_s)
    wall = time.perf_counter() - t0
    ok = sum(1 for r in results if r.error is None and r.tokens == 1)
    return {"system": system, "requests": n, "ok": ok, "wall_s": wall, "req_s": ok / wall if wall > 0 else 0.0,
            "errors": [r.error for r in results if r.error][:5]}


async def bench(args, systems: list[str], labels: dict[str, str]) -> dict:
    ctx: dict[str, Any] = {}
    engines = []
    out: dict[str, Any] = {"rounds": [], "hop": [], "sequential": [], "hop_sequential": [], "short": []}
    try:
        if "B" in systems:
            from disagg.core.types import Role
            from serve_app.engine import VllmEngine
            from serve_app.engine_args import EngineSpec
            from serve_app.ports import claim_port
            from serve_app.tiny_model import build_tiny_model

            model = str(build_tiny_model())
            for role in (Role.PREFILL, Role.DECODE):
                spec = EngineSpec(model=model, role=role, side_channel_port=claim_port("127.0.0.1").port,
                                  kv_cache_memory_bytes=KV_BYTES, max_model_len=2048, max_num_seqs=64,
                                  max_num_batched_tokens=2048, seed=0)
                e = VllmEngine(spec)
                engines.append(e)  # before start: a half-started engine is shut down too
                log(f"B: starting the in-process {role.value} engine ...")
                await asyncio.wait_for(e.start(), args.start_timeout)
                log(f"B: {role.value} engine ready in {e.start_time_s:.1f} s")
            ctx["B"] = (engines[0], engines[1], engines[0].tokenizer)
        ctx["http"] = AsyncAppClient(BASE_URL, timeout_s=args.request_timeout,
                                     max_connections=max(args.streams, args.short_concurrency) * 2)
        tail = RequestLogTail(args.request_log) if "A" in systems else None

        for w in range(args.warmup):  # unmeasured: first-use costs of every path
            for s in systems:
                rnd, res = await run_round(s, -1, prompts_for_round(f"w{w}{s}", args.streams), args.tokens, ctx,
                                           args.round_timeout)
                log(f"warm-up {labels[s]}: {rnd.tok_s:.0f} tok/s, errors {len(rnd.errors)}"
                    + (f" ({rnd.errors[0]})" if rnd.errors else ""))
        if tail:
            tail.records(set(), timeout_s=0)  # skip the warm-up records

        for i in range(args.rounds):
            prompts = prompts_for_round(f"r{i}", args.streams)  # same set for every system this round
            for s in systems:
                await asyncio.sleep(args.pause)
                rnd, res = await run_round(s, i, prompts, args.tokens, ctx, args.round_timeout)
                out["rounds"].append(asdict(rnd))
                msg = (f"round {i} {labels[s]}: {rnd.tok_s:.0f} tok/s ({rnd.tokens} tokens in {rnd.wall_s:.3f} s), "
                       f"TTFT p50 {percentile(rnd.ttft_s, 50) * 1e3:.0f} ms")
                if s == "A" and tail:
                    n_rec = join_log(tail, res, i, out["hop"])
                    msg += f", log records {n_rec}/{len(res)}"
                if rnd.errors or rnd.short_requests:
                    msg += f", ERRORS {len(rnd.errors)} short {rnd.short_requests}: {rnd.errors[:1]}"
                log(msg)

        # Unloaded probes: one request at a time, systems interleaved (TTFT without queueing)
        for k in range(args.sequential):
            for s in systems:
                await asyncio.sleep(0.2)
                rnd, res = await run_round(s, k, prompts_for_round(f"seq{k}", 1), args.tokens, ctx,
                                           args.round_timeout)
                out["sequential"].append({"system": s, "index": k, "ttft_s": rnd.ttft_s, "tok_s": rnd.tok_s,
                                          "errors": rnd.errors})
                if s == "A" and tail:
                    join_log(tail, res, k, out["hop_sequential"])
        if args.sequential:
            log(f"{args.sequential} sequential probes per system done")

        # Short requests: how many requests per second each system completes (1 output token each)
        for s in systems:
            if args.short_requests:
                await asyncio.sleep(args.pause)
                burst = await short_burst(s, args.short_requests, args.short_concurrency, ctx, args.round_timeout)
                out["short"].append(burst)
                log(f"short requests {labels[s]}: {burst['req_s']:.0f} req/s ({burst['ok']}/{burst['requests']} ok "
                    f"in {burst['wall_s']:.2f} s, {args.short_concurrency} at a time)")
    finally:
        if "http" in ctx:
            await ctx["http"].aclose()
        for e in reversed(engines):
            try:
                await asyncio.wait_for(e.shutdown(), 60)
            except Exception as exc:  # keep shutting the others down
                log(f"B: engine shutdown failed: {exc!r}")
    return out


def summarize(data: dict, systems: list[str], labels: dict[str, str]) -> dict:
    summary: dict[str, Any] = {}
    for s in systems:
        rounds = [r for r in data["rounds"] if r["system"] == s]
        if not rounds:
            continue
        tps = [r["tok_s"] for r in rounds]
        ttft = [t for r in rounds for t in r["ttft_s"]]
        summary[s] = {
            "label": labels[s], "rounds": len(rounds), "tok_s_median": statistics.median(tps),
            "tok_s_min": min(tps), "tok_s_max": max(tps), "tok_s_per_round": tps,
            "ttft_p50_ms": percentile(ttft, 50) * 1e3, "ttft_p99_ms": percentile(ttft, 99) * 1e3,
            "ttft_samples": len(ttft),
            "ttft_p50_ms_per_round": [percentile(r["ttft_s"], 50) * 1e3 for r in rounds],
            "errors": sum(len(r["errors"]) for r in rounds),
            "short_requests": sum(r["short_requests"] for r in rounds),
        }
    if "B" in summary:
        for s in summary:
            summary[s]["ratio_to_B"] = summary[s]["tok_s_median"] / summary["B"]["tok_s_median"]
    for name, src in (("hop", "hop"), ("hop_sequential", "hop_sequential")):
        hop = {}
        for key in ("hop_overhead_s", "proxy_http_s", "router_internal_s", "prefill_engine_s",
                    "decode_engine_first_s", "client_ttft_s", "router_ttft_s"):
            xs = [h[key] for h in data.get(src, []) if h.get(key) is not None]
            if xs:
                hop[key] = {"p50_ms": percentile(xs, 50) * 1e3, "p99_ms": percentile(xs, 99) * 1e3,
                            "min_ms": min(xs) * 1e3, "max_ms": max(xs) * 1e3, "n": len(xs)}
        summary[name] = hop
    seq = {}
    for s in systems:
        xs = [t for p in data.get("sequential", []) if p["system"] == s for t in p["ttft_s"]]
        if xs:
            seq[s] = {"label": labels[s], "ttft_p50_ms": percentile(xs, 50) * 1e3,
                      "ttft_p99_ms": percentile(xs, 99) * 1e3, "n": len(xs),
                      "tok_s_median": statistics.median(p["tok_s"] for p in data["sequential"] if p["system"] == s)}
    summary["sequential"] = seq
    summary["short"] = {b["system"]: {"label": labels[b["system"]], **b} for b in data.get("short", [])}
    return summary


def markdown(summary: dict, systems: list[str]) -> str:
    lines = ["| system | output tok/s, median (min–max) | TTFT p50 | TTFT p99 | ratio to B |",
             "| --- | --- | --- | --- | --- |"]
    for s in systems:
        if s not in summary:
            continue
        x = summary[s]
        ratio = f"{x['ratio_to_B']:.2f}×" if "ratio_to_B" in x else "—"
        lines.append(f"| {x['label']} | {x['tok_s_median']:.0f} ({x['tok_s_min']:.0f}–{x['tok_s_max']:.0f}) | "
                     f"{x['ttft_p50_ms']:.0f} ms | {x['ttft_p99_ms']:.0f} ms | {ratio} |")
    lines += _system_table(
        ["one request at a time (unloaded)", "TTFT p50", "TTFT p99", "single-stream tok/s (median)", "n"],
        summary.get("sequential") or {}, systems,
        lambda x: [f"{x['ttft_p50_ms']:.1f} ms", f"{x['ttft_p99_ms']:.1f} ms", f"{x['tok_s_median']:.0f}", str(x["n"])])
    lines += _system_table(
        ["short requests (1 output token, {short_concurrency} at a time)", "completed req/s", "ok"],
        summary.get("short") or {}, systems, lambda x: [f"{x['req_s']:.0f}", f"{x['ok']}/{x['requests']}"])
    for key, title in (("hop", "A, per request at {streams} concurrent streams (router log joined by id)"),
                       ("hop_sequential", "A, per request, one at a time (router log joined by id)")):
        lines += _hop_table(summary.get(key) or {}, title)
    return "\n".join(lines)


def _system_table(header: list[str], per_system: dict, systems: list[str], cells) -> list[str]:
    """A markdown table after a blank line: one row per system present, its label then `cells(x)`."""
    if not per_system:
        return []
    rows = [f"| {per_system[s]['label']} | " + " | ".join(cells(per_system[s])) + " |" for s in systems if s in per_system]
    return ["", "| " + " | ".join(header) + " |", "|" + " --- |" * len(header), *rows]


def _hop_table(hop: dict, title: str) -> list[str]:
    lines: list[str] = []
    if hop:
        names = {"hop_overhead_s": "hop overhead = client TTFT − (prefill_engine_s + decode_engine_first_s)",
                 "proxy_http_s": "proxy + HTTP = client TTFT − router ttft_s",
                 "router_internal_s": "inside the router = router ttft_s − (prefill_engine_s + decode_engine_first_s)",
                 "prefill_engine_s": "prefill_engine_s (engine side)",
                 "decode_engine_first_s": "decode_engine_first_s (engine side, includes the NIXL pull)",
                 "client_ttft_s": "client TTFT (A, joined records)"}
        lines += ["", f"| {title} | p50 | p99 | n |", "| --- | --- | --- | --- |"]
        for k, name in names.items():
            if k in hop:
                lines.append(f"| {name} | {hop[k]['p50_ms']:.1f} ms | {hop[k]['p99_ms']:.1f} ms | {hop[k]['n']} |")
    return lines


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default=str(ROOT / "deployments" / "bench-1p1d.yaml"))
    ap.add_argument("--systems", default="A,B,C", help="comma-separated subset of A,B,C, in round order")
    ap.add_argument("--mode", choices=("shipped", "direct"), default="direct",
                    help="direct: Serve's fast path (HAProxy, gRPC) + Ray Serve LLM's direct streaming; "
                         "shipped: Serve's defaults")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--streams", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--sequential", type=int, default=16,
                    help="after the rounds: this many single requests per system, one at a time, interleaved")
    ap.add_argument("--pause", type=float, default=1.0, help="seconds of idle before each round")
    ap.add_argument("--short-requests", type=int, default=600,
                    help="after the probes: this many 1-token requests per system, for completed requests/s (0: skip)")
    ap.add_argument("--short-concurrency", type=int, default=32)
    ap.add_argument("--round-timeout", type=float, default=300.0)
    ap.add_argument("--request-timeout", type=float, default=240.0)
    ap.add_argument("--start-timeout", type=float, default=600.0)
    ap.add_argument("--json", help="write every round, request-log join and the summary here")
    args = ap.parse_args(argv)
    systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    if not set(systems) <= {"A", "B", "C"} or not systems:
        ap.error("--systems must be a subset of A,B,C")
    if args.rounds < 1 or args.streams < 1 or args.tokens < 1:
        ap.error("--rounds, --streams and --tokens must be positive")
    suffix = " [HAProxy + gRPC cluster]" if args.mode == "direct" else " [Serve defaults]"
    labels = {"A": "A: our graph (Serve, router ingress)" + suffix,
              "B": "B: same engines in-process, no HTTP (limit)",
              "C": ("C: Ray Serve LLM P/D, direct streaming" if args.mode == "direct"
                    else "C: Ray Serve LLM P/D, as shipped")}

    os.environ.update(OFFLINE_ENV)  # nothing may leave the machine; the model is local
    os.environ.update(MODE_ENV[args.mode])  # read by `ray start` (LocalStack) and the app builders
    run_dir = Path(os.environ.get("DISAGG_RUN_DIR", os.getcwd()))
    os.environ["DISAGG_RUN_DIR"] = str(run_dir)

    from serve_app.launch import LocalStack, engine_processes, ray_running

    stack = LocalStack(args.config, log=lambda m: log(f"stack: {m}"), ready_timeout_s=args.start_timeout)
    request_log = stack.apps[0][1].router.request_log
    args.request_log = run_dir / request_log if request_log else None
    if "A" in systems and args.request_log is None:
        ap.error("system A needs router.request_log in the config")
    if engine_processes():
        log(f"vLLM engine processes are already running ({engine_processes()}); refusing to start")
        return 2
    if ray_running():  # LocalStack would reuse it, and its env (mode) would not be ours
        log("a Ray cluster is already running on 127.0.0.1:6379; refusing to start")
        return 2

    started = time.time()
    data: dict[str, Any] = {}
    try:
        stack.start()  # A's app; C joins the same cluster; B needs no Ray at all
        if "C" in systems:
            from serve_app.tiny_model import build_tiny_model

            deploy_raylm(str(build_tiny_model()), args.start_timeout, direct=args.mode == "direct")
        data = asyncio.run(bench(args, systems, labels))
    finally:
        log("stopping: serve shutdown (both apps), engines, ray stop ...")
        stack.stop()
        left = engine_processes()
        log(f"stopped; engine processes left: {left or 'none'}")

    summary = summarize(data, systems, labels)
    table = (markdown(summary, systems).replace("{streams}", str(args.streams))
             .replace("{short_concurrency}", str(args.short_concurrency)))
    print("\n" + table + "\n", flush=True)
    if args.json:
        write_result(args.json, {"args": vars(args), "started": started, "summary": summary, "table": table, **data})
        log(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
