"""QuantFP8: scale a tensor into float8 (e4m3), per tensor or per token.

vLLM twin: ``vllm/model_executor/layers/quantization/input_quant_fp8.py``
(``QuantFP8``).
Read it for what "W8A8" asks of the activations: before each FP8 matmul the
input ``x`` is quantized too. Dynamic: ``scale = max|x| / 448`` (448 is the
largest e4m3 number), computed on the device for every call, so the largest
entry maps to the top of the fp8 range; static: the checkpoint's
``input_scale``. ``x / scale`` is rounded to e4m3 (3 mantissa bits: a
relative step of 1/8 near each power of two), clamped to +-448.
The ``group_shape`` says over what the max is taken: ``PER_TENSOR``, one
scale for the whole batch (so a token's rounding depends on the other tokens
of its batch), or ``PER_TOKEN``, a scale per row (a token's rounding is its
own).
Sessions: 06 (quantization).

Simpler than vLLM: per-tensor and per-token scales (vLLM also has per-group
ones); ``forward_cuda`` runs the same torch code (vLLM calls its
``scaled_fp8_quant`` CUDA kernel).
"""

from __future__ import annotations

import torch

from engine.model_executor.custom_op import CustomOp
from engine.model_executor.layers.quantization.utils.quant_utils import GroupShape

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8_DTYPE).max  # 448.0
# A zero tensor would give scale 0 and 0/0 below; vLLM clamps the same way.
_MIN_SCALE = 1.0 / (FP8_MAX * 512.0)


def scaled_fp8_quant(
    x: torch.Tensor, scale: torch.Tensor | None = None, use_per_token_if_dynamic: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(x / scale)`` in e4m3 and the float32 ``scale``. Given, or computed
    from ``max|x|``: a scalar, or with ``use_per_token_if_dynamic`` one per
    row of the 2-D ``x`` (shape ``[rows, 1]``)."""
    if scale is None:
        if use_per_token_if_dynamic:
            amax = x.abs().amax(dim=-1, keepdim=True)  # [rows, 1]
        else:
            amax = x.abs().amax().reshape(())
        scale = (amax.float() / FP8_MAX).clamp(min=_MIN_SCALE)
    elif scale.numel() == 1:
        scale = scale.reshape(())
    q = (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q, scale


@CustomOp.register("quant_fp8")
class QuantFP8(CustomOp):
    """``forward(x, scale=None) -> (x_fp8, scale)``; ``static``: a scale must be
    given (one per tensor); dynamic: computed per ``group_shape``."""

    def __init__(self, static: bool, group_shape: GroupShape = GroupShape.PER_TENSOR) -> None:
        super().__init__()
        if group_shape not in (GroupShape.PER_TENSOR, GroupShape.PER_TOKEN):
            raise ValueError(
                f"QuantFP8 group_shape must be PER_TENSOR or PER_TOKEN, got {group_shape}"
            )
        if static and group_shape != GroupShape.PER_TENSOR:
            raise ValueError("QuantFP8(static=True) takes one checkpoint scale: PER_TENSOR only")
        self.static = static
        self.group_shape = group_shape
        self.use_per_token_if_dynamic = group_shape == GroupShape.PER_TOKEN

    def forward_native(
        self, x: torch.Tensor, scale: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if self.static and scale is None:
            raise ValueError("QuantFP8(static=True) needs the checkpoint's input_scale")
        return scaled_fp8_quant(x, scale, self.use_per_token_if_dynamic)

    def forward_cuda(
        self, x: torch.Tensor, scale: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return self.forward_native(x, scale)
