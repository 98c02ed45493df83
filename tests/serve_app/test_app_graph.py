"""The production config and application graph, checked without a GPU (nothing is started)."""

from pathlib import Path

import pytest
import yaml

pytest.importorskip("ray.serve")

from serve_app.app import PINNED_ROUTER, build_app  # noqa: E402
from serve_app.config import ConfigError, load_serve_config  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]


def _args(name: str) -> dict:
    return yaml.safe_load((ROOT / "deployments" / name).read_text())["applications"][0]["args"]


def _graph(args: dict):
    router = build_app(args)._bound_deployment
    prefill, decode = (a._bound_deployment for a in router.init_args[:2])
    return router, prefill, decode


def test_production_graph_is_the_papers_topology_on_gpus():
    router, prefill, decode = _graph(_args("disagg.yaml"))
    assert (router.name, prefill.name, decode.name) == ("router", "prefill", "decode")
    assert prefill.ray_actor_options["num_gpus"] == 1 and decode.ray_actor_options["num_gpus"] == 1
    assert prefill._deployment_config.num_replicas == 2
    auto = decode._deployment_config.autoscaling_config
    assert (auto.min_replicas, auto.max_replicas, auto.initial_replicas) == (2, 6, 4)
    for pool in (prefill, decode):
        rr = pool._deployment_config.request_router_config
        assert rr.request_router_class == PINNED_ROUTER
    cfg = router.init_args[2]
    assert cfg["engine"]["device"] == "cuda" and cfg["model"]["source"] == "Qwen/Qwen2.5-3B-Instruct"
    assert cfg["engine"]["engine_kwargs"]["num_gpu_blocks_override"] * 16 == 60000


def test_cpu_profile_graph_fits_two_cores():
    router, prefill, decode = _graph(_args("local.yaml"))
    total = sum(d.ray_actor_options["num_cpus"] * (d._deployment_config.num_replicas or 1)
                for d in (router, prefill, decode))
    assert prefill._deployment_config.num_replicas == 1 and decode._deployment_config.num_replicas == 2
    assert total <= 2.0
    assert all(d.ray_actor_options.get("num_gpus", 0) == 0 for d in (prefill, decode))


@pytest.mark.parametrize("file, policy", [
    ("disagg.yaml", "slo_goodput"), ("local.yaml", "slo_goodput"), ("local-2p2d.yaml", "slo_goodput"),
    # these need every request disaggregated: the planner sizes pools so, 2node proves the cross-node hand-off
    ("local-autoscale.yaml", "marginal_cost"), ("local-2node.yaml", "marginal_cost")])
def test_shipped_configs_validate(file, policy):
    (name, cfg), = load_serve_config(ROOT / "deployments" / file)
    assert cfg.router.policy == policy  # the live SLO capacity's winner where nothing needs disaggregation


@pytest.mark.parametrize("mutate, field", [
    (lambda a: a["engine"].update(device="cuda", gpu_memory_utilization=0.9, kv_cache_memory_bytes=None), "num_gpus"),
    (lambda a: a["prefill"].update(num_gpus=1), "num_gpus"),
    (lambda a: a["engine"].pop("kv_cache_memory_bytes"), "kv_cache_memory_bytes"),
    (lambda a: a["router"].update(policy="oracle"), "simulator only"),
    (lambda a: a["router"].update(policy="nope"), "known policies"),
    (lambda a: a["decode"].update(autoscaling={"min_replicas": 3, "max_replicas": 1}), "min_replicas"),
    (lambda a: a["model"].pop("served_name"), "served_name"),
    (lambda a: a["engine"].update(turbo=True), "turbo"),
    (lambda a: a["engine"].update(side_channel_ports=[30000, 29999]), "side_channel_ports"),
    (lambda a: a["engine"].update(side_channel_ports=[80, 90]), "side_channel_ports"),
    (lambda a: a["engine"].update(warmup_timeout_s=0), "warmup_timeout_s"),
    (lambda a: a["router"].update(num_replicas=0), "num_replicas"),
    (lambda a: a["decode"].update(resources={"GPU": 1}), "resources"),
    (lambda a: a["decode"].update(resources={"decode_node": 0}), "resources"),
])
def test_bad_configs_are_refused_naming_the_field(mutate, field):
    args = _args("local.yaml")
    mutate(args)
    with pytest.raises(ConfigError, match=field):
        build_app(args)


def test_config_file_errors_name_file_and_line(tmp_path):
    doc = yaml.safe_load((ROOT / "deployments" / "local.yaml").read_text())
    doc["applications"][0]["args"]["engine"]["max_num_seqs"] = -1
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump(doc, sort_keys=False))
    with pytest.raises(ConfigError) as e:
        load_serve_config(bad)
    line = next(i for i, l in enumerate(bad.read_text().splitlines(), 1) if "max_num_seqs" in l)
    assert str(e.value).startswith(f"{bad}:{line}: field 'applications.0.args.engine.max_num_seqs'")


def test_a_cost_model_calibrated_for_another_model_is_refused(tmp_path):
    from disagg.core.cost_model import load_profile

    cm = load_profile("cpu-tiny").model_copy(update={"calibrated": True, "model": "Qwen/Qwen2.5-3B-Instruct"})
    cm.save(tmp_path / "cm.yaml")
    args = _args("local.yaml")
    args["router"]["cost_model"] = str(tmp_path / "cm.yaml")
    with pytest.raises(ConfigError, match="calibrated for model 'Qwen/Qwen2.5-3B-Instruct'.*'tiny:tiny'"):
        build_app(args)


def test_pools_pinned_by_custom_resources_start_one_local_node_each():
    """local-2node.yaml: each pool asks for its own resource, and the local launcher starts one
    node offering each (the head the first), so the prefill and decode engines run on two nodes."""
    from serve_app.launch import node_resources

    router, prefill, decode = _graph(_args("local-2node.yaml"))
    assert prefill.ray_actor_options["resources"] == {"prefill_node": 1}
    assert decode.ray_actor_options["resources"] == {"decode_node": 1}
    assert "resources" not in router.ray_actor_options
    nodes = node_resources(load_serve_config(ROOT / "deployments" / "local-2node.yaml"))
    assert [sorted(n) for n in nodes] == [["prefill_node"], ["decode_node"]]
    assert node_resources(load_serve_config(ROOT / "deployments" / "local.yaml")) == [{}]  # one node


def test_decode_replicas_get_the_prefill_pool_for_their_warm_up_handoff():
    router, prefill, decode = _graph(_args("local.yaml"))
    (peer,) = decode.init_args[2:]
    assert peer._bound_deployment.name == "prefill"
    assert prefill.init_args[2:] == ()  # a prefill replica proves itself alone: it never waits for a decode


def test_engines_write_no_access_line_per_call_unless_asked():
    args = _args("local.yaml")
    _, prefill, decode = _graph(args)
    assert not prefill._deployment_config.logging_config["enable_access_log"]
    assert not decode._deployment_config.logging_config["enable_access_log"]
    args["engine"]["access_log"] = True
    _, prefill, _ = _graph(args)
    assert prefill._deployment_config.logging_config["enable_access_log"]


def test_router_replicas_fixed_or_autoscaled():
    args = _args("local.yaml")
    router, _, _ = _graph(args)
    assert router._deployment_config.num_replicas == 2  # the CPU profile runs two routers
    args["router"]["autoscaling"] = {"min_replicas": 1, "max_replicas": 4, "target_ongoing_requests": 64}
    router, _, _ = _graph(args)
    auto = router._deployment_config.autoscaling_config
    assert (auto.min_replicas, auto.max_replicas, auto.initial_replicas) == (1, 4, 2)


def test_an_engine_pool_autoscaled_on_ongoing_requests_does_not_count_the_routers_state_streams():
    """Each router replica keeps one state stream open on every engine replica: the target Serve
    compares ongoing requests with is the configured one plus those streams."""
    args = _args("disagg.yaml")
    _, _, decode = _graph(args)
    routers = args["router"].get("num_replicas", 1)
    assert decode._deployment_config.autoscaling_config.target_ongoing_requests == 32 + routers
    args["router"]["num_replicas"] = 4
    _, _, decode = _graph(args)
    assert decode._deployment_config.autoscaling_config.target_ongoing_requests == 36


def test_cluster_yaml_holds_the_production_graph():
    """cluster.yaml (the Ray cluster launcher's file) gives disagg.yaml's engines a GPU each at their
    widest, installs the GPU extra on every node and starts Ray with Serve's fast path."""
    cluster = yaml.safe_load((ROOT / "cluster.yaml").read_text())
    types = cluster["available_node_types"]
    gpus = sum(t["resources"].get("GPU", 0) * t.get("max_workers", 1)
               for name, t in types.items() if name != cluster["head_node_type"])
    (_, cfg), = load_serve_config(ROOT / "deployments" / "disagg.yaml")
    widest = sum((p.autoscaling.max_replicas if p.autoscaling else p.num_replicas) * p.num_gpus
                 for p in cfg.pools().values())
    assert gpus >= widest == 8
    assert types[cluster["head_node_type"]]["resources"]["GPU"] == 0  # GPUs only where engines run
    assert any('".[gpu' in c for c in cluster["setup_commands"])
    for cmds in (cluster["head_start_ray_commands"], cluster["worker_start_ray_commands"]):
        start = next(c for c in cmds if "ray start" in c)
        assert "RAY_SERVE_ENABLE_HA_PROXY=1" in start and "RAY_SERVE_THROUGHPUT_OPTIMIZED=1" in start
