"""The punica ops in plain torch (vLLM twin: ``vllm/lora/ops/torch_ops/``). Sessions: 06."""

from engine.lora.ops.torch_ops.lora_ops import bgmv_expand_slice, bgmv_shrink

__all__ = ["bgmv_expand_slice", "bgmv_shrink"]
