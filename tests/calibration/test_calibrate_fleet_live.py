"""`disagg calibrate --live` on the session's running app: every engine instance measured through
`/admin/probe`, per-instance constants written and reloaded by the router, `/admin/state` showing
them with when they were measured."""

import json
import os
import subprocess
import sys
import time
from datetime import datetime, timedelta, timezone

import httpx
import pytest

from disagg.core.cost_model import CostModel

pytestmark = pytest.mark.stack


@pytest.fixture(scope="module")
def client(stack):
    with httpx.Client(base_url=stack.base_url, timeout=httpx.Timeout(120.0)) as c:
        yield c


def admin_state(client) -> dict:
    r = client.get("/admin/state")
    assert r.status_code == 200, r.text
    return r.json()


def test_a_probe_measures_exactly_the_named_instance(client):
    instances = admin_state(client)["instances"]
    for iid in instances:
        r = client.post("/admin/probe", json={"instance": iid, "kind": "prefill", "size": 256})
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["instance"] == iid and 0 < body["seconds"] < 5
        assert body["kv_capacity_tokens"] == instances[iid]["kv_capacity_tokens"]
    r = client.post("/admin/probe", json={"instance": iid, "kind": "decode", "size": 4, "tokens": 8})
    assert r.status_code == 200 and 0 < r.json()["seconds"] < 1, r.text


def test_a_decode_probe_at_long_context_runs_its_streams_at_that_context(client):
    """The probe the calibration reads `decode_context_s` from: its streams' prompts are `context`
    tokens long, as the engine's own count of the prompt tokens it looked up in its prefix cache
    shows (not timed: a shared host's probes stray by more than the term)."""
    iid = next(i for i, v in admin_state(client)["instances"].items() if v["role"] == "decode")

    def queried() -> int:
        return admin_state(client)["instances"][iid]["prefix_cache_queries"]

    looked_up = {}
    for context in (16, 1000):
        before = queried()
        r = client.post("/admin/probe", json={"instance": iid, "kind": "decode", "size": 2, "tokens": 4,
                                              "context": context})
        assert r.status_code == 200 and r.json()["context"] == context, r.text
        deadline = time.monotonic() + 10  # the count rides the engine's next state push
        while queried() - before < 2 * context and time.monotonic() < deadline:
            time.sleep(0.1)
        looked_up[context] = queried() - before
    assert looked_up[1000] >= 2 * 1000 > looked_up[16] >= 2 * 16, looked_up


def test_a_repeated_seed_still_times_a_whole_prefill(client):
    """A rerun of a calibration (or a bench's constants check) sends the same seeds: the prompt must
    still be new to the prefix cache, or the probe times a prefill of one block and the fit learns a
    τ_pre near zero."""
    iid = next(i for i, v in admin_state(client)["instances"].items() if v["role"] == "prefill")
    body = {"instance": iid, "kind": "prefill", "size": 1536, "repeats": 3, "seed": 424242}
    first, again = (client.post("/admin/probe", json=body).json()["seconds"] for _ in range(2))
    assert again > 0.5 * first, (first, again)  # a cached 1,536-token prompt prefills ~20× faster


@pytest.mark.parametrize("body, param", [
    (b"not json", "instance"),
    ({"instance": "decode-nobody", "kind": "prefill", "size": 8}, "instance"),
    ({"kind": "prefill", "size": 8}, "instance"),
    ({"instance": "<live>", "kind": "sideways", "size": 8}, "kind"),
    ({"instance": "<live>", "kind": "prefill", "size": 0}, "size"),
    ({"instance": "<live>", "kind": "prefill", "size": 2048}, "size"),  # max_model_len 2048: no room to sample
    ({"instance": "<live>", "kind": "prefill", "size": True}, "size"),
    ({"instance": "<live>", "kind": "decode", "size": 65}, "size"),  # max_num_seqs 64
    ({"instance": "<live>", "kind": "decode", "size": 2, "tokens": 1}, "tokens"),
    ({"instance": "<live>", "kind": "decode", "size": 2, "seed": -1}, "seed"),
    ({"instance": "<live>", "kind": "decode", "size": 2, "context": 0}, "context"),
    ({"instance": "<live>", "kind": "decode", "size": 2, "tokens": 32, "context": 2017}, "context"),  # + 32 > 2048
])
def test_a_bad_probe_is_a_400_naming_the_field(client, body, param):
    live = next(iter(admin_state(client)["instances"]))
    if isinstance(body, dict):
        r = client.post("/admin/probe", json={k: live if v == "<live>" else v for k, v in body.items()})
    else:
        r = client.post("/admin/probe", content=body)
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_the_running_fleet_is_calibrated_per_instance_and_the_router_prices_with_it(client, stack, tmp_path):
    before = admin_state(client)
    (model, info), = before["models"].items()
    runs = stack.run_dir / "runs"  # the CPU profile's router.cost_model_dir: --apply may load only from there
    runs.mkdir(exist_ok=True)
    saved = runs / "before-live-calibration.yaml"
    CostModel.from_dict(info["cost_model_constants"]).save(saved)
    out, report = runs / "live-by-tests.yaml", tmp_path / "report.json"
    cmd = [sys.executable, "-m", "disagg.cli", "calibrate", "--live", "--url", stack.base_url, "--out", str(out),
           "--quick", "--apply", "--report", str(report), "--url-requests", "4", "--budget-s", "240", "--host"]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=360)
        assert proc.returncode == 0, proc.stderr[-3000:]
        cm = CostModel.load(out)
        assert set(cm.instances) == set(before["instances"])  # every live instance, by its id
        when = {c.measured_at for c in cm.instances.values()}
        assert len(when) == 1
        age = datetime.now(timezone.utc) - datetime.fromisoformat(when.pop())
        assert timedelta(0) <= age < timedelta(minutes=10)
        for c in cm.instances.values():
            assert 0 < c.prefill_token_s < 1e-3 and 0 < c.step_base_s < 0.1 and c.kv_capacity_tokens > 10_000
        assert cm.calibrated and cm.model == info["source"]
        # probes move no KV: the transfer comes from the lone requests' route headers, at two prompt
        # lengths; the bandwidth is measured where the longer prompts took longer, else kept and said so
        kept = info["cost_model_constants"]["transfer"]["tokens_per_s"]
        assert 0 < cm.transfer.latency_s < 0.2
        if "tokens/s (measured: medians of lone requests at 64 and " in proc.stdout:
            assert cm.transfer.tokens_per_s != kept and 1e3 < cm.transfer.tokens_per_s < 1e9
        else:
            assert "not measurable through the noise" in proc.stdout and cm.transfer.tokens_per_s == kept
        assert "applied" in proc.stdout and "held-out" in proc.stdout
        # the shared host: every engine of the CPU profile runs on one core, beside the serving path
        host = cm.shared_host
        assert host is not None and host.cores == os.cpu_count() and 0 < host.engine_cores <= host.cores
        assert host.measured_at == next(iter(cm.instances.values())).measured_at
        # the serving path priced per engine step and per message, at the app's own batching of streams
        assert host.token_cpu_s == 0 and 0 < host.step_cpu_s + host.event_cpu_s < 0.02 and 0 <= host.request_cpu_s < 0.5
        assert (host.stream_interval_s, host.stream_interval_max_s) == (
            info["stream_interval_s"], info["stream_interval_max_s"]) and host.stream_interval_s > 0
        r = json.loads(report.read_text())
        # a prefill beside a decode, on two of the engines: the weight the host shares them by
        beside = r["shared_host"]["prefill_beside_decode"]
        assert host.prefill_weight == beside["prefill_weight"] and 0.3 < host.prefill_weight < 5
        assert host.mixed_cores == min(beside["cores_shared"], host.cores) and 0.3 < host.mixed_cores
        assert len(beside["decode_stretch"]) == len(beside["prefill_stretch"]) >= 2
        stretch = r["shared_host"]["stretch_by_busy_engines"]
        assert set(stretch) == {str(k) for k in range(1, len(before["instances"]) + 1)}
        # the engines' share of each serving window is read from their processes, not from the constants
        pids = [pid for i in before["instances"].values() for pid in i["engine_pids"]]
        assert r["shared_host"]["engine_cpu"] == "measured"
        assert r["shared_host"]["engine_processes"] == len(pids) >= len(before["instances"])
        for w in r["shared_host"]["windows"]:
            assert 0 < w["engine_cpu_above_idle_s"] < w["cpu_above_idle_s"], w
            # the engines counted their steps (a step serves one token to each stream at most), the
            # client its messages (a message carries one token at least)
            assert w["engine_steps"] >= w["tokens"] / w["concurrency"], w
            assert w["requests"] <= w["events"] <= w["tokens"], w
        assert [w["window"] for w in r["shared_host"]["windows"]] == ["few streams", "streams", "short"]
        assert set(r["instances"]) == set(cm.instances)
        assert all(f["held_out"]["n"] >= 2 for f in r["instances"].values())

        after = admin_state(client)
        assert after["models"][model]["cost_model"] == cm.name
        for iid, inst in after["instances"].items():
            assert inst["constants_source"] == "instance", iid
            own = cm.instances[iid].model_dump(mode="json")
            assert inst["constants"] == {**own, "kv_capacity_tokens": inst["kv_capacity_tokens"]}
            assert inst["constants"]["measured_at"] == cm.instances[iid].measured_at
    finally:
        r = client.post("/admin/cost_model", json={"cost_model": str(saved), "model": model})
        assert r.status_code == 200, r.text
        out.unlink(missing_ok=True)
    source = lambda st: {i: x["constants_source"] for i, x in st["instances"].items()}  # noqa: E731
    assert source(admin_state(client)) == source(before)
