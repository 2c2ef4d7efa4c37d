"""Quantization schemes by name: ``quantization="gguf"`` -> its config class.

vLLM twin: ``vllm/model_executor/layers/quantization/__init__.py``
(``QUANTIZATION_METHODS``, ``get_quantization_config``).
Read it for the registry every ``quantization=`` value goes through; each
scheme is a ``QuantizationConfig`` subclass (base_config.py).
Sessions: 06 (quantization).

Simpler than vLLM: two schemes, GGUF and FP8 (vLLM registers ~30).
"""

from __future__ import annotations

from engine.model_executor.layers.quantization.base_config import (
    QuantizationConfig,
    QuantizeMethodBase,
)

QUANTIZATION_METHODS: list[str] = ["fp8", "gguf"]


def get_quantization_config(quantization: str) -> type[QuantizationConfig]:
    if quantization not in QUANTIZATION_METHODS:
        raise ValueError(
            f"quantization must be one of {QUANTIZATION_METHODS}, got {quantization!r}"
        )
    from engine.model_executor.layers.quantization.fp8 import Fp8Config
    from engine.model_executor.layers.quantization.gguf import GGUFConfig

    return {"fp8": Fp8Config, "gguf": GGUFConfig}[quantization]


__all__ = [
    "QUANTIZATION_METHODS",
    "QuantizationConfig",
    "QuantizeMethodBase",
    "get_quantization_config",
]
