"""Load a Hugging Face checkpoint folder of safetensors files.

vLLM twin: ``vllm/model_executor/model_loader/default_loader.py``
(``DefaultModelLoader``), used with ``load_format="auto"`` or
``"safetensors"``.
Read it for the loading contract: the loader only *streams* ``(name,
tensor)`` pairs; the model's own ``load_weights`` decides where each goes and
returns the names it filled; the loader then checks that every parameter was
filled (``track_weights_loading``) -- a checkpoint that silently leaves
weights uninitialised would otherwise produce garbage text, not an error.
Sessions: 04.

Simpler than vLLM: safetensors only (one file or many with
``model.safetensors.index.json``), no secondary weight sources, no
multithreaded or prefetching readers. ``model`` is a local folder or a Hub
repo id that is already cached (or downloadable when online).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Generator, Iterable
from typing import TYPE_CHECKING

import torch
from torch import nn

from engine.model_executor.model_loader.base_loader import BaseModelLoader
from engine.model_executor.model_loader.weight_utils import (
    download_weights_from_hf,
    find_safetensors_files,
    safetensors_weights_iterator,
)

if TYPE_CHECKING:
    from engine.config import ModelConfig


class DefaultModelLoader(BaseModelLoader):
    @dataclasses.dataclass
    class Source:
        """Where one set of weights comes from."""

        model_or_path: str
        revision: str | None = None
        prefix: str = ""  # prepended to every tensor name

    def _prepare_weights(
        self, model_name_or_path: str, revision: str | None
    ) -> tuple[str, list[str]]:
        """The local folder and its safetensors files (downloading if needed)."""
        if os.path.isdir(model_name_or_path):
            hf_folder = model_name_or_path
        else:
            hf_folder = download_weights_from_hf(model_name_or_path, ["*.safetensors"], revision)
        return hf_folder, find_safetensors_files(hf_folder)

    def _get_weights_iterator(
        self, source: Source
    ) -> Generator[tuple[str, torch.Tensor], None, None]:
        _, files = self._prepare_weights(source.model_or_path, source.revision)
        for name, tensor in safetensors_weights_iterator(files):
            yield source.prefix + name, tensor

    def get_all_weights(
        self, model_config: ModelConfig, model: nn.Module
    ) -> Generator[tuple[str, torch.Tensor], None, None]:
        yield from self._get_weights_iterator(DefaultModelLoader.Source(model_config.model))

    def download_model(self, model_config: ModelConfig) -> None:
        self._prepare_weights(model_config.model, None)

    def load_weights(self, model: nn.Module, model_config: ModelConfig) -> None:
        weights = _NameTracker(self.get_all_weights(model_config, model))
        try:
            loaded_weights = model.load_weights(weights)
        except ValueError as e:
            # Say which checkpoint tensor was being loaded if the error doesn't.
            if weights.current is not None and weights.current not in str(e):
                raise ValueError(f"while loading checkpoint tensor {weights.current!r}: {e}") from e
            raise
        self.track_weights_loading(model, loaded_weights, model_config.model)


class _NameTracker:
    """Wraps the weights iterator and remembers the last name handed out."""

    def __init__(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        self._weights = iter(weights)
        self.current: str | None = None

    def __iter__(self) -> _NameTracker:
        return self

    def __next__(self) -> tuple[str, torch.Tensor]:
        name, tensor = next(self._weights)
        self.current = name
        return name, tensor
