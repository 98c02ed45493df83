"""`disagg validate`'s judgement (disagg/bench/validate.py) on hand-written bench folders; the live
path is in test_bench_live.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from disagg.bench.harness import BenchError
from disagg.bench.validate import (
    FIGURE, ValidateConfig, check, folder, judge_cell, markdown, plot, ranking, run_order, summarize,
)


def cell(ttft, tpot, attainment):
    return {"ttft_p50_s": ttft, "ttft_p90_s": 2 * ttft, "tpot_p50_s": tpot, "tpot_p90_s": 2 * tpot,
            "attainment": attainment}


def test_the_rates_are_swept_in_alternating_directions():
    assert run_order((4.0, 1.0, 2.0), 3) == [(0, 1.0), (0, 2.0), (0, 4.0), (1, 4.0), (1, 2.0), (1, 1.0),
                                             (2, 1.0), (2, 2.0), (2, 4.0)]


def test_a_cell_passes_within_the_bound_or_the_live_noise_whichever_is_wider():
    steady = [cell(0.100, 0.010, 0.90), cell(0.102, 0.010, 0.91)]
    c = judge_cell(steady, cell(0.112, 0.010, 0.94), within=0.15)
    assert c["live"]["ttft_p50_s"] == pytest.approx(0.101)
    assert c["passed"]["ttft_p50_s"] and c["allowed"]["ttft_p50_s"] == 0.15
    assert c["passed"]["attainment"]  # +0.035
    c = judge_cell(steady, cell(0.130, 0.010, 0.80), within=0.15)
    assert not c["passed"]["ttft_p50_s"] and not c["passed"]["attainment"]  # +29%; −0.105
    noisy = [cell(0.080, 0.010, 0.70), cell(0.120, 0.010, 0.90)]  # spread 40% and 0.2
    c = judge_cell(noisy, cell(0.130, 0.010, 0.60), within=0.15)
    assert c["allowed"]["ttft_p50_s"] == pytest.approx(0.6) and c["passed"]["ttft_p50_s"]
    assert c["allowed"]["attainment"] == pytest.approx(0.3) and c["passed"]["attainment"]
    assert not judge_cell(noisy, {}, within=0.15)["passed"]["ttft_p50_s"]  # no prediction never passes


def row(policy, live, sim, spread=0.0, trace="t", rate=1.0):
    return {"policy": policy, "trace": trace, "rate": rate, "live": {"attainment": live}, "sim": {"attainment": sim},
            "live_spread": {"attainment": spread}}


def test_the_order_counts_only_pairs_live_separates_beyond_their_noise():
    agree = ranking([row("a", 0.9, 0.8), row("b", 0.5, 0.4), row("c", 0.88, 0.95, spread=0.05)])
    # a–c within c's noise: not counted (the simulator swaps them); a>b and c>b both kept
    assert agree[0]["separated_pairs"] == 2 and agree[0]["agrees"]
    flipped = ranking([row("a", 0.9, 0.4), row("b", 0.5, 0.8)])
    assert not flipped[0]["agrees"] and flipped[0]["live_order"] == "a > b" and flipped[0]["sim_order"] == "b > a"
    tie = ranking([row("a", 0.9, 0.95), row("b", 0.5, 0.95)])
    assert not tie[0]["agrees"] and tie[0]["sim_order"] in ("a = b", "b = a")  # a tie does not order them


def write_folder(path: Path, live: dict, sim: dict | None) -> Path:
    """A bench folder's requests.jsonl: per (policy, trace) a list of (ttft, tpot, met) requests."""
    path.mkdir(parents=True)
    lines = []
    for system, groups in (("live", live), ("sim", sim or {})):
        for (policy, trace), reqs in groups.items():
            lines += [json.dumps({"system": system, "policy": policy, "trace": trace, "index": i, "ttft_s": t,
                                  "tpot_s": p, "slo_met": m}) for i, (t, p, m) in enumerate(reqs)]
    (path / "requests.jsonl").write_text("\n".join(lines) + "\n")
    return path


def test_the_report_has_every_cell_the_noise_floor_and_the_figure(tmp_path):
    fast = [(0.1, 0.01, True)] * 9 + [(0.5, 0.02, False)]
    slow = [(0.2, 0.02, True)] * 5 + [(0.9, 0.05, False)] * 5
    runs = {}
    for rep in range(2):
        for rate in (1.0, 3.0):
            live = {("marginal_cost", "conv"): fast if rate == 1.0 else slow, ("round_robin", "conv"): slow}
            sim = {("marginal_cost", "conv"): fast, ("round_robin", "conv"): fast} if rep == 0 else None
            runs[(rep, rate)] = write_folder(folder(tmp_path, rep, rate), live, sim)
    report = summarize(runs, within=0.15)
    assert [(r["rate"], r["policy"]) for r in report["rows"]] == [
        (1.0, "marginal_cost"), (1.0, "round_robin"), (3.0, "marginal_cost"), (3.0, "round_robin")]
    assert all(r["repeats"] == 2 for r in report["rows"])
    first = report["rows"][0]
    assert all(first["passed"].values()) and first["live_spread"]["ttft_p50_s"] == 0.0  # the same records twice
    assert not report["rows"][1]["passed"]["attainment"]  # live 0.5, predicted 1.0
    s = report["summary"]
    assert (s["latency_cells"], s["attainment_cells"], s["rankings"]) == (16, 4, 2)
    assert (s["pairs"], s["pairs_agree"]) == (1, 0)  # at 1 req/s live separates them; the simulator ties them
    md = markdown(report)
    assert md.count("| conv |") == 4 + 2 and "✗" in md and f"{s['latency_passed']} of 16" in md
    plot(report, tmp_path / FIGURE)
    assert (tmp_path / FIGURE).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("change, message", [({"rates": ()}, "--rates"), ({"rates": (1.0, -2.0)}, "--rates"),
                                             ({"rates": (1.0, 1.0)}, "twice"), ({"repeats": 0}, "--repeats"),
                                             ({"within": 1.5}, "--within")])
def test_bad_settings_are_refused_before_anything_runs(tmp_path, change, message):
    base = dict(url="http://127.0.0.1:9", out=tmp_path, traces=("t",), policies=("round_robin",), rates=(1.0,))
    with pytest.raises(BenchError, match=message):
        check(ValidateConfig(**{**base, **change}))


def test_resimulate_judges_other_constants_against_the_same_live_runs_and_targets(tmp_path):
    """`disagg validate --resimulate`: the simulator alone, on the earlier run's slices, rates and
    topology, with the live runs' SLO targets; a slower engine predicts higher latencies."""
    import yaml

    from disagg.bench.validate import RESULTS_JSON, resimulate
    from disagg.core.cost_model import load_profile

    trace = tmp_path / "chat.csv"
    trace.write_text("arrival_s,prompt_tokens,output_tokens\n" +
                     "".join(f"{i * 0.5},{200 + 30 * i},{20 + i}\n" for i in range(12)))
    measured = tmp_path / "measured"
    live = {("round_robin", "chat"): [(0.05, 0.004, True)] * 12}
    slo = {"tight": {"ttft_s": 0.03, "tpot_s": 0.002}, "loose": {"ttft_s": 0.09, "tpot_s": 0.006}}
    for rep in range(2):
        for rate in (1.0, 2.0):
            path = write_folder(folder(measured, rep, rate), live, None)
            (path / "results.json").write_text(json.dumps(
                {"resolved": {"topology": "1P2D", "max_model_len": 2048}, "settings": {"rate": rate},
                 "cost_model": {"slo": slo}}))
    (measured / RESULTS_JSON).write_text(json.dumps(
        {"within": 0.15, "settings": {"traces": [str(trace)], "policies": ["round_robin"], "rates": [1.0, 2.0],
                                      "repeats": 2, "max_requests": 12, "seed": 0}}))
    fast = load_profile("cpu-tiny")
    slower = fast.engine.model_copy(update={"step_base_s": 10 * fast.engine.step_base_s})
    slow = fast.model_copy(update={"engine": slower})
    (tmp_path / "slow.yaml").write_text(yaml.safe_dump(slow.to_dict()))

    reports = {name: resimulate(measured, src, tmp_path / name, log=lambda m: None)
               for name, src in (("fast", "cpu-tiny"), ("slow", str(tmp_path / "slow.yaml")))}
    for name, report in reports.items():
        assert [(r["rate"], r["repeats"]) for r in report["rows"]] == [(1.0, 2), (2.0, 2)]
        assert all(r["live"]["ttft_p50_s"] == pytest.approx(0.05) for r in report["rows"])
        used = yaml.safe_load((tmp_path / name / "rate-1" / "repeat-1" / "cost_model.yaml").read_text())
        assert used["slo"] == slo  # judged as the live runs were, whatever the file's own targets
    assert all(s["sim"]["tpot_p50_s"] > 5 * f["sim"]["tpot_p50_s"]
               for f, s in zip(reports["fast"]["rows"], reports["slow"]["rows"]))
    with pytest.raises(BenchError, match="not the folder of a finished"):
        resimulate(tmp_path / "chat.csv", "cpu-tiny", tmp_path / "x", log=lambda m: None)


def test_at_the_measured_speed_each_repeat_is_simulated_at_the_speed_its_check_found(tmp_path):
    """`--at-measured-speed`: the simulator runs every repeat, its engines scaled to what that repeat's
    constants check measured; a repeat whose host ran decode steps 2× slower predicts slower tokens,
    and the cell counts the median of the repeats' predictions."""
    from disagg.bench.constants_check import ProbePoint, Verdict
    from disagg.bench.validate import resimulate
    from disagg.core.cost_model import load_profile

    cm = load_profile("cpu-tiny")
    trace = tmp_path / "chat.csv"
    trace.write_text("arrival_s,prompt_tokens,output_tokens\n" +
                     "".join(f"{i * 0.5},{200 + 30 * i},{20 + i}\n" for i in range(12)))
    measured = tmp_path / "measured"
    live = {("round_robin", "chat"): [(0.05, 0.004, True)] * 12}

    def check(decode: float) -> dict:
        e = cm.engine
        points = (ProbePoint("d0", "prefill", 128, e.prefill_s(128), 1.0),
                  ProbePoint("d0", "decode", 1, decode * e.decode_token_s(1), 1.0))
        return Verdict(points, {}).as_dict()

    for rep, decode in enumerate((1.0, 2.0)):
        path = write_folder(folder(measured, rep, 1.0), live, None)
        (path / "results.json").write_text(json.dumps(
            {"resolved": {"topology": "1P2D", "max_model_len": 2048}, "settings": {"rate": 1.0},
             "cost_model": {"slo": {k.value: v.model_dump() for k, v in cm.slo.items()},
                            "constants_check": check(decode)}}))
    (measured / "validate.json").write_text(json.dumps(
        {"within": 0.15, "settings": {"traces": [str(trace)], "policies": ["round_robin"], "rates": [1.0],
                                      "repeats": 2, "max_requests": 12, "seed": 0}}))

    fitted = resimulate(measured, "cpu-tiny", tmp_path / "fitted", log=lambda m: None)
    at_speed = resimulate(measured, "cpu-tiny", tmp_path / "at-speed", log=lambda m: None, at_measured_speed=True)
    assert not (tmp_path / "fitted" / "rate-1" / "repeat-2").exists()  # once per rate, as fitted
    per_repeat = [summarize({(0, 1.0): folder(measured, k, 1.0)}, 0.15,
                            {(0, 1.0): folder(tmp_path / "at-speed", k, 1.0)})["rows"][0]["sim"]["tpot_p50_s"]
                  for k in range(2)]
    first = fitted["rows"][0]["sim"]["tpot_p50_s"]
    assert per_repeat[0] == pytest.approx(first)  # the first repeat ran at the fitted speed
    assert per_repeat[1] > 1.5 * first  # the second at twice its decode step
    assert at_speed["rows"][0]["sim"]["tpot_p50_s"] == pytest.approx((per_repeat[0] + per_repeat[1]) / 2)
    assert at_speed["settings"]["at_measured_speed"] is True
    unchecked = folder(measured, 1, 1.0) / "results.json"
    record = json.loads(unchecked.read_text())
    del record["cost_model"]["constants_check"]
    unchecked.write_text(json.dumps(record))
    with pytest.raises(BenchError, match="no constants check"):
        resimulate(measured, "cpu-tiny", tmp_path / "x", log=lambda m: None, at_measured_speed=True)
    record["cost_model"]["slo"] = {}
    unchecked.write_text(json.dumps(record))
    with pytest.raises(BenchError, match=f"{unchecked}.*slo"):  # the file named, and the field
        resimulate(measured, "cpu-tiny", tmp_path / "x", log=lambda m: None, at_measured_speed=True)


def test_refit_fits_again_before_each_run_not_begun_and_simulates_each_repeat_with_its_runs_constants(
        tmp_path, monkeypatch):
    """`--refit`: the constants are fitted again before every run that has not begun (a resumed run
    keeps the constants it began with), and each repeat is simulated with the constants its own run
    judged with — here the second fit finds the engines 3× slower, so its repeat predicts slower tokens."""
    import yaml

    import disagg.bench.validate as validate
    from disagg.core.cost_model import load_profile

    trace = tmp_path / "chat.csv"
    trace.write_text("arrival_s,prompt_tokens,output_tokens\n" +
                     "".join(f"{i * 0.5},{200 + 30 * i},{20 + i}\n" for i in range(12)))
    fitted = [load_profile("cpu-tiny")]
    real_run_bench = validate.run_bench

    def refit():  # each fit finds the engines slower than the one before
        e = fitted[-1].engine
        fitted.append(fitted[-1].model_copy(update={"engine": e.scaled(3.0)}))

    def live_bench(cfg, progress=None, log=None):  # the app's side of `disagg bench`, as its folder keeps it
        if cfg.url is None:
            return real_run_bench(cfg, progress=progress, log=log)
        assert cfg.cost_model is None and not cfg.sim  # the router's own constants; simulated per repeat
        live = {("round_robin", "chat"): [(0.05, 0.004, True)] * 12}
        path = write_folder(cfg.out, live, None)
        cm = fitted[-1]
        (path / "cost_model.yaml").write_text(yaml.safe_dump(cm.to_dict()))
        (path / "settings.json").write_text("{}")
        (path / "results.json").write_text(json.dumps(
            {"resolved": {"topology": "1P2D", "max_model_len": 2048}, "settings": {"rate": cfg.rate},
             "cost_model": {"slo": {k.value: v.model_dump() for k, v in cm.slo.items()}}}))

    monkeypatch.setattr(validate, "run_bench", live_bench)
    cfg = ValidateConfig(url="http://127.0.0.1:9", out=tmp_path / "v", traces=(str(trace),),
                         policies=("round_robin",), rates=(1.0,), repeats=2, max_requests=12)
    report = validate.run_validate(cfg, log=lambda m: None, refit=refit)
    assert len(fitted) == 3 and report["settings"]["refit"] is True  # one fit before each of the two runs
    used = [yaml.safe_load((folder(cfg.out / "sim", k, 1.0) / "cost_model.yaml").read_text())["engine"]
            for k in range(2)]
    assert used == [fitted[1].engine.model_dump(mode="json"), fitted[2].engine.model_dump(mode="json")]
    per_repeat = [summarize({(0, 1.0): folder(cfg.out, k, 1.0)}, 0.15,
                            {(0, 1.0): folder(cfg.out / "sim", k, 1.0)})["rows"][0]["sim"]["tpot_p50_s"]
                  for k in range(2)]
    assert per_repeat[1] > 2 * per_repeat[0]
    assert report["rows"][0]["sim"]["tpot_p50_s"] == pytest.approx(sum(per_repeat) / 2)  # the repeats' median
    # resumed: every run has begun, so nothing is fitted again
    monkeypatch.setattr(validate, "run_bench", lambda cfg, progress=None, log=None: None)
    validate.run_validate(cfg, log=lambda m: None, refit=refit)
    assert len(fitted) == 3
    with pytest.raises(BenchError, match="--refit.*--cost-model"):
        validate.run_validate(ValidateConfig(**{**cfg.__dict__, "cost_model": "cpu-tiny"}), log=lambda m: None,
                              refit=refit)
