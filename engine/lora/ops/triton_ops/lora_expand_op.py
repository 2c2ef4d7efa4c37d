"""lora_expand: every token's shrunk vector times its adapter's ``B``, added into the
layer's output columns, in one Triton launch.

vLLM twin: ``vllm/lora/ops/triton_ops/lora_expand_op.py`` (``lora_expand``,
``_lora_expand_kernel``; the tile loop is ``do_expand_kernel`` / ``mm_k`` in
``kernel_utils.py``).
Read it for the second half of the grouped LoRA matmul, and for how a fused
layer's slices land in their own columns::

  output[t, col_s : col_s + n_s] += inputs[s, t] @ B_s[slot[t]]^T   (slice s)

with ``col_s = offset_start + n_0 + ... + n_{s-1}``. Same grid and token
grouping as ``lora_shrink`` -- ``(M tiles, N tiles x slices, max_loras + 1)``,
the slot's tokens gathered through ``LoRAKernelMeta``'s sorted indices -- but
the reduction axis is the small rank ``r`` (one or two ``BLOCK_K`` steps) and
the wide one is the output: the N tiles span the widest slice, and a program
past a narrower slice's width (GQA's k and v against q) returns. The product
accumulates in fp32; with ``add_inputs`` the output's current values are added
in fp32 before the one rounding to the output dtype. Tokens without an adapter
are not touched. Checked in Triton's interpreter (tests/lora/test_lora_triton.py)
and on CUDA (tests/gpu/test_gpu_lora.py). Sessions: 06.

Simpler than vLLM: the same omissions as ``lora_shrink`` (no tuned configs,
no programmatic dependent launch, no custom-op registration, masked loads
throughout); the weights must be contiguous (vLLM passes per-slice strides).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.lora.ops.triton_ops.utils import _get_lora_b_ptr, dot_precision, tile


@triton.jit
def _lora_expand_kernel(
    input_ptr,  # [num_slices, M, K]
    lora_ptr,  # slice 0's B [slots, n_0, K]: its element type types the table's addresses
    lora_table,  # int64 [num_slices, 3]: B's address, width n_s, first output column
    out_ptr,  # [M, total width]
    M,
    MAX_N,
    token_indices_sorted_by_lora_ids,
    num_tokens_per_lora,
    lora_token_start_loc,
    lora_ids,
    input_d0_stride,
    input_d1_stride,
    input_d2_stride,
    output_d0_stride,
    output_d1_stride,
    K: tl.constexpr,  # the reduction length: one build per value
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    ADD_INPUTS: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    pid_m = tl.program_id(axis=0)
    num_n_tiles = tl.cdiv(MAX_N, BLOCK_N)
    pid_n = tl.program_id(axis=1) % num_n_tiles
    slice_id = tl.program_id(axis=1) // num_n_tiles
    lora_idx = tl.program_id(axis=2)

    lora_id = tl.load(lora_ids + lora_idx)
    group_len = tl.load(num_tokens_per_lora + lora_idx)
    m_start = pid_m * BLOCK_M
    N = tl.load(lora_table + slice_id * 3 + 1)  # this slice's width
    if (lora_id < 0) | (m_start >= group_len) | (pid_n * BLOCK_N >= N):
        return  # base-model tokens, an idle slot, past the slot's tokens or the slice's width

    group_start = tl.load(lora_token_start_loc + lora_idx)
    offs_m = m_start + tl.arange(0, BLOCK_M)
    m_mask = offs_m < group_len
    rows = tl.load(token_indices_sorted_by_lora_ids + group_start + offs_m, mask=m_mask, other=0)
    m_mask = m_mask & (rows < M)

    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    w_ptr = tl.load(lora_table + slice_id * 3).to(tl.pointer_type(lora_ptr.dtype.element_ty))
    w_ptr += lora_id * N * K  # contiguous B_s: [slots, N, K]
    x_ptr = input_ptr + slice_id * input_d0_stride

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_mask = offs_k < K
        x = tl.load(
            x_ptr + rows[:, None] * input_d1_stride + offs_k[None, :] * input_d2_stride,
            mask=m_mask[:, None] & k_mask[None, :],
            other=0.0,
        )
        # B_s[lora_id] is [N, K]; load the [BLOCK_K, BLOCK_N] tile of its transpose.
        w = tl.load(
            w_ptr + offs_k[:, None] + offs_n[None, :] * K,
            mask=k_mask[:, None] & n_mask[None, :],
            other=0.0,
        )
        acc = tl.dot(x.to(w.dtype), w, acc, input_precision=DOT_PRECISION)

    first_col = tl.load(lora_table + slice_id * 3 + 2)
    out = (
        out_ptr
        + rows[:, None] * output_d0_stride
        + (first_col + offs_n)[None, :] * output_d1_stride
    )
    mask = m_mask[:, None] & n_mask[None, :]
    if ADD_INPUTS:
        acc += tl.load(out, mask=mask, other=0.0).to(tl.float32)
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=mask)


@torch.inference_mode()
def lora_expand(
    inputs: torch.Tensor,  # [num_slices, T, r]
    lora_b_weights: tuple[torch.Tensor, ...] | list[torch.Tensor],  # each [slots, n_s, r]
    output_tensor: torch.Tensor,  # [T, >= offset_start + sum n_s], updated in place
    token_lora_mapping: torch.Tensor,  # [T]
    token_indices_sorted_by_lora_ids: torch.Tensor,  # [T]
    num_tokens_per_lora: torch.Tensor,  # [max_loras + 1]
    lora_token_start_loc: torch.Tensor,  # [max_loras + 2]
    lora_ids: torch.Tensor,  # [max_loras + 1]
    no_lora: bool,
    offset_start: int = 0,
    add_inputs: bool = True,
) -> None:
    """For each slice ``s``: ``output_tensor[t, cols of s] (+)= inputs[s, t] @
    lora_b_weights[s][slot[t]]^T`` where ``slot[t] >= 0`` (``add_inputs``: add,
    else overwrite); rows of tokens without an adapter are left as they are."""
    num_slices, M, K = inputs.shape
    assert len(lora_b_weights) == num_slices
    assert lora_b_weights[0].shape[2] == K, "B's rank differs from inputs'"
    widths = [w.shape[1] for w in lora_b_weights]
    assert output_tensor.ndim == 2 and output_tensor.shape[0] == M
    assert offset_start + sum(widths) <= output_tensor.shape[1]
    assert token_lora_mapping.numel() == M and token_indices_sorted_by_lora_ids.numel() == M
    assert lora_token_start_loc.numel() == lora_ids.numel() + 1 == num_tokens_per_lora.numel() + 1

    if no_lora or M == 0:
        return
    table = _get_lora_b_ptr(lora_b_weights, offset_start, inputs.device)
    MAX_N = max(widths)
    wide = lora_b_weights[0].dtype == torch.float32
    BLOCK_M = tile(M, 16, 64)
    BLOCK_N = tile(MAX_N, 16, 64 if wide else 128)
    BLOCK_K = tile(K, 16, 64)
    grid = (triton.cdiv(M, BLOCK_M), triton.cdiv(MAX_N, BLOCK_N) * num_slices, lora_ids.numel())
    _lora_expand_kernel[grid](
        inputs,
        lora_b_weights[0],
        table,
        output_tensor,
        M,
        MAX_N,
        token_indices_sorted_by_lora_ids,
        num_tokens_per_lora,
        lora_token_start_loc,
        lora_ids,
        *inputs.stride(),
        *output_tensor.stride(),
        K=K,
        BLOCK_M=BLOCK_M,
        BLOCK_N=BLOCK_N,
        BLOCK_K=BLOCK_K,
        ADD_INPUTS=add_inputs,
        DOT_PRECISION=dot_precision(lora_b_weights[0].dtype),
        num_warps=4,
    )
