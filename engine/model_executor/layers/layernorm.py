"""RMSNorm, with the residual add fused in.

vLLM twin: ``vllm/model_executor/layers/layernorm.py`` (``RMSNorm``).
Read it for the fused-residual calling convention every decoder layer uses:
``norm(x)`` returns the normalised ``x``; ``norm(x, residual)`` first forms
``x + residual``, returns ``(normalised sum, sum)`` and the sum becomes the
next residual. That saves one read/write of the hidden states per norm.
The statistics are computed in float32 and the result cast back to the input
dtype before the weight multiply, as transformers and vLLM do.
Sessions: 04.

A ``CustomOp``: ``forward_native`` is the torch code above (the reference;
what the CPU runs), ``forward_cuda`` calls the fused Triton kernels
``rms_norm`` / ``fused_add_rms_norm`` from ``engine/_custom_ops.py`` -- one
launch per norm instead of ~7. Note the CUDA path's in-place contract (vLLM's
too): ``norm(x, residual)`` overwrites ``x`` with the normalised sum and
``residual`` with the sum, and returns those same two tensors.

Simpler than vLLM: no variance-size override, no batch-invariant mode; vLLM's
native path goes through its ``vllm.ir`` op registry (``ir.ops.rms_norm``),
ours is the torch code inline.
"""

from __future__ import annotations

import torch
from torch import nn

from engine._cpu_ops import cpu_kernels
from engine.model_executor.custom_op import CustomOp
from engine.model_executor.layers import cpu_fused


@CustomOp.register("rms_norm")
class RMSNorm(CustomOp):
    """``y = w * x / sqrt(mean(x^2, last dim) + eps)``."""

    def __init__(
        self,
        hidden_size: int,
        eps: float = 1e-6,
        has_weight: bool = True,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.hidden_size = hidden_size
        self.variance_epsilon = eps
        self.has_weight = has_weight
        weight = torch.ones(hidden_size, dtype=dtype or torch.get_default_dtype())
        if has_weight:
            self.weight = nn.Parameter(weight, requires_grad=False)
        else:
            self.register_buffer("weight", weight, persistent=False)

    def forward_native(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        # x: [..., hidden_size] (e.g. [T, hidden] or, for q/k norms, [T, heads, head_dim]).
        orig_dtype = x.dtype
        x = x.to(torch.float32)
        if residual is not None:
            x = x + residual.to(torch.float32)
            residual = x.to(orig_dtype)
        variance = x.pow(2).mean(dim=-1, keepdim=True)
        x = (x * torch.rsqrt(variance + self.variance_epsilon)).to(orig_dtype)
        if self.has_weight:
            x = x * self.weight
        return x if residual is None else (x, residual)

    def forward_cuda(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if self.weight.dtype != x.dtype or (residual is not None and residual.dtype != x.dtype):
            # torch would promote (e.g. bf16 x, fp32 weight -> fp32 out); the
            # kernels keep one dtype, so mixed inputs take the reference path.
            return self.forward_native(x, residual)
        from engine import _custom_ops as ops

        if residual is None:
            out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
            ops.rms_norm(out, x, self.weight, self.variance_epsilon)
            return out
        ops.fused_add_rms_norm(x, residual, self.weight, self.variance_epsilon)
        return x, residual

    def forward_cpu(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        # float32 everywhere: the same maths as forward_native in fewer ops
        # (bit-identical; see cpu_fused). Other dtypes upcast in the reference.
        if (
            x.dtype != torch.float32
            or self.weight.dtype != torch.float32
            or (residual is not None and residual.dtype != torch.float32)
        ):
            return self.forward_native(x, residual)
        weight = self.weight if self.has_weight else None
        kernels = cpu_kernels()
        if kernels is not None and (x.dim() <= 2 or x.is_contiguous()) and x.stride(-1) == 1:
            # csrc/cpu/layernorm.cpp: one call per norm (float rounding away from native).
            if residual is None:
                out = torch.empty_like(x, memory_format=torch.contiguous_format)
                kernels.rms_norm(out, x, weight, self.variance_epsilon)
                return out
            if residual.shape == x.shape and (residual.dim() <= 2 or residual.is_contiguous()):
                kernels.fused_add_rms_norm(x, residual, weight, self.variance_epsilon)
                return x, residual
        if residual is None:
            return cpu_fused.rms_norm(x, weight, self.variance_epsilon)
        cpu_fused.fused_add_rms_norm_(x, residual, weight, self.variance_epsilon)
        return x, residual

    def extra_repr(self) -> str:
        return f"hidden_size={self.hidden_size}, eps={self.variance_epsilon}"
