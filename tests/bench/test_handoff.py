"""benchmarks/handoff.py: the hand-off's tables from a validation's request logs."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("handoff", ROOT / "benchmarks" / "handoff.py")
handoff = importlib.util.module_from_spec(spec)
spec.loader.exec_module(handoff)


def _record(sent, e2e, ttft, prompt, prefill_engine_s, decode_first_s, router_first_s, crossed=True, **kw):
    route = {"decode_engine_first_s": str(decode_first_s), "router_first_s": str(router_first_s)}
    if crossed:
        route["prefill_engine_s"] = str(prefill_engine_s)
    return {"system": "live", "trace": "t", "policy": "p", "rate": 1.5, "sent_s": sent, "e2e_s": e2e,
            "ttft_s": ttft, "prompt_tokens": prompt, "prefill_id": "prefill-a",
            "decode_id": "decode-b" if crossed else "prefill-a", "route": route, **kw}


def _validate_folder(tmp_path: Path, repeats: list[list[dict]]) -> Path:
    for i, records in enumerate(repeats):
        d = tmp_path / "rate-1.5" / f"repeat-{i + 1}"
        d.mkdir(parents=True)
        (d / "requests.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return tmp_path


def test_time_outside_the_engines_is_binned_by_the_requests_in_flight_of_its_own_run(tmp_path):
    first = _record(0.0, 1.0, 0.100, 64, 0.020, 0.030, 0.080)  # 50 ms outside, 30 of it in the router
    second = _record(0.5, 1.0, 0.060, 64, 0.0, 0.040, 0.050, crossed=False)  # one engine, one in flight
    other_repeat = _record(0.5, 1.0, 0.060, 64, 0.0, 0.040, 0.050, crossed=False)  # its own run
    sim = {**first, "system": "sim"}  # only live requests count
    runs = handoff.live_runs(handoff.read_validate(_validate_folder(tmp_path, [[first, second, sim], [other_repeat]])))
    rows = handoff.outside_by_load(runs)
    by = {(r["path"], r["in_flight"]): r for r in rows}
    assert by["disaggregated", "0"]["outside_p50_s"] == pytest.approx(0.050)
    assert by["disaggregated", "0"]["router_p50_s"] == pytest.approx(0.030)
    assert by["one engine", "1"]["n"] == 1 and by["one engine", "0"]["n"] == 1
    assert by["one engine", "1"]["outside_p50_s"] == pytest.approx(0.020)


def test_a_hand_off_is_binned_by_the_prompt_waiting_on_its_prefill_engine(tmp_path):
    # the first request's prefill ends 60 ms after it was sent (router_first − decode first): the
    # second, sent 1 ms after the first, is waiting then; the third comes later and waits for nothing
    first = _record(0.0, 1.0, 0.2, 64, 0.010, 0.100, 0.160)
    second = _record(0.001, 1.0, 0.3, 2000, 0.050, 0.020, 0.100)
    third = _record(5.0, 1.0, 0.1, 64, 0.010, 0.020, 0.060)
    runs = handoff.live_runs(handoff.read_validate(_validate_folder(tmp_path, [[first, second, third]])))
    rows = {r["queued_tokens"]: r for r in handoff.first_token_by_queued_prefill(runs)}
    assert rows["1500+"]["n"] == 1 and rows["1500+"]["decode_first_p50_s"] == pytest.approx(0.100)
    assert rows["0"]["n"] == 2


def test_a_folder_without_live_runs_is_a_message_naming_it(tmp_path):
    with pytest.raises(SystemExit, match="not a `disagg validate --out` folder"):
        handoff.read_validate(tmp_path)
    d = _validate_folder(tmp_path / "v", [[]])
    (d / "rate-1.5" / "repeat-1" / "requests.jsonl").write_text("{broken\n")
    with pytest.raises(SystemExit, match=r"requests.jsonl:1: not a JSON record"):
        handoff.read_validate(d)
