"""`slo_goodput`: goodput-directed placement."""

from __future__ import annotations

import math
import operator

from pydantic import Field

from disagg.core.cost_model import (
    CostModel,
    EngineConstants,
    SharedHost,
    SloTarget,
    attention_pairs,
)
from disagg.core.engine_model import RequestRate
from disagg.core.policies.base import (
    NO_PAIRS,
    PairTransfers,
    Params,
    Policy,
    cached_prompt_tokens,
    feasible,
    fits,
    register,
)
from disagg.core.types import (
    CostTerms,
    Decision,
    InstanceView,
    NoCapacity,
    RequestFeatures,
    Role,
)


class SloGoodputParams(Params):
    latency_error: float = Field(
        default=0.15, gt=0.0, le=1.0, allow_inf_nan=False,
        description="relative spread of a latency prediction: a prediction at x × the target misses with "
                    "probability Φ((x − 1) / latency_error)",
    )
    work_weight: float = Field(
        default=0.02, ge=0.0, le=1.0, allow_inf_nan=False,
        description="expected misses charged per TTFT target of latency added (the request's predicted TTFT; a "
                    "colocated prefill's time, once for its decode instance and once per sequence it stalls)",
    )
    allow_colocated: bool = Field(default=True, description="may prefill on the chosen decode instance")
    allow_hosted: bool = Field(default=True, description="may serve a request whole (prefill and decode) on a "
                                                        "prefill instance where that prices fewer misses: the "
                                                        "decode pool is the limit, or engines share cores")
    utilization_window_s: float = Field(
        default=5.0, gt=0.0, allow_inf_nan=False,
        description="time constant of the prefill utilization each prefill instance is judged by when it "
                    "hosts decodes: about the length of a decode",
    )


_INV_SQRT2 = 1.0 / math.sqrt(2.0)
_END = operator.itemgetter(0)  # a prefill end's time (`_prefill_ends`)


def _miss(predicted_s: float, target_s: float, spread: float) -> float:
    """Chance that a latency predicted at `predicted_s` misses `target_s`: a normal error of `spread`
    × target around the prediction (Φ((x − 1)/spread) with x = predicted/target)."""
    return 0.5 * math.erfc((1.0 - predicted_s / target_s) / spread * _INV_SQRT2)


# A placement as the `_best_*` methods price it: (cost, order, prefill instance, decode instance,
# prefill queue s, prefill work s, transfer s, first decode step s, TPOT s, KV pressure at the
# request's peak) — a plain tuple, built in the pricing loops, where a NamedTuple costs ten times as
# much. `order` places it in one fixed sequence — decode instance i's pairs at 2i, its colocated
# prefill at 2i + 1, hosted placements after them all (inf) — and of two equal costs the earlier one
# wins, whichever method prices it first.
_Priced = tuple[float, float, InstanceView, InstanceView, float, float, float, float, float, float]


@register
class SloGoodput(Policy):
    """`slo_goodput`: the (prefill, decode) placement with the fewest expected SLO misses — prefix-cache
    aware, colocation and hosting included.

    Candidates: the best prefill instance paired with every decode instance (every pair when the
    cost model has per-pair transfer constants; a later-ending prefill instance too when it stalls
    fewer hosted decodes), each decode instance prefilling the request itself (colocated), and each
    prefill instance serving it whole (hosted). Each is priced by what it does to SLO attainment,
    not by raw seconds:

        cost = P(the request misses) + Σ_running ΔP(a running request misses its TPOT)
               [+ P(KV overflow) for a colocated or hosted request] + w·latency added / TTFT target

    - The request's TTFT: the queue on the prefill site + the prefill of the prompt tokens *not*
      cached there + the KV transfer of the tokens the decode instance does not hold + its first
      decode step (half a step more when a batch is in flight; a full prefill chunk more when the
      decode instance is busy with a colocated prefill then) + the serving overhead and the
      hand-off's (`handoff_overhead_s`: the prefill call's reply, the decode call). Colocated: the
      queue of colocated prefills there + the uncached prefill, chunked beside b decoding sequences.
      Hosted: the prefill instance's queue + the uncached prefill (its last chunk gives the first
      token) + the serving overhead. On a shared host the overheads run at its stretch too.
    - Its TPOT: τ_dec(b + 1) on the decode instance, plus the colocated prefill time still pending
      there when it starts decoding, spread over its ô tokens.
    - Each of the b requests running on the decode instance: TPOT τ_dec(b) + pending colocated
      prefill / ô before, τ_dec(b + 1) + (that + this request's colocated prefill) / ô after —
      judged against the strictest class's TPOT target (their classes are not visible), ô being
      this request's prediction (the predictor gives a point, its mean; no quantile).
    - Hosted, the decode shares the prefill instance with its prefills: with h decodes hosted there
      and u the share of its time the policy's own prefills took lately (an exponential average
      over `utilization_window_s`), the request's TPOT is τ_dec(h + 1)/(1 − u). Every prefill sent
      to an instance hosting h decodes — hosted or not — stalls them: each of the h goes from
      τ_dec(h)/(1 − u) to that + the prefill's time / ô, judged as above. So prefills keep away
      from the instances where decodes are hosted, unless that costs misses.
    - A latency predicted at x × its target misses with probability Φ((x − 1)/`latency_error`);
      TTFT, TPOT and KV overflow count as one miss when any of them happens (taken independent).
      KV overflow (preemption) is judged the same way on the decode instance's pressure at the
      request's peak: KV used + its prompt and ô + ô/2 for each running sequence, which is midway
      through its own output. A colocated prefill on a decode instance that overflows also costs a
      running sequence's miss: it takes blocks chunk by chunk and so preempts one (vLLM's
      scheduler, and the simulator's engine model), where a transferred prompt waits for its
      blocks. Probabilities saturate: a request that will miss anyway goes where it harms the
      others least.
    - The last term, `work_weight` × the latency the placement adds / the request's TTFT target,
      is small: it orders candidates that all surely meet (or surely miss) their targets by the
      load they add. The latency added is the request's TTFT, plus for a colocated prefill its
      time once for the decode instance's capacity and once for each of the b sequences it
      stalls — so decode instances are kept for decoding unless prefilling there saves misses.
      Hosted, it is its prefill's time once for each of the h decodes there and its decode's
      per-sequence step time ô × τ_seq, which the prefills there wait for: where every placement
      meets its targets, hosting wins only if that costs less than the transfer and first decode
      step it saves. When the decode pool's KV or TPOT is the limit, the prefill pool's KV and
      time serve decodes as well. On a shared host it also counts the seconds the placement adds
      to the sequences running on the other engines (below): past capacity, where every sequence
      misses anyway and the miss terms no longer change, those seconds still keep the load on as
      few engines as it needs.

    On a shared host (`CostModel.shared_host`: the CPU profile's engines on one core) every step
    above runs at the host's stretch σ(k) for the k engines busy (`_HostLoad`), so the placements
    are priced for the hardware serving them:
    - a decode on an idle instance makes one more engine busy: its own tokens take τ·σ(k + 1), and
      every sequence running anywhere on the host goes from τ·σ(k) to τ·σ(k + 1) — its TPOT misses
      are charged to the placement, and w × the seconds that adds over the rest of its output (ô/2
      tokens: midway through an output like this one) / the TTFT target. On a busy instance the
      host's stretch stays, and one more sequence costs its batch only τ_seq: so decodes gather on
      few engines until a batch's step outgrows what another busy engine costs everyone;
    - a prefill on a prefill instance (a pair, or hosted) takes its work from the engines it shares
      the cores with: every sequence running on the host is delayed by work / engine_cores (by less
      where the engines have a core to spare), its misses and w × its seconds charged as above.
      A colocated prefill runs in its decode instance's share of the host: it delays that
      instance's sequences only (as above);
    - TTFTs take the same stretch: a prefill's queue and work, a decode's first step.
    Engines that own their devices (no `shared_host`): σ is 1 and nothing above changes a price.

    Queues: on a prefill instance, the ledger's `backlog_s` (which prices each prefill at the part of
    its prompt that instance did not hold cached). On a decode instance the backlog mixes colocated
    prefill with decode work, so the policy keeps its own clock of when the colocated prefills it
    sent there end, bounded by the backlog; with several router replicas each sees only its own
    colocated prefills there (private state, like a round-robin cursor: fresh per replica), and its
    own prefills in the utilization u. On a prefill instance the ledger's view counts the prefill work only: the
    decodes hosted there run beside the prefills, not ahead of them (`InstanceView.hosted`).
    Cached prefixes come from `InstanceView.cached_prefix_blocks`; live views carry none, so every
    prompt is priced uncached there and the policy still works.

    Parameters (each from first principles, none fitted to a trace): `latency_error` (0.15: one
    engine step and a 50 ms poll against a 175 ms TTFT target are 10–30% of it), `work_weight`
    (0.02: a whole TTFT target of added latency is worth 2% of a miss, below any real change in
    miss probability), `allow_colocated` (true), `allow_hosted` (true), `utilization_window_s`
    (5 s: about a decode's length, ô × τ_dec for a few hundred tokens).

    ```yaml
    policy: {name: slo_goodput, params: {latency_error: 0.15, work_weight: 0.02, allow_colocated: true,
                                         allow_hosted: true, utilization_window_s: 5.0}}
    ```
    """

    name = "slo_goodput"
    Params = SloGoodputParams

    @property
    def may_colocate(self) -> bool:
        return self.params.allow_colocated

    @property
    def may_host(self) -> bool:
        return self.params.allow_hosted

    def __init__(self, cost_model: CostModel, params: Params | None = None) -> None:
        super().__init__(cost_model, params)
        # decode instance → when the colocated prefills this policy sent there end (its own clock)
        self._colocated_ends: dict[str, float] = {}
        self._tpot_floor_s = min(t.tpot_s for t in cost_model.slo.values())  # the strictest class's target
        self._pair_transfers = PairTransfers(cost_model)
        # prefill instance → [prefill seconds per second this policy sent there, as of time t]: an
        # exponential average over `utilization_window_s`; a decode hosted there gets (1 − it) of the engine
        self._prefill_rate: dict[str, list[float]] = {}
        # instance id (None: the default constants) → batch size → `_step_times`; pure, so memoised
        self._steps: dict[str | None, dict[int, tuple[float, float, float, float]]] = {}
        self._requests = RequestRate()  # the requests this policy routes: the serving path's per-request CPU

    def _utilization(self, instance_id: str, now: float) -> float:
        """The share of the prefill instance's time its prefills take (our own, averaged), below 0.95."""
        r = self._prefill_rate.get(instance_id)
        if r is None:
            return 0.0
        return min(0.95, r[0] * math.exp((r[1] - now) / self.params.utilization_window_s))

    def _add_prefill(self, instance_id: str, work_s: float, now: float) -> None:
        window = self.params.utilization_window_s
        r = self._prefill_rate.get(instance_id)
        if r is None:
            self._prefill_rate[instance_id] = [work_s / window, now]
        else:
            r[0] = r[0] * math.exp((r[1] - now) / window) + work_s / window
            r[1] = now

    def _colocated_queue_s(self, v: InstanceView, now: float) -> float:
        """Colocated prefill still to run on a decode instance. The ledger's backlog there mixes it with
        decode work, so: our own clock, bounded by that backlog."""
        return min(v.backlog_s, max(0.0, self._colocated_ends.get(v.instance_id, now) - now))

    def choose(self, req, prefill, decode, now):
        prm, cm, prompt = self.params, self.cost_model, req.prompt_tokens
        decode_ok = feasible(decode, req, "decode")
        prefill_ok = [v for v in prefill if fits(v, prompt)]
        if not prefill_ok and not prm.allow_colocated:
            feasible(prefill, req, "prefill")  # raises the precise reason
            raise NoCapacity("no prefill candidate fits and colocated prefill is disabled")
        out, target = max(1, req.predicted_output_tokens), cm.target(req.slo_class)
        if req.ttft_target_s is not None:  # SLOs that scale with the request
            target = SloTarget(ttft_s=req.ttft_target_s, tpot_s=req.tpot_target_s)
        host = None
        if cm.shared_host is not None:
            self._requests.arrive(now)
            host = _HostLoad(cm, cm.shared_host, prefill, decode, prm.latency_error, self._tpot_floor_s,
                             self._requests.at(now), prm.work_weight / target.ttft_s, out / 2)
        ends = self._prefill_ends(prefill_ok, req, now, host)
        sites = self._decode_sites(decode_ok, req, out, now, host)
        # each kind's cheapest replaces the cheapest so far only if it costs less (or as much and comes
        # first: `_Priced`), and the cost to beat lets the next kind skip its hopeless candidates early
        best = self._best_pair(req, out, target, ends, sites, now, None, host)
        if prm.allow_colocated:
            best = self._best_colocated(req, out, target, sites, best, host)
        if prm.allow_hosted:
            best = self._best_hosted(req, out, target, ends, now, best, host)

        # best is set: decode_ok is not empty, and either colocation is allowed or a prefill fits
        _, _, p, d, q, work, xfer, first, tpot, press = best
        if p is d and p.role is not Role.PREFILL:
            self._colocated_ends[d.instance_id] = now + q + work
        else:
            self._add_prefill(p.instance_id, work, now)
        return Decision(
            p.instance_id, d.instance_id, self.name,
            CostTerms(backlog_s=q, own_work_s=work, pressure=p.pressure_after(prompt)),
            CostTerms(backlog_s=first, own_work_s=out * tpot, pressure=press, transfer_s=xfer),
        )

    # The `_best_*` methods price every decode instance on every decision (43 of them at 64 instances),
    # so they are kept to float arithmetic: the cost model's step times come from a memo per batch
    # size, Φ (`_miss`) is written out, what only a winner needs (KV pressure, the running sequences'
    # misses before) is computed once a candidate may win, and a candidate is priced in full only if it
    # can still win — its last term, w·latency/target, is a lower bound of its cost (every other term
    # is ≥ 0), so one whose last term exceeds the best cost so far, of any kind, is skipped. Same
    # expressions in the same order as the straightforward form, so the same floats and the same
    # choice (tests/core/test_decision_speed.py checks it against that form).

    def _best_pair(self, req: RequestFeatures, out: int, target: SloTarget, ends: list[tuple], sites: list[tuple],
                   now: float, best: _Priced | None, host: "_HostLoad | None" = None) -> _Priced | None:
        """The cheapest disaggregated placement — prefill on an instance of `ends` (`_prefill_ends`),
        KV transfer, decode on an instance of `sites` (`_decode_sites`) — if it beats `best`, else `best`."""
        if not ends:
            return best
        prm, cm = self.params, self.cost_model
        spread, w = prm.latency_error, prm.work_weight
        overhead = _outside_s(cm, host, handoff=True)
        prompt, ttft_t, tpot_t, tpot_others = req.prompt_tokens, target.ttft_s, target.tpot_s, self._tpot_floor_s

        # a pair depends on its prefill instance through the prefill's end and the TPOT misses that
        # prefill adds to the decodes hosted there (its stall); so without per-pair transfer constants
        # only the earliest end is worth pairing, and any later one that stalls less
        stalls = [self._stall(p, work, out, now, spread) if p.hosted else 0.0 for _, _, work, p in ends]
        if host is not None:  # and on a shared host, the sequences running on every engine there
            stalls = [stall + host.prefill_stall(work, p, out) for stall, (_, _, work, p) in zip(stalls, ends)]
        if not cm.pairs and len(ends) > 1:
            if not any(stalls):  # the common case: the loop below would keep the first earliest end alone
                ends, stalls = [min(ends, key=_END)], stalls[:1]
            else:
                keep, low = [], math.inf
                for j in sorted(range(len(ends)), key=[e[0] for e in ends].__getitem__):
                    if stalls[j] < low:
                        keep.append(j)
                        low = stalls[j]
                ends, stalls = [ends[j] for j in keep], [stalls[j] for j in keep]

        erfc, k = math.erfc, _INV_SQRT2
        transfer = cm.transfer
        xfer_whole = transfer.transfer_s(prompt)
        pair_rows = [self._pair_transfers.row(p.instance_id) for _, _, _, p in ends] if cm.pairs else \
            [NO_PAIRS] * len(ends)
        best_cost = math.inf if best is None else best[0]
        bar = best_cost + _COST_ROUNDING
        for i, d, _, b, steps, pending, held, spread_harm in sites:
            did = d.instance_id
            tau_b, tau_after, step, step_beside_chunk, _ = steps
            ok_kv = None  # and `press`, `before`: computed once a candidate on d may win
            for (end, q, work, p), pair_row, stall in zip(ends, pair_rows, stalls):
                if p.instance_id == did:  # `cm.transfer_s`, by instance ids
                    xfer = 0.0
                else:
                    tc = pair_row.get(did, transfer)
                    xfer = xfer_whole if tc is transfer and not held else tc.transfer_s(prompt - held)
                arrive = end + xfer
                # the first token comes from d's next step: longer while d prefills a colocated prompt
                first = step_beside_chunk if pending > arrive else step
                if b:
                    first *= 1.5  # + the rest of the step in flight, half a step on average
                ttft = arrive + first + overhead
                load = w * ttft / ttft_t + stall + spread_harm
                if load > bar:
                    continue
                meets_ttft = 1.0 - 0.5 * erfc((1.0 - ttft / ttft_t) / spread * k)
                if 1.0 - meets_ttft + load > bar:  # 1 − meet ≥ 1 − meets_ttft
                    continue
                if ok_kv is None:
                    # KV at the request's peak: its prompt and output, and the running sequences' growth
                    # meanwhile (half an output each on average: they are midway through theirs)
                    press = d.pressure_after(prompt + out + b * out // 2)
                    ok_kv = 1.0 - 0.5 * erfc((1.0 - press) / spread * k)
                    before = 0.5 * erfc((1.0 - (tau_b + pending / out) / tpot_others) / spread * k) if b else 0.0
                tpot = tau_after + max(0.0, pending - arrive) / out
                after = 0.5 * erfc((1.0 - (tau_after + pending / out) / tpot_others) / spread * k) if b else 0.0
                meet = meets_ttft * (1.0 - 0.5 * erfc((1.0 - tpot / tpot_t) / spread * k)) * ok_kv
                cost = 1.0 - meet + b * (after - before) + load
                if cost < best_cost or best is None or cost == best_cost and 2 * i < best[1]:
                    best = (cost, 2 * i, p, d, q, work, xfer, first, tpot, press)
                    best_cost, bar = cost, cost + _COST_ROUNDING
        return best

    def _best_colocated(self, req: RequestFeatures, out: int, target: SloTarget, sites: list[tuple],
                        best: _Priced | None, host: "_HostLoad | None" = None) -> _Priced | None:
        """The cheapest colocated placement — an instance of `sites` (`_decode_sites`) prefilling the
        request beside its decodes, then decoding it — if it beats `best`, else `best`."""
        prm, cm = self.params, self.cost_model
        spread, w = prm.latency_error, prm.work_weight
        overhead = _outside_s(cm, host, handoff=False)
        prompt, ttft_t, tpot_t, tpot_others = req.prompt_tokens, target.ttft_s, target.tpot_s, self._tpot_floor_s
        erfc, k = math.erfc, _INV_SQRT2
        best_cost = math.inf if best is None else best[0]
        bar = best_cost + _COST_ROUNDING
        for i, d, ec, b, steps, pending, held, spread_harm in sites:
            uncached = prompt - held
            chunk = max(1, ec.max_batched_tokens - b)
            # beside b decoding sequences, each step prefills (budget − b) tokens and costs them their step
            chunk_step = ec.step_base_s + ec.decode_seq_s * b + ec.decode_context_s * d.kv_used_tokens
            work = (ec.prefill_overhead_s + -(-uncached // chunk) * chunk_step
                    + ec.prefill_token_s * uncached + ec.prefill_attention_s * attention_pairs(uncached, held))
            if steps[4] != 1.0:  # on a shared host, at d's stretch
                work *= steps[4]
            ttft = pending + work + overhead
            # its time is taken from d and from each of the b sequences waiting for it
            load = w * (ttft + (1 + b) * work) / ttft_t + spread_harm
            if load > bar:
                continue
            meets_ttft = 1.0 - 0.5 * erfc((1.0 - ttft / ttft_t) / spread * k)
            if 1.0 - meets_ttft + load > bar:  # 2 − meet − ok_kv ≥ 1 − meets_ttft
                continue
            tau_b, tau_after = steps[0], steps[1]
            press = d.pressure_after(prompt + out + b * out // 2)  # as for a pair
            ok_kv = 1.0 - 0.5 * erfc((1.0 - press) / spread * k)
            before = 0.5 * erfc((1.0 - (tau_b + pending / out) / tpot_others) / spread * k) if b else 0.0
            after = 0.5 * erfc((1.0 - (tau_after + (pending + work) / out) / tpot_others) / spread * k) if b else 0.0
            meet = meets_ttft * (1.0 - 0.5 * erfc((1.0 - tau_after / tpot_t) / spread * k)) * ok_kv
            # if d's KV overflows it preempts a running sequence (it takes blocks chunk by chunk, where
            # a transferred prompt waits for all of them): one more miss
            cost = 2.0 - meet - ok_kv + b * (after - before) + load
            if cost < best_cost or best is None or cost == best_cost and 2 * i + 1 < best[1]:
                best = (cost, 2 * i + 1, d, d, pending, work, 0.0, 0.0, tau_after, press)
                best_cost, bar = cost, cost + _COST_ROUNDING
        return best

    def _best_hosted(self, req: RequestFeatures, out: int, target: SloTarget, ends: list[tuple], now: float,
                     best: _Priced | None, host: "_HostLoad | None" = None) -> _Priced | None:
        """The cheapest hosted placement — a prefill instance of `ends` (`_prefill_ends`) serving the
        request whole: no transfer, and its KV holds the decode — if it beats `best`, else `best`."""
        prm, cm = self.params, self.cost_model
        spread, w = prm.latency_error, prm.work_weight
        overhead = _outside_s(cm, host, handoff=False)
        prompt, ttft_t, tpot_t, tpot_others = req.prompt_tokens, target.ttft_s, target.tpot_s, self._tpot_floor_s
        erfc, k = math.erfc, _INV_SQRT2
        same_engine = not cm.instances
        best_cost = math.inf if best is None else best[0]
        bar = best_cost + _COST_ROUNDING
        for end, q, work, p in ends:
            if p.role is not Role.PREFILL:  # a decode instance listed as a prefill one: `_best_colocated`
                continue
            pid = p.instance_id
            ec = cm.engine if same_engine else cm.for_instance(pid)
            memo = self._steps.setdefault(None if same_engine else pid, {})
            h = p.hosted
            steps = memo.get(h)
            if steps is None:
                steps = memo[h] = _step_times(ec, h)
            c = ec.decode_context_s
            if c:  # the context p's hosted decodes hold: at most its KV in use (prompts awaiting hand-off too)
                steps = _with_context(steps, c, p.kv_used_tokens, prompt, out)
            tau_h, tau_after = steps[0], steps[1]
            extra = 0.0
            if host is not None:  # on a shared host: at p's stretch, and p stays busy while it decodes
                tau_h, tau_after, extra = host.decode_on(p, tau_h, tau_after)
                extra += host.prefill_stall(work, p, out)
            ttft = end + overhead  # its last prefill chunk gives the first token
            # its time is taken from the h decodes hosted there (its prefill), and from p's prefills
            # (its decode: ô steps, each longer by one sequence's cost)
            own = out * (ec.decode_seq_s + c * (prompt + out // 2)) if c else out * ec.decode_seq_s
            load = w * (ttft + h * work + own) / ttft_t + extra
            if load > bar:
                continue
            meets_ttft = 1.0 - 0.5 * erfc((1.0 - ttft / ttft_t) / spread * k)
            if 1.0 - meets_ttft + load > bar:
                continue
            # its decode gets the engine's time the prefills leave: τ/(1 − utilization) per token
            share = 1.0 - self._utilization(pid, now)
            tpot = tau_after / share
            press = p.pressure_after(prompt + out + h * out // 2)
            ok_kv = 1.0 - 0.5 * erfc((1.0 - press) / spread * k)
            harm = 0.0
            if h:
                before = 0.5 * erfc((1.0 - tau_h / share / tpot_others) / spread * k)
                after = 0.5 * erfc((1.0 - (tpot + work / out) / tpot_others) / spread * k)
                harm = h * (after - before)
            meet = meets_ttft * (1.0 - 0.5 * erfc((1.0 - tpot / tpot_t) / spread * k)) * ok_kv
            cost = 2.0 - meet - ok_kv + harm + load  # overflowing, it preempts a running sequence
            if cost < best_cost or best is None:  # hosted placements come last: a tie keeps `best`
                best = (cost, math.inf, p, p, q, work, 0.0, 0.0, tpot, press)
                best_cost, bar = cost, cost + _COST_ROUNDING
        return best

    def _decode_sites(self, pool: list[InstanceView], req: RequestFeatures, out: int, now: float,
                      host: "_HostLoad | None" = None) -> list[tuple]:
        """What pricing a placement on each decode candidate starts from, shared by its pairs and its
        colocated prefill: (its position in `pool`, the instance, its engine constants, b = its running
        sequences, `_step_times` for b (with the context they hold, and the request's) and d's stretch,
        the colocated prefill still to run there, the prompt tokens it holds cached, the misses that
        making d busy adds to the host's sequences)."""
        cm, hashes = self.cost_model, req.prefix_hashes
        colocated_ends, same_engine = self._colocated_ends, not cm.instances
        ec, memo = cm.engine, self._steps.setdefault(None, {})
        c = ec.decode_context_s
        sites = []
        for i, d in enumerate(pool):
            did = d.instance_id
            if not same_engine:
                ec, memo = cm.for_instance(did), self._steps.setdefault(did, {})
                c = ec.decode_context_s
            b = d.queued
            steps = memo.get(b)
            if steps is None:
                steps = memo[b] = _step_times(ec, b)
            if c:
                steps = _with_context(steps, c, d.kv_used_tokens, req.prompt_tokens, out)
            end = colocated_ends.get(did)  # `_colocated_queue_s`, without its min and max where none is left
            pending = min(d.backlog_s, end - now) if end is not None and end > now else 0.0
            held = cached_prompt_tokens(d, req) if hashes else 0
            if host is None:
                sites.append((i, d, ec, b, steps, pending, held, 0.0))
                continue
            sigma_now, sigma_d, harm = host.site(d)
            tau_b, tau_after, step, beside = steps[:4]
            sites.append((i, d, ec, b, (tau_b * sigma_now, tau_after * sigma_d, step * sigma_d, beside * sigma_d,
                                        sigma_d), pending, held, harm))
        return sites

    def _stall(self, p: InstanceView, work: float, out: int, now: float, spread: float) -> float:
        """The TPOT misses a prefill of `work` seconds on `p` adds to the decodes `p` hosts: each gets
        τ_dec(h)/(1 − utilization) per token, and `work` more spread over its (predicted) output."""
        ec, h = self.cost_model.for_instance(p.instance_id), p.hosted
        tpot = ec.decode_token_s(h, p.kv_used_tokens) / (1.0 - self._utilization(p.instance_id, now))
        return h * (_miss(tpot + work / out, self._tpot_floor_s, spread) - _miss(tpot, self._tpot_floor_s, spread))

    def _prefill_ends(self, pool: list[InstanceView], req: RequestFeatures, now: float,
                      host: "_HostLoad | None" = None) -> list[tuple]:
        """(end of the request's prefill, queue, work, instance) on each prefill candidate; on a shared
        host the end is at the instance's stretch, the queue and work as they are alone."""
        cm, prompt = self.cost_model, req.prompt_tokens
        # without prefix hashes or per-instance constants the work is the same everywhere: price it once
        uniform = not (req.prefix_hashes or cm.instances)
        work = cm.engine.prefill_s(prompt) if uniform else 0.0
        ends = []
        for p in pool:
            q = p.backlog_s
            if not uniform:
                cached = cached_prompt_tokens(p, req)  # the uncached rest attends to the cached prefix too
                work = cm.for_instance(p.instance_id).prefill_s(prompt - cached, cached)
            ends.append((q + work if host is None else (q + work) * host.prefill_sigma(p), q, work, p))
        return ends


# Skipping a candidate whose lower bound exceeds the best cost must not depend on the last bits of
# Φ: its other terms are ≥ 0 exactly but for Φ's rounding, far below this margin.
_COST_ROUNDING = 1e-9


def _step_times(ec: EngineConstants, b: int) -> tuple[float, float, float, float, float]:
    """τ_dec(b), τ_dec(b + 1), a decode step of b + 1 sequences, that step beside a full prefill
    chunk, and the stretch they run at (1: alone)."""
    return (ec.decode_token_s(b), ec.decode_token_s(b + 1), ec.step_s(0, b + 1),
            ec.step_s(ec.max_batched_tokens - b - 1, b + 1), 1.0)


def _with_context(steps: tuple, c: float, held: int, prompt: int, out: int) -> tuple:
    """`_step_times` with what the context the sequences hold costs each step (`decode_context_s` =
    c): `held` tokens now (the instance's KV in use), the request's prompt more from its first step,
    and half its output more on average over its decode."""
    tau_b, tau_after, step, beside, sigma = steps
    joined = held + prompt
    return tau_b + c * held, tau_after + c * (joined + out // 2), step + c * joined, beside + c * joined, sigma


def _outside_s(cm: CostModel, host: "_HostLoad | None", handoff: bool) -> float:
    """A placement's time outside the engines: the serving path, and for a pair the hand-off's second
    crossing of it (the prefill call's reply, the decode call), at the host's stretch."""
    unloaded = cm.serving_overhead_s + (cm.handoff_overhead_s if handoff else 0.0)
    return unloaded if host is None else unloaded * host.sigma


class _HostLoad:
    """The shared host as one decision sees it: which engines are busy (a decode instance with
    requests, a prefill instance with a backlog or hosted decodes), the serving path's CPU for the
    tokens they stream and the requests arriving, and the sequences running there, each with its
    TPOT as it is now."""

    __slots__ = ("host", "busy", "k", "weights", "weight", "tokens", "requests", "sigma", "sigma_up", "running",
                 "spread", "floor", "per_s", "remaining", "_harm_up")

    def __init__(self, cm: CostModel, host: SharedHost, prefill: list[InstanceView], decode: list[InstanceView],
                 spread: float, floor: float, requests_per_s: float, per_s: float = 0.0,
                 remaining: float = 0.0) -> None:
        """`per_s`: what a second added to a running sequence costs beside its misses (the policy's
        `work_weight` / the request's TTFT target); `remaining`: the tokens each running sequence has
        left to make (half of this request's predicted output: they are midway through theirs)."""
        self.host, self.spread, self.floor = host, spread, floor
        self.per_s, self.remaining = per_s, remaining
        views = {v.instance_id: v for v in (*prefill, *decode)}
        self.busy: set[str] = set()
        # each busy engine's weight on the host: a prefill instance with prefills queued claims a
        # prefill's share (`SharedHost.prefill_weight`), the others a decode step's
        self.weights: dict[str, float] = {}
        batches = []  # (instance, engine constants, running sequences, their context) of each busy engine that decodes
        for iid, v in views.items():
            b = v.queued if v.role is not Role.PREFILL else v.hosted
            if b or v.backlog_s > 0:
                self.busy.add(iid)
                prefilling = v.role is Role.PREFILL and v.backlog_s > 0
                self.weights[iid] = host.prefill_weight if prefilling else 1.0
                if b:
                    batches.append((iid, cm.for_instance(iid), b, v.kv_used_tokens))
        self.k = len(self.busy)
        self.weight = sum(self.weights.values())
        # the serving path works for each decoding engine's steps and relays its streams' messages
        # (`SharedHost.serving_cores`), and does each request's own work at the rate they come (`HostShare`)
        serving = [host.serving_cores(b, ec.step_s(0, b, 0.0, kv)) for _, ec, b, kv in batches]
        self.tokens = tokens = sum(load for load, _ in serving)
        self.requests = requests = host.request_cores(requests_per_s) + sum(relay for _, relay in serving)
        self.sigma = host.stretch(self.k, tokens, requests, 1.0, self.weight)
        self.sigma_up = host.stretch(self.k + 1, tokens, requests, 1.0, self.weight + 1.0)
        self.running = [(iid, ec.decode_token_s(b, kv) * self.sigma, b) for iid, ec, b, kv in batches]
        self._harm_up: float | None = None

    def prefill_sigma(self, v: InstanceView) -> float:
        """The stretch a prefill on `v` runs at: with a prefill's weight, and one more busy engine if
        `v` has no work now."""
        w = self.host.prefill_weight
        if w == 1.0:  # even weights: the stretches already priced
            return self.sigma if v.instance_id in self.busy else self.sigma_up
        k, total = self.k, self.weight + w
        if v.instance_id in self.busy:
            total -= self.weights[v.instance_id]
        else:
            k += 1
        return self.host.stretch(k, self.tokens, self.requests, w, total)

    def _delayed(self, delay: float, out: int, besides: str) -> float:
        """What the sequences running on engines other than `besides` lose when each is delayed by
        `delay` seconds spread over `out` tokens: the TPOT misses they gain (judged against the
        strictest class, their own not being visible), and the seconds."""
        spread, floor, per_token, seconds = self.spread, self.floor, delay / out, self.per_s * delay
        return sum(b * (_miss(t + per_token, floor, spread) - _miss(t, floor, spread) + seconds)
                   for iid, t, b in self.running if iid != besides)

    def harm_up(self) -> float:
        """What one more busy engine costs every sequence running on the host (σ(k) → σ(k + 1)): the
        misses it adds, and the seconds, which still count once those sequences miss anyway."""
        if self._harm_up is None:
            spread, floor, up = self.spread, self.floor, self.sigma_up / self.sigma
            self._harm_up = sum(b * (_miss(t * up, floor, spread) - _miss(t, floor, spread)
                                     + self.per_s * t * (up - 1.0) * self.remaining)
                                for _, t, b in self.running)
        return self._harm_up

    def site(self, d: InstanceView) -> tuple[float, float, float]:
        """For a decode placed on `d`: the stretch its sequences run at now, then, and the misses it
        adds to the host's other sequences by making `d` busy (0 if it is already)."""
        if d.instance_id in self.busy:
            return self.sigma, self.sigma, 0.0
        return self.sigma, self.sigma_up, self.harm_up()

    def decode_on(self, p: InstanceView, tau_h: float, tau_after: float) -> tuple[float, float, float]:
        """A decode hosted on prefill instance `p`: τ_dec(h) and τ_dec(h + 1) at its stretch, and the
        misses it adds to the host's sequences by keeping `p` busy while it decodes."""
        sigma_now, sigma_p, harm = self.site(p)
        return tau_h * sigma_now, tau_after * sigma_p, harm

    def prefill_stall(self, work: float, p: InstanceView, out: int) -> float:
        """What a prefill of `work` seconds on `p` costs the sequences running on the host's other
        engines: with k busy engines on `engine_cores` cores, its time is taken from theirs — each is
        delayed by work / engine_cores when every core is taken without it, by the part the spare
        cores cannot absorb otherwise — spread over a sequence's (predicted) output: the misses that
        adds, and the seconds. The decodes `p` itself hosts wait for the whole prefill, priced where
        `p` is priced (`_stall`, or a hosted placement's harm), so not here."""
        if not self.running:
            return 0.0
        k = self.k if p.instance_id in self.busy else self.k + 1
        cores = self.host.engine_cores
        delay = work * max(0.0, min(k / cores - 1.0, 1.0 / cores))
        return self._delayed(delay, out, p.instance_id) if delay > 0 else 0.0
