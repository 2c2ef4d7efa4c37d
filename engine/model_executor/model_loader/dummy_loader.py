"""Random weights instead of a checkpoint.

vLLM twin: ``vllm/model_executor/model_loader/dummy_loader.py``
(``DummyModelLoader``), used with ``load_format="dummy"``.
Read it for how to benchmark or test the engine with only a config.json: the
model is built as usual and every parameter is filled uniformly in
``[-1e-3, 1e-3)``, reproducibly for a given ``seed`` (see
``initialize_dummy_weights``). Outputs are meaningless text.
Sessions: 04.

Difference from vLLM: the seed is ``model_config.seed`` (vLLM always uses
1234), so two engines with the same seed get the same dummy model.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from torch import nn

from engine.model_executor.model_loader.base_loader import BaseModelLoader
from engine.model_executor.model_loader.weight_utils import initialize_dummy_weights

if TYPE_CHECKING:
    from engine.config import ModelConfig


class DummyModelLoader(BaseModelLoader):
    def download_model(self, model_config: ModelConfig) -> None:
        pass  # nothing to download

    def load_weights(self, model: nn.Module, model_config: ModelConfig) -> None:
        initialize_dummy_weights(model, seed=model_config.seed)
