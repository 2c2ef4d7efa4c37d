"""Bodies of ``POST /tokenize`` and ``POST /detokenize``.

vLLM twin: ``vllm/entrypoints/serve/tokenize/protocol.py``. Sessions: 01.
``/tokenize`` takes either a ``prompt`` or chat ``messages`` (rendered with
the chat template, exactly as ``/v1/chat/completions`` would).
"""

from __future__ import annotations

from typing import Any

from engine.entrypoints.openai.chat_completion.protocol import ChatCompletionMessageParam
from engine.entrypoints.openai.engine.protocol import OpenAIBaseModel


class TokenizeRequest(OpenAIBaseModel):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatCompletionMessageParam] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    return_token_strs: bool = False


class TokenizeResponse(OpenAIBaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(OpenAIBaseModel):
    model: str | None = None
    tokens: list[int]


class DetokenizeResponse(OpenAIBaseModel):
    prompt: str
