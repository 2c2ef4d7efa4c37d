"""PunicaWrapperGPU: ``add_shrink`` / ``add_expand`` with the Triton kernels.

vLLM twin: ``vllm/lora/punica_wrapper/punica_gpu.py`` (``PunicaWrapperGPU``:
``update_metadata``, ``add_shrink``, ``add_expand``, ``add_lora_linear``).
Read it for how the per-step work moves out of the layers: ``update_metadata``
groups the step's tokens by slot once (``LoRAKernelMeta.prepare_tensors``),
and every LoRA layer of the forward pass reuses that grouping, running one
shrink launch over all its slices (q, k, v in one go) and one expand launch.
The shrunk ``[num_slices, T, r]`` intermediate is kept in fp32, so a bf16
model rounds the LoRA product once, when it is added to the layer's output.
Sessions: 06.

Simpler than vLLM: one set of metadata (vLLM keeps a second one for the
sampler's LoRA logits and MoE LoRA), no embedding or LM-head LoRA, no
CUDA-graph specialization on the number of active adapters. The class needs
no CUDA call of its own: the tests run it on CPU tensors with Triton's
interpreter (``TRITON_INTERPRET=1``), constructing it directly, while
``get_punica_wrapper`` picks it on CUDA only.
"""

from __future__ import annotations

import torch

from engine.lora.ops.triton_ops import LoRAKernelMeta, lora_expand, lora_shrink
from engine.lora.punica_wrapper.punica_base import PunicaWrapperBase


class PunicaWrapperGPU(PunicaWrapperBase):
    def __init__(
        self, max_num_batched_tokens: int, device: torch.device | str, max_loras: int
    ) -> None:
        super().__init__(max_num_batched_tokens, device)
        self.max_loras = max_loras
        self.token_mapping_meta = LoRAKernelMeta.make(max_loras, max_num_batched_tokens, device)

    def update_metadata(self, token_lora_mapping: torch.Tensor) -> None:
        super().update_metadata(token_lora_mapping)
        # From the caller's tensor, not the device copy: on the host the
        # no-adapter check costs nothing.
        self.token_mapping_meta.prepare_tensors(token_lora_mapping)

    def add_shrink(
        self,
        y: torch.Tensor,
        x: torch.Tensor,
        lora_a_stacked: tuple[torch.Tensor, ...],
        scale: float,
    ) -> None:
        lora_shrink(x, lora_a_stacked, y, *self.token_mapping_meta.meta_args(x.shape[0]), scale)

    def add_expand(
        self,
        y: torch.Tensor,
        x: torch.Tensor,
        lora_b_stacked: tuple[torch.Tensor, ...],
        output_slices: tuple[int, ...],
        offset_start: int = 0,
        add_inputs: bool = True,
    ) -> None:
        assert tuple(b.shape[1] for b in lora_b_stacked) == tuple(output_slices)
        lora_expand(
            x,
            lora_b_stacked,
            y,
            *self.token_mapping_meta.meta_args(x.shape[1]),
            offset_start=offset_start,
            add_inputs=add_inputs,
        )

    def add_lora_linear(
        self,
        y: torch.Tensor,
        x: torch.Tensor,
        lora_a_stacked: tuple[torch.Tensor, ...],
        lora_b_stacked: tuple[torch.Tensor, ...],
        scale: float,
        output_slices: tuple[int, ...],
    ) -> None:
        """As the base class, with an fp32 intermediate (the base's is ``x.dtype``)."""
        if self.token_mapping_meta.no_lora:
            return  # the whole step runs the base model: no launch, no buffer
        rank = lora_a_stacked[0].shape[1]
        buffer = torch.empty(
            len(output_slices), x.shape[0], rank, dtype=torch.float32, device=x.device
        )
        self.add_shrink(buffer, x, lora_a_stacked, scale)
        self.add_expand(y, buffer, lora_b_stacked, output_slices)
