"""A Triton GEMM for decode-sized batches: ``y = x W^T + b`` with 1 to 16 rows of ``x``.

vLLM twin: the ROCm skinny GEMMs -- ``rocm_unquantized_gemm_impl`` in
``vllm/model_executor/layers/utils.py``, which sends 1-4 rows to ``ops.wvSplitK`` and
``ops.LLMM1`` (CUDA C++ in ``csrc/rocm/skinny_gemms.cu``). vLLM on NVIDIA GPUs keeps
``F.linear`` (cuBLAS) for every shape. Read it for why a decode step at batch 1 is not
the weights' bytes over the bandwidth: a GEMM library tiles for large M, so with one row
most of each tile is padding and the kernel's fixed start-up and tail cost, a few
microseconds, is larger than the time to stream a 1024 x 1024 bf16 matrix (2 MB at
~4.3 TB/s: 0.5 us). A skinny GEMM gives each program a strip of ``BLOCK_N`` output
features, walks the whole ``K`` in ``BLOCK_K`` slices, and reads every weight exactly
once.
Sessions: 04 (worker), 06 (what the batch-1 step spends its time on).

Shapes: ``x`` is ``[..., K]`` with at most ``SKINNY_GEMM_MAX_ROWS`` rows once flattened,
``W`` is ``[N, K]`` contiguous, ``b`` is ``[N]`` or None; the output is ``[..., N]`` in
``x``'s dtype. Products are summed in float32 and rounded once, so the result is within
one output ulp of cuBLAS's, whose reduction order differs. One row uses a
multiply-and-sum over the K slice; 2 to 16 rows use ``tl.dot`` on a 16-row tile (the
unused rows are masked: their loads read nothing). The launch reads shapes only (no host
sync, no allocation besides the output), so it can be captured in a CUDA graph.

Simpler than vLLM: Triton instead of hand-written HIP, no split-K (a layer needs
enough output features to fill the GPU: ``N / BLOCK_N`` programs), a fixed tile table
instead of one derived from the compute-unit count, no fp8 inputs. Not on the engine's
path yet: ``benchmarks/skinny_gemm.py`` measures it against ``F.linear`` on the GPU
first (docs/gpu.md, "Where the batch-1 step goes").
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

# Rows of x the kernel takes (one tl.dot tile); more rows are a GEMM library's job.
SKINNY_GEMM_MAX_ROWS = 16


@dataclass(frozen=True)
class SkinnyGemmConfig:
    """A launch shape: output features and input features per program step."""

    block_n: int = 16
    block_k: int = 256
    num_warps: int = 4
    num_stages: int = 3


@triton.jit
def _skinny_gemm_kernel(
    x_ptr,
    w_ptr,
    b_ptr,
    out_ptr,
    M,
    N,
    stride_xm,
    stride_om,
    K: tl.constexpr,  # the reduction length: one build per value (a model has a few)
    HAS_BIAS: tl.constexpr,
    USE_DOT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    # One program = output features [n0, n0 + BLOCK_N) for every row of x.
    pid = tl.program_id(0)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    offs_m = tl.arange(0, BLOCK_M)
    m_mask = offs_m < M
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_mask = offs_k < K
        # W tile [BLOCK_N, BLOCK_K]: contiguous along K, read once in the whole launch.
        w = tl.load(
            w_ptr + offs_n[:, None] * K + offs_k[None, :],
            mask=n_mask[:, None] & k_mask[None, :],
            other=0.0,
        )
        # x tile [BLOCK_M, BLOCK_K]: a few KB, re-read by every program (from L2).
        x = tl.load(
            x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :],
            mask=m_mask[:, None] & k_mask[None, :],
            other=0.0,
        )
        if USE_DOT:
            acc += tl.dot(x, tl.trans(w), out_dtype=tl.float32)
        else:
            prod = x.to(tl.float32) * w.to(tl.float32)  # [BLOCK_N, BLOCK_K]
            acc += tl.sum(prod, axis=1)[None, :]
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    out = out_ptr + offs_m[:, None] * stride_om + offs_n[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


def skinny_gemm(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    config: SkinnyGemmConfig | None = None,
) -> torch.Tensor:
    """``x W^T + b`` for at most ``SKINNY_GEMM_MAX_ROWS`` rows (see the module docstring)."""
    k = x.shape[-1]
    if weight.ndim != 2 or weight.shape[1] != k:
        raise ValueError(
            f"skinny_gemm: weight must be [N, {k}] to match x's last dim, got {tuple(weight.shape)}"
        )
    if not weight.is_contiguous():
        raise ValueError("skinny_gemm: weight must be contiguous ([N, K] row-major)")
    if x.dtype != weight.dtype:
        raise ValueError(f"skinny_gemm: x is {x.dtype} but weight is {weight.dtype}")
    n = weight.shape[0]
    if bias is not None and tuple(bias.shape) != (n,):
        raise ValueError(f"skinny_gemm: bias must be [{n}], got {tuple(bias.shape)}")
    x2 = x.reshape(-1, k)
    m = x2.shape[0]
    if m > SKINNY_GEMM_MAX_ROWS:
        raise ValueError(
            f"skinny_gemm: x has {m} rows; at most {SKINNY_GEMM_MAX_ROWS} (use F.linear)"
        )
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m > 0 and n > 0:
        cfg = config or SkinnyGemmConfig()
        grid = (triton.cdiv(n, cfg.block_n),)
        _skinny_gemm_kernel[grid](
            x2,
            weight,
            bias if bias is not None else weight,  # never read without HAS_BIAS
            out,
            m,
            n,
            x2.stride(0),
            out.stride(0),
            K=k,
            HAS_BIAS=bias is not None,
            USE_DOT=m > 1,
            BLOCK_M=SKINNY_GEMM_MAX_ROWS if m > 1 else 1,  # a tl.dot tile, or one row
            BLOCK_N=cfg.block_n,
            BLOCK_K=cfg.block_k,
            num_warps=cfg.num_warps,
            num_stages=cfg.num_stages,
        )
    return out.reshape(*x.shape[:-1], n)
