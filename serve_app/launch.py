"""Start a local Ray cluster on loopback, deploy a Serve config, wait until it serves; stop it all.

`make run` calls `python -m serve_app.launch --config deployments/local.yaml`; the test
session uses `LocalStack` the same way. Shutdown order matters (measured): `serve shutdown` first,
then wait until no vLLM engine process is left (an orphaned EngineCore keeps its NIXL ports and
~2.5 GB, and the next deployment hangs), then `ray stop`.

The cluster is started with the settings a single machine needs: loopback only, auth off, usage
stats off, and worker niceness 0 — Ray's default nice 15 starves the engines against anything
else running on a small machine — and with Serve's fast token path (`FAST_PATH_ENV`: HAProxy
ingress, gRPC between replicas), which the environment may turn off (`RAY_SERVE_ENABLE_HA_PROXY=0`).

Teardown only touches what this stack started: Ray is started with a `DISAGG_STACK_ID` in its
environment, which every Ray worker and every engine they spawn inherits (and keeps when orphaned),
so the engines left after `serve shutdown` are told apart from another run's on the same machine.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
import uuid
from pathlib import Path

import yaml

from disagg.cli.common import as_typed, live_fit_argv
from serve_app.config import ConfigError, load_serve_config
from serve_app.engine import ENGINE_PROCESS_MARKERS, RUNTIME_DIR_VAR
from serve_app.tiny_model import resolve_model

RAY_ENV = {
    "RAY_USAGE_STATS_ENABLED": "0",
    "RAY_AUTH_MODE": "disabled",
    "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
    "RAY_worker_niceness": "0",
}
STACK_ID_VAR = "DISAGG_STACK_ID"


def _bin(name: str) -> str:
    here = Path(sys.executable).parent / name
    return str(here) if here.exists() else (shutil.which(name) or name)


# Serve's fast token path, unless the environment says otherwise: HAProxy on the HTTP port hands
# connections straight to the router replicas (no Python proxy hop per token chunk), handle calls
# go over gRPC, and user code runs on the replica's main loop. Measured on the CPU profile
# (benchmarks/serving_throughput.py): router hop overhead at 16 streams 158 → 66 ms p50.
FAST_PATH_ENV = {
    "RAY_SERVE_ENABLE_HA_PROXY": "1",
    "RAY_SERVE_THROUGHPUT_OPTIMIZED": "1",
    # Behind HAProxy a stopping ingress replica stays reachable this long (Serve's default: 30 s) so
    # that HAProxy can drop it from its backends first. That window alone filled Serve's 30 s budget
    # per shutdown tier, so every `serve shutdown` timed out and the engines were stopped by signal.
    # HAProxy runs on this very node: its reload takes well under a second.
    "RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S": "2",
}


def _env() -> dict[str, str]:
    return {"DISAGG_RUN_DIR": os.getcwd(), **FAST_PATH_ENV, **os.environ, **RAY_ENV}


def _get(url: str, timeout: float = 2.0) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def _stack_id_of(pid: int) -> str | None:
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            env = f.read().split(b"\0")
    except OSError:  # gone, or not ours to read
        return None
    prefix = f"{STACK_ID_VAR}=".encode()
    return next((e[len(prefix):].decode() for e in env if e.startswith(prefix)), None)


def engine_processes(stack_id: str | None = None) -> list[int]:
    """vLLM engine processes on this machine; with `stack_id`, only those that stack started."""
    out = subprocess.run(["ps", "-eo", "pid=,args="], capture_output=True, text=True).stdout
    pids = []
    for line in out.splitlines():
        pid, _, args = line.strip().partition(" ")
        if any(m in args for m in ENGINE_PROCESS_MARKERS):
            if stack_id is None or _stack_id_of(int(pid)) == stack_id:
                pids.append(int(pid))
    return pids


def stack_engines_left() -> list[int]:
    """Engines started by some LocalStack (they carry a stack id): leftovers that hold ports and memory."""
    return [p for p in engine_processes() if _stack_id_of(p) is not None]


RAY_ADDRESS = "127.0.0.1:6379"
SERVE_RUN_TIMEOUT_S = 300.0  # `serve run --non-blocking` returns once the config is submitted
METRICS_PORT = 8079  # Ray's Prometheus endpoint on this node: Serve's, the engines' and the router's series
# `ray start --address` on loopback: Ray joins a node to a cluster only with multi-node clusters
# enabled (RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=1), and then rewrites a loopback head address to this
# machine's outward one, where the head does not listen. Ray's own CLI, with that rewrite off.
_RAY_JOIN_ON_LOOPBACK = ("import sys, ray._private.services as s; s.resolve_ip_for_localhost = lambda host: host; "
                         "from ray.scripts.scripts import main; sys.argv[0] = 'ray'; sys.exit(main())")
DASHBOARD_URL = "http://127.0.0.1:8265"  # the head's dashboard (`serve status` reads the app's state there)
DASHBOARD_AGENT_PORT = 52365  # Ray's default for the head's agent; the nth local worker node's is n above
LOCAL_RESOURCE_AMOUNT = 1000.0  # of each custom resource on its local node: room for any pool width
WORKER_OBJECT_STORE_BYTES = 256 << 20  # a local worker node's object store (the head keeps Ray's default)
_SERVE_SHUTDOWN = f"import ray; from ray import serve; ray.init(address={RAY_ADDRESS!r}); serve.shutdown()"


def gcs_listening() -> bool:
    """Something accepts connections at the cluster address (cheap: no Ray client started)."""
    host, port = RAY_ADDRESS.rsplit(":", 1)
    try:
        socket.create_connection((host, int(port)), timeout=2.0).close()
    except OSError:
        return False
    return True


def ray_running() -> bool:
    if not gcs_listening():  # no cluster (`ray status` would retry for a minute before saying so)
        return False
    try:
        return subprocess.run([_bin("ray"), "status", "--address", RAY_ADDRESS], env=_env(),
                              capture_output=True, timeout=60).returncode == 0
    except subprocess.TimeoutExpired:  # a cluster too busy to answer is still a cluster
        return True


def _running_stack_id() -> str | None:
    """The stack id the running Ray cluster was started with (None: started by hand)."""
    out = subprocess.run(["ps", "-eo", "pid=,args="], capture_output=True, text=True).stdout
    for line in out.splitlines():
        pid, _, args = line.strip().partition(" ")
        if "raylet" in args.split(" ")[0]:
            return _stack_id_of(int(pid))
    return None


class LocalStack:
    """One Ray head on 127.0.0.1 and one deployed Serve config; a context manager."""

    def __init__(self, config: str | Path, *, num_cpus: int | None = None, ready_timeout_s: float = 900.0,
                 reuse_ray: bool = False, log=print) -> None:
        self.config = Path(config)
        self.num_cpus = num_cpus or os.cpu_count() or 2
        self.ready_timeout_s = ready_timeout_s
        self.log = log
        self.apps = load_serve_config(self.config)  # fail before starting anything
        doc = yaml.safe_load(self.config.read_text())
        http = doc.get("http_options") or {}
        self.base_url = f"http://127.0.0.1:{http.get('port', 8000)}"
        self.started_ray = False
        self.deployed = False
        self.reuse_ray = reuse_ray
        self.stack_id = uuid.uuid4().hex  # replaced by the running cluster's when reusing one
        self.forced: list[str] = []  # what the last stop had to force: a graceful stop forces nothing
        self.stop_times: dict[str, float] = {}  # the last stop's phases, in seconds

    def __enter__(self) -> "LocalStack":
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def start(self) -> None:
        self._prepare_models()
        if ray_running():
            if not self.reuse_ray:
                raise RuntimeError(f"a Ray cluster is already running at {RAY_ADDRESS}; stop it (ray stop) "
                                   "or reuse it explicitly")
            self.stack_id = _running_stack_id()
        else:
            left = stack_engines_left()
            if left:
                raise RuntimeError(f"vLLM engine processes of an earlier stack are still alive (pids {left}); "
                                   "they hold NIXL ports and memory: stop them first")
            self.log("starting Ray on 127.0.0.1 ...")
            nodes = node_resources(self.apps)
            self.started_ray = True  # from here on, `ray stop` at teardown (a node may start and then fail)
            subprocess.run([_bin("ray"), "start", "--head", f"--num-cpus={self.num_cpus}",
                            "--node-ip-address=127.0.0.1", "--include-dashboard=true",
                            "--dashboard-host=127.0.0.1", "--disable-usage-stats",
                            f"--metrics-export-port={METRICS_PORT}", *_resources_arg(nodes[0])],
                           env=self._ray_env(), check=True, capture_output=True, timeout=180)
            for n, resources in enumerate(nodes[1:], start=1):
                self.log(f"starting a Ray worker node on 127.0.0.1 offering {sorted(resources)} ...")
                subprocess.run([sys.executable, "-c", _RAY_JOIN_ON_LOOPBACK, "start", f"--address={RAY_ADDRESS}",
                                f"--num-cpus={self.num_cpus}", "--node-ip-address=127.0.0.1", "--disable-usage-stats",
                                f"--object-store-memory={WORKER_OBJECT_STORE_BYTES}",
                                f"--dashboard-agent-listen-port={DASHBOARD_AGENT_PORT + n}", *_resources_arg(resources)],
                               env={**self._ray_env(), "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "1"},
                               check=True, capture_output=True, timeout=180)
        self.log(f"deploying {self.config} ...")
        # `serve run` talks to the cluster (GCS), not to the dashboard's REST API
        self.deployed = True  # from here on, teardown owns the app and its engines
        self._serve_run(self.config)
        self.wait_ready()

    def fit_host(self, timeout_s: float = 300.0) -> list[tuple[Path, str]]:
        """Fit the constants of the machine the app runs on and have every router replica price with
        them: `disagg calibrate --live --quick --host --apply` per served model of the first
        application (about 30 s on the CPU profile). The SLO targets a bench judges with then describe
        this host, not the one a shipped profile was measured on. Each file goes to the app's
        `router.cost_model_dir`, the one folder `--apply` may load from. Returns (file, the
        calibration's summary) per model; RuntimeError naming the command when a fit fails."""
        fitted = []
        app = self.apps[0][0]
        for name, cfg in self.apps:
            if name.split("/")[0] != app.split("/")[0]:
                continue
            if cfg.router.cost_model_dir is None:
                raise RuntimeError(f"{self.config}: fitting the host needs router.cost_model_dir (where the "
                                   "router may load the fitted file from)")
            out = Path(_env()["DISAGG_RUN_DIR"]) / cfg.router.cost_model_dir / f"host-{cfg.model.served_name}.yaml"
            out.parent.mkdir(parents=True, exist_ok=True)
            cmd = live_fit_argv(self.base_url, cfg.model.served_name, str(out), cfg.engine.device == "cpu", 60)
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, env=_env())
            if proc.returncode != 0:
                why = (proc.stderr.strip().splitlines() or ["no output"])[-1]
                raise RuntimeError(f"fitting the host failed ({why}); the router keeps the config's constants. "
                                   f"Retry: {as_typed(cmd)}")
            settled = [line.removeprefix("host: ") for line in proc.stderr.splitlines()
                       if line.startswith(("host: settled", "host: still above"))]
            fitted.append((out, "\n".join([*settled, proc.stdout])))
        return fitted

    def _ray_env(self) -> dict[str, str]:
        """What every process of this stack's Ray inherits: its stack id, its runtime folder, under
        which each engine keeps its IPC sockets, and its HAProxy folder (both removed at stop, even
        where a process was killed); the environment may set HAProxy's paths itself."""
        return {**haproxy_env(self.stack_id), **_env(), STACK_ID_VAR: self.stack_id,
                RUNTIME_DIR_VAR: str(runtime_dir(self.stack_id))}

    def _prepare_models(self, apps=None) -> None:
        """Build the offline tiny models once here, rather than in every engine replica at once."""
        for _, cfg in apps or self.apps:  # one entry per model, also of a multi-model app
            if cfg.model.source.startswith("tiny:"):
                resolve_model(cfg.model.source)

    @contextlib.contextmanager
    def extra_app(self, config: str | Path, name: str, route_prefix: str, ready_timeout_s: float = 600.0):
        """Serve the first application of another config file next to this stack's, on the same
        cluster and proxy, as application `name` at `route_prefix`; yields its base URL. On exit the
        stack's own config is deployed alone again (Serve removes the extra application; the stack's
        applications, unchanged, keep their replicas) and this waits until the extra engines are gone.
        """
        if not self.deployed:
            raise RuntimeError("the stack is not deployed")
        config = Path(config)
        self._prepare_models(load_serve_config(config))  # fail before touching the cluster
        extra = dict(yaml.safe_load(config.read_text())["applications"][0], name=name, route_prefix=route_prefix)
        doc = yaml.safe_load(self.config.read_text())
        if any(a.get("name") == name or a.get("route_prefix") == route_prefix for a in doc["applications"]):
            raise ValueError(f"application name {name!r} or route prefix {route_prefix!r} is already in {self.config}")
        doc["applications"].append(extra)
        engines_before = len(engine_processes(self.stack_id)) if self.stack_id else 0
        with tempfile.TemporaryDirectory() as tmp:
            both = Path(tmp) / "with-extra.yaml"
            both.write_text(yaml.safe_dump(doc, sort_keys=False))
            self.log(f"deploying {config} as {name!r} at {route_prefix} next to {self.config} ...")
            try:
                self._serve_run(both)
                url = f"{self.base_url}{route_prefix.rstrip('/')}"
                self._wait_healthy(url, ready_timeout_s)
                yield url
            finally:
                self.log(f"removing {name!r} ...")
                self._serve_run(self.config)
                deadline = time.monotonic() + 120.0
                while (self.stack_id and len(engine_processes(self.stack_id)) > engines_before
                       and time.monotonic() < deadline):
                    time.sleep(1.0)

    def _serve_run(self, config: Path) -> None:
        """`serve run --non-blocking` of `config`; fails at once if the cluster goes away meanwhile
        (an earlier stack's Ray still stopping when this one started, say), not after its timeout."""
        proc = subprocess.Popen([_bin("serve"), "run", "--non-blocking", "--address", RAY_ADDRESS, str(config)],
                                env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        deadline = time.monotonic() + SERVE_RUN_TIMEOUT_S
        while True:
            try:
                out, err = proc.communicate(timeout=1.0)
                break
            except subprocess.TimeoutExpired:
                gone = not gcs_listening()
                if gone or time.monotonic() > deadline:
                    proc.kill()
                    proc.communicate()
                    raise RuntimeError(f"the Ray cluster at {RAY_ADDRESS} went away while deploying {config}" if gone
                                       else f"deploying {config} took more than {SERVE_RUN_TIMEOUT_S:.0f} s")
        if proc.returncode != 0:
            raise subprocess.CalledProcessError(proc.returncode, proc.args, out, err)

    def wait_ready(self) -> None:
        deadline = time.monotonic() + self.ready_timeout_s
        self._wait_healthy(self.base_url, self.ready_timeout_s)
        self._wait_running(deadline)

    def _wait_running(self, deadline: float) -> None:
        """Until Serve reports every application RUNNING: `/health` answers from the first router
        replica up, while the others (and their share of HAProxy's traffic) may still be starting."""
        last = ""
        while time.monotonic() < deadline:
            out = subprocess.run([_bin("serve"), "status", "--address", DASHBOARD_URL], env=_env(),
                                 capture_output=True, text=True, timeout=60)
            apps = (yaml.safe_load(out.stdout) or {}).get("applications") or {} if out.returncode == 0 else {}
            last = ", ".join(f"{name}: {a.get('status')}" for name, a in apps.items()) or out.stderr[-200:]
            if apps and all(a.get("status") == "RUNNING" for a in apps.values()):
                self.log(f"every replica up ({last})")
                return
            time.sleep(2.0)
        raise TimeoutError(f"Serve did not report the application running within {self.ready_timeout_s:.0f} s "
                           f"(last: {last})")

    def _wait_healthy(self, base_url: str, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        last = None
        while time.monotonic() < deadline:
            if not gcs_listening():  # nothing will ever answer: say so now
                raise RuntimeError(f"the Ray cluster at {RAY_ADDRESS} went away before the app at {base_url} "
                                   "was healthy")
            try:
                status, body = _get(f"{base_url}/health")
                if status == 200:
                    self.log(f"ready: {body.decode()}")
                    return
                last = body.decode()[:200]
            except (OSError, urllib.error.URLError) as e:
                last = str(e)
            time.sleep(2.0)
        raise TimeoutError(f"the app at {base_url} was not healthy within {timeout_s:.0f} s "
                           f"(last answer: {last})")

    def stop(self, timeout_s: float = 90.0) -> None:
        """Tear everything down; a second Ctrl-C during teardown is ignored, or engines would leak.

        The budget: Serve's own shutdown waits up to 30 s for its controller (the routers drained,
        then each engine tier: about 2 + 10 + 8 s measured on 2 busy cores), after connecting to the
        cluster; half of 90 s leaves it room, and the engines their own exit after it."""
        if threading.current_thread() is not threading.main_thread():
            return self._stop(timeout_s)
        saved = {sig: signal.signal(sig, signal.SIG_IGN) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            self._stop(timeout_s)
        finally:
            for sig, handler in saved.items():
                signal.signal(sig, handler)

    def _stop(self, timeout_s: float) -> None:
        """Within `timeout_s`: serve shutdown, the engines' own exit, then SIGTERM and SIGKILL for
        the ones left (orphans would hold NIXL ports and memory), then `ray stop`. Each step gets a
        share of the budget, so a cluster that vanished or hangs cannot hold the stop up."""
        deadline = time.monotonic() + timeout_s
        left = lambda: max(1.0, deadline - time.monotonic())  # noqa: E731
        if not self.deployed:  # nothing of ours runs: never touch another cluster's apps
            self._ray_stop(left())  # ... but a cluster we started and failed to finish starting goes
            return
        self.deployed = False
        self.forced, self.stop_times = [], {}  # this stop's
        t0 = time.monotonic()
        if ray_running():
            try:
                subprocess.run([sys.executable, "-c", _SERVE_SHUTDOWN], env=_env(), capture_output=True,
                               timeout=left() * 0.5)
                self.stop_times["serve_shutdown_s"] = time.monotonic() - t0
            except subprocess.TimeoutExpired:
                self.forced.append("serve shutdown timed out")
                self.log("serve shutdown timed out; stopping engines and Ray anyway")
        else:
            self.log("Ray is gone; stopping the engines it left")
        if self.stack_id is None:  # a cluster started by hand: its engines are not ours to kill
            return
        graceful = deadline - 0.4 * timeout_s  # leave time for SIGTERM, SIGKILL and ray stop
        while engine_processes(self.stack_id) and time.monotonic() < graceful:
            time.sleep(0.5)
        if not engine_processes(self.stack_id):  # gone by themselves (else signalled below)
            self.stop_times["engines_gone_s"] = time.monotonic() - t0
        for sig, wait_s in ((signal.SIGTERM, 5.0), (signal.SIGKILL, 2.0)):
            pids = engine_processes(self.stack_id)
            if not pids:
                break
            self.forced.append(f"{sig.name} to {len(pids)} engine processes")
            self.log(f"{len(pids)} engine processes still alive: {sig.name}")
            for pid in pids:
                try:
                    os.kill(pid, sig)
                except ProcessLookupError:
                    pass
            until = time.monotonic() + wait_s
            while engine_processes(self.stack_id) and time.monotonic() < until:
                time.sleep(0.2)
        self._ray_stop(left())
        self.stop_times["total_s"] = time.monotonic() - t0

    def _ray_stop(self, timeout_s: float) -> None:
        """`ray stop` (every node of this machine) and the runtime folder, if this stack started Ray."""
        if self.started_ray:
            try:
                subprocess.run([_bin("ray"), "stop", "--force"], env=_env(), capture_output=True, timeout=timeout_s)
            except subprocess.TimeoutExpired:
                self.log("ray stop timed out")
            self.started_ray = False
            if self.stack_id is not None:
                shutil.rmtree(runtime_dir(self.stack_id), ignore_errors=True)
                shutil.rmtree(haproxy_dir(self.stack_id), ignore_errors=True)


def runtime_dir(stack_id: str) -> Path:
    """The folder of one stack's engine runtime files (vLLM's IPC sockets)."""
    return Path(tempfile.gettempdir()) / f"disagg-{stack_id}"


HAPROXY_SOCKET_PATH_MAX = 97  # HAProxy refuses a longer socket path ("too long (max 97)")
SERVE_NODE_ID_CHARS = 56  # Serve puts each node's HAProxy files in <folder>/<node id>/


def haproxy_dir(stack_id: str) -> Path:
    """The folder of one stack's HAProxy files: its config, admin and metrics sockets, server state
    and logs, in a folder per node that Serve adds below it. Serve's default is one shared folder
    in the system temp folder that nothing removes. Short, for the socket paths below it."""
    return Path(tempfile.gettempdir()) / f"haproxy-{stack_id[:8]}"


def haproxy_env(stack_id: str) -> dict[str, str]:
    """Serve's HAProxy paths (`ray.serve._private.constants`), all under `haproxy_dir`; none (Serve's
    defaults) where the system temp folder's path is too long for HAProxy's sockets below it."""
    d = haproxy_dir(stack_id)
    if len(str(d / ("n" * SERVE_NODE_ID_CHARS) / "metrics.sock").encode()) > HAPROXY_SOCKET_PATH_MAX:
        return {}
    return {"RAY_SERVE_HAPROXY_CONFIG_FILE_LOC": str(d / "haproxy.cfg"),
            "RAY_SERVE_HAPROXY_SOCKET_PATH": str(d / "admin.sock"),
            "RAY_SERVE_HAPROXY_SERVER_STATE_BASE": str(d),
            "RAY_SERVE_HAPROXY_SERVER_STATE_FILE": str(d / "server-state"),
            "RAY_SERVE_HAPROXY_METRICS_SOCKET_PATH": str(d / "metrics.sock")}


def vllm_temp_files() -> set[str]:
    """What vLLM leaves directly in the system temp folder by default: its IPC sockets and
    torch.distributed's file stores (`vllm_dist_*`). An engine with a runtime folder leaves none."""
    out = set()
    for entry in os.scandir(tempfile.gettempdir()):
        try:
            if stat.S_ISSOCK(entry.stat(follow_symlinks=False).st_mode) or entry.name.startswith("vllm_dist_"):
                out.add(entry.path)
        except OSError:  # gone meanwhile
            pass
    return out


def node_resources(apps) -> list[dict[str, float]]:
    """The Ray nodes a local stack starts: the head, plus one worker node for each further custom
    resource the config's pools ask for (the first one is the head's), each offering plenty of it.
    So a config that pins its prefill and decode pools to two resources runs on two nodes of this
    machine, and its KV handoffs cross between them as they would between machines."""
    names = list(dict.fromkeys(name for _, cfg in apps
                               for pool in (cfg.prefill, cfg.decode, cfg.colocated) if pool is not None
                               for name in pool.resources))
    nodes = [{name: LOCAL_RESOURCE_AMOUNT} for name in names]
    return nodes or [{}]


def _resources_arg(resources: dict[str, float]) -> list[str]:
    return [f"--resources={json.dumps(resources)}"] if resources else []


def _fit_host(stack: LocalStack) -> None:
    print("fitting this machine's constants once it is quiet (disagg calibrate --live --host, about 30 s) ...",
          flush=True)
    t0 = time.monotonic()
    try:
        fitted = stack.fit_host()
    except (RuntimeError, subprocess.TimeoutExpired) as e:
        print(f"disagg: warning: {e}", file=sys.stderr, flush=True)
        return
    for path, summary in fitted:
        keep = [line for line in summary.splitlines()
                if line.startswith(("settled", "still above", "serving path", "lone requests", "SLO ", "KV transfer",
                                    "held-out", "shared host"))]
        print("\n".join(keep), flush=True)
        print(f"the router prices with {path} (fitted in {time.monotonic() - t0:.0f} s); `disagg bench` judges "
              "goodput against it", flush=True)


def _interrupt(*_) -> None:
    raise KeyboardInterrupt


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description="serve a config on a local Ray cluster until Ctrl-C")
    ap.add_argument("--config", default="deployments/local.yaml")
    ap.add_argument("--fit-host", action="store_true",
                    help="once serving, fit this machine's constants and have the router price with them "
                         "(`disagg calibrate --live --quick --host --apply`, about 30 s)")
    args = ap.parse_args(argv)
    fit = args.fit_host
    try:
        stack = LocalStack(args.config, reuse_ray=True)
    except ConfigError as e:
        print(f"disagg: error: {e}", file=sys.stderr)
        return 2
    # SIGTERM (a supervisor, `kill`) stops everything exactly like Ctrl-C does
    signal.signal(signal.SIGTERM, _interrupt)
    with stack:
        url = stack.base_url
        if fit:
            _fit_host(stack)
        args = yaml.safe_load(stack.config.read_text())["applications"][0].get("args") or {}
        # a multi-model app: show the alias, which lets the router choose the model
        model = (args.get("router") or {}).get("alias", "auto") if "models" in args else stack.apps[0][1].model.served_name
        print(f"""
Serving on {url} (Ray dashboard: {DASHBOARD_URL}; Prometheus metrics: http://127.0.0.1:{METRICS_PORT}/metrics). Try:

  curl -s {url}/v1/chat/completions -H 'Content-Type: application/json' \\
    -d '{json.dumps({"model": model, "messages": [{"role": "user", "content": "Hello!"}], "max_tokens": 32})}' -i

Ctrl-C stops everything this command started.""", flush=True)
        try:
            while gcs_listening():  # Ray stopped underneath (`ray stop`): clean up what it left, and exit
                time.sleep(5.0)
            print("\nRay has stopped; cleaning up ...", flush=True)
        except KeyboardInterrupt:
            print("\nstopping ...", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
