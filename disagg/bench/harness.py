"""`disagg bench`: run routing policies against the live app (and/or the simulator) on trace slices.

What one invocation does, in this order:
1. **Check every input before anything is sent**: policies (known, and not simulator-only for a
   live run), rates and shares, the cost model, the topology, every trace (a row that fails to
   parse is a `TraceError` naming file, line and field), the output folder (a folder holding a
   run of *other* settings is refused), and the app: `GET /health` must answer 200,
   `GET /v1/models` gives the model and its `max_model_len`, `GET /admin/state` the instances.
2. **Plan each trace slice**, deterministically: the first `max_requests` requests, rescaled to
   the rate (`--rate`, or the saturation rate, or the trace's own rate), cut at `duration_s`,
   SLO classes drawn with `tight_share` and `seed`, then fitted to the model's context (a prompt
   is capped at `max_model_len - 1` tokens and its output at what is left; both counts are
   reported). The simulator and the live app get the very same requests.
3. **Correctness gates** (live only; a failed gate stops the run, `GateFailed`, exit 1):
   `token_count` (ignore_eos with max_tokens=N returns exactly N completion tokens, per usage),
   `greedy_equivalence` (round_robin, one greedy prompt sent 2×(decode instances) times: the
   texts are identical and the route headers cover every decode instance in `/admin/state`) and
   `warm` (round-robin requests until every prefill×decode pair has served one request, at most
   2·P·D requests; round robin advances both pools together, so when gcd(P, D) > 1 some pairs are
   unreachable: they are listed, and the gate only requires every instance to be warmed).
   Results go to `gates.json` and `results.json`.
4. **Saturation** (`--saturation`, optional and slow live): the rule of
   `disagg.sim.runner.find_saturation` (round robin's goodput midway between a light rate and
   overload, doubling then bisection on log-rate), probing live with `probe_iterations` bisection
   steps (the simulator uses 10). A probe at rate r sends the first max(probe_requests,
   r·probe_seconds) requests of the whole trace (beyond `max_requests` if need be), so that each
   probe is a sustained load of about `probe_seconds`, not a burst. Fixed-size probes do not work
   live: measured on the CPU profile with 30-request probes, round robin's goodput never fell
   below 0.37 even at 6,000 req/s (30 requests at once are a burst the engines absorb), so the
   doubling ran to its limit and the "saturation rate" came out at 3,000 req/s. A probe takes
   its duration plus the drain, the light one (1/20 of the trace's own rate, at least
   probe_requests requests) the longest: expect several minutes per trace on the CPU profile.
   With `--sim` and no URL, `find_saturation` itself runs in the simulator. The rates found are
   stored in settings.json and reused when the run resumes.
5. **Per policy, per trace**: `POST /admin/policy`, `POST /admin/reset_prefix_cache`, then the
   open-loop generator (`disagg.bench.loadgen`) sends the slice. Every finished request becomes
   one JSON line in `DIR/requests.jsonl`, written whole with one `write()` on an O_APPEND file.
   With `realtime` (`--realtime`) the generator runs under SCHED_FIFO during the live part: when
   the app saturates the machine's cores, a normally scheduled generator wakes up late (see
   `loadgen.realtime_priority` for the measurements) and its send lag, not the trace, shapes the
   arrivals; every run reports its send-lag P99 and is flagged above `lag_bound_s` either way.
   With `--baseline NAME=URL`, another OpenAI-compatible system (Ray Serve LLM's P/D app, for
   one) gets the same slice right after our policies on each trace, lines with `system: NAME`,
   after its own gates (token count, a warm-up: its instances cannot be addressed or reset).
   **SLO capacity** (`--capacity A`, instead of the fixed-rate runs): per trace, each policy's
   highest rate at which a share ≥ A of the requests meet both SLO targets, by the simulator's
   search (`disagg.sim.runner.capacity_steps`: doubling from the start rate — `--rate`, else the
   trace's own — then `--capacity-steps` bisection steps on log-rate). Every probe of a search
   sends the same requests from the trace's start, max(`probe_requests`, start rate ×
   `probe_seconds`) of them, rescaled to its rate. The policies' searches advance in lockstep,
   one probe each in turn, so a slow spell of the machine does not land on one policy. Every
   probe is stored in settings.json as it ends; a resumed run replays them and probes only what
   is missing. With `--sim` the same searches run in the simulator.
6. `--sim`: `disagg.sim.runner.simulate` on the same slices, with `--cost-model` and the
   topology (by default the live app's instance counts, else 1P2D); its `RequestRecord`s become
   lines of the same schema with `system: "sim"`. The simulator runs the app the bench measures
   (`Bench._as_the_app`): its router replicas, the engines' state pushed, and each request's
   output length known, as the live router knows it from the bench's `ignore_eos` and `max_tokens`.
7. `disagg.bench.report` writes results.json, results.md and the PNG plots.

**Resuming.** A line's key is (system, policy, trace, index). On start the harness reads the
lines already there (a torn last line from a killed process is cut off) and sends only the
requests without one; requests in flight when the run was killed have no line and are sent again,
so after any number of interruptions each request is counted exactly once. The pending requests
keep their schedule, shifted so that the first of them is sent at once; the load they see is then
not exactly that of an uninterrupted run (the requests that had finished are not in flight),
which `results.json` notes per run (`resumed`). `settings.json` holds the settings that decide
what is sent and how it is judged; rerunning with any of them changed is refused before anything
is sent.

**Goodput** is judged against the SLO targets of the cost-model YAML given with `--cost-model`
(default: the shipped `cpu-tiny` profile, the one `deployments/local.yaml` routes with). Pass the
same file the router was deployed with; its name is compared with the router's `/admin/state`
and a difference is reported as a warning in results.json.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import math
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

from disagg.app_client import AppError, AsyncAppClient
from disagg.bench import report
from disagg.bench.constants_check import check_constants, mismatch
from disagg.bench.loadgen import (
    ClientResult, ClientShards, PlannedRequest, event_loop_runner, prompt_seed, realtime_priority,
    run_open_loop, send_one,
)
from disagg.bench.records import LIVE, SIM, to_request_record
from disagg.core.cost_model import CostModel, CostModelError, load_profile
from disagg.core.policies import PolicyError, known_policies, parse_policy_spec
from disagg.core.types import SloClass
from disagg.files import SHARED, json_safe, write_json_atomic, write_text_atomic
from disagg.sim.metrics import RequestRecord, summarize
from disagg.sim.runner import capacity_steps, saturation_search, saturation_steps  # noqa: F401  (one rule, sim and live)
from disagg.sim.traces import TraceRequest, assign_slo_classes, read_trace, rescale_to_rate, slice_trace

SETTINGS_FILE = "settings.json"
COST_MODEL_FILE = "cost_model.yaml"  # the constants the run judged (and simulated) with, whole: results.json names them
RECORDS_FILE = "requests.jsonl"
GATES_FILE = "gates.json"
SETTINGS_VERSION = 1
APP = "app"  # --cost-model app: judge with the constants the app's router prices with
# the simulator's delay of the engines' state pushes: the live engines push at most every 5 ms
# (`EngineConfig.push_interval_s`), and docs/multi-router.md measures the pushed state 0.7-14.5 ms old
ENGINE_PUSH_S = 0.005


class BenchError(Exception):
    """Bad input or an unusable target, found before anything is sent: one line for the user."""


class GateFailed(BenchError):
    """The app under test failed a correctness gate: measuring it would be meaningless."""


@dataclass(frozen=True)
class BenchConfig:
    """Everything `disagg bench` was asked to do (CLI flags, validated by `check`)."""

    out: Path
    traces: tuple[str, ...]
    policies: tuple[str, ...]
    url: str | None = None
    fmt: str = "auto"
    rate: float | None = None
    saturation: bool = False
    duration_s: float | None = None
    max_requests: int | None = None
    tight_share: float = 0.5
    seed: int = 0
    sim: bool = False
    cost_model: str | None = None  # a profile or YAML; None: the router's own constants live (APP), else cpu-tiny
    topology: str | None = None
    routers: int | None = None  # the simulator's router replicas (sim-only runs; live: the app's)
    max_model_len: int | None = None  # sim-only runs; a live run reads it from GET /v1/models
    request_timeout_s: float = 300.0
    lag_bound_s: float = 0.050
    probe_requests: int = 20
    probe_seconds: float = 20.0
    probe_iterations: int = 5
    capacity: float | None = None  # the SLO-capacity search's attainment (e.g. 0.9); None: fixed-rate runs
    capacity_steps: int = 3  # its bisection steps after the bracket
    max_connections: int = 4096
    gates: bool = True
    realtime: bool = False  # the generator under SCHED_FIFO (see loadgen.realtime_priority)
    # other OpenAI-compatible systems on the same engines and trace: (name, base URL), e.g.
    # ("ray_serve_llm", "http://127.0.0.1:8000/raylm"); each runs after our policies on every trace
    baselines: tuple[tuple[str, str], ...] = ()
    # report goodput even when the constants judged with do not describe the app's hardware
    # (`constants_check`): for studies of miscalibration, never for a figure about routing
    accept_foreign_constants: bool = False
    # each request's targets: this many times its own unloaded TTFT and TPOT (`CostModel.target_for`),
    # sent as X-SLO-Scale so the router prices what the bench judges; None: its class's targets
    slo_scale: float | None = None

    @property
    def live(self) -> bool:
        return self.url is not None


@dataclass(frozen=True)
class TraceInput:
    name: str
    path: Path
    sha256: str
    requests: tuple[TraceRequest, ...]


@dataclass
class Target:
    """What the app under test told us about itself."""

    model: str
    max_model_len: int
    prefill: list[str]
    decode: list[str]
    policy: str
    cost_model: str
    routers: int = 1  # router replicas


# --- the record file ---------------------------------------------------------------------------


def record_key(rec: dict) -> tuple[str, str, str, int]:
    return rec["system"], rec["policy"], rec["trace"], int(rec["index"])


class RecordStore:
    """`requests.jsonl`: one JSON object per finished request, appended whole, never rewritten.

    Each line is one `os.write` on an O_APPEND descriptor, so a reader never sees two records
    interleaved; a process killed mid-write can leave one torn last line, which `load` cuts off
    (that request is sent again)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.records: dict[tuple, dict] = {}
        self.duplicates = 0
        self.torn_bytes = 0
        self._fd: int | None = None

    def load(self) -> "RecordStore":
        if not self.path.exists():
            return self
        data = self.path.read_bytes()
        if data and not data.endswith(b"\n"):
            keep = data.rfind(b"\n") + 1
            self.torn_bytes = len(data) - keep
            with open(self.path, "r+b") as f:
                f.truncate(keep)
            data = data[:keep]
        for n, line in enumerate(data.splitlines(), 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
                key = record_key(rec)
            except (ValueError, KeyError, TypeError):
                raise BenchError(f"{self.path}:{n}: not a bench record; the folder is damaged") from None
            if key in self.records:
                self.duplicates += 1
                continue
            self.records[key] = rec
        return self

    def done(self, system: str, policy: str, trace: str) -> set[int]:
        return {k[3] for k in self.records if k[:3] == (system, policy, trace)}

    def append(self, rec: dict) -> None:
        key = record_key(rec)
        if key in self.records:  # never count a request twice, whatever the caller does
            self.duplicates += 1
            return
        if self._fd is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        line = (json.dumps(json_safe(rec), separators=(",", ":")) + "\n").encode()
        os.write(self._fd, line)
        self.records[key] = rec

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def live_record(res: ClientResult, *, policy: str, trace: str, req: TraceRequest, cm: CostModel,
                rate: float, system: str = LIVE, slo_scale: float | None = None) -> dict:
    """One live request as a JSON line; the RequestRecord fields plus the client's own figures."""
    slo = SloClass(res.slo_class) if res.slo_class else SloClass.LOOSE
    target = cm.target_for(slo, req.prompt_tokens, slo_scale)
    met = (res.error is None and res.ttft_s is not None and res.ttft_s <= target.ttft_s
           and (res.tpot_s is None or res.tpot_s <= target.tpot_s))
    route = res.route
    rec = RequestRecord(
        request_id=f"{trace}/{res.index}", arrival_s=req.arrival_s, prompt_tokens=req.prompt_tokens,
        output_tokens=res.tokens, slo_class=slo.value,
        prefill_id=route.get("served_prefill") or route.get("prefill"),
        decode_id=route.get("served_decode") or route.get("decode"),
        predicted_output_tokens=None, ttft_s=res.ttft_s, tpot_s=res.tpot_s, e2e_s=res.e2e_s, slo_met=met,
        error=res.error,
    ).as_dict()
    return {"system": system, "policy": policy, "trace": trace, "index": res.index, **rec,
            "max_tokens": res.max_tokens, "rate": rate, "sent_s": res.sent_s, "send_lag_s": res.send_lag_s,
            "content_events": res.content_events, "status": res.status, "route": route}


def sim_record(r: RequestRecord, *, policy: str, trace: str, rate: float, slice_: Sequence[TraceRequest]) -> dict:
    index = int(r.request_id[1:])  # the simulator names request i of its trace "r{i}"
    return {"system": SIM, "policy": policy, "trace": trace, "index": index, **r.as_dict(),
            "request_id": f"{trace}/{index}", "max_tokens": slice_[index].output_tokens, "rate": rate,
            "sent_s": r.arrival_s, "send_lag_s": None, "content_events": None, "status": None, "route": {}}


# --- planning ----------------------------------------------------------------------------------


def own_rate(trace: Sequence[TraceRequest]) -> float:
    span = trace[-1].arrival_s - trace[0].arrival_s if len(trace) > 1 else 0.0
    return (len(trace) - 1) / span if span > 0 else 1.0


def fit_to_context(trace: Sequence[TraceRequest], max_len: int | None) -> tuple[list[TraceRequest], int, int]:
    """Cap each prompt at max_len − 1 tokens and its output at what is left of the context.

    The router refuses (400) a prompt that fills the context or a max_tokens that overflows it, so
    unfitted requests would measure the validation path, not the serving path."""
    if not max_len:
        return list(trace), 0, 0
    out, prompts, outputs = [], 0, 0
    for r in trace:
        p = min(r.prompt_tokens, max_len - 1)
        o = min(r.output_tokens, max_len - p)
        prompts += p != r.prompt_tokens
        outputs += o != r.output_tokens
        out.append(dataclasses.replace(r, prompt_tokens=p, output_tokens=o) if (p, o) != (r.prompt_tokens,
                                                                                        r.output_tokens) else r)
    return out, prompts, outputs


def plan_slice(trace: Sequence[TraceRequest], *, rate: float | None, duration_s: float | None,
               max_requests: int | None, tight_share: float, seed: int,
               max_len: int | None) -> tuple[list[TraceRequest], dict]:
    """The slice that is run: first max_requests, rescaled to the rate, cut at duration_s, SLO
    classes assigned, fitted to the context. Deterministic in its arguments."""
    t = list(trace[:max_requests] if max_requests else trace)
    if rate is not None and len(t) > 1:
        t = rescale_to_rate(t, rate)
    if duration_s is not None:
        try:
            t = slice_trace(t, 0.0, duration_s)
        except ValueError as e:
            raise BenchError(f"--duration {duration_s:g}: {e}") from None
    t = assign_slo_classes(t, tight_share, seed)
    t, capped_p, capped_o = fit_to_context(t, max_len)
    info = {"requests": len(t), "rate": own_rate(t) if len(t) > 1 else rate,
            "span_s": t[-1].arrival_s - t[0].arrival_s, "prompts_capped_to_context": capped_p,
            "outputs_capped_to_context": capped_o}
    return t, info


def planned(slice_: Sequence[TraceRequest], trace: str, seed: int, indices: Sequence[int] | None = None,
            stream: str | None = None, slo_scale: float | None = None) -> list[PlannedRequest]:
    """Loadgen requests for (some of) a slice, re-based so the first of them is sent at once."""
    idx = list(range(len(slice_))) if indices is None else sorted(indices)
    if not idx:
        return []
    t0 = min(slice_[i].arrival_s for i in idx)
    return [PlannedRequest(index=i, at_s=slice_[i].arrival_s - t0, prompt_tokens=slice_[i].prompt_tokens,
                           max_tokens=slice_[i].output_tokens,
                           slo_class=slice_[i].slo_class.value if slice_[i].slo_class else None,
                           prompt_seed=prompt_seed(seed, stream or trace, i), prefix_hashes=slice_[i].prefix_hashes,
                           slo_scale=slo_scale)
            for i in idx]


async def saturation_search_async(goodput, own: float, iterations: int) -> dict:
    steps = saturation_steps(own, iterations)
    try:
        rate = next(steps)
        while True:
            rate = steps.send(await goodput(rate))
    except StopIteration as stop:
        return stop.value


# --- input checks ------------------------------------------------------------------------------


def check_config(cfg: BenchConfig) -> tuple[CostModel | None, list[TraceInput]]:
    """Everything that can be checked without the network. Raises BenchError (or TraceError)."""
    if not cfg.live and not cfg.sim:
        raise BenchError("nothing to run: give --url (the live app) and/or --sim")
    if not cfg.policies:
        raise BenchError("--policies is empty")
    live_ok = known_policies(False)
    for spec in cfg.policies:
        try:
            name, _ = parse_policy_spec(spec)  # a known name, or NAME:key=value... with valid parameters
        except PolicyError as e:
            raise BenchError(str(e)) from None
        if cfg.live and name not in live_ok:
            raise BenchError(f"policy {name!r} runs in the simulator only; the live app knows: {', '.join(live_ok)}")
    if len(set(cfg.policies)) != len(cfg.policies):
        raise BenchError(f"--policies lists a policy twice: {','.join(cfg.policies)}")
    if cfg.rate is not None and not (math.isfinite(cfg.rate) and cfg.rate > 0):
        raise BenchError(f"--rate must be a positive number of requests/s, got {cfg.rate}")
    if cfg.rate is not None and cfg.saturation:
        raise BenchError("--rate and --saturation exclude each other")
    if cfg.capacity is not None:
        if cfg.saturation or cfg.baselines:
            raise BenchError("--capacity excludes --saturation and --baseline")
        if not 0.0 < cfg.capacity <= 1.0:
            raise BenchError(f"--capacity is the share of requests that must meet their SLO, in (0, 1]; got {cfg.capacity}")
        if cfg.capacity_steps < 0:
            raise BenchError(f"--capacity-steps must be >= 0, got {cfg.capacity_steps}")
        if cfg.probe_requests < 2 or not cfg.probe_seconds > 0:
            raise BenchError("capacity probing needs --probe-requests >= 2 and --probe-seconds > 0")
    if not (0.0 <= cfg.tight_share <= 1.0):
        raise BenchError(f"--tight-share must be in [0, 1], got {cfg.tight_share}")
    if cfg.slo_scale is not None and not (math.isfinite(cfg.slo_scale) and cfg.slo_scale > 0):
        raise BenchError(f"--slo-scale must be a finite number > 0 (times each request's own unloaded latency), "
                         f"got {cfg.slo_scale}")
    if cfg.duration_s is not None and not cfg.duration_s > 0:
        raise BenchError(f"--duration must be > 0 s, got {cfg.duration_s}")
    if cfg.max_requests is not None and cfg.max_requests < 1:
        raise BenchError(f"--max-requests must be ≥ 1, got {cfg.max_requests}")
    if cfg.max_model_len is not None and cfg.max_model_len < 2:
        raise BenchError(f"--max-model-len must be ≥ 2, got {cfg.max_model_len}")
    if cfg.request_timeout_s <= 0:
        raise BenchError(f"--request-timeout must be > 0 s, got {cfg.request_timeout_s}")
    if cfg.saturation and (cfg.probe_requests < 2 or cfg.probe_iterations < 1 or not cfg.probe_seconds > 0):
        raise BenchError("saturation probing needs --probe-requests ≥ 2, --probe-seconds > 0 and "
                         "--probe-iterations ≥ 1")
    if cfg.topology is not None:
        from disagg.sim.simulator import Topology

        try:
            Topology.parse(cfg.topology)
        except ValueError as e:
            raise BenchError(str(e)) from None
    if cfg.url is not None and not cfg.url.startswith(("http://", "https://")):
        raise BenchError(f"--url must be an http:// URL, got {cfg.url!r}")
    check_baselines(cfg)
    source = judge_source(cfg)
    if source == APP and not cfg.live:
        raise BenchError(f"--cost-model {APP} judges with the constants the app's router prices with: it needs --url")
    cm = None if source == APP else load_profile(source)  # CostModelError names the file and field
    if not cfg.traces:
        raise BenchError("give at least one --trace")
    traces, names = [], set()
    for t in cfg.traces:
        path = Path(t)
        if not path.is_file():
            raise BenchError(f"trace {t!r}: no such file")
        name = path.name.split(".")[0]
        if name in names:
            raise BenchError(f"two traces are named {name!r}; the name (file name without extension) keys the results")
        names.add(name)
        reqs = read_trace(path, cfg.fmt)  # TraceError: file:line: field
        traces.append(TraceInput(name, path, _sha256(path), tuple(reqs)))
    return cm, traces


def judge_source(cfg: BenchConfig) -> str:
    """Where the cost model that judges goodput comes from: as given, else the router's own
    constants for a live run (what `make run` fitted on this host), else the CPU profile's."""
    return cfg.cost_model or (APP if cfg.live else "cpu-tiny")


async def router_cost_model(app: AsyncAppClient, model: str) -> CostModel:
    """The cost model the app's router prices `model` (its first served one) with, from `/admin/state`."""
    try:
        state = await app.state()
    except AppError as e:
        raise BenchError(f"--cost-model {APP}: cannot read the router's constants: {e}") from None
    models = state.get("models") or {}
    if model not in models and len(models) == 1:
        model = next(iter(models))
    if model not in models or "cost_model_constants" not in models[model]:
        raise BenchError(f"--cost-model {APP}: {app.base_url}/admin/state gives no constants for {model!r}; name a cost "
                         "model (a profile or the file `disagg calibrate` wrote)")
    try:
        return CostModel.from_dict(models[model]["cost_model_constants"])
    except CostModelError as e:
        raise BenchError(f"--cost-model {APP}: the router's constants do not load here: {e}") from None


def check_baselines(cfg: BenchConfig) -> None:
    names = [n for n, _ in cfg.baselines]
    if cfg.baselines and not cfg.live:
        raise BenchError("--baseline needs --url: baselines run beside the live app, on its rates and gates")
    for name, url in cfg.baselines:
        if not name or not all(ch.isalnum() or ch in "_-" for ch in name):
            raise BenchError(f"--baseline name {name!r}: use letters, digits, '_' and '-' (NAME=URL)")
        if name in (LIVE, SIM) or name in known_policies(True):
            raise BenchError(f"--baseline name {name!r} is taken (a system or policy name); pick another")
        if not url.startswith(("http://", "https://")):
            raise BenchError(f"--baseline {name}: the URL must be http://..., got {url!r}")
    if len(set(names)) != len(names):
        raise BenchError(f"--baseline lists a name twice: {','.join(names)}")


def parse_baseline(text: str) -> tuple[str, str]:
    """`NAME=URL` from the command line."""
    name, sep, url = text.partition("=")
    if not sep:
        raise BenchError(f"--baseline {text!r}: expected NAME=URL, e.g. ray_serve_llm=http://127.0.0.1:8000/raylm")
    return name.strip(), url.strip().rstrip("/")


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def cost_model_key(cm: CostModel) -> dict:
    """What identifies the judging constants across a resume."""
    return {"name": cm.name, "sha256": hashlib.sha256(json.dumps(cm.to_dict(), sort_keys=True).encode()).hexdigest()[:16]}


def settings_of(cfg: BenchConfig, cm: CostModel | None, traces: Sequence[TraceInput]) -> dict:
    """The settings that decide what is sent and how it is judged (compared on resume); the
    router's own constants (`cm` None) are compared as a resolved value once read."""
    return {
        "version": SETTINGS_VERSION, "live": cfg.live, "sim": cfg.sim,
        "traces": [{"name": t.name, "sha256": t.sha256} for t in traces],
        "policies": list(cfg.policies), "baselines": [{"name": n, "url": u} for n, u in cfg.baselines],
        "rate": cfg.rate, "saturation": cfg.saturation,
        "duration_s": cfg.duration_s, "max_requests": cfg.max_requests, "tight_share": cfg.tight_share,
        "seed": cfg.seed, "cost_model": cost_model_key(cm) if cm is not None else {"source": APP},
        "slo_scale": cfg.slo_scale,
        "topology": cfg.topology, "max_model_len": cfg.max_model_len if not cfg.live else None,
        "probe": ({"requests": cfg.probe_requests, "seconds": cfg.probe_seconds, "iterations": cfg.probe_iterations}
                  if cfg.saturation else None),
        "capacity": ({"attainment": cfg.capacity, "steps": cfg.capacity_steps, "probe_requests": cfg.probe_requests,
                      "probe_seconds": cfg.probe_seconds} if cfg.capacity is not None else None),
    }


def _diff(old: Any, new: Any, where: str = "") -> list[str]:
    if isinstance(old, dict) and isinstance(new, dict):
        out = []
        for k in sorted(set(old) | set(new), key=str):
            out += _diff(old.get(k), new.get(k), f"{where}.{k}" if where else str(k))
        return out
    return [] if old == new else [f"{where}: was {json.dumps(old)}, now {json.dumps(new)}"]


def check_out_dir(out: Path, settings: dict) -> dict | None:
    """The stored settings file of a compatible earlier run (None for a new run), or BenchError."""
    if out.exists() and not out.is_dir():
        raise BenchError(f"--out {out} exists and is not a folder")
    path = out / SETTINGS_FILE
    if not path.exists():
        if out.exists() and (out / RECORDS_FILE).exists():
            raise BenchError(f"{out} holds {RECORDS_FILE} but no {SETTINGS_FILE}: not a folder this command "
                             "wrote; use another --out")
        return None
    try:
        stored = json.loads(path.read_text())
        old = stored["settings"]
    except (ValueError, KeyError, TypeError):
        raise BenchError(f"{path} is not a bench settings file; use another --out") from None
    diffs = _diff(old, settings)
    if diffs:
        raise BenchError(f"{out} holds a run with other settings ({'; '.join(diffs)}); "
                         "use another --out, or rerun with the same settings to resume it")
    return stored


# --- talking to the app ------------------------------------------------------------------------


async def probe_target(app: AsyncAppClient) -> Target:
    try:
        await app.health()
    except AppError as e:
        raise BenchError(f"{e}; the app is not ready") from None
    try:
        models = await app.model()
        state = await app.state()
    except AppError as e:
        raise BenchError(f"{app.base_url} does not look like the disagg app: {e}") from None
    insts = state["instances"] or {}
    max_len = models.get("max_model_len")
    if not isinstance(max_len, int) or max_len < 2:
        raise BenchError(f"{app.base_url}/v1/models gives no usable max_model_len ({max_len!r})")
    return Target(model=models["id"], max_model_len=max_len,
                  prefill=sorted(i for i, v in insts.items() if v.get("role") == "prefill"),
                  decode=sorted(i for i, v in insts.items() if v.get("role") == "decode"),
                  policy=state.get("policy", "?"), cost_model=state.get("cost_model", "?"),
                  routers=max(1, len(state.get("routers") or {})))


async def set_policy(app: AsyncAppClient, spec: str) -> None:
    """Switch the app to a policy: a name, or NAME:key=value... (`parse_policy_spec`)."""
    name, params = parse_policy_spec(spec)
    try:
        await app.set_policy(name, params)
    except AppError as e:
        raise BenchError(f"the app refused policy {spec!r}: {e}") from None


async def reset_prefix_cache(app: AsyncAppClient) -> None:
    try:
        await app.reset_prefix_cache()
    except AppError as e:
        raise BenchError(str(e)) from None


# --- gates -------------------------------------------------------------------------------------


def _gate_request(seed: int, i: int, prompt: int, max_tokens: int, stream: str) -> PlannedRequest:
    return PlannedRequest(index=i, at_s=0.0, prompt_tokens=prompt, max_tokens=max_tokens, slo_class="loose",
                          prompt_seed=prompt_seed(seed, stream, i))


async def token_count_gate(app: AsyncAppClient, model: str, seed: int, timeout_s: float,
                           name: str = "token_count") -> dict:
    bad = []
    for i, n in enumerate((1, 9)):
        r = await send_one(app.http, model, _gate_request(seed, i, 24, n, "gate/token_count"), timeout_s=timeout_s)
        if r.error or r.usage_completion_tokens != n:
            bad.append(f"max_tokens={n}: usage.completion_tokens={r.usage_completion_tokens}, "
                       f"content events={r.content_events}, error={r.error}")
    return {"name": name, "passed": not bad, "requests": 2,
            "detail": "; ".join(bad) or "ignore_eos + max_tokens=N gave exactly N completion tokens (N=1, 9)"}


async def baseline_gates(app: AsyncAppClient, name: str, model: str, seed: int, timeout_s: float,
                         warm_requests: int = 8) -> list[dict]:
    """What can be checked of a system we cannot look inside: the token-count contract, then a
    warm-up of `warm_requests` requests (its instances are not addressable, so the greedy
    equivalence gate and a per-pair warm-up do not apply; its prefix cache cannot be reset, and
    the prompts it is measured on are ones it has never seen)."""
    gates = [await token_count_gate(app, model, seed, timeout_s, name=f"{name}: token_count")]
    if not gates[0]["passed"]:
        return gates
    errors = []
    for i in range(warm_requests):
        r = await send_one(app.http, model, _gate_request(seed, i, 64, 4, f"gate/warm/{name}"), timeout_s=timeout_s)
        if r.error:
            errors.append(r.error)
    gates.append({"name": f"{name}: warm", "passed": not errors, "requests": warm_requests,
                  "detail": (f"{warm_requests} warm-up requests" + (f"; errors: {errors[:2]}" if errors else ""))})
    return gates


async def baseline_model(app: AsyncAppClient, name: str) -> str:
    try:
        return (await app.model())["id"]
    except (AppError, KeyError, TypeError) as e:
        raise BenchError(f"baseline {name}: {app.base_url}/v1/models gave no model ({e})") from None


async def run_gates(app: AsyncAppClient, target: Target, seed: int, timeout_s: float) -> list[dict]:
    """The three correctness gates, in order, up to the first that fails; each a dict with name,
    passed, detail and the number of requests it sent."""
    gates = []

    def req(i: int, prompt: int, max_tokens: int, stream: str) -> PlannedRequest:
        return _gate_request(seed, i, prompt, max_tokens, stream)

    # 1. token-count contract
    gates.append(await token_count_gate(app, target.model, seed, timeout_s))
    if not gates[-1]["passed"]:  # the first failed gate stops: what follows would measure a broken app
        return gates

    # 2. greedy equivalence across decode instances
    await set_policy(app, "round_robin")
    n = 2 * max(1, len(target.decode))
    texts, decodes, errors = [], set(), []
    for i in range(n):
        r = await send_one(app.http, target.model, req(0, 32, 16, "gate/greedy"), timeout_s=timeout_s)
        if r.error:
            errors.append(r.error)
        texts.append(r.text)
        decodes.add(r.route.get("served_decode") or r.route.get("decode"))
    missing = sorted(set(target.decode) - decodes)
    ok = not errors and len(set(texts)) == 1 and not missing and bool(target.decode)
    detail = (f"{n} identical greedy answers across decode instances {sorted(decodes)}" if ok else
              f"errors={errors[:2]}, distinct texts={len(set(texts))}, decode instances not reached={missing}, "
              f"decode instances in /admin/state={target.decode}")
    gates.append({"name": "greedy_equivalence", "passed": ok, "requests": n, "detail": detail})
    if not ok:
        return gates

    # 3. warm every prefill×decode pair once
    pairs_all = {(p, d) for p in target.prefill for d in target.decode}
    seen, sent, errors = set(), 0, []
    limit = 2 * max(1, len(pairs_all))
    while sent < limit and not pairs_all <= seen:
        r = await send_one(app.http, target.model, req(sent, 64, 4, "gate/warm"), timeout_s=timeout_s)
        sent += 1
        if r.error:
            errors.append(r.error)
            continue
        seen.add((r.route.get("served_prefill") or r.route.get("prefill"),
                  r.route.get("served_decode") or r.route.get("decode")))
    unreached = sorted(f"{p}->{d}" for p, d in pairs_all - seen)
    instances_ok = ({p for p, _ in seen} >= set(target.prefill)) and ({d for _, d in seen} >= set(target.decode))
    ok = not errors and instances_ok
    gates.append({"name": "warm", "passed": ok, "requests": sent,
                  "detail": (f"{len(seen & pairs_all)}/{len(pairs_all)} prefill×decode pairs warmed"
                             + (f"; unreachable by round robin: {unreached}" if unreached else "")
                             + (f"; errors: {errors[:2]}" if errors else ""))})
    return gates


# --- the run -----------------------------------------------------------------------------------


class Bench:
    """One `disagg bench` invocation. `run()` returns the results dict (also written to `out`)."""

    def __init__(self, cfg: BenchConfig, *, progress: Callable[[int, str], Callable[[int], None]] | None = None,
                 log: Callable[[str], None] = lambda m: print(m, file=sys.stderr, flush=True),
                 meter: Callable[[], dict[str, float]] | None = None) -> None:
        self.cfg = cfg
        # CPU seconds so far by part of the host (a study's: benchmarks/host_cpu_live_vs_sim.py); each
        # live run records what it used of each, and its window
        self.meter = meter
        self.progress = progress or (lambda total, label: (lambda n: None))
        self.log = log
        # None until a live run reads the router's (`--cost-model app`): then a resolved setting
        self.cm, self.traces = check_config(cfg)
        self.constants_check: dict | None = None
        self.settings = settings_of(cfg, self.cm, self.traces)
        self.stored = check_out_dir(cfg.out, self.settings)
        self.resolved: dict = dict((self.stored or {}).get("resolved") or {})
        self.gates: list[dict] = []
        self.sent = {"gates": 0, "probes": 0, "runs": 0}
        self.load_stats: dict[str, dict] = {}
        self.host_cpu: dict[str, dict] = {}  # live runs with a meter: CPU seconds by part, and the window
        self.engine_time: dict[str, dict] = {}  # simulated runs: the engines' work and stepping (Simulator)
        self.resumed: set[tuple] = set()
        self.warnings: list[str] = []
        self.slices: dict[str, list[TraceRequest]] = {}
        self.slice_info: dict[str, dict] = {}
        self.store = RecordStore(cfg.out / RECORDS_FILE)
        self.target: Target | None = None
        self.shards: ClientShards | None = None

    # what every live request of this run shares: its seed, its SLO scale, the judging constants --------

    def _planned(self, slice_: Sequence[TraceRequest], trace: str, indices: Sequence[int] | None = None,
                 stream: str | None = None) -> list[PlannedRequest]:
        return planned(slice_, trace, self.cfg.seed, indices, stream=stream, slo_scale=self.cfg.slo_scale)

    def _record(self, res: ClientResult, *, policy: str, trace: str, req: TraceRequest, rate: float,
                system: str = LIVE) -> dict:
        return live_record(res, policy=policy, trace=trace, req=req, cm=self.cm, rate=rate, system=system,
                           slo_scale=self.cfg.slo_scale)

    # settings.json ------------------------------------------------------------------------------

    def _save_settings(self) -> None:
        constants = self.cfg.out / COST_MODEL_FILE
        if self.cm is not None and not constants.exists():  # a resumed run has the same (`cost_model_key`)
            self.cm.save(constants)
        write_json_atomic(self.cfg.out / SETTINGS_FILE, json_safe({
            "settings": self.settings, "resolved": self.resolved,
            "info": {"url": self.cfg.url, "traces": {t.name: str(t.path) for t in self.traces},
                     "cost_model_source": judge_source(self.cfg)},
        }))

    def _resolve(self, key: str, value) -> None:
        """A value found at run time that must not change when the run resumes."""
        old = self.resolved.get(key)
        if old is not None and old != value:
            raise BenchError(f"{self.cfg.out} holds a run where {key} was {old!r}; now it is {value!r}. "
                             "Use another --out")
        self.resolved[key] = value

    # entry --------------------------------------------------------------------------------------

    def run(self) -> dict:
        self.store.load()
        if self.store.torn_bytes:
            self.log(f"cut a torn last line ({self.store.torn_bytes} bytes) from {self.store.path}")
        try:
            if self.cfg.live:
                with realtime_priority(self.cfg.realtime) as why_not:
                    if why_not:
                        self.warnings.append(why_not)
                    event_loop_runner()(self._live())
            else:
                self._resolve_sim_only()
            if self.cfg.sim:
                self._run_sim()
        finally:
            self.store.close()
        return write_results(self)

    def _resolve_sim_only(self) -> None:
        self._resolve("max_model_len", self.cfg.max_model_len)
        self._resolve("topology", self.cfg.topology or "1P2D")
        self._resolve("routers", self.cfg.routers or 1)
        self._plan_all()
        self._save_settings()

    def _plan_all(self, rates: dict[str, float | None] | None = None) -> None:
        for t in self.traces:
            rate = self.cfg.rate if rates is None else rates.get(t.name)
            s, info = plan_slice(t.requests, rate=rate, duration_s=self.cfg.duration_s,
                                 max_requests=self.cfg.max_requests, tight_share=self.cfg.tight_share,
                                 seed=self.cfg.seed, max_len=self.resolved.get("max_model_len"))
            self.slices[t.name], self.slice_info[t.name] = s, info

    def _store_saturation(self, name: str, found: dict) -> None:
        self.resolved.setdefault("saturation", {})[name] = found
        self.log(f"{name}: saturation rate {found['rate']:.3f} req/s")
        self._save_settings()

    def _saturation_rates(self) -> dict[str, float]:
        return {n: f["rate"] for n, f in (self.resolved.get("saturation") or {}).items()}

    def _sim_saturation(self, t: TraceInput) -> dict:
        from disagg.sim.runner import find_saturation
        from disagg.sim.simulator import Topology

        base = list(t.requests[: self.cfg.max_requests] if self.cfg.max_requests else t.requests)
        base, _, _ = fit_to_context(base, self.resolved.get("max_model_len"))
        return find_saturation(base, self.cm, Topology.parse(self.resolved["topology"]),
                               tight_share=self.cfg.tight_share, seed=self.cfg.seed, slo_scale=self.cfg.slo_scale)

    # live ---------------------------------------------------------------------------------------

    async def _check_constants(self, app: AsyncAppClient, target: Target) -> None:
        """Refuse (BenchError) when the judging constants describe other hardware (`constants_check`)."""
        try:
            verdict = await check_constants(app.probe, self.cm, target.prefill + target.decode,
                                            target.max_model_len, self.cm.engine.max_num_seqs, self.cfg.seed,
                                            log=self.log)
        except AppError as e:
            if e.status in (401, 403, 404):  # no admin access from here: the probes cannot run
                self.warnings.append(f"the cost model's constants were not checked against the app's hardware "
                                     f"({e}); goodput assumes {self.cm.name!r} describes it")
                return
            raise BenchError(f"checking the cost model against the app's engines failed: {e}") from None
        self.constants_check = verdict.as_dict()
        ratios = ", ".join(f"{k} {r:.2f}×" for k, r in verdict.ratios.items())
        self.log(f"constants of {self.cm.name!r} against the app's engines (measured ÷ predicted): {ratios}")
        if not verdict.fits:
            message = mismatch(verdict, self.cm.name, self.cfg.url)
            if not self.cfg.accept_foreign_constants:
                raise BenchError(message)
            self.warnings.append(message)

    async def _live(self) -> None:
        cfg = self.cfg
        async with contextlib.AsyncExitStack() as stack:
            sh = await stack.enter_async_context(
                ClientShards(cfg.url, timeout_s=cfg.request_timeout_s, max_connections=cfg.max_connections))
            self.shards = sh
            c = sh.app
            target = await probe_target(c)
            self.target = target
            self._resolve("max_model_len", target.max_model_len)
            self._resolve("model", target.model)
            self._resolve("topology", cfg.topology or f"{len(target.prefill)}P{max(1, len(target.decode))}D")
            self._resolve("routers", target.routers)
            if self.cm is None:
                self.cm = await router_cost_model(c, target.model)
                self._resolve("cost_model", cost_model_key(self.cm))
            if target.cost_model != self.cm.name:
                self.warnings.append(f"goodput is judged with cost model {self.cm.name!r}; the router routes with "
                                     f"{target.cost_model!r}")
            await self._check_constants(c, target)
            if not cfg.saturation:
                self._plan_all()
            self._save_settings()  # every input checked: from here on requests are sent
            if cfg.gates:
                self.log(f"gates: token count, greedy equivalence over {len(target.decode)} decode instances, warm-up")
                self._record_gates(await run_gates(c, target, cfg.seed, cfg.request_timeout_s), "")
            if cfg.saturation:
                await self._live_saturation(c)
                self._plan_all(self._saturation_rates())
                self._save_settings()
            if cfg.capacity is not None:
                for t in self.traces:
                    await self._live_capacity(c, t)
                return
            baselines = {}
            for name, url in cfg.baselines:
                shards = await stack.enter_async_context(
                    ClientShards(url, timeout_s=cfg.request_timeout_s, max_connections=cfg.max_connections))
                model = await baseline_model(shards.app, name)
                if cfg.gates:
                    self.log(f"gates for baseline {name}: token count, warm-up")
                    gates = await baseline_gates(shards.app, name, model, cfg.seed, cfg.request_timeout_s)
                    self._record_gates(gates, f"baseline {name}: ")
                baselines[name] = (shards, model)
            # interleaved: on every trace, each of our policies, then each baseline system
            for t in self.traces:
                for policy in cfg.policies:
                    await self._live_run(c, policy, t.name)
                for name, (shards, model) in baselines.items():
                    await self._live_run(None, name, t.name, system=name, shards=shards, model=model)

    def _record_gates(self, gates: list[dict], what: str) -> None:
        """Count and keep gate results (gates.json holds every gate so far); stop on a failed one."""
        self.gates += gates
        self.sent["gates"] += sum(g["requests"] for g in gates)
        write_json_atomic(self.cfg.out / GATES_FILE, self.gates)
        failed = [g for g in gates if not g["passed"]]
        if failed:
            raise GateFailed(f"{what}correctness gate failed, nothing measured: "
                             + "; ".join(f"{g['name']}: {g['detail']}" for g in failed))

    async def _live_saturation(self, c: AsyncAppClient) -> None:
        """Find each trace's saturation rate by probing the live app (round robin, short slices)."""
        cfg = self.cfg
        for t in self.traces:
            if t.name in self._saturation_rates():
                continue
            self.log(f"{t.name}: saturation search on the live app (slow: see disagg.bench.harness) ...")
            pool = list(t.requests)

            async def probe(rate: float, t=t, pool=pool) -> float:
                n = min(len(pool), max(cfg.probe_requests, math.ceil(rate * cfg.probe_seconds)))
                s, _ = plan_slice(pool[:n], rate=rate, duration_s=None, max_requests=None,
                                  tight_share=cfg.tight_share, seed=cfg.seed, max_len=self.resolved.get("max_model_len"))
                await set_policy(c, "round_robin")
                await reset_prefix_cache(c)
                reqs = self._planned(s, t.name, stream=f"{t.name}/probe")
                results, _ = await run_open_loop(self.shards, self.target.model, reqs, timeout_s=cfg.request_timeout_s)
                self.sent["probes"] += len(results)
                recs = [to_request_record(self._record(r, policy="round_robin", trace=t.name, req=s[r.index],
                                                       rate=rate)) for r in results]
                g = summarize(recs)["goodput"]
                self.log(f"  probe {t.name} at {rate:.3f} req/s, {n} requests: round_robin goodput {g:.3f}")
                return g

            own = own_rate(pool[: cfg.max_requests] if cfg.max_requests else pool)
            self._store_saturation(t.name, await saturation_search_async(probe, own, cfg.probe_iterations))

    def _capacity_pool(self, t: TraceInput) -> list[TraceRequest]:
        return list(t.requests[: self.cfg.max_requests] if self.cfg.max_requests else t.requests)

    def _capacity_probe_slice(self, pool: list[TraceRequest], start: float) -> list[TraceRequest]:
        """The requests every probe of a search sends, rescaled to its rate, live and simulated alike: a
        probe that took rate × probe_seconds of the trace would measure a longer slice at a higher
        rate (on a bursty trace, where a burst begins) rather than the rate."""
        cfg = self.cfg
        return pool[:min(len(pool), max(cfg.probe_requests, math.ceil(start * cfg.probe_seconds)))]

    async def _live_capacity(self, c: AsyncAppClient, t: TraceInput) -> None:
        """Every policy's SLO capacity on trace `t`, searched live in lockstep (module doc, step 5)."""
        cfg = self.cfg
        pool = self._capacity_pool(t)
        start = cfg.rate or own_rate(pool)
        found = self.resolved.setdefault("capacity", {}).setdefault(t.name, {})
        probe = self._capacity_probe_slice(pool, start)
        searches: dict[str, list] = {}  # policy → [search, next rate, probes]
        for policy in cfg.policies:
            probes = found.get(policy, {}).get("probes", [])
            search, rate = _replayed(capacity_steps(start, cfg.capacity, cfg.capacity_steps), probes)
            if search is not None:
                searches[policy] = [search, rate, list(probes)]
        while searches:
            for policy, s in list(searches.items()):
                search, rate, probes = s
                got = await self._capacity_probe(c, t, probe, policy, rate)
                probes.append([rate, got])
                found[policy] = {"probes": probes}
                try:
                    s[1] = search.send(got)
                except StopIteration as stop:
                    found[policy] = {**stop.value, "start_rps": start, "attainment": cfg.capacity}
                    del searches[policy]
                    cap = stop.value["capacity_rps"]
                    self.log(f"{t.name}: {policy} SLO capacity " + (f"{cap:.3f} req/s" if cap else "none"))
                self._save_settings()

    async def _capacity_probe(self, c: AsyncAppClient, t: TraceInput, probe: list[TraceRequest], policy: str,
                              rate: float) -> float:
        """The share of the `probe` requests meeting both SLO targets with `policy`, their arrivals
        rescaled to `rate`."""
        cfg = self.cfg
        n = len(probe)
        s, _ = plan_slice(probe, rate=rate, duration_s=None, max_requests=None, tight_share=cfg.tight_share,
                          seed=cfg.seed, max_len=self.resolved.get("max_model_len"))
        await set_policy(c, policy)
        await reset_prefix_cache(c)
        reqs = self._planned(s, t.name, stream=f"{t.name}/capacity")
        results, _ = await run_open_loop(self.shards, self.target.model, reqs, timeout_s=cfg.request_timeout_s)
        self.sent["probes"] += len(results)
        recs = [to_request_record(self._record(r, policy=policy, trace=t.name, req=s[r.index], rate=rate))
                for r in results]
        got = summarize(recs)["goodput"]
        self.log(f"  probe {t.name} {policy} at {rate:.3f} req/s, {n} requests: {got:.3f} met their SLO")
        return got

    def _as_the_app(self) -> dict:
        """How the simulator runs the app the bench measures: its router replicas, each seeing the
        engines' state as they push it (`ENGINE_PUSH_S` after a change), and routing with each
        request's output length, which the bench's requests state (`ignore_eos`, `max_tokens`)."""
        return {"routers": self.resolved.get("routers") or 1, "push_s": ENGINE_PUSH_S, "known_output": True,
                "slo_scale": self.cfg.slo_scale}

    def _sim_capacity(self) -> None:
        """The same searches in the simulator."""
        from disagg.sim.runner import find_capacity
        from disagg.sim.simulator import Topology

        topology = Topology.parse(self.resolved["topology"])
        out = self.resolved.setdefault("capacity_sim", {})
        for t in self.traces:
            pool = self._capacity_pool(t)
            start = self.cfg.rate or own_rate(pool)
            pool, _, _ = fit_to_context(pool, self.resolved.get("max_model_len"))  # as the live probes are
            probe = self._capacity_probe_slice(pool, start)  # the live probes' requests, not the whole pool
            for policy in self.cfg.policies:
                if policy in out.get(t.name, {}):
                    continue
                found = find_capacity(rescale_to_rate(probe, start), self.cm, topology, policy,
                                      attainment=self.cfg.capacity, steps=self.cfg.capacity_steps,
                                      tight_share=self.cfg.tight_share, seed=self.cfg.seed, **self._as_the_app())
                out.setdefault(t.name, {})[policy] = found
                self._save_settings()

    async def _live_run(self, c: AsyncAppClient | None, policy: str, trace: str, *, system: str = LIVE,
                        shards: ClientShards | None = None, model: str | None = None) -> None:
        """One policy of our app (`c` switches it and resets its caches) or one baseline system
        (`c` None: its own `shards` and `model`, nothing to switch) on one trace slice."""
        s = self.slices[trace]
        done = self.store.done(system, policy, trace)
        pending = [i for i in range(len(s)) if i not in done]
        if not pending:
            return
        if done:
            self.resumed.add((system, policy, trace))
            self.log(f"{policy} on {trace}: resuming, {len(done)} of {len(s)} requests already recorded")
        if c is not None:
            await set_policy(c, policy)
            await reset_prefix_cache(c)
        rate = self.slice_info[trace]["rate"]
        bar = self.progress(len(pending), f"{policy[:11]}/{trace[:8]}")

        def on_result(res: ClientResult) -> None:
            self.store.append(self._record(res, policy=policy, trace=trace, req=s[res.index], rate=rate,
                                           system=system))
            bar(1)

        reqs = self._planned(s, trace, pending)
        before, t0 = (self.meter(), time.monotonic()) if self.meter else (None, 0.0)
        results, stats = await run_open_loop(shards or self.shards, model or self.target.model, reqs,
                                             on_result=on_result, timeout_s=self.cfg.request_timeout_s)
        key = f"{system}/{policy}/{trace}"
        if before is not None:
            after = self.meter()
            self.host_cpu[key] = {"window_s": time.monotonic() - t0, **{p: after[p] - before[p] for p in after}}
        self.sent["runs"] += len(results)
        self.load_stats[key] = stats.as_dict()

    # sim ----------------------------------------------------------------------------------------

    def _run_sim(self) -> None:
        from disagg.sim.runner import simulate
        from disagg.sim.simulator import Topology

        if self.cfg.capacity is not None:
            self._sim_capacity()
            return
        topology = Topology.parse(self.resolved["topology"])
        if self.cfg.saturation and not self.cfg.live:
            for t in self.traces:
                if t.name not in self._saturation_rates():
                    self.log(f"{t.name}: saturation search in the simulator ...")
                    self._store_saturation(t.name, self._sim_saturation(t))
            self._plan_all(self._saturation_rates())
            self._save_settings()
        for policy in self.cfg.policies:
            for t in self.traces:
                s = self.slices[t.name]
                done = self.store.done(SIM, policy, t.name)
                if len(done) >= len(s):
                    continue
                bar = self.progress(len(s), f"sim {policy[:7]}/{t.name[:8]}")
                _, result = simulate(s, self.cm, topology, policy, seed=self.cfg.seed, progress=bar,
                                     **self._as_the_app())
                self.engine_time[f"{SIM}/{policy}/{t.name}"] = result.extra["engine_time"]
                rate = self.slice_info[t.name]["rate"]
                for r in sorted(result.records, key=lambda r: int(r.request_id[1:])):
                    rec = sim_record(r, policy=policy, trace=t.name, rate=rate, slice_=s)
                    if rec["index"] not in done:
                        self.store.append(rec)


def _replayed(search, probes: Sequence[Sequence[float]]):
    """(the capacity search advanced through the `probes` an earlier run measured, its next rate),
    or (None, None) when they completed it."""
    rate = next(search)
    for _, got in probes:
        try:
            rate = search.send(got)
        except StopIteration:
            return None, None
    return search, rate


def run_bench(cfg: BenchConfig, **kw) -> dict:
    return Bench(cfg, **kw).run()


def write_results(bench: Bench) -> dict:
    """Summarize the bench folder and write every output file; returns the results dict."""
    cfg = bench.cfg
    traces = [t.name for t in bench.traces]
    records = list(bench.store.records.values())
    order = (([(LIVE, p) for p in cfg.policies] if cfg.live else []) + [(n, n) for n, _ in cfg.baselines]
             + ([(SIM, p) for p in cfg.policies] if cfg.sim else []))
    expected = {t: info["requests"] for t, info in bench.slice_info.items()}
    runs = report.summarize_runs(records, expected=expected, lag_bound_s=cfg.lag_bound_s, order=order,
                                 traces=traces)
    for r in runs:
        key = (r["system"], r["policy"], r["trace"])
        r["resumed"] = key in bench.resumed
        r["load"] = bench.load_stats.get("/".join(key))
        for field_, by_run in (("host_cpu_s", bench.host_cpu), ("engine_time", bench.engine_time)):
            if "/".join(key) in by_run:  # only the runs of this invocation that measured them
                r[field_] = by_run["/".join(key)]
    warnings = list(bench.warnings)
    for r in runs:
        if r["send_lag_exceeded"]:
            warnings.append(f"{r['policy']} on {r['trace']}: the generator's send lag P99 was "
                            f"{r['send_lag_p99_s'] * 1e3:.0f} ms (bound {cfg.lag_bound_s * 1e3:.0f} ms): the client, "
                            "not the app, shaped part of the arrivals")
        if not r["complete"]:
            warnings.append(f"{r['system']} {r['policy']} on {r['trace']}: {r['requests']} of "
                            f"{r['expected_requests']} requests recorded (rerun the command to finish it)")
    for name, sat in (bench.resolved.get("saturation") or {}).items():
        if sat.get("bracketed") is False:
            warnings.append(f"{name}: round robin's goodput never fell below the saturation rule's target "
                            f"{sat['target_goodput']:.3f} up to {sat['rate']:.3g} req/s; the rate is that last "
                            "probed rate, not a mid-collapse point")
    if bench.store.duplicates:
        warnings.append(f"{bench.store.duplicates} duplicate lines in requests.jsonl were ignored")
    results = {
        "settings": bench.settings, "resolved": bench.resolved, "url": cfg.url,
        "cost_model": {"name": bench.cm.name, "source": judge_source(cfg), "constants_check": bench.constants_check,
                       "slo": {c.value: {"ttft_s": bench.cm.target(c).ttft_s, "tpot_s": bench.cm.target(c).tpot_s}
                               for c in SloClass}},
        "gates": bench.gates, "warnings": warnings, "requests_sent": bench.sent,
        "traces": bench.slice_info, "runs": runs,
        "tables": {m: report.table(runs, m, traces) for m, _, _ in report.TABLE_METRICS},
        "sim_vs_live": report.sim_vs_live(runs),
        "send_lag_bound_s": cfg.lag_bound_s, "generator_realtime": cfg.realtime,
    }
    results = json_safe(results)
    out = cfg.out
    write_json_atomic(out / report.RESULTS_JSON, results)
    write_text_atomic(out / report.RESULTS_MD, report.markdown(results), permissions=SHARED)  # a report for anyone on the machine
    if runs:
        report.plot_goodput(results, out / report.GOODPUT_PNG)
        report.plot_ttft_cdf(records, results, out / report.TTFT_PNG)
    return results
