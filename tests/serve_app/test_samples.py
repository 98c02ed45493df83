"""`n > 1` over prefill and decode, in-process over stand-in engines: one prefill and one KV pull
serve every sample; samples 1..n-1 run on the decode instance that pulled it, prefilled there from
its prefix cache, each with vLLM's own seed for its index; the answer has every sample."""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm")
sys.path.insert(0, str(Path(__file__).parent))

from test_bad_requests import MODEL, _Pool, _post, _router  # noqa: E402


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("chat", [False, True])
def test_n_samples_share_one_prefill_and_one_kv_pull(stream, chat):
    async def run():
        prefill, decode = _Pool("prefill", ["p1"]), _Pool("decode", ["d1", "d2"])
        r = await _router(prefill, decode)
        body = {"model": MODEL, "max_tokens": 3, "n": 3, "seed": 7, "stream": stream}
        body.update({"messages": [{"role": "user", "content": "x"}]} if chat else {"prompt": "x"})
        resp, out = await _post(r, body, chat=chat)
        return r, prefill, decode, resp, out
    r, prefill, decode, resp, out = asyncio.run(run())
    assert resp.status_code == 200
    assert [name for name, *_ in prefill.calls] == ["prefill"]  # one prefill for every sample
    calls = [(replica, call) for name, replica, call in decode.calls if name == "decode"]
    assert len(calls) == 3 and len({replica for replica, _ in calls}) == 1  # all on the instance holding the KV
    with_kv = [c for _, c in calls if c.kv_transfer_params]
    assert len(with_kv) == 1 and with_kv[0] is calls[0][1]  # sample 0 pulls it; the others hit the cache
    assert [c.params.seed for _, c in calls] == [7, 8, 9] and all(c.params.n == 1 for _, c in calls)
    if stream:
        events = [json.loads(line.removeprefix("data: ")) for chunk in out for line in chunk.split("\n\n")
                  if line.startswith("data: {")]
        indexes = {c["index"] for e in events for c in e["choices"]}
    else:
        indexes = {c["index"] for c in out["choices"]}
        assert out["usage"]["completion_tokens"] == 9
    assert indexes == {0, 1, 2}
    assert r.flights == {} and len(r.ledger) == 0 and r.counters.served == 1
