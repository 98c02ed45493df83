"""The multi-turn conversation workload (disagg.sim.workloads.conversations / multi_turn_chat)."""

from __future__ import annotations

import itertools
import math
import re
from collections import Counter

import pytest

from disagg.core.types import PREFIX_BLOCK_TOKENS as B
from disagg.sim.traces import rescale_to_rate, trace_stats
from disagg.sim.workloads import ConversationShape, conversations, generate, multi_turn_chat


def _first(n: int, seed: int = 0, shape: ConversationShape = ConversationShape()):
    return list(itertools.islice(conversations(seed, shape), n))


def test_each_turn_extends_the_previous_prompt_and_answer_and_shares_its_block_hashes():
    convs = _first(300)
    assert max(len(c) for c in convs) >= 5  # the check below covers long conversations
    for conv in convs:
        for prev, turn in zip(conv, conv[1:]):
            user_text = turn.prompt_tokens - prev.prompt_tokens - prev.output_tokens
            assert 4 <= user_text <= 2048
            full = prev.prompt_tokens // B
            assert turn.prefix_hashes[:full] == prev.prefix_hashes[:full]
            assert full >= 1 or prev.prompt_tokens < B
            if prev.prompt_tokens % B:  # the partial last block grew into a new, full one
                assert prev.prefix_hashes[-1] not in turn.prefix_hashes
            assert turn.arrival_s > prev.arrival_s


def test_one_hash_per_block_partial_last_block_included():
    for conv in _first(100, seed=3):
        for turn in conv:
            assert len(turn.prefix_hashes) == math.ceil(turn.prompt_tokens / B)
            assert len(set(turn.prefix_hashes)) == len(turn.prefix_hashes)


def test_system_prompts_are_shared_across_conversations_and_only_they():
    convs = _first(200, seed=1, shape=ConversationShape(system_prompts=3))
    # how many conversations each block hash appears in
    spread = Counter(h for conv in convs for h in {h for turn in conv for h in turn.prefix_hashes})
    shared = {h for h, k in spread.items() if k > 1}
    assert shared and len(shared) <= 3 * (4096 // B)  # blocks of at most 3 system prompts
    starts = Counter(conv[0].prefix_hashes[0] for conv in convs)
    assert starts.most_common(1)[0][1] > 200 / 3  # the most popular system prompt leads
    alone = _first(200, seed=1, shape=ConversationShape(system_prompts=0))
    spread = Counter(h for conv in alone for h in {h for turn in conv for h in turn.prefix_hashes})
    assert max(spread.values()) == 1


def test_conversations_respect_the_turn_and_context_limits():
    shape = ConversationShape(mean_turns=6.0, max_turns=5, max_context_tokens=3000)
    convs = _first(300, seed=2, shape=shape)
    assert max(len(c) for c in convs) == 5
    assert all(t.prompt_tokens + t.output_tokens <= 3000 for c in convs for t in c)


@pytest.mark.parametrize("bad", [dict(system_prompts=-1), dict(mean_turns=0.5), dict(max_turns=0),
                                 dict(think_gaps=0.0), dict(think_gaps=math.nan), dict(max_context_tokens=1)])
def test_bad_shapes_are_refused(bad):
    with pytest.raises(ValueError, match="conversation shape"):
        ConversationShape(**bad)


def test_trace_is_seeded_sorted_hashed_and_at_the_rate():
    a = multi_turn_chat(800, 5.0, 7)
    assert a == multi_turn_chat(800, 5.0, 7)
    assert a != multi_turn_chat(800, 5.0, 8)
    assert a[0].arrival_s == 0.0
    assert all(x.arrival_s <= y.arrival_s for x, y in zip(a, a[1:]))
    assert all(r.prefix_hashes for r in a)
    assert trace_stats(a)["mean_rate"] == pytest.approx(5.0)
    # another rate is the same trace stretched, as rescale_to_rate would make it
    b, stretched = multi_turn_chat(800, 2.0, 7), rescale_to_rate(a, 2.0)
    assert [(r.prompt_tokens, r.output_tokens, r.prefix_hashes) for r in b] == \
        [(r.prompt_tokens, r.output_tokens, r.prefix_hashes) for r in a]
    assert [r.arrival_s for r in b] == pytest.approx([r.arrival_s for r in stretched])


def test_trace_turns_share_prefixes_with_earlier_requests():
    trace = generate("multi_turn_chat", 1500, 10.0, 0)
    seen: set[int] = set()
    reusing = 0
    for r in trace:
        if r.prefix_hashes[0] in seen:
            reusing += 1
        seen.update(r.prefix_hashes)
    assert reusing > 0.9 * len(trace)  # a system prompt or an earlier turn: almost every request


def test_cli_writes_the_workload_as_a_native_trace_with_its_hashes(tmp_path, capsys):
    from disagg.cli import main
    from disagg.sim.traces import read_trace

    out = tmp_path / "mt.csv"
    assert main(["traces", "generate", "multi_turn_chat", "--requests", "60", "--rate", "5", "--seed", "2",
                 "--out", str(out)]) == 0
    assert read_trace(out) == generate("multi_turn_chat", 60, 5.0, 2)
    for argv, words in ((["chat"], "unknown workload 'chat'; known: .*multi_turn_chat"),
                        (["short_chat", "--requests", "0"], "--requests"),
                        (["short_chat", "--rate", "-1"], "--rate")):
        assert main(["traces", "generate", *argv, "--out", str(tmp_path / "bad.csv")]) == 2
        assert re.search(words, capsys.readouterr().err)
    assert not (tmp_path / "bad.csv").exists()
