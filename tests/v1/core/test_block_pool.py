"""Tests for engine/v1/core/block_pool.py (twin of vllm/v1/core/block_pool.py).

The life of a block: free -> owned (get_new_blocks) -> cached (cache_full_blocks)
-> shared (touch) -> free again but still cached (free_blocks) -> evicted when
reused. Plus the null block, BlockHashToBlockMap and reset_prefix_cache.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from engine.tracing.core_trace import KVCacheTrace
from engine.tracing.events import KVCached
from engine.utils.hashing import sha256
from engine.v1.core.block_pool import BlockHashToBlockMap, BlockPool
from engine.v1.core.kv_cache_utils import KVCacheBlock, make_block_hash_with_group_id
from tests.helpers.core import assert_block_pool_consistent, free_block_ids, make_request

BLOCK_SIZE = 16


def make_pool(num_blocks: int, enable_caching: bool = True) -> BlockPool:
    return BlockPool(num_blocks, enable_caching=enable_caching, hash_block_size=BLOCK_SIZE)


def key(name: str, group_id: int = 0):
    return make_block_hash_with_group_id(sha256(name), group_id)


def cached_request_blocks(pool: BlockPool, request_id: str, tokens: list[int]):
    """Allocate blocks for all of ``tokens`` and cache the full ones, as
    allocate_slots does after a prefill."""
    request = make_request(request_id, tokens, block_size=BLOCK_SIZE)
    num_blocks = -(-len(tokens) // BLOCK_SIZE)
    blocks = pool.get_new_blocks(num_blocks)
    pool.cache_full_blocks(
        request,
        blocks,
        num_cached_blocks=0,
        num_full_blocks=len(tokens) // BLOCK_SIZE,
        block_size=BLOCK_SIZE,
        kv_cache_group_id=0,
    )
    return request, blocks


# ---------------------------------------------------------------------------
# The null block and construction
# ---------------------------------------------------------------------------
def test_null_block_is_block_zero_and_never_free():
    pool = make_pool(10)
    assert pool.null_block is pool.blocks[0]
    assert pool.null_block.is_null
    assert not any(b.is_null for b in pool.blocks[1:])
    assert pool.get_num_free_blocks() == 9
    assert free_block_ids(pool) == [1, 2, 3, 4, 5, 6, 7, 8, 9]
    assert pool.get_usage() == 0.0
    assert_block_pool_consistent(pool)


def test_get_new_blocks_never_returns_the_null_block():
    pool = make_pool(10)
    blocks = pool.get_new_blocks(9)
    assert [b.block_id for b in blocks] == [1, 2, 3, 4, 5, 6, 7, 8, 9]
    assert pool.get_num_free_blocks() == 0
    assert pool.get_usage() == 1.0
    with pytest.raises(
        ValueError, match=r"Cannot get 1 free blocks from the pool \(only 0 are free\)"
    ):
        pool.get_new_blocks(1)

    pool.free_blocks(blocks)
    assert pool.get_num_free_blocks() == 9
    assert 0 not in free_block_ids(pool)
    assert_block_pool_consistent(pool)


def test_freeing_the_null_block_does_not_queue_it():
    pool = make_pool(4)
    blocks = pool.get_new_blocks(2)
    # Block tables may hold the null block as a placeholder; freeing such a
    # table must not put it into circulation.
    pool.free_blocks([pool.null_block, *blocks])
    assert free_block_ids(pool) == [3, 1, 2]
    assert pool.get_num_free_blocks() == 3
    assert pool.null_block.prev_free_block is None and pool.null_block.next_free_block is None


def test_touch_ignores_the_null_block():
    pool = make_pool(4)
    pool.touch([pool.null_block])
    assert free_block_ids(pool) == [1, 2, 3]
    assert pool.get_num_free_blocks() == 3


@pytest.mark.parametrize("num_blocks", [0, 1, -3, 2.0])
def test_block_pool_needs_at_least_two_blocks(num_blocks):
    with pytest.raises(ValueError, match="num_gpu_blocks must be an integer >= 2"):
        BlockPool(num_blocks, enable_caching=True, hash_block_size=BLOCK_SIZE)


def test_smallest_pool_has_one_usable_block():
    pool = make_pool(2)
    assert pool.get_num_free_blocks() == 1
    assert [b.block_id for b in pool.get_new_blocks(1)] == [1]
    assert pool.get_usage() == 1.0


# ---------------------------------------------------------------------------
# Allocation, reference counts, freeing
# ---------------------------------------------------------------------------
def test_get_new_blocks_pops_head_and_sets_ref_cnt_to_one():
    pool = make_pool(8)
    first = pool.get_new_blocks(3)
    assert [b.block_id for b in first] == [1, 2, 3]
    assert [b.ref_cnt for b in first] == [1, 1, 1]
    assert pool.get_num_free_blocks() == 4
    assert free_block_ids(pool) == [4, 5, 6, 7]
    assert [b.block_id for b in pool.get_new_blocks(2)] == [4, 5]
    assert pool.get_new_blocks(0) == []
    assert pool.get_num_free_blocks() == 2
    assert_block_pool_consistent(pool)


def test_get_new_blocks_too_many_takes_nothing():
    pool = make_pool(5)
    with pytest.raises(
        ValueError, match=r"Cannot get 5 free blocks from the pool \(only 4 are free\)"
    ):
        pool.get_new_blocks(5)
    assert free_block_ids(pool) == [1, 2, 3, 4]
    assert all(b.ref_cnt == 0 for b in pool.blocks)


def test_free_blocks_appends_in_the_given_order():
    pool = make_pool(8)
    b1, b2, b3 = pool.get_new_blocks(3)
    pool.free_blocks([b3, b1, b2])
    assert free_block_ids(pool) == [4, 5, 6, 7, 3, 1, 2]
    assert [b.ref_cnt for b in (b1, b2, b3)] == [0, 0, 0]
    # Freed blocks are evicted last: the untouched ones go first.
    assert [b.block_id for b in pool.get_new_blocks(5)] == [4, 5, 6, 7, 3]
    assert_block_pool_consistent(pool)


def test_free_blocks_only_queues_blocks_whose_ref_cnt_reaches_zero():
    pool = make_pool(6)
    b1, b2 = pool.get_new_blocks(2)
    pool.touch([b1])  # a second holder
    assert b1.ref_cnt == 2
    pool.free_blocks([b1, b2])
    assert (b1.ref_cnt, b2.ref_cnt) == (1, 0)
    assert free_block_ids(pool) == [3, 4, 5, 2]
    pool.free_blocks([b1])
    assert b1.ref_cnt == 0
    assert free_block_ids(pool) == [3, 4, 5, 2, 1]
    assert_block_pool_consistent(pool)


def test_usage_counts_usable_blocks_in_use():
    pool = make_pool(11)  # 10 usable
    blocks = pool.get_new_blocks(3)
    assert pool.get_usage() == pytest.approx(0.3)
    more = pool.get_new_blocks(7)
    assert pool.get_usage() == pytest.approx(1.0)
    pool.free_blocks(more)
    assert pool.get_usage() == pytest.approx(0.3)
    pool.free_blocks(blocks)
    assert pool.get_usage() == 0.0


# ---------------------------------------------------------------------------
# Caching full blocks
# ---------------------------------------------------------------------------
def test_cache_full_blocks_registers_each_full_block_under_its_hash():
    pool = make_pool(8)
    request, blocks = cached_request_blocks(pool, "r", list(range(40)))  # 2 full + 8 tokens
    assert [b.block_id for b in blocks] == [1, 2, 3]
    assert len(request.block_hashes) == 2
    for i in (0, 1):
        assert blocks[i].block_hash == make_block_hash_with_group_id(request.block_hashes[i], 0)
        assert pool.get_cached_block(request.block_hashes[i], [0]) == [blocks[i]]
    assert blocks[2].block_hash is None  # partial: not cached
    assert len(pool.cached_block_hash_to_block) == 2
    # Another group id is a different key: a miss.
    assert pool.get_cached_block(request.block_hashes[0], [1]) is None
    assert pool.get_cached_block(request.block_hashes[0], [0, 1]) is None
    assert_block_pool_consistent(pool)


def test_cache_full_blocks_is_incremental():
    pool = make_pool(8)
    request = make_request("r", list(range(48)))
    blocks = pool.get_new_blocks(3)
    pool.cache_full_blocks(request, blocks, 0, 1, BLOCK_SIZE, 0)
    assert [b.block_hash is not None for b in blocks] == [True, False, False]
    pool.cache_full_blocks(request, blocks, 1, 3, BLOCK_SIZE, 0)
    assert [b.block_hash is not None for b in blocks] == [True, True, True]
    assert len(pool.cached_block_hash_to_block) == 3
    # Nothing new to cache: a no-op (re-caching would raise on the hash setter).
    pool.cache_full_blocks(request, blocks, 3, 3, BLOCK_SIZE, 0)
    pool.cache_full_blocks(request, blocks, 3, 2, BLOCK_SIZE, 0)
    assert len(pool.cached_block_hash_to_block) == 3


def test_cache_full_blocks_needs_a_hash_per_full_block():
    pool = make_pool(8)
    request = make_request("r", list(range(20)))  # one hash
    blocks = pool.get_new_blocks(2)
    with pytest.raises(RuntimeError, match="2 full blocks but only 1 block hashes"):
        pool.cache_full_blocks(request, blocks, 0, 2, BLOCK_SIZE, 0)


def test_cache_full_blocks_rejects_a_block_size_that_is_not_a_multiple():
    pool = make_pool(8)  # hashes every 16 tokens
    request = make_request("r", list(range(48)))
    blocks = pool.get_new_blocks(2)
    with pytest.raises(ValueError, match="block_size 24 must be a multiple of hash_block_size 16"):
        pool.cache_full_blocks(request, blocks, 0, 2, 24, 0)
    assert len(pool.cached_block_hash_to_block) == 0


def test_cache_full_blocks_joins_fine_hashes_for_a_coarser_block_size():
    # Hashes every 4 tokens, blocks of 12 tokens: each block's key is its
    # three 4-token hashes joined, in order.
    pool = BlockPool(8, enable_caching=True, hash_block_size=4)
    request = make_request("r", list(range(100, 130)), block_size=4)  # 7 fine hashes
    fine = request.block_hashes
    blocks = pool.get_new_blocks(3)
    pool.cache_full_blocks(request, blocks, 0, 2, 12, 0)
    assert blocks[0].block_hash == make_block_hash_with_group_id(b"".join(fine[0:3]), 0)
    assert blocks[1].block_hash == make_block_hash_with_group_id(b"".join(fine[3:6]), 0)
    assert blocks[2].block_hash is None  # 30 tokens: only two full 12-token blocks
    assert pool.get_cached_block(b"".join(fine[3:6]), [0]) == [blocks[1]]


def test_cached_trace_event_names_the_hash_the_block_is_cached_under():
    events: list = []
    trace = KVCacheTrace(SimpleNamespace(record=events.append, full=False))
    pool = BlockPool(8, enable_caching=True, hash_block_size=4, trace=trace)
    request = make_request("r", list(range(24)), block_size=4)
    blocks = pool.get_new_blocks(2)
    pool.cache_full_blocks(request, blocks, 0, 2, 8, 0)
    cached = [e for e in events if isinstance(e, KVCached)]
    assert [e.block_hash for e in cached] == [
        (request.block_hashes[0] + request.block_hashes[1]).hex(),
        (request.block_hashes[2] + request.block_hashes[3]).hex(),
    ]


def test_cache_full_blocks_skips_null_blocks():
    pool = make_pool(4)
    request = make_request("r", list(range(32)))
    (b1,) = pool.get_new_blocks(1)
    pool.cache_full_blocks(request, [pool.null_block, b1], 0, 2, BLOCK_SIZE, 0)
    assert pool.null_block.block_hash is None
    assert b1.block_hash == make_block_hash_with_group_id(request.block_hashes[1], 0)
    assert pool.get_cached_block(request.block_hashes[0], [0]) is None


# ---------------------------------------------------------------------------
# Prefix hits: touch, and eviction on reuse
# ---------------------------------------------------------------------------
def test_freed_blocks_stay_cached_until_reused():
    pool = make_pool(6)
    request, blocks = cached_request_blocks(pool, "r", list(range(32)))
    pool.free_blocks(reversed(blocks))
    assert free_block_ids(pool) == [3, 4, 5, 2, 1]
    assert pool.get_cached_block(request.block_hashes[0], [0]) == [blocks[0]]
    assert pool.get_cached_block(request.block_hashes[1], [0]) == [blocks[1]]
    assert_block_pool_consistent(pool)


def test_touch_takes_a_free_cached_block_out_of_the_queue():
    pool = make_pool(6)
    request, (b1, b2) = cached_request_blocks(pool, "r", list(range(32)))
    pool.free_blocks([b2, b1])
    assert free_block_ids(pool) == [3, 4, 5, 2, 1]

    hit = pool.get_cached_block(request.block_hashes[0], [0])
    assert hit == [b1]
    pool.touch(hit)
    assert b1.ref_cnt == 1
    assert free_block_ids(pool) == [3, 4, 5, 2]
    assert pool.get_num_free_blocks() == 4
    # Still cached: touching is a hit, not an eviction.
    assert b1.block_hash is not None
    assert pool.get_cached_block(request.block_hashes[0], [0]) == [b1]
    assert_block_pool_consistent(pool)


def test_touch_of_an_in_use_block_only_adds_a_reference():
    pool = make_pool(6)
    _, (b1, b2) = cached_request_blocks(pool, "r", list(range(32)))
    pool.touch([b1, b2])
    pool.touch([b1])
    assert (b1.ref_cnt, b2.ref_cnt) == (3, 2)
    assert free_block_ids(pool) == [3, 4, 5]
    assert_block_pool_consistent(pool)


def test_reusing_a_cached_free_block_evicts_its_hash():
    pool = make_pool(3)  # 2 usable blocks
    request, (b1, b2) = cached_request_blocks(pool, "r", list(range(32)))
    pool.free_blocks([b2, b1])  # tail first, as a finished request frees
    assert free_block_ids(pool) == [2, 1]

    (reused,) = pool.get_new_blocks(1)
    assert reused is b2
    assert reused.block_hash is None
    assert reused.ref_cnt == 1
    assert pool.get_cached_block(request.block_hashes[1], [0]) is None
    # The other freed block is still a hit.
    assert pool.get_cached_block(request.block_hashes[0], [0]) == [b1]
    assert len(pool.cached_block_hash_to_block) == 1

    (reused,) = pool.get_new_blocks(1)
    assert reused is b1
    assert pool.get_cached_block(request.block_hashes[0], [0]) is None
    assert len(pool.cached_block_hash_to_block) == 0
    assert_block_pool_consistent(pool)


def test_evicting_one_of_two_blocks_under_one_hash_keeps_the_other():
    pool = make_pool(4)
    # Two requests computed the same 16 tokens independently (no hit between
    # them), so both blocks are cached under one hash.
    req_a, (a1,) = cached_request_blocks(pool, "a", list(range(16)))
    req_b, (b1,) = cached_request_blocks(pool, "b", list(range(16)))
    assert req_a.block_hashes == req_b.block_hashes
    assert len(pool.cached_block_hash_to_block) == 1
    assert pool.get_cached_block(req_a.block_hashes[0], [0]) == [a1]

    pool.free_blocks([a1])
    pool.free_blocks([b1])
    assert free_block_ids(pool) == [3, 1, 2]
    pool.get_new_blocks(2)  # 3, then 1: evicts a1's copy
    assert a1.block_hash is None
    assert pool.get_cached_block(req_a.block_hashes[0], [0]) == [b1]
    assert_block_pool_consistent(pool)


def test_get_new_blocks_without_caching_leaves_hashes_alone():
    pool = make_pool(3, enable_caching=False)
    block = pool.blocks[1]
    block.block_hash = key("x")  # set by hand; a no-cache pool never evicts
    (got,) = pool.get_new_blocks(1)
    assert got is block
    assert got.block_hash == key("x")


# ---------------------------------------------------------------------------
# BlockHashToBlockMap
# ---------------------------------------------------------------------------
def test_block_hash_to_block_map_single_block():
    cache = BlockHashToBlockMap()
    block = KVCacheBlock(block_id=1)
    assert cache.get_one_block(key("a")) is None
    assert len(cache) == 0 and key("a") not in cache

    cache.insert(key("a"), block)
    assert cache.get_one_block(key("a")) is block
    assert len(cache) == 1 and key("a") in cache
    assert cache.get_one_block(key("a", group_id=1)) is None

    assert cache.pop(key("a"), block_id=2) is None  # wrong block: nothing removed
    assert cache.get_one_block(key("a")) is block
    assert cache.pop(key("a"), block_id=1) is block
    assert len(cache) == 0 and cache.get_one_block(key("a")) is None
    assert cache.pop(key("a"), block_id=1) is None


def test_block_hash_to_block_map_duplicate_blocks_under_one_hash():
    cache = BlockHashToBlockMap()
    first, second, third = (
        KVCacheBlock(block_id=4),
        KVCacheBlock(block_id=9),
        KVCacheBlock(block_id=2),
    )
    cache.insert(key("a"), first)
    cache.insert(key("a"), second)
    cache.insert(key("b"), third)
    assert len(cache) == 2  # keys, not blocks
    # Any copy will do for a hit; the first one inserted is returned.
    assert cache.get_one_block(key("a")) is first

    assert cache.pop(key("a"), block_id=4) is first
    assert key("a") in cache
    assert cache.get_one_block(key("a")) is second
    assert cache.pop(key("a"), block_id=4) is None  # already gone
    assert cache.get_one_block(key("a")) is second

    assert cache.pop(key("a"), block_id=9) is second
    assert key("a") not in cache
    assert cache.get_one_block(key("b")) is third
    assert len(cache) == 1


def test_block_hash_to_block_map_pop_keeps_a_dict_entry_with_one_block_left():
    cache = BlockHashToBlockMap()
    first, second = KVCacheBlock(block_id=4), KVCacheBlock(block_id=9)
    cache.insert(key("a"), first)
    assert cache._cache[key("a")] is first  # one copy: stored bare
    cache.insert(key("a"), second)
    assert cache._cache[key("a")] == {4: first, 9: second}
    assert cache.pop(key("a"), block_id=4) is first
    # Once a dict, always a dict: it is not turned back into a bare block.
    assert cache._cache[key("a")] == {9: second}
    assert cache.pop(key("a"), block_id=9) is second
    assert key("a") not in cache._cache


def test_block_hash_to_block_map_three_copies():
    cache = BlockHashToBlockMap()
    blocks = [KVCacheBlock(block_id=i) for i in (1, 2, 3)]
    for block in blocks:
        cache.insert(key("a"), block)
    assert cache.pop(key("a"), block_id=2) is blocks[1]
    assert cache.get_one_block(key("a")) is blocks[0]
    assert cache.pop(key("a"), block_id=1) is blocks[0]
    assert cache.get_one_block(key("a")) is blocks[2]
    assert cache.pop(key("a"), block_id=3) is blocks[2]
    assert len(cache) == 0


# ---------------------------------------------------------------------------
# reset_prefix_cache
# ---------------------------------------------------------------------------
def test_reset_prefix_cache_refused_while_a_block_is_in_use():
    pool = make_pool(6)
    request, blocks = cached_request_blocks(pool, "r", list(range(48)))
    pool.free_blocks(reversed(blocks[1:]))  # block 1 still held
    assert not pool.reset_prefix_cache()
    assert len(pool.cached_block_hash_to_block) == 3
    assert all(b.block_hash is not None for b in blocks)


def test_reset_prefix_cache_when_every_block_is_free():
    pool = make_pool(6)
    request, blocks = cached_request_blocks(pool, "r", list(range(48)))
    pool.free_blocks(reversed(blocks))
    order = free_block_ids(pool)
    assert pool.reset_prefix_cache()
    assert len(pool.cached_block_hash_to_block) == 0
    assert all(b.block_hash is None for b in pool.blocks)
    for block_hash in request.block_hashes:
        assert pool.get_cached_block(block_hash, [0]) is None
    # The free queue itself is untouched.
    assert free_block_ids(pool) == order
    assert pool.get_num_free_blocks() == 5
    assert_block_pool_consistent(pool)


def test_reset_prefix_cache_on_a_fresh_pool():
    pool = make_pool(3)
    assert pool.reset_prefix_cache()
    assert pool.get_num_free_blocks() == 2
