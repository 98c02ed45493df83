"""A request the policy serves whole on a prefill instance ("hosted", `Policy.may_host`).

The real `Router` runs in-process over stand-in engines. The decode pool's KV is full, so
`slo_goodput` hosts the request on the prefill instance. That engine streams the answer itself,
from a local prefill: no prefill call, no KV to pull, and nothing sent to the decode pool. The
call carries only the prefill's priced work to that engine's ledger, which other routers read as
its queue. The live run of a hosted request, on the real engines, is in tests/serve_app/test_serving.py.
"""

from __future__ import annotations

import asyncio
import json

import pytest

pytest.importorskip("ray.serve")

from starlette.requests import Request  # noqa: E402

from serve_app.messages import DecodeChunk, EngineStateReport  # noqa: E402
from factories import StandInPool, in_process_router, shipped_args  # noqa: E402



class _Stream:
    """Four tokens in two chunks, the first naming its replica."""

    def __init__(self, replica: str) -> None:
        self.replica, self.chunks = replica, [(5, 6), (7, 8)]

    def __aiter__(self):
        return self

    async def __anext__(self):
        if not self.chunks:
            raise StopAsyncIteration
        first = len(self.chunks) == 2
        ids = self.chunks.pop(0)
        return DecodeChunk(ids, "".join(f"<{t}>" for t in ids), None if self.chunks else "length",
                           replica=self.replica if first else None, engine_first_token_s=0.001 if first else None)

    def cancel(self) -> None:
        pass


class _Engines(StandInPool):
    """Engines that stream; `full` ones report their KV cache full."""

    def __init__(self, role: str, ids: list[str], full: bool = False) -> None:
        super().__init__(role, ids)
        self.full = full

    def state(self, replica: str):
        used = 65536 if self.full else 0
        return EngineStateReport(replica=replica, role=self.role, running=0, waiting=0, kv_used_tokens=used,
                                 kv_capacity_tokens=65536, prefix_cache_hits=0, prefix_cache_queries=0,
                                 kv_transfers_ok=0, kv_transfers_failed=0, kv_received_tokens=0, admitted={})

    def decode_stream(self, call, replica: str):
        return _Stream(replica)


def test_a_request_hosted_on_the_prefill_instance_streams_from_there_alone(tmp_path):
    prefill, decode = _Engines("prefill", ["p0"]), _Engines("decode", ["d0", "d1"], full=True)
    args = shipped_args(policy="slo_goodput", request_log=str(tmp_path / "requests.jsonl"))
    raw = json.dumps({"model": "tiny-qwen2", "prompt": "host me", "max_tokens": 4, "temperature": 0}).encode()

    async def receive():
        return {"type": "http.request", "body": raw, "more_body": False}

    async def scenario():
        r = await in_process_router(prefill, decode, args)
        request = Request({"type": "http", "method": "POST", "path": "/v1/completions", "headers": [(b"content-type", b"application/json")]}, receive)
        resp = await r._handle(request, chat=False)
        return r, resp

    r, resp = asyncio.run(scenario())
    assert resp.status_code == 200, resp.body
    assert json.loads(resp.body)["choices"][0]["text"] == "<5><6><7><8>"
    assert [(method, replica) for method, replica, _ in prefill.calls] == [("decode", "p0")]
    assert decode.calls == []
    call = prefill.calls[0][2]
    assert call.kv_transfer_params is None  # a local prefill: no KV to pull
    (line,) = [json.loads(x) for x in (tmp_path / "requests.jsonl").read_text().splitlines()]
    assert line["prefill"] == line["decode"] == "prefill-p0" and line["fallback"] is None
    cm = r.served["tiny-qwen2"].cost_model
    # the engine holds its prefill's work until the first token and no decode work after it (the decode runs
    # beside the prefills there, not ahead of them), as this router's own ledger does
    assert call.prefill_work_s == pytest.approx(cm.for_instance("prefill-p0").prefill_s(len(call.prompt_token_ids)))
    assert call.work_s == 0.0
    assert (r.counters.failed, r.counters.prefill_retries, r.counters.decode_retries) == (0, 0, 0)
    assert len(r.dispatcher.ledger) == 0
