"""What the router exports to Prometheus: Ray's metrics endpoint, and so the dashboard's Grafana.

Every router replica exports its own series through `ray.serve.metrics` (Serve adds the
application, deployment and replica tags); Prometheus sums them. Names start with `disagg_`
(Ray prefixes `ray_`). Per finished request (`request_finished`, fed the request log's record):
- `disagg_requests_total{model, slo_class, outcome}`: served, failed, cancelled;
- `disagg_ttft_seconds`, `disagg_tpot_seconds`, `disagg_e2e_seconds{model, slo_class}`;
- `disagg_slo_requests_total{model, slo_class, met}`: met = both the TTFT and the TPOT target of
  the request (its class's, or with X-SLO-Scale its own); attainment = met / all;
- `disagg_decisions_total{model, policy, prefill, decode}`, and each priced cost term of the
  chosen candidates, `disagg_decision_cost_seconds{model, policy, side, term}`;
- the TTFT the decision predicted next to the one measured: `disagg_ttft_predicted_seconds` and
  `disagg_ttft_relative_error{model, policy}` (|predicted − measured| / measured).
Every `refresh` (once a second): the router's counters as `disagg_router_events_total{event}`
(fallbacks, retries, migrations, 429s, ...), each instance's `disagg_instance_backlog_seconds`,
`disagg_instance_queued_requests` and `disagg_instance_kv_pressure{model, role, instance}`, and
`disagg_router_loop_lag_seconds`. With the planner: `disagg_planned_width{model, pool}`.
"""

from __future__ import annotations

from dataclasses import asdict
from typing import Iterable

from ray.serve.metrics import Counter, Gauge, Histogram

from disagg.core.types import InstanceView

LATENCY_BUCKETS_S = [0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0]
TPOT_BUCKETS_S = [0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64]
RELATIVE_ERROR_BUCKETS = [0.05, 0.1, 0.2, 0.3, 0.5, 1.0, 2.0, 4.0]
COST_TERMS = ("backlog_s", "own_work_s", "queue_s", "transfer_s")


def predicted_ttft_s(decision: dict | None) -> float | None:
    """The TTFT a pricing decision implies: the chosen prefill candidate's backlog, its own work and
    the transfer. None for policies that do not price (their terms are all zero)."""
    if not decision:
        return None
    p = decision["prefill_cost"]
    t = p["backlog_s"] + p["own_work_s"] + p["transfer_s"]
    return t if t > 0 else None


class RouterMetrics:
    def __init__(self) -> None:
        model_class = ("model", "slo_class")
        self.requests = Counter("disagg_requests_total", "requests finished, by outcome",
                                tag_keys=(*model_class, "outcome"))
        self.ttft = Histogram("disagg_ttft_seconds", "time to first token at the router",
                              boundaries=LATENCY_BUCKETS_S, tag_keys=model_class)
        self.tpot = Histogram("disagg_tpot_seconds", "time per output token after the first",
                              boundaries=TPOT_BUCKETS_S, tag_keys=model_class)
        self.e2e = Histogram("disagg_e2e_seconds", "arrival to last token", boundaries=LATENCY_BUCKETS_S,
                             tag_keys=model_class)
        self.slo = Counter("disagg_slo_requests_total", "served requests, by whether both SLO targets were met",
                           tag_keys=(*model_class, "met"))
        self.decisions = Counter("disagg_decisions_total", "routing decisions",
                                 tag_keys=("model", "policy", "prefill", "decode"))
        self.cost = Histogram("disagg_decision_cost_seconds", "the chosen candidates' priced cost terms",
                              boundaries=LATENCY_BUCKETS_S, tag_keys=("model", "policy", "side", "term"))
        self.ttft_predicted = Histogram("disagg_ttft_predicted_seconds", "the TTFT the decision priced",
                                        boundaries=LATENCY_BUCKETS_S, tag_keys=("model", "policy"))
        self.ttft_error = Histogram("disagg_ttft_relative_error", "|predicted - measured| / measured TTFT",
                                    boundaries=RELATIVE_ERROR_BUCKETS, tag_keys=("model", "policy"))
        self.events = Counter("disagg_router_events_total", "the router's counters: fallbacks, retries, "
                              "migrations, 429s, ...", tag_keys=("event",))
        self.backlog = Gauge("disagg_instance_backlog_seconds", "committed work on an instance",
                             tag_keys=("model", "role", "instance"))
        self.queued = Gauge("disagg_instance_queued_requests", "requests admitted to an instance and not finished",
                            tag_keys=("model", "role", "instance"))
        self.kv_pressure = Gauge("disagg_instance_kv_pressure", "KV cache in use / capacity",
                                 tag_keys=("model", "role", "instance"))
        self.loop_lag = Gauge("disagg_router_loop_lag_seconds", "how far the router's event loop runs behind")
        self.planned_width = Gauge("disagg_planned_width", "each pool's width as the SLO-driven planner last set it",
                                   tag_keys=("model", "pool"))
        self._counted: dict[str, int] = {}
        self._load: dict[tuple[str, str], tuple] = {}  # (model, instance) → the load last exported
        self._lag: float | None = None

    def request_finished(self, record: dict, model: str, ttft_target_s: float, tpot_target_s: float) -> None:
        """One request log record (`request_log.request_record`) into the series."""
        tags = {"model": model, "slo_class": record["slo_class"]}
        error = record["error"]
        outcome = "served" if error is None else "cancelled" if error == "cancelled by client" else "failed"
        self.requests.inc(1, tags={**tags, "outcome": outcome})
        decision = record["decision"]
        if decision:
            policy = {"model": model, "policy": decision["policy"]}
            self.decisions.inc(1, tags={**policy, "prefill": decision["prefill"], "decode": decision["decode"]})
            for side in ("prefill", "decode"):
                for term in COST_TERMS:
                    if value := decision[f"{side}_cost"][term]:
                        self.cost.observe(value, tags={**policy, "side": side, "term": term})
        ttft, e2e, n = record["ttft_s"], record["e2e_s"], record["output_tokens"]
        if ttft is None or outcome != "served":
            return
        self.ttft.observe(ttft, tags=tags)
        self.e2e.observe(e2e, tags=tags)
        tpot = (e2e - ttft) / (n - 1) if n > 1 else 0.0
        if n > 1:
            self.tpot.observe(tpot, tags=tags)
        met = ttft <= ttft_target_s and tpot <= tpot_target_s
        self.slo.inc(1, tags={**tags, "met": str(met).lower()})
        if decision and (predicted := predicted_ttft_s(decision)) is not None and ttft > 0:
            policy = {"model": model, "policy": decision["policy"]}
            self.ttft_predicted.observe(predicted, tags=policy)
            self.ttft_error.observe(abs(predicted - ttft) / ttft, tags=policy)

    def planned(self, model: str, widths: dict[str, int]) -> None:
        """The planner's latest plan: {pool: width} (serve_app.planning)."""
        for pool, width in widths.items():
            self.planned_width.set(width, tags={"model": model, "pool": pool})

    def refresh(self, counters, instances: Iterable[tuple[str, InstanceView]], loop_lag_s: float) -> None:
        """The counters' growth since the last refresh, each instance's load, the loop's lag."""
        for event, value in asdict(counters).items():
            if (grown := value - self._counted.get(event, 0)) > 0:
                self.events.inc(grown, tags={"event": event})
            self._counted[event] = value
        for model, v in instances:
            load = (v.backlog_s, v.queued, v.kv_used_tokens / v.kv_capacity_tokens if v.kv_capacity_tokens else 0.0)
            key = (model, v.instance_id)
            if self._load.get(key) == load:  # a gauge keeps its value: an idle fleet costs no metric updates
                continue
            self._load[key] = load
            tags = {"model": model, "role": v.role.value, "instance": v.instance_id}
            self.backlog.set(load[0], tags=tags)
            self.queued.set(load[1], tags=tags)
            self.kv_pressure.set(load[2], tags=tags)
        if loop_lag_s != self._lag:
            self._lag = loop_lag_s
            self.loop_lag.set(loop_lag_s)
