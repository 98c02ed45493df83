"""`Ledger.view` hands out the same view while neither the instance's totals nor its poll change, and
a fresh one — equal to a view built from scratch — after any change."""

from __future__ import annotations

import random

from disagg.core.ledger import Ledger, PolledState
from disagg.core.types import InstanceView, Role

IDS = ["p0", "p1", "d0", "d1"]


def _expected(led: Ledger, iid: str, role: Role, polled: PolledState, lookup) -> InstanceView:
    t = led._totals.get(iid)
    backlog, queued, since = (t.backlog_s, t.queued, t.kv_since_poll) if t else (0.0, 0, 0)
    return InstanceView(iid, role, backlog + polled.others_backlog_s, queued + polled.others_queued,
                        polled.kv_used_tokens + since, polled.kv_capacity_tokens, lookup)


def test_views_are_reused_only_while_nothing_they_show_changed():
    rng = random.Random(0)
    led = Ledger()
    polls = {i: PolledState(0, 10_000) for i in IDS}
    lookups = [None, lambda hashes: 0]
    open_requests: list[str] = []
    last: dict[str, InstanceView] = {}
    reused = 0
    for step in range(3000):
        op = rng.random()
        if op < 0.25:
            rid = f"r{step}"
            p, d = rng.choice(IDS), rng.choice(IDS[2:])
            led.admit(rid, p, d, rng.uniform(0, 1), rng.uniform(0, 2), rng.randint(1, 500))
            open_requests.append(rid)
        elif op < 0.4 and open_requests:
            led.prefill_done(rng.choice(open_requests))
        elif op < 0.55 and open_requests:
            led.finish(open_requests.pop(rng.randrange(len(open_requests))))
        elif op < 0.7:
            iid = rng.choice(IDS)
            if rng.random() < 0.5:  # a poll that reads something new
                polls[iid] = PolledState(rng.randint(0, 9000), 10_000, others_backlog_s=rng.choice([0.0, 0.5]),
                                         others_queued=rng.choice([0, 2]))
            led.polled(iid)
        elif op < 0.75 and rng.random() < 0.1:
            led.forget_instance(rng.choice(IDS))
        iid = rng.choice(IDS)
        role, lookup = (Role.PREFILL if iid.startswith("p") else Role.DECODE), rng.choice(lookups)
        got = led.view(iid, role, polls[iid], lookup)
        assert got == _expected(led, iid, role, polls[iid], lookup)
        reused += got is last.get(iid)
        last[iid] = got
    assert reused > 100  # the cache does serve
