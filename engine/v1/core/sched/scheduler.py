"""The V1 scheduler: one token budget, running requests first, preempt by recompute.

vLLM twin: ``vllm/v1/core/sched/scheduler.py`` (``Scheduler.schedule``,
``_preempt_request``, ``update_from_output``, ``finish_requests``).

Read it for the decision order of ``schedule()``:

1. There is no prefill phase and no decode phase. Every request simply wants
   ``num_new_tokens = num_tokens_with_spec - num_computed_tokens`` more tokens
   computed; a fresh prompt wants hundreds, a decoding request wants 1.
2. RUNNING requests are served first, in admission order, each clamped by
   ``long_prefill_token_threshold``, the remaining ``token_budget`` and
   ``max_model_len``. If ``allocate_slots`` finds no free blocks, a running
   request is preempted (``preempted_req``; FCFS: the last running request;
   PRIORITY: the worst ``(priority, arrival_time)``, the first in the running
   list of those tied), its blocks are freed, it goes back to the *front* of
   the waiting queue with ``num_computed_tokens = 0``, and the allocation is
   retried. If ``preempted_req`` is the request itself, the loop stops.
3. WAITING requests are admitted only if nothing was preempted this step.
   They come from two queues: ``waiting`` and ``skipped_waiting``, where a
   request blocked on something other than space waits (a grammar still
   compiling, remote KV, more streamed input: the ``WAITING_FOR_*``
   statuses). FCFS takes ``skipped_waiting`` first, PRIORITY the better of
   the two heads. A blocked request is promoted back to WAITING once what it
   waits for is ready; otherwise it is set aside for this step and the next
   request is tried. Each admitted request gets a prefix-cache lookup
   (``get_computed_blocks``), then as many of its remaining tokens as the
   budget allows (unless chunked prefill is off, in which case the whole rest
   must fit). With ``scheduler_reserve_full_isl`` (on by default) it is
   admitted only if the free blocks could hold its whole sequence, not just
   this chunk. The first request that does not fit stops admission: nobody is
   preempted for a waiting request.
4. ``_update_after_schedule`` advances each scheduled request's
   ``num_computed_tokens`` *now*, before the model runs -- the scheduler
   plans as if the step already happened.

Then ``update_from_output`` appends the sampled tokens, runs the stop checks,
frees finished requests and builds the per-client ``EngineCoreOutputs``.
``reset_prefix_cache(reset_running_requests=True)`` preempts every running
request first, so the reset cannot be refused.

A property of vLLM's PRIORITY rule that Glassbox keeps: with admission by
first chunk only (``scheduler_reserve_full_isl=False``) and prefix caching
off, two requests tied on ``(priority, arrival_time)`` whose prompts are
chunked can preempt each other in turn for ever, each readmission taking the
blocks the other needs next.
Sessions: 02 (scheduler), 03 (where it calls the KV cache manager).

Placeholders (``num_output_placeholders``) are always 0 here; the
``AsyncScheduler`` subclass (async_scheduler.py) sets them, and
``schedule()`` counts them as tokens still to compute.

Speculative decoding: a running request's drafts (``spec_token_ids``, set by
``update_draft_token_ids`` after each step) are scheduled after its known
tokens (``scheduled_spec_decode_tokens``); ``update_from_output`` steps
``num_computed_tokens`` back over the drafts the runner rejected.

Structured outputs (session 06): a constrained request waits in
``skipped_waiting`` (``WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR``) until its
grammar has compiled; ``get_grammar_bitmask`` asks the
``StructuredOutputManager`` for the step's bitmask rows (the engine core
calls it between ``execute_model`` and ``sample_tokens``);
``update_from_output`` advances each request's matcher over the tokens it
kept, and ``update_draft_token_ids`` cuts drafts at the first token the
grammar forbids.

LoRA: a waiting request whose adapter would make the running set hold more
than ``max_loras`` adapters is passed over (set aside like a blocked one)
until one finishes. vLLM counts the adapters of the requests scheduled in the
step; Glassbox counts every running request's, so the next step can never
need more slots than exist.

Pausing (``set_pause_state``, for ``pause_generation``): PAUSED_NEW admits
no waiting request, PAUSED_ALL schedules nothing; either way
``get_num_unfinished_requests`` counts only what may still run, so a paused
engine idles instead of spinning on empty steps.

Simpler than vLLM: no encoder inputs, KV connectors or streaming
input. Requests waiting for remote KV or streamed input are
never promoted, as no KV connector or streaming session exists to release
them.

Tracing (Glassbox's own): the scheduler receives a ``SchedulerTrace``
(``engine/tracing/core_trace.py``) and calls it at each decision; its
``kv_cache`` part goes to the KV cache manager and the block pool.
"""

from __future__ import annotations

import logging
import time
from collections import defaultdict
from collections.abc import Iterable

from engine.config import GlassboxConfig
from engine.tracing.core_trace import SchedulerTrace
from engine.v1.core.kv_cache_manager import KVCacheBlocks, KVCacheManager
from engine.v1.core.sched.interface import PauseState, SchedulerInterface
from engine.v1.core.sched.output import (
    CachedRequestData,
    GrammarOutput,
    NewRequestData,
    SchedulerOutput,
)
from engine.v1.core.sched.request_queue import (
    RequestQueue,
    SchedulingPolicy,
    create_request_queue,
)
from engine.v1.core.sched.utils import check_stop, remove_all
from engine.v1.engine import EngineCoreEventType, EngineCoreOutput, EngineCoreOutputs
from engine.v1.kv_cache_interface import KVCacheConfig
from engine.v1.metrics.stats import SchedulerStats
from engine.v1.outputs import DraftTokenIds, ModelRunnerOutput
from engine.v1.request import Request, RequestStatus
from engine.v1.spec_decode.metrics import SpecDecodingStats

logger = logging.getLogger(__name__)


class Scheduler(SchedulerInterface):
    def __init__(
        self,
        glassbox_config: GlassboxConfig,
        kv_cache_config: KVCacheConfig,
        structured_output_manager: object | None,
        block_size: int,
        hash_block_size: int | None = None,
        include_finished_set: bool = False,
        log_stats: bool = False,
        trace: SchedulerTrace = SchedulerTrace.NULL,
    ) -> None:
        self.glassbox_config = glassbox_config
        self.scheduler_config = glassbox_config.scheduler_config
        self.lora_config = glassbox_config.lora_config
        self.cache_config = glassbox_config.cache_config
        self.kv_cache_config = kv_cache_config
        self.log_stats = log_stats
        self.trace = trace
        # Compiles grammars for structured outputs; None until Glassbox has them.
        self.structured_output_manager = structured_output_manager
        # vLLM's KV connector (disaggregated prefill, KV offloading): none here.
        self.connector = None
        # pause_generation / resume_generation (PauseState): what schedule() may pick.
        self._pause_state = PauseState.UNPAUSED

        # With include_finished_set, each client's EngineCoreOutputs also lists
        # the ids that finished since its last batch (vLLM uses it when one
        # front end talks to several engines).
        self.finished_req_ids_dict: dict[int, set[str]] | None = (
            defaultdict(set) if include_finished_set else None
        )
        # Requests that were scheduled in the previous step (for CachedRequestData).
        self.prev_step_scheduled_req_ids: set[str] = set()

        self.max_num_running_reqs = self.scheduler_config.max_num_seqs
        self.scheduler_reserve_full_isl = self.scheduler_config.scheduler_reserve_full_isl
        self.max_num_scheduled_tokens = self.scheduler_config.max_num_scheduled_tokens
        self.max_model_len = glassbox_config.model_config.max_model_len
        self.block_size = block_size
        # Speculative decoding: drafts verified per step at most, and the KV
        # slots reserved beyond the scheduled tokens for the drafts a model
        # proposer writes in the same step (EAGLE, draft model; n-gram writes none).
        speculative_config = glassbox_config.speculative_config
        self.num_spec_tokens = glassbox_config.num_speculative_tokens
        self.num_lookahead_tokens = 0
        if speculative_config is not None and (
            speculative_config.use_eagle() or speculative_config.uses_draft_model()
        ):
            self.num_lookahead_tokens = self.num_spec_tokens

        # Every live request, by id. Removed once finished *and* freed.
        self.requests: dict[str, Request] = {}
        try:
            self.policy = SchedulingPolicy(self.scheduler_config.policy)
        except ValueError as e:
            raise ValueError(f"Unknown scheduling policy: {self.scheduler_config.policy}") from e
        self.waiting = create_request_queue(self.policy)
        # Waiting requests blocked on something other than space (WAITING_FOR_*).
        self.skipped_waiting = create_request_queue(self.policy)
        # A plain list in admission order: FCFS preemption pops its tail.
        self.running: list[Request] = []
        # Finished since the last schedule(): the worker must drop their state.
        self.finished_req_ids: set[str] = set()
        self.trace.created(self)

        # The prefix-cache hash granularity; always the block size in Glassbox.
        if hash_block_size is None:
            hash_block_size = block_size
        self.kv_cache_manager = KVCacheManager(
            kv_cache_config=kv_cache_config,
            max_model_len=self.max_model_len,
            max_num_batched_tokens=self.scheduler_config.max_num_batched_tokens,
            enable_caching=self.cache_config.enable_prefix_caching,
            log_stats=log_stats,
            hash_block_size=hash_block_size,
            # An EAGLE head's cache entry at a block's last position depends on
            # the next token, so a prefix hit gives up its last block.
            use_eagle=speculative_config is not None and speculative_config.use_eagle(),
            trace=trace.kv_cache,
        )
        # Glassbox's own counters: the step number (``SchedulerOutput.step``,
        # for traces) and preemptions (vLLM counts them in the front end);
        # the per-step count goes out with the next stats.
        self.step_counter = 0
        self.num_preemptions_total = 0
        self._num_preemptions_this_step = 0

    # ------------------------------------------------------------------
    # schedule()
    # ------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        scheduled_new_reqs: list[Request] = []
        scheduled_resumed_reqs: list[Request] = []
        scheduled_running_reqs: list[Request] = []
        preempted_reqs: list[Request] = []

        req_to_new_blocks: dict[str, KVCacheBlocks] = {}
        num_scheduled_tokens: dict[str, int] = {}
        scheduled_spec_decode_tokens: dict[str, list[int]] = {}
        token_budget = self.max_num_scheduled_tokens
        if self._pause_state == PauseState.PAUSED_ALL:
            token_budget = 0  # frozen: a step only reports finished ids
        threshold = self.scheduler_config.long_prefill_token_threshold
        scheduled_timestamp = time.monotonic()
        self.step_counter += 1
        self.trace.step_started(self.step_counter)

        # -- 1. RUNNING requests -------------------------------------------
        req_index = 0
        while req_index < len(self.running) and token_budget > 0:
            request = self.running[req_index]

            if (
                request.num_output_placeholders > 0
                and request.num_computed_tokens + 2 - request.num_output_placeholders
                >= request.num_prompt_tokens + request.max_tokens
            ):
                # Async scheduling: the step in flight already samples the
                # request's last allowed token; another step would be wasted.
                req_index += 1
                continue

            # Placeholders (async scheduling) are tokens a step in flight is
            # sampling: known to be coming, not yet appended.
            num_new_tokens = (
                request.num_tokens_with_spec
                + request.num_output_placeholders
                - request.num_computed_tokens
            )
            if 0 < threshold < num_new_tokens:
                num_new_tokens = threshold
            num_new_tokens = min(num_new_tokens, token_budget)
            # The position of the next token must stay inside the model's window.
            num_new_tokens = min(
                num_new_tokens, self.max_model_len - 1 - request.num_computed_tokens
            )
            if num_new_tokens <= 0:
                # Nothing to do for this one this step; look at the next
                # (deliberately not strict FCFS).
                req_index += 1
                continue

            while True:
                new_blocks = self.kv_cache_manager.allocate_slots(
                    request, num_new_tokens, num_lookahead_tokens=self.num_lookahead_tokens
                )
                if new_blocks is not None:
                    break
                # Out of blocks: preempt someone and retry.
                if self.policy == SchedulingPolicy.PRIORITY:
                    # The worst (priority, arrival_time); on a tie max() keeps
                    # the first it meets, the earliest admitted.
                    preempted_req = max(self.running, key=lambda r: (r.priority, r.arrival_time))
                    self.running.remove(preempted_req)
                    if preempted_req in scheduled_running_reqs:
                        # Already scheduled earlier in this loop: refund it.
                        scheduled_running_reqs.remove(preempted_req)
                        token_budget += num_scheduled_tokens.pop(preempted_req.request_id)
                        req_to_new_blocks.pop(preempted_req.request_id)
                        scheduled_spec_decode_tokens.pop(preempted_req.request_id, None)
                        req_index -= 1
                else:
                    preempted_req = self.running.pop()
                self._preempt_request(preempted_req, scheduled_timestamp)
                preempted_reqs.append(preempted_req)
                self.trace.preempted(preempted_req, request)
                if preempted_req == request:
                    break

            if new_blocks is None:
                # The request preempted itself: nothing more can run.
                break

            scheduled_running_reqs.append(request)
            req_to_new_blocks[request.request_id] = new_blocks
            num_scheduled_tokens[request.request_id] = num_new_tokens
            token_budget -= num_new_tokens
            req_index += 1

            if request.spec_token_ids:
                # The drafts are the scheduled tokens past the known ones (the
                # budget or the model window may cut them short).
                num_scheduled_spec_tokens = (
                    num_new_tokens
                    + request.num_computed_tokens
                    - request.num_tokens
                    - request.num_output_placeholders
                )
                if num_scheduled_spec_tokens > 0:
                    scheduled_spec_decode_tokens[request.request_id] = request.spec_token_ids[
                        :num_scheduled_spec_tokens
                    ]
                # The proposer sets fresh drafts after this step.
                request.spec_token_ids = []

        # -- 2. WAITING requests (only if nobody was preempted) -------------
        if not preempted_reqs:
            # Requests set aside in this step; they go back in front of
            # skipped_waiting once admission stops.
            step_skipped_waiting = create_request_queue(self.policy)
            # Adapters in the running set: a step may use at most max_loras.
            running_loras: set[int] = set()
            if self.lora_config is not None:
                running_loras = {r.lora_request.lora_int_id for r in self.running if r.lora_request}
            # A paused scheduler (PauseState) admits nobody.
            admitting = self._pause_state == PauseState.UNPAUSED
            while admitting and (self.waiting or self.skipped_waiting) and token_budget > 0:
                if len(self.running) == self.max_num_running_reqs:
                    break
                request_queue = self._select_waiting_queue_for_scheduling()
                assert request_queue is not None
                request = request_queue.peek_request()

                if self._is_blocked_waiting_status(
                    request.status
                ) and not self._try_promote_blocked_waiting_request(request):
                    # Still blocked: try the next one (it is not a space problem).
                    request_queue.pop_request()
                    step_skipped_waiting.prepend_request(request)
                    continue
                if (
                    self.lora_config is not None
                    and request.lora_request is not None
                    and request.lora_request.lora_int_id not in running_loras
                    and len(running_loras) == self.lora_config.max_loras
                ):
                    # Its adapter would be one too many: it waits, others go on.
                    request_queue.pop_request()
                    step_skipped_waiting.prepend_request(request)
                    continue

                if request.num_computed_tokens == 0:
                    # Fresh or preempted: look the prompt up in the prefix cache.
                    new_computed_blocks, num_new_local_computed_tokens = (
                        self.kv_cache_manager.get_computed_blocks(request)
                    )
                    num_computed_tokens = num_new_local_computed_tokens
                    # Until its first output takes them: a request preempted
                    # before producing a token is counted at its resumed lookup.
                    if request.prefill_stats is not None:
                        request.prefill_stats.set(
                            num_prompt_tokens=request.num_prompt_tokens,
                            num_local_cached_tokens=num_new_local_computed_tokens,
                            num_external_cached_tokens=0,
                        )
                else:
                    new_computed_blocks = self.kv_cache_manager.empty_kv_cache_blocks
                    num_new_local_computed_tokens = 0
                    num_computed_tokens = request.num_computed_tokens

                num_new_tokens = request.num_tokens - num_computed_tokens
                if 0 < threshold < num_new_tokens:
                    num_new_tokens = threshold
                if (
                    not self.scheduler_config.enable_chunked_prefill
                    and num_new_tokens > token_budget
                ):
                    # Without chunking the whole rest must run in one step.
                    break
                num_new_tokens = min(num_new_tokens, token_budget)
                assert num_new_tokens > 0

                new_blocks = self.kv_cache_manager.allocate_slots(
                    request,
                    num_new_tokens,
                    num_new_computed_tokens=num_new_local_computed_tokens,
                    new_computed_blocks=new_computed_blocks,
                    # No lookahead slots at admission: a waiting request's cursor
                    # is 0 here (vLLM reserves them only for one whose KV arrived
                    # from elsewhere, which Glassbox has not).
                    full_sequence_must_fit=self.scheduler_reserve_full_isl,
                )
                if new_blocks is None:
                    # Does not fit: stop admitting (never preempt for a waiter).
                    break

                request = request_queue.pop_request()
                self.running.append(request)
                if request.lora_request is not None:
                    running_loras.add(request.lora_request.lora_int_id)
                if self.log_stats:
                    request.record_event(EngineCoreEventType.SCHEDULED, scheduled_timestamp)
                if request.status == RequestStatus.WAITING:
                    scheduled_new_reqs.append(request)
                elif request.status == RequestStatus.PREEMPTED:
                    scheduled_resumed_reqs.append(request)
                else:
                    raise RuntimeError(f"Invalid request status: {request.status}")

                req_to_new_blocks[request.request_id] = self.kv_cache_manager.get_blocks(
                    request.request_id
                )
                num_scheduled_tokens[request.request_id] = num_new_tokens
                token_budget -= num_new_tokens
                request.status = RequestStatus.RUNNING
                request.num_computed_tokens = num_computed_tokens
                self.trace.admitted(request, num_new_tokens)

            # prepend_request reversed them; prepend_requests restores their order.
            if step_skipped_waiting:
                self.skipped_waiting.prepend_requests(step_skipped_waiting)

        # -- 3. Build the output ------------------------------------------------
        total_num_scheduled_tokens = sum(num_scheduled_tokens.values())
        assert total_num_scheduled_tokens <= self.max_num_scheduled_tokens
        assert token_budget >= 0
        assert len(self.running) <= self.max_num_running_reqs

        num_common_prefix_blocks = [0] * len(self.kv_cache_config.kv_cache_groups)
        if self.running:
            num_common_prefix_blocks = self.kv_cache_manager.get_num_common_prefix_blocks(
                self.running[0].request_id
            )

        new_reqs_data = [
            NewRequestData.from_request(req, req_to_new_blocks[req.request_id].get_block_ids())
            for req in scheduled_new_reqs
        ]
        cached_reqs_data = self._make_cached_request_data(
            scheduled_running_reqs, scheduled_resumed_reqs, req_to_new_blocks
        )
        self.prev_step_scheduled_req_ids = set(num_scheduled_tokens)

        scheduler_output = SchedulerOutput(
            scheduled_new_reqs=new_reqs_data,
            scheduled_cached_reqs=cached_reqs_data,
            num_scheduled_tokens=num_scheduled_tokens,
            total_num_scheduled_tokens=total_num_scheduled_tokens,
            num_common_prefix_blocks=num_common_prefix_blocks,
            finished_req_ids=self.finished_req_ids,
            preempted_req_ids={req.request_id for req in preempted_reqs},
            scheduled_spec_decode_tokens=scheduled_spec_decode_tokens,
            step=self.step_counter,
        )
        self._update_after_schedule(scheduler_output)
        self.trace.scheduled(self, scheduler_output, token_budget, scheduled_timestamp)
        return scheduler_output

    def _preempt_request(self, request: Request, timestamp: float) -> None:
        """Free a running request's KV and put it back at the front of the
        waiting queue; it will recompute everything (prompt + outputs so far).
        The caller has already removed it from ``self.running``."""
        assert request.status == RequestStatus.RUNNING, "only running requests can be preempted"
        self.kv_cache_manager.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.spec_token_ids = []
        request.num_preemptions += 1
        self.num_preemptions_total += 1
        self._num_preemptions_this_step += 1
        if self.log_stats:
            request.record_event(EngineCoreEventType.PREEMPTED, timestamp)
        self.waiting.prepend_request(request)

    def _update_after_schedule(self, scheduler_output: SchedulerOutput) -> None:
        # Advance the cursors now: the next schedule() may run before the
        # model's output comes back (vLLM overlaps them), so it must already
        # see these tokens as computed.
        for req_id, num_tokens in scheduler_output.num_scheduled_tokens.items():
            request = self.requests[req_id]
            request.num_computed_tokens += num_tokens
            request.is_prefill_chunk = request.num_computed_tokens < (
                request.num_tokens + request.num_output_placeholders
            )
            scheduler_output.has_structured_output_requests |= (
                request.use_structured_output and not request.is_prefill_chunk
            )
        # The worker hears about these finished ids exactly once.
        self.finished_req_ids = set()

    def _make_cached_request_data(
        self,
        running_reqs: list[Request],
        resumed_reqs: list[Request],
        req_to_new_blocks: dict[str, KVCacheBlocks],
    ) -> CachedRequestData:
        data = CachedRequestData()
        for req in [*running_reqs, *resumed_reqs]:
            req_id = req.request_id
            data.req_ids.append(req_id)
            if req in resumed_reqs:
                data.resumed_req_ids.add(req_id)
            if req_id not in self.prev_step_scheduled_req_ids:
                data.all_token_ids[req_id] = req.all_token_ids.copy()
            data.new_block_ids.append(req_to_new_blocks[req_id].get_block_ids(allow_none=True))
            data.num_computed_tokens.append(req.num_computed_tokens)
            # Placeholders count: the worker holds them (as -1) in its output list.
            data.num_output_tokens.append(req.num_output_tokens + req.num_output_placeholders)
        return data

    # ------------------------------------------------------------------
    # The two waiting queues
    # ------------------------------------------------------------------
    @staticmethod
    def _is_blocked_waiting_status(status: RequestStatus) -> bool:
        return status in (
            RequestStatus.WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR,
            RequestStatus.WAITING_FOR_REMOTE_KVS,
            RequestStatus.WAITING_FOR_STREAMING_REQ,
        )

    def _enqueue_waiting_request(self, request: Request) -> None:
        if self._is_blocked_waiting_status(request.status):
            self.skipped_waiting.add_request(request)
        else:
            self.waiting.add_request(request)

    def _select_waiting_queue_for_scheduling(self) -> RequestQueue | None:
        """The queue whose head is admitted next, None when both are empty."""
        if self.policy == SchedulingPolicy.FCFS:
            # Skipped requests came first: they go first once unblocked.
            return self.skipped_waiting or self.waiting or None
        if self.waiting and self.skipped_waiting:
            waiting_req = self.waiting.peek_request()
            skipped_req = self.skipped_waiting.peek_request()
            return self.waiting if waiting_req < skipped_req else self.skipped_waiting
        return self.waiting or self.skipped_waiting or None

    def _try_promote_blocked_waiting_request(self, request: Request) -> bool:
        """Set a blocked request back to WAITING if what it waits for is ready."""
        if request.status == RequestStatus.WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR:
            structured_output_req = request.structured_output_request
            if not (structured_output_req and structured_output_req.grammar):
                return False
            request.status = RequestStatus.WAITING
            self.trace.structured_output.grammar_ready(request)
            return True
        if request.status in (
            RequestStatus.WAITING_FOR_REMOTE_KVS,
            RequestStatus.WAITING_FOR_STREAMING_REQ,
        ):
            # A KV connector or the next streamed chunk releases these;
            # Glassbox has neither, so they wait until aborted.
            return False
        raise AssertionError(
            "Unexpected blocked waiting status in promotion: "
            f"{request.status.name} for request {request.request_id}"
        )

    # ------------------------------------------------------------------
    # update_from_output()
    # ------------------------------------------------------------------
    def get_grammar_bitmask(self, scheduler_output: SchedulerOutput) -> GrammarOutput | None:
        """The bitmask rows of the step's constrained requests that sample
        (not those in the middle of their prompt), in scheduling order."""
        if not scheduler_output.has_structured_output_requests:
            return None
        assert self.structured_output_manager is not None
        structured_output_request_ids = [
            req_id
            for req_id in scheduler_output.num_scheduled_tokens
            if (req := self.requests.get(req_id))
            and req.use_structured_output
            and not req.is_prefill_chunk
        ]
        if not structured_output_request_ids:
            return None
        bitmask = self.structured_output_manager.grammar_bitmask(
            self.requests,
            structured_output_request_ids,
            scheduler_output.scheduled_spec_decode_tokens,
        )
        return GrammarOutput(structured_output_request_ids, bitmask)

    def update_from_output(
        self, scheduler_output: SchedulerOutput, model_runner_output: ModelRunnerOutput
    ) -> dict[int, EngineCoreOutputs]:
        self.trace.update_started(scheduler_output.step)
        sampled_token_ids = model_runner_output.sampled_token_ids
        logprobs = model_runner_output.logprobs
        prompt_logprobs_dict = model_runner_output.prompt_logprobs_dict
        outputs: dict[int, list[EngineCoreOutput]] = defaultdict(list)
        stopped_running_reqs: set[Request] = set()
        # Async scheduling only: preempted while this step was in flight.
        stopped_preempted_reqs: set[Request] = set()
        spec_decoding_stats: SpecDecodingStats | None = None
        # Logprob rows follow the runner's request order, one row per sampled
        # token: request k's rows start after all tokens of requests 0..k-1.
        logprob_row_start: dict[str, int] = {}
        row = 0
        for i, rid in enumerate(model_runner_output.req_ids):
            logprob_row_start[rid] = row
            row += len(sampled_token_ids[i]) if sampled_token_ids else 0

        for req_id, num_tokens_scheduled in scheduler_output.num_scheduled_tokens.items():
            assert num_tokens_scheduled > 0
            request = self.requests.get(req_id)
            req_index = model_runner_output.req_id_to_index.get(req_id)
            generated = (
                list(sampled_token_ids[req_index])
                if (req_index is not None and sampled_token_ids)
                else []
            )
            row_start = logprob_row_start.get(req_id, 0)
            if request is None or request.is_finished():
                # Aborted while the step was running: drop its tokens.
                continue

            scheduled_spec_token_ids = scheduler_output.scheduled_spec_decode_tokens.get(req_id)
            if scheduled_spec_token_ids and generated:
                # Speculative decoding: the runner returns the accepted drafts
                # plus one token of its own. The positions of the rejected
                # drafts were computed for nothing: step the cursor back over
                # them, so the next step writes their slots again (the blocks
                # stay allocated). Their placeholders go too (async).
                num_draft_tokens = len(scheduled_spec_token_ids)
                num_rejected = num_draft_tokens - (len(generated) - 1)
                if request.num_computed_tokens > 0:
                    request.num_computed_tokens -= num_rejected
                if request.num_output_placeholders > 0:
                    request.num_output_placeholders -= num_rejected
                spec_decoding_stats = self.make_spec_decoding_stats(
                    spec_decoding_stats, num_draft_tokens, len(generated) - 1
                )
                self.trace.drafts_verified(request, scheduled_spec_token_ids, generated)

            status_before_stop = request.status
            new_token_ids: list[int] = []
            stopped = False
            if generated:
                new_token_ids, stopped = self._update_request_with_output(request, generated)
            if new_token_ids and request.use_structured_output:
                grammar = request.structured_output_request.grammar
                if not grammar.accept_tokens(req_id, new_token_ids):
                    # Cannot happen under the mask (a grammar already
                    # complete, with ignore_eos): end the request, as vLLM.
                    logger.error("grammar refused tokens %s of %s", new_token_ids, req_id)
                    request.status = RequestStatus.FINISHED_ABORTED
                    stopped = True
                self.trace.structured_output.advanced(request, new_token_ids)

            finish_reason = None
            if stopped:
                finish_reason = request.get_finished_reason()
                self._free_request(request)
                if status_before_stop == RequestStatus.RUNNING:
                    stopped_running_reqs.add(request)
                else:
                    stopped_preempted_reqs.add(request)

            new_logprobs = None
            if (
                logprobs is not None
                and request.sampling_params.logprobs is not None
                and new_token_ids
            ):
                new_logprobs = logprobs.slice_rows(row_start, row_start + len(new_token_ids))

            # A request's prompt logprobs come all at once, in the step that
            # ends its prefill: the step that samples its first token.
            prompt_logprobs_lists = prompt_logprobs_dict.get(req_id)
            if new_token_ids or stopped:
                outputs[request.client_index].append(
                    EngineCoreOutput(
                        request_id=req_id,
                        new_token_ids=new_token_ids,
                        new_logprobs=new_logprobs,
                        new_prompt_logprobs_tensors=prompt_logprobs_lists,
                        finish_reason=finish_reason,
                        stop_reason=request.stop_reason,
                        events=request.take_events(),
                        prefill_stats=request.take_prefill_stats(),
                    )
                )

        if stopped_running_reqs:
            self.running = remove_all(self.running, stopped_running_reqs)
        if stopped_preempted_reqs:
            self.waiting.remove_requests(stopped_preempted_reqs)
        self.trace.updated(self, outputs)

        engine_core_outputs = {
            client_index: EngineCoreOutputs(outputs=outs) for client_index, outs in outputs.items()
        }
        finished_req_ids = self.finished_req_ids_dict
        if finished_req_ids:
            # Every client hears which of its requests finished since its last batch.
            for client_index, finished_set in finished_req_ids.items():
                if (eco := engine_core_outputs.get(client_index)) is not None:
                    eco.finished_requests = finished_set
                else:
                    engine_core_outputs[client_index] = EngineCoreOutputs(
                        finished_requests=finished_set
                    )
            finished_req_ids.clear()
        stats = self.make_stats(spec_decoding_stats)
        if stats is not None:
            eco = engine_core_outputs.get(0)
            if eco is None:
                eco = engine_core_outputs[0] = EngineCoreOutputs()
            eco.scheduler_stats = stats
        return engine_core_outputs

    def update_draft_token_ids(self, draft_token_ids: DraftTokenIds) -> None:
        """Hand each request the drafts the proposer made after the last step;
        the next schedule() verifies them."""
        for req_id, spec_token_ids in zip(
            draft_token_ids.req_ids, draft_token_ids.draft_token_ids, strict=True
        ):
            request = self.requests.get(req_id)
            if request is None or request.is_finished():
                continue  # finished (or aborted) since the step ran
            if request.is_prefill_chunk:
                # Mid-prompt: nothing was sampled, so drafts cannot follow yet.
                request.spec_token_ids = []
                continue
            if request.use_structured_output:
                # Only drafts the grammar allows may be verified.
                spec_token_ids = request.structured_output_request.grammar.validate_tokens(
                    spec_token_ids
                )
            request.spec_token_ids = spec_token_ids

    def _update_request_with_output(
        self, request: Request, new_token_ids: list[int]
    ) -> tuple[list[int], bool]:
        """Append the sampled tokens, stopping at the first that ends the
        request. Returns the tokens kept and whether the request stopped."""
        kept: list[int] = []
        for token_id in new_token_ids:
            request.append_output_token_ids(token_id)
            kept.append(token_id)
            if check_stop(request, self.max_model_len):
                return kept, True  # tokens after the stop are discarded
        return kept, False

    # ------------------------------------------------------------------
    # Requests in and out
    # ------------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request_id {request.request_id!r} is already in the scheduler")
        self._enqueue_waiting_request(request)
        self.requests[request.request_id] = request
        self.trace.queued(request)
        if self.log_stats:
            request.record_event(EngineCoreEventType.QUEUED)

    def finish_requests(
        self, request_ids: str | Iterable[str] | None, finished_status: RequestStatus
    ) -> list[tuple[str, int]]:
        """End requests from outside the step (aborts, ignored prompts).

        Unknown or already-finished ids are skipped. Returns (id, client index)
        of the requests actually finished.
        """
        if not RequestStatus.is_finished(finished_status):
            raise ValueError(f"finished_status must be a FINISHED_* status, got {finished_status}")
        if isinstance(request_ids, str):
            request_ids = (request_ids,)
        elif request_ids is None:
            request_ids = list(self.requests)
        valid: list[Request] = []
        for req_id in dict.fromkeys(request_ids):  # dedupe, keep order
            request = self.requests.get(req_id)
            if request is None or request.is_finished():
                continue
            valid.append(request)
        running = {r for r in valid if r.status == RequestStatus.RUNNING}
        waiting = [r for r in valid if r.status != RequestStatus.RUNNING]
        if running:
            self.running = remove_all(self.running, running)
        if waiting:
            # A waiting request is in one of the two queues; removal from the
            # other is a no-op.
            self.waiting.remove_requests(waiting)
            self.skipped_waiting.remove_requests(waiting)
        for request in valid:
            request.status = finished_status
            self._free_request(request)
        return [(r.request_id, r.client_index) for r in valid]

    def _free_request(self, request: Request) -> None:
        assert request.is_finished()
        self.trace.finished(request)
        self.finished_req_ids.add(request.request_id)
        if self.finished_req_ids_dict is not None:
            self.finished_req_ids_dict[request.client_index].add(request.request_id)
        self.kv_cache_manager.free(request)
        del self.requests[request.request_id]

    # ------------------------------------------------------------------
    # Counters
    # ------------------------------------------------------------------
    @property
    def pause_state(self) -> PauseState:
        return self._pause_state

    def set_pause_state(self, pause_state: PauseState) -> None:
        self._pause_state = pause_state
        self.trace.pause_state_set(pause_state.name)

    def get_num_unfinished_requests(self) -> int:
        """The requests there is work for: a paused scheduler counts only
        those it may still schedule, so a paused engine idles."""
        if self._pause_state == PauseState.PAUSED_ALL:
            return 0
        if self._pause_state == PauseState.PAUSED_NEW:
            return len(self.running)
        return len(self.waiting) + len(self.skipped_waiting) + len(self.running)

    def has_finished_requests(self) -> bool:
        return len(self.finished_req_ids) > 0

    def get_request_counts(self) -> tuple[int, int]:
        """(num_running_reqs, num_waiting_reqs), both waiting queues counted."""
        return len(self.running), len(self.waiting) + len(self.skipped_waiting)

    def make_stats(
        self, spec_decoding_stats: SpecDecodingStats | None = None
    ) -> SchedulerStats | None:
        if not self.log_stats:
            return None
        prefix_cache_stats = self.kv_cache_manager.make_prefix_cache_stats()
        assert prefix_cache_stats is not None
        num_preemptions, self._num_preemptions_this_step = self._num_preemptions_this_step, 0
        return SchedulerStats(
            num_running_reqs=len(self.running),
            num_waiting_reqs=len(self.waiting),
            num_skipped_waiting_reqs=len(self.skipped_waiting),
            step_counter=self.step_counter,
            kv_cache_usage=self.kv_cache_manager.usage,
            prefix_cache_stats=prefix_cache_stats,
            num_preemptions=num_preemptions,
            spec_decoding_stats=spec_decoding_stats,
        )

    def make_spec_decoding_stats(
        self,
        spec_decoding_stats: SpecDecodingStats | None,
        num_draft_tokens: int,
        num_accepted_tokens: int,
    ) -> SpecDecodingStats | None:
        """Count one request's verified drafts into this step's stats."""
        if not self.log_stats:
            return None
        if spec_decoding_stats is None:
            spec_decoding_stats = SpecDecodingStats.new(self.num_spec_tokens)
        spec_decoding_stats.observe_draft(num_draft_tokens, num_accepted_tokens)
        return spec_decoding_stats

    # ------------------------------------------------------------------
    # Cache resets
    # ------------------------------------------------------------------
    def reset_prefix_cache(
        self, reset_running_requests: bool = False, reset_connector: bool = False
    ) -> bool:
        """Forget every cached block hash.

        The block pool refuses while any block is in use, so without
        ``reset_running_requests`` this fails (False) whenever a request is
        running. With it, every running request is preempted first (its KV
        freed, back to waiting to recompute), so the reset succeeds.
        """
        if reset_running_requests:
            self._reset_running_requests()
        reset_successful = self.kv_cache_manager.reset_prefix_cache()
        if reset_running_requests and not reset_successful:
            raise RuntimeError(
                "Failed to reset KV cache even when all the running requests are "
                "preempted and moved to the waiting queue."
            )
        if reset_connector:
            reset_successful = self.reset_connector_cache() and reset_successful
        return reset_successful

    def _reset_running_requests(self) -> None:
        """Preempt every running request (for ``reset_prefix_cache``)."""
        timestamp = time.monotonic()
        # From the tail: each goes to the front of waiting, so they come back
        # in their running order.
        while self.running:
            request = self.running.pop()
            self._preempt_request(request, timestamp)
            # Async scheduling: the frames of the steps in flight now carry
            # tokens of a computation that will be redone; drop them on arrival.
            request.async_tokens_to_discard = request.num_output_placeholders
            request.num_output_placeholders = 0
            self.trace.preempted_for_reset(request)
        # Their next schedule must send the worker everything again.
        self.prev_step_scheduled_req_ids.clear()

    def reset_connector_cache(self) -> bool:
        # No KV connector: nothing to reset, which counts as success (so that
        # reset_prefix_cache(reset_connector=True) reports the local reset).
        assert self.connector is None
        return True
