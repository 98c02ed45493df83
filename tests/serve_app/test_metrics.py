"""The router's Prometheus series: what one finished request and one refresh put in them.

`RouterMetrics` is fed the request log's own records, so these tests build records the way the
router does (`request_record`) and read the series back through stand-ins of Ray's metric
classes that keep what they were given. The live proof that the series reach Ray's metrics
endpoint is tests/serve_app/test_serving.py."""

from __future__ import annotations

from collections import defaultdict

import pytest

import serve_app.metrics as metrics_module
from disagg.core.types import InstanceView, Role
from serve_app.metrics import RouterMetrics, predicted_ttft_s
from serve_app.request_log import Counters


class _Series:
    """Keeps every observation, keyed by the tags as a sorted tuple."""

    def __init__(self, name, description="", boundaries=None, tag_keys=None):
        self.name, self.tag_keys = name, tag_keys or ()
        self.values = defaultdict(list)

    def _key(self, tags):
        assert set(tags or {}) == set(self.tag_keys), (self.name, tags, self.tag_keys)
        return tuple(sorted((tags or {}).items()))

    def inc(self, value=1, tags=None):
        self.values[self._key(tags)].append(value)

    observe = set = inc


@pytest.fixture
def metrics(monkeypatch):
    for cls in ("Counter", "Gauge", "Histogram"):
        monkeypatch.setattr(metrics_module, cls, _Series)
    return RouterMetrics()


def _cost(backlog=0.0, own=0.0, queue=0.0, transfer=0.0):
    return {"backlog_s": backlog, "own_work_s": own, "pressure": 0.1, "queue_s": queue, "transfer_s": transfer,
            "slo_weight": 1.0, "total_s": backlog + own + queue + transfer}


def _record(**kw):
    r = {"slo_class": "tight", "error": None, "ttft_s": 0.1, "e2e_s": 1.1, "output_tokens": 11,
         "decision": {"prefill": "prefill-a", "decode": "decode-b", "policy": "marginal_cost",
                      "prefill_cost": _cost(backlog=0.02, own=0.05, transfer=0.005),
                      "decode_cost": _cost(own=0.4, queue=0.01)}}
    r.update(kw)
    return r


def _only(series):
    (key, values), = series.values.items()
    return dict(key), values


def test_a_served_request_fills_latency_slo_decision_and_prediction_series(metrics):
    metrics.request_finished(_record(), "m", ttft_target_s=0.2, tpot_target_s=0.2)
    assert _only(metrics.requests) == ({"model": "m", "slo_class": "tight", "outcome": "served"}, [1])
    assert _only(metrics.ttft)[1] == [0.1] and _only(metrics.e2e)[1] == [1.1]
    assert _only(metrics.tpot)[1] == [pytest.approx(0.1)]  # (1.1 − 0.1) / 10
    assert _only(metrics.slo) == ({"model": "m", "slo_class": "tight", "met": "true"}, [1])
    assert _only(metrics.decisions)[0] == {"model": "m", "policy": "marginal_cost", "prefill": "prefill-a",
                                           "decode": "decode-b"}
    terms = {(dict(k)["side"], dict(k)["term"]): v for k, v in metrics.cost.values.items()}
    assert terms == {("prefill", "backlog_s"): [0.02], ("prefill", "own_work_s"): [0.05],
                     ("prefill", "transfer_s"): [0.005], ("decode", "own_work_s"): [0.4],
                     ("decode", "queue_s"): [0.01]}  # zero terms are not observed
    assert _only(metrics.ttft_predicted)[1] == [pytest.approx(0.075)]
    assert _only(metrics.ttft_error)[1] == [pytest.approx(0.25)]  # |0.075 − 0.1| / 0.1


@pytest.mark.parametrize("ttft, e2e, met", [(0.3, 1.3, "false"), (0.1, 3.1, "false"), (0.2, 2.2, "true")])
def test_slo_met_needs_both_targets(metrics, ttft, e2e, met):
    metrics.request_finished(_record(ttft_s=ttft, e2e_s=e2e), "m", ttft_target_s=0.2, tpot_target_s=0.2)
    assert _only(metrics.slo)[0]["met"] == met


def test_failed_and_cancelled_requests_are_counted_without_latencies(metrics):
    metrics.request_finished(_record(error="cancelled by client", ttft_s=None), "m", 0.2, 0.2)
    metrics.request_finished(_record(error="decode failed after 3 tokens: boom"), "m", 0.2, 0.2)
    outcomes = sorted(dict(k)["outcome"] for k in metrics.requests.values)
    assert outcomes == ["cancelled", "failed"]
    assert not metrics.ttft.values and not metrics.slo.values and not metrics.ttft_error.values


def test_unpriced_decisions_predict_nothing():
    zero = {"prefill_cost": _cost(), "decode_cost": _cost()}
    assert predicted_ttft_s(zero) is None and predicted_ttft_s(None) is None


def test_refresh_exports_counter_growth_instance_load_and_loop_lag(metrics):
    c = Counters(requests=5, migrations=1)
    view = InstanceView("decode-b", Role.DECODE, backlog_s=1.5, queued=3, kv_used_tokens=250, kv_capacity_tokens=1000)
    metrics.refresh(c, [("m", view)], loop_lag_s=0.02)
    c.requests, c.shed_429 = 7, 2
    loaded = InstanceView("decode-b", Role.DECODE, backlog_s=2.0, queued=4, kv_used_tokens=500, kv_capacity_tokens=1000)
    metrics.refresh(c, [("m", loaded)], loop_lag_s=0.03)
    metrics.refresh(c, [("m", loaded)], loop_lag_s=0.03)  # nothing moved: no update (a gauge keeps its value)
    events = {dict(k)["event"]: v for k, v in metrics.events.values.items()}
    assert events == {"requests": [5, 2], "migrations": [1], "shed_429": [2]}  # growth only, once each
    tags = (("instance", "decode-b"), ("model", "m"), ("role", "decode"))
    assert metrics.backlog.values[tags] == [1.5, 2.0] and metrics.queued.values[tags] == [3, 4]
    assert metrics.kv_pressure.values[tags] == [0.25, 0.5]
    assert metrics.loop_lag.values[()] == [0.02, 0.03]


def test_the_shipped_grafana_dashboard_reads_only_series_the_router_exports(metrics):
    import json
    import re
    from pathlib import Path

    dashboard = json.loads((Path(__file__).resolve().parents[2] / "deployments" / "grafana" / "disagg-router.json")
                           .read_text())
    exported = {s.name for s in vars(metrics).values() if isinstance(s, _Series)}
    exprs = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    used = {m.group(1) for e in exprs for m in re.finditer(r"ray_(disagg_\w+?)(?:_bucket)?\b", e)}
    assert used and used <= exported, used - exported
    assert used == exported  # and every series has a panel


def test_the_planners_widths_are_exported_per_pool(metrics):
    metrics.planned("m", {"prefill": 1, "decode": 3})
    metrics.planned("m", {"prefill": 1, "decode": 2})
    assert metrics.planned_width.values[(("model", "m"), ("pool", "decode"))] == [3, 2]
    assert metrics.planned_width.values[(("model", "m"), ("pool", "prefill"))] == [1, 1]
