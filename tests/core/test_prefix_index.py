"""The live router's prefix index (disagg.core.prefix_index): modelled, and exact from the engines' events."""

from __future__ import annotations

import pytest

from disagg.core.cost_model import load_profile
from disagg.core.policies import build_policy
from disagg.core.prefix_index import PENDING_S, PrefixGap, PrefixIndex, index_block_tokens, prompt_block_hashes
from disagg.core.types import InstanceView, RequestFeatures, Role


def test_hashes_name_whole_prefixes_of_full_blocks():
    a = list(range(1000, 1300))  # 300 tokens: two full 128-token blocks, 44 left over
    h = prompt_block_hashes(a, 128)
    assert len(h) == 2
    assert prompt_block_hashes(a[:256] + [7] * 44, 128) == h  # the partial tail is not hashed
    same_first = prompt_block_hashes(a[:128] + [5] * 128, 128)
    assert same_first[0] == h[0] and same_first[1] != h[1]
    # a block equal in content but after a different prefix is a different prefix
    shifted = prompt_block_hashes([9] * 128 + a[128:256], 128)
    assert shifted[1] != h[1]
    assert prompt_block_hashes(a[:127], 128) == ()
    longer = a + list(range(5000, 5300))  # the prompt and its output: only the new blocks are hashed
    assert prompt_block_hashes(longer, 128, known=h) == prompt_block_hashes(longer, 128)


@pytest.mark.parametrize("engine_block,index_block", [(16, 64), (32, 64), (64, 64), (128, 128), (48, 96)])
def test_index_block_is_a_multiple_of_the_engine_block(engine_block, index_block):
    assert index_block_tokens(engine_block) == index_block


def test_index_records_forgets_and_bounds_by_capacity():
    idx = PrefixIndex(64)
    hashes = prompt_block_hashes(list(range(64 * 5)), 64)
    assert idx.lookup("d0") is None  # nothing known: a policy treats the instance as cold
    idx.record("d0", hashes, kv_capacity_tokens=64 * 100, now=0.0)
    assert idx.lookup("d0")(hashes) == 5
    assert idx.lookup("d0") is idx.lookup("d0")  # one lookup per instance: the ledger reuses unchanged views
    assert idx.lookup("d0")(prompt_block_hashes(list(range(64 * 3)) + [1] * 64, 64)) == 3
    idx.record("d1", hashes, kv_capacity_tokens=64 * 3, now=0.0)  # room for 3 blocks: the tail is evicted first
    assert idx.lookup("d1")(hashes) == 3
    assert idx.blocks_held() == {"d0": 5, "d1": 3}
    idx.forget("d0")
    assert idx.lookup("d0") is None
    idx.clear()
    assert idx.blocks_held() == {}


def _view(iid: str, idx: PrefixIndex, queued: int = 0) -> InstanceView:
    return InstanceView(iid, Role.DECODE, backlog_s=0.0, queued=queued, kv_used_tokens=0,
                        kv_capacity_tokens=100_000, prefix_lookup=idx.lookup(iid))


def test_policies_route_a_shared_prefix_to_the_instance_holding_it():
    """The index feeds the policies the live router runs: the decode instance that holds a long
    prompt's prefix wins the follow-up turn under `prefix_affinity` and `slo_goodput`."""
    cm = load_profile("cpu-tiny")
    block = 128
    idx = PrefixIndex(block)
    turn1 = list(range(2000, 3500))
    idx.record("decode-b", prompt_block_hashes(turn1, block), 100_000, now=0.0)
    turn2 = turn1 + list(range(7000, 7100))
    req = RequestFeatures("r", len(turn2), 16, prefix_hashes=prompt_block_hashes(turn2, block),
                          prefix_block_tokens=block)
    prefill = [InstanceView("prefill-a", Role.PREFILL, 0.0, 0, 0, 100_000)]
    # which decode instance wins is the question: `slo_goodput` may not serve the request whole on
    # the (idle) prefill instance here
    params = {"prefix_affinity": {}, "slo_goodput": {"allow_hosted": False}}
    for name in ("prefix_affinity", "slo_goodput"):
        policy = build_policy(name, cm, params[name])  # fresh each time: round-robin cursors start at decode-a
        # decode-a is listed first and equally idle: only the cached prefix can favour decode-b
        d = policy.choose(req, prefill, [_view("decode-a", idx), _view("decode-b", idx)], 0.0)
        assert d.decode_id == "decode-b", name
        cold = RequestFeatures("r", len(turn2), 16)
        d = build_policy(name, cm, params[name]).choose(cold, prefill, [_view("decode-a", idx), _view("decode-b", idx)],
                                                        0.0)
        assert d.decode_id == "decode-a", name  # without hashes the cache is invisible


def _apply(idx: PrefixIndex, iid: str, seq: int, since: int, added=(), removed=(), snapshot=False, now=0.0) -> None:
    idx.apply(iid, seq=seq, since=since, added=frozenset(added), removed=frozenset(removed), snapshot=snapshot,
              now=now)


def test_an_instance_with_events_is_exactly_what_its_engine_reports_evictions_included():
    idx = PrefixIndex(64)
    hashes = prompt_block_hashes(list(range(64 * 4)), 64)
    _apply(idx, "d0", 1, 0, added=hashes, snapshot=True)
    assert idx.exact("d0") and idx.lookup("d0")(hashes) == 4
    _apply(idx, "d0", 2, 1, removed=hashes[2:])  # evicted from the tail (running requests took the space)
    assert idx.lookup("d0")(hashes) == 2 and idx.blocks_held() == {"d0": 2}
    _apply(idx, "d0", 3, 2, removed=hashes[:2])
    assert idx.lookup("d0")(hashes) == 0
    # no capacity model bounds it: the engine says what it holds
    many = prompt_block_hashes(list(range(64 * 50)), 64)
    _apply(idx, "d0", 4, 3, added=many)
    assert idx.lookup("d0")(many) == 50


def test_a_delta_that_does_not_follow_the_version_held_is_refused():
    idx = PrefixIndex(64)
    with pytest.raises(PrefixGap):  # a delta before any snapshot
        _apply(idx, "d0", 2, 1, added={1})
    _apply(idx, "d0", 1, 0, added={1}, snapshot=True)
    with pytest.raises(PrefixGap):
        _apply(idx, "d0", 3, 2, added={2})  # version 2 never arrived
    assert idx.lookup("d0")((1, 2)) == 1  # unchanged by the refused delta
    _apply(idx, "d0", 5, 0, added={2}, snapshot=True)  # a resubscription's snapshot replaces everything
    assert idx.lookup("d0")((1,)) == 0 and idx.lookup("d0")((2,)) == 1


def test_a_prompt_just_routed_counts_as_held_until_confirmed_or_expired():
    idx = PrefixIndex(64)
    a = prompt_block_hashes(list(range(64 * 3)), 64)
    b = prompt_block_hashes(list(range(1000, 1000 + 64 * 3)), 64)
    _apply(idx, "d0", 1, 0, snapshot=True, now=10.0)
    idx.record("d0", a, 10**6, now=10.0)  # routed there: a burst sharing the prefix lands together
    idx.record("d0", b, 10**6, now=10.0)
    assert idx.lookup("d0")(a) == 3 and idx.lookup("d0")(b) == 3
    _apply(idx, "d0", 2, 1, added=a, now=10.5)  # the engine stored `a`
    _apply(idx, "d0", 3, 2, now=10.0 + PENDING_S + 0.1)  # `b` never came (its request failed)
    assert idx.lookup("d0")(a) == 3 and idx.lookup("d0")(b) == 0
    _apply(idx, "d0", 4, 3, removed=a, now=20.0)  # and once evicted, a confirmed prompt is gone
    assert idx.lookup("d0")(a) == 0


def test_a_reset_empties_exact_instances_but_keeps_their_version():
    idx = PrefixIndex(64)
    _apply(idx, "d0", 7, 0, added={1, 2}, snapshot=True)
    idx.record("d1", (5, 6), 10**6, now=0.0)  # modelled
    idx.clear()
    assert idx.blocks_held() == {"d0": 0} and idx.lookup("d1") is None
    _apply(idx, "d0", 8, 7, removed={1, 2})  # the engine's own AllBlocksCleared follows, and applies
    assert idx.exact("d0")
