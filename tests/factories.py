"""Small, real test inputs for the routing core: hand-built instance views, requests, a cost model.

Numbers are chosen so costs can be computed by hand in a test:

    step_base_s = 0.01, prefill_token_s = 0.001, decode_seq_s = 0.001,
    kv_capacity_tokens = 10_000, max_batched_tokens = 256,
    transfer: latency 0.002 s, 100_000 tokens/s.

so a lone 100-token prefill takes 0.01 + 0.1 = 0.11 s and one decode token at concurrency b takes
0.01 + 0.001·b s.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any, Iterable, Sequence

from disagg.bench.sse import DONE
from disagg.core.cost_model import CostModel
from disagg.core.types import InstanceView, RequestFeatures, Role, SloClass

STEP_BASE_S = 0.01
PREFILL_TOKEN_S = 0.001
DECODE_SEQ_S = 0.001
KV_CAPACITY = 10_000
MAX_BATCHED_TOKENS = 256
TRANSFER_LATENCY_S = 0.002
TRANSFER_TOKENS_PER_S = 100_000.0

_ID_PREFIX = {Role.PREFILL: "p", Role.DECODE: "d", Role.BOTH: "b"}


def engine_dict(**overrides: Any) -> dict:
    d = {
        "step_base_s": STEP_BASE_S,
        "prefill_token_s": PREFILL_TOKEN_S,
        "decode_seq_s": DECODE_SEQ_S,
        "kv_capacity_tokens": KV_CAPACITY,
        "block_size": 16,
        "max_num_seqs": 64,
        "max_batched_tokens": MAX_BATCHED_TOKENS,
    }
    d.update(overrides)
    return d


def cost_model_dict(**overrides: Any) -> dict:
    """A valid cost-model mapping (as it would come out of YAML); top-level keys overridable."""
    d = {
        "name": "test-small",
        "model": "none",
        "engine": engine_dict(),
        "transfer": {"latency_s": TRANSFER_LATENCY_S, "tokens_per_s": TRANSFER_TOKENS_PER_S},
        "slo": {"tight": {"ttft_s": 0.2, "tpot_s": 0.05}, "loose": {"ttft_s": 0.6, "tpot_s": 0.15}},
    }
    d.update(overrides)
    return d


def make_cost_model(**overrides: Any) -> CostModel:
    return CostModel.from_dict(cost_model_dict(**overrides))


def make_instances(
    role: Role = Role.DECODE,
    *,
    backlog_s: Sequence[float] | None = None,
    queued: Sequence[int] | None = None,
    kv_used: Sequence[int] | None = None,
    capacity: int | Sequence[int] = KV_CAPACITY,
    n: int | None = None,
    prefix: str | None = None,
) -> list[InstanceView]:
    """One InstanceView per position; the given per-instance lists must agree in length.

    Ids are `<prefix><index>` with prefix p/d/b by role, so `make_instances(Role.DECODE,
    backlog_s=[0.2, 0.0, 1.5])` gives d0, d1, d2. Unspecified fields are idle (0).
    """
    lists = {k: v for k, v in {"backlog_s": backlog_s, "queued": queued, "kv_used": kv_used}.items() if v is not None}
    if not isinstance(capacity, int):
        lists["capacity"] = capacity
    lengths = {len(v) for v in lists.values()}
    if n is not None:
        lengths.add(n)
    if len(lengths) > 1:
        raise ValueError(f"make_instances: lists disagree in length: { {k: len(v) for k, v in lists.items()} }, n={n}")
    size = lengths.pop() if lengths else 3
    pre = prefix if prefix is not None else _ID_PREFIX[role]
    caps = list(capacity) if not isinstance(capacity, int) else [capacity] * size
    return [
        InstanceView(
            instance_id=f"{pre}{i}",
            role=role,
            backlog_s=float(backlog_s[i]) if backlog_s is not None else 0.0,
            queued=int(queued[i]) if queued is not None else 0,
            kv_used_tokens=int(kv_used[i]) if kv_used is not None else 0,
            kv_capacity_tokens=int(caps[i]),
        )
        for i in range(size)
    ]


def make_request(
    prompt_tokens: int = 100,
    predicted_output_tokens: int = 50,
    slo_class: SloClass = SloClass.LOOSE,
    true_output_tokens: int | None = None,
    request_id: str = "r0",
) -> RequestFeatures:
    return RequestFeatures(
        request_id=request_id,
        prompt_tokens=prompt_tokens,
        predicted_output_tokens=predicted_output_tokens,
        slo_class=slo_class,
        true_output_tokens=true_output_tokens,
    )


# --- stand-in engine pools for the router run in-process (tests/serve_app) -------------------------------

def stream_text(events: Iterable[str]) -> tuple[str, list[str]]:
    """A streamed completion's text and its error events' messages, from its events' data (as
    `disagg.bench.sse` gives them); [DONE] and events without a choice (usage) add no text."""
    text, errors = "", []
    for data in events:
        if data == DONE:
            continue
        event = json.loads(data)
        if "error" in event:
            errors.append(event["error"]["message"])
        elif event.get("choices"):
            text += event["choices"][0]["text"]
    return text, errors


@functools.cache
def tiny_tokenizer():
    """The served tiny model's tokenizer (the model is built once, offline, if missing)."""
    from transformers import AutoTokenizer

    from serve_app.tiny_model import build_tiny_model
    return AutoTokenizer.from_pretrained(build_tiny_model())


def vllm_text(tokenizer, prompt: Sequence[int], output: Sequence[int]) -> str:
    """The text vLLM streams for `output` after `prompt` (its detokenizer: a `tokenizers`
    DecodeStream primed with the prompt; no stop strings)."""
    from tokenizers.decoders import DecodeStream

    stream, text = DecodeStream(ids=list(prompt), skip_special_tokens=True), ""
    for t in output:
        text += stream.step(tokenizer.backend_tokenizer, t) or ""
    return text


def stream_token_ids(events: Iterable[str]) -> tuple[list[int] | None, list[int]]:
    """A completion streamed with `return_token_ids`: its prompt's ids (first chunk) and all its
    output ids, chunk after chunk."""
    prompt, output = None, []
    for data in events:
        event = json.loads(data) if data != DONE else {}
        if event.get("choices"):
            choice = event["choices"][0]
            if prompt is None:
                prompt = choice.get("prompt_token_ids")
            output += choice["token_ids"]
    return prompt, output


def as_output_deltas(chunks):
    """A stand-in decode's `DecodeChunk`s as the `OutputDelta`s (vLLM `CompletionOutput`s) an engine
    replica's `generate` streams; the stream's `cancel` passes through."""
    from vllm.logprobs import Logprob
    from vllm.outputs import CompletionOutput

    from serve_app.messages import OutputDelta

    def logprobs(chunk):
        if chunk.logprobs is None:
            return None
        steps = []  # as vLLM orders them: the sampled token first, then the top alternatives by rank
        for tid, lp in zip(chunk.token_ids, chunk.logprobs):
            top = {tid if text == lp.token else 10_000 + rank: Logprob(value, rank=rank, decoded_token=text)
                   for rank, (text, value) in enumerate(lp.top, start=1)}
            sampled = top.pop(tid, Logprob(lp.logprob, rank=len(lp.top) + 1, decoded_token=lp.token))
            steps.append({tid: sampled, **top})
        return steps

    class Deltas:
        def __init__(self) -> None:
            self.chunks = chunks

        def __aiter__(self):
            return self

        async def __anext__(self):
            c = await self.chunks.__anext__()
            out = CompletionOutput(index=0, text=c.text, token_ids=list(c.token_ids), cumulative_logprob=None,
                                   logprobs=logprobs(c), finish_reason=c.finish_reason)
            return OutputDelta(out, c.finish_reason is not None, replica=c.replica,
                               engine_first_token_s=c.engine_first_token_s)

        def cancel(self) -> None:
            if hasattr(self.chunks, "cancel"):
                self.chunks.cancel()

        def __getattr__(self, name):
            return getattr(self.chunks, name)

    return Deltas()


class BroadcastResults:
    """What a pool handle's `broadcast(...)` returns: the replies, fetched with `results_async`."""

    def __init__(self, value: list) -> None:
        self.value = value

    async def results_async(self, timeout_s: float | None = None, return_exceptions: bool = False) -> list:
        return self.value


def idle_state(replica: str, role: Role | str, admitted: dict | None = None):
    """An engine's state report with nothing running and a 64k-token KV cache."""
    from serve_app.messages import EngineStateReport

    return EngineStateReport(replica=replica, role=Role(role), running=0, waiting=0, kv_used_tokens=0,
                             kv_capacity_tokens=65536, prefix_cache_hits=0, prefix_cache_queries=0,
                             kv_transfers_ok=0, kv_transfers_failed=0, kv_received_tokens=0,
                             admitted=admitted or {})


class StandInPool:
    """An engine pool's handle for the router run in-process: answers `broadcast("state")` and the
    `prefill` / `decode` calls the router pins to a replica, recording each as (method, replica,
    call) in `calls`. A test subclasses it to change `state`, `prefill_reply` or `decode_stream`."""

    def __init__(self, role: Role | str, ids: list[str]) -> None:
        self.role, self.ids = role, ids
        self.calls: list[tuple[str, str, Any]] = []
        self.broadcasts: list[tuple[str, tuple]] = []  # (method, args) of every broadcast but the polls
        self.version = 1  # the engines' state version (`changed` makes the next and pushes it)
        self._watchers: list = []  # one queue per open `watch` stream

    def state(self, replica: str):
        return idle_state(replica, self.role)

    async def prefill_reply(self, call, replica: str):
        from serve_app.messages import PrefillReply

        return PrefillReply(kv_transfer_params={"remote": replica}, first_token_id=7, engine_ttft_s=0.001,
                            replica=replica)

    def decode_stream(self, call, replica: str):
        raise NotImplementedError("a decode pool's test says how it streams")

    def broadcast(self, method: str, *args) -> BroadcastResults:
        if method != "state":
            self.broadcasts.append((method, args))
        else:  # a test may have changed what `state` answers: the engine would publish a new version
            self.version += 1
        return BroadcastResults([self._versioned(r) if method == "state" else {} for r in self.ids])

    def _versioned(self, replica: str):
        from dataclasses import replace

        return replace(self.state(replica), seq=self.version)

    def changed(self) -> None:
        """The engines' state moved: a new version, pushed on every open `watch` stream."""
        self.version += 1
        for q in self._watchers:
            q.put_nowait(None)

    async def watch_stream(self, router: str, replica: str):
        """What `EngineServer.watch` streams: the current version, then each new one."""
        import asyncio

        q: asyncio.Queue = asyncio.Queue()
        self._watchers.append(q)
        try:
            while True:
                yield self._versioned(replica)
                await q.get()
                if replica not in self.ids:
                    raise RuntimeError(f"replica {replica} is gone")
        finally:
            self._watchers.remove(q)

    @property
    def watch(self) -> "_PinnedMethod":
        return _PinnedMethod(self, "watch", self.watch_stream)

    def options(self, **kw) -> "StandInPool":
        return self

    @property
    def prefill(self) -> "_PinnedMethod":
        return _PinnedMethod(self, "prefill", self.prefill_reply)

    @property
    def decode(self) -> "_PinnedMethod":
        return _PinnedMethod(self, "decode", self.decode_stream)

    @property
    def generate(self) -> "_PinnedMethod":
        return _PinnedMethod(self, "decode", self.generate_stream)

    def generate_stream(self, call, replica: str):
        """`decode_stream`'s chunks as the engines' `generate` streams them: vLLM's outputs."""
        return as_output_deltas(self.decode_stream(call, replica))

    async def release_reply(self, call, replica: str) -> None:
        return None

    async def abort_reply(self, request_id, replica: str) -> None:
        return None

    @property
    def abort(self) -> "_PinnedMethod":
        return _PinnedMethod(self, "abort", self.abort_reply)

    @property
    def release_kv(self) -> "_PinnedMethod":
        return _PinnedMethod(self, "release_kv", self.release_reply)

    async def probe_reply(self, call, replica: str):
        from serve_app.messages import ProbeReply

        return ProbeReply(seconds=0.001, replica=replica, kv_capacity_tokens=65536)

    @property
    def probe(self) -> "_PinnedMethod":
        return _PinnedMethod(self, "probe", self.probe_reply)


class _PinnedMethod:
    """`pool.<method>.remote(call, replica=...)`, as a Serve handle offers it."""

    def __init__(self, pool: StandInPool, name: str, answer) -> None:
        self.pool, self.name, self.answer = pool, name, answer

    def remote(self, *args, replica: str | None = None):
        call = args[0] if len(args) == 1 else args  # release_kv(request_id, kv_transfer_params): both
        self.pool.calls.append((self.name, replica, call))
        return self.answer(call, replica)


def shipped_args(config: str = "local.yaml", **router: Any) -> dict:
    """A shipped Serve config's application args (a fresh copy), the router's settings updated by
    `router`, its request log off and its policy `marginal_cost` unless given: the tests that build
    a router from it drive the disaggregated path (prefill call, KV hand-off, decode call), which the
    shipped default (`slo_goodput`) takes only where it prices fewer misses."""
    import yaml

    path = Path(__file__).resolve().parents[1] / "deployments" / config
    args = yaml.safe_load(path.read_text())["applications"][0]["args"]
    args["router"] = {**args["router"], "request_log": None, "policy": DISAGGREGATING_POLICY, **router}
    return args


DISAGGREGATING_POLICY = "marginal_cost"  # always a prefill instance and another, decode, instance


async def in_process_router(prefill: Any, decode: Any, args: dict, pools: dict | None = None, *,
                            poll: bool = True, background: bool = False):
    """The real router deployment's class (the one under Serve's ingress wrapper), built in this
    process over stand-in pools. Unless `background`, its loops (polls, lag, metrics, planner) are
    stopped: a test polls by hand (once here unless `poll` is False) and decides how stale each view is."""
    from serve_app.router import Router

    cls = Router.__mro__[1]
    r = cls.__new__(cls)
    await r.__init__(prefill, decode, args, pools)
    if background:
        return r
    r.stop_background()
    if poll:
        await r.poll_once()
    return r
