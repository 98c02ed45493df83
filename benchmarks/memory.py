"""Memory of the CPU profile: the whole Ray cluster's PSS, and the router replica's RSS under load.

Usage (from the repository root, with nothing else running on the machine):

    .venv/bin/python benchmarks/memory.py --json runs/memory.json

It starts deployments/local.yaml (router, 1 prefill + 2 decode vLLM engines, KV over NIXL) with
`serve_app.launch.LocalStack` and measures:

1. the total resident memory of everything the stack started: the sum of PSS
   (/proc/<pid>/smaps_rollup) over the whole process tree of the Ray cluster — the processes of
   this Ray session (gcs_server, raylet, dashboard, monitor, client server; found by the session
   name or the head node id in their command lines) and all their descendants: Ray's agents and
   workers, the Serve controller and proxy, the router and engine replicas, and the vLLM
   EngineCore / worker processes the replicas spawn. PSS splits shared pages between the
   processes that map them, so the sum does not double-count shared libraries. Broken down by
   kind; measured idle after start-up and again after the load below. As a cross-check, the
   machine's MemTotal − MemAvailable before start and after.
2. the router replica's RSS (and PSS): idle after start-up, after a warm-up of `--warmup`
   requests (the baseline: first-use allocations are not growth), after `--requests` (10,000)
   small requests and after twice that (20,000). Requests: POST /v1/completions, max_tokens 1,
   ignore_eos, `--concurrency` (64) in flight, distinct short prompts; each batch is bounded by
   `--batch-timeout` seconds (what did not finish in time is reported, not waited for).
   `--batches N` runs N batches (default 2: 10k and 20k). A control follows: the router left idle
   for as long as one batch took (its 50 ms engine poll still runs), to tell growth per request
   from growth over time.

Teardown always runs (LocalStack.stop: serve shutdown, no engine process left, ray stop).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable, Sequence

from disagg.app_client import AppClient, AppError, AsyncAppClient
from disagg.bench.script import log, write_result
from disagg.stats import percentile

ROOT = Path(__file__).resolve().parents[1]
MODEL = "tiny-qwen2"
RAY_TMP = Path("/tmp/ray")
TICK_S = 1.0 / os.sysconf("SC_CLK_TCK")
GIB = 1024 ** 3
MIB = 1024 ** 2


# ------------------------------------------------------------------------------------------------
# /proc
# ------------------------------------------------------------------------------------------------

def _read(path: str) -> str | None:
    try:
        with open(path, "rb") as f:
            return f.read().decode(errors="replace")
    except OSError:
        return None


def cmdline(pid: int) -> str:
    return (_read(f"/proc/{pid}/cmdline") or "").replace("\0", " ").strip()


def ppid_map() -> dict[int, int]:
    out = {}
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        stat = _read(f"/proc/{d}/stat")
        if not stat:
            continue
        # "pid (comm) state ppid ...": comm may contain spaces and parentheses
        rest = stat[stat.rfind(")") + 2:].split()
        out[int(d)] = int(rest[1])
    return out


def smaps_rollup(pid: int) -> dict[str, int]:
    """Rss/Pss/... in bytes from /proc/<pid>/smaps_rollup ({} if the process is gone)."""
    text = _read(f"/proc/{pid}/smaps_rollup")
    out: dict[str, int] = {}
    for line in (text or "").splitlines()[1:]:
        key, _, rest = line.partition(":")
        parts = rest.split()
        if len(parts) == 2 and parts[1] == "kB":
            out[key.strip()] = int(parts[0]) * 1024
    return out


def vm_rss(pid: int) -> int | None:
    for line in (_read(f"/proc/{pid}/status") or "").splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return None


def meminfo() -> dict[str, int]:
    out = {}
    for line in (_read("/proc/meminfo") or "").splitlines():
        key, _, rest = line.partition(":")
        out[key] = int(rest.split()[0]) * 1024
    return out


def used_bytes() -> int:
    m = meminfo()
    return m["MemTotal"] - m["MemAvailable"]


# ------------------------------------------------------------------------------------------------
# The Ray cluster's process tree
# ------------------------------------------------------------------------------------------------

def ray_session() -> tuple[str, str | None]:
    """(session name, head node id) of the cluster this machine's /tmp/ray/session_latest names."""
    session = Path(os.path.realpath(RAY_TMP / "session_latest")).name
    node_id = None
    for d in os.listdir("/proc"):
        if d.isdigit():
            c = cmdline(int(d))
            if "gcs_server" in c and session in c:
                for arg in c.split():
                    if arg.startswith("--node-id="):
                        node_id = arg.split("=", 1)[1]
    return session, node_id


def cluster_pids(session: str, node_id: str | None, exclude: set[int]) -> list[int]:
    """Every process of this Ray session and all their descendants (minus `exclude` and its tree)."""
    parents = ppid_map()
    roots = set()
    for pid in parents:
        c = cmdline(pid)
        if session in c or (node_id and node_id in c):
            roots.add(pid)
    children: dict[int, list[int]] = {}
    for pid, pp in parents.items():
        children.setdefault(pp, []).append(pid)
    excluded = set()
    stack = list(exclude)
    while stack:  # bounded by the process count: each pid is visited once
        p = stack.pop()
        if p in excluded:
            continue
        excluded.add(p)
        stack.extend(children.get(p, ()))
    seen: set[int] = set()
    stack = list(roots)
    while stack:
        p = stack.pop()
        if p in seen or p in excluded:
            continue
        seen.add(p)
        stack.extend(children.get(p, ()))
    return sorted(seen)


def kind(pid: int, parents: dict[int, int]) -> str:
    c = cmdline(pid)
    comm = (_read(f"/proc/{pid}/comm") or "").strip()
    for role in ("router", "prefill", "decode"):
        if f"ServeReplica:disagg:{role}" in c:
            return f"{role} replica"
    if "EngineCore" in c or "EngineCore" in comm or "VLLM::Worker" in c or comm.startswith("VLLM::Worker"):
        # attribute vLLM's processes to the replica that spawned them
        p, hops = parents.get(pid), 0
        while p and hops < 8:
            pc = cmdline(p)
            for role in ("prefill", "decode"):
                if f"ServeReplica:disagg:{role}" in pc:
                    return f"{role} vLLM EngineCore/worker"
            p, hops = parents.get(p), hops + 1
        return "vLLM EngineCore/worker (other)"
    if "ServeController" in c:
        return "Serve controller"
    if "ProxyActor" in c:
        return "Serve proxy"
    if comm.startswith("ray-dashboard-") or c.startswith("ray-dashboard-"):
        return "Ray system: dashboard modules"
    if "multiprocessing.resource_tracker" in c or "multiprocessing.forkserver" in c:
        return "Python multiprocessing helpers (resource_tracker, forkserver)"
    if c.startswith("ray::"):
        return "other Ray workers (" + c.split()[0] + ")"
    for needle, name in (("gcs_server", "gcs_server"), ("raylet", "raylet"), ("dashboard/agent.py", "dashboard agent"),
                         ("runtime_env/agent", "runtime_env agent"), ("dashboard/dashboard.py", "dashboard"),
                         ("log_monitor.py", "log_monitor"), ("autoscaler/_private/monitor.py", "autoscaler monitor"),
                         ("ray.util.client.server", "client server")):
        if needle in c:
            return "Ray system: " + name
    return "Ray system: other (" + (comm or c[:40]) + ")"


def cpu_by(part_of: Callable[[str, str], str], parts: Sequence[str]) -> dict[str, float]:
    """CPU seconds so far (utime + stime) of every process of the Ray session but this one, summed by
    `part_of(kind, comm)` into `parts`."""
    session, node_id = ray_session()
    parents = ppid_map()
    out = dict.fromkeys(parts, 0.0)
    for pid in cluster_pids(session, node_id, exclude={os.getpid()}):
        stat, comm = _read(f"/proc/{pid}/stat"), _read(f"/proc/{pid}/comm")
        if stat is None or comm is None:  # gone meanwhile
            continue
        fields = stat[stat.rfind(")") + 2:].split()
        out[part_of(kind(pid, parents), comm.strip())] += (int(fields[11]) + int(fields[12])) * TICK_S
    return out


def cluster_memory(exclude: set[int]) -> dict[str, Any]:
    session, node_id = ray_session()
    parents = ppid_map()
    pids = cluster_pids(session, node_id, exclude)
    rows: dict[str, dict[str, int]] = {}
    total_pss = total_rss = 0
    for pid in pids:
        m = smaps_rollup(pid)
        if not m:
            continue
        k = kind(pid, parents)
        r = rows.setdefault(k, {"processes": 0, "pss": 0, "rss": 0})
        r["processes"] += 1
        r["pss"] += m.get("Pss", 0)
        r["rss"] += m.get("Rss", 0)
        total_pss += m.get("Pss", 0)
        total_rss += m.get("Rss", 0)
    return {"session": session, "node_id": node_id, "processes": len(pids), "pss": total_pss,
            "rss_sum": total_rss, "by_kind": dict(sorted(rows.items(), key=lambda kv: -kv[1]["pss"])),
            "machine_used": used_bytes()}


def router_pid() -> int | None:
    found = []
    for d in os.listdir("/proc"):
        if d.isdigit() and "ServeReplica:disagg:router" in cmdline(int(d)):
            found.append(int(d))
    if len(found) > 1:
        log(f"warning: several router replicas {found}; using the first")
    return found[0] if found else None


def router_sample(pid: int, settle_s: float) -> dict[str, Any]:
    """RSS/PSS of the router after `settle_s` of idle: median of 3 samples 0.5 s apart."""
    time.sleep(settle_s)
    rss, pss = [], []
    for _ in range(3):
        rss.append(vm_rss(pid) or 0)
        pss.append(smaps_rollup(pid).get("Pss", 0))
        time.sleep(0.5)
    return {"rss": int(statistics.median(rss)), "pss": int(statistics.median(pss))}


# ------------------------------------------------------------------------------------------------
# Load
# ------------------------------------------------------------------------------------------------

async def load(base_url: str, n: int, concurrency: int, timeout_s: float, tag: str) -> dict[str, Any]:
    """n small requests, `concurrency` in flight, stops handing out work at the deadline."""
    lat: list[float] = []
    errors: dict[str, int] = {}
    next_i = 0
    deadline = time.monotonic() + timeout_s

    async def worker(app: AsyncAppClient):
        nonlocal next_i
        while next_i < n and time.monotonic() < deadline:
            i = next_i
            next_i += 1
            body = {"model": MODEL, "prompt": f"{tag} {i}: route serve stream", "max_tokens": 1,
                    "temperature": 0.0, "ignore_eos": True}
            t0 = time.perf_counter()
            try:
                await app.complete(body)
                lat.append(time.perf_counter() - t0)
            except AppError as e:
                what = f"HTTP {e.status}" if e.status is not None else e.message.partition(":")[0]  # the error type
                errors[what] = errors.get(what, 0) + 1

    t0 = time.perf_counter()
    async with AsyncAppClient(base_url, timeout_s=60.0, max_connections=concurrency) as app:
        await asyncio.wait_for(asyncio.gather(*(worker(app) for _ in range(concurrency))), timeout_s + 120)
    wall = time.perf_counter() - t0
    return {"requested": n, "ok": len(lat), "errors": errors, "wall_s": wall,
            "req_per_s": len(lat) / wall if wall else 0.0,
            "latency_p50_ms": percentile([x * 1e3 for x in lat], 50, empty=None),
            "latency_p99_ms": percentile([x * 1e3 for x in lat], 99, empty=None),
            "timed_out": next_i < n}


# ------------------------------------------------------------------------------------------------

def fmt_cluster(m: dict) -> str:
    lines = ["| processes of the Ray cluster | count | PSS | RSS (sum) |", "| --- | --- | --- | --- |"]
    for k, r in m["by_kind"].items():
        lines.append(f"| {k} | {r['processes']} | {r['pss'] / GIB:.2f} GiB | {r['rss'] / GIB:.2f} GiB |")
    lines.append(f"| **total** | {m['processes']} | **{m['pss'] / GIB:.2f} GiB** | {m['rss_sum'] / GIB:.2f} GiB |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default=str(ROOT / "deployments" / "local.yaml"))
    ap.add_argument("--requests", type=int, default=10_000, help="requests per batch (two batches)")
    ap.add_argument("--batches", type=int, default=2, help="batches of --requests after the warm-up")
    ap.add_argument("--warmup", type=int, default=500)
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--batch-timeout", type=float, default=1200.0)
    ap.add_argument("--idle-control", type=float, default=600.0,
                    help="after the load, leave the router idle this long (at most one batch's wall time)")
    ap.add_argument("--settle", type=float, default=5.0, help="idle seconds before each router sample")
    ap.add_argument("--json")
    args = ap.parse_args(argv)

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    from serve_app.launch import LocalStack, engine_processes, ray_running

    if engine_processes() or ray_running():
        log("a Ray cluster or vLLM engine processes are already running; refusing to start")
        return 2
    stack = LocalStack(args.config, log=lambda m: log(f"stack: {m}"))
    out: dict[str, Any] = {"args": vars(args)}
    out["machine_used_before"] = used_bytes()
    me = {os.getpid()}
    try:
        t0 = time.monotonic()
        stack.start()
        out["start_s"] = time.monotonic() - t0
        time.sleep(args.settle)
        out["cluster_idle"] = cluster_memory(me)
        log(f"cluster idle: {out['cluster_idle']['pss'] / GIB:.2f} GiB PSS over "
            f"{out['cluster_idle']['processes']} processes")
        pid = router_pid()
        if pid is None:
            raise RuntimeError("no router replica process found")
        samples = {"idle": router_sample(pid, 0)}
        out["load"] = {}
        batches = [("warmup", args.warmup)] + [(f"after_{(i + 1) * args.requests // 1000}k", args.requests)
                                               for i in range(args.batches)]
        out["batches"] = [b for b, _ in batches]
        for name, n in batches:
            log(f"load {name}: {n} requests, {args.concurrency} concurrent ...")
            res = asyncio.run(load(stack.base_url, n, args.concurrency, args.batch_timeout, name))
            out["load"][name] = res
            log(f"  {res['ok']} ok in {res['wall_s']:.0f} s ({res['req_per_s']:.0f} req/s), errors {res['errors']}, "
                f"p50 {res['latency_p50_ms']} ms")
            if router_pid() != pid:
                raise RuntimeError("the router replica restarted during the load")
            samples[name] = router_sample(pid, args.settle)
            log(f"  router RSS {samples[name]['rss'] / MIB:.1f} MiB, PSS {samples[name]['pss'] / MIB:.1f} MiB")
        # Control: the same router left idle (its 50 ms engine poll keeps running) for as long as a
        # batch took, to tell growth per request from growth over time.
        last = batches[-1][0]
        idle_s = min(args.idle_control, out["load"][last]["wall_s"]) if args.idle_control > 0 else 0
        if idle_s:
            log(f"idle control: {idle_s:.0f} s without requests ...")
            samples["final_idle"] = router_sample(pid, idle_s)
            log(f"  router RSS {samples['final_idle']['rss'] / MIB:.1f} MiB")
        out["idle_control_s"] = idle_s
        out["router"] = {"pid": pid, **samples}
        with AppClient(stack.base_url, timeout_s=10.0) as app:
            out["router_state"] = app.state()
        out["cluster_after_load"] = cluster_memory(me)
    finally:
        log("stopping ...")
        stack.stop()
        out["engine_processes_left"] = engine_processes()
        log(f"stopped; engine processes left: {out['engine_processes_left'] or 'none'}")

    done = {k: v["ok"] for k, v in out["load"].items()}
    s = out["router"]
    print()
    print(fmt_cluster(out["cluster_idle"]))
    print(f"\nMachine used (MemTotal − MemAvailable): {out['machine_used_before'] / GIB:.2f} GiB before start, "
          f"{out['cluster_idle']['machine_used'] / GIB:.2f} GiB idle after start "
          f"(+{(out['cluster_idle']['machine_used'] - out['machine_used_before']) / GIB:.2f} GiB); "
          f"cluster PSS after the load {out['cluster_after_load']['pss'] / GIB:.2f} GiB.\n")
    print("| router replica | requests served so far | RSS | PSS |")
    print("| --- | --- | --- | --- |")
    cum = 0
    names = ["idle", *out["batches"], "final_idle"]
    for name in names:
        if name not in s:
            continue
        cum += done.get(name, 0)
        label = f"{out['batches'][-1]} + {out['idle_control_s']:.0f} s idle" if name == "final_idle" else name
        print(f"| {label} | {cum} | {s[name]['rss'] / MIB:.1f} MiB | {s[name]['pss'] / MIB:.1f} MiB |")
    growth = {}
    parts = []
    prev = "warmup"
    for name in out["batches"][1:]:
        g = s[name]["rss"] - s[prev]["rss"]
        growth[f"{prev}_to_{name}"] = g
        parts.append(f"{prev} → {name}: {g / MIB:+.1f} MiB ({g / max(1, done[name]):+.0f} B/request)")
        prev = name
    print("\nRouter RSS growth: " + "; ".join(parts) + ".")
    if "final_idle" in s:
        g = s["final_idle"]["rss"] - s[prev]["rss"]
        print(f"Idle control ({out['idle_control_s']:.0f} s, no requests): {g / MIB:+.1f} MiB.")
        growth["idle_control"] = g
    out["router_growth"] = growth
    print(f"Router counters at the end: {out['router_state'].get('counters')} (requests not sent by this "
          f"script would show as requests > {sum(done.values())}).")
    if args.json:
        write_result(args.json, out)
        log(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
