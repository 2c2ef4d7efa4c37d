"""QuantFP8: scale a tensor into float8 (e4m3), per tensor.

vLLM twin: ``vllm/model_executor/layers/quantization/input_quant_fp8.py``
(``QuantFP8``).
Read it for what "W8A8" asks of the activations: before each FP8 matmul the
input ``x`` is quantized too. Dynamic: ``scale = max|x| / 448`` (448 is the
largest e4m3 number), computed on the device for every call, so the largest
entry maps to the top of the fp8 range; static: the checkpoint's
``input_scale``. ``x / scale`` is rounded to e4m3 (3 mantissa bits: a
relative step of 1/8 near each power of two), clamped to +-448.
Sessions: 06 (quantization).

Simpler than vLLM: per-tensor scales only (vLLM also has per-token and
per-group scales); ``forward_cuda`` runs the same torch code (vLLM calls its
``scaled_fp8_quant`` CUDA kernel).
"""

from __future__ import annotations

import torch

from engine.model_executor.custom_op import CustomOp

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8_DTYPE).max  # 448.0
# A zero tensor would give scale 0 and 0/0 below; vLLM clamps the same way.
_MIN_SCALE = 1.0 / (FP8_MAX * 512.0)


def scaled_fp8_quant(
    x: torch.Tensor, scale: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(x / scale)`` in e4m3 and the float32 scalar ``scale`` (computed from
    ``max|x|`` when not given). ``x`` is any float tensor."""
    if scale is None:
        scale = (x.abs().amax().float() / FP8_MAX).clamp(min=_MIN_SCALE)
    q = (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q, scale.reshape(())


@CustomOp.register("quant_fp8")
class QuantFP8(CustomOp):
    """``forward(x, scale=None) -> (x_fp8, scale)``; ``static``: a scale must be given."""

    def __init__(self, static: bool) -> None:
        super().__init__()
        self.static = static

    def forward_native(
        self, x: torch.Tensor, scale: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if self.static and scale is None:
            raise ValueError("QuantFP8(static=True) needs the checkpoint's input_scale")
        return scaled_fp8_quant(x, scale)

    def forward_cuda(
        self, x: torch.Tensor, scale: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return self.forward_native(x, scale)
