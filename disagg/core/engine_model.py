"""A step-level model of one vLLM engine's continuous batching, fast enough to replay a day of traffic.

Used by the simulator for every instance, and by the TTFT estimator to run an instance's state
forward: one engine model, not two. Pure: the caller owns the clock and the event heap; the model
says when its current step ends and what happened in it.

What is modelled (vLLM v1 scheduler semantics):
- one step at a time; each step decodes one token for every running sequence, then fills the rest
  of the token budget (`max_batched_tokens`) with prefill chunks — chunked prefill — first for
  requests already prefilling, then by admitting waiting requests in FCFS order;
- step time from the calibrated cost model: base + τ_pre·prefill tokens + per-sequence decode cost
  + the prefill chunks' attention over their context (c·(k + c/2) for a chunk of c tokens after k),
  plus the per-prefill overhead for each prefill the step finishes;
- at most `max_num_seqs` running sequences;
- paged KV: a sequence holds ceil(tokens / block_size) blocks; blocks are allocated as chunks and
  tokens are written; a waiting request is admitted only when blocks for its first chunk are free,
  and FCFS admission stops at the first request that does not fit;
- preemption by recompute when a decode step needs a block and none is free: the most recently
  admitted sequence is evicted to the front of the queue and later recomputes prompt + output;
- prefill-only requests (a disaggregated prefill) keep their KV after the first token until the
  transfer out ends (`release`); decode-side requests whose KV arrives by transfer are admitted
  with blocks for the whole prompt, hold them during the transfer without computing, and then
  decode (their first step produces the first token).

Engines that share a host (`CostModel.shared_host`) are given one `HostShare`: each step is then
stretched by the host's processor sharing at the moment it is planned — how many of the host's
engines are busy and what their steps weigh (a prefill claims more of a shared core than a decode
step: `SharedHost.step_weight`), the serving path's CPU for the tokens their steps stream, and its
CPU per request at the rate requests arrive (`HostShare.arrive`). The stretch is fixed for the step, or the macro
step, it is planned for; whoever drives the engines cuts macro steps short when the number of busy
engines changes (the simulator does).

What is not: prefix caching, speculative decoding, the dependence of a decode step's time on its
sequences' context length, and the block that vLLM writes for the last prompt token on the decode
side (one token per request).

Speed: decoding sequences share one step counter, so advancing the whole batch is O(1); between
events (an arrival, a completion, running out of blocks) the model plans a *macro step* of k
identical decode steps at once, and an arrival truncates it at the end of the step in flight.
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from dataclasses import dataclass, field
from enum import Enum

from disagg.core.cost_model import EngineConstants, SharedHost, attention_pairs


class JobState(Enum):
    WAITING = 0
    TRANSFER_IN = 1  # decode side: blocks held, KV arriving
    READY = 2  # decode side: KV arrived, joins the batch at the next step
    PREFILLING = 3
    DECODING = 4
    HOLDING = 5  # prefill side: first token out, KV held until transferred
    DONE = 6


class Job:
    """One request's life on one engine."""

    __slots__ = (
        "rid", "prompt", "target", "remote_kv", "prefill_only", "payload",
        "computed", "prefill_goal", "kvlen", "generated", "blocks", "state",
        "base", "gbase", "fin_step", "epoch", "t_first", "t_last", "preemptions",
    )

    def __init__(self, rid, prompt: int, target: int, *, remote_kv: bool = False, prefill_only: bool = False, payload=None):
        if prompt < 1 or target < 1:
            raise ValueError(f"job {rid!r}: prompt and target must be >= 1, got {prompt}, {target}")
        self.rid = rid
        self.prompt = prompt
        self.target = 1 if prefill_only else target
        self.remote_kv = remote_kv
        self.prefill_only = prefill_only
        self.payload = payload
        self.computed = 0  # prompt(+recomputed output) tokens whose KV is computed here
        self.prefill_goal = prompt
        self.kvlen = 0
        self.generated = 0
        self.blocks = 0
        self.state = JobState.WAITING
        self.base = 0  # while decoding: kvlen = base + engine.step
        self.gbase = 0  # while decoding: generated = gbase + engine.step
        self.fin_step = 0
        self.epoch = 0
        self.t_first: float | None = None
        self.t_last: float | None = None
        self.preemptions = 0


_NO_JOBS: tuple[()] = ()
_NO_CHUNKS: list[tuple[Job, int]] = []  # the prefill chunks of a step that only decodes: never appended to


@dataclass(slots=True)
class StepOutcome:
    prefilled: list[Job] = field(default_factory=list)  # prefill-only jobs now HOLDING
    finished: list[Job] = field(default_factory=list)  # jobs whose last token is out
    started: list[Job] = field(default_factory=list)  # whole jobs whose own prefill gave their first token


# what a step in which no job prefilled or finished returns: one shared outcome, never appended to
# (`end_step` makes a new one for any step with something to report)
_QUIET_STEP = StepOutcome([], [], [])


REQUEST_RATE_WINDOW_S = 1.0


class RequestRate:
    """Requests per second over about the last `window_s` seconds: a count of arrivals that decays
    exponentially with their age."""

    __slots__ = ("window_s", "_rate", "_at")

    def __init__(self, window_s: float = REQUEST_RATE_WINDOW_S, rate: float = 0.0, at: float = 0.0) -> None:
        self.window_s = window_s
        self._rate = rate
        self._at = at

    def arrive(self, now: float) -> None:
        self._rate = self.at(now) + 1.0 / self.window_s
        self._at = max(now, self._at)

    def at(self, now: float) -> float:
        if self._rate == 0.0 or now <= self._at:
            return self._rate
        return self._rate * math.exp((self._at - now) / self.window_s)

    def copy(self) -> "RequestRate":
        return RequestRate(self.window_s, self._rate, self._at)


def prefill_part_s(c: EngineConstants, seconds: float, decode_seqs: int, context: int = 0) -> float:
    """The prefill work in a step of `seconds` (alone) beside `decode_seqs` decoding sequences, as
    its weight on a shared host counts it (`SharedHost.step_weight`): what the step takes beyond
    the decode step it rides on (over `context` tokens), or all of it when nothing decodes."""
    return seconds - c.step_s(0, decode_seqs, 0.0, context) if decode_seqs else seconds


_WEIGHT_CHANGE = 0.05  # a busy engine's step weight moving by more re-plans the others (`HostShare.busy_changes`)


class HostShare:
    """The busy engines of one shared host and the serving-path CPU they call for; says how much
    slower than alone a step planned now runs (`SharedHost.stretch`). An engine is busy from the
    step it plans until it finds nothing to run.

    The serving path's CPU per streamed token follows the busy engines' steps. Its CPU per request
    is spent over the request's life — rendering and routing before the prefill, the engine calls,
    the stream's end — on the cores the serving path's processes run on, so it is a demand at the
    rate requests arrive (`arrive`, over about the last second), not a burst in the step that
    prefills one: charged to that step, 16 ms of it on a 7 ms prefill asked for two cores
    (docs/results.md)."""

    def __init__(self, host: SharedHost, requests: RequestRate | None = None) -> None:
        self.host = host
        self.loads: dict[str, float] = {}  # busy engine → serving cores its current step calls for, at its rate
        self.total = 0.0
        self.relays: dict[str, float] = {}  # busy engine → serving cores its streams' batched messages take
        self.relay_total = 0.0
        self.weights: dict[str, float] = {}  # busy engine → its current step's weight (`SharedHost.step_weight`)
        self.weight = 0.0  # their sum
        self.requests = requests if requests is not None else RequestRate()
        self.busy_changes = 0  # bumped whenever an engine becomes busy or idle, or its step's weight changes
        self.releases: list[tuple[float, str]] = []  # (when, engine): known idle from then on (`release_at`)

    def arrive(self, now: float) -> None:
        """A request came to the host at `now` (its serving path's per-request work starts)."""
        self.requests.arrive(now)

    def step(self, instance_id: str, tokens: int, seconds: float, now: float, prefill_s: float = 0.0) -> float:
        """An engine plans a step of `seconds` (alone, `prefill_s` of it prefill work) at `now` that
        streams `tokens`: its stretch."""
        weight = self.host.step_weight(prefill_s, seconds)
        load, relay = self.host.serving_cores(tokens, seconds)
        self._busy(instance_id, load, relay, weight)
        return self.stretch_at(now, weight)

    def release_at(self, instance_id: str, when: float) -> None:
        """A busy engine that nothing here drives goes idle at `when` (the estimator's peers, whose work
        is known to drain then): steps planned from then on no longer share the host with it."""
        self.releases.append((when, instance_id))
        self.releases.sort()

    def spin(self, instance_id: str) -> None:
        """The engine steps with nothing to compute: vLLM's engine loop keeps stepping (schedule, a
        call to the worker that polls the KV connector) while a KV transfer it is part of is pending
        — a finished prefill's KV awaiting its pull, a decode's awaiting its arrival — so it takes
        a busy engine's share of the host and streams nothing (docs/results.md: a lone hand-off's
        decode engine spent more CPU on a two-token answer than an engine serving a whole
        1,024-token request)."""
        self._busy(instance_id, 0.0, 0.0, 1.0)

    def _busy(self, instance_id: str, load: float, relay: float, weight: float) -> None:
        """`instance_id` is busy with a step of `weight`, its serving path needing `load` cores at
        the step's rate and `relay` at its messages' own (`SharedHost.serving_cores`)."""
        old = self.loads.get(instance_id)
        was = self.weights.get(instance_id, 0.0)
        if old is None:
            self.busy_changes += 1
            old = 0.0
        elif abs(weight - was) > _WEIGHT_CHANGE:  # the others' shares move as much as if one came or went
            self.busy_changes += 1
        self.loads[instance_id] = load
        self.total += load - old
        self.relay_total += relay - self.relays.get(instance_id, 0.0)
        self.relays[instance_id] = relay
        self.weight += weight - was
        self.weights[instance_id] = weight

    def stretch_at(self, now: float, own: float = 1.0) -> float:
        """How many times slower than alone the host runs work of weight `own` at `now`: the stretch
        of a step planned now, which the serving path's own time outside the engines takes too (one
        model of the host for the engines and the processes beside them, a decode step's weight).
        Releases due by `now` take effect first."""
        while self.releases and self.releases[0][0] <= now:
            self.idle(self.releases.pop(0)[1])
        requests = self.host.request_cores(self.requests.at(now)) if self.host.request_cpu_s else 0.0
        return self.host.stretch(len(self.loads), self.total, requests + self.relay_total, own, self.weight)

    def idle(self, instance_id: str) -> None:
        old = self.loads.pop(instance_id, None)
        if old is not None:
            self.busy_changes += 1
            weight = self.weights.pop(instance_id)
            relay = self.relays.pop(instance_id)
            self.total = self.total - old if self.loads else 0.0  # no rounding drift once all are idle
            self.relay_total = self.relay_total - relay if self.loads else 0.0
            self.weight = self.weight - weight if self.loads else 0.0

    @property
    def busy(self) -> int:
        return len(self.loads)

    def copy(self) -> "HostShare":
        other = HostShare(self.host, self.requests.copy())
        other.loads = dict(self.loads)
        other.total = self.total
        other.relays = dict(self.relays)
        other.relay_total = self.relay_total
        other.weights = dict(self.weights)
        other.weight = self.weight
        other.releases = list(self.releases)
        return other


class EngineModel:
    def __init__(self, instance_id: str, constants: EngineConstants, share: HostShare | None = None) -> None:
        self.instance_id = instance_id
        self.c = constants
        self.bs = constants.block_size
        self.total_blocks = constants.kv_capacity_tokens // constants.block_size
        self.free_blocks = self.total_blocks
        self.waiting: deque[Job] = deque()
        self.prefilling: list[Job] = []
        self.decoding: dict[object, Job] = {}
        self.ready: list[Job] = []
        self.holding = 0
        self.transferring = 0
        self._fin: list[tuple[int, int, int, Job]] = []  # (finish step, seq, epoch, job)
        self._phase = [0] * self.bs  # decoding jobs by base % block_size
        self._context = 0  # Σ base over decoding jobs: at step s they hold _context + len(decoding)·s tokens
        self._context_s = constants.decode_context_s  # read once: the hot path skips the term when 0
        self.step = 0
        self._seq = 0
        # the step (or macro step) in flight
        self.busy = False
        self._start = 0.0
        self._dur = 0.0
        self._k = 0
        self._chunks: list[tuple[Job, int]] = []
        self._joined: list[Job] = []
        self._transfers: list[Job] = []
        self._grown = (0, 0)  # (k, blocks the decoding batch allocates over k steps) of the step in flight
        self.steps_run = 0
        self._alone = 0.0  # the step in flight's length alone (unstretched)
        # the steps run: their seconds alone (the compute they asked for) and as stretched by the host
        self.work_s = 0.0
        self.stepping_s = 0.0
        self.preemptions = 0
        self.version = 0  # bumped whenever what a poll reads may have changed
        self._decode_step_s: dict[int, float] = {}  # batch size → `c.step_s(0, size)`
        self.share = share  # the host this engine shares with others; None: it owns its device

    # --- what the router's poll sees -------------------------------------------------------

    @property
    def kv_used_tokens(self) -> int:
        return (self.total_blocks - self.free_blocks) * self.bs

    @property
    def running(self) -> int:
        return len(self.prefilling) + len(self.decoding)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting) + len(self.ready) + self.transferring

    def idle(self) -> bool:
        return not (self.busy or self.waiting or self.prefilling or self.decoding or self.ready)

    def can_ever_fit(self, tokens: int) -> bool:
        return -(-(tokens + 1) // self.bs) <= self.total_blocks

    # --- inputs ------------------------------------------------------------------------------

    def submit(self, job: Job) -> None:
        """Queue a job. The caller then calls `poke(now)` to (re)schedule."""
        job.state = JobState.WAITING
        self.waiting.append(job)
        self.version += 1

    def kv_arrived(self, job: Job) -> None:
        """The decode-side transfer for `job` finished; it decodes from the next step."""
        if job.state is not JobState.TRANSFER_IN:
            raise ValueError(f"job {job.rid!r} is not transferring (state {job.state.name})")
        self.transferring -= 1
        job.state = JobState.READY
        self.ready.append(job)
        self.version += 1

    def release(self, job: Job) -> None:
        """The prefill side's KV for `job` has been transferred out: free its blocks."""
        if job.state is not JobState.HOLDING:
            raise ValueError(f"job {job.rid!r} is not holding KV (state {job.state.name})")
        self.free_blocks += job.blocks
        job.blocks = 0
        job.state = JobState.DONE
        self.holding -= 1
        self.version += 1

    def take_transfers(self) -> list[Job] | tuple[()]:
        """Decode-side jobs admitted since the last call: the caller starts their KV transfers."""
        out = self._transfers
        if not out:
            return _NO_JOBS  # the common answer, without a new list each call
        self._transfers = []
        return out

    def poke(self, now: float) -> float | None:
        """New work may be schedulable. Returns a new step-end time if the caller must schedule one
        (the engine was idle, or a macro step was cut short), else None. Afterwards the caller
        drains `take_transfers()`."""
        if not self.busy:
            return self._plan(now)
        if self._k > 1:
            done = int((now - self._start) / self._dur + 1e-9)
            keep = min(self._k, done + 1)
            if keep < self._k:
                self._k = keep
                return self._start + keep * self._dur
        return None

    def mid_step(self, now: float, done: float = 0.5) -> None:
        """The engine is `done` of the way through the step its state gives at `now`: that step is
        planned as begun `done` of a step before `now`, so work arriving now waits the rest of it.
        For a state read at a random moment of the engine's steps (a router's view), where the
        step's remainder is half a step on average."""
        if not self.busy and self._plan(now) is not None:
            self._start = now - done * self._dur

    @property
    def step_end(self) -> float:
        return self._start + self._k * self._dur

    def step_in_flight_end(self, t: float) -> float | None:
        """The end of the step this engine runs at `t` (one step of a macro step); None when it runs
        none begun before `t`: idle, or between steps."""
        if not self.busy or self._start >= t:
            return None
        end = self._start + max(1, math.ceil((t - self._start) / self._dur - 1e-9)) * self._dur
        return end if end > t else None

    # --- the step ------------------------------------------------------------------------------

    def _blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.bs)

    def _blocks_over(self, k: int) -> int:
        """Blocks the decoding batch allocates over the next k decode steps."""
        bs, phase = self.bs, self._phase
        j = -self.step % bs  # the phase that starts a new block at the next step
        if k == 1:
            return phase[j]
        full, rem = divmod(k, bs)
        # the next `rem` steps start new blocks in phases j, j-1, …, j-rem+1 (mod bs): one slice, or
        # two where it wraps (summed in C, not a Python loop per step: the macro step's search calls this)
        if rem <= j + 1:
            part = sum(phase[j + 1 - rem:j + 1])
        else:
            part = sum(phase[:j + 1]) + sum(phase[bs - (rem - j - 1):])
        return full * len(self.decoding) + part

    def _plan(self, now: float) -> float | None:
        if not (self.waiting or self.ready or self.decoding or self.prefilling):
            if self.share is not None:
                self._between_steps(self.share)
            return None  # nothing to run (a common poke: a transfer out just freed blocks)
        self.version += 1
        if self.ready:
            for job in self.ready:
                self._join(job, generated=0)
            self.ready.clear()
        preempted = False
        grown = self._blocks_over(1)  # the next decode step's new blocks
        while grown > self.free_blocks and (self.decoding or self.prefilling):
            self._preempt_newest()
            preempted = True
            grown = self._blocks_over(1)
        n = len(self.decoding)
        chunks = self._prefill_chunks(n, grown, preempted) if (self.prefilling or self.waiting) else _NO_CHUNKS
        if not chunks and not self.decoding and self.prefilling:
            # Partial prefills hold all the blocks and none can go on: evict the newest.
            self._preempt_newest()
            return self._plan(now)
        self._chunks = chunks
        if chunks:
            self._k = 1
            attention = self.c.prefill_attention_s
            tokens = finishing = 0
            pairs = 0.0
            for job, c in chunks:  # one pass: a step has a chunk or two
                tokens += c
                finishing += job.computed + c >= job.prefill_goal
                if attention:  # each chunk attends to what its job has computed so far (advanced at end_step)
                    pairs += attention_pairs(c, job.computed)
            context = self._context + n * self.step if n and self._context_s else 0
            self._dur = self._alone = self.c.step_s(tokens, n, pairs, context) + self.c.prefill_overhead_s * finishing
            if self.share is not None:
                prefill = prefill_part_s(self.c, self._dur, n, context)
                self._dur *= self.share.step(self.instance_id, n + finishing, self._dur, now, prefill)
        elif n:
            while self._fin and self._fin[0][3].epoch != self._fin[0][2]:
                heapq.heappop(self._fin)
            k = max(1, self._fin[0][0] - self.step)
            grown = self._blocks_over(k)
            if grown > self.free_blocks:
                lo, hi = 1, k  # largest k whose allocations fit (k=1 fits: preemption above)
                while lo < hi:
                    mid = (lo + hi + 1) // 2
                    if self._blocks_over(mid) <= self.free_blocks:
                        lo = mid
                    else:
                        hi = mid - 1
                k = lo
                grown = self._blocks_over(k)
            self._k = k
            dur = self._decode_step_s.get(n)
            if dur is None:  # the step time of a decode-only batch depends on its size alone: memoised
                dur = self._decode_step_s[n] = self.c.step_s(0, n)
            if self._context_s:
                # each of the k steps attends to n tokens more than the one before: the macro step's
                # steps each take their mean (exact in sum; the first is short of it by (k-1)/2 of n tokens)
                dur += self._context_s * (self._context + n * self.step + n * (k - 1) / 2)
            self._alone = dur
            if self.share is not None:
                dur *= self.share.step(self.instance_id, n, dur, now)
            self._dur = dur
        else:
            self.busy = False
            if self.share is not None:
                self._between_steps(self.share)
            return None
        # nothing that changes the decoding batch happens before `end_step`, which allocates these blocks,
        # unless a poke cuts the step short
        self._grown = (self._k, grown)
        self.busy = True
        self._start = now
        return now + self._k * self._dur

    def _between_steps(self, share: HostShare) -> None:
        """Nothing to compute: idle on the shared host, or spinning while a KV transfer is pending."""
        if self.holding or self.transferring:
            share.spin(self.instance_id)
        else:
            share.idle(self.instance_id)

    def _prefill_chunks(self, n: int, grown: int, preempted: bool) -> list[tuple[Job, int]]:
        """The prefill chunks of the next step beside `n` decoding sequences that allocate `grown` new
        blocks: the prefills in progress first, then admissions from the queue, within the token budget.
        Decode-side jobs whose KV arrives by transfer are admitted on the way (`take_transfers`)."""
        budget = self.c.max_batched_tokens - n
        # the decode step's own new blocks come first (only prefill chunks compete for them)
        reserved = grown
        self.free_blocks -= reserved
        chunks: list[tuple[Job, int]] = []
        for job in self.prefilling:
            if budget <= 0:
                break
            c = self._grant(job, budget)
            if c == 0:
                break
            chunks.append((job, c))
            budget -= c
        # vLLM v1 admits nothing from the queue in a step that had to preempt: the freed blocks
        # would only be taken back by the next decode step, throwing the chunk away. (With nothing
        # left running, admission must go on, or the engine would idle with a queue.)
        admit = not preempted or not (self.decoding or self.prefilling)
        while self.waiting and budget > 0 and admit:
            job = self.waiting[0]
            if job.remote_kv and job.computed == 0:
                need = self._blocks_for(job.prompt)
                if need > self.free_blocks:
                    break
                self.waiting.popleft()
                self.free_blocks -= need
                job.blocks = need
                job.kvlen = job.computed = job.prompt
                job.state = JobState.TRANSFER_IN
                self.transferring += 1
                self._transfers.append(job)
                continue
            if self.running >= self.c.max_num_seqs:
                break
            c = self._grant(job, budget)
            if c == 0:
                break
            self.waiting.popleft()
            job.state = JobState.PREFILLING
            self.prefilling.append(job)
            chunks.append((job, c))
            budget -= c
        self.free_blocks += reserved
        return chunks

    def _grant(self, job: Job, budget: int) -> int:
        """Allocate blocks for the next prefill chunk of `job`; the chunk size, 0 if none fit."""
        c = min(job.prefill_goal - job.computed, budget)
        need = self._blocks_for(job.kvlen + c) - job.blocks
        if need > self.free_blocks:
            # Shrink the chunk to what the free blocks hold (vLLM schedules partial chunks too).
            c = (job.blocks + self.free_blocks) * self.bs - job.kvlen
            if c <= 0:
                return 0
            need = self._blocks_for(job.kvlen + c) - job.blocks
        self.free_blocks -= need
        job.blocks += need
        return c

    def end_step(self, now: float) -> StepOutcome:
        """The step in flight ended at `now`: advance state; returns what happened since the last call."""
        out = None  # made for the first job that prefilled or finished: most steps have none
        self.version += 1
        k = self._k
        planned_k, grown = self._grown
        if planned_k != k:
            grown = self._blocks_over(k)
        self.free_blocks -= grown
        self.step += k
        self.steps_run += k
        self.work_s += k * self._alone
        self.stepping_s += k * self._dur
        if self._joined:
            first_step_end = self._start + self._dur
            for job in self._joined:
                if job.state is JobState.DECODING and job.t_first is None:
                    job.t_first = first_step_end
            self._joined.clear()
        for job, c in self._chunks:
            job.computed += c
            job.kvlen += c
            if job.computed < job.prefill_goal:
                continue
            self.prefilling.remove(job)
            job.generated += 1
            if out is None:
                out = StepOutcome()
            if job.t_first is None:
                job.t_first = now
                if not job.prefill_only:
                    out.started.append(job)
            if job.prefill_only:
                job.state = JobState.HOLDING
                job.t_last = now
                self.holding += 1
                out.prefilled.append(job)
            elif job.generated >= job.target:
                self._finish(job, now, out)
            else:
                self._join(job, generated=job.generated)
        if self._chunks:
            self._chunks = []
        while self._fin and self._fin[0][0] <= self.step:
            _, _, epoch, job = heapq.heappop(self._fin)
            if job.epoch != epoch or job.state is not JobState.DECODING:
                continue
            self._leave_decoding(job)
            if out is None:
                out = StepOutcome()
            self._finish(job, now, out)
        # blocks grown by sequences that just left are already counted in their kvlen
        self.busy = False
        return _QUIET_STEP if out is None else out

    def _join(self, job: Job, generated: int) -> None:
        job.state = JobState.DECODING
        job.generated = generated
        job.base = job.kvlen - self.step
        job.gbase = generated - self.step
        job.fin_step = self.step + (job.target - generated)
        job.epoch += 1
        self.decoding[job.rid] = job
        self._phase[job.base % self.bs] += 1
        self._context += job.base
        self._seq += 1
        heapq.heappush(self._fin, (job.fin_step, self._seq, job.epoch, job))
        if job.t_first is None:
            self._joined.append(job)

    def _leave_decoding(self, job: Job) -> None:
        del self.decoding[job.rid]
        self._phase[job.base % self.bs] -= 1
        self._context -= job.base
        job.kvlen = job.base + self.step
        job.generated = job.gbase + self.step
        job.blocks = self._blocks_for(job.kvlen)
        job.epoch += 1

    def _finish(self, job: Job, now: float, out: StepOutcome) -> None:
        self.free_blocks += job.blocks
        job.blocks = 0
        job.state = JobState.DONE
        job.t_last = now
        out.finished.append(job)

    def _preempt_newest(self) -> None:
        """Evict the most recently admitted running sequence; it will recompute from scratch."""
        if self.prefilling:
            job = self.prefilling.pop()
        else:
            job = self.decoding[next(reversed(self.decoding))]
            self._leave_decoding(job)
        self.free_blocks += job.blocks
        job.blocks = 0
        job.kvlen = job.computed = 0
        job.prefill_goal = job.prompt + job.generated
        job.remote_kv = False  # the transferred KV is gone: recompute locally
        job.state = JobState.WAITING
        job.preemptions += 1
        self.preemptions += 1
        self.waiting.appendleft(job)
