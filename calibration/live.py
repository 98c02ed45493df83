"""Calibrate the running fleet: every live instance of one served model, measured through the app.

`disagg calibrate --live --url URL --out FILE [--apply]`. No engine is started: each probe goes to
the router's `POST /admin/probe`, which runs it on exactly the named instance, where the engine
replica times it (`serve_app.probes`), so no Serve hop is counted. Per instance (`LivePlan`): lone
prefills over the doubling ladder of prompt lengths of offline calibration, decode steps at a
few concurrencies and at one with long prompts (the cost of the context the steps attend to), and
a held-out set of each kind, every point over several rounds in rotating order.
Instances are measured one after the other, and after every probe the client pauses (`pause_s`)
so the fleet's own traffic keeps getting served; the whole run is bounded by `budget_s`, past
which it stops with nothing written.

The fleet's layout, limits and current cost model come from `/admin/state`, so only the URL is
needed. What the fit makes of the samples is `fit.fit_fleet`.
"""

from __future__ import annotations

import asyncio
import statistics
import time
from dataclasses import dataclass
from typing import Callable

from calibration.fit import InstanceSamples, Sample
from calibration.measure import Plan
from disagg.core.cost_model import CostModel
from serve_app.messages import PROBE_CONTEXT

PROBE_TIMEOUT_S = 90.0  # one probe over HTTP: the router's own bound (60 s) plus the hops


class LiveCalibrationError(RuntimeError):
    """The app could not be calibrated live (unreachable, refused a probe, over budget)."""


@dataclass(frozen=True, slots=True)
class Fleet:
    """What `/admin/state` says of the served model to calibrate."""

    model: str  # served name
    source: str  # the model the engines load (what the cost model records it was measured with)
    instances: dict[str, str]  # instance id → role
    max_model_len: int
    max_num_seqs: int
    cost_model: CostModel  # the one the router prices with now: the KV bandwidth and pairs are kept from it
    # every engine of the app, of any model: on one host they all share its processors (`--host`)
    engines: tuple[str, ...] = ()
    engine_pids: tuple[int, ...] = ()  # and their processes (EngineCores and workers), where they name them
    replica_pids: tuple[int, ...] = ()  # the processes of the engine replicas that name them
    # how the engine replicas batch a stream's tokens into messages (the app's engine settings)
    stream_intervals: tuple[float, float] = (0.0, 0.0)

    @classmethod
    def from_state(cls, state: dict, model: str | None) -> "Fleet":
        models = state.get("models") or {}
        if model is None:
            if len(models) != 1:
                raise LiveCalibrationError(f"the app serves {len(models)} models ({', '.join(models)}): "
                                           "pick one with --model")
            model = next(iter(models))
        if model not in models:
            raise LiveCalibrationError(f"--model {model!r}: the app serves {', '.join(models)}")
        m = models[model]
        if "cost_model_constants" not in m:
            raise LiveCalibrationError("/admin/state carries no cost-model constants: not this product's "
                                       "router, or an older one")
        instances = {iid: i["role"] for iid, i in state["instances"].items() if i["model"] == model}
        if not instances:
            raise LiveCalibrationError(f"model {model!r} has no live instance to measure")
        return cls(model, m["source"], dict(sorted(instances.items())), int(m["max_model_len"]), int(m["max_num_seqs"]),
                   CostModel.from_dict(m["cost_model_constants"]), tuple(sorted(state["instances"])),
                   tuple(int(pid) for i in state["instances"].values() for pid in i.get("engine_pids") or ()),
                   tuple(int(i["pid"]) for i in state["instances"].values() if i.get("engine_pids") and i.get("pid")),
                   (float(m.get("stream_interval_s") or 0.0), float(m.get("stream_interval_max_s") or 0.0)))


@dataclass(frozen=True, slots=True)
class LivePlan:
    """What is probed on each instance. Every point is measured `rounds` times, the points in a
    rotated order each round, so that a slow spell of a shared machine lands on different points
    rather than bending one curve; a prefill sample is the median of `prefill_repeats` lone
    prefills run back to back in the engine replica (they take milliseconds each, and the machine's
    noise is of their size). A held-out point's measured time is the median of its
    `held_out_rounds`, more than the fitted points get: a lone probe on a shared 2-core host strays
    12–28% from its typical time, so a median of two would judge the constants mostly by that
    noise. Its rounds are spread over the fitted points' rounds, so the held-out points are
    measured in the same minute as the points they judge: a host drifts by more than that noise
    from one half-minute to the next (docs/calibration.md), and a held-out set taken after the
    fitted points would judge the drift. They are few points, so the extra rounds cost seconds."""

    prefill_lengths: tuple[int, ...]
    held_out_lengths: tuple[int, ...]
    concurrencies: tuple[int, ...]
    held_out_concurrencies: tuple[int, ...]
    rounds: int
    held_out_rounds: int
    prefill_repeats: int
    decode_tokens: int
    long_context: tuple[int, int] | None = None  # (streams, prompt tokens) of a decode probe each round

    @classmethod
    def for_context(cls, max_model_len: int, max_num_seqs: int, quick: bool) -> "LivePlan":
        p = Plan.for_context(max_model_len, max_num_seqs, quick=True)  # the prompt ladder by doublings
        conc = tuple(c for c in ((1, 4, 16) if quick else (1, 4, 16, 32)) if c <= max_num_seqs)
        held_c = tuple(c for c in ((3,) if quick else (3, 12)) if c <= max_num_seqs)
        held = p.held_out_lengths if quick else Plan.for_context(max_model_len, max_num_seqs, False).held_out_lengths
        return cls(p.prefill_lengths, held, conc, held_c, rounds=3, held_out_rounds=6,
                   prefill_repeats=3, decode_tokens=16, long_context=p.long_context)

    def held_out_in_round(self, r: int) -> int:
        """How often each held-out point is measured in round r: `held_out_rounds` spread evenly."""
        return self.held_out_rounds // self.rounds + (r < self.held_out_rounds % self.rounds)

    def steps(self) -> int:
        return (self.rounds * (len(self.prefill_lengths) + len(self.concurrencies) + (self.long_context is not None))
                + self.held_out_rounds * (len(self.held_out_lengths) + len(self.held_out_concurrencies)))


def rotated(items: tuple, k: int) -> list:
    k %= max(1, len(items))
    return list(items[k:] + items[:k])


class LiveCalibrator:
    """Drives the probes of one fleet; `post(body) -> reply` is the `/admin/probe` call."""

    def __init__(self, post: Callable, plan: LivePlan, pause_s: float, budget_s: float, seed: int = 0) -> None:
        self.post, self.plan, self.pause_s, self.seed = post, plan, pause_s, seed
        self.deadline = time.monotonic() + budget_s
        self.budget_s = budget_s
        self._n = 0
        self.kv_capacity_tokens = 0  # as the latest probe's engine reported it

    async def _probe(self, instance: str, kind: str, size: int, context: int = 0) -> float:
        if time.monotonic() > self.deadline:
            raise LiveCalibrationError(f"over the budget of {self.budget_s:g} s (--budget-s); nothing written")
        self._n += 1
        body = {"instance": instance, "kind": kind, "size": size, "seed": self.seed * 1_000_003 + self._n}
        if kind == "prefill":
            body["repeats"] = self.plan.prefill_repeats
        else:
            body["tokens"] = self.plan.decode_tokens
            if context:
                body["context"] = context
        reply = await self.post(body)
        await asyncio.sleep(self.pause_s)  # the fleet's own requests go first between probes
        self.kv_capacity_tokens = int(reply["kv_capacity_tokens"])
        return float(reply["seconds"])

    async def measure(self, instance: str, progress: Callable[[int], None] = lambda n: None) -> InstanceSamples:
        p = self.plan
        await self._probe(instance, "prefill", p.prefill_lengths[0])  # unmeasured: an idle engine wakes up first
        # (kind, size, held out, prompt tokens of a decode probe at long context; 0: the short probe's)
        points = [("prefill", n, False, 0) for n in p.prefill_lengths]
        points += [("prefill", n, True, 0) for n in p.held_out_lengths]
        points += [("decode", b, False, 0) for b in p.concurrencies]
        points += [("decode", b, True, 0) for b in p.held_out_concurrencies]
        if p.long_context is not None:
            points.append(("decode", p.long_context[0], False, p.long_context[1]))
        seen: dict[tuple, list[float]] = {pt: [] for pt in points}
        for r in range(p.rounds):
            held = p.held_out_in_round(r)  # a held-out point's copies go to different places of the round
            due = tuple(pt for copy in range(max(1, held)) for pt in points if copy < (held if pt[2] else 1))
            for pt in rotated(due, r * max(1, len(due) // p.rounds)):
                seen[pt].append(await self._probe(instance, pt[0], pt[1], pt[3]))
                progress(1)

        def fitted(kind: str) -> list[Sample]:
            return [Sample(n, x, extra_context=c - PROBE_CONTEXT if c else 0)
                    for (k, n, held, c), xs in seen.items() if k == kind and not held for x in xs]

        def held_out(kind: str) -> list[Sample]:
            return [Sample(n, statistics.median(xs)) for (k, n, held, _), xs in seen.items() if k == kind and held]

        return InstanceSamples(fitted("prefill"), fitted("decode"), held_out("prefill"), held_out("decode"),
                               self.kv_capacity_tokens)


async def calibrate_fleet(url: str, model: str | None, quick: bool, pause_s: float, budget_s: float, seed: int,
                          progress_for: Callable[[int], Callable[[int], None]] | None = None
                          ) -> tuple[Fleet, dict[str, InstanceSamples], float]:
    """(the fleet, each instance's samples, seconds taken). `progress_for(total_steps)` makes a
    progress callback."""
    from disagg.app_client import AppError, AsyncAppClient

    t0 = time.monotonic()
    async with AsyncAppClient(url, timeout_s=PROBE_TIMEOUT_S, max_connections=1) as app:
        async def get_state() -> dict:
            try:
                return await app.state()
            except AppError as e:
                raise LiveCalibrationError(str(e)) from None

        async def post(body: dict) -> dict:
            try:
                return await app.probe(body)
            except AppError as e:
                raise LiveCalibrationError(f"{e} (probe {body})") from None

        fleet = Fleet.from_state(await get_state(), model)
        plan = LivePlan.for_context(fleet.max_model_len, fleet.max_num_seqs, quick)
        per = plan.steps()
        progress = progress_for(per * len(fleet.instances)) if progress_for else (lambda n: None)
        cal = LiveCalibrator(post, plan, pause_s, budget_s, seed)
        samples = {iid: await cal.measure(iid, progress) for iid in fleet.instances}
        gone = set(fleet.instances) - set((await get_state())["instances"])
        if gone:  # measured, then replaced: its constants would name nobody
            raise LiveCalibrationError(f"instances left the fleet while being measured: {sorted(gone)}; "
                                       "nothing written, run it again")
    return fleet, samples, time.monotonic() - t0
