"""Write this step's keys and values into the paged KV cache (Triton).

vLLM twin: ``vllm/v1/attention/ops/triton_reshape_and_cache_flash.py``
(``triton_reshape_and_cache_flash``, kernel ``reshape_and_cache_kernel_flash``).
Read it for the first half of every paged-attention layer: token ``t``'s K/V
row goes to flat slot ``slot_mapping[t] = block_id * block_size + offset``,
i.e. ``key_cache[block_id, offset]``. The name says "flash" because the cache
uses the flash-attention layout ``[num_blocks, block_size, num_kv_heads,
head_size]`` per K and per V.
Sessions: 05 (attention backends).

Simpler than vLLM: no FP8 / per-token-head quantisation and no head-major
(ROCm) layout. A slot of -1 marks a padding token (e.g. a CUDA-graph batch
padded to its captured size) and is skipped, as in vLLM.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def reshape_and_cache_kernel_flash(
    key_ptr,  # [num_tokens, num_kv_heads, head_size]
    value_ptr,  # [num_tokens, num_kv_heads, head_size]
    key_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_size]
    value_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_size]
    slot_mapping_ptr,  # [num_tokens] int64
    key_stride_0,  # between tokens (elements)
    key_stride_1,  # between heads
    value_stride_0,
    value_stride_1,
    cache_stride_block,  # key_cache and value_cache share strides
    cache_stride_slot,
    cache_stride_head,
    BLOCK_SIZE: tl.constexpr,  # tokens per KV block
    HEAD_SIZE: tl.constexpr,
    HEAD_SIZE_PADDED: tl.constexpr,  # next power of two (tl.arange needs one)
):
    # One program instance = one (token, kv head): copies head_size values of
    # K and of V from the new-token tensors to that token's cache slot.
    token_idx = tl.program_id(0)
    head_idx = tl.program_id(1)

    slot = tl.load(slot_mapping_ptr + token_idx).to(tl.int64)
    if slot < 0:
        return  # padding token: owns no slot

    block_idx = slot // BLOCK_SIZE
    offset_in_block = slot % BLOCK_SIZE
    offs_d = tl.arange(0, HEAD_SIZE_PADDED)
    dim_mask = offs_d < HEAD_SIZE

    src_k = key_ptr + token_idx.to(tl.int64) * key_stride_0 + head_idx * key_stride_1
    src_v = value_ptr + token_idx.to(tl.int64) * value_stride_0 + head_idx * value_stride_1
    dst = (
        block_idx * cache_stride_block
        + offset_in_block * cache_stride_slot
        + head_idx * cache_stride_head
    )

    k = tl.load(src_k + offs_d, mask=dim_mask)
    v = tl.load(src_v + offs_d, mask=dim_mask)
    # tl.store casts to the cache's element type (same dtype in practice).
    tl.store(key_cache_ptr + dst + offs_d, k, mask=dim_mask)
    tl.store(value_cache_ptr + dst + offs_d, v, mask=dim_mask)


def triton_reshape_and_cache_flash(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_size]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_size]
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_size]
    value_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_size]
    slot_mapping: torch.Tensor,  # [num_tokens] int64, -1 = padding
) -> None:
    """Scatter ``key[t]`` / ``value[t]`` into slot ``slot_mapping[t]``, in place.

    Only the first ``slot_mapping.shape[0]`` rows of ``key``/``value`` are read.
    No host synchronisation: the launch grid depends on shapes only.
    """
    num_tokens = slot_mapping.shape[0]
    if key.shape[0] < num_tokens or value.shape[0] < num_tokens:
        raise ValueError(
            f"key/value have {key.shape[0]}/{value.shape[0]} rows but slot_mapping has {num_tokens}"
        )
    if key_cache.stride() != value_cache.stride():
        raise ValueError("key_cache and value_cache must have the same strides")
    for name, t in (("key", key), ("value", value), ("key_cache", key_cache)):
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous in head_size (stride(-1) == 1)")
    num_kv_heads, head_size = key.shape[1], key.shape[2]
    if num_tokens == 0:
        return
    reshape_and_cache_kernel_flash[(num_tokens, num_kv_heads)](
        key,
        value,
        key_cache,
        value_cache,
        slot_mapping,
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        key_cache.stride(0),
        key_cache.stride(1),
        key_cache.stride(2),
        BLOCK_SIZE=key_cache.shape[1],
        HEAD_SIZE=head_size,
        HEAD_SIZE_PADDED=triton.next_power_of_2(head_size),
    )
