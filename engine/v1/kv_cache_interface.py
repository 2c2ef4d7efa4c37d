"""What a KV cache looks like, described without any tensors.

vLLM twin: ``vllm/v1/kv_cache_interface.py``.
Read it for: ``AttentionSpec.page_size_bytes`` (bytes one block costs in one
layer: K and V, ``block_size`` tokens, every KV head), ``max_memory_usage_bytes``
(what one ``max_model_len`` sequence needs) and ``KVCacheConfig`` (how many
blocks the pool has and which layers share them). The scheduler only ever sees
block ids; the worker turns this config into real tensors.
Sessions: 03 (KV cache), 04 (worker).

``UniformTypeKVCacheSpecs`` holds layers of one type whose pages differ in
size -- a target model and its draft model: they share one block table, and a
block costs the sum of their pages.

Simpler than vLLM: one layer spec type, ``FullAttentionSpec`` (no
sliding-window, chunked-local, MLA, Mamba, cross-attention or sink specs, and
no ``KVCacheSpecKind``), so ``UniformTypeKVCacheSpecs`` only ever groups full
attention and lacks vLLM's DeepSeek-V4 helpers (``get_page_sizes``,
``get_num_layer_tuples``, ``max_memory_usage_pages``); no quantized KV cache
(``kv_quant_mode``), no separate V head size (``head_size_v``), no
context-parallel sharding in ``max_memory_usage_bytes``.

Differs from vLLM on purpose: ``dtype`` may be a ``torch.dtype`` (as in
vLLM) or its name (``"float32"``), and is stored by name, so this module --
which the torch-free scheduler imports -- never imports torch, and a spec built
either way compares equal.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from engine.v1.utils import cdiv

if TYPE_CHECKING:
    from typing_extensions import Self

    from engine.config.glassbox import GlassboxConfig

# Bytes per element of each KV cache dtype Glassbox can hold.
DTYPE_SIZES = {"float32": 4, "float16": 2, "bfloat16": 2, "float8_e4m3fn": 1}


def dtype_name(dtype: Any) -> str:
    """``torch.float16`` or ``"float16"`` -> ``"float16"`` (no torch import)."""
    name = dtype if isinstance(dtype, str) else str(dtype).removeprefix("torch.")
    if name not in DTYPE_SIZES:
        raise ValueError(f"dtype must be one of {sorted(DTYPE_SIZES)}, got {dtype!r}")
    return name


@dataclass(frozen=True)
class KVCacheSpec(ABC):
    """One layer's KV cache format; each attention type subclasses it."""

    block_size: int

    @property
    @abstractmethod
    def page_size_bytes(self) -> int:
        """Bytes one block of ``block_size`` tokens takes in this layer."""

    @abstractmethod
    def max_memory_usage_bytes(self, glassbox_config: GlassboxConfig) -> int:
        """Bytes this layer's cache needs for one request of ``max_model_len`` tokens."""

    def copy_with_new_block_size(self, block_size: int) -> Self:
        return replace(self, block_size=block_size)

    @classmethod
    def merge(cls, specs: list[Self]) -> Self:
        """One spec for a group of layers; they must all be equal."""
        if any(spec != specs[0] for spec in specs[1:]):
            raise ValueError("All layers in the same KV cache group must be the same.")
        return specs[0]


@dataclass(frozen=True, kw_only=True)
class AttentionSpec(KVCacheSpec):
    num_kv_heads: int
    head_size: int
    # A torch.dtype or its name; stored as the name (see the module docstring).
    dtype: Any
    # Pads every page to this many bytes (vLLM: to share one page size across
    # groups of different layer types).
    page_size_padded: int | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "dtype", dtype_name(self.dtype))

    @property
    def real_page_size_bytes(self) -> int:
        # 2 = one K page + one V page.
        return 2 * self.block_size * self.num_kv_heads * self.head_size * DTYPE_SIZES[self.dtype]

    @property
    def page_size_bytes(self) -> int:
        real = self.real_page_size_bytes
        if self.page_size_padded is None:
            return real
        if self.page_size_padded < real:
            raise ValueError(
                f"page_size_padded={self.page_size_padded} is smaller than the "
                f"real page size {real}"
            )
        return self.page_size_padded


@dataclass(frozen=True, kw_only=True)
class FullAttentionSpec(AttentionSpec):
    """Every token of the sequence stays in the cache until the request ends."""

    def max_memory_usage_bytes(self, glassbox_config: GlassboxConfig) -> int:
        max_model_len = glassbox_config.model_config.max_model_len
        return cdiv(max_model_len, self.block_size) * self.page_size_bytes


@dataclass(frozen=True, kw_only=True)
class UniformTypeKVCacheSpecs(KVCacheSpec):
    """Layers of one type (here: full attention) and one block size whose pages
    may differ in size: one group, one block table, and one block id names a
    page in every layer, so a block costs the sum of the layers' pages."""

    kv_cache_specs: dict[str, KVCacheSpec]

    @property
    def page_size_bytes(self) -> int:
        return sum(spec.page_size_bytes for spec in self.kv_cache_specs.values())

    def max_memory_usage_bytes(self, glassbox_config: GlassboxConfig) -> int:
        # Pages one max_model_len sequence needs (the same count in every layer).
        max_num_pages = max(
            cdiv(spec.max_memory_usage_bytes(glassbox_config), spec.page_size_bytes)
            for spec in self.kv_cache_specs.values()
        )
        return max_num_pages * self.page_size_bytes

    @classmethod
    def is_uniform_type(cls, kv_cache_specs: dict[str, KVCacheSpec]) -> bool:
        """Same block size and all full attention (the only type Glassbox has).
        No layers: False (vLLM fails on an empty dict)."""
        specs = list(kv_cache_specs.values())
        return (
            bool(specs)
            and len({spec.block_size for spec in specs}) == 1
            and all(isinstance(spec, FullAttentionSpec) for spec in specs)
        )

    @classmethod
    def from_specs(cls, kv_cache_specs: dict[str, KVCacheSpec]) -> UniformTypeKVCacheSpecs | None:
        """The layers as one spec, or None when they are not of one type."""
        if not cls.is_uniform_type(kv_cache_specs):
            return None
        block_size = next(iter(kv_cache_specs.values())).block_size
        return cls(block_size=block_size, kv_cache_specs=dict(kv_cache_specs))


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
