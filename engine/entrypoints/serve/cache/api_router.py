"""``POST /reset_prefix_cache``, attached only in development mode
(``GLASSBOX_SERVER_DEV_MODE=1``, vLLM's ``VLLM_SERVER_DEV_MODE``).

vLLM twin: ``vllm/entrypoints/serve/cache/api_router.py`` (``attach_router``).
Read it for how an experiment on the prefix cache starts from a cold cache
without restarting the server: the engine forgets every cached block hash
(``Scheduler.reset_prefix_cache``), which it refuses while a request holds
blocks, unless ``?reset_running_requests=true`` preempts the running requests
first (they recompute). The answer says whether the reset happened,
``{"reset": true}`` (vLLM's answers 200 with no body either way). Sessions: 03.

Simpler than vLLM: no multimodal or encoder caches to reset; vLLM's
``reset_external`` (a KV connector's cache) is accepted, and Glassbox has no
connector, so it changes nothing.
"""

from __future__ import annotations

import logging

from fastapi import APIRouter, FastAPI, Query, Request
from fastapi.responses import JSONResponse

from engine.entrypoints.serve import SERVER_DEV_MODE_ENV, server_dev_mode

logger = logging.getLogger(__name__)
router = APIRouter()


@router.post("/reset_prefix_cache")
async def reset_prefix_cache(
    raw_request: Request,
    reset_running_requests: bool = Query(default=False),
    reset_external: bool = Query(default=False),
) -> JSONResponse:
    logger.info("Resetting the prefix cache")
    reset = await raw_request.app.state.engine_client.reset_prefix_cache(
        reset_running_requests, reset_external
    )
    return JSONResponse({"reset": reset})


def attach_router(app: FastAPI) -> None:
    if not server_dev_mode():
        return
    logger.warning("Development endpoints are on (%s): not for production", SERVER_DEV_MODE_ENV)
    app.include_router(router)
