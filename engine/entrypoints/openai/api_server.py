"""The OpenAI-compatible API server: FastAPI + uvicorn around one ``AsyncLLM``.

vLLM twin: ``vllm/entrypoints/openai/api_server.py`` (``build_async_engine_client``,
``build_app``, ``init_app_state``, ``run_server``) and the routers it mounts.
Read it for the shape of a serving process: the ``AsyncLLM`` (and with it
the EngineCore process) is built first, then the app, whose handlers only
``await`` -- all model work happens in the other process, so one event loop
serves every connection while the GPU loop never waits on HTTP.

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions``,
``GET /v1/models``, ``GET /health`` (200, or 503 once the engine is dead),
``GET /metrics`` (Prometheus text, the ``glassbox:`` metrics),
``POST /tokenize``, ``POST /detokenize``, ``GET /version``.
Sessions: 01.

Stopping (``run_server`` -> ``engine/entrypoints/launcher.py``): SIGTERM or
Ctrl-C drains the requests in flight for ``--shutdown-timeout`` seconds
(default 30 here, 0 in vLLM), aborts the rest, stops EngineCore, then the server.

Differs from vLLM on engine death: vLLM shuts the server down (unless
VLLM_KEEP_ALIVE_ON_ENGINE_DEATH is set); Glassbox keeps it up so ``/health``
can report 503, every request (streaming too) gets a 503 error body and
``/metrics`` shows ``glassbox:engine_dead 1`` -- easier to watch.
``--no-keep-alive-on-engine-death`` gives vLLM's default.

Limits on what one client may send (``--max-request-body-size``,
``--max-input-chars``, ``--h11-max-incomplete-event-size``,
``--h11-max-header-count``, ``--limit-concurrency``, ``--header-read-timeout``,
``--body-read-timeout``): ``RequestLimitsMiddleware`` and ``GlassboxH11Protocol``
in ``server_utils``. The OpenAPI schema declares the answers routes really give
(``ErrorResponse`` for 400/401/404/408/413/431/503, SSE for streams, text for
``/metrics``; no 422, which this server never sends).

Differs from vLLM on purpose: ``/tokenize`` and ``/detokenize`` need the API
key (vLLM leaves them open): they run the tokenizer, which costs CPU like a
generation request's render step, so an anonymous client must not be able to
keep it busy. Request bodies are capped (vLLM has no cap) and the request head
has a read timeout, 431 beyond ``--h11-max-incomplete-event-size`` (default
64 KiB, where vLLM's 4 MiB lets a 1 MB header through) and a header count
enforced here (uvicorn ignores vLLM's ``h11_max_header_count``); these keep one
client from holding memory, connections or the event loop.
"""

from __future__ import annotations

import argparse
import logging
import socket
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from http import HTTPStatus
from typing import Any

import uvicorn
from fastapi import APIRouter, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

import engine
from engine.entrypoints.launcher import GracefulServer, serve_http
from engine.entrypoints.openai.chat_completion.protocol import (
    ChatCompletionRequest,
    ChatCompletionResponse,
)
from engine.entrypoints.openai.chat_completion.serving import OpenAIServingChat
from engine.entrypoints.openai.cli_args import api_keys, engine_args_from_cli, make_arg_parser
from engine.entrypoints.openai.completion.protocol import CompletionRequest, CompletionResponse
from engine.entrypoints.openai.completion.serving import OpenAIServingCompletion
from engine.entrypoints.openai.engine.protocol import ErrorResponse, ModelList
from engine.entrypoints.openai.engine.serving import (
    OpenAIServing,
    create_error_response,
    make_renderer_executor,
)
from engine.entrypoints.openai.models.serving import (
    BaseModelPath,
    LoRAModulePath,
    OpenAIServingModels,
)
from engine.entrypoints.openai.server_utils import (
    AuthenticationMiddleware,
    GlassboxH11Protocol,
    RequestLimitsMiddleware,
    error_json,
    exception_handler,
    http_exception_handler,
    validation_exception_handler,
    with_cancellation,
)
from engine.entrypoints.serve.cache.api_router import attach_router as attach_cache_router
from engine.entrypoints.serve.lora.api_router import attach_router as attach_lora_router
from engine.entrypoints.serve.profile.api_router import attach_router as attach_profile_router
from engine.entrypoints.serve.rlhf.api_router import attach_router as attach_rlhf_router
from engine.entrypoints.serve.tokenize.protocol import (
    DetokenizeRequest,
    DetokenizeResponse,
    TokenizeRequest,
    TokenizeResponse,
)
from engine.entrypoints.serve.tokenize.serving import OpenAIServingTokenization
from engine.entrypoints.utils import log_non_default_args
from engine.tracing.engine_trace import ServerTrace
from engine.usage.usage_lib import UsageContext
from engine.v1.engine.async_llm import AsyncLLM
from engine.v1.engine.exceptions import EngineOverloadedError

logger = logging.getLogger(__name__)

router = APIRouter()


def _errors(*codes: HTTPStatus) -> dict[int | str, dict[str, Any]]:
    """OpenAPI entries for the error answers a route gives (all ``ErrorResponse``)."""
    return {int(code): {"model": ErrorResponse, "description": code.phrase} for code in codes}


# Errors any request may meet before a handler runs: a body over
# --max-request-body-size, a body too slow to arrive, too many headers.
_LIMIT_ERRORS = (
    HTTPStatus.REQUEST_TIMEOUT,
    HTTPStatus.REQUEST_ENTITY_TOO_LARGE,
    HTTPStatus.REQUEST_HEADER_FIELDS_TOO_LARGE,
)
_GENERATION_ERRORS = _errors(
    HTTPStatus.BAD_REQUEST,
    HTTPStatus.UNAUTHORIZED,
    HTTPStatus.NOT_FOUND,
    HTTPStatus.SERVICE_UNAVAILABLE,
    *_LIMIT_ERRORS,
)
_TOKENIZER_ERRORS = _errors(
    HTTPStatus.BAD_REQUEST, HTTPStatus.UNAUTHORIZED, HTTPStatus.NOT_FOUND, *_LIMIT_ERRORS
)
# One server-sent event: ``data`` holds a JSON chunk, or ``[DONE]`` at the end.
_SSE = {
    "text/event-stream": {
        "schema": {
            "type": "object",
            "properties": {"data": {"type": "string"}, "event": {"type": "string"}},
            "required": ["data"],
        }
    }
}


@asynccontextmanager
async def build_async_engine_client(args: argparse.Namespace) -> AsyncIterator[AsyncLLM]:
    """Start the engine (EngineCore in its own process); stop it on exit."""
    engine_args = engine_args_from_cli(args)
    engine_client = AsyncLLM.from_engine_args(
        engine_args,
        usage_context=UsageContext.OPENAI_API_SERVER,
        log_requests=args.enable_log_requests,
    )
    try:
        yield engine_client
    finally:
        engine_client.shutdown()


def served_model_names(args: argparse.Namespace) -> list[str]:
    if args.served_model_name:
        return list(args.served_model_name)
    model = args.model_tag or args.model
    if model is None or model == "default":
        from engine.model_executor.model_loader.default_model import DEFAULT_MODEL_NAME

        return [DEFAULT_MODEL_NAME]
    return [model]


def _sse_stream(
    generator: AsyncIterator[str], request_id: str, trace: ServerTrace
) -> AsyncIterator[str]:
    async def stream() -> AsyncIterator[str]:
        async for chunk in generator:
            trace.chunk(request_id, chunk)
            yield chunk

    return stream()


async def _generation_response(
    handler: OpenAIServing,
    create: Callable[[Any], Awaitable[Any]],
    request: Any,
    raw_request: Request,
    endpoint: str,
) -> Response:
    """What the two generation routes share: fix the request id (the
    X-Request-Id header's, if sent), run the handler's ``create``, and answer
    with SSE when it returned a stream, JSON otherwise."""
    try:
        request_id = handler._base_request_id(request, raw_request.headers.get("X-Request-Id"))
    except ValueError as e:
        return _error_response(e)
    request.request_id = request_id
    trace: ServerTrace = raw_request.app.state.trace
    trace.request(request_id, endpoint, bool(request.stream))
    try:
        result = await create(request)
    except Exception as e:
        return _error_response(e)
    if hasattr(result, "__aiter__"):
        return StreamingResponse(
            _sse_stream(result, request_id, trace), media_type="text/event-stream"
        )
    return JSONResponse(result.model_dump())


@router.post(
    "/v1/completions",
    responses={
        200: {
            "model": CompletionResponse,
            "content": _SSE,
            "description": "JSON, or an SSE stream when stream is true",
        },
        **_GENERATION_ERRORS,
    },
)
@with_cancellation
async def create_completion(request: CompletionRequest, raw_request: Request) -> Response:
    handler: OpenAIServingCompletion = raw_request.app.state.openai_serving_completion
    return await _generation_response(
        handler, handler.create_completion, request, raw_request, "/v1/completions"
    )


@router.post(
    "/v1/chat/completions",
    responses={
        200: {
            "model": ChatCompletionResponse,
            "content": _SSE,
            "description": "JSON, or an SSE stream when stream is true",
        },
        **_GENERATION_ERRORS,
    },
)
@with_cancellation
async def create_chat_completion(request: ChatCompletionRequest, raw_request: Request) -> Response:
    handler: OpenAIServingChat = raw_request.app.state.openai_serving_chat
    return await _generation_response(
        handler, handler.create_chat_completion, request, raw_request, "/v1/chat/completions"
    )


def _error_response(e: Exception) -> JSONResponse:
    error = create_error_response(e)
    if error.error.code >= 500 and error.error.code != HTTPStatus.SERVICE_UNAVAILABLE:
        logger.exception("request failed")
    response = error_json(error)
    if isinstance(e, EngineOverloadedError):
        response.headers["Retry-After"] = "1"  # the queue drains within seconds
    return response


@router.get(
    "/v1/models",
    responses={200: {"model": ModelList}, **_errors(HTTPStatus.UNAUTHORIZED, *_LIMIT_ERRORS)},
)
async def show_available_models(raw_request: Request) -> JSONResponse:
    models = await raw_request.app.state.openai_serving_models.show_available_models()
    return JSONResponse(models.model_dump())


@router.get(
    "/health",
    response_class=Response,
    responses={
        200: {"description": "the engine is alive (empty body)", "content": {}},
        **_errors(HTTPStatus.SERVICE_UNAVAILABLE, *_LIMIT_ERRORS),
    },
)
async def health(raw_request: Request) -> Response:
    engine_client: AsyncLLM = raw_request.app.state.engine_client
    try:
        await engine_client.check_health()
    except Exception as e:
        return error_json(
            create_error_response(e, "ServiceUnavailableError", HTTPStatus.SERVICE_UNAVAILABLE)
        )
    return Response(status_code=200)


@router.get(
    "/metrics",
    response_class=PlainTextResponse,
    responses={
        200: {
            "description": "Prometheus text format",
            "content": {"text/plain": {"schema": {"type": "string"}}},
        },
        **_errors(HTTPStatus.NOT_FOUND, *_LIMIT_ERRORS),
    },
)
async def metrics(raw_request: Request) -> Response:
    engine_client: AsyncLLM = raw_request.app.state.engine_client
    if engine_client.stat_logger is None:
        return error_json(
            create_error_response(
                "metrics are off: the server was started with --disable-log-stats",
                "NotFoundError",
                HTTPStatus.NOT_FOUND,
            )
        )
    return PlainTextResponse(
        engine_client.render_prometheus(), media_type="text/plain; version=0.0.4; charset=utf-8"
    )


@router.post("/tokenize", responses={200: {"model": TokenizeResponse}, **_TOKENIZER_ERRORS})
async def tokenize(request: TokenizeRequest, raw_request: Request) -> Response:
    try:
        result = await raw_request.app.state.openai_serving_tokenization.create_tokenize(request)
    except Exception as e:
        return _error_response(e)
    return JSONResponse(result.model_dump())


@router.post("/detokenize", responses={200: {"model": DetokenizeResponse}, **_TOKENIZER_ERRORS})
async def detokenize(request: DetokenizeRequest, raw_request: Request) -> Response:
    try:
        result = await raw_request.app.state.openai_serving_tokenization.create_detokenize(request)
    except Exception as e:
        return _error_response(e)
    return JSONResponse(result.model_dump())


@router.get("/version", responses=_errors(*_LIMIT_ERRORS))
async def show_version() -> JSONResponse:
    return JSONResponse({"version": engine.__version__})


def build_app(args: argparse.Namespace) -> FastAPI:
    app = FastAPI(title="Glassbox OpenAI-compatible server", version=engine.__version__)
    app.include_router(router)
    attach_lora_router(app)
    attach_profile_router(app, args)
    attach_cache_router(app)
    attach_rlhf_router(app)
    app.state.args = args
    app.add_exception_handler(RequestValidationError, validation_exception_handler)
    app.add_exception_handler(StarletteHTTPException, http_exception_handler)
    app.add_exception_handler(Exception, exception_handler)
    app.add_middleware(
        RequestLimitsMiddleware,
        max_body_size=_arg(args, "max_request_body_size"),
        body_timeout=_arg(args, "body_read_timeout"),
        max_header_count=_arg(args, "h11_max_header_count"),
    )
    # Added last, so it runs first: no body is read for a request without the key.
    if tokens := api_keys(args):
        app.add_middleware(AuthenticationMiddleware, tokens=tokens)
    _declare_real_errors(app)
    return app


def _arg(args: argparse.Namespace, name: str) -> Any:
    """A serve flag's value; its default for a Namespace built without it."""
    if hasattr(args, name):
        return getattr(args, name)
    return make_arg_parser(argparse.ArgumentParser()).get_default(name)


def _declare_real_errors(app: FastAPI) -> None:
    """A bad body is a 400 here (``validation_exception_handler``), never
    FastAPI's 422: drop the 422 entries FastAPI writes into the schema."""
    build_schema = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = build_schema()
            for path in schema.get("paths", {}).values():
                for operation in path.values():
                    operation.get("responses", {}).pop("422", None)
            for name in ("HTTPValidationError", "ValidationError"):
                schema.get("components", {}).get("schemas", {}).pop(name, None)
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]


async def init_app_state(engine_client: AsyncLLM, state: Any, args: argparse.Namespace) -> None:
    # ``root`` is the model as the user named it (vLLM: ``args.model``), never
    # the folder it resolved to (a Hub cache snapshot, the embedded default).
    model_path = args.model_tag or args.model or served_model_names(args)[0]
    state.engine_client = engine_client
    state.trace = ServerTrace.create(engine_client.tracer)
    state.openai_serving_models = models = OpenAIServingModels(
        engine_client,
        [BaseModelPath(name, model_path) for name in served_model_names(args)],
        engine_client.model_config.max_model_len,
        lora_modules=[LoRAModulePath.parse(m) for m in _arg(args, "lora_modules") or []],
        lora_config=engine_client.glassbox_config.lora_config,
    )
    await models.init_static_loras()
    # One renderer thread for the whole server (vLLM: one per renderer).
    serving_kwargs: dict[str, Any] = {
        "executor": make_renderer_executor(),
        "max_input_chars": _arg(args, "max_input_chars"),
    }
    state.openai_serving_completion = OpenAIServingCompletion(
        engine_client, models, **serving_kwargs
    )
    state.openai_serving_chat = chat = OpenAIServingChat(
        engine_client, models, response_role=args.response_role, **serving_kwargs
    )
    state.openai_serving_tokenization = OpenAIServingTokenization(
        engine_client, models, chat=chat, **serving_kwargs
    )


def create_server_socket(host: str, port: int) -> socket.socket:
    """Bind before the engine starts, so a busy port fails fast."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family=family, type=socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    return sock


def build_server_config(app: FastAPI, args: argparse.Namespace) -> uvicorn.Config:
    config = uvicorn.Config(
        app,
        log_level=args.uvicorn_log_level,
        timeout_keep_alive=5,  # vLLM's VLLM_HTTP_TIMEOUT_KEEP_ALIVE default
        lifespan="off",
        http=GlassboxH11Protocol,
        limit_concurrency=_arg(args, "limit_concurrency"),
        h11_max_incomplete_event_size=_arg(args, "h11_max_incomplete_event_size"),
    )
    # Read by GlassboxH11Protocol (uvicorn has no header-read timeout).
    config.header_timeout = _arg(args, "header_read_timeout")  # type: ignore[attr-defined]
    return config


def build_server(app: FastAPI, args: argparse.Namespace) -> uvicorn.Server:
    """A plain uvicorn server (tests run it on a thread); ``run_server`` uses
    ``GracefulServer`` over the same config."""
    return uvicorn.Server(build_server_config(app, args))


async def run_server(args: argparse.Namespace, sock: socket.socket | None = None) -> None:
    """Serve until SIGTERM/SIGINT; then drain, stop the engine, and return."""
    if sock is None:
        sock = create_server_socket(args.host, args.port)
    async with build_async_engine_client(args) as engine_client:
        # After the engine is up (vLLM logs first): a bad argument stays a one-line error.
        log_non_default_args(args)
        app = build_app(args)
        await init_app_state(engine_client, app.state, args)
        host, port = sock.getsockname()[:2]
        logger.info(
            "Glassbox API server on http://%s:%d (model %s)",
            host,
            port,
            served_model_names(args)[0],
        )
        server = GracefulServer(build_server_config(app, args), engine_client)
        await serve_http(server, sock, args.keep_alive_on_engine_death)
