"""Gated activations.

vLLM twin: ``vllm/model_executor/layers/activation.py`` (``SiluAndMul``).
Read it for why the MLP's gate and up projections are one matmul: the fused
``gate_up_proj`` output is ``[T, 2 * inter]`` and ``SiluAndMul`` splits it in
half, ``silu(gate) * up`` -> ``[T, inter]``.
Sessions: 04.

Simpler than vLLM: plain torch (vLLM calls a fused CUDA kernel).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class SiluAndMul(nn.Module):
    """``x: [..., 2d] -> silu(x[..., :d]) * x[..., d:]``, shape ``[..., d]``."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] % 2 != 0:
            raise ValueError(f"SiluAndMul needs an even last dimension, got shape {tuple(x.shape)}")
        d = x.shape[-1] // 2
        return F.silu(x[..., :d]) * x[..., d:]
