"""Paged attention through FlashInfer: the default GPU backend when it is installed.

vLLM twin: ``vllm/v1/attention/backends/flashinfer.py`` (``FlashInferBackend``,
``FlashInferMetadata``, ``FlashInferMetadataBuilder``, ``FlashInferImpl``).
Read it for FlashInfer's split of the work into *plan* and *run*:

  * ``FlashInferMetadataBuilder.build`` (once per step) turns the step's
    layout into FlashInfer's CSR page description -- ``paged_kv_indptr``
    (where each request's pages start in ``paged_kv_indices``),
    ``paged_kv_indices`` (the block ids, request after request) and
    ``paged_kv_last_page_len`` (how many slots of each request's last block
    are used) -- and calls the wrapper's ``plan()``: FlashInfer decides on the
    host how to tile and split the work and copies that schedule to the GPU;
  * ``FlashInferImpl.forward`` (per layer) writes this step's K/V through the
    slot mapping (our Triton ``triton_reshape_and_cache_flash`` kernel) and
    calls ``run()``, which reuses the plan -- all layers share one plan.

Which wrapper: ``BatchDecodeWithPagedKVCacheWrapper`` for a batch of pure
decodes (every request has one query token), otherwise
``BatchPrefillWithPagedKVCacheWrapper`` for the whole batch -- prefills,
prefills after a prefix-cache hit, chunks and the decodes mixed in with them
(a causal mask aligned to the end of each context covers them all).

Cache layout: the same ``[2, num_blocks, block_size, H_kv, D]`` as every
Glassbox backend. ``kv_cache.unbind(0)`` gives FlashInfer's "NHD" pair
``(k_cache, v_cache)``, each ``[num_pages, page_size, H_kv, D]``, which
``run()`` accepts as a tuple, so one cache serves all three backends (vLLM's
FlashInfer backend stores ``[num_blocks, 2, ...]`` instead, a layout choice).

CUDA graphs (FULL_DECODE_ONLY, ``supports_cudagraph = True``). A decode
wrapper built with ``use_cuda_graph=True`` keeps its ``indptr``, ``indices``
and ``last_page_len`` in buffers it was given at construction, and its batch
size is fixed, so the builder keeps one such wrapper per captured batch size
(``bind_layers`` tells it the sizes). For a captured size the builder plans
that wrapper *before* the graph is replayed: ``plan()`` copies the step's
page table into the fixed buffers and the schedule into the wrapper's
workspace, then the replayed ``run()`` kernels read them. Padding requests
of a padded batch get one page, the null block 0 (never written), with one
used slot, so they read valid memory and write nothing (their slot is -1).

Loaded only where FlashInfer can get its kernels: the wheel compiles them on
first use (nvcc + ninja) unless ``flashinfer-jit-cache`` provides them, so
without either the module raises ImportError and the selector picks
TRITON_ATTN. The first step of each new shape pays that compile once.

Supported: fp16 and bf16 (FlashInfer has no fp32 kernels; the selector picks
TRITON_ATTN for fp32), head sizes 64, 128 and 256, and the same head counts
and scale in every layer (one plan serves all layers).

Batch order: the builder sets ``reorder_batch_threshold = 1`` as vLLM's
does, so the runner puts a mixed batch's decodes (one query token) first.

Simpler than vLLM: no cascade attention, TRT-LLM kernels, FP8/NVFP4 KV cache,
sliding window, sinks, soft-cap, DCP, or speculative verification rows as
decodes (they take the prefill wrapper); the reordered
mixed batch is not split -- it goes to the prefill wrapper whole, where vLLM
plans its leading decodes on the decode wrapper and the rest on the prefill
wrapper.
Sessions: 05 (attention backends), 06 (CUDA graphs).
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from engine.v1.attention.backend import (
    AttentionBackend,
    AttentionCGSupport,
    AttentionImpl,
    AttentionMetadataBuilder,
    CommonAttentionMetadata,
)

try:
    import flashinfer
    from flashinfer import (
        BatchDecodeWithPagedKVCacheWrapper,
        BatchPrefillWithPagedKVCacheWrapper,
    )
except ImportError as e:  # the selector falls back to TRITON_ATTN
    raise ImportError(f"the FLASHINFER attention backend needs the flashinfer package ({e})") from e

# Below the flashinfer import: without flashinfer the module stops above, before importing Triton.
from engine.v1.attention.ops.triton_reshape_and_cache_flash import (
    triton_reshape_and_cache_flash,
)


def _why_kernels_unavailable() -> str | None:
    """None when FlashInfer can get its kernels on this machine, else why not.

    The ``flashinfer-python`` wheel ships sources: each kernel is compiled on
    first use (nvcc, driven by ninja) unless the ``flashinfer-jit-cache``
    package provides it prebuilt. Without either, importing succeeds but the
    first ``plan()`` fails, so the backend refuses to load instead and the
    selector picks TRITON_ATTN.
    """
    try:
        from flashinfer.jit.env import has_flashinfer_jit_cache

        if has_flashinfer_jit_cache():
            return None
    except ImportError:
        pass
    cuda_home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    nvcc_candidates = [
        os.environ.get("FLASHINFER_NVCC"),
        shutil.which("nvcc"),
        "/usr/local/cuda/bin/nvcc",
    ]
    if cuda_home:
        nvcc_candidates.append(os.path.join(cuda_home, "bin", "nvcc"))
    if not any(c and os.path.exists(c) for c in nvcc_candidates):
        return "no nvcc to compile its kernels (and no flashinfer-jit-cache)"
    if shutil.which("ninja") is None:
        return "no ninja to drive its kernel builds (and no flashinfer-jit-cache)"
    return None


_reason = _why_kernels_unavailable()
if _reason is not None:
    raise ImportError(
        f"FlashInfer {getattr(flashinfer, '__version__', '?')} cannot run here: {_reason}"
    )

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16)
SUPPORTED_HEAD_SIZES = (64, 128, 256)
# FlashInfer keeps split-KV partial results here; one buffer for every
# wrapper of a runner (FlashInfer recommends 128 MiB; decode at batch 256
# with long contexts wants more).
WORKSPACE_BUFFER_SIZE = 256 * 1024 * 1024
# The null block: never handed to a request, so padding requests may read it.
NULL_BLOCK_ID = 0


@dataclass(frozen=True)
class FlashInferLayerParams:
    """What ``plan()`` needs to know about the layers it plans for."""

    num_qo_heads: int
    num_kv_heads: int
    head_size: int
    sm_scale: float
    dtype: torch.dtype


@dataclass
class FlashInferMetadata:
    num_actual_tokens: int  # query rows of the step (the padded size under a CUDA graph)
    slot_mapping: torch.Tensor  # [num_actual_tokens] int64, device; -1 = padding
    num_reqs: int  # requests planned for (padding requests included)
    num_decodes: int  # requests with one query token (all of them on the decode path)
    num_prefills: int  # requests with more than one
    # Exactly one of the two is set: the wrapper this step was planned on.
    prefill_wrapper: Any | None
    decode_wrapper: Any | None
    # True when decode_wrapper is a fixed-size CUDA-graph wrapper.
    uses_cudagraph_wrapper: bool = False


class FlashInferMetadataBuilder(AttentionMetadataBuilder):
    reorder_batch_threshold: int = 1
    # Graphs replay its fixed-size decode wrappers: one query token per request.
    cudagraph_support = AttentionCGSupport.UNIFORM_SINGLE_TOKEN_DECODE

    def __init__(self, block_size: int, device: torch.device) -> None:
        super().__init__(block_size, device)
        # Decodes first (vLLM raises it for drafts when TRT-LLM decodes them).
        self._init_reorder_batch_threshold(1)
        self.params: FlashInferLayerParams | None = None
        self.cudagraph_batch_sizes: frozenset[int] = frozenset()
        self._workspace_buffer: torch.Tensor | None = None
        self._prefill_wrapper: Any | None = None
        self._decode_wrapper: Any | None = None
        # batch size -> CUDA-graph decode wrapper, and the buffers they all use.
        self._decode_wrappers_cudagraph: dict[int, Any] = {}
        self._graph_indptr: torch.Tensor | None = None  # [max_size + 1] int32
        self._graph_indices: torch.Tensor | None = None  # [max_size * max_blocks] int32
        self._graph_last_page_len: torch.Tensor | None = None  # [max_size] int32

    # ------------------------------------------------------------------
    # Set-up (the runner calls this once the KV cache exists)
    # ------------------------------------------------------------------
    def bind_layers(
        self,
        layers: Iterable[Any],
        dtype: torch.dtype,
        cudagraph_batch_sizes: Iterable[int] = (),
    ) -> None:
        """Record the layers' shapes (each has ``num_heads``, ``num_kv_heads``,
        ``head_size`` and ``scale``) and the decode batch sizes that CUDA
        graphs will replay (empty when graphs are off)."""
        if dtype not in SUPPORTED_DTYPES:
            raise ValueError(
                f"FLASHINFER supports dtypes {[str(d) for d in SUPPORTED_DTYPES]}, got {dtype}; "
                "use TRITON_ATTN for float32"
            )
        shapes = {
            (layer.num_heads, layer.num_kv_heads, layer.head_size, float(layer.scale))
            for layer in layers
        }
        if not shapes:
            raise ValueError("bind_layers() got no attention layers")
        if len(shapes) > 1:
            raise ValueError(
                "FLASHINFER plans once per step for every layer, so all layers need the same "
                f"(num_heads, num_kv_heads, head_size, scale); got {sorted(shapes)}"
            )
        ((num_heads, num_kv_heads, head_size, scale),) = shapes
        if head_size not in SUPPORTED_HEAD_SIZES:
            raise ValueError(
                f"FLASHINFER supports head sizes {SUPPORTED_HEAD_SIZES}, got {head_size}"
            )
        self.params = FlashInferLayerParams(num_heads, num_kv_heads, head_size, scale, dtype)
        sizes = sorted(set(cudagraph_batch_sizes))
        if any(s < 1 for s in sizes):
            raise ValueError(f"cudagraph batch sizes must be >= 1, got {sizes}")
        self.cudagraph_batch_sizes = frozenset(sizes)

    def _get_workspace_buffer(self) -> torch.Tensor:
        if self._workspace_buffer is None:
            # FlashInfer wants it zeroed before first use.
            self._workspace_buffer = torch.zeros(
                WORKSPACE_BUFFER_SIZE, dtype=torch.uint8, device=self.device
            )
        return self._workspace_buffer

    def _get_prefill_wrapper(self) -> Any:
        if self._prefill_wrapper is None:
            self._prefill_wrapper = BatchPrefillWithPagedKVCacheWrapper(
                self._get_workspace_buffer(), "NHD"
            )
        return self._prefill_wrapper

    def _get_decode_wrapper(self, batch_size: int, use_cudagraph: bool, max_blocks: int) -> Any:
        if not use_cudagraph:
            if self._decode_wrapper is None:
                self._decode_wrapper = BatchDecodeWithPagedKVCacheWrapper(
                    self._get_workspace_buffer(), "NHD", use_tensor_cores=True
                )
            return self._decode_wrapper
        wrapper = self._decode_wrappers_cudagraph.get(batch_size)
        if wrapper is None:
            if self._graph_indices is None:
                # Allocated once (before the first capture): captured graphs
                # keep these addresses. Every graph wrapper uses prefixes of them.
                max_size = max(self.cudagraph_batch_sizes)
                self._graph_indptr = torch.zeros(
                    max_size + 1, dtype=torch.int32, device=self.device
                )
                self._graph_indices = torch.zeros(
                    max_size * max_blocks, dtype=torch.int32, device=self.device
                )
                self._graph_last_page_len = torch.ones(
                    max_size, dtype=torch.int32, device=self.device
                )
            assert self._graph_indptr is not None and self._graph_last_page_len is not None
            wrapper = BatchDecodeWithPagedKVCacheWrapper(
                self._get_workspace_buffer(),
                "NHD",
                use_cuda_graph=True,
                use_tensor_cores=True,
                paged_kv_indptr_buffer=self._graph_indptr[: batch_size + 1],
                paged_kv_indices_buffer=self._graph_indices,
                paged_kv_last_page_len_buffer=self._graph_last_page_len[:batch_size],
            )
            self._decode_wrappers_cudagraph[batch_size] = wrapper
        return wrapper

    # ------------------------------------------------------------------
    # Once per step
    # ------------------------------------------------------------------
    def build(self, common: CommonAttentionMetadata) -> FlashInferMetadata:
        if self.params is None:
            raise RuntimeError(
                "FlashInferMetadataBuilder.bind_layers() must be called before build()"
            )
        p = self.params
        bs = self.block_size
        num_rows = common.num_reqs  # padded under a CUDA graph
        # The CPU copies cover the real requests only; rows past them are padding.
        seq_lens = common.seq_lens_cpu.numpy().astype(np.int64)
        qsl = common.query_start_loc_cpu.numpy().astype(np.int64)
        num_real = len(seq_lens)
        if num_real > num_rows or len(qsl) != num_real + 1:
            raise ValueError(
                f"seq_lens_cpu has {num_real} rows and query_start_loc_cpu {len(qsl)}, "
                f"for num_reqs={num_rows}"
            )
        query_lens = qsl[1:] - qsl[:-1]
        pure_decode = common.max_query_len == 1 and common.num_actual_tokens == num_rows
        num_decodes = int((query_lens == 1).sum()) + (num_rows - num_real)

        # CSR page table. Request i uses pages[i] blocks, the first pages[i]
        # entries of its block-table row; its last block holds last_len[i] slots.
        pages = -(-seq_lens // bs)
        last_len = seq_lens - (pages - 1) * bs
        empty = pages == 0  # (padding) a request with no context: give it the null block
        pages[empty], last_len[empty] = 1, 1
        num_pad = num_rows - num_real
        pages = np.concatenate([pages, np.ones(num_pad, dtype=np.int64)])
        last_len = np.concatenate([last_len, np.ones(num_pad, dtype=np.int64)])
        indptr = np.zeros(num_rows + 1, dtype=np.int32)
        np.cumsum(pages, out=indptr[1:])
        indices = self._gather_page_indices(
            common.block_table_tensor, seq_lens, pages[:num_real], num_pad
        )

        indptr_t = torch.from_numpy(indptr)
        last_len_t = torch.from_numpy(last_len.astype(np.int32))
        if pure_decode:
            use_cudagraph = num_rows in self.cudagraph_batch_sizes
            wrapper = self._get_decode_wrapper(
                num_rows, use_cudagraph, max_blocks=common.block_table_tensor.shape[1]
            )
            wrapper.plan(
                indptr_t,
                indices,
                last_len_t,
                p.num_qo_heads,
                p.num_kv_heads,
                p.head_size,
                bs,
                q_data_type=p.dtype,
                kv_data_type=p.dtype,
                sm_scale=p.sm_scale,
            )
            return FlashInferMetadata(
                num_actual_tokens=common.num_actual_tokens,
                slot_mapping=common.slot_mapping[: common.num_actual_tokens],
                num_reqs=num_rows,
                num_decodes=num_rows,
                num_prefills=0,
                prefill_wrapper=None,
                decode_wrapper=wrapper,
                uses_cudagraph_wrapper=use_cudagraph,
            )
        if num_pad:
            raise ValueError("only pure-decode batches may carry padding requests")
        wrapper = self._get_prefill_wrapper()
        wrapper.plan(
            torch.from_numpy(qsl.astype(np.int32)),
            indptr_t,
            indices,
            last_len_t,
            p.num_qo_heads,
            p.num_kv_heads,
            p.head_size,
            bs,
            causal=common.causal,
            sm_scale=p.sm_scale,
            q_data_type=p.dtype,
            kv_data_type=p.dtype,
        )
        return FlashInferMetadata(
            num_actual_tokens=common.num_actual_tokens,
            slot_mapping=common.slot_mapping[: common.num_actual_tokens],
            num_reqs=num_rows,
            num_decodes=num_decodes,
            num_prefills=num_rows - num_decodes,
            prefill_wrapper=wrapper,
            decode_wrapper=None,
        )

    def _gather_page_indices(
        self, block_table: torch.Tensor, seq_lens: np.ndarray, pages: np.ndarray, num_pad: int
    ) -> torch.Tensor:
        """``paged_kv_indices`` on the device: each real request's first
        ``pages[i]`` block-table entries, then one null block per padding request.

        The block table lives on the device only, so the host computes flat
        positions into it (row * width + column) and the device gathers.
        """
        width = block_table.shape[1]
        rows = np.repeat(np.arange(len(pages), dtype=np.int64), pages)
        starts = np.repeat(np.cumsum(pages) - pages, pages)
        cols = np.arange(len(rows), dtype=np.int64) - starts
        flat = torch.from_numpy(rows * width + cols).to(self.device, non_blocking=True)
        indices = block_table.reshape(-1)[flat]
        # Requests with no context (seq_len 0) read the null block instead.
        if (seq_lens == 0).any():
            empty_pos = np.flatnonzero(np.repeat(seq_lens == 0, pages))
            indices[torch.from_numpy(empty_pos).to(self.device)] = NULL_BLOCK_ID
        if num_pad:
            pad = torch.full((num_pad,), NULL_BLOCK_ID, dtype=indices.dtype, device=self.device)
            indices = torch.cat([indices, pad])
        return indices.to(torch.int32)


class FlashInferImpl(AttentionImpl):
    def __init__(self, num_heads: int, head_size: int, scale: float, num_kv_heads: int) -> None:
        super().__init__(num_heads, head_size, scale, num_kv_heads)
        if head_size not in SUPPORTED_HEAD_SIZES:
            raise ValueError(
                f"FLASHINFER supports head sizes {SUPPORTED_HEAD_SIZES}, got {head_size}"
            )

    def forward(
        self,
        layer: torch.nn.Module,
        query: torch.Tensor,  # [T, num_heads, head_size]
        key: torch.Tensor,  # [T, num_kv_heads, head_size]
        value: torch.Tensor,  # [T, num_kv_heads, head_size]
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_size]
        attn_metadata: FlashInferMetadata | None,
        output: torch.Tensor,  # [T, num_heads, head_size]
    ) -> torch.Tensor:
        if attn_metadata is None:
            # Profiling / dummy run: no KV cache to read or write.
            return output.zero_()
        md = attn_metadata
        if query.dtype not in SUPPORTED_DTYPES:
            raise ValueError(f"FLASHINFER supports dtypes {SUPPORTED_DTYPES}, got {query.dtype}")
        n = md.num_actual_tokens
        key_cache, value_cache = kv_cache.unbind(0)  # each [num_blocks, block_size, H_kv, D]: "NHD"

        # 1. Write this step's K/V into their slots (slot -1: padding, skipped).
        triton_reshape_and_cache_flash(key, value, key_cache, value_cache, md.slot_mapping)

        # 2. Attend with the plan made in build().
        wrapper = md.decode_wrapper if md.decode_wrapper is not None else md.prefill_wrapper
        wrapper.run(query[:n].contiguous(), (key_cache, value_cache), out=output[:n])
        return output


class FlashInferBackend(AttentionBackend):
    # Decode steps replay through fixed-size wrappers (see the module docstring).
    supports_cudagraph = True

    @staticmethod
    def get_name() -> str:
        return "FLASHINFER"

    @staticmethod
    def get_impl_cls() -> type[AttentionImpl]:
        return FlashInferImpl

    @staticmethod
    def get_builder_cls() -> type[AttentionMetadataBuilder]:
        return FlashInferMetadataBuilder

    @staticmethod
    def get_supported_dtypes() -> tuple[torch.dtype, ...]:
        return SUPPORTED_DTYPES

    @staticmethod
    def get_supported_head_sizes() -> tuple[int, ...]:
        return SUPPORTED_HEAD_SIZES

    @staticmethod
    def get_version() -> str:
        return getattr(flashinfer, "__version__", "unknown")
