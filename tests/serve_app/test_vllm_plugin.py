"""The vLLM plugin's per-process CPU setup: asks for AMX exactly when the CPU has it, never raises.

The live proof is every engine replica's warm-up handoff (a decode step right after a NIXL pull,
where a missing AMX permission is fatal); these tests pin the decision on any host, AMX or not.
"""

from __future__ import annotations

import logging

import pytest
import torch

from serve_app import vllm_plugin


@pytest.mark.parametrize("supported, granted, expect", [(False, False, False), (True, True, True),
                                                         (True, False, False)])
def test_amx_permission_is_requested_only_where_the_cpu_has_amx(monkeypatch, caplog, supported, granted, expect):
    calls = []
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: supported)
    monkeypatch.setattr(torch.cpu, "_init_amx", lambda: calls.append(1) or granted)
    with caplog.at_level(logging.ERROR, logger="disagg.vllm_plugin"):
        assert vllm_plugin.request_amx_permission() is expect
    assert len(calls) == (1 if supported else 0)
    assert ("refused AMX permission" in caplog.text) is (supported and not granted)


def test_register_runs_every_setup_step_even_when_one_fails(monkeypatch, caplog):
    ran = []

    def broken():
        ran.append("amx")
        raise OSError("arch_prctl failed")

    broken.__name__ = "request_amx_permission"
    monkeypatch.setattr(vllm_plugin, "_registered", False)
    monkeypatch.setattr(vllm_plugin, "_is_cpu_platform", lambda: True)
    monkeypatch.setattr(vllm_plugin, "request_amx_permission", broken)
    monkeypatch.setattr(vllm_plugin, "_patch_nixl_agent_config", lambda: ran.append("nixl"))
    with caplog.at_level(logging.WARNING, logger="disagg.vllm_plugin"):
        vllm_plugin.register()
    assert ran == ["amx", "nixl"]
    assert "request_amx_permission not applied (OSError: arch_prctl failed)" in caplog.text


def test_this_hosts_amx_state_is_usable():
    """This host's AMX, as the kernel lists it, is what torch (and so vLLM's kernel choice) sees, and
    where the CPU has it the permission is granted (else engines die with SIGILL)."""
    with open("/proc/cpuinfo") as f:
        flags = {flag for line in f if line.startswith("flags") for flag in line.split(":", 1)[1].split()}
    has_amx = "amx_tile" in flags
    assert torch.cpu._is_amx_tile_supported() is has_amx
    assert vllm_plugin.request_amx_permission() is has_amx
