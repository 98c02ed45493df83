"""Teardown kills only the engines its own stack started, never another run's on the same machine;
a stack keeps its runtime files in folders of its own."""

import os
import subprocess
import time
import uuid
from pathlib import Path

import pytest

from serve_app import launch
from serve_app.launch import STACK_ID_VAR, engine_processes, stack_engines_left


def fake_engine(stack_id: str | None) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if k != STACK_ID_VAR}
    if stack_id:
        env[STACK_ID_VAR] = stack_id
    # a process whose command line reads like vLLM's engine core
    return subprocess.Popen(["bash", "-c", "exec -a VLLM::EngineCore sleep 60"], env=env)


def test_engines_are_told_apart_by_the_stack_that_started_them():
    ours, theirs, unmarked = fake_engine("stack-a"), fake_engine("stack-b"), fake_engine(None)
    try:
        deadline = time.monotonic() + 10
        while len({ours.pid, theirs.pid, unmarked.pid} & set(engine_processes())) < 3:
            assert time.monotonic() < deadline, "fake engines did not show up in ps"
            time.sleep(0.05)
        assert ours.pid in engine_processes("stack-a")
        assert theirs.pid not in engine_processes("stack-a") and unmarked.pid not in engine_processes("stack-a")
        left = stack_engines_left()
        assert ours.pid in left and theirs.pid in left and unmarked.pid not in left
    finally:
        for p in (ours, theirs, unmarked):
            p.kill()
            p.wait(timeout=10)


def test_no_cluster_is_known_at_once_without_waiting_for_ray_status(monkeypatch):
    import socket
    import time

    from serve_app import launch

    with socket.socket() as s:  # a port nobody listens on once closed
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setattr(launch, "RAY_ADDRESS", f"127.0.0.1:{port}")
    monkeypatch.setattr(launch.subprocess, "run", lambda *a, **k: pytest.fail("ray status must not run"))
    t0 = time.monotonic()
    assert launch.ray_running() is False
    assert time.monotonic() - t0 < 2.0


def test_stop_after_ray_vanished_kills_engines_that_ignore_sigterm_within_the_budget(monkeypatch):
    """Ray gone (`ray stop --force` under `make run`): the engines it orphaned are ours to stop, and
    the stop ends within its budget even when they ignore SIGTERM."""
    from serve_app import launch

    env = {**{k: v for k, v in os.environ.items() if k != STACK_ID_VAR}, STACK_ID_VAR: "stack-stop"}
    stubborn = subprocess.Popen(["bash", "-c", "trap '' TERM; exec -a VLLM::EngineCore sleep 60"], env=env)
    other = fake_engine("stack-other")
    try:
        deadline = time.monotonic() + 10
        while stubborn.pid not in engine_processes("stack-stop"):
            assert time.monotonic() < deadline, "the fake engine did not show up in ps"
            time.sleep(0.05)
        monkeypatch.setattr(launch, "ray_running", lambda: False)
        stack = launch.LocalStack.__new__(launch.LocalStack)
        stack.deployed, stack.stack_id, stack.started_ray, stack.log = True, "stack-stop", False, lambda m: None
        t0 = time.monotonic()
        stack.stop(timeout_s=10.0)
        assert time.monotonic() - t0 < 12.0
        assert stubborn.wait(timeout=5) == -9  # SIGKILL, after SIGTERM was ignored
        # ... and the stop says it was forced (the test session fails on a stop that was)
        assert stack.forced == ["SIGTERM to 1 engine processes", "SIGKILL to 1 engine processes"]
        assert other.poll() is None  # another stack's engine is left alone
    finally:
        for p in (stubborn, other):
            p.kill()
            p.wait(timeout=10)


def test_deploying_into_a_cluster_that_goes_away_fails_at_once(monkeypatch, tmp_path):
    """`make run` started while an earlier stack's Ray was still stopping: the deploy and the wait
    for health end as soon as the cluster is gone, instead of waiting out their timeouts."""
    from serve_app import launch

    hung = subprocess.Popen(["sleep", "60"])  # a `serve run` that never returns
    monkeypatch.setattr(launch.subprocess, "Popen", lambda *a, **k: hung)
    listening = iter([True, True, False])
    monkeypatch.setattr(launch, "gcs_listening", lambda: next(listening, False))
    stack = launch.LocalStack.__new__(launch.LocalStack)
    stack.log = lambda m: None
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match="went away while deploying"):
        stack._serve_run(tmp_path / "app.yaml")
    assert time.monotonic() - t0 < 10.0 and hung.poll() is not None  # killed, not left behind

    monkeypatch.setattr(launch, "_get", lambda *a, **k: pytest.fail("no cluster: nothing to ask"))
    with pytest.raises(RuntimeError, match="went away before the app"):
        stack._wait_healthy("http://127.0.0.1:1", timeout_s=600)


def test_haproxy_keeps_its_files_in_the_stacks_own_folder_within_the_socket_path_limit(monkeypatch):
    stack_id = uuid.uuid4().hex
    env = launch.haproxy_env(stack_id)
    folder = launch.haproxy_dir(stack_id)
    assert folder != launch.haproxy_dir(uuid.uuid4().hex)  # one folder per stack, removed at its stop
    assert all(Path(v) == folder or Path(v).parent == folder for v in env.values())
    assert set(env) >= {"RAY_SERVE_HAPROXY_CONFIG_FILE_LOC", "RAY_SERVE_HAPROXY_SOCKET_PATH",
                        "RAY_SERVE_HAPROXY_SERVER_STATE_BASE", "RAY_SERVE_HAPROXY_METRICS_SOCKET_PATH"}
    # Serve puts each node's files in <folder>/<56-character node id>/; HAProxy takes socket paths of
    # at most 97 bytes (a longer one fails its start: "socket path ... too long (max 97)")
    node_id = "f" * 56
    for var in ("RAY_SERVE_HAPROXY_SOCKET_PATH", "RAY_SERVE_HAPROXY_METRICS_SOCKET_PATH"):
        d, name = os.path.split(env[var])
        assert len(os.path.join(d, node_id, name).encode()) <= 97
    # a system temp folder too deep for that leaves Serve's defaults alone
    monkeypatch.setattr(launch.tempfile, "gettempdir", lambda: "/" + "t" * 40)
    assert launch.haproxy_env(stack_id) == {}
    monkeypatch.undo()
    # the stack's Ray inherits them, unless the environment sets them itself
    s = launch.LocalStack.__new__(launch.LocalStack)
    s.stack_id = stack_id
    for var in env:
        monkeypatch.delenv(var, raising=False)
    assert env.items() <= s._ray_env().items()
    monkeypatch.setenv("RAY_SERVE_HAPROXY_SOCKET_PATH", "/run/serve/admin.sock")
    assert s._ray_env()["RAY_SERVE_HAPROXY_SOCKET_PATH"] == "/run/serve/admin.sock"
