"""vLLM's KV-cache events folded into the router's prefix hashes (disagg.core.kv_event_fold)."""

from __future__ import annotations

import hashlib

from disagg.core.kv_event_fold import KvEventFold
from disagg.core.prefix_index import prompt_block_hashes

BLOCK = 16  # vLLM's KV block on the CPU platform
INDEX = 64  # the router's index block: 4 engine blocks


def vllm_hashes(tokens: list[int], parent: bytes | None = None) -> list[bytes]:
    """A stand-in for vLLM's chained block hashes: any injective chain will do, the fold only
    follows parents."""
    out = []
    for i in range(0, len(tokens) - BLOCK + 1, BLOCK):
        parent = hashlib.sha256((parent or b"") + repr(tokens[i:i + BLOCK]).encode()).digest()
        out.append(parent)
    return out


def store(fold: KvEventFold, tokens: list[int], start_block: int = 0, chunk: int = 3) -> list[bytes]:
    """Store the full blocks of `tokens` from `start_block` on, in events of `chunk` blocks, as a
    prefill's steps would; vLLM's hashes of all of them."""
    hashes = vllm_hashes(tokens)
    for i in range(start_block, len(hashes), chunk):
        part = hashes[i:i + chunk]
        fold.stored(hashes[i - 1] if i else None, part, tokens[i * BLOCK:(i + len(part)) * BLOCK], BLOCK)
    return hashes


def test_stored_blocks_become_the_routers_hashes_of_the_prefixes_they_end():
    fold = KvEventFold(INDEX)
    prompt = list(range(1000, 1000 + 300))  # 18 full engine blocks: 4 full index blocks
    store(fold, prompt)
    assert fold.held == frozenset(prompt_block_hashes(prompt, INDEX))
    added, removed = fold.take_delta()
    assert added == fold.held and not removed
    assert fold.take_delta() == (frozenset(), frozenset())


def test_a_continuation_stored_later_extends_the_chain():
    """A decode caches its output's blocks after the prompt's: the next turn's prefix."""
    fold = KvEventFold(INDEX)
    turn = list(range(5000, 5000 + 200))
    store(fold, turn[:130])  # 8 blocks now
    store(fold, turn, start_block=8, chunk=1)  # then one block per decode step
    assert fold.held == frozenset(prompt_block_hashes(turn, INDEX))


def test_eviction_from_the_tail_releases_the_index_blocks_it_ends():
    fold = KvEventFold(INDEX)
    prompt = list(range(256))
    hashes = store(fold, prompt)
    fold.take_delta()
    index = prompt_block_hashes(prompt, INDEX)
    fold.removed(hashes[::-1][:5])  # vLLM evicts a request's blocks tail first: blocks 15..11
    assert fold.held == frozenset(index[:2])
    assert fold.take_delta() == (frozenset(), frozenset(index[2:]))


def test_a_block_stored_twice_is_held_until_both_copies_go():
    fold = KvEventFold(INDEX)
    prompt = list(range(64))
    hashes = store(fold, prompt)
    store(fold, prompt)  # vLLM may cache equal blocks twice (two requests computed them at once)
    fold.removed(hashes[-1:])
    assert fold.held == frozenset(prompt_block_hashes(prompt, INDEX))
    fold.removed(hashes[-1:])
    assert fold.held == frozenset()


def test_a_change_undone_before_it_was_taken_is_no_change():
    fold = KvEventFold(INDEX)
    prompt = list(range(64))
    hashes = store(fold, prompt)
    fold.removed(hashes)
    assert fold.take_delta() == (frozenset(), frozenset())


def test_a_reset_removes_everything_and_an_unknown_parent_is_counted_not_guessed():
    fold = KvEventFold(INDEX)
    prompt = list(range(128))
    hashes = store(fold, prompt)
    fold.take_delta()
    fold.cleared()
    assert fold.held == frozenset()
    assert fold.take_delta() == (frozenset(), frozenset(prompt_block_hashes(prompt, INDEX)))
    fold.stored(hashes[3], hashes[4:6], prompt[64:96], BLOCK)  # its parent's event was missed
    assert fold.unattributed == 2 and fold.held == frozenset()


def test_what_an_engine_holds_of_a_prompt_is_counted_in_whole_index_blocks_before_its_last_token():
    fold = KvEventFold(INDEX)
    prompt = list(range(3000, 3000 + 256))  # 4 index blocks exactly
    store(fold, prompt)
    assert fold.held_tokens(prompt) == 192  # the last block ends at the last token: vLLM computes that one
    assert fold.held_tokens(prompt + [1]) == 256
    assert fold.held_tokens(prompt[:64] + [9] * 200) == 64
    assert fold.held_tokens(list(range(100))) == 0
