"""An engine stand-in for the fleet-scale rig: the engine replica's interface, no model.

The router's control path (state pushes, the registry, the policy over many instances) has to be
measured at fleet size: 64 engines and 4 routers. No host here runs 64 vLLM engines, so the rig
(`engine.stand_in: true`, deployments/rig-64.yaml) puts this class where `EngineServer` runs. It
speaks the same interface the router uses — `prefill`, `generate`, `watch`, `state`, `abort`,
`release_kv`, `reset_prefix_cache`, `decision_ages` — with the same per-router ledger and the same
`StatePublisher`, and times its work with the calibrated engine model: a prefill takes the cost
model's `prefill_s(prompt)` of the tokens its prefix cache does not hold, one at a time; every
running sequence gets a token per step of `step_s(0, running)`. Its prefix cache is an LRU of
KV blocks up to its capacity, filled by the prompts it prefills or receives and by its answers,
evicted tail first, and published as vLLM publishes its KV events (`engine.kv_events`): into the
same fold, pushed to the routers with the state. It measures router scale only: the real engines
stay the end-to-end test.

A stand-in replica must stay small (64 of them share the host), so it never imports vLLM. Two
things cross Ray as vLLM objects, and both are handled here without it:
- the calls' `SamplingParams` unpickle into `WireSamplingParams`, a plain record built from the
  field names the app builder reads off the real class (`vllm_wire_names`) and passes in;
- the token stream's `CompletionOutput`s are sent as `WireOutput`, which unpickles as vLLM's own
  `CompletionOutput` on the router side, where vLLM is loaded.
"""

from __future__ import annotations

import asyncio
import os
import sys
import time
import types
from collections import OrderedDict
from dataclasses import dataclass, field
from enum import IntEnum
from typing import Any, AsyncIterator

from disagg.core.kv_event_fold import KvEventFold
from disagg.core.prefix_index import index_block_tokens
from disagg.core.types import Role
from serve_app.call_ledger import CallLedger
from serve_app.config import AppConfig, load_cost_model
from serve_app.messages import EngineStateReport, GenerateCall, OutputDelta, PrefillCall, PrefillReply
from serve_app.state_push import StatePublisher

TOKEN_ID = 100  # what every stand-in sequence generates
TOKEN_TEXT = " a"


def vllm_wire_names() -> dict:
    """What a stand-in needs to read vLLM's sampling parameters without vLLM: the field order of
    `SamplingParams` (it pickles as its class and the field values in that order) and the values of
    `RequestOutputKind`. Called by the app builder, where vLLM is loaded."""
    from vllm.sampling_params import RequestOutputKind, SamplingParams

    return {"sampling_fields": list(SamplingParams.__struct_fields__),
            "output_kinds": {k.name: int(k.value) for k in RequestOutputKind}}


def install_wire_types(names: dict) -> None:
    """Make `vllm.sampling_params` importable in this (vLLM-free) process as the two plain types the
    calls unpickle into. A no-op where vLLM itself is loaded."""
    if "vllm.sampling_params" in sys.modules:
        return
    fields = tuple(names["sampling_fields"])

    class WireSamplingParams:
        """vLLM's SamplingParams as plain attributes (no validation: the router validated it)."""

        def __init__(self, *values: Any) -> None:
            self.__dict__.update(zip(fields, values))

    module = types.ModuleType("vllm.sampling_params")
    module.SamplingParams = WireSamplingParams
    module.RequestOutputKind = IntEnum("RequestOutputKind", names["output_kinds"])
    package = sys.modules.setdefault("vllm", types.ModuleType("vllm"))
    package.sampling_params = module
    sys.modules["vllm.sampling_params"] = module


def completion_output(index: int, text: str, token_ids: list[int], finish_reason: str | None) -> Any:
    """vLLM's CompletionOutput, built where it is unpickled (the router)."""
    from vllm.outputs import CompletionOutput

    return CompletionOutput(index=index, text=text, token_ids=token_ids, cumulative_logprob=None, logprobs=None,
                            finish_reason=finish_reason)


@dataclass(slots=True)
class WireOutput:
    """A CompletionOutput sent from a process without vLLM."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None

    def __reduce__(self):
        return completion_output, (self.index, self.text, self.token_ids, self.finish_reason)


class _PrefixCache:
    """The stand-in's prefix cache: an LRU of KV blocks (each named by its prefix), and the KV
    events a vLLM engine would publish for it, folded as the real replica folds them."""

    def __init__(self, block_size: int, capacity_tokens: int, fold: KvEventFold | None) -> None:
        self.block_size = block_size
        self.capacity_blocks = max(1, capacity_tokens // block_size)
        self.fold = fold
        self._blocks: OrderedDict[int, None] = OrderedDict()  # least recently used first

    def cached_tokens(self, token_ids: list[int]) -> int:
        """Leading tokens of `token_ids` held (the last token is always computed, as in vLLM)."""
        n = 0
        for h, _ in self._chain(token_ids[:-1]):
            if h not in self._blocks:
                break
            n += self.block_size
        return n

    def store(self, token_ids: list[int]) -> None:
        """The full blocks of `token_ids` are computed (or received): cache them, evicting beyond capacity."""
        chain = self._chain(token_ids)
        parent = None
        for h, block in chain:
            if h not in self._blocks:
                self._blocks[h] = None
                if self.fold is not None:
                    self.fold.stored(parent, [h], block, self.block_size)
            parent = h
        for h, _ in reversed(chain):  # the first block the most recent: a prefix is evicted from its tail
            self._blocks.move_to_end(h)
        while len(self._blocks) > self.capacity_blocks:
            old, _ = self._blocks.popitem(last=False)
            if self.fold is not None:
                self.fold.removed([old])

    def clear(self) -> None:
        self._blocks.clear()
        if self.fold is not None:
            self.fold.cleared()

    def _chain(self, token_ids: list[int]) -> list[tuple[int, tuple[int, ...]]]:
        out, h, bs = [], 0, self.block_size
        for i in range(0, len(token_ids) - bs + 1, bs):
            block = tuple(token_ids[i:i + bs])
            h = hash((h, block))
            out.append((h, block))
        return out


@dataclass(slots=True)
class _Sequence:
    prompt_tokens: int
    left: int  # tokens still to generate
    generated: int = 0
    tokens: asyncio.Queue = field(default_factory=asyncio.Queue)  # one None per token, then the end


class StandInEngine:
    """The engine replica's interface over the calibrated engine model (see the module docstring)."""

    async def __init__(self, config: dict, role: str, prefill_pool: Any = None, wire_names: dict | None = None) -> None:
        from ray import serve

        install_wire_types(wire_names or {"sampling_fields": [], "output_kinds": {}})
        cfg = AppConfig.model_validate(config)
        self.role = Role(role)
        self.replica_id = serve.get_replica_context().replica_id.unique_id
        self.constants = load_cost_model(cfg.router.cost_model).for_instance("")
        self.block_size = cfg.engine.block_size or 16
        self.capacity = self.constants.kv_capacity_tokens
        self.stream_interval_s = cfg.engine.stream_interval_s
        self.calls = CallLedger(self.role)
        self.running: dict[str, _Sequence] = {}
        self.prefills_waiting = 0
        self.steps = 0  # its steps, a prefill's included, as vLLM's engine reports them
        self._prefill_lock = asyncio.Lock()  # one prefill at a time, in arrival order
        self._work = asyncio.Event()
        self._stepper = asyncio.create_task(self._step_forever())
        fold = KvEventFold(index_block_tokens(self.block_size)) if cfg.engine.kv_events else None
        self.cache = _PrefixCache(self.block_size, self.capacity, fold)
        self.publisher = StatePublisher(self._report, cfg.engine.push_interval_s, self.block_size, self.capacity,
                                        cfg.engine.state_age_bound_s, fold)

    # -- the engine model ----------------------------------------------------------------------

    async def _prefilled(self, prompt: list[int]) -> tuple[float, int]:
        """Run one prefill in turn: (its seconds from the call, the prompt tokens the cache held)."""
        t0 = time.perf_counter()
        self.prefills_waiting += 1
        self.publisher.poke()
        try:
            async with self._prefill_lock:
                cached = self.cache.cached_tokens(prompt)
                await asyncio.sleep(self.constants.prefill_s(len(prompt) - cached))
                self.cache.store(prompt)
                self.steps += 1
        finally:
            self.prefills_waiting -= 1
            self.publisher.poke()
        return time.perf_counter() - t0, cached

    async def _step_forever(self) -> None:
        while True:
            if not self.running:
                self._work.clear()
                await self._work.wait()
            await asyncio.sleep(self.constants.step_s(0, len(self.running)))
            for rid, seq in list(self.running.items()):
                seq.generated += 1
                seq.left -= 1
                seq.tokens.put_nowait(None)
                if seq.left <= 0:
                    del self.running[rid]
            self.steps += 1
            self.publisher.poke()

    def _kv_used(self) -> int:
        return sum(s.prompt_tokens + s.generated for s in self.running.values())

    async def _report(self) -> EngineStateReport:
        return EngineStateReport(
            replica=self.replica_id, role=self.role, running=len(self.running), waiting=self.prefills_waiting,
            kv_used_tokens=min(self.capacity, self._kv_used()), kv_capacity_tokens=self.capacity,
            prefix_cache_hits=0, prefix_cache_queries=0, kv_transfers_ok=0, kv_transfers_failed=0,
            kv_received_tokens=0, admitted=self.calls.totals(), pid=os.getpid(), block_size=self.block_size,
            steps=self.steps,
            kv_events_missed=self.cache.fold.unattributed if self.cache.fold else 0)

    # -- the replica interface -------------------------------------------------------------------

    def _admit(self, call: PrefillCall | GenerateCall) -> None:
        self.calls.arrived(call)
        self.publisher.call_arrived(call.state_seq, call.decided_at)

    def _release(self, call: PrefillCall | GenerateCall, after_first_token: bool = False) -> None:
        self.calls.ended(call, after_first_token)
        self.publisher.poke()

    async def prefill(self, call: PrefillCall, replica: str | None = None) -> PrefillReply:
        self._admit(call)
        try:
            seconds, cached = await self._prefilled(list(call.prompt_token_ids))
        finally:
            self._release(call)
        return PrefillReply(kv_transfer_params={"stand_in": self.replica_id}, first_token_id=TOKEN_ID,
                            engine_ttft_s=seconds, replica=self.replica_id, cached_tokens=cached)

    async def generate(self, call: GenerateCall, replica: str | None = None) -> AsyncIterator[OutputDelta]:
        self._admit(call)
        t0, prefilled = time.perf_counter(), False
        try:
            prompt = list(call.prompt_token_ids)
            held = self.cache.fold.held_tokens(prompt) if self.cache.fold else None
            if call.kv_transfer_params is None:
                await self._prefilled(prompt)
            else:
                self.cache.store(prompt)  # the pulled KV is cached, as vLLM caches it
            seq = _Sequence(len(prompt), max(1, call.params.max_tokens or 16))
            self.running[call.request_id] = seq
            self._work.set()
            first = True
            while seq.left > 0 or not seq.tokens.empty():
                await seq.tokens.get()
                if first:
                    self.calls.first_token(call)
                    prefilled = True
                else:
                    await asyncio.sleep(self.stream_interval_s)  # batch the tokens of an interval, as the engines do
                n = 1 + seq.tokens.qsize()
                for _ in range(n - 1):
                    seq.tokens.get_nowait()
                done = seq.left <= 0 and seq.tokens.empty()
                out = WireOutput(0, TOKEN_TEXT * n, [TOKEN_ID] * n, "length" if done else None)
                yield OutputDelta(output=out, finished=done, replica=self.replica_id if first else None,
                                  engine_first_token_s=time.perf_counter() - t0 if first else None,
                                  num_cached_tokens=0 if first else None, held_tokens=held if first else None)
                first = False
            self.cache.store(prompt + [TOKEN_ID] * (seq.generated - 1))  # the answer's KV, all but the last token's
        finally:
            self.running.pop(call.request_id, None)
            self._release(call, after_first_token=prefilled)

    async def watch(self, router: str = "", replica: str | None = None) -> AsyncIterator[EngineStateReport]:
        async for r in self.publisher.watch():
            yield r

    async def state(self, exact: bool = False) -> EngineStateReport:
        return await self.publisher.publish(exact)

    def decision_ages(self) -> list[float]:
        return self.publisher.take_ages()

    async def abort(self, request_id: str, replica: str | None = None) -> None:
        if (seq := self.running.pop(request_id, None)) is not None:
            seq.left = 0  # its stream ends at once
            seq.tokens.put_nowait(None)

    async def release_kv(self, request_id: str, kv_transfer_params: dict, replica: str | None = None) -> None:
        return None

    async def reset_prefix_cache(self) -> bool:
        self.cache.clear()
        self.publisher.poke()
        return True

    async def check_health(self) -> None:
        if self._stepper.done():
            raise RuntimeError("the stand-in's step loop ended")

    async def __del__(self) -> None:
        self._stepper.cancel()
        self.publisher.close()
