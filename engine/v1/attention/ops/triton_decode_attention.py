"""Split-KV ("flash-decoding") attention for query-length-1 requests (Triton).

vLLM twin: ``vllm/v1/attention/ops/triton_decode_attention.py``
(``decode_attention_fwd``, stage-1 kernel ``_fwd_grouped_kernel_stage1``,
stage-2 kernel ``_fwd_kernel_stage2``).
Read it for why decode wants a different launch from prefill: a decode
request has one query token, so the unified kernel gives it one program per
KV head that walks the whole context alone. With a small batch that is a few
dozen programs on a GPU with 132 SMs -- most of the chip idles. Here the
context is cut into ``NUM_KV_SPLITS`` slices handled by separate programs:

  stage 1, grid ``(num_reqs, num_kv_heads, NUM_KV_SPLITS)``: each program
    attends its request's GQA group of query heads over one slice of the
    context and writes the slice's normalised partial output and its
    log-sum-exp (base 2) to a float32 workspace;
  stage 2, grid ``(num_reqs, num_query_heads)``: merge the slices, weighting
    each partial output by ``exp2(lse_s - max_s lse)``.

The slice length is computed in the kernel from ``seq_lens`` (device), so the
grid depends on shapes only and the launch can be captured in a CUDA graph;
slices past the end of a short context exit at once.
Sessions: 05 (attention backends), 06 (CUDA graphs: why decode kernels must
not depend on host values).

Simpler than vLLM: no soft-cap, no separate value head size, one grouped
stage-1 kernel for all GQA ratios (vLLM also has an ungrouped one), and the
number of splits is a fixed constant rather than tuned per batch.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.v1.attention.ops.triton_unified_attention import LOG2E

# Slices per request; a power of two (stage 2 loads them with tl.arange).
NUM_KV_SPLITS = 16


@triton.jit
def _kv_split_len(seq_len, NUM_KV_SPLITS: tl.constexpr, TILE_SIZE: tl.constexpr):
    """Length of each context slice (the last may be shorter): a whole number
    of tiles, at least one. Both stages must agree on it."""
    split_len = tl.cdiv(tl.cdiv(seq_len, NUM_KV_SPLITS), TILE_SIZE) * TILE_SIZE
    return tl.maximum(split_len, TILE_SIZE)


@triton.jit
def _fwd_grouped_kernel_stage1(
    query_ptr,  # [num_tokens, num_query_heads, head_size]
    key_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_size]
    value_cache_ptr,
    block_tables_ptr,  # [num_reqs, max_blocks_per_req] int32
    seq_lens_ptr,  # [num_reqs] int32
    query_start_loc_ptr,  # [num_reqs + 1] int32
    split_out_ptr,  # [>= num_reqs, num_query_heads, NUM_KV_SPLITS, head_size] float32
    split_lse_ptr,  # [>= num_reqs, num_query_heads, NUM_KV_SPLITS] float32
    scale,  # softmax scale * log2(e)
    query_stride_0,
    query_stride_1,
    stride_k_cache_0,
    stride_k_cache_1,
    stride_k_cache_2,
    stride_v_cache_0,
    stride_v_cache_1,
    stride_v_cache_2,
    block_table_stride,
    split_out_stride_0,
    split_out_stride_1,
    split_out_stride_2,
    split_lse_stride_0,
    split_lse_stride_1,
    num_queries_per_kv: tl.constexpr,
    BLOCK_H: tl.constexpr,  # num_queries_per_kv padded to a power of two >= 16
    BLOCK_SIZE: tl.constexpr,
    HEAD_SIZE: tl.constexpr,
    HEAD_SIZE_PADDED: tl.constexpr,
    TILE_SIZE: tl.constexpr,
    NUM_KV_SPLITS: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    # One program instance = (request, KV head, context slice). Its rows are the
    # query heads of that KV head's GQA group, all for the request's one token.
    req_idx = tl.program_id(0)
    kv_head_idx = tl.program_id(1)
    split_idx = tl.program_id(2)

    q_start = tl.load(query_start_loc_ptr + req_idx)
    if tl.load(query_start_loc_ptr + req_idx + 1) - q_start != 1:
        return  # not a decode (e.g. a zero-length padding request)
    seq_len = tl.load(seq_lens_ptr + req_idx)

    # Slice [kv_start, kv_end): equal, TILE_SIZE-aligned lengths; stage 2
    # recomputes the same split_len to know how many slices are non-empty.
    split_len = _kv_split_len(seq_len, NUM_KV_SPLITS, TILE_SIZE)
    kv_start = split_idx * split_len
    kv_end = tl.minimum(kv_start + split_len, seq_len)
    if kv_start >= kv_end:
        return

    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, HEAD_SIZE_PADDED)
    offs_t = tl.arange(0, TILE_SIZE)
    head_idx = kv_head_idx * num_queries_per_kv + offs_h
    head_mask = offs_h < num_queries_per_kv
    dim_mask = offs_d < HEAD_SIZE

    # Q tile [BLOCK_H, HEAD_SIZE_PADDED]: the group's heads of the one query token.
    q_ptrs = (
        query_ptr
        + q_start.to(tl.int64) * query_stride_0
        + head_idx[:, None] * query_stride_1
        + offs_d[None, :]
    )
    q = tl.load(q_ptrs, mask=head_mask[:, None] & dim_mask[None, :], other=0.0)

    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, HEAD_SIZE_PADDED], dtype=tl.float32)
    block_table_row = block_tables_ptr + req_idx.to(tl.int64) * block_table_stride

    # A decode's query is the last token: it sees the whole context, no causal mask.
    for tile_start in range(kv_start, kv_end, TILE_SIZE):
        kv_pos = tile_start + offs_t
        kv_mask = kv_pos < kv_end
        physical_block = tl.load(block_table_row + kv_pos // BLOCK_SIZE, mask=kv_mask, other=0).to(
            tl.int64
        )
        slot_in_block = kv_pos % BLOCK_SIZE
        # K and V tiles [TILE_SIZE, HEAD_SIZE_PADDED], gathered through the block table.
        k_offs = (
            physical_block[:, None] * stride_k_cache_0
            + slot_in_block[:, None] * stride_k_cache_1
            + kv_head_idx * stride_k_cache_2
            + offs_d[None, :]
        )
        k = tl.load(key_cache_ptr + k_offs, mask=kv_mask[:, None] & dim_mask[None, :], other=0.0)
        v_offs = (
            physical_block[:, None] * stride_v_cache_0
            + slot_in_block[:, None] * stride_v_cache_1
            + kv_head_idx * stride_v_cache_2
            + offs_d[None, :]
        )
        v = tl.load(value_cache_ptr + v_offs, mask=kv_mask[:, None] & dim_mask[None, :], other=0.0)

        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale  # [BLOCK_H, TILE_SIZE]
        s = tl.where(kv_mask[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))  # finite: each tile has >= 1 valid key
        p = tl.exp2(s - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new

    # Normalised partial output of this slice and its log2-sum-exp2.
    out_ptrs = (
        split_out_ptr
        + req_idx.to(tl.int64) * split_out_stride_0
        + head_idx[:, None] * split_out_stride_1
        + split_idx * split_out_stride_2
        + offs_d[None, :]
    )
    tl.store(out_ptrs, acc / l_i[:, None], mask=head_mask[:, None] & dim_mask[None, :])
    lse_ptrs = (
        split_lse_ptr
        + req_idx.to(tl.int64) * split_lse_stride_0
        + head_idx * split_lse_stride_1
        + split_idx
    )
    tl.store(lse_ptrs, m_i + tl.log2(l_i), mask=head_mask)


@triton.jit
def _fwd_kernel_stage2(
    split_out_ptr,  # [>= num_reqs, num_query_heads, NUM_KV_SPLITS, head_size] float32
    split_lse_ptr,  # [>= num_reqs, num_query_heads, NUM_KV_SPLITS] float32
    output_ptr,  # [num_tokens, num_query_heads, head_size]
    seq_lens_ptr,
    query_start_loc_ptr,
    output_stride_0,
    output_stride_1,
    split_out_stride_0,
    split_out_stride_1,
    split_out_stride_2,
    split_lse_stride_0,
    split_lse_stride_1,
    HEAD_SIZE: tl.constexpr,
    HEAD_SIZE_PADDED: tl.constexpr,
    TILE_SIZE: tl.constexpr,
    NUM_KV_SPLITS: tl.constexpr,
):
    # One program instance = (request, query head): merges its slices.
    req_idx = tl.program_id(0)
    head_idx = tl.program_id(1)
    q_start = tl.load(query_start_loc_ptr + req_idx)
    if tl.load(query_start_loc_ptr + req_idx + 1) - q_start != 1:
        return
    seq_len = tl.load(seq_lens_ptr + req_idx)
    split_len = _kv_split_len(seq_len, NUM_KV_SPLITS, TILE_SIZE)
    num_valid_splits = tl.cdiv(seq_len, split_len)  # only these were written by stage 1

    offs_s = tl.arange(0, NUM_KV_SPLITS)
    offs_d = tl.arange(0, HEAD_SIZE_PADDED)
    split_mask = offs_s < num_valid_splits
    dim_mask = offs_d < HEAD_SIZE

    lse_row = (
        split_lse_ptr + req_idx.to(tl.int64) * split_lse_stride_0 + head_idx * split_lse_stride_1
    )
    lse = tl.load(lse_row + offs_s, mask=split_mask, other=float("-inf"))  # [NUM_KV_SPLITS]
    lse_max = tl.max(lse, axis=0)
    lse_max = tl.where(lse_max == float("-inf"), 0.0, lse_max)  # empty context (padding)
    weight = tl.exp2(lse - lse_max)  # 0 for empty slices

    out_base = (
        split_out_ptr + req_idx.to(tl.int64) * split_out_stride_0 + head_idx * split_out_stride_1
    )
    parts = tl.load(
        out_base + offs_s[:, None] * split_out_stride_2 + offs_d[None, :],
        mask=split_mask[:, None] & dim_mask[None, :],
        other=0.0,
    )  # [NUM_KV_SPLITS, HEAD_SIZE_PADDED]
    total = tl.sum(weight, axis=0)
    merged = tl.sum(parts * weight[:, None], axis=0) / tl.where(total == 0.0, 1.0, total)

    out_ptrs = (
        output_ptr + q_start.to(tl.int64) * output_stride_0 + head_idx * output_stride_1 + offs_d
    )
    tl.store(out_ptrs, merged.to(output_ptr.dtype.element_ty), mask=dim_mask)


def decode_attention_fwd(
    q: torch.Tensor,  # [num_tokens, num_query_heads, head_size]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_size]
    v_cache: torch.Tensor,
    out: torch.Tensor,  # [num_tokens, num_query_heads, head_size], written in place
    query_start_loc: torch.Tensor,  # [num_reqs + 1] int32; every real request has length 1
    seq_lens: torch.Tensor,  # [num_reqs] int32
    block_table: torch.Tensor,  # [num_reqs, max_blocks_per_req] int32
    # workspace [>= num_reqs, num_query_heads, num_kv_splits, head_size] float32
    split_out: torch.Tensor,
    split_lse: torch.Tensor,  # workspace [>= num_reqs, num_query_heads, num_kv_splits] float32
    sm_scale: float,
    num_reqs: int | None = None,
) -> None:
    """Decode attention for a batch of query-length-1 requests, split over the context.

    Requests whose query length is not 1 are skipped (their output rows are
    left as they were); the caller routes only decode-only batches here. The
    workspaces are read and written in full rows per request, so they can be
    persistent buffers shared by all layers (layers run one after another).
    """
    num_tokens, num_query_heads, head_size = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    if num_reqs is None:
        num_reqs = query_start_loc.shape[0] - 1
    num_kv_splits = split_out.shape[2]
    if num_kv_splits & (num_kv_splits - 1):
        raise ValueError(f"the number of KV splits must be a power of two, got {num_kv_splits}")
    if (
        split_out.shape[0] < num_reqs
        or split_out.shape[1] != num_query_heads
        or split_out.shape[3] != head_size
    ):
        raise ValueError(
            f"split_out workspace {tuple(split_out.shape)} too small for {num_reqs} requests x "
            f"{num_query_heads} heads x head_size {head_size}"
        )
    if split_lse.shape != split_out.shape[:3]:
        raise ValueError(
            f"split_lse shape {tuple(split_lse.shape)} must be {tuple(split_out.shape[:3])}"
        )
    if split_out.dtype != torch.float32 or split_lse.dtype != torch.float32:
        raise ValueError("the split-KV workspaces must be float32")
    if num_reqs == 0 or num_tokens == 0:
        return
    num_queries_per_kv = num_query_heads // num_kv_heads
    head_size_padded = max(16, triton.next_power_of_2(head_size))
    tile_size = 16
    dot_precision = "ieee" if q.dtype == torch.float32 else "tf32"

    _fwd_grouped_kernel_stage1[(num_reqs, num_kv_heads, num_kv_splits)](
        q,
        k_cache,
        v_cache,
        block_table,
        seq_lens,
        query_start_loc,
        split_out,
        split_lse,
        sm_scale * LOG2E,
        q.stride(0),
        q.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        v_cache.stride(0),
        v_cache.stride(1),
        v_cache.stride(2),
        block_table.stride(0),
        split_out.stride(0),
        split_out.stride(1),
        split_out.stride(2),
        split_lse.stride(0),
        split_lse.stride(1),
        num_queries_per_kv=num_queries_per_kv,
        BLOCK_H=max(16, triton.next_power_of_2(num_queries_per_kv)),
        BLOCK_SIZE=block_size,
        HEAD_SIZE=head_size,
        HEAD_SIZE_PADDED=head_size_padded,
        TILE_SIZE=tile_size,
        NUM_KV_SPLITS=num_kv_splits,
        DOT_PRECISION=dot_precision,
    )
    _fwd_kernel_stage2[(num_reqs, num_query_heads)](
        split_out,
        split_lse,
        out,
        seq_lens,
        query_start_loc,
        out.stride(0),
        out.stride(1),
        split_out.stride(0),
        split_out.stride(1),
        split_out.stride(2),
        split_lse.stride(0),
        split_lse.stride(1),
        HEAD_SIZE=head_size,
        HEAD_SIZE_PADDED=head_size_padded,
        TILE_SIZE=tile_size,
        NUM_KV_SPLITS=num_kv_splits,
    )
