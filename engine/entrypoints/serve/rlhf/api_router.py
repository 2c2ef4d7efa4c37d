"""Pausing generation from outside, attached only in development mode
(``GLASSBOX_SERVER_DEV_MODE=1``, vLLM's ``VLLM_SERVER_DEV_MODE``).

vLLM twin: ``vllm/entrypoints/serve/rlhf/api_router.py`` (``/pause``,
``/resume``, ``/is_paused``). Read it for what a trainer does around a weight
update: ``POST /pause?mode=wait`` (in-flight requests finish, new ones queue;
``abort`` ends them, ``keep`` freezes them), swap the weights, ``POST
/resume``. The pause returns once it is complete. Sessions: 02 (the
scheduler's pause states).

Simpler than vLLM: no weight-transfer routes (``/update_weights`` and its
siblings), and no deprecated ``wait_for_inflight_requests``.
"""

from __future__ import annotations

import logging
from http import HTTPStatus

from fastapi import APIRouter, FastAPI, Query, Request
from fastapi.responses import JSONResponse

from engine.entrypoints.serve import server_dev_mode

logger = logging.getLogger(__name__)
router = APIRouter()


@router.post("/pause")
async def pause_generation(
    raw_request: Request,
    mode: str = Query(default="abort"),
    clear_cache: bool = Query(default=True),
) -> JSONResponse:
    try:
        await raw_request.app.state.engine_client.pause_generation(
            mode=mode, clear_cache=clear_cache
        )
    except ValueError as e:
        return JSONResponse({"error": str(e)}, status_code=HTTPStatus.BAD_REQUEST)
    return JSONResponse({"status": "paused"})


@router.post("/resume")
async def resume_generation(raw_request: Request) -> JSONResponse:
    await raw_request.app.state.engine_client.resume_generation()
    return JSONResponse({"status": "resumed"})


@router.get("/is_paused")
async def is_paused(raw_request: Request) -> JSONResponse:
    return JSONResponse({"is_paused": await raw_request.app.state.engine_client.is_paused()})


def attach_router(app: FastAPI) -> None:
    if server_dev_mode():
        app.include_router(router)
