"""The engine model on its own: step times, chunking, KV accounting, preemption."""

import pytest
import yaml

from disagg.core.cost_model import CostModel, CostModelError, EngineConstants, load_profile, shipped_profiles
from disagg.core.engine_model import EngineModel, Job, JobState


def consts(**kw) -> EngineConstants:
    base = dict(step_base_s=0.01, prefill_token_s=0.001, decode_seq_s=0.002, kv_capacity_tokens=1024,
                block_size=16, max_num_seqs=8, max_batched_tokens=64)
    base.update(kw)
    return EngineConstants(**base)


def run_until_idle(engine: EngineModel, now: float = 0.0, limit: int = 100_000):
    """Drive one engine alone: returns every finished/prefilled job with the final time."""
    finished, prefilled = [], []
    end = engine.poke(now)
    for _ in range(limit):
        if end is None:
            return finished, prefilled, now
        now = end
        out = engine.end_step(now)
        finished += out.finished
        prefilled += out.prefilled
        end = engine.poke(now)
        for job in engine.take_transfers():  # transfers complete instantly here
            engine.kv_arrived(job)
            end = engine.poke(now) if end is None else end
    raise AssertionError("engine did not go idle")


def test_lone_prefill_only_job_takes_chunked_prefill_time():
    c = consts()
    e = EngineModel("p", c)
    job = Job("a", prompt=100, target=5, prefill_only=True)
    e.submit(job)
    _, prefilled, t = run_until_idle(e)
    # 100 tokens with a 64-token budget: chunks of 64 and 36, each step pays the base.
    assert prefilled == [job]
    assert t == pytest.approx(2 * 0.01 + 100 * 0.001)
    assert t == pytest.approx(c.prefill_s(100))
    assert job.t_first == pytest.approx(t)
    assert job.state is JobState.HOLDING
    assert e.kv_used_tokens == 112  # 7 blocks of 16 held until the transfer out
    e.release(job)
    assert e.kv_used_tokens == 0


def test_lone_colocated_job_decodes_at_batch_one_step_time():
    c = consts()
    e = EngineModel("d", c)
    job = Job("a", prompt=40, target=10)
    e.submit(job)
    finished, _, t = run_until_idle(e)
    assert finished == [job]
    prefill = 0.01 + 40 * 0.001
    assert job.t_first == pytest.approx(prefill)
    assert job.t_last == pytest.approx(prefill + 9 * (0.01 + 0.002))
    assert e.free_blocks == e.total_blocks


def test_a_whole_job_is_reported_started_once_when_its_own_prefill_gives_its_first_token():
    """`StepOutcome.started`: what tells the simulator that a request served whole on an instance
    has no prefill left there. Never a prefill-only job (it is `prefilled`), never twice (a
    preempted job recomputes with its first token already out)."""
    c = consts(kv_capacity_tokens=160)  # 10 blocks: the two jobs cannot both grow to their end
    e = EngineModel("p", c)
    whole = [Job("a", prompt=60, target=40), Job("b", prompt=60, target=40)]
    prefill_only = Job("c", prompt=20, target=1, prefill_only=True)
    for job in (*whole, prefill_only):
        e.submit(job)
    started, now, end = [], 0.0, e.poke(0.0)
    for _ in range(10_000):
        if end is None:
            break
        now = end
        out = e.end_step(now)
        started += out.started
        for job in out.prefilled:
            e.release(job)
        end = e.poke(now)
    assert e.preemptions > 0 and e.idle()
    assert sorted(j.rid for j in started) == ["a", "b"]


def test_remote_kv_job_first_token_after_one_decode_step():
    e = EngineModel("d", consts())
    job = Job("a", prompt=40, target=3, remote_kv=True)
    e.submit(job)
    assert e.poke(0.0) is None  # admission only starts the transfer
    assert e.take_transfers() == [job]
    assert e.kv_used_tokens == 48  # blocks for the whole prompt, held during the transfer
    e.kv_arrived(job)
    end = e.poke(0.5)
    assert end == pytest.approx(0.5 + 3 * 0.012)  # one macro step of 3 decode steps
    out = e.end_step(end)
    assert out.finished == [job]
    assert job.t_first == pytest.approx(0.512)
    assert job.t_last == pytest.approx(0.536)


def test_batch_of_equal_jobs_finishes_together_and_frees_every_block():
    e = EngineModel("d", consts(max_batched_tokens=512))
    jobs = [Job(i, prompt=30, target=20) for i in range(4)]
    for j in jobs:
        e.submit(j)
    finished, _, t = run_until_idle(e)
    assert sorted(j.rid for j in finished) == [0, 1, 2, 3]
    # one prefill step for all 120 prompt tokens, then 19 decode steps at batch 4
    assert t == pytest.approx(0.01 + 120 * 0.001 + 19 * (0.01 + 4 * 0.002))
    assert e.free_blocks == e.total_blocks


def test_max_num_seqs_caps_the_batch():
    e = EngineModel("d", consts(max_num_seqs=2, max_batched_tokens=512))
    for i in range(3):
        e.submit(Job(i, prompt=10, target=5))
    e.poke(0.0)
    assert e.running == 2 and len(e.waiting) == 1


def test_arrival_cuts_a_macro_step_at_the_step_in_flight():
    e = EngineModel("d", consts())
    e.submit(Job("long", prompt=10, target=100))
    end = e.poke(0.0)
    e.end_step(end)  # prefill done at 0.02
    end = e.poke(end)
    assert end == pytest.approx(0.02 + 99 * 0.012)  # the whole decode as one macro step
    e.submit(Job("late", prompt=10, target=2))
    cut = e.poke(0.05)
    # 0.05 is inside the 3rd decode step (0.044..0.056): the step in flight completes first
    assert cut == pytest.approx(0.02 + 3 * 0.012)


def test_kv_exhaustion_preempts_newest_and_everything_still_completes():
    # 8 blocks of 16 tokens: 4 sequences growing to 60 tokens each cannot all stay resident.
    e = EngineModel("d", consts(kv_capacity_tokens=128, max_batched_tokens=512))
    jobs = [Job(i, prompt=20, target=40) for i in range(4)]
    for j in jobs:
        e.submit(j)
    free_seen = []
    end = e.poke(0.0)
    now = 0.0
    for _ in range(10_000):
        if end is None:
            break
        now = end
        e.end_step(now)
        free_seen.append(e.free_blocks)
        end = e.poke(now)
    assert all(j.state is JobState.DONE for j in jobs)
    assert e.preemptions > 0
    assert min(free_seen) >= 0
    assert e.free_blocks == e.total_blocks


def test_can_ever_fit():
    e = EngineModel("d", consts(kv_capacity_tokens=64))
    assert e.can_ever_fit(63)
    assert not e.can_ever_fit(64)


# --- the attention term: a prefill chunk of c tokens after k pays prefill_attention_s·c·(k + c/2) ---

ATTN = 1e-6  # s per (token, context token) pair: large, so that every step time below shows it


def test_chunked_prefill_pays_attention_over_the_context_each_chunk_attends_to():
    c = consts(prefill_attention_s=ATTN)
    e = EngineModel("p", c)
    e.submit(Job("a", prompt=100, target=1, prefill_only=True))
    first = e.poke(0.0)
    # chunk 1: 64 tokens over an empty context, 64·32 = 2,048 pairs
    assert first == pytest.approx(0.01 + 0.064 + 2048e-6, abs=1e-12)
    e.end_step(first)
    end = e.poke(first)
    # chunk 2: 36 tokens over the 64 computed, 36·(64 + 18) = 2,952 pairs
    assert end - first == pytest.approx(0.01 + 0.036 + 2952e-6, abs=1e-12)
    assert end - first == pytest.approx(c.prefill_s(36, context_tokens=64), abs=1e-12)  # as after a cached prefix
    # the chunks add up to p²/2 = 5,000 pairs: the lone prefill time of the cost model
    assert end == pytest.approx(0.125, abs=1e-12) and end == pytest.approx(c.prefill_s(100), abs=1e-12)


def test_each_chunk_of_a_shared_step_attends_to_its_own_context():
    e = EngineModel("d", consts(prefill_attention_s=ATTN))
    e.submit(Job("old", prompt=100, target=3))
    e.submit(Job("new", prompt=20, target=3))
    e.end_step(e.poke(0.0))  # old's first 64 tokens
    start = 0.01 + 0.064 + 2048e-6
    end = e.poke(start)
    # old's last 36 over 64 computed (2,952 pairs) and all 20 of new over nothing (20·10 = 200)
    assert end - start == pytest.approx(0.01 + 0.056 + 3152e-6, abs=1e-12)


def test_decode_steps_pay_no_attention():
    c = consts(prefill_attention_s=ATTN)
    e = EngineModel("d", c)
    job = Job("a", prompt=40, target=10)
    e.submit(job)
    run_until_idle(e)
    prefill = 0.01 + 40 * 0.001 + 40 * 20 * ATTN
    assert job.t_first == pytest.approx(prefill, abs=1e-12)
    assert job.t_last - job.t_first == pytest.approx(9 * (0.01 + 0.002), abs=1e-12)


def test_a_recomputed_prefill_pays_its_attention_again_from_an_empty_context():
    # prompt + the tokens generated before the preemption are recomputed as one prefill
    c = consts(prefill_attention_s=ATTN, max_batched_tokens=512)
    e = EngineModel("d", c)
    job = Job("a", prompt=30, target=5)
    job.generated, job.prefill_goal = 4, 34  # as `_preempt_newest` leaves it
    e.submit(job)
    assert e.poke(0.0) == pytest.approx(0.01 + 0.034 + 34 * 17 * ATTN, abs=1e-12)


def test_without_the_term_the_step_model_is_the_linear_one():
    linear, zero = consts(), consts(prefill_attention_s=0.0)
    assert linear.prefill_attention_s == 0.0
    for p in (1, 64, 65, 1000):
        assert zero.prefill_s(p) == linear.prefill_s(p) == -(-p // 64) * 0.01 + p * 0.001
    assert consts(prefill_attention_s=ATTN).prefill_s(1000) == pytest.approx(linear.prefill_s(1000) + 0.5)


def test_profiles_and_files_without_the_term_still_load(tmp_path):
    for name in shipped_profiles():
        assert load_profile(name).engine.prefill_attention_s == 0.0
    old = load_profile("cpu-tiny").to_dict()
    del old["engine"]["prefill_attention_s"]  # a file written before the term existed
    path = tmp_path / "old.yaml"
    path.write_text(yaml.safe_dump(old))
    assert CostModel.load(path).engine.prefill_attention_s == 0.0
    old["engine"]["prefill_attention_s"] = 2e-9
    CostModel.from_dict(old).save(path)
    assert CostModel.load(path).engine.prefill_attention_s == 2e-9


@pytest.mark.parametrize("bad", [-1e-9, 1e-3])
def test_an_attention_term_that_cannot_be_seconds_per_pair_is_refused(bad):
    with pytest.raises(CostModelError, match="prefill_attention_s"):
        CostModel.from_dict({**load_profile("cpu-tiny").to_dict(),
                             "engine": {**load_profile("cpu-tiny").engine.model_dump(), "prefill_attention_s": bad}})


CTX = 1e-5  # s per step per token of context held by the decoding sequences (large, to show)


def test_decode_steps_pay_for_the_context_their_sequences_hold():
    # prompt 40, 10 tokens: the prefill gives the first; the 9 decode steps attend to 40, 41, …, 48
    e = EngineModel("d", consts(decode_context_s=CTX))
    job = Job("a", prompt=40, target=10)
    e.submit(job)
    run_until_idle(e)
    assert job.t_first == pytest.approx(0.01 + 0.04, abs=1e-12)  # a lone prefill holds no decoding context
    assert job.t_last - job.t_first == pytest.approx(9 * 0.012 + CTX * sum(range(40, 49)), abs=1e-12)
    # the same with the term at 0: the step model before it
    plain = EngineModel("d", consts())
    other = Job("a", prompt=40, target=10)
    plain.submit(other)
    run_until_idle(plain)
    assert other.t_last - other.t_first == pytest.approx(9 * 0.012, abs=1e-12)


def test_a_batchs_context_is_every_sequences_own_and_leaves_with_it():
    # both prefill in one step (no decodes beside it), then decode together until the short one ends
    e = EngineModel("d", consts(decode_context_s=CTX, max_batched_tokens=256))
    short, long = Job("s", prompt=40, target=5), Job("l", prompt=100, target=10)
    e.submit(short)
    e.submit(long)
    run_until_idle(e)
    start = 0.01 + 0.14
    together = 4 * 0.014 + CTX * sum(140 + 2 * j for j in range(4))  # contexts 40+j and 100+j
    assert short.t_last == pytest.approx(start + together, abs=1e-12)
    alone = 5 * 0.012 + CTX * sum(range(104, 109))  # the long one's context after the four steps
    assert long.t_last == pytest.approx(start + together + alone, abs=1e-12)


def test_a_prefill_step_beside_decodes_pays_for_their_context():
    e = EngineModel("d", consts(decode_context_s=CTX))
    a = Job("a", prompt=40, target=20)
    e.submit(a)
    first = e.poke(0.0)
    e.end_step(first)  # a prefilled: it decodes from here with 40 tokens of context
    decode_end = e.poke(first)
    e.submit(Job("c", prompt=30, target=2))
    cut = e.poke(first + 1e-6)  # the macro step is cut at the step in flight
    e.end_step(cut)
    end = e.poke(cut)
    # c's whole prompt beside a's decode, whose sequence holds 41 tokens by now
    assert end - cut == pytest.approx(0.01 + 0.03 + 0.002 + CTX * 41, abs=1e-12)
    assert decode_end > cut


def test_profiles_and_files_without_the_decode_context_term_still_load(tmp_path):
    for name in shipped_profiles():
        assert load_profile(name).engine.decode_context_s == 0.0
    old = load_profile("cpu-tiny").to_dict()
    old["engine"].pop("decode_context_s", None)  # a file written before the term existed
    path = tmp_path / "old.yaml"
    path.write_text(yaml.safe_dump(old))
    assert CostModel.load(path).engine.decode_context_s == 0.0
    assert consts(decode_context_s=CTX).scaled(2.0).decode_context_s == 2 * CTX


@pytest.mark.parametrize("bad", [-1e-9, 1e-3])
def test_a_decode_context_term_that_cannot_be_seconds_per_token_is_refused(bad):
    with pytest.raises(CostModelError, match="decode_context_s"):
        CostModel.from_dict({**load_profile("cpu-tiny").to_dict(),
                             "engine": {**load_profile("cpu-tiny").engine.model_dump(), "decode_context_s": bad}})
