"""Prefix caching through KVCacheManager (twin of vllm/tests/v1/core/test_prefix_caching.py).

Each test drives the manager the way the scheduler does: ``get_computed_blocks``
for a waiting request, then ``allocate_slots`` with the hit, then ``free``.
Block ids are exact: a fresh pool hands out ids 1, 2, 3, ... (0 is the null
block), and freed blocks return to the tail of the free queue, tail block first.
"""

from __future__ import annotations

import logging

import pytest

from engine.tracing.core_trace import KVCacheTrace
from engine.utils.hashing import sha256
from engine.v1.core.kv_cache_coordinator import get_kv_cache_coordinator
from engine.v1.core.kv_cache_manager import KVCacheBlocks, KVCacheManager
from engine.v1.core.kv_cache_utils import get_block_hash, get_group_id, hash_block_tokens
from engine.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec
from engine.v1.metrics.stats import PrefixCacheStats
from tests.helpers.core import (
    allocate_prompt,
    assert_block_pool_consistent,
    block_token_ids,
    free_block_ids,
    get_request_block_ids,
    make_kv_cache_config,
    make_kv_cache_manager,
    make_kv_cache_spec,
    make_request,
)

BLOCK_SIZE = 16


def ids(blocks: KVCacheBlocks | None) -> list[int]:
    assert blocks is not None, "allocation failed"
    return [b.block_id for b in blocks.blocks[0]]


def ref_cnts(manager: KVCacheManager, block_ids: list[int]) -> list[int]:
    return [manager.block_pool.blocks[i].ref_cnt for i in block_ids]


def num_cached_hashes(manager: KVCacheManager) -> int:
    return len(manager.block_pool.cached_block_hash_to_block)


# ---------------------------------------------------------------------------
# Hits, misses and what gets cached
# ---------------------------------------------------------------------------
def test_prefill_miss_then_hit_while_in_use_then_hit_after_free():
    manager = make_kv_cache_manager(num_blocks=11)  # 10 usable
    common = block_token_ids([10, 11, 12])  # 3 full blocks

    # A: 3 common blocks + 7 tokens. Cold cache: a miss.
    req_a = make_request("a", common + [1] * 7)
    hit, num_hit = manager.get_computed_blocks(req_a)
    assert (hit.blocks, num_hit) == (((),), 0)
    assert ids(manager.allocate_slots(req_a, 55)) == [1, 2, 3, 4]

    # The 3 full blocks are cached under the request's chained hashes; the
    # partial 4th is not.
    parent = None
    for i, block_id in enumerate([1, 2, 3]):
        block = manager.block_pool.blocks[block_id]
        parent = hash_block_tokens(sha256, parent, common[i * 16 : (i + 1) * 16])
        assert get_block_hash(block.block_hash) == parent == req_a.block_hashes[i]
        assert get_group_id(block.block_hash) == 0
    assert manager.block_pool.blocks[4].block_hash is None
    assert ref_cnts(manager, [1, 2, 3, 4]) == [1, 1, 1, 1]

    # B shares the 3 common blocks, which A still holds.
    req_b = make_request("b", common + [2] * 5)
    hit, num_hit = manager.get_computed_blocks(req_b)
    assert ids(hit) == [1, 2, 3] and num_hit == 48
    # The lookup alone takes no reference.
    assert ref_cnts(manager, [1, 2, 3]) == [1, 1, 1]
    assert ids(manager.allocate_slots(req_b, 5, 48, hit)) == [5]
    assert get_request_block_ids(manager, "b") == [1, 2, 3, 5]
    assert ref_cnts(manager, [1, 2, 3, 4, 5]) == [2, 2, 2, 1, 1]
    assert manager.block_pool.get_num_free_blocks() == 5

    manager.free(req_a)
    manager.free(req_b)
    assert manager.block_pool.get_num_free_blocks() == 10
    # Never-used blocks first, then A's private tail, then B's blocks tail first
    # (the shared ones only became free when B let go of them).
    assert free_block_ids(manager.block_pool) == [6, 7, 8, 9, 10, 4, 5, 3, 2, 1]

    # C hits the same 3 blocks although nobody holds them any more.
    req_c = make_request("c", common + [3] * 6)
    hit, num_hit = manager.get_computed_blocks(req_c)
    assert ids(hit) == [1, 2, 3] and num_hit == 48
    assert ids(manager.allocate_slots(req_c, 6, 48, hit)) == [6]
    assert free_block_ids(manager.block_pool) == [7, 8, 9, 10, 4, 5]
    assert manager.block_pool.get_num_free_blocks() == 6
    assert_block_pool_consistent(manager.block_pool)


def test_500_token_shared_prompt_hits_496_tokens():
    manager = make_kv_cache_manager(num_blocks=40, max_model_len=600)
    shared = [(7 * i + 3) % 1000 for i in range(500)]

    req_a = make_request("a", shared)
    new_blocks, num_hit = allocate_prompt(manager, req_a)
    assert num_hit == 0
    assert ids(new_blocks) == list(range(1, 33))  # cdiv(500, 16) = 32 blocks
    assert len(req_a.block_hashes) == 31  # 31 * 16 = 496; 4 tokens left over
    assert num_cached_hashes(manager) == 31

    req_b = make_request("b", shared + [5000 + i for i in range(20)])  # 520 tokens
    hit, num_hit = manager.get_computed_blocks(req_b)
    assert num_hit == 496
    assert ids(hit) == list(range(1, 32))
    # B's 32nd block mixes 4 shared tokens with 12 of its own: a miss.
    assert req_b.block_hashes[31] != req_a.block_hashes[-1]

    new_blocks = manager.allocate_slots(req_b, 520 - 496, 496, hit)
    assert ids(new_blocks) == [33, 34]  # cdiv(520, 16) - 31 = 2 new blocks
    assert ref_cnts(manager, list(range(1, 32))) == [2] * 31
    assert ref_cnts(manager, [32, 33, 34]) == [1, 1, 1]
    # B's 32nd block (tokens 496..511) is now full and cached too.
    assert num_cached_hashes(manager) == 32
    assert manager.block_pool.blocks[33].block_hash is not None
    assert manager.block_pool.blocks[34].block_hash is None
    assert_block_pool_consistent(manager.block_pool)


@pytest.mark.parametrize(
    ("prompt_len", "expected_hit"),
    [
        (15, 0),
        (16, 0),  # one block, but its last token must be recomputed
        (17, 16),
        (31, 16),
        (32, 16),  # the fully repeated 2-block prompt still recomputes block 2
        (33, 32),
        (48, 32),
        (49, 48),
    ],
)
def test_repeated_prompt_always_recomputes_its_last_token(prompt_len, expected_hit):
    manager = make_kv_cache_manager(num_blocks=20)
    prompt = list(range(100, 100 + prompt_len))
    allocate_prompt(manager, make_request("first", prompt))

    repeat = make_request("repeat", prompt)
    hit, num_hit = manager.get_computed_blocks(repeat)
    assert num_hit == expected_hit
    assert len(hit.blocks[0]) == expected_hit // 16
    # Something is always left to compute, so allocate_slots gets > 0 tokens.
    assert repeat.num_tokens - num_hit >= 1


def test_exact_repeat_of_a_32_token_prompt():
    manager = make_kv_cache_manager(num_blocks=11)
    prompt = list(range(32))
    req_a = make_request("a", prompt)
    assert ids(allocate_prompt(manager, req_a)[0]) == [1, 2]

    req_b = make_request("b", prompt)
    hit, num_hit = manager.get_computed_blocks(req_b)
    assert (ids(hit), num_hit) == ([1], 16)
    assert ids(manager.allocate_slots(req_b, 16, 16, hit)) == [3]
    assert get_request_block_ids(manager, "b") == [1, 3]
    # B recomputed block 2's tokens into its own block 3, which is cached under
    # the same hash as A's block 2: two copies of one prefix.
    block_2, block_3 = manager.block_pool.blocks[2], manager.block_pool.blocks[3]
    assert block_3.block_hash == block_2.block_hash is not None
    assert num_cached_hashes(manager) == 2
    assert ref_cnts(manager, [1, 2, 3]) == [2, 1, 1]

    # 33 tokens: now both full blocks may be hit.
    req_c = make_request("c", prompt + [99])
    hit, num_hit = manager.get_computed_blocks(req_c)
    assert num_hit == 32
    assert ids(hit)[0] == 1 and ids(hit)[1] in (2, 3)
    assert_block_pool_consistent(manager.block_pool)


def test_first_miss_ends_the_hit():
    manager = make_kv_cache_manager(num_blocks=11)
    allocate_prompt(manager, make_request("a", block_token_ids([1, 2, 3]) + [0]))
    # Block 0 matches, block 1 differs; block 2 holds A's block-2 tokens but
    # after a different prefix, so it is a miss as well.
    req_b = make_request("b", block_token_ids([1, 9, 3]) + [0])
    hit, num_hit = manager.get_computed_blocks(req_b)
    assert (ids(hit), num_hit) == ([1], 16)


def test_cache_salt_separates_otherwise_equal_prompts():
    manager = make_kv_cache_manager(num_blocks=20)
    prompt = block_token_ids([1, 2, 3]) + [4]
    allocate_prompt(manager, make_request("a", prompt, cache_salt="alice"))

    assert manager.get_computed_blocks(make_request("b", prompt))[1] == 0
    assert manager.get_computed_blocks(make_request("c", prompt, cache_salt="bob"))[1] == 0
    hit, num_hit = manager.get_computed_blocks(make_request("d", prompt, cache_salt="alice"))
    assert (ids(hit), num_hit) == ([1, 2, 3], 48)


def test_requests_with_prompt_logprobs_skip_reading_the_prefix_cache():
    """Cached prompt tokens are never run through the model, so they have no
    logprobs: SamplingParams sets skip_reading_prefix_cache when prompt_logprobs
    is requested, and the lookup must then report no hit (vLLM checks it in
    KVCacheManager.get_computed_blocks)."""
    manager = make_kv_cache_manager(num_blocks=20)
    prompt = block_token_ids([1, 2, 3]) + [4]
    allocate_prompt(manager, make_request("a", prompt))

    wants_logprobs = make_request("b", prompt, prompt_logprobs=1)
    assert wants_logprobs.sampling_params.skip_reading_prefix_cache is True
    hit, num_hit = manager.get_computed_blocks(wants_logprobs)
    assert num_hit == 0
    assert hit.blocks == ((),)


def test_skip_reading_prefix_cache_is_honoured_without_prompt_logprobs():
    manager = make_kv_cache_manager(num_blocks=20)
    prompt = block_token_ids([1, 2, 3]) + [4]
    allocate_prompt(manager, make_request("a", prompt))

    # Explicitly off: the normal hit.
    reads = make_request("b", prompt, skip_reading_prefix_cache=False)
    assert manager.get_computed_blocks(reads)[1] == 48
    # Explicitly on: no hit, although every block is cached.
    skips = make_request("c", prompt, skip_reading_prefix_cache=True)
    assert manager.get_computed_blocks(skips)[1] == 0


# ---------------------------------------------------------------------------
# Reference counts and shared prefixes
# ---------------------------------------------------------------------------
def test_ref_counts_across_three_requests_sharing_a_prefix():
    manager = make_kv_cache_manager(num_blocks=20)
    common = block_token_ids([5, 6])
    reqs = [make_request(f"r{i}", common + [100 + i] * 3) for i in range(3)]

    assert ids(allocate_prompt(manager, reqs[0])[0]) == [1, 2, 3]
    assert ref_cnts(manager, [1, 2]) == [1, 1]
    assert allocate_prompt(manager, reqs[1])[1] == 32
    assert ref_cnts(manager, [1, 2]) == [2, 2]
    assert allocate_prompt(manager, reqs[2])[1] == 32
    assert ref_cnts(manager, [1, 2]) == [3, 3]
    assert [get_request_block_ids(manager, r.request_id) for r in reqs] == [
        [1, 2, 3],
        [1, 2, 4],
        [1, 2, 5],
    ]
    assert ref_cnts(manager, [3, 4, 5]) == [1, 1, 1]
    assert manager.get_num_common_prefix_blocks("r0") == [2]

    manager.free(reqs[1])
    assert ref_cnts(manager, [1, 2, 4]) == [2, 2, 0]
    assert free_block_ids(manager.block_pool)[-1] == 4
    assert get_request_block_ids(manager, "r1") == []
    manager.free(reqs[0])
    assert ref_cnts(manager, [1, 2, 3]) == [1, 1, 0]
    # Shared blocks are not free while anyone holds them.
    assert 1 not in free_block_ids(manager.block_pool)
    manager.free(reqs[2])
    assert ref_cnts(manager, [1, 2, 5]) == [0, 0, 0]
    assert free_block_ids(manager.block_pool)[-5:] == [4, 3, 5, 2, 1]
    assert_block_pool_consistent(manager.block_pool)


def test_get_num_common_prefix_blocks():
    manager = make_kv_cache_manager(num_blocks=30)
    common = block_token_ids([1, 2, 3])
    req_a = make_request("a", common + [7] * 20)
    req_b = make_request("b", common[:32] + [8] * 20)  # shares 2 blocks with A
    allocate_prompt(manager, req_a)
    # Alone, every one of its 5 blocks (68 tokens, the partial one too) is common.
    assert manager.get_num_common_prefix_blocks("a") == [5]
    allocate_prompt(manager, req_b)
    assert manager.get_num_common_prefix_blocks("a") == [2]
    assert manager.get_num_common_prefix_blocks("b") == [2]

    # An unrelated request breaks the common prefix for everyone.
    req_c = make_request("c", [9] * 20)
    allocate_prompt(manager, req_c)
    assert manager.get_num_common_prefix_blocks("a") == [0]
    manager.free(req_c)
    assert manager.get_num_common_prefix_blocks("a") == [2]
    manager.free(req_b)
    assert manager.get_num_common_prefix_blocks("a") == [5]


def test_a_hit_is_adopted_before_new_blocks_are_popped():
    """The hit block sits at the head of the free queue; adopting it first
    keeps the new-block allocation from evicting it."""
    manager = make_kv_cache_manager(num_blocks=3)  # 2 usable
    req_a = make_request("a", list(range(16)))
    req_b = make_request("b", list(range(16, 32)))
    assert ids(allocate_prompt(manager, req_a)[0]) == [1]
    assert ids(allocate_prompt(manager, req_b)[0]) == [2]
    manager.free(req_a)
    manager.free(req_b)
    assert free_block_ids(manager.block_pool) == [1, 2]

    req_c = make_request("c", list(range(32)))  # A's block, then new tokens
    hit, num_hit = manager.get_computed_blocks(req_c)
    assert (ids(hit), num_hit) == ([1], 16)
    assert ids(manager.allocate_slots(req_c, 16, 16, hit)) == [2]
    assert get_request_block_ids(manager, "c") == [1, 2]
    assert free_block_ids(manager.block_pool) == []


def test_freeing_twice_or_freeing_an_unknown_request_is_a_no_op():
    manager = make_kv_cache_manager(num_blocks=6)
    req = make_request("a", list(range(40)))
    allocate_prompt(manager, req)
    manager.free(req)
    order = free_block_ids(manager.block_pool)
    assert order == [4, 5, 3, 2, 1]
    manager.free(req)
    manager.free(make_request("never-allocated", [1, 2, 3]))
    assert free_block_ids(manager.block_pool) == order
    assert ref_cnts(manager, [1, 2, 3]) == [0, 0, 0]
    assert_block_pool_consistent(manager.block_pool)


# ---------------------------------------------------------------------------
# Eviction
# ---------------------------------------------------------------------------
def test_eviction_order_after_frees():
    manager = make_kv_cache_manager(num_blocks=8)  # 7 usable: A takes 4, B takes 3
    pool = manager.block_pool
    req_a = make_request("a", list(range(0, 64)))
    req_b = make_request("b", list(range(1000, 1048)))
    assert ids(allocate_prompt(manager, req_a)[0]) == [1, 2, 3, 4]
    assert ids(allocate_prompt(manager, req_b)[0]) == [5, 6, 7]
    assert pool.get_num_free_blocks() == 0
    assert num_cached_hashes(manager) == 7

    manager.free(req_a)
    manager.free(req_b)
    # A's blocks tail first, then B's tail first.
    assert free_block_ids(pool) == [4, 3, 2, 1, 7, 6, 5]
    assert num_cached_hashes(manager) == 7  # freed, still cached

    # New, unrelated allocations take the queue's head and evict as they go.
    req_c = make_request("c", list(range(5000, 5032)))
    assert manager.get_computed_blocks(req_c)[1] == 0
    assert ids(manager.allocate_slots(req_c, 32)) == [4, 3]
    assert pool.get_cached_block(req_a.block_hashes[3], [0]) is None
    assert pool.get_cached_block(req_a.block_hashes[2], [0]) is None
    assert [b.block_id for b in pool.get_cached_block(req_a.block_hashes[0], [0])] == [1]
    assert free_block_ids(pool) == [2, 1, 7, 6, 5]

    # A's first two blocks survived the eviction: a new request still hits them.
    req_a2 = make_request("a2", list(range(0, 40)))
    hit, num_hit = manager.get_computed_blocks(req_a2)
    assert (ids(hit), num_hit) == ([1, 2], 32)

    req_d = make_request("d", list(range(9000, 9080)))  # 5 blocks: evicts the rest
    assert ids(manager.allocate_slots(req_d, 80)) == [2, 1, 7, 6, 5]
    for block_hash in [*req_a.block_hashes, *req_b.block_hashes]:
        assert pool.get_cached_block(block_hash, [0]) is None
    # What is cached now is exactly C's and D's full blocks.
    assert num_cached_hashes(manager) == 2 + 5
    assert_block_pool_consistent(pool)


def test_reused_block_loses_its_hash_even_when_left_partial():
    manager = make_kv_cache_manager(num_blocks=2)  # 1 usable block
    req_a = make_request("a", list(range(16)))
    allocate_prompt(manager, req_a)
    assert manager.block_pool.blocks[1].block_hash is not None
    manager.free(req_a)

    req_b = make_request("b", list(range(15)))  # same tokens, one short: no full block
    assert manager.get_computed_blocks(req_b)[1] == 0
    assert ids(manager.allocate_slots(req_b, 15)) == [1]
    assert manager.block_pool.blocks[1].block_hash is None
    assert num_cached_hashes(manager) == 0


# ---------------------------------------------------------------------------
# Free-block accounting of hits
# ---------------------------------------------------------------------------
def test_hit_on_free_cached_blocks_consumes_free_blocks():
    manager = make_kv_cache_manager(num_blocks=11)
    pool = manager.block_pool
    common = block_token_ids([1, 2, 3])
    req_a = make_request("a", common + [4] * 7)
    allocate_prompt(manager, req_a)
    manager.free(req_a)
    assert pool.get_num_free_blocks() == 10
    assert free_block_ids(pool) == [5, 6, 7, 8, 9, 10, 4, 3, 2, 1]

    req_b = make_request("b", common + [5] * 7)
    hit, num_hit = manager.get_computed_blocks(req_b)
    assert (ids(hit), num_hit) == ([1, 2, 3], 48)
    assert pool.get_num_free_blocks() == 10  # a lookup changes nothing
    assert ids(manager.allocate_slots(req_b, 7, 48, hit)) == [5]
    # 3 hit blocks left the free queue plus 1 new block.
    assert pool.get_num_free_blocks() == 6
    assert free_block_ids(pool) == [6, 7, 8, 9, 10, 4]
    assert ref_cnts(manager, [1, 2, 3, 5]) == [1, 1, 1, 1]
    assert manager.usage == pytest.approx(0.4)
    assert_block_pool_consistent(pool)


def test_allocation_fails_when_free_hits_plus_new_blocks_exceed_the_pool():
    manager = make_kv_cache_manager(num_blocks=8)  # 7 usable
    pool = manager.block_pool
    common = block_token_ids([1, 2, 3])
    req_a = make_request("a", common)
    assert ids(allocate_prompt(manager, req_a)[0]) == [1, 2, 3]
    manager.free(req_a)
    req_x = make_request("x", block_token_ids([7, 8, 9]))
    assert ids(allocate_prompt(manager, req_x)[0]) == [4, 5, 6]
    assert free_block_ids(pool) == [7, 3, 2, 1]

    # B = A's 3 cached (free) blocks + 2 new blocks. Only 2 blocks are new,
    # but adopting the 3 free hit blocks removes them from the pool as well:
    # 5 > 4 free, so the allocation must fail.
    req_b = make_request("b", common + block_token_ids([4, 5]))
    hit, num_hit = manager.get_computed_blocks(req_b)
    assert (ids(hit), num_hit) == ([1, 2, 3], 48)
    assert manager.allocate_slots(req_b, 32, 48, hit) is None

    # Nothing changed.
    assert free_block_ids(pool) == [7, 3, 2, 1]
    assert pool.get_num_free_blocks() == 4
    assert ref_cnts(manager, [1, 2, 3]) == [0, 0, 0]
    assert num_cached_hashes(manager) == 6
    assert get_request_block_ids(manager, "b") == []
    assert "b" not in manager.coordinator.single_type_managers[0].num_cached_block
    assert req_b.num_computed_tokens == 0
    assert_block_pool_consistent(pool)

    # Once X is gone there is room, and the hit is still there.
    manager.free(req_x)
    hit, num_hit = manager.get_computed_blocks(req_b)
    assert num_hit == 48
    assert ids(manager.allocate_slots(req_b, 32, 48, hit)) == [7, 6]
    assert get_request_block_ids(manager, "b") == [1, 2, 3, 7, 6]


def test_allocation_with_in_use_hits_needs_only_new_blocks():
    manager = make_kv_cache_manager(num_blocks=8)  # 7 usable
    common = block_token_ids([1, 2, 3])
    allocate_prompt(manager, make_request("a", common))  # holds 1, 2, 3
    allocate_prompt(manager, make_request("x", block_token_ids([7, 8])))  # 4, 5
    assert manager.block_pool.get_num_free_blocks() == 2

    # The 3 hit blocks are in use (not free): only the 2 new blocks count.
    req_b = make_request("b", common + block_token_ids([4, 5]))
    hit, num_hit = manager.get_computed_blocks(req_b)
    assert num_hit == 48
    assert ids(manager.allocate_slots(req_b, 32, 48, hit)) == [6, 7]
    assert ref_cnts(manager, [1, 2, 3]) == [2, 2, 2]
    # One more token would need a block: refused.
    req_c = make_request("c", common + block_token_ids([4, 5]) + [6])
    hit, num_hit = manager.get_computed_blocks(req_c)
    assert num_hit == 80
    assert manager.allocate_slots(req_c, 1, 80, hit) is None
    assert ref_cnts(manager, [1, 2, 3, 6, 7]) == [2, 2, 2, 1, 1]


def test_allocate_slots_without_a_hit_fails_cleanly():
    manager = make_kv_cache_manager(num_blocks=6)  # 5 usable
    allocate_prompt(manager, make_request("x", list(range(1000, 1020))))  # takes 1, 2
    req = make_request("a", list(range(64)))
    assert manager.allocate_slots(req, 49) is None  # needs 4 blocks, 3 free
    assert free_block_ids(manager.block_pool) == [3, 4, 5]
    assert get_request_block_ids(manager, "a") == []
    assert ids(manager.allocate_slots(req, 48)) == [3, 4, 5]
    assert_block_pool_consistent(manager.block_pool)


def test_allocate_slots_rejects_non_positive_token_counts():
    manager = make_kv_cache_manager(num_blocks=4)
    req = make_request("a", list(range(10)))
    with pytest.raises(ValueError, match="num_new_tokens must be greater than 0, got 0"):
        manager.allocate_slots(req, 0)


# ---------------------------------------------------------------------------
# Growing a running request: chunked prefill and decode
# ---------------------------------------------------------------------------
def test_chunked_prefill_caches_blocks_as_they_fill():
    manager = make_kv_cache_manager(num_blocks=11)
    req = make_request("a", list(range(100)))  # 6 full blocks + 4 tokens
    expected = [(40, [1, 2, 3], 2), (40, [4, 5], 5), (20, [6, 7], 6)]
    for chunk, new_ids, cached in expected:
        assert ids(manager.allocate_slots(req, chunk)) == new_ids
        req.num_computed_tokens += chunk
        assert num_cached_hashes(manager) == cached
    assert get_request_block_ids(manager, "a") == [1, 2, 3, 4, 5, 6, 7]
    hashed = [manager.block_pool.blocks[i].block_hash is not None for i in range(1, 8)]
    assert hashed == [True] * 6 + [False]


def test_decode_hashes_a_block_when_generated_tokens_fill_it():
    manager = make_kv_cache_manager(num_blocks=11)
    req = make_request("a", block_token_ids([1, 2, 3]) + [4] * 7)  # 55 tokens
    assert ids(allocate_prompt(manager, req)[0]) == [1, 2, 3, 4]
    assert num_cached_hashes(manager) == 3

    # Decode: each step appends the sampled token, then schedules it.
    new_block_steps = []
    for step in range(12):
        req.append_output_token_ids(50 + step)
        new_blocks = manager.allocate_slots(req, 1)
        assert new_blocks is not None
        if new_blocks.blocks[0]:
            new_block_steps.append((req.num_tokens, ids(new_blocks)))
        req.num_computed_tokens += 1
        if req.num_tokens == 63:
            assert manager.block_pool.blocks[4].block_hash is None
        if req.num_tokens == 64:
            # Block 4 (tokens 48..63) just filled: it is hashed and cached.
            assert manager.block_pool.blocks[4].block_hash is not None
            assert num_cached_hashes(manager) == 4
    # Token 65 is the first that needs a 5th block.
    assert new_block_steps == [(65, [5])]
    assert manager.block_pool.blocks[5].block_hash is None

    # A block filled by decode is a prefix hit for a later prompt.
    later = make_request("later", list(req.all_token_ids[:64]) + [999])
    hit, num_hit = manager.get_computed_blocks(later)
    assert (ids(hit), num_hit) == ([1, 2, 3, 4], 64)


def test_slots_are_capped_at_max_model_len():
    manager = make_kv_cache_manager(num_blocks=11, max_model_len=64)
    req = make_request("a", list(range(60)))
    assert ids(allocate_prompt(manager, req)[0]) == [1, 2, 3, 4]
    # 60 + 10 > 64: only up to max_model_len gets slots, which the 4 blocks hold.
    new_blocks = manager.allocate_slots(req, 10)
    assert new_blocks is not None and new_blocks.blocks[0] == ()
    assert get_request_block_ids(manager, "a") == [1, 2, 3, 4]


# ---------------------------------------------------------------------------
# Preemption: free, then resume from the cache
# ---------------------------------------------------------------------------
def test_preempted_request_resumes_from_its_own_cached_blocks():
    manager = make_kv_cache_manager(num_blocks=11)
    req = make_request("a", list(range(40)))
    allocate_prompt(manager, req)
    req.append_output_token_ids(list(range(40, 50)))  # 50 tokens, 3 full blocks
    manager.allocate_slots(req, 9)
    req.num_computed_tokens = 49

    # Preemption: blocks freed, cursor reset, the request waits again.
    manager.free(req)
    req.num_computed_tokens = 0
    req.num_preemptions += 1
    assert manager.usage == 0.0

    hit, num_hit = manager.get_computed_blocks(req)
    assert (ids(hit), num_hit) == ([1, 2, 3], 48)
    # Its freed partial block 4 went to the queue's tail, so the head (5) is next.
    assert ids(manager.allocate_slots(req, 2, 48, hit)) == [5]
    assert get_request_block_ids(manager, "a") == [1, 2, 3, 5]


# ---------------------------------------------------------------------------
# Prefix caching off, usage, stats, reset
# ---------------------------------------------------------------------------
def test_prefix_caching_disabled_never_hits_or_hashes():
    manager = make_kv_cache_manager(num_blocks=11, enable_caching=False)
    prompt = block_token_ids([1, 2, 3]) + [4]
    req_a = make_request("a", prompt)
    assert ids(allocate_prompt(manager, req_a)[0]) == [1, 2, 3, 4]
    assert num_cached_hashes(manager) == 0
    assert all(b.block_hash is None for b in manager.block_pool.blocks)

    req_b = make_request("b", prompt)
    assert manager.get_computed_blocks(req_b) == (manager.empty_kv_cache_blocks, 0)
    assert ids(allocate_prompt(manager, req_b)[0]) == [5, 6, 7, 8]
    manager.free(req_a)
    manager.free(req_b)
    req_c = make_request("c", prompt)
    assert manager.get_computed_blocks(req_c)[1] == 0
    assert num_cached_hashes(manager) == 0


def test_usage_tracks_blocks_in_use():
    manager = make_kv_cache_manager(num_blocks=11)  # 10 usable
    assert manager.usage == 0.0
    common = block_token_ids([1, 2, 3])
    req_a = make_request("a", common + [4] * 7)
    allocate_prompt(manager, req_a)
    assert manager.usage == pytest.approx(0.4)
    req_b = make_request("b", common + [5] * 7)
    allocate_prompt(manager, req_b)  # shares 3 blocks, adds 1
    assert manager.usage == pytest.approx(0.5)
    manager.free(req_a)
    assert manager.usage == pytest.approx(0.4)
    manager.free(req_b)
    # Cached-but-free blocks do not count as used.
    assert manager.usage == 0.0
    assert num_cached_hashes(manager) == 3


def test_prefix_cache_stats_count_tokens_and_keep_preempted_apart():
    manager = make_kv_cache_manager(num_blocks=20, log_stats=True)
    common = block_token_ids([1, 2, 3])
    req_a = make_request("a", common + [4] * 7)  # 55 tokens, miss
    allocate_prompt(manager, req_a)
    req_b = make_request("b", common + [5] * 5)  # 53 tokens, 48 hit
    allocate_prompt(manager, req_b)

    stats = manager.make_prefix_cache_stats()
    assert stats == PrefixCacheStats(requests=2, queries=108, hits=48)

    # The counters restart after each take.
    assert manager.make_prefix_cache_stats() == PrefixCacheStats()

    # A preempted request's re-lookup is counted apart.
    manager.free(req_b)
    req_b.num_computed_tokens = 0
    req_b.num_preemptions = 1
    manager.get_computed_blocks(req_b)
    req_c = make_request("c", common[:32] + [6])  # 33 tokens, 32 hit
    manager.get_computed_blocks(req_c)
    stats = manager.make_prefix_cache_stats()
    assert stats == PrefixCacheStats(
        requests=1,
        queries=33,
        hits=32,
        preempted_requests=1,
        preempted_queries=53,
        preempted_hits=48,
    )


def test_prefix_cache_stats_record_a_reset():
    manager = make_kv_cache_manager(num_blocks=11, log_stats=True)
    req = make_request("a", list(range(20)))
    allocate_prompt(manager, req)
    assert not manager.reset_prefix_cache()
    assert manager.make_prefix_cache_stats().reset is False
    manager.free(req)
    assert manager.reset_prefix_cache()
    assert manager.make_prefix_cache_stats().reset is True
    assert manager.make_prefix_cache_stats().reset is False


def test_prefix_cache_stats_disabled():
    manager = make_kv_cache_manager(num_blocks=11, log_stats=False)
    allocate_prompt(manager, make_request("a", list(range(20))))
    assert manager.prefix_cache_stats is None
    assert manager.make_prefix_cache_stats() is None


def test_reset_prefix_cache_through_the_manager():
    manager = make_kv_cache_manager(num_blocks=11)
    common = block_token_ids([1, 2, 3])
    req_a = make_request("a", common + [4] * 7)
    req_b = make_request("b", common + [5] * 7)
    allocate_prompt(manager, req_a)
    allocate_prompt(manager, req_b)
    assert not manager.reset_prefix_cache()
    assert num_cached_hashes(manager) == 3

    manager.free(req_a)
    manager.free(req_b)
    assert manager.reset_prefix_cache()
    assert num_cached_hashes(manager) == 0
    assert all(b.block_hash is None for b in manager.block_pool.blocks)
    assert manager.get_computed_blocks(make_request("c", common + [6]))[1] == 0


# ---------------------------------------------------------------------------
# KVCacheBlocks and construction
# ---------------------------------------------------------------------------
def test_kv_cache_blocks_helpers():
    manager = make_kv_cache_manager(num_blocks=11)
    req = make_request("a", list(range(40)))
    new_blocks, _ = allocate_prompt(manager, req)
    assert new_blocks.get_block_ids() == ([1, 2, 3],)
    assert new_blocks.get_unhashed_block_ids() == [3]
    assert manager.get_block_ids("a") == ([1, 2, 3],)

    empty = new_blocks.new_empty()
    assert empty.get_block_ids() == ([],)
    assert empty.get_block_ids(allow_none=True) is None
    assert new_blocks.get_block_ids(allow_none=True) == ([1, 2, 3],)
    assert (new_blocks + empty).get_block_ids() == ([1, 2, 3],)
    assert (empty + new_blocks + new_blocks).get_block_ids() == ([1, 2, 3, 1, 2, 3],)
    # A request without blocks: the shared empty value.
    assert manager.get_blocks("nobody") is manager.empty_kv_cache_blocks


def test_manager_from_a_real_kv_cache_config():
    config = make_kv_cache_config(num_blocks=9, max_model_len=128)
    manager = KVCacheManager(config, max_model_len=128, hash_block_size=BLOCK_SIZE)
    assert manager.block_pool.num_gpu_blocks == 9
    assert manager.block_pool.get_num_free_blocks() == 8
    assert manager.num_kv_cache_groups == 1
    assert manager.enable_caching is True


def test_more_than_one_kv_cache_group_is_rejected():
    spec = make_kv_cache_spec()
    config = KVCacheConfig(
        num_blocks=10,
        kv_cache_groups=[KVCacheGroupSpec(["layer.0"], spec), KVCacheGroupSpec(["layer.1"], spec)],
    )
    with pytest.raises(ValueError, match="exactly one KV cache group with prefix caching, got 2"):
        get_kv_cache_coordinator(
            config, max_model_len=64, use_eagle=False, enable_caching=True, hash_block_size=16
        )
    with pytest.raises(ValueError, match="exactly one KV cache group with prefix caching, got 2"):
        KVCacheManager(config, max_model_len=64, hash_block_size=BLOCK_SIZE)


# ---------------------------------------------------------------------------
# vLLM's constructor and allocate_slots options
# ---------------------------------------------------------------------------
def test_manager_takes_vllms_positional_order_and_a_keyword_only_trace():
    config = make_kv_cache_config(num_blocks=9, max_model_len=128)
    manager = KVCacheManager(config, 128, BLOCK_SIZE)
    assert manager.max_num_batched_tokens == 128  # defaults to max_model_len
    manager = KVCacheManager(config, 128, BLOCK_SIZE, 64, False, True, True)
    assert (manager.max_num_batched_tokens, manager.enable_caching) == (64, False)
    assert (manager.use_eagle, manager.log_stats) == (True, True)
    with pytest.raises(TypeError):
        KVCacheManager(config, 128, BLOCK_SIZE, 64, True, False, False, KVCacheTrace.NULL)


def test_hash_block_size_must_be_the_block_size_with_prefix_caching():
    config = make_kv_cache_config(num_blocks=9, max_model_len=128)
    with pytest.raises(
        ValueError,
        match="assumes hash_block_size == block_size, got hash_block_size=8, block_size=16",
    ):
        KVCacheManager(config, max_model_len=128, hash_block_size=8)
    # Without prefix caching no hash is ever read, so any value is accepted.
    KVCacheManager(config, max_model_len=128, hash_block_size=8, enable_caching=False)


@pytest.mark.parametrize(
    "prompt_len, hit_without_eagle, hit_with_eagle", [(67, 64, 48), (20, 16, 0), (10, 0, 0)]
)
def test_use_eagle_drops_the_last_hit_block(prompt_len, hit_without_eagle, hit_with_eagle):
    tokens = [7000 + i for i in range(prompt_len)]
    for use_eagle, expected in ((False, hit_without_eagle), (True, hit_with_eagle)):
        config = make_kv_cache_config(num_blocks=20, max_model_len=256)
        manager = KVCacheManager(config, 256, BLOCK_SIZE, use_eagle=use_eagle)
        allocate_prompt(manager, make_request("first", tokens))
        hit, num_hit_tokens = manager.get_computed_blocks(make_request("again", tokens))
        assert num_hit_tokens == expected
        assert len(hit.blocks[0]) == expected // BLOCK_SIZE


def test_lookahead_slots_are_allocated_but_never_cached():
    manager = make_kv_cache_manager(num_blocks=10, max_model_len=144)
    req = make_request("a", list(range(30)))
    # 30 tokens + 5 draft slots = 35 slots: 3 blocks, of which 1 is full of real tokens.
    new_blocks = manager.allocate_slots(req, 30, num_lookahead_tokens=5)
    assert ids(new_blocks) == [1, 2, 3]
    assert [manager.block_pool.blocks[i].block_hash is not None for i in (1, 2, 3)] == [
        True,
        False,
        False,
    ]
    # The draft slots never push the table past max_model_len (9 blocks).
    long_req = make_request("b", list(range(140)))
    manager.free(req)
    assert len(ids(manager.allocate_slots(long_req, 140, num_lookahead_tokens=10))) == 9


def test_full_sequence_must_fit_gates_on_the_whole_prompt():
    # 7 usable blocks; "holder" keeps 3 of them, so 4 are free.
    manager = make_kv_cache_manager(num_blocks=8, max_model_len=112)
    shared = block_token_ids([1, 2])
    holder = make_request("holder", shared + list(range(10)))
    allocate_prompt(manager, holder)
    assert manager.block_pool.get_num_free_blocks() == 4

    # 96 tokens = 6 blocks. Its first 16-token chunk fits, the whole prompt does not.
    newcomer = make_request("newcomer", list(range(5000, 5096)))
    assert manager.allocate_slots(newcomer, 16, full_sequence_must_fit=True) is None
    assert manager.block_pool.get_num_free_blocks() == 4
    assert get_request_block_ids(manager, "newcomer") == []
    assert ids(manager.allocate_slots(newcomer, 16)) == [4]
    manager.free(newcomer)

    # A prefix hit on blocks already in use costs nothing: 2 hit + 4 new = 6 blocks.
    sharer = make_request("sharer", shared + list(range(9000, 9064)))
    hit, num_hit_tokens = manager.get_computed_blocks(sharer)
    assert num_hit_tokens == 32
    new_blocks = manager.allocate_slots(
        sharer, 16, num_hit_tokens, hit, full_sequence_must_fit=True
    )
    assert new_blocks is not None and len(ids(new_blocks)) == 1


def test_without_prefix_caching_no_block_is_a_common_prefix():
    manager = make_kv_cache_manager(num_blocks=10, enable_caching=False)
    allocate_prompt(manager, make_request("only", list(range(40))))
    # One request holding 3 blocks: with caching they would all count.
    assert manager.get_num_common_prefix_blocks("only") == [0]
    with_cache = make_kv_cache_manager(num_blocks=10)
    allocate_prompt(with_cache, make_request("only", list(range(40))))
    assert with_cache.get_num_common_prefix_blocks("only") == [3]


def test_reset_prefix_cache_logs_why_it_failed(caplog):
    manager = make_kv_cache_manager(num_blocks=10)
    req = make_request("a", list(range(40)))
    allocate_prompt(manager, req)
    with caplog.at_level(logging.INFO, logger="engine.v1.core.block_pool"):
        assert manager.reset_prefix_cache() is False
        manager.free(req)
        assert manager.reset_prefix_cache() is True
    messages = [r.getMessage() for r in caplog.records]
    assert messages == [
        "Failed to reset prefix cache because some blocks (3) are not freed yet",
        "Successfully reset prefix cache",
    ]
