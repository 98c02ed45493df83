"""The copies of a request's vLLM `SamplingParams` that each engine call runs with.

vLLM's OpenAI layer, in the router, turns a request into one `SamplingParams`
(`to_sampling_params`). The P/D path runs it as several engine calls, each with its own copy:
- the prefill (`prefill_params`): one token, its KV published for a remote decode; what shapes only
  decoded tokens is dropped (its token is never output, and e.g. a stop token or `min_tokens` would
  keep it from publishing its KV); `prompt_logprobs` stays: the prefill is where the prompt is
  computed, so `echo` and `prompt_logprobs` come from there;
- each decode (`decode_params`): one sample (the router fans `n` out itself: `sample_params`),
  streamed as deltas, pulling the KV when given `kv_transfer_params`; `prompt_logprobs` only where
  the decode computes the prompt itself;
- a migrated decode's continuation (`continuation_params`): fewer tokens left, and the stop strings
  applied by the router (`router_text`), not the engine.

A copy is made by constructing anew (`replaced`), never by mutating a clone: `SamplingParams`
derives fields at construction (the stop-string hold-back, the stop-token set, whether to read
the prefix cache), and a mutated clone would keep the old ones.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from vllm import SamplingParams

# derived by SamplingParams.__post_init__ from the other fields: recomputed, never copied
_DERIVED = frozenset({"output_text_buffer_length", "skip_reading_prefix_cache"})


def replaced(params: SamplingParams, **changes: Any) -> SamplingParams:
    """A new `SamplingParams` equal to `params` but for `changes` (derived fields recomputed)."""
    from vllm import SamplingParams

    kept = {f: getattr(params, f) for f in params.__struct_fields__ if not f.startswith("_") and f not in _DERIVED}
    return SamplingParams(**{**kept, **changes})


def _with_kv(params: SamplingParams, kv_transfer_params: dict | None) -> dict | None:
    """`params.extra_args` with the KV-transfer parameters of this call (none: without them)."""
    extra = {k: v for k, v in (params.extra_args or {}).items() if k != "kv_transfer_params"}
    if kv_transfer_params:
        extra["kv_transfer_params"] = dict(kv_transfer_params)
    return extra or None


def prefill_params(params: SamplingParams) -> SamplingParams:
    """The prefill's copy: one token, no stop rules, no grammar, no output logprobs, the final
    output only, its KV kept for a remote decode; `prompt_logprobs` as asked."""
    from vllm.sampling_params import RequestOutputKind

    return replaced(params, n=1, max_tokens=1, min_tokens=0, stop=None, stop_token_ids=None,
                    include_stop_str_in_output=False, ignore_eos=False, logprobs=None, structured_outputs=None,
                    output_kind=RequestOutputKind.FINAL_ONLY,
                    extra_args=_with_kv(params, {"do_remote_decode": True}))


def sample_params(params: SamplingParams, index: int) -> SamplingParams:
    """Sample `index` of an `n > 1` request as a request of its own, as vLLM's own fan-out makes it
    (`ParentRequest`): one sample, and a seed of `seed + index` when the request has a seed. The
    prompt's logprobs come with sample 0 only (asking for them again would also keep the others
    from reading the prefix cache that sample 0 filled)."""
    seed = None if params.seed is None else params.seed + index
    changes: dict[str, Any] = {"n": 1, "seed": seed}
    if index:
        changes["prompt_logprobs"] = None
    return replaced(params, **changes)


def decode_params(params: SamplingParams, kv_transfer_params: dict | None) -> SamplingParams:
    """A decode's copy, streamed as deltas. With `kv_transfer_params` the prompt's KV is pulled,
    not computed here, so its logprobs come from the prefill instead (`prefill_params`)."""
    from vllm.sampling_params import RequestOutputKind

    changes: dict[str, Any] = {"output_kind": RequestOutputKind.DELTA,
                               "extra_args": _with_kv(params, kv_transfer_params)}
    if kv_transfer_params:
        changes["prompt_logprobs"] = None
    return replaced(params, **changes)


def continuation_params(params: SamplingParams, generated: int) -> SamplingParams:
    """The copy that continues a single-sample completion after `generated` of its tokens, once those
    are part of the prompt: fewer tokens left to generate and to force, no stop strings (the router
    applies them to the text it makes), no prompt logprobs (sent already)."""
    return replaced(params, max_tokens=params.max_tokens - generated, min_tokens=max(0, params.min_tokens - generated),
                    stop=None, include_stop_str_in_output=False, prompt_logprobs=None)
