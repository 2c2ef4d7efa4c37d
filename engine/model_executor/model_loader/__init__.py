"""``get_model``: from a GlassboxConfig to a loaded ``nn.Module``.

vLLM twin: ``vllm/model_executor/model_loader/__init__.py`` (``get_model``,
``get_model_loader``).
Read it for the dispatch on ``load_config.load_format``: ``"auto"`` and
``"safetensors"`` read a checkpoint (``DefaultModelLoader``), ``"gguf"``
(also ``"auto"`` with a .gguf model) reads a llama.cpp file
(``GGUFModelLoader``), ``"dummy"`` fills random weights (``DummyModelLoader``).
Sessions: 04.

Difference from vLLM: ``get_model`` takes the device and dtype explicitly
(the worker resolves ``dtype="auto"`` with ``engine.utils.torch_utils.resolve_dtype``);
vLLM reads both from its configs.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import torch
from torch import nn

from engine.model_executor.model_loader.base_loader import BaseModelLoader
from engine.model_executor.model_loader.default_loader import DefaultModelLoader
from engine.model_executor.model_loader.dummy_loader import DummyModelLoader
from engine.model_executor.model_loader.gguf_loader import GGUFModelLoader

if TYPE_CHECKING:
    from engine.config import GlassboxConfig, LoadConfig

_LOAD_FORMAT_TO_MODEL_LOADER: dict[str, type[BaseModelLoader]] = {
    "auto": DefaultModelLoader,
    "safetensors": DefaultModelLoader,
    "gguf": GGUFModelLoader,
    "dummy": DummyModelLoader,
}


def get_model_loader(load_config: LoadConfig) -> BaseModelLoader:
    load_format = load_config.load_format
    if load_format not in _LOAD_FORMAT_TO_MODEL_LOADER:
        raise ValueError(
            f"load_format must be one of {sorted(_LOAD_FORMAT_TO_MODEL_LOADER)}, "
            f"got {load_format!r}"
        )
    return _LOAD_FORMAT_TO_MODEL_LOADER[load_format](load_config)


def get_model(
    glassbox_config: GlassboxConfig,
    device: torch.device | str,
    dtype: torch.dtype,
    prefix: str = "",
) -> nn.Module:
    """Build the model of ``glassbox_config`` on ``device`` in ``dtype`` and load
    its weights; ``prefix`` starts every layer name (``"draft_model"`` for a draft)."""
    load_config = glassbox_config.load_config
    if glassbox_config.model_config.is_gguf and load_config.load_format == "auto":
        load_config = dataclasses.replace(load_config, load_format="gguf")
    loader = get_model_loader(load_config)
    return loader.load_model(glassbox_config, device=device, dtype=dtype, prefix=prefix)


__all__ = [
    "BaseModelLoader",
    "DefaultModelLoader",
    "DummyModelLoader",
    "GGUFModelLoader",
    "get_model",
    "get_model_loader",
]
