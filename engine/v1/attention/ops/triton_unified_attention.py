"""Paged attention for every request shape in one Triton kernel.

vLLM twin: ``vllm/v1/attention/ops/triton_unified_attention.py``
(``unified_attention``, ``kernel_unified_attention``; the binary search
``find_seq_idx`` lives in vLLM's ``triton_attention_helpers.py``).
Read it for how one kernel serves a whole V1 batch -- prefills, prefills after
a prefix-cache hit, chunked prefills and decodes, mixed -- with nothing
computed on the host per request:

  * the grid is ``(num_q_blocks, num_kv_heads)``, where ``num_q_blocks`` is an
    upper bound computed from *shapes* only (``num_tokens // BLOCK_Q +
    num_reqs``), so no per-request lengths are copied to the host;
  * each program finds its request by binary search over ``query_start_loc``,
    loads ``BLOCK_Q`` query tokens x the ``num_queries_per_kv`` query heads
    that share its KV head (GQA: the K/V tile is loaded once for all of them),
    then walks the request's KV blocks through its block-table row with an
    online softmax (flash attention: running max, running sum, rescaled
    accumulator);
  * causality is shifted by the context already cached: query row ``j`` of a
    request with ``seq_len`` tokens and ``query_len`` new ones sits at absolute
    position ``seq_len - query_len + j`` and sees keys ``0 .. that position``.

Sessions: 05 (attention backends).

Simpler than vLLM: no sliding window, ALiBi, soft-cap, sinks, FP8 or
quantised KV, multimodal prefix ranges, tensor descriptors, and no 3-D
(segmented) variant -- our split-KV decode is the separate
``triton_decode_attention.py``. The block-size choice is one line (a bigger
query block when any request has many query tokens) rather than vLLM's tuned
table.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# exp(x) == exp2(x * log2(e)); the kernels work in base 2 (exp2 is one
# hardware instruction), so the softmax scale is pre-multiplied by log2(e).
LOG2E = 1.4426950408889634


@triton.jit
def find_seq_idx(
    query_start_loc_ptr,  # [num_seqs + 1] int32
    q_block_global_idx,  # this program's index along grid axis 0
    num_seqs,
    BLOCK_Q: tl.constexpr,
):
    """The request that owns query block ``q_block_global_idx``.

    Request i's query blocks are numbered from ``query_start_loc[i] // BLOCK_Q
    + i`` (see ``unified_attention`` for why that leaves room for all of them);
    that start is non-decreasing in i, so binary-search the last request whose
    first block is <= ours.
    """
    lo = 0
    hi = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        first_block = tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid
        if first_block <= q_block_global_idx:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


@triton.jit
def kernel_unified_attention(
    output_ptr,  # [num_tokens, num_query_heads, head_size]
    query_ptr,  # [num_tokens, num_query_heads, head_size]
    key_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_size]
    value_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_size]
    block_tables_ptr,  # [num_seqs, max_blocks_per_seq] int32
    seq_lens_ptr,  # [num_seqs] int32: context length after this step
    query_start_loc_ptr,  # [num_seqs + 1] int32
    scale,  # softmax scale * log2(e)
    num_seqs,
    query_stride_0,
    query_stride_1,
    output_stride_0,
    output_stride_1,
    stride_k_cache_0,  # between blocks
    stride_k_cache_1,  # between slots of a block
    stride_k_cache_2,  # between kv heads
    stride_v_cache_0,
    stride_v_cache_1,
    stride_v_cache_2,
    block_table_stride,
    num_queries_per_kv: tl.constexpr,  # query heads per KV head (GQA group)
    BLOCK_SIZE: tl.constexpr,  # tokens per KV cache block
    HEAD_SIZE: tl.constexpr,
    HEAD_SIZE_PADDED: tl.constexpr,  # next power of two >= max(HEAD_SIZE, 16)
    TILE_SIZE: tl.constexpr,  # keys per loop iteration (may span several blocks)
    BLOCK_Q: tl.constexpr,  # query tokens per program
    BLOCK_M: tl.constexpr,  # rows per program = BLOCK_Q * num_queries_per_kv, padded to pow2
    CAUSAL: tl.constexpr,
    # "ieee" for fp32 (no TF32 rounding), else "tf32" (unused for 16-bit)
    DOT_PRECISION: tl.constexpr,
):
    # One program instance = (query block of one request, one KV head).
    # Rows m = 0..BLOCK_M-1 of its tile are (query token, query head) pairs:
    #   token = m // num_queries_per_kv,
    #   head = kv_head * num_queries_per_kv + m % num_queries_per_kv.
    q_block_global_idx = tl.program_id(0)
    kv_head_idx = tl.program_id(1)

    seq_idx = find_seq_idx(query_start_loc_ptr, q_block_global_idx, num_seqs, BLOCK_Q)
    q_start = tl.load(query_start_loc_ptr + seq_idx)
    query_len = tl.load(query_start_loc_ptr + seq_idx + 1) - q_start
    q_block_local_idx = q_block_global_idx - (q_start // BLOCK_Q + seq_idx)
    if q_block_local_idx * BLOCK_Q >= query_len:
        return  # a spare program of the upper-bound grid
    seq_len = tl.load(seq_lens_ptr + seq_idx)
    context_len = seq_len - query_len  # tokens cached before this step

    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_SIZE_PADDED)
    offs_t = tl.arange(0, TILE_SIZE)
    query_pos = (
        q_block_local_idx * BLOCK_Q + offs_m // num_queries_per_kv
    )  # within this step's chunk
    head_idx = kv_head_idx * num_queries_per_kv + offs_m % num_queries_per_kv
    row_mask = (offs_m < BLOCK_Q * num_queries_per_kv) & (query_pos < query_len)
    dim_mask = offs_d < HEAD_SIZE

    # Q tile [BLOCK_M, HEAD_SIZE_PADDED]
    token_idx = (q_start + query_pos).to(tl.int64)
    q_ptrs = (
        query_ptr
        + token_idx[:, None] * query_stride_0
        + head_idx[:, None] * query_stride_1
        + offs_d[None, :]
    )
    q = tl.load(q_ptrs, mask=row_mask[:, None] & dim_mask[None, :], other=0.0)

    # Online-softmax state per row (base-2 logits).
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)  # running max
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)  # running sum of exp2(s - m_i)
    acc = tl.zeros([BLOCK_M, HEAD_SIZE_PADDED], dtype=tl.float32)  # running sum of p @ V

    # Keys this query block can see: all of them, or under causality up to the
    # absolute position of its last query row.
    if CAUSAL:
        kv_end = tl.minimum(seq_len, context_len + (q_block_local_idx + 1) * BLOCK_Q)
    else:
        kv_end = seq_len
    block_table_row = block_tables_ptr + seq_idx.to(tl.int64) * block_table_stride
    q_abs_pos = context_len + query_pos  # [BLOCK_M] absolute position of each row's token

    for tile_start in range(0, kv_end, TILE_SIZE):
        kv_pos = tile_start + offs_t  # [TILE_SIZE] absolute key positions
        kv_mask = kv_pos < kv_end
        # Logical block kv_pos // BLOCK_SIZE -> physical block from the block table.
        physical_block = tl.load(block_table_row + kv_pos // BLOCK_SIZE, mask=kv_mask, other=0).to(
            tl.int64
        )
        slot_in_block = kv_pos % BLOCK_SIZE

        # K and V tiles [TILE_SIZE, HEAD_SIZE_PADDED] (head_size contiguous in memory).
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

        # Scores [BLOCK_M, TILE_SIZE], base 2.
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale
        visible = row_mask[:, None] & kv_mask[None, :]
        if CAUSAL:
            visible = visible & (kv_pos[None, :] <= q_abs_pos[:, None])
        s = tl.where(visible, s, float("-inf"))

        # Online softmax: rescale what we have by exp2(old max - new max).
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with nothing visible yet
        p = tl.exp2(s - m_safe[:, None])
        alpha = tl.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new

    # Every real row sees at least its own key, so l_i > 0 there; guard padding rows.
    acc = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    out_ptrs = (
        output_ptr
        + token_idx[:, None] * output_stride_0
        + head_idx[:, None] * output_stride_1
        + offs_d[None, :]
    )
    tl.store(
        out_ptrs, acc.to(output_ptr.dtype.element_ty), mask=row_mask[:, None] & dim_mask[None, :]
    )


def unified_attention(
    q: torch.Tensor,  # [num_tokens, num_query_heads, head_size]
    k: torch.Tensor,  # key cache [num_blocks, block_size, num_kv_heads, head_size]
    v: torch.Tensor,  # value cache, same shape
    out: torch.Tensor,  # [num_tokens, num_query_heads, head_size], written in place
    cu_seqlens_q: torch.Tensor,  # query_start_loc [num_seqs + 1] int32
    max_seqlen_q: int,
    seqused_k: torch.Tensor,  # seq_lens [num_seqs] int32
    softmax_scale: float,
    causal: bool,
    block_table: torch.Tensor,  # [num_seqs, max_blocks_per_seq] int32
    num_seqs: int | None = None,
) -> None:
    """Attention of every query token over its request's paged context.

    Host work is shape arithmetic only (no ``.item()``, no device->host copy),
    so the launch can be recorded in a CUDA graph; ``max_seqlen_q`` (a host
    int the runner already has) only picks the tile shape.
    """
    num_tokens, num_query_heads, head_size = q.shape
    _, block_size, num_kv_heads, k_head_size = k.shape
    if num_seqs is None:
        num_seqs = cu_seqlens_q.shape[0] - 1
    if k_head_size != head_size or v.shape != k.shape:
        raise ValueError(
            f"cache shape {tuple(k.shape)} / {tuple(v.shape)} does not fit q {tuple(q.shape)}"
        )
    if num_query_heads % num_kv_heads != 0:
        raise ValueError(
            f"num_query_heads ({num_query_heads}) must be a multiple of "
            f"num_kv_heads ({num_kv_heads})"
        )
    if (
        block_table.dtype != torch.int32
        or cu_seqlens_q.dtype != torch.int32
        or seqused_k.dtype != torch.int32
    ):
        raise ValueError("block_table, cu_seqlens_q and seqused_k must be int32")
    for name, t in (("q", q), ("out", out), ("k", k), ("v", v), ("block_table", block_table)):
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous in its last dimension")
    if num_tokens == 0 or num_seqs == 0:
        return
    num_queries_per_kv = num_query_heads // num_kv_heads

    # Rows per program: 16 (the smallest tl.dot tile) when every request has
    # few query tokens (decode-heavy batches), 64 when a prefill could fill
    # it; never fewer than one whole GQA group. float32 stays at 16: its exact
    # ("ieee") dot runs on FMA units and a 64-row tile spills registers.
    many_rows = max_seqlen_q * num_queries_per_kv > 16 and q.dtype != torch.float32
    rows = 64 if many_rows else 16
    BLOCK_M = max(rows, triton.next_power_of_2(num_queries_per_kv))
    BLOCK_Q = BLOCK_M // num_queries_per_kv
    # Request i needs ceil(len_i / BLOCK_Q) programs and is given
    # floor(start_{i+1} / BLOCK_Q) - floor(start_i / BLOCK_Q) + 1 >= that many,
    # so sum over requests <= num_tokens // BLOCK_Q + num_seqs programs suffice.
    total_num_q_blocks = num_tokens // BLOCK_Q + num_seqs

    kernel_unified_attention[(total_num_q_blocks, num_kv_heads)](
        out,
        q,
        k,
        v,
        block_table,
        seqused_k,
        cu_seqlens_q,
        softmax_scale * LOG2E,
        num_seqs,
        q.stride(0),
        q.stride(1),
        out.stride(0),
        out.stride(1),
        k.stride(0),
        k.stride(1),
        k.stride(2),
        v.stride(0),
        v.stride(1),
        v.stride(2),
        block_table.stride(0),
        num_queries_per_kv=num_queries_per_kv,
        BLOCK_SIZE=block_size,
        HEAD_SIZE=head_size,
        HEAD_SIZE_PADDED=max(16, triton.next_power_of_2(head_size)),
        TILE_SIZE=32,
        BLOCK_Q=BLOCK_Q,
        BLOCK_M=BLOCK_M,
        CAUSAL=causal,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
    )


__all__ = ["LOG2E", "find_seq_idx", "kernel_unified_attention", "unified_attention"]
