"""LoRA around a row-parallel layer (o_proj, down_proj).

vLLM twin: ``vllm/lora/layers/row_parallel_linear.py`` (``RowParallelLinearWithLoRA``).
Read it for where tensor parallelism would split ``A`` (by input columns, as
the base weight) and leave ``B`` whole. With one worker nothing is split.
Sessions: 06.
"""

from __future__ import annotations

from engine.lora.layers.base_linear import BaseLinearLayerWithLoRA


class RowParallelLinearWithLoRA(BaseLinearLayerWithLoRA):
    """One slice: the layer's whole output."""
