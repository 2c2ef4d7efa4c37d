"""LoRA layer wrappers and ``from_layer`` (vLLM twin: ``vllm/lora/layers/`` and
``vllm/lora/utils.py``'s ``from_layer``): which wrapper a base layer gets."""

from __future__ import annotations

from torch import nn

from engine.lora.layers.base_linear import BaseLinearLayerWithLoRA
from engine.lora.layers.column_parallel_linear import (
    ColumnParallelLinearWithLoRA,
    MergedColumnParallelLinearWithLoRA,
    MergedQKVParallelLinearWithLoRA,
)
from engine.lora.layers.row_parallel_linear import RowParallelLinearWithLoRA


def from_layer(layer: nn.Module, max_loras: int, max_lora_rank: int) -> BaseLinearLayerWithLoRA:
    """The LoRA wrapper of a linear layer, its per-slot weights allocated."""
    from engine.model_executor.layers.linear import (
        ColumnParallelLinear,
        MergedColumnParallelLinear,
        QKVParallelLinear,
        RowParallelLinear,
    )

    # Most specific first: the fused layers are ColumnParallelLinear too.
    for base, wrapper in (
        (QKVParallelLinear, MergedQKVParallelLinearWithLoRA),
        (MergedColumnParallelLinear, MergedColumnParallelLinearWithLoRA),
        (ColumnParallelLinear, ColumnParallelLinearWithLoRA),
        (RowParallelLinear, RowParallelLinearWithLoRA),
    ):
        if isinstance(layer, base):
            wrapped = wrapper(layer)
            wrapped.create_lora_weights(max_loras, max_lora_rank)
            return wrapped
    raise ValueError(f"no LoRA wrapper for {type(layer).__name__}")


__all__ = [
    "BaseLinearLayerWithLoRA",
    "ColumnParallelLinearWithLoRA",
    "MergedColumnParallelLinearWithLoRA",
    "MergedQKVParallelLinearWithLoRA",
    "RowParallelLinearWithLoRA",
    "from_layer",
]
