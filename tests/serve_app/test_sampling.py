"""The copies of a request's `SamplingParams` each engine call runs with (`serve_app.sampling`)."""

import pytest

pytest.importorskip("vllm")

from vllm import SamplingParams  # noqa: E402
from vllm.sampling_params import RequestOutputKind, StructuredOutputsParams  # noqa: E402

from serve_app.sampling import (  # noqa: E402
    continuation_params, decode_params, prefill_params, replaced, sample_params,
)


def _request(**kw) -> SamplingParams:
    base = {"max_tokens": 10, "temperature": 0.7, "seed": 5, "n": 3, "stop": ["\n\n"], "min_tokens": 3,
            "logprobs": 2, "prompt_logprobs": 1, "structured_outputs": StructuredOutputsParams(regex="[ab]+"),
            "output_kind": RequestOutputKind.DELTA, "extra_args": {"tag": "x"}}
    return SamplingParams(**{**base, **kw})


def test_a_copy_recomputes_what_sampling_params_derive():
    p = _request()
    assert p.output_text_buffer_length == 1  # held back for the stop string "\n\n"
    q = replaced(p, stop=None)
    assert q.stop == [] and q.output_text_buffer_length == 0 and p.stop == ["\n\n"]
    assert replaced(p, stop_token_ids=[9]).all_stop_token_ids == {9}


def test_the_prefill_runs_one_token_keeps_the_prompt_logprobs_and_publishes_its_kv():
    p = prefill_params(_request())
    assert (p.n, p.max_tokens, p.min_tokens, p.stop, p.logprobs, p.structured_outputs) == (1, 1, 0, [], None, None)
    assert p.prompt_logprobs == 1 and p.output_kind == RequestOutputKind.FINAL_ONLY
    assert p.extra_args == {"tag": "x", "kv_transfer_params": {"do_remote_decode": True}}


def test_samples_take_vllms_seeds_and_only_the_first_asks_for_the_prompt():
    p = _request()
    seeds = [sample_params(p, i).seed for i in range(3)]
    assert seeds == [5, 6, 7]  # vLLM's ParentRequest: seed + index
    assert [sample_params(p, i).prompt_logprobs for i in range(3)] == [1, None, None]
    assert all(sample_params(p, i).n == 1 for i in range(3))
    assert sample_params(_request(seed=None), 2).seed is None


def test_a_decode_pulling_kv_leaves_the_prompt_logprobs_to_the_prefill():
    p = sample_params(_request(), 0)
    pulled = decode_params(p, {"remote_engine_id": "e"})
    assert pulled.prompt_logprobs is None and pulled.extra_args["kv_transfer_params"] == {"remote_engine_id": "e"}
    local = decode_params(p, None)
    assert local.prompt_logprobs == 1 and "kv_transfer_params" not in (local.extra_args or {})
    assert local.output_kind == RequestOutputKind.DELTA and local.structured_outputs is not None


def test_a_continuation_has_fewer_tokens_left_and_no_stop_strings():
    p = sample_params(_request(), 0)
    c = continuation_params(p, 2)
    assert (c.max_tokens, c.min_tokens, c.stop, c.prompt_logprobs) == (8, 1, [], None)
    assert continuation_params(p, 5).min_tokens == 0
    assert p.max_tokens == 10 and p.stop == ["\n\n"]  # not changed in place
