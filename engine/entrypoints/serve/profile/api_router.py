"""The profiling endpoints, attached only when the server was started with a
profiler (``--profiler-config``).

vLLM twin: ``vllm/entrypoints/serve/profile/api_router.py`` (``attach_router``).
Read it for how a client brackets the requests it wants profiled:
``POST /start_profile``, send them, ``POST /stop_profile``; the traces appear
in ``torch_profiler_dir`` (one per worker rank, one for this process). A
client can make the server write files and slow down, so the endpoints exist
only when asked for, as in vLLM. Sessions: 04.
"""

from __future__ import annotations

import argparse
import logging

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import Response

logger = logging.getLogger(__name__)
router = APIRouter()


@router.post("/start_profile")
async def start_profile(raw_request: Request) -> Response:
    logger.info("Starting the profiler")
    await raw_request.app.state.engine_client.start_profile()
    return Response(status_code=200)


@router.post("/stop_profile")
async def stop_profile(raw_request: Request) -> Response:
    logger.info("Stopping the profiler (writing the traces)")
    await raw_request.app.state.engine_client.stop_profile()
    return Response(status_code=200)


def attach_router(app: FastAPI, args: argparse.Namespace) -> None:
    # The flag's JSON object (EngineArgs checks it when the engine starts).
    config = getattr(args, "profiler_config", None)
    profiler = config.get("profiler") if isinstance(config, dict) else None
    if profiler is None:
        return
    logger.warning("Profiling endpoints are on (profiler=%s): for local development only", profiler)
    app.include_router(router)
