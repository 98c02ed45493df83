"""cluster.yaml, the Ray cluster launcher's file for production GPU clusters: it passes the config
preparation and schema check that `ray up` runs before it contacts the cloud, and keeps what lets it
boot: named host and container images (Ray's defaults cannot run vLLM's CUDA build), a copy of the
repository without the local venv or run outputs, the gpu extra installed on every node, GPUs only
on the worker nodes. No cluster, no network."""

from __future__ import annotations

import ast
import copy
import fnmatch
import json
import re
import shlex
import tomllib
from pathlib import Path

import jsonschema
import pytest
import ray.autoscaler
import yaml
from packaging.requirements import Requirement
from ray.autoscaler._private import commands
from ray.autoscaler._private.command_runner import SSHCommandRunner

ROOT = Path(__file__).resolve().parents[1]
CLUSTER = ROOT / "cluster.yaml"


class _NoCloud:
    """Stands in for the AWS provider, whose checks need credentials and the network; `ray up` has
    prepared and validated the config by the time it gets here."""

    def __init__(self):
        self.reached = False

    def fillout_available_node_types_resources(self, config):
        return config

    def bootstrap_config(self, config):
        self.reached = True
        return config


def _bootstrap(config: dict, monkeypatch) -> tuple[dict, _NoCloud]:
    """Ray's own `_bootstrap_config`, as `ray up` calls it: defaults merged in, setup commands
    merged, docker checked, then the schema; only the provider's part is stubbed."""
    provider = _NoCloud()
    monkeypatch.setitem(commands._NODE_PROVIDERS, config["provider"]["type"], lambda _: provider)
    return commands._bootstrap_config(copy.deepcopy(config), no_config_cache=True), provider


@pytest.fixture
def prepared(monkeypatch) -> dict:
    config, provider = _bootstrap(yaml.safe_load(CLUSTER.read_text()), monkeypatch)
    assert provider.reached
    return config


def _extras() -> dict[str, list[str]]:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]


def _default_amis() -> set[str]:
    """Ray's default AMIs, read from the installed Ray's source (importing it needs boto3)."""
    source = (Path(ray.autoscaler.__file__).parent / "_private" / "aws" / "config.py").read_text()
    for node in ast.parse(source).body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "DEFAULT_AMI" for t in node.targets):
            return set(ast.literal_eval(node.value).values())
    raise AssertionError("DEFAULT_AMI not found in Ray's AWS config")


def _head(config: dict) -> dict:
    return config["available_node_types"][config["head_node_type"]]


def _workers(config: dict) -> dict[str, dict]:
    return {n: t for n, t in config["available_node_types"].items() if n != config["head_node_type"]}


def _docker_run_options(config: dict, node_type: str) -> list[str]:
    """What `docker run` gets on a node of this type: the global docker config updated by the node
    type's own, as the launcher merges them for workers (StandardAutoscaler), then run_options plus
    the head's or the workers' own."""
    docker = copy.deepcopy(config.get("docker", {}))
    role = "head" if node_type == config["head_node_type"] else "worker"
    if role == "worker":
        docker.update(config["available_node_types"][node_type].get("docker", {}))
    return docker.get("run_options", []) + docker.get(f"{role}_run_options", [])


def test_ray_up_accepts_the_config(prepared):
    assert prepared["cluster_name"] == "disagg"
    assert (prepared["provider"]["type"], prepared["provider"]["region"]) == ("aws", "us-west-2")
    assert set(prepared["available_node_types"]) == {"head", "gpu_worker"}


@pytest.mark.parametrize("where, key, misspelled", [
    ("top", "setup_commands", "setup_comands"),  # else Ray's default setup commands would run instead
    ("docker", "run_options", "run_option"),
    ("gpu_worker", "min_workers", "min_worker"),
])
def test_a_misspelled_key_fails_the_check(monkeypatch, where, key, misspelled):
    config = yaml.safe_load(CLUSTER.read_text())
    section = {"top": config, "docker": config["docker"], **config["available_node_types"]}[where]
    section[misspelled] = section.pop(key)
    with pytest.raises(jsonschema.ValidationError, match=re.escape(repr(misspelled))):
        _bootstrap(config, monkeypatch)


def test_every_node_boots_a_named_host_image_not_rays_default(prepared):
    defaults = _default_amis()
    assert defaults  # the installed Ray still has its table
    for name, node_type in prepared["available_node_types"].items():
        ami = node_type["node_config"].get("ImageId", "")
        assert ami and ami.lower() != "latest_dlami", f"{name}: no ImageId, so Ray's default AMI"
        assert ami not in defaults, f"{name}: {ami} is one of Ray's default AMIs"


def test_the_container_is_rays_image_for_the_pinned_ray_and_python(prepared):
    image = prepared["docker"]["image"]
    schema = json.loads((Path(ray.autoscaler.__file__).parent / "ray-schema.json").read_text())
    assert image != schema["properties"]["docker"]["properties"]["image"]["default"]
    assert prepared["docker"]["container_name"]
    # one image on every node: the GPU image has the C compiler the install needs, the CPU one not
    assert not {"head_image", "worker_image"} & set(prepared["docker"])
    assert all("worker_image" not in t.get("docker", {}) for t in prepared["available_node_types"].values())
    tag = re.fullmatch(r"rayproject/ray:(\d+\.\d+\.\d+)-py3(\d+)-cu(\d+)", image)
    assert tag, f"{image}: not a versioned CUDA build of Ray's image"
    ray_pin = next(Requirement(r) for r in _extras()["gpu"] if Requirement(r).name == "ray")
    assert ray_pin.specifier.contains(tag[1]), f"{image} does not hold the gpu extra's {ray_pin}"
    assert int(tag[2]) >= 11  # vLLM 0.32 requires Python >= 3.11


def test_gpu_workers_offer_gpus_and_the_head_none(prepared):
    assert _head(prepared)["resources"].get("GPU", 0) == 0
    assert "--gpus all" not in _docker_run_options(prepared, prepared["head_node_type"])
    workers = _workers(prepared)
    assert workers
    for name, node_type in workers.items():
        assert node_type["resources"]["GPU"] > 0
        assert node_type["min_workers"] >= 1
        assert "--gpus all" in _docker_run_options(prepared, name), f"{name}: containers would see no GPU"


def _installed_extras(cmds: list[str]) -> list[set[str]]:
    """The extras of each `pip install ... .[extras]` in these commands."""
    found = []
    for cmd in cmds:
        for part in re.split(r"&&|;", cmd):
            words = shlex.split(part)
            if "pip" in words and "install" in words:
                found += [set(w[2:-1].split(",")) for w in words if w.startswith(".[") and w.endswith("]")]
    return found


def test_every_node_installs_exactly_the_gpu_extra(prepared):
    extras = _extras()
    assert "gpu" in extras
    assert {"vllm", "nixl", "ray"} <= {Requirement(r).name for r in extras["gpu"]}
    (remote,) = [r for r, local in prepared["file_mounts"].items() if local == "."]  # the repository
    head_cmds = prepared["head_setup_commands"]  # setup_commands merged in, as `ray up` does
    assert _installed_extras(head_cmds) == [{"gpu"}]
    assert any(f"cd {remote}" in c and ".[gpu]" in c for c in head_cmds)
    for name, node_type in _workers(prepared).items():
        cmds = node_type.get("worker_setup_commands", prepared["worker_setup_commands"])
        assert _installed_extras(cmds) == [{"gpu"}], name


def _rsync_excludes(path: str, patterns: list[str]) -> bool:
    """Whether rsync leaves `path` (relative to the transfer root) out under these --exclude
    patterns: a leading "/" anchors a pattern at the root, another "/" matches the path's end, no "/"
    matches any single name; a trailing "/" matches directories only; "*" stays inside one name; and
    rsync does not descend into an excluded directory."""
    parts = path.split("/")
    for depth in range(1, len(parts) + 1):
        head, is_dir = parts[:depth], depth < len(parts)
        for pattern in patterns:
            if pattern.endswith("/") and not is_dir:
                continue
            names = pattern.strip("/").split("/")
            if pattern.startswith("/"):
                tail = head if len(head) == len(names) else None
            else:
                tail = head[-len(names):] if len(head) >= len(names) else None
            if tail and all(fnmatch.fnmatchcase(a, b) for a, b in zip(tail, names)):
                return True
    return False


@pytest.mark.parametrize("path, pattern, excluded", [
    ("runs/x.jsonl", "/runs/", True),
    ("a/runs/x.jsonl", "/runs/", False),   # anchored
    ("runs", "/runs/", False),             # a file, and the pattern wants a directory
    ("a/b/m.so", "*.so", True),
    ("a/data/traces/t.csv", "data/traces/", True),
    ("a.so/b.py", "*.so", True),           # an excluded directory takes its content along
])
def test_the_rsync_matcher_follows_rsync(path, pattern, excluded):
    assert _rsync_excludes(path, [pattern]) is excluded


def test_the_repository_copy_leaves_out_the_venv_run_outputs_and_builds(prepared):
    args = SSHCommandRunner._create_rsync_filter_args(None, {
        "rsync_exclude": prepared["rsync_exclude"], "rsync_filter": prepared["rsync_filter"]})
    excludes = [args[i + 1] for i, a in enumerate(args) if a == "--exclude"]  # what Ray hands rsync
    for path in [".venv/lib/python3.11/site-packages/torch/lib/libtorch_cpu.so", ".venv/bin/python",
                 "runs/requests.jsonl", "data/traces/azure_conv_2023.csv", ".cache/tiny-model/config.json",
                 "disagg/__pycache__/cli.cpython-311.pyc", "build/lib/disagg/core/engine_model.c",
                 "disagg.egg-info/PKG-INFO", "disagg/core/engine_model.cpython-311-x86_64-linux-gnu.so"]:
        assert _rsync_excludes(path, excludes), f"{path} would be shipped to every node"
    sources = [p.relative_to(ROOT).as_posix() for d in ("disagg", "serve_app", "calibration", "deployments")
               for p in (ROOT / d).rglob("*") if p.is_file() and p.suffix in (".py", ".yaml", ".json")
               and "__pycache__" not in p.parts]
    needed = ["pyproject.toml", "setup.py", "README.md", "data/evaluations/synthetic.csv", *sources]
    assert "disagg/core/engine_model.py" in needed
    kept = [p for p in needed if not _rsync_excludes(p, excludes)]
    assert set(needed) - set(kept) <= {"disagg/core/compiled-sources.json"}  # the build rewrites it


def test_every_ray_process_gets_the_admin_token_and_a_drain_window_the_routers_outlast(prepared):
    """disagg.yaml's routers read the admin token from DISAGG_ADMIN_TOKEN (unset: they refuse to start),
    so every node's `ray start` exports it, from a file mounted on every node; the HAProxy drain
    window Serve holds a stopping router open for is shorter than the routers' drain budget."""
    from serve_app.config import load_serve_config

    (_, cfg), = load_serve_config(ROOT / "deployments" / "disagg.yaml")
    assert cfg.router.admin_token_env == "DISAGG_ADMIN_TOKEN"
    secret = next(r for r, local in prepared["file_mounts"].items() if local == ".secrets/admin-token")
    for key in ("head_start_ray_commands", "worker_start_ray_commands"):
        start = next(c for c in prepared[key] if "ray start" in c)
        assert f"export DISAGG_ADMIN_TOKEN=$(cat {secret});" in start, key
        window = float(re.search(r"RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S=(\S+)", start).group(1))
        assert window < cfg.router.drain_timeout_s / 2, key
    # not committed, and so not shipped with the repository either (rsync_filter: .gitignore)
    assert "/.secrets/" in (ROOT / ".gitignore").read_text().splitlines()
    assert ".gitignore" in prepared["rsync_filter"]
