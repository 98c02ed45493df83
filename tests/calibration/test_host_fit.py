"""The shared host's fits (`calibration.host`) on synthetic measurements: they recover the constants
that made them."""

import pytest

from calibration.host import LoadWindow, engine_seconds, fit_engine_cores, fit_serving_cpu, host_cpu_s
from disagg.core.cost_model import EngineConstants, SharedHost


@pytest.mark.parametrize("engine_cores", [1.0, 1.5, 2.0])
def test_engine_cores_are_recovered_from_the_stretch_at_each_busy_count(engine_cores):
    host = SharedHost(engine_cores=engine_cores, cores=2)
    stretch = {k: host.stretch(k) for k in (1, 2, 3, 4)}
    assert fit_engine_cores(stretch, most=2.0) == pytest.approx(engine_cores, abs=0.011)


def test_engines_that_barely_slow_each_other_fit_about_a_core_each():
    assert fit_engine_cores({1: 1.0, 2: 1.0, 3: 1.02}, most=4.0) == pytest.approx(2.94, abs=0.011)  # 3 / 1.02


def test_serving_cpu_per_step_per_message_and_per_request_are_recovered():
    c = EngineConstants(step_base_s=0.004, prefill_token_s=3e-5, decode_seq_s=2e-4, kv_capacity_tokens=65536)
    step_s, event_s, request_s = 0.0006, 0.0007, 0.004
    windows = []
    # the host fit's three windows as the CPU profile served them: few streams (many steps, tokens 8 a
    # message), many streams (8 tokens a step, 10 a message), short answers (requests dominate)
    for requests, tokens, streams, steps, events in ((8, 128, 2, 1030, 140), (48, 128, 16, 800, 600),
                                                     (120, 4, 8, 220, 240)):
        engine = engine_seconds(c, requests, 32, tokens, streams / 2)
        cpu = steps * step_s + events * event_s + requests * request_s + engine
        windows.append(LoadWindow(cpu, steps, events, requests, engine))
    assert fit_serving_cpu(windows) == pytest.approx((step_s, event_s, request_s), rel=1e-6)


def test_a_window_below_its_engine_time_fits_no_negative_cpu():
    fit = fit_serving_cpu([LoadWindow(1.0, 1000, 120, 10, 2.0), LoadWindow(0.5, 80, 40, 100, 0.1),
                           LoadWindow(0.8, 300, 300, 24, 0.5)])
    assert all(x >= 0 for x in fit)


def test_engine_seconds_are_the_prefills_and_each_tokens_share_of_its_step():
    c = EngineConstants(step_base_s=0.004, prefill_token_s=3e-5, decode_seq_s=2e-4, kv_capacity_tokens=65536)
    assert engine_seconds(c, 2, 100, 11, 4) == pytest.approx(2 * (c.prefill_s(100) + 10 * (0.004 + 4 * 2e-4) / 4))


def test_the_host_cpu_clock_moves_with_work():
    t0 = host_cpu_s()
    sum(i * i for i in range(3_000_000))
    assert host_cpu_s() > t0


def test_an_engine_processs_cpu_is_read_over_a_window():
    """What a process beside this one burns in a window is its CPU, not this process's or the idle host's:
    the engines' share of a serving window is read this way."""
    import asyncio
    import subprocess
    import sys

    from calibration.host import _cpu_of

    burner = subprocess.Popen([sys.executable, "-c", "import time\nt = time.process_time()\n"
                               "while time.process_time() - t < 0.6: pass\nprint('burnt', flush=True)\ninput()"],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        async def until_it_has_burnt():
            assert await asyncio.wait_for(asyncio.to_thread(burner.stdout.readline), 60) == "burnt\n"

        _, burnt, _, _ = asyncio.run(_cpu_of(until_it_has_burnt, [burner.pid]))
        assert 0.5 < burnt <= 0.6 + 0.3  # its start-up's imports on top of the 0.6 s
        _, idle, _, _ = asyncio.run(_cpu_of(lambda: asyncio.sleep(0.3), [burner.pid]))
        assert idle < 0.05  # waiting on its input, it burns nothing
    finally:
        burner.kill()
        burner.communicate(timeout=30)


def test_an_engine_process_not_on_this_machine_is_named():
    import os
    import subprocess
    import time

    from calibration.host import HostCalibrationError, engine_processes_running, process_cpu_s

    gone = subprocess_that_exited()
    with pytest.raises(HostCalibrationError, match=f"engine process {gone} is not on this machine"):
        process_cpu_s([gone])
    with pytest.raises(HostCalibrationError, match=f"engine process {gone} is not on this machine"):
        engine_processes_running([gone])  # none of them left
    # a process of this machine that is not an engine: another machine's engine has its number here;
    # the error says what runs under that number here
    with pytest.raises(HostCalibrationError, match=f"engine process {os.getpid()} is not on this machine .*"
                                                   f"here process {os.getpid()} is .*, state R, command line .*pytest"):
        engine_processes_running([os.getpid()])
    assert engine_processes_running([]) == ()  # stand-in engines name none
    # one listed process that has exited since (a passing helper) is left out, the engine's are read
    engine = subprocess.Popen(["bash", "-c", "exec -a VLLM::EngineCore sleep 60"])
    try:
        deadline = time.monotonic() + 10
        while "VLLM::EngineCore" not in open(f"/proc/{engine.pid}/cmdline").read():
            assert time.monotonic() < deadline, "the stand-in engine did not take its title"
            time.sleep(0.05)
        assert engine_processes_running([engine.pid, gone]) == (engine.pid,)
        # ... and so is one that has exited but not been collected by its parent yet (a zombie)
        zombie = subprocess.Popen(["true"])
        while open(f"/proc/{zombie.pid}/stat").read().rsplit(")", 1)[1].split()[0] != "Z":
            assert time.monotonic() < deadline + 10, "the child did not exit"
            time.sleep(0.05)
        assert engine_processes_running([engine.pid, zombie.pid]) == (engine.pid,)
        zombie.wait(timeout=10)
    finally:
        engine.kill()
        engine.wait(timeout=10)


def test_an_untitled_running_process_under_an_engine_replica_is_its_engines():
    """An EngineCore is its replica's child whatever its title reads; an untitled process that is no
    replica's descendant is still refused."""
    import subprocess
    import time

    from calibration.host import HostCalibrationError, engine_processes_running
    from serve_app.engine import descendants

    replica = subprocess.Popen(["bash", "-c", "sleep 60 & wait"])
    try:
        deadline = time.monotonic() + 10
        while not descendants(replica.pid):
            assert time.monotonic() < deadline, "the stand-in replica's child did not start"
            time.sleep(0.05)
        [core] = descendants(replica.pid)
        assert engine_processes_running([core], [replica.pid]) == (core,)
        with pytest.raises(HostCalibrationError, match=f"engine process {core} is not on this machine"):
            engine_processes_running([core])
        with pytest.raises(HostCalibrationError, match=f"engine process {core} is not on this machine"):
            engine_processes_running([core], [core + 10_000_000])  # another machine's replica
    finally:
        replica.kill()
        replica.wait(timeout=10)


def test_an_engine_process_is_known_by_its_kernel_name_where_its_command_line_lacks_the_title():
    """The kernel keeps a process's name (comm) apart from its command line, which is read from the
    process's memory; vLLM's title sets both. A running EngineCore refused by its command line alone
    failed a fresh-clone CI run's host fit."""
    import subprocess
    import time

    from serve_app.engine import ENGINE_PROCESS_MARKERS, engine_command

    # bash names itself as vLLM titles an EngineCore (15 bytes kept), its command line names no engine
    named = subprocess.Popen(["bash", "-c", 'n=VLLM::Engine; printf "${n}Core" > /proc/$$/comm; sleep 60; :'])
    plain = subprocess.Popen(["sleep", "60"])
    try:
        deadline = time.monotonic() + 10
        while open(f"/proc/{named.pid}/comm").read().strip() != "VLLM::EngineCor":
            assert time.monotonic() < deadline, "the stand-in did not take its name"
            time.sleep(0.05)
        assert not any(m in open(f"/proc/{named.pid}/cmdline").read() for m in ENGINE_PROCESS_MARKERS)
        assert engine_command(named.pid) == "VLLM::EngineCor"
        assert engine_command(plain.pid) is None
    finally:
        for p in (named, plain):
            p.kill()
            p.wait(timeout=10)


def test_an_engines_processes_are_its_core_and_workers_not_their_passing_helpers():
    """A helper the EngineCore starts (a compile worker pool, a probe) may exit while the engine runs:
    the host fit, reading the engine's processes, then failed on a CI host with "engine process ...
    has exited". An engine names its core and the descendants that are vLLM's workers."""
    import os
    import signal
    import subprocess
    import time

    from serve_app.engine import descendants, engine_tree

    core = subprocess.Popen(["bash", "-c", "(exec -a VLLM::Worker sleep 60) & sleep 60 & wait"], start_new_session=True)
    try:
        def workers() -> list[int]:  # a child is bash's fork until it has exec'd: wait for the title
            return [p for p in descendants(core.pid) if "VLLM::Worker" in open(f"/proc/{p}/cmdline").read()]

        deadline = time.monotonic() + 10
        while len(descendants(core.pid)) < 2 or not workers():
            assert time.monotonic() < deadline, "the stand-in core's two children did not start"
            time.sleep(0.05)
        [worker] = workers()
        assert engine_tree([core.pid]) == (core.pid, worker)
    finally:
        os.killpg(core.pid, signal.SIGKILL)
        core.wait(timeout=10)


def subprocess_that_exited() -> int:
    import subprocess
    import sys

    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait(timeout=30)
    return p.pid


def test_a_quiet_window_reads_no_negative_cpu(monkeypatch):
    """The host's count moves in 10 ms ticks and this process's in nanoseconds: over a short quiet
    window the host can read less than this process alone (it did, on a CI host: -0.008 cores)."""
    import asyncio

    import calibration.host as host

    readings = iter([100.0, 100.0])  # the host's tick has not moved while this process worked
    monkeypatch.setattr(host, "host_cpu_s", lambda: next(readings))

    async def busy():
        sum(i * i for i in range(300_000))

    cpu, _, wall, _ = asyncio.run(host._cpu_of(busy))
    assert cpu == 0.0 and wall > 0


def test_settling_waits_for_a_quiet_host_within_its_limit():
    import asyncio

    from calibration.host import settle

    said: list[str] = []
    quiet, idle = asyncio.run(settle(5.0, quiet_cores=1e9, window_s=0.05, log=said.append))  # any host is quiet
    assert quiet < 1.0 and said[-1].startswith("settled") and idle is not None and idle >= 0.0
    busy, idle = asyncio.run(settle(0.2, quiet_cores=-1.0, window_s=0.05, log=said.append))  # never quiet
    assert 0.2 <= busy < 1.0 and "measuring anyway" in said[-1] and idle is None  # no idle reading to reuse


def test_contention_probes_every_engine_of_the_host_and_recovers_its_cores():
    """Two models' engines on one host (a multi-model app): each is probed alone and beside the
    others, and the stretch the stand-in's processor sharing gives is what the fit recovers."""
    import asyncio

    from calibration.host import HostPlan, measure_contention

    host = SharedHost(engine_cores=1.2, cores=2)
    alone_s = {"tiny:colocated-1": 0.004, "small:colocated-2": 0.011}
    busy: set[str] = set()
    probed = []

    async def post(body: dict) -> dict:
        iid = body["instance"]
        busy.add(iid)
        probed.append(iid)
        await asyncio.sleep(0)  # every probe of a group starts before any ends
        stretch = host.stretch(len(busy))
        await asyncio.sleep(0)
        busy.discard(iid)
        return {"seconds": alone_s[iid] * stretch}

    stretch_at = asyncio.run(measure_contention(list(alone_s), post, HostPlan.quick()))
    assert set(probed) == set(alone_s)
    assert stretch_at == pytest.approx({1: 1.0, 2: host.stretch(2)})
    assert fit_engine_cores(stretch_at, most=2.0) == pytest.approx(1.2, abs=0.011)


def test_a_prefills_weight_is_the_ratio_of_the_shares_the_two_got():
    from calibration.host import HostCalibrationError, fit_prefill_weight

    assert fit_prefill_weight([2.0, 2.0], [2.0, 2.0]) == 1.0  # fair sharing
    assert fit_prefill_weight([3.0, 2.6, 2.8], [1.5, 1.6, 1.4]) == pytest.approx(2.0)  # the median round
    with pytest.raises(HostCalibrationError, match="no round"):
        fit_prefill_weight([], [])


def test_the_prefill_weight_probes_overlap_and_recover_the_weight_the_host_shares_by():
    """A stand-in host that shares one core by weight: the timed probe of each pair runs beside the
    other, which is already busy, and the measured stretches give back the weight."""
    import asyncio

    from calibration.host import CONTENTION_TOKENS, measure_prefill_weight

    host = SharedHost(engine_cores=1, cores=2, prefill_weight=1.8)
    busy: dict[str, str] = {}
    bodies = []

    async def post(body: dict) -> dict:
        iid, kind = body["instance"], body["kind"]
        bodies.append(body)
        weight = {"prefill": host.prefill_weight, "decode": 1.0}
        others = [k for i, k in busy.items() if i != iid]
        busy[iid] = kind
        stretch = host.stretch(1 + len(others), own=weight[kind], weights=weight[kind] + sum(weight[k] for k in others))
        alone = 0.002 if kind == "decode" else 0.02
        await asyncio.sleep(0.001 * body["tokens"] if kind == "decode" else 0.01 * body["repeats"])
        del busy[iid]
        return {"seconds": alone * stretch}

    weight, report = asyncio.run(measure_prefill_weight("decode-1", "prefill-0", post, 1024, rounds=2))
    assert weight == pytest.approx(1.8)
    assert report["decode_stretch"] == pytest.approx([2.8, 2.8], abs=1e-3)  # rounded in the report
    assert report["prefill_stretch"] == pytest.approx([2.8 / 1.8] * 2, abs=1e-3)
    assert report["cores_shared"] == pytest.approx(1.0)  # the stand-in loses none of its core
    assert {b["instance"] for b in bodies if b["kind"] == "prefill"} == {"prefill-0"}
    assert all(b["size"] == 1024 for b in bodies if b["kind"] == "prefill")
    # the background prefills outlast the decode probe: about 3× its time alone, within the probe's limit
    assert max(b["repeats"] for b in bodies if b["kind"] == "prefill") == min(16, 3 * CONTENTION_TOKENS * 2 // 20 + 1)
    assert report["besides"] == []

    # with the host's other engines decoding beside both probes: the weight among as many busy engines
    # as the host has (a prefill and three decodes on one core), and the core the four share
    bodies.clear()
    weight, report = asyncio.run(measure_prefill_weight("decode-1", "prefill-0", post, 1024, rounds=2,
                                                        besides=["decode-2", "prefill-1"]))
    assert weight == pytest.approx(1.8)
    assert report["decode_stretch"] == pytest.approx([4.8, 4.8], abs=1e-3)  # (1.8 + 3) / 1
    assert report["prefill_stretch"] == pytest.approx([4.8 / 1.8] * 2, abs=1e-3)
    assert report["cores_shared"] == pytest.approx(1.0) and report["besides"] == ["decode-2", "prefill-1"]
    assert {b["instance"] for b in bodies if b["kind"] == "decode"} == {"decode-1", "decode-2", "prefill-1"}


def test_the_engines_steps_are_summed_from_admin_state_for_the_engines_asked():
    from calibration.host import engine_steps

    instances = {"prefill-0": {"steps": 40}, "decode-0": {"steps": 2}, "decode-1": {}, "other-0": {"steps": 7}}
    assert engine_steps(instances) == 49  # an engine that reports none counts none
    assert engine_steps(instances, {"prefill-0", "decode-1"}) == 40
