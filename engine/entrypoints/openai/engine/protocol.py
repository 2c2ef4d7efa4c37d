"""Pydantic models shared by the OpenAI endpoints.

vLLM twin: ``vllm/entrypoints/openai/engine/protocol.py``.
Read it for the wire format every response uses: the error body
``{"error": {"message", "type", "param", "code"}}`` (OpenAI's schema, which
the ``openai`` client turns into ``BadRequestError``, ``NotFoundError``...),
``usage`` and the model list; and for structured outputs on the wire (session
06): OpenAI's ``response_format`` (``ResponseFormat``,
``JsonSchemaResponseFormat``) and vLLM's ``structured_outputs`` body field,
which ``to_sampling_params`` merges into one ``StructuredOutputsParams`` --
``{"type": "json_object"}`` sets ``json_object``, ``{"type": "json_schema"}``
sets ``json`` to its ``schema``, over any ``structured_outputs`` the request
also sent (the same kind is replaced, a second kind is a 400).
Sessions: 01, 06.

Simpler than vLLM: no tool calls, reasoning fields or multimodal content, and
no structural tags (``response_format`` type ``"structural_tag"`` and
``structured_outputs.structural_tag`` are a 400 saying so). Request models are
*strict* (no "5" for an int, no 1 for a string), so a wrong JSON type is a 400
naming the field, never a silent cast.

Differs from vLLM on purpose: every check of the constraint's shape (one
kind, a non-empty ``choice``, a ``json_schema`` format with its ``schema``) runs
when the body is parsed and the 400 names the field (``response_format`` or
``structured_outputs``); vLLM finds some of these only when it builds the
sampling params, naming no field. ``structured_outputs.json_object: false`` is
a 400 too (vLLM takes it for a constraint, and the engine then finds none), and
so is a schema nested deeper than ``MAX_SCHEMA_DEPTH`` (vLLM has no cap).
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationInfo,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError

from engine.sampling_params import INT64_MAX, INT64_MIN, StructuredOutputsParams


def random_uuid() -> str:
    return uuid.uuid4().hex


class OpenAIBaseModel(BaseModel):
    # Unknown fields are ignored, as by vLLM and OpenAI (clients send extras
    # such as "user" or "metadata"); known fields must have the right type.
    model_config = ConfigDict(extra="ignore", strict=True)


class ErrorInfo(OpenAIBaseModel):
    message: str
    type: str
    param: str | None = None
    code: int


class ErrorResponse(OpenAIBaseModel):
    error: ErrorInfo


class ModelPermission(OpenAIBaseModel):
    id: str = Field(default_factory=lambda: f"modelperm-{random_uuid()}")
    object: str = "model_permission"
    created: int = Field(default_factory=lambda: int(time.time()))
    allow_create_engine: bool = False
    allow_sampling: bool = True
    allow_logprobs: bool = True
    allow_search_indices: bool = False
    allow_view: bool = True
    allow_fine_tuning: bool = False
    organization: str = "*"
    group: str | None = None
    is_blocking: bool = False


class ModelCard(OpenAIBaseModel):
    id: str
    object: str = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "glassbox"
    root: str | None = None
    parent: str | None = None
    max_model_len: int | None = None
    permission: list[ModelPermission] = Field(default_factory=list)


class ModelList(OpenAIBaseModel):
    object: str = "list"
    data: list[ModelCard] = Field(default_factory=list)


class PromptTokenUsageInfo(OpenAIBaseModel):
    cached_tokens: int | None = None


class UsageInfo(OpenAIBaseModel):
    prompt_tokens: int = 0
    total_tokens: int = 0
    completion_tokens: int | None = 0
    prompt_tokens_details: PromptTokenUsageInfo | None = None


class StreamOptions(OpenAIBaseModel):
    include_usage: bool | None = False
    # vLLM extension: a usage object on every chunk, not only the last.
    continuous_usage_stats: bool | None = False


class RepetitionDetection(OpenAIBaseModel):
    """vLLM's ``repetition_detection`` object: end the output when it ends in
    a pattern of min..max_pattern_size tokens repeated min_count times."""

    max_pattern_size: int = Field(0, ge=0)
    min_pattern_size: int = Field(0, ge=0)
    min_count: int = Field(0, ge=0)


class DeltaMessage(OpenAIBaseModel):
    role: str | None = None
    content: str | None = None


def _bad_value(message: str) -> PydanticCustomError:
    """A validation error whose text is ``message`` as is (no "Value error, ")."""
    return PydanticCustomError("value_error", "{reason}", {"reason": message})


# The constraint kinds of StructuredOutputsParams; a request sets exactly one.
_CONSTRAINTS = ("json", "regex", "choice", "grammar", "json_object")

STRUCTURAL_TAGS_UNSUPPORTED = (
    "Glassbox does not support structural tags (tool-call tags); constrain the output with "
    "a JSON schema, a regex, a choice list or a grammar instead"
)


# JSON schemas are copied and walked recursively on the way to the grammar
# compiler: one nested a few hundred levels would hit Python's recursion limit
# there (a 500), so past this depth it is a 400 here (vLLM has no such cap).
# Each level of nested objects in a schema is two levels of JSON.
MAX_SCHEMA_DEPTH = 64


def _check_schema_depth(schema: Any) -> Any:
    """``schema`` (a dict, or a JSON string) unless it is nested deeper than
    ``MAX_SCHEMA_DEPTH``; walked with a stack, not recursion."""
    too_deep = _bad_value(
        f"the schema is nested more than {MAX_SCHEMA_DEPTH} levels deep (objects and arrays); "
        "flatten it, e.g. with $defs and $ref"
    )
    value = schema
    if isinstance(schema, str):
        try:
            value = json.loads(schema)
        except RecursionError:
            raise too_deep from None
        except ValueError:
            return schema  # not JSON at all: the input processor says so
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict):
            children = list(item.values())
        elif isinstance(item, list):
            children = item
        else:
            continue
        if depth > MAX_SCHEMA_DEPTH:
            raise too_deep
        stack.extend((child, depth + 1) for child in children)
    return schema


class JsonSchemaResponseFormat(OpenAIBaseModel):
    name: str
    description: str | None = None
    # The wire name is "schema", which BaseModel already uses (as vLLM: an alias).
    json_schema: dict[str, Any] | None = Field(None, alias="schema")
    # OpenAI's flag; the grammar enforces the schema either way.
    strict: bool | None = None

    @field_validator("json_schema")
    @classmethod
    def _not_too_deep(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        return _check_schema_depth(value)


class ResponseFormat(OpenAIBaseModel):
    """OpenAI's ``response_format``: plain text, any JSON object, or JSON that
    follows ``json_schema.schema``."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaResponseFormat | None = None

    @field_validator("type", mode="before")
    @classmethod
    def _no_structural_tag(cls, value: Any) -> Any:
        if value == "structural_tag":
            raise _bad_value(STRUCTURAL_TAGS_UNSUPPORTED)
        return value

    @model_validator(mode="after")
    def _json_schema_has_a_schema(self) -> ResponseFormat:
        if self.type == "json_schema" and (
            self.json_schema is None or self.json_schema.json_schema is None
        ):
            raise _bad_value(
                "type 'json_schema' needs json_schema.schema, the JSON schema the output follows "
                '(e.g. {"type": "json_schema", "json_schema": {"name": "answer", "schema": '
                '{"type": "object"}}})'
            )
        return self

    def structured_outputs_kwargs(self) -> dict[str, Any]:
        """The ``StructuredOutputsParams`` fields this format sets (none for text)."""
        if self.type == "json_object":
            return {"json_object": True}
        if self.type == "json_schema":
            assert self.json_schema is not None
            return {"json": self.json_schema.json_schema}
        return {}


class StructuredOutputsRequest(OpenAIBaseModel):
    """vLLM's ``structured_outputs`` body field (an extra body field for the
    ``openai`` client): the fields of ``StructuredOutputsParams``, exactly one
    constraint set. The engine's own checks run when the body is parsed."""

    # The wire name is "json", which BaseModel already uses.
    json_: str | dict[str, Any] | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    whitespace_pattern: str | None = None
    # Declared only to be refused by name (extra fields are otherwise ignored).
    structural_tag: str | None = None

    @field_validator("json_")
    @classmethod
    def _not_too_deep(cls, value: str | dict[str, Any] | None) -> str | dict[str, Any] | None:
        return _check_schema_depth(value)

    @field_validator("structural_tag")
    @classmethod
    def _no_structural_tag(cls, value: str | None) -> str | None:
        if value is not None:
            raise _bad_value(STRUCTURAL_TAGS_UNSUPPORTED)
        return value

    @field_validator("json_object")
    @classmethod
    def _json_object_is_true(cls, value: bool | None) -> bool | None:
        # StructuredOutputsParams counts False as set, but it constrains nothing.
        if value is False:
            raise _bad_value("false sets no constraint; send true, or leave json_object out")
        return value

    @model_validator(mode="after")
    def _one_constraint(self) -> StructuredOutputsRequest:
        try:
            StructuredOutputsParams(**self.params_kwargs())
        except ValueError as e:
            # The engine's text names structured_outputs, as the error's field does.
            reason = str(e).removeprefix("structured_outputs").removeprefix(".").lstrip()
            raise _bad_value(reason) from e
        return self

    def params_kwargs(self) -> dict[str, Any]:
        return self.model_dump(by_alias=True, exclude={"structural_tag"})

    def constraint(self) -> str:
        """The name of the one constraint set (checked when parsed)."""
        kwargs = self.params_kwargs()
        return next(k for k in _CONSTRAINTS if kwargs[k] is not None)


class SamplingFields(OpenAIBaseModel):
    """Request fields both endpoints turn into ``SamplingParams``: OpenAI's
    and vLLM's extras (``top_k``, ``min_p``, ``ignore_eos``, ``min_tokens``,
    ``priority``, ...). None means "the model's default"."""

    model: str | None = None
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    # The 64-bit range vLLM's protocol gives seed and priority.
    seed: int | None = Field(None, ge=INT64_MIN, le=INT64_MAX)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    priority: int = Field(0, ge=INT64_MIN, le=INT64_MAX)
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # vLLM extension: the engine request id (defaults to a random one).
    request_id: str | None = None
    # Structured outputs (session 06): OpenAI's field, then vLLM's extension.
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsRequest | None = None
    # vLLM extension: stop on a repeated token pattern (finish_reason "repetition").
    repetition_detection: RepetitionDetection | None = None

    @field_validator("structured_outputs")
    @classmethod
    def _one_constraint_in_all(
        cls, value: StructuredOutputsRequest | None, info: ValidationInfo
    ) -> StructuredOutputsRequest | None:
        """response_format's constraint replaces structured_outputs' of the
        same kind (vLLM's ``replace``); two kinds cannot both hold."""
        response_format = info.data.get("response_format")
        if value is None or response_format is None:
            return value
        overrides = response_format.structured_outputs_kwargs()
        if overrides and value.constraint() not in overrides:
            raise _bad_value(
                f"response_format type {response_format.type!r} and structured_outputs."
                f"{value.constraint()} are two constraints on the output; send one of them"
            )
        return value

    def structured_outputs_params(self) -> StructuredOutputsParams | None:
        """The request's constraint (vLLM's ``to_sampling_params``): response_format's,
        merged over structured_outputs', or None."""
        kwargs = self.structured_outputs.params_kwargs() if self.structured_outputs else {}
        if self.response_format is not None:
            kwargs.update(self.response_format.structured_outputs_kwargs())
        return StructuredOutputsParams(**kwargs) if kwargs else None

    def name_structured_outputs_error(
        self, message: str, param: str | None
    ) -> tuple[str, str | None]:
        """The input processor names a bad constraint ``structured_outputs.json``;
        when the schema came in ``response_format``, name that field instead."""
        prefix = "structured_outputs.json "
        response_format = self.response_format
        if response_format is None or response_format.type != "json_schema":
            return message, param
        if not message.startswith(prefix):
            return message, param
        return "response_format.json_schema.schema " + message[len(prefix) :], "response_format"

    def sampling_kwargs(self) -> dict[str, Any]:
        """The fields that map one-to-one onto ``SamplingParams``, and the
        structured-outputs constraint built from two of them."""
        return dict(
            n=self.n,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            repetition_penalty=self.repetition_penalty,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            min_p=self.min_p,
            seed=self.seed,
            stop=self.stop,
            stop_token_ids=self.stop_token_ids,
            bad_words=self.bad_words,
            include_stop_str_in_output=self.include_stop_str_in_output,
            ignore_eos=self.ignore_eos,
            min_tokens=self.min_tokens,
            skip_special_tokens=self.skip_special_tokens,
            spaces_between_special_tokens=self.spaces_between_special_tokens,
            logit_bias=self.logit_bias,
            allowed_token_ids=self.allowed_token_ids,
            structured_outputs=self.structured_outputs_params(),
            repetition_detection=(
                self.repetition_detection.model_dump() if self.repetition_detection else None
            ),
        )
