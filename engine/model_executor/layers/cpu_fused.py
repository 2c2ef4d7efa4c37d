"""CPU paths for the elementwise layers: the same maths in fewer torch ops.

vLLM twin: ``vllm/_custom_ops.py`` -- on a CPU build its ``rms_norm``,
``fused_add_rms_norm``, ``rotary_embedding`` and ``silu_and_mul`` run C++ from
``csrc/cpu/`` (``layernorm.cpp``, ``pos_encoding.cpp``, ``activation.cpp``;
vLLM's ``RotaryEmbedding.forward_cpu`` calls ``ops.rotary_embedding``).
Read it for why a decode step on a CPU is dominated by *op count*, not
arithmetic: with ~32 tokens per step every elementwise op touches a few
kilobytes, so its cost is the op's dispatch, not its arithmetic (more so when
the big matmuls have just evicted the interpreter from the caches). The reference
``forward_native`` of a norm runs ~10 ops, RoPE ~30 per layer; these run 7
and ~12, in place where vLLM's kernels are in place, and give **bit-identical**
float32 results (same operations in the same order, only without
temporaries), so greedy parity with transformers cannot move.
The layers' ``forward_cpu`` prefers Glassbox's own C++ twins of those files
(``csrc/cpu/``, loaded by ``engine/_cpu_ops.py``: one call per norm, RoPE or
SiLU-and-mul) and uses these helpers where that build is unavailable or
``GLASSBOX_CPU_KERNELS=0``.
Sessions: 04 (worker), 06 (kernel fusion).

Simpler than vLLM: plain torch; float32 only (callers fall back to
``forward_native`` for other dtypes, where the reference upcasts).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """``weight * x / sqrt(mean(x^2) + eps)`` over the last dim, as a new tensor."""
    _check_float32(x, "x")
    out = x * x.pow(2).mean(dim=-1, keepdim=True).add_(eps).rsqrt_()
    return out if weight is None else out.mul_(weight)


def fused_add_rms_norm_(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor | None, eps: float
) -> None:
    """In place, vLLM's contract: ``residual += x``, then ``x = rms_norm(residual)``.

    The caller's next residual is the updated ``residual``; its normalised
    value is in ``x``. Both must be float32 tensors of the same shape.
    """
    _check_float32(x, "x")
    _check_float32(residual, "residual")
    if x.shape != residual.shape:
        raise ValueError(
            f"x and residual must have the same shape, got {tuple(x.shape)} and "
            f"{tuple(residual.shape)}"
        )
    residual.add_(x)  # == x + residual bit for bit (float addition commutes)
    inv_rms = residual.pow(2).mean(dim=-1, keepdim=True).add_(eps).rsqrt_()
    torch.mul(residual, inv_rms, out=x)
    if weight is not None:
        x.mul_(weight)


def rotary_embedding_(
    positions: torch.Tensor,  # [T] (any shape; flattened)
    query: torch.Tensor,  # [T, num_heads * head_size] or [T, num_heads, head_size]
    key: torch.Tensor | None,  # [T, num_kv_heads * head_size] or 3-D, or None
    head_size: int,
    cos_sin_cache: torch.Tensor,  # [max_position, rotary_dim]: cos | sin halves
    is_neox_style: bool,
) -> None:
    """Rotate ``query`` and ``key`` in place (vLLM's ``rotary_embedding`` contract).

    Only the first ``rotary_dim`` features of each head rotate. Views are fine
    (``query`` and ``key`` are usually column slices of the qkv output) as
    long as the last dimension is contiguous.
    """
    _check_float32(query, "query")
    positions = positions.flatten()
    num_tokens = positions.shape[0]
    cos_sin = cos_sin_cache.index_select(0, positions)  # [T, rotary_dim]
    half = cos_sin.shape[-1] // 2
    cos = cos_sin[:, None, :half]  # [T, 1, rotary_dim / 2], broadcast over heads
    sin = cos_sin[:, None, half:]
    for x in (query, key):
        if x is None:
            continue
        x = x.view(num_tokens, x.numel() // max(num_tokens, 1) // head_size, head_size)
        if is_neox_style:  # pairs (i, i + rotary_dim / 2)
            x1, x2 = x[..., :half], x[..., half : 2 * half]
        else:  # GPT-J style: pairs (2i, 2i + 1)
            x1, x2 = x[..., 0 : 2 * half : 2], x[..., 1 : 2 * half : 2]
        x1_sin = x1 * sin
        x1.mul_(cos).sub_(x2 * sin)  # x1 cos - x2 sin
        x2.mul_(cos).add_(x1_sin)  # x2 cos + x1 sin (x1 before the update)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """``silu(x[..., :d]) * x[..., d:]`` with the product written into the silu output."""
    d = x.shape[-1] // 2
    return F.silu(x[..., :d]).mul_(x[..., d:])


def _check_float32(t: torch.Tensor, name: str) -> None:
    if t.dtype != torch.float32:
        raise ValueError(f"{name} must be float32 for the fused CPU path, got {t.dtype}")
