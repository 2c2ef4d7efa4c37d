"""Pydantic models shared by the OpenAI endpoints.

vLLM twin: ``vllm/entrypoints/openai/engine/protocol.py``.
Read it for the wire format every response uses: the error body
``{"error": {"message", "type", "param", "code"}}`` (OpenAI's schema, which
the ``openai`` client turns into ``BadRequestError``, ``NotFoundError``...),
``usage`` and the model list.
Sessions: 01.

Simpler than vLLM: no tool calls, structured outputs, reasoning fields or
multimodal content. Request models are *strict* (no "5" for an int, no 1 for a
string), so a wrong JSON type is a 400 naming the field, never a silent cast.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from engine.sampling_params import INT64_MAX, INT64_MIN


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


class DeltaMessage(OpenAIBaseModel):
    role: str | None = None
    content: str | None = None


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

    def sampling_kwargs(self) -> dict[str, Any]:
        """The fields that map one-to-one onto ``SamplingParams``."""
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
        )
