"""What ``LLM.generate`` and ``AsyncLLM.generate`` hand back to the user.

vLLM twin: ``vllm/outputs.py``.
Read it for: the user-facing result objects -- one ``RequestOutput`` per
request, holding one ``CompletionOutput`` per sample (``n`` of them) -- and
``RequestOutput.add``, which merges outputs that piled up before the caller
read them (concatenate for DELTA streaming, replace for CUMULATIVE).
Sessions: 01 (engine loop: the output processor builds these).

``RequestOutput.request_id`` is the id the *user* gave (vLLM's
``external_req_id``); the engine core knows the request by an internal id
with a random suffix (see ``InputProcessor.assign_request_id``).

Simpler than vLLM: generation only. The pooling/embedding/classification/score
outputs are left out because Glassbox serves decoder-only text generation; the
fields of features Glassbox does not have (``encoder_prompt``,
``routed_experts``, ``kv_transfer_params``) exist with vLLM's names so vLLM's
calls run, and are always None. ``RequestOutput.lora_request`` is the
request's adapter (None: the base model). As in vLLM, an unknown
keyword to ``RequestOutput`` is logged once and ignored (forward
compatibility), not an error.

Differs from vLLM on purpose: ``RequestOutput.add`` refuses to merge outputs
of two different requests (vLLM merges silently), and ``RequestOutput``
compares by value, so tests can compare whole outputs.
"""

from __future__ import annotations

import logging
from collections.abc import MutableSequence, Sequence
from dataclasses import dataclass
from typing import Any

from engine.logprobs import PromptLogprobs, SampleLogprobs

logger = logging.getLogger(__name__)

# Unknown RequestOutput keywords already warned about (vLLM: warning_once).
_warned_extra_kwargs: set[str] = set()


@dataclass
class CompletionOutput:
    """One of the ``n`` samples of a request.

    ``finish_reason`` is None while the sample is still being generated, then
    one of "stop" (EOS, a stop token or a stop string), "length" (hit
    max_tokens or max_model_len) or "abort" (cancelled); vLLM also reports
    "error" and "repetition". ``stop_reason`` is the stop string or stop token
    id that ended it, or None (including when the model's own EOS ended it).
    ``routed_experts`` and ``lora_request`` are always None in Glassbox (no
    MoE expert capture; the adapter is on the ``RequestOutput``, as in vLLM V1).
    """

    index: int
    text: str
    token_ids: Sequence[int]
    cumulative_logprob: float | None
    logprobs: SampleLogprobs | None
    routed_experts: Any | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    lora_request: Any | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None

    def __repr__(self) -> str:
        return (
            f"CompletionOutput(index={self.index}, text={self.text!r}, "
            f"token_ids={list(self.token_ids)}, "
            f"cumulative_logprob={self.cumulative_logprob}, "
            f"logprobs={self.logprobs}, finish_reason={self.finish_reason}, "
            f"stop_reason={self.stop_reason!r})"
        )


class RequestOutput:
    """Everything the engine has to say about one request at one moment.

    ``outputs`` holds one ``CompletionOutput`` per sample that has produced
    something so far (for ``n > 1`` they arrive independently and are matched
    by ``index``). ``finished`` is True once the whole request is done.
    ``request_id`` is the id the caller passed to ``generate`` /
    ``add_request``. ``metrics`` is the request's timing stats when the
    engine keeps them, else None. ``num_cached_tokens`` is how many prompt
    tokens were served from the prefix cache.
    """

    def __init__(
        self,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int] | None,
        prompt_logprobs: PromptLogprobs | None,
        outputs: list[CompletionOutput],
        finished: bool,
        metrics: Any | None = None,
        lora_request: Any | None = None,
        encoder_prompt: str | None = None,
        encoder_prompt_token_ids: list[int] | None = None,
        num_cached_tokens: int | None = None,
        *,
        kv_transfer_params: dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> None:
        if kwargs:
            # Code written for a newer engine may pass fields this one lacks.
            key = str(sorted(kwargs))
            if key not in _warned_extra_kwargs:
                _warned_extra_kwargs.add(key)
                logger.warning("RequestOutput: Ignoring extra arguments: %s", kwargs)
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_token_ids = prompt_token_ids
        self.prompt_logprobs = prompt_logprobs
        self.outputs = outputs
        self.finished = finished
        self.metrics = metrics
        self.lora_request = lora_request
        self.encoder_prompt = encoder_prompt
        self.encoder_prompt_token_ids = encoder_prompt_token_ids
        self.num_cached_tokens = num_cached_tokens
        self.kv_transfer_params = kv_transfer_params

    def add(self, next_output: RequestOutput, aggregate: bool) -> None:
        """Fold a newer output for the same request into this one.

        Used when the engine produced several outputs before the consumer
        picked the previous one up. With ``aggregate=True`` (DELTA streaming)
        each sample's new text, tokens and logprobs are appended to what is
        already here; with ``aggregate=False`` (CUMULATIVE) the newer sample
        simply replaces the older one, since it already contains everything.
        A sample index not seen before is appended.
        """
        if next_output.request_id != self.request_id:
            raise ValueError(
                f"cannot merge outputs of different requests: request_id "
                f"{next_output.request_id!r} into {self.request_id!r}"
            )
        self.finished = self.finished or next_output.finished
        self.kv_transfer_params = next_output.kv_transfer_params

        position_of_index = {c.index: pos for pos, c in enumerate(self.outputs)}
        for newer in next_output.outputs:
            pos = position_of_index.get(newer.index)
            if pos is None:
                position_of_index[newer.index] = len(self.outputs)
                self.outputs.append(newer)
                continue
            if not aggregate:
                self.outputs[pos] = newer
                continue
            older = self.outputs[pos]
            older.text += newer.text
            if not isinstance(older.token_ids, MutableSequence):
                older.token_ids = list(older.token_ids)
            older.token_ids.extend(newer.token_ids)
            if newer.logprobs:
                if older.logprobs is None:
                    older.logprobs = []
                older.logprobs.extend(newer.logprobs)
            # These describe the sample as a whole, so the newest value wins.
            older.cumulative_logprob = newer.cumulative_logprob
            older.finish_reason = newer.finish_reason
            older.stop_reason = newer.stop_reason

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, RequestOutput):
            return NotImplemented
        return vars(self) == vars(other)

    def __repr__(self) -> str:
        return (
            f"RequestOutput(request_id={self.request_id}, "
            f"prompt={self.prompt!r}, "
            f"prompt_token_ids={self.prompt_token_ids}, "
            f"prompt_logprobs={self.prompt_logprobs}, "
            f"outputs={self.outputs}, "
            f"finished={self.finished}, "
            f"metrics={self.metrics}, "
            f"num_cached_tokens={self.num_cached_tokens})"
        )
