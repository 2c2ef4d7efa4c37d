"""LoRA around column-parallel layers: plain, gate/up, q/k/v.

vLLM twin: ``vllm/lora/layers/column_parallel_linear.py``
(``ColumnParallelLinearWithLoRA``, ``MergedColumnParallelLinearWithLoRA``,
``MergedQKVParallelLinearWithLoRA``).
Read it for the fused layers: one base matmul produces q, k and v (or gate
and up), and each slice gets its own adapter pair, since PEFT trains
``q_proj``, ``k_proj`` and ``v_proj`` separately. Sessions: 06.
"""

from __future__ import annotations

from engine.lora.layers.base_linear import BaseLinearLayerWithLoRA


class ColumnParallelLinearWithLoRA(BaseLinearLayerWithLoRA):
    """One slice: the layer's whole output."""


class MergedColumnParallelLinearWithLoRA(BaseLinearLayerWithLoRA):
    """gate_up_proj: slices gate, up."""


class MergedQKVParallelLinearWithLoRA(BaseLinearLayerWithLoRA):
    """qkv_proj: slices q, k, v."""
