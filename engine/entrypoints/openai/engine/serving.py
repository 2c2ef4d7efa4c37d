"""``OpenAIServing``: what every OpenAI endpoint shares.

vLLM twin: ``vllm/entrypoints/openai/engine/serving.py`` (``OpenAIServing``)
and ``create_error_response`` from ``vllm/entrypoints/utils.py``.
Read it for: the model check (unknown model -> 404), the mapping from Python
errors to HTTP errors (a bad parameter -> 400 naming it, a dead or overloaded
engine -> 503), how a request body becomes ``SamplingParams`` -- ``None``
fields take the generation config's defaults (the model's
``generation_config.json`` unless ``--generation-config`` says otherwise),
exactly as ``LLM`` does -- and the length rules of vLLM's render step (``TokenizeParams`` in
``vllm/renderers/params.py``, ``get_max_tokens`` in ``vllm/entrypoints/utils.py``):
``max_tokens`` above ``max_model_len`` is a 400, so is a prompt that leaves less
room than ``max_tokens`` asks for, and a request without ``max_tokens`` may
generate up to the end of the context (or ``generation_config``'s
``max_new_tokens``). Tokenizing runs on one renderer thread
(``make_renderer_executor``; vLLM: ``BaseRenderer._executor``), never on the
event loop, and a prompt text longer than the tokens left for it could hold
(room x the longest token text, vLLM's ``_text_len_check``) is a 400 before
tokenizing.
Sessions: 01.

Differs from vLLM on purpose: a prompt too long for the ``max_tokens`` asked
names the prompt's own field (``prompt`` / ``messages``) as ``param``, where
vLLM names ``input_tokens`` or ``input_text``, which are not request fields;
``--max-input-chars`` adds a server-wide cap on prompt characters (vLLM has none); and a bad
``max_completion_tokens`` is reported under that name, not as ``max_tokens``;
a client's request id (body or ``X-Request-Id``) longer than 128 characters or
outside ``A-Z a-z 0-9 . _ : -`` is a 400, where vLLM echoes any id verbatim
into responses and logs.
"""

from __future__ import annotations

import asyncio
import functools
import json
import re
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from concurrent.futures import Executor, ThreadPoolExecutor
from http import HTTPStatus
from typing import Any, ParamSpec, TypeVar

from engine.entrypoints.openai.engine.protocol import (
    ErrorInfo,
    ErrorResponse,
    SamplingFields,
    UsageInfo,
    random_uuid,
)
from engine.entrypoints.openai.models.serving import OpenAIServingModels, unknown_model_message
from engine.logprobs import Logprob, PromptLogprobs
from engine.lora.request import LoRARequest
from engine.sampling_params import RequestOutputKind, SamplingParams
from engine.v1.engine.async_llm import AsyncLLM
from engine.v1.engine.exceptions import (
    EngineDeadError,
    EngineGenerateError,
    EngineOverloadedError,
)

T = TypeVar("T")
P = ParamSpec("P")


# A client-chosen request id: echoed back, logged and traced, so kept short
# and free of markup or control characters.
MAX_REQUEST_ID_LEN = 128
_REQUEST_ID_RE = re.compile(r"[A-Za-z0-9._:\-]+")


class GlassboxValidationError(ValueError):
    """A bad request value, with the request field it came from
    (vLLM twin: ``VLLMValidationError``)."""

    def __init__(self, message: str, parameter: str | None = None) -> None:
        super().__init__(message)
        self.parameter = parameter


class ModelNotFoundError(Exception):
    """The request named a model this server does not serve."""


def make_async(func: Callable[P, T], executor: Executor | None) -> Callable[P, Awaitable[T]]:
    """``func`` run on ``executor``'s threads, awaited from the event loop
    (vLLM twin: ``make_async`` in ``vllm/utils/async_utils.py``)."""

    def wrapper(*args: P.args, **kwargs: P.kwargs) -> Awaitable[T]:
        loop = asyncio.get_running_loop()
        return loop.run_in_executor(executor, functools.partial(func, *args, **kwargs))

    return wrapper


def make_renderer_executor() -> ThreadPoolExecutor:
    """The thread that tokenizes prompts and renders chat templates, so a long
    prompt never stalls the event loop (vLLM: ``BaseRenderer._executor``, one
    worker by default, ``renderer_num_workers``)."""
    return ThreadPoolExecutor(max_workers=1, thread_name_prefix="glassbox-renderer")


def max_chars_per_token(tokenizer: Any) -> int:
    """The longest token text in the vocabulary: no prompt of N tokens can have
    more than N times this many characters (vLLM: ``max_chars_per_token``)."""
    return max((len(token) for token in tokenizer.get_vocab()), default=1)


def create_error_response(
    message: str | BaseException,
    err_type: str = "BadRequestError",
    status_code: HTTPStatus = HTTPStatus.BAD_REQUEST,
    param: str | None = None,
) -> ErrorResponse:
    if isinstance(message, BaseException):
        exc = message
        if isinstance(exc, GlassboxValidationError):
            err_type, status_code, param = "BadRequestError", HTTPStatus.BAD_REQUEST, exc.parameter
        elif isinstance(exc, ModelNotFoundError):
            err_type, status_code, param = "NotFoundError", HTTPStatus.NOT_FOUND, "model"
        elif isinstance(exc, (EngineDeadError, EngineOverloadedError)):
            err_type, status_code = "ServiceUnavailableError", HTTPStatus.SERVICE_UNAVAILABLE
        elif isinstance(exc, EngineGenerateError):
            err_type, status_code = "InternalServerError", HTTPStatus.INTERNAL_SERVER_ERROR
        elif isinstance(exc, (ValueError, TypeError, OverflowError)) or any(
            cls.__name__ == "TemplateError" for cls in type(exc).__mro__
        ):
            err_type, status_code = "BadRequestError", HTTPStatus.BAD_REQUEST
        else:
            err_type, status_code = "InternalServerError", HTTPStatus.INTERNAL_SERVER_ERROR
        message = str(exc) or type(exc).__name__
    return ErrorResponse(
        error=ErrorInfo(message=message, type=err_type, param=param, code=int(status_code))
    )


def param_from_message(message: str, field_names: set[str]) -> str | None:
    """Glassbox's validation messages start with the field's name
    ("temperature must be non-negative ..."): recover it for ``param``."""
    match = re.match(r"([A-Za-z_][A-Za-z0-9_]*)", message)
    return match.group(1) if match and match.group(1) in field_names else None


async def aclose_generator(generator: Any) -> None:
    """Close an async generator (running its cleanup: the abort of an
    unfinished request); a plain async iterator has nothing to close."""
    aclose = getattr(generator, "aclose", None)
    if aclose is not None:
        await aclose()


def make_usage_info(num_prompt_tokens: int, num_completion_tokens: int) -> UsageInfo:
    return UsageInfo(
        prompt_tokens=num_prompt_tokens,
        completion_tokens=num_completion_tokens,
        total_tokens=num_prompt_tokens + num_completion_tokens,
    )


async def merge_async_iterators(
    *iterators: AsyncIterator[T],
) -> AsyncGenerator[tuple[int, T], None]:
    """Yield ``(iterator index, item)`` from several async iterators as items
    arrive (one prompt of a multi-prompt completion per iterator)."""
    if len(iterators) == 1:
        try:
            async for item in iterators[0]:
                yield 0, item
        finally:
            # Closing a generate() that has not finished aborts its request.
            await aclose_generator(iterators[0])
        return
    queue: asyncio.Queue[tuple[int, Any] | BaseException | None] = asyncio.Queue()

    async def drain(i: int, it: AsyncIterator[T]) -> None:
        try:
            async for item in it:
                await queue.put((i, item))
        except BaseException as e:  # noqa: BLE001 -- forwarded to the consumer
            await queue.put(e)
        finally:
            await queue.put(None)

    tasks = [asyncio.create_task(drain(i, it)) for i, it in enumerate(iterators)]
    try:
        remaining = len(tasks)
        while remaining:
            item = await queue.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield item
    finally:
        for task in tasks:
            task.cancel()
        # Let each generator run its cleanup (the abort) before we return.
        await asyncio.gather(*tasks, return_exceptions=True)


class OpenAIServing:
    request_id_prefix = "req"

    def __init__(
        self,
        engine_client: AsyncLLM,
        models: OpenAIServingModels,
        *,
        executor: Executor | None = None,
        max_input_chars: int | None = None,
    ) -> None:
        self.engine_client = engine_client
        self.models = models
        self.model_config = engine_client.model_config
        self.max_model_len = engine_client.model_config.max_model_len
        # Shared by the endpoints of one server (see make_renderer_executor).
        self._executor = executor if executor is not None else make_renderer_executor()
        tokenizer = engine_client.tokenizer
        self.max_chars_per_token = max_chars_per_token(tokenizer) if tokenizer is not None else None
        # --max-input-chars: a cap on every prompt text, checked before tokenizing.
        self.max_input_chars = max_input_chars
        # The generation config's values, used where the request says nothing.
        defaults = engine_client.model_config.get_diff_sampling_param()
        # max_new_tokens caps only requests that leave max_tokens open (vLLM's
        # get_max_tokens); None lets them run to the end of the context.
        self.default_max_tokens: int | None = defaults.pop("max_tokens", None)
        self.default_sampling_params = defaults

    # -- errors ------------------------------------------------------------------
    @staticmethod
    def create_error_response(
        message: str | BaseException,
        err_type: str = "BadRequestError",
        status_code: HTTPStatus = HTTPStatus.BAD_REQUEST,
        param: str | None = None,
    ) -> ErrorResponse:
        return create_error_response(message, err_type, status_code, param)

    @staticmethod
    def create_streaming_error_response(error: BaseException | str) -> str:
        return json.dumps(create_error_response(error).model_dump())

    def _check_model(self, request: SamplingFields) -> None:
        if request.model is None or self.models.is_base_model(request.model):
            return
        if request.model in self.models.lora_requests:
            return
        raise ModelNotFoundError(unknown_model_message(request.model))

    def _maybe_get_adapters(self, request: SamplingFields) -> LoRARequest | None:
        """The adapter a request's ``model`` names (None: the base model)."""
        return self.models.lora_requests.get(request.model) if request.model else None

    def _base_request_id(self, request: SamplingFields, raw_request_id: str | None) -> str:
        """The body's ``request_id``, else the X-Request-Id header's, else a
        fresh one. A given id is echoed in responses and logs, so it must be
        short and plain (vLLM echoes any id verbatim)."""
        for value, param in ((request.request_id, "request_id"), (raw_request_id, "X-Request-Id")):
            if value:
                if len(value) > MAX_REQUEST_ID_LEN or not _REQUEST_ID_RE.fullmatch(value):
                    raise GlassboxValidationError(
                        f"{param} must be at most {MAX_REQUEST_ID_LEN} characters of "
                        f"A-Z a-z 0-9 . _ : - (got {len(value)} characters: {value[:32]!r}...)",
                        param,
                    )
                return value
        return f"{self.request_id_prefix}-{random_uuid()}"

    def check_capacity(self, num_sequences: int) -> None:
        """Refuse a request the engine has no room to queue before anything is
        sent, so a streaming request gets its 503 (or 400) as a status code.
        ``add_request`` checks again, for requests that raced this one."""
        try:
            self.engine_client.check_capacity(num_sequences)
        except ValueError as e:
            raise GlassboxValidationError(str(e), "n") from e

    def check_input_chars(
        self, num_chars: int, field: str, max_tokens: int = 0, max_tokens_field: str | None = None
    ) -> None:
        """Refuse a prompt text before tokenizing it when it is longer than
        --max-input-chars, or than the most characters the tokens left for the
        prompt could hold (vLLM's rule: room x the longest token in the vocabulary)."""
        if self.max_input_chars is not None and num_chars > self.max_input_chars:
            raise GlassboxValidationError(
                f"{field} has {num_chars} characters, more than --max-input-chars="
                f"{self.max_input_chars}; shorten it.",
                field,
            )
        if self.max_chars_per_token is None:
            return
        room = self.max_model_len - max_tokens
        limit = max(room, 0) * self.max_chars_per_token
        if num_chars > limit:
            asked = f", and {max_tokens_field}={max_tokens} leaves {room} of them for the prompt"
            raise GlassboxValidationError(
                f"This model's maximum context length is {self.max_model_len} tokens"
                f"{asked if max_tokens_field else ''}: at most {limit} characters (no token is "
                f"longer than {self.max_chars_per_token}), but {field} has {num_chars} "
                "characters; shorten the prompt"
                + (f" or lower {max_tokens_field}." if max_tokens_field else "."),
                field,
            )

    async def render_prompt(
        self,
        request_id: str,
        prompt: Any,
        params: SamplingParams,
        request: SamplingFields,
        prompt_field: str,
        max_tokens_field: str,
    ) -> dict[str, Any]:
        """Tokenize and validate one prompt before anything is sent, so a bad
        prompt is a 400 even for a streaming request (vLLM: the render step).
        The tokenizer runs on the renderer thread, never on the event loop.
        Returns the tokenized prompt ``generate()`` takes."""
        if isinstance(prompt, str):
            requested = getattr(request, max_tokens_field) or 0
            self.check_input_chars(len(prompt), prompt_field, requested, max_tokens_field)
        return await make_async(self._render_prompt, self._executor)(
            request_id, prompt, params, request, prompt_field, max_tokens_field
        )

    def _render_prompt(
        self,
        request_id: str,
        prompt: Any,
        params: SamplingParams,
        request: SamplingFields,
        prompt_field: str,
        max_tokens_field: str,
    ) -> dict[str, Any]:
        try:
            prompt_text, core_request = self.engine_client.input_processor.process_inputs(
                request_id, prompt, params, priority=request.priority
            )
        except ValueError as e:
            # The input processor's messages start with the field they are
            # about (min_tokens, allowed_token_ids, logit_bias, priority...);
            # anything else is about the prompt itself.
            field = param_from_message(str(e), set(type(request).model_fields))
            raise GlassboxValidationError(str(e), field or prompt_field) from e
        num_prompt_tokens = len(core_request.prompt_token_ids)
        requested = getattr(request, max_tokens_field) or 0
        if num_prompt_tokens + requested > self.max_model_len:
            raise GlassboxValidationError(
                f"This model's maximum context length is {self.max_model_len} tokens, but "
                f"the {num_prompt_tokens}-token prompt plus {max_tokens_field}={requested} "
                f"needs {num_prompt_tokens + requested}; shorten the prompt or lower "
                f"{max_tokens_field}.",
                prompt_field,
            )
        rendered: dict[str, Any] = {"prompt_token_ids": core_request.prompt_token_ids}
        if prompt_text is not None:
            rendered["prompt"] = prompt_text
        return rendered

    # -- request -> SamplingParams ----------------------------------------------------
    def build_sampling_params(
        self,
        request: SamplingFields,
        max_tokens: int | None,
        logprobs: int | None,
        output_kind: RequestOutputKind,
        *,
        max_tokens_field: str = "max_tokens",
        logprobs_field: str = "logprobs",
        prompt_logprobs: int | None = None,
    ) -> SamplingParams:
        """``max_tokens`` / ``logprobs`` are the request's values, which the
        two endpoints take from differently named fields (named for errors)."""
        if max_tokens is not None and max_tokens > self.max_model_len:
            # Checked before tokenizing: no prompt can make such a request fit.
            raise GlassboxValidationError(
                f"{max_tokens_field}={max_tokens} is more than max_model_len="
                f"{self.max_model_len}, the most tokens a request can hold (prompt and "
                "output together); ask for fewer output tokens.",
                max_tokens_field,
            )
        limit = self.model_config.max_logprobs  # --max-logprobs; -1: no limit
        if logprobs is not None and not (
            0 <= logprobs <= limit or (limit == -1 and logprobs >= -1)
        ):
            allowed = "an integer >= 0, or -1" if limit == -1 else f"in [0, {limit}]"
            raise GlassboxValidationError(
                f"{logprobs_field} must be {allowed} (--max-logprobs), got {logprobs}",
                logprobs_field,
            )
        if max_tokens is None:
            max_tokens = self.default_max_tokens
        kwargs = request.sampling_kwargs()
        for key, value in self.default_sampling_params.items():
            if kwargs.get(key) is None:
                kwargs[key] = value
        for key in ("top_k", "min_p"):
            if kwargs.get(key) is None:
                kwargs[key] = 0 if key == "top_k" else 0.0
        try:
            return SamplingParams.from_optional(
                **kwargs,
                max_tokens=max_tokens,
                logprobs=logprobs,
                prompt_logprobs=prompt_logprobs,
                output_kind=output_kind,
            )
        except ValueError as e:
            message = str(e)
            param = param_from_message(message, set(type(request).model_fields))
            # SamplingParams knows these two by one name only.
            renamed = {"max_tokens": max_tokens_field, "logprobs": logprobs_field}
            if param in renamed and renamed[param] != param:
                message = renamed[param] + message.removeprefix(param)
                param = renamed[param]
            raise GlassboxValidationError(message, param) from e


def logprob_token(logprob: Logprob, token_id: int) -> str:
    """The text of one token as OpenAI reports it (its id when it has no text)."""
    return logprob.decoded_token if logprob.decoded_token is not None else f"token_id:{token_id}"


def top_logprobs_by_rank(position: dict[int, Logprob], k: int) -> list[tuple[int, Logprob]]:
    """The ``k`` most likely tokens at one position, most likely first."""
    return sorted(position.items(), key=lambda item: item[1].rank or 0)[:k]


def clamp_prompt_logprobs(prompt_logprobs: PromptLogprobs | None) -> PromptLogprobs | None:
    """-inf (a token the model rules out) as -9999.0: JSON has no infinity."""
    for position in prompt_logprobs or []:
        for entry in (position or {}).values():
            entry.logprob = max(entry.logprob, -9999.0)
    return prompt_logprobs
