"""One served model as the router holds it: its engine pools, tokenizer, P/D policy, cost model and
output-length predictor.

With several models (a `MultiModelConfig`) each model keeps its own of all of these, and a request
naming a model is routed within that model's pools only; its instance ids are prefixed with
`<served name>:`. The P/D policy and the cost model can be swapped at run time (`/admin/*`).

Before rendering, `too_long` refuses a prompt that cannot fit from its size alone: one token never
covers more characters than the longest entry of the vocabulary (`max_token_chars`: byte-level BPE
spells a token with one character per byte, and a token's text never has more characters than its
bytes), so a prompt of more than `max_model_len × max_token_chars × PROMPT_CHARS_MARGIN` characters
has more than `max_model_len` tokens. The margin covers normalizers that merge characters before
tokenizing (NFC composing a letter and its accent). The bound only refuses what cannot fit; prompts
under it are tokenized and measured exactly.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ray.serve.handle import DeploymentHandle

from disagg.core.cost_model import CostModel
from disagg.core.policies import Policy, build_policy
from disagg.core.predictor import BucketMeanPredictor
from disagg.core.prefix_index import PrefixIndex
from disagg.core.types import Role
from disagg.core.utility import ModelPrices
from serve_app.config import AppConfig, load_cost_model
from serve_app.tiny_model import resolve_model
from serve_app.openai_api import ApiError

PROMPT_CHARS_MARGIN = 2  # see the module docstring: characters a normalizer may merge away


@dataclass(slots=True)
class ServedModel:
    """One served model: its pools, tokenizer, P/D policy, cost model and predictor."""

    name: str
    cfg: AppConfig
    handles: dict[Role, DeploymentHandle]
    tokenizer: Any
    cost_model: CostModel
    policy: Policy
    policy_params: dict
    predictor: BucketMeanPredictor
    id_prefix: str  # instance ids: <prefix><role>-<replica>
    prices: ModelPrices | None = None
    streams: dict[Role, Any] = field(default_factory=dict)  # every pool's handle in streaming mode
    max_token_chars: int = 0  # the longest vocabulary entry, in characters (0: unknown, no pre-check)
    prefix_index: PrefixIndex | None = None  # which prefixes each instance holds; from the first engine report on
    surface: Any = None  # vLLM's OpenAI layer for this model (`openai_surface.ServingSurface`)
    vocab_size: int = 0  # token ids at or above it are no token of this model

    def __post_init__(self) -> None:
        # a prefill engine streams too when the policy serves a request whole there (`Policy.may_host`)
        self.streams = {role: h.options(stream=True) for role, h in self.handles.items()}
        if not self.max_token_chars:
            self.max_token_chars = max_token_chars(self.tokenizer)
        self.vocab_size = self.vocab_size or len(self.tokenizer)

    @classmethod
    def build(cls, name: str, cfg: AppConfig, handles: dict[str, DeploymentHandle], prices: ModelPrices | None,
              prefixed: bool, replica_index: int = 0, surface: Any = None) -> "ServedModel":
        """From the model's config and its pools' handles ({role value: handle}). `surface`: vLLM's
        OpenAI layer for the model (`openai_surface.build_surface`), whose tokenizer the router counts
        tokens with (None: the model's tokenizer alone). `prefixed`: the app serves several models, so
        instance ids name the model; `replica_index`: this router replica's rank (its policy's
        tie-break seed is derived from it)."""
        cm = load_cost_model(cfg.router.cost_model)
        tokenizer = surface.tokenizer if surface is not None else _tokenizer(cfg.model.source)
        return cls(name=name, cfg=cfg, handles={Role(r): h for r, h in handles.items()},
                   tokenizer=tokenizer, cost_model=cm, surface=surface,
                   policy=build_policy(cfg.router.policy, cm, cfg.router.policy_params).for_replica(replica_index),
                   policy_params=dict(cfg.router.policy_params), predictor=BucketMeanPredictor(),
                   id_prefix=f"{name}:" if prefixed else "", prices=prices)


    @property
    def decode_role(self) -> Role:
        """The role of the engines that decode (and first-token) this model's requests."""
        return Role.BOTH if self.cfg.is_colocated else Role.DECODE

    @property
    def start_role(self) -> Role:
        """The role of the engines a request of this model starts on (the alias route's candidates)."""
        return Role.BOTH if self.cfg.is_colocated else Role.PREFILL

    def too_long(self, sizes: list[tuple[int, bool]], param: str) -> ApiError | None:
        """A 400 for a prompt that cannot fit from its size alone (see the module docstring), else None.
        `sizes`: each prompt's (size, in tokens) (`openai_api.prompt_sizes`). Cheap: no rendering, so
        an oversize prompt is refused in microseconds."""
        limit = self.cfg.model.max_model_len
        head = f"This model's maximum context length is {limit} tokens. However, your prompt contains"
        for size, in_tokens in sizes:  # vLLM's words for the same refusal
            if in_tokens and size >= limit:
                return ApiError(f"{head} {size} input tokens, which exceeds this limit even without any output "
                                "tokens.", param=param, kind="BadRequestError")
            bound = limit * self.max_token_chars * PROMPT_CHARS_MARGIN
            if not in_tokens and self.max_token_chars and size > bound:
                return ApiError(f"{head} {size} characters, more than {limit} tokens can hold (at most "
                                f"{self.max_token_chars} characters per token).", param=param, kind="BadRequestError")
        return None


def max_token_chars(tokenizer) -> int:
    """The most characters any one token spells (its vocabulary entry; special tokens included)."""
    entries = tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))
    return max((len(e) for e in entries if isinstance(e, str)), default=0)


def _tokenizer(source: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(resolve_model(source))
