"""vLLM's own serving benchmark, an outside client, drives our ingress (benchmarks/vllm_bench_serve.py)."""

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.stack
ROOT = Path(__file__).resolve().parents[2]


def test_vllm_bench_serve_completes_every_request_through_our_ingress(stack):
    cmd = [sys.executable, str(ROOT / "benchmarks" / "vllm_bench_serve.py"), "--backend", "openai",
           "--base-url", stack.base_url, "--endpoint", "/v1/completions", "--model", "tiny-qwen2",
           "--dataset-name", "random", "--random-input-len", "64", "--random-output-len", "8",
           "--num-prompts", "8", "--request-rate", "4", "--ignore-eos", "--seed", "1"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    lines = {k.strip(): v.strip() for k, _, v in (ln.partition(":") for ln in out.splitlines() if ":" in ln)}
    assert lines.get("Successful requests") == "8" and lines.get("Failed requests") == "0", out[-3000:]
