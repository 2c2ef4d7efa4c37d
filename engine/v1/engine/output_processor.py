"""EngineCoreOutputs -> RequestOutput, in the front end.

vLLM twin: ``vllm/v1/engine/output_processor.py`` (``OutputProcessor``,
``RequestState``).
Read it for: EngineCore only sends token-id deltas. Everything a user sees --
text, stop strings, logprob dicts, ``n``-sample grouping, streaming kind
(CUMULATIVE / DELTA / FINAL_ONLY) -- is built here, per request, in a
``RequestState``. A stop string found here means the core must abort the
request: those ids come back in ``OutputProcessorOutput.reqs_to_abort``.
Sessions: 01 (engine loop).

Simpler than vLLM: no prompt logprobs, pooling outputs, LoRA or per-request
timing histograms.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from engine.logprobs import Logprob, SampleLogprobs
from engine.outputs import CompletionOutput, RequestOutput
from engine.sampling_params import RequestOutputKind
from engine.tracing.engine_trace import OutputProcessorTrace
from engine.v1.engine import EngineCoreOutput, EngineCoreRequest, FinishReason
from engine.v1.engine.detokenizer import IncrementalDetokenizer
from engine.v1.engine.parallel_sampling import ParentRequest


@dataclass
class RequestState:
    request_id: str
    parent_req: ParentRequest | None
    request_index: int
    prompt: str | None
    prompt_token_ids: list[int]
    output_kind: RequestOutputKind
    detokenizer: IncrementalDetokenizer
    tokenizer: Any | None
    want_logprobs: bool
    logprobs: SampleLogprobs = field(default_factory=list)
    cumulative_logprob: float | None = None
    num_cached_tokens: int = 0
    arrival_time: float = 0.0
    first_token_time: float | None = None
    # DELTA streaming bookkeeping: tokens in the latest update, logprob
    # positions already sent.
    _new_tokens: int = 0
    _sent_logprobs: int = 0

    @classmethod
    def from_new_request(
        cls,
        tokenizer: Any | None,
        request: EngineCoreRequest,
        prompt: str | None,
        parent_req: ParentRequest | None,
        request_index: int,
    ) -> RequestState:
        params = request.sampling_params
        return cls(
            request_id=request.request_id,
            parent_req=parent_req,
            request_index=request_index,
            prompt=prompt,
            prompt_token_ids=list(request.prompt_token_ids),
            output_kind=params.output_kind,
            detokenizer=IncrementalDetokenizer(tokenizer, request.prompt_token_ids, params),
            tokenizer=tokenizer if params.detokenize else None,
            want_logprobs=params.logprobs is not None,
            cumulative_logprob=0.0 if params.logprobs is not None else None,
            arrival_time=request.arrival_time,
        )

    def _update_logprobs(self, output: EngineCoreOutput, num_kept: int) -> None:
        rows = output.new_logprobs
        if not self.want_logprobs or rows is None:
            return
        for r in range(min(num_kept, len(rows.logprob_token_ids))):
            ids, lps, rank = (
                rows.logprob_token_ids[r],
                rows.logprobs[r],
                rows.sampled_token_ranks[r],
            )
            position: dict[int, Logprob] = {}
            # Row layout: sampled token first, then top-1..top-k.
            for j, (token_id, lp) in enumerate(zip(ids, lps)):
                if token_id in position:
                    continue
                decoded = self.tokenizer.decode([token_id]) if self.tokenizer is not None else None
                position[token_id] = Logprob(lp, rank if j == 0 else j, decoded)
            self.logprobs.append(position)
            assert self.cumulative_logprob is not None
            self.cumulative_logprob += lps[0]

    def make_completion_output(
        self, finish_reason, stop_reason, finished: bool
    ) -> CompletionOutput:
        delta = self.output_kind == RequestOutputKind.DELTA
        token_ids = self.detokenizer.token_ids
        logprobs = self.logprobs if self.want_logprobs else None
        if delta:
            token_ids = token_ids[len(token_ids) - self._new_tokens :]
            if logprobs is not None:
                logprobs = logprobs[self._sent_logprobs :]
                self._sent_logprobs = len(self.logprobs)
        return CompletionOutput(
            index=self.request_index,
            text=self.detokenizer.get_next_output_text(finished, delta),
            token_ids=list(token_ids),
            cumulative_logprob=self.cumulative_logprob,
            logprobs=logprobs,
            finish_reason=str(finish_reason) if finish_reason is not None else None,
            stop_reason=stop_reason,
        )


@dataclass
class OutputProcessorOutput:
    request_outputs: list[RequestOutput]
    reqs_to_abort: list[str]
    # For metrics: prompt tokens of requests that got their first token in
    # this batch, and tokens generated in it.
    num_prompt_tokens: int = 0
    num_generation_tokens: int = 0


class OutputProcessor:
    def __init__(
        self, tokenizer: Any | None, trace: OutputProcessorTrace = OutputProcessorTrace.NULL
    ) -> None:
        self.tokenizer = tokenizer
        self.trace = trace
        self.request_states: dict[str, RequestState] = {}
        self.parent_requests: dict[str, ParentRequest] = {}

    def get_num_unfinished_requests(self) -> int:
        return len(self.request_states)

    def has_unfinished_requests(self) -> bool:
        return bool(self.request_states)

    def add_request(
        self,
        request: EngineCoreRequest,
        prompt: str | None,
        parent_req: ParentRequest | None = None,
        request_index: int = 0,
    ) -> None:
        if request.request_id in self.request_states:
            raise ValueError(f"request_id {request.request_id!r} is already in use")
        self.request_states[request.request_id] = RequestState.from_new_request(
            self.tokenizer, request, prompt, parent_req, request_index
        )
        self.trace.added(request, prompt, parent_req, request_index)
        if parent_req is not None:
            self.parent_requests[parent_req.request_id] = parent_req

    def abort_requests(self, request_ids: list[str]) -> list[str]:
        """Forget requests (parent ids expand to their children). Returns the
        child/plain ids that EngineCore must abort."""
        to_abort: list[str] = []
        for req_id in request_ids:
            parent = self.parent_requests.pop(req_id, None)
            ids = sorted(parent.child_requests) if parent else [req_id]
            for rid in ids:
                if self.request_states.pop(rid, None) is not None:
                    to_abort.append(rid)
                    self.trace.aborted(rid)
        return to_abort

    def process_outputs(self, engine_core_outputs: list[EngineCoreOutput]) -> OutputProcessorOutput:
        request_outputs: list[RequestOutput] = []
        reqs_to_abort: list[str] = []
        num_prompt_tokens = num_generation_tokens = 0
        now = time.monotonic()
        for output in engine_core_outputs:
            state = self.request_states.get(output.request_id)
            if state is None:
                continue  # aborted in the front end while the step ran
            if state.first_token_time is None and output.new_token_ids:
                state.first_token_time = now
                num_prompt_tokens += len(state.prompt_token_ids)
            num_generation_tokens += len(output.new_token_ids)
            state.num_cached_tokens = output.num_cached_tokens
            finish_reason = output.finish_reason
            stop_reason = output.stop_reason
            stop_terminated = finish_reason == FinishReason.STOP
            new_ids = list(output.new_token_ids)
            stop_str = state.detokenizer.update(new_ids, stop_terminated)
            state._new_tokens = len(new_ids)
            state._update_logprobs(output, len(new_ids))
            if stop_str is not None:
                # The stop string wins even if the core also finished this
                # step (length, EOS); only a still-running request needs an abort.
                if finish_reason is None:
                    reqs_to_abort.append(output.request_id)
                finish_reason, stop_reason = FinishReason.STOP, stop_str
            finished = finish_reason is not None
            self.trace.output(state, new_ids, finished)

            request_output = self._make_request_output(state, finish_reason, stop_reason, finished)
            if request_output is not None:
                request_outputs.append(request_output)
            if finished:
                self.trace.finished(state, finish_reason, stop_reason, stop_str)
                self._finish_request(state)
        return OutputProcessorOutput(
            request_outputs, reqs_to_abort, num_prompt_tokens, num_generation_tokens
        )

    def _make_request_output(
        self, state: RequestState, finish_reason, stop_reason, finished: bool
    ) -> RequestOutput | None:
        if state.output_kind == RequestOutputKind.FINAL_ONLY and not finished:
            return None
        completion = state.make_completion_output(finish_reason, stop_reason, finished)
        parent = state.parent_req
        if parent is None:
            return RequestOutput(
                request_id=state.request_id,
                prompt=state.prompt,
                prompt_token_ids=state.prompt_token_ids,
                prompt_logprobs=None,
                outputs=[completion],
                finished=finished,
                num_cached_tokens=state.num_cached_tokens,
            )
        # A child of an n > 1 request: report under the parent's id.
        if state.output_kind == RequestOutputKind.FINAL_ONLY:
            parent.completions[completion.index] = completion
            if len(parent.completions) < parent.n:
                return None
            outputs = [parent.completions[i] for i in sorted(parent.completions)]
            all_finished = True
        else:
            outputs = [completion]
            if finished:
                parent.completions[completion.index] = completion
            all_finished = len(parent.completions) == parent.n
        return RequestOutput(
            request_id=parent.request_id,
            prompt=state.prompt,
            prompt_token_ids=state.prompt_token_ids,
            prompt_logprobs=None,
            outputs=outputs,
            finished=all_finished,
            num_cached_tokens=state.num_cached_tokens,
        )

    def _finish_request(self, state: RequestState) -> None:
        self.request_states.pop(state.request_id, None)
        parent = state.parent_req
        if parent is not None:
            parent.child_requests.discard(state.request_id)
            if not parent.child_requests:
                self.parent_requests.pop(parent.request_id, None)
