"""`disagg check-config` and `disagg calibrate`'s config handling, for every shipped deployment."""

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "disagg.cli", *args], capture_output=True, text=True, timeout=120,
                          cwd=ROOT)


@pytest.mark.parametrize("config, expect", [
    ("local.yaml", ["1 prefill + 2 decode on cpu", "cost model cpu-tiny"]),
    ("disagg.yaml", ["2 prefill + 4 decode on cuda"]),
    ("local-multi.yaml", ["'disagg-multi/tiny-qwen2' ok: 1 colocated on cpu", "cost model cpu-tiny-qwen2 (inline)",
                          "'disagg-multi/small-qwen2' ok: 1 colocated on cpu"]),
])
def test_check_config_describes_every_shipped_deployment(config, expect):
    r = cli("check-config", str(ROOT / "deployments" / config))
    assert r.returncode == 0, r.stderr
    for text in expect:
        assert text in r.stdout


def test_calibrate_asks_which_model_of_a_multi_model_config_before_starting_anything(tmp_path):
    out = tmp_path / "cm.yaml"
    multi = str(ROOT / "deployments" / "local-multi.yaml")
    r = cli("calibrate", "--config", multi, "--out", str(out))
    assert r.returncode == 2 and "serves 2 models (tiny-qwen2, small-qwen2)" in r.stderr and "--model" in r.stderr
    r = cli("calibrate", "--config", multi, "--model", "large-qwen2", "--out", str(out))
    assert r.returncode == 2 and "--model 'large-qwen2'" in r.stderr and "tiny-qwen2, small-qwen2" in r.stderr
    r = cli("calibrate", "--config", str(ROOT / "deployments" / "local.yaml"), "--url", "http://127.0.0.1:9",
            "--out", str(out))
    assert r.returncode == 2 and "cannot reach http://127.0.0.1:9" in r.stderr
    assert not out.exists()
