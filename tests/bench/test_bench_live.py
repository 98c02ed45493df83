"""`disagg bench` against the real stack (tests/conftest.py `stack`): Ray Serve, the router, 1 prefill
+ 2 decode vLLM engines (CPU build) with NIXL. A short run: two policies, a generated trace of 20
short-chat requests at a low rate, gates on, plus the simulator on the same slice."""

from __future__ import annotations

import json

import httpx
import pytest

from disagg.cli import main as cli_main
from disagg.sim.traces import TraceRequest, write_native
from disagg.sim.workloads import generate

pytestmark = pytest.mark.stack
N = 20


def counters(url: str) -> dict:
    r = httpx.get(f"{url}/admin/state", timeout=30.0, trust_env=False)
    assert r.status_code == 200
    return r.json()["counters"]


def test_a_short_live_bench_accounts_for_every_request_exactly_once(stack, tmp_path):
    trace = tmp_path / "chat.csv"
    # short chat, outputs capped so each request stays short on two CPU cores
    reqs = [TraceRequest(r.arrival_s, min(r.prompt_tokens, 400), min(r.output_tokens, 48))
            for r in generate("short_chat", N, 1.0, 11)]
    write_native(trace, reqs)
    out = tmp_path / "bench"
    before = counters(stack.base_url)
    code = cli_main(["bench", "--url", stack.base_url, "--trace", str(trace), "--policies", "round_robin,marginal_cost",
                     "--rate", "1.5", "--sim", "--out", str(out), "--request-timeout", "120"])
    after = counters(stack.base_url)
    assert code == 0

    results = json.loads((out / "results.json").read_text())
    gates = {g["name"]: g for g in results["gates"]}
    assert set(gates) == {"token_count", "greedy_equivalence", "warm"} and all(g["passed"] for g in gates.values())
    assert "2/2" in gates["warm"]["detail"]  # 1 prefill × 2 decode instances

    recs = [json.loads(line) for line in (out / "requests.jsonl").read_text().splitlines()]
    keys = [(r["system"], r["policy"], r["trace"], r["index"]) for r in recs]
    assert len(keys) == len(set(keys)) == 2 * 2 * N  # live and sim, two policies, N each, none twice
    live = [r for r in recs if r["system"] == "live"]
    for policy in ("round_robin", "marginal_cost"):
        mine = [r for r in live if r["policy"] == policy]
        assert sorted(r["index"] for r in mine) == list(range(N))
        assert all(r["error"] is None and r["output_tokens"] == r["max_tokens"] for r in mine), \
            [r["error"] for r in mine if r["error"]][:3]
        assert all(r["route"]["policy"] == policy and r["decode_id"].startswith("decode-") for r in mine)
        assert all(r["ttft_s"] > 0 and r["send_lag_s"] is not None for r in mine)
        assert all(1 <= r["content_events"] <= r["output_tokens"] for r in mine)  # tokens relayed, some coalesced

    # every request sent is accounted for exactly once, on both sides of the wire
    sent = results["requests_sent"]
    assert sent["runs"] == 2 * N and sent["probes"] == 0
    assert after["requests"] - before["requests"] == sent["gates"] + sent["runs"]
    assert after["served"] - before["served"] == sent["gates"] + sent["runs"]
    assert after["failed"] == before["failed"]

    runs = {(r["system"], r["policy"]): r for r in results["runs"]}
    assert len(runs) == 4 and all(r["requests"] == N and r["complete"] for r in runs.values())
    assert results["resolved"]["topology"] == "1P2D" and results["resolved"]["max_model_len"] == 2048
    for name in ("results.md", "goodput.png", "ttft_cdf.png", "settings.json", "gates.json"):
        assert (out / name).stat().st_size > 0
    md = (out / "results.md").read_text()
    assert "| round_robin |" in md and "| marginal_cost (sim) |" in md


def test_validate_runs_the_same_slice_live_twice_and_in_the_simulator(stack, tmp_path):
    """`disagg validate` on the real stack: per (repeat, rate) one bench folder, the live noise floor from
    the repeats, the simulator's prediction with the router's own constants, the report and its figure."""
    trace = tmp_path / "chat.csv"
    write_native(trace, [TraceRequest(r.arrival_s, min(r.prompt_tokens, 300), min(r.output_tokens, 16))
                         for r in generate("short_chat", 8, 1.0, 5)])
    out = tmp_path / "validate"
    code = cli_main(["validate", "--url", stack.base_url, "--trace", str(trace), "--policies", "marginal_cost",
                     "--rates", "2", "--repeats", "2", "--out", str(out)])
    assert code == 0
    report = json.loads((out / "validate.json").read_text())
    [row] = report["rows"]
    assert row["policy"] == "marginal_cost" and row["repeats"] == 2 and row["rate"] == 2.0
    assert all(row["live"][m] is not None and row["sim"][m] is not None for m in row["live"])
    assert row["live_spread"]["ttft_p50_s"] is not None  # two live runs: a noise floor
    for rep in (1, 2):
        recs = [json.loads(line) for line in (out / "rate-2" / f"repeat-{rep}" / "requests.jsonl").read_text().splitlines()]
        systems = {r["system"] for r in recs}
        assert systems == ({"live", "sim"} if rep == 1 else {"live"})  # the simulator is deterministic: once
        assert all(r["error"] is None for r in recs if r["system"] == "live")
        settings = json.loads((out / "rate-2" / f"repeat-{rep}" / "settings.json").read_text())
        assert settings["settings"]["cost_model"] == {"source": "app"}  # the router's own constants, checked
    assert (out / "predicted_vs_measured.png").stat().st_size > 0 and "| 2 |" in (out / "validate.md").read_text()
