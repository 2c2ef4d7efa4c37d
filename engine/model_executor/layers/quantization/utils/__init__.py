"""Helpers shared by the quantization schemes.

vLLM twin: ``vllm/model_executor/layers/quantization/utils/``.
Sessions: 06 (quantization).

Simpler than vLLM: only ``quant_utils.GroupShape`` (vLLM's package also holds
the kernels' layout and marlin / machete / w8a8 helpers).
"""
