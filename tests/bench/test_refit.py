"""`disagg.bench.refit`: which runs are fitted for again; the fit itself is the start-up fit's
command (`live_fit_argv`), run live by the session's stack (tests/conftest.py)."""

from __future__ import annotations

import json

import pytest

from disagg.bench.harness import BenchError
from disagg.bench.refit import before_run, finished
from disagg.cli.common import as_typed, live_fit_argv


def test_a_run_is_fitted_for_once_and_never_again_under_other_constants(tmp_path):
    fits = []
    fresh, done, begun = tmp_path / "fresh", tmp_path / "done", tmp_path / "begun"
    done.mkdir()
    (done / "results.json").write_text(json.dumps({"resolved": {"capacity": {}}}))
    begun.mkdir()
    (begun / "settings.json").write_text("{}")
    assert before_run(fresh, lambda: fits.append("fresh"), lambda m: None) is None
    assert before_run(done, lambda: fits.append("done"), lambda m: None) == {"resolved": {"capacity": {}}}
    assert fits == ["fresh"] and finished(done) == {"resolved": {"capacity": {}}} and finished(fresh) is None
    with pytest.raises(BenchError, match=f"{begun} was begun.*remove the folder"):
        before_run(begun, lambda: fits.append("begun"), lambda m: None)
    assert fits == ["fresh"]  # a begun run is never re-fitted under: it would resume against other constants


def test_the_fit_command_measures_the_host_only_where_engines_share_it():
    cpu = live_fit_argv("http://127.0.0.1:8000", "tiny-qwen2", "runs/x.yaml", True, 30)
    gpu = live_fit_argv("http://127.0.0.1:8000", "tiny-qwen2", "runs/x.yaml", False, 30)
    assert cpu[1:6] == ["-m", "disagg.cli", "calibrate", "--live", "--url"] and "--apply" in cpu
    assert cpu[-3:] == ["--host", "--settle-s", "30"] and "--host" not in gpu
    assert as_typed(gpu) == ("disagg calibrate --live --url http://127.0.0.1:8000 --quick --url-requests 8 "
                             "--model tiny-qwen2 --out runs/x.yaml --apply")  # what a failed fit says to type
