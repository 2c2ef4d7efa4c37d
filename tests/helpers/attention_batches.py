"""Attention test batches scattered over a noisy paged KV cache, and the
float32 ``cpu_attn`` reference they are checked against.

Used by ``tests/v1/attention/test_triton_attn.py`` (TRITON_ATTN, CPU and GPU)
and ``tests/gpu/test_flashinfer.py`` (FLASHINFER). Each test file still builds
its own ``CommonAttentionMetadata`` from the pieces returned here, because the
two backends' runners pad a CUDA-graph batch differently.

Import with ``from tests.helpers.attention_batches import scatter_requests, cpu_attn_fp32``.
"""

from __future__ import annotations

import random
from typing import Any

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from engine.v1.attention.backend import CommonAttentionMetadata
from engine.v1.attention.backends.cpu_attn import (
    CPUAttentionBackendImpl,
    CPUAttentionMetadataBuilder,
)


def scatter_requests(
    contexts: list[tuple[int, int]],
    *,
    H: int,
    H_KV: int,
    D: int,
    BS: int,
    dtype: torch.dtype,
    device: torch.device,
    seed: int,
    num_pad_slots: int,
) -> tuple[torch.Tensor, list[list[int]], list[int], torch.Tensor, torch.Tensor, torch.Tensor]:
    """Blocks, slots and q/k/v for requests given as (num_cached_tokens, num_new_tokens).

    Returns ``(kv_cache, block_tables, slots, q, k, v)``:
      * ``kv_cache`` [2, num_blocks, BS, H_KV, D] on the CPU, noise everywhere,
        so a block a request does not own leaks into its output if read;
      * ``block_tables``: per request, its blocks, drawn at random (never
        block 0, the null block), so they are not contiguous;
      * ``slots``: the cache slot of every new token, then ``num_pad_slots``
        padding tokens with slot -1;
      * ``q`` [T, H, D], ``k``/``v`` [T, H_KV, D] on ``device``: column slices
        of one fused QKV tensor (non-contiguous rows), as the models pass them.
    The same ``seed`` gives the same batch.
    """
    g = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    needed = sum(-(-(c + n) // BS) for c, n in contexts)
    num_blocks = needed + 8
    kv_cache = torch.randn(2, num_blocks, BS, H_KV, D, generator=g).to(dtype)
    free = list(range(1, num_blocks))  # block 0 is the null block
    rng.shuffle(free)
    tables, slots = [], []
    for cached, new in contexts:
        blocks = [free.pop() for _ in range(-(-(cached + new) // BS))]
        tables.append(blocks)
        slots += [blocks[p // BS] * BS + p % BS for p in range(cached, cached + new)]
    slots += [-1] * num_pad_slots
    num_tokens = len(slots)
    qkv = torch.randn(num_tokens, (H + 2 * H_KV) * D, generator=g).to(dtype).to(device)
    q, k, v = qkv.split([H * D, H_KV * D, H_KV * D], dim=-1)
    q, k, v = q.view(num_tokens, H, D), k.view(num_tokens, H_KV, D), v.view(num_tokens, H_KV, D)
    return kv_cache, tables, slots, q, k, v


def cpu_attn_fp32(b: Any, common: CommonAttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
    """``cpu_attn`` in float32, on ``b.q``'s device, over float32 copies of a batch.

    ``b`` carries ``q, k, v, kv_cache, H, H_KV, D, BS``; ``common`` must
    describe the real requests only (``cpu_attn`` knows nothing of padding).
    Returns (output of the ``common.num_actual_tokens`` real tokens, cache
    after the K/V write).
    """
    n_real = common.num_actual_tokens
    device = b.q.device
    cache = b.kv_cache.float().clone()
    out = torch.empty(n_real, b.H, b.D, device=device)
    # The plain-torch path, also for decodes (not the C++ kernel of csrc/cpu).
    md = CPUAttentionMetadataBuilder(b.BS, device, use_cpu_kernels=False).build(common)
    with sdpa_kernel(SDPBackend.MATH):  # exact float32 on every device (no TF32, no fused kernel)
        CPUAttentionBackendImpl(b.H, b.D, b.D**-0.5, b.H_KV).forward(
            None, b.q[:n_real].float(), b.k[:n_real].float(), b.v[:n_real].float(), cache, md, out
        )
    return out, cache
