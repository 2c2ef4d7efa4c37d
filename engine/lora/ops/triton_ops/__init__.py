"""The punica ops as Triton kernels (vLLM twin: ``vllm/lora/ops/triton_ops/``):
``LoRAKernelMeta`` groups a step's tokens by adapter slot, ``lora_shrink`` and
``lora_expand`` run the two grouped matmuls. Sessions: 06."""

from engine.lora.ops.triton_ops.lora_expand_op import lora_expand
from engine.lora.ops.triton_ops.lora_kernel_metadata import LoRAKernelMeta
from engine.lora.ops.triton_ops.lora_shrink_op import lora_shrink

__all__ = ["LoRAKernelMeta", "lora_expand", "lora_shrink"]
