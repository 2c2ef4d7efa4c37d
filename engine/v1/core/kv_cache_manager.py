"""The scheduler's only door into the KV cache.

vLLM twin: ``vllm/v1/core/kv_cache_manager.py`` (``KVCacheManager``, ``KVCacheBlocks``).
Read it for the three calls the scheduler makes:
  * ``get_computed_blocks(request)`` -- prefix-cache lookup for a waiting
    request. The hit is capped at ``num_tokens - 1``: the last prompt token is
    always recomputed, because the model must run on at least one token to
    produce logits for the next one.
  * ``allocate_slots(request, num_new_tokens, ...)`` -- make room for this
    step's tokens (adopting the prefix-hit blocks first), or return ``None``
    when the free pool is too small; that ``None`` is what triggers preemption.
    Afterwards every block the step fills completely is hashed into the cache.
  * ``free(request)`` -- drop the request's references, tail blocks first.
Sessions: 03 (KV cache), 02 (where the scheduler calls it).

Simpler than vLLM: ``allocate_slots`` takes no external (KV connector) tokens,
no ``delay_cache_blocks`` and no encoder tokens; no sliding-window skipping
(``remove_skipped_blocks``), no KV events (``take_events``), no connector-driven
``evict_blocks``, no metrics collector, no context parallelism, and no
``take_new_block_ids`` (vLLM zeroes fresh blocks for some model types).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal, overload

from engine.tracing.core_trace import KVCacheTrace
from engine.v1.core.kv_cache_coordinator import get_kv_cache_coordinator
from engine.v1.core.kv_cache_utils import KVCacheBlock
from engine.v1.kv_cache_interface import KVCacheConfig
from engine.v1.metrics.stats import PrefixCacheStats
from engine.v1.request import Request


@dataclass
class KVCacheBlocks:
    """Blocks handed to the scheduler, hiding the manager's internals.

    ``blocks[g][j]`` is the j-th block of KV cache group g.
    """

    blocks: tuple[Sequence[KVCacheBlock], ...]

    def __add__(self, other: KVCacheBlocks) -> KVCacheBlocks:
        return KVCacheBlocks(tuple([*a, *b] for a, b in zip(self.blocks, other.blocks)))

    @overload
    def get_block_ids(self, allow_none: Literal[False] = False) -> tuple[list[int], ...]: ...

    @overload
    def get_block_ids(self, allow_none: Literal[True]) -> tuple[list[int], ...] | None: ...

    def get_block_ids(self, allow_none: bool = False) -> tuple[list[int], ...] | None:
        """Block ids per group; with ``allow_none``, None when there are none."""
        if allow_none and all(len(group) == 0 for group in self.blocks):
            return None
        return tuple([b.block_id for b in group] for group in self.blocks)

    def get_unhashed_block_ids(self) -> list[int]:
        assert len(self.blocks) == 1, "only one KV cache group is supported"
        return [b.block_id for b in self.blocks[0] if b.block_hash is None]

    def new_empty(self) -> KVCacheBlocks:
        return KVCacheBlocks(tuple(() for _ in self.blocks))


class KVCacheManager:
    """The KV cache as the scheduler sees it.

    ``hash_block_size`` is how many tokens each of ``Request.block_hashes``
    covers. vLLM hashes at a finer granularity than a block only for hybrid
    models whose groups have different block sizes (every block size is then
    a multiple of it); Glassbox has one group, so it always equals the block
    size, and with prefix caching on the coordinator raises ``ValueError`` if
    it does not.
    ``max_num_batched_tokens`` (default ``max_model_len``) caps what vLLM
    reserves per request for sliding-window groups; with full attention only,
    it changes nothing here. ``use_eagle`` drops the last block of every
    prefix hit (the EAGLE drafter needs that block's hidden states).
    """

    def __init__(
        self,
        kv_cache_config: KVCacheConfig,
        max_model_len: int,
        hash_block_size: int,
        max_num_batched_tokens: int | None = None,
        enable_caching: bool = True,
        use_eagle: bool = False,
        log_stats: bool = False,
        *,
        trace: KVCacheTrace = KVCacheTrace.NULL,
    ) -> None:
        self.max_model_len = max_model_len
        self.max_num_batched_tokens = (
            max_model_len if max_num_batched_tokens is None else max_num_batched_tokens
        )
        self.trace = trace
        self.enable_caching = enable_caching
        self.use_eagle = use_eagle
        self.log_stats = log_stats
        self.prefix_cache_stats = PrefixCacheStats() if log_stats else None
        self.coordinator = get_kv_cache_coordinator(
            kv_cache_config=kv_cache_config,
            max_model_len=max_model_len,
            use_eagle=use_eagle,
            enable_caching=enable_caching,
            hash_block_size=hash_block_size,
            trace=trace,
        )
        self.num_kv_cache_groups = len(kv_cache_config.kv_cache_groups)
        self.block_pool = self.coordinator.block_pool
        self.kv_cache_config = kv_cache_config
        # Shared empty result, so a miss allocates nothing.
        self.empty_kv_cache_blocks = KVCacheBlocks(
            tuple(() for _ in range(self.num_kv_cache_groups))
        )

    @property
    def usage(self) -> float:
        """Fraction of usable KV blocks in use, 0.0 to 1.0."""
        return self.block_pool.get_usage()

    def make_prefix_cache_stats(self) -> PrefixCacheStats | None:
        """Take the prefix-cache counters gathered since the last call."""
        if not self.log_stats:
            return None
        stats, self.prefix_cache_stats = self.prefix_cache_stats, PrefixCacheStats()
        return stats

    def get_computed_blocks(self, request: Request) -> tuple[KVCacheBlocks, int]:
        """Longest cached prefix of a not-yet-scheduled request.

        Returns the hit blocks (not yet referenced: ``allocate_slots`` touches
        them) and the number of tokens they cover.
        """
        if not self.enable_caching or request.skip_reading_prefix_cache:
            return self.empty_kv_cache_blocks, 0
        # Never hit the whole sequence: the last token must be computed to get
        # logits. With block_size 16, a 32-token prompt repeated exactly hits 16
        # tokens (one block), not 32.
        max_cache_hit_length = request.num_tokens - 1
        hit_blocks, num_hit_tokens = self.coordinator.find_longest_cache_hit(
            request.block_hashes, max_cache_hit_length
        )
        self.trace.cache_hit(request, hit_blocks, num_hit_tokens)
        if self.prefix_cache_stats is not None:
            self.prefix_cache_stats.record(
                num_tokens=request.num_tokens,
                num_hits=num_hit_tokens,
                preempted=request.num_preemptions > 0,
            )
        return self.create_kv_cache_blocks(hit_blocks), num_hit_tokens

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        num_new_computed_tokens: int = 0,
        new_computed_blocks: KVCacheBlocks | None = None,
        num_lookahead_tokens: int = 0,
        *,
        full_sequence_must_fit: bool = False,
    ) -> KVCacheBlocks | None:
        """Reserve slots for ``num_new_tokens`` more tokens of ``request``.

        Token layout of the request after this call::

            | computed | new_computed (prefix hit) | new (this step) | lookahead |
            |<- already has blocks ->|
                       |<------------- may need new blocks ---------------->|
            |<---------- cached afterwards (full blocks) ----->|

        ``num_lookahead_tokens`` are slots for draft tokens a speculator will
        write; they are never cached. With ``full_sequence_must_fit`` (an
        admission gate), the call also fails unless the whole request, not
        just this chunk, would fit in the free pool now.

        Returns the newly allocated blocks, or None (nothing changed) if the
        free pool cannot cover them. Hit blocks that are currently free count
        against the pool too, since adopting them removes them from it.
        """
        if num_new_tokens <= 0:
            raise ValueError(f"num_new_tokens must be greater than 0, got {num_new_tokens}")
        hit_blocks = (
            new_computed_blocks.blocks
            if new_computed_blocks is not None
            else self.empty_kv_cache_blocks.blocks
        )
        num_computed_tokens = min(
            request.num_computed_tokens + num_new_computed_tokens, self.max_model_len
        )

        if full_sequence_must_fit:
            full_num_tokens = min(request.num_tokens, self.max_model_len)
            num_blocks_to_allocate = self.coordinator.get_num_blocks_to_allocate(
                request.request_id, full_num_tokens, hit_blocks
            )
            if num_blocks_to_allocate > self.block_pool.get_num_free_blocks():
                self.trace.allocation_failed(self, request, num_new_tokens, num_blocks_to_allocate)
                return None

        num_tokens_need_slot = min(
            num_computed_tokens + num_new_tokens + num_lookahead_tokens, self.max_model_len
        )
        num_blocks_to_allocate = self.coordinator.get_num_blocks_to_allocate(
            request.request_id, num_tokens_need_slot, hit_blocks
        )
        if num_blocks_to_allocate > self.block_pool.get_num_free_blocks():
            self.trace.allocation_failed(self, request, num_new_tokens, num_blocks_to_allocate)
            return None

        if any(hit_blocks):
            self.coordinator.allocate_new_computed_blocks(request.request_id, hit_blocks)
        new_blocks = self.coordinator.allocate_new_blocks(request.request_id, num_tokens_need_slot)

        if self.enable_caching:
            # Only tokens that exist can be hashed: cap at num_tokens (slots
            # for draft or not-yet-sampled tokens have nothing to hash yet).
            num_tokens_to_cache = min(num_computed_tokens + num_new_tokens, request.num_tokens)
            self.coordinator.cache_blocks(request, num_tokens_to_cache)
        return self.create_kv_cache_blocks(new_blocks)

    def free(self, request: Request) -> None:
        """Release the request's blocks; its tail blocks become evictable first."""
        self.coordinator.free(request.request_id)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash (e.g. after new weights are loaded).

        Returns False, and changes nothing, while any request still holds
        blocks; the scheduler preempts running requests first when asked to.
        """
        if not self.block_pool.reset_prefix_cache():
            return False
        if self.prefix_cache_stats is not None:
            self.prefix_cache_stats.reset = True
        return True

    def get_num_common_prefix_blocks(self, running_request_id: str) -> list[int]:
        return self.coordinator.get_num_common_prefix_blocks(running_request_id)

    def get_blocks(self, request_id: str) -> KVCacheBlocks:
        return self.create_kv_cache_blocks(self.coordinator.get_blocks(request_id))

    def get_block_ids(self, request_id: str) -> tuple[list[int], ...]:
        return self.get_blocks(request_id).get_block_ids()

    def cache_blocks(self, request: Request, num_computed_tokens: int) -> None:
        if self.enable_caching:
            self.coordinator.cache_blocks(request, num_computed_tokens)

    def create_kv_cache_blocks(self, blocks: tuple[Sequence[KVCacheBlock], ...]) -> KVCacheBlocks:
        return KVCacheBlocks(blocks) if any(blocks) else self.empty_kv_cache_blocks
