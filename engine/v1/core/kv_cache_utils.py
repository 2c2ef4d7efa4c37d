"""Blocks, the free queue, block hashing and KV pool sizing.

vLLM twin: ``vllm/v1/core/kv_cache_utils.py``.
Read it for:
  * ``KVCacheBlock`` -- the scheduler-side record of one physical block: id,
    reference count, and (once full and cached) its hash.
  * ``FreeKVCacheBlockQueue`` -- an intrusive doubly linked list of blocks with
    ``ref_cnt == 0``. The head is evicted first. A cached block that gets a
    prefix hit is unlinked from the middle in O(1), which is why this is not a
    ``collections.deque``.
  * ``hash_block_tokens`` / ``get_request_block_hasher`` -- block *i*'s hash
    covers block *i*'s tokens **and** block *i-1*'s hash, so equal hashes mean
    equal prefixes, not just equal blocks.
  * ``get_kv_cache_config`` -- how many blocks fit in the memory left over.
Sessions: 03 (KV cache).

Simpler than vLLM: sha256 over pickle is the only hash; extra keys are only the
cache salt (no multimodal or LoRA keys); one KV cache group.
"""

from __future__ import annotations

import hashlib
import os
import pickle
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NewType

from engine.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheSpec,
    KVCacheTensor,
)
from engine.v1.utils import cdiv

if TYPE_CHECKING:
    from engine.v1.request import Request

# The hash of one full block (and, through chaining, of its whole prefix).
BlockHash = NewType("BlockHash", bytes)
# The same hash with the KV cache group id appended (4 bytes, big endian): the
# key of the prefix-cache map, so one token prefix can be cached per group.
BlockHashWithGroupId = NewType("BlockHashWithGroupId", bytes)


def make_block_hash_with_group_id(block_hash: BlockHash, group_id: int) -> BlockHashWithGroupId:
    return BlockHashWithGroupId(block_hash + group_id.to_bytes(4, "big", signed=False))


def get_block_hash(key: BlockHashWithGroupId) -> BlockHash:
    return BlockHash(key[:-4])


def get_group_id(key: BlockHashWithGroupId) -> int:
    return int.from_bytes(key[-4:], "big", signed=False)


def sha256(obj: Any) -> bytes:
    """sha256 over the pickled object: stable across processes and runs."""
    return hashlib.sha256(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)).digest()


# The "parent hash" of a request's first block. vLLM seeds it from
# PYTHONHASHSEED (random when unset). We default to a fixed seed instead so that
# two processes -- and two runs a learner compares -- agree on every hash; set
# PYTHONHASHSEED to get a different, still reproducible, hash space.
NONE_HASH: BlockHash = BlockHash(b"")


def init_none_hash(hash_fn: Callable[[Any], bytes] = sha256) -> None:
    global NONE_HASH
    seed = os.getenv("PYTHONHASHSEED") or "glassbox"
    NONE_HASH = BlockHash(hash_fn(seed))


init_none_hash()


@dataclass(slots=True, eq=False)
class KVCacheBlock:
    """Metadata of one physical KV block (the data lives on the worker)."""

    block_id: int
    # How many requests currently hold this block in their block table.
    ref_cnt: int = 0
    # Set once the block is full and registered in the prefix cache.
    _block_hash: BlockHashWithGroupId | None = None
    # Links of the free queue; only FreeKVCacheBlockQueue touches them.
    prev_free_block: KVCacheBlock | None = None
    next_free_block: KVCacheBlock | None = None
    # Block 0: a placeholder id that is never allocated, cached or freed.
    is_null: bool = False

    @property
    def block_hash(self) -> BlockHashWithGroupId | None:
        return self._block_hash

    @block_hash.setter
    def block_hash(self, block_hash: BlockHashWithGroupId) -> None:
        if self._block_hash is not None:
            raise RuntimeError(f"block {self.block_id} is already cached under another hash")
        self._block_hash = block_hash

    def reset_hash(self) -> None:
        self._block_hash = None

    def __repr__(self) -> str:
        prev_id = self.prev_free_block.block_id if self.prev_free_block else None
        next_id = self.next_free_block.block_id if self.next_free_block else None
        h = self._block_hash.hex()[:8] if self._block_hash else None
        return (
            f"KVCacheBlock(block_id={self.block_id}, ref_cnt={self.ref_cnt}, "
            f"hash={h}, prev={prev_id}, next={next_id})"
        )


class FreeKVCacheBlockQueue:
    """Free blocks in eviction order, as an O(1) doubly linked list.

    Two sentinel blocks (id -1) bracket the list so that every real block in
    it always has both neighbours; no Python objects are allocated per
    operation. Order: at start-up, by block id. Afterwards the scheduler appends
    a finished request's blocks tail-first, so the head holds the least
    recently used blocks and, among one request's blocks, the deepest ones
    (which are the least likely to be shared) go first.
    """

    def __init__(self, blocks: list[KVCacheBlock]) -> None:
        self.num_free_blocks = len(blocks)
        self.fake_free_list_head = KVCacheBlock(block_id=-1)
        self.fake_free_list_tail = KVCacheBlock(block_id=-1)
        chain = [self.fake_free_list_head, *blocks, self.fake_free_list_tail]
        for left, right in zip(chain, chain[1:]):
            left.next_free_block = right
            right.prev_free_block = left

    def popleft(self) -> KVCacheBlock:
        block = self.fake_free_list_head.next_free_block
        if block is None or block is self.fake_free_list_tail:
            raise ValueError("no free KV blocks left")
        self._unlink(block)
        return block

    def popleft_n(self, n: int) -> list[KVCacheBlock]:
        if n > self.num_free_blocks:
            raise ValueError(f"asked for {n} free blocks, only {self.num_free_blocks} exist")
        return [self.popleft() for _ in range(n)]

    def remove(self, block: KVCacheBlock) -> None:
        """Unlink a block from anywhere in the queue (a prefix-cache hit)."""
        if block.prev_free_block is None or block.next_free_block is None:
            raise RuntimeError(f"remove() on a block that is not in the free queue: {block}")
        self._unlink(block)

    def append(self, block: KVCacheBlock) -> None:
        self.append_n([block])

    def append_n(self, blocks: Sequence[KVCacheBlock]) -> None:
        # Check everything before linking anything, so a bad call leaves the
        # queue untouched.
        for block in blocks:
            if block.prev_free_block is not None or block.next_free_block is not None:
                raise RuntimeError(f"block {block.block_id} is already in the free queue")
        if len({id(b) for b in blocks}) != len(blocks):
            raise RuntimeError("the same block appears twice in one append_n call")
        last = self.fake_free_list_tail.prev_free_block
        assert last is not None
        for block in blocks:
            last.next_free_block = block
            block.prev_free_block = last
            last = block
        last.next_free_block = self.fake_free_list_tail
        self.fake_free_list_tail.prev_free_block = last
        self.num_free_blocks += len(blocks)

    def get_all_free_blocks(self) -> list[KVCacheBlock]:
        """Head-to-tail walk; O(n), for tests, traces and the TUI."""
        out = []
        block = self.fake_free_list_head.next_free_block
        while block is not None and block is not self.fake_free_list_tail:
            out.append(block)
            block = block.next_free_block
        return out

    def _unlink(self, block: KVCacheBlock) -> None:
        assert block.prev_free_block is not None and block.next_free_block is not None
        block.prev_free_block.next_free_block = block.next_free_block
        block.next_free_block.prev_free_block = block.prev_free_block
        block.prev_free_block = block.next_free_block = None
        self.num_free_blocks -= 1


# ---------------------------------------------------------------------------
# Block hashing
# ---------------------------------------------------------------------------
def generate_block_hash_extra_keys(
    request: Request, start_token_idx: int, end_token_idx: int
) -> tuple[Any, ...] | None:
    """Keys besides the token ids that make a block distinct.

    Only the cache salt today (on the first block, which then changes every
    later hash through the chain). vLLM also mixes in multimodal hashes, LoRA
    names and prompt embeddings here.
    """
    if start_token_idx == 0 and request.cache_salt:
        return (request.cache_salt,)
    return None


def hash_block_tokens(
    hash_function: Callable[[Any], bytes],
    parent_block_hash: BlockHash | None,
    curr_block_token_ids: Sequence[int],
    extra_keys: tuple[Any, ...] | None = None,
) -> BlockHash:
    """hash(parent hash, this block's token ids, extra keys)."""
    parent = parent_block_hash if parent_block_hash else NONE_HASH
    return BlockHash(hash_function((parent, tuple(curr_block_token_ids), extra_keys)))


def get_request_block_hasher(
    block_size: int, caching_hash_fn: Callable[[Any], bytes] = sha256
) -> Callable[[Request], list[BlockHash]]:
    """Build the function ``Request.update_block_hashes`` calls.

    It returns hashes only for the full blocks not hashed yet, so calling it
    after every appended token costs nothing until a block fills up.
    """

    def request_block_hasher(request: Request) -> list[BlockHash]:
        start = len(request.block_hashes) * block_size
        parent = request.block_hashes[-1] if request.block_hashes else None
        new_hashes: list[BlockHash] = []
        tokens = request.all_token_ids
        while start + block_size <= request.num_tokens:
            end = start + block_size
            extra = generate_block_hash_extra_keys(request, start, end)
            parent = hash_block_tokens(caching_hash_fn, parent, tokens[start:end], extra)
            new_hashes.append(parent)
            start = end
        return new_hashes

    return request_block_hasher


# ---------------------------------------------------------------------------
# Sizing the pool
# ---------------------------------------------------------------------------
def get_num_blocks(available_memory: int, num_layers: int, page_size_bytes: int) -> int:
    """Blocks that fit when every layer needs one page per block."""
    return max(int(available_memory // (page_size_bytes * num_layers)), 0)


def get_kv_cache_config(
    kv_cache_specs: dict[str, KVCacheSpec],
    available_memory: int,
    max_model_len: int,
    num_gpu_blocks_override: int | None = None,
) -> KVCacheConfig:
    """Turn per-layer specs and a memory budget into a ``KVCacheConfig``.

    Every layer gets its own tensor of ``num_blocks * page_size`` bytes; all
    layers share one block table (one group), as for any plain decoder.
    Raises when the pool cannot hold even one ``max_model_len`` sequence,
    as vLLM does, because such a request could never finish.
    """
    if not kv_cache_specs:
        raise ValueError("the model reported no attention layers to build a KV cache for")
    specs = list(kv_cache_specs.values())
    spec = specs[0]
    if any(s != spec for s in specs):
        raise ValueError(
            "all layers must share one KV cache spec (hybrid models are not supported)"
        )
    if not isinstance(spec, FullAttentionSpec):
        raise ValueError(f"unsupported KV cache spec {type(spec).__name__}")
    num_layers = len(specs)
    if num_gpu_blocks_override is not None:
        num_blocks = num_gpu_blocks_override
    else:
        if available_memory <= 0:
            raise ValueError(
                "no memory is left for the KV cache after loading the model; "
                "raise gpu_memory_utilization or use a smaller model"
            )
        num_blocks = get_num_blocks(available_memory, num_layers, spec.page_size_bytes)

    # One block is the null block; the rest must hold a full-length sequence.
    needed = cdiv(max_model_len, spec.block_size)
    if num_blocks - 1 < needed:
        per_token = spec.page_size_bytes * num_layers / spec.block_size
        raise ValueError(
            f"the KV cache has {num_blocks} blocks ({num_blocks - 1} usable after the null "
            f"block) of {spec.block_size} tokens, but one sequence of max_model_len="
            f"{max_model_len} needs {needed} blocks. At {per_token:.0f} bytes per token, "
            f"at most {max(num_blocks - 1, 0) * spec.block_size} tokens fit: lower "
            "max_model_len, or raise gpu_memory_utilization / num_gpu_blocks_override."
        )
    names = list(kv_cache_specs)
    return KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=[
            KVCacheTensor(size=num_blocks * spec.page_size_bytes, shared_by=[name])
            for name in names
        ],
        kv_cache_groups=[KVCacheGroupSpec(layer_names=names, kv_cache_spec=spec)],
    )
