"""The trace objects of the engine loop and the front end.

vLLM twin: none (the injected-collector pattern of vLLM's
``KVCacheMetricsCollector``). ``EngineCore`` holds an ``EngineCoreTrace``;
the front end's ``OutputProcessor`` an ``OutputProcessorTrace``; the
multi-process clients of ``core_client.py`` a ``ClientTrace``; the API
server a ``ServerTrace``; ``glassbox trace`` a ``CliTrace``. Each method is
one named point of those files.

Sessions: 01 (engine loop).
"""

from __future__ import annotations

import time
from typing import Any

from engine.tracing.events import (
    ApiChunk,
    ApiRequest,
    EngineOutputReady,
    EngineProfile,
    EngineStepLaunched,
    OutputReceived,
    OutputSent,
    RequestAdded,
    RequestFinished,
    RequestOutputEvent,
    RequestReceived,
    RequestSent,
    SamplingParamsSummary,
    TraceCli,
    TraceTokenTexts,
)
from engine.tracing.tracer import SubsystemTrace, Tracer

# Prompts are kept in ``request.added`` up to this many characters.
MAX_PROMPT_CHARS = 512


class EngineCoreTrace(SubsystemTrace):
    """``EngineCore``: when the trace is written, and the process hop's core side."""

    def __init__(self, tracer: Tracer) -> None:
        super().__init__(tracer)
        self._wait_start_ns = 0
        self._newest_step: int | None = None  # the last step launched
        self._updated_step: int | None = None  # the last step whose tokens were read
        self._step_batches_unsent = 0  # output batches of that step not yet queued

    def step_launched(self, step: int, num_in_flight: int) -> None:
        """``engine.step_launched``; then write what was recorded so far while
        the device runs the step (docs/trace_format.md: why every step). The
        host may wait for a step's tokens from here on."""
        self._newest_step = step
        self.tracer.record(EngineStepLaunched(step=step, num_in_flight=num_in_flight))
        self.tracer.flush()

    def waiting_for_output(self) -> None:
        """The host is about to block until a step's tokens are on the host."""
        self._wait_start_ns = time.perf_counter_ns()

    def output_ready(self, step: int) -> None:
        """``engine.output_ready``: ``step``'s tokens are on the host."""
        self.tracer.set_step(step)
        self._updated_step = step
        now = time.perf_counter_ns()
        self.tracer.record(EngineOutputReady(step=step, wait_ns=now - self._wait_start_ns))

    def step_done(self, scheduler: Any, outputs: dict, batch_queue: Any = ()) -> None:
        """A step's output was applied and gave ``outputs`` (one batch per
        client). What happens until the next ``schedule()`` (requests added,
        aborts) belongs to the newest step launched -- with async scheduling
        not the step just updated, as the next one is already in flight --
        except those batches, which carry the updated step's tokens. Write the
        step's last events now if no step follows to carry them."""
        self._step_batches_unsent = len(outputs)
        if self._newest_step is not None:
            self.tracer.set_step(self._newest_step)
        if not scheduler.has_requests() and not batch_queue:
            self.tracer.flush()

    def profiled(self, is_start: bool, profile_prefix: str | None) -> None:
        """``engine.profile``: the workers' profiling window opened or closed."""
        self.tracer.record(EngineProfile(is_start=is_start, profile_prefix=profile_prefix))

    def request_received(self, request_type: Any, request: Any) -> None:
        """The input thread decoded a request (``EngineCoreRequestType``)."""
        fields = _hop_fields(request_type, request)
        if fields is not None:
            self.tracer.record(RequestReceived(**fields))

    def output_sent(self, outputs: Any) -> None:
        """The busy loop queued an ``EngineCoreOutputs`` for the output thread:
        first the batches of the step just updated (stamped with that step),
        then, between steps, utility results and aborts (the current step)."""
        step = None
        if self._step_batches_unsent:
            self._step_batches_unsent -= 1
            step = self._updated_step
        ids = [o.request_id for o in outputs.outputs]
        self.tracer.record(OutputSent(step=step, request_ids=ids))


class ClientTrace(SubsystemTrace):
    """The multi-process clients of ``core_client.py``: the front end's side of the hop."""

    def request_sent(self, request_type: Any, request: Any) -> None:
        fields = _hop_fields(request_type, request)
        if fields is not None:
            self.tracer.record(RequestSent(**fields))

    def output_received(self, outputs: Any) -> None:
        self.tracer.record(OutputReceived(request_ids=[o.request_id for o in outputs.outputs]))


def _hop_fields(request_type: Any, request: Any) -> dict[str, Any] | None:
    """The fields of a process-hop event: an add names its request, an abort
    lists its ids; None for the other request types (utility calls)."""
    if request_type.name == "ADD":
        return {"type": "add", "request_id": request.request_id}
    if request_type.name == "ABORT":
        return {"type": "abort", "request_ids": list(request)}
    return None


class OutputProcessorTrace(SubsystemTrace):
    """``OutputProcessor``: each request as the user sees it."""

    def __init__(self, tracer: Tracer) -> None:
        super().__init__(tracer)
        # request id -> length of its output text at its last update.
        self._text_len: dict[str, int] = {}

    def added(self, request: Any, prompt: str | None, parent_req: Any, request_index: int) -> None:
        """Ids are internal ones (``request.external_req_id`` holds the user's);
        a child's parent is named by the parent's internal id."""
        params = request.sampling_params
        if prompt is not None and len(prompt) > MAX_PROMPT_CHARS:
            prompt = prompt[:MAX_PROMPT_CHARS] + "..."
        self.tracer.record(
            RequestAdded(
                request_id=request.request_id,
                external_req_id=request.external_req_id,
                parent_request_id=parent_req.request_id if parent_req is not None else None,
                index=request_index,
                num_prompt_tokens=len(request.prompt_token_ids),
                prompt=prompt,
                arrival_time=request.arrival_time,
                priority=request.priority,
                sampling_params=SamplingParamsSummary(
                    max_tokens=params.max_tokens,
                    temperature=params.temperature,
                    top_p=params.top_p,
                    top_k=params.top_k,
                    min_p=params.min_p,
                    seed=params.seed,
                    n=params.n,
                    stop=list(params.stop or []),
                    stop_token_ids=list(params.stop_token_ids or []),
                    logprobs=params.logprobs,
                    ignore_eos=params.ignore_eos,
                    output_kind=params.output_kind.name,
                ),
                prompt_token_ids=list(request.prompt_token_ids) if self.full else None,
                lora_name=request.lora_request.lora_name if request.lora_request else "",
            )
        )

    def aborted(self, request_id: str) -> None:
        """The front end dropped the request (``abort_requests``)."""
        self._text_len.pop(request_id, None)
        self.tracer.record(
            RequestFinished(request_id=request_id, finish_reason="abort", aborted_by="front end")
        )

    def output(self, state: Any, new_token_ids: list[int], finished: bool) -> None:
        """One ``EngineCoreOutput`` went through ``state`` (a ``RequestState``)."""
        text = state.detokenizer.output_text
        start = self._text_len.pop(state.request_id, 0)
        if not finished:
            self._text_len[state.request_id] = len(text)
        self.tracer.record(
            RequestOutputEvent(
                request_id=state.request_id,
                new_token_ids=new_token_ids,
                text_delta=text[start:],
                num_output_tokens=len(state.detokenizer.token_ids),
                finished=finished,
            )
        )

    def finished(self, state: Any, finish_reason: Any, stop_reason: Any, stop_str: Any) -> None:
        """``stop_str``: the stop string the front end found, or None."""
        self.tracer.record(
            RequestFinished(
                request_id=state.request_id,
                finish_reason=str(finish_reason),
                stop_reason=stop_reason,
                num_prompt_tokens=len(state.prompt_token_ids),
                num_output_tokens=len(state.detokenizer.token_ids),
                num_cached_tokens=state.num_cached_tokens,
                stop_string_in_front_end=stop_str is not None,
            )
        )


class ServerTrace(SubsystemTrace):
    """The OpenAI-compatible server: HTTP requests and streamed chunks."""

    def request(self, request_id: str, endpoint: str, stream: bool) -> None:
        self.tracer.record(ApiRequest(request_id=request_id, endpoint=endpoint, stream=stream))

    def chunk(self, request_id: str, chunk: str | bytes) -> None:
        self.tracer.record(ApiChunk(request_id=request_id, num_bytes=len(chunk)))


class CliTrace(SubsystemTrace):
    """``glassbox trace`` (``engine/entrypoints/cli/trace.py``): what the run is
    for, and the text of the tokens it mentions, so a viewer needs no tokenizer."""

    def run_planned(
        self, follow_request_id: str, prompt: str, model: str, arrival_steps: dict[str, int]
    ) -> None:
        """``arrival_steps``: request id -> engine steps run before it is added."""
        background = [rid for rid in arrival_steps if rid != follow_request_id]
        self.tracer.record(
            TraceCli(
                follow_request_id=follow_request_id,
                prompt=prompt,
                model=model,
                background_request_ids=background,
                arrival_steps=arrival_steps,
            )
        )

    def token_texts(self, texts: dict[str, str]) -> None:
        self.tracer.record(TraceTokenTexts(token_texts=texts))


__all__ = ["CliTrace", "ClientTrace", "EngineCoreTrace", "OutputProcessorTrace", "ServerTrace"]
