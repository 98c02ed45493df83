"""`disagg bench` (disagg.bench.harness + report) against the HTTP stub of tests/bench/test_loadgen.py
and in simulator mode: resuming a killed run, refusing other settings and bad input before anything
is sent, the correctness gates, and the files it writes."""

from __future__ import annotations

import json
import math
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from disagg.bench import constants_check
from disagg.bench.harness import (
    BenchConfig, BenchError, GateFailed, RecordStore, fit_to_context, plan_slice, run_bench, saturation_search,
)
from disagg.cli import main as cli_main
from disagg.core.cost_model import CostModel, load_profile
from disagg.sim.runner import find_saturation, rr_goodput
from disagg.sim.simulator import Topology
from disagg.sim.traces import TraceRequest, write_native
from disagg.sim.workloads import generate
from test_loadgen import StubServer

ROOT = Path(__file__).resolve().parents[2]


def small_trace(path: Path, n: int = 30, gap: float = 0.1, out_tokens=(4, 12)) -> Path:
    """n requests, `gap` s apart, short prompts and outputs: quick against the stub."""
    lo, hi = out_tokens
    write_native(path, [TraceRequest(i * gap, 20 + (7 * i) % 40, lo + (5 * i) % (hi - lo + 1)) for i in range(n)])
    return path


def lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "disagg.cli", "bench", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT)


# --- resumption --------------------------------------------------------------------------------


def test_a_killed_run_resumes_and_counts_every_request_exactly_once(tmp_path):
    trace = small_trace(tmp_path / "t.csv", n=30)
    out = tmp_path / "out"
    with StubServer(first_token_s=0.05, token_gap_s=0.02) as stub:
        args = ["--url", stub.url, "--trace", str(trace), "--policies", "round_robin,least_loaded",
                "--rate", "10", "--out", str(out)]
        proc = subprocess.Popen([sys.executable, "-m", "disagg.cli", "bench", *args], cwd=ROOT,
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        records = out / "requests.jsonl"
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if records.exists() and len(records.read_bytes().splitlines()) >= 12:
                break
            time.sleep(0.02)
        proc.send_signal(signal.SIGKILL)  # no cleanup of any kind
        proc.wait(10)
        assert proc.returncode == -signal.SIGKILL
        before = lines(records)
        assert 12 <= len(before) < 60
        with open(records, "ab") as f:  # a torn line, as a kill in the middle of a write leaves
            f.write(b'{"system":"live","policy":"round_robin","tra')
        sent_before = len(stub.completions)

        done = cli(*args)
        assert done.returncode == 0, done.stderr
        after = lines(records)
        sent_after = len(stub.completions) - sent_before
    keys = [(r["system"], r["policy"], r["trace"], r["index"]) for r in after]
    assert len(keys) == len(set(keys)) == 60  # exactly N per policy, no duplicates
    for policy in ("round_robin", "least_loaded"):
        assert sorted(r["index"] for r in after if r["policy"] == policy) == list(range(30))
    assert after[: len(before)] == before  # earlier lines untouched
    results = json.loads((out / "results.json").read_text())
    assert results["requests_sent"]["runs"] == 60 - len(before)  # only the missing ones were sent
    assert sent_after == results["requests_sent"]["runs"] + results["requests_sent"]["gates"]
    assert all(r["requests"] == 30 and r["complete"] and r["failed"] == 0 for r in results["runs"])
    assert any(r["resumed"] for r in results["runs"])


def test_record_store_cuts_a_torn_line_and_ignores_duplicates(tmp_path):
    path = tmp_path / "requests.jsonl"
    rec = {"system": "live", "policy": "p", "trace": "t", "index": 0, "ttft_s": 0.1}
    path.write_bytes((json.dumps(rec) + "\n" + json.dumps(rec) + "\n").encode() + b'{"system": "li')
    store = RecordStore(path).load()
    assert store.torn_bytes == len(b'{"system": "li') and store.duplicates == 1 and len(store.records) == 1
    assert path.read_bytes().endswith(b"\n")
    store.append(rec)  # already there: not written again
    store.append({**rec, "index": 1})
    store.close()
    assert [r["index"] for r in lines(path)] == [0, 0, 1]  # the file's own duplicate stays; no new one
    assert store.done("live", "p", "t") == {0, 1}


# --- refused before anything is sent -----------------------------------------------------------


def test_other_settings_in_the_output_folder_are_refused_before_sending(tmp_path):
    trace = small_trace(tmp_path / "t.csv", n=5)
    out = tmp_path / "out"
    with StubServer() as stub:
        base = ["--url", stub.url, "--trace", str(trace), "--policies", "round_robin", "--rate", "20", "--out", str(out)]
        assert cli(*base).returncode == 0
        n_completions, n_admin = len(stub.completions), len(stub.admin)
        other = cli(*base, "--tight-share", "0.2")
        assert other.returncode == 2
        assert "other settings" in other.stderr and "tight_share: was 0.5, now 0.2" in other.stderr
        other = cli(*[a if a != "round_robin" else "round_robin,least_loaded" for a in base])
        assert other.returncode == 2 and "policies" in other.stderr
        assert (len(stub.completions), len(stub.admin)) == (n_completions, n_admin)  # not even /health
        # the same settings again: nothing left to send, the report is rewritten
        again = cli(*base)
        assert again.returncode == 0, again.stderr
        gate_requests = sum(g["requests"] for g in json.loads((out / "gates.json").read_text()))
        assert len(stub.completions) == n_completions + gate_requests  # the gates rerun; no request is resent
    assert len(lines(out / "requests.jsonl")) == 5


def test_bad_input_is_refused_before_anything_is_sent(tmp_path):
    trace = small_trace(tmp_path / "t.csv", n=5)
    bad = tmp_path / "bad.csv"
    bad.write_text("arrival_s,prompt_tokens,output_tokens\n0.0,10,5\n0.5,-3,5\n")
    with StubServer() as stub:
        common = ["--url", stub.url, "--rate", "5", "--out", str(tmp_path / "o")]
        r = cli("--trace", str(bad), "--policies", "round_robin", *common)
        assert r.returncode == 2 and "bad.csv:3" in r.stderr and "prompt_tokens" in r.stderr
        r = cli("--trace", str(trace), "--policies", "round_robin,fastest_ever", *common)
        assert r.returncode == 2 and "unknown policy 'fastest_ever'" in r.stderr and "least_loaded" in r.stderr
        r = cli("--trace", str(trace), "--policies", "oracle", *common)
        assert r.returncode == 2 and "simulator only" in r.stderr
        r = cli("--trace", str(trace), "--policies", "slo_goodput:hosting=false", *common)
        assert r.returncode == 2 and "'hosting'" in r.stderr and "allow_hosted" in r.stderr
        r = cli("--trace", str(tmp_path / "missing.csv"), "--policies", "round_robin", *common)
        assert r.returncode == 2 and "not found" in r.stderr
        assert stub.completions == [] and stub.admin == []
        port = stub.port
    r = cli("--url", f"http://127.0.0.1:{port}", "--trace", str(trace), "--policies", "round_robin",
            "--rate", "5", "--out", str(tmp_path / "o2"))
    assert r.returncode == 2 and "cannot reach" in r.stderr
    assert not (tmp_path / "o2" / "requests.jsonl").exists()


def test_an_unready_app_is_refused(tmp_path):
    trace = small_trace(tmp_path / "t.csv", n=5)
    with StubServer() as stub:
        stub._admin_route_orig = stub._admin_route
        stub._admin_route = lambda m, p, b: (503, {"status": "starting"}) if p == "/health" else \
            stub._admin_route_orig(m, p, b)
        with pytest.raises(BenchError, match="not ready"):
            run_bench(BenchConfig(out=tmp_path / "o", traces=(str(trace),), policies=("round_robin",), url=stub.url,
                                  rate=5.0))
        assert stub.completions == []


# --- gates -------------------------------------------------------------------------------------


def test_the_token_count_gate_stops_a_run_against_a_server_that_miscounts(tmp_path):
    trace = small_trace(tmp_path / "t.csv", n=5)
    out = tmp_path / "out"
    with StubServer(extra_tokens=1) as stub:
        r = cli("--url", stub.url, "--trace", str(trace), "--policies", "round_robin", "--rate", "5", "--out", str(out))
        assert r.returncode == 1
        assert "correctness gate failed" in r.stderr and "token_count" in r.stderr
        assert len(stub.completions) == 2  # only the gate's two requests
    gates = json.loads((out / "gates.json").read_text())
    assert gates[0]["name"] == "token_count" and not gates[0]["passed"]
    assert not (out / "requests.jsonl").exists()


def test_greedy_gate_needs_every_decode_instance_in_the_route_headers(tmp_path):
    """The stub lists a third decode instance in /admin/state that it never routes to."""
    trace = small_trace(tmp_path / "t.csv", n=5)
    with StubServer() as stub:
        orig = stub._admin_route

        def state_with_ghost(method, path, body):
            status, obj = orig(method, path, body)
            if path == "/admin/state":
                obj["instances"]["decode-ghost"] = {"role": "decode"}
            return status, obj

        stub._admin_route = state_with_ghost
        with pytest.raises(GateFailed, match="greedy_equivalence.*decode-ghost"):
            run_bench(BenchConfig(out=tmp_path / "o", traces=(str(trace),), policies=("round_robin",),
                                  url=stub.url, rate=5.0))


def test_gates_pass_and_are_recorded(tmp_path):
    trace = small_trace(tmp_path / "t.csv", n=8)
    with StubServer(decode=("decode-a", "decode-b", "decode-c")) as stub:
        res = run_bench(BenchConfig(out=tmp_path / "o", traces=(str(trace),), policies=("least_loaded",),
                                    url=stub.url, rate=20.0))
        policies_set = [a for a in stub.admin if a == "POST /admin/policy"]
    names = [g["name"] for g in res["gates"]]
    assert names == ["token_count", "greedy_equivalence", "warm"] and all(g["passed"] for g in res["gates"])
    assert res["gates"][1]["requests"] == 6  # 2 × 3 decode instances
    assert "3/3" in res["gates"][2]["detail"]
    assert len(policies_set) == 2  # round_robin for the greedy and warm gates, then the measured policy
    assert stub.policy == "least_loaded"


# --- the judging constants ---------------------------------------------------------------------


def test_a_live_run_judges_with_the_routers_constants_after_checking_them(tmp_path):
    trace = small_trace(tmp_path / "t.csv", n=5)
    with StubServer(hardware_factor=1.2) as stub:
        res = run_bench(BenchConfig(out=tmp_path / "o", traces=(str(trace),), policies=("round_robin",),
                                    url=stub.url, rate=20.0))
        probes = [a for a in stub.admin if a == "POST /admin/probe"]
    check = res["cost_model"]["constants_check"]
    assert res["cost_model"]["source"] == "app" and check["fits"]
    assert check["ratios"]["prefill"] == pytest.approx(1.2) and check["ratios"]["decode"] == pytest.approx(1.2)
    assert len(probes) == len(check["points"]) * 3 + 3  # 3 rounds per point, a warm-up per instance


def test_constants_of_other_hardware_are_refused_before_any_request(tmp_path, monkeypatch):
    trace = small_trace(tmp_path / "t.csv", n=5)
    out = tmp_path / "o"
    with StubServer(hardware_factor=2.5) as stub:
        r = cli("--url", stub.url, "--trace", str(trace), "--policies", "round_robin", "--rate", "5",
                "--out", str(out))
        assert r.returncode == 2
        assert "does not describe the hardware" in r.stderr and "disagg calibrate --live --url" in r.stderr
        assert stub.completions == []
        assert not (out / "requests.jsonl").exists()
        assert "on the last of 3 attempts" in r.stderr  # a slow spell would have passed by the third
        # a miscalibration study may still report, flagged
        monkeypatch.setattr(constants_check, "PAUSES_S", (0.0, 0.0))
        res = run_bench(BenchConfig(out=tmp_path / "o2", traces=(str(trace),), policies=("round_robin",),
                                    url=stub.url, rate=20.0, accept_foreign_constants=True))
    assert not res["cost_model"]["constants_check"]["fits"]
    assert len(res["cost_model"]["constants_check"]["earlier_attempts"]) == 2
    assert any("does not describe the hardware" in w for w in res["warnings"])


def test_the_routers_constants_need_a_live_app(tmp_path):
    trace = small_trace(tmp_path / "t.csv", n=5)
    with pytest.raises(BenchError, match="--cost-model app .* needs --url"):
        run_bench(BenchConfig(out=tmp_path / "o", traces=(str(trace),), policies=("round_robin",), sim=True,
                              cost_model="app", max_model_len=2048))


# --- files -------------------------------------------------------------------------------------


def test_sim_mode_writes_results_json_markdown_and_plots(tmp_path):
    a = tmp_path / "chat.csv"
    b = tmp_path / "long.csv"
    write_native(a, generate("short_chat", 40, 4.0, 1))
    write_native(b, generate("long_prompt_short_answer", 40, 4.0, 2))
    out = tmp_path / "out"
    code = cli_main(["bench", "--sim", "--trace", f"{a},{b}", "--policies", "round_robin,marginal_cost,oracle",
                     "--rate", "12", "--max-model-len", "2048", "--topology", "1P2D", "--out", str(out)])
    assert code == 0
    for name in ("settings.json", "cost_model.yaml", "requests.jsonl", "results.json", "results.md", "goodput.png",
                 "ttft_cdf.png"):
        assert (out / name).stat().st_size > 0, name
    assert CostModel.load(out / "cost_model.yaml") == load_profile("cpu-tiny")  # what it judged with, whole
    for png in ("goodput.png", "ttft_cdf.png"):
        assert (out / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert not list(out.glob(".*"))  # no temporary files left behind
    res = json.loads((out / "results.json").read_text())
    assert [(r["policy"], r["trace"]) for r in res["runs"]] == [
        (p, t) for p in ("round_robin", "marginal_cost", "oracle") for t in ("chat", "long")]
    for r in res["runs"]:
        assert r["system"] == "sim" and r["requests"] == 40 and r["complete"]
        assert 0.0 <= r["goodput"] <= 1.0 and r["ttft_p50_s"] <= r["ttft_p99_s"]
        assert r["send_lag_p99_s"] is None and r["send_lag_exceeded"] is False
    assert res["cost_model"]["slo"]["tight"] == {"ttft_s": 0.25, "tpot_s": 0.05}  # cpu-tiny's targets
    assert res["traces"]["long"]["prompts_capped_to_context"] > 0  # long prompts fitted to 2048
    row = res["tables"]["goodput"]["marginal_cost (sim)"]
    assert row["mean"] == pytest.approx((row["chat"] + row["long"]) / 2)
    md = (out / "results.md").read_text()
    assert "| policy or system | chat | long | mean ± std |" in md and "| marginal_cost (sim) |" in md
    # the same per-request schema as a live run
    recs = lines(out / "requests.jsonl")
    assert len(recs) == 3 * 2 * 40
    assert set(recs[0]) == LIVE_KEYS


LIVE_KEYS = {"system", "policy", "trace", "index", "request_id", "arrival_s", "prompt_tokens", "output_tokens",
             "slo_class", "prefill_id", "decode_id", "predicted_output_tokens", "ttft_s", "tpot_s", "e2e_s",
             "slo_met", "error", "preemptions", "max_tokens", "rate", "sent_s", "send_lag_s", "content_events",
             "status", "route"}


def test_live_and_sim_in_one_command_share_the_slices_and_the_table(tmp_path):
    trace = small_trace(tmp_path / "t.csv", n=12)
    with StubServer(first_token_s=0.01, token_gap_s=0.005) as stub:
        res = run_bench(BenchConfig(out=tmp_path / "o", traces=(str(trace),), policies=("round_robin", "least_loaded"),
                                    url=stub.url, rate=20.0, sim=True))
    recs = lines(tmp_path / "o" / "requests.jsonl")
    assert {tuple(sorted(r)) for r in recs} == {tuple(sorted(LIVE_KEYS))}
    live = {(r["policy"], r["index"]): r for r in recs if r["system"] == "live"}
    sim = {(r["policy"], r["index"]): r for r in recs if r["system"] == "sim"}
    assert live.keys() == sim.keys() and len(live) == 24
    for k in live:  # the very same requests
        assert (live[k]["prompt_tokens"], live[k]["max_tokens"], live[k]["slo_class"], live[k]["arrival_s"]) == \
               (sim[k]["prompt_tokens"], sim[k]["max_tokens"], sim[k]["slo_class"], sim[k]["arrival_s"])
        assert live[k]["output_tokens"] == live[k]["max_tokens"] and live[k]["route"]["served_decode"]
        # the stub streams a token an event: the events the client saw, as relayed (none simulated)
        assert live[k]["content_events"] == live[k]["output_tokens"] and sim[k]["content_events"] is None
    assert list(res["tables"]["goodput"]) == ["round_robin", "least_loaded", "round_robin (sim)", "least_loaded (sim)"]
    assert res["resolved"]["topology"] == "1P2D"  # taken from the stub's /admin/state
    assert all(r["send_lag_p99_s"] is not None for r in res["runs"] if r["system"] == "live")
    # the sim-vs-live rows are computed from the same runs the table shows
    runs = {(r["system"], r["policy"]): r for r in res["runs"]}
    assert [d["policy"] for d in res["sim_vs_live"]] == ["round_robin", "least_loaded"]
    for d in res["sim_vs_live"]:
        live, sim = runs[("live", d["policy"])], runs[("sim", d["policy"])]
        assert d["ttft_p50_error"] == pytest.approx((sim["ttft_p50_s"] - live["ttft_p50_s"]) / live["ttft_p50_s"])
        assert d["goodput_difference"] == pytest.approx(sim["goodput"] - live["goodput"])
    assert "## Simulated vs measured" in (tmp_path / "o" / "results.md").read_text()


def test_a_meter_records_each_live_runs_cpu_by_part_and_the_simulator_its_engines_time(tmp_path):
    trace = small_trace(tmp_path / "t.csv", n=8)
    reads = []

    def meter() -> dict[str, float]:  # a study's /proc reader (benchmarks/host_cpu_live_vs_sim.py)
        reads.append(time.monotonic())
        return {"engine_steps": 2.0 * len(reads), "serving": 0.5 * len(reads)}

    with StubServer(first_token_s=0.01, token_gap_s=0.005) as stub:
        res = run_bench(BenchConfig(out=tmp_path / "o", traces=(str(trace),), policies=("round_robin", "least_loaded"),
                                    url=stub.url, rate=20.0, sim=True), meter=meter)
    runs = {(r["system"], r["policy"]): r for r in res["runs"]}
    assert len(reads) == 4  # around each live run's load, not its gates or probes
    for policy in ("round_robin", "least_loaded"):
        cpu = runs[("live", policy)]["host_cpu_s"]
        assert cpu["engine_steps"] == 2.0 and cpu["serving"] == 0.5
        assert 0.3 < cpu["window_s"] < 10  # 8 requests 50 ms apart, each of a few 5 ms tokens
        assert "engine_time" not in runs[("live", policy)] and "host_cpu_s" not in runs[("sim", policy)]
        engines = runs[("sim", policy)]["engine_time"]["engines"]
        assert set(engines) == {"prefill-0", "decode-0", "decode-1"}
        assert all(e["work_s"] > 0 and e["steps"] > 0 for e in engines.values())
        assert runs[("sim", policy)]["engine_time"]["makespan_s"] >= 0.35


@pytest.mark.parametrize("scale,goodput", [(1000.0, 1.0), (0.01, 0.0)])
def test_an_slo_scale_judges_each_request_by_its_own_unloaded_latency_live_and_simulated(tmp_path, scale, goodput):
    """--slo-scale: every request goes out with X-SLO-Scale (the router prices the targets the bench
    judges by), live and simulated requests alike are judged by `scale` × their own unloaded latency:
    far above it everything meets its targets, far below nothing does."""
    trace = small_trace(tmp_path / "t.csv", n=8)
    with StubServer(first_token_s=0.01, token_gap_s=0.005) as stub:
        res = run_bench(BenchConfig(out=tmp_path / "o", traces=(str(trace),), policies=("round_robin",),
                                    url=stub.url, rate=20.0, sim=True, gates=False, slo_scale=scale))
    assert [c["headers"]["x-slo-scale"] for c in stub.completions] == [repr(scale)] * 8
    assert {(r["system"], r["goodput"]) for r in res["runs"]} == {("live", goodput), ("sim", goodput)}
    assert res["settings"]["slo_scale"] == scale
    assert f"{scale:g} × its own unloaded TTFT and TPOT" in (tmp_path / "o" / "results.md").read_text()
    with pytest.raises(BenchError, match="--slo-scale must be a finite number > 0"):
        run_bench(BenchConfig(out=tmp_path / "o2", traces=(str(trace),), policies=("round_robin",), sim=True,
                              slo_scale=0.0))


def test_a_baseline_system_runs_the_same_requests_after_each_trace_and_gets_its_own_row(tmp_path):
    trace_a, trace_b = small_trace(tmp_path / "a.csv", n=8), small_trace(tmp_path / "b.csv", n=6, gap=0.05)
    with StubServer(first_token_s=0.01) as ours, StubServer(first_token_s=0.03, model="their-model") as theirs:
        res = run_bench(BenchConfig(out=tmp_path / "o", traces=(str(trace_a), str(trace_b)),
                                    policies=("round_robin", "least_loaded"), url=ours.url, rate=20.0,
                                    baselines=(("other", theirs.url),)))
        theirs_bodies = [c["body"] for c in theirs.completions]
        assert theirs.admin == ["GET /v1/models"]  # nothing switched or reset on a system we cannot look inside
    recs = lines(tmp_path / "o" / "requests.jsonl")
    other = {(r["trace"], r["index"]): r for r in recs if r["system"] == "other"}
    mine = {(r["trace"], r["index"]): r for r in recs if r["system"] == "live" and r["policy"] == "round_robin"}
    assert other.keys() == mine.keys() and len(other) == 14 and all(r["policy"] == "other" for r in other.values())
    for k in other:  # the very same requests as our policies got
        assert (other[k]["prompt_tokens"], other[k]["max_tokens"], other[k]["arrival_s"]) == \
               (mine[k]["prompt_tokens"], mine[k]["max_tokens"], mine[k]["arrival_s"])
    assert all(b["model"] == "their-model" for b in theirs_bodies)
    # its own gates (2 token-count + 8 warm-up requests), then 14 measured
    assert [g["name"] for g in res["gates"]][-2:] == ["other: token_count", "other: warm"]
    assert len(theirs_bodies) == 2 + 8 + 14
    assert list(res["tables"]["goodput"]) == ["round_robin", "least_loaded", "other"]
    assert res["requests_sent"]["runs"] == 3 * 14


def test_baseline_names_and_urls_are_checked_before_anything_is_sent(tmp_path):
    trace = small_trace(tmp_path / "t.csv", n=3)
    base = dict(out=tmp_path / "o", traces=(str(trace),), policies=("round_robin",), url="http://127.0.0.1:9",
                rate=5.0)
    cases = [
        ((("least_loaded", "http://x"),), "taken"),
        ((("sim", "http://x"),), "taken"),
        ((("a b", "http://x"),), "letters"),
        ((("b", "ftp://x"),), "http://"),
        ((("b", "http://x"), ("b", "http://y")), "twice"),
    ]
    for baselines, match in cases:
        with pytest.raises(BenchError, match=match):
            run_bench(BenchConfig(**base, baselines=baselines))
    with pytest.raises(BenchError, match="needs --url"):
        run_bench(BenchConfig(**{**base, "url": None}, sim=True, baselines=(("b", "http://x"),)))
    assert not (tmp_path / "o").exists()


# --- planning and the saturation rule ----------------------------------------------------------


def test_plan_slice_is_deterministic_rescaled_cut_and_fitted():
    trace = [TraceRequest(i * 1.0, 100 + 500 * (i % 5), 50 + 900 * (i % 3)) for i in range(50)]
    s1, info = plan_slice(trace, rate=5.0, duration_s=4.0, max_requests=40, tight_share=0.5, seed=3, max_len=1024)
    s2, _ = plan_slice(trace, rate=5.0, duration_s=4.0, max_requests=40, tight_share=0.5, seed=3, max_len=1024)
    assert s1 == s2
    # 40 requests at 5/s are 0.195 s apart (span 7.8 s): 21 arrive before the 4 s cut
    assert all(r.arrival_s < 4.0 for r in s1) and len(s1) == 21
    assert all(r.prompt_tokens <= 1023 and r.prompt_tokens + r.output_tokens <= 1024 for r in s1)
    assert {r.slo_class.value for r in s1} == {"tight", "loose"}
    assert info["requests"] == 21 and info["rate"] == pytest.approx(20 / (20 * 7.8 / 39))
    fitted, capped_p, capped_o = fit_to_context([TraceRequest(0.0, 5000, 10), TraceRequest(1.0, 1000, 2000)], 2048)
    assert [(r.prompt_tokens, r.output_tokens) for r in fitted] == [(2047, 1), (1000, 1048)]
    assert (capped_p, capped_o) == (1, 2)


def test_saturation_search_is_the_simulators_rule():
    trace = generate("short_chat", 60, 2.0, 7)
    cm, topo = load_profile("cpu-tiny"), Topology.parse("1P1D")
    ref = find_saturation(trace, cm, topo, tight_share=0.5, seed=0, iterations=6)
    span = trace[-1].arrival_s - trace[0].arrival_s
    ours = saturation_search(lambda r: rr_goodput(trace, cm, topo, r, 0.5, 0), (len(trace) - 1) / span, 6)
    assert {k: ours[k] for k in ref} == ref and isinstance(ours["bracketed"], bool)


def test_saturation_search_brackets_a_collapse_that_starts_before_the_own_rate():
    """Goodput 1.0 light, 0.83 at the own rate, 0.31 at 2×, 0.10 at 4×: the target 0.55 lies
    between 1× and 2× (as measured once on the live CPU profile), not between the last two
    doubling points, and the bisection must look there."""
    curve = {1.0: 0.83, 2.0: 0.31, 4.0: 0.10}
    g = lambda r: 1.0 if r < 0.5 else next((v for k, v in sorted(curve.items(), reverse=True) if r >= k), 1.0)  # noqa: E731
    out = saturation_search(g, 1.0, 8)
    assert out["bracketed"] is True and out["target_goodput"] == pytest.approx(0.55)
    assert out["bracket"][0] >= 1.0 and out["bracket"][1] <= 2.0 and 1.99 <= out["rate"] <= 2.0
    # a smooth collapse: the rate found has goodput at the target
    smooth = lambda r: 1.0 / (1.0 + (r / 3.0) ** 4)  # noqa: E731
    out = saturation_search(smooth, 1.0, 20)
    assert smooth(out["rate"]) == pytest.approx(out["target_goodput"], abs=1e-3)
    # no collapse at all: flagged, and the last probed rate is returned
    flat = saturation_search(lambda r: 0.9, 1.0, 8)
    assert flat["bracketed"] is False and flat["rate"] == pytest.approx(flat["overload_rate"]) and flat["overload_rate"] == 2 ** 12


def test_live_saturation_probes_the_app_and_is_reused_on_resume(tmp_path):
    trace = small_trace(tmp_path / "t.csv", n=12, gap=0.01, out_tokens=(2, 4))  # own rate 100/s: quick probes
    cfg = BenchConfig(out=tmp_path / "o", traces=(str(trace),), policies=("round_robin",), url=None, saturation=True,
                      probe_requests=6, probe_seconds=0.05, probe_iterations=2)
    with StubServer() as stub:
        cfg = BenchConfig(**{**cfg.__dict__, "url": stub.url})
        res = run_bench(cfg)
        probes = res["requests_sent"]["probes"]
        # the stub never saturates: a light probe (5/s), the trace's own rate (100/s), 12 doublings,
        # and no bisection (nothing to bracket); a probe sends max(6, rate × 0.05 s) requests, at
        # most the trace's 12
        rates = [5.0, 100.0] + [100.0 * 2 ** k for k in range(1, 13)]
        assert probes == sum(min(12, max(6, math.ceil(r * 0.05))) for r in rates)
        sat = res["resolved"]["saturation"]["t"]
        assert sat["bracketed"] is False and sat["rate"] == pytest.approx(100.0 * 2 ** 12)
        assert any("never fell below" in w for w in res["warnings"])
        assert sat["goodput_light"] == 1.0 and res["runs"][0]["rate"] == pytest.approx(sat["rate"], rel=1e-6)
        again = run_bench(cfg)
        assert again["requests_sent"]["probes"] == 0 and again["resolved"]["saturation"] == res["resolved"]["saturation"]


# --- SLO capacity ------------------------------------------------------------------------------


def test_live_capacity_search_probes_every_policy_in_turn_and_a_rerun_replays_it(tmp_path):
    """`--capacity` against the stub (which answers every request well within its SLO, so each
    search doubles the rate to its limit): every policy gets the simulator's probe sequence, every
    probe sends the same requests (a faster probe takes no longer slice of the trace), the probes
    alternate between the policies, and rerunning the finished command sends nothing."""
    trace = small_trace(tmp_path / "t.csv", n=30, gap=0.1)
    out = tmp_path / "out"
    cfg = BenchConfig(out=out, traces=(str(trace),), policies=("round_robin", "least_loaded"), capacity=0.9,
                      capacity_steps=2, probe_requests=4, probe_seconds=0.5, gates=False)
    with StubServer(first_token_s=0.01, token_gap_s=0.002) as stub:
        cfg = BenchConfig(**{**cfg.__dict__, "url": stub.url})
        results = run_bench(cfg)
        sent = len(stub.completions)
        switches = [p for p in stub.policies if p in cfg.policies]
        again = run_bench(cfg)
        assert len(stub.completions) == sent  # every probe replayed from settings.json
    found = results["resolved"]["capacity"]["t"]
    own = 10.0  # 30 requests 0.1 s apart
    for policy in cfg.policies:
        c = found[policy]
        assert [round(r, 6) for r, _ in c["probes"]] == [round(own * 2 ** k, 6) for k in range(7)]
        assert all(g == 1.0 for _, g in c["probes"])
        assert c["capacity_rps"] == pytest.approx(own * 64) and c["bracketed"] is False
    # 14 probes of max(4 requests, 10 req/s × 0.5 s) = 5, the trace's first five whatever the rate
    first_five = {4 + (5 * i) % 9 for i in range(5)}  # small_trace's output lengths
    assert sent == 14 * 5 and {c["body"]["max_tokens"] for c in stub.completions} == first_five
    assert switches[:4] == ["round_robin", "least_loaded", "round_robin", "least_loaded"]  # lockstep
    assert results["runs"] == [] and again["resolved"]["capacity"] == results["resolved"]["capacity"]
    assert "SLO capacity" in (out / "results.md").read_text()


def test_the_simulated_capacity_search_sends_the_live_probes_requests(tmp_path, monkeypatch):
    """`--sim` beside `--capacity`: the simulator searches with the requests every live probe sends
    (max(probe_requests, start rate × probe_seconds) from the trace's start), not the whole slice,
    and routes them knowing their output lengths as the live router does."""
    import disagg.sim.runner as runner

    searched = []

    def search(trace, cost_model, topology, policy, **kw):
        searched.append((policy, len(trace), kw["known_output"]))
        return {"capacity_rps": 1.0, "bracket": [1.0, 2.0], "bracketed": True, "probes": [[1.0, 1.0]],
                "attainment": kw["attainment"]}

    monkeypatch.setattr(runner, "find_capacity", search)
    trace = small_trace(tmp_path / "t.csv", n=30, gap=0.1)
    cfg = BenchConfig(out=tmp_path / "out", traces=(str(trace),), policies=("round_robin",), capacity=0.9,
                      capacity_steps=2, probe_requests=4, probe_seconds=0.5, gates=False, sim=True)
    run_bench(cfg)
    # max(4, 10 req/s × 0.5 s), not the pool's 30; with the output lengths the live requests state
    assert searched == [("round_robin", 5, True)]


def test_capacity_is_checked_before_anything_is_sent(tmp_path):
    trace = small_trace(tmp_path / "t.csv")
    for bad, message in ((dict(capacity=1.5), r"in \(0, 1\]"), (dict(capacity=0.9, saturation=True), "excludes"),
                         (dict(capacity=0.9, capacity_steps=-1), "capacity-steps")):
        cfg = BenchConfig(out=tmp_path / "o", traces=(str(trace),), policies=("round_robin",), sim=True, **bad)
        with pytest.raises(BenchError, match=message):
            run_bench(cfg)
    assert not (tmp_path / "o").exists()
