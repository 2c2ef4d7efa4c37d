"""EngineCoreOutputs -> RequestOutput, in the front end.

vLLM twin: ``vllm/v1/engine/output_processor.py`` (``OutputProcessor``,
``RequestState``, ``RequestOutputCollector``).
Read it for: EngineCore only sends token-id deltas. Everything a user sees --
text, stop strings, logprob dicts, ``n``-sample grouping, streaming kind
(CUMULATIVE / DELTA / FINAL_ONLY) -- is built here, per request, in a
``RequestState``. A stop string found here means the core must abort the
request: those ids come back in ``OutputProcessorOutput.reqs_to_abort``.

Ids: states are keyed by the internal request id (the core's). Outputs carry
the user's id (``external_req_id``), and ``external_req_ids`` maps each user
id to its internal ids, so ``abort_requests(ids, internal=False)`` can abort
by the id the user knows -- every request sent under it, all children of an
``n > 1`` request included.

Where outputs go: a request added with a ``RequestOutputCollector`` (AsyncLLM)
gets its outputs put there; one added without (LLMEngine) has them returned
in ``OutputProcessorOutput.request_outputs``. ``stream_interval`` N > 1 sends a
DELTA request's output only every N tokens (and for its first token and when
it finishes); the tokens in between travel together in the next output.
Sessions: 01 (engine loop).

Simpler than vLLM: no pooling outputs, streaming
inputs, routed experts or per-request timing stats; the metrics are two
token counts per batch (``num_prompt_tokens``, ``num_generation_tokens``).
Glassbox's trace object stands where vLLM's ``tracing_enabled`` (OpenTelemetry
spans) is.

Differs from vLLM on purpose: adding a second request under an internal id
that is still in use is an error (vLLM treats it as more input for a
streaming request, which Glassbox does not have); aborting a child of an
``n > 1`` request also forgets its parent once no child is left (vLLM keeps
the parent after an abort by the user's id); a DELTA output without new
tokens (an abort) carries no logprobs (vLLM's slice resends them all); a
CUMULATIVE output holds copies of the token and logprob lists, so an output
already handed out never changes (vLLM hands out the growing lists).
"""

from __future__ import annotations

import asyncio
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from engine.outputs import CompletionOutput, RequestOutput
from engine.sampling_params import RequestOutputKind
from engine.tracing.engine_trace import OutputProcessorTrace
from engine.v1.engine import EngineCoreOutput, EngineCoreRequest, FinishReason
from engine.v1.engine.detokenizer import IncrementalDetokenizer
from engine.v1.engine.logprobs import LogprobsProcessor
from engine.v1.engine.parallel_sampling import ParentRequest


class RequestOutputCollector:
    """Hand-off point between the output handler (producer) and one
    ``generate()`` (consumer). Holds one output; newer DELTA outputs are
    merged into it, newer CUMULATIVE/FINAL_ONLY ones replace it, so a slow
    consumer never makes the producer wait."""

    def __init__(self, output_kind: RequestOutputKind, request_id: str) -> None:
        self.aggregate = output_kind == RequestOutputKind.DELTA
        # The internal id: what generate() aborts when its consumer goes away.
        self.request_id = request_id
        self.output: RequestOutput | Exception | None = None
        self.ready = asyncio.Event()

    def put(self, output: RequestOutput | Exception) -> None:
        if self.output is None or isinstance(output, Exception):
            self.output = output
            self.ready.set()
        elif isinstance(self.output, RequestOutput):
            # Merged by sample index, so the samples of n > 1 stay apart.
            self.output.add(output, aggregate=self.aggregate)

    async def get(self) -> RequestOutput:
        while (output := self.output) is None:
            await self.ready.wait()
        self.output = None
        self.ready.clear()
        if isinstance(output, Exception):
            raise output
        return output

    def get_nowait(self) -> RequestOutput | None:
        output = self.output
        if output is not None:
            self.output = None
            self.ready.clear()
        if isinstance(output, Exception):
            raise output
        return output


@dataclass
class OutputProcessorOutput:
    request_outputs: list[RequestOutput]
    reqs_to_abort: list[str]
    # For metrics (when log_stats): prompt tokens of requests that got their
    # first token in this batch, and tokens generated in it.
    num_prompt_tokens: int = 0
    num_generation_tokens: int = 0


class RequestState:
    """Front-end state of one request (one child, for ``n > 1``)."""

    def __init__(
        self,
        request_id: str,
        external_req_id: str,
        parent_req: ParentRequest | None,
        request_index: int,
        output_kind: RequestOutputKind,
        prompt: str | None,
        prompt_token_ids: list[int],
        logprobs_processor: LogprobsProcessor,
        detokenizer: IncrementalDetokenizer,
        max_tokens_param: int | None,
        arrival_time: float,
        queue: RequestOutputCollector | None,
        stream_interval: int,
        top_p: float | None = None,
        n: int | None = None,
        temperature: float | None = None,
        lora_request: Any | None = None,
    ) -> None:
        self.request_id = request_id
        self.lora_request = lora_request  # echoed in every RequestOutput
        self.external_req_id = external_req_id
        self.parent_req = parent_req
        self.request_index = request_index
        self.output_kind = output_kind
        self.prompt = prompt
        self.prompt_token_ids = prompt_token_ids
        self.prompt_len = len(prompt_token_ids)
        self.logprobs_processor = logprobs_processor
        self.detokenizer = detokenizer
        self.max_tokens_param = max_tokens_param
        self.top_p = top_p
        self.n = n
        self.temperature = temperature
        self.arrival_time = arrival_time
        self.queue = queue
        # Until the first token arrives (then the prompt counts as processed).
        self.is_prefilling = True
        self.num_cached_tokens = 0
        self.stream_interval = stream_interval
        # Output tokens already sent (DELTA with stream_interval > 1).
        self.sent_tokens_offset = 0

    @classmethod
    def from_new_request(
        cls,
        tokenizer: Any | None,
        request: EngineCoreRequest,
        prompt: str | None,
        parent_req: ParentRequest | None,
        request_index: int,
        queue: RequestOutputCollector | None,
        stream_interval: int,
    ) -> RequestState:
        params = request.sampling_params
        if not params.detokenize:
            tokenizer = None
        assert request.external_req_id is not None, "call assign_request_id first"
        return cls(
            request_id=request.request_id,
            external_req_id=request.external_req_id,
            parent_req=parent_req,
            request_index=request_index,
            output_kind=params.output_kind,
            prompt=prompt,
            prompt_token_ids=list(request.prompt_token_ids),
            lora_request=request.lora_request,
            logprobs_processor=LogprobsProcessor.from_new_request(tokenizer, request),
            detokenizer=IncrementalDetokenizer.from_new_request(tokenizer, request),
            max_tokens_param=params.max_tokens,
            arrival_time=request.arrival_time,
            queue=queue,
            stream_interval=stream_interval,
            top_p=params.top_p,
            n=params.n,
            temperature=params.temperature,
        )

    def make_request_output(
        self,
        new_token_ids: list[int],
        finish_reason: FinishReason | None,
        stop_reason: int | str | None,
    ) -> RequestOutput | None:
        """The output to send for this update, or None when nothing goes out
        now (FINAL_ONLY before the end, a stream interval not reached yet, an
        ``n > 1`` request still waiting for its other samples)."""
        finished = finish_reason is not None
        if not finished and self.output_kind == RequestOutputKind.FINAL_ONLY:
            return None
        if self.stream_interval > 1:
            num_output_tokens = self.detokenizer.num_output_tokens()
            if not (
                finished
                or self.sent_tokens_offset == 0
                or num_output_tokens - self.sent_tokens_offset >= self.stream_interval
            ):
                return None
            if self.output_kind == RequestOutputKind.DELTA:
                # Everything held back since the last output goes now.
                new_token_ids = self.detokenizer.output_token_ids[self.sent_tokens_offset :]
                self.sent_tokens_offset = num_output_tokens

        completion = self._new_completion_output(new_token_ids, finish_reason, stop_reason)
        external_req_id = self.external_req_id
        if self.parent_req is None:
            outputs = [completion]
        else:
            outputs, finished = self.parent_req.get_outputs(self.request_id, completion)
            if not outputs:
                return None
            external_req_id = self.parent_req.external_req_id
        return self._new_request_output(external_req_id, outputs, finished)

    def _new_request_output(
        self, external_req_id: str, outputs: list[CompletionOutput], finished: bool
    ) -> RequestOutput:
        if self.output_kind == RequestOutputKind.DELTA:
            # Prompt logprobs go out once, with the first output.
            prompt_logprobs = self.logprobs_processor.pop_prompt_logprobs()
        else:
            prompt_logprobs = self.logprobs_processor.prompt_logprobs
        return RequestOutput(
            request_id=external_req_id,
            prompt=self.prompt,
            prompt_token_ids=self.prompt_token_ids,
            prompt_logprobs=prompt_logprobs,
            outputs=outputs,
            finished=finished,
            num_cached_tokens=self.num_cached_tokens,
            lora_request=self.lora_request,
        )

    def _new_completion_output(
        self,
        token_ids: list[int],
        finish_reason: FinishReason | None,
        stop_reason: int | str | None,
    ) -> CompletionOutput:
        finished = finish_reason is not None
        delta = self.output_kind == RequestOutputKind.DELTA
        text = self.detokenizer.get_next_output_text(finished, delta)
        if not delta:
            token_ids = self.detokenizer.output_token_ids
        logprobs = self.logprobs_processor.logprobs
        if logprobs is not None:
            # One position per token: in DELTA the last len(token_ids) are the
            # new ones. A copy either way, so a sent output never changes.
            logprobs = logprobs[len(logprobs) - len(token_ids) :] if delta else list(logprobs)
        return CompletionOutput(
            index=self.request_index,
            text=text,
            token_ids=list(token_ids),
            cumulative_logprob=self.logprobs_processor.cumulative_logprob,
            logprobs=logprobs,
            finish_reason=str(finish_reason) if finished else None,
            stop_reason=stop_reason if finished else None,
        )


class OutputProcessor:
    """Turns each batch of ``EngineCoreOutput`` into ``RequestOutput``s."""

    def __init__(
        self,
        tokenizer: Any | None,
        *,
        log_stats: bool,
        stream_interval: int = 1,
        trace: OutputProcessorTrace = OutputProcessorTrace.NULL,
    ) -> None:
        if not isinstance(stream_interval, int) or stream_interval < 1:
            raise ValueError(f"stream_interval must be an integer >= 1, got {stream_interval!r}")
        self.tokenizer = tokenizer
        self.log_stats = log_stats
        self.stream_interval = stream_interval
        self.trace = trace
        # internal request id -> state.
        self.request_states: dict[str, RequestState] = {}
        # internal id of an n > 1 request -> its ParentRequest.
        self.parent_requests: dict[str, ParentRequest] = {}
        # the user's id -> internal ids of the states added under it.
        self.external_req_ids: defaultdict[str, list[str]] = defaultdict(list)

    def get_num_unfinished_requests(self) -> int:
        return len(self.request_states)

    def has_unfinished_requests(self) -> bool:
        return len(self.request_states) > 0

    def propagate_error(self, e: Exception) -> None:
        """Hand ``e`` to every waiting ``generate()`` (the engine failed)."""
        for state in self.request_states.values():
            if state.queue is not None:
                state.queue.put(e)

    def add_request(
        self,
        request: EngineCoreRequest,
        prompt: str | None,
        parent_req: ParentRequest | None = None,
        request_index: int = 0,
        queue: RequestOutputCollector | None = None,
    ) -> None:
        request_id = request.request_id
        if request_id in self.request_states:
            raise ValueError(f"request_id {request_id!r} is already in use")
        state = RequestState.from_new_request(
            self.tokenizer,
            request,
            prompt,
            parent_req,
            request_index,
            queue,
            self.stream_interval,
        )
        self.request_states[request_id] = state
        if parent_req is not None:
            self.parent_requests[parent_req.request_id] = parent_req
        self.external_req_ids[state.external_req_id].append(request_id)
        self.trace.added(request, prompt, parent_req, request_index)

    def abort_requests(self, request_ids: Iterable[str], internal: bool) -> list[str]:
        """Forget requests; returns the internal ids EngineCore must abort.

        ``internal=False``: the ids are the user's; every request added under
        one is aborted. ``internal=True``: the ids are internal ones; the id of
        an ``n > 1`` request aborts all its children. A request with a
        collector gets a last output with finish_reason "abort"."""
        internal_ids: list[str] = []
        for request_id in request_ids:
            if internal:
                internal_ids.append(request_id)
            else:
                internal_ids.extend(self.external_req_ids.get(request_id, ()))
        to_abort: list[str] = []
        for request_id in internal_ids:
            state = self.request_states.get(request_id)
            if state is not None:
                if state.queue is not None:
                    output = state.make_request_output([], FinishReason.ABORT, None)
                    if output is not None:
                        state.queue.put(output)
                self._finish_request(state)
                to_abort.append(request_id)
                self.trace.aborted(request_id)
            elif (parent := self.parent_requests.get(request_id)) is not None:
                to_abort += self.abort_requests(sorted(parent.child_requests), internal=True)
                self.parent_requests.pop(request_id, None)
        return to_abort

    def process_outputs(self, engine_core_outputs: list[EngineCoreOutput]) -> OutputProcessorOutput:
        """Detokenize, check stop strings, build logprobs and the outputs of
        one batch. The only loop over the batch in the front end."""
        request_outputs: list[RequestOutput] = []
        reqs_to_abort: list[str] = []
        num_prompt_tokens = num_generation_tokens = 0
        for output in engine_core_outputs:
            request_id = output.request_id
            state = self.request_states.get(request_id)
            if state is None:
                continue  # aborted in the front end while the step ran
            new_token_ids = output.new_token_ids
            if state.is_prefilling and new_token_ids:
                state.is_prefilling = False
                num_prompt_tokens += state.prompt_len
            num_generation_tokens += len(new_token_ids)
            if output.prefill_stats is not None:  # only on the request's first output
                state.num_cached_tokens = output.prefill_stats.num_cached_tokens
            finish_reason = output.finish_reason
            stop_reason = output.stop_reason

            # Text, and the stop strings only text can reveal. A stop string
            # wins even if the core also finished this step (length, EOS).
            stop_str = state.detokenizer.update(new_token_ids, finish_reason == FinishReason.STOP)
            if stop_str is not None:
                finish_reason, stop_reason = FinishReason.STOP, stop_str
            state.logprobs_processor.update_from_output(output)
            finished = finish_reason is not None
            self.trace.output(state, new_token_ids, finished)

            request_output = state.make_request_output(new_token_ids, finish_reason, stop_reason)
            if request_output is not None:
                if state.queue is not None:
                    state.queue.put(request_output)  # AsyncLLM: to its generate()
                else:
                    request_outputs.append(request_output)  # LLMEngine: returned
            if finished:
                self.trace.finished(state, finish_reason, stop_reason, stop_str)
                self._finish_request(state)
                if not output.finished:
                    # Only the front end knows it ended: the core must be told.
                    reqs_to_abort.append(request_id)
        if not self.log_stats:
            num_prompt_tokens = num_generation_tokens = 0
        return OutputProcessorOutput(
            request_outputs, reqs_to_abort, num_prompt_tokens, num_generation_tokens
        )

    def _finish_request(self, state: RequestState) -> None:
        """Drop a finished or aborted request, its id mapping, and its parent
        once the parent has no child left."""
        request_id = state.request_id
        self.request_states.pop(request_id, None)
        internal_ids = self.external_req_ids.get(state.external_req_id)
        if internal_ids is not None:
            internal_ids.remove(request_id)
            if not internal_ids:
                del self.external_req_ids[state.external_req_id]
        parent = state.parent_req
        if parent is not None:
            # An aborted child without a collector never went through get_outputs.
            parent.child_requests.discard(request_id)
            if not parent.child_requests:
                self.parent_requests.pop(parent.request_id, None)
