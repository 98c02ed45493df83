"""How unevenly a shared host's engines split its cores between a prefill and a decode.

Usage (the app running on this machine, e.g. `make run`, and nothing else loading it):

    .venv/bin/python benchmarks/prefill_beside_decode.py --url http://127.0.0.1:8000 \
        [--prompts 256 1024 1984] [--batches 1 4 16] [--rounds 4] --json out.json

For each prompt length and decode batch it runs what `disagg calibrate --live --host` runs for
`SharedHost.prefill_weight` (`calibration.host.measure_prefill_weight`: a decode probe on a decode
engine and lone prefills on the prefill engine, alone and overlapping, paired in each round; the
host fit has the host's other engines decode beside them, `--mix on`) and
prints each one's stretch, the shares they got (one over the stretch: they sum to about the core
they share when the sharing is uneven rather than lossy) and the weight, medians over rounds.

`--mix on`: the host's other engines decode beside both overlapping probes, as the host fit measures
the weight (among as many busy engines as the host has); the default, `off`, is a prefill beside one
decode, as the fit measured it before; `--mix both` measures each row both ways, back to back, so
the two compare within one run. `--same-engine` takes no mix.

`--same-engine`: the prefills and the decode probe on one decode engine instead, so that they share
its steps (vLLM batches the prompt's chunk with the running decodes), not the host's cores; beside
each row, the stretch of the prefill the cost model's additive step gives, `step_s(prompt, batch)`
over `step_s(prompt, 0)` with the router's constants.
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
from disagg.core.cost_model import CostModel


async def run(url: str, prompts: list[int], batches: list[int], rounds: int, same_engine: bool = False,
              mix: str = "off") -> list[dict]:
    async with AsyncAppClient(url, timeout_s=PROBE_TIMEOUT_S, max_connections=4) as app:
        state = await app.state()
        instances = state["instances"]
        prefill = sorted(i for i, v in instances.items() if v["role"] == "prefill")
        decode = sorted(i for i, v in instances.items() if v["role"] == "decode")
        if not prefill or not decode:
            sys.exit("the app needs a prefill and a decode instance (a disaggregated profile)")
        engine = None
        if same_engine:  # the router's constants, for the additive step's stretch
            engine = CostModel.from_dict(next(iter(state["models"].values()))["cost_model_constants"]).engine
        rows = []
        prefiller = decode[0] if same_engine else prefill[0]
        others = [i for i in sorted(instances) if i not in (decode[0], prefiller)]
        modes = {"off": [()], "on": [others], "both": [(), others]}[mix]
        for prompt in prompts:
            for batch in batches:
                for besides in modes:
                    weight, r = await measure_prefill_weight(decode[0], prefiller, app.probe, prompt, rounds,
                                                             batch=batch, besides=besides)
                    d, p = statistics.median(r["decode_stretch"]), statistics.median(r["prefill_stretch"])
                    decodes = 1 + len(besides)
                    rows.append({**r, "decode_median": d, "prefill_median": p, "shares": decodes / d + 1 / p})
                    line = (f"prefill {prompt} tokens beside {decodes} decode(s) of {batch}: decode ×{d:.2f}, "
                            f"prefill ×{p:.2f}, shares {decodes}×{1 / d:.2f} + {1 / p:.2f} = "
                            f"{decodes / d + 1 / p:.2f}, weight {weight:.2f}")
                    if engine is not None:
                        additive = engine.step_s(prompt, batch) / engine.step_s(prompt, 0)
                        rows[-1]["additive_prefill_stretch"] = additive
                        line += f"; the additive step's prefill ×{additive:.2f}"
                    print(line, flush=True)
        return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--url", required=True)
    ap.add_argument("--prompts", type=int, nargs="+", default=[256, 1024, 1984])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 4, 16])
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--same-engine", action="store_true", help="prefills and decodes on one decode engine")
    ap.add_argument("--mix", choices=("off", "on", "both"), default="off",
                    help="the host's other engines decode beside both probes (both: each row both ways)")
    ap.add_argument("--json", help="write every measurement here (atomically)")
    args = ap.parse_args(argv)
    if args.rounds < 1 or min(args.prompts) < 1 or min(args.batches) < 1:
        ap.error("--rounds, --prompts and --batches must be >= 1")
    if args.same_engine and args.mix != "off":
        ap.error("--same-engine measures one engine's steps: it takes no --mix")
    rows = asyncio.run(run(args.url.rstrip("/"), args.prompts, args.batches, args.rounds, args.same_engine, args.mix))
    if args.json:
        write_result(args.json, {"rows": rows, "rounds": args.rounds, "same_engine": args.same_engine,
                                 "mix": args.mix})
    return 0


if __name__ == "__main__":
    sys.exit(main())
