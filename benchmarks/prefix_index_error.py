"""How far the router's prefix index is from the engines' caches: with vLLM's KV events, and without.

Usage (nothing else running on the machine; from the repository root):

    .venv/bin/python benchmarks/prefix_index_error.py --conversations 160 --json runs/prefix_index_error.json

Starts the CPU profile (`--config`, deployments/local.yaml by default: 1 prefill + 2 decode vLLM
engines, 2 router replicas) once per mode and drives the same multi-turn chat through each:
- `events` (the default): the index is what the engines' KV events say;
- `model`: the index is the router's LRU model of each cache, from what it sent where
  (`router.prefix_index: model`; the engines still publish their events, for the scoring).

The chat: `--concurrency` conversations at a time, each of up to `--turns` turns; a turn's prompt
is the previous prompt, the answer the model gave to it and new user text, and every conversation
opens with one of a few shared system prompts. The content passes the prefill engine's KV cache
several times (and each decode engine's about once), so the engines evict while requests run.
Per request, the request log sets the router's prediction of the prompt tokens each chosen engine
holds beside the truth: on the prefill side vLLM's own count of the tokens its cache supplied; on
the decode side, what the engine's KV events said it held when the decode call came (vLLM's own
count there adds the tokens pulled over NIXL). The script reports each side's error in tokens
(mean absolute, p99, the share exact, over- and under-predicted), and each mode's TTFT p50/p99,
the share of turns within `--ttft-slo-ms`, and the tokens vLLM reused.

`--repeats N` runs every mode N times, interleaved (the order alternates from one repeat to the
next, so a slow spell of the machine does not land on one mode), and adds per mode the median and
range of the TTFT and SLO figures over the repeats, with the paired difference of the share within
the SLO (second mode minus first) per repeat: two shared cores are noisy, and a difference whose
paired values straddle zero is not an effect.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx
import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from disagg.bench.script import log, write_result  # noqa: E402
from disagg.stats import percentile  # noqa: E402
from serve_app.launch import LocalStack, _env  # noqa: E402

MODEL = "tiny-qwen2"
VOCAB = 2048  # the tiny model's
SYSTEM_PROMPTS = 4
SYSTEM_TOKENS = 400
USER_TOKENS = 120
ANSWER_TOKENS = 100
MAX_CONTEXT = 2000  # the profile's max_model_len is 2048


async def chat(base_url: str, args) -> list[float]:
    """Run the conversations; the TTFT of every turn (s)."""
    rng = random.Random(args.seed)
    systems = [[rng.randrange(10, VOCAB) for _ in range(SYSTEM_TOKENS)] for _ in range(SYSTEM_PROMPTS)]
    ttfts: list[float] = []
    todo = list(range(args.conversations))

    async def conversation(client: httpx.AsyncClient, k: int) -> None:
        crng = random.Random(f"{args.seed}/{k}")
        context = list(systems[crng.randrange(SYSTEM_PROMPTS)])
        for _ in range(args.turns):
            prompt = context + [crng.randrange(10, VOCAB) for _ in range(USER_TOKENS)]
            if len(prompt) + ANSWER_TOKENS > MAX_CONTEXT:
                return
            t0 = time.perf_counter()
            first = None
            answer: list[int] = []
            async with client.stream("POST", "/v1/completions", json={
                    "model": MODEL, "prompt": prompt, "max_tokens": ANSWER_TOKENS, "ignore_eos": True,
                    "temperature": 0.0, "stream": True, "return_token_ids": True}) as r:
                if r.status_code != 200:
                    raise RuntimeError(f"HTTP {r.status_code}: {(await r.aread())[:300]!r}")
                async for line in r.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    if first is None:
                        first = time.perf_counter() - t0
                    answer += json.loads(line[6:])["choices"][0].get("token_ids") or []
            ttfts.append(first)
            context = prompt + answer

    async def worker(client: httpx.AsyncClient) -> None:
        while todo:
            await conversation(client, todo.pop(0))

    async with httpx.AsyncClient(base_url=base_url, timeout=600, trust_env=False) as client:
        await asyncio.gather(*(worker(client) for _ in range(args.concurrency)))
    return ttfts


def errors_of(errors: list[int]) -> dict:
    """Predicted minus actual tokens, summarised."""
    n = len(errors)
    if not n:
        return {"requests": 0}
    absolute = [abs(e) for e in errors]
    return {"requests": n, "mean_abs_error_tokens": round(statistics.fmean(absolute), 1),
            "p99_abs_error_tokens": percentile(absolute, 99), "exact_share": round(sum(e == 0 for e in errors) / n, 4),
            "over_predicted_share": round(sum(e > 0 for e in errors) / n, 4),
            "under_predicted_share": round(sum(e < 0 for e in errors) / n, 4)}


def scored(log_path: Path) -> dict:
    """Each side's predicted against actual cached tokens, from the request log."""
    sides: dict[str, list[int]] = {"prefill": [], "decode": []}
    reused = 0
    for line in log_path.read_text().splitlines():
        r = json.loads(line)
        predicted = r.get("cached_tokens_predicted") or {}
        if r.get("error"):
            continue
        for side, actual in (("prefill", r.get("prefill_cached_tokens")), ("decode", r.get("decode_held_tokens"))):
            if predicted.get(side) is not None and actual is not None:
                sides[side].append(predicted[side] - actual)
        reused += r.get("prefill_cached_tokens") or 0
    return {"prefill": errors_of(sides["prefill"]), "decode": errors_of(sides["decode"]),
            "prefill_tokens_reused": reused}


def run_mode(mode: str, args, tmp: Path, repeat: int = 0) -> dict:
    doc = yaml.safe_load(args.config.read_text())
    app = doc["applications"][0]["args"]
    app["router"]["prefix_index"] = mode
    if args.policy:
        app["router"]["policy"] = args.policy
    log_path = tmp / f"requests-{mode}-{repeat}.jsonl"  # one per run: the router appends to its log
    app["router"]["request_log"] = str(log_path)
    config = tmp / f"local-{mode}-{repeat}.yaml"
    config.write_text(yaml.safe_dump(doc))
    with LocalStack(config, log=log) as stack:
        sources = {v["prefix_source"] for v in httpx.get(f"{stack.base_url}/admin/state", timeout=60).json()[
            "instances"].values()}
        t0 = time.monotonic()
        ttfts = asyncio.run(chat(stack.base_url, args))
        wall = time.monotonic() - t0
        state = httpx.get(f"{stack.base_url}/admin/state", timeout=60).json()
    out = {"mode": mode, "config": args.config.name, "policy": app["router"]["policy"],
           "index_sources_at_start": sorted(sources), "turns": len(ttfts), "wall_s": round(wall, 1),
           "ttft_p50_s": round(percentile(ttfts, 50), 4), "ttft_p99_s": round(percentile(ttfts, 99), 4),
           "ttft_slo_share": round(sum(t <= args.ttft_slo_ms / 1e3 for t in ttfts) / len(ttfts), 4),
           "kv_events_missed": sum(v["kv_events_missed"] for v in state["instances"].values()),
           "kv_capacity_tokens": {k: v["kv_capacity_tokens"] for k, v in state["instances"].items()},
           **scored(log_path)}
    log(json.dumps(out))
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--modes", default="events,model", help="comma-separated: events, model")
    ap.add_argument("--config", type=Path, default=ROOT / "deployments" / "local.yaml")
    ap.add_argument("--policy", help="the routers' policy (default: the config's); `slo_goodput` and "
                    "`prefix_affinity` route by the index")
    ap.add_argument("--conversations", type=int, default=160)
    ap.add_argument("--concurrency", type=int, default=16, help="conversations in progress at once")
    ap.add_argument("--turns", type=int, default=7, help="at most, per conversation")
    ap.add_argument("--ttft-slo-ms", type=float, default=750.0, help="report the share of turns within this TTFT "
                    "(the cpu-tiny profile's loose target)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--repeats", type=int, default=1, help="runs per mode, interleaved")
    ap.add_argument("--json", type=Path, help="write the figures here (atomically)")
    args = ap.parse_args()
    modes = args.modes.split(",")
    if not set(modes) <= {"events", "model"}:
        ap.error(f"--modes: events and/or model, got {args.modes!r}")

    os.environ.update(_env())
    results = []
    with tempfile.TemporaryDirectory(prefix="prefix-index-") as tmp:
        for k in range(args.repeats):
            for m in modes if k % 2 == 0 else modes[::-1]:
                results.append({"repeat": k, **run_mode(m, args, Path(tmp), k)})
    over = repeats_summary(results, modes)
    if args.repeats > 1:
        log(json.dumps(over))
    if args.json:
        write_result(args.json, {"conversations": args.conversations, "concurrency": args.concurrency,
                                 "turns": args.turns, "seed": args.seed, "repeats": args.repeats,
                                 "modes": results, "over_repeats": over})
    return 0


def repeats_summary(results: list[dict], modes: list[str]) -> dict:
    """Per mode: median and range over repeats of the figures that decide capacity; per repeat, the
    paired difference in the share of turns within the SLO (the last mode minus the first)."""
    out: dict = {}
    for m in modes:
        runs = [r for r in results if r["mode"] == m]
        out[m] = {f: {"median": statistics.median(r[f] for r in runs), "min": min(r[f] for r in runs),
                      "max": max(r[f] for r in runs)}
                  for f in ("ttft_p50_s", "ttft_p99_s", "ttft_slo_share", "wall_s")}
        out[m]["decode_exact_share"] = [r["decode"].get("exact_share") for r in runs]
    if len(modes) == 2:
        first, last = ({r["repeat"]: r["ttft_slo_share"] for r in results if r["mode"] == m} for m in modes)
        out[f"slo_share_{modes[-1]}_minus_{modes[0]}"] = [round(last[k] - first[k], 4) for k in sorted(first)]
    return out


if __name__ == "__main__":
    sys.exit(main())
