"""The pool of physical KV blocks and the prefix-cache map.

vLLM twin: ``vllm/v1/core/block_pool.py`` (``BlockPool``, ``BlockHashToBlockMap``).
Read it for the life of a block:

  free (in queue, maybe still cached)
    --get_new_blocks-->  owned (ref_cnt 1; its old hash is evicted from the map)
    --cache_full_blocks--> owned and cached (hash -> block in the map)
    --touch (prefix hit)--> shared (ref_cnt > 1), unlinked from the free queue
    --free_blocks-->  ref_cnt 0: back at the free queue's tail, hash kept, so a
                      later request can still hit it until it is reused.

Block 0 is the null block: popped at start-up, never handed out, never cached,
never returned to the free queue.
Sessions: 03 (KV cache).

``hash_block_size`` is the number of tokens each of ``Request.block_hashes``
covers; ``cache_full_blocks`` joins consecutive hashes when a block is a
multiple of it (``BlockHashListWithBlockSize``). The KV cache manager always
passes the block size itself (one KV cache group).

Simpler than vLLM: no KV events for external consumers (vLLM's
``BlockStored`` / ``BlockRemoved`` for KV-aware routers, ``take_events``), no
``evict_blocks`` for KV connectors, no ``block_mask`` (sliding-window groups
cache only some blocks) and no residency metrics. Glassbox's trace events
(``kv.init``, ``kv.cached``, ``kv.evicted``, ``kv.cache_reset``; the
per-request ones come from the managers) play a similar role for the replay
model in ``engine/tracing/replay.py``.

Differs from vLLM on purpose: a pool needs at least 2 blocks, the null block
and one usable (vLLM accepts the null block alone, for attention-free models,
which Glassbox does not serve).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

from engine.tracing.core_trace import KVCacheTrace
from engine.v1.core.kv_cache_utils import (
    BlockHash,
    BlockHashList,
    BlockHashListWithBlockSize,
    BlockHashWithGroupId,
    FreeKVCacheBlockQueue,
    KVCacheBlock,
    get_block_hash,
    get_group_id,
    make_block_hash_with_group_id,
)

if TYPE_CHECKING:
    from engine.v1.request import Request

logger = logging.getLogger(__name__)


class BlockHashToBlockMap:
    """hash -> block(s) holding that prefix.

    Usually one block per hash; two requests that computed the same prefix at
    the same time each keep their own copy (block tables are append-only, so
    a block id, once handed out, is never swapped for a twin). Values are a
    bare block in the common case and a ``{block_id: block}`` dict otherwise.
    """

    def __init__(self) -> None:
        self._cache: dict[BlockHashWithGroupId, KVCacheBlock | dict[int, KVCacheBlock]] = {}

    def get_one_block(self, key: BlockHashWithGroupId) -> KVCacheBlock | None:
        entry = self._cache.get(key)
        if entry is None or isinstance(entry, KVCacheBlock):
            return entry
        return next(iter(entry.values()))

    def insert(self, key: BlockHashWithGroupId, block: KVCacheBlock) -> None:
        entry = self._cache.get(key)
        if entry is None:
            self._cache[key] = block
        elif isinstance(entry, KVCacheBlock):
            self._cache[key] = {entry.block_id: entry, block.block_id: block}
        else:
            entry[block.block_id] = block

    def pop(self, key: BlockHashWithGroupId, block_id: int) -> KVCacheBlock | None:
        """Remove ``block_id`` under ``key``; returns it, or None if absent.

        A dict entry stays a dict even when one block is left in it (it is
        never turned back into a bare block).
        """
        entry = self._cache.pop(key, None)
        if entry is None:
            return None
        if isinstance(entry, KVCacheBlock):
            if entry.block_id == block_id:
                return entry
            self._cache[key] = entry  # another block holds this hash: keep it
            return None
        block = entry.pop(block_id, None)
        if entry:
            self._cache[key] = entry
        return block

    def __len__(self) -> int:
        return len(self._cache)

    def __contains__(self, key: object) -> bool:
        return key in self._cache


class BlockPool:
    def __init__(
        self,
        num_gpu_blocks: int,
        enable_caching: bool,
        hash_block_size: int,
        trace: KVCacheTrace = KVCacheTrace.NULL,
    ) -> None:
        if not isinstance(num_gpu_blocks, int) or num_gpu_blocks < 2:
            raise ValueError(f"num_gpu_blocks must be an integer >= 2, got {num_gpu_blocks!r}")
        self.num_gpu_blocks = num_gpu_blocks
        self.enable_caching = enable_caching
        self.hash_block_size = hash_block_size
        self.blocks = [KVCacheBlock(block_id=i) for i in range(num_gpu_blocks)]
        self.free_block_queue = FreeKVCacheBlockQueue(self.blocks)
        self.cached_block_hash_to_block = BlockHashToBlockMap()
        # Block 0 stands in for "no block here" in block tables (vLLM uses it
        # for sliding-window holes and padding); it is taken out for good.
        self.null_block = self.free_block_queue.popleft()
        self.null_block.is_null = True
        self.trace = trace
        self.trace.pool_created(self)

    # -- prefix cache -------------------------------------------------------
    def get_cached_block(
        self, block_hash: BlockHash, kv_cache_group_ids: list[int]
    ) -> list[KVCacheBlock] | None:
        """The cached block for this hash in every group, or None on any miss."""
        found = []
        for group_id in kv_cache_group_ids:
            block = self.cached_block_hash_to_block.get_one_block(
                make_block_hash_with_group_id(block_hash, group_id)
            )
            if block is None:
                return None
            found.append(block)
        return found

    def cache_full_blocks(
        self,
        request: Request,
        blocks: list[KVCacheBlock],
        num_cached_blocks: int,
        num_full_blocks: int,
        block_size: int,
        kv_cache_group_id: int,
    ) -> None:
        """Register ``blocks[num_cached_blocks:num_full_blocks]`` under the
        request's block hashes, making them reusable by later requests."""
        if num_cached_blocks >= num_full_blocks:
            return
        block_hashes: BlockHashList = request.block_hashes
        if block_size != self.hash_block_size:
            # Hashes were computed every hash_block_size tokens; join them up
            # to one hash per block (block_size must be a multiple).
            block_hashes = BlockHashListWithBlockSize(
                request.block_hashes, self.hash_block_size, block_size
            )
        if len(block_hashes) < num_full_blocks:
            raise RuntimeError(
                f"request {request.request_id}: {num_full_blocks} full blocks but only "
                f"{len(block_hashes)} block hashes"
            )
        for i in range(num_cached_blocks, num_full_blocks):
            block = blocks[i]
            if block.is_null:
                continue
            key = make_block_hash_with_group_id(block_hashes[i], kv_cache_group_id)
            block.block_hash = key
            self.cached_block_hash_to_block.insert(key, block)
        self.trace.cached(request, blocks, num_cached_blocks, num_full_blocks, kv_cache_group_id)

    # -- allocation -----------------------------------------------------------
    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        """Pop ``num_blocks`` from the head of the free queue (LRU first).

        A popped block may still be cached from an earlier request; reusing it
        evicts that entry, since its contents are about to be overwritten.
        """
        if num_blocks > self.get_num_free_blocks():
            raise ValueError(
                f"Cannot get {num_blocks} free blocks from the pool "
                f"(only {self.get_num_free_blocks()} are free)"
            )
        blocks = self.free_block_queue.popleft_n(num_blocks)
        for block in blocks:
            if self.enable_caching:
                self._maybe_evict_cached_block(block)
            assert block.ref_cnt == 0, block
            block.ref_cnt = 1
        return blocks

    def _maybe_evict_cached_block(self, block: KVCacheBlock) -> bool:
        key = block.block_hash
        if key is None:
            return False
        if self.cached_block_hash_to_block.pop(key, block.block_id) is None:
            return False
        block.reset_hash()
        self.trace.evicted(block, get_block_hash(key), get_group_id(key))
        return True

    def touch(self, blocks: Sequence[KVCacheBlock]) -> None:
        """Take a reference on prefix-hit blocks; a free one leaves the queue."""
        for block in blocks:
            if block.ref_cnt == 0 and not block.is_null:
                self.free_block_queue.remove(block)
            block.ref_cnt += 1

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        """Drop one reference from each block; blocks reaching zero join the
        free queue's tail in the given order (first given = evicted first)."""
        blocks = list(ordered_blocks)
        for block in blocks:
            block.ref_cnt -= 1
            assert block.ref_cnt >= 0 or block.is_null, f"ref_cnt below zero: {block}"
        self.free_block_queue.append_n([b for b in blocks if b.ref_cnt == 0 and not b.is_null])

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash; only allowed when no block is in use."""
        num_used_blocks = self.num_gpu_blocks - self.get_num_free_blocks()
        if num_used_blocks != 1:  # the null block is always in use
            logger.warning(
                "Failed to reset prefix cache because some blocks (%d) are not freed yet",
                num_used_blocks - 1,
            )
            return False
        self.cached_block_hash_to_block = BlockHashToBlockMap()
        for block in self.blocks:
            block.reset_hash()
        self.trace.cache_reset()
        logger.info("Successfully reset prefix cache")
        return True

    # -- accounting -------------------------------------------------------------
    def get_num_free_blocks(self) -> int:
        return self.free_block_queue.num_free_blocks

    def get_usage(self) -> float:
        """Fraction of usable blocks (the null block excluded) that are in use."""
        usable = self.num_gpu_blocks - 1
        return 1.0 - self.get_num_free_blocks() / usable if usable else 0.0
