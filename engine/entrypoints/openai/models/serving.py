"""``OpenAIServingModels``: which model names this server answers to.

vLLM twin: ``vllm/entrypoints/openai/models/serving.py``.
Read it for ``GET /v1/models`` and the check behind "unknown model -> 404":
a request's ``model`` must be one of ``--served-model-name`` (by default the
model path given to ``glassbox serve``). Sessions: 01.

Simpler than vLLM: no LoRA adapters, so the list is fixed at start-up.

Differs from vLLM on purpose: the 404 for an unknown model quotes at most
``MAX_ECHOED_MODEL_NAME_CHARS`` characters of the name (vLLM echoes all of it),
so a client cannot make the server send back a megabyte of its own input.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.entrypoints.openai.engine.protocol import ModelCard, ModelList, ModelPermission

MAX_ECHOED_MODEL_NAME_CHARS = 100


def unknown_model_message(model_name: str) -> str:
    """The 404 text, with a long name cut to its first characters + "..."."""
    if len(model_name) > MAX_ECHOED_MODEL_NAME_CHARS:
        model_name = model_name[:MAX_ECHOED_MODEL_NAME_CHARS] + "..."
    return f"The model `{model_name}` does not exist."


@dataclass
class BaseModelPath:
    name: str
    model_path: str


class OpenAIServingModels:
    def __init__(self, base_model_paths: list[BaseModelPath], max_model_len: int | None) -> None:
        if not base_model_paths:
            raise ValueError("base_model_paths must name at least one model")
        self.base_model_paths = base_model_paths
        self.max_model_len = max_model_len

    def is_base_model(self, model_name: str) -> bool:
        return any(model.name == model_name for model in self.base_model_paths)

    def model_name(self) -> str:
        """The name responses carry (the first served name)."""
        return self.base_model_paths[0].name

    async def show_available_models(self) -> ModelList:
        return ModelList(
            data=[
                ModelCard(
                    id=model.name,
                    root=model.model_path,
                    max_model_len=self.max_model_len,
                    permission=[ModelPermission()],
                )
                for model in self.base_model_paths
            ]
        )
