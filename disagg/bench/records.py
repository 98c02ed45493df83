"""The bench's request records: one JSON line per request (`requests.jsonl`), live or simulated.

Shared by the harness, which writes them, and the reports, which read them back.
"""

from __future__ import annotations

import dataclasses

from disagg.sim.metrics import RequestRecord

LIVE, SIM = "live", "sim"  # the `system` of a record from our app and from the simulator
RECORD_FIELDS = tuple(f.name for f in dataclasses.fields(RequestRecord))


def to_request_record(rec: dict) -> RequestRecord:
    """A JSON line back to the simulator's record type, for `disagg.sim.metrics.summarize`."""
    return RequestRecord(**{k: rec.get(k) for k in RECORD_FIELDS if k in rec})
