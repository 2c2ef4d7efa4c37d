"""PunicaWrapperCPU: ``add_shrink`` / ``add_expand`` with the torch ops.

vLLM twin: ``vllm/lora/punica_wrapper/punica_cpu.py`` (``PunicaWrapperCPU``).
Read it for the loop over output slices: a fused q/k/v layer has three (A, B)
pairs, each shrinking the same input and expanding into its own columns.
Sessions: 06.

Simpler than vLLM: per-token ops for prefill and decode alike (vLLM's CPU
wrapper switches to the segment ops for prefill). CUDA gets the Triton
kernels instead (``punica_gpu.py``), unless Triton is missing.
"""

from __future__ import annotations

import torch

from engine.lora.ops.torch_ops import bgmv_expand_slice, bgmv_shrink
from engine.lora.punica_wrapper.punica_base import PunicaWrapperBase


class PunicaWrapperCPU(PunicaWrapperBase):
    def add_shrink(
        self,
        y: torch.Tensor,
        x: torch.Tensor,
        lora_a_stacked: tuple[torch.Tensor, ...],
        scale: float,
    ) -> None:
        indices = self._indices_for(x)
        for i, lora_a in enumerate(lora_a_stacked):
            bgmv_shrink(x, lora_a, y[i], indices, scale)

    def add_expand(
        self,
        y: torch.Tensor,
        x: torch.Tensor,
        lora_b_stacked: tuple[torch.Tensor, ...],
        output_slices: tuple[int, ...],
    ) -> None:
        indices = self._indices_for(x[0])
        offset = 0
        for i, (lora_b, size) in enumerate(zip(lora_b_stacked, output_slices, strict=True)):
            bgmv_expand_slice(x[i], lora_b, y, indices, offset, size)
            offset += size
