"""``OpenAIServingModels``: which model names this server answers to.

vLLM twin: ``vllm/entrypoints/openai/models/serving.py``.
Read it for ``GET /v1/models`` and the check behind "unknown model -> 404":
a request's ``model`` must be one of ``--served-model-name`` (by default the
model path given to ``glassbox serve``) or the name of a LoRA adapter. The
adapters come from ``--lora-modules name=path`` at start-up and, when
``GLASSBOX_ALLOW_RUNTIME_LORA_UPDATING`` is set (vLLM's
``VLLM_ALLOW_RUNTIME_LORA_UPDATING``), from ``POST /v1/load_lora_adapter``;
each gets the next integer id, and a request naming it runs with its
``LoRARequest``. A load (``init_static_loras`` for the start-up ones) has the
engine read the adapter at once (``engine_client.add_lora``), as vLLM's does:
a broken adapter, or one trained for another base model, is refused there
with a 400 instead of failing the first request that names it.
Sessions: 01, 06 (LoRA).

Simpler than vLLM: no LoRA resolver plugins, no in-place reload.

Differs from vLLM on purpose: the 404 for an unknown model quotes at most
``MAX_ECHOED_MODEL_NAME_CHARS`` characters of the name (vLLM echoes all of it),
so a client cannot make the server send back a megabyte of its own input.
"""

from __future__ import annotations

import itertools
import json
from dataclasses import dataclass
from typing import Any

from engine.config.lora import LoRAConfig
from engine.entrypoints.openai.engine.protocol import ModelCard, ModelList, ModelPermission
from engine.lora.peft_helper import check_lora_adapter
from engine.lora.request import LoRARequest
from engine.v1.engine.exceptions import EngineCoreUtilityError

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


@dataclass
class LoRAModulePath:
    name: str
    path: str
    base_model_name: str | None = None

    @classmethod
    def parse(cls, text: str) -> LoRAModulePath:
        """``name=path`` or ``{"name": ..., "path": ..., "base_model_name": ...}``."""
        if text.lstrip().startswith("{"):
            try:
                fields = json.loads(text)
                return cls(fields["name"], fields["path"], fields.get("base_model_name"))
            except (ValueError, KeyError, TypeError) as e:
                raise ValueError(f"--lora-modules {text!r}: not a {{name, path}} object") from e
        name, sep, path = text.partition("=")
        if not sep or not name or not path:
            raise ValueError(f"--lora-modules entries are name=path, got {text!r}")
        return cls(name, path)


class LoRAAdapterError(ValueError):
    """A load or unload the server refuses; ``status`` is its HTTP status."""

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.status = status


class OpenAIServingModels:
    def __init__(
        self,
        engine_client: Any,
        base_model_paths: list[BaseModelPath],
        max_model_len: int | None,
        lora_modules: list[LoRAModulePath] | None = None,
        lora_config: LoRAConfig | None = None,
    ) -> None:
        if not base_model_paths:
            raise ValueError("base_model_paths must name at least one model")
        self.engine_client = engine_client
        self.base_model_paths = base_model_paths
        self.max_model_len = max_model_len
        self.lora_config = lora_config
        self.static_lora_modules = lora_modules or []
        self.lora_requests: dict[str, LoRARequest] = {}
        self._lora_parents: dict[str, str] = {}
        self._lora_ids = itertools.count(1)

    async def init_static_loras(self) -> None:
        """Load the ``--lora-modules`` adapters (the server does not start with a broken one)."""
        for module in self.static_lora_modules:
            await self.load_lora_adapter(module.name, module.path, module.base_model_name)

    def is_base_model(self, model_name: str) -> bool:
        return any(model.name == model_name for model in self.base_model_paths)

    def model_name(self, lora_request: LoRARequest | None = None) -> str:
        """The name responses carry: the adapter's, else the first served name."""
        return lora_request.lora_name if lora_request else self.base_model_paths[0].name

    async def load_lora_adapter(
        self, lora_name: str, lora_path: str, base_model_name: str | None = None
    ) -> LoRARequest:
        if self.lora_config is None:
            raise LoRAAdapterError("LoRA is not enabled: start the server with --enable-lora")
        if not lora_name or not lora_path:
            raise LoRAAdapterError("Both 'lora_name' and 'lora_path' must be provided.")
        if lora_name in self.lora_requests or self.is_base_model(lora_name):
            raise LoRAAdapterError(f"The lora adapter '{lora_name}' has already been loaded.")
        try:
            check_lora_adapter(lora_path, self.lora_config.max_lora_rank)
        except ValueError as e:
            raise LoRAAdapterError(f"lora adapter '{lora_name}': {e}") from None
        request = LoRARequest(lora_name, next(self._lora_ids), lora_path)
        try:
            await self.engine_client.add_lora(request)
        except Exception as e:
            reason = e.reason if isinstance(e, EngineCoreUtilityError) else str(e)
            raise LoRAAdapterError(reason) from None  # it names the adapter
        self.lora_requests[lora_name] = request
        self._lora_parents[lora_name] = base_model_name or self.base_model_paths[0].name
        return request

    async def unload_lora_adapter(self, lora_name: str) -> None:
        if lora_name not in self.lora_requests:
            raise LoRAAdapterError(f"The lora adapter '{lora_name}' cannot be found.", 404)
        del self.lora_requests[lora_name]
        del self._lora_parents[lora_name]

    async def show_available_models(self) -> ModelList:
        cards = [
            ModelCard(
                id=model.name,
                root=model.model_path,
                max_model_len=self.max_model_len,
                permission=[ModelPermission()],
            )
            for model in self.base_model_paths
        ]
        cards += [
            ModelCard(
                id=name,
                root=request.lora_path,
                parent=self._lora_parents[name],
                max_model_len=self.max_model_len,
                permission=[ModelPermission()],
            )
            for name, request in self.lora_requests.items()
        ]
        return ModelList(data=cards)
