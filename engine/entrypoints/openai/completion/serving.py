"""``OpenAIServingCompletion``: ``POST /v1/completions``.

vLLM twin: ``vllm/entrypoints/openai/completion/serving.py``.
Read it for the path of one HTTP request: check the model, render (tokenize +
validate) every prompt, build ``SamplingParams`` (DELTA outputs when
streaming, FINAL_ONLY otherwise), call ``AsyncLLM.generate`` once per prompt
and merge the streams. Choice ``index`` is ``prompt_index * n + sample_index``.
Streaming writes one SSE ``data:`` line per chunk, an optional usage-only
chunk, then ``data: [DONE]``.
``response_format`` / ``structured_outputs`` (session 06) ride in the
``SamplingParams``; rendering each prompt runs the input processor's check that
the constraint compiles, so a bad one is a 400 before anything is generated.
Sessions: 01, 06.

``prompt_logprobs`` (vLLM's extension) puts each prompt token's logprob and
top alternatives in the non-streamed choices, -inf written as -9999.0.
``echo`` puts the prompt before each choice's text; with ``logprobs`` the
prompt's tokens come first in them (the first with a null logprob), and with
``max_tokens=0`` the choice is the prompt alone: how evaluation harnesses ask
a server for the log-likelihood of a text.

Simpler than vLLM: no suffix, best_of or beam search (each is a 400 naming the
field when set); no structural tags in ``response_format``.
"""

from __future__ import annotations

import time
from collections.abc import AsyncGenerator, AsyncIterator, Sequence
from typing import Any

from engine.entrypoints.openai.completion.protocol import (
    CompletionLogProbs,
    CompletionRequest,
    CompletionResponse,
    CompletionResponseChoice,
    CompletionResponseStreamChoice,
    CompletionStreamResponse,
)
from engine.entrypoints.openai.engine.serving import (
    GlassboxValidationError,
    OpenAIServing,
    aclose_generator,
    clamp_prompt_logprobs,
    logprob_token,
    make_usage_info,
    merge_async_iterators,
)
from engine.logprobs import Logprob
from engine.outputs import CompletionOutput, RequestOutput
from engine.sampling_params import RequestOutputKind


class OpenAIServingCompletion(OpenAIServing):
    request_id_prefix = "cmpl"

    async def create_completion(
        self, request: CompletionRequest, raw_request_id: str | None = None
    ) -> CompletionResponse | AsyncGenerator[str, None]:
        """A response, or an SSE generator when ``stream`` is set. Bad input
        raises (the API server turns it into an error response)."""
        self._check_model(request)
        # A stream answers 200 before its first token: fail a dead engine here (503).
        if self.engine_client.errored:
            raise self.engine_client.dead_error
        for field, unsupported in (
            ("suffix", request.suffix is not None),
            ("best_of", request.best_of is not None and request.best_of != request.n),
        ):
            if unsupported:
                raise GlassboxValidationError(f"{field} is not supported by Glassbox", field)
        if request.stream and request.prompt_logprobs not in (None, 0):
            raise GlassboxValidationError(
                "prompt_logprobs are not available when stream=True", "prompt_logprobs"
            )
        prompts = _normalize_prompts(request.prompt)
        request_id = self._base_request_id(request, raw_request_id)
        kind = RequestOutputKind.DELTA if request.stream else RequestOutputKind.FINAL_ONLY
        # Echoed logprobs start with the prompt's; max_tokens=0 with echo: the
        # prompt alone (the engine still samples one token, which is dropped).
        prompt_logprobs = request.prompt_logprobs
        if prompt_logprobs is None and request.echo:
            prompt_logprobs = request.logprobs
        echo_only = bool(request.echo) and request.max_tokens == 0
        params = self.build_sampling_params(
            request,
            1 if echo_only else request.max_tokens,
            request.logprobs,
            kind,
            prompt_logprobs=prompt_logprobs,
        )
        rendered = []
        for i, prompt in enumerate(prompts):
            try:
                rendered.append(
                    await self.render_prompt(
                        f"{request_id}-{i}", prompt, params, request, "prompt", "max_tokens"
                    )
                )
            except GlassboxValidationError as e:
                # A bad schema sent as response_format is reported under that name.
                message, param = request.name_structured_outputs_error(str(e), e.parameter)
                if param == e.parameter:
                    raise
                raise GlassboxValidationError(message, param) from e
        self.check_capacity(len(prompts) * request.n)
        lora_request = self._maybe_get_adapters(request)
        generators = [
            self.engine_client.generate(
                _salted(prompt, request.cache_salt),
                params,
                f"{request_id}-{i}",
                priority=request.priority,
                lora_request=lora_request,
            )
            for i, prompt in enumerate(rendered)
        ]
        result_generator = merge_async_iterators(*generators)
        model_name = self.models.model_name(lora_request)
        num_prompt_tokens = sum(len(p["prompt_token_ids"]) for p in rendered)
        if request.stream:
            return self.completion_stream_generator(
                request, result_generator, request_id, model_name, len(prompts), num_prompt_tokens
            )
        final: list[RequestOutput | None] = [None] * len(prompts)
        try:
            async for i, res in result_generator:
                final[i] = res
        finally:
            await result_generator.aclose()
        return self.request_output_to_completion_response(
            [r for r in final if r is not None], request, request_id, model_name
        )

    async def completion_stream_generator(
        self,
        request: CompletionRequest,
        result_generator: AsyncIterator[tuple[int, RequestOutput]],
        request_id: str,
        model_name: str,
        num_prompts: int,
        num_prompt_tokens: int,
    ) -> AsyncGenerator[str, None]:
        created = int(time.time())
        n = request.n
        num_tokens = [0] * (num_prompts * n)
        text_offsets = [0] * (num_prompts * n)
        options = request.stream_options
        include_usage = bool(options and options.include_usage)
        continuous_usage = include_usage and bool(options and options.continuous_usage_stats)
        has_echoed = [False] * (num_prompts * n)
        try:
            async for prompt_index, res in result_generator:
                for output in res.outputs:
                    i = prompt_index * n + output.index
                    num_tokens[i] += len(output.token_ids)
                    if request.echo and not has_echoed[i]:
                        # The first chunk of a choice carries the prompt.
                        text, token_ids, positions = self._echoed(res, output, request)
                        has_echoed[i] = True
                    elif request.echo and request.max_tokens == 0:
                        continue  # only the dropped token: nothing to send
                    else:
                        text, token_ids, positions = output.text, output.token_ids, output.logprobs
                    logprobs = None
                    if request.logprobs is not None and positions is not None:
                        logprobs = self._create_completion_logprobs(
                            token_ids, positions, text_offsets[i]
                        )
                    text_offsets[i] += len(text)
                    chunk = CompletionStreamResponse(
                        id=request_id,
                        object="text_completion",
                        created=created,
                        model=model_name,
                        choices=[
                            CompletionResponseStreamChoice(
                                index=i,
                                text=text,
                                logprobs=logprobs,
                                finish_reason=output.finish_reason,
                                stop_reason=output.stop_reason,
                            )
                        ],
                    )
                    if include_usage:
                        chunk.usage = (
                            make_usage_info(num_prompt_tokens, num_tokens[i])
                            if continuous_usage
                            else None
                        )
                    yield f"data: {chunk.model_dump_json(exclude_unset=True)}\n\n"
            if include_usage:
                usage_chunk = CompletionStreamResponse(
                    id=request_id,
                    object="text_completion",
                    created=created,
                    model=model_name,
                    choices=[],
                    usage=make_usage_info(num_prompt_tokens, sum(num_tokens)),
                )
                usage_json = usage_chunk.model_dump_json(exclude_unset=True, exclude_none=True)
                yield f"data: {usage_json}\n\n"
        except Exception as e:
            # Headers are gone already: the error travels as the next event.
            yield f"data: {self.create_streaming_error_response(e)}\n\n"
        finally:
            await aclose_generator(result_generator)
        yield "data: [DONE]\n\n"

    def request_output_to_completion_response(
        self,
        final_res_batch: list[RequestOutput],
        request: CompletionRequest,
        request_id: str,
        model_name: str,
    ) -> CompletionResponse:
        choices: list[CompletionResponseChoice] = []
        num_prompt_tokens = num_generated_tokens = 0
        for prompt_index, res in enumerate(final_res_batch):
            num_prompt_tokens += len(res.prompt_token_ids or [])
            prompt_logprobs = clamp_prompt_logprobs(res.prompt_logprobs)
            for output in sorted(res.outputs, key=lambda o: o.index):
                num_generated_tokens += len(output.token_ids)
                if request.echo:
                    text, token_ids, positions = self._echoed(res, output, request)
                else:
                    text, token_ids, positions = output.text, output.token_ids, output.logprobs
                logprobs = None
                if request.logprobs is not None and positions is not None:
                    logprobs = self._create_completion_logprobs(token_ids, positions, 0)
                choices.append(
                    CompletionResponseChoice(
                        index=prompt_index * request.n + output.index,
                        text=text,
                        logprobs=logprobs,
                        finish_reason=output.finish_reason,
                        stop_reason=output.stop_reason,
                        prompt_logprobs=prompt_logprobs,
                    )
                )
        return CompletionResponse(
            id=request_id,
            model=model_name,
            choices=choices,
            usage=make_usage_info(num_prompt_tokens, num_generated_tokens),
        )

    def _echoed(
        self, res: RequestOutput, output: CompletionOutput, request: CompletionRequest
    ) -> tuple[str, list[int], list[dict[int, Logprob] | None] | None]:
        """The prompt, then the choice's own tokens (none with max_tokens=0):
        text, token ids, and logprob positions when logprobs were asked for."""
        prompt_ids = list(res.prompt_token_ids or [])
        prompt_text = res.prompt
        if prompt_text is None:  # the prompt came as token ids
            tokenizer = self.engine_client.tokenizer
            prompt_text = tokenizer.decode(prompt_ids) if tokenizer is not None else ""
        # -inf becomes -9999.0 in _create_completion_logprobs.
        prompt_positions = res.prompt_logprobs
        if request.max_tokens == 0:
            return prompt_text, prompt_ids, prompt_positions
        positions = None
        if prompt_positions is not None and output.logprobs is not None:
            positions = [*prompt_positions, *output.logprobs]
        return prompt_text + output.text, [*prompt_ids, *output.token_ids], positions

    def _create_completion_logprobs(
        self,
        token_ids: Sequence[int],
        positions: Sequence[dict[int, Logprob] | None],
        initial_text_offset: int,
    ) -> CompletionLogProbs:
        """OpenAI's legacy logprobs: per token its text, logprob, the top
        alternatives and where it starts in the choice's text. An echoed
        prompt's first token has no logprob (null, like its top alternatives)."""
        tokens: list[str] = []
        token_logprobs: list[float | None] = []
        top_logprobs: list[dict[str, float] | None] = []
        text_offset: list[int] = []
        offset = initial_text_offset
        tokenizer = self.engine_client.tokenizer
        for token_id, position in zip(token_ids, positions):
            entry = position.get(token_id) if position is not None else None
            if entry is not None:
                token = logprob_token(entry, token_id)
            elif tokenizer is not None:
                token = tokenizer.decode([token_id])
            else:
                token = f"token_id:{token_id}"
            tokens.append(token)
            token_logprobs.append(max(entry.logprob, -9999.0) if entry is not None else None)
            top_logprobs.append(
                None
                if position is None
                else {logprob_token(lp, t): max(lp.logprob, -9999.0) for t, lp in position.items()}
            )
            text_offset.append(offset)
            offset += len(token)
        # Passed explicitly: streamed chunks are dumped with exclude_unset.
        return CompletionLogProbs(
            text_offset=text_offset,
            token_logprobs=token_logprobs,
            tokens=tokens,
            top_logprobs=top_logprobs,
        )


def _normalize_prompts(prompt: Any) -> list[Any]:
    """str | [str] | [int] | [[int]] -> a list of prompts ``generate`` takes."""
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise GlassboxValidationError("prompt must not be empty", "prompt")
    if all(isinstance(p, int) for p in prompt):
        return [{"prompt_token_ids": list(prompt)}]
    if all(isinstance(p, str) for p in prompt):
        return list(prompt)
    return [{"prompt_token_ids": list(p)} for p in prompt]


def _salted(prompt: dict, cache_salt: str | None) -> dict:
    return prompt if cache_salt is None else {**prompt, "cache_salt": cache_salt}
