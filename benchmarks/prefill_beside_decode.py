"""How unevenly a shared host's engines split its cores between a prefill and a decode.

Usage (the app running on this machine, e.g. `make run`, and nothing else loading it):

    .venv/bin/python benchmarks/prefill_beside_decode.py --url http://127.0.0.1:8000 \
        [--prompts 256 1024 1984] [--batches 1 4 16] [--rounds 4] --json out.json

For each prompt length and decode batch it runs what `disagg calibrate --live --host` runs for
`SharedHost.prefill_weight` (`calibration.host.measure_prefill_weight`: a decode probe on a decode
engine and lone prefills on the prefill engine, alone and overlapping, paired in each round) and
prints each one's stretch, the shares they got (one over the stretch: they sum to about the core
they share when the sharing is uneven rather than lossy) and the weight, medians over rounds.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys

from calibration.host import measure_prefill_weight
from calibration.live import PROBE_TIMEOUT_S
from disagg.app_client import AsyncAppClient
from disagg.bench.script import write_result


async def run(url: str, prompts: list[int], batches: list[int], rounds: int) -> list[dict]:
    async with AsyncAppClient(url, timeout_s=PROBE_TIMEOUT_S, max_connections=4) as app:
        instances = (await app.state())["instances"]
        prefill = sorted(i for i, v in instances.items() if v["role"] == "prefill")
        decode = sorted(i for i, v in instances.items() if v["role"] == "decode")
        if not prefill or not decode:
            sys.exit("the app needs a prefill and a decode instance (a disaggregated profile)")
        rows = []
        for prompt in prompts:
            for batch in batches:
                weight, r = await measure_prefill_weight(decode[0], prefill[0], app.probe, prompt, rounds, batch=batch)
                d, p = statistics.median(r["decode_stretch"]), statistics.median(r["prefill_stretch"])
                rows.append({**r, "decode_median": d, "prefill_median": p, "shares": 1 / d + 1 / p})
                print(f"prefill {prompt} tokens beside a decode of {batch}: decode ×{d:.2f}, prefill ×{p:.2f}, "
                      f"shares {1 / d:.2f} + {1 / p:.2f} = {1 / d + 1 / p:.2f}, weight {weight:.2f}", flush=True)
        return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--url", required=True)
    ap.add_argument("--prompts", type=int, nargs="+", default=[256, 1024, 1984])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 4, 16])
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--json", help="write every measurement here (atomically)")
    args = ap.parse_args(argv)
    if args.rounds < 1 or min(args.prompts) < 1 or min(args.batches) < 1:
        ap.error("--rounds, --prompts and --batches must be >= 1")
    rows = asyncio.run(run(args.url.rstrip("/"), args.prompts, args.batches, args.rounds))
    if args.json:
        write_result(args.json, {"rows": rows, "rounds": args.rounds})
    return 0


if __name__ == "__main__":
    sys.exit(main())
