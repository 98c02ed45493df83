"""Offline tiny models: a Qwen2-architecture LLM that vLLM can load, built without a model hub.

No machine this project runs on can download weights, yet every test of the real stack needs a
model. This module builds one in about a second from nothing but local, deterministic inputs:

* a byte-level BPE tokenizer trained with `tokenizers` on a corpus generated here from a fixed
  word list and a seeded RNG (so the tokenizer is identical on every machine and Python version);
  specials `<|endoftext|>`, `<|im_start|>`, `<|im_end|>`, eos `<|im_end|>`, a ChatML chat
  template, saved as a `PreTrainedTokenizerFast`;
* a randomly initialised `Qwen2ForCausalLM` with a fixed torch seed. `initializer_range=0.3`
  (instead of the usual 0.02) spreads the logits enough that greedy output does not collapse onto
  one token, so "token-identical output" tests actually mean something.

Sizes (`size=`):
    tiny:  hidden 128, 2 layers, 4 heads, 2 KV heads (~0.75 M parameters, ~1.5 MB)
    small: hidden 256, 4 layers, 4 heads, 2 KV heads (the "second, bigger model")

Where it goes: `$DISAGG_CACHE_DIR/models/<size>-qwen2`. `DISAGG_CACHE_DIR` defaults to `<repo>/.cache`
when running from a source checkout (the folder holding pyproject.toml), else `~/.cache/disagg`.

Concurrency and idempotence: the model is built into a temporary sibling folder, a marker file is
written last, then the folder is renamed into place (atomic on one filesystem). A folder with the
marker is complete and is returned as is; one without it (a crash mid-build) is rebuilt. Two
processes racing to build both succeed; the loser discards its copy.

CLI: `python -m serve_app.tiny_model [--dest D] [--size tiny|small]` prints the path.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

MARKER = ".disagg-model-complete"
"""File written last into a finished model folder; its presence means "complete"."""

# Bump when anything below changes the produced files: an old cached model is then rebuilt.
RECIPE_VERSION = 3

EOT, IM_START, IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


@dataclass(frozen=True, slots=True)
class ModelSize:
    """Architecture of one named size. All sizes share the tokenizer recipe."""

    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    intermediate_size: int


SIZES: dict[str, ModelSize] = {
    "tiny": ModelSize(hidden_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, intermediate_size=512),
    "small": ModelSize(hidden_size=256, num_hidden_layers=4, num_attention_heads=4,
                       num_key_value_heads=2, intermediate_size=1024),
}

VOCAB_SIZE = 2048
MAX_POSITION_EMBEDDINGS = 4096
INITIALIZER_RANGE = 0.3
SEED = 0

# A fixed word list: the corpus is generated from it with a seeded RNG, so it never depends on
# what happens to be installed on the machine.
_WORDS = """
the of and to in is was for on that with as by at from it be this are or an which have has
not but were all their they one can more also its other new two been first time after into
some would only when there than these where what about who how many most such over through
model token request prefill decode cache memory engine router latency throughput batch queue
prompt output input length budget cost price signal pressure block transfer network server
replica cluster node worker process thread core machine deploy scale config policy schedule
estimate predict measure simulate calibrate route serve stream answer question reason explain
data value number system program function method class object string list table file path
python code test build run start stop wait read write send receive open close return yield
red green blue small large fast slow early late good bad high low long short first last next
city river mountain forest ocean planet star light sound water fire earth wind stone tree
people world year day week hour minute second month history science language music art book
""".split()

_PUNCT = [".", ",", ";", ":", "?", "!", " -", " (", ")", "'", '"']


def _corpus(num_lines: int = 4000, seed: int = SEED) -> list[str]:
    """Deterministic training text: sentences, numbers, code-like lines and ChatML turns."""
    rng = random.Random(seed)
    lines: list[str] = []
    for i in range(num_lines):
        kind = i % 5
        if kind == 0:  # prose
            words = [rng.choice(_WORDS) for _ in range(rng.randint(6, 24))]
            words[0] = words[0].capitalize()
            text = " ".join(words)
            for _ in range(rng.randint(0, 2)):
                pos = rng.randint(1, len(text) - 1)
                text = text[:pos] + rng.choice(_PUNCT) + text[pos:]
            lines.append(text + rng.choice([".", "?", "!"]))
        elif kind == 1:  # numbers and units
            lines.append(f"{rng.choice(_WORDS)} {rng.randint(0, 100000)} "
                         f"{rng.random():.3f} {rng.choice(['ms', 's', 'MB', 'GB', '%'])}")
        elif kind == 2:  # code-like
            a, b = rng.choice(_WORDS), rng.choice(_WORDS)
            lines.append(f"def {a}_{b}(x, y={rng.randint(0, 9)}):\n    return x.{a}(y) + {b}[{i}]")
        elif kind == 3:  # ChatML turn
            q = " ".join(rng.choice(_WORDS) for _ in range(rng.randint(3, 12)))
            a = " ".join(rng.choice(_WORDS) for _ in range(rng.randint(3, 20)))
            lines.append(f"{IM_START}user\n{q}?{IM_END}\n{IM_START}assistant\n{a}.{IM_END}")
        else:  # upper case, mixed case and all printable ASCII
            lines.append(" ".join(rng.choice(_WORDS).upper() for _ in range(4))
                         + " " + "".join(chr(c) for c in range(33, 127)))
    return lines


def default_cache_dir() -> Path:
    """`$DISAGG_CACHE_DIR`, else `<repo>/.cache` from a source checkout, else `~/.cache/disagg`."""
    env = os.environ.get("DISAGG_CACHE_DIR")
    if env:
        return Path(env).expanduser()
    repo = Path(__file__).resolve().parents[2]
    if (repo / "pyproject.toml").is_file():
        return repo / ".cache"
    return Path.home() / ".cache" / "disagg"


def default_model_dir(size: str = "tiny") -> Path:
    """Where `build_tiny_model(size=size)` puts the model when no `dest` is given."""
    _check_size(size)
    return default_cache_dir() / "models" / f"{size}-qwen2"


def is_complete(path: Path) -> bool:
    """True if `path` holds a finished model of the current recipe version."""
    marker = path / MARKER
    if not marker.is_file():
        return False
    try:
        return json.loads(marker.read_text()).get("recipe_version") == RECIPE_VERSION
    except (OSError, ValueError):
        return False


def build_tiny_model(dest: Path | None = None, size: str = "tiny") -> Path:
    """Return the folder of a complete offline model of `size`, building it if needed.

    Idempotent and safe to call from several processes at once (see the module docstring).
    `dest` is the model folder itself (default: `default_model_dir(size)`).
    """
    _check_size(size)
    dest = Path(dest) if dest is not None else default_model_dir(size)
    dest = dest.expanduser().resolve()
    if is_complete(dest):
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.building-", dir=dest.parent))
    try:
        _build_into(tmp, size)
        tmp.chmod(0o755)  # mkdtemp makes it 0700; the model is read by other users' processes too
        if dest.exists() and not is_complete(dest):
            shutil.rmtree(dest, ignore_errors=True)  # left behind by a crash or an older recipe
        try:
            os.rename(tmp, dest)
        except OSError:
            if not is_complete(dest):  # not a lost race: a real failure
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return dest


def resolve_model(source: str) -> str:
    """A config's `model.source` as vLLM loads it: 'tiny:tiny' / 'tiny:small' → the offline tiny
    model's folder (built once); anything else as given."""
    if source.startswith("tiny:"):
        return str(build_tiny_model(size=source.split(":", 1)[1]))
    return source


def _check_size(size: str) -> None:
    if size not in SIZES:
        raise ValueError(f"unknown model size {size!r}; allowed: {', '.join(SIZES)}")


def _build_into(out: Path, size: str) -> None:
    """Write tokenizer, config and weights into `out`, the marker file last."""
    # Heavy imports stay here so importing this module (e.g. for default_model_dir) is cheap.
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import GenerationConfig, PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

    # --- tokenizer -------------------------------------------------------------------------
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=[EOT, IM_START, IM_END],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # every byte encodable
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(), trainer=trainer)
    hf_tok = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=IM_END,
        pad_token=EOT,
        unk_token=None,
        bos_token=None,
        additional_special_tokens=[IM_START],
        model_max_length=MAX_POSITION_EMBEDDINGS,
        clean_up_tokenization_spaces=False,
    )
    hf_tok.chat_template = CHATML_TEMPLATE
    hf_tok.save_pretrained(out)

    # --- model -----------------------------------------------------------------------------
    arch = SIZES[size]
    eos_id = hf_tok.convert_tokens_to_ids(IM_END)
    pad_id = hf_tok.convert_tokens_to_ids(EOT)
    config = Qwen2Config(
        vocab_size=len(hf_tok),
        hidden_size=arch.hidden_size,
        intermediate_size=arch.intermediate_size,
        num_hidden_layers=arch.num_hidden_layers,
        num_attention_heads=arch.num_attention_heads,
        num_key_value_heads=arch.num_key_value_heads,
        max_position_embeddings=MAX_POSITION_EMBEDDINGS,
        initializer_range=INITIALIZER_RANGE,
        tie_word_embeddings=True,
        bos_token_id=pad_id,
        eos_token_id=eos_id,
        pad_token_id=pad_id,
    )
    # bfloat16 weights: what vLLM's CPU platform runs anyway (it casts a float32 checkpoint to
    # bf16 and warns per tensor), and half the size. Initialised in fp32, then cast.
    config.dtype = torch.bfloat16
    state = torch.random.get_rng_state()
    try:
        torch.manual_seed(SEED)
        model = Qwen2ForCausalLM(config).to(torch.bfloat16).eval()
    finally:
        torch.random.set_rng_state(state)
    model.generation_config = GenerationConfig(
        bos_token_id=pad_id, eos_token_id=eos_id, pad_token_id=pad_id
    )
    model.save_pretrained(out, safe_serialization=True)

    for f in out.iterdir():  # some writers create 0600 files; the model is shared read-only
        f.chmod(0o644)
    (out / MARKER).write_text(json.dumps(
        {"recipe_version": RECIPE_VERSION, "size": size, **asdict(arch),
         "vocab_size": len(hf_tok), "eos_token_id": eos_id}, indent=2) + "\n")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Build (once) an offline tiny Qwen2 model; print its path.")
    parser.add_argument("--dest", type=Path, default=None, help="model folder (default: the cache)")
    parser.add_argument("--size", choices=sorted(SIZES), default="tiny")
    args = parser.parse_args(argv)
    print(build_tiny_model(args.dest, size=args.size))


if __name__ == "__main__":
    main()
