"""``OpenAIServingChat``: ``POST /v1/chat/completions``.

vLLM twin: ``vllm/entrypoints/openai/chat_completion/serving.py``.
Read it for how a conversation becomes a prompt -- the tokenizer's chat
template renders ``messages`` to text (``tokenize=False``) and the text is
tokenized without adding special tokens again, the same way ``LLM.chat`` does
-- and for the streaming shape: per choice a first chunk carrying only
``role``, then content deltas, then the chunk with ``finish_reason``.
``response_format`` / ``structured_outputs`` (session 06) ride in the
``SamplingParams`` (``SamplingFields.sampling_kwargs``); the input processor
checks the constraint compiles while the prompt is rendered, so a bad schema is
a 400 before the request reaches the engine, streaming or not.
``prompt_logprobs`` (vLLM's extension) returns the rendered prompt's
logprobs beside the choices, when not streaming.
Sessions: 01, 06.

``echo`` puts the last message's content before each choice's when that
message has the response's role (continuing an assistant turn).

Simpler than vLLM: no tool calls, reasoning parsers or harmony format (setting
one is a 400 naming the field); no structural tags in ``response_format``.
"""

from __future__ import annotations

import time
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any

from engine.entrypoints.openai.chat_completion.protocol import (
    ChatCompletionLogProb,
    ChatCompletionLogProbs,
    ChatCompletionLogProbsContent,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatCompletionResponseChoice,
    ChatCompletionResponseStreamChoice,
    ChatCompletionStreamResponse,
    ChatMessage,
)
from engine.entrypoints.openai.engine.protocol import DeltaMessage
from engine.entrypoints.openai.engine.serving import (
    GlassboxValidationError,
    OpenAIServing,
    aclose_generator,
    clamp_prompt_logprobs,
    logprob_token,
    make_async,
    make_usage_info,
    merge_async_iterators,
    top_logprobs_by_rank,
)
from engine.outputs import CompletionOutput, RequestOutput
from engine.sampling_params import RequestOutputKind


class OpenAIServingChat(OpenAIServing):
    request_id_prefix = "chatcmpl"

    def __init__(self, *args: Any, response_role: str = "assistant", **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.response_role = response_role

    async def create_chat_completion(
        self, request: ChatCompletionRequest, raw_request_id: str | None = None
    ) -> ChatCompletionResponse | AsyncGenerator[str, None]:
        self._check_model(request)
        # A stream answers 200 before its first token: fail a dead engine here (503).
        if self.engine_client.errored:
            raise self.engine_client.dead_error
        if request.tools:
            raise GlassboxValidationError("tools are not supported by Glassbox", "tools")
        if request.top_logprobs is not None and not request.logprobs:
            raise GlassboxValidationError("top_logprobs needs logprobs=true", "top_logprobs")
        if request.stream and request.prompt_logprobs not in (None, 0):
            raise GlassboxValidationError(
                "prompt_logprobs are not available when stream=True", "prompt_logprobs"
            )
        num_logprobs = (request.top_logprobs or 0) if request.logprobs else None

        request_id = self._base_request_id(request, raw_request_id)
        kind = RequestOutputKind.DELTA if request.stream else RequestOutputKind.FINAL_ONLY
        # OpenAI's newer name wins when both are given.
        max_tokens_field = (
            "max_completion_tokens" if request.max_completion_tokens is not None else "max_tokens"
        )
        params = self.build_sampling_params(
            request,
            getattr(request, max_tokens_field),
            num_logprobs,
            kind,
            max_tokens_field=max_tokens_field,
            logprobs_field="top_logprobs",
            prompt_logprobs=request.prompt_logprobs,
        )
        prompt = await self.render_chat_async(
            request, getattr(request, max_tokens_field) or 0, max_tokens_field
        )
        try:
            rendered = await self.render_prompt(
                request_id, prompt, params, request, "messages", max_tokens_field
            )
        except GlassboxValidationError as e:
            # A bad schema sent as response_format is reported under that name.
            message, param = request.name_structured_outputs_error(str(e), e.parameter)
            if param == e.parameter:
                raise
            raise GlassboxValidationError(message, param) from e
        self.check_capacity(request.n)
        lora_request = self._maybe_get_adapters(request)
        result_generator = merge_async_iterators(
            self.engine_client.generate(
                rendered
                if request.cache_salt is None
                else {**rendered, "cache_salt": request.cache_salt},
                params,
                request_id,
                priority=request.priority,
                lora_request=lora_request,
            )
        )
        model_name = self.models.model_name(lora_request)
        num_prompt_tokens = len(rendered["prompt_token_ids"])
        if request.stream:
            return self.chat_completion_stream_generator(
                request, result_generator, request_id, model_name, num_prompt_tokens
            )
        final: RequestOutput | None = None
        try:
            async for _, res in result_generator:
                final = res
        finally:
            await result_generator.aclose()
        assert final is not None
        return self.chat_completion_full_response(request, final, request_id, model_name)

    async def render_chat_async(
        self,
        request: ChatCompletionRequest,
        max_tokens: int = 0,
        max_tokens_field: str | None = None,
    ) -> dict[str, Any]:
        """``render_chat`` on the renderer thread, after a length check of the
        messages' text (a lower bound of the rendered prompt's) on the loop."""
        num_chars = sum(_content_chars(m.content) for m in request.messages)
        self.check_input_chars(num_chars, "messages", max_tokens, max_tokens_field)
        return await make_async(self.render_chat, self._executor)(
            request, max_tokens, max_tokens_field
        )

    def render_chat(
        self,
        request: ChatCompletionRequest,
        max_tokens: int = 0,
        max_tokens_field: str | None = None,
    ) -> dict[str, Any]:
        """messages -> chat template text -> token ids (as ``LLM.chat``)."""
        tokenizer = self.engine_client.get_tokenizer()
        if not request.messages:
            raise GlassboxValidationError("messages must not be empty", "messages")
        if request.add_generation_prompt and request.continue_final_message:
            raise GlassboxValidationError(
                "add_generation_prompt and continue_final_message cannot both be true",
                "continue_final_message",
            )
        conversation: list[dict[str, str]] = []
        for message in request.messages:
            content = message.content
            if isinstance(content, list):
                texts = []
                for part in content:
                    if part.type != "text" or part.text is None:
                        raise GlassboxValidationError(
                            f"message content parts must be of type 'text', got {part.type!r}",
                            "messages",
                        )
                    texts.append(part.text)
                content = "\n".join(texts)
            conversation.append({"role": message.role, "content": content or ""})
        if request.chat_template is None and not getattr(tokenizer, "chat_template", None):
            raise GlassboxValidationError(
                "the model's tokenizer has no chat template; pass one as chat_template",
                "chat_template",
            )
        try:
            text = tokenizer.apply_chat_template(
                conversation,
                chat_template=request.chat_template,
                tokenize=False,
                add_generation_prompt=request.add_generation_prompt,
                continue_final_message=request.continue_final_message,
                **(request.chat_template_kwargs or {}),
            )
        except Exception as e:  # jinja errors, bad template kwargs
            raise GlassboxValidationError(f"the chat template failed: {e}", "messages") from e
        self.check_input_chars(len(text), "messages", max_tokens, max_tokens_field)
        # The template already wrote any BOS; don't let encode() add another.
        return {
            "prompt": text,
            "prompt_token_ids": tokenizer.encode(text, add_special_tokens=False),
        }

    async def chat_completion_stream_generator(
        self,
        request: ChatCompletionRequest,
        result_generator: AsyncIterator[tuple[int, RequestOutput]],
        request_id: str,
        model_name: str,
        num_prompt_tokens: int,
    ) -> AsyncGenerator[str, None]:
        created = int(time.time())
        num_choices = request.n
        num_tokens = [0] * num_choices
        options = request.stream_options
        include_usage = bool(options and options.include_usage)
        continuous_usage = include_usage and bool(options and options.continuous_usage_stats)

        def chunk_json(choice: ChatCompletionResponseStreamChoice, completion_tokens: int) -> str:
            chunk = ChatCompletionStreamResponse(
                id=request_id,
                object="chat.completion.chunk",
                created=created,
                model=model_name,
                choices=[choice],
            )
            if include_usage:
                chunk.usage = (
                    make_usage_info(num_prompt_tokens, completion_tokens)
                    if continuous_usage
                    else None
                )
            return f"data: {chunk.model_dump_json(exclude_unset=True)}\n\n"

        try:
            first_iteration = True
            async for _, res in result_generator:
                if first_iteration:
                    # The role goes out first, once per choice.
                    for i in range(num_choices):
                        yield chunk_json(
                            ChatCompletionResponseStreamChoice(
                                index=i,
                                delta=DeltaMessage(role=self.response_role, content=""),
                                logprobs=None,
                                finish_reason=None,
                            ),
                            0,
                        )
                    echoed = self._echoed_content(request)
                    for i in range(num_choices if echoed else 0):
                        yield chunk_json(
                            ChatCompletionResponseStreamChoice(
                                index=i,
                                delta=DeltaMessage(content=echoed),
                                logprobs=None,
                                finish_reason=None,
                            ),
                            0,
                        )
                    first_iteration = False
                for output in res.outputs:
                    i = output.index
                    num_tokens[i] += len(output.token_ids)
                    if not output.text and not output.token_ids and output.finish_reason is None:
                        continue
                    logprobs = None
                    if request.logprobs and output.logprobs is not None:
                        logprobs = self._create_chat_logprobs(output, request.top_logprobs or 0)
                    yield chunk_json(
                        ChatCompletionResponseStreamChoice(
                            index=i,
                            delta=DeltaMessage(content=output.text),
                            logprobs=logprobs,
                            finish_reason=output.finish_reason,
                            stop_reason=output.stop_reason,
                        ),
                        num_tokens[i],
                    )
            if include_usage:
                usage_chunk = ChatCompletionStreamResponse(
                    id=request_id,
                    object="chat.completion.chunk",
                    created=created,
                    model=model_name,
                    choices=[],
                    usage=make_usage_info(num_prompt_tokens, sum(num_tokens)),
                )
                usage_json = usage_chunk.model_dump_json(exclude_unset=True, exclude_none=True)
                yield f"data: {usage_json}\n\n"
        except Exception as e:
            yield f"data: {self.create_streaming_error_response(e)}\n\n"
        finally:
            await aclose_generator(result_generator)
        yield "data: [DONE]\n\n"

    def chat_completion_full_response(
        self,
        request: ChatCompletionRequest,
        final_res: RequestOutput,
        request_id: str,
        model_name: str,
    ) -> ChatCompletionResponse:
        choices = []
        for output in sorted(final_res.outputs, key=lambda o: o.index):
            logprobs = None
            if request.logprobs and output.logprobs is not None:
                logprobs = self._create_chat_logprobs(output, request.top_logprobs or 0)
            choices.append(
                ChatCompletionResponseChoice(
                    index=output.index,
                    message=ChatMessage(
                        role=self.response_role, content=self._echoed_content(request) + output.text
                    ),
                    logprobs=logprobs,
                    finish_reason=output.finish_reason,
                    stop_reason=output.stop_reason,
                )
            )
        num_prompt_tokens = len(final_res.prompt_token_ids or [])
        num_generated_tokens = sum(len(o.token_ids) for o in final_res.outputs)
        return ChatCompletionResponse(
            id=request_id,
            model=model_name,
            choices=choices,
            usage=make_usage_info(num_prompt_tokens, num_generated_tokens),
            prompt_logprobs=clamp_prompt_logprobs(final_res.prompt_logprobs),
        )

    def _echoed_content(self, request: ChatCompletionRequest) -> str:
        """With ``echo``, the last message's text when it has the response's role
        (the turn being continued), else ""."""
        if not request.echo or not request.messages:
            return ""
        last = request.messages[-1]
        if last.role != self.response_role or not last.content:
            return ""
        if isinstance(last.content, list):  # content parts: their text, one per line
            return "\n".join(part.text or "" for part in last.content)
        return last.content

    @staticmethod
    def _create_chat_logprobs(
        output: CompletionOutput, top_logprobs: int
    ) -> ChatCompletionLogProbs:
        content = []
        for token_id, position in zip(output.token_ids, output.logprobs or []):
            sampled = position.get(token_id)
            token = (
                logprob_token(sampled, token_id) if sampled is not None else f"token_id:{token_id}"
            )
            content.append(
                ChatCompletionLogProbsContent(
                    token=token,
                    logprob=max(sampled.logprob, -9999.0) if sampled is not None else -9999.0,
                    bytes=list(token.encode("utf-8")),
                    top_logprobs=[
                        ChatCompletionLogProb(
                            token=(t := logprob_token(lp, tid)),
                            logprob=max(lp.logprob, -9999.0),
                            bytes=list(t.encode("utf-8")),
                        )
                        for tid, lp in top_logprobs_by_rank(position, top_logprobs)
                    ],
                )
            )
        return ChatCompletionLogProbs(content=content)


def _content_chars(content: Any) -> int:
    """Characters of a message's text (a string or a list of text parts)."""
    if isinstance(content, str):
        return len(content)
    if isinstance(content, list):
        return sum(len(getattr(part, "text", None) or "") for part in content)
    return 0
