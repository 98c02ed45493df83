"""The application's configuration: the `args` of the Serve config file, validated at build time.

`serve run deployments/local.yaml` hands the application's `args` mapping to `build_app`, which
validates it here before any replica starts. `disagg check-config FILE` runs the same validation
on a whole Serve config file and reports `file:line: field '...'` for every problem.

Two shapes of `args`:
- one model (`AppConfig`): `model`, `engine`, its engine pools, `router`. The pools are either
  disaggregated (`prefill` + `decode`) or `colocated` (one pool of engines doing both);
- several models behind one endpoint (`MultiModelConfig`, recognised by its `models` list): each
  entry is one model with its own engines, pools, P/D policy, cost model, prices and accuracy
  prior; `router` adds the alias (default `auto`) that routes by accuracy − λ·cost under each
  query's TTFT limit across every instance of every model. Each entry is served exactly like a
  one-model app: `ModelEntry.app_config` gives its `AppConfig` view.

Access settings (`router.api_keys_env`, `admin`, `admin_token_env`, `cost_model_dir`) name
environment variables and folders, never secrets: `graph/access.py` reads the variables on each
router replica, so no key is written in a config file.

Pure pydantic: importing this module needs neither Ray nor vLLM, so configs are checked anywhere.
"""

from __future__ import annotations

import ipaddress
import re
from enum import Enum
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator, model_validator

from disagg.core.policies import PolicyError, build_policy
from disagg.core.cost_model import CostModel, CostModelError, load_profile
from disagg.core.model_routing import (
    ModelRouter, build_model_router, known_model_routers, model_router_class, model_router_params,
)
from disagg.core.planner import PlannerConfig
from disagg.core.types import Role, SloClass
from disagg.core.utility import AccuracyTable, EvaluationError, ModelPrices
from disagg.core.yaml_errors import explain, line_of, read_yaml, yaml_root
from serve_app.engine_args import KV_CONNECTORS, NIXL_BACKENDS, RESERVED_ENGINE_KWARGS, EngineSpec

SPEC_FIELDS = frozenset(EngineSpec.__dataclass_fields__) - {"engine_kwargs", "role"}
_ONE_ENGINE = "one replica is one engine: no pipeline or data parallelism inside it"
_ENGINE_KWARGS_HINTS = {
    "tensor_parallel_size": "use the pool's tensor_parallel_size, with num_gpus to match",
    "kv_transfer_config": "use engine.kv_transfer", "kv_connector": "use engine.kv_transfer.connector",
    "kv_buffer_device": "use engine.kv_transfer.buffer_device", "stat_loggers": "the engine replica sets them",
    "pipeline_parallel_size": _ONE_ENGINE, "data_parallel_size": _ONE_ENGINE,
    "distributed_executor_backend": "tensor-parallel workers run as processes of the replica",
}


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


class AdminAccess(str, Enum):
    """Who may call the router's `/admin/*` routes (`router.admin`)."""

    DISABLED = "disabled"  # nobody: the routes answer 404, as unknown paths do
    LOOPBACK = "loopback"  # clients whose address, as the router replica sees it, is loopback
    TOKEN = "token"  # whoever presents `Authorization: Bearer <the token in router.admin_token_env>`


class OpenAiSettings(_Strict):
    """vLLM's OpenAI-layer options (`model.openai`), named as `vllm serve` takes them as flags."""

    chat_template: str | None = Field(default=None, min_length=1, description="a template file or the template "
                                      "itself; default: the tokenizer's")
    chat_template_content_format: Literal["auto", "string", "openai"] = "auto"
    trust_request_chat_template: bool = Field(default=False, description="let requests bring their own template")
    default_chat_template_kwargs: dict[str, Any] | None = None
    response_role: str = Field(default="assistant", min_length=1)
    enable_auto_tool_choice: bool = Field(default=False, description="tool_choice 'auto' (needs tool_call_parser)")
    tool_call_parser: str | None = Field(default=None, min_length=1, description="e.g. 'hermes', 'llama3_json'")
    tool_strict_level: Literal["auto", "function", "parameter"] = "auto"
    exclude_tools_when_tool_choice_none: bool = False
    reasoning_parser: str | None = Field(default=None, min_length=1, description="e.g. 'deepseek_r1', 'qwen3'")
    return_tokens_as_token_ids: bool = False
    enable_prompt_tokens_details: bool = False
    enable_force_include_usage: bool = False

    @model_validator(mode="after")
    def _auto_needs_parser(self) -> "OpenAiSettings":
        if self.enable_auto_tool_choice and self.tool_call_parser is None:
            raise ValueError("enable_auto_tool_choice needs tool_call_parser (as vllm serve does)")
        return self


class ModelConfig(_Strict):
    source: str = Field(description="a model name (Qwen/Qwen2.5-3B-Instruct), a local folder, or 'tiny:tiny' / "
                        "'tiny:small' for the offline tiny models built on first use")
    served_name: str = Field(description="the `model` name clients send and /v1/models lists")
    max_model_len: int = Field(default=2048, gt=0, description="context window: prompt + max_tokens")
    openai: OpenAiSettings = Field(default_factory=OpenAiSettings, description="vLLM's OpenAI-layer options: "
                                   "chat template, tool-call and reasoning parsers")


class KvTransferSettings(_Strict):
    """How KV moves between engines (`engine.kv_transfer`); see serve_app.engine_args."""

    connector: Literal["pull", "push"] = Field(
        default="pull", description="'pull': vLLM's NixlConnector, the decode engine READs the blocks; 'push': "
        "NixlPushConnector, the prefill engine WRITEs them (the fast direction over cuda_ipc, i.e. GPUs of "
        "one node without RDMA)")
    buffer_device: Literal["cpu", "cuda"] | None = Field(
        default=None, description="where NIXL's transfer buffers live; default: engine.device. 'cpu' on GPUs "
        "stages every transfer through host memory (for GPUs whose memory NIXL cannot register)")
    backends: tuple[str, ...] = Field(default=("UCX",), min_length=1, description="NIXL backends")
    ucx_tls: str | None = Field(default=None, min_length=1, description="UCX_TLS for the engines' NIXL agents, "
                                "e.g. 'cuda_ipc,cuda_copy,rc,tcp'; default: UCX chooses")
    ucx_net_devices: str | None = Field(default=None, min_length=1, description="UCX_NET_DEVICES, e.g. "
                                        "'mlx5_0:1'; default: UCX chooses")

    @field_validator("backends")
    @classmethod
    def _known_backends(cls, v: tuple[str, ...]) -> tuple[str, ...]:
        for b in v:
            if b not in NIXL_BACKENDS:
                raise ValueError(f"unknown NIXL backend {b!r}; allowed: {', '.join(NIXL_BACKENDS)}")
        return v

    @property
    def vllm_connector(self) -> str:
        return KV_CONNECTORS[0] if self.connector == "pull" else KV_CONNECTORS[1]


class EngineConfig(_Strict):
    device: Literal["cpu", "cuda"] = Field(description="where engines run and where NIXL buffers live")
    max_num_seqs: int = Field(default=64, gt=0)
    max_num_batched_tokens: int = Field(default=2048, gt=0, description="token budget per step (chunked prefill)")
    block_size: int | None = Field(default=None, gt=0, description="KV block size; None = vLLM's platform default")
    kv_cache_memory_bytes: int | None = Field(default=None, gt=0, description="KV cache size (CPU engines)")
    gpu_memory_utilization: float | None = Field(default=None, gt=0.0, le=1.0, description="GPU engines")
    enforce_eager: bool = True
    side_channel_host: str = Field(default="127.0.0.1", description="address peers reach the NIXL side channel "
                                   "on; 'auto' = this node's IP (multi-node clusters)")
    side_channel_ports: tuple[int, int] = Field(
        default=(27000, 27999), description="[first, last] TCP ports engines claim for their NIXL side channel, "
        "one per engine per host; keep it outside the kernel's ephemeral range (32768-60999 on Linux)")
    start_timeout_s: float = Field(default=900.0, gt=0, description="an engine not up within this fails its "
                                   "replica (Serve starts a new one) instead of waiting forever")
    warmup_timeout_s: float = Field(default=600.0, gt=0, description="bound on the warm-up handoff every replica "
                                    "completes before it reports ready (a decode engine waits for a prefill one)")
    seed: int = 0
    stream_interval_max_s: float = Field(default=0.08, ge=0.0, le=1.0, description="under load the batching "
                                         "interval grows with the engine's open streams (4 per base interval) up "
                                         "to this, so the token path's message rate stays flat")
    stream_interval_s: float = Field(default=0.02, ge=0.0, le=1.0, description="after the first token, stream "
                                     "tokens in batches at most this often (0 = every token alone)")
    push_interval_s: float = Field(default=0.005, ge=0.0, le=1.0, description="an engine pushes its state to the "
                                   "routers at most this often (a burst of changes makes one report)")
    state_age_bound_s: float = Field(default=0.02, gt=0.0, description="a call decided on engine state older "
                                     "than this is counted in the engine's stale_decisions")
    kv_events: bool = Field(default=True, description="engines publish vLLM's KV-cache events and push what their "
                            "prefix caches hold to the routers (exact prefix state); off: the routers model each "
                            "cache from what they sent where")
    kv_transfer: KvTransferSettings = Field(default_factory=KvTransferSettings)
    engine_kwargs: dict[str, Any] = Field(default_factory=dict, description="extra vLLM AsyncEngineArgs fields")
    stand_in: bool = Field(default=False, description="the fleet-scale rig: engine replicas are stand-ins "
                           "timed by the cost model (serve_app.engine_standin), no model runs; for measuring "
                           "the router at fleet size only")
    access_log: bool = Field(default=False, description="Serve's access-log line for every call an engine "
                             "replica serves, state polls included (20 lines/s per replica): for debugging")

    @model_validator(mode="after")
    def _port_range(self) -> "EngineConfig":
        lo, hi = self.side_channel_ports
        if not 1024 <= lo <= hi <= 65535:
            raise ValueError(f"side_channel_ports must be [first, last] with 1024 <= first <= last <= 65535, "
                             f"got [{lo}, {hi}]")
        return self

    @model_validator(mode="after")
    def _memory_for_device(self) -> "EngineConfig":
        if self.device == "cpu" and self.kv_cache_memory_bytes is None:
            raise ValueError("device 'cpu' needs kv_cache_memory_bytes (else vLLM reserves 90% of host RAM)")
        if self.device == "cpu" and self.gpu_memory_utilization is not None:
            raise ValueError("gpu_memory_utilization does not apply to device 'cpu'; use kv_cache_memory_bytes")
        if self.device == "cpu" and self.kv_transfer.buffer_device == "cuda":
            raise ValueError("kv_transfer.buffer_device 'cuda' needs engine.device 'cuda'")
        return self

    @field_validator("engine_kwargs")
    @classmethod
    def _kwargs_we_set(cls, v: dict[str, Any]) -> dict[str, Any]:
        clash = sorted(set(v) & (RESERVED_ENGINE_KWARGS | SPEC_FIELDS))
        if clash:
            hint = _ENGINE_KWARGS_HINTS.get(clash[0], "use the engine or pool field of that name")
            raise ValueError(f"{clash[0]}: set by the config, not engine_kwargs ({hint})")
        return v

    def kv_buffer_device(self) -> str:
        return self.kv_transfer.buffer_device or self.device


PLANNER_POLICY = "serve_app.autoscale:planned_replicas"  # Serve's custom autoscaling policy for `policy: planner`


class AutoscalingConfig(_Strict):
    min_replicas: int = Field(ge=0)
    max_replicas: int = Field(ge=1)
    policy: Literal["ongoing_requests", "planner"] = Field(
        default="ongoing_requests", description="'ongoing_requests': Serve's default (target_ongoing_requests "
        "per replica); 'planner': the width the router's SLO-driven planner sets (router.planner)")
    target_ongoing_requests: float = Field(default=8.0, gt=0)
    upscale_delay_s: float = Field(default=5.0, ge=0)
    downscale_delay_s: float = Field(default=30.0, ge=0)

    @model_validator(mode="after")
    def _bounds(self) -> "AutoscalingConfig":
        if self.min_replicas > self.max_replicas:
            raise ValueError(f"min_replicas {self.min_replicas} > max_replicas {self.max_replicas}")
        return self

    def to_serve(self, initial: int, standing: int = 0) -> dict:
        """Serve's autoscaling config. `standing`: calls every replica holds open whatever the load
        (each router replica's state stream on an engine): added to the target, so that it counts
        requests only."""
        return {
            "min_replicas": self.min_replicas,
            "max_replicas": self.max_replicas,
            "initial_replicas": max(self.min_replicas, min(initial, self.max_replicas)),
            "target_ongoing_requests": self.target_ongoing_requests + standing,
            "upscale_delay_s": self.upscale_delay_s,
            "downscale_delay_s": self.downscale_delay_s,
        } | ({"policy": {"policy_function": PLANNER_POLICY}} if self.policy == "planner" else {})


BUILTIN_RESOURCES = {"CPU", "GPU", "memory", "object_store_memory"}


class PoolConfig(_Strict):
    num_replicas: int = Field(default=1, ge=1, description="pool width (initial width with autoscaling)")
    autoscaling: AutoscalingConfig | None = None
    num_cpus: float = Field(default=1.0, ge=0)
    num_gpus: float = Field(default=0.0, ge=0, description="GPUs per replica: its engine's tensor_parallel_size")
    tensor_parallel_size: int = Field(default=1, ge=1, description="GPUs one engine of this pool spans (vLLM's "
                                      "tensor parallelism, inside one node); the replica reserves them as one "
                                      "placement-group bundle, and routing treats the engine as one instance")
    resources: dict[str, float] = Field(default_factory=dict, description="custom Ray resources each replica "
                                        "needs, e.g. {decode_node: 1}: pins the pool to the nodes that offer them")
    max_ongoing_requests: int = Field(default=1024, gt=0, description="the engine queues; Serve should not")
    env: dict[str, str] = Field(default_factory=dict, description="extra environment for this pool's replicas")

    @field_validator("resources")
    @classmethod
    def _custom_resources(cls, v: dict[str, float]) -> dict[str, float]:
        for name, amount in v.items():
            if not name or name in BUILTIN_RESOURCES:
                raise ValueError(f"{name!r} is not a custom resource (CPUs and GPUs have num_cpus and num_gpus)")
            if amount <= 0:
                raise ValueError(f"{name}: {amount} is not a positive amount")
        return v


def load_cost_model(source: str | dict) -> CostModel:
    """A shipped profile name, a cost-model YAML path, or the cost model itself given inline."""
    if isinstance(source, dict):
        return CostModel.from_dict(source)
    return load_profile(source)


class RouterSettings(_Strict):
    """What every router deployment takes, serving one model or several."""

    poll_interval_s: float = Field(default=5.0, gt=0, le=60, description="liveness poll period: finds new engine "
                                   "replicas and checks the state streams (the state itself is pushed)")
    prefix_index: Literal["events", "model"] = Field(
        default="events", description="where the prefix index of each engine comes from: its pushed KV events "
        "(`engine.kv_events`), or the router's model of its cache (what was sent where; for comparing the two: "
        "the engines still report what their events say they held, in the request log)")
    default_slo: SloClass = SloClass.LOOSE
    request_log: str | None = Field(default=None, description="JSON-lines file, one record per request")
    num_cpus: float = Field(default=0.1, ge=0)
    drain_timeout_s: float = Field(default=25.0, gt=0, description="a router replica being stopped (a rolling "
                                   "restart, serve shutdown) finishes its streams for at most this long before Serve "
                                   "kills it; it includes Serve's HAProxy deregistration window "
                                   "(RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S), so keep it well above that")
    prefill_retries: int = Field(default=1, ge=0, description="other prefill instances tried after a failure")
    migration_limit: int = Field(default=1, ge=0, description="times a request whose decode instance fails "
                                 "mid-stream is continued on another one (its prompt and the tokens so far "
                                 "prefilled there); 0 = end the stream with an error instead")
    shed_queue_factor: float = Field(default=2.0, ge=0, description="answer 429 + Retry-After when every decode "
                                     "instance already holds this many times engine.max_num_seqs requests (tight "
                                     "requests: twice that); 0 = never shed (disagg.core.admission)")
    shed_loop_lag_s: float = Field(default=0.05, ge=0, description="answer 429 + Retry-After before reading a "
                                   "request when the router's own event loop has run this far behind for a "
                                   "whole second (tight requests: twice that); 0 = never")
    max_body_bytes: int = Field(default=8 << 20, gt=0, description="largest request body accepted; a larger one "
                                "is refused with 413 before it is parsed")
    num_replicas: int = Field(default=1, ge=1, description="router replicas (initial count with autoscaling); "
                              "each sees the others' admitted work through the engines' ledgers")
    autoscaling: AutoscalingConfig | None = Field(default=None, description="scale the routers on ongoing requests")
    api_keys_env: str | None = Field(default=None, description="NAME of the environment variable (on the Ray "
                                     "nodes) holding the API keys, comma-separated: then /v1/* need "
                                     "`Authorization: Bearer <key>`; unset = the API is open")
    admin: AdminAccess = Field(default=AdminAccess.LOOPBACK, description="who may call /admin/*: 'disabled' "
                               "(404), 'loopback' (clients on 127.0.0.1/::1 only) or 'token' (a Bearer token)")
    admin_token_env: str | None = Field(default=None, description="NAME of the environment variable holding "
                                        "the admin token (admin: token)")
    cost_model_dir: str | None = Field(default=None, description="the folder (relative: to DISAGG_RUN_DIR) "
                                       "whose YAML files POST /admin/cost_model may load; unset = shipped "
                                       "profile names only")

    @field_validator("admin", mode="before")
    @classmethod
    def _admin_not_a_yaml_boolean(cls, v: Any) -> Any:
        if isinstance(v, bool):  # YAML 1.1 reads a bare off / no / false (on / yes / true) as a boolean
            raise ValueError(f"admin must be one of {[a.value for a in AdminAccess]}, got the boolean {v} "
                             "(YAML reads a bare off/no/false as false: write 'disabled')")
        return v

    @model_validator(mode="after")
    def _access(self) -> "RouterSettings":
        # the error names the field, never its value: a key pasted here by mistake must not reach a log
        for name in ("api_keys_env", "admin_token_env"):
            value = getattr(self, name)
            if value is not None and not ENV_NAME.fullmatch(value):
                raise ValueError(f"router.{name} must be the NAME of an environment variable (letters, digits "
                                 "and _, not starting with a digit), not the secret itself")
        if self.admin is AdminAccess.TOKEN and self.admin_token_env is None:
            raise ValueError("router.admin 'token' needs router.admin_token_env (the environment variable "
                             "holding the admin token)")
        if self.admin is not AdminAccess.TOKEN and self.admin_token_env is not None:
            raise ValueError(f"router.admin_token_env is set but router.admin is {self.admin.value!r}: set "
                             "admin: token to use the token, or drop admin_token_env")
        return self


class RouterConfig(RouterSettings):
    policy: str = Field(default="marginal_cost", description="P/D policy; 'colocated' for a colocated pool")
    policy_params: dict[str, Any] = Field(default_factory=dict)
    cost_model: str | dict[str, Any] = Field(default="cpu-tiny", description="shipped profile name, a "
                                             "cost-model YAML path, or the cost model inline")
    planner: PlannerConfig = Field(default_factory=PlannerConfig, description="the SLO-driven planner's knobs, "
                                   "for pools with autoscaling.policy 'planner' (their bounds are the pools' "
                                   "min_replicas and max_replicas)")

    @field_validator("planner")
    @classmethod
    def _planner_bounds_come_from_the_pools(cls, v: PlannerConfig) -> PlannerConfig:
        # the defaults come back when a validated config is dumped and read again (as Serve does)
        default = PlannerConfig()
        given = sorted(f for f in v.model_fields_set
                       if f.startswith(("min_", "max_")) and getattr(v, f) != getattr(default, f))
        if given:
            raise ValueError(f"{given[0]}: a pool's bounds are its autoscaling min_replicas and max_replicas")
        return v

    def planned_pools(self, pools: dict[str, PoolConfig]) -> list[str]:
        """The pools whose width the planner sets."""
        return [n for n, p in pools.items() if p.autoscaling is not None and p.autoscaling.policy == "planner"]


# pool name in the config → the role its engines play
POOL_ROLES = {"prefill": Role.PREFILL, "decode": Role.DECODE, "colocated": Role.BOTH}


class AppConfig(_Strict):
    """One model: its engines in a disaggregated (`prefill` + `decode`) or a `colocated` layout."""

    model: ModelConfig
    engine: EngineConfig
    prefill: PoolConfig | None = Field(default=None, description="prefill pool (disaggregated layout)")
    decode: PoolConfig | None = Field(default=None, description="decode pool (disaggregated layout)")
    colocated: PoolConfig | None = Field(default=None, description="one pool of engines that prefill and "
                                         "decode (instead of prefill + decode)")
    router: RouterConfig = Field(default_factory=RouterConfig)

    @model_validator(mode="before")
    @classmethod
    def _colocated_policy_default(cls, data: Any) -> Any:
        # a colocated pool has one routing choice per request; 'colocated' is the policy that makes it
        if isinstance(data, dict) and data.get("colocated") is not None:
            router = data.get("router") or {}
            if isinstance(router, dict) and "policy" not in router:
                data = {**data, "router": {**router, "policy": "colocated"}}
        return data

    @property
    def is_colocated(self) -> bool:
        return self.colocated is not None

    def pools(self) -> dict[str, PoolConfig]:
        """Pool name → pool, in the graph's order: prefill, decode — or colocated."""
        if self.colocated is not None:
            return {"colocated": self.colocated}
        return {"prefill": self.prefill, "decode": self.decode}

    def pool_of(self, role: Role) -> PoolConfig:
        """The pool whose engines serve `role`: a colocated pool serves every role."""
        if self.colocated is not None:
            return self.colocated
        if role is Role.BOTH:
            raise ValueError("a disaggregated app has no colocated pool")
        return self.prefill if role is Role.PREFILL else self.decode

    @model_validator(mode="after")
    def _cross_field(self) -> "AppConfig":
        if self.colocated is not None and (self.prefill is not None or self.decode is not None):
            raise ValueError("colocated: give either a colocated pool or prefill + decode pools, not both")
        if self.colocated is None:
            for name in ("prefill", "decode"):
                if getattr(self, name) is None:
                    raise ValueError(f"{name}: missing (a disaggregated app needs prefill and decode pools; "
                                     "or give one 'colocated' pool instead)")
        for name, pool in self.pools().items():
            _check_pool_devices(name, pool, self.engine.device)
        try:
            cm = load_cost_model(self.router.cost_model)
        except CostModelError as e:
            raise ValueError(f"router.cost_model: {e}") from None
        try:
            policy = build_policy(self.router.policy, cm, self.router.policy_params)
        except PolicyError as e:
            raise ValueError(f"router.policy: {e}") from None
        if cm.calibrated and cm.model and cm.model != self.model.source:
            raise ValueError(f"router.cost_model {cm.name!r} was calibrated for model {cm.model!r}; "
                             f"this config serves {self.model.source!r}")
        if policy.simulator_only:
            raise ValueError(f"router.policy {self.router.policy!r} runs in the simulator only")
        if self.colocated is not None and self.router.planned_pools(self.pools()):
            raise ValueError("colocated.autoscaling.policy: the planner sizes prefill and decode pools; a colocated "
                             "pool scales on ongoing requests")
        if self.colocated is not None and self.router.policy != "colocated":
            raise ValueError(f"router.policy {self.router.policy!r} needs a prefill pool; a colocated pool is "
                             "routed with policy 'colocated'")
        return self


def _check_pool_devices(name: str, pool: PoolConfig, device: str) -> None:
    """A replica gets exactly the GPUs its engine spans: fewer and vLLM fails at start, more lie idle."""
    tp = pool.tensor_parallel_size
    if device == "cuda" and pool.num_gpus != tp:
        if pool.num_gpus < tp:
            raise ValueError(f"{name}.tensor_parallel_size {tp} is more than the {pool.num_gpus:g} GPUs each replica "
                             f"gets ({name}.num_gpus): set num_gpus: {tp}")
        raise ValueError(f"{name}.num_gpus {pool.num_gpus:g} with tensor_parallel_size {tp}: an engine uses exactly "
                         f"tensor_parallel_size GPUs (set num_gpus: {tp}, or tensor_parallel_size to the GPUs it "
                         "should span)")
    if device == "cpu" and pool.num_gpus:
        raise ValueError(f"{name}.num_gpus must be 0 with engine.device 'cpu'")


# --- several models behind one endpoint ------------------------------------------------------


class PricesConfig(_Strict):
    """Price per token in one currency unit of your choice; λ is per that unit."""

    input_per_token: float = Field(ge=0.0, allow_inf_nan=False)
    output_per_token: float = Field(ge=0.0, allow_inf_nan=False)

    def to_core(self) -> ModelPrices:
        return ModelPrices(self.input_per_token, self.output_per_token)


class ModelEntry(_Strict):
    """One model of a multi-model app: served by its own pools exactly as a one-model app."""

    model: ModelConfig
    engine: EngineConfig
    prefill: PoolConfig | None = None
    decode: PoolConfig | None = None
    colocated: PoolConfig | None = None
    policy: str | None = Field(default=None, description="P/D policy for requests naming this model; default "
                               "marginal_cost (disaggregated) or colocated")
    policy_params: dict[str, Any] = Field(default_factory=dict)
    cost_model: str | dict[str, Any] = Field(default="cpu-tiny", description="this model's engine constants: "
                                             "shipped profile, calibrated YAML path, or inline")
    prices: PricesConfig
    accuracy_prior: float = Field(ge=0.0, le=1.0, description="expected score in [0, 1] when the accuracy "
                                  "table has no history for this model")

    @property
    def deployment_prefix(self) -> str:
        """Serve deployment names of this model's pools: its served name, made name-safe."""
        return re.sub(r"[^A-Za-z0-9_.-]+", "_", self.model.served_name)

    def app_config(self, router: "MultiRouterConfig") -> AppConfig:
        return AppConfig.model_validate(self._app_dict(router))

    def _app_dict(self, router: "MultiRouterConfig") -> dict:
        policy = self.policy or ("colocated" if self.colocated is not None else "marginal_cost")
        # the shared router settings, except the request log: the multi-model router keeps one
        shared = router.model_dump(include=set(RouterSettings.model_fields) - {"request_log"})
        rc = {"policy": policy, "policy_params": self.policy_params, "cost_model": self.cost_model, **shared}
        d = {"model": self.model, "engine": self.engine, "router": rc}
        for name in ("prefill", "decode", "colocated"):
            if getattr(self, name) is not None:
                d[name] = getattr(self, name)
        return d


class MultiRouterConfig(RouterSettings):
    alias: str = Field(default="auto", min_length=1, description="the `model` name that lets the router choose "
                       "the model by accuracy − λ·cost under the query's TTFT limit")
    lam: float = Field(default=0.0, ge=0.0, allow_inf_nan=False, description="default λ (per currency unit of "
                       "the prices); a request may override it with X-Route-Lambda")
    accuracy_table: str | None = Field(default=None, description="saved AccuracyTable JSON (`disagg` accuracy "
                                       "train); without it each model answers its accuracy_prior")
    model_policy: str = Field(default="latency_aware", description="the model-level router of the alias route "
                              f"(disagg.core.model_routing): one of {', '.join(known_model_routers())}")
    model_policy_params: dict[str, Any] = Field(default_factory=dict, description="that router's parameters")

    @field_validator("model_policy")
    @classmethod
    def _known_model_policy(cls, v: str) -> str:
        model_router_class(v)  # ModelRouterError is a ValueError: reported on this field, with the known names
        return v

    @field_validator("model_policy_params")
    @classmethod
    def _model_policy_params(cls, v: dict[str, Any], info: ValidationInfo) -> dict[str, Any]:
        if "model_policy" in info.data:  # an unknown router is reported on model_policy alone
            model_router_params(info.data["model_policy"], v)
        return v

    def model_router(self, accuracy: AccuracyTable) -> ModelRouter:
        """The alias route's router at the configured λ, over `accuracy` (`MultiModelConfig.accuracy`)."""
        return build_model_router(self.model_policy, self.lam, accuracy, self.model_policy_params)


class MultiModelConfig(_Strict):
    models: list[ModelEntry] = Field(min_length=1)
    router: MultiRouterConfig = Field(default_factory=MultiRouterConfig)

    @model_validator(mode="after")
    def _cross_field(self) -> "MultiModelConfig":
        seen: dict[str, int] = {}
        prefixes: dict[str, int] = {}
        for i, m in enumerate(self.models):
            name = m.model.served_name
            if name in seen:
                raise ValueError(f"models.{i}.model.served_name: {name!r} is already served by models.{seen[name]}")
            seen[name] = i
            if m.deployment_prefix in prefixes:
                raise ValueError(f"models.{i}.model.served_name: {name!r} gives the same deployment names as "
                                 f"models.{prefixes[m.deployment_prefix]}")
            prefixes[m.deployment_prefix] = i
            _check_entry(i, m, self.router)
            for pool_name in ("prefill", "decode", "colocated"):
                pool = getattr(m, pool_name, None)
                if pool is not None and pool.autoscaling is not None and pool.autoscaling.policy == "planner":
                    raise ValueError(f"models.{i}.{pool_name}.autoscaling.policy: the planner sizes the pools of a "
                                     "one-model app only")
        if self.router.alias in seen:
            raise ValueError(f"router.alias: {self.router.alias!r} is also a served model name (models."
                             f"{seen[self.router.alias]}); the alias must differ from every model")
        if self.router.accuracy_table is not None:
            try:
                AccuracyTable.load(self.router.accuracy_table)
            except EvaluationError as e:
                raise ValueError(f"router.accuracy_table: {e}") from None
        return self

    def app_configs(self) -> dict[str, AppConfig]:
        """Served name → that model's one-model view."""
        return {m.model.served_name: m.app_config(self.router) for m in self.models}

    def accuracy(self) -> AccuracyTable:
        """The accuracy estimator: the saved table if given, with every model's prior filled in."""
        priors = {m.model.served_name: m.accuracy_prior for m in self.models}
        if self.router.accuracy_table is None:
            return AccuracyTable(priors=priors)
        table = AccuracyTable.load(self.router.accuracy_table)
        table.priors = {**priors, **table.priors}  # the table's own priors win: they were fitted with it
        return table


def _check_entry(i: int, m: ModelEntry, router: MultiRouterConfig) -> None:
    """Validate one model's one-model view; errors name the field under models.<i>."""
    try:
        m.app_config(router)
    except ValidationError as e:
        first = e.errors()[0]
        msg = first["msg"].removeprefix("Value error, ")
        loc = ".".join(str(p) for p in first["loc"])
        # the view's router.policy / router.cost_model are this entry's own policy / cost_model
        msg = msg.replace("router.policy", "policy").replace("router.cost_model", "cost_model")
        raise ValueError(f"models.{i}.{loc}: {msg}" if loc else f"models.{i}.{msg}") from None


class ConfigError(ValueError):
    """A configuration that cannot be served; the message names file, line and field."""


def is_multi_model(args: Any) -> bool:
    return isinstance(args, dict) and "models" in args


def parse_args(args: dict, path: Path | None = None, prefix: tuple = ()) -> AppConfig | MultiModelConfig:
    """`args` of one application: a one-model `AppConfig`, or a `MultiModelConfig` when it lists `models`."""
    try:
        return (MultiModelConfig if is_multi_model(args) else AppConfig).model_validate(args)
    except ValidationError as e:
        raise ConfigError(explain(e, path, yaml_root(path) if path else None, prefix)) from None


def _check_admin_reachability(cfg: AppConfig | MultiModelConfig, doc: dict, path: Path, i: int) -> None:
    """`admin: loopback` only where Serve listens on loopback: behind Serve's HAProxy (our fast path)
    every client reaches a router replica on the proxy's node from 127.0.0.1 (HAProxy forwards no client
    address), so on a public bind 'loopback' would admit anyone who reaches the port."""
    http = doc.get("http_options") if isinstance(doc.get("http_options"), dict) else {}
    host = str(http.get("host", "127.0.0.1"))  # Serve's default bind
    if cfg.router.admin is AdminAccess.LOOPBACK and not is_loopback_host(host):
        loc = ("applications", i, "args", "router", "admin")
        raise ConfigError(f"{path}:{line_of(yaml_root(path), loc)}: field '{'.'.join(map(str, loc))}': 'loopback' "
                          f"with http_options.host {host!r}: behind Serve's HAProxy every client reaches the router "
                          "from 127.0.0.1, so anyone reaching the port would pass; use admin: token (with "
                          "admin_token_env) or admin: disabled")


def is_loopback_host(host: str) -> bool:
    """An address (or 'localhost') on the loopback interface; IPv4-mapped IPv6 included."""
    if host.lower() == "localhost":
        return True
    try:
        ip = ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        return False
    mapped = getattr(ip, "ipv4_mapped", None)
    return (mapped or ip).is_loopback


def load_serve_config(path: str | Path) -> list[tuple[str, AppConfig]]:
    """Validate every application of a Serve config file that our `build_app` builds.

    One entry per served model: a one-model app as itself, a multi-model app as one entry per
    model, named `<app>/<served name>` (each model is calibrated and served like a one-model app).
    """
    path = Path(path)
    doc = read_yaml(path, ConfigError, "Serve config")
    apps = doc.get("applications") if isinstance(doc, dict) else None
    if not isinstance(apps, list) or not apps:
        raise ConfigError(f"{path}:1: field 'applications': a Serve config needs a list of applications")
    out = []
    for i, app in enumerate(apps):
        if not isinstance(app, dict) or app.get("import_path") != "serve_app.app:build_app":
            continue
        args = app.get("args")
        if not isinstance(args, dict):
            raise ConfigError(f"{path}: field 'applications.{i}.args': missing (the application's configuration)")
        name = app.get("name", f"app{i}")
        cfg = parse_args(args, path, ("applications", i, "args"))
        _check_admin_reachability(cfg, doc, path, i)
        if isinstance(cfg, MultiModelConfig):
            out.extend((f"{name}/{served}", view) for served, view in cfg.app_configs().items())
        else:
            out.append((name, cfg))
    if not out:
        raise ConfigError(f"{path}: no application with import_path serve_app.app:build_app")
    return out
