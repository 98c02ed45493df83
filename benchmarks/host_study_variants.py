"""Every recorded run of `benchmarks/host_cpu_live_vs_sim.py` simulated again under a variant of the
shared-host model, beside the model as it is: which form the live runs support. Offline, simulator only.

Usage (after one or more studies, from the repository root):

    .venv/bin/python benchmarks/host_study_variants.py --variant even-weight \
        runs/host-cpu-2p2d-s21 runs/host-cpu-2p2d-s22 --json runs/host-variants-even-weight.json

Each run is simulated with the constants it was judged with (its rate's fit), once as they are
and once with the variant, and each of TTFT and TPOT p50 and p90 is compared with the live run's:
- `even-weight`: the prefill weight at 1 and `mixed_cores` unset (even sharing between a prefill
  and decodes);
- `leftover-share`: the engines share what the serving path and the background leave of their
  cores, σ = (sharing + a) / (1 − c), instead of σ = sharing + c + a / σ (c the share of every core
  taken at rates of their own, a the steps' work's share at full speed). A form tried and not kept
  (docs/results.md);
- `decode-context`: every engine's decode steps priced for the context their sequences hold at
  `decode_context_s` = `--decode-context-s` (`benchmarks/decode_context.py` measures it) in place
  of the fitted one (0 before the fit had the term), beside the fitted step base and per-sequence
  cost (the fits' short decode probes hold 16 tokens of context); 0 takes the term out.
Prints each run's four errors under both, and per form: the cells within 15%, the median error,
each statistic's median error, and the median of live over simulated TTFT per request by prompt
length.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from host_cpu_live_vs_sim import STATS, by_prompt, latency  # noqa: E402

from disagg.bench.harness import COST_MODEL_FILE, RECORDS_FILE  # noqa: E402
from disagg.bench.records import LIVE  # noqa: E402
from disagg.bench.script import log, write_result  # noqa: E402
from disagg.bench.validate import simulate_live_run  # noqa: E402
from disagg.core.cost_model import CostModel, SharedHost, load_profile  # noqa: E402
from disagg.user_input import resolve_trace  # noqa: E402

LEAST_FREE = 0.1  # the engines' share of their cores however much the serving path asks (`leftover-share`)


def leftover_stretch(self: SharedHost, busy: int, token_cores: float = 0.0, request_cores: float = 0.0,
                     own: float = 1.0, weights: float | None = None) -> float:
    """`SharedHost.stretch` with the engines sharing what the serving path leaves of their cores."""
    if busy <= 0:
        return 1.0
    free = 1.0 - (request_cores + self.idle_cores) / self.cores
    return (self._sharing(busy, own, weights) + token_cores / self.cores) / max(free, LEAST_FREE)


@contextlib.contextmanager
def variant(name: str, cm: CostModel, decode_context_s: float = 0.0):
    """The cost model to simulate with under `name` ("as fitted": `cm` itself)."""
    if name == "decode-context":
        def with_context(e):
            return e.model_copy(update={"decode_context_s": decode_context_s})
        yield cm.model_copy(update={"engine": with_context(cm.engine),
                                    "instances": {i: with_context(e) for i, e in cm.instances.items()}})
    elif name == "even-weight":
        yield cm.model_copy(update={"shared_host": cm.shared_host.model_copy(
            update={"prefill_weight": 1.0, "mixed_cores": None})})
    elif name == "leftover-share":
        kept = SharedHost.stretch
        SharedHost.stretch = leftover_stretch
        try:
            yield cm
        finally:
            SharedHost.stretch = kept
    else:
        yield cm


def mine(folder: Path, system: str, policy: str, trace: str) -> list[dict]:
    return [r for r in map(json.loads, (folder / RECORDS_FILE).read_text().splitlines())
            if r["system"] == system and r["policy"] == policy and r["trace"] == trace]


def summary(rows: list[dict], form: str) -> dict:
    def known(k: str) -> list[float]:
        return [r[form]["errors"][k] for r in rows if r[form]["errors"][k] is not None]

    errors = [e for k in STATS for e in known(k)]
    ratios: dict[str, list[float]] = {}
    for r in rows:
        for b, v in r[form]["live_over_sim_ttft"].items():
            ratios.setdefault(b, []).extend(v)
    return {"within_15pct": f"{sum(abs(e) <= 0.15 for e in errors)} of {len(errors)}",
            "median_error": round(statistics.median(errors), 3),
            "median_error_by_stat": {k: round(statistics.median(known(k)), 3) for k in STATS if known(k)},
            "live_over_sim_ttft_median": {b: round(statistics.median(v), 2) for b, v in ratios.items() if v}}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("studies", nargs="+", help="folders of host_cpu_live_vs_sim.py measurements")
    ap.add_argument("--variant", choices=("even-weight", "leftover-share", "decode-context"), required=True)
    ap.add_argument("--decode-context-s", type=float, default=0.0,
                    help="`decode-context`: seconds per step per token of context a decoding sequence holds")
    ap.add_argument("--work", default=None, help="where the simulations go (default: each study's own folder)")
    ap.add_argument("--json", required=True)
    args = ap.parse_args()
    if args.variant == "decode-context" and args.decode_context_s < 0:
        ap.error("--decode-context-s must be ≥ 0 (seconds per step per token of context)")
    rows = []
    for out in map(Path, args.studies):
        measured = json.loads((out / "host_cpu.json").read_text())
        paths = {p.name.split(".")[0]: str(p) for p in map(resolve_trace, measured["settings"]["trace"])}
        for row in measured["rows"]:
            rate, policy, trace = row["rate"], row["policy"], row["trace"]
            live_dir = out / f"rate-{rate:g}"
            cm = load_profile(live_dir / COST_MODEL_FILE)
            live = mine(live_dir, LIVE, policy, trace)
            got = {"study": out.name, "rate": rate, "policy": policy, "trace": trace, "live": latency(live)}
            for form in ("as fitted", args.variant):
                work = (Path(args.work) / out.name if args.work else out / "variants") / form / f"rate-{rate:g}" \
                    / f"{policy}-{trace}"
                slices = {"traces": [paths[trace]], "policies": [policy],
                          "max_requests": measured["settings"]["max_requests"], "seed": measured["settings"]["seed"]}
                with variant(form, cm, args.decode_context_s) as priced:
                    simulate_live_run(live_dir, slices, priced, work, False, lambda _m: None)
                simulated = mine(work, "sim", policy, trace)
                sim = latency(simulated)
                got[form] = {"latency": sim, "live_over_sim_ttft": by_prompt(live, simulated),
                             "errors": {k: (sim[k] - got["live"][k]) / got["live"][k]
                                        if sim[k] and got["live"][k] else None for k in STATS}}
            log(f"{out.name} {rate:g} req/s {trace} {policy}: " + " | ".join(
                f"{form} " + " ".join(f"{got[form]['errors'][k]:+.0%}" for k in STATS)
                for form in ("as fitted", args.variant)))
            rows.append(got)
    result = {"variant": args.variant, "decode_context_s": args.decode_context_s, "rows": rows,
              "summary": {form: summary(rows, form) for form in ("as fitted", args.variant)}}
    print(json.dumps(result["summary"], indent=1))
    write_result(args.json, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
