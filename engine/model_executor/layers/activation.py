"""Gated activations.

vLLM twin: ``vllm/model_executor/layers/activation.py`` (``SiluAndMul``).
Read it for why the MLP's gate and up projections are one matmul: the fused
``gate_up_proj`` output is ``[T, 2 * inter]`` and ``SiluAndMul`` splits it in
half, ``silu(gate) * up`` -> ``[T, inter]``.
Sessions: 04.

A ``CustomOp``: ``forward_native`` is two torch ops (silu, then the multiply);
``forward_cuda`` is one Triton kernel, ``silu_and_mul`` in
``engine/_custom_ops.py``, that reads the ``[T, 2 * inter]`` input once.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine._cpu_ops import cpu_kernels
from engine.model_executor.custom_op import CustomOp
from engine.model_executor.layers import cpu_fused


@CustomOp.register("silu_and_mul")
class SiluAndMul(CustomOp):
    """``x: [..., 2d] -> silu(x[..., :d]) * x[..., d:]``, shape ``[..., d]``."""

    @staticmethod
    def _check(x: torch.Tensor) -> int:
        if x.shape[-1] % 2 != 0:
            raise ValueError(f"SiluAndMul needs an even last dimension, got shape {tuple(x.shape)}")
        return x.shape[-1] // 2

    def forward_native(self, x: torch.Tensor) -> torch.Tensor:
        d = self._check(x)
        return F.silu(x[..., :d]) * x[..., d:]

    def forward_cpu(self, x: torch.Tensor) -> torch.Tensor:
        d = self._check(x)
        # Dtype first: asking for the kernels may compile them (minutes).
        if x.dtype == torch.float32 and x.is_contiguous() and (kernels := cpu_kernels()):
            out = torch.empty((*x.shape[:-1], d), dtype=x.dtype)
            kernels.silu_and_mul(out, x)  # csrc/cpu/activation.cpp: one pass
            return out
        return cpu_fused.silu_and_mul(x)  # the product lands in the silu output: one op fewer

    def forward_cuda(self, x: torch.Tensor) -> torch.Tensor:
        from engine import _custom_ops as ops

        d = self._check(x)
        out = torch.empty((*x.shape[:-1], d), dtype=x.dtype, device=x.device)
        ops.silu_and_mul(out, x)
        return out
