"""Multi-node for real, on one machine: a head and a worker Ray node on loopback, each offering
its own custom resource; the prefill pool pinned to one, the decode pool to the other
(deployments/local-2node.yaml), so every KV handoff crosses nodes.

One machine runs one Ray cluster at a time, so this module starts its own stack and runs in a
pytest session of its own (`make test` runs it after the main suite).
"""

from __future__ import annotations

import json
import time
import urllib.request
from pathlib import Path

import pytest

from serve_app.launch import LocalStack, engine_processes
from unprovoked import UNPROVOKED, unprovoked_failures

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "deployments" / "local-2node.yaml"
pytestmark = [pytest.mark.stack, pytest.mark.multinode]


def _get(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=30) as r:
        return json.load(r)


def _post(url: str, body: dict) -> dict:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        return json.load(r)


@pytest.fixture(scope="module")
def two_nodes(tmp_path_factory, monkeypatch_module):
    monkeypatch_module.setenv("DISAGG_RUN_DIR", str(tmp_path_factory.mktemp("two-nodes")))
    with LocalStack(CONFIG, log=lambda m: print(f"[two nodes] {m}", flush=True)) as s:
        s.engines_at_start = set(engine_processes(s.stack_id))
        s.initial_state = _get(f"{s.base_url}/admin/state")
        yield s
        state = _get(f"{s.base_url}/admin/state")
        problems = unprovoked_failures(state["counters"], UNPROVOKED, s.engines_at_start,
                                       set(engine_processes(s.stack_id)), set(s.initial_state["instances"]),
                                       set(state["instances"]))
        assert not problems, "failures on the two-node stack: " + "; ".join(problems)


@pytest.fixture(scope="module")
def monkeypatch_module():
    mp = pytest.MonkeyPatch()
    yield mp
    mp.undo()


def test_the_pools_run_on_the_nodes_that_offer_their_resources(two_nodes):
    from ray.util.state import list_nodes

    nodes = [n for n in list_nodes(address="http://127.0.0.1:8265", detail=True) if n.state == "ALIVE"]
    offering = {name: {n.node_id for n in nodes if name in (n.resources_total or {})}
                for name in ("prefill_node", "decode_node")}
    assert all(len(ids) == 1 for ids in offering.values()), offering
    assert offering["prefill_node"] != offering["decode_node"], "both resources on one node"
    instances = two_nodes.initial_state["instances"]
    placed = {v["role"]: v["node_id"] for v in instances.values()}
    assert placed == {"prefill": next(iter(offering["prefill_node"])),
                      "decode": next(iter(offering["decode_node"]))}, instances


def test_the_kv_of_every_request_crosses_from_the_prefill_node_to_the_decode_node(two_nodes):
    base = two_nodes.base_url
    before = _get(f"{base}/admin/state")
    body = {"model": "tiny-qwen2", "max_tokens": 16, "temperature": 0.0, "ignore_eos": True}
    prompts = [" ".join(["kv", "cache", "crosses", "nodes", str(i)] * 60) for i in range(4)]
    answers = [_post(f"{base}/v1/completions", {**body, "prompt": p}) for p in prompts]
    assert all(a["usage"]["completion_tokens"] == 16 for a in answers)
    prompt_tokens = sum(a["usage"]["prompt_tokens"] for a in answers)

    def decode_of(state: dict) -> dict:
        (d,) = [v for v in state["instances"].values() if v["role"] == "decode"]
        return d

    deadline = time.monotonic() + 10
    while True:  # the engines' counters arrive with their next poll
        after = _get(f"{base}/admin/state")
        got = decode_of(after)["kv_received_tokens"] - decode_of(before)["kv_received_tokens"]
        if got >= prompt_tokens - len(prompts) or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    # every prompt's KV came over NIXL from the other node (at most its last token recomputed)
    assert got >= prompt_tokens - len(prompts), (got, prompt_tokens)
    assert decode_of(after)["kv_transfers_ok"] - decode_of(before)["kv_transfers_ok"] >= len(prompts)
    assert decode_of(after)["kv_transfers_failed"] == decode_of(before)["kv_transfers_failed"]
    assert after["counters"]["local_prefill_fallbacks"] == before["counters"]["local_prefill_fallbacks"]
