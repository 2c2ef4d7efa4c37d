"""Request and response bodies of ``POST /v1/completions``.

vLLM twin: ``vllm/entrypoints/openai/completion/protocol.py``.
Read it for OpenAI's legacy completion format (``choices[i].text``,
``logprobs.tokens / token_logprobs / top_logprobs / text_offset``) plus vLLM's
sampling extras inherited from ``SamplingFields`` -- among them, as in vLLM,
``response_format`` and ``structured_outputs`` (session 06), which legacy
OpenAI completions do not have. Sessions: 01, 06.

Simpler than vLLM: no structural tags (``response_format`` type
``"structural_tag"`` is a 400).
"""

from __future__ import annotations

import time
from typing import Literal

from pydantic import Field

from engine.entrypoints.openai.engine.protocol import (
    OpenAIBaseModel,
    SamplingFields,
    UsageInfo,
    random_uuid,
)
from engine.logprobs import Logprob


class CompletionRequest(SamplingFields):
    # One prompt (text or token ids) or a batch of them.
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    # Top-k logprobs per generated token (0..20), as in OpenAI's legacy API.
    logprobs: int | None = None
    echo: bool | None = False
    suffix: str | None = None
    best_of: int | None = None
    prompt_logprobs: int | None = None
    # vLLM extension: mixed into the first KV block's hash, so only requests
    # with the same salt share cached prefix blocks.
    cache_salt: str | None = Field(default=None, min_length=1)


class CompletionLogProbs(OpenAIBaseModel):
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class CompletionResponseChoice(OpenAIBaseModel):
    index: int
    text: str
    logprobs: CompletionLogProbs | None = None
    finish_reason: str | None = None
    # vLLM extension: the stop string or stop token id that ended the choice.
    stop_reason: int | str | None = None
    # vLLM extension: with prompt_logprobs, None for the first prompt token,
    # then {token id: logprob, rank, decoded_token} per prompt token.
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None


class CompletionResponse(OpenAIBaseModel):
    id: str = Field(default_factory=lambda: f"cmpl-{random_uuid()}")
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionResponseChoice]
    usage: UsageInfo


class CompletionResponseStreamChoice(OpenAIBaseModel):
    index: int
    text: str
    logprobs: CompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class CompletionStreamResponse(OpenAIBaseModel):
    id: str = Field(default_factory=lambda: f"cmpl-{random_uuid()}")
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionResponseStreamChoice]
    usage: UsageInfo | None = None
