"""The runtime LoRA endpoints, attached only when
``GLASSBOX_ALLOW_RUNTIME_LORA_UPDATING`` is set.

vLLM twin: ``vllm/entrypoints/serve/lora/api_router.py`` (``attach_router``;
vLLM's switch is ``VLLM_ALLOW_RUNTIME_LORA_UPDATING``).
Read it for why the switch exists: a client that may load adapters makes the
server read any folder it names, so it is for local development only. A load
checks the folder (PEFT config, rank, target modules) and registers the name
(``OpenAIServingModels.load_lora_adapter``); the worker reads the weights
when the first request names it. An unload removes the name: requests in
flight finish with it. Sessions: 06.
"""

from __future__ import annotations

import logging
import os
from http import HTTPStatus

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import Response

from engine.entrypoints.openai.engine.serving import create_error_response
from engine.entrypoints.openai.models.serving import LoRAAdapterError, OpenAIServingModels
from engine.entrypoints.openai.server_utils import error_json
from engine.entrypoints.serve.lora.protocol import (
    LoadLoRAAdapterRequest,
    UnloadLoRAAdapterRequest,
)

logger = logging.getLogger(__name__)
ALLOW_RUNTIME_LORA_UPDATING_ENV = "GLASSBOX_ALLOW_RUNTIME_LORA_UPDATING"
router = APIRouter()


def _error(e: LoRAAdapterError) -> Response:
    error_type = "NotFoundError" if e.status == 404 else "BadRequestError"
    return error_json(create_error_response(str(e), error_type, HTTPStatus(e.status)))


@router.post("/v1/load_lora_adapter")
async def load_lora_adapter(request: LoadLoRAAdapterRequest, raw_request: Request) -> Response:
    models: OpenAIServingModels = raw_request.app.state.openai_serving_models
    try:
        await models.load_lora_adapter(request.lora_name, request.lora_path)
    except LoRAAdapterError as e:
        return _error(e)
    return Response(f"Success: LoRA adapter '{request.lora_name}' added successfully.")


@router.post("/v1/unload_lora_adapter")
async def unload_lora_adapter(request: UnloadLoRAAdapterRequest, raw_request: Request) -> Response:
    models: OpenAIServingModels = raw_request.app.state.openai_serving_models
    try:
        await models.unload_lora_adapter(request.lora_name)
    except LoRAAdapterError as e:
        return _error(e)
    return Response(f"Success: LoRA adapter '{request.lora_name}' removed successfully.")


def attach_router(app: FastAPI) -> None:
    if os.environ.get(ALLOW_RUNTIME_LORA_UPDATING_ENV, "").lower() not in ("1", "true"):
        return
    logger.warning(
        "LoRA adapters may be loaded and unloaded at run time (%s): for local development "
        "only, a client can make the server read any folder",
        ALLOW_RUNTIME_LORA_UPDATING_ENV,
    )
    app.include_router(router)
