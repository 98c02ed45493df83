"""vLLM general plugin: the per-process CPU setup a NIXL-connected vLLM engine needs to run at all,
and to run at speed.

Registered in pyproject.toml as

    [project.entry-points."vllm.general_plugins"]
    disagg_cpu_tunings = "serve_app.vllm_plugin:register"

so vLLM calls `register()` in *every* process it starts (frontend, EngineCore, workers), possibly
several times per process. It must therefore be idempotent, cheap, and never raise.

0. AMX permission (fixed here). On CPUs with AMX (Sapphire Rapids and later) vLLM's CPU attention
   picks its `amx` kernel whenever `torch.cpu._is_amx_tile_supported()` is true, but Linux only
   lets a process execute AMX instructions after it asked for the tile state
   (`arch_prctl(ARCH_REQ_XCOMP_PERM)`). torch asks lazily, from its own oneDNN kernels; a decode
   worker whose first forward pass runs straight after a NIXL pull reaches vLLM's attention kernel
   first and dies with SIGILL. `torch.cpu._init_amx()` asks up front, in every process vLLM
   starts; on a CPU without AMX it is a no-op.

Why the rest: on a CPU-only machine an engine using vLLM's NixlConnector with default settings ran ~100x
slower (8 tok/s instead of ~630 tok/s for one request) and every idle worker spun a core at 100%.
Two independent causes, two tunings (both measured on a 2-core CPU machine):

1. NIXL progress thread (fixed here). `nixl_agent_config(enable_prog_thread=True)` is NIXL's
   default and starts a UCX progress thread that busy-polls (`pthrDelay=0`), eating a core that
   the model needs. vLLM drives NIXL by polling transfer state from its own step loop
   (`check_xfer_state`, which makes UCX progress itself), so the thread is not needed. vLLM has
   no option for it, so this plugin wraps the `nixl_agent_config` factory that
   `vllm.distributed.nixl_utils` hands out (which the NixlConnector worker,
   `kv_connector/v1/nixl/base_worker.py`, imports at module import time) so that every agent
   config vLLM builds gets `enable_prog_thread=False`. Only on the CPU platform: on GPUs the
   progress thread is the intended, tested configuration and we leave it alone.

2. OpenMP binding (NOT done here; set by the engine wrapper, `serve_app.engine.engine_env`,
   before vLLM starts). On CPU the NixlConnector worker pins itself with `sched_setaffinity` to the
   last physical core of each NUMA node (reserved "for kv transfer"), while vLLM's automatic OpenMP
   binding (`VLLM_CPU_OMP_THREADS_BIND=auto`) puts its compute threads on the other cores: the
   worker's threads then fight their own affinity mask. Binding OpenMP to that same reserved core
   (`VLLM_CPU_OMP_THREADS_BIND=1` on a 2-core machine) is what worked. It has to be an environment
   variable because vLLM reads it in the worker process at start-up.

3. Message-queue spinning (fixed here). An engine's scheduler process and its worker hand every
   step to each other through shared-memory queues whose reader busy-loops (`sched_yield`) for a
   second after each message (`shm_broadcast.SpinCondition.wait`) before it sleeps on the writer's
   notification socket. With engines sharing cores, waiting readers take time slices from the
   engines' compute and from everything else on the host: a worker waiting for its next step
   spins on the core its busy neighbours compute on, a scheduler waiting for its worker spins
   beside the router. On the CPU platform a reader spins for `queue_spin_s()` only (2 ms by
   default: a busy engine's other side often answers that fast), then waits on the notification
   socket for at most `QUEUE_WAIT_SLICE_MS` at a time, looking at the queue between. Not an
   unbounded sleep: the socket is not a reliable wake-up — its publisher keeps one message in
   flight and drops the rest while a reader has not taken the last one, and a reader that found
   its message by looking never takes it — so an unbounded wait can miss its message for good
   (measured: an engine froze mid-run). The slice bounds that miss. `DISAGG_VLLM_QUEUE_SPIN_S`
   sets the spin, in the environment the engines start in (`1` or more: vLLM's own behaviour).
   Measured in docs/results.md ("The engines' spinning queues").

If a vLLM upgrade moves the patched symbol, `register()` logs a warning naming what it could not
find and leaves vLLM unpatched (slow but correct); it never crashes engine start-up.
"""

from __future__ import annotations

import functools
import logging
import math
import os
import sys
import time
from typing import Any

logger = logging.getLogger("disagg.vllm_plugin")

_NIXL_UTILS = "vllm.distributed.nixl_utils"
# Modules that bind `nixl_agent_config` into their own namespace with `from ... import`; if one
# was imported before register() ran, its binding is patched too.
_NIXL_CONSUMERS = ("vllm.distributed.kv_transfer.kv_connector.v1.nixl.base_worker",)
_PATCHED_FLAG = "__disagg_patched__"  # marks what this plugin has wrapped: wrapped once per process
QUEUE_SPIN_S = 0.002  # how long a queue reader spins for its next message before it waits in slices (item 3)
QUEUE_SPIN_ENV = "DISAGG_VLLM_QUEUE_SPIN_S"
QUEUE_WAIT_SLICE_MS = 1  # the longest a queue reader sleeps without looking (item 3): at most this per missed wake-up

_registered = False


def register() -> None:
    """Entry point called by vLLM's `load_general_plugins()`. Idempotent; never raises."""
    global _registered
    if _registered:
        return
    _registered = True
    try:
        if not _is_cpu_platform():
            return
    except Exception as exc:  # a plugin must never take an engine down
        logger.warning("disagg vLLM plugin: platform unknown, CPU setup skipped (%s: %s)",
                       type(exc).__name__, exc)
        return
    for setup in (request_amx_permission, _patch_nixl_agent_config, _stop_queue_spinning):
        try:
            setup()
        except Exception as exc:  # each step alone: one failing must not skip the others
            logger.warning("disagg vLLM plugin: %s not applied (%s: %s)", setup.__name__,
                           type(exc).__name__, exc)


def request_amx_permission() -> bool:
    """Ask the kernel for AMX tile permission in this process if the CPU has AMX (see item 0).

    Returns whether AMX is usable here. Without the permission, the first AMX instruction in the
    process is fatal (SIGILL), so a CPU that reports AMX but refuses it is logged loudly.
    """
    import torch

    if not torch.cpu._is_amx_tile_supported():
        return False
    if torch.cpu._init_amx():
        logger.debug("disagg vLLM plugin: AMX tile permission granted")
        return True
    logger.error("disagg vLLM plugin: the CPU reports AMX but the kernel refused AMX permission; "
                 "vLLM's AMX kernels will crash this process")
    return False


def _is_cpu_platform() -> bool:
    from vllm.platforms import current_platform

    return bool(current_platform.is_cpu())


def _force_no_prog_thread(factory: Any) -> Any:
    """Wrap NIXL's `nixl_agent_config` so that `enable_prog_thread` is always False."""
    if factory is None or getattr(factory, _PATCHED_FLAG, False):
        return factory  # None means "NIXL not installed": keep vLLM's own handling of that

    @functools.wraps(factory)
    def nixl_agent_config(*args: Any, **kwargs: Any) -> Any:
        if args:  # enable_prog_thread is the first positional parameter of nixl_agent_config
            args = (False, *args[1:])
        else:
            kwargs["enable_prog_thread"] = False
        return factory(*args, **kwargs)

    setattr(nixl_agent_config, _PATCHED_FLAG, True)
    return nixl_agent_config


def _patch_nixl_agent_config() -> None:
    """Make every `nixl_agent_config` vLLM obtains from nixl_utils disable the progress thread.

    nixl_utils resolves its NIXL symbols lazily: `from vllm.distributed.nixl_utils import
    nixl_agent_config` calls the module `__getattr__`, which calls `_load_nixl_attr(name)`, which
    imports NIXL and caches the result in the module globals. We wrap `_load_nixl_attr` (so NIXL
    itself is still imported only when vLLM first needs it, never by this plugin) and rewrap any
    value already cached or already bound in a consumer module.
    """
    import importlib

    try:
        nixl_utils = importlib.import_module(_NIXL_UTILS)
    except ImportError:
        logger.warning("disagg vLLM plugin: %s not found; NIXL progress thread left enabled "
                       "(expect a busy core per engine on CPU)", _NIXL_UTILS)
        return

    loader = getattr(nixl_utils, "_load_nixl_attr", None)
    if loader is None:
        logger.warning("disagg vLLM plugin: %s._load_nixl_attr not found; NIXL progress thread "
                       "left enabled (expect a busy core per engine on CPU)", _NIXL_UTILS)
        return

    if not getattr(loader, _PATCHED_FLAG, False):
        @functools.wraps(loader)
        def _load_nixl_attr(name: str) -> Any:
            value = loader(name)
            if name == "nixl_agent_config":
                value = _force_no_prog_thread(value)
                nixl_utils.__dict__[name] = value  # the original cached the unwrapped value
            return value

        setattr(_load_nixl_attr, _PATCHED_FLAG, True)
        nixl_utils._load_nixl_attr = _load_nixl_attr

    if "nixl_agent_config" in nixl_utils.__dict__:  # already resolved before we ran
        nixl_utils.__dict__["nixl_agent_config"] = _force_no_prog_thread(
            nixl_utils.__dict__["nixl_agent_config"])
    for name in _NIXL_CONSUMERS:
        module = sys.modules.get(name)
        if module is not None and "nixl_agent_config" in module.__dict__:
            module.nixl_agent_config = _force_no_prog_thread(module.nixl_agent_config)
    logger.debug("disagg vLLM plugin: NIXL agents will be created with enable_prog_thread=False")


def queue_spin_s() -> float:
    """How long a queue reader spins before it waits in slices: `DISAGG_VLLM_QUEUE_SPIN_S`, else `QUEUE_SPIN_S`."""
    raw = os.environ.get(QUEUE_SPIN_ENV)
    if raw is None:
        return QUEUE_SPIN_S
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value >= 0):
        logger.warning("disagg vLLM plugin: %s=%r is not a number of seconds >= 0; spinning %g s",
                       QUEUE_SPIN_ENV, raw, QUEUE_SPIN_S)
        return QUEUE_SPIN_S
    return value


def _stop_queue_spinning() -> None:
    """Make every shared-memory queue reader of this process wait on its notification socket in
    slices instead of spinning (item 3)."""
    from vllm.distributed.device_communicators import shm_broadcast

    cls = shm_broadcast.SpinCondition
    spin_wait = cls.wait
    if getattr(spin_wait, _PATCHED_FLAG, False):
        return
    spin_s = queue_spin_s()

    @functools.wraps(spin_wait)
    def wait(self: Any, timeout_ms: int | None = None) -> None:
        now = time.monotonic()
        if not (self.is_reader and now <= self.last_read + self.busy_loop_s):
            return spin_wait(self, timeout_ms)  # past vLLM's busy second: its own (blocking) wait
        if getattr(self, "_disagg_read", None) != self.last_read:  # the first wait since the last read
            self._disagg_read, self._disagg_since = self.last_read, now
        if now - self._disagg_since < spin_s:
            return spin_wait(self, timeout_ms)  # a reply this soon is worth a short spin (one yield)
        slice_ms = QUEUE_WAIT_SLICE_MS if timeout_ms is None else min(timeout_ms, QUEUE_WAIT_SLICE_MS)
        if self.local_notify_socket in dict(self.poller.poll(timeout=slice_ms)):
            try:
                self.local_notify_socket.recv(flags=shm_broadcast.zmq.NOBLOCK, copy=False)
            except shm_broadcast.zmq.Again:
                pass
        # a cancel ping also ends the wait: the caller checks `shutting_down` on return

    setattr(wait, _PATCHED_FLAG, True)
    cls.wait = wait
    logger.debug("disagg vLLM plugin: shared-memory queue readers wait in %d ms slices instead of spinning",
                 QUEUE_WAIT_SLICE_MS)
