"""The trace objects of the engine core's bookkeeping: the scheduler and the KV cache.

vLLM twin: none; the pattern is vLLM's ``KVCacheMetricsCollector``, which
``BlockPool`` receives at construction and calls at a few points. The
scheduler (``engine/v1/core/sched/scheduler.py``) holds a ``SchedulerTrace``;
its KV cache manager, coordinator, single-type managers and block pool share
the ``KVCacheTrace`` it hands down; the ``StructuredOutputManager``
(``engine/v1/structured_output/__init__.py``) and the scheduler's grammar
bookkeeping call a ``StructuredOutputTrace``. Each method is one named point
of those files and builds the event(s) of ``events.py`` from what it is
given. No torch here: ``engine/v1/core`` imports this module.

Sessions: 02 (scheduler), 03 (KV cache), 06 (structured outputs).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from engine.tracing.events import (
    EngineConfig,
    GrammarAdvanced,
    GrammarBitmask,
    GrammarCompiled,
    GrammarCompileStarted,
    GrammarReady,
    GrammarRolledBack,
    KVAllocated,
    KVAllocationFailed,
    KVCached,
    KVCacheHit,
    KVCacheReset,
    KVEvicted,
    KVFreed,
    KVInit,
    KVTouched,
    SchedAdmitted,
    SchedFinished,
    SchedPause,
    SchedPreempted,
    SchedQueued,
    SchedStep,
    SchedUpdate,
    SpecVerified,
)
from engine.tracing.tracer import SubsystemTrace, Tracer

# The host objects are duck-typed (this package imports no engine module):
# ``request`` is a ``Request``, ``block`` a ``KVCacheBlock``, ``scheduler`` a
# ``Scheduler``, ``block_pool`` a ``BlockPool``.


class KVCacheTrace(SubsystemTrace):
    """Events of ``BlockPool``, ``KVCacheManager`` and the single-type managers."""

    def pool_created(self, block_pool: Any) -> None:
        self.tracer.record(
            KVInit(
                num_blocks=block_pool.num_gpu_blocks,
                block_size=block_pool.hash_block_size,
                null_block_id=block_pool.null_block.block_id,
                enable_caching=block_pool.enable_caching,
            )
        )

    def cached(
        self,
        request: Any,
        blocks: Sequence[Any],
        num_cached_blocks: int,
        num_full_blocks: int,
        kv_cache_group_id: int,
    ) -> None:
        """``blocks[num_cached_blocks:num_full_blocks]`` were just added to the
        prefix-cache map (null blocks are never cached)."""
        record, request_id = self.tracer.record, request.request_id
        for i in range(num_cached_blocks, num_full_blocks):
            if not blocks[i].is_null:
                # The block's key minus its 4-byte group id: right even when
                # the block size is a multiple of the hash block size.
                block_hash = blocks[i].block_hash[:-4].hex()
                record(
                    KVCached(
                        block_id=blocks[i].block_id,
                        block_hash=block_hash,
                        kv_cache_group_id=kv_cache_group_id,
                        request_id=request_id,
                        block_index=i,
                    )
                )

    def evicted(self, block: Any, block_hash: bytes, kv_cache_group_id: int) -> None:
        self.tracer.record(
            KVEvicted(
                block_id=block.block_id,
                block_hash=block_hash.hex(),
                kv_cache_group_id=kv_cache_group_id,
            )
        )

    def cache_reset(self) -> None:
        self.tracer.record(KVCacheReset())

    def cache_hit(self, request: Any, hit_blocks: Sequence[Sequence[Any]], num_tokens: int) -> None:
        """The prefix-cache lookup of ``get_computed_blocks`` (one group)."""
        self.tracer.record(
            KVCacheHit(
                request_id=request.request_id,
                num_cached_tokens=num_tokens,
                block_ids=[b.block_id for b in hit_blocks[0]],
                num_tokens=request.num_tokens,
                num_block_hashes=len(request.block_hashes),
            )
        )

    def allocation_failed(
        self, manager: Any, request: Any, num_new_tokens: int, num_blocks_needed: int
    ) -> None:
        """``manager`` (a ``KVCacheManager``) could not place ``num_new_tokens``."""
        self.tracer.record(
            KVAllocationFailed(
                request_id=request.request_id,
                num_new_tokens=num_new_tokens,
                num_blocks_needed=num_blocks_needed,
                num_free_blocks=manager.block_pool.get_num_free_blocks(),
            )
        )

    def touched(self, request_id: str, blocks: Sequence[Any]) -> None:
        """A request adopted prefix-hit ``blocks`` (after ``BlockPool.touch``)."""
        if blocks:
            self.tracer.record(
                KVTouched(
                    request_id=request_id,
                    block_ids=[b.block_id for b in blocks],
                    ref_cnts=[b.ref_cnt for b in blocks],
                )
            )

    def allocated(
        self, request_id: str, new_blocks: Sequence[Any], req_blocks: Sequence[Any]
    ) -> None:
        self.tracer.record(
            KVAllocated(
                request_id=request_id,
                block_ids=[b.block_id for b in new_blocks],
                num_blocks=len(req_blocks),
            )
        )

    def freed(self, request_id: str, req_blocks: Sequence[Any]) -> None:
        """A request's blocks went back, tail first (after ``BlockPool.free_blocks``)."""
        if req_blocks:
            released = req_blocks[::-1]
            self.tracer.record(
                KVFreed(
                    request_id=request_id,
                    block_ids=[b.block_id for b in released],
                    to_free_queue=[
                        b.block_id for b in released if b.ref_cnt == 0 and not b.is_null
                    ],
                )
            )


class StructuredOutputTrace(SubsystemTrace):
    """Events of ``StructuredOutputManager`` (compiles run on its thread
    pool, so ``grammar_compiled`` is called from a compile thread) and of the
    scheduler's grammar bookkeeping (it holds this object as
    ``SchedulerTrace.structured_output``)."""

    def compile_started(self, request: Any, grammar_kind: str) -> None:
        self.tracer.record(
            GrammarCompileStarted(request_id=request.request_id, grammar_kind=grammar_kind)
        )

    def grammar_compiled(
        self, request_id: str, grammar_kind: str, seconds: float, cache_hit: bool, error: str = ""
    ) -> None:
        self.tracer.record(
            GrammarCompiled(
                request_id=request_id,
                grammar_kind=grammar_kind,
                compile_s=seconds,
                cache_hit=cache_hit,
                error=error,
            )
        )

    def grammar_ready(self, request: Any) -> None:
        self.tracer.record(GrammarReady(request_id=request.request_id))

    def bitmask_filled(
        self, request_ids: list[str], num_rows: list[int], bitmask: Any, vocab_size: int
    ) -> None:
        """``bitmask``: the int32 rows just written (a tensor), in order. The
        rows are for the step ``schedule()`` built last: with async
        scheduling a deferred step's are filled after the previous step's
        update (``tracer.step`` is that step's again)."""
        first_rows, row = [], 0
        for n in num_rows:
            first_rows.append(row)
            row += n
        rows = bitmask.numpy()[first_rows].view("uint8")
        # Bits set = tokens allowed; an all-ones row also sets the padding bits.
        num_allowed = [min(int(c), vocab_size) for c in _popcount(rows)]
        self.tracer.record(
            GrammarBitmask(
                step=self.tracer.scheduled_step,
                request_ids=list(request_ids),
                num_rows=list(num_rows),
                num_allowed=num_allowed,
                vocab_size=vocab_size,
            )
        )

    def rolled_back(self, request_id: str, num_tokens: int) -> None:
        """While the bitmask rows of the step ``schedule()`` built last are filled."""
        self.tracer.record(
            GrammarRolledBack(
                step=self.tracer.scheduled_step, request_id=request_id, num_tokens=num_tokens
            )
        )

    def advanced(self, request: Any, token_ids: list[int]) -> None:
        grammar = request.structured_output_request.grammar
        self.tracer.record(
            GrammarAdvanced(
                request_id=request.request_id,
                token_ids=list(token_ids),
                num_processed_tokens=grammar.num_processed_tokens,
                terminated=grammar.is_terminated(),
            )
        )


class SchedulerTrace(SubsystemTrace):
    """Events of ``Scheduler``; ``kv_cache`` is the trace its KV cache manager gets."""

    def __init__(self, tracer: Tracer) -> None:
        super().__init__(tracer)
        self.kv_cache = KVCacheTrace.create(tracer)
        self.structured_output = StructuredOutputTrace.create(tracer)
        self._update_start_ns = 0
        # Request id -> its PrefillStats.num_cached_tokens, noted at admission:
        # the request gives its PrefillStats away with its first output.
        self._num_cached_tokens: dict[str, int] = {}

    def created(self, scheduler: Any) -> None:
        """``engine.config``: the settings a replay needs."""
        sc = scheduler.scheduler_config
        self.tracer.record(
            EngineConfig(
                max_num_seqs=sc.max_num_seqs,
                max_num_batched_tokens=scheduler.max_num_scheduled_tokens,
                max_model_len=scheduler.max_model_len,
                enable_chunked_prefill=sc.enable_chunked_prefill,
                long_prefill_token_threshold=sc.long_prefill_token_threshold,
                policy=scheduler.policy.value,
                block_size=scheduler.block_size,
                enable_prefix_caching=scheduler.cache_config.enable_prefix_caching,
                num_gpu_blocks=scheduler.kv_cache_config.num_blocks,
                async_scheduling=bool(sc.async_scheduling),
            )
        )

    def pause_state_set(self, state: str) -> None:
        """``sched.pause``: ``pause_generation`` / ``resume_generation`` reached the scheduler."""
        self.tracer.record(SchedPause(state=state))

    def step_started(self, step: int) -> None:
        """Events from here until the next ``schedule()`` belong to ``step``."""
        self.tracer.set_step(step)
        self.tracer.scheduled_step = step

    def queued(self, request: Any) -> None:
        self.tracer.record(
            SchedQueued(
                request_id=request.request_id,
                num_prompt_tokens=request.num_prompt_tokens,
                max_tokens=request.max_tokens,
                priority=request.priority,
                arrival_time=request.arrival_time,
                num_block_hashes=len(request.block_hashes),
            )
        )

    def preempted(self, preempted_req: Any, request: Any) -> None:
        """``preempted_req`` lost its blocks so that ``request`` could run."""
        self.tracer.record(
            SchedPreempted(
                request_id=preempted_req.request_id,
                for_request_id=request.request_id,
                num_tokens=preempted_req.num_tokens,
                num_output_tokens=preempted_req.num_output_tokens,
                num_preemptions=preempted_req.num_preemptions,
            )
        )

    def preempted_for_reset(self, request: Any) -> None:
        """``reset_prefix_cache(reset_running_requests=True)`` preempted
        ``request``: no other request needed its blocks (``for_request_id``
        is empty)."""
        self.tracer.record(
            SchedPreempted(
                request_id=request.request_id,
                for_request_id="",
                num_tokens=request.num_tokens,
                num_output_tokens=request.num_output_tokens,
                num_preemptions=request.num_preemptions,
            )
        )

    def drafts_verified(self, request: Any, draft_token_ids: list[int], token_ids: list[int]):
        """``spec.verified``: ``token_ids`` came back for ``draft_token_ids``;
        the request's cursor has been rolled back already."""
        num_accepted = len(token_ids) - 1
        self.tracer.record(
            SpecVerified(
                request_id=request.request_id,
                draft_token_ids=list(draft_token_ids),
                num_accepted=num_accepted,
                token_ids=list(token_ids),
                num_rejected=len(draft_token_ids) - num_accepted,
                num_computed_tokens=request.num_computed_tokens,
            )
        )

    def admitted(self, request: Any, num_new_tokens: int) -> None:
        """A waiting request joined the running list (after its cursor was set).
        One that was preempted before is resumed: a fresh one has none."""
        if request.prefill_stats is not None:  # not yet sent with a first output
            self._num_cached_tokens[request.request_id] = request.prefill_stats.num_cached_tokens
        self.tracer.record(
            SchedAdmitted(
                request_id=request.request_id,
                resumed=request.num_preemptions > 0,
                num_computed_tokens=request.num_computed_tokens,
                num_new_tokens=num_new_tokens,
                num_tokens=request.num_tokens,
            )
        )

    def scheduled(
        self, scheduler: Any, scheduler_output: Any, token_budget: int, started: float
    ) -> None:
        """``sched.step``, at the end of ``schedule()``; ``started`` is its
        ``time.monotonic()`` at the start."""
        cached = scheduler_output.scheduled_cached_reqs
        resumed = cached.resumed_req_ids
        self.tracer.record(
            SchedStep(
                token_budget=scheduler.max_num_scheduled_tokens,
                token_budget_left=token_budget,
                num_scheduled_tokens=scheduler_output.num_scheduled_tokens,
                total_num_scheduled_tokens=scheduler_output.total_num_scheduled_tokens,
                new_req_ids=[r.req_id for r in scheduler_output.scheduled_new_reqs],
                resumed_req_ids=[r for r in cached.req_ids if r in resumed],
                running_req_ids=[r for r in cached.req_ids if r not in resumed],
                preempted_req_ids=sorted(scheduler_output.preempted_req_ids),
                finished_req_ids=sorted(scheduler_output.finished_req_ids),
                num_running=len(scheduler.running),
                num_waiting=len(scheduler.waiting),
                num_skipped_waiting=len(getattr(scheduler, "skipped_waiting", ())),
                num_common_prefix_blocks=scheduler_output.num_common_prefix_blocks,
                kv_cache_usage=scheduler.kv_cache_manager.usage,
                duration_ns=int((time.monotonic() - started) * 1e9),
                scheduled_spec_decode_tokens=scheduler_output.scheduled_spec_decode_tokens,
                num_lookahead_tokens=scheduler.num_lookahead_tokens,
            )
        )

    def update_started(self, step: int) -> None:
        """``update_from_output()`` of ``step`` begins; with async scheduling
        the next step was scheduled meanwhile, so its events are ``step``'s again."""
        self.tracer.set_step(step)
        self._update_start_ns = time.perf_counter_ns()

    def updated(self, scheduler: Any, outputs: dict[int, list[Any]]) -> None:
        """``sched.update``, at the end of ``update_from_output()``: ``outputs``
        maps client index -> its ``EngineCoreOutput`` list."""
        new_token_ids, finished = {}, {}
        for outs in outputs.values():
            for o in outs:
                if o.new_token_ids:
                    new_token_ids[o.request_id] = o.new_token_ids
                if o.finish_reason is not None:
                    finished[o.request_id] = str(o.finish_reason)
        self.tracer.record(
            SchedUpdate(
                new_token_ids=new_token_ids,
                finished=finished,
                num_running=len(scheduler.running),
                num_waiting=len(scheduler.waiting),
                num_skipped_waiting=len(getattr(scheduler, "skipped_waiting", ())),
                duration_ns=time.perf_counter_ns() - self._update_start_ns,
            )
        )

    def finished(self, request: Any) -> None:
        self.tracer.record(
            SchedFinished(
                request_id=request.request_id,
                status=request.status.name,
                finish_reason=str(request.get_finished_reason()),
                stop_reason=request.stop_reason,
                num_prompt_tokens=request.num_prompt_tokens,
                num_output_tokens=request.num_output_tokens,
                num_cached_tokens=self._num_cached_tokens.pop(request.request_id, 0),
                num_preemptions=request.num_preemptions,
            )
        )


__all__ = ["KVCacheTrace", "SchedulerTrace", "StructuredOutputTrace"]


def _popcount(rows: Any) -> Any:
    """Set bits per row of a uint8 array (numpy; no torch here)."""
    import numpy as np

    return np.unpackbits(rows, axis=1).sum(axis=1)
