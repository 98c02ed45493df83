"""Does a greedy continuation recomputed from prompt + the first k output tokens give the rest of
the uninterrupted answer? What a migrated decode does (the new instance prefills prompt + the
tokens already sent), measured on vLLM alone: no router, no Ray, no NIXL.

Usage (from the repository root):

    python benchmarks/recompute_divergence.py --dtype auto --dtype float32 --json runs/recompute.json

For each dtype, prompt and cut k: the uninterrupted greedy answer (`--max-tokens`, EOS ignored),
then the greedy answer of prompt + its first k tokens; prints whether the two agree after k and,
if not, the first output position where they differ. The tiny offline model (`disagg tiny-model`)
by default; `--model` for another. bf16 prefill and decode kernels need not round alike (on CPUs
with AMX they do not), so an answer can fork at a near-tie; a fork says nothing about the router.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

PROMPTS = ("A decode engine dies mid-answer; the router carries on:", "The router prices every candidate by",
           "def kv_cache(x):")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", help="model folder (default: the tiny offline model, built if missing)")
    p.add_argument("--dtype", action="append", help="engine dtype, repeatable (default: auto)")
    p.add_argument("--max-tokens", type=int, default=400)
    p.add_argument("--cuts", type=int, nargs="+", default=[3, 5, 10, 50, 200],
                   help="k: tokens kept before the recompute")
    p.add_argument("--json", type=Path, help="also write the results here")
    a = p.parse_args(argv)
    if any(not 0 < k < a.max_tokens for k in a.cuts):
        p.error(f"--cuts must lie in (0, --max-tokens={a.max_tokens})")
    return a


def measure(model: str, dtype: str, max_tokens: int, cuts: list[int]) -> list[dict]:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(model=model, dtype=dtype, enforce_eager=True, max_model_len=2048, kv_cache_memory_bytes=64 << 20,
              max_num_seqs=8, max_num_batched_tokens=2048, enable_prefix_caching=False)
    tokenizer = llm.get_tokenizer()

    def greedy(ids: list[int], n: int) -> list[int]:
        sp = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
        return list(llm.generate([TokensPrompt(prompt_token_ids=ids)], sp, use_tqdm=False)[0].outputs[0].token_ids)

    rows = []
    for prompt in PROMPTS:
        ids = tokenizer.encode(prompt)
        whole = greedy(ids, max_tokens)
        for k in cuts:
            rest = greedy(ids + whole[:k], max_tokens - k)
            fork = next((k + i for i, (a, b) in enumerate(zip(rest, whole[k:])) if a != b), None)
            rows.append({"dtype": dtype, "prompt": prompt, "k": k, "same": fork is None, "first_difference_at": fork})
            print(json.dumps(rows[-1]), flush=True)
    del llm
    return rows


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    model = a.model
    if model is None:
        from serve_app.tiny_model import build_tiny_model
        model = str(build_tiny_model())
    rows = [r for dtype in a.dtype or ["auto"] for r in measure(model, dtype, a.max_tokens, a.cuts)]
    for dtype in a.dtype or ["auto"]:
        mine = [r for r in rows if r["dtype"] == dtype]
        print(f"{dtype}: {sum(r['same'] for r in mine)} of {len(mine)} recomputed continuations agree")
    if a.json:
        from disagg.bench.script import write_result
        write_result(a.json, {"model": model, "max_tokens": a.max_tokens, "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
