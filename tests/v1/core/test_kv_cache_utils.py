"""Tests for engine/v1/core/kv_cache_utils.py (twin of vllm/v1/core/kv_cache_utils.py).

Covers the free-block queue, block hashing (chaining, determinism, salts,
the NONE_HASH seed), the KV cache specs, and how get_kv_cache_configs sizes
the pool.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest

import engine.v1.core.kv_cache_utils as kv_cache_utils
from engine.config import CacheConfig, GlassboxConfig
from engine.utils.hashing import get_hash_fn_by_name, sha256
from engine.v1.core.kv_cache_utils import (
    BlockHashListWithBlockSize,
    FreeKVCacheBlockQueue,
    KVCacheBlock,
    check_enough_kv_cache_memory,
    estimate_max_model_len,
    generate_block_hash_extra_keys,
    generate_scheduler_kv_cache_config,
    get_block_hash,
    get_group_id,
    get_kv_cache_config_from_groups,
    get_kv_cache_configs,
    get_kv_cache_groups,
    get_max_concurrency_for_kv_cache_config,
    get_num_blocks,
    get_request_block_hasher,
    hash_block_tokens,
    init_none_hash,
    is_kv_cache_spec_uniform,
    make_block_hash_with_group_id,
    resolve_kv_cache_block_sizes,
)
from engine.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    UniformTypeKVCacheSpecs,
)
from tests.helpers.core import make_kv_cache_spec, make_model_config, make_request

REPO_ROOT = Path(__file__).resolve().parents[3]


@pytest.fixture
def restore_none_hash():
    """Tests that re-seed NONE_HASH put the process-wide value back afterwards."""
    saved = kv_cache_utils.NONE_HASH
    yield
    kv_cache_utils.NONE_HASH = saved


def queue_ids(queue: FreeKVCacheBlockQueue) -> list[int]:
    return [b.block_id for b in queue.get_all_free_blocks()]


def assert_queue_links(queue: FreeKVCacheBlockQueue, expected_ids: list[int]) -> None:
    """The list holds exactly expected_ids, walked both ways, with a matching count."""
    forward, block = [], queue.fake_free_list_head.next_free_block
    while block is not queue.fake_free_list_tail:
        assert block is not None, "forward walk fell off the list before the tail sentinel"
        forward.append(block.block_id)
        block = block.next_free_block
    backward, block = [], queue.fake_free_list_tail.prev_free_block
    while block is not queue.fake_free_list_head:
        assert block is not None, "backward walk fell off the list before the head sentinel"
        backward.append(block.block_id)
        block = block.prev_free_block
    assert forward == expected_ids
    assert backward == expected_ids[::-1]
    assert queue.num_free_blocks == len(expected_ids)
    assert queue_ids(queue) == expected_ids


def make_blocks(n: int) -> list[KVCacheBlock]:
    return [KVCacheBlock(block_id=i) for i in range(n)]


# ---------------------------------------------------------------------------
# KVCacheBlock and hash keys
# ---------------------------------------------------------------------------
def test_kv_cache_block_defaults_and_single_hash():
    block = KVCacheBlock(block_id=7)
    assert (block.ref_cnt, block.block_hash, block.is_null) == (0, None, False)
    assert block.prev_free_block is None and block.next_free_block is None

    key = make_block_hash_with_group_id(sha256("x"), 0)
    block.block_hash = key
    assert block.block_hash == key
    # A cached block must be evicted (reset) before it can take another hash.
    with pytest.raises(RuntimeError, match="block 7"):
        block.block_hash = make_block_hash_with_group_id(sha256("y"), 0)
    assert block.block_hash == key
    block.reset_hash()
    assert block.block_hash is None
    block.block_hash = make_block_hash_with_group_id(sha256("y"), 0)


@pytest.mark.parametrize("group_id", [0, 1, 255, 2**32 - 1])
def test_block_hash_with_group_id_round_trip(group_id):
    block_hash = sha256("tokens")
    key = make_block_hash_with_group_id(block_hash, group_id)
    assert len(key) == len(block_hash) + 4
    assert get_block_hash(key) == block_hash
    assert get_group_id(key) == group_id


def test_same_hash_different_groups_are_different_keys():
    block_hash = sha256("tokens")
    assert make_block_hash_with_group_id(block_hash, 0) != make_block_hash_with_group_id(
        block_hash, 1
    )


# ---------------------------------------------------------------------------
# FreeKVCacheBlockQueue
# ---------------------------------------------------------------------------
def test_free_queue_initial_order_is_by_block_id():
    blocks = make_blocks(5)
    queue = FreeKVCacheBlockQueue(blocks)
    assert_queue_links(queue, [0, 1, 2, 3, 4])
    assert queue.fake_free_list_head.next_free_block is blocks[0]
    assert queue.fake_free_list_tail.prev_free_block is blocks[4]
    assert blocks[0].prev_free_block is queue.fake_free_list_head
    assert blocks[4].next_free_block is queue.fake_free_list_tail
    for left, right in zip(blocks, blocks[1:]):
        assert left.next_free_block is right and right.prev_free_block is left


def test_free_queue_empty_at_construction():
    queue = FreeKVCacheBlockQueue([])
    assert_queue_links(queue, [])
    assert queue.fake_free_list_head.next_free_block is queue.fake_free_list_tail
    with pytest.raises(ValueError, match="^No free blocks available$"):
        queue.popleft()


def test_free_queue_popleft_unlinks_the_head():
    blocks = make_blocks(4)
    queue = FreeKVCacheBlockQueue(blocks)
    popped = queue.popleft()
    assert popped is blocks[0]
    assert popped.prev_free_block is None and popped.next_free_block is None
    assert queue.fake_free_list_head.next_free_block is blocks[1]
    assert blocks[1].prev_free_block is queue.fake_free_list_head
    assert_queue_links(queue, [1, 2, 3])


def test_free_queue_popleft_until_empty_then_error():
    queue = FreeKVCacheBlockQueue(make_blocks(3))
    assert [queue.popleft().block_id for _ in range(3)] == [0, 1, 2]
    assert_queue_links(queue, [])
    with pytest.raises(ValueError, match="^No free blocks available$"):
        queue.popleft()
    assert queue.num_free_blocks == 0


def test_free_queue_popleft_n():
    blocks = make_blocks(6)
    queue = FreeKVCacheBlockQueue(blocks)
    assert queue.popleft_n(0) == []
    assert_queue_links(queue, [0, 1, 2, 3, 4, 5])

    popped = queue.popleft_n(4)
    assert [b.block_id for b in popped] == [0, 1, 2, 3]
    assert all(b.prev_free_block is None and b.next_free_block is None for b in popped)
    assert_queue_links(queue, [4, 5])

    with pytest.raises(ValueError, match="Cannot pop 3 blocks: only 2 are free"):
        queue.popleft_n(3)
    # A refused request takes nothing.
    assert_queue_links(queue, [4, 5])

    assert [b.block_id for b in queue.popleft_n(2)] == [4, 5]
    assert_queue_links(queue, [])


def test_free_queue_remove_from_middle_head_and_tail():
    blocks = make_blocks(5)
    queue = FreeKVCacheBlockQueue(blocks)

    queue.remove(blocks[2])
    assert blocks[2].prev_free_block is None and blocks[2].next_free_block is None
    assert blocks[1].next_free_block is blocks[3]
    assert blocks[3].prev_free_block is blocks[1]
    assert_queue_links(queue, [0, 1, 3, 4])

    queue.remove(blocks[0])  # the head
    assert queue.fake_free_list_head.next_free_block is blocks[1]
    assert_queue_links(queue, [1, 3, 4])

    queue.remove(blocks[4])  # the tail
    assert queue.fake_free_list_tail.prev_free_block is blocks[3]
    assert_queue_links(queue, [1, 3])

    assert queue.popleft() is blocks[1]
    assert_queue_links(queue, [3])


def test_free_queue_remove_touches_only_the_neighbours():
    """O(1) removal: only the removed block and its two neighbours change links."""
    blocks = make_blocks(50)
    queue = FreeKVCacheBlockQueue(blocks)
    before = {b.block_id: (b.prev_free_block, b.next_free_block) for b in blocks}

    queue.remove(blocks[25])

    changed = {
        b.block_id for b in blocks if (b.prev_free_block, b.next_free_block) != before[b.block_id]
    }
    assert changed == {24, 25, 26}
    assert blocks[24].next_free_block is blocks[26]
    assert blocks[26].prev_free_block is blocks[24]
    assert_queue_links(queue, [i for i in range(50) if i != 25])


def test_free_queue_remove_block_not_in_queue_raises():
    blocks = make_blocks(3)
    queue = FreeKVCacheBlockQueue(blocks)
    popped = queue.popleft()
    with pytest.raises(RuntimeError, match=r"^remove\(\) called on an invalid block"):
        queue.remove(popped)
    assert_queue_links(queue, [1, 2])


def test_free_queue_append_goes_to_tail():
    blocks = make_blocks(4)
    queue = FreeKVCacheBlockQueue(blocks)
    b0, b1 = queue.popleft(), queue.popleft()
    queue.append(b0)
    assert_queue_links(queue, [2, 3, 0])
    assert queue.fake_free_list_tail.prev_free_block is b0
    assert b0.next_free_block is queue.fake_free_list_tail
    queue.append(b1)
    assert_queue_links(queue, [2, 3, 0, 1])


def test_free_queue_append_into_empty_queue():
    blocks = make_blocks(2)
    queue = FreeKVCacheBlockQueue(blocks)
    queue.popleft_n(2)
    queue.append(blocks[1])
    assert_queue_links(queue, [1])
    assert queue.fake_free_list_head.next_free_block is blocks[1]
    assert queue.popleft() is blocks[1]
    assert_queue_links(queue, [])


def test_free_queue_append_n_keeps_given_order():
    blocks = make_blocks(6)
    queue = FreeKVCacheBlockQueue(blocks)
    taken = queue.popleft_n(4)  # 0, 1, 2, 3
    queue.append_n([taken[3], taken[1], taken[2]])
    assert_queue_links(queue, [4, 5, 3, 1, 2])
    queue.append_n([])
    assert_queue_links(queue, [4, 5, 3, 1, 2])
    queue.append_n([taken[0]])
    assert_queue_links(queue, [4, 5, 3, 1, 2, 0])


def test_free_queue_append_of_a_free_block_raises():
    blocks = make_blocks(3)
    queue = FreeKVCacheBlockQueue(blocks)
    with pytest.raises(RuntimeError, match="block 1 is already in the free queue"):
        queue.append(blocks[1])
    assert_queue_links(queue, [0, 1, 2])


def test_free_queue_rejected_append_n_leaves_queue_unchanged():
    """append_n validates its blocks; a rejected call must not half-link the batch.

    Block 0 is out of the queue, block 2 is still in it: the call raises, and
    the queue must still be exactly [1, 2] with block 0 unlinked (so it can be
    appended properly afterwards).
    """
    blocks = make_blocks(3)
    queue = FreeKVCacheBlockQueue(blocks)
    b0 = queue.popleft()
    with pytest.raises(RuntimeError, match="block 2 is already in the free queue"):
        queue.append_n([b0, blocks[2]])
    assert b0.prev_free_block is None and b0.next_free_block is None
    assert_queue_links(queue, [1, 2])


def test_free_queue_get_all_free_blocks_returns_blocks_head_to_tail():
    blocks = make_blocks(4)
    queue = FreeKVCacheBlockQueue(blocks)
    assert queue.get_all_free_blocks() == blocks
    queue.remove(blocks[1])
    queue.append(blocks[1])
    assert queue.get_all_free_blocks() == [blocks[0], blocks[2], blocks[3], blocks[1]]
    # A snapshot: walking it does not change the queue.
    assert queue.num_free_blocks == 4


@pytest.mark.parametrize("seed", range(5))
def test_free_queue_matches_a_list_model_under_random_operations(seed):
    rng = random.Random(seed)
    blocks = make_blocks(30)
    queue = FreeKVCacheBlockQueue(blocks)
    model = list(range(30))  # ids in queue order
    out: list[int] = []  # ids not in the queue
    for _ in range(300):
        op = rng.choice(["popleft", "popleft_n", "remove", "append", "append_n"])
        if op == "popleft" and model:
            popped = queue.popleft().block_id
            assert popped == model.pop(0)
            out.append(popped)
        elif op == "popleft_n" and model:
            n = rng.randint(0, min(4, len(model)))
            got = [b.block_id for b in queue.popleft_n(n)]
            assert got == model[:n]
            del model[:n]
            out.extend(got)
        elif op == "remove" and model:
            victim = rng.choice(model)
            queue.remove(blocks[victim])
            model.remove(victim)
            out.append(victim)
        elif op == "append" and out:
            back = out.pop(rng.randrange(len(out)))
            queue.append(blocks[back])
            model.append(back)
        elif op == "append_n" and out:
            rng.shuffle(out)
            k = rng.randint(0, len(out))
            batch, out[:] = out[:k], out[k:]
            queue.append_n([blocks[i] for i in batch])
            model.extend(batch)
        assert_queue_links(queue, model)


# ---------------------------------------------------------------------------
# Block hashing
# ---------------------------------------------------------------------------
def test_hash_block_tokens_chains_on_the_parent():
    tokens = list(range(16))
    first = hash_block_tokens(sha256, None, tokens)
    assert first == sha256((kv_cache_utils.NONE_HASH, tuple(tokens), None))
    # An empty parent means "no parent" too.
    assert hash_block_tokens(sha256, kv_cache_utils.NONE_HASH, tokens) == first

    child = hash_block_tokens(sha256, first, tokens)
    assert child == sha256((first, tuple(tokens), None))
    assert child != first  # same tokens, different parent
    # Extra keys are part of the hash.
    assert hash_block_tokens(sha256, None, tokens, ("salt",)) != first
    # A list and a tuple of the same tokens hash the same.
    assert hash_block_tokens(sha256, first, tuple(tokens)) == child


def test_request_hashes_only_full_blocks():
    for num_tokens, expected_num_hashes in [(1, 0), (15, 0), (16, 1), (17, 1), (47, 2), (48, 3)]:
        request = make_request("r", list(range(num_tokens)), block_size=16)
        assert len(request.block_hashes) == expected_num_hashes, num_tokens


def test_request_block_hashes_are_the_manual_chain():
    tokens = list(range(100, 150))  # 3 full blocks of 16 + 2 tokens
    request = make_request("r", tokens, block_size=16)
    parent = None
    expected = []
    for start in (0, 16, 32):
        parent = hash_block_tokens(sha256, parent, tokens[start : start + 16])
        expected.append(parent)
    assert request.block_hashes == expected


def test_same_block_tokens_after_a_different_prefix_hash_differently():
    shared_block = [7] * 16
    a = make_request("a", [1] * 16 + shared_block)
    b = make_request("b", [2] * 16 + shared_block)
    c = make_request("c", [1] * 16 + shared_block + [9])
    assert a.block_hashes[0] != b.block_hashes[0]
    # Block 1 holds identical tokens in a and b, but its prefix differs.
    assert a.block_hashes[1] != b.block_hashes[1]
    # Same prefix -> same hashes, whatever follows the last full block.
    assert c.block_hashes == a.block_hashes


def test_block_size_changes_the_hashes():
    tokens = list(range(64))
    by_16 = make_request("a", tokens, block_size=16).block_hashes
    by_32 = make_request("b", tokens, block_size=32).block_hashes
    assert len(by_16) == 4 and len(by_32) == 2
    assert not set(by_16) & set(by_32)


def test_block_hashes_extend_as_output_tokens_arrive():
    request = make_request("r", list(range(30)), block_size=16)
    assert len(request.block_hashes) == 1
    first = request.block_hashes[0]

    request.append_output_token_ids(30)  # 31 tokens: block 1 still partial
    assert request.block_hashes == [first]
    request.append_output_token_ids(31)  # 32 tokens: block 1 full
    assert len(request.block_hashes) == 2
    assert request.block_hashes[0] == first
    request.append_output_token_ids(list(range(32, 50)))  # 50 tokens: 3 full blocks
    assert len(request.block_hashes) == 3

    # A block filled by generated tokens hashes exactly like the same tokens
    # arriving in a prompt, so a later prompt can hit it.
    assert make_request("p", list(range(50))).block_hashes == request.block_hashes


def test_block_hasher_called_repeatedly_returns_only_new_hashes():
    request = make_request("r", list(range(40)), block_size=16)
    hasher = get_request_block_hasher(16, sha256)
    assert hasher(request) == []  # both full blocks were hashed at construction


def test_request_without_hasher_has_no_block_hashes():
    request = make_request("r", list(range(40)), hash_blocks=False)
    assert request.block_hashes == []
    request.append_output_token_ids([1] * 30)
    assert request.block_hashes == []


def test_cache_salt_is_an_extra_key_of_the_first_block_only():
    salted = make_request("s", list(range(40)), cache_salt="tenant-a")
    plain = make_request("p", list(range(40)))
    # The second value is the next multimodal input to look at: with no
    # multimodal inputs, whatever was passed in.
    assert generate_block_hash_extra_keys(salted, 0, 16, 0) == (("tenant-a",), 0)
    assert generate_block_hash_extra_keys(salted, 16, 32, 0) == (None, 0)
    assert generate_block_hash_extra_keys(plain, 0, 16, 3) == (None, 3)


def test_cache_salt_changes_every_block_hash():
    tokens = list(range(64))
    plain = make_request("p", tokens).block_hashes
    salt_a = make_request("a", tokens, cache_salt="tenant-a").block_hashes
    salt_a_again = make_request("a2", tokens, cache_salt="tenant-a").block_hashes
    salt_b = make_request("b", tokens, cache_salt="tenant-b").block_hashes
    assert len(plain) == len(salt_a) == len(salt_b) == 4
    # The salt only enters block 0, but the chain carries it into every block.
    for i in range(4):
        assert len({plain[i], salt_a[i], salt_b[i]}) == 3, i
    assert salt_a == salt_a_again
    assert salt_a[0] == hash_block_tokens(sha256, None, tokens[:16], ("tenant-a",))


def test_init_none_hash_uses_pythonhashseed(monkeypatch, restore_none_hash):
    monkeypatch.setenv("PYTHONHASHSEED", "1234")
    init_none_hash(sha256)
    assert kv_cache_utils.NONE_HASH == sha256("1234")
    seeded = make_request("r", list(range(32))).block_hashes

    monkeypatch.setenv("PYTHONHASHSEED", "5678")
    init_none_hash(sha256)
    assert kv_cache_utils.NONE_HASH == sha256("5678")
    assert make_request("r", list(range(32))).block_hashes[0] != seeded[0]

    # Unset (or empty): a fixed default, not a random one, so runs agree.
    monkeypatch.delenv("PYTHONHASHSEED")
    init_none_hash(sha256)
    assert kv_cache_utils.NONE_HASH == sha256("glassbox")
    monkeypatch.setenv("PYTHONHASHSEED", "")
    init_none_hash(sha256)
    assert kv_cache_utils.NONE_HASH == sha256("glassbox")

    # Same seed -> the same hashes again.
    monkeypatch.setenv("PYTHONHASHSEED", "1234")
    init_none_hash(sha256)
    assert make_request("r", list(range(32))).block_hashes == seeded


_CHILD_SCRIPT = """
import json
from engine.sampling_params import SamplingParams
from engine.utils.hashing import sha256
from engine.v1.core.kv_cache_utils import get_request_block_hasher
from engine.v1.request import Request
hashes = {}
for salt in (None, "tenant-a"):
    request = Request(
        request_id="child",
        prompt_token_ids=list(range(1000, 1070)),
        sampling_params=SamplingParams(max_tokens=8),
        cache_salt=salt,
        block_hasher=get_request_block_hasher(16, sha256),
    )
    request.append_output_token_ids([5, 6])
    hashes[str(salt)] = [h.hex() for h in request.block_hashes]
print(json.dumps(hashes))
"""


def _hashes_in_child(pythonhashseed: str | None) -> dict[str, list[str]]:
    env = dict(os.environ)
    env.pop("PYTHONHASHSEED", None)
    if pythonhashseed is not None:
        env["PYTHONHASHSEED"] = pythonhashseed
    result = subprocess.run(
        [sys.executable, "-c", _CHILD_SCRIPT],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout.strip().splitlines()[-1])


def _hashes_here() -> dict[str, list[str]]:
    hashes = {}
    for salt in (None, "tenant-a"):
        request = make_request("parent", list(range(1000, 1070)), max_tokens=8, cache_salt=salt)
        request.append_output_token_ids([5, 6])
        hashes[str(salt)] = [h.hex() for h in request.block_hashes]
    return hashes


def test_block_hashes_are_identical_in_another_process(monkeypatch, restore_none_hash):
    """sha256 over pickle, seeded by a fixed default: no dependence on Python's
    per-process randomised hash(). The child runs with PYTHONHASHSEED unset, so
    its str hashes are randomised, yet every block hash must match ours."""
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    init_none_hash(sha256)
    here = _hashes_here()
    assert [len(v) for v in here.values()] == [4, 4]  # 72 tokens -> 4 full blocks

    child = _hashes_in_child(None)
    assert child == here


def test_block_hashes_follow_pythonhashseed_in_another_process(monkeypatch, restore_none_hash):
    monkeypatch.setenv("PYTHONHASHSEED", "42")
    init_none_hash(sha256)
    here_42 = _hashes_here()
    monkeypatch.delenv("PYTHONHASHSEED")
    init_none_hash(sha256)
    here_default = _hashes_here()

    child_42 = _hashes_in_child("42")
    assert child_42 == here_42
    assert child_42["None"][0] != here_default["None"][0]


def test_append_n_checks_the_tail_sentinel_first():
    # vLLM's order: an empty batch is a no-op, then a queue whose tail
    # sentinel lost its link is an AssertionError -- before any check of the
    # blocks themselves (block 0 below is still linked into another queue).
    elsewhere = make_blocks(2)
    FreeKVCacheBlockQueue(elsewhere)
    broken = FreeKVCacheBlockQueue([])
    broken.fake_free_list_tail.prev_free_block = None
    broken.append_n([])
    with pytest.raises(AssertionError, match="fake_free_list_tail should always exist"):
        broken.append_n([elsewhere[0]])
    assert broken.num_free_blocks == 0
    assert broken.fake_free_list_head.next_free_block is broken.fake_free_list_tail


def test_get_hash_fn_by_name():
    assert get_hash_fn_by_name("sha256") is sha256
    with pytest.raises(ValueError, match="Unsupported hash function: sha256_cbor"):
        get_hash_fn_by_name("sha256_cbor")


def test_block_hash_list_with_block_size_joins_consecutive_hashes():
    fine = [b"a", b"b", b"c", b"d", b"e"]
    coarse = BlockHashListWithBlockSize(fine, hash_block_size=4, target_block_size=8)
    assert len(coarse) == 2  # the fifth fine hash does not fill a coarse block
    assert (coarse[0], coarse[1], coarse[-1]) == (b"ab", b"cd", b"cd")
    assert coarse[1:] == [b"cd"]
    assert list(coarse) == [b"ab", b"cd"]
    with pytest.raises(IndexError):
        coarse[2]
    with pytest.raises(ValueError, match="block_size 6 must be a multiple of hash_block_size 4"):
        BlockHashListWithBlockSize(fine, hash_block_size=4, target_block_size=6)


# ---------------------------------------------------------------------------
# KV cache specs and pool sizing
# ---------------------------------------------------------------------------
def make_config(
    max_model_len: int, num_gpu_blocks_override: int | None = None, block_size: int = 16
) -> GlassboxConfig:
    return GlassboxConfig(
        model_config=make_model_config(max_model_len),
        cache_config=CacheConfig(
            block_size=block_size, num_gpu_blocks_override=num_gpu_blocks_override
        ),
    )


def test_full_attention_page_size_bytes():
    # K and V pages: 2 * block_size * num_kv_heads * head_size * dtype bytes.
    assert make_kv_cache_spec(block_size=16, num_kv_heads=1, head_size=8).page_size_bytes == 1024
    bf16 = FullAttentionSpec(block_size=16, num_kv_heads=8, head_size=128, dtype="bfloat16")
    assert bf16.page_size_bytes == 2 * 16 * 8 * 128 * 2
    spec = make_kv_cache_spec()
    # 100 tokens need 7 blocks of 16.
    assert spec.max_memory_usage_bytes(make_config(100)) == 7 * 1024
    assert spec.max_memory_usage_bytes(make_config(112)) == 7 * 1024
    assert spec.max_memory_usage_bytes(make_config(113)) == 8 * 1024


def test_full_attention_spec_takes_a_torch_dtype_and_keeps_its_name():
    import torch

    from_torch = FullAttentionSpec(block_size=8, num_kv_heads=2, head_size=4, dtype=torch.float16)
    from_name = FullAttentionSpec(block_size=8, num_kv_heads=2, head_size=4, dtype="float16")
    assert from_torch.dtype == "float16"
    assert from_torch == from_name and hash(from_torch) == hash(from_name)
    assert from_torch.page_size_bytes == 2 * 8 * 2 * 4 * 2


def test_full_attention_spec_rejects_unknown_dtype():
    import torch

    with pytest.raises(ValueError, match="dtype must be one of .*'int3'"):
        FullAttentionSpec(block_size=16, num_kv_heads=1, head_size=8, dtype="int3")
    with pytest.raises(ValueError, match="dtype must be one of .*torch.int8"):
        FullAttentionSpec(block_size=16, num_kv_heads=1, head_size=8, dtype=torch.int8)


def test_attention_spec_fields_after_block_size_are_keyword_only():
    assert FullAttentionSpec(16, num_kv_heads=1, head_size=8, dtype="float32").block_size == 16
    with pytest.raises(TypeError):
        FullAttentionSpec(16, 1, 8, "float32")  # type: ignore[misc]


def test_page_size_padded_replaces_the_real_page_size():
    padded = FullAttentionSpec(
        block_size=16, num_kv_heads=1, head_size=8, dtype="float32", page_size_padded=1536
    )
    assert (padded.real_page_size_bytes, padded.page_size_bytes) == (1024, 1536)
    too_small = FullAttentionSpec(
        block_size=16, num_kv_heads=1, head_size=8, dtype="float32", page_size_padded=1000
    )
    with pytest.raises(ValueError, match="page_size_padded=1000 is smaller than .* 1024"):
        _ = too_small.page_size_bytes


def test_is_kv_cache_spec_uniform():
    assert is_kv_cache_spec_uniform({})
    assert is_kv_cache_spec_uniform({"a": make_kv_cache_spec(), "b": make_kv_cache_spec()})
    assert not is_kv_cache_spec_uniform(
        {"a": make_kv_cache_spec(head_size=8), "b": make_kv_cache_spec(head_size=16)}
    )


def test_get_num_blocks():
    config = make_config(16)
    assert get_num_blocks(config, 1, 10 * 1024, 1024) == 10
    assert get_num_blocks(config, 1, 10 * 1024 + 1023, 1024) == 10
    assert get_num_blocks(config, 2, 10 * 1024, 1024) == 5
    assert get_num_blocks(config, 1, -1, 1024) == 0
    # num_gpu_blocks_override wins over the memory budget.
    assert get_num_blocks(make_config(16, num_gpu_blocks_override=3), 1, 10 * 1024, 1024) == 3


def test_get_kv_cache_configs_with_override():
    spec = make_kv_cache_spec()
    (config,) = get_kv_cache_configs(
        make_config(160, num_gpu_blocks_override=11), [{"layer.0": spec}], [0]
    )
    assert config.num_blocks == 11
    assert len(config.kv_cache_groups) == 1
    assert config.kv_cache_groups[0].layer_names == ["layer.0"]
    assert config.kv_cache_groups[0].kv_cache_spec == spec
    assert [(t.size, t.shared_by) for t in config.kv_cache_tensors] == [(11 * 1024, ["layer.0"])]


def test_get_kv_cache_configs_block_count_from_memory_budget():
    spec = make_kv_cache_spec()  # 1024 bytes per block per layer
    layers = {"layer.0": spec, "layer.1": spec}
    # Two layers: one block costs 2048 bytes; 10.99 blocks' worth rounds down to 10.
    (config,) = get_kv_cache_configs(make_config(64), [layers], [10 * 2048 + 2047])
    assert config.num_blocks == 10
    assert [(t.size, t.shared_by) for t in config.kv_cache_tensors] == [
        (10 * 1024, ["layer.0"]),
        (10 * 1024, ["layer.1"]),
    ]
    assert config.kv_cache_groups[0].layer_names == ["layer.0", "layer.1"]
    # The override wins over the budget.
    (overridden,) = get_kv_cache_configs(
        make_config(64, num_gpu_blocks_override=7), [layers], [10 * 2048]
    )
    assert overridden.num_blocks == 7


def test_get_kv_cache_configs_boundary_fits_exactly_one_max_len_sequence():
    spec = make_kv_cache_spec()
    # 160 tokens = 10 blocks; 11 blocks leave 10 after the null block.
    (config,) = get_kv_cache_configs(
        make_config(160, num_gpu_blocks_override=11), [{"layer.0": spec}], [0]
    )
    assert config.num_blocks == 11
    with pytest.raises(ValueError) as excinfo:
        get_kv_cache_configs(make_config(161, num_gpu_blocks_override=11), [{"layer.0": spec}], [0])
    message = str(excinfo.value)
    assert message.startswith(
        "To serve at least one request with the model's max seq len (161), 12288 bytes"
    )
    assert "available KV cache memory (11264 bytes)" in message
    assert "the estimated maximum model length is 160." in message
    assert "Try increasing `num_gpu_blocks_override`" in message


def test_get_kv_cache_configs_too_little_memory_for_max_model_len():
    spec = make_kv_cache_spec()
    # 5 blocks of memory, 4 usable (64 tokens); max_model_len 100 needs 7 blocks.
    with pytest.raises(ValueError, match="max seq len \\(100\\)") as excinfo:
        get_kv_cache_configs(make_config(100), [{"layer.0": spec}], [5 * 1024])
    assert "the estimated maximum model length is 64." in str(excinfo.value)
    assert "Try increasing `gpu_memory_utilization`" in str(excinfo.value)


def test_get_kv_cache_configs_without_memory_or_override():
    with pytest.raises(ValueError, match="^No available memory for the cache blocks"):
        get_kv_cache_configs(make_config(16), [{"layer.0": make_kv_cache_spec()}], [0])


def test_get_kv_cache_configs_rejects_no_layers_and_mixed_block_sizes():
    with pytest.raises(ValueError, match="no attention layers"):
        get_kv_cache_configs(make_config(16), [{}], [1 << 20])
    mixed = {
        "layer.0": make_kv_cache_spec(block_size=16),
        "layer.1": make_kv_cache_spec(block_size=32),
    }
    with pytest.raises(ValueError, match=r"one block size, got block sizes \[16, 32\]"):
        get_kv_cache_configs(make_config(16), [mixed], [1 << 20])


# A target's two layers (2 KV heads of 8: 2048-byte pages) and a draft's one
# (1 KV head of 8: 1024 bytes): a block costs 2 * 2048 + 1024 = 5120 bytes.
TARGET_AND_DRAFT = {
    "model.layers.0.attn": make_kv_cache_spec(num_kv_heads=2),
    "model.layers.1.attn": make_kv_cache_spec(num_kv_heads=2),
    "draft_model.model.layers.0.attn": make_kv_cache_spec(num_kv_heads=1),
}


def test_layers_whose_pages_differ_share_one_block_table():
    (config,) = get_kv_cache_configs(make_config(64), [TARGET_AND_DRAFT], [10 * 5120 + 100])
    (group,) = config.kv_cache_groups
    assert isinstance(group.kv_cache_spec, UniformTypeKVCacheSpecs)
    assert group.kv_cache_spec.page_size_bytes == 5120
    assert config.num_blocks == 10
    assert [(t.shared_by, t.size) for t in config.kv_cache_tensors] == [
        (["model.layers.0.attn"], 10 * 2048),
        (["model.layers.1.attn"], 10 * 2048),
        (["draft_model.model.layers.0.attn"], 10 * 1024),
    ]
    # 64 tokens = 4 blocks per sequence: 10 blocks hold 2.5 sequences.
    assert get_max_concurrency_for_kv_cache_config(make_config(64), config) == 2.5
    # The scheduler counts blocks only: it sees one full-attention spec.
    scheduler_config = generate_scheduler_kv_cache_config([config])
    assert isinstance(scheduler_config.kv_cache_groups[0].kv_cache_spec, FullAttentionSpec)
    assert scheduler_config.kv_cache_groups[0].layer_names == list(TARGET_AND_DRAFT)


def test_layers_whose_pages_differ_with_a_block_override():
    (config,) = get_kv_cache_configs(
        make_config(64, num_gpu_blocks_override=7), [TARGET_AND_DRAFT], [1 << 30]
    )
    assert config.num_blocks == 7
    assert sum(t.size for t in config.kv_cache_tensors) == 7 * 5120
    # One sequence plus the null block needs 5 blocks: 4 do not fit.
    with pytest.raises(ValueError, match="max seq len"):
        get_kv_cache_configs(
            make_config(64, num_gpu_blocks_override=4), [TARGET_AND_DRAFT], [1 << 30]
        )


def test_uniform_type_spec_needs_one_type_and_block_size():
    assert UniformTypeKVCacheSpecs.from_specs({}) is None
    assert (
        UniformTypeKVCacheSpecs.from_specs(
            {"a": make_kv_cache_spec(block_size=16), "b": make_kv_cache_spec(block_size=32)}
        )
        is None
    )
    spec = UniformTypeKVCacheSpecs.from_specs(TARGET_AND_DRAFT)
    assert spec is not None and spec.block_size == 16
    # max_model_len 64: 4 pages in every layer.
    assert spec.max_memory_usage_bytes(make_config(64)) == 4 * 5120


def test_uniform_type_spec_accepts_any_heads_and_dtype_and_copies_its_input():
    specs = {
        "target": make_kv_cache_spec(num_kv_heads=2),
        "draft": make_kv_cache_spec(num_kv_heads=4, head_size=16, dtype="float16"),
    }
    assert UniformTypeKVCacheSpecs.is_uniform_type(specs)
    assert not UniformTypeKVCacheSpecs.is_uniform_type({})
    spec = UniformTypeKVCacheSpecs.from_specs(specs)
    assert spec is not None and spec.page_size_bytes == 2048 + 4096
    specs["late"] = make_kv_cache_spec()
    assert list(spec.kv_cache_specs) == ["target", "draft"]


def test_equal_specs_still_make_a_plain_full_attention_group():
    spec = make_kv_cache_spec(num_kv_heads=2)
    layers = {"layer.0": spec, "layer.1": spec}
    (group,) = get_kv_cache_groups(make_config(64), layers)
    assert group.layer_names == ["layer.0", "layer.1"]
    assert type(group.kv_cache_spec) is FullAttentionSpec and group.kv_cache_spec == spec


def test_draft_layers_with_another_dtype_and_head_size_join_the_group():
    config = make_config(64)
    # The draft: 4 float16 heads of 16 -> 4096-byte pages; a block costs 2 * 2048 + 4096.
    layers = {
        "model.layers.0.attn": make_kv_cache_spec(num_kv_heads=2),
        "model.layers.1.attn": make_kv_cache_spec(num_kv_heads=2),
        "draft_model.model.layers.0.attn": make_kv_cache_spec(
            num_kv_heads=4, head_size=16, dtype="float16"
        ),
    }
    groups = get_kv_cache_groups(config, layers)
    assert [g.layer_names for g in groups] == [list(layers)]
    kv_cache_config = get_kv_cache_config_from_groups(config, groups, 6 * 8192 + 8191)
    assert kv_cache_config.num_blocks == 6
    assert [t.size for t in kv_cache_config.kv_cache_tensors] == [6 * 2048, 6 * 2048, 6 * 4096]


def test_draft_with_another_block_size_is_a_clear_error():
    layers = dict(TARGET_AND_DRAFT)
    layers["draft_model.model.layers.0.attn"] = make_kv_cache_spec(block_size=32)
    with pytest.raises(
        ValueError, match=r"one block size, got block sizes \[16, 32\] and types \['FullAtt"
    ):
        get_kv_cache_configs(make_config(64), [layers], [1 << 20])


def test_memory_check_counts_every_layers_page_for_the_null_block():
    # 64 tokens = 4 blocks, plus the null block: 5 * 5120 bytes.
    (config,) = get_kv_cache_configs(make_config(64), [TARGET_AND_DRAFT], [5 * 5120])
    assert config.num_blocks == 5
    with pytest.raises(ValueError) as excinfo:
        get_kv_cache_configs(make_config(64), [TARGET_AND_DRAFT], [5 * 5120 - 1])
    message = str(excinfo.value)
    assert "(64), 25600 bytes of KV cache are needed" in message
    # 4 * 5120 - 1 bytes after the null block hold 3 blocks: 48 tokens.
    assert "the estimated maximum model length is 48." in message


def test_workers_holding_target_and_draft_layers_get_the_smallest_block_count():
    target = {name: spec for name, spec in TARGET_AND_DRAFT.items() if name.startswith("model.")}
    draft = {name: spec for name, spec in TARGET_AND_DRAFT.items() if name.startswith("draft")}
    # Worker 0: 4096 bytes a block, 10 blocks; worker 1: 1024 bytes a block, 30 blocks.
    configs = get_kv_cache_configs(make_config(64), [target, draft], [10 * 4096, 30 * 1024])
    assert [c.num_blocks for c in configs] == [10, 10]
    assert [[t.size for t in c.kv_cache_tensors] for c in configs] == [
        [10 * 2048, 10 * 2048],
        [10 * 1024],
    ]
    # Each worker's spec covers only its own layers.
    assert [c.kv_cache_groups[0].kv_cache_spec.page_size_bytes for c in configs] == [4096, 1024]
    overridden = get_kv_cache_configs(
        make_config(64, num_gpu_blocks_override=7), [target, draft], [0, 0]
    )
    assert [[t.size for t in c.kv_cache_tensors] for c in overridden] == [
        [7 * 2048, 7 * 2048],
        [7 * 1024],
    ]
    # A worker without any of the layers gets no tensors and keeps the block count.
    configs = get_kv_cache_configs(make_config(64), [TARGET_AND_DRAFT, {}], [10 * 5120, 1 << 20])
    assert [c.num_blocks for c in configs] == [10, 10]
    assert configs[1].kv_cache_tensors == []


def test_get_kv_cache_configs_gives_every_worker_the_smallest_block_count():
    spec = make_kv_cache_spec()
    configs = get_kv_cache_configs(
        make_config(32), [{"a": spec}, {"a": spec}], [10 * 1024, 20 * 1024 + 5]
    )
    assert [c.num_blocks for c in configs] == [10, 10]
    # The bigger worker's tensor shrinks with its block count.
    assert [c.kv_cache_tensors[0].size for c in configs] == [10 * 1024, 10 * 1024]
    scheduler_config = generate_scheduler_kv_cache_config(configs)
    assert scheduler_config == configs[0] and scheduler_config is not configs[0]


def test_get_kv_cache_configs_rejects_a_layer_that_differs_across_workers():
    with pytest.raises(ValueError, match="'a' are different across workers"):
        get_kv_cache_configs(
            make_config(32),
            [{"a": make_kv_cache_spec(head_size=8)}, {"a": make_kv_cache_spec(head_size=16)}],
            [1 << 20, 1 << 20],
        )


def test_generate_scheduler_kv_cache_config_needs_equal_block_counts():
    with pytest.raises(ValueError, match="same num_blocks"):
        generate_scheduler_kv_cache_config([KVCacheConfig(num_blocks=4), KVCacheConfig(5)])


def test_estimate_max_model_len_restores_the_config():
    config = make_config(1000)
    layers = {"layer.0": make_kv_cache_spec()}
    # 10 pages of 16 tokens: 160 tokens.
    assert estimate_max_model_len(config, layers, 10 * 1024) == 160
    assert estimate_max_model_len(config, layers, 10 * 1024 - 1) == 144
    assert estimate_max_model_len(config, layers, 1023) == 0
    # Never more than the configured max_model_len.
    assert estimate_max_model_len(make_config(100), layers, 1 << 20) == 100
    assert config.model_config.max_model_len == 1000


def test_check_enough_kv_cache_memory_counts_the_null_block():
    layers = {"layer.0": make_kv_cache_spec()}
    check_enough_kv_cache_memory(make_config(64), layers, 5 * 1024)  # 4 blocks + null
    with pytest.raises(ValueError, match="max seq len \\(64\\)"):
        check_enough_kv_cache_memory(make_config(64), layers, 5 * 1024 - 1)
    check_enough_kv_cache_memory(make_config(64), {}, 0)  # no layers: nothing to check


def test_get_max_concurrency_for_kv_cache_config():
    spec = make_kv_cache_spec()
    kv_cache_config = KVCacheConfig(
        num_blocks=10, kv_cache_groups=[KVCacheGroupSpec(["a", "b"], spec)]
    )
    # 64 tokens = 4 blocks per request; 10 blocks hold 2.5 such requests.
    assert get_max_concurrency_for_kv_cache_config(make_config(64), kv_cache_config) == 2.5


def test_resolve_kv_cache_block_sizes_is_the_block_size_twice():
    spec = make_kv_cache_spec(block_size=32)
    one_group = KVCacheConfig(num_blocks=4, kv_cache_groups=[KVCacheGroupSpec(["a"], spec)])
    assert resolve_kv_cache_block_sizes(one_group, make_config(64, block_size=32)) == (32, 32)
    two_groups = KVCacheConfig(
        num_blocks=4,
        kv_cache_groups=[KVCacheGroupSpec(["a"], spec), KVCacheGroupSpec(["b"], spec)],
    )
    with pytest.raises(ValueError, match="exactly one KV cache group, got 2"):
        resolve_kv_cache_block_sizes(two_groups, make_config(64))
