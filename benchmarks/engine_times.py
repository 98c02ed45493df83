"""Where a live request's time goes, from the engines' own times in its route header, against what
the cost model predicts for them.

Usage:

    # a live bench folder (`disagg bench --url ...`, e.g. one of `disagg validate`'s), against the
    # constants it judged with (its cost_model.yaml; --cost-model for another file)
    .venv/bin/python benchmarks/engine_times.py --bench runs/validate/rate-1.5/repeat-1 --json runs/engine_times.json
    # a running app, idle: lone requests of a few prompt lengths against probes of the same lengths
    .venv/bin/python benchmarks/engine_times.py --url http://127.0.0.1:8000 --lengths 16 400 1024 1775

`--bench`: per (policy, trace), the median of the prefill engine's own time (`prefill_engine_s`:
from the call to its first token, queue included) over the model's prefill of the prompt, those
two in ms, the decode engine's time to its first token (`decode_engine_first_s`: the KV pull and
the step that makes it), and the client TTFT less both; and where the route header has them, the
router's own split: its handler reading and rendering the request (`intake_s`), from routing to the
first token at the router (`router_first_s`, both engines' times inside), and the client TTFT less
both — the time spent outside the router's handler (HTTP proxy, waiting for the router's event loop
to take the request and to relay its first token). `--url`: for each length, `--repeats` lone
completions of random token ids (no prefix-cache hits) with their prefill and decode engine times,
and a prefill probe of the same length on the prefill instance (`/admin/probe`), all in ms.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
from collections import defaultdict
from pathlib import Path

from disagg.bench.harness import COST_MODEL_FILE
from disagg.bench.script import write_result


def from_bench(folder: Path, cost_model: str) -> list[dict]:
    from disagg.core.cost_model import load_profile

    cm = load_profile(cost_model)
    groups: dict[tuple, list[dict]] = defaultdict(list)
    for line in (folder / "requests.jsonl").read_text().splitlines():
        r = json.loads(line)
        route = r.get("route") or {}
        if r.get("system") == "live" and not r.get("error") and "prefill_engine_s" in route:
            groups[(r["policy"], r["trace"])].append(r)
    rows = []
    for (policy, trace), recs in sorted(groups.items()):
        prefill = [float(r["route"]["prefill_engine_s"]) for r in recs]
        decode = [float(r["route"]["decode_engine_first_s"]) for r in recs]
        model = [cm.for_instance(r["route"]["served_prefill"]).prefill_s(r["prompt_tokens"]) for r in recs]
        rows.append({"policy": policy, "trace": trace, "requests": len(recs),
                     "prompt_tokens_p50": statistics.median(r["prompt_tokens"] for r in recs),
                     "prefill_engine_over_model_p50": statistics.median(p / m for p, m in zip(prefill, model)),
                     "prefill_engine_ms_p50": 1e3 * statistics.median(prefill),
                     "prefill_model_ms_p50": 1e3 * statistics.median(model),
                     "decode_first_ms_p50": 1e3 * statistics.median(decode),
                     "outside_engines_ms_p50": 1e3 * statistics.median(
                         r["ttft_s"] - p - d for r, p, d in zip(recs, prefill, decode))})
        timed = [r for r in recs if "intake_s" in r["route"]]  # routers before the field have no split
        if timed:
            intake = [float(r["route"]["intake_s"]) for r in timed]
            first = [float(r["route"]["router_first_s"]) for r in timed]
            rows[-1].update({"router_intake_ms_p50": 1e3 * statistics.median(intake),
                             "router_first_ms_p50": 1e3 * statistics.median(first),
                             "outside_handler_ms_p50": 1e3 * statistics.median(
                                 r["ttft_s"] - i - f for r, i, f in zip(timed, intake, first))})
    return rows


def from_app(url: str, lengths: list[int], repeats: int, seed: int) -> list[dict]:
    from disagg.app_client import COMPLETIONS, ROUTE_HEADER, AppClient
    from disagg.bench.loadgen import parse_route

    rng = random.Random(seed)
    rows = []
    with AppClient(url, timeout_s=120) as app:
        state = app.state()
        prefill = next(i for i, v in sorted(state["instances"].items()) if v["role"] == "prefill")
        model = next(iter(state["models"]))
        for n in lengths:
            probe = app.probe({"instance": prefill, "kind": "prefill", "size": n, "repeats": repeats,
                               "seed": rng.randrange(1 << 30)})
            lone = []
            for _ in range(repeats):  # token ids every vocabulary has; random, so no prefix-cache hits
                body = {"model": model, "prompt": [rng.randrange(100, 1000) for _ in range(n)], "max_tokens": 2,
                        "ignore_eos": True}
                r = app.http.post(COMPLETIONS, json=body)
                r.raise_for_status()
                route = parse_route(r.headers.get(ROUTE_HEADER))
                lone.append((float(route["prefill_engine_s"]), float(route["decode_engine_first_s"])))
            rows.append({"prompt_tokens": n, "probe_ms": [1e3 * s for s in probe["samples"]],
                         "prefill_engine_ms": [1e3 * p for p, _ in lone],
                         "decode_first_ms": [1e3 * d for _, d in lone]})
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--bench", help="a live bench folder")
    src.add_argument("--url", help="a running app, idle")
    ap.add_argument("--cost-model", help="with --bench: the constants to compare with (default: the folder's own)")
    ap.add_argument("--lengths", type=int, nargs="+", default=[16, 400, 1024, 1775], help="with --url")
    ap.add_argument("--repeats", type=int, default=3, help="with --url: requests and probes per length")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args(argv)
    own = Path(args.bench or ".") / COST_MODEL_FILE
    if args.bench and not (args.cost_model or own.exists()):
        ap.error(f"--bench: {own} is missing (a run older than bench folders keeping their constants): "
                 "give --cost-model")
    rows = from_bench(Path(args.bench), args.cost_model or str(own)) if args.bench else \
        from_app(args.url.rstrip("/"), args.lengths, args.repeats, args.seed)
    for row in rows:
        print(json.dumps({k: round(v, 2) if isinstance(v, float) else
                          [round(x, 1) for x in v] if isinstance(v, list) else v for k, v in row.items()}))
    if args.json:
        write_result(args.json, {"rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
