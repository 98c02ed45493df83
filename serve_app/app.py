"""`build_app`: the one function that wires the application graph from the config.

    router (ingress, FastAPI) ──handle──▶ prefill pool (engine replicas)
                              └─handle──▶ decode pool  (engine replicas)

or, for a colocated pool, one handle to engines that prefill and decode. With several models
(`MultiModelConfig`), each model gets its own pools, named `<served name>-prefill` /
`-decode` / `-colocated`, and the one router holds a handle to every pool.

The Serve config file points its application's `import_path` at `serve_app.app:build_app`
and puts our configuration (`serve_app.config.AppConfig`) under `args`. The same function
builds the production GPU graph (deployments/disagg.yaml) and the CPU profile
(deployments/local.yaml); only resource shapes and engine settings differ.
"""

from __future__ import annotations

from ray import serve
from ray.serve.config import RequestRouterConfig

from disagg.core.types import Role
from serve_app.config import (
    POOL_ROLES, AppConfig, ConfigError, MultiModelConfig, PoolConfig, RouterSettings, parse_args,
)
from serve_app.engine_server import EngineServer
from serve_app.engine_standin import StandInEngine, vllm_wire_names
from serve_app.router import Router

PINNED_ROUTER = "serve_app.pinned_router:PinnedReplicaRouter"


def placement(pool: PoolConfig) -> dict:
    """A GPU replica reserves what its engine needs as one placement-group bundle on one node: its
    CPUs, its custom resources and all `tensor_parallel_size` GPUs, atomically (a half-placed
    tensor-parallel engine would hold GPUs it cannot use). The replica actor takes the whole bundle,
    so Ray sets `CUDA_VISIBLE_DEVICES` to those GPUs, and vLLM's workers, spawned by the engine,
    inherit it. CPU pools need none: they take fractions of cores."""
    if not pool.num_gpus:
        return {}
    bundle = {"CPU": pool.num_cpus, "GPU": pool.num_gpus, **pool.resources}
    return {"placement_group_bundles": [{k: v for k, v in bundle.items() if v}],
            "placement_group_strategy": "STRICT_PACK"}


def _pool_options(name: str, pool: PoolConfig, access_log: bool, state_streams: int) -> dict:
    """`state_streams`: the router replicas' state streams each engine replica holds (one each; with
    router autoscaling, its minimum)."""
    opts = {
        "name": name,
        "max_ongoing_requests": pool.max_ongoing_requests,
        "ray_actor_options": {"num_cpus": pool.num_cpus, "num_gpus": pool.num_gpus,
                              "runtime_env": {"env_vars": dict(pool.env)} if pool.env else {},
                              **({"resources": dict(pool.resources)} if pool.resources else {})},
        **placement(pool),
        "request_router_config": RequestRouterConfig(request_router_class=PINNED_ROUTER),
        "health_check_period_s": 10,
        "health_check_timeout_s": 30,
        # engines take 15-50 s to start on small CPUs, minutes for big models on GPUs
        "graceful_shutdown_timeout_s": 20,
        # Warnings and errors stay; the per-call access lines (one per state poll) go unless asked for
        "logging_config": {"enable_access_log": access_log},
    }
    if pool.autoscaling:
        opts["autoscaling_config"] = pool.autoscaling.to_serve(pool.num_replicas, state_streams)
    else:
        opts["num_replicas"] = pool.num_replicas
    return opts


def _engine_pools(cfg: AppConfig, prefix: str = "") -> dict[str, serve.Application]:
    """Role value → the bound engine deployment of each of this model's pools.

    A decode pool gets a handle to its model's prefill pool: each decode replica's warm-up pulls
    KV from a prefill replica before it reports ready.
    """
    plain = cfg.model_dump(mode="json")
    engine = serve.deployment(StandInEngine if cfg.engine.stand_in else EngineServer)
    extra = {"wire_names": vllm_wire_names()} if cfg.engine.stand_in else {}
    routers = cfg.router.autoscaling.min_replicas if cfg.router.autoscaling else cfg.router.num_replicas
    bound: dict[str, serve.Application] = {}
    for name in sorted(cfg.pools(), key=lambda n: n != "prefill"):  # prefill first: decode binds it
        role = POOL_ROLES[name]
        peer = (bound[Role.PREFILL.value],) if role is Role.DECODE else ()
        bound[role.value] = (engine.options(**_pool_options(prefix + name, cfg.pools()[name], cfg.engine.access_log,
                                                            routers))
                             .bind(plain, role.value, *peer, **extra))
    return bound


def build_app(args: dict) -> serve.Application:
    """Validate `args` (raising ConfigError naming the field) and return the application."""
    if not isinstance(args, dict):
        raise ConfigError(f"the application's args must be a mapping, got {type(args).__name__}")
    cfg = parse_args(args, prefix=("args",))
    if isinstance(cfg, MultiModelConfig):
        pools = {m.model.served_name: _engine_pools(m.app_config(cfg.router), f"{m.deployment_prefix}-")
                 for m in cfg.models}
        return _router(cfg.router).bind(None, None, cfg.model_dump(mode="json"), pools)
    pools = _engine_pools(cfg)
    if cfg.is_colocated:
        return _router(cfg.router).bind(None, None, cfg.model_dump(mode="json"), {cfg.model.served_name: pools})
    return _router(cfg.router).bind(pools[Role.PREFILL.value], pools[Role.DECODE.value], cfg.model_dump(mode="json"))


def _router(rc: RouterSettings) -> serve.Deployment:
    """The router deployment: `router.num_replicas` replicas, or Serve's autoscaling between bounds."""
    opts = {"name": "router", "max_ongoing_requests": 4096, "ray_actor_options": {"num_cpus": rc.num_cpus},
            "graceful_shutdown_timeout_s": rc.drain_timeout_s}
    if rc.autoscaling:
        opts["autoscaling_config"] = rc.autoscaling.to_serve(rc.num_replicas)
    else:
        opts["num_replicas"] = rc.num_replicas
    return serve.deployment(Router).options(**opts)
