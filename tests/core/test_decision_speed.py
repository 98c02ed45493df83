"""The fast pricing loops of `slo_goodput` and `pair_cost` choose exactly what the straightforward
exhaustive forms choose.

Both policies price every decode instance on every decision; their loops are written for speed
(memoised step times, Φ written out, candidates skipped on a lower bound, floats instead of a
`CostTerms` per candidate). The references below are those policies as they were written before:
every candidate priced in full, one `CostTerms` each. On many randomized fleets and request
sequences (ties, prefix caches, heterogeneous constants, per-pair transfers, pools that do not fit,
near-tie tolerances) the decisions must be equal — ids and the explanation's floats alike — and so
must the private state they leave (`slo_goodput`'s clocks) and the `NoCapacity` raised.
"""

from __future__ import annotations

import random

import pytest

from disagg.core.cost_model import attention_pairs, load_profile
from disagg.core.policies import PairCost, SloGoodput
from disagg.core.policies.base import feasible, fits
from disagg.core.policies.marginal_cost import _with_transfer
from disagg.core.policies.base import cached_prompt_tokens
from disagg.core.policies.slo_goodput import _HostLoad, _miss
from disagg.core.types import CostTerms, Decision, InstanceView, NoCapacity, RequestFeatures, Role, SloClass
from factories import engine_dict, make_cost_model


class ReferenceSloGoodput(SloGoodput):
    """`slo_goodput` priced the straightforward way: every candidate in full."""

    def choose(self, req, prefill, decode, now):
        prm, cm = self.params, self.cost_model
        spread, w = prm.latency_error, prm.work_weight
        target = cm.target(req.slo_class)
        ttft_t, tpot_t, tpot_others = target.ttft_s, target.tpot_s, self._tpot_floor_s
        prompt = req.prompt_tokens
        out = max(1, req.predicted_output_tokens)
        decode_ok = feasible(decode, req, "decode")
        prefill_ok = [v for v in prefill if fits(v, prompt)]
        if not prefill_ok and not prm.allow_colocated:
            feasible(prefill, req, "prefill")
            raise NoCapacity("no prefill candidate fits and colocated prefill is disabled")
        host = None
        if cm.shared_host is not None:
            self._requests.arrive(now)
            host = _HostLoad(cm, cm.shared_host, prefill, decode, spread, tpot_others, self._requests.at(now),
                             w / ttft_t, out / 2)
        # the serving path at the host's stretch; a pair's hand-off crosses it once more
        overhead = cm.serving_overhead_s * (1.0 if host is None else host.sigma)
        handoff = cm.handoff_overhead_s * (1.0 if host is None else host.sigma)
        ends = []
        for p in prefill_ok:
            q = p.backlog_s
            cached = cached_prompt_tokens(p, req)
            work = cm.for_instance(p.instance_id).prefill_s(prompt - cached, cached)
            stall = self._stall(p, work, out, now, spread)
            if host is None:
                ends.append((q + work, q, work, p, stall))
            else:
                ends.append(((q + work) * host.prefill_sigma(p), q, work, p, stall + host.prefill_stall(work, p, out)))
        all_ends = ends
        if ends and not cm.pairs:  # the earliest end, and each later one that stalls fewer hosted decodes
            ordered = sorted(ends, key=lambda e: e[0])
            ends = [e for j, e in enumerate(ordered) if all(e[4] < f[4] for f in ordered[:j])]
        best = None
        for d in decode_ok:
            ec = cm.for_instance(d.instance_id)
            b = d.queued
            pending = self._colocated_queue_s(d, now)
            held = cached_prompt_tokens(d, req)
            press = d.pressure_after(prompt + out + b * out // 2)
            ok_kv = 1.0 - _miss(press, 1.0, spread)
            # on a shared host: the stretch d's sequences run at now and with this one, and the misses
            # making d busy adds to the host's other sequences
            sigma_now, sigma_d, harm = (1.0, 1.0, 0.0) if host is None else host.site(d)
            # the context d's sequences hold, and the request's: its prompt, and half its output on average
            kv = d.kv_used_tokens
            tau_after = ec.decode_token_s(b + 1, kv + prompt + out // 2) * sigma_d
            before = _miss(ec.decode_token_s(b, kv) * sigma_now + pending / out, tpot_others, spread) if b else 0.0
            step = ec.step_s(0, b + 1, 0.0, kv + prompt) * sigma_d
            for end, q, work, p, stall in ends:
                xfer = cm.transfer_s(p.instance_id, d.instance_id, prompt - held)
                arrive = end + xfer
                first = ec.step_s(ec.max_batched_tokens - b - 1, b + 1, 0.0, kv + prompt) * sigma_d \
                    if pending > arrive else step
                if b:
                    first *= 1.5
                ttft = arrive + first + overhead + handoff
                tpot = tau_after + max(0.0, pending - arrive) / out
                after = _miss(tau_after + pending / out, tpot_others, spread) if b else 0.0
                meet = (1.0 - _miss(ttft, ttft_t, spread)) * (1.0 - _miss(tpot, tpot_t, spread)) * ok_kv
                cost = 1.0 - meet + b * (after - before) + (w * ttft / ttft_t + stall + harm)  # as summed there
                if best is None or cost < best[0]:
                    best = (cost, p, d, q, work, xfer, first, tpot, press)
            if prm.allow_colocated:
                uncached = prompt - held
                chunk = max(1, ec.max_batched_tokens - b)
                work = (ec.prefill_overhead_s
                        + -(-uncached // chunk) * (ec.step_base_s + ec.decode_seq_s * b + ec.decode_context_s * kv)
                        + ec.prefill_token_s * uncached + ec.prefill_attention_s * attention_pairs(uncached, held))
                work *= sigma_d
                ttft = pending + work + overhead
                after = _miss(tau_after + (pending + work) / out, tpot_others, spread) if b else 0.0
                meet = (1.0 - _miss(ttft, ttft_t, spread)) * (1.0 - _miss(tau_after, tpot_t, spread)) * ok_kv
                cost = 2.0 - meet - ok_kv + b * (after - before) + w * (ttft + (1 + b) * work) / ttft_t + harm
                if best is None or cost < best[0]:
                    best = (cost, d, d, pending, work, 0.0, 0.0, tau_after, press)
        for end, q, work, p, _ in all_ends if prm.allow_hosted else ():
            if p.role is not Role.PREFILL:
                continue
            ec, h = cm.for_instance(p.instance_id), p.hosted
            ttft = end + overhead
            share = 1.0 - self._utilization(p.instance_id, now)
            kv = p.kv_used_tokens
            tau_h, tau_after, extra = ec.decode_token_s(h, kv), ec.decode_token_s(h + 1, kv + prompt + out // 2), 0.0
            if host is not None:
                tau_h, tau_after, extra = host.decode_on(p, tau_h, tau_after)
                extra += host.prefill_stall(work, p, out)
            tpot = tau_after / share
            press = p.pressure_after(prompt + out + h * out // 2)
            ok_kv = 1.0 - _miss(press, 1.0, spread)
            harm = h * (_miss(tpot + work / out, tpot_others, spread)
                        - _miss(tau_h / share, tpot_others, spread)) if h else 0.0
            meet = (1.0 - _miss(ttft, ttft_t, spread)) * (1.0 - _miss(tpot, tpot_t, spread)) * ok_kv
            own = out * (ec.decode_seq_s + ec.decode_context_s * (prompt + out // 2))
            cost = 2.0 - meet - ok_kv + harm + w * (ttft + h * work + own) / ttft_t + extra
            if best is None or cost < best[0]:
                best = (cost, p, p, q, work, 0.0, 0.0, tpot, press)
        _, p, d, q, work, xfer, first, tpot, press = best
        if p is d and p.role is not Role.PREFILL:
            self._colocated_ends[d.instance_id] = now + q + work
        else:
            self._add_prefill(p.instance_id, work, now)
        return Decision(
            p.instance_id, d.instance_id, self.name,
            CostTerms(backlog_s=q, own_work_s=work, pressure=p.pressure_after(prompt)),
            CostTerms(backlog_s=first, own_work_s=out * tpot, pressure=press, transfer_s=xfer),
        )


class ReferencePairCost(PairCost):
    """`pair_cost` priced the straightforward way: a `CostTerms` per candidate, every option listed."""

    def choose(self, req, prefill, decode, now):
        prm = self.params
        cm = self.cost_model
        sigma = prm.sigma.get(req.slo_class, 1.0)
        out = self.output_tokens(req)
        decode_ok = feasible(decode, req, "decode")
        d_priced = [(d, self.decode_terms(d, req, sigma, out)) for d in decode_ok]
        options = []
        prefill_ok = [v for v in prefill if fits(v, req.prompt_tokens)]
        p_priced = [(p, self.prefill_terms(p, req, sigma)) for p in prefill_ok]
        if cm.pairs:
            candidates = ((p, pt, d, dt) for p, pt in p_priced for d, dt in d_priced)
        elif p_priced:
            p, pt = self._tie.pick(p_priced, [x[1].total_s for x in p_priced])
            candidates = ((p, pt, d, dt) for d, dt in d_priced)
        else:
            candidates = iter(())
        for p, pt, d, dt in candidates:
            lacks = req.prompt_tokens - self.cached(d, req)  # d pulls only what it does not hold
            xfer = prm.w_service * cm.transfer_s(p.instance_id, d.instance_id, lacks) * sigma
            options.append((pt.total_s + dt.total_s + xfer, p, pt, d, _with_transfer(dt, xfer)))
        if prm.allow_colocated:
            for d, dt in d_priced:
                c = self.cached(d, req)
                work = cm.for_instance(d.instance_id).prefill_s(req.prompt_tokens - c, c)
                stall = prm.interference * work * d.queued
                pt = CostTerms(own_work_s=prm.w_service * (work + stall) * sigma, slo_weight=sigma)
                options.append((pt.total_s + dt.total_s, d, pt, d, dt))
        if not options:
            feasible(prefill, req, "prefill")
            raise NoCapacity("no prefill candidate fits and colocated prefill is disabled")
        _, p, pt, d, dt = self._tie.pick(options, [o[0] for o in options])
        return Decision(p.instance_id, d.instance_id, self.name, pt, dt)


# --- randomized fleets ----------------------------------------------------------------------------


def _cost_models():
    a40 = load_profile("a40")
    small = make_cost_model()
    hetero = make_cost_model(instances={"d1": engine_dict(decode_seq_s=0.004, max_batched_tokens=512),
                                        "p0": engine_dict(prefill_token_s=0.0004, kv_capacity_tokens=4000)})
    pairs = make_cost_model(pairs={"p0->d0": {"latency_s": 0.0, "tokens_per_s": 1e6},
                                   "p1->d2": {"latency_s": 0.05, "tokens_per_s": 1e4}})
    overhead = make_cost_model(serving_overhead_s=0.03, engine=engine_dict(prefill_token_s=0.0001))
    # every constant the cost model has set at once, so no term of either policy goes unchecked
    every = make_cost_model(serving_overhead_s=0.01, handoff_overhead_s=0.006,
                            engine=engine_dict(prefill_overhead_s=0.004, prefill_attention_s=2e-9,
                                               decode_context_s=1e-7),
                            instances={"d0": engine_dict(prefill_attention_s=5e-9, decode_seq_s=0.001,
                                                         decode_context_s=3e-7)},
                            pairs={"p0->d1": {"latency_s": 0.01, "tokens_per_s": 5e4}})
    assert all(v for k, v in every.engine.model_dump().items() if k != "measured_at"), every.engine
    # engines on one host: the stretch, the serving path's CPU and the prefill's stall priced too
    shared = make_cost_model(engine=engine_dict(prefill_token_s=0.0001, decode_context_s=1e-7), serving_overhead_s=0.01,
                             handoff_overhead_s=0.005,
                             shared_host={"engine_cores": 1.0, "cores": 2.0, "token_cpu_s": 0.0005})
    return {"a40": a40, "small": small, "hetero": hetero, "pairs": pairs, "overhead": overhead, "every": every,
            "shared": shared}


CMS = _cost_models()


def _holding(blocks: int, hashes: tuple[int, ...]):
    held = set(hashes[:blocks])
    return lambda hs: next((i for i, h in enumerate(hs) if h not in held), len(hs))


def _pool(rng: random.Random, role: Role, n: int, cap: int, hashes: tuple[int, ...]) -> list[InstanceView]:
    prefix = "p" if role is Role.PREFILL else "d"
    shared_backlog = rng.uniform(0.0, 1.0)
    views = []
    for i in range(n):
        if views and rng.random() < 0.15:  # an exact copy under another id: a tie
            v = views[-1]
            views.append(InstanceView(f"{prefix}{i}", role, v.backlog_s, v.queued, v.kv_used_tokens,
                                      v.kv_capacity_tokens, v.prefix_lookup, v.hosted))
            continue
        backlog = rng.choice([0.0, shared_backlog, rng.uniform(0.0, 0.3), rng.uniform(0.0, 2.0), rng.uniform(0, 8)])
        queued = rng.choice([0, 0, 1, rng.randint(0, 8), rng.randint(0, 60)])
        capacity = rng.choice([cap, cap, cap // 4, 600])
        used = rng.choice([0, rng.randint(0, capacity), rng.randint(0, 2 * capacity)])
        lookup = _holding(rng.randint(0, len(hashes)), hashes) if hashes and rng.random() < 0.7 else None
        hosted = rng.choice([0, 0, queued, rng.randint(0, queued)]) if role is Role.PREFILL else 0
        views.append(InstanceView(f"{prefix}{i}", role, backlog, queued, used, capacity, lookup, hosted))
    return views


def _request(rng: random.Random, i: int) -> RequestFeatures:
    prompt = rng.choice([1, rng.randint(1, 600), rng.randint(1, 4000), rng.randint(1000, 12000)])
    hashes = tuple(rng.sample(range(10_000), k=prompt // 512 + 1)) if rng.random() < 0.5 else ()
    slo = SloClass.TIGHT if rng.random() < 0.5 else SloClass.LOOSE
    return RequestFeatures(f"r{i}", prompt, rng.choice([0, 1, rng.randint(1, 100), rng.randint(1, 800)]), slo,
                           rng.randint(1, 800), hashes)


def _decide(policy, req, prefill, decode, now):
    try:
        return policy.choose(req, prefill, decode, now)
    except NoCapacity as e:
        return ("NoCapacity", str(e))


def _run_pair(fast, slow, rng: random.Random, decisions: int, max_p: int, max_d: int) -> int:
    """Drive both policies through the same random decisions; returns how many were compared."""
    cap = fast.cost_model.engine.kv_capacity_tokens
    now = 0.0
    for i in range(decisions):
        req = _request(rng, i)
        n_p, n_d = rng.randint(0, max_p), rng.randint(1, max_d)
        prefill = _pool(rng, Role.PREFILL, n_p, cap, req.prefix_hashes)
        decode = _pool(rng, Role.DECODE, n_d, cap, req.prefix_hashes)
        if prefill and rng.random() < 0.05:  # one instance in both pools: the same id on both sides
            prefill = [*prefill, decode[0]]
        got, want = _decide(fast, req, prefill, decode, now), _decide(slow, req, prefill, decode, now)
        assert got == want, f"decision {i}: {req}\n fast {got}\n reference {want}"
        now += rng.choice([0.0, rng.expovariate(20.0)])
    return decisions


@pytest.mark.parametrize("cm_name", sorted(CMS))
@pytest.mark.parametrize("params", [{}, {"allow_colocated": False}, {"allow_hosted": False},
                                    {"allow_colocated": False, "allow_hosted": False, "utilization_window_s": 0.5},
                                    {"work_weight": 0.0}, {"work_weight": 1.0},
                                    {"latency_error": 0.02}, {"latency_error": 1.0}])
def test_slo_goodput_chooses_as_the_exhaustive_reference(cm_name, params):
    cm = CMS[cm_name]
    rng = random.Random(f"slo/{cm_name}/{sorted(params.items())}")
    compared = 0
    for _ in range(12):  # fresh policies: the private clocks start empty
        fast = SloGoodput(cm, SloGoodput.Params(**params))
        slow = ReferenceSloGoodput(cm, SloGoodput.Params(**params))
        compared += _run_pair(fast, slow, rng, 40, max_p=6, max_d=12)
        assert fast._colocated_ends == slow._colocated_ends
        assert fast._prefill_rate == slow._prefill_rate
    assert compared == 480


@pytest.mark.parametrize("cm_name", sorted(CMS))
@pytest.mark.parametrize("params", [{}, {"allow_colocated": False}, {"tie_tolerance": 0.05, "seed": 3},
                                    {"tie_tolerance": 0.5, "seed": 1, "interference": 0.0},
                                    {"w_backlog": 0.0, "w_queue_s": 0.0, "rho": 0.0}])
def test_pair_cost_chooses_as_the_exhaustive_reference(cm_name, params):
    cm = CMS[cm_name]
    rng = random.Random(f"pair/{cm_name}/{sorted(params.items())}")
    fast = PairCost(cm, PairCost.Params(**params))
    slow = ReferencePairCost(cm, PairCost.Params(**params))
    assert _run_pair(fast, slow, rng, 400, max_p=6, max_d=12) == 400


@pytest.mark.parametrize("cls, ref", [(SloGoodput, ReferenceSloGoodput), (PairCost, ReferencePairCost)])
def test_at_64_instances_too(cls, ref):
    """The decision-cost benchmark's fleet size (21 prefill, 43 decode), where skipping pays most."""
    cm = CMS["a40"]
    rng = random.Random(64)
    fast, slow = cls(cm), ref(cm)
    assert _run_pair(fast, slow, rng, 150, max_p=21, max_d=43) == 150
