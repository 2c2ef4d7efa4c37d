"""``OpenAIServingTokenization``: ``/tokenize`` and ``/detokenize``.

vLLM twin: ``vllm/entrypoints/serve/tokenize/serving.py``.
Read it to see exactly which token ids a prompt or a conversation becomes on
this server -- the same ids the generation endpoints would send to EngineCore.
Sessions: 01.
"""

from __future__ import annotations

from engine.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
from engine.entrypoints.openai.chat_completion.serving import OpenAIServingChat
from engine.entrypoints.openai.engine.serving import GlassboxValidationError, OpenAIServing
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
            tokens = self.chat.render_chat(chat_request)["prompt_token_ids"]
        else:
            tokens = list(
                tokenizer.encode(request.prompt, add_special_tokens=request.add_special_tokens)
            )
        token_strs = tokenizer.convert_ids_to_tokens(tokens) if request.return_token_strs else None
        return TokenizeResponse(
            count=len(tokens),
            max_model_len=self.max_model_len or 0,
            tokens=tokens,
            token_strs=token_strs,
        )

    async def create_detokenize(self, request: DetokenizeRequest) -> DetokenizeResponse:
        self._check_model(request)  # type: ignore[arg-type]
        tokenizer = self.engine_client.get_tokenizer()
        vocab_size = self.model_config.vocab_size
        bad = [t for t in request.tokens if t < 0 or (vocab_size and t >= vocab_size)]
        if bad:
            raise GlassboxValidationError(
                f"tokens must be in [0, {vocab_size - 1}], got {bad[0]}", "tokens"
            )
        return DetokenizeResponse(prompt=tokenizer.decode(request.tokens))
