"""The router's in-flight ledger: committed work and KV per instance, in O(1) per event.

The live router and the simulator keep one each and call it at the same moments:
`admit` when a request is routed, `prefill_done` when its prefill (and KV hand-off) ends,
`finish` when its last token is out (or it failed). Between engine polls the ledger is the
router's freshest knowledge; `view` merges it with the latest polled engine state.

Backlog is the priced work (seconds) of requests admitted and not finished — the paper's
"seconds of work already committed". KV use comes from the engines' polls (every 50 ms by
default: stale, as in any real deployment); what the poll cannot see yet — the prompts admitted
to an instance since its last poll — the ledger adds on top, so a burst of decisions between two
polls does not all see the same empty instance.

Several router replicas: each keeps its own ledger of what it admitted; the engines keep a ledger
of the calls they received, per router, and report the other routers' totals in each poll
(`PolledState.others_backlog_s`), so no router is blind to the rest for longer than a poll.
"""

from __future__ import annotations

from dataclasses import dataclass

from disagg.core.cost_model import CostModel
from disagg.core.types import InstanceView, PrefixLookup, Role, quick_init


@dataclass(slots=True)
class _Entry:
    prefill_id: str
    decode_id: str
    prefill_work_s: float
    decode_work_s: float
    prefill_open: bool = True


@dataclass(slots=True)
class _Totals:
    backlog_s: float = 0.0
    queued: int = 0
    kv_since_poll: int = 0  # prompt tokens admitted after the last poll
    # requests served whole here (prefill and decode on one instance), and their decode work: on a
    # prefill instance that work runs beside the prefills rather than ahead of them
    hosted: int = 0
    hosted_decode_s: float = 0.0
    # the last view made of these totals and the poll it merged: every change of the totals drops it,
    # so while neither changes `view` hands out the same (frozen) view instead of building another
    view: InstanceView | None = None
    view_poll: PolledState | None = None


@quick_init
@dataclass(frozen=True, slots=True)
class PolledState:
    """What an engine last reported (see the engine's `state()` call).

    `others_backlog_s` / `others_queued` / `others_hosted`: the work *other* router replicas have
    admitted to this engine, its calls, and the requests of theirs it serves whole (a prefill
    engine's hosted decodes), from the engine's own ledger of the calls it has received (each
    router sees its own admissions at once in its `Ledger`, and everyone else's as of its latest
    poll). Zero with one router.
    """

    kv_used_tokens: int
    kv_capacity_tokens: int
    running: int = 0
    waiting: int = 0
    others_backlog_s: float = 0.0
    others_queued: int = 0
    others_hosted: int = 0


class Ledger:
    def __init__(self) -> None:
        self._entries: dict[str, _Entry] = {}
        self._totals: dict[str, _Totals] = {}

    def __len__(self) -> int:
        return len(self._entries)

    def _t(self, instance_id: str) -> _Totals:
        t = self._totals.get(instance_id)
        if t is None:
            t = self._totals[instance_id] = _Totals()
        return t

    def admit(
        self,
        request_id: str,
        prefill_id: str,
        decode_id: str,
        prefill_work_s: float,
        decode_work_s: float,
        prompt_tokens: int,
    ) -> None:
        if request_id in self._entries:
            raise KeyError(f"request {request_id!r} is already in the ledger")
        self._entries[request_id] = _Entry(prefill_id, decode_id, prefill_work_s, decode_work_s)
        p = self._t(prefill_id)
        p.backlog_s += prefill_work_s
        p.queued += 1
        p.kv_since_poll += prompt_tokens
        p.view = None
        d = self._t(decode_id)
        if d is not p:
            d.queued += 1
            d.kv_since_poll += prompt_tokens
            d.view = None
        else:
            d.hosted += 1
            d.hosted_decode_s += decode_work_s
        d.backlog_s += decode_work_s

    def prefill_done(self, request_id: str) -> None:
        """The prefill ended and its KV left the prefill instance (idempotent)."""
        e = self._entries.get(request_id)
        if e is None or not e.prefill_open:
            return
        e.prefill_open = False
        p = self._t(e.prefill_id)
        p.backlog_s = max(0.0, p.backlog_s - e.prefill_work_s)
        if e.prefill_id != e.decode_id:
            p.queued -= 1
            if not p.queued:
                p.backlog_s = 0.0  # idle: exactly, as in `finish`
        p.view = None

    def finish(self, request_id: str) -> None:
        """The request left the system, served or failed (idempotent)."""
        self.prefill_done(request_id)
        e = self._entries.pop(request_id, None)
        if e is None:
            return
        d = self._t(e.decode_id)
        d.backlog_s = max(0.0, d.backlog_s - e.decode_work_s)
        d.queued -= 1
        if e.prefill_id == e.decode_id:
            d.hosted -= 1
            d.hosted_decode_s = max(0.0, d.hosted_decode_s - e.decode_work_s) if d.hosted else 0.0
        if not d.queued:
            # nothing left here: exactly no backlog, not the rounding left of adding and subtracting the
            # works in another order (an idle instance must look idle: `slo_goodput` counts busy engines)
            d.backlog_s = 0.0
        d.view = None

    def forget_instance(self, instance_id: str) -> list[str]:
        """An instance went away: drop its totals and return the requests that depended on it
        (those decoding there, and those whose prefill there had not finished)."""
        lost = [r for r, e in self._entries.items()
                if e.decode_id == instance_id or (e.prefill_id == instance_id and e.prefill_open)]
        for r in lost:
            self.finish(r)
        self._totals.pop(instance_id, None)
        return lost

    def polled(self, instance_id: str) -> None:
        """A fresh poll of this instance arrived: it now sees everything admitted so far."""
        t = self._totals.get(instance_id)
        if t is not None and t.kv_since_poll:
            t.kv_since_poll = 0
            t.view = None

    def backlog_s(self, instance_id: str) -> float:
        t = self._totals.get(instance_id)
        return t.backlog_s if t else 0.0

    def queued(self, instance_id: str) -> int:
        t = self._totals.get(instance_id)
        return t.queued if t else 0

    def view(self, instance_id: str, role: Role, polled: PolledState,
             prefix_lookup: PrefixLookup | None = None) -> InstanceView:
        t = self._totals.get(instance_id) or self._t(instance_id)
        v = t.view
        if v is not None and t.view_poll is polled and v.role is role and v.prefix_lookup is prefix_lookup:
            return v
        backlog, hosted = t.backlog_s, 0
        if role is Role.PREFILL and (t.hosted or polled.others_hosted):
            # the queue a prefill waits behind: the decodes hosted here run beside it, not ahead of it
            # (the other routers' hosted calls hold no work past their first token: `AdmittedWork`)
            backlog, hosted = max(0.0, backlog - t.hosted_decode_s), t.hosted + polled.others_hosted
        t.view, t.view_poll = InstanceView(
            instance_id, role,
            backlog + polled.others_backlog_s,  # backlog_s
            t.queued + polled.others_queued,  # queued
            polled.kv_used_tokens + t.kv_since_poll,  # kv_used_tokens
            polled.kv_capacity_tokens,
            prefix_lookup,
            hosted,
        ), polled
        return t.view


def admission_work(cm: CostModel, prefill_id: str, decode_id: str, prompt_tokens: int,
                   predicted_output_tokens: int, decode_queued: int, cached_tokens: int = 0) -> tuple[float, float]:
    """The seconds of work a routed request commits to its prefill and decode instances:
    the calibrated prefill time of the prompt tokens the prefill instance does not hold cached
    (attending to the `cached_tokens` it does), and ô decode tokens at the decode instance's
    concurrency once it has joined. The live router and the simulator both price with this."""
    prefill_s = cm.for_instance(prefill_id).prefill_s(prompt_tokens - cached_tokens, cached_tokens)
    decode_s = predicted_output_tokens * cm.for_instance(decode_id).decode_token_s(decode_queued + 1)
    return prefill_s, decode_s


class AdmittedWork:
    """An engine's own ledger of the calls it is serving, per router replica that sent them.

    The engine adds a call's priced work when the call arrives and removes it when the call ends
    (a prefill when it returns, a decode at its last token); each router reads the *other*
    routers' totals from the engine's state (`others`) and adds its own, live, from its `Ledger`.
    What the engines report is what the routers' own ledgers count, so that a router sees the
    others' requests as it sees its own:
    - a call that prefills here before it decodes carries that prefill's work apart, which the
      engine `release`s at the call's first token (the router's `Ledger.prefill_done`);
    - a call a prefill engine serves whole (hosted) holds no work after its first token (its decode
      runs beside the prefills, not ahead of them) and is counted as hosted until its end: the
      decodes a prefill instance hosts are what its prefills stall.
    """

    def __init__(self) -> None:
        self._by_router: dict[str, list] = {}  # router id → [work seconds, calls, hosted calls]

    def add(self, router: str, work_s: float, hosted: bool = False) -> None:
        t = self._by_router.setdefault(router, [0.0, 0, 0])
        t[0] += work_s
        t[1] += 1
        t[2] += hosted

    def release(self, router: str, work_s: float) -> None:
        """Part of a call's work is done (its prefill, at its first token); the call goes on."""
        t = self._by_router.get(router)
        if t is not None:
            t[0] = max(0.0, t[0] - work_s)

    def remove(self, router: str, work_s: float, hosted: bool = False) -> None:
        t = self._by_router.get(router)
        if t is None:
            return
        t[0] = max(0.0, t[0] - work_s)
        t[1] -= 1
        t[2] = max(0, t[2] - hosted)
        if t[1] <= 0:
            del self._by_router[router]

    def totals(self) -> dict[str, tuple[float, int, int]]:
        return {r: (w, n, h) for r, (w, n, h) in self._by_router.items()}


def others(totals: dict[str, tuple[float, int, int]], router: str) -> tuple[float, int, int]:
    """(work seconds, calls, hosted calls) that routers other than `router` have on an engine, from its totals."""
    work, calls, hosted = 0.0, 0, 0
    for r, (w, n, h) in totals.items():
        if r != router:
            work += w
            calls += n
            hosted += h
    return work, calls, hosted
