"""What the router records: one JSON line per finished request, and running counters.

Each line carries the request's decision with its per-term costs, where it was actually served
(and any fallback), the predicted and actual output lengths, and the measured times beside the
engines' own; with several models, also the alias route's whole choice (every candidate's
estimated TTFT, accuracy, cost, utility). The counters (`/admin/state`) count every fallback,
retry and failure, so none is silent.
"""

from __future__ import annotations

import json
import math
import os
import time
from dataclasses import dataclass
from pathlib import Path

from disagg.core.cost_model import SloTarget
from serve_app.flight import Flight


@dataclass(slots=True)
class Counters:
    requests: int = 0  # requests received
    served: int = 0  # completions streamed or returned whole
    failed: int = 0  # valid requests that ended in an error (no capacity, engine failures)
    rejected_400: int = 0  # invalid requests, refused before routing
    prefill_retries: int = 0  # prefill calls that failed (each retried elsewhere or locally)
    local_prefill_fallbacks: int = 0  # requests prefilled on their decode instance: no prefill instance could
    decode_retries: int = 0  # decode calls that failed before their first token
    migrations: int = 0  # decodes continued on another instance after theirs failed mid-stream
    misrouted: int = 0  # calls answered by another replica than the one they were pinned to
    cancelled: int = 0  # requests the client went away from
    instances_lost: int = 0  # engine instances that stopped answering polls (died, or scaled down)
    shed_429: int = 0  # requests refused with 429 because every candidate was too far behind (overload)
    shed_router_busy: int = 0  # ... of which because this router's own event loop was too far behind


class RequestLog:
    """Append-only JSON lines, one per finished request; each line written whole."""

    def __init__(self, path: str | None) -> None:
        # a relative path is relative to the folder the stack was launched from (DISAGG_RUN_DIR)
        self.path = Path(os.environ.get("DISAGG_RUN_DIR", ".")) / path if path else None
        if self.path:
            self.path.parent.mkdir(parents=True, exist_ok=True)

    def write(self, record: dict) -> None:
        if self.path is None:
            return
        line = json.dumps(record, separators=(",", ":")) + "\n"
        with open(self.path, "a") as f:  # one write() per line: lines never interleave
            f.write(line)


def request_record(f: Flight, error: str | None, now: float, multi_model: bool, router: str = "",
                   target: SloTarget | None = None) -> dict:
    """The log line of a finished request: `error` None when served, `now` the monotonic time it
    finished; `multi_model`: also name the requested and the serving model; `router`: the router
    replica that routed it; `target`: its latency targets (`Flight.target`), None before it had a model."""
    record = {
        "id": f.response_id or f.rid, "prompt_index": f.prompt_index, "time": time.time(), "router": router,
        "slo_class": f.slo.value, "slo_scale": f.slo_scale,
        "ttft_target_s": target.ttft_s if target else None, "tpot_target_s": target.tpot_s if target else None,
        "prompt_tokens": len(f.prompt_ids),
        "max_tokens": f.params.max_tokens, "n": f.n, "predicted_output_tokens": f.predicted,
        "output_tokens": f.generated_total, "finish_reason": f.finish_reason, "error": error,
        "prefill": f.actual_prefill, "decode": f.actual_decode, "fallback": f.fallback,
        "migrated_from": f.migrated_from or None, "migrated_after_tokens": f.migrated_after or None,
        "decision": f.decision.as_dict() if f.decision else None, "decision_us": f.decision_us,
        "decision_cpu_us": f.decision_cpu_us,
        "intake_s": f.intake_s, "ttft_s": f.router_first_s,
        "e2e_s": (now - f.t_arrival) if f.t_arrival else None,
        "prefill_engine_s": f.prefill_engine_s, "decode_engine_first_s": f.decode_engine_first_s,
        "decode_engine_timeline": f.decode_engine_timeline.as_dict() if f.decode_engine_timeline else None,
        "cached_tokens_predicted": f.cached_predicted, "prefill_cached_tokens": f.prefill_cached_tokens,
        "decode_held_tokens": f.decode_held_tokens,
    }
    if multi_model:
        record.update({"requested_model": f.requested_model, "model": f.model.name if f.model else None})
    if f.choice is not None:
        c = f.choice.chosen
        choice = f.choice.as_dict()
        for cand in choice["candidates"]:  # beyond the limit: not estimated further (JSON has no inf)
            if math.isinf(cand["ttft_s"]):
                cand["ttft_s"] = None
        record.update({"choice": choice, "estimated_ttft_s": c.ttft_s,
                       "ttft_limit_s": f.ttft_limit_s, "lambda": f.lam, "feasible": f.choice.feasible,
                       "accuracy": c.accuracy, "cost": c.cost, "utility": c.utility,
                       "alias_decision_us": f.alias_us})
    return record
