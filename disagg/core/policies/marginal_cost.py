"""The calibration paper's scorer (`marginal_cost`), its oracle (`oracle`, simulator only) and the
pair-priced variant with KV transfer per (prefill, decode) pair (`pair_cost`)."""

from __future__ import annotations

from typing import Annotated, Sequence

from pydantic import Field

from disagg.core.cost_model import CostModel
from disagg.core.policies.base import (
    PairTransfers, Params, Policy, PolicyError, TieBreak, TieBreakParams, cached_prompt_tokens, decode_context,
    feasible, fits, register,
)
from disagg.core.types import CostTerms, Decision, InstanceView, NoCapacity, RequestFeatures, SloClass


class MarginalCostParams(TieBreakParams):
    w_backlog: float = Field(default=1.0, ge=0.0, description="w_b: weight of committed backlog seconds")
    w_service: float = Field(default=1.0, ge=0.0, description="w_s: weight of the request's own work")
    w_queue_s: float = Field(default=0.002, ge=0.0, description="w_q: seconds charged per queued request")
    rho: float = Field(default=1.0, ge=0.0, description="ρ: how much post-admission KV pressure slows work")
    sigma: dict[SloClass, Annotated[float, Field(ge=0.0, allow_inf_nan=False)]] = Field(
        default_factory=lambda: {SloClass.TIGHT: 2.0, SloClass.LOOSE: 1.0},
        description="σ(class): amplification of strict SLO classes",
    )
    cached_prefix: bool = Field(
        default=True, description="price a prefill at the part of the prompt the candidate does not hold cached "
                                  "(false: the whole prompt everywhere, the paper's scorer)")


@register
class MarginalCost(Policy):
    """`marginal_cost`: the calibration paper's scorer — argmin of expected marginal completion time.

    For each decode candidate d, with p prompt tokens, ô predicted output tokens, SLO class s::

        cost(d) = w_b·backlog(d)·σ(s) + w_s·ô·τ_dec(d)·(1 + ρ·press⁺(d))·σ(s) + w_q·queue(d)

    where τ_dec(d) is d's calibrated per-token decode time at its post-admission concurrency and
    press⁺(d) = (KV used + p + ô) / KV capacity. Prefill candidates are priced the same way with the
    calibrated prefill time of p tokens in place of ô·τ_dec and press⁺ = (KV used + p) / capacity.
    With `cached_prefix` (the default) and prefix hashes on the request, a prefill candidate holding
    the prompt's first c tokens cached is priced at its prefill of the p − c others (attending to
    the c) and press⁺ = (KV used + p − c) / capacity: what vLLM computes and allocates there.
    Argmin in each pool independently; ties go to the first candidate. The chosen candidates' terms
    travel in the Decision, so every choice can be explained.

    Parameters: `w_backlog`, `w_service`, `w_queue_s`, `rho`, `sigma`, `cached_prefix` (above), and near-tie breaking:
    `tie_tolerance` (default 0.0 = deterministic argmin) and `seed` (default 0). With t > 0 each pool's
    choice is uniformly random among the candidates costing at most (1 + t) × that pool's best, so
    router replicas with equally stale views do not all pick the same instance.

    ```yaml
    policy:
      name: marginal_cost
      params: {w_backlog: 1.0, w_service: 1.0, w_queue_s: 0.002, rho: 1.0, sigma: {tight: 2.0, loose: 1.0},
               tie_tolerance: 0.05, seed: 0}
    ```
    """

    name = "marginal_cost"
    Params = MarginalCostParams

    def __init__(self, cost_model: CostModel, params: Params | None = None) -> None:
        super().__init__(cost_model, params)
        self._tie = TieBreak(self.params)

    def output_tokens(self, req: RequestFeatures) -> int:
        return req.predicted_output_tokens

    def cached(self, v: InstanceView, req: RequestFeatures) -> int:
        """The prompt tokens a prefill on `v` would not compute."""
        return cached_prompt_tokens(v, req) if self.params.cached_prefix else 0

    def prefill_terms(self, v: InstanceView, req: RequestFeatures, sigma: float) -> CostTerms:
        prm = self.params
        cached = self.cached(v, req) if req.prefix_hashes else 0  # no hashes, nothing cached: spare the calls
        press = v.pressure_after(req.prompt_tokens - cached)
        work = self.cost_model.for_instance(v.instance_id).prefill_s(req.prompt_tokens - cached, cached)
        return CostTerms(
            backlog_s=prm.w_backlog * v.backlog_s * sigma,
            own_work_s=prm.w_service * work * (1.0 + prm.rho * press) * sigma,
            pressure=press,
            queue_s=prm.w_queue_s * v.queued,
            slo_weight=sigma,
        )

    def decode_terms(self, v: InstanceView, req: RequestFeatures, sigma: float, out: int) -> CostTerms:
        prm = self.params
        press = v.pressure_after(req.prompt_tokens + out)
        tau_dec = self.cost_model.for_instance(v.instance_id).decode_token_s(v.queued + 1, decode_context(v, req, out))
        return CostTerms(
            backlog_s=prm.w_backlog * v.backlog_s * sigma,
            own_work_s=prm.w_service * out * tau_dec * (1.0 + prm.rho * press) * sigma,
            pressure=press,
            queue_s=prm.w_queue_s * v.queued,
            slo_weight=sigma,
        )

    def choose(self, req, prefill, decode, now):
        sigma = self.params.sigma.get(req.slo_class, 1.0)
        out = self.output_tokens(req)
        p_best = self._argmin_prefill(feasible(prefill, req, "prefill"), req, sigma)
        d_best = self._argmin_decode(feasible(decode, req, "decode"), req, sigma, out)
        return Decision(p_best.instance_id, d_best.instance_id, self.name,
                        self.prefill_terms(p_best, req, sigma), self.decode_terms(d_best, req, sigma, out))

    # The hot loops price with plain floats (same formula as *_terms, which explain the winner):
    # building a CostTerms per candidate would triple the decision cost. Without per-instance
    # constants, the prefill time is one number and τ_dec one function for the whole pool.
    def _argmin_prefill(self, pool, req, sigma):
        prm, cm, p = self.params, self.cost_model, req.prompt_tokens
        wb, ws, wq, rho = prm.w_backlog * sigma, prm.w_service * sigma, prm.w_queue_s, prm.rho
        if req.prefix_hashes and prm.cached_prefix:
            return self._tie.pick(pool, self._prefill_totals(pool, req, sigma))
        if cm.instances:
            totals = [wb * v.backlog_s + ws * cm.for_instance(v.instance_id).prefill_s(p)
                      * (1.0 + rho * ((v.kv_used_tokens + p) / v.kv_capacity_tokens)) + wq * v.queued for v in pool]
        else:
            work = cm.engine.prefill_s(p)
            totals = [wb * v.backlog_s + ws * work * (1.0 + rho * ((v.kv_used_tokens + p) / v.kv_capacity_tokens))
                      + wq * v.queued for v in pool]
        return self._tie.pick(pool, totals)

    def _prefill_works(self, pool: Sequence[InstanceView], req: RequestFeatures) -> list[float]:
        """Each candidate's prefill time of the prompt, less what it holds cached (`cached`)."""
        cm, p = self.cost_model, req.prompt_tokens
        if req.prefix_hashes and self.params.cached_prefix:
            return [cm.for_instance(v.instance_id).prefill_s(p - c, c)
                    for v, c in zip(pool, (cached_prompt_tokens(v, req) for v in pool))]
        if not cm.instances:
            return [cm.engine.prefill_s(p)] * len(pool)
        return [cm.for_instance(v.instance_id).prefill_s(p) for v in pool]

    def _prefill_totals(self, pool: Sequence[InstanceView], req: RequestFeatures, sigma: float) -> list[float]:
        """`prefill_terms(v, req, sigma).total_s` for each v in `pool`."""
        prm, p = self.params, req.prompt_tokens
        wb, ws, rho, wq = prm.w_backlog, prm.w_service, prm.rho, prm.w_queue_s
        new = [p - self.cached(v, req) for v in pool] if req.prefix_hashes else [p] * len(pool)
        return [wb * v.backlog_s * sigma + ws * work * (1.0 + rho * v.pressure_after(n)) * sigma + wq * v.queued
                for v, work, n in zip(pool, self._prefill_works(pool, req), new)]

    def _argmin_decode(self, pool, req, sigma, out):
        prm, cm, extra = self.params, self.cost_model, req.prompt_tokens + out
        wb, ws, wq, rho = prm.w_backlog * sigma, prm.w_service * sigma * out, prm.w_queue_s, prm.rho
        if cm.instances:
            totals = [wb * v.backlog_s
                      + ws * cm.for_instance(v.instance_id).decode_token_s(v.queued + 1, decode_context(v, req, out))
                      * (1.0 + rho * ((v.kv_used_tokens + extra) / v.kv_capacity_tokens)) + wq * v.queued for v in pool]
        else:
            tau = cm.engine.decode_token_s
            own = req.prompt_tokens + out // 2  # `decode_context(v, req, out)`, written out: the hot loop
            totals = [wb * v.backlog_s + ws * tau(v.queued + 1, v.kv_used_tokens + own)
                      * (1.0 + rho * ((v.kv_used_tokens + extra) / v.kv_capacity_tokens)) + wq * v.queued for v in pool]
        return self._tie.pick(pool, totals)


@register
class Oracle(MarginalCost):
    """`oracle`: `marginal_cost` told the true output length — an upper bound on what a better
    output-length predictor could gain. Simulator only: live requests have no true length.
    Parameters: those of `marginal_cost`, `tie_tolerance` and `seed` included.

    ```yaml
    policy: {name: oracle, params: {tie_tolerance: 0.0, seed: 0}}   # `disagg sim` only
    ```
    """

    name = "oracle"
    simulator_only = True

    def output_tokens(self, req: RequestFeatures) -> int:
        if req.true_output_tokens is None:
            raise PolicyError("the oracle policy needs the true output length: it runs in the simulator only")
        return req.true_output_tokens


class PairCostParams(MarginalCostParams):
    allow_colocated: bool = Field(
        default=True, description="may prefill on the chosen decode instance when that is cheaper"
    )
    interference: float = Field(
        default=1.0,
        ge=0.0,
        description="share of a colocated prefill's time charged once per sequence it stalls",
    )


@register
class PairCost(MarginalCost):
    """`pair_cost`: prices (prefill, decode) as one pair, KV transfer included.

    Beyond the paper: the cost of a pair is the marginal_cost prefill price on p, plus the
    calibrated KV transfer time p→d of the prompt tokens d does not hold cached (with
    `cached_prefix`; the whole prompt otherwise), plus the marginal_cost decode price on d. With
    per-pair transfer constants (for example same node vs across nodes) the argmin is taken over
    all pairs; otherwise the prefill instance is the prefill pool's own argmin.
    With `allow_colocated`, each decode instance is also priced as its own prefill: no transfer,
    but the prefill joins d's backlog and stalls the sequences running there, charged as
    `interference × prefill time × queued(d)`.

    Parameters: those of `marginal_cost` (weights, `sigma`, and `tie_tolerance` / `seed`), plus
    `allow_colocated` and `interference`. With `tie_tolerance` t > 0: without per-pair transfer
    constants the prefill instance is drawn among those priced within (1 + t) × the cheapest prefill,
    then the (prefill, decode) pairs and colocated options within (1 + t) × the cheapest of them;
    with per-pair constants, among all pairs and colocated options within (1 + t) × the cheapest.

    ```yaml
    policy: {name: pair_cost, params: {allow_colocated: true, interference: 1.0, tie_tolerance: 0.05, seed: 0}}
    ```
    """

    name = "pair_cost"
    Params = PairCostParams

    def __init__(self, cost_model: CostModel, params: Params | None = None) -> None:
        super().__init__(cost_model, params)
        self._pair_transfers = PairTransfers(cost_model)

    @property
    def may_colocate(self) -> bool:
        return self.params.allow_colocated

    def choose(self, req, prefill, decode, now):
        prm, cm = self.params, self.cost_model
        sigma = prm.sigma.get(req.slo_class, 1.0)
        out = self.output_tokens(req)
        prompt = req.prompt_tokens
        decode_ok = feasible(decode, req, "decode")
        prefill_ok = [v for v in prefill if fits(v, prompt)]
        # Candidates are priced as plain floats — `prefill_terms` / `decode_terms`' expressions in the
        # same order, so the very totals their `CostTerms` add up to — and only the winner's terms are
        # built: a `CostTerms` per candidate was most of the decision's time at 64 instances.
        d_totals = self._decode_totals(decode_ok, req, sigma, out)
        p_totals = self._prefill_totals(prefill_ok, req, sigma)
        if cm.pairs:
            paired = range(len(prefill_ok))
        elif prefill_ok:
            # the prefill choice is independent of d: its near-ties are judged on the prefill price
            # alone (a tolerance on the pair total would drown them in the decode backlog)
            paired = (self._tie.pick(range(len(prefill_ok)), p_totals),)
        else:
            paired = ()
        # the options' totals, in order: each paired prefill with every decode instance, then each
        # decode instance as its own prefill
        costs: list[float] = []
        w_s = prm.w_service
        stays = w_s * 0.0 * sigma
        # the KV moved to d: the prompt less what d holds cached (the connector pulls only the rest)
        lacks = [prompt - self.cached(d, req) for d in decode_ok] if req.prefix_hashes else None
        moved = ([w_s * cm.transfer.transfer_s(n) * sigma for n in lacks] if lacks
                 else [w_s * cm.transfer.transfer_s(prompt) * sigma] * len(decode_ok))  # default constants
        for i in paired:
            p_id, pt = prefill_ok[i].instance_id, p_totals[i]
            pair_row = self._pair_transfers.row(p_id)
            if pair_row:
                costs += [pt + dt + (stays if d.instance_id == p_id else w_s * pair_row.get(
                          d.instance_id, cm.transfer).transfer_s(lacks[j] if lacks else prompt) * sigma)
                          for j, (d, dt) in enumerate(zip(decode_ok, d_totals))]
            else:  # `cm.transfer_s`: one price for every decode instance but p itself
                costs += [pt + dt + (stays if d.instance_id == p_id else mv)
                          for d, dt, mv in zip(decode_ok, d_totals, moved)]
        n_pairs = len(costs)
        if prm.allow_colocated:
            costs += [w_s * (work + prm.interference * work * d.queued) * sigma + dt
                      for d, dt, work in zip(decode_ok, d_totals, self._prefill_works(decode_ok, req))]

        if not costs:
            feasible(prefill, req, "prefill")  # raises the precise reason
            raise NoCapacity("no prefill candidate fits and colocated prefill is disabled")
        best = self._tie.pick(range(len(costs)), costs)  # tolerance 0: the first cheapest
        if best < n_pairs:
            p, d = prefill_ok[paired[best // len(decode_ok)]], decode_ok[best % len(decode_ok)]
            xfer = w_s * cm.transfer_s(p.instance_id, d.instance_id, prompt - self.cached(d, req)) * sigma
            return Decision(p.instance_id, d.instance_id, self.name, self.prefill_terms(p, req, sigma),
                            _with_transfer(self.decode_terms(d, req, sigma, out), xfer))
        d = decode_ok[best - n_pairs]
        work = self._prefill_works([d], req)[0]
        stall = prm.interference * work * d.queued
        pt = CostTerms(own_work_s=w_s * (work + stall) * sigma, slo_weight=sigma)
        return Decision(d.instance_id, d.instance_id, self.name, pt, self.decode_terms(d, req, sigma, out))

    def _decode_totals(self, pool: Sequence[InstanceView], req: RequestFeatures, sigma: float, out: int) -> list[float]:
        """`decode_terms(v, req, sigma, out).total_s` for each v in `pool`."""
        prm, cm, extra = self.params, self.cost_model, req.prompt_tokens + out
        wb, ws, rho, wq = prm.w_backlog, prm.w_service, prm.rho, prm.w_queue_s
        return [wb * v.backlog_s * sigma
                + ws * out * cm.for_instance(v.instance_id).decode_token_s(v.queued + 1, decode_context(v, req, out))
                * (1.0 + rho * v.pressure_after(extra)) * sigma
                + wq * v.queued for v in pool]

def _with_transfer(t: CostTerms, transfer_s: float) -> CostTerms:
    return CostTerms(t.backlog_s, t.own_work_s, t.pressure, t.queue_s, transfer_s, t.slo_weight)
