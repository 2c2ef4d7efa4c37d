"""The two base classes of quantization: a config, and a method per layer.

vLLM twin: ``vllm/model_executor/layers/quantization/base_config.py``
(``QuantizationConfig``, ``QuantizeMethodBase``).
Read it for the three levels every quantization scheme in vLLM follows:

  Config  one object per model, built from the checkpoint (or the
          ``quantization=`` argument): which layers are quantized and how;
  Method  one object per layer, handed out by ``Config.get_quant_method``:
          it creates the layer's parameters (``create_weights``), converts
          them once loaded (``process_weights_after_loading``) and computes
          the layer's output (``apply``; ``embedding`` for a vocabulary);
  Kernel  what ``apply`` calls to do the arithmetic on the stored format.

A linear layer never looks at its weights itself: it calls
``self.quant_method.apply(self, x, bias)``. The unquantized case is just one
more method (``UnquantizedLinearMethod`` in layers/linear.py).
Sessions: 06 (quantization).

Simpler than vLLM: no minimum GPU capability, no checkpoint-name mapping
(``apply_vllm_mapper``), no KV-cache scales.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

import torch
from torch import nn


class QuantizeMethodBase(ABC):
    """How one layer stores its weights and computes with them."""

    @abstractmethod
    def create_weights(
        self, layer: nn.Module, *weight_args: Any, **extra_weight_attrs: Any
    ) -> None:
        """Register the layer's parameters (their loaders come in ``extra_weight_attrs``)."""

    @abstractmethod
    def apply(self, layer: nn.Module, *args: Any, **kwargs: Any) -> torch.Tensor:
        """The layer's output from its stored weights."""

    def embedding(self, layer: nn.Module, *args: Any, **kwargs: Any) -> torch.Tensor:
        """Rows of an embedding table; only vocabulary methods have it."""
        raise RuntimeError(f"{type(self).__name__} is not a method for embedding tables")

    def process_weights_after_loading(self, layer: nn.Module) -> None:  # noqa: B027
        """Turn what the checkpoint gave into what ``apply`` reads (default: nothing)."""


class QuantizationConfig(ABC):
    """One quantization scheme, as configured for one model."""

    @abstractmethod
    def get_name(self) -> str:
        """The ``quantization=`` name (``"gguf"``)."""

    @abstractmethod
    def get_supported_act_dtypes(self) -> list[torch.dtype]:
        """Activation dtypes the method's kernels accept."""

    @classmethod
    @abstractmethod
    def from_config(cls, config: dict[str, Any]) -> QuantizationConfig:
        """Build from a checkpoint's quantization config (``{}`` when it has none)."""

    @abstractmethod
    def get_quant_method(self, layer: nn.Module, prefix: str) -> QuantizeMethodBase | None:
        """The method for ``layer`` (named ``prefix``); None leaves it unquantized."""
