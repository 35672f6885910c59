"""KV-cache bookkeeping: ref counts, prefix-cache hits, LRU eviction, n>1 sharing."""

from __future__ import annotations

import pytest

from kiln.engine.kv_cache import BlockPool, KVCacheManager
from kiln.engine.request import Request
from kiln.sampling_params import SamplingParams

BS = 4


def make_req(tokens, rid="r", salt=None, **params) -> Request:
    return Request(rid, list(tokens), SamplingParams(**params), frozenset({2}), 0.0, cache_salt=salt)


def admit(kv: KVCacheManager, req: Request) -> int:
    computed, hit = kv.get_computed_blocks(req)
    assert kv.allocate_slots(req, req.num_tokens - hit, computed)
    req.num_computed_tokens = req.num_tokens
    return hit


def test_allocation_counts_blocks_and_frees():
    kv = KVCacheManager(num_blocks=10, block_size=BS, enable_prefix_caching=False)
    req = make_req(range(10))
    admit(kv, req)
    assert len(req.blocks) == 3 and all(b.ref_cnt == 1 for b in req.blocks)
    assert 0 not in [b.block_id for b in req.blocks]  # the null block is never handed out
    assert kv.pool.num_free == 9 - 3
    kv.free(req)
    assert kv.pool.num_free == 9 and kv.usage == 0.0


def test_allocation_fails_without_side_effects_when_full():
    kv = KVCacheManager(num_blocks=4, block_size=BS, enable_prefix_caching=False)
    req = make_req(range(13))  # needs 4 blocks, only 3 usable
    assert not kv.allocate_slots(req, 13)
    assert req.blocks == [] and kv.pool.num_free == 3


def test_prefix_hit_reuses_full_blocks_only_and_caps_at_len_minus_one():
    kv = KVCacheManager(num_blocks=16, block_size=BS, enable_prefix_caching=True)
    a = make_req(range(10), "a")
    admit(kv, a)
    b = make_req(list(range(8)) + [99, 98, 97], "b")
    assert admit(kv, b) == 8
    assert b.blocks[:2] == a.blocks[:2] and b.blocks[0].ref_cnt == 2
    assert b.blocks[2] is not a.blocks[2]
    # Exactly the same 8 tokens: only 4 may hit, the last token must be computed.
    c = make_req(range(8), "c")
    computed, hit = kv.get_computed_blocks(c)
    assert hit == 4 and len(computed) == 1


def test_freed_blocks_stay_cached_until_evicted_lru():
    kv = KVCacheManager(num_blocks=5, block_size=BS, enable_prefix_caching=True)
    a = make_req(range(9), "a")
    admit(kv, a)
    kv.free(a)
    b = make_req(range(9), "b")
    assert admit(kv, b) == 8  # revived from the free queue
    kv.free(b)
    # A different prompt needing every block evicts the cached ones.
    c = make_req(range(100, 116), "c")
    assert admit(kv, c) == 0
    kv.free(c)
    d = make_req(range(9), "d")
    assert kv.get_computed_blocks(d)[1] == 0


def test_hash_collision_is_caught_by_token_check():
    pool = BlockPool(4)
    block = pool.get_new_blocks(1)[0]
    pool.cache(block, 12345, (1, 2, 3, 4))
    assert pool.lookup(12345, (1, 2, 3, 4)) is block
    assert pool.lookup(12345, (9, 9, 9, 9)) is None


def test_fanned_out_sequences_share_prompt_blocks_without_prefix_caching():
    kv = KVCacheManager(num_blocks=16, block_size=BS, enable_prefix_caching=False)
    first = make_req(range(10), "0_x", salt="x")
    second = make_req(range(10), "1_x", salt="x")
    stranger = make_req(range(10), "y")
    admit(kv, first)
    assert admit(kv, second) == 8
    assert second.blocks[:2] == first.blocks[:2]
    assert admit(kv, stranger) == 0


def test_prompt_logprobs_requests_skip_the_prefix_cache():
    kv = KVCacheManager(num_blocks=16, block_size=BS, enable_prefix_caching=True)
    admit(kv, make_req(range(10), "a"))
    assert kv.get_computed_blocks(make_req(range(10), "b", prompt_logprobs=1))[1] == 0


def test_pool_needs_two_blocks():
    with pytest.raises(ValueError):
        BlockPool(1)


@pytest.mark.parametrize("reuse_freed_first", [False, True])
def test_which_free_block_goes_first(reuse_freed_first):
    """Lazily committed memory (CPU): freed blocks are reused before never-used ones, so the
    blocks ever touched stay at the peak in use; elsewhere never-used blocks go first, so
    cached blocks live longest."""
    pool = BlockPool(8, reuse_freed_first)
    first = pool.get_new_blocks(2)
    assert [b.block_id for b in first] == [1, 2]
    pool.free(first)
    again = [b.block_id for b in pool.get_new_blocks(3)]
    assert again == ([1, 2, 3] if reuse_freed_first else [3, 4, 5])  # each allocation in ascending order
    assert pool.num_free == 4


def test_reusing_freed_blocks_keeps_the_prefix_cache_within_the_footprint():
    """With freed blocks reused first, a finished prompt's blocks stay cached until a later
    allocation needs them, and its tail blocks go before its shared prefix."""
    kv = KVCacheManager(num_blocks=16, block_size=BS, enable_prefix_caching=True, reuse_freed_first=True)
    a = make_req(range(13), "a")  # blocks: [0-3] [4-7] [8-11] + partial
    admit(kv, a)
    kv.free(a)
    assert kv.get_computed_blocks(make_req(range(13), "b"))[1] == 12
    admit(kv, make_req(range(100, 104), "c"))  # takes one block: a's partial tail
    assert kv.get_computed_blocks(make_req(range(13), "d"))[1] == 12
    admit(kv, make_req(range(200, 204), "e"))  # the next least recently freed: a's last full block
    assert kv.get_computed_blocks(make_req(range(13), "f"))[1] == 8
