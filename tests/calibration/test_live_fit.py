"""`disagg calibrate --live`, its pure parts: the fleet fit (per-instance constants, the pool-wide
default, what is kept from the running cost model) and the probe driver against a stand-in
`/admin/probe` (the plan, the pauses, the budget). The live path is in test_calibrate_fleet_live.py."""

import asyncio
import random
import time

import pytest

from calibration.fit import SPEED_MATERIAL, CalibrationError, InstanceSamples, Sample, fit_engine, fit_fleet, speed_of
from calibration.live import Fleet, LiveCalibrationError, LiveCalibrator, LivePlan
from disagg.core.cost_model import load_profile
from disagg.core.types import SloClass
from serve_app.messages import PROBE_CONTEXT

BASE = load_profile("cpu-tiny")
SLOW = dict(base=0.004, overhead=0.006, tau_pre=3.0e-5, tau_seq=4.0e-5)  # another generation of hardware
FAST = dict(base=0.0017, overhead=0.004, tau_pre=1.0e-5, tau_seq=2.0e-5)


def instance(t: dict, noise: float = 0.01, seed: int = 0, kv: int = 100_000) -> InstanceSamples:
    rng = random.Random(seed)
    j = lambda x: x * (1 + rng.uniform(-noise, noise))  # noqa: E731
    pre = lambda p: j(t["overhead"] + t["base"] + t["tau_pre"] * p)  # noqa: E731
    dec = lambda b: j(t["base"] + t["tau_seq"] * b)  # noqa: E731
    return InstanceSamples(prefill=[Sample(p, pre(p)) for p in (16, 64, 256, 1024, 1984) for _ in range(2)],
                           decode=[Sample(b, dec(b)) for b in (1, 4, 16) for _ in range(2)],
                           held_out_prefill=[Sample(p, pre(p)) for p in (200, 800)],
                           held_out_decode=[Sample(12, dec(12))], kv_capacity_tokens=kv)


def test_instances_of_other_hardware_get_their_own_constants_and_the_pool_default_lies_between():
    cm, fits = fit_fleet({"prefill-a": instance(FAST), "decode-b": instance(SLOW, seed=1)}, BASE, "live", "tiny:tiny",
                         serving_overhead_s=0.02, measured_at="2026-12-01T21:00:00+00:00")
    fast, slow = cm.for_instance("prefill-a"), cm.for_instance("decode-b")
    assert fast.prefill_token_s == pytest.approx(FAST["tau_pre"], rel=0.1)
    assert slow.prefill_token_s == pytest.approx(SLOW["tau_pre"], rel=0.1)
    assert slow.step_base_s == pytest.approx(SLOW["base"], rel=0.1)
    assert fast.prefill_s(1024) < cm.engine.prefill_s(1024) < slow.prefill_s(1024)
    assert fast.measured_at == slow.measured_at == cm.engine.measured_at == "2026-12-01T21:00:00+00:00"
    assert cm.for_instance("decode-started-later") == cm.engine  # priced by the pool-wide fit
    assert all(f.held_out["median_rel_error"] < 0.05 for f in fits.values())
    # what probes cannot measure stays as the router had it; the SLO rule follows the new fit
    assert cm.transfer == BASE.transfer and cm.pairs == BASE.pairs
    assert cm.calibrated and cm.model == "tiny:tiny" and cm.serving_overhead_s == 0.02
    assert cm.slo[SloClass.TIGHT].ttft_s != BASE.slo[SloClass.TIGHT].ttft_s
    assert cm.slo[SloClass.LOOSE].ttft_s == pytest.approx(3 * cm.slo[SloClass.TIGHT].ttft_s)
    # the smallest engine bounds the default KV capacity; each instance keeps its own
    cm2, _ = fit_fleet({"a": instance(FAST, kv=50_000), "b": instance(FAST, seed=2)}, BASE, "live", "tiny:tiny",
                       0.0, "t")
    assert cm2.engine.kv_capacity_tokens == 50_000 and cm2.for_instance("b").kv_capacity_tokens == 100_000


def test_instances_of_one_speed_share_one_fit_which_predicts_each_better_than_its_own():
    # three identical engines, probed twice per point with 8% noise: each one's own fit trades its
    # terms off on too few samples, the shared fit has three times the data
    noisy = {f"decode-{k}": instance(FAST, noise=0.08, seed=10 + k) for k in range(3)}
    truth = {f"decode-{k}": instance(FAST, noise=0.0) for k in range(3)}
    cm, fits = fit_fleet(noisy, BASE, "live", "tiny:tiny", 0.0, "t")
    assert all(f.shared and f.speed == pytest.approx(1.0, abs=0.05) for f in fits.values())
    for iid in noisy:
        priced = cm.for_instance(iid)
        assert priced == cm.engine.model_copy(update={"kv_capacity_tokens": noisy[iid].kv_capacity_tokens})

    def error(e, s: InstanceSamples) -> float:  # the worst, against the noiseless truth at every point
        pre = [abs(e.prefill_s(int(x.x)) - x.seconds) / x.seconds for x in s.prefill + s.held_out_prefill]
        dec = [abs(e.decode_token_s(int(x.x)) - x.seconds) / x.seconds for x in s.decode + s.held_out_decode]
        return max(pre + dec)

    limits = (BASE.engine.block_size, BASE.engine.max_num_seqs, BASE.engine.max_batched_tokens)
    own = [error(fit_engine(s.prefill, s.decode, s.kv_capacity_tokens, *limits)[0], truth[iid])
           for iid, s in noisy.items()]
    shared = [error(cm.for_instance(iid), truth[iid]) for iid in noisy]
    assert max(shared) < max(own)


def test_an_instance_off_the_common_speed_gets_its_own_fit_and_does_not_bend_the_shared_one():
    fleet = {f"decode-{k}": instance(FAST, seed=k) for k in range(3)} | {"decode-odd": instance(SLOW, seed=9)}
    cm, fits = fit_fleet(fleet, BASE, "live", "tiny:tiny", 0.0, "t")
    assert [iid for iid, f in fits.items() if not f.shared] == ["decode-odd"]
    assert fits["decode-odd"].engine == fits["decode-odd"].own  # priced by its own fit, which is kept too
    assert all(f.own != f.engine for iid, f in fits.items() if f.shared)
    assert fits["decode-odd"].speed > 1 + SPEED_MATERIAL
    odd = cm.for_instance("decode-odd")
    assert odd.prefill_token_s == pytest.approx(SLOW["tau_pre"], rel=0.1)
    assert odd.step_base_s == pytest.approx(SLOW["base"], rel=0.1)
    # the shared fit, and so the default and the SLO targets, describe the typical engines
    assert cm.engine.prefill_token_s == pytest.approx(FAST["tau_pre"], rel=0.1)
    assert cm.engine.step_base_s == pytest.approx(FAST["base"], rel=0.1)
    assert fits["decode-odd"].held_out["median_rel_error"] < 0.05


def test_speed_of_samples_is_the_factor_their_engine_runs_at():
    e = BASE.engine
    slow = e.scaled(1.7)
    pre = [Sample(p, slow.prefill_s(p)) for p in (16, 256, 1984)]
    dec = [Sample(b, slow.decode_token_s(b)) for b in (1, 16)]
    assert speed_of(e, pre, dec) == pytest.approx(1.7)


def test_a_measured_hand_off_enters_the_model_and_the_slo_rule_an_unmeasured_one_is_kept():
    samples = {"prefill-a": instance(FAST), "decode-b": instance(SLOW, seed=1)}
    base = BASE.model_copy(update={"handoff_overhead_s": 0.003})
    kept, _ = fit_fleet(samples, base, "live", "tiny:tiny", 0.02, "t")
    measured, _ = fit_fleet(samples, base, "live", "tiny:tiny", 0.02, "t", handoff_overhead_s=0.008)
    assert kept.handoff_overhead_s == 0.003 and measured.handoff_overhead_s == 0.008
    # the tight TTFT is twice a disaggregated request's unloaded time, its hand-off's serving path included
    grown = measured.slo[SloClass.TIGHT].ttft_s - kept.slo[SloClass.TIGHT].ttft_s
    assert grown == pytest.approx(2 * 0.005)


def test_an_instance_whose_fit_is_refused_refuses_the_whole_and_names_it():
    flat = instance(FAST)
    flat.prefill = [Sample(s.x, 0.01) for s in flat.prefill]  # does not grow with the prompt
    with pytest.raises(CalibrationError, match="instance decode-x: prefill latency does not grow"):
        fit_fleet({"prefill-a": instance(FAST), "decode-x": flat}, BASE, "live", "tiny:tiny", 0.0, "t")
    with pytest.raises(CalibrationError, match="no instance"):
        fit_fleet({}, BASE, "live", "tiny:tiny", 0.0, "t")


def state(models: dict, instances: dict) -> dict:
    return {"models": models, "instances": instances}


def model_state(**over) -> dict:
    return {"source": "tiny:tiny", "max_model_len": 2048, "max_num_seqs": 64,
            "cost_model_constants": BASE.to_dict(), **over}


def test_the_fleet_is_read_from_admin_state_and_ambiguity_is_an_error():
    s = state({"m": model_state()}, {"prefill-1": {"model": "m", "role": "prefill", "engine_pids": [11, 12], "pid": 10},
                                     "decode-2": {"model": "m", "role": "decode", "engine_pids": [21, 22], "pid": 20},
                                     "o:decode-3": {"model": "o", "role": "decode", "engine_pids": [31], "pid": 30},
                                     "o:decode-4": {"model": "o", "role": "decode", "pid": 40}})  # a stand-in
    f = Fleet.from_state(s, None)
    assert f.instances == {"decode-2": "decode", "prefill-1": "prefill"} and f.cost_model == BASE
    assert f.engines == ("decode-2", "o:decode-3", "o:decode-4", "prefill-1")  # the host's: every model's
    assert sorted(f.engine_pids) == [11, 12, 21, 22, 31]  # and their processes, whose CPU is theirs
    assert sorted(f.replica_pids) == [10, 20, 30]  # ... under the replicas that name them
    with pytest.raises(LiveCalibrationError, match="serves 2 models"):
        Fleet.from_state(state({"m": model_state(), "o": model_state()}, {}), None)
    with pytest.raises(LiveCalibrationError, match="--model 'x'"):
        Fleet.from_state(s, "x")
    with pytest.raises(LiveCalibrationError, match="no live instance"):
        Fleet.from_state(state({"m": model_state()}, {}), None)
    bare = model_state()
    del bare["cost_model_constants"]
    with pytest.raises(LiveCalibrationError, match="older one"):
        Fleet.from_state(state({"m": bare}, {}), None)


PLAN = LivePlan.for_context(2048, 64, quick=True)


class StandInProbes:
    """`/admin/probe` answering from known constants, recording what it was asked and when."""

    def __init__(self, t: dict) -> None:
        self.t, self.calls = t, []

    async def __call__(self, body: dict) -> dict:
        self.calls.append((time.monotonic(), body))
        t = self.t
        if body["kind"] == "prefill":
            seconds = t["overhead"] + t["base"] + t["tau_pre"] * body["size"]
        else:  # a decode step pays for the context its streams hold beyond a short probe's
            seconds = t["base"] + t["tau_seq"] * body["size"] \
                + t.get("tau_ctx", 0.0) * body["size"] * (body.get("context", PROBE_CONTEXT) - PROBE_CONTEXT)
        return {"seconds": seconds, "kv_capacity_tokens": 1234}


def test_the_driver_follows_the_plan_pauses_after_every_probe_and_fits_what_it_measured():
    probes = StandInProbes({**SLOW, "tau_ctx": 9e-8})
    t0 = time.monotonic()
    s = asyncio.run(LiveCalibrator(probes, PLAN, pause_s=0.005, budget_s=60).measure("decode-2"))
    n = len(probes.calls)
    assert time.monotonic() - t0 >= 0.005 * n  # a pause after each probe
    assert {b["instance"] for _, b in probes.calls} == {"decode-2"}
    assert len({b["seed"] for _, b in probes.calls}) == n  # every probe's prompt is new: no prefix-cache hits
    # one unmeasured wake-up, then every fitted point once per round, every held-out point in more rounds
    assert n == 1 + PLAN.steps() and 3 <= PLAN.rounds < PLAN.held_out_rounds
    assert sorted(x.x for x in s.prefill) == sorted(PLAN.prefill_lengths * PLAN.rounds)
    streams, context = PLAN.long_context
    assert context == 1024 and streams == 16  # half the model's context, beside the short probes
    assert sorted(x.x for x in s.decode) == sorted((*PLAN.concurrencies, streams) * PLAN.rounds)
    assert sorted(x.extra_context for x in s.decode if x.extra_context) == [context - PROBE_CONTEXT] * PLAN.rounds
    asked = [(b["kind"], b["size"]) for _, b in probes.calls[1:]]
    asked_long = [(b["kind"], b["size"], b.get("context")) for _, b in probes.calls[1:]]
    assert asked_long.count(("decode", streams, context)) == PLAN.rounds
    assert all(asked.count(("prefill", n)) == PLAN.held_out_rounds for n in PLAN.held_out_lengths)
    assert all(asked.count(("decode", c)) == PLAN.held_out_rounds for c in PLAN.held_out_concurrencies)
    # a held-out point is the median of its rounds: one sample each
    assert sorted(x.x for x in s.held_out_prefill) == sorted(PLAN.held_out_lengths)
    assert sorted(x.x for x in s.held_out_decode) == sorted(PLAN.held_out_concurrencies)
    assert s.kv_capacity_tokens == 1234
    assert all(b["tokens"] == PLAN.decode_tokens for _, b in probes.calls if b["kind"] == "decode")
    assert all(b["repeats"] == PLAN.prefill_repeats for _, b in probes.calls if b["kind"] == "prefill")
    # every round measures each fitted point once and the held-out points in their share of rounds,
    # so the held-out set is taken in the same minute as the points it judges; rounds visit the points
    # in different orders, so a slow spell does not land on one point
    fitted = [("prefill", n) for n in PLAN.prefill_lengths] + [("decode", c) for c in PLAN.concurrencies] \
        + [("decode", streams)]
    held = [("prefill", n) for n in PLAN.held_out_lengths] + [("decode", c) for c in PLAN.held_out_concurrencies]
    rounds, at = [], 0
    for r in range(PLAN.rounds):
        size = len(fitted) + len(held) * PLAN.held_out_in_round(r)
        rounds.append(asked[at:at + size])
        at += size
    assert at == len(asked) and PLAN.rounds >= 3
    for r, got in enumerate(rounds):
        assert sorted(got) == sorted(fitted + held * PLAN.held_out_in_round(r))
        assert PLAN.held_out_in_round(r) >= 1
    assert rounds[0] != rounds[1]
    cm, fits = fit_fleet({"decode-2": s}, BASE, "live", "tiny:tiny", 0.0, "t")
    assert cm.for_instance("decode-2").decode_seq_s == pytest.approx(SLOW["tau_seq"], rel=1e-6)
    assert cm.for_instance("decode-2").decode_context_s == pytest.approx(9e-8, rel=1e-6)
    assert fits["decode-2"].held_out["median_rel_error"] < 1e-6


def test_a_run_past_its_budget_stops_before_its_next_probe():
    probes = StandInProbes(FAST)
    with pytest.raises(LiveCalibrationError, match="over the budget of 0.05 s"):
        asyncio.run(LiveCalibrator(probes, PLAN, pause_s=0.02, budget_s=0.05).measure("prefill-1"))
    assert 1 <= len(probes.calls) <= 4
