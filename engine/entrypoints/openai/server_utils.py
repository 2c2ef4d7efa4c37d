"""Middleware and error handlers of the API server.

vLLM twin: ``vllm/entrypoints/openai/server_utils.py``
(``AuthenticationMiddleware``, ``validation_exception_handler``, ...) and
``with_cancellation`` from ``vllm/entrypoints/utils.py``.
Read it for three server rules: every error body is OpenAI's
``{"error": {...}}``; a body that fails validation is a 400 whose ``param``
names the offending field; and a client that hangs up on a non-streaming
request cancels the handler (so ``generate()`` aborts the request).
Sessions: 01.
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import logging
import secrets
from collections.abc import Awaitable, Callable
from http import HTTPStatus
from typing import Any

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Receive, Scope, Send

from engine.entrypoints.openai.engine.protocol import ErrorInfo, ErrorResponse
from engine.entrypoints.openai.engine.serving import create_error_response

logger = logging.getLogger(__name__)

# Paths that need the API key; /health and /metrics stay open, as in vLLM.
GUARDED_PREFIX = "/v1"


def error_json(error: ErrorResponse) -> JSONResponse:
    return JSONResponse(error.model_dump(), status_code=error.error.code)


class AuthenticationMiddleware:
    """Rejects /v1 requests without ``Authorization: Bearer <api key>`` (401)."""

    def __init__(self, app: ASGIApp, tokens: list[str]) -> None:
        self.app = app
        # Compare digests in constant time; never keep the keys themselves.
        self.api_tokens = [hashlib.sha256(t.encode("utf-8")).digest() for t in tokens]

    def verify_token(self, headers: Headers) -> bool:
        scheme, _, param = (headers.get("Authorization") or "").partition(" ")
        if scheme.lower() != "bearer":
            return False
        digest = hashlib.sha256(param.encode("utf-8")).digest()
        match = False
        for token in self.api_tokens:
            match |= secrets.compare_digest(digest, token)
        return match

    def __call__(self, scope: Scope, receive: Receive, send: Send) -> Awaitable[None]:
        if scope["type"] not in ("http", "websocket") or scope.get("method") == "OPTIONS":
            return self.app(scope, receive, send)
        path = scope["path"].removeprefix(scope.get("root_path", ""))
        if path.startswith(GUARDED_PREFIX) and not self.verify_token(Headers(scope=scope)):
            response = error_json(
                create_error_response(
                    "Unauthorized: send the API key as 'Authorization: Bearer <key>'",
                    "AuthenticationError",
                    HTTPStatus.UNAUTHORIZED,
                )
            )
            return response(scope, receive, send)
        return self.app(scope, receive, send)


async def validation_exception_handler(
    request: Request, exc: RequestValidationError
) -> JSONResponse:
    """Malformed JSON or a field of the wrong type/shape -> 400 naming the field."""
    errors = exc.errors()
    param = None
    parts = []
    for error in errors:
        loc = [str(p) for p in error.get("loc", ()) if p != "body"]
        if error.get("type") == "json_invalid":
            parts.append(f"the body is not valid JSON: {error.get('msg')}")
            continue
        if param is None and loc:
            param = loc[0]
        parts.append(f"{'.'.join(loc) or 'body'}: {error.get('msg')}")
    message = "; ".join(dict.fromkeys(parts)) or "invalid request body"
    return error_json(
        ErrorResponse(
            error=ErrorInfo(
                message=message, type="BadRequestError", param=param, code=HTTPStatus.BAD_REQUEST
            )
        )
    )


async def http_exception_handler(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    status = HTTPStatus(exc.status_code)
    return error_json(
        ErrorResponse(
            error=ErrorInfo(message=str(exc.detail), type=status.phrase, code=status.value)
        )
    )


async def exception_handler(request: Request, exc: Exception) -> JSONResponse:
    logger.exception("Unhandled error while serving %s", request.url.path)
    return error_json(create_error_response(exc))


async def listen_for_disconnect(request: Request) -> None:
    """Returns when the client disconnects."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


def with_cancellation(handler: Callable[..., Awaitable[Any]]) -> Callable[..., Awaitable[Any]]:
    """Cancel the handler when the client disconnects before it returns.

    Cancelling reaches the ``generate()`` the handler awaits, which aborts the
    request in EngineCore. (Streaming responses are covered by Starlette,
    which cancels the body iterator on disconnect.)"""

    @functools.wraps(handler)
    async def wrapper(*args: Any, **kwargs: Any) -> Any:
        request: Request = kwargs["raw_request"]
        handler_task = asyncio.create_task(handler(*args, **kwargs))
        cancellation_task = asyncio.create_task(listen_for_disconnect(request))
        done, pending = await asyncio.wait(
            [handler_task, cancellation_task], return_when=asyncio.FIRST_COMPLETED
        )
        for task in pending:
            task.cancel()
        if handler_task in done:
            return handler_task.result()
        # Wait for the cancelled handler to finish aborting.
        await asyncio.gather(handler_task, return_exceptions=True)
        return None

    return wrapper
