"""What every replica's vLLM engine would start with, checked without starting one (and without a GPU).

Golden tests of the `AsyncEngineArgs` fields, the `KVTransferConfig` and the environment a GPU
replica builds from the shipped production configs; vLLM's own `AsyncEngineArgs` and
`KVTransferConfig` constructed from them for every shipped config; the placement-group bundles of
GPU pools; the config refusals of impossible GPU layouts; the GPU split of `disagg calibrate --config`.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import yaml

from calibration.measure import GpuShortage, gpu_assignment, visible_gpus
from disagg.core.types import Role
from serve_app.config import ConfigError, load_serve_config, parse_args
from serve_app.engine import make_runtime_dir
from serve_app.engine_args import EngineSpec, engine_env, engine_kwargs, kv_transfer_config
from serve_app.engine_server import engine_spec

ROOT = Path(__file__).resolve().parents[2]
DEPLOYMENTS = sorted(p.name for p in (ROOT / "deployments").glob("*.yaml"))


def _config(name: str):
    (_, cfg), *_ = load_serve_config(ROOT / "deployments" / name)
    return cfg


def _args(name: str) -> dict:
    return yaml.safe_load((ROOT / "deployments" / name).read_text())["applications"][0]["args"]


def test_production_engine_golden():
    spec = engine_spec(_config("disagg.yaml"), Role.PREFILL, "10.0.0.7", 27001)
    assert engine_kwargs(spec) == {
        "model": "Qwen/Qwen2.5-3B-Instruct",
        "max_model_len": 8192,
        "max_num_seqs": 128,
        "max_num_batched_tokens": 2048,
        "gpu_memory_utilization": 0.9,
        "block_size": 16,  # the 3,750-block KV budget is counted in blocks of 16
        "num_gpu_blocks_override": 3750,
        "enforce_eager": False,
        "seed": 0,
        "tensor_parallel_size": 1,
        "disable_log_stats": True,
        "kv_transfer_config": {
            "kv_connector": "NixlConnector", "kv_role": "kv_both", "kv_buffer_device": "cuda",
            "kv_connector_extra_config": {"backends": ["UCX"]},
        },
    }
    assert engine_env(spec, cpu_platform=False) == {
        "VLLM_NIXL_SIDE_CHANNEL_PORT": "27001", "VLLM_NIXL_SIDE_CHANNEL_HOST": "10.0.0.7"}


def test_tensor_parallel_engine_golden():
    cfg = _config("disagg-70b-tp4.yaml")
    for role in (Role.PREFILL, Role.DECODE):
        kw = engine_kwargs(engine_spec(cfg, role, "10.0.0.7", 27001))
        assert kw["tensor_parallel_size"] == 4
        # the TP workers are processes of the replica, on the GPUs Ray gave it
        assert kw["distributed_executor_backend"] == "mp"
        assert kw["model"] == "meta-llama/Llama-3.3-70B-Instruct" and kw["block_size"] == 16
        assert kw["kv_transfer_config"]["kv_buffer_device"] == "cuda"


def test_kv_movement_is_configurable():
    args = _args("disagg.yaml")
    args["engine"]["kv_transfer"] = {"connector": "push", "buffer_device": "cpu", "backends": ["UCX"],
                                     "ucx_tls": "cuda_ipc,cuda_copy,tcp", "ucx_net_devices": "mlx5_0:1"}
    spec = engine_spec(parse_args(args), Role.DECODE, "10.0.0.7", 27002)
    assert kv_transfer_config(spec) == {
        "kv_connector": "NixlPushConnector", "kv_role": "kv_both", "kv_buffer_device": "cpu",
        "kv_connector_extra_config": {"backends": ["UCX"]}}
    env = engine_env(spec, cpu_platform=False)
    assert env["UCX_TLS"] == "cuda_ipc,cuda_copy,tcp" and env["UCX_NET_DEVICES"] == "mlx5_0:1"


def test_engines_publish_their_kv_events_on_a_socket_in_their_runtime_folder():
    spec = EngineSpec(model="m", runtime_dir="/run/engine-7")
    assert engine_kwargs(spec)["kv_events_config"] == {
        "enable_kv_cache_events": True, "publisher": "zmq", "endpoint": "ipc:///run/engine-7/kv-events"}
    assert "kv_events_config" not in engine_kwargs(dataclasses.replace(spec, kv_events=False))
    assert "kv_events_config" not in engine_kwargs(EngineSpec(model="m"))  # no folder yet: start() gives one
    with pytest.raises(ValueError, match="kv_events_config"):
        EngineSpec(model="m", engine_kwargs={"kv_events_config": {}})  # the spec's field, not a raw kwarg


def test_cpu_profile_engine_keeps_its_tunings():
    spec = engine_spec(_config("local.yaml"), Role.DECODE, "127.0.0.1", 27003)
    kw = engine_kwargs(spec)
    assert kw["kv_transfer_config"]["kv_buffer_device"] == "cpu" and kw["kv_cache_memory_bytes"] > 0
    assert "distributed_executor_backend" not in kw and "gpu_memory_utilization" not in kw
    env = engine_env(spec, cpu_platform=True)
    assert "UCX_TLS" not in env and env["VLLM_CPU_OMP_THREADS_BIND"]


@pytest.mark.parametrize("file", DEPLOYMENTS)
def test_vllm_takes_the_engine_args_of_every_shipped_config(file):
    """vLLM's own classes accept what every replica of every shipped config would pass them (with
    the runtime folder each engine's start gives it)."""
    from vllm.config import KVEventsConfig, KVTransferConfig
    from vllm.engine.arg_utils import AsyncEngineArgs

    apps = load_serve_config(ROOT / "deployments" / file)
    for _, cfg in apps:
        for role in (Role.BOTH,) if cfg.is_colocated else (Role.PREFILL, Role.DECODE):
            spec = dataclasses.replace(engine_spec(cfg, role, "127.0.0.1", 27000), runtime_dir="/run/engine")
            kw = engine_kwargs(spec)
            kw["kv_transfer_config"] = KVTransferConfig(**kw["kv_transfer_config"])
            if "kv_events_config" in kw:
                kw["kv_events_config"] = KVEventsConfig(**kw["kv_events_config"])
            args = AsyncEngineArgs(**kw)
            assert args.kv_transfer_config.kv_connector == cfg.engine.kv_transfer.vllm_connector
            events = args.kv_events_config
            assert (events is not None and events.enable_kv_cache_events) == cfg.engine.kv_events
            assert args.tensor_parallel_size == cfg.pool_of(role).tensor_parallel_size


def test_gpu_replicas_reserve_their_engine_as_one_bundle():
    from serve_app.app import build_app

    def pools(name):
        router = build_app(_args(name))._bound_deployment
        return [a._bound_deployment for a in router.init_args[:2]]

    for name, gpus in (("disagg.yaml", 1), ("disagg-70b-tp4.yaml", 4)):
        for pool in pools(name):
            rc = pool._replica_config
            assert rc.placement_group_strategy == "STRICT_PACK"
            (bundle,) = rc.placement_group_bundles
            assert bundle["GPU"] == gpus and bundle["CPU"] == pool.ray_actor_options["num_cpus"]
            assert pool.ray_actor_options["num_gpus"] == gpus  # the replica takes the whole bundle
    for pool in pools("local.yaml"):
        assert pool._replica_config.placement_group_bundles is None  # CPU engines share cores


@pytest.mark.parametrize("mutate, message", [
    (lambda a: a["decode"].update(tensor_parallel_size=4), "decode.tensor_parallel_size 4 is more than the 1 GPUs"),
    (lambda a: a["prefill"].update(num_gpus=2), "prefill.num_gpus 2 with tensor_parallel_size 1"),
    (lambda a: a["prefill"].update(num_gpus=0.5), "prefill.tensor_parallel_size 1 is more than the 0.5 GPUs"),
    (lambda a: a["engine"]["engine_kwargs"].update(tensor_parallel_size=2), "tensor_parallel_size: set by the config"),
    (lambda a: a["engine"]["engine_kwargs"].update(pipeline_parallel_size=2), "no pipeline or data parallelism"),
    (lambda a: a["engine"]["engine_kwargs"].update(kv_transfer_config={}), "use engine.kv_transfer"),
    (lambda a: a["engine"]["kv_transfer"].update(connector="shared_storage"), "connector"),
    (lambda a: a["engine"]["kv_transfer"].update(backends=["RDMA"]), "unknown NIXL backend 'RDMA'"),
])
def test_impossible_gpu_layouts_are_refused(mutate, message):
    args = _args("disagg.yaml")
    mutate(args)
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        parse_args(args)


def test_cpu_engines_take_no_gpu_buffers():
    args = _args("local.yaml")
    args["engine"]["kv_transfer"] = {"buffer_device": "cuda"}
    with pytest.raises(ConfigError, match="buffer_device 'cuda' needs engine.device 'cuda'"):
        parse_args(args)


def test_check_config_refuses_a_tensor_parallel_engine_without_its_gpus(tmp_path):
    """The CLI names file, line and field."""
    import subprocess
    import sys

    doc = yaml.safe_load((ROOT / "deployments" / "disagg-70b-tp4.yaml").read_text())
    doc["applications"][0]["args"]["decode"]["num_gpus"] = 2
    bad = tmp_path / "tp.yaml"
    bad.write_text(yaml.safe_dump(doc, sort_keys=False))
    r = subprocess.run([sys.executable, "-m", "disagg.cli", "check-config", str(bad)], capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 2
    assert f"{bad}:" in r.stderr and "decode.tensor_parallel_size 4 is more than the 2 GPUs" in r.stderr
    ok = subprocess.run([sys.executable, "-m", "disagg.cli", "check-config",
                         str(ROOT / "deployments" / "disagg-70b-tp4.yaml")], capture_output=True, text=True,
                        timeout=120)
    assert ok.returncode == 0 and "2 prefill (TP 4) + 2 decode (TP 4) on cuda" in ok.stdout


def test_calibration_gives_each_engine_its_own_gpus():
    assert gpu_assignment(["0", "1"], 1, 1) == ("0", "1")
    assert gpu_assignment(["4", "5", "6", "7", "0", "1", "2", "3"], 4, 4) == ("4,5,6,7", "0,1,2,3")
    with pytest.raises(GpuShortage, match="--live"):
        gpu_assignment(["0"], 1, 1)  # both engines on GPU 0 would fail at the second one's start
    with pytest.raises(GpuShortage, match="4 \\+ 4 GPUs"):
        gpu_assignment(["0", "1", "2", "3"], 4, 4)


def test_visible_gpus_follow_cuda_visible_devices():
    assert visible_gpus({"CUDA_VISIBLE_DEVICES": "2, 3"}) == ["2", "3"]
    assert visible_gpus({"CUDA_VISIBLE_DEVICES": ""}) == []


def test_spec_sets_each_engines_gpus_and_runtime_folder():
    spec = EngineSpec(model="m", visible_devices="2,3", runtime_dir="/run/x")
    env = engine_env(spec, cpu_platform=False)
    assert env["CUDA_VISIBLE_DEVICES"] == "2,3" and env["VLLM_RPC_BASE_PATH"] == env["TMPDIR"] == "/run/x"
    assert not env["TORCHINDUCTOR_CACHE_DIR"].startswith("/run/x")  # the compile cache outlives the engine
    assert "CUDA_VISIBLE_DEVICES" not in engine_env(EngineSpec(model="m"), cpu_platform=False)


def test_engine_runtime_folders_live_under_the_stacks(tmp_path, monkeypatch):
    monkeypatch.setenv("DISAGG_RUNTIME_DIR", str(tmp_path / "stack"))
    a, b = make_runtime_dir(), make_runtime_dir()
    assert a != b and all(Path(d).parent == tmp_path / "stack" for d in (a, b))
