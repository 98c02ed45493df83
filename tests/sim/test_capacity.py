"""SLO capacity: the bounded search (driven by hand-made attainment curves), the search on a real
simulated trace, and `disagg sim --capacity` (JSON, table, the oracle bound, bad flags)."""

from __future__ import annotations

import json
import math

import pytest

from disagg.cli import main
from disagg.core.cost_model import load_profile
from disagg.sim.runner import attainment_crossing, capacity_steps, find_capacity, prepare_trace, simulate
from disagg.sim.simulator import Topology
from disagg.sim.traces import write_native
from disagg.sim.workloads import generate


def drive(attained, start, attainment=0.9, steps=8, max_doublings=6):
    """Run the search against a function rate -> attainment; returns (result, probed rates)."""
    probed = []
    search = capacity_steps(start, attainment, steps, max_doublings)
    try:
        rate = next(search)
        while True:
            probed.append(rate)
            rate = search.send(attained(rate))
    except StopIteration as stop:
        return stop.value, probed


def cliff(at: float):
    """A monotone attainment curve: everything meets its SLO up to `at` req/s, then half."""
    return lambda rate: 1.0 if rate <= at else 0.5


@pytest.mark.parametrize("true_capacity, start, doublings", [
    (3.7, 1.0, 2),    # up: 1 ok, 2 ok, 4 fails
    (0.3, 1.0, 2),    # down: 1 fails, 0.5 fails, 0.25 ok
    (1.5, 1.0, 1),    # up one step
    (0.99, 1.0, 1),   # just below the start
])
def test_bisection_finds_a_known_capacity_within_its_bracket(true_capacity, start, doublings):
    steps = 8
    res, probed = drive(cliff(true_capacity), start, steps=steps)
    lo, hi = res["bracket"]
    assert res["bracketed"] and res["capacity_rps"] == lo
    assert lo <= true_capacity < hi
    assert hi / lo == pytest.approx(2 ** (1 / 2 ** steps))  # each step halves log(hi / lo)
    assert len(probed) == 1 + doublings + steps
    assert [r for r, _ in res["probes"]] == probed
    assert all(r <= true_capacity for r, a in res["probes"] if a >= 0.9)


@pytest.mark.parametrize("steps", [0, 1, 3, 8])
def test_the_number_of_probes_is_bounded(steps):
    _, probed = drive(cliff(5.0), 1.0, steps=steps, max_doublings=6)
    assert len(probed) == 1 + 3 + steps  # 1, 2, 4, 8 (fails), then the bisection
    # whatever the curve, never more than 1 + max_doublings + steps probes
    for curve in (cliff(1e9), cliff(1e-9), lambda r: 0.9 if int(r * 10) % 2 else 0.1):
        _, probed = drive(curve, 1.0, steps=steps, max_doublings=4)
        assert len(probed) <= 1 + 4 + steps


def test_a_capacity_beyond_the_bracket_is_a_lower_bound():
    res, probed = drive(cliff(1e9), 2.0, max_doublings=3)
    assert probed == [2.0, 4.0, 8.0, 16.0]  # no failure seen: no bisection
    assert res["capacity_rps"] == 16.0 and not res["bracketed"] and res["bracket"] == [16.0, None]


def test_a_capacity_below_the_bracket_is_none():
    res, probed = drive(cliff(1e-9), 2.0, max_doublings=3)
    assert probed == [2.0, 1.0, 0.5, 0.25]
    assert res["capacity_rps"] is None and not res["bracketed"] and res["bracket"] == [0.0, 0.25]


def test_attainment_exactly_at_the_target_passes_and_nan_fails():
    res, _ = drive(lambda r: 0.9 if r <= 3.0 else 0.89, 1.0, steps=4)
    assert 2.0 <= res["capacity_rps"] <= 3.0
    res, _ = drive(lambda r: math.nan, 1.0, max_doublings=2)
    assert res["capacity_rps"] is None


def test_the_crossing_reads_a_linear_curve_between_the_grid_points():
    # attainment falls linearly in log2(rate): 0.95 at 1 req/s, 0.75 at 4; the target 0.8 is at 2^1.5
    def curve(rate):
        return 0.95 - 0.1 * math.log2(rate)
    res, _ = drive(curve, 1.0, attainment=0.8, steps=2)
    lo, hi = res["bracket"]
    assert hi / lo == pytest.approx(2 ** 0.25)  # the grid's step at 2 steps: 1.19x
    assert lo <= res["crossing_rps"] < hi
    assert res["crossing_rps"] == pytest.approx(2 ** 1.5)  # exact on a curve linear in log(rate)
    assert res["capacity_rps"] == lo < 2 ** 1.5  # the grid reading sits up to a step below it


def test_no_crossing_without_a_bracket_and_the_lower_end_when_the_failing_side_measured_nothing():
    res, _ = drive(cliff(1e9), 2.0, max_doublings=3)
    assert res["crossing_rps"] is None
    res, _ = drive(cliff(1e-9), 2.0, max_doublings=3)
    assert res["crossing_rps"] is None
    res, _ = drive(lambda r: 1.0 if r <= 1.5 else math.nan, 1.0, steps=0)
    assert res["crossing_rps"] == res["capacity_rps"] == 1.0
    # the last probe of a rate is the one the search judged it by
    probes = [[1.0, 0.95], [2.0, 0.7], [1.0, 0.9]]
    assert attainment_crossing(probes, [1.0, 2.0], 0.8) == pytest.approx(2 ** 0.5)


@pytest.mark.parametrize("kwargs", [dict(start_rps=0.0), dict(start_rps=math.inf), dict(attainment=0.0),
                                    dict(attainment=1.2), dict(steps=-1)])
def test_bad_search_settings_are_refused(kwargs):
    args = dict(start_rps=1.0, attainment=0.9, steps=3) | kwargs
    with pytest.raises(ValueError):
        next(capacity_steps(**args))


# --- on a simulated trace ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def cm():
    return load_profile("a40")


def test_capacity_of_a_real_simulation_is_where_attainment_crosses(cm):
    trace = generate("short_chat", 60, 2.0, 1)
    kw = dict(attainment=0.9, steps=4, tight_share=0.5, seed=3)
    res = find_capacity(trace, cm, Topology(1, 1), "round_robin", **kw)
    again = find_capacity(trace, cm, Topology(1, 1), "round_robin", **kw)
    assert res == again  # deterministic for a seed
    assert res["bracketed"] and res["start_rps"] == pytest.approx(2.0, rel=0.5)
    lo, hi = res["bracket"]

    def goodput(rate):
        summary, _ = simulate(prepare_trace(trace, rate, 0.5, 3), cm, Topology(1, 1), "round_robin", seed=3)
        return summary["goodput"]

    assert goodput(lo) >= 0.9 > goodput(hi)  # checked independently of the search
    assert len(res["probes"]) <= 1 + 6 + 4


def test_a_trace_without_a_rate_is_refused(cm):
    from disagg.sim.traces import TraceRequest

    with pytest.raises(ValueError, match="2 requests"):
        find_capacity([TraceRequest(0.0, 10, 5)], cm, Topology(1, 1), "round_robin", attainment=0.9, steps=2,
                      tight_share=0.5, seed=0)


# --- the CLI -------------------------------------------------------------------------------------


@pytest.fixture
def small_trace(tmp_path):
    path = tmp_path / "t.csv"
    write_native(path, generate("short_chat", 40, 2.0, 1))
    return path


def test_cli_capacity_writes_capacity_rps_and_adds_the_oracle_as_bound(small_trace, tmp_path, capsys):
    out = tmp_path / "r.json"
    assert main(["sim", "--trace", str(small_trace), "--topology", "1P1D", "--policies", "round_robin,power_of_two",
                 "--capacity", "--capacity-steps", "3", "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    data = json.loads(out.read_text())
    assert list(data["policies"]) == ["round_robin", "power_of_two", "oracle"]
    assert data["capacity"]["bound_policy"] == "oracle" and data["capacity"]["bound_added"] is True
    assert data["capacity"]["attainment"] == 0.9 and data["capacity"]["steps"] == 3
    for name, p in data["policies"].items():
        assert p["capacity_rps"] > 0 and "goodput" in p  # beside the existing fields
        assert p["capacity"]["bracketed"] and len(p["capacity"]["probes"]) <= 1 + 6 + 3
        assert p["capacity"]["bound"] is (name == "oracle")
    assert "capacity req/s" in printed and "oracle (bound)" in printed
    assert f"{data['policies']['round_robin']['capacity_rps']:.2f}" in printed


def test_cli_capacity_keeps_a_requested_oracle_once(small_trace, tmp_path):
    out = tmp_path / "r.json"
    assert main(["sim", "--trace", str(small_trace), "--topology", "1P1D", "--policies", "oracle",
                 "--capacity", "--capacity-steps", "1", "--attainment", "0.5", "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    assert list(data["policies"]) == ["oracle"] and data["capacity"]["bound_added"] is False
    assert data["capacity"]["attainment"] == 0.5


def test_cli_without_capacity_has_no_capacity_fields(small_trace, tmp_path, capsys):
    out = tmp_path / "r.json"
    assert main(["sim", "--trace", str(small_trace), "--policies", "round_robin", "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["capacity"] is None and "capacity_rps" not in data["policies"]["round_robin"]
    assert "capacity req/s" not in capsys.readouterr().out


@pytest.mark.parametrize("flags, named", [
    (["--capacity", "--attainment", "0"], "--attainment"),
    (["--capacity", "--attainment", "1.5"], "--attainment"),
    (["--capacity", "--attainment", "nan"], "--attainment"),
    (["--capacity", "--capacity-steps", "-1"], "--capacity-steps"),
    (["--capacity", "--capacity-steps", "99"], "--capacity-steps"),
    (["--attainment", "0.9"], "--attainment"),  # without --capacity
    (["--capacity-steps", "4"], "--capacity-steps"),
    (["--tight-share", "1.5"], "--tight-share"),
    (["--max-requests", "-3"], "--max-requests"),
    (["--rate", "nan"], "--rate"),
])
def test_cli_refuses_bad_flags_naming_them(small_trace, tmp_path, capsys, flags, named):
    out = tmp_path / "r.json"
    assert main(["sim", "--trace", str(small_trace), *flags, "--json", str(out)]) == 2
    assert named in capsys.readouterr().err
    assert not out.exists()


def test_cli_capacity_refuses_a_trace_without_a_rate(tmp_path, capsys):
    path = tmp_path / "one.csv"
    write_native(path, generate("short_chat", 1, 2.0, 1))
    assert main(["sim", "--trace", str(path), "--capacity"]) == 2
    assert "--capacity" in capsys.readouterr().err
