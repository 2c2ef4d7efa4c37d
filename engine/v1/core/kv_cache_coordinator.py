"""Fans KV-cache calls out to one manager per KV cache group.

vLLM twin: ``vllm/v1/core/kv_cache_coordinator.py`` (``KVCacheCoordinator``,
``UnitaryKVCacheCoordinator``, ``get_kv_cache_coordinator``).
Read it for: the seam between ``KVCacheManager`` (what the scheduler calls) and
the per-type managers. A plain decoder has a single group, so the unitary
coordinator just forwards; hybrid models (full + sliding-window layers) get
several groups and must agree on one cache-hit length.
Sessions: 03 (KV cache).

Simpler than vLLM: only the unitary coordinator (one group) exists; the
hybrid coordinator is not implemented and a config with several groups is
rejected with an error.
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
        enable_caching: bool,
        trace: KVCacheTrace = KVCacheTrace.NULL,
    ) -> None:
        self.kv_cache_config = kv_cache_config
        self.enable_caching = enable_caching
        block_size = kv_cache_config.kv_cache_groups[0].kv_cache_spec.block_size
        self.block_pool = BlockPool(
            kv_cache_config.num_blocks, enable_caching, hash_block_size=block_size, trace=trace
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


class UnitaryKVCacheCoordinator(KVCacheCoordinator):
    """Exactly one KV cache group: every layer shares one block table."""

    def __init__(
        self,
        kv_cache_config: KVCacheConfig,
        enable_caching: bool,
        trace: KVCacheTrace = KVCacheTrace.NULL,
    ) -> None:
        super().__init__(kv_cache_config, enable_caching, trace)
        self.kv_cache_spec = kv_cache_config.kv_cache_groups[0].kv_cache_spec
        self.block_size = self.kv_cache_spec.block_size

    def find_longest_cache_hit(
        self, block_hashes: Sequence[BlockHash], max_cache_hit_length: int
    ) -> tuple[tuple[list[KVCacheBlock], ...], int]:
        hit_blocks = self.single_type_managers[0].find_longest_cache_hit(
            block_hashes=block_hashes,
            max_length=max_cache_hit_length,
            kv_cache_group_ids=[0],
            block_pool=self.block_pool,
            kv_cache_spec=self.kv_cache_spec,
        )
        return hit_blocks, len(hit_blocks[0]) * self.block_size


def get_kv_cache_coordinator(
    kv_cache_config: KVCacheConfig, enable_caching: bool, trace: KVCacheTrace = KVCacheTrace.NULL
) -> KVCacheCoordinator:
    if len(kv_cache_config.kv_cache_groups) != 1:
        raise ValueError(
            f"Glassbox supports exactly one KV cache group, got "
            f"{len(kv_cache_config.kv_cache_groups)} (hybrid attention is not implemented)"
        )
    return UnitaryKVCacheCoordinator(kv_cache_config, enable_caching, trace)
