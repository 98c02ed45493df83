"""An engine's ledger of the calls it serves holds, for each, what the sending router's own ledger
holds for that request at the same moment: the other routers read it as theirs."""

import pytest

from disagg.core.ledger import Ledger, PolledState, others
from disagg.core.types import Role
from serve_app.call_ledger import CallLedger
from serve_app.messages import GenerateCall, PrefillCall


def _view(router: Ledger, engine: CallLedger, iid: str, role: Role, me: str = "r2"):
    """Router `me`'s view of the instance, its own ledger empty: only what the engine holds of r1's calls."""
    work, calls, hosted = others(engine.totals(), me)
    return router.view(iid, role, PolledState(0, 10_000, others_backlog_s=work, others_queued=calls,
                                              others_hosted=hosted))


def test_a_hosted_call_holds_its_prefill_until_the_first_token_and_counts_as_hosted_to_its_end():
    own, engine, other = Ledger(), CallLedger(Role.PREFILL), Ledger()
    own.admit("a", "p0", "p0", 0.3, 2.0, 100)  # r1 hosts the request on p0
    call = GenerateCall("a-d0", [1] * 100, None, None, "r1", 0.0, prefill_work_s=0.3)
    engine.arrived(call)
    mine, theirs = own.view("p0", Role.PREFILL, PolledState(0, 10_000)), _view(other, engine, "p0", Role.PREFILL)
    assert (theirs.backlog_s, theirs.queued, theirs.hosted) == (pytest.approx(mine.backlog_s), 1, 1) == (0.3, 1, 1)
    own.prefill_done("a")
    engine.first_token(call)
    mine, theirs = own.view("p0", Role.PREFILL, PolledState(0, 10_000)), _view(other, engine, "p0", Role.PREFILL)
    assert (theirs.backlog_s, theirs.queued, theirs.hosted) == (mine.backlog_s, mine.queued, mine.hosted) == (0, 1, 1)
    engine.ended(call, after_first_token=True)
    assert engine.totals() == {}


def test_a_colocated_call_holds_its_prefill_then_its_decode():
    engine = CallLedger(Role.DECODE)
    call = GenerateCall("a-d0", [1] * 100, None, None, "r1", 2.0, prefill_work_s=0.3)
    engine.arrived(call)
    assert engine.totals() == {"r1": (pytest.approx(2.3), 1, 0)}
    engine.first_token(call)
    assert engine.totals() == {"r1": (pytest.approx(2.0), 1, 0)}
    engine.ended(call, after_first_token=True)
    assert engine.totals() == {}


def test_a_call_that_ends_before_its_first_token_takes_all_it_held():
    engine = CallLedger(Role.DECODE)
    kept = GenerateCall("b-d0", [1] * 10, None, {"kv": 1}, "r1", 1.0)  # the KV given: no prefill here
    engine.arrived(kept)
    failed = GenerateCall("a-d0", [1] * 100, None, None, "r1", 2.0, prefill_work_s=0.3)
    engine.arrived(failed)
    engine.first_token(kept)  # nothing of it was a prefill here
    assert engine.totals() == {"r1": (pytest.approx(3.3), 2, 0)}
    engine.ended(failed)
    assert engine.totals() == {"r1": (pytest.approx(1.0), 1, 0)}


def test_a_prefill_call_holds_its_work_until_it_returns_and_is_never_hosted():
    engine = CallLedger(Role.PREFILL)
    call = PrefillCall("a-p0", [1] * 100, {}, "r1", 0.3)
    engine.arrived(call)
    assert engine.totals() == {"r1": (0.3, 1, 0)}
    engine.ended(call)
    assert engine.totals() == {}
