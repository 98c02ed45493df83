"""The shared host's stretch against steady streams through the live app: TPOT measured vs modelled.

Usage (the CPU profile running, e.g. `make run`; nothing else on the machine):

    .venv/bin/python benchmarks/shared_host_steady.py --url http://127.0.0.1:8000 --rounds 3 \
        --json runs/shared_host_steady.json

With `colocated` routing (set for the run, the app's own policy restored after; `--policy round_robin`
prefills each on the prefill engine and hands its KV over NIXL first), it sends 1, 2, 4, 8
and 16 streaming completions at once (32-token prompts, 160 output tokens, `ignore_eos`): the
policy spreads them over the decode engines, n per engine, so after the first the steps of k = 2
busy engines stream n tokens each. Each stream's TPOT, timed by the bench's client, is compared
with what the router's own cost model (from `/admin/state`, its `shared_host` included) gives the
engine it ran on: τ_dec(n) × σ(k, the serving path's demand for the tokens of every engine's batch).
Rounds repeat the sizes in turn, so a slow spell of the host lands on every size.

Prints and writes, per size: how the streams split over the engines, the medians of measured and
modelled TPOT, and their ratio. The ratio between sizes within a round is the figure to read: the
host's speed drifts by 10-30% between minutes (docs/results.md), the model's shape does not.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
from pathlib import Path

SIZES = (1, 2, 4, 8, 16)
PROMPT_TOKENS = 32
OUTPUT_TOKENS = 160


def modelled_tpot_s(cm, batches: dict[str, int]) -> dict[str, float]:
    """Per engine, the TPOT the cost model gives `batches` (engine → streams) decoding at once."""
    host = cm.shared_host
    if host is None:
        return {iid: cm.for_instance(iid).decode_token_s(n) for iid, n in batches.items()}
    serving = [host.serving_cores(n, cm.for_instance(iid).step_s(0, n)) for iid, n in batches.items()]
    sigma = host.stretch(len(batches), sum(load for load, _ in serving), sum(relay for _, relay in serving))
    return {iid: cm.for_instance(iid).decode_token_s(n) * sigma for iid, n in batches.items()}


async def run(url: str, rounds: int, seed: int, policy: str = "colocated") -> dict:
    from disagg.app_client import AsyncAppClient
    from disagg.bench.loadgen import PlannedRequest, prompt_seed, send_one
    from disagg.core.cost_model import CostModel

    async with AsyncAppClient(url, timeout_s=120.0, max_connections=max(SIZES)) as app:
        state = await app.state()
        model, entry = next(iter(state["models"].items()))
        cm = CostModel.from_dict(entry["cost_model_constants"])
        await app.set_policy(policy, {}, model)
        sent = 0
        by_size: dict[int, list[dict]] = {n: [] for n in SIZES}
        try:
            for _ in range(rounds):
                for size in SIZES:
                    reqs = [PlannedRequest(index=sent + i, at_s=0.0, prompt_tokens=PROMPT_TOKENS,
                                           max_tokens=OUTPUT_TOKENS,
                                           prompt_seed=prompt_seed(seed, "shared-host-steady", sent + i))
                            for i in range(size)]
                    sent += size
                    results = await asyncio.gather(*(send_one(app.http, model, r, timeout_s=120.0) for r in reqs))
                    failed = [r.error for r in results if r.error]
                    if failed:
                        raise RuntimeError(f"{url}: {failed[0]}")
                    batches: dict[str, int] = {}
                    for r in results:
                        batches[r.route["served_decode"]] = batches.get(r.route["served_decode"], 0) + 1
                    model_s = modelled_tpot_s(cm, batches)
                    by_size[size] += [{"engine": r.route["served_decode"], "measured_s": r.tpot_s,
                                       "modelled_s": model_s[r.route["served_decode"]],
                                       "split": sorted(batches.values(), reverse=True)} for r in results]
        finally:
            await app.set_policy(entry["policy"], entry["policy_params"], model)
    rows = []
    for size, streams in by_size.items():
        measured = statistics.median(s["measured_s"] for s in streams)
        modelled = statistics.median(s["modelled_s"] for s in streams)
        rows.append({"streams": size, "split": streams[0]["split"], "measured_tpot_s": measured,
                     "modelled_tpot_s": modelled, "modelled_over_measured": modelled / measured})
    return {"url": url, "rounds": rounds, "policy": policy, "cost_model": cm.name,
            "shared_host": entry["cost_model_constants"].get("shared_host"), "rows": rows, "streams": by_size}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--url", default="http://127.0.0.1:8000")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--policy", default="colocated", choices=("colocated", "round_robin"),
                    help="colocated: each stream whole on a decode engine; round_robin: through the hand-off")
    ap.add_argument("--json", type=Path, help="write the results here")
    args = ap.parse_args(argv)
    if not 1 <= args.rounds <= 20:
        ap.error(f"--rounds must be in [1, 20], got {args.rounds}")
    result = asyncio.run(run(args.url.rstrip("/"), args.rounds, args.seed, args.policy))
    for row in result["rows"]:
        print(f"{row['streams']:2d} streams, split {row['split']}: "
              f"TPOT measured {row['measured_tpot_s'] * 1e3:.2f} ms, "
              f"modelled {row['modelled_tpot_s'] * 1e3:.2f} ms ({row['modelled_over_measured']:.2f}x)")
    if args.json:
        from disagg.bench.script import write_result

        write_result(args.json, result)
        print(f"wrote {args.json}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
