"""The vLLM plugin's per-process CPU setup: asks for AMX exactly when the CPU has it, never raises,
and makes vLLM's step queues wait without spinning yet without missing a message.

The live proof is every engine replica's warm-up handoff (a decode step right after a NIXL pull,
where a missing AMX permission is fatal); these tests pin the decision on any host, AMX or not.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid

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
    monkeypatch.setattr(vllm_plugin, "_stop_queue_spinning", lambda: ran.append("spin"))
    with caplog.at_level(logging.WARNING, logger="disagg.vllm_plugin"):
        vllm_plugin.register()
    assert ran == ["amx", "nixl", "spin"]
    assert "request_amx_permission not applied (OSError: arch_prctl failed)" in caplog.text


def test_this_hosts_amx_state_is_usable():
    """This host's AMX, as the kernel lists it, is what torch (and so vLLM's kernel choice) sees, and
    where the CPU has it the permission is granted (else engines die with SIGILL)."""
    with open("/proc/cpuinfo") as f:
        flags = {flag for line in f if line.startswith("flags") for flag in line.split(":", 1)[1].split()}
    has_amx = "amx_tile" in flags
    assert torch.cpu._is_amx_tile_supported() is has_amx
    assert vllm_plugin.request_amx_permission() is has_amx


def _queue_pair(monkeypatch, folder, notify: bool = True):
    """vLLM's shared-memory queue in this process: its writer, and a reader in a thread that takes
    one message (so it is inside vLLM's busy second), then times its wait for the next one. Its IPC
    sockets go to `folder`, not the system temp folder (which the stack's teardown checks is clean)."""
    from vllm.distributed.device_communicators import shm_broadcast

    monkeypatch.setattr(shm_broadcast, "get_open_zmq_ipc_path", lambda: f"ipc://{folder}/{uuid.uuid4()}")
    MessageQueue = shm_broadcast.MessageQueue
    writer = MessageQueue(n_reader=1, n_local_reader=1)
    box: dict = {}

    def read() -> None:
        reader = MessageQueue.create_from_handle(writer.export_handle(), 0)
        reader.wait_until_ready()
        box["first"] = reader.dequeue(timeout=10)
        cpu0, t0 = time.thread_time(), time.monotonic()
        box["second"] = reader.dequeue(timeout=10)
        box["got_at"] = time.monotonic()
        box["wait_s"], box["cpu_s"] = box["got_at"] - t0, time.thread_time() - cpu0

    t = threading.Thread(target=read, daemon=True)
    t.start()
    writer.wait_until_ready()
    if not notify:  # every wake-up lost, as when the publisher drops it
        writer._spin_condition.notify = lambda: None
    return writer, t, box


def test_a_queue_reader_sleeps_while_it_waits_and_wakes_for_the_next_message(monkeypatch, tmp_path):
    """vLLM's own shared-memory queue (scheduler → worker and back, once per engine step), patched:
    a reader waiting 0.3 s for its next message burns little CPU (unpatched it spins through all of
    it: `sched_yield` for a second after each read), and still gets the message at once."""
    monkeypatch.delenv(vllm_plugin.QUEUE_SPIN_ENV, raising=False)  # the default spin, 2 ms
    vllm_plugin._stop_queue_spinning()
    vllm_plugin._stop_queue_spinning()  # idempotent: vLLM may load its plugins twice in a process
    writer, t, box = _queue_pair(monkeypatch, tmp_path)
    writer.enqueue("step 1")
    time.sleep(0.3)
    writer.enqueue("step 2")
    t.join(timeout=10)
    assert (box["first"], box["second"]) == ("step 1", "step 2")
    assert 0.25 < box["wait_s"] < 1.0
    assert box["cpu_s"] < 0.02, f"the reader used {box['cpu_s']:.3f} s of CPU waiting {box['wait_s']:.3f} s"


def test_a_queue_reader_whose_wake_up_is_lost_still_takes_its_message_within_a_slice(monkeypatch, tmp_path):
    """The notification socket drops wake-ups (see the plugin's item 3): a reader must not sleep past
    its message for more than a slice or two, never freeze."""
    monkeypatch.delenv(vllm_plugin.QUEUE_SPIN_ENV, raising=False)
    vllm_plugin._stop_queue_spinning()
    writer, t, box = _queue_pair(monkeypatch, tmp_path, notify=False)
    writer.enqueue("step 1")
    time.sleep(0.2)
    t_sent = time.monotonic()
    writer.enqueue("step 2")
    t.join(timeout=10)
    assert box.get("second") == "step 2", "the reader missed its message"
    late_s = box["got_at"] - t_sent
    assert late_s < 0.05, f"the reader took its message {late_s:.3f} s late"


@pytest.mark.parametrize("raw, expect", [(None, vllm_plugin.QUEUE_SPIN_S), ("1", 1.0), ("0", 0.0),
                                         ("fast", vllm_plugin.QUEUE_SPIN_S), ("-1", vllm_plugin.QUEUE_SPIN_S),
                                         ("nan", vllm_plugin.QUEUE_SPIN_S)])
def test_the_spin_is_set_by_the_environment_and_a_bad_value_is_named(monkeypatch, caplog, raw, expect):
    if raw is None:
        monkeypatch.delenv(vllm_plugin.QUEUE_SPIN_ENV, raising=False)
    else:
        monkeypatch.setenv(vllm_plugin.QUEUE_SPIN_ENV, raw)
    with caplog.at_level(logging.WARNING, logger="disagg.vllm_plugin"):
        assert vllm_plugin.queue_spin_s() == expect
    bad = raw is not None and expect == vllm_plugin.QUEUE_SPIN_S and raw != str(expect)
    assert (f"{vllm_plugin.QUEUE_SPIN_ENV}={raw!r} is not a number" in caplog.text) is bad
