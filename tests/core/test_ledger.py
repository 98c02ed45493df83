"""The router's in-flight ledger: O(1) bookkeeping of committed work per instance, plus the KV
admitted since each instance's last poll (added on top of the stale polled KV use)."""

from __future__ import annotations

import pytest

from disagg.core.ledger import Ledger, PolledState
from disagg.core.types import InstanceView, Role

approx = pytest.approx
ZERO_POLL = PolledState(kv_used_tokens=0, kv_capacity_tokens=10_000)


def _totals(led: Ledger, iid: str) -> tuple[float, int, int]:
    """(backlog_s, queued, KV the ledger adds on top of a zero poll)."""
    v = led.view(iid, Role.DECODE, ZERO_POLL)
    assert v.backlog_s == led.backlog_s(iid) and v.queued == led.queued(iid)
    return v.backlog_s, v.queued, v.kv_used_tokens


def _admit(led, rid, p="p0", d="d0", pw=0.2, dw=1.5, prompt=100):
    led.admit(rid, p, d, prefill_work_s=pw, decode_work_s=dw, prompt_tokens=prompt)


def test_unknown_instance_is_empty():
    led = Ledger()
    assert led.backlog_s("x") == 0.0 and led.queued("x") == 0
    assert _totals(led, "x") == (0.0, 0, 0)
    assert len(led) == 0
    led.polled("x")  # a poll of an instance the ledger never saw is harmless
    assert _totals(led, "x") == (0.0, 0, 0)


def test_admit_prefill_done_finish_arithmetic():
    led = Ledger()
    _admit(led, "r1", pw=0.2, dw=1.5, prompt=100)
    _admit(led, "r2", pw=0.3, dw=0.5, prompt=40)
    assert len(led) == 2
    # both instances will hold the prompts (prefill computes them, decode receives them)
    assert _totals(led, "p0") == (approx(0.5), 2, 140)
    assert _totals(led, "d0") == (approx(2.0), 2, 140)

    led.prefill_done("r1")
    assert _totals(led, "p0")[:2] == (approx(0.3), 1)
    assert _totals(led, "d0")[:2] == (approx(2.0), 2)  # decode side unchanged

    led.finish("r1")
    assert _totals(led, "p0")[:2] == (approx(0.3), 1)
    assert _totals(led, "d0")[:2] == (approx(0.5), 1)
    assert len(led) == 1

    led.finish("r2")  # finish without prefill_done closes the prefill too
    assert _totals(led, "p0")[:2] == (approx(0.0), 0)
    assert _totals(led, "d0")[:2] == (approx(0.0), 0)
    assert len(led) == 0


def test_requests_on_different_instances_do_not_mix():
    led = Ledger()
    _admit(led, "r1", p="p0", d="d0", pw=0.1, dw=1.0, prompt=10)
    _admit(led, "r2", p="p1", d="d1", pw=0.2, dw=2.0, prompt=20)
    assert _totals(led, "p0") == (approx(0.1), 1, 10)
    assert _totals(led, "p1") == (approx(0.2), 1, 20)
    assert _totals(led, "d0") == (approx(1.0), 1, 10)
    assert _totals(led, "d1") == (approx(2.0), 1, 20)


def test_colocated_counts_queued_and_prompt_once():
    led = Ledger()
    _admit(led, "r1", p="d0", d="d0", pw=0.2, dw=1.5, prompt=100)
    assert _totals(led, "d0") == (approx(1.7), 1, 100)
    led.prefill_done("r1")
    assert _totals(led, "d0")[:2] == (approx(1.5), 1)
    led.finish("r1")
    assert _totals(led, "d0")[:2] == (approx(0.0), 0)


def test_a_prefill_instance_hosting_a_request_shows_only_prefill_work_as_its_queue():
    """Served whole on a prefill instance, a request's decode runs beside that instance's prefills:
    the prefill view's backlog leaves it out (and counts the hosted request); a decode view of the
    same totals, and `backlog_s`, keep everything."""
    led = Ledger()
    _admit(led, "plain", p="p0", d="d0", pw=0.3, dw=1.0, prompt=50)
    _admit(led, "hosted", p="p0", d="p0", pw=0.2, dw=1.5, prompt=100)
    v = led.view("p0", Role.PREFILL, ZERO_POLL)
    assert (v.backlog_s, v.queued, v.hosted, v.kv_used_tokens) == (approx(0.5), 2, 1, 150)
    assert led.backlog_s("p0") == approx(2.0)
    assert led.view("p0", Role.DECODE, ZERO_POLL).hosted == 0
    led.prefill_done("hosted")  # its first token: nothing of it is left in the prefill queue
    v = led.view("p0", Role.PREFILL, ZERO_POLL)
    assert (v.backlog_s, v.queued, v.hosted) == (approx(0.3), 2, 1)
    led.finish("hosted")
    v = led.view("p0", Role.PREFILL, ZERO_POLL)
    assert (v.backlog_s, v.queued, v.hosted) == (approx(0.3), 1, 0)
    assert led.backlog_s("p0") == approx(0.3)


def test_prefill_done_is_idempotent():
    led = Ledger()
    _admit(led, "r1", pw=0.2)
    _admit(led, "r2", pw=0.3)
    for _ in range(3):
        led.prefill_done("r1")
    assert _totals(led, "p0")[:2] == (approx(0.3), 1)
    led.prefill_done("never-admitted")  # unknown ids are ignored
    assert _totals(led, "p0")[:2] == (approx(0.3), 1)


def test_finish_is_idempotent():
    led = Ledger()
    _admit(led, "r1", pw=0.2, dw=1.5)
    _admit(led, "r2", pw=0.3, dw=0.5)
    for _ in range(3):
        led.finish("r1")
        led.prefill_done("r1")  # a late prefill_done after finish is a no-op too
    assert _totals(led, "d0")[:2] == (approx(0.5), 1)
    assert _totals(led, "p0")[:2] == (approx(0.3), 1)
    led.finish("never-admitted")
    assert len(led) == 1


def test_duplicate_admit_raises_and_changes_nothing():
    led = Ledger()
    _admit(led, "r1", pw=0.2, dw=1.5, prompt=100)
    with pytest.raises(KeyError, match="r1"):
        _admit(led, "r1", p="p1", d="d1", pw=9.0, dw=9.0, prompt=999)
    assert len(led) == 1
    assert _totals(led, "p0") == (approx(0.2), 1, 100)
    assert _totals(led, "p1") == (0.0, 0, 0) and _totals(led, "d1") == (0.0, 0, 0)


@pytest.mark.parametrize("polled_kv", [0, 100, 5_000])
def test_view_adds_kv_admitted_since_the_last_poll(polled_kv):
    led = Ledger()
    _admit(led, "r1", p="p0", d="d0", pw=0.2, dw=1.5, prompt=100)
    _admit(led, "r2", p="p1", d="d0", pw=0.2, dw=0.5, prompt=30)
    poll = PolledState(kv_used_tokens=polled_kv, kv_capacity_tokens=8_000, running=7, waiting=3)
    v = led.view("d0", Role.DECODE, poll)
    assert v == InstanceView(instance_id="d0", role=Role.DECODE, backlog_s=2.0, queued=2,
                             kv_used_tokens=polled_kv + 130, kv_capacity_tokens=8_000)


def test_a_poll_resets_only_that_instance_and_only_what_came_before():
    led = Ledger()
    _admit(led, "r1", p="p0", d="d0", prompt=100)
    led.polled("d0")  # the engine now reports r1's KV itself
    assert _totals(led, "d0")[2] == 0
    assert _totals(led, "p0")[2] == 100  # p0 has not been polled
    _admit(led, "r2", p="p0", d="d0", prompt=40)
    assert _totals(led, "d0")[2] == 40
    assert _totals(led, "p0")[2] == 140
    # work and queue are the ledger's own: a poll does not touch them
    assert _totals(led, "d0")[:2] == (approx(3.0), 2)


def test_view_of_instance_without_ledger_entries_uses_the_poll():
    led = Ledger()
    v = led.view("p7", Role.PREFILL, PolledState(kv_used_tokens=321, kv_capacity_tokens=4_000))
    assert v == InstanceView("p7", Role.PREFILL, 0.0, 0, 321, 4_000)


def test_forget_decode_instance_returns_its_requests_and_clears_totals():
    led = Ledger()
    _admit(led, "r1", p="p0", d="d0", pw=0.2, dw=1.0)
    _admit(led, "r2", p="p1", d="d0", pw=0.3, dw=2.0)
    _admit(led, "r3", p="p0", d="d1", pw=0.4, dw=3.0)
    led.prefill_done("r1")
    lost = led.forget_instance("d0")
    assert sorted(lost) == ["r1", "r2"]
    assert len(led) == 1
    assert _totals(led, "d0") == (0.0, 0, 0)
    # the lost requests' work is gone from their prefill instances too; r3 stays
    assert _totals(led, "p1")[:2] == (approx(0.0), 0)
    assert _totals(led, "p0")[:2] == (approx(0.4), 1)
    assert _totals(led, "d1")[:2] == (approx(3.0), 1)
    assert led.forget_instance("d0") == []


def test_forget_prefill_instance_returns_only_requests_still_prefilling_there():
    """After prefill_done the KV has left the prefill instance: losing it loses nothing of r1,
    which is still decoding on d0 (returning it would make the router retry a healthy request)."""
    led = Ledger()
    _admit(led, "r1", p="p0", d="d0", pw=0.2, dw=1.0)
    _admit(led, "r2", p="p0", d="d1", pw=0.3, dw=2.0)
    led.prefill_done("r1")
    lost = led.forget_instance("p0")
    assert lost == ["r2"]
    assert len(led) == 1
    assert _totals(led, "p0") == (0.0, 0, 0)
    assert _totals(led, "d0")[:2] == (approx(1.0), 1)  # r1 still decoding on d0
    assert _totals(led, "d1")[:2] == (approx(0.0), 0)


def test_an_instance_with_nothing_left_has_exactly_no_backlog():
    """Works added and removed in another order leave float rounding (0.1 + 0.2 − 0.1 − 0.2 ≠ 0);
    an idle instance must show exactly 0, or a policy counting busy engines sees it busy."""
    led = Ledger()
    _admit(led, "a", pw=0.1, dw=0.7)
    _admit(led, "b", pw=0.2, dw=0.3)
    _admit(led, "h", p="p0", d="p0", pw=0.3, dw=0.6)  # hosted on the prefill instance
    assert led.backlog_s("p0") > 0 and led.backlog_s("d0") > 0
    for rid in ("a", "b"):
        led.prefill_done(rid)
    assert led.backlog_s("p0") > 0  # the hosted request is still there
    for rid in ("a", "h", "b"):
        led.finish(rid)
    assert led.backlog_s("p0") == 0.0 and led.backlog_s("d0") == 0.0
    assert led.view("p0", Role.PREFILL, ZERO_POLL).backlog_s == 0.0
    assert led.view("d0", Role.DECODE, ZERO_POLL).backlog_s == 0.0


def test_memory_is_bounded_after_many_cycles():
    led = Ledger()
    instances = [("p0", "d0"), ("p1", "d1"), ("d2", "d2")]
    for i in range(10_000):
        p, d = instances[i % 3]
        led.admit(f"r{i}", p, d, prefill_work_s=0.1 + (i % 7) * 0.013, decode_work_s=0.3 + (i % 11) * 0.071,
                  prompt_tokens=1 + i % 500)
        if i >= 5:  # keep a few in flight so the sums really go up and down
            led.prefill_done(f"r{i - 5}")
            led.finish(f"r{i - 5}")
        if i % 100 == 0:
            for iid in ("p0", "p1", "d0", "d1", "d2"):
                led.polled(iid)
    for i in range(9_995, 10_000):
        led.finish(f"r{i}")
    for iid in ("p0", "p1", "d0", "d1", "d2"):
        led.polled(iid)
    assert len(led) == 0
    for iid in ("p0", "p1", "d0", "d1", "d2"):
        b, q, kv = _totals(led, iid)
        assert b == 0.0 and q == 0 and kv == 0  # exactly: no rounding left of ten thousand sums
    assert len(led._totals) == 5  # one small record per instance, none per request
    assert len(led._entries) == 0


# --- several router replicas: the engine's ledger of calls, per router ----------------------------

def test_engine_ledger_totals_per_router_and_releases_what_it_added():
    from disagg.core.ledger import AdmittedWork

    w = AdmittedWork()
    w.add("r1", 0.5)
    w.add("r1", 0.25)
    w.add("r2", 2.0)
    assert w.totals() == {"r1": (0.75, 2, 0), "r2": (2.0, 1, 0)}
    w.remove("r1", 0.5)
    w.remove("r2", 2.0)
    w.remove("r3", 1.0)  # a call this engine never counted: ignored
    assert w.totals() == {"r1": (0.25, 1, 0)}


def test_engine_ledger_releases_a_calls_prefill_at_its_first_token_and_counts_hosted_calls_to_their_end():
    """What the routers' own ledgers count: a call's prefill made on the engine leaves at the first token
    (`Ledger.prefill_done`), the call stays; a prefill engine's hosted call holds no work after it."""
    from disagg.core.ledger import AdmittedWork

    w = AdmittedWork()
    w.add("r1", 0.2 + 1.5)  # colocated on a decode engine: its prefill, then its decode
    w.add("r1", 0.3, hosted=True)  # served whole by a prefill engine: its prefill only
    w.release("r1", 0.2)
    w.release("r1", 0.3)
    assert w.totals() == {"r1": (approx(1.5), 2, 1)}
    w.remove("r1", 0.0, hosted=True)
    assert w.totals() == {"r1": (approx(1.5), 1, 0)}
    w.remove("r1", 1.5)
    w.release("r1", 0.1)  # a call this engine no longer counts: ignored
    assert w.totals() == {}


@pytest.mark.parametrize("me, expect", [("r1", (2.5, 3, 1)), ("r2", (1.25, 4, 2)), ("r9", (3.25, 5, 2))])
def test_others_sums_every_router_but_the_asking_one(me, expect):
    from disagg.core.ledger import others

    totals = {"r1": (0.75, 2, 1), "r2": (2.0, 1, 0), "r3": (0.5, 2, 1)}
    assert others(totals, me) == (approx(expect[0]), expect[1], expect[2])


def test_view_adds_other_routers_work_to_this_routers_ledger():
    led = Ledger()
    _admit(led, "a", d="d0", dw=1.0)
    polled = PolledState(kv_used_tokens=0, kv_capacity_tokens=10_000, others_backlog_s=2.0, others_queued=3)
    v = led.view("d0", Role.DECODE, polled)
    assert (v.backlog_s, v.queued) == (approx(3.0), 4)


def test_a_prefill_views_hosted_decodes_are_every_routers():
    """The decodes other routers host on a prefill instance are the ones its prefills stall as much as
    this router's: a router blind to them hosts beside them and sends prefills over them."""
    led = Ledger()
    led.admit("h", "p0", "p0", 0.2, 1.0, 100)  # this router hosts one there: its decode runs beside the queue
    polled = PolledState(kv_used_tokens=0, kv_capacity_tokens=10_000, others_backlog_s=0.5, others_queued=3,
                         others_hosted=2)
    v = led.view("p0", Role.PREFILL, polled)
    assert (v.hosted, v.queued) == (3, 4) and v.backlog_s == approx(0.2 + 0.5)
    alone = led.view("p1", Role.PREFILL, polled)  # only the others host there
    assert (alone.hosted, alone.backlog_s) == (2, approx(0.5))
