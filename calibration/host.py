"""Calibrate the shared host: how the engines of one machine slow each other down, and what CPU the
serving path takes beside them (`CostModel.shared_host`, the processor-sharing model).

`disagg calibrate --live --url URL --host --out FILE`, run on the machine the app runs on:
1. **Contention.** Decode probes (`/admin/probe`, timed in the engine replicas) on 1, 2, … k of
   the app's engines at once (every model's: they all share the host), every engine measured alone
   too. An engine's step time with k busy over its time alone is the stretch at k; `engine_cores`
   is the least-squares fit of `stretch = max(1, k / engine_cores)` (`fit_engine_cores`).
   Then the unevenness of that sharing (`prefill_weight`): in each round, a decode probe on one
   engine and a run of lone prefills on another, each alone and then overlapping. The share each
   got of the core is one over its stretch, and their ratio is the prefill's weight
   (`fit_prefill_weight`); their sum is the cores the two shared (`mixed_cores`: decode steps
   beside each other can lose more of a core than a prefill beside a decode does).
2. **Serving CPU.** The host's CPU time (/proc/stat, less this process's own) over four windows:
   idle, a few streams of long answers, many such streams, and many short requests, all through
   the app. The idle rate is the stack's background (`idle_cores`; `settle`'s quiet window where
   one ran before). Each loaded window's CPU above it, less the engines' own above theirs, is split
   into CPU per engine step (the engines count their steps: `/admin/state`), per message of tokens
   the client received and per request (`fit_serving_cpu`). Per streamed token it is not a
   constant: on the CPU profile it fell two- to fourfold from one stream to sixteen, as each step
   carries more tokens and the engine replicas batch a stream's tokens into messages; per step and
   per message it held (benchmarks/serving_cpu_terms.py). The engines' CPU is read from their
   processes (the EngineCore and its workers, as `/admin/state` names them): what their steps
   took, measured. Where no engine names its processes (stand-ins) it is what the steps of that
   load take by the fitted constants, a small difference of two large numbers on a saturated
   host: fits minutes apart read 0–113 and 618–1,192 µs per token that way.
3. `cores`: the host's online processors.

The host must be the app's alone while this runs: any other work on it counts as the serving path's.
"""

from __future__ import annotations

import asyncio
import math
import os
import statistics
import time
from dataclasses import dataclass
from typing import Awaitable, Callable, Collection, Sequence

import numpy as np

from disagg.core.cost_model import EngineConstants, SharedHost

TICK_S = 1.0 / os.sysconf("SC_CLK_TCK")
STREAM_TOKENS = 128  # the streaming windows: long answers, so steps and messages dominate their CPU
STREAMS = 16
STREAM_REQUESTS = 48
FEW_STREAMS = 2  # a few streams: many steps, each of few tokens, in few messages
FEW_STREAM_REQUESTS = 8
SHORT_TOKENS = 4  # the short window: requests dominate
SHORT_CONCURRENCY = 8
SHORT_REQUESTS = 120
PROMPT_TOKENS = 32
CONTENTION_BATCH = 4
CONTENTION_TOKENS = 64
CONTENTION_ROUNDS = 4  # probes of one engine vary by ±30% on shared cores: the medians need a few
WEIGHT_PROMPT = 1024  # the prefill the weight is measured with: the SLO rule's reference prompt
WEIGHT_LEAD_S = 0.03  # the first of two overlapping probes starts this long before the second
IDLE_ENGINES_S = 1.0  # the engines' idle CPU where the host's was read before: they rest at ~0
STEPS_SETTLE_S = 0.1  # after a window, for the engines' last steps to reach the router's state (pushed in ms)
QUIET_CORES = 0.4  # a host this busy with nothing served is still settling (`settle`); the CPU profile idles at ~0.2


@dataclass(frozen=True, slots=True)
class HostPlan:
    """How long each measurement runs: the defaults, or `quick()` (half of everything) for a fit at start-up."""

    contention_rounds: int = CONTENTION_ROUNDS
    contention_tokens: int = CONTENTION_TOKENS
    idle_s: float = 8.0
    stream_requests: int = STREAM_REQUESTS
    short_requests: int = SHORT_REQUESTS
    few_stream_requests: int = FEW_STREAM_REQUESTS

    @classmethod
    def quick(cls) -> "HostPlan":
        return cls(CONTENTION_ROUNDS // 2, CONTENTION_TOKENS // 2, 4.0, STREAM_REQUESTS // 2, SHORT_REQUESTS // 2,
                   FEW_STREAM_REQUESTS // 2)


class HostCalibrationError(RuntimeError):
    """A request of the host's load windows failed."""


def host_cpu_s() -> float:
    """CPU seconds every process of this host has used since boot (user, nice, system, irq, softirq, steal)."""
    with open("/proc/stat") as f:
        fields = f.readline().split()[1:]
    user, nice, system, _idle, _iowait, irq, softirq, steal = (int(x) for x in fields[:8])
    return (user + nice + system + irq + softirq + steal) * TICK_S


def process_cpu_s(pids: Sequence[int]) -> float:
    """CPU seconds the processes `pids` have used, every thread's (user + system, /proc/<pid>/stat)."""
    total = 0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                stat = f.read()
        except (FileNotFoundError, ProcessLookupError):
            raise _not_here(pid) from None
        fields = stat[stat.rindex(")") + 2:].split()  # after the command, which may hold spaces
        total += int(fields[11]) + int(fields[12])  # utime, stime: fields 14 and 15 of proc(5)
    return total * TICK_S


def engine_processes_running(pids: Sequence[int], replicas: Sequence[int] = ()) -> tuple[int, ...]:
    """Those of `pids` still running, each a vLLM engine process of this machine: titled as one by
    vLLM, or descended from one of the engine replicas' own processes `replicas` (the app names
    them beside their engines'). The title alone missed a running EngineCore on fresh-clone CI
    hosts, twice; a replica's child is its engine whatever the title reads. One that has exited
    since the engine listed it is left out: a fresh-clone CI host had one gone before every fit.
    One that runs but is neither (an app on other machines names processes whose numbers belong to
    something else here), or none left of a non-empty list, is an error."""
    from serve_app.engine import engine_command

    running = []
    for pid in pids:  # its title first: one that exits between two reads is gone, not a stranger
        if engine_command(pid) is not None:
            running.append(pid)
        elif _exited(pid):
            continue
        elif _descends_from(pid, replicas):
            running.append(pid)
        else:
            raise _not_here(pid)
    if pids and not running:
        raise _not_here(pids[0])
    return tuple(running)


def _proc_stat(pid: int) -> tuple[bytes, list[bytes]] | None:
    """Process `pid`'s name and the fields of /proc/<pid>/stat after it (its state first, then its
    parent); None where there is no such process."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    end = stat.rfind(b")")  # the name may hold spaces and parentheses
    return stat[stat.find(b"(") + 1:end], stat[end + 2:].split()


def _descends_from(pid: int, ancestors: Sequence[int], hops: int = 64) -> bool:
    """Whether one of `ancestors` is a parent, grandparent, ... of process `pid` (within `hops`)."""
    wanted = set(ancestors)
    for _ in range(hops if wanted else 0):
        stat = _proc_stat(pid)
        if stat is None:
            return False
        pid = int(stat[1][1])
        if pid in wanted:
            return True
        if pid <= 1:
            return False
    return False


def _exited(pid: int) -> bool:
    """No process `pid`, or one that has exited and waits for its parent to collect it (a zombie)."""
    stat = _proc_stat(pid)
    return stat is None or stat[1][0] in (b"Z", b"X")


def _not_here(pid: int) -> HostCalibrationError:
    return HostCalibrationError(f"engine process {pid} is not on this machine or has exited ({_what_is(pid)}): "
                                "the host is measured where the command runs, which must be the app's machine")


def _what_is(pid: int) -> str:
    """What runs here as process `pid`, for an error: its name, state and command line."""
    stat = _proc_stat(pid)
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            cmd = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        stat = None
    if stat is None:
        return "no such process here"
    name, state = stat[0].decode(errors="replace"), stat[1][0].decode()
    return f"here process {pid} is {name!r}, state {state}, command line {cmd[:80]!r}"


def fit_engine_cores(stretch_at: dict[int, float], most: float) -> float:
    """The `engine_cores` in (0, `most`] whose `max(1, k / engine_cores)` is nearest (least squares)
    to the measured stretch at each count k of busy engines."""
    grid = np.arange(0.05, most + 1e-9, 0.01)
    ks = np.array(sorted(stretch_at), dtype=float)
    s = np.array([stretch_at[int(k)] for k in ks])
    errors = [float(np.sum((s - np.maximum(1.0, ks / e)) ** 2)) for e in grid]
    return round(float(grid[int(np.argmin(errors))]), 2)


def fit_prefill_weight(decode_stretch: list[float], prefill_stretch: list[float]) -> float:
    """A prefill step's weight against a decode step's, from rounds of the two overlapping on one
    shared core: the ratio of the shares they got (one over each one's stretch), the median over
    rounds. Fair sharing (2× and 2×) is 1."""
    ratios = [d / p for d, p in zip(decode_stretch, prefill_stretch) if d > 0 and p > 0]
    if not ratios:
        raise HostCalibrationError("no round of the prefill-beside-decode measurement finished")
    return round(statistics.median(ratios), 2)


def engine_steps(instances: dict[str, dict], ids: Collection[str] | None = None) -> int:
    """The steps with outputs the engines of `/admin/state`'s `instances` (those of `ids`, if given)
    have made so far."""
    return sum(int(i.get("steps") or 0) for iid, i in instances.items() if ids is None or iid in ids)


@dataclass(frozen=True, slots=True)
class LoadWindow:
    """One loaded window: CPU above idle (s), what it served (the engines' steps, the messages of
    tokens the client received, the requests), and what the engines' steps of it take."""

    cpu_s: float
    steps: int
    events: int
    requests: int
    engine_s: float


def fit_serving_cpu(windows: list[LoadWindow]) -> tuple[float, float, float]:
    """(step_cpu_s, event_cpu_s, request_cpu_s) from loaded windows: non-negative least squares of
    cpu − engine time = steps · step_cpu_s + events · event_cpu_s + requests · request_cpu_s."""
    from calibration.fit import nnls

    a = np.array([[w.steps, w.events, w.requests] for w in windows], dtype=float)
    b = np.array([w.cpu_s - w.engine_s for w in windows], dtype=float)
    step_s, event_s, request_s = nnls(a, b)  # a window below its engine time (noise, steps that wait) pulls toward 0
    return float(step_s), float(event_s), float(request_s)


def engine_seconds(c: EngineConstants, requests: int, prompt: int, tokens: int, batch_per_engine: float) -> float:
    """What the engines' steps of a window take by the constants: each request's lone prefill,
    and its decode tokens at the window's batch per decode engine (a step's time shared by the batch)."""
    b = max(1.0, batch_per_engine)
    per_token = (c.step_base_s + c.decode_seq_s * b) / b
    return requests * (c.prefill_s(prompt) + max(0, tokens - 1) * per_token)


async def _load(url: str, model: str, requests: int, concurrency: int, tokens: int, seed: int) -> tuple[int, int]:
    """Send `requests` streaming completions `concurrency` at a time, each window its own prompts;
    (the tokens they streamed, the messages of content they came in)."""
    from disagg.app_client import AsyncAppClient
    from disagg.bench.loadgen import PlannedRequest, prompt_seed, send_one

    sem = asyncio.Semaphore(concurrency)
    streamed = events = 0

    async def one(app: AsyncAppClient, i: int) -> None:
        nonlocal streamed, events
        req = PlannedRequest(index=i, at_s=0.0, prompt_tokens=PROMPT_TOKENS, max_tokens=tokens,
                             prompt_seed=prompt_seed(seed, f"calibrate/host/{concurrency}/{tokens}", i))
        async with sem:
            r = await send_one(app.http, model, req, timeout_s=120.0)
        if r.error:
            raise HostCalibrationError(f"{url}/v1/completions: {r.error}")
        streamed += r.tokens
        events += r.content_events

    async with AsyncAppClient(url, timeout_s=120.0, max_connections=concurrency) as app:
        await asyncio.gather(*(one(app, i) for i in range(requests)))
    return streamed, events


async def _cpu_of(run: Callable[[], Awaitable], engine_pids: Sequence[int] = ()) -> tuple[float, float, float, object]:
    """(host CPU s less this process's, the engine processes' CPU s, wall s, what `run` returned).
    The host's count moves in clock ticks and this process's in nanoseconds, so over a short quiet
    window the difference can dip below zero by up to a tick: it is floored there, since no host
    runs negative work."""
    h0, e0, own0, t0 = host_cpu_s(), process_cpu_s(engine_pids), time.process_time(), time.monotonic()
    result = await run()
    engines = process_cpu_s(engine_pids) - e0
    others = (host_cpu_s() - h0) - (time.process_time() - own0)
    return max(0.0, others), engines, time.monotonic() - t0, result


async def settle(limit_s: float, quiet_cores: float = QUIET_CORES, window_s: float = 2.0,
                 log: Callable[[str], None] = lambda m: None) -> tuple[float, float | None]:
    """Wait until the host's CPU use (less this process's) stays under `quiet_cores` for one
    `window_s`, at most `limit_s`. Returns the seconds waited and the quiet window's CPU use (the
    host idle, which `measure_host` then need not measure again), None if it never went quiet.
    A stack that has just started keeps the host busy for a while (measured: an engine's decode
    step 1.9× its settled time), and constants fitted then describe that moment, not the engines."""
    waited = 0.0
    while True:
        cpu, _, wall, _ = await _cpu_of(lambda: asyncio.sleep(window_s))
        waited += wall
        log(f"host busy {cpu / wall:.2f} cores")
        if cpu / wall < quiet_cores or waited >= limit_s:
            quiet = cpu / wall < quiet_cores
            log(f"settled after {waited:.0f} s" if quiet
                else f"still above {quiet_cores:g} cores after {waited:.0f} s: measuring anyway")
            return waited, cpu / wall if quiet else None


async def measure_contention(engines: Sequence[str], post: Callable[[dict], Awaitable[dict]], plan: HostPlan,
                             seed: int = 0) -> dict[int, float]:
    """The stretch of the engines' decode steps at k = 1, 2, … len(`engines`) busy at once: the median
    over rounds and engines of a step with k busy over the same engine's step alone in that round."""
    n = 0

    async def step_s(iid: str) -> float:
        nonlocal n
        n += 1
        body = {"instance": iid, "kind": "decode", "size": CONTENTION_BATCH, "tokens": plan.contention_tokens,
                "seed": seed * 1_000_003 + 500_000 + n}
        return float((await post(body))["seconds"])

    ids = list(engines)
    alone = {iid: [] for iid in ids}
    together: dict[int, list[float]] = {k: [] for k in range(2, len(ids) + 1)}
    for _ in range(plan.contention_rounds):  # alone and together in every round: a slow spell lands on both
        for iid in ids:
            alone[iid].append(await step_s(iid))
        for k in together:
            group = ids[:k]
            steps = await asyncio.gather(*(step_s(iid) for iid in group))
            together[k] += [s / alone[iid][-1] for iid, s in zip(group, steps)]  # paired within the round
    return {1: 1.0, **{k: statistics.median(v) for k, v in together.items()}}


async def measure_prefill_weight(decoder: str, prefiller: str, post: Callable[[dict], Awaitable[dict]],
                                 prompt: int, rounds: int, seed: int = 0, batch: int = CONTENTION_BATCH,
                                 besides: Sequence[str] = ()) -> tuple[float, dict]:
    """(`prefill_weight`, what was measured): each round times a decode probe of `batch` streams
    on `decoder` and a run of lone prefills of `prompt` tokens on `prefiller`, each alone, then
    each with the other running from just before it to past its end (the overlapping one runs
    longer), paired within the round so a slow spell lands on both. The engines `besides` decode
    in the background of both overlapping probes: the weight is then the one a prefill claims
    among as many busy engines as the host has, not beside one decode alone."""
    n = 0

    async def probe(body: dict) -> float:
        nonlocal n
        n += 1
        return float((await post({**body, "seed": seed * 1_000_003 + 700_000 + n}))["seconds"])

    def decode(tokens: int) -> Awaitable[float]:
        return probe({"instance": decoder, "kind": "decode", "size": batch, "tokens": tokens})

    def prefill(repeats: int) -> Awaitable[float]:
        return probe({"instance": prefiller, "kind": "prefill", "size": prompt, "repeats": repeats})

    def with_the_others(background: Awaitable[float]) -> Awaitable:
        return asyncio.gather(background, *(probe({"instance": iid, "kind": "decode", "size": batch,
                                                   "tokens": 3 * CONTENTION_TOKENS}) for iid in besides))

    async def beside(background: Awaitable[float], timed: Callable[[], Awaitable[float]]) -> float:
        task = asyncio.ensure_future(background)
        await asyncio.sleep(WEIGHT_LEAD_S)
        try:
            return await timed()
        finally:
            await task

    # the background outlasts the timed probe however the two share the core: prefills of about 3× the
    # decode probe's time alone, a decode of 3× its tokens beside 3 prefills
    decode_s, prefill_s = [], []
    for _ in range(rounds):
        alone_d, alone_p = await decode(CONTENTION_TOKENS), await prefill(3)
        repeats = min(16, max(3, math.ceil(3 * CONTENTION_TOKENS * alone_d / max(alone_p, 1e-6))))
        decode_s.append(await beside(with_the_others(prefill(repeats)), lambda: decode(CONTENTION_TOKENS)) / alone_d)
        prefill_s.append(await beside(with_the_others(decode(3 * CONTENTION_TOKENS)), lambda: prefill(3)) / alone_p)
    weight = fit_prefill_weight(decode_s, prefill_s)
    # every decode of the mix is taken to run at the timed one's stretch
    decodes = 1 + len(besides)
    shared = round(statistics.median(decodes / d + 1 / p for d, p in zip(decode_s, prefill_s)), 2)
    return weight, {"prompt_tokens": prompt, "batch": batch, "cores_shared": shared, "besides": list(besides),
                    "decode_stretch": [round(x, 3) for x in decode_s],
                    "prefill_stretch": [round(x, 3) for x in prefill_s], "prefill_weight": weight}


async def measure_host(url: str, model: str, instances: dict[str, str], engine: EngineConstants,
                       post: Callable[[dict], Awaitable[dict]], plan: HostPlan = HostPlan(), seed: int = 0,
                       log: Callable[[str], None] = lambda m: None,
                       engines: Sequence[str] = (), idle_cores: float | None = None,
                       engine_pids: Sequence[int] = (), replica_pids: Sequence[int] = (),
                       read_steps: Callable[[], Awaitable[int]] | None = None,
                       stream_intervals: tuple[float, float] = (0.0, 0.0)) -> tuple[SharedHost, dict]:
    """The shared host's constants, measured through the app at `url` (see the module docstring);
    `post(body)` is a `/admin/probe` call, `engine` the fitted pool constants of `model`, whose
    `instances` the serving windows load; `engines`: every engine on the host, of any model (the
    contention probes'; default: `instances`); `idle_cores`: the app's CPU use at rest if already
    measured (`settle`'s quiet window), else measured here; `engine_pids`: the processes of every
    engine on the host, whose CPU is the engines' share of each window (none: their steps by the
    constants `engine`), and `replica_pids` the engine replicas' own (`engine_processes_running`);
    `read_steps()`: the steps every engine on the host has made so far (None: not known, and the
    serving path's CPU is split between messages and requests alone); `stream_intervals`: the
    app's batching of streams (`engine.stream_interval_s`, `engine.stream_interval_max_s`), which
    the host's model prices messages by. Returns the host and a report of every measurement."""
    engine_pids = engine_processes_running(engine_pids, replica_pids)
    ids = list(engines) or list(instances)
    stretch_at = await measure_contention(ids, post, plan, seed)
    cores = float(os.cpu_count() or 1)
    engine_cores = fit_engine_cores(stretch_at, cores) if len(ids) > 1 else cores
    log(f"contention: stretch by busy engines {stretch_at} → engine_cores {engine_cores:g}")
    weight, weight_report, mixed = 1.0, None, None
    if len(ids) > 1:  # a prefill on one of the model's engines (a prefill one first) beside a decode on another
        prefiller = min(instances, key=lambda iid: (instances[iid] != "prefill", iid))
        decoder = next(iid for iid in sorted(ids, key=lambda iid: (iid not in instances, iid)) if iid != prefiller)
        weight, weight_report = await measure_prefill_weight(
            decoder, prefiller, post, min(WEIGHT_PROMPT, engine.max_batched_tokens), plan.contention_rounds, seed,
            besides=[iid for iid in ids if iid not in (decoder, prefiller)])
        mixed = min(max(weight_report["cores_shared"], 0.05), cores)
        log(f"prefill beside decode: decode stretched {weight_report['decode_stretch']}, prefill "
            f"{weight_report['prefill_stretch']} → prefill_weight {weight:g}, mixed_cores {mixed:g}")

    decode = sum(role == "decode" for role in instances.values()) or len(instances)
    # the engines' idle CPU, for their share above it: over the idle window, or a second of rest
    # where `settle` already read the host's
    idle_wall = IDLE_ENGINES_S
    if idle_cores is None:
        idle_cpu, engines_idle, idle_wall, _ = await _cpu_of(lambda: asyncio.sleep(plan.idle_s), engine_pids)
        idle_cores = idle_cpu / idle_wall
    elif engine_pids:
        _, engines_idle, idle_wall, _ = await _cpu_of(lambda: asyncio.sleep(IDLE_ENGINES_S), engine_pids)
    else:
        engines_idle = 0.0
    idle_rate, engines_idle_rate = idle_cores, engines_idle / idle_wall
    windows, modelled, report_windows = [], [], []

    async def steps_so_far() -> int:
        return await read_steps() if read_steps is not None else 0

    for name, requests, concurrency, tokens in (
            ("few streams", plan.few_stream_requests, FEW_STREAMS, STREAM_TOKENS),
            ("streams", plan.stream_requests, STREAMS, STREAM_TOKENS),
            ("short", plan.short_requests, SHORT_CONCURRENCY, SHORT_TOKENS)):
        steps_before = await steps_so_far()
        cpu, engines_cpu, wall, (streamed, events) = await _cpu_of(
            lambda: _load(url, model, requests, concurrency, tokens, seed), engine_pids)
        await asyncio.sleep(STEPS_SETTLE_S)
        steps = await steps_so_far() - steps_before
        above = cpu - idle_rate * wall
        by_constants = engine_seconds(engine, requests, PROMPT_TOKENS, tokens, concurrency / decode)
        engines_above = engines_cpu - engines_idle_rate * wall
        windows.append(LoadWindow(above, steps, events, requests, engines_above if engine_pids else by_constants))
        modelled.append(LoadWindow(above, steps, events, requests, by_constants))
        report_windows.append({"window": name, "requests": requests, "concurrency": concurrency,
                               "tokens": streamed, "events": events, "engine_steps": steps,
                               "wall_s": round(wall, 3), "cpu_above_idle_s": round(above, 3),
                               "engine_steps_s": round(by_constants, 3),
                               "engine_cpu_above_idle_s": round(engines_above, 3) if engine_pids else None})
        log(f"{name}: {requests} requests, {streamed} tokens in {events} messages and {steps} engine steps in "
            f"{wall:.1f} s; {above:.2f} s of CPU above idle, "
            + (f"{engines_above:.2f} s of it the engines' ({by_constants:.2f} s of steps by the constants)"
               if engine_pids else f"{by_constants:.2f} s of it engine steps by the constants"))
    step_cpu_s, event_cpu_s, request_cpu_s = fit_serving_cpu(windows)
    by_steps = fit_serving_cpu(modelled)  # the other reading, for the report: how far the constants' steps are off
    host = SharedHost(engine_cores=engine_cores, cores=cores, step_cpu_s=round(step_cpu_s, 7),
                      event_cpu_s=round(event_cpu_s, 7), request_cpu_s=round(request_cpu_s, 6),
                      stream_interval_s=stream_intervals[0], stream_interval_max_s=stream_intervals[1],
                      idle_cores=round(min(idle_rate, cores), 3),
                      prefill_weight=min(max(weight, 0.1), 10.0), mixed_cores=mixed)
    report = {"stretch_by_busy_engines": stretch_at, "prefill_beside_decode": weight_report,
              "idle_cores": round(idle_rate, 4), "engines_idle_cores": round(engines_idle_rate, 4),
              "engine_cpu": "measured" if engine_pids else "by the constants", "engine_processes": len(engine_pids),
              "windows": report_windows,
              "serving_cpu_by_the_constants": {"step_cpu_s": round(by_steps[0], 7),
                                               "event_cpu_s": round(by_steps[1], 7),
                                               "request_cpu_s": round(by_steps[2], 6)},
              "shared_host": host.model_dump(mode="json")}
    return host, report
