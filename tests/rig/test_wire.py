"""The stand-in engine reads vLLM's objects without vLLM: what crosses Ray unpickles on each side."""

from __future__ import annotations

import pickle
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

_READ_WITHOUT_VLLM = """
import pickle, sys
from serve_app.engine_standin import install_wire_types
install_wire_types({names!r})
params = pickle.loads({raw!r})
print(params.max_tokens, params.temperature, params.output_kind.name, "torch" in sys.modules, "vllm.outputs" in sys.modules)
"""


def test_sampling_params_unpickle_in_a_process_without_vllm():
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    from serve_app.engine_standin import vllm_wire_names

    raw = pickle.dumps(SamplingParams(max_tokens=7, temperature=0.5, output_kind=RequestOutputKind.DELTA))
    code = _READ_WITHOUT_VLLM.format(names=vllm_wire_names(), raw=raw)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["7", "0.5", "DELTA", "False", "False"]


def test_a_stand_ins_output_unpickles_as_vllms_completion_output():
    from vllm.outputs import CompletionOutput, RequestOutput

    from serve_app.engine_standin import WireOutput

    first = pickle.loads(pickle.dumps(WireOutput(0, " a", [100], None)))
    last = pickle.loads(pickle.dumps(WireOutput(0, " a a", [100, 100], "length")))
    assert isinstance(first, CompletionOutput) and first.token_ids == [100] and first.finish_reason is None
    whole = RequestOutput("r", None, [1, 2], None, [first], finished=False)
    whole.add(RequestOutput("r", None, [1, 2], None, [last], finished=True), aggregate=True)
    assert whole.outputs[0].token_ids == [100, 100, 100] and whole.outputs[0].finish_reason == "length"
