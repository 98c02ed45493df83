"""The application's configuration: the `args` of the Serve config file, validated at build time.

`serve run deployments/local.yaml` hands the application's `args` mapping to `build_app`, which
validates it here before any replica starts. `disagg check-config FILE` runs the same validation
on a whole Serve config file and reports `file:line: field '...'` for every problem.

Pure pydantic: importing this module needs neither Ray nor vLLM, so configs are checked anywhere.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from disagg.core.policies import PolicyError, build_policy
from disagg.core.cost_model import CostModelError, load_profile
from disagg.core.types import SloClass
from disagg.core.yaml_errors import explain, read_yaml, yaml_root


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ModelConfig(_Strict):
    source: str = Field(description="a model name (Qwen/Qwen2.5-3B-Instruct), a local folder, or 'tiny:tiny' / "
                        "'tiny:small' for the offline tiny models built on first use")
    served_name: str = Field(description="the `model` name clients send and /v1/models lists")
    max_model_len: int = Field(default=2048, gt=0, description="context window: prompt + max_tokens")


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
    seed: int = 0
    stream_interval_s: float = Field(default=0.02, ge=0.0, le=1.0, description="after the first token, stream "
                                     "tokens in batches at most this often (0 = every token alone)")
    engine_kwargs: dict[str, Any] = Field(default_factory=dict, description="extra vLLM AsyncEngineArgs fields")

    @model_validator(mode="after")
    def _memory_for_device(self) -> "EngineConfig":
        if self.device == "cpu" and self.kv_cache_memory_bytes is None:
            raise ValueError("device 'cpu' needs kv_cache_memory_bytes (else vLLM reserves 90% of host RAM)")
        if self.device == "cpu" and self.gpu_memory_utilization is not None:
            raise ValueError("gpu_memory_utilization does not apply to device 'cpu'; use kv_cache_memory_bytes")
        return self


class AutoscalingConfig(_Strict):
    min_replicas: int = Field(ge=0)
    max_replicas: int = Field(ge=1)
    target_ongoing_requests: float = Field(default=8.0, gt=0)
    upscale_delay_s: float = Field(default=5.0, ge=0)
    downscale_delay_s: float = Field(default=30.0, ge=0)

    @model_validator(mode="after")
    def _bounds(self) -> "AutoscalingConfig":
        if self.min_replicas > self.max_replicas:
            raise ValueError(f"min_replicas {self.min_replicas} > max_replicas {self.max_replicas}")
        return self

    def to_serve(self, initial: int) -> dict:
        return {
            "min_replicas": self.min_replicas,
            "max_replicas": self.max_replicas,
            "initial_replicas": max(self.min_replicas, min(initial, self.max_replicas)),
            "target_ongoing_requests": self.target_ongoing_requests,
            "upscale_delay_s": self.upscale_delay_s,
            "downscale_delay_s": self.downscale_delay_s,
        }


class PoolConfig(_Strict):
    num_replicas: int = Field(default=1, ge=1, description="pool width (initial width with autoscaling)")
    autoscaling: AutoscalingConfig | None = None
    num_cpus: float = Field(default=1.0, ge=0)
    num_gpus: float = Field(default=0.0, ge=0)
    max_ongoing_requests: int = Field(default=1024, gt=0, description="the engine queues; Serve should not")
    env: dict[str, str] = Field(default_factory=dict, description="extra environment for this pool's replicas")


class RouterConfig(_Strict):
    policy: str = "marginal_cost"
    policy_params: dict[str, Any] = Field(default_factory=dict)
    cost_model: str = Field(default="cpu-tiny", description="shipped profile name or a cost-model YAML path")
    poll_interval_s: float = Field(default=0.05, gt=0, le=10, description="engine state poll period")
    default_slo: SloClass = SloClass.LOOSE
    request_log: str | None = Field(default=None, description="JSON-lines file, one record per request")
    num_cpus: float = Field(default=0.1, ge=0)
    prefill_retries: int = Field(default=1, ge=0, description="other prefill instances tried after a failure")


class AppConfig(_Strict):
    model: ModelConfig
    engine: EngineConfig
    prefill: PoolConfig
    decode: PoolConfig
    router: RouterConfig = Field(default_factory=RouterConfig)

    @model_validator(mode="after")
    def _cross_field(self) -> "AppConfig":
        for name in ("prefill", "decode"):
            pool: PoolConfig = getattr(self, name)
            if self.engine.device == "cuda" and pool.num_gpus < 1:
                raise ValueError(f"{name}.num_gpus must be >= 1 with engine.device 'cuda' (one GPU per engine)")
            if self.engine.device == "cpu" and pool.num_gpus:
                raise ValueError(f"{name}.num_gpus must be 0 with engine.device 'cpu'")
        try:
            cm = load_profile(self.router.cost_model)
            build_policy(self.router.policy, cm, self.router.policy_params)
        except (PolicyError, CostModelError) as e:
            raise ValueError(f"router: {e}") from None
        if cm.calibrated and cm.model and cm.model != self.model.source:
            raise ValueError(f"router.cost_model {self.router.cost_model!r} was calibrated for model {cm.model!r}; "
                             f"this config serves {self.model.source!r}")
        if build_policy(self.router.policy, cm, self.router.policy_params).simulator_only:
            raise ValueError(f"router.policy {self.router.policy!r} runs in the simulator only")
        return self


class ConfigError(ValueError):
    """A configuration that cannot be served; the message names file, line and field."""


def parse_args(args: dict, path: Path | None = None, prefix: tuple = ()) -> AppConfig:
    try:
        return AppConfig.model_validate(args)
    except ValidationError as e:
        raise ConfigError(explain(e, path, yaml_root(path) if path else None, prefix)) from None


def load_serve_config(path: str | Path) -> list[tuple[str, AppConfig]]:
    """Validate every application of a Serve config file that our `build_app` builds."""
    path = Path(path)
    doc = read_yaml(path, ConfigError, "Serve config")
    apps = doc.get("applications") if isinstance(doc, dict) else None
    if not isinstance(apps, list) or not apps:
        raise ConfigError(f"{path}:1: field 'applications': a Serve config needs a list of applications")
    out = []
    for i, app in enumerate(apps):
        if not isinstance(app, dict) or app.get("import_path") != "disagg.graph.app:build_app":
            continue
        args = app.get("args")
        if not isinstance(args, dict):
            raise ConfigError(f"{path}: field 'applications.{i}.args': missing (the application's configuration)")
        out.append((app.get("name", f"app{i}"), parse_args(args, path, ("applications", i, "args"))))
    if not out:
        raise ConfigError(f"{path}: no application with import_path disagg.graph.app:build_app")
    return out
