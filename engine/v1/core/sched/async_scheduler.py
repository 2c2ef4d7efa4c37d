"""AsyncScheduler: schedule step N+1 before step N's tokens are known.

vLLM twin: ``vllm/v1/core/sched/async_scheduler.py`` (``AsyncScheduler``:
``_update_after_schedule``, ``_update_request_with_output``). vLLM's default
scheduler whenever ``scheduler_config.async_scheduling`` resolves to True.

Read it for the one idea that makes the overlap possible: a *placeholder*.
With a batch queue of two (``EngineCore.step_with_batch_queue``) the engine
schedules step N+1 while step N still runs on the device, so the token step N
samples is not in the request yet. Each decoding request scheduled in a step
therefore gets ``num_output_placeholders += 1``: "one more token is coming".
The base scheduler counts placeholders as tokens to compute -- the next step
schedules the placeholder's position, and the worker takes its id on the
device from the previous step's sampled ids -- and sends them in
``num_output_tokens`` so the worker's lists line up.

When step N's output arrives, each appended token retires one placeholder,
and only then are the request's blocks cached up to
``num_computed_tokens - num_output_placeholders``: a block whose last token is
still a placeholder has no known content, so it must not get a hash.

A request that ``reset_prefix_cache`` preempted while steps were in flight
gets ``async_tokens_to_discard`` (its placeholder count): each frame that
still arrives for it is dropped, since the request recomputes from scratch.

A request that finishes at step N was already scheduled in step N+1: that
step's token is dropped (the base ``update_from_output`` skips finished
requests), the price of never waiting for the host.
Sessions: 01 (engine loop), 02 (scheduler), 03 (KV cache: what ``cache_blocks`` may hash).

Speculative decoding (EAGLE or a draft model; session 06): the drafts for
step N+1 are proposed on the device after step N, so the scheduler never
sees them. A step that verifies d drafts adds 1 + d placeholders (every draft
may be accepted), and the request's ``spec_token_ids`` become k -1
placeholders, which step N+1 schedules after its last token; the runner
copies the real drafts in on the device. When step N's output arrives,
``update_from_output`` takes the rejected drafts off both the cursor and the
placeholders; the runner, which scheduled N+1 from the optimistic cursor,
corrects its own copy once it sees step N's verdict.

Structured outputs: a constrained request scheduled while its previous
token is still in flight sets ``pending_structured_output_tokens``; the
engine core then samples that step only after the previous step's output has
advanced the grammar (vLLM's deferred sampling).
"""

from __future__ import annotations

from typing import Any

from engine.v1.core.sched.output import SchedulerOutput
from engine.v1.core.sched.scheduler import Scheduler
from engine.v1.request import Request, RequestStatus


class AsyncScheduler(Scheduler):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # Shared and never mutated: the drafts the worker keeps on the device.
        self._spec_token_placeholders: list[int] = [-1] * self.num_spec_tokens

    def _update_after_schedule(self, scheduler_output: SchedulerOutput) -> None:
        super()._update_after_schedule(scheduler_output)
        spec_decode_tokens = scheduler_output.scheduled_spec_decode_tokens
        for req_id in scheduler_output.num_scheduled_tokens:
            request = self.requests[req_id]
            if request.is_prefill_chunk:
                continue  # a mid-prompt chunk samples nothing
            # Its grammar has not seen the token in flight yet.
            scheduler_output.pending_structured_output_tokens |= (
                request.use_structured_output and request.num_output_placeholders > 0
            )
            # This step samples one token, plus one per draft if all are accepted.
            request.num_output_placeholders += 1 + len(spec_decode_tokens.get(req_id, ()))
            # Drafts for the next step: proposed on the device after this one.
            request.spec_token_ids = self._spec_token_placeholders

    def _update_request_with_output(
        self, request: Request, new_token_ids: list[int]
    ) -> tuple[list[int], bool]:
        if request.async_tokens_to_discard > 0:
            # A frame from before a reset_prefix_cache preemption: stale.
            request.async_tokens_to_discard -= 1
            return [], False
        status_before_update = request.status
        new_token_ids, stopped = super()._update_request_with_output(request, new_token_ids)
        request.num_output_placeholders -= len(new_token_ids)
        assert request.num_output_placeholders >= 0
        if status_before_update == RequestStatus.RUNNING:
            # Only now is the content of these positions known.
            self.kv_cache_manager.cache_blocks(
                request, request.num_computed_tokens - request.num_output_placeholders
            )
        return new_token_ids, stopped
