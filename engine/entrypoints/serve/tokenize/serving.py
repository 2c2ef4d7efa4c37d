"""``OpenAIServingTokenization``: ``/tokenize`` and ``/detokenize``.

vLLM twin: ``vllm/entrypoints/serve/tokenize/serving.py``.
Read it to see exactly which token ids a prompt or a conversation becomes on
this server -- the same ids the generation endpoints would send to EngineCore.
As for generation, the tokenizer runs on the renderer thread, never on the event loop.
Sessions: 01.

Differs from vLLM on purpose: a ``prompt`` (or ``messages``) longer than
``max_model_len`` times the longest token text, or than ``--max-input-chars``,
is a 400 before tokenizing (vLLM tokenizes text of any length here): such a text
could never be a prompt, and tokenizing megabytes would hold the renderer thread
that every generation request waits on.
"""

from __future__ import annotations

from typing import Any

from engine.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
from engine.entrypoints.openai.chat_completion.serving import OpenAIServingChat
from engine.entrypoints.openai.engine.serving import (
    GlassboxValidationError,
    OpenAIServing,
    make_async,
)
from engine.entrypoints.serve.tokenize.protocol import (
    DetokenizeRequest,
    DetokenizeResponse,
    TokenizeRequest,
    TokenizeResponse,
)


class OpenAIServingTokenization(OpenAIServing):
    def __init__(self, *args, chat: OpenAIServingChat, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.chat = chat

    async def create_tokenize(self, request: TokenizeRequest) -> TokenizeResponse:
        self._check_model(request)  # type: ignore[arg-type]
        tokenizer = self.engine_client.get_tokenizer()
        if (request.prompt is None) == (request.messages is None):
            raise GlassboxValidationError("give exactly one of prompt or messages", "prompt")
        if request.messages is not None:
            chat_request = ChatCompletionRequest(
                messages=request.messages,
                add_generation_prompt=request.add_generation_prompt,
                continue_final_message=request.continue_final_message,
                chat_template=request.chat_template,
                chat_template_kwargs=request.chat_template_kwargs,
            )
            rendered = await self.chat.render_chat_async(chat_request)
            tokens = rendered["prompt_token_ids"]
        else:
            assert request.prompt is not None
            self.check_input_chars(len(request.prompt), "prompt")
            tokens = await make_async(self._encode, self._executor)(
                tokenizer, request.prompt, request.add_special_tokens
            )
        token_strs = None
        if request.return_token_strs:
            token_strs = await make_async(tokenizer.convert_ids_to_tokens, self._executor)(tokens)
        return TokenizeResponse(
            count=len(tokens),
            max_model_len=self.max_model_len or 0,
            tokens=tokens,
            token_strs=token_strs,
        )

    @staticmethod
    def _encode(tokenizer: Any, prompt: str, add_special_tokens: bool) -> list[int]:
        return list(tokenizer.encode(prompt, add_special_tokens=add_special_tokens))

    async def create_detokenize(self, request: DetokenizeRequest) -> DetokenizeResponse:
        self._check_model(request)  # type: ignore[arg-type]
        tokenizer = self.engine_client.get_tokenizer()
        vocab_size = self.model_config.vocab_size
        bad = [t for t in request.tokens if t < 0 or (vocab_size and t >= vocab_size)]
        if bad:
            raise GlassboxValidationError(
                f"tokens must be in [0, {vocab_size - 1}], got {bad[0]}", "tokens"
            )
        text = await make_async(tokenizer.decode, self._executor)(request.tokens)
        return DetokenizeResponse(prompt=text)
