"""`disagg accuracy train|synth` and `disagg study latency-routing`: outputs, and bad input refused
with file, line and field, nothing written."""

from __future__ import annotations

import json

import pytest

from disagg.cli import main
from disagg.core.utility import AccuracyTable, read_evaluations
from disagg.sim.synthetic_accuracy import synthetic_evaluations, true_accuracy, write_evaluations
from disagg.sim.traces import write_native
from disagg.sim.workloads import generate


def test_train_writes_a_table_that_predicts_the_evaluations(tmp_path, capsys):
    csv = tmp_path / "ev.csv"
    csv.write_text("prompt_tokens,model,score,notes\n100,small,1,x\n100,small,0,y\n3000,large,1,z\n")
    out = tmp_path / "acc.json"
    assert main(["accuracy", "train", "--evaluations", str(csv), "--out", str(out)]) == 0
    table = AccuracyTable.load(out)
    assert table.count("small") == 2 and table.count("large") == 1
    assert table.predict("small", 100) == pytest.approx(0.5)
    assert table.predict("large", 3000) == pytest.approx(1.0)
    assert "2 rows" in capsys.readouterr().out


@pytest.mark.parametrize("text,where,field", [
    ("prompt_tokens,score\n100,1\n", ":1:", "model"),
    ("prompt_tokens,model,score\n100,small,0.5\n200,large,1.5\n", ":3:", "score"),
    ("prompt_tokens,model,score\n100,small,-0.1\n", ":2:", "score"),
    ("prompt_tokens,model,score\n100,small,abc\n", ":2:", "score"),
    ("prompt_tokens,model,score\n1e3,small,0.5\n", ":2:", "prompt_tokens"),
    ("prompt_tokens,model,score\n100,,0.5\n", ":2:", "model"),
])
def test_bad_evaluations_are_refused_naming_file_line_and_field_and_nothing_is_written(
        tmp_path, capsys, text, where, field):
    csv = tmp_path / "ev.csv"
    csv.write_text(text)
    out = tmp_path / "acc.json"
    out.write_text("previous")  # an earlier artifact stays as it was
    assert main(["accuracy", "train", "--evaluations", str(csv), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert f"{csv}{where}" in err and field in err
    assert out.read_text() == "previous"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["acc.json", "ev.csv"]  # no temporary file left


def test_missing_or_empty_evaluations_file_is_a_usage_error(tmp_path, capsys):
    out = tmp_path / "acc.json"
    assert main(["accuracy", "train", "--evaluations", str(tmp_path / "none.csv"), "--out", str(out)]) == 2
    empty = tmp_path / "empty.csv"
    empty.write_text("prompt_tokens,model,score\n")
    assert main(["accuracy", "train", "--evaluations", str(empty), "--out", str(out)]) == 2
    assert "no evaluation rows" in capsys.readouterr().err
    assert not out.exists()


def test_synthetic_evaluations_follow_their_ground_truth_and_round_trip(tmp_path):
    rows = synthetic_evaluations(3000, seed=4)
    path = tmp_path / "syn.csv"
    write_evaluations(path, rows)
    assert read_evaluations(path) == rows
    table = AccuracyTable().train(rows)
    # the learned table recovers the synthetic truth where it has data, and the ordering everywhere
    for n in (128, 1024):
        for m in ("small", "large"):
            assert table.predict(m, n) == pytest.approx(true_accuracy(m, n), abs=0.06)
        assert table.predict("large", n) > table.predict("small", n)
    assert synthetic_evaluations(50, seed=4) == synthetic_evaluations(50, seed=4)


def test_study_writes_its_table_json_and_plot(tmp_path, capsys):
    trace = tmp_path / "t.csv"
    write_native(trace, generate("short_chat", 240, 5.0, 3))
    out = tmp_path / "out"
    args = ["study", "latency-routing", "--trace", str(trace), "--rate", "10", "--max-requests", "120",
            "--lambdas", "0,2000", "--seeds", "0,1", "--out", str(out)]
    assert main(args) == 0
    printed = capsys.readouterr().out
    result = json.loads((out / "results.json").read_text())
    assert (out / "utility_attainment.png").stat().st_size > 10_000
    assert (out / "results.md").read_text().strip() in printed
    runs = result["runs"]
    assert len(runs) == 2 * 2 * 3  # seeds × λ × routers
    assert {(r["router"], r["lam"], r["seed"]) for r in runs} == {
        (router, lam, seed) for router in ("latency_aware", "accuracy_cost", "load_balance")
        for lam in (0.0, 2000.0) for seed in (0, 1)}
    for r in runs:
        assert 0.0 <= r["attainment"] <= 1.0 and r["mape"] >= 0.0
        assert r["utility"] == pytest.approx(r["accuracy"] - r["lam"] * r["cost_per_1k"] / 1000)
        assert r["utility_on_time"] <= r["utility"] + 1e-12  # a late answer's accuracy counts 0
        if r["attainment"] == 1.0:
            assert r["utility_on_time"] == pytest.approx(r["utility"])
    assert len(result["estimator"]) == 4 * 2


@pytest.mark.parametrize("extra,message", [
    (["--lambdas", "0,-1"], "--lambdas"),
    (["--lambdas", "0,x"], "--lambdas"),
    (["--fleet", "small:2,huge:1"], "unknown model 'huge'"),
    (["--max-requests", "200", "--seeds", "0,1"], "seed 1 needs requests [200, 400)"),
])
def test_study_bad_flags_are_usage_errors(tmp_path, capsys, extra, message):
    trace = tmp_path / "t.csv"
    write_native(trace, generate("short_chat", 240, 5.0, 3))
    args = ["study", "latency-routing", "--trace", str(trace), "--rate", "10", "--max-requests", "100", *extra]
    assert main(args) == 2
    assert message in capsys.readouterr().err


def test_study_needs_a_rate(tmp_path, capsys):
    trace = tmp_path / "t.csv"
    write_native(trace, generate("short_chat", 50, 5.0, 3))
    assert main(["study", "latency-routing", "--trace", str(trace), "--max-requests", "20"]) == 2
    assert "--rate" in capsys.readouterr().err
