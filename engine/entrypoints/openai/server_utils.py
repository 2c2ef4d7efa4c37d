"""Middleware and error handlers of the API server.

vLLM twin: ``vllm/entrypoints/openai/server_utils.py``
(``AuthenticationMiddleware``, ``validation_exception_handler``, ...) and
``with_cancellation`` from ``vllm/entrypoints/utils.py``.
Read it for three server rules: every error body is OpenAI's
``{"error": {...}}``; a body that fails validation is a 400 whose ``param``
names the offending field; and a client that hangs up on a non-streaming
request cancels the handler (so ``generate()`` aborts the request).
Sessions: 01.

Differs from vLLM on purpose: ``RequestLimitsMiddleware`` (body size, body
read timeout, header count) and ``GlassboxH11Protocol`` (head read timeout,
431 for an oversized head, read-and-drop before closing) bound what one client
can hold; vLLM serves with plain uvicorn, which has neither a body cap nor a
head read timeout. The API key also guards ``/tokenize`` and ``/detokenize``.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hashlib
import json
import logging
import secrets
from collections.abc import Awaitable, Callable
from http import HTTPStatus
from typing import Any

import h11
import uvicorn
from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send
from uvicorn.protocols.http.h11_impl import DEFAULT_MAX_INCOMPLETE_EVENT_SIZE, H11Protocol

from engine.entrypoints.openai.engine.protocol import ErrorInfo, ErrorResponse
from engine.entrypoints.openai.engine.serving import create_error_response

logger = logging.getLogger(__name__)

# Paths that need the API key: everything under /v1 and, unlike vLLM, the
# tokenizer endpoints, which cost CPU like a generation request's render step.
# /health, /metrics and /version stay open for probes, as in vLLM.
GUARDED_PREFIXES = ("/v1", "/tokenize", "/detokenize")


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
        if path.startswith(GUARDED_PREFIXES) and not self.verify_token(Headers(scope=scope)):
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
    response = error_json(
        ErrorResponse(
            error=ErrorInfo(message=str(exc.detail), type=status.phrase, code=status.value)
        )
    )
    # Keep what the exception carries, e.g. the ``Allow`` header of a 405.
    response.headers.update(exc.headers or {})
    return response


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


def _plain_error(status: HTTPStatus, message: str, param: str | None = None) -> JSONResponse:
    response = error_json(
        ErrorResponse(
            error=ErrorInfo(message=message, type=status.phrase, param=param, code=status.value)
        )
    )
    response.headers["Connection"] = "close"
    return response


class RequestLimitsMiddleware:
    """Bounds what one request may send before any handler runs (Glassbox's
    own; vLLM relies on uvicorn's defaults): at most ``max_header_count``
    headers (431), a body of at most ``max_body_size`` bytes (413, refused from
    ``Content-Length`` before reading when the client announces it), and a body
    that arrives within ``body_timeout`` seconds (408). The body is read here,
    whole, and handed on to the app, so JSON parsing never sees more."""

    def __init__(
        self, app: ASGIApp, max_body_size: int, body_timeout: float, max_header_count: int
    ) -> None:
        self.app = app
        self.max_body_size = max_body_size
        self.body_timeout = body_timeout
        self.max_header_count = max_header_count

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if len(scope["headers"]) > self.max_header_count:
            response = _plain_error(
                HTTPStatus.REQUEST_HEADER_FIELDS_TOO_LARGE,
                f"the request has {len(scope['headers'])} headers, more than "
                f"--h11-max-header-count={self.max_header_count}",
            )
            await response(scope, receive, send)
            return
        too_large = _plain_error(
            HTTPStatus.REQUEST_ENTITY_TOO_LARGE,
            f"the request body is larger than --max-request-body-size={self.max_body_size} bytes",
        )
        declared = Headers(scope=scope).get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_body_size:
            await too_large(scope, receive, send)
            return
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.body_timeout
        body = bytearray()
        while True:
            try:
                message = await asyncio.wait_for(receive(), max(deadline - loop.time(), 0))
            except TimeoutError:
                response = _plain_error(
                    HTTPStatus.REQUEST_TIMEOUT,
                    f"the request body did not arrive within --body-read-timeout="
                    f"{self.body_timeout:g} s",
                )
                await response(scope, receive, send)
                return
            if message["type"] == "http.disconnect":
                return  # the client left; nothing to answer
            body += message.get("body", b"")
            if len(body) > self.max_body_size:
                await too_large(scope, receive, send)
                return
            if not message.get("more_body", False):
                break
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": bytes(body), "more_body": False}
            return await receive()  # after the body: the disconnect, if it comes

        await self.app(scope, replay, send)


class _H11Connection(h11.Connection):
    """Remembers the status h11 suggests for the request it could not parse
    (431 for a header block over the size limit, else 400)."""

    error_status_hint = 400

    def next_event(self) -> Any:
        try:
            return super().next_event()
        except h11.RemoteProtocolError as e:
            self.error_status_hint = e.error_status_hint
            raise


class GlassboxH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with two defences it lacks (Glassbox's own; vLLM
    serves with plain uvicorn):

    - a header-read timeout: a request head not complete ``header_timeout``
      seconds after the connection opened (or went idle after a response) gets
      408 and the connection closes, so slow-loris clients that send headers a
      byte at a time cannot hold connections for ever; uvicorn has only an
      idle keep-alive timeout, reset by every byte;
    - an unparseable request gets h11's suggested status (431 for headers over
      ``--h11-max-incomplete-event-size``) where uvicorn always sends 400, and the
      rest of what the client sends is read and dropped for a moment before the
      close, so the client reads the answer instead of a connection reset.
    """

    LINGER_S = 2.0

    def __init__(self, config: uvicorn.Config, *args: Any, **kwargs: Any) -> None:
        super().__init__(config, *args, **kwargs)
        self.max_incomplete_event_size = (
            config.h11_max_incomplete_event_size or DEFAULT_MAX_INCOMPLETE_EVENT_SIZE
        )
        self.conn = _H11Connection(h11.SERVER, self.max_incomplete_event_size)
        self.header_timeout: float | None = getattr(config, "header_timeout", None)
        self._header_timer: asyncio.TimerHandle | None = None
        self._lingering = False

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm_header_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_header_timer()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._lingering:
            return  # the answer is sent; drop the rest of the request
        super().data_received(data)
        if self.conn.their_state is not h11.IDLE:
            self._cancel_header_timer()  # the head is complete (or failed)

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing() and self.conn.their_state is h11.IDLE:
            self._arm_header_timer()  # the next request's head has the same bound

    def _arm_header_timer(self) -> None:
        self._cancel_header_timer()
        if self.header_timeout is not None:
            self._header_timer = self.loop.call_later(
                self.header_timeout, self._header_timeout_expired
            )

    def _cancel_header_timer(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _header_timeout_expired(self) -> None:
        self._header_timer = None
        if self.transport.is_closing() or self.conn.their_state is not h11.IDLE:
            return
        if self.conn.trailing_data[0]:
            # Part of a head arrived: say why the connection closes.
            self._write_raw_error(
                408,
                f"the request head did not arrive within --header-read-timeout="
                f"{self.header_timeout:g} s",
            )
        self.transport.close()

    def send_400_response(self, msg: str) -> None:
        status = HTTPStatus(self.conn.error_status_hint or 400)
        if status == HTTPStatus.REQUEST_HEADER_FIELDS_TOO_LARGE:
            msg = (
                "the request headers are larger than --h11-max-incomplete-event-size="
                f"{self.max_incomplete_event_size} bytes"
            )
        self._write_raw_error(status.value, msg)
        # Read and drop what the client is still sending for a moment: closing
        # with unread data makes the kernel reset the connection, and the
        # client would see the reset instead of this answer.
        self._lingering = True
        self.flow.resume_reading()
        with contextlib.suppress(OSError, RuntimeError):
            self.transport.write_eof()
        self.loop.call_later(self.LINGER_S, self.transport.close)

    def _write_raw_error(self, status: int, message: str) -> None:
        """An error answer written directly: h11 refuses to send a response
        for a request it has not parsed."""
        body = json.dumps(
            ErrorResponse(
                error=ErrorInfo(message=message, type=HTTPStatus(status).phrase, code=status)
            ).model_dump()
        ).encode()
        head = (
            f"HTTP/1.1 {status} {HTTPStatus(status).phrase}\r\n"
            "content-type: application/json\r\n"
            f"content-length: {len(body)}\r\n"
            "connection: close\r\n\r\n"
        ).encode("ascii")
        self.transport.write(head + body)
