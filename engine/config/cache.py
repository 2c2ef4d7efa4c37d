"""CacheConfig: how the paged KV cache is cut up.

vLLM twin: ``vllm/config/cache.py`` (``CacheConfig``).
Read it for: ``block_size``, ``enable_prefix_caching``, ``num_gpu_blocks_override``
and ``gpu_memory_utilization`` -- the four knobs that decide how many KV blocks
exist and whether finished prompts stay reusable.
Sessions: 03 (KV cache).

Simpler than vLLM: no cache dtypes other than the model dtype, no CPU offload
or swap space, one hash function (sha256 over pickle, see kv_cache_utils).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class CacheConfig:
    block_size: int = 16
    """Tokens per KV block. vLLM's default on CUDA is 16; its CPU platform picks 128
    when the user sets none, Glassbox keeps 16 there so block tables stay readable."""

    gpu_memory_utilization: float = 0.92
    """Fraction of device memory the engine may use (weights + activations + KV);
    0.92 as in vLLM."""

    enable_prefix_caching: bool = True
    """Keep full blocks addressable by their hash after a request frees them."""

    num_gpu_blocks_override: int | None = None
    """Total number of KV blocks, the null block included. Skips memory profiling."""

    kv_cache_memory_bytes: int | None = None
    """KV cache size in bytes. On CUDA it replaces the gpu_memory_utilization
    budget; on the CPU it replaces GLASSBOX_CPU_KVCACHE_SPACE (GiB, default 1),
    the twin of vLLM's VLLM_CPU_KVCACHE_SPACE."""

    prefix_caching_hash_algo: str = "sha256"

    # Filled in by EngineCore._initialize_kv_caches once the pool is sized.
    num_gpu_blocks: int | None = None

    def __post_init__(self) -> None:
        if (
            not isinstance(self.block_size, int)
            or isinstance(self.block_size, bool)
            or self.block_size <= 0
        ):
            raise ValueError(f"block_size must be a positive integer, got {self.block_size!r}")
        if (
            not isinstance(self.gpu_memory_utilization, (int, float))
            or isinstance(self.gpu_memory_utilization, bool)
            or not 0.0 < self.gpu_memory_utilization <= 1.0
        ):
            raise ValueError(
                f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization!r}"
            )
        if self.num_gpu_blocks_override is not None and (
            not isinstance(self.num_gpu_blocks_override, int) or self.num_gpu_blocks_override < 2
        ):
            raise ValueError(
                "num_gpu_blocks_override must be an integer >= 2 (block 0 is the "
                f"reserved null block), got {self.num_gpu_blocks_override!r}"
            )
        if self.kv_cache_memory_bytes is not None and (
            not isinstance(self.kv_cache_memory_bytes, int) or self.kv_cache_memory_bytes <= 0
        ):
            raise ValueError(
                "kv_cache_memory_bytes must be a positive integer, "
                f"got {self.kv_cache_memory_bytes!r}"
            )
        if self.prefix_caching_hash_algo != "sha256":
            raise ValueError(
                "prefix_caching_hash_algo must be 'sha256' (the only one Glassbox "
                f"implements), got {self.prefix_caching_hash_algo!r}"
            )
