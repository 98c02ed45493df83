"""Accuracy − λ·cost under a TTFT limit: prices, the accuracy table, the evaluations CSV, the choice."""

from __future__ import annotations

import json
import math
from types import SimpleNamespace

import pytest

from disagg.core.types import NoCapacity
from disagg.core.utility import (
    AccuracyTable,
    Candidate,
    EvaluationError,
    EvaluationRow,
    ModelPrices,
    Query,
    choose_instance,
    cost_estimate,
    prompt_bucket,
    read_evaluations,
)

# --- cost ----------------------------------------------------------------------------------------


def test_cost_estimate_prices_input_and_output_tokens():
    prices = ModelPrices(input_per_token=2e-6, output_per_token=8e-6)
    assert cost_estimate(prices, 1000, 250) == pytest.approx(1000 * 2e-6 + 250 * 8e-6, abs=1e-15)
    assert cost_estimate(prices, 0, 0) == 0.0


@pytest.mark.parametrize("inp,out,field", [
    (-1e-6, 1e-6, "input_per_token"),
    (1e-6, float("nan"), "output_per_token"),
    (float("inf"), 1e-6, "input_per_token"),
    ("1", 1e-6, "input_per_token"),
])
def test_bad_prices_name_the_field(inp, out, field):
    with pytest.raises(ValueError, match=field):
        ModelPrices(inp, out)


def test_negative_token_counts_are_refused():
    with pytest.raises(ValueError, match="token counts"):
        cost_estimate(ModelPrices(1.0, 1.0), -1, 5)


# --- accuracy table ------------------------------------------------------------------------------


@pytest.mark.parametrize("tokens,bucket", [(0, 1), (1, 1), (2, 2), (3, 2), (63, 6), (64, 7), (127, 7), (128, 8)])
def test_prompt_bucket_is_log2(tokens, bucket):
    assert prompt_bucket(tokens) == bucket


ROWS = [
    (100, "big", 1.0), (100, "big", 0.0), (120, "big", 1.0),  # bucket 7: mean 2/3
    (1000, "big", 0.5),  # bucket 10
    (50, "small", 0.4), (60, "small", 0.2),  # bucket 6
]


def test_accuracy_table_exact_values():
    t = AccuracyTable(shrinkage=2.0, default_prior=0.3, priors={"new": 0.7}).train(ROWS)
    big_mean = 2.5 / 4
    assert t.model_mean("big") == pytest.approx(big_mean)
    # bucket 7: (2·M + 2.0) / (2 + 3)
    assert t.predict("big", 100) == pytest.approx((2 * big_mean + 2.0) / 5)
    assert t.predict("big", 64) == t.predict("big", 127) == t.predict("big", 100)
    # bucket 10: (2·M + 0.5) / (2 + 1)
    assert t.predict("big", 1000) == pytest.approx((2 * big_mean + 0.5) / 3)
    # a cold bucket answers the model mean
    assert t.predict("big", 5) == pytest.approx(big_mean)
    small_mean = 0.3
    assert t.predict("small", 55) == pytest.approx((2 * small_mean + 0.6) / 4)
    # no history: the model's prior, else the default prior
    assert t.predict("new", 100) == 0.7
    assert t.predict("unknown", 100) == 0.3
    assert t.count("big") == 4 and t.count("big", 100) == 3 and t.count("unknown") == 0
    assert t.models == ["big", "small"]


def test_zero_shrinkage_is_the_bucket_mean_and_large_shrinkage_the_model_mean():
    raw = AccuracyTable(shrinkage=0.0).train(ROWS)
    assert raw.predict("big", 100) == pytest.approx(2 / 3)
    heavy = AccuracyTable(shrinkage=1e9).train(ROWS)
    assert heavy.predict("big", 100) == pytest.approx(2.5 / 4, abs=1e-6)


def test_train_accumulates_and_accepts_rows_or_tuples():
    a = AccuracyTable().train(ROWS[:3]).train([EvaluationRow(*r) for r in ROWS[3:]])
    b = AccuracyTable().train(ROWS)
    assert a.to_dict() == b.to_dict()


@pytest.mark.parametrize("bad,match", [
    ((100, "m", 1.5), "row 1: field 'score'"),
    ((100, "m", -0.1), "row 1: field 'score'"),
    ((100, "m", float("nan")), "row 1: field 'score'"),
    ((-3, "m", 0.5), "row 1: field 'prompt_tokens'"),
    ((1.5, "m", 0.5), "row 1: field 'prompt_tokens'"),
    ((100, "", 0.5), "row 1: field 'model'"),
    ((100, "m"), r"row 1: expected \(prompt_tokens, model, score\)"),
])
def test_a_bad_row_is_named_and_nothing_is_learnt(bad, match):
    t = AccuracyTable()
    with pytest.raises(EvaluationError, match=match):
        t.train([(100, "m", 0.5), bad])
    assert t.count("m") == 0


@pytest.mark.parametrize("kw,match", [
    (dict(shrinkage=-1.0), "shrinkage"),
    (dict(default_prior=1.5), "default_prior"),
    (dict(priors={"m": 2.0}), "priors"),
])
def test_bad_table_parameters(kw, match):
    with pytest.raises(ValueError, match=match):
        AccuracyTable(**kw)


def test_save_and_load_round_trip(tmp_path):
    t = AccuracyTable(shrinkage=3.0, default_prior=0.4, priors={"p": 0.9}).train(ROWS)
    path = tmp_path / "sub" / "acc.json"
    t.save(path)
    assert [p.name for p in path.parent.iterdir()] == ["acc.json"]  # no temporary left behind
    u = AccuracyTable.load(path)
    assert u.to_dict() == t.to_dict()
    for model in ("big", "small", "p", "none"):
        for tokens in (1, 55, 100, 1000, 10**6):
            assert u.predict(model, tokens) == t.predict(model, tokens)
    t.train([(100, "big", 0.0)])
    t.save(path)  # overwrite in place
    assert AccuracyTable.load(path).count("big") == 5


@pytest.mark.parametrize("text,match", [
    ("{not json", r"acc.json:1: not valid JSON"),
    ("[]", "expected a JSON object"),
    ('{"version": 2}', "field 'version'"),
    ('{"version": 1, "extra": 1}', "field 'extra'"),
    ('{"version": 1, "shrinkage": -1}', "shrinkage"),
    ('{"version": 1, "priors": [0.5]}', "field 'priors'"),
    ('{"version": 1, "priors": {"m": "high"}}', "priors"),
    ('{"version": 1, "models": {"m": {"n": 0, "sum": 0, "buckets": {}}}}', "field 'models.m.n'"),
    ('{"version": 1, "models": {"m": {"n": 1, "sum": 2, "buckets": {"3": {"n": 1, "sum": 1}}}}}',
     "field 'models.m.sum'"),
    ('{"version": 1, "models": {"m": {"n": 2, "sum": 1, "buckets": {"3": {"n": 1, "sum": 1}}}}}',
     "field 'models.m.n': 2 rows but its buckets hold 1"),
    ('{"version": 1, "models": {"m": {"n": 1, "sum": 1, "buckets": {"x": {"n": 1, "sum": 1}}}}}',
     "field 'models.m.buckets.x'"),
])
def test_load_errors_name_file_and_field(tmp_path, text, match):
    path = tmp_path / "acc.json"
    path.write_text(text)
    with pytest.raises(EvaluationError, match=match) as e:
        AccuracyTable.load(path)
    assert str(path) in str(e.value)


def test_load_missing_file(tmp_path):
    with pytest.raises(EvaluationError, match="no such accuracy-table file"):
        AccuracyTable.load(tmp_path / "nope.json")


# --- evaluations CSV -----------------------------------------------------------------------------


def test_read_evaluations_any_column_order_extra_columns_blank_lines(tmp_path):
    path = tmp_path / "evals.csv"
    path.write_text("model,score,prompt_tokens,notes\nbig,1,100,ok\n\nsmall,0.25,7,\"a, b\"\n")
    rows = read_evaluations(path)
    assert rows == [EvaluationRow(100, "big", 1.0), EvaluationRow(7, "small", 0.25)]
    assert AccuracyTable().train(rows).predict("small", 7) == 0.25


@pytest.mark.parametrize("text,where", [
    ("prompt_tokens,model\n10,m\n", r":1: missing column\(s\) \['score'\]"),
    ("", r": empty; expected a header prompt_tokens,model,score"),
    ("prompt_tokens,model,score\n10,m,0.5\n10,m,1.5\n", r":3: field 'score': 1.5 is outside \[0, 1\]"),
    ("prompt_tokens,model,score\n10,m,-0.5\n", r":2: field 'score': -0.5 is outside \[0, 1\]"),
    ("prompt_tokens,model,score\n10,m,nan\n", r":2: field 'score': nan is outside \[0, 1\]"),
    ("prompt_tokens,model,score\n10,m,high\n", r":2: field 'score': 'high' is not a number"),
    ("prompt_tokens,model,score\n1e3,m,0.5\n", r":2: field 'prompt_tokens': '1e3' is not an integer"),
    ("prompt_tokens,model,score\n-4,m,0.5\n", r":2: field 'prompt_tokens': -4 is not an integer >= 0"),
    ("prompt_tokens,model,score\n10,,0.5\n", r":2: field 'model'"),
    ("prompt_tokens,model,score\n10,m,0.5\n10,m\n", r":3: field 'score': missing"),
])
def test_read_evaluations_errors_name_file_line_field(tmp_path, text, where):
    path = tmp_path / "evals.csv"
    path.write_text(text)
    with pytest.raises(EvaluationError, match=str(path).replace(".", r"\.") + where):
        read_evaluations(path)


def test_read_evaluations_missing_file(tmp_path):
    with pytest.raises(EvaluationError, match="no such evaluations file"):
        read_evaluations(tmp_path / "nope.csv")


# --- the choice ----------------------------------------------------------------------------------


def cands(*specs) -> list[Candidate]:
    """specs: (model, ttft_s, accuracy, cost) → candidates i0, i1, ..."""
    return [Candidate(f"i{k}", m, ttft, acc, cost) for k, (m, ttft, acc, cost) in enumerate(specs)]


FLEET = cands(
    ("large", 0.50, 0.90, 0.010),  # i0: most accurate, too slow for a 0.3 s limit
    ("medium", 0.20, 0.80, 0.004),  # i1
    ("small", 0.05, 0.60, 0.001),  # i2: cheapest
    ("medium", 0.25, 0.80, 0.004),  # i3: same terms as i1, later
)

CHOICE_TABLE = [
    # (name, candidates, limit, lambda, expected id, feasible)
    ("lambda 0 picks the most accurate within the limit", FLEET, 1.0, 0.0, "i0", True),
    ("the limit binds: the most accurate is too slow, next best", FLEET, 0.3, 0.0, "i1", True),
    ("ties go to the first candidate", FLEET, 0.3, 10.0, "i1", True),
    ("large lambda picks the cheapest feasible", FLEET, 0.3, 1e4, "i2", True),
    ("large lambda, loose limit: still the cheapest", FLEET, 1.0, 1e4, "i2", True),
    ("medium lambda trades accuracy for cost", FLEET, 1.0, 40.0, "i1", True),  # U: .50, .64, .56, .64
    ("only the cheap one is fast enough", FLEET, 0.1, 0.0, "i2", True),
    ("nothing feasible: the smallest TTFT", FLEET, 0.01, 0.0, "i2", False),
    ("nothing feasible, TTFT ties: the first", cands(("a", 0.5, 0.9, 0.0), ("b", 0.4, 0.1, 0.0), ("c", 0.4, 0.2, 0.0)),
     0.1, 0.0, "i1", False),
    ("an instance that cannot serve (inf) is never feasible",
     cands(("a", math.inf, 1.0, 0.0), ("b", 0.2, 0.5, 0.0)), 0.3, 0.0, "i1", True),
    ("exactly at the limit is feasible", cands(("a", 0.3, 0.9, 0.0), ("b", 0.1, 0.5, 0.0)), 0.3, 0.0, "i0", True),
]


@pytest.mark.parametrize("name,candidates,limit,lam,expected,feasible", CHOICE_TABLE, ids=[r[0] for r in CHOICE_TABLE])
def test_choice_table(name, candidates, limit, lam, expected, feasible):
    ch = choose_instance(candidates, Query(limit, "q1"), lam)
    assert (ch.instance_id, ch.feasible) == (expected, feasible)
    assert ch.chosen.instance_id == expected == candidates[ch.index].instance_id
    assert ch.model == candidates[ch.index].model


def test_choice_carries_every_candidates_terms():
    ch = choose_instance(FLEET, Query(0.3), 40.0)
    assert [t.instance_id for t in ch.terms] == ["i0", "i1", "i2", "i3"]
    assert [t.feasible for t in ch.terms] == [False, True, True, True]
    for t, c in zip(ch.terms, FLEET):
        assert (t.ttft_s, t.accuracy, t.cost) == (c.ttft_s, c.accuracy, c.cost)
        assert t.utility == pytest.approx(c.accuracy - 40.0 * c.cost)
    assert ch.utility == ch.chosen.utility
    assert (ch.lam, ch.ttft_limit_s) == (40.0, 0.3)
    d = ch.as_dict()
    assert d["instance"] == "i1" and len(d["candidates"]) == 4
    json.dumps(d)  # loggable as is
    assert ch.header_value().startswith("instance=i1; model=medium; feasible=1;")


def test_choice_does_not_mutate_and_is_deterministic():
    before = list(FLEET)
    a = choose_instance(FLEET, Query(0.3), 1.0)
    assert choose_instance(FLEET, Query(0.3), 1.0) == a
    assert FLEET == before


@pytest.mark.parametrize("lam", [-0.1, float("nan"), float("inf"), -float("inf"), "1", None])
def test_bad_lambda_names_lambda(lam):
    with pytest.raises(ValueError, match="lambda"):
        choose_instance(FLEET, Query(0.3), lam)


@pytest.mark.parametrize("limit", [0.0, -1.0, float("nan"), float("inf"), "0.3", None, True])
def test_bad_limit_names_ttft_limit(limit):
    with pytest.raises(ValueError, match="ttft_limit"):
        Query(limit)
    with pytest.raises(ValueError, match="ttft_limit"):  # any object with ttft_limit_s is checked too
        choose_instance(FLEET, SimpleNamespace(ttft_limit_s=limit), 0.0)


def test_no_candidates_is_no_capacity():
    with pytest.raises(NoCapacity):
        choose_instance([], Query(0.3), 0.0)


@pytest.mark.parametrize("bad,match", [
    (Candidate("x", "m", float("nan"), 0.5, 0.0), "candidate 1 \\('x'\\): ttft_s"),
    (Candidate("x", "m", -0.1, 0.5, 0.0), "ttft_s"),
    (Candidate("x", "m", 0.1, 1.5, 0.0), "accuracy"),
    (Candidate("x", "m", 0.1, float("nan"), 0.0), "accuracy"),
    (Candidate("x", "m", 0.1, 0.5, -1.0), "cost"),
    (Candidate("x", "m", 0.1, 0.5, float("inf")), "cost"),
])
def test_bad_candidates_are_named(bad, match):
    with pytest.raises(ValueError, match=match):
        choose_instance([FLEET[0], bad], Query(0.3), 0.0)


def test_end_to_end_table_prices_and_limit():
    """The pieces together: accuracy from history, cost from prices, TTFT from the estimator's numbers."""
    table = AccuracyTable(shrinkage=0.0).train([(500, "large", 0.9), (500, "small", 0.6)])
    prices = {"large": ModelPrices(1e-5, 3e-5), "small": ModelPrices(1e-6, 3e-6)}
    ttft = {"large": 0.4, "small": 0.08}
    prompt, out = 500, 200
    c = [Candidate(f"{m}-0", m, ttft[m], table.predict(m, prompt), cost_estimate(prices[m], prompt, out))
         for m in ("large", "small")]
    assert choose_instance(c, Query(0.5), 0.0).model == "large"
    assert choose_instance(c, Query(0.2), 0.0).model == "small"  # latency-aware: large is too slow
    assert choose_instance(c, Query(0.5), 100.0).model == "small"  # 0.9 − 1.1 < 0.6 − 0.11
