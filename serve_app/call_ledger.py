"""An engine replica's ledger of the calls it serves, per router replica (`AdmittedWork`).

Each router reads the other routers' totals from the engine's state and adds them to its own
ledger's (`disagg.core.ledger.Ledger.view`), so the engine must hold for a call what a router holds
for its own request at the same moment:
- a prefill call: its prefill's work, until it returns;
- a call that generates: the work of a prefill it makes here (no KV given: colocated, hosted, a
  fallback) until its first token, as the router marks its own `prefill_done` then; and its
  decode's work to its end, but none on a prefill engine serving the request whole (hosted), whose
  decode runs beside the prefills there, not ahead of them;
- a hosted call is counted as such until its end: the decodes a prefill instance hosts are what
  its prefills stall, whichever router sent them.
The simulator's engines keep the same books (`disagg.sim.simulator`).
"""

from __future__ import annotations

from disagg.core.ledger import AdmittedWork
from disagg.core.types import Role
from serve_app.messages import DecodeCall, GenerateCall, PrefillCall

Call = PrefillCall | GenerateCall | DecodeCall


def prefill_held_s(call: Call) -> float:
    """The work of the prefill a generating call makes on its engine, held until its first token
    (a `PrefillCall`'s whole work is its prefill: none of it is held apart)."""
    return 0.0 if isinstance(call, PrefillCall) else call.prefill_work_s


class CallLedger:
    def __init__(self, role: Role) -> None:
        self.role = role
        self._work = AdmittedWork()

    def arrived(self, call: Call) -> None:
        self._work.add(call.router, call.work_s + prefill_held_s(call), hosted=self._hosted(call))

    def first_token(self, call: GenerateCall | DecodeCall) -> None:
        """The call's prefill here is done: its work leaves, the call stays (no version of the state
        of its own: `serve_app.state_push.moved`)."""
        if held := prefill_held_s(call):
            self._work.release(call.router, held)

    def ended(self, call: Call, after_first_token: bool = False) -> None:
        held = call.work_s + (0.0 if after_first_token else prefill_held_s(call))
        self._work.remove(call.router, held, hosted=self._hosted(call))

    def totals(self) -> dict[str, tuple[float, int, int]]:
        return self._work.totals()

    def _hosted(self, call: Call) -> bool:
        return self.role is Role.PREFILL and not isinstance(call, PrefillCall)
