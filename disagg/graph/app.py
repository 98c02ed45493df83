"""`build_app`: the one function that wires the application graph from the config.

    router (ingress, FastAPI) ──handle──▶ prefill pool (engine replicas)
                              └─handle──▶ decode pool  (engine replicas)

The Serve config file points its application's `import_path` at `disagg.graph.app:build_app`
and puts our configuration (`disagg.graph.config.AppConfig`) under `args`. The same function
builds the production GPU graph (deployments/disagg.yaml) and the CPU profile
(deployments/local.yaml); only resource shapes and engine settings differ.
"""

from __future__ import annotations

from ray import serve
from ray.serve.config import RequestRouterConfig

from disagg.core.types import Role
from disagg.graph.config import AppConfig, ConfigError, PoolConfig, parse_args
from disagg.graph.engine_server import EngineServer
from disagg.graph.router import Router

PINNED_ROUTER = "disagg.graph.pinned_router:PinnedReplicaRouter"


def _pool_options(name: str, pool: PoolConfig, engine_device: str) -> dict:
    opts = {
        "name": name,
        "max_ongoing_requests": pool.max_ongoing_requests,
        "ray_actor_options": {"num_cpus": pool.num_cpus, "num_gpus": pool.num_gpus,
                              "runtime_env": {"env_vars": dict(pool.env)} if pool.env else {}},
        "request_router_config": RequestRouterConfig(request_router_class=PINNED_ROUTER),
        "health_check_period_s": 10,
        "health_check_timeout_s": 30,
        # engines take 15-50 s to start on small CPUs, minutes for big models on GPUs
        "graceful_shutdown_timeout_s": 20,
    }
    if pool.autoscaling:
        opts["autoscaling_config"] = pool.autoscaling.to_serve(pool.num_replicas)
    else:
        opts["num_replicas"] = pool.num_replicas
    return opts


def build_app(args: dict) -> serve.Application:
    """Validate `args` (raising ConfigError naming the field) and return the application."""
    if not isinstance(args, dict):
        raise ConfigError(f"the application's args must be a mapping, got {type(args).__name__}")
    cfg: AppConfig = parse_args(args, prefix=("args",))
    plain = cfg.model_dump(mode="json")
    engine = serve.deployment(EngineServer)
    prefill = engine.options(**_pool_options("prefill", cfg.prefill, cfg.engine.device)).bind(plain, Role.PREFILL.value)
    decode = engine.options(**_pool_options("decode", cfg.decode, cfg.engine.device)).bind(plain, Role.DECODE.value)
    router = serve.deployment(Router).options(
        name="router",
        num_replicas=1,
        max_ongoing_requests=4096,
        ray_actor_options={"num_cpus": cfg.router.num_cpus},
    )
    return router.bind(prefill, decode, plain)
