"""Fused GPU kernels behind the CustomOp layers (Triton).

vLLM twin: ``vllm/_custom_ops.py`` -- thin Python wrappers around
``torch.ops._C.*``, whose CUDA C++ lives in ``csrc/libtorch_stable/``
(``layernorm_kernels.cu``, ``pos_encoding_kernels.cu``,
``activation_kernels.cu``, ``fused_qknorm_rope_kernel.cu``).
Read it for what each fused op replaces. In plain torch (``forward_native``)
an RMSNorm is ~7 kernels (cast, add, square, mean, rsqrt, mul, cast, mul), a
rotary embedding ~15 (gather, chunk, casts, four muls, two adds, cat...), and
SiluAndMul 2 plus a copy; at decode each kernel moves a few KB, so the step is
launch-bound. Each op below is one kernel that reads its inputs once and
writes its outputs once.

The ops keep vLLM's names, argument order and in-place contracts:

  ``rms_norm(out, input, weight, epsilon)``
      out = input / sqrt(mean(input^2) + eps) * weight, over the last dim.
  ``fused_add_rms_norm(input, residual, weight, epsilon)``      (in place)
      residual <- input + residual;  input <- rms_norm(residual) * weight.
  ``rotary_embedding(positions, query, key, head_size, cos_sin_cache, is_neox)``
      rotates the first ``cos_sin_cache.shape[1]`` features of every query
      and key head by its token's position, in place.
  ``fused_qk_norm_rope(qkv, num_heads_q, num_heads_k, num_heads_v, head_dim,
  eps, q_weight, k_weight, cos_sin_cache, is_neox, position_ids)`` (in place)
      Qwen3's per-head RMSNorm of q and k followed by RoPE, on the fused qkv
      projection output; v is untouched.
  ``silu_and_mul(out, input)``
      out = silu(input[..., :d]) * input[..., d:].

Numerics follow our ``forward_native`` rather than vLLM's CUDA: statistics in
float32, and the result rounded to the input dtype at the same points the torch
code rounds (after normalising, before the weight multiply), so bf16 outputs
agree with the reference to about one bf16 ulp. The rotation itself is done in
float32 and rounded once (torch rounds after each multiply and add).

Every op launches with a grid computed from shapes only -- no host sync, no
allocation -- so it can be captured in a CUDA graph; zero tokens launch nothing.
Inputs may be row-strided views (q/k are column slices of the qkv output) but
the last dimension must be contiguous. Positions are not range-checked (a
check would need a sync); an out-of-range position reads garbage, as in vLLM.
Sessions: 04 (worker), 06 (kernel fusion).

Simpler than vLLM: Triton instead of CUDA C++; no quantised variants, no
``rope_dim_offset``/``inverse`` rotary arguments, no
``forced_token_heads_per_warp`` tuning knob; one program per row (norms) or per
(token, head) (rotary) rather than vLLM's warp-per-head vectorised layouts.
Importing this module imports triton; only ``forward_cuda`` paths import it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# Largest row (elements) a norm program holds in registers at once.
_MAX_FUSED_BYTES = 65536


# ----------------------------------------------------------------------------
# Shared helpers
# ----------------------------------------------------------------------------
def _check_last_dim_contiguous(name: str, t: torch.Tensor) -> None:
    if t.dim() == 0 or (t.shape[-1] > 1 and t.stride(-1) != 1):
        raise ValueError(
            f"{name} must have a contiguous last dimension (stride 1), got shape "
            f"{tuple(t.shape)} strides {t.stride()}"
        )


def _row_layout(name: str, t: torch.Tensor) -> tuple[int, int, int, int]:
    """Describe ``t``'s rows (all dims but the last) for the norm kernels.

    Returns ``(num_rows, rows_per_group, group_stride, row_stride)``: row ``r``
    starts at element ``(r // rows_per_group) * group_stride + (r %
    rows_per_group) * row_stride``. That covers a [T, H] tensor with any row
    stride (one row per group) and a [T, heads, D] view of a column slice of
    qkv (Qwen3's q/k norm: ``heads`` rows per token, token stride = qkv width).
    """
    _check_last_dim_contiguous(name, t)
    if t.dim() == 1:
        return 1, 1, 0, 0
    if t.dim() == 2:
        return t.shape[0], 1, t.stride(0), 0
    if t.dim() == 3:
        return t.shape[0] * t.shape[1], max(t.shape[1], 1), t.stride(0), t.stride(1)
    try:
        flat = t.view(-1, t.shape[-1])
    except RuntimeError:
        raise ValueError(
            f"{name} with {t.dim()} dims must be viewable as [rows, {t.shape[-1]}] "
            f"(got strides {t.stride()}); pass a 2D or 3D tensor"
        ) from None
    return flat.shape[0], 1, flat.stride(0), 0


def _norm_block(name: str, t: torch.Tensor) -> tuple[int, int]:
    """(BLOCK, num_warps) for a norm over ``t``'s last dimension."""
    hidden = t.shape[-1]
    block = triton.next_power_of_2(hidden)
    if block * t.element_size() > _MAX_FUSED_BYTES:
        raise ValueError(
            f"{name}: last dimension {hidden} is too large for a one-block norm "
            f"(at most {_MAX_FUSED_BYTES // t.element_size()} elements of {t.dtype})"
        )
    return block, min(max(block // 256, 1), 8)


def _check_same_dtype(**tensors: torch.Tensor) -> None:
    dtypes = {name: t.dtype for name, t in tensors.items()}
    if len(set(dtypes.values())) != 1:
        raise ValueError(f"these tensors must share one dtype, got {dtypes}")


# ----------------------------------------------------------------------------
# RMSNorm
# ----------------------------------------------------------------------------
@triton.jit
def _row_start(row, rows_per_group, group_stride, row_stride):
    # Element offset of row ``row`` (int64: T * width can pass 2**31).
    row = row.to(tl.int64)
    return (row // rows_per_group) * group_stride + (row % rows_per_group) * row_stride


@triton.jit
def _rms_norm_kernel(
    out_ptr,  # rows of [hidden], layout (out_group_stride, out_row_stride)
    in_ptr,  # rows of [hidden], layout (in_group_stride, in_row_stride)
    weight_ptr,  # [hidden]
    rows_per_group,
    out_group_stride,
    out_row_stride,
    in_group_stride,
    in_row_stride,
    hidden,
    eps,
    BLOCK: tl.constexpr,  # next power of two >= hidden
):
    # One program = one row.
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    mask = offs < hidden
    src = in_ptr + _row_start(row, rows_per_group, in_group_stride, in_row_stride)
    dst = out_ptr + _row_start(row, rows_per_group, out_group_stride, out_row_stride)

    x = tl.load(src + offs, mask=mask, other=0.0).to(tl.float32)
    rstd = tl.rsqrt(tl.sum(x * x, axis=0) / hidden + eps)
    w = tl.load(weight_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    out_ty = out_ptr.dtype.element_ty
    # Round to the input dtype before the weight multiply, as torch does.
    normed = (x * rstd).to(out_ty).to(tl.float32)
    tl.store(dst + offs, (normed * w).to(out_ty), mask=mask)


def rms_norm(out: torch.Tensor, input: torch.Tensor, weight: torch.Tensor, epsilon: float) -> None:
    """``out = input / sqrt(mean(input**2, -1) + epsilon) * weight`` (out: same shape)."""
    if out.shape != input.shape:
        raise ValueError(
            f"out shape {tuple(out.shape)} must equal input shape {tuple(input.shape)}"
        )
    if weight.shape != (input.shape[-1],):
        raise ValueError(f"weight must have shape ({input.shape[-1]},), got {tuple(weight.shape)}")
    _check_same_dtype(out=out, input=input, weight=weight)
    num_rows, rows_per_group, in_gs, in_rs = _row_layout("input", input)
    _, out_rpg, out_gs, out_rs = _row_layout("out", out)
    if out_rpg != rows_per_group:  # pragma: no cover - same shape gives same grouping
        raise ValueError("out and input must group rows the same way")
    if num_rows == 0:
        return
    block, num_warps = _norm_block("rms_norm", input)
    _rms_norm_kernel[(num_rows,)](
        out,
        input,
        weight,
        rows_per_group,
        out_gs,
        out_rs,
        in_gs,
        in_rs,
        input.shape[-1],
        epsilon,
        BLOCK=block,
        num_warps=num_warps,
    )


@triton.jit
def _fused_add_rms_norm_kernel(
    in_ptr,  # [rows, hidden], row stride in_row_stride: read x, write the norm
    residual_ptr,  # [rows, hidden], row stride residual_row_stride: read r, write x + r
    weight_ptr,  # [hidden]
    in_row_stride,
    residual_row_stride,
    hidden,
    eps,
    BLOCK: tl.constexpr,
):
    # One program = one row. Everything is read before anything is written,
    # so updating both tensors in place is safe.
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < hidden
    x_ptrs = in_ptr + row * in_row_stride + offs
    r_ptrs = residual_ptr + row * residual_row_stride + offs

    # Sum in float32; the norm uses the unrounded sum, the residual keeps it rounded.
    s = tl.load(x_ptrs, mask=mask, other=0.0).to(tl.float32)
    s += tl.load(r_ptrs, mask=mask, other=0.0).to(tl.float32)
    out_ty = in_ptr.dtype.element_ty
    tl.store(r_ptrs, s.to(residual_ptr.dtype.element_ty), mask=mask)

    rstd = tl.rsqrt(tl.sum(s * s, axis=0) / hidden + eps)
    w = tl.load(weight_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    normed = (s * rstd).to(out_ty).to(tl.float32)
    tl.store(x_ptrs, (normed * w).to(out_ty), mask=mask)


def fused_add_rms_norm(
    input: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, epsilon: float
) -> None:
    """In place: ``residual += input``, then ``input = rms_norm(residual) * weight``.

    Both [..., hidden], viewable as [rows, hidden] with a contiguous last dim.
    The caller's ``(input, residual)`` pair then holds ``(normed, new residual)``
    -- what ``RMSNorm.forward(x, residual)`` returns.
    """
    if input.shape != residual.shape:
        raise ValueError(
            f"input shape {tuple(input.shape)} must equal residual shape {tuple(residual.shape)}"
        )
    if weight.shape != (input.shape[-1],):
        raise ValueError(f"weight must have shape ({input.shape[-1]},), got {tuple(weight.shape)}")
    _check_same_dtype(input=input, residual=residual, weight=weight)
    hidden = input.shape[-1]
    x2d, r2d = _as_2d("input", input), _as_2d("residual", residual)
    if x2d.shape[0] == 0:
        return
    block, num_warps = _norm_block("fused_add_rms_norm", input)
    _fused_add_rms_norm_kernel[(x2d.shape[0],)](
        x2d,
        r2d,
        weight,
        x2d.stride(0),
        r2d.stride(0),
        hidden,
        epsilon,
        BLOCK=block,
        num_warps=num_warps,
    )


def _as_2d(name: str, t: torch.Tensor) -> torch.Tensor:
    """A [rows, last] *view* of ``t`` (in-place ops cannot work on a copy)."""
    _check_last_dim_contiguous(name, t)
    try:
        return t.view(-1, t.shape[-1])
    except RuntimeError:
        raise ValueError(
            f"{name} must be viewable as [rows, {t.shape[-1]}] for an in-place op; got "
            f"shape {tuple(t.shape)} strides {t.stride()}"
        ) from None


# ----------------------------------------------------------------------------
# Rotary embedding (and Qwen3's fused q/k norm + rotary)
# ----------------------------------------------------------------------------
@triton.jit
def _pair_offsets(HALF_PAD: tl.constexpr, half, IS_NEOX: tl.constexpr):
    # Element i of the rotation pairs feature i1[i] with feature i2[i]:
    # neox style splits the rotary part in two halves, GPT-J style pairs neighbours.
    i = tl.arange(0, HALF_PAD)
    if IS_NEOX:
        return i, i + half, i
    else:
        return 2 * i, 2 * i + 1, i


@triton.jit
def _rotate_pairs(
    head_ptr, x1, x2, cache_row_ptr, half, IS_NEOX: tl.constexpr, HALF_PAD: tl.constexpr
):
    # x1, x2: [HALF_PAD] float32 values of the paired features (already in the
    # input dtype's precision); writes the rotated pairs back to head_ptr.
    i1, i2, i = _pair_offsets(HALF_PAD, half, IS_NEOX)
    mask = i < half
    x_ty = head_ptr.dtype.element_ty
    # cos_sin_cache row = [cos(pos * f_0..f_half-1) | sin(...)]; torch casts it
    # to the input dtype before use, so do we.
    cos = tl.load(cache_row_ptr + i, mask=mask, other=0.0).to(x_ty).to(tl.float32)
    sin = tl.load(cache_row_ptr + half + i, mask=mask, other=0.0).to(x_ty).to(tl.float32)
    tl.store(head_ptr + i1, (x1 * cos - x2 * sin).to(x_ty), mask=mask)
    tl.store(head_ptr + i2, (x2 * cos + x1 * sin).to(x_ty), mask=mask)


@triton.jit
def _rotary_embedding_kernel(
    positions_ptr,  # [T] int
    query_ptr,  # [T, num_q_heads, head_size] (token_stride, head_stride, 1)
    key_ptr,  # [T, num_k_heads, head_size], or query_ptr again when there is no key
    cos_sin_cache_ptr,  # [max_position, rotary_dim] = [cos | sin]
    q_token_stride,
    q_head_stride,
    k_token_stride,
    k_head_stride,
    cache_stride,
    num_q_heads,
    half,  # rotary_dim // 2
    IS_NEOX: tl.constexpr,
    HALF_PAD: tl.constexpr,  # next power of two >= half
):
    # One program = one (token, head); heads [0, num_q_heads) are query heads,
    # the rest key heads. Features past rotary_dim are never touched.
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    if head < num_q_heads:
        head_ptr = query_ptr + token * q_token_stride + head * q_head_stride
    else:
        head_ptr = key_ptr + token * k_token_stride + (head - num_q_heads) * k_head_stride
    pos = tl.load(positions_ptr + token).to(tl.int64)

    i1, i2, i = _pair_offsets(HALF_PAD, half, IS_NEOX)
    mask = i < half
    x1 = tl.load(head_ptr + i1, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(head_ptr + i2, mask=mask, other=0.0).to(tl.float32)
    _rotate_pairs(head_ptr, x1, x2, cos_sin_cache_ptr + pos * cache_stride, half, IS_NEOX, HALF_PAD)


def _head_layout(
    name: str, t: torch.Tensor, num_tokens: int, head_size: int
) -> tuple[int, int, int]:
    """(num_heads, token_stride, head_stride) of a [T, H * D] or [T, H, D] tensor."""
    _check_last_dim_contiguous(name, t)
    if t.dim() == 2 and t.shape[0] == num_tokens and t.shape[1] % head_size == 0:
        return t.shape[1] // head_size, t.stride(0), head_size
    if t.dim() == 3 and t.shape[0] == num_tokens and t.shape[2] == head_size:
        return t.shape[1], t.stride(0), t.stride(1)
    raise ValueError(
        f"{name} must be [num_tokens={num_tokens}, num_heads * {head_size}] or "
        f"[num_tokens, num_heads, {head_size}], got {tuple(t.shape)}"
    )


def _check_cos_sin_cache(cos_sin_cache: torch.Tensor, head_size: int) -> int:
    rotary_dim = cos_sin_cache.shape[-1] if cos_sin_cache.dim() == 2 else -1
    if rotary_dim <= 0 or rotary_dim % 2 or rotary_dim > head_size:
        raise ValueError(
            "cos_sin_cache must be [max_position, rotary_dim] with rotary_dim even and "
            f"<= head_size={head_size}; got shape {tuple(cos_sin_cache.shape)}"
        )
    _check_last_dim_contiguous("cos_sin_cache", cos_sin_cache)
    return rotary_dim


def rotary_embedding(
    positions: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor | None,
    head_size: int,
    cos_sin_cache: torch.Tensor,
    is_neox: bool,
) -> None:
    """Rotate ``query`` (and ``key``) in place by each token's position.

    positions: [T] (or any shape with T elements); query/key: [T, H * head_size]
    or [T, H, head_size], any token stride; cos_sin_cache: [max_position,
    rotary_dim], rotary_dim <= head_size (the rest of each head passes through).
    """
    positions = positions.reshape(-1)
    num_tokens = positions.shape[0]
    rotary_dim = _check_cos_sin_cache(cos_sin_cache, head_size)
    num_q_heads, q_ts, q_hs = _head_layout("query", query, num_tokens, head_size)
    if key is None:
        key_arg, num_k_heads, k_ts, k_hs = query, 0, 0, 0
    else:
        _check_same_dtype(query=query, key=key)
        num_k_heads, k_ts, k_hs = _head_layout("key", key, num_tokens, head_size)
        key_arg = key
    if num_tokens == 0 or num_q_heads + num_k_heads == 0:
        return
    half = rotary_dim // 2
    _rotary_embedding_kernel[(num_tokens, num_q_heads + num_k_heads)](
        positions,
        query,
        key_arg,
        cos_sin_cache,
        q_ts,
        q_hs,
        k_ts,
        k_hs,
        cos_sin_cache.stride(0),
        num_q_heads,
        half,
        IS_NEOX=bool(is_neox),
        HALF_PAD=triton.next_power_of_2(half),
        num_warps=1,
    )


@triton.jit
def _fused_qk_norm_rope_kernel(
    qkv_ptr,  # [T, (Hq + Hk + Hv) * D], row stride qkv_row_stride
    q_weight_ptr,  # [D]
    k_weight_ptr,  # [D]
    cos_sin_cache_ptr,  # [max_position, rotary_dim] = [cos | sin]
    positions_ptr,  # [T] int
    qkv_row_stride,
    cache_stride,
    num_heads_q,
    head_dim,
    rotary_dim,
    eps,
    IS_NEOX: tl.constexpr,
    D_PAD: tl.constexpr,  # next power of two >= head_dim
    HALF_PAD: tl.constexpr,  # next power of two >= rotary_dim // 2
):
    # One program = one (token, head) over the q heads then the k heads; the
    # head's D features are contiguous at column head * D of the qkv row.
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    head_ptr = qkv_ptr + token * qkv_row_stride + head * head_dim
    if head < num_heads_q:
        weight_ptr = q_weight_ptr
    else:
        weight_ptr = k_weight_ptr
    x_ty = qkv_ptr.dtype.element_ty

    # 1. RMS statistics over the whole head.
    offs = tl.arange(0, D_PAD)
    in_head = offs < head_dim
    x = tl.load(head_ptr + offs, mask=in_head, other=0.0).to(tl.float32)
    rstd = tl.rsqrt(tl.sum(x * x, axis=0) / head_dim + eps)

    # 2. Features past rotary_dim (partial RoPE): normalise, store, done.
    tail = in_head & (offs >= rotary_dim)
    w = tl.load(weight_ptr + offs, mask=in_head, other=0.0).to(tl.float32)
    y = ((x * rstd).to(x_ty).to(tl.float32) * w).to(x_ty)
    tl.store(head_ptr + offs, y, mask=tail)

    # 3. The rotary features: re-read them as pairs (from cache), normalise
    #    (rounded to the input dtype, as the unfused path stores them), rotate.
    half = rotary_dim // 2
    i1, i2, i = _pair_offsets(HALF_PAD, half, IS_NEOX)
    mask = i < half
    x1 = tl.load(head_ptr + i1, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(head_ptr + i2, mask=mask, other=0.0).to(tl.float32)
    w1 = tl.load(weight_ptr + i1, mask=mask, other=0.0).to(tl.float32)
    w2 = tl.load(weight_ptr + i2, mask=mask, other=0.0).to(tl.float32)
    y1 = ((x1 * rstd).to(x_ty).to(tl.float32) * w1).to(x_ty).to(tl.float32)
    y2 = ((x2 * rstd).to(x_ty).to(tl.float32) * w2).to(x_ty).to(tl.float32)
    pos = tl.load(positions_ptr + token).to(tl.int64)
    _rotate_pairs(head_ptr, y1, y2, cos_sin_cache_ptr + pos * cache_stride, half, IS_NEOX, HALF_PAD)


def fused_qk_norm_rope(
    qkv: torch.Tensor,
    num_heads_q: int,
    num_heads_k: int,
    num_heads_v: int,
    head_dim: int,
    eps: float,
    q_weight: torch.Tensor,
    k_weight: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    is_neox: bool,
    position_ids: torch.Tensor,
) -> None:
    """In place on ``qkv`` [T, (Hq + Hk + Hv) * D]: RMSNorm each q head with
    ``q_weight`` and each k head with ``k_weight`` (over D), then RoPE them.

    Equal to ``RMSNorm`` per head followed by ``rotary_embedding`` -- the unfused
    Qwen3 path -- in one kernel instead of three.
    """
    if qkv.dim() != 2 or qkv.shape[1] != (num_heads_q + num_heads_k + num_heads_v) * head_dim:
        raise ValueError(
            f"qkv must be [num_tokens, (num_heads_q + num_heads_k + num_heads_v) * head_dim] = "
            f"[T, {(num_heads_q + num_heads_k + num_heads_v) * head_dim}], got {tuple(qkv.shape)}"
        )
    _check_last_dim_contiguous("qkv", qkv)
    for name, w in (("q_weight", q_weight), ("k_weight", k_weight)):
        if w.shape != (head_dim,):
            raise ValueError(f"{name} must have shape ({head_dim},), got {tuple(w.shape)}")
    _check_same_dtype(qkv=qkv, q_weight=q_weight, k_weight=k_weight)
    rotary_dim = _check_cos_sin_cache(cos_sin_cache, head_dim)
    position_ids = position_ids.reshape(-1)
    num_tokens = qkv.shape[0]
    if position_ids.shape[0] != num_tokens:
        raise ValueError(
            f"position_ids must have one entry per qkv row ({num_tokens}), "
            f"got {position_ids.shape[0]}"
        )
    if num_tokens == 0 or num_heads_q + num_heads_k == 0:
        return
    _fused_qk_norm_rope_kernel[(num_tokens, num_heads_q + num_heads_k)](
        qkv,
        q_weight,
        k_weight,
        cos_sin_cache,
        position_ids,
        qkv.stride(0),
        cos_sin_cache.stride(0),
        num_heads_q,
        head_dim,
        rotary_dim,
        eps,
        IS_NEOX=bool(is_neox),
        D_PAD=triton.next_power_of_2(head_dim),
        HALF_PAD=triton.next_power_of_2(rotary_dim // 2),
        num_warps=1,
    )


# ----------------------------------------------------------------------------
# SiluAndMul
# ----------------------------------------------------------------------------
@triton.jit
def _silu_and_mul_kernel(
    out_ptr,  # [rows, d], row stride out_row_stride
    in_ptr,  # [rows, 2 * d] = [gate | up], row stride in_row_stride
    out_row_stride,
    in_row_stride,
    d,
    BLOCK: tl.constexpr,
):
    # One program = BLOCK columns of one row.
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < d
    src = in_ptr + row * in_row_stride
    gate = tl.load(src + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(src + d + cols, mask=mask, other=0.0).to(tl.float32)
    out_ty = out_ptr.dtype.element_ty
    # torch rounds silu(gate) to the input dtype before the multiply.
    act = (gate / (1.0 + tl.exp(-gate))).to(out_ty).to(tl.float32)
    tl.store(out_ptr + row * out_row_stride + cols, (act * up).to(out_ty), mask=mask)


def silu_and_mul(out: torch.Tensor, input: torch.Tensor) -> None:
    """``out[..., :] = silu(input[..., :d]) * input[..., d:]``; input [..., 2d], out [..., d]."""
    if input.shape[-1] % 2:
        raise ValueError(f"silu_and_mul needs an even last dimension, got {tuple(input.shape)}")
    d = input.shape[-1] // 2
    if out.shape != (*input.shape[:-1], d):
        raise ValueError(
            f"out must have shape {(*input.shape[:-1], d)} for input {tuple(input.shape)}, "
            f"got {tuple(out.shape)}"
        )
    _check_same_dtype(out=out, input=input)
    in2d, out2d = _as_2d("input", input), _as_2d("out", out)
    if in2d.shape[0] == 0 or d == 0:
        return
    block = min(triton.next_power_of_2(d), 1024)
    _silu_and_mul_kernel[(in2d.shape[0], triton.cdiv(d, block))](
        out2d,
        in2d,
        out2d.stride(0),
        in2d.stride(0),
        d,
        BLOCK=block,
        num_warps=4,
    )
