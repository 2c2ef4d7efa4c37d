"""lora_shrink: every token's input times its adapter's ``A``, in one Triton launch.

vLLM twin: ``vllm/lora/ops/triton_ops/lora_shrink_op.py`` (``lora_shrink``,
``_lora_shrink_kernel``; the tile loop is ``do_shrink_kernel`` / ``mm_k`` in
``kernel_utils.py``).
Read it for the grouped matmul at the heart of multi-LoRA serving (Punica's
SGMV): instead of gathering ``A[slot]`` per token (``bgmv_shrink`` in the torch
ops, which reads a whole ``[r, in]`` matrix for every token), the tokens are
grouped by slot (``LoRAKernelMeta``) and each group is multiplied by its
slot's ``A`` once, as a small dense GEMM::

  output[s, t] = scaling * inputs[t] @ A_s[slot[t]]^T     [T, in] -> [num_slices, T, r]

Grid ``(M tiles, N tiles x slices, max_loras + 1)``: program ``(m, n, i)``
takes rows ``m * BLOCK_M ...`` of slot ``active_lora_ids[i]``'s run in the
sorted token order, loads those tokens' rows of ``inputs`` through the sorted
indices (a gather: the group's tokens need not be adjacent in the batch),
loops over ``in`` in ``BLOCK_K`` chunks accumulating in fp32, and scatters
the ``[BLOCK_M, BLOCK_N]`` result back to the tokens' rows of its slice of
``output``. Programs of the no-adapter group (-1), of idle slots, and past a
group's end return at once; rows without an adapter keep the zeros written
before the launch. Checked in Triton's interpreter (tests/lora/test_lora_triton.py)
and on CUDA (tests/gpu/test_gpu_lora.py). Sessions: 06.

Simpler than vLLM: no split-K (vLLM splits the long ``in`` axis across
programs and adds the parts atomically, which helps decode batches), no
grouped tile ordering, no programmatic dependent launch, no tuned configs,
no torch custom-op registration (LoRA runs eagerly here); every program masks
its loads instead of vLLM's even-K fast path.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.lora.ops.triton_ops.utils import _get_lora_a_ptr, dot_precision, tile


@triton.jit
def _lora_shrink_kernel(
    input_ptr,  # [M, K]
    lora_ptr,  # slice 0's A [slots, N, K]: its element type types the table's addresses
    lora_ptr_table,  # int64 [num_slices]: each slice's A
    out_ptr,  # [num_slices, M, N]
    M,
    N,
    token_indices_sorted_by_lora_ids,
    num_tokens_per_lora,
    lora_token_start_loc,
    lora_ids,
    scaling,
    input_d0_stride,
    input_d1_stride,
    lora_d0_stride,
    lora_d1_stride,
    lora_d2_stride,
    output_d0_stride,
    output_d1_stride,
    output_d2_stride,
    K: tl.constexpr,  # the reduction length: one build per value
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    pid_m = tl.program_id(axis=0)
    num_n_tiles = tl.cdiv(N, BLOCK_N)
    pid_n = tl.program_id(axis=1) % num_n_tiles
    slice_id = tl.program_id(axis=1) // num_n_tiles
    lora_idx = tl.program_id(axis=2)

    lora_id = tl.load(lora_ids + lora_idx)
    group_len = tl.load(num_tokens_per_lora + lora_idx)
    m_start = pid_m * BLOCK_M
    if (lora_id < 0) | (m_start >= group_len):
        return  # the base model's tokens, an idle slot, or past this slot's tokens

    # This program's tokens: a run of the slot's group in the sorted order.
    group_start = tl.load(lora_token_start_loc + lora_idx)
    offs_m = m_start + tl.arange(0, BLOCK_M)
    m_mask = offs_m < group_len
    rows = tl.load(token_indices_sorted_by_lora_ids + group_start + offs_m, mask=m_mask, other=0)
    m_mask = m_mask & (rows < M)  # a step longer than this input: its extra tokens are skipped

    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    w_ptr = tl.load(lora_ptr_table + slice_id).to(tl.pointer_type(lora_ptr.dtype.element_ty))
    w_ptr += lora_id * lora_d0_stride

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_mask = offs_k < K
        x = tl.load(
            input_ptr + rows[:, None] * input_d0_stride + offs_k[None, :] * input_d1_stride,
            mask=m_mask[:, None] & k_mask[None, :],
            other=0.0,
        )
        # A_s[lora_id] is [N, K]; load the [BLOCK_K, BLOCK_N] tile of its transpose.
        w = tl.load(
            w_ptr + offs_k[:, None] * lora_d2_stride + offs_n[None, :] * lora_d1_stride,
            mask=k_mask[:, None] & n_mask[None, :],
            other=0.0,
        )
        acc = tl.dot(x.to(w.dtype), w, acc, input_precision=DOT_PRECISION)
    acc *= scaling

    out = (
        out_ptr
        + slice_id * output_d0_stride
        + rows[:, None] * output_d1_stride
        + offs_n[None, :] * output_d2_stride
    )
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


@torch.inference_mode()
def lora_shrink(
    inputs: torch.Tensor,  # [T, in]
    lora_a_weights: tuple[torch.Tensor, ...] | list[torch.Tensor],  # each [slots, r, in]
    output_tensor: torch.Tensor,  # [num_slices, T, r], overwritten
    token_lora_mapping: torch.Tensor,  # [T]
    token_indices_sorted_by_lora_ids: torch.Tensor,  # [T]
    num_tokens_per_lora: torch.Tensor,  # [max_loras + 1]
    lora_token_start_loc: torch.Tensor,  # [max_loras + 2]
    lora_ids: torch.Tensor,  # [max_loras + 1]
    no_lora: bool,
    scaling: float,
) -> None:
    """``output_tensor[s, t] = scaling * inputs[t] @ lora_a_weights[s][slot[t]]^T``,
    zero where ``slot[t]`` is -1 (the arguments after ``output_tensor`` are
    ``LoRAKernelMeta.meta_args``). Accumulates in fp32."""
    num_slices = len(lora_a_weights)
    M, K = inputs.shape
    N = lora_a_weights[0].shape[1]  # the rank
    assert lora_a_weights[0].shape[2] == K, "A's input width differs from inputs'"
    assert output_tensor.shape == (num_slices, M, N)
    assert token_lora_mapping.numel() == M and token_indices_sorted_by_lora_ids.numel() == M
    assert lora_token_start_loc.numel() == lora_ids.numel() + 1 == num_tokens_per_lora.numel() + 1

    output_tensor.zero_()  # tokens without an adapter are never written by the kernel
    if no_lora or M == 0:
        return
    table = _get_lora_a_ptr(lora_a_weights, inputs.device)
    wide = lora_a_weights[0].dtype == torch.float32
    BLOCK_M = tile(M, 16, 64)
    BLOCK_N = tile(N, 16, 64)
    BLOCK_K = 64 if wide else 128
    grid = (triton.cdiv(M, BLOCK_M), triton.cdiv(N, BLOCK_N) * num_slices, lora_ids.numel())
    _lora_shrink_kernel[grid](
        inputs,
        lora_a_weights[0],
        table,
        output_tensor,
        M,
        N,
        token_indices_sorted_by_lora_ids,
        num_tokens_per_lora,
        lora_token_start_loc,
        lora_ids,
        scaling,
        *inputs.stride(),
        *lora_a_weights[0].stride(),
        *output_tensor.stride(),
        K=K,
        BLOCK_M=BLOCK_M,
        BLOCK_N=BLOCK_N,
        BLOCK_K=BLOCK_K,
        DOT_PRECISION=dot_precision(lora_a_weights[0].dtype),
        num_warps=4,
    )
