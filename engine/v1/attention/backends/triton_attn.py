"""Paged attention in Triton: the default GPU backend when FlashInfer is absent.

vLLM twin: ``vllm/v1/attention/backends/triton_attn.py``
(``TritonAttentionBackend``, ``TritonAttentionMetadata``,
``TritonAttentionMetadataBuilder``, ``TritonAttentionImpl``).
Read it for the same three roles as ``cpu_attn.py`` with the work moved onto
the device:

  * ``build`` (once per step) does no computation at all: it hands the
    runner's device tensors to the kernels and decides nothing per request;
  * ``forward`` (per layer) launches ``triton_reshape_and_cache_flash`` to
    write the new K/V, then either ``unified_attention`` (any batch) or, for a
    small batch of pure decodes, the split-KV ``decode_attention_fwd``.

Batch order: as vLLM's, the builder leaves ``reorder_batch_threshold`` None --
the unified kernel takes decodes and prefills mixed in any order, so the
runner does not reorder the batch for it.

Sessions: 05 (attention backends), 06 (CUDA graphs).

CUDA graphs (``supports_cudagraph = True``). ``forward`` makes no host
synchronisation and reads no CPU tensor: launch grids come from shapes and
from host ints the runner already has (``num_actual_tokens``, ``num_reqs``,
``max_query_len``); every per-request value is read by the kernels from
device memory. To capture a decode step and replay it the runner must
  1. keep ``query_start_loc``, ``seq_lens``, ``block_table_tensor`` and
     ``slot_mapping`` as views of persistent buffers (fixed addresses), and
     copy each step's values into them before replay;
  2. pad the batch to the captured size: padding tokens get slot -1 (their
     K/V are not written) and padding requests either length 0
     (``query_start_loc`` repeats) or length 1 with ``seq_len`` 0 -- both
     leave real rows untouched; ``num_reqs``/``num_actual_tokens`` in the
     metadata are the padded sizes, constant per graph;
  3. run one eager step of that path before capture, so the split-KV
     workspace (allocated once, on first use, shared by all layers) exists
     and capture records no allocation;
  4. keep the kernel choice fixed per graph: it depends only on
     ``max_query_len == 1`` and ``num_reqs <= split_kv_max_reqs``, both
     constant for a captured decode batch size.

Simpler than vLLM: no cascade attention, sliding window, ALiBi, sinks,
soft-cap, FP8 / quantised KV cache or encoder attention; K/V write and
attention are one ``forward`` call (vLLM splits out ``do_kv_cache_update``);
our cache layout is ``[2, num_blocks, block_size, H_kv, D]`` (K/V first) for
every backend, where vLLM's Triton backend puts the block first.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from engine.v1.attention.backend import (
    AttentionBackend,
    AttentionCGSupport,
    AttentionImpl,
    AttentionMetadataBuilder,
    CommonAttentionMetadata,
)
from engine.v1.attention.ops import (
    triton_decode_attention,
    triton_reshape_and_cache_flash,
    triton_unified_attention,
)

# The unified kernel launches (query blocks x KV heads) programs; a decode
# batch gives one query block per request. Below this many programs the GPU
# is under-filled and splitting each context over more programs wins (the
# same rule of thumb as vLLM's MIN_LAUNCH_GRID_SIZE_2D).
MIN_LAUNCH_GRID_SIZE_2D = 128
SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MAX_HEAD_SIZE = 256


class SplitKVWorkspace:
    """float32 scratch for split-KV decode, shared by every layer of a runner.

    Keyed by (rows, heads, splits, head_size, device) and allocated once, so a
    captured CUDA graph keeps pointing at the same memory.
    """

    def __init__(self) -> None:
        self._buffers: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}

    def get(
        self, max_reqs: int, num_heads: int, num_splits: int, head_size: int, device: torch.device
    ) -> tuple[torch.Tensor, torch.Tensor]:
        key = (max_reqs, num_heads, num_splits, head_size, str(device))
        if key not in self._buffers:
            self._buffers[key] = (
                # split_out [max_reqs, H, splits, D]: each slice's normalised partial output
                torch.empty(
                    max_reqs, num_heads, num_splits, head_size, dtype=torch.float32, device=device
                ),
                # split_lse [max_reqs, H, splits]: each slice's log2-sum-exp2 of scores
                torch.empty(max_reqs, num_heads, num_splits, dtype=torch.float32, device=device),
            )
        return self._buffers[key]


@dataclass
class TritonAttentionMetadata:
    num_actual_tokens: int  # tokens in the batch (padded size under CUDA graphs)
    num_reqs: int
    max_query_len: int
    max_seq_len: int
    query_start_loc: torch.Tensor  # [num_reqs + 1] int32, device
    seq_lens: torch.Tensor  # [num_reqs] int32, device
    block_table: torch.Tensor  # [num_reqs, max_blocks] int32, device
    slot_mapping: torch.Tensor  # [num_actual_tokens] int64, device; -1 = padding
    causal: bool
    split_kv_workspace: SplitKVWorkspace = field(repr=False)


class TritonAttentionMetadataBuilder(AttentionMetadataBuilder):
    # The unified kernel's launch depends only on host ints that are fixed for
    # a uniform batch (num_reqs, max_query_len): drafts' 1 + k tokens too.
    cudagraph_support = AttentionCGSupport.UNIFORM_BATCH

    def __init__(self, block_size: int, device: torch.device) -> None:
        super().__init__(block_size, device)
        self.split_kv_workspace = SplitKVWorkspace()

    def build(self, common: CommonAttentionMetadata) -> TritonAttentionMetadata:
        # No per-request work and no CPU tensors: everything the kernels need
        # is already on the device. Slicing keeps views of the runner's buffers.
        block_table = common.block_table_tensor[: common.num_reqs]
        if block_table.dtype != torch.int32:
            raise ValueError(f"block_table_tensor must be int32, got {block_table.dtype}")
        return TritonAttentionMetadata(
            num_actual_tokens=common.num_actual_tokens,
            num_reqs=common.num_reqs,
            max_query_len=common.max_query_len,
            max_seq_len=common.max_seq_len,
            query_start_loc=common.query_start_loc[: common.num_reqs + 1],
            seq_lens=common.seq_lens[: common.num_reqs],
            block_table=block_table,
            slot_mapping=common.slot_mapping[: common.num_actual_tokens],
            causal=common.causal,
            split_kv_workspace=self.split_kv_workspace,
        )


class TritonAttentionImpl(AttentionImpl):
    def __init__(self, num_heads: int, head_size: int, scale: float, num_kv_heads: int) -> None:
        super().__init__(num_heads, head_size, scale, num_kv_heads)
        if not 1 <= head_size <= MAX_HEAD_SIZE:
            raise ValueError(
                f"TRITON_ATTN supports head_size in [1, {MAX_HEAD_SIZE}], got {head_size}"
            )
        # Decode-only batches of at most this many requests use split-KV decode
        # (fewer than MIN_LAUNCH_GRID_SIZE_2D unified programs). Tests set it to
        # 0 to force the unified kernel, or raise it to force split-KV.
        self.split_kv_max_reqs = MIN_LAUNCH_GRID_SIZE_2D // num_kv_heads
        self.num_kv_splits = triton_decode_attention.NUM_KV_SPLITS

    def use_split_kv(self, md: TritonAttentionMetadata) -> bool:
        # Host ints only, fixed for a captured decode batch size. (A one-token
        # query is the last position: causal or not, it sees the whole context.)
        return md.max_query_len == 1 and md.num_reqs <= self.split_kv_max_reqs

    def forward(
        self,
        layer: torch.nn.Module,
        query: torch.Tensor,  # [T, num_heads, head_size]
        key: torch.Tensor,  # [T, num_kv_heads, head_size]
        value: torch.Tensor,  # [T, num_kv_heads, head_size]
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_size]
        attn_metadata: TritonAttentionMetadata | None,
        output: torch.Tensor,  # [T, num_heads, head_size]
    ) -> torch.Tensor:
        if attn_metadata is None:
            # Profiling / dummy run: no KV cache to read or write.
            return output.zero_()
        md = attn_metadata
        if query.dtype not in SUPPORTED_DTYPES:
            raise ValueError(f"TRITON_ATTN supports dtypes {SUPPORTED_DTYPES}, got {query.dtype}")
        n = md.num_actual_tokens
        key_cache, value_cache = kv_cache.unbind(0)  # each [num_blocks, block_size, H_kv, D]

        # 1. Write this step's K/V into their slots.
        triton_reshape_and_cache_flash.triton_reshape_and_cache_flash(
            key, value, key_cache, value_cache, md.slot_mapping
        )

        # 2. Attend.
        if self.use_split_kv(md):
            split_out, split_lse = md.split_kv_workspace.get(
                self.split_kv_max_reqs,
                self.num_heads,
                self.num_kv_splits,
                self.head_size,
                query.device,
            )
            triton_decode_attention.decode_attention_fwd(
                query[:n],
                key_cache,
                value_cache,
                output[:n],
                md.query_start_loc,
                md.seq_lens,
                md.block_table,
                split_out,
                split_lse,
                self.scale,
                num_reqs=md.num_reqs,
            )
        else:
            triton_unified_attention.unified_attention(
                q=query[:n],
                k=key_cache,
                v=value_cache,
                out=output[:n],
                cu_seqlens_q=md.query_start_loc,
                max_seqlen_q=md.max_query_len,
                seqused_k=md.seq_lens,
                softmax_scale=self.scale,
                causal=md.causal,
                block_table=md.block_table,
                num_seqs=md.num_reqs,
            )
        return output


class TritonAttentionBackend(AttentionBackend):
    # forward never syncs with the host; see the module docstring for what
    # capture additionally needs from the runner.
    supports_cudagraph = True

    @staticmethod
    def get_name() -> str:
        return "TRITON_ATTN"

    @staticmethod
    def get_impl_cls() -> type[AttentionImpl]:
        return TritonAttentionImpl

    @staticmethod
    def get_builder_cls() -> type[AttentionMetadataBuilder]:
        return TritonAttentionMetadataBuilder
