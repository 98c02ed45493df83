"""What one vLLM engine is started with, as pure functions of its `EngineSpec`.

`VllmEngine.start()` (serve_app.engine) builds vLLM's `AsyncEngineArgs(**engine_kwargs(spec))`,
with `KVTransferConfig(**kv_transfer_config(spec))` in it, and sets `engine_env(spec)` while the
EngineCore process is spawned. Nothing here imports vLLM (except `engine_env` when asked to detect
the platform), so the arguments a GPU replica would start with are checked by golden tests on a
machine without GPUs, and `AsyncEngineArgs(**kwargs)` is constructed there from every shipped config.

KV movement (`engine.kv_transfer` in the config):
- `connector`: vLLM's `NixlConnector` (an alias of `NixlPullConnector`: the decode engine READs
  the blocks) or `NixlPushConnector` (the prefill engine WRITEs them). Over RDMA both run at line
  rate; over `cuda_ipc` (GPUs of one node without RDMA) UCX serves a remote WRITE at full speed
  and a remote READ over TCP, so push is the fast one there (vllm#52607: 0.5 against 49 GB/s).
- `kv_buffer_device`: `cuda` registers the KV cache itself with NIXL; `cpu` stages transfers
  through a host buffer, for GPUs whose memory NIXL cannot register. The CPU platform has only `cpu`.
- `nixl_backends` ([UCX]) and the UCX variables `UCX_TLS` / `UCX_NET_DEVICES`, which vLLM's NIXL
  guide sets to pin the transports and NICs UCX may use.

Tensor parallelism: `tensor_parallel_size` workers of vLLM's multiprocessing executor, inside the
one replica; its GPUs are the replica's (`serve_app.app` reserves them as one placement-group
bundle, and Ray sets `CUDA_VISIBLE_DEVICES` for the replica, which the EngineCore inherits).
"""

from __future__ import annotations

import getpass
import os
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from disagg.core.types import Role

KV_BUFFER_DEVICES = ("cpu", "cuda")
KV_CONNECTORS = ("NixlConnector", "NixlPushConnector")  # pull (vLLM's default name) and push
NIXL_BACKENDS = ("UCX", "LIBFABRIC", "GDS", "GDS_MT", "POSIX", "Mooncake")
# Fields vLLM must not take from `engine_kwargs`: the spec sets them, or the router's contract needs
# them (one replica = one engine of one process group; the multiprocessing executor).
RESERVED_ENGINE_KWARGS = frozenset({
    "kv_transfer_config", "kv_events_config", "stat_loggers", "pipeline_parallel_size", "data_parallel_size",
    "distributed_executor_backend"})
KV_EVENTS_SOCKET = "kv-events"  # in the engine's runtime folder: where its EngineCore publishes KV events


@dataclass(frozen=True, slots=True)
class EngineSpec:
    """Everything needed to start one engine. Validated on construction.

    Memory: on the CPU platform give `kv_cache_memory_bytes` (vLLM would otherwise reserve
    `gpu_memory_utilization` = 90 % of *host RAM*); on GPUs give either. Not both.
    """

    model: str  # a local folder (e.g. build_tiny_model()) or a model name
    role: Role = Role.BOTH
    kv_buffer_device: Literal["cpu", "cuda"] = "cpu"
    kv_connector: str = "NixlConnector"
    nixl_backends: tuple[str, ...] = ("UCX",)
    ucx_tls: str | None = None  # UCX_TLS for this engine's NIXL agent; None: UCX picks
    ucx_net_devices: str | None = None  # UCX_NET_DEVICES; None: UCX picks
    side_channel_port: int = 5600  # NIXL handshake port; unique per engine on a host
    side_channel_host: str = "127.0.0.1"  # the address peers reach this engine's side channel on
    max_model_len: int = 2048
    max_num_seqs: int = 64
    max_num_batched_tokens: int | None = None  # None: vLLM's default for the platform
    kv_cache_memory_bytes: int | None = None
    gpu_memory_utilization: float | None = None
    block_size: int | None = None  # None: vLLM's default for the platform
    tensor_parallel_size: int = 1
    enforce_eager: bool = True
    seed: int = 0
    # CPU only: OpenMP core binding; None = the core(s) NixlConnector pins the worker to.
    cpu_omp_threads_bind: str | None = None
    # folder for vLLM's IPC sockets (VLLM_RPC_BASE_PATH); None: vLLM's default, the system temp folder
    runtime_dir: str | None = None
    # CUDA_VISIBLE_DEVICES for the engine's processes; None: the replica's (Ray sets it per GPU actor).
    # Set where one process starts several GPU engines (`disagg calibrate --config`).
    visible_devices: str | None = None
    # publish vLLM's KV-cache events (on an IPC socket in `runtime_dir`): the routers' exact prefix state
    kv_events: bool = True
    engine_kwargs: Mapping[str, Any] = field(default_factory=dict)  # extra AsyncEngineArgs fields

    def __post_init__(self) -> None:
        if not isinstance(self.role, Role):
            try:
                object.__setattr__(self, "role", Role(self.role))
            except ValueError:
                raise ValueError(f"unknown role {self.role!r}; allowed: "
                                 f"{', '.join(r.value for r in Role)}") from None
        _one_of("kv_buffer_device", self.kv_buffer_device, KV_BUFFER_DEVICES)
        _one_of("kv_connector", self.kv_connector, KV_CONNECTORS)
        if not self.nixl_backends:
            raise ValueError("nixl_backends is empty; give at least one, e.g. ['UCX']")
        for b in self.nixl_backends:
            _one_of("nixl_backends", b, NIXL_BACKENDS)
        if not 1 <= self.side_channel_port <= 65535:
            raise ValueError(f"side_channel_port {self.side_channel_port} is not a TCP port")
        if self.kv_cache_memory_bytes is not None and self.gpu_memory_utilization is not None:
            raise ValueError("give kv_cache_memory_bytes or gpu_memory_utilization, not both "
                             f"(got {self.kv_cache_memory_bytes} and {self.gpu_memory_utilization})")
        for name in ("max_model_len", "max_num_seqs", "tensor_parallel_size"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        reserved = RESERVED_ENGINE_KWARGS | {
            f for f in type(self).__dataclass_fields__ if f not in ("engine_kwargs", "role")}
        clash = reserved & set(self.engine_kwargs)
        if clash:
            raise ValueError(f"engine_kwargs may not set {sorted(clash)}: use the EngineSpec fields "
                             "(one replica is one engine: no pipeline or data parallelism inside it)")


def _one_of(name: str, value: Any, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ValueError(f"unknown {name} {value!r}; allowed: {', '.join(allowed)}")


# Spec fields passed to AsyncEngineArgs under the same name when set (None: vLLM's default).
_OPTIONAL_ARGS = ("max_num_batched_tokens", "kv_cache_memory_bytes", "gpu_memory_utilization", "block_size")


def kv_transfer_config(spec: EngineSpec) -> dict[str, Any]:
    """vLLM's `KVTransferConfig` fields for `spec`.

    Every engine is `kv_both`: the same engine class serves as prefill, decode or colocated engine,
    and a pool's role is the router's choice, not the engine's."""
    return {
        "kv_connector": spec.kv_connector,
        "kv_role": "kv_both",
        "kv_buffer_device": spec.kv_buffer_device,
        "kv_connector_extra_config": {"backends": list(spec.nixl_backends)},
    }


def kv_events_endpoint(spec: EngineSpec) -> str | None:
    """Where the engine publishes its KV-cache events (a ZeroMQ IPC socket its replica subscribes
    to); None when events are off or the spec has no runtime folder to put the socket in."""
    if not spec.kv_events or spec.runtime_dir is None:
        return None
    return f"ipc://{spec.runtime_dir}/{KV_EVENTS_SOCKET}"


def kv_events_config(spec: EngineSpec) -> dict[str, Any] | None:
    """vLLM's `KVEventsConfig` fields for `spec`, or None (events off)."""
    endpoint = kv_events_endpoint(spec)
    if endpoint is None:
        return None
    return {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": endpoint}


def engine_kwargs(spec: EngineSpec) -> dict[str, Any]:
    """vLLM's `AsyncEngineArgs` fields for `spec`; `kv_transfer_config` and `kv_events_config` as the
    dicts of the functions of those names (the caller builds vLLM's config objects from them)."""
    kwargs: dict[str, Any] = {
        "model": spec.model,
        "max_model_len": spec.max_model_len,
        "max_num_seqs": spec.max_num_seqs,
        "enforce_eager": spec.enforce_eager,
        "seed": spec.seed,
        "tensor_parallel_size": spec.tensor_parallel_size,
        # TP workers as processes of this replica, on the GPUs Ray gave it: no Ray actors of vLLM's own
        "distributed_executor_backend": "mp" if spec.tensor_parallel_size > 1 else None,
        # Our stat logger replaces vLLM's periodic log lines; stats stay enabled for it.
        "disable_log_stats": True,
        "kv_transfer_config": kv_transfer_config(spec),
    }
    if (events := kv_events_config(spec)) is not None:
        kwargs["kv_events_config"] = events
    if kwargs["distributed_executor_backend"] is None:
        del kwargs["distributed_executor_backend"]  # one worker: vLLM's own choice (in-process)
    for name in _OPTIONAL_ARGS:
        if (value := getattr(spec, name)) is not None:
            kwargs[name] = value
    kwargs.update(spec.engine_kwargs)
    return kwargs


def nixl_reserved_cpus() -> list[int]:
    """The cores vLLM's NixlConnector pins a CPU worker to: the highest core of each NUMA node.

    Mirrors `CpuPlatform.discover_numa_topology` + `NixlConnectorWorker.__init__` (vLLM 0.32)
    without importing vLLM. Falls back to the highest core this process may run on.
    """
    allowed = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    cores: list[int] = []
    node_root = "/sys/devices/system/node"
    try:
        nodes = sorted(n for n in os.listdir(node_root) if n.startswith("node") and n[4:].isdigit())
    except OSError:
        nodes = []
    for node in nodes:
        cpus = [int(c[3:]) for c in os.listdir(f"{node_root}/{node}")
                if c.startswith("cpu") and c[3:].isdigit()]
        if cpus:
            cores.append(max(cpus))
    if not cores and allowed:
        cores = [allowed[-1]]
    return sorted(cores)


def on_cpu_platform() -> bool:
    from vllm.platforms import current_platform

    return bool(current_platform.is_cpu())


def engine_env(spec: EngineSpec, *, cpu_platform: bool | None = None) -> dict[str, str]:
    """Environment variables to set before creating the engine of `spec` (start() does it).

    * `VLLM_NIXL_SIDE_CHANNEL_PORT` / `_HOST`: where this engine's NIXL handshake listens; peers
      learn it from `kv_transfer_params` (`remote_host`, `remote_port`).
    * `UCX_TLS` / `UCX_NET_DEVICES` when the spec sets them.
    * `CUDA_VISIBLE_DEVICES` when the spec names the engine's GPUs.
    * `VLLM_RPC_BASE_PATH` and `TMPDIR` when the spec has a `runtime_dir`: vLLM's IPC sockets and the
      engine processes' temp files go there, not to the system temp folder, and leave with the folder
      (torch's compile cache stays where it was: `TORCHINDUCTOR_CACHE_DIR`).
    * CPU platform only: `VLLM_CPU_OMP_THREADS_BIND` = the core(s) NixlConnector pins the worker
      to (see `serve_app.vllm_plugin` for why: without it, ~100x slower), unless the spec sets
      `cpu_omp_threads_bind`.
    `cpu_platform=None` asks vLLM which platform this is (imports vLLM).
    Not returned but enforced by start(): a `VLLM_CPU_KVCACHE_SPACE` inherited from the parent
    environment is removed while the engine starts if the spec sets `kv_cache_memory_bytes`
    (vLLM would let the legacy variable override it).
    """
    env = {
        "VLLM_NIXL_SIDE_CHANNEL_PORT": str(spec.side_channel_port),
        "VLLM_NIXL_SIDE_CHANNEL_HOST": spec.side_channel_host,
    }
    for var, value in (("UCX_TLS", spec.ucx_tls), ("UCX_NET_DEVICES", spec.ucx_net_devices),
                       ("CUDA_VISIBLE_DEVICES", spec.visible_devices)):
        if value is not None:
            env[var] = value
    if spec.runtime_dir is not None:
        env["VLLM_RPC_BASE_PATH"] = spec.runtime_dir  # read in this process, whose temp folder is fixed
        # the engine processes' other temp files: torch.distributed's file store, multiprocessing's folders
        env["TMPDIR"] = spec.runtime_dir
        # ... but not torch's compile cache, which is worth keeping across engine starts
        env["TORCHINDUCTOR_CACHE_DIR"] = os.environ.get("TORCHINDUCTOR_CACHE_DIR") or os.path.join(
            tempfile.gettempdir(), f"torchinductor_{getpass.getuser()}")
    if cpu_platform is None:
        cpu_platform = on_cpu_platform()
    if cpu_platform:
        bind = spec.cpu_omp_threads_bind
        if bind is None:
            # one binding per tensor-parallel rank ('|'-separated), each on the cores NIXL pins it to
            bind = "|".join([",".join(str(c) for c in nixl_reserved_cpus())] * spec.tensor_parallel_size)
        env["VLLM_CPU_OMP_THREADS_BIND"] = bind
    return env
