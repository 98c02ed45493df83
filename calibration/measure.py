"""Measure the target hardware with real engines: the inputs of `fit`.

Starts one prefill and one decode engine from the deployment config's engine settings (the same
`EngineSpec` the Serve replicas build), in this process, with NIXL between them, and measures:
- prefill latency of lone prompts over a geometric ladder of lengths, 16 tokens up to the longest
  the engine takes (random token ids: no prefix-cache hits) — wide enough a range to tell the
  attention term (quadratic in the prompt) from the linear one — each length once unmeasured
  first (an idle engine's wake-up is not prefill work); each
  prefill's KV is then handed to the decode engine, which gives
- the KV hand-off time: the decode engine's first-token time with remote KV minus one decode step;
- decode step time at several concurrencies: the median gap between streamed tokens once every
  stream of the batch is running, each concurrency several times in rotating order, and once a
  round at one concurrency with prompts of half the context (what the context the sequences hold
  costs a step: `long_context_point`);
- the engine's KV capacity.
A second, interleaved set of prefill lengths and concurrencies is kept out of the fit for the
held-out check, measured in every round like the fitted points (`Plan.rounds`), each the median of
its rounds.
"""

from __future__ import annotations

import dataclasses
import os
import random
import statistics
import subprocess
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Callable, NamedTuple

from calibration.fit import Measurements, Sample
from disagg.core.types import Role
from serve_app.config import AppConfig
from serve_app.engine import VllmEngine
from serve_app.messages import PROBE_CONTEXT
from serve_app.probes import median_step_s

GREEDY = {"temperature": 0.0}
SHORTEST_PROMPT = 16
DECODE_ROOM = 64  # tokens below max_model_len left for the decode side's own tokens
SERVING_PROBE_TOKENS = 64  # prompt of the lone requests that measure the serving path
TRANSFER_PROBE_TOKENS = 1024  # and of those that measure the KV transfer's bandwidth (at most half the context)
LONG_CONTEXT_STREAMS = 16  # the decode probe at long context: its streams,
LONG_CONTEXT_MAX = 2048  # and at most this many prompt tokens each: enough to show the term, quick to prefill


def long_context_point(max_model_len: int, max_num_seqs: int) -> tuple[int, int] | None:
    """(streams, prompt tokens each) of the decode probe that measures the cost of the context the
    sequences hold (`decode_context_s`): half the model's context, beside the short probes'
    `PROBE_CONTEXT`; None where the context is too short to tell the two apart."""
    context = min(LONG_CONTEXT_MAX, max_model_len // 2)
    return (min(LONG_CONTEXT_STREAMS, max_num_seqs), context) if context >= 4 * PROBE_CONTEXT else None


@dataclass(frozen=True, slots=True)
class Plan:
    prefill_lengths: tuple[int, ...]
    held_out_lengths: tuple[int, ...]
    concurrencies: tuple[int, ...]
    held_out_concurrencies: tuple[int, ...]
    repeats: int
    decode_tokens: int
    long_context: tuple[int, int] | None = None  # (streams, prompt tokens): `long_context_point`

    @classmethod
    def for_context(cls, max_model_len: int, max_num_seqs: int, quick: bool) -> "Plan":
        top = max(SHORTEST_PROMPT, max_model_len - DECODE_ROOM)
        # geometric: as many rungs per doubling at the short end, where the overhead shows, as at
        # the long end, where the attention term does
        lengths = ladder(SHORTEST_PROMPT, top, 2.0 if quick else 2 ** 0.5)
        held = tuple(sorted({max(SHORTEST_PROMPT, int(top * f)) for f in (0.03, 0.1, 0.4, 0.9)} - set(lengths)))
        conc = tuple(c for c in (1, 2, 4, 8, 16, 32) if c <= max_num_seqs)
        held_c = tuple(c for c in (3, 12) if c <= max_num_seqs)
        long = long_context_point(max_model_len, max_num_seqs)
        if quick:
            return cls(lengths, held[1::2], tuple(c for c in (1, 4, 16) if c <= max_num_seqs), held_c[:1], 2, 32, long)
        return cls(lengths, held, conc, held_c, 3, 48, long)

    def steps(self) -> int:
        return self.repeats * (len(self.prefill_lengths) + len(self.held_out_lengths)) + len(self.concurrencies) \
            + len(self.held_out_concurrencies) + (self.long_context is not None)

    def rounds(self, points: tuple[int, ...], held: tuple[int, ...]) -> list[list[tuple[int, bool]]]:
        """`repeats` rounds of every fitted point and every held-out one, (point, held out), each
        round's order rotated by one: a slow moment of a shared machine lands on different points
        rather than bending the curve, and the held-out points, measured in every round like the
        fitted ones, are the median of as many probes. Measured once after the fitted points, a
        held-out point was one probe of a host whose probes stray by 12–28% (docs/results.md)."""
        every = [(x, False) for x in points] + [(x, True) for x in held]
        return [every[r % len(every):] + every[:r % len(every)] for r in range(self.repeats)] if every else []


def ladder(shortest: int, top: int, ratio: float) -> tuple[int, ...]:
    """shortest, shortest·ratio, shortest·ratio², ... below `top`, then `top` itself."""
    out, x = [], float(shortest)
    while x < top:
        out.append(round(x))
        x *= ratio
    return tuple(sorted({*out, top}))


class GpuShortage(RuntimeError):
    """Fewer GPUs visible than the two calibration engines span."""


def visible_gpus(environ: Mapping[str, str] = os.environ) -> list[str]:
    """The GPUs this process may use: `CUDA_VISIBLE_DEVICES` when set, else what `nvidia-smi -L`
    lists (none without a driver)."""
    if "CUDA_VISIBLE_DEVICES" in environ:
        return [d.strip() for d in environ["CUDA_VISIBLE_DEVICES"].split(",") if d.strip()]
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired):
        return []
    return [str(i) for i, line in enumerate(out.splitlines()) if line.startswith("GPU ")]


def gpu_assignment(visible: Sequence[str], prefill_tp: int, decode_tp: int) -> tuple[str, str]:
    """`CUDA_VISIBLE_DEVICES` of the prefill and the decode engine: disjoint sets of `prefill_tp` and
    `decode_tp` visible GPUs, so the two engines started by one process do not both take GPU 0."""
    need = prefill_tp + decode_tp
    if len(visible) < need:
        raise GpuShortage(f"calibrating on GPUs starts a prefill and a decode engine ({prefill_tp} + {decode_tp} "
                          f"GPUs) on this machine, which has {len(visible)} visible; run it on a GPU node with "
                          f"{need}, or calibrate the running app instead: disagg calibrate --live --url "
                          "http://127.0.0.1:8000 --out runs/fleet.yaml --apply")
    return ",".join(visible[:prefill_tp]), ",".join(visible[prefill_tp:need])


@dataclass(slots=True)
class Result:
    measurements: Measurements
    held_out_prefill: list[Sample]
    held_out_decode: list[Sample]
    seconds: float


class Calibrator:
    def __init__(self, cfg: AppConfig, seed: int = 0) -> None:
        self.cfg = cfg
        self.rng = random.Random(seed)
        self.vocab = 1000
        self._n = 0

    def _ids(self, n: int) -> list[int]:
        return [self.rng.randrange(10, self.vocab) for _ in range(n)]

    def _rid(self, tag: str) -> str:
        self._n += 1
        return f"calib-{tag}-{self._n}"

    async def run(self, plan: Plan, progress: Callable[[int], None] = lambda n: None) -> Result:
        from serve_app.engine_server import engine_spec
        from serve_app.ports import claim_port

        t0 = time.perf_counter()
        host = "127.0.0.1"
        devices: tuple[str | None, str | None] = (None, None)
        if self.cfg.engine.device == "cuda":
            devices = gpu_assignment(visible_gpus(), self.cfg.pool_of(Role.PREFILL).tensor_parallel_size,
                                     self.cfg.pool_of(Role.DECODE).tensor_parallel_size)
        ports = [claim_port(host, self.cfg.engine.side_channel_ports) for _ in range(2)]
        P, D = (VllmEngine(dataclasses.replace(engine_spec(self.cfg, role, host, claim.port), visible_devices=gpus))
                for role, claim, gpus in zip((Role.PREFILL, Role.DECODE), ports, devices))
        started = []
        try:
            for e in (P, D):
                await e.start()
                started.append(e)
            self.vocab = min(len(D.tokenizer), 50_000)
            await self._decode_step(D, 1, 8)  # wake-up, unmeasured
            step1 = await self._decode_step(D, 1, plan.decode_tokens)
            prefill, transfer, held = [], [], {}
            # The first run of a prompt length pays for its shape (and an engine idle for a moment
            # for its wake-up: tens of ms on a small CPU): each length once unmeasured first.
            for p in (*plan.prefill_lengths, *plan.held_out_lengths):
                await self._prefill_and_handoff(P, D, p, step1)
            for round_ in plan.rounds(plan.prefill_lengths, plan.held_out_lengths):
                for p, held_out in round_:
                    s, x = await self._prefill_and_handoff(P, D, p, step1)
                    if held_out:
                        held.setdefault(p, []).append(s.seconds)
                    else:
                        prefill.append(s)
                        transfer.append(x)
                    progress(1)
            held_prefill = [Sample(p, statistics.median(v)) for p, v in held.items()]
            decode, held = [], {}
            for round_ in plan.rounds(plan.concurrencies, plan.held_out_concurrencies):
                for b, held_out in round_:
                    step = await self._decode_step(D, b, plan.decode_tokens)
                    if held_out:
                        held.setdefault(b, []).append(step)
                    else:
                        decode.append(Sample(b, step))
                if plan.long_context is not None:  # once a round, among the short probes' rounds
                    b, context = plan.long_context
                    step = await self._decode_step(D, b, plan.decode_tokens, context)
                    decode.append(Sample(b, step, extra_context=context - PROBE_CONTEXT))
            progress(len(plan.concurrencies) + len(plan.held_out_concurrencies) + (plan.long_context is not None))
            held_decode = [Sample(b, statistics.median(v)) for b, v in held.items()]
            state = await D.state()
            e = self.cfg.engine
            m = Measurements(prefill=prefill, decode=decode, transfer=transfer,
                             kv_capacity_tokens=state.kv_capacity_tokens, model=self.cfg.model.source,
                             block_size=e.block_size or 16, max_num_seqs=e.max_num_seqs,
                             max_batched_tokens=e.max_num_batched_tokens)
            return Result(m, held_prefill, held_decode, time.perf_counter() - t0)
        finally:
            for e in started:
                await e.shutdown()
            for claim in ports:
                claim.release()

    async def _prefill_and_handoff(self, P: VllmEngine, D: VllmEngine, p: int, step1: float) -> tuple[Sample, Sample]:
        ids = self._ids(p)
        rid = self._rid("p")
        r = await P.prefill(rid, ids, {"max_tokens": 1, **GREEDY})
        t = time.perf_counter()
        async for _ in D.decode(rid, ids, {"max_tokens": 1, **GREEDY}, r.kv_transfer_params):
            break
        first = time.perf_counter() - t
        # the decode engine's first token = pulling the KV + one step over the last prompt token
        return Sample(p, r.engine_ttft_s), Sample(p, max(first - step1, 1e-6))

    async def _decode_step(self, D: VllmEngine, batch: int, tokens: int, context: int = PROBE_CONTEXT) -> float:
        """Median inter-token gap while all `batch` streams of `context` prompt tokens run together."""
        return await median_step_s(lambda: D.decode(self._rid("d"), self._ids(context), {
            "max_tokens": tokens, "ignore_eos": True, **GREEDY}, None), batch)


class LoneRequest(NamedTuple):
    """One lone request through the app, timed by the client and by the engines (route header)."""

    ttft_s: float  # the client's
    outside_s: float  # the part of it outside the engines: proxy, router, Serve hops
    decode_first_s: float  # the decode engine's own time from its call to the first token
    decode_id: str | None  # the instance that decoded it
    disaggregated: bool  # a prefill engine ran it first: the decode engine's time includes the KV pull
    prompt_tokens: int


def detours(gaps: Sequence[LoneRequest], splits: bool) -> list[str]:
    """The policies to route more lone requests with, so that the short ones, which the serving path
    and the hand-off are measured on, take both paths: `round_robin` if none of them crossed a
    prefill engine where the app has one (`splits`), `colocated` if none was served by one engine
    alone. The app's own policy may send a long prompt one way and a short one the other."""
    short = [g for g in gaps if g.prompt_tokens == SERVING_PROBE_TOKENS]
    return ((["round_robin"] if splits and not any(g.disaggregated for g in short) else [])
            + (["colocated"] if all(g.disaggregated for g in short) else []))


async def serving_path_gaps(url: str, prompt_tokens: int | tuple[int, ...], n: int, seed: int = 0,
                            timeout_s: float = 60.0) -> list[LoneRequest]:
    """`n` lone streaming requests through a running app per prompt length (one length, or several
    in turn): one at a time, random token ids so no prefix-cache hits, one unmeasured first. The
    engines' own part is what they report in the `x-disagg-route` header (the prefill's time and the
    decode engine's time to its first token), so the gap is measured, not modelled: the HTTP proxy,
    the router and the Serve hops. Sent and timed by the bench's client, as every live figure is."""
    from disagg.app_client import AppError, AsyncAppClient
    from disagg.bench.loadgen import PlannedRequest, prompt_seed, send_one

    lengths = (prompt_tokens,) if isinstance(prompt_tokens, int) else tuple(prompt_tokens)
    out: list[LoneRequest] = []
    async with AsyncAppClient(url, timeout_s=timeout_s, max_connections=1) as app:
        try:
            model = (await app.model())["id"]
        except (AppError, KeyError, TypeError) as e:
            raise RuntimeError(f"{url}: no model from /v1/models ({e})") from None
        for i in range(n * len(lengths) + 1):
            tokens = lengths[(i - 1) % len(lengths)] if i else lengths[0]  # alternating: a slow spell hits both
            req = PlannedRequest(index=i, at_s=0.0, prompt_tokens=tokens, max_tokens=2,
                                 prompt_seed=prompt_seed(seed, "calibrate/serving", i))
            r = await send_one(app.http, model, req, timeout_s=timeout_s)
            if r.error or r.ttft_s is None:
                raise RuntimeError(f"{url}/v1/completions: {r.error or 'a streamed completion carried no token'}")
            try:
                prefill = float(r.route.get("prefill_engine_s", 0.0))
                decode_first = float(r.route["decode_engine_first_s"])
            except (KeyError, ValueError):
                raise RuntimeError(f"{url}: the x-disagg-route header carries no engine times "
                                   f"({r.route or 'no header'}): not this product's router, or an older one") from None
            if i:  # the first one wakes an idle path up
                out.append(LoneRequest(r.ttft_s, r.ttft_s - prefill - decode_first, decode_first,
                                       r.route.get("served_decode"), "prefill_engine_s" in r.route, tokens))
    return out
