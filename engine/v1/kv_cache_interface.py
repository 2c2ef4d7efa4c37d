"""What a KV cache looks like, described without any tensors.

vLLM twin: ``vllm/v1/kv_cache_interface.py``.
Read it for: ``FullAttentionSpec.page_size_bytes`` (bytes one block costs in one
layer: K and V, ``block_size`` tokens, every KV head) and ``KVCacheConfig`` (how
many blocks the pool has and which layers share them). The scheduler only ever
sees block ids; the worker turns this config into real tensors.
Sessions: 03 (KV cache), 04 (worker).

Simpler than vLLM: one spec type (full attention); dtypes are named by string
so this module stays torch-free.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field

DTYPE_SIZES = {"float32": 4, "float16": 2, "bfloat16": 2, "float8_e4m3fn": 1}


@dataclass(frozen=True)
class KVCacheSpec(ABC):
    """One layer's KV cache format; each attention type subclasses it."""

    block_size: int

    @property
    @abstractmethod
    def page_size_bytes(self) -> int:
        """Bytes one block of ``block_size`` tokens takes in this layer."""

    @abstractmethod
    def max_memory_usage_bytes(self, max_model_len: int) -> int:
        """Bytes this layer's cache needs for one request of ``max_model_len`` tokens."""


@dataclass(frozen=True)
class FullAttentionSpec(KVCacheSpec):
    num_kv_heads: int
    head_size: int
    dtype: str = "float32"

    def __post_init__(self) -> None:
        if self.dtype not in DTYPE_SIZES:
            raise ValueError(f"dtype must be one of {sorted(DTYPE_SIZES)}, got {self.dtype!r}")

    @property
    def page_size_bytes(self) -> int:
        # 2 = one K page + one V page.
        return 2 * self.block_size * self.num_kv_heads * self.head_size * DTYPE_SIZES[self.dtype]

    def max_memory_usage_bytes(self, max_model_len: int) -> int:
        num_blocks = -(-max_model_len // self.block_size)
        return num_blocks * self.page_size_bytes


@dataclass
class KVCacheTensor:
    """One backing buffer of ``size`` bytes, used by the layers in ``shared_by``."""

    size: int
    shared_by: list[str]


@dataclass
class KVCacheGroupSpec:
    """Layers that share one block table (all of them, for a plain decoder)."""

    layer_names: list[str]
    kv_cache_spec: KVCacheSpec


@dataclass
class KVCacheConfig:
    num_blocks: int
    kv_cache_tensors: list[KVCacheTensor] = field(default_factory=list)
    kv_cache_groups: list[KVCacheGroupSpec] = field(default_factory=list)
