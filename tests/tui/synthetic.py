"""A synthetic trace of any length, for the TUI's speed tests.

It plays a simple FCFS scheduler (no prefix caching, no chunking, whole
prompts in one step, one decode token per step) and writes the events the
engine would write for it -- ``kv.init``, ``sched.queued``, ``kv.allocated``,
``sched.admitted``, ``sched.step``, ``runner.batch``, ``sampler.sampled``,
``sched.update``, ``sched.finished``, ``kv.freed`` -- in the engine's order,
so the replay model accepts it (it checks every allocation against its free
queue and every queue length against ``sched.step``). The events are the
typed classes of ``engine.tracing``; the file holds them as JSON lines.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import msgspec

from engine.tracing import (
    EngineConfig,
    EngineState,
    KVAllocated,
    KVFreed,
    KVInit,
    RunnerBatch,
    SamplerSampled,
    SchedAdmitted,
    SchedFinished,
    SchedQueued,
    SchedStep,
    SchedUpdate,
    TraceEvent,
)


def synthetic_events(
    num_steps: int, num_blocks: int = 64, block_size: int = 16, max_running: int = 4, seed: int = 0
) -> list[TraceEvent]:
    rng = random.Random(seed)
    events: list[TraceEvent] = []
    state = EngineState()  # tracks the free queue so allocations pop its head
    seq = 0

    def emit(cls: type[TraceEvent], step: int | None, **fields: Any) -> None:
        nonlocal seq
        seq += 1
        e = cls(ts=1_000_000 + seq * 1000, pid=7, seq=seq, step=step, **fields)
        events.append(e)
        state.apply(e)

    emit(
        EngineConfig,
        None,
        max_num_seqs=max_running,
        max_num_batched_tokens=256,
        max_model_len=128,
        enable_chunked_prefill=True,
        long_prefill_token_threshold=0,
        policy="fcfs",
        block_size=block_size,
        enable_prefix_caching=False,
        num_gpu_blocks=num_blocks,
    )
    emit(
        KVInit,
        None,
        num_blocks=num_blocks,
        block_size=block_size,
        null_block_id=0,
        enable_caching=False,
    )
    lengths: dict[str, tuple[int, int]] = {}
    counter = 0

    def add_request(step: int | None) -> None:
        nonlocal counter
        rid = f"s{counter}"
        counter += 1
        prompt, out = rng.randint(8, 40), rng.randint(3, 40)
        lengths[rid] = (prompt, out)
        emit(
            SchedQueued,
            step,
            request_id=rid,
            num_prompt_tokens=prompt,
            max_tokens=out,
            priority=0,
            arrival_time=float(counter),
            num_block_hashes=0,
        )

    for _ in range(6):
        add_request(None)
    for step in range(1, num_steps + 1):
        scheduled: dict[str, int] = {}
        new_ids: list[str] = []
        for rid in list(state.running):
            req = state.requests[rid]
            if req.num_computed_tokens + 1 > len(req.block_ids) * block_size:
                emit(
                    KVAllocated,
                    step,
                    request_id=rid,
                    block_ids=[state.free_queue[0]],
                    num_blocks=len(req.block_ids) + 1,
                )
            scheduled[rid] = 1
        while state.waiting and len(state.running) < max_running:
            rid = state.waiting[0]
            prompt, _ = lengths[rid]
            need = -(-prompt // block_size)
            if need > state.num_free_blocks:
                break
            emit(
                KVAllocated,
                step,
                request_id=rid,
                block_ids=state.free_queue[:need],
                num_blocks=need,
            )
            emit(
                SchedAdmitted,
                step,
                request_id=rid,
                resumed=False,
                num_computed_tokens=0,
                num_new_tokens=prompt,
                num_tokens=prompt,
            )
            scheduled[rid] = prompt
            new_ids.append(rid)
        emit(
            SchedStep,
            step,
            token_budget=256,
            token_budget_left=256 - sum(scheduled.values()),
            num_scheduled_tokens=scheduled,
            total_num_scheduled_tokens=sum(scheduled.values()),
            new_req_ids=new_ids,
            resumed_req_ids=[],
            running_req_ids=[r for r in scheduled if r not in new_ids],
            preempted_req_ids=[],
            finished_req_ids=[],
            num_running=len(state.running),
            num_waiting=len(state.waiting),
            num_common_prefix_blocks=[0],
            kv_cache_usage=state.kv_cache_usage,
            duration_ns=50_000,
        )
        rows = list(scheduled)
        if rows:
            reqs = [state.requests[r] for r in rows]
            emit(
                RunnerBatch,
                step,
                num_reqs=len(rows),
                num_tokens=sum(scheduled.values()),
                num_tokens_padded=sum(scheduled.values()),
                attn_backend="CPU_ATTN",
                cudagraph_mode="NONE",
                req_ids=rows,
                query_lens=[scheduled[r] for r in rows],
                num_computed_tokens=[q.num_computed_tokens - scheduled[q.request_id] for q in reqs],
                seq_lens=[q.num_computed_tokens for q in reqs],
                slot_mapping=[[] for _ in rows],
                discard_req_ids=[],
                max_query_len=1,
                max_seq_len=1,
            )
        new_tokens = {r: [rng.randint(3, 200)] for r in rows}
        for i, r in enumerate(rows):
            emit(
                SamplerSampled,
                step,
                request_id=r,
                row=i,
                token_id=new_tokens[r][0],
                logprob=-0.5,
                greedy=True,
            )
        finished = {}
        for r in rows:
            req = state.requests[r]
            if req.num_output_tokens + 1 >= lengths[r][1]:
                finished[r] = "length"
        for r in finished:
            req = state.requests[r]
            emit(
                SchedFinished,
                step,
                request_id=r,
                status="FINISHED_LENGTH_CAPPED",
                finish_reason="length",
                stop_reason=None,
                num_prompt_tokens=lengths[r][0],
                num_output_tokens=lengths[r][1],
                num_cached_tokens=0,
                num_preemptions=0,
            )
            blocks = list(reversed(req.block_ids))
            emit(KVFreed, step, request_id=r, block_ids=blocks, to_free_queue=blocks)
        emit(
            SchedUpdate,
            step,
            new_token_ids=new_tokens,
            finished=finished,
            num_running=len(state.running),
            num_waiting=len(state.waiting),
            duration_ns=20_000,
        )
        while len(state.waiting) < 3:
            add_request(step)
    return events


def write_synthetic_trace(path: Path, num_steps: int, **kwargs: Any) -> Path:
    """The trace as JSON lines, as the engine's tracer writes them."""
    events = synthetic_events(num_steps, **kwargs)
    path.write_bytes(msgspec.json.Encoder().encode_lines(events))
    return path
