"""Prompt + parameters -> ``EngineCoreRequest``, checked before they reach the core.

vLLM twin: ``vllm/v1/engine/input_processor.py`` (``InputProcessor.process_inputs``).
Read it for what is settled in the front end so EngineCore never has to:
tokenizing text prompts, rejecting prompts the model cannot hold, filling in
``max_tokens`` when the user left it open, and telling the sampling
parameters which tokens mean end-of-sequence.
``assign_request_id`` gives each request the internal id the core will know
it by: the user's id plus 8 random hex characters, with the user's id kept in
``external_req_id``. Users may reuse an id (even while the first request with
it is running), and no id a user picks can equal the id of someone else's
request or of an ``n > 1`` child (``"{index}_{internal id}"``).
Sessions: 01 (engine loop).

Simpler than vLLM: text and token-id prompts only (no multimodal data,
embeddings or encoder-decoder prompts), no LoRA. Structured outputs are
refused with speculative decoding under async scheduling (vLLM supports the
pair: Glassbox's async drafts never reach the host, where the grammar is).

Differs from vLLM on purpose: ``process_inputs`` returns the prompt text with
the request (vLLM returns the request and reads the text off the prompt in
the caller), since tokenizing here already took the text apart.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Mapping
from typing import Any

from engine.config import GlassboxConfig
from engine.lora.peft_helper import check_lora_adapter
from engine.lora.request import LoRARequest
from engine.sampling_params import _SAMPLING_EPS, SamplingParams
from engine.v1.engine import EngineCoreRequest
from engine.v1.sample.logits_processor import validate_logits_processors_parameters

# What a prompt may be: text, {"prompt": text}, or {"prompt_token_ids": [...]}.
PromptType = str | Mapping[str, Any]


class InputProcessor:
    def __init__(self, glassbox_config: GlassboxConfig, tokenizer: Any | None) -> None:
        self.glassbox_config = glassbox_config
        self.model_config = glassbox_config.model_config
        self.tokenizer = tokenizer
        self.generation_config = self.model_config.try_get_generation_config()

    @staticmethod
    def assign_request_id(request: EngineCoreRequest) -> None:
        """Move the user's id to ``external_req_id`` and give the request a
        unique internal ``request_id``."""
        if request.external_req_id is not None:
            raise ValueError(
                "The external_req_id field should not be set on EngineCoreRequests"
                " passed to Glassbox; use the request_id field."
            )
        request.external_req_id = request.request_id
        request.request_id = f"{request.external_req_id}-{uuid.uuid4().hex[:8]}"

    def get_eos_token_id(self) -> int | None:
        if self.tokenizer is None:
            return None
        return getattr(self.tokenizer, "eos_token_id", None)

    def _tokenize(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            text = prompt
        elif isinstance(prompt, Mapping) and "prompt_token_ids" in prompt:
            token_ids = prompt["prompt_token_ids"]
            if not isinstance(token_ids, (list, tuple)) or not all(
                isinstance(t, int) and not isinstance(t, bool) for t in token_ids
            ):
                raise ValueError("prompt_token_ids must be a list of integers")
            return prompt.get("prompt"), list(token_ids)
        elif isinstance(prompt, Mapping) and "prompt" in prompt:
            text = prompt["prompt"]
            if not isinstance(text, str):
                raise ValueError(f"prompt must be a string, got {type(text).__name__}")
        else:
            raise ValueError(
                "a prompt must be a string, {'prompt': str} or {'prompt_token_ids': [int, ...]}, "
                f"got {type(prompt).__name__}"
            )
        if self.tokenizer is None:
            raise ValueError(
                "a text prompt needs a tokenizer, but skip_tokenizer_init=True; "
                "pass {'prompt_token_ids': [...]} instead"
            )
        return text, list(self.tokenizer.encode(text))

    def _validate_prompt(self, token_ids: list[int]) -> None:
        max_model_len = self.model_config.max_model_len
        assert max_model_len is not None
        if not token_ids:
            raise ValueError("the prompt is empty (0 tokens); at least one token is required")
        if len(token_ids) >= max_model_len:
            raise ValueError(
                f"the prompt (length {len(token_ids)}) does not fit max_model_len="
                f"{max_model_len}: at least one position must be left to generate into"
            )
        vocab_size = self.model_config.vocab_size
        if vocab_size:
            bad = [t for t in token_ids if not 0 <= t < vocab_size]
            if bad:
                raise ValueError(
                    f"prompt token id {bad[0]} is out of vocabulary (vocab_size={vocab_size})"
                )

    def _validate_logprobs(self, params: SamplingParams) -> None:
        """vLLM's ``SamplingParams._validate_logprobs``: at most ``max_logprobs``
        per token, sampled or prompt, -1 (the whole vocabulary) counted as the
        vocabulary size."""
        vocab_size = self.model_config.vocab_size
        max_logprobs = self.model_config.max_logprobs
        if max_logprobs == -1:
            return
        for kind, asked in (("sample", params.logprobs), ("prompt", params.prompt_logprobs)):
            num_logprobs = vocab_size if asked == -1 else asked
            if num_logprobs is not None and num_logprobs > max_logprobs:
                raise ValueError(
                    f"Requested {kind} logprobs of {num_logprobs}, which is greater than "
                    f"max allowed: {max_logprobs} (raise max_logprobs, -1 for no limit)"
                )

    def _validate_structured_outputs(self, params: SamplingParams) -> None:
        config = self.glassbox_config
        if self.tokenizer is None:
            raise ValueError("structured_outputs needs a tokenizer, but skip_tokenizer_init=True")
        if config.speculative_config is not None and config.scheduler_config.async_scheduling:
            # vLLM supports this (drafts copied to the host, sampling deferred);
            # Glassbox's async drafts stay on the device, so not yet.
            raise ValueError(
                "structured_outputs with speculative decoding needs async scheduling off in "
                "Glassbox (async_scheduling=False / --no-async-scheduling)"
            )
        params._validate_structured_outputs(config.structured_outputs_config)

    def process_inputs(
        self,
        request_id: str,
        prompt: PromptType,
        params: SamplingParams,
        arrival_time: float | None = None,
        priority: int = 0,
        lora_request: LoRARequest | None = None,
    ) -> tuple[str | None, EngineCoreRequest]:
        """Returns the prompt text (if any) and the request for EngineCore,
        still under the user's ``request_id`` (see ``assign_request_id``)."""
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params must be SamplingParams, got {type(params).__name__}")
        if not isinstance(priority, int) or isinstance(priority, bool):
            raise ValueError(f"priority must be an integer, got {priority!r}")
        if priority != 0 and self.glassbox_config.scheduler_config.policy != "priority":
            raise ValueError(
                f"priority={priority} was given but scheduling_policy is "
                f"{self.glassbox_config.scheduler_config.policy!r}; "
                "use scheduling_policy='priority'"
            )
        if params.prompt_logprobs is not None and not params.skip_reading_prefix_cache:
            # Cached prompt tokens are not run, so they would have no logits.
            raise ValueError(
                "prompt_logprobs needs skip_reading_prefix_cache=True (its default when "
                "prompt_logprobs is set): cached prompt tokens get no logits"
            )
        if self.glassbox_config.speculative_config is not None and (
            params.min_p > _SAMPLING_EPS or params.logit_bias
        ):
            # As vLLM: the rejection sampler does not apply them to the drafts.
            raise ValueError(
                "min_p and logit_bias are not supported with speculative decoding; leave them unset"
            )
        self._validate_logprobs(params)
        self._validate_lora_request(lora_request)
        prompt_text, token_ids = self._tokenize(prompt)
        self._validate_prompt(token_ids)

        params = params.clone()
        max_model_len = self.model_config.max_model_len
        assert max_model_len is not None
        room = max_model_len - len(token_ids)
        if params.max_tokens is None:
            params.max_tokens = room
        if params.min_tokens > room:
            # The request could never reach min_tokens, so it could never stop.
            raise ValueError(
                f"min_tokens={params.min_tokens} is more than the {room} tokens left after the "
                f"{len(token_ids)}-token prompt in max_model_len={max_model_len}"
            )
        validate_logits_processors_parameters(self.model_config.logits_processors, params)
        if params.structured_outputs is not None:
            self._validate_structured_outputs(params)
        params.update_from_generation_config(self.generation_config, self.get_eos_token_id())
        if self.tokenizer is not None:
            params.update_from_tokenizer(self.tokenizer)
        return prompt_text, EngineCoreRequest(
            request_id=request_id,
            prompt_token_ids=token_ids,
            sampling_params=params,
            arrival_time=arrival_time if arrival_time is not None else time.time(),
            priority=priority,
            lora_request=lora_request,
            cache_salt=self._cache_salt(prompt),
        )

    @staticmethod
    def _cache_salt(prompt: PromptType) -> str | None:
        """A dict prompt's ``cache_salt``: mixed into its first block's hash, so
        only requests with the same salt share cached blocks (vLLM's field)."""
        salt = prompt.get("cache_salt") if isinstance(prompt, dict) else None
        if salt is not None and (not isinstance(salt, str) or not salt):
            raise ValueError(f"cache_salt must be a non-empty string, got {salt!r}")
        return salt

    def _validate_lora_request(self, lora_request: LoRARequest | None) -> None:
        """The adapter must be usable before the request enters the engine:
        LoRA on, its folder a PEFT LoRA of a supported module and rank."""
        if lora_request is None:
            return
        if not isinstance(lora_request, LoRARequest):
            raise ValueError(
                f"lora_request must be a LoRARequest, got {type(lora_request).__name__}"
            )
        lora_config = self.glassbox_config.lora_config
        if lora_config is None:
            raise ValueError(
                f"lora_request={lora_request.lora_name!r}: LoRA is not enabled (enable_lora=True)"
            )
        try:
            check_lora_adapter(lora_request.lora_path, lora_config.max_lora_rank)
        except ValueError as e:
            raise ValueError(f"lora_request {lora_request.lora_name!r}: {e}") from None
