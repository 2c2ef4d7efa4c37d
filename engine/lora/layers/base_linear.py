"""BaseLinearLayerWithLoRA: a linear layer plus per-slot adapter weights.

vLLM twin: ``vllm/lora/layers/base_linear.py`` (``BaseLinearLayerWithLoRA``:
``create_lora_weights``, ``reset_lora``, ``set_lora``, ``apply``).
Read it for the memory layout of multi-LoRA serving: for each output slice
(q, k, v of a fused projection; one slice otherwise) the layer holds
``lora_a_stacked [max_loras, max_lora_rank, in]`` and ``lora_b_stacked
[max_loras, n_slice, max_lora_rank]``, zero-padded to the largest rank, one
row per adapter slot. ``apply`` runs the base layer untouched, then adds
every token's adapter product through the punica wrapper. Sessions: 06.

Simpler than vLLM: no fully-sharded LoRA, no bias adapters, no LoRA stream.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from engine.lora.punica_wrapper import PunicaWrapperBase


class BaseLinearLayerWithLoRA(nn.Module):
    def __init__(self, base_layer: nn.Module) -> None:
        super().__init__()
        self.base_layer = base_layer
        self.input_size = base_layer.input_size
        # One entry per slice of the output (q/k/v or gate/up stack several).
        self.output_slices: tuple[int, ...] = tuple(base_layer.output_partition_sizes)
        self.punica_wrapper: PunicaWrapperBase | None = None

    def create_lora_weights(self, max_loras: int, max_lora_rank: int) -> None:
        weight = next(self.base_layer.parameters())
        dtype = weight.dtype if weight.is_floating_point() else torch.get_default_dtype()
        kwargs: dict[str, Any] = {"dtype": dtype, "device": weight.device}
        self.lora_a_stacked = tuple(
            torch.zeros(max_loras, max_lora_rank, self.input_size, **kwargs)
            for _ in self.output_slices
        )
        self.lora_b_stacked = tuple(
            torch.zeros(max_loras, size, max_lora_rank, **kwargs) for size in self.output_slices
        )

    def reset_lora(self, index: int) -> None:
        for a, b in zip(self.lora_a_stacked, self.lora_b_stacked, strict=True):
            a[index].zero_()
            b[index].zero_()

    def set_lora(
        self,
        index: int,
        lora_a: list[torch.Tensor | None],  # per slice: [r, in] or None
        lora_b: list[torch.Tensor | None],  # per slice: [n_slice, r] (scaling folded in)
    ) -> None:
        self.reset_lora(index)
        for i, (a, b) in enumerate(zip(lora_a, lora_b, strict=True)):
            if a is None or b is None:
                continue  # this slice has no adapter: its rows stay zero
            rank = a.shape[0]
            self.lora_a_stacked[i][index, :rank].copy_(a)
            self.lora_b_stacked[i][index, :, :rank].copy_(b)

    def set_mapping(self, punica_wrapper: PunicaWrapperBase) -> None:
        self.punica_wrapper = punica_wrapper

    def apply(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        output = self.base_layer.quant_method.apply(self.base_layer, x, bias)
        assert self.punica_wrapper is not None
        self.punica_wrapper.add_lora_linear(
            output.view(-1, output.shape[-1]),
            x.reshape(-1, x.shape[-1]),
            self.lora_a_stacked,
            self.lora_b_stacked,
            1.0,  # the adapters' scaling is folded into B (LoRALayerWeights.optimize)
            self.output_slices,
        )
        return output

    def forward(self, x: torch.Tensor):
        base = self.base_layer
        bias = None if base.skip_bias_add or getattr(base, "tp_rank", 0) > 0 else base.bias
        return base._finish(self.apply(x, bias))

    @property
    def weight(self) -> torch.Tensor:
        return self.base_layer.weight
