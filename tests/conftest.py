import os
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from factories import DISAGGREGATING_POLICY  # noqa: E402
from unprovoked import UNPROVOKED, unprovoked_failures  # noqa: E402
ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="session")
def stack(tmp_path_factory):
    """The CPU profile (deployments/local.yaml) running for real: Ray on loopback, the router,
    1 prefill + 2 decode vLLM engines with NIXL. Started once per test session, stopped at the end."""
    from serve_app.launch import LocalStack, engine_processes, haproxy_dir, runtime_dir, vllm_temp_files

    if os.environ.get("DISAGG_STACK_URL"):  # develop against a stack already up (`make run`)
        url = os.environ["DISAGG_STACK_URL"]
        shipped = _admin_state(url)["policy"]
        _set_policy(url, DISAGGREGATING_POLICY)
        yield SimpleNamespace(base_url=url, run_dir=Path.cwd(), host_fit=None, host_fit_summary=None,
                              policy_after_fit=shipped, shipped_policy=shipped)
        return
    run_dir = tmp_path_factory.mktemp("stack")
    os.environ["DISAGG_RUN_DIR"] = str(run_dir)  # where the router writes its request log
    sockets_before = vllm_temp_files()  # the system temp folder's vLLM files before the stack
    haproxy_before = _haproxy_default_entries()
    with LocalStack(ROOT / "deployments" / "local.yaml", log=lambda m: print(f"[stack] {m}", flush=True)) as s:
        s.run_dir = run_dir
        s.provoked = UNPROVOKED.copy()  # tests that cause a failure on purpose count it here (unprovoked.provoked)
        s.engines_at_start = set(engine_processes(s.stack_id))  # ... and what they kill (unprovoked.killed_on_purpose)
        s.initial_state = _admin_state(s.base_url)  # before any test's request: what start-up did
        s.instances_at_start = set(s.initial_state["instances"])
        # what `make run` does next: the routers price with constants fitted on this machine, and a
        # bench judges against them (a shipped profile describes another host)
        [(s.host_fit, s.host_fit_summary)] = s.fit_host()
        s.policy_after_fit = _admin_state(s.base_url)["policy"]
        # the serving-path tests drive the disaggregated path (prefill, NIXL hand-off, decode), which the
        # shipped default takes only where it prices fewer misses: they run with a policy that always
        # disaggregates; tests of the shipped default set it themselves (test_serving.py)
        s.shipped_policy = s.initial_state["policy"]
        _set_policy(s.base_url, DISAGGREGATING_POLICY)
        yield s
        _assert_nothing_failed_unprovoked(s)
    # a stop that had to force anything would kill engines mid-drain in a cluster's rolling restart
    assert not s.forced, f"the stack's stop was not graceful: {s.forced}"
    # every engine kept its IPC sockets in the stack's runtime folder, and the folder went with the stop
    assert not runtime_dir(s.stack_id).exists()
    assert not vllm_temp_files() - sockets_before, "engines left files in the system temp folder"
    # HAProxy kept its sockets and logs in the stack's own folder, and the folder went with the stop
    assert not haproxy_dir(s.stack_id).exists()
    assert _haproxy_default_entries() == haproxy_before, "HAProxy wrote to Serve's shared default folder"


def _haproxy_default_entries() -> set[str]:
    """What Serve's default HAProxy folder holds (each node's folder), where the stack must not write.
    Serve's own constant: a fixed folder, not the temp folder's, so it differs under a custom TMPDIR."""
    from ray.serve._private.constants import RAY_SERVE_HAPROXY_SERVER_STATE_BASE

    try:
        return set(os.listdir(RAY_SERVE_HAPROXY_SERVER_STATE_BASE))
    except FileNotFoundError:
        return set()


def _set_policy(base_url: str, name: str) -> None:
    from disagg.app_client import AppClient

    with AppClient(base_url) as app:
        app.set_policy(name)


def _admin_state(base_url: str) -> dict:
    from disagg.app_client import AppClient

    with AppClient(base_url) as app:
        return app.state()


def _assert_nothing_failed_unprovoked(stack) -> None:
    """Fail the session loudly on any engine death, replacement, fallback or retry no test provoked."""
    from serve_app.launch import engine_processes

    state = _admin_state(stack.base_url)
    problems = unprovoked_failures(state["counters"], stack.provoked, stack.engines_at_start,
                                   set(engine_processes(stack.stack_id)), stack.instances_at_start,
                                   set(state["instances"]),
                                   {k: v["kv_events_missed"] for k, v in state["instances"].items()})
    assert not problems, "unprovoked failures during the live session: " + "; ".join(problems)


@pytest.fixture(scope="session")
def calibrated_file(tmp_path_factory, stack):
    """`disagg calibrate --quick` on the CPU profile, end to end (it starts its own two engines),
    with the serving path measured through the session's running app (`--url`)."""
    import subprocess

    out = tmp_path_factory.mktemp("calibration")
    # inside the CPU profile's router.cost_model_dir (runs/ in the run folder): /admin/cost_model loads only there
    path = stack.run_dir / "runs" / "calibrated-by-tests.yaml"
    cmd = [sys.executable, "-m", "disagg.cli", "calibrate", "--config", str(ROOT / "deployments" / "local.yaml"),
           "--out", str(path), "--report", str(out / "report.json"), "--quick",
           "--url", stack.base_url, "--url-requests", "8"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return SimpleNamespace(path=path, report=out / "report.json", stdout=proc.stdout,
                           stderr=proc.stderr)
