"""Per-request records and the summary figures: goodput, TTFT/TPOT percentiles, load balance.

Goodput is the share of *all* requests (failed ones included) that met both their SLO class's
TTFT and TPOT targets. TPOT is (last token − first token) / (output tokens − 1); a one-token
answer has no TPOT and meets that half of the SLO by definition. The live harness and the
simulator write the same records, so their summaries are comparable line for line.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Iterable

from disagg.core.types import SloClass, quick_init
from disagg.stats import percentile


@quick_init
@dataclass(frozen=True, slots=True)
class RequestRecord:
    request_id: str
    arrival_s: float
    prompt_tokens: int
    output_tokens: int
    slo_class: str
    prefill_id: str | None
    decode_id: str | None
    predicted_output_tokens: int | None
    ttft_s: float | None
    tpot_s: float | None
    e2e_s: float | None
    slo_met: bool
    error: str | None = None
    preemptions: int = 0

    @classmethod
    def served(cls, rid, req, slo: SloClass, prefill_id, decode_id, predicted, *, t_first: float, t_last: float,
               ttft_target_s: float, tpot_target_s: float, preemptions: int = 0) -> "RequestRecord":
        ttft = t_first - req.arrival_s
        tpot = (t_last - t_first) / (req.output_tokens - 1) if req.output_tokens > 1 else None
        met = ttft <= ttft_target_s and (tpot is None or tpot <= tpot_target_s)
        return cls(rid, req.arrival_s, req.prompt_tokens, req.output_tokens, slo.value, prefill_id, decode_id,
                   predicted, ttft, tpot, t_last - req.arrival_s, met, None, preemptions)

    @classmethod
    def failure(cls, rid, req, slo: SloClass, now: float, error: str) -> "RequestRecord":
        return cls(rid, req.arrival_s, req.prompt_tokens, req.output_tokens, slo.value, None, None, None,
                   None, None, None, False, error)

    def as_dict(self) -> dict:
        return asdict(self)


def summarize(records: Iterable[RequestRecord], instance_tokens: dict[str, int] | None = None) -> dict:
    recs = list(records)
    n = len(recs)
    ttft = [r.ttft_s for r in recs if r.ttft_s is not None]
    tpot = [r.tpot_s for r in recs if r.tpot_s is not None]
    out = {
        "requests": n,
        "failed": sum(1 for r in recs if r.error is not None),
        "goodput": (sum(1 for r in recs if r.slo_met) / n) if n else math.nan,
        "ttft_p50_s": percentile(ttft, 50),
        "ttft_p99_s": percentile(ttft, 99),
        "tpot_p50_s": percentile(tpot, 50),
        "tpot_p99_s": percentile(tpot, 99),
        "e2e_p50_s": percentile([r.e2e_s for r in recs if r.e2e_s is not None], 50),
    }
    for cls in SloClass:
        sub = [r for r in recs if r.slo_class == cls.value]
        out[f"goodput_{cls.value}"] = (sum(1 for r in sub if r.slo_met) / len(sub)) if sub else math.nan
    if instance_tokens:
        out["load_balance"] = load_balance(instance_tokens)
    return out


def load_balance(instance_tokens: dict[str, int]) -> dict[str, float]:
    """Token load per pool: max/mean ratio (1.0 = perfectly even) and coefficient of variation."""
    out: dict[str, float] = {}
    for pool in ("prefill", "decode"):
        xs = [v for k, v in instance_tokens.items() if k.startswith(pool)]
        if not xs or sum(xs) == 0:
            continue
        mean = sum(xs) / len(xs)
        var = sum((x - mean) ** 2 for x in xs) / len(xs)
        out[f"{pool}_max_over_mean"] = max(xs) / mean
        out[f"{pool}_cv"] = math.sqrt(var) / mean
    return out
