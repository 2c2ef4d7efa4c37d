"""The two-phase model load every loader shares: build, then fill.

vLLM twin: ``vllm/model_executor/model_loader/base_loader.py``
(``BaseModelLoader.load_model``) and ``model_loader/utils.py``
(``initialize_model``).
Read it for the order of events: the registry maps config.json's
``architectures`` to a class; the class is instantiated with the model dtype
as torch's default dtype and the target device as the default device (so
every parameter is created in place, with no CPU copy first); then
``load_weights`` fills the parameters; the module is returned in eval mode.
Sessions: 04.

Simpler than vLLM: no quantization post-processing
(``process_weights_after_loading``) and no model inspection logging.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING

import torch
from torch import nn

from engine.model_executor.layers.rotary_embedding import clear_rope_cache
from engine.model_executor.models.registry import ModelRegistry
from engine.utils.torch_utils import set_default_torch_dtype

if TYPE_CHECKING:
    from engine.config import GlassboxConfig, LoadConfig, ModelConfig


def initialize_model(glassbox_config: GlassboxConfig, prefix: str = "") -> nn.Module:
    """Instantiate the architecture named in config.json (weights uninitialised)."""
    model_config = glassbox_config.model_config
    model_cls = ModelRegistry.resolve_model_cls(model_config.architectures)
    try:
        return model_cls(glassbox_config=glassbox_config, prefix=prefix)
    finally:
        clear_rope_cache()  # the layers of one model share a RoPE module; models do not


class BaseModelLoader(ABC):
    def __init__(self, load_config: LoadConfig) -> None:
        self.load_config = load_config

    @abstractmethod
    def download_model(self, model_config: ModelConfig) -> None:
        """Make the weights available locally (no-op when there is nothing to fetch)."""

    @abstractmethod
    def load_weights(self, model: nn.Module, model_config: ModelConfig) -> None:
        """Fill the parameters of an already-built ``model``."""

    def track_weights_loading(
        self, model: nn.Module, loaded_weights: set[str], source: str = ""
    ) -> None:
        """Every parameter must have been filled from the checkpoint."""
        weights_to_load = {name for name, _ in model.named_parameters()}
        weights_not_loaded = weights_to_load - set(loaded_weights)
        if weights_not_loaded:
            raise ValueError(
                f"the checkpoint {source!r} is missing weights for these parameters: "
                f"{sorted(weights_not_loaded)}"
            )

    def load_model(
        self,
        glassbox_config: GlassboxConfig,
        device: torch.device | str,
        dtype: torch.dtype,
        prefix: str = "",
    ) -> nn.Module:
        """``prefix`` names the model's layers: a draft model is built under
        ``"draft_model"`` so its attention layers do not clash with the target's."""
        model_config = glassbox_config.model_config
        with set_default_torch_dtype(dtype), torch.device(device):
            model = initialize_model(glassbox_config, prefix=prefix)
        self.load_weights(model, model_config)
        return model.eval()
