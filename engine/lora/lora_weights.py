"""LoRALayerWeights: one module's adapter, ``A`` and ``B``.

vLLM twin: ``vllm/lora/lora_weights.py`` (``LoRALayerWeights``).
Read it for the shapes: ``lora_a`` is ``[r, in]``, ``lora_b`` is ``[out, r]``,
and the module's output gains ``scaling * x A^T B^T``; ``optimize()`` folds
``scaling`` into ``B`` once so the kernels skip the multiply. Sessions: 06.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class LoRALayerWeights:
    module_name: str  # e.g. model.layers.0.self_attn.q_proj
    rank: int
    lora_a: torch.Tensor  # [r, in]
    lora_b: torch.Tensor  # [out, r]
    scaling: float = 1.0

    def optimize(self) -> LoRALayerWeights:
        if self.scaling != 1.0:
            self.lora_b = self.lora_b * self.scaling
            self.scaling = 1.0
        return self
