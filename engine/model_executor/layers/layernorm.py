"""RMSNorm, with the residual add fused in.

vLLM twin: ``vllm/model_executor/layers/layernorm.py`` (``RMSNorm``).
Read it for the fused-residual calling convention every decoder layer uses:
``norm(x)`` returns the normalised ``x``; ``norm(x, residual)`` first forms
``x + residual``, returns ``(normalised sum, sum)`` and the sum becomes the
next residual. That saves one read/write of the hidden states per norm.
The statistics are computed in float32 and the result cast back to the input
dtype before the weight multiply, as transformers and vLLM do.
Sessions: 04.

Simpler than vLLM: one plain-torch ``forward`` (vLLM dispatches to fused CUDA
kernels through ``CustomOp``); no variance-size override.
"""

from __future__ import annotations

import torch
from torch import nn


class RMSNorm(nn.Module):
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

    def forward(
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

    def extra_repr(self) -> str:
        return f"hidden_size={self.hidden_size}, eps={self.variance_epsilon}"
