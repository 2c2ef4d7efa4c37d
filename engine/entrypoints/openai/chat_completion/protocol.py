"""Request and response bodies of ``POST /v1/chat/completions``.

vLLM twin: ``vllm/entrypoints/openai/chat_completion/protocol.py``.
Read it for the chat format: ``messages`` in, ``choices[i].message`` out, and
for streaming ``chat.completion.chunk`` objects whose ``delta`` carries the
role first and then pieces of content; ``logprobs.content[j]`` has the token,
its logprob, its UTF-8 bytes and the ``top_logprobs`` alternatives.
``response_format`` and ``structured_outputs`` (session 06) come from
``SamplingFields``, shared with completions, as in vLLM.
Sessions: 01, 06.

Simpler than vLLM: text content only (a string or a list of
``{"type": "text"}`` parts), no tools or reasoning; ``response_format`` is
text, ``json_object`` or ``json_schema`` (no structural tags).
"""

from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import Field

from engine.entrypoints.openai.engine.protocol import (
    DeltaMessage,
    OpenAIBaseModel,
    SamplingFields,
    UsageInfo,
    random_uuid,
)
from engine.logprobs import Logprob


class ChatContentPart(OpenAIBaseModel):
    type: str
    text: str | None = None


class ChatCompletionMessageParam(OpenAIBaseModel):
    role: str
    content: str | list[ChatContentPart] | None = None
    name: str | None = None


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatCompletionMessageParam]
    max_tokens: int | None = None
    # OpenAI's newer name for max_tokens; wins when both are given.
    max_completion_tokens: int | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = None
    # vLLM extension: mixed into the first KV block's hash, so only requests
    # with the same salt share cached prefix blocks.
    cache_salt: str | None = Field(default=None, min_length=1)
    # vLLM's chat-template extras.
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    echo: bool = False
    tools: list[dict[str, Any]] | None = None
    # vLLM extension: logprobs of the rendered prompt's tokens (not streamed).
    prompt_logprobs: int | None = None


class ChatMessage(OpenAIBaseModel):
    role: str
    content: str | None = None


class ChatCompletionLogProb(OpenAIBaseModel):
    token: str
    logprob: float = -9999.0
    bytes: list[int] | None = None


class ChatCompletionLogProbsContent(ChatCompletionLogProb):
    top_logprobs: list[ChatCompletionLogProb] = Field(default_factory=list)


class ChatCompletionLogProbs(OpenAIBaseModel):
    content: list[ChatCompletionLogProbsContent] | None = None


class ChatCompletionResponseChoice(OpenAIBaseModel):
    index: int
    message: ChatMessage
    logprobs: ChatCompletionLogProbs | None = None
    finish_reason: str | None = "stop"
    stop_reason: int | str | None = None


class ChatCompletionResponse(OpenAIBaseModel):
    id: str = Field(default_factory=lambda: f"chatcmpl-{random_uuid()}")
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatCompletionResponseChoice]
    usage: UsageInfo
    # vLLM extension: with prompt_logprobs, None for the first prompt token,
    # then {token id: logprob, rank, decoded_token} per prompt token.
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None


class ChatCompletionResponseStreamChoice(OpenAIBaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatCompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionStreamResponse(OpenAIBaseModel):
    id: str = Field(default_factory=lambda: f"chatcmpl-{random_uuid()}")
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatCompletionResponseStreamChoice]
    usage: UsageInfo | None = None
