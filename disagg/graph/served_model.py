"""One served model as the router holds it: its engine pools, tokenizer, P/D policy, cost model and
output-length predictor.

With several models (a `MultiModelConfig`) each model keeps its own of all of these, and a request
naming a model is routed within that model's pools only; its instance ids are prefixed with
`<served name>:`. The P/D policy and the cost model can be swapped at run time (`/admin/*`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ray.serve.handle import DeploymentHandle

from disagg.core.cost_model import CostModel
from disagg.core.policies import Policy, build_policy
from disagg.core.predictor import BucketMeanPredictor
from disagg.core.types import Role
from disagg.core.utility import ModelPrices
from disagg.graph.config import AppConfig, load_cost_model
from disagg.graph.engine_server import resolve_model
from disagg.graph.openai_api import ApiError


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
    decode_stream: Any = None  # the decoding pool's handle in streaming mode

    def __post_init__(self) -> None:
        self.decode_stream = self.handles[self.decode_role].options(stream=True)

    @classmethod
    def build(cls, name: str, cfg: AppConfig, handles: dict[str, DeploymentHandle], prices: ModelPrices | None,
              prefixed: bool, replica_index: int = 0) -> "ServedModel":
        """From the model's config and its pools' handles ({role value: handle}); loads the tokenizer.
        `prefixed`: the app serves several models, so instance ids name the model; `replica_index`:
        this router replica's rank (its policy's tie-break seed is derived from it)."""
        cm = load_cost_model(cfg.router.cost_model)
        return cls(name=name, cfg=cfg, handles={Role(r): h for r, h in handles.items()},
                   tokenizer=_tokenizer(cfg.model.source), cost_model=cm,
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

    def sampling(self, req, prompt_tokens: int) -> dict:
        """The request's sampling settings for this model; `max_tokens` defaults to the room left in the
        context window. 400 naming `max_tokens` when the prompt and `max_tokens` do not fit."""
        limit = self.cfg.model.max_model_len
        room = limit - prompt_tokens
        if req.max_tokens is not None and req.max_tokens > room:
            raise ApiError(f"max_tokens {req.max_tokens} + {prompt_tokens} prompt tokens exceed the context "
                           f"window of {limit}", param="max_tokens")
        return req.sampling(default_max_tokens=room)


def _tokenizer(source: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(resolve_model(source))
