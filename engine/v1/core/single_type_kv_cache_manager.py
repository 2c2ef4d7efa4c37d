"""Per-attention-type block bookkeeping: who owns which blocks, and prefix hits.

vLLM twin: ``vllm/v1/core/single_type_kv_cache_manager.py``.
Read it for:
  * ``req_to_blocks`` -- each request's block table, in token order;
  * ``num_cached_block`` -- how many leading blocks of it are already in the
    prefix-cache map (so ``cache_blocks`` only hashes the new full ones);
  * ``FullAttentionManager.find_longest_cache_hit`` -- walk the request's
    block hashes from the first and stop at the first miss: a prefix hit is
    always a run of leading full blocks;
  * ``free`` -- blocks go back *reversed*, so the tail of a finished request
    is evicted before its (more shareable) head.
Sessions: 03 (KV cache).

Simpler than vLLM: only the full-attention manager (no sliding window,
chunked-local, Mamba or cross-attention managers), no context parallelism,
no KV-connector (external) tokens. So the allocation calls take only what full
attention uses: no ``total_computed_tokens`` / ``num_tokens_main_model`` (they
matter for windowed and Mamba layers), no per-request admission cap, no
``remove_skipped_blocks`` and no ``take_new_block_ids``.
"""

from __future__ import annotations

import itertools
from abc import ABC, abstractmethod
from collections import defaultdict
from collections.abc import Sequence
from typing import TYPE_CHECKING

from engine.v1.core.block_pool import BlockPool
from engine.v1.core.kv_cache_utils import BlockHashList, KVCacheBlock
from engine.v1.kv_cache_interface import FullAttentionSpec, KVCacheSpec
from engine.v1.utils import cdiv

if TYPE_CHECKING:
    from engine.v1.request import Request


class SingleTypeKVCacheManager(ABC):
    def __init__(
        self,
        kv_cache_spec: KVCacheSpec,
        block_pool: BlockPool,
        enable_caching: bool,
        kv_cache_group_id: int,
    ) -> None:
        self.block_size = kv_cache_spec.block_size
        self.kv_cache_spec = kv_cache_spec
        self.block_pool = block_pool
        self.enable_caching = enable_caching
        self.kv_cache_group_id = kv_cache_group_id
        # request id -> its blocks, one per block_size tokens, in order.
        self.req_to_blocks: defaultdict[str, list[KVCacheBlock]] = defaultdict(list)
        # request id -> number of its leading blocks already in the cache map.
        # Present from the request's first allocation until it is freed.
        self.num_cached_block: dict[str, int] = {}
        self._null_block = block_pool.null_block
        # The pool's trace: block events name the request that caused them.
        self.trace = block_pool.trace

    @staticmethod
    def _get_num_evictable_blocks(blocks: Sequence[KVCacheBlock]) -> int:
        # A hit on a free cached block takes it out of the free pool, so it
        # counts against the free blocks just like a fresh allocation.
        return sum(b.ref_cnt == 0 and not b.is_null for b in blocks)

    def get_num_blocks_to_allocate(
        self,
        request_id: str,
        num_tokens: int,
        new_computed_blocks: Sequence[KVCacheBlock],
    ) -> int:
        """Free blocks this request would consume to hold ``num_tokens`` slots."""
        num_required = cdiv(num_tokens, self.block_size)
        num_held = len(self.req_to_blocks.get(request_id, ()))
        num_new = max(num_required - num_held - len(new_computed_blocks), 0)
        return num_new + self._get_num_evictable_blocks(new_computed_blocks)

    def allocate_new_computed_blocks(
        self, request_id: str, new_computed_blocks: Sequence[KVCacheBlock]
    ) -> None:
        """Adopt prefix-hit blocks as the start of a new request's table."""
        if request_id in self.num_cached_block:
            # Already running: hits are only looked up before the first allocation.
            assert not new_computed_blocks
            return
        req_blocks = self.req_to_blocks[request_id]
        assert not req_blocks, f"{request_id} already holds blocks"
        if self.enable_caching:
            self.block_pool.touch(new_computed_blocks)
            self.trace.touched(request_id, new_computed_blocks)
        else:
            assert not new_computed_blocks, "prefix hits while prefix caching is off"
        req_blocks.extend(new_computed_blocks)
        # The hit blocks are, by definition, already cached.
        self.num_cached_block[request_id] = len(req_blocks)

    def allocate_new_blocks(self, request_id: str, num_tokens: int) -> list[KVCacheBlock]:
        """Grow the table until it has room for ``num_tokens`` tokens."""
        req_blocks = self.req_to_blocks[request_id]
        self.num_cached_block.setdefault(request_id, 0)
        num_new = cdiv(num_tokens, self.block_size) - len(req_blocks)
        if num_new <= 0:
            return []
        new_blocks = self.block_pool.get_new_blocks(num_new)
        req_blocks.extend(new_blocks)
        self.trace.allocated(request_id, new_blocks, req_blocks)
        return new_blocks

    def cache_blocks(self, request: Request, num_tokens: int) -> None:
        """Register every block that ``num_tokens`` tokens fill completely."""
        num_cached = self.num_cached_block.get(request.request_id, 0)
        num_full = num_tokens // self.block_size
        if num_cached >= num_full:
            return
        self.block_pool.cache_full_blocks(
            request=request,
            blocks=self.req_to_blocks[request.request_id],
            num_cached_blocks=num_cached,
            num_full_blocks=num_full,
            block_size=self.block_size,
            kv_cache_group_id=self.kv_cache_group_id,
        )
        self.num_cached_block[request.request_id] = num_full

    def free(self, request_id: str) -> None:
        req_blocks = self.req_to_blocks.pop(request_id, [])
        # Tail first: the last blocks of a sequence are the least likely to be
        # shared by a future prompt, so they should be evicted first.
        self.block_pool.free_blocks(reversed(req_blocks))
        self.trace.freed(request_id, req_blocks)
        self.num_cached_block.pop(request_id, None)

    @abstractmethod
    def get_num_common_prefix_blocks(self, running_request_id: str) -> int:
        """Leading blocks shared by *every* request that holds blocks
        (the input to cascade attention)."""

    @classmethod
    @abstractmethod
    def find_longest_cache_hit(
        cls,
        block_hashes: BlockHashList,
        max_length: int,
        kv_cache_group_ids: list[int],
        block_pool: BlockPool,
        kv_cache_spec: KVCacheSpec,
        use_eagle: bool,
        alignment_tokens: int,
    ) -> tuple[list[KVCacheBlock], ...]:
        """The longest run of cached leading blocks covering at most
        ``max_length`` tokens, one list per group.

        ``use_eagle`` drops the last hit block, so that block is recomputed and
        the EAGLE drafter gets the hidden states it needs. The hit length is
        cut down to a multiple of ``alignment_tokens`` (the block size, unless
        several groups must agree on one length).
        """


class FullAttentionManager(SingleTypeKVCacheManager):
    @classmethod
    def find_longest_cache_hit(
        cls,
        block_hashes: BlockHashList,
        max_length: int,
        kv_cache_group_ids: list[int],
        block_pool: BlockPool,
        kv_cache_spec: KVCacheSpec,
        use_eagle: bool,
        alignment_tokens: int,
    ) -> tuple[list[KVCacheBlock], ...]:
        if not isinstance(kv_cache_spec, FullAttentionSpec):
            raise TypeError("FullAttentionManager serves full-attention groups only")
        hits: tuple[list[KVCacheBlock], ...] = tuple([] for _ in kv_cache_group_ids)
        block_size = kv_cache_spec.block_size
        max_num_blocks = max_length // block_size
        for block_hash in itertools.islice(block_hashes, max_num_blocks):
            cached = block_pool.get_cached_block(block_hash, kv_cache_group_ids)
            if cached is None:
                break  # a prefix ends at its first miss
            for group_hits, block in zip(hits, cached):
                group_hits.append(block)
        if use_eagle and hits[0]:
            for group_hits in hits:
                group_hits.pop()
        while len(hits[0]) * block_size % alignment_tokens != 0:
            for group_hits in hits:
                group_hits.pop()
        return hits

    def get_num_common_prefix_blocks(self, running_request_id: str) -> int:
        num_holders = len(self.req_to_blocks)
        count = 0
        for block in self.req_to_blocks[running_request_id]:
            if block.ref_cnt != num_holders:
                break
            count += 1
        return count


spec_manager_map: dict[type[KVCacheSpec], type[SingleTypeKVCacheManager]] = {
    FullAttentionSpec: FullAttentionManager,
}


def get_manager_for_kv_cache_spec(kv_cache_spec: KVCacheSpec, **kwargs) -> SingleTypeKVCacheManager:
    manager_class = spec_manager_map.get(type(kv_cache_spec))
    if manager_class is None:
        raise ValueError(f"no KV cache manager for spec type {type(kv_cache_spec).__name__}")
    return manager_class(kv_cache_spec, **kwargs)
