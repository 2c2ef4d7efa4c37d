"""Fans KV-cache calls out to one manager per KV cache group.

vLLM twin: ``vllm/v1/core/kv_cache_coordinator.py`` (``KVCacheCoordinator``,
``KVCacheCoordinatorNoPrefixCache``, ``UnitaryKVCacheCoordinator``,
``get_kv_cache_coordinator``).
Read it for: the seam between ``KVCacheManager`` (what the scheduler calls) and
the per-type managers. ``get_kv_cache_coordinator`` picks one of three: no
prefix caching (lookups always miss), one group (the unitary coordinator just
forwards), or several groups (hybrid models: full + sliding-window layers,
which must agree on one cache-hit length).
Sessions: 03 (KV cache).

Simpler than vLLM: the hybrid coordinator is not implemented, so a config with
several groups is rejected with an error when prefix caching is on (vLLM's
no-prefix-cache coordinator takes any number of groups, and so does ours, but
the pool sizing in ``kv_cache_utils`` only ever builds one). No KV events, no
context parallelism, no cross-attention (encoder) blocks.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import TYPE_CHECKING

from engine.tracing.core_trace import KVCacheTrace
from engine.v1.core.block_pool import BlockPool
from engine.v1.core.kv_cache_utils import BlockHash, KVCacheBlock
from engine.v1.core.single_type_kv_cache_manager import get_manager_for_kv_cache_spec
from engine.v1.kv_cache_interface import KVCacheConfig

if TYPE_CHECKING:
    from engine.v1.request import Request


class KVCacheCoordinator(ABC):
    def __init__(
        self,
        kv_cache_config: KVCacheConfig,
        max_model_len: int,
        use_eagle: bool,
        enable_caching: bool,
        hash_block_size: int,
        trace: KVCacheTrace = KVCacheTrace.NULL,
    ) -> None:
        self.kv_cache_config = kv_cache_config
        self.max_model_len = max_model_len
        self.enable_caching = enable_caching
        self.block_pool = BlockPool(
            kv_cache_config.num_blocks, enable_caching, hash_block_size=hash_block_size, trace=trace
        )
        # Groups whose cache hits lose their last block for the EAGLE drafter.
        self.eagle_group_ids: set[int] = (
            set(range(len(kv_cache_config.kv_cache_groups))) if use_eagle else set()
        )
        self.single_type_managers = tuple(
            get_manager_for_kv_cache_spec(
                group.kv_cache_spec,
                block_pool=self.block_pool,
                enable_caching=enable_caching,
                kv_cache_group_id=i,
            )
            for i, group in enumerate(kv_cache_config.kv_cache_groups)
        )

    def get_num_blocks_to_allocate(
        self,
        request_id: str,
        num_tokens: int,
        new_computed_blocks: tuple[Sequence[KVCacheBlock], ...],
    ) -> int:
        return sum(
            manager.get_num_blocks_to_allocate(request_id, num_tokens, new_computed_blocks[i])
            for i, manager in enumerate(self.single_type_managers)
        )

    def allocate_new_computed_blocks(
        self, request_id: str, new_computed_blocks: tuple[Sequence[KVCacheBlock], ...]
    ) -> None:
        for i, manager in enumerate(self.single_type_managers):
            manager.allocate_new_computed_blocks(request_id, new_computed_blocks[i])

    def allocate_new_blocks(
        self, request_id: str, num_tokens: int
    ) -> tuple[list[KVCacheBlock], ...]:
        return tuple(
            m.allocate_new_blocks(request_id, num_tokens) for m in self.single_type_managers
        )

    def cache_blocks(self, request: Request, num_computed_tokens: int) -> None:
        for manager in self.single_type_managers:
            manager.cache_blocks(request, num_computed_tokens)

    def free(self, request_id: str) -> None:
        for manager in self.single_type_managers:
            manager.free(request_id)

    def get_num_common_prefix_blocks(self, running_request_id: str) -> list[int]:
        return [
            m.get_num_common_prefix_blocks(running_request_id) for m in self.single_type_managers
        ]

    def get_blocks(self, request_id: str) -> tuple[list[KVCacheBlock], ...]:
        return tuple(m.req_to_blocks.get(request_id) or [] for m in self.single_type_managers)

    @abstractmethod
    def find_longest_cache_hit(
        self, block_hashes: Sequence[BlockHash], max_cache_hit_length: int
    ) -> tuple[tuple[list[KVCacheBlock], ...], int]:
        """Hit blocks per group and the hit length in tokens."""


class KVCacheCoordinatorNoPrefixCache(KVCacheCoordinator):
    """Prefix caching is off: every lookup misses and no block counts as a
    shared prefix (any number of groups)."""

    def __init__(
        self,
        kv_cache_config: KVCacheConfig,
        max_model_len: int,
        use_eagle: bool,
        hash_block_size: int,
        trace: KVCacheTrace = KVCacheTrace.NULL,
    ) -> None:
        super().__init__(kv_cache_config, max_model_len, use_eagle, False, hash_block_size, trace)
        self.num_single_type_manager = len(self.single_type_managers)

    def get_num_common_prefix_blocks(self, running_request_id: str) -> list[int]:
        return [0] * self.num_single_type_manager

    def find_longest_cache_hit(
        self, block_hashes: Sequence[BlockHash], max_cache_hit_length: int
    ) -> tuple[tuple[list[KVCacheBlock], ...], int]:
        return tuple([] for _ in range(self.num_single_type_manager)), 0


class UnitaryKVCacheCoordinator(KVCacheCoordinator):
    """Exactly one KV cache group: every layer shares one block table."""

    def __init__(
        self,
        kv_cache_config: KVCacheConfig,
        max_model_len: int,
        use_eagle: bool,
        enable_caching: bool,
        hash_block_size: int,
        trace: KVCacheTrace = KVCacheTrace.NULL,
    ) -> None:
        super().__init__(
            kv_cache_config, max_model_len, use_eagle, enable_caching, hash_block_size, trace
        )
        self.kv_cache_spec = kv_cache_config.kv_cache_groups[0].kv_cache_spec
        self.block_size = self.kv_cache_spec.block_size
        # Request.block_hashes must hold one hash per block: the lookup walks
        # them block by block.
        if enable_caching and hash_block_size != self.block_size:
            raise ValueError(
                "UnitaryKVCacheCoordinator assumes hash_block_size == block_size, got "
                f"hash_block_size={hash_block_size}, block_size={self.block_size}"
            )

    def find_longest_cache_hit(
        self, block_hashes: Sequence[BlockHash], max_cache_hit_length: int
    ) -> tuple[tuple[list[KVCacheBlock], ...], int]:
        hit_blocks = self.single_type_managers[0].find_longest_cache_hit(
            block_hashes=block_hashes,
            max_length=max_cache_hit_length,
            kv_cache_group_ids=[0],
            block_pool=self.block_pool,
            kv_cache_spec=self.kv_cache_spec,
            use_eagle=0 in self.eagle_group_ids,
            alignment_tokens=self.block_size,
        )
        return hit_blocks, len(hit_blocks[0]) * self.block_size


def get_kv_cache_coordinator(
    kv_cache_config: KVCacheConfig,
    max_model_len: int,
    use_eagle: bool,
    enable_caching: bool,
    hash_block_size: int,
    trace: KVCacheTrace = KVCacheTrace.NULL,
) -> KVCacheCoordinator:
    if not enable_caching:
        return KVCacheCoordinatorNoPrefixCache(
            kv_cache_config, max_model_len, use_eagle, hash_block_size, trace
        )
    if len(kv_cache_config.kv_cache_groups) == 1:
        return UnitaryKVCacheCoordinator(
            kv_cache_config, max_model_len, use_eagle, enable_caching, hash_block_size, trace
        )
    raise ValueError(
        f"Glassbox supports exactly one KV cache group with prefix caching, got "
        f"{len(kv_cache_config.kv_cache_groups)} (hybrid attention is not implemented)"
    )
