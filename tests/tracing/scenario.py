"""A scripted engine run for the tracing tests, and helpers to compare the
replay model with a live engine.

The run (block size 4, a 16-token step budget, a pool of 16 blocks) is built
so that every path the trace must show happens at least once:

  * several concurrent requests, two sharing a 10-token prefix -> prefix hits;
  * a 30-token prompt -> chunked prefill over several steps;
  * the pool runs dry while requests decode -> preemption (and recompute);
  * one request is aborted through ``LLMEngine.abort_request``;
  * one request ends on a stop string (found by the front end);
  * late requests reuse the freed, still-cached prefix blocks (a prefix hit on
    blocks sitting in the free queue) and evict cached blocks when the pool
    is reused.

With ``CountingExecutor`` (next token = last token + 1) the outputs are known.

Ids: the scenario sends its requests as "a", "b", "long", ...; the engine,
and so every event, knows each by an internal id (``"long-1f0c9a2e"``).
``internal_ids`` reads the mapping from the trace's ``request.added`` events.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from typing import Any

from engine.engine.arg_utils import EngineArgs
from engine.sampling_params import SamplingParams
from engine.tracing import EngineState, TraceReplay
from engine.v1.core.kv_cache_utils import get_block_hash
from engine.v1.core.sched.scheduler import Scheduler
from engine.v1.engine.llm_engine import LLMEngine
from tests.helpers.counting_executor import CountingExecutor
from tests.helpers.engine_fixtures import ids

BLOCK_SIZE = 4
SCENARIO_ENGINE_ARGS: dict[str, Any] = dict(
    block_size=BLOCK_SIZE,
    num_gpu_blocks_override=16,
    max_num_batched_tokens=16,
    max_num_seqs=4,
    max_model_len=48,
)
# A random Llama with the tiny checkpoint's shapes (its config lacks an MLP width).
REAL_MODEL_ARGS: dict[str, Any] = dict(
    load_format="dummy",
    device="cpu",
    dtype="float32",
    hf_overrides={"intermediate_size": 32},
)


def words(start: int, n: int) -> str:
    return " ".join(f"w{i}" for i in range(start, start + n))


SHARED_PREFIX = words(0, 10)


def internal_ids(events: Iterable[Any]) -> dict[str, str]:
    """The id each request was sent under -> the internal id the engine gave
    it, from ``request.added`` (the scenario sends each id once, no
    ``n > 1``). Checks each internal id is the sent id, ``-`` and 8 hex digits."""
    ids: dict[str, str] = {}
    for e in events:
        if e.kind == "request.added":
            assert e.external_req_id not in ids, f"{e.external_req_id} sent twice"
            assert re.fullmatch(rf"{re.escape(e.external_req_id)}-[0-9a-f]{{8}}", e.request_id), e
            ids[e.external_req_id] = e.request_id
    return ids


def make_engine(
    model_dir, trace_path=None, trace_level="off", real_model=False, **kwargs
) -> LLMEngine:
    """An in-process ``LLMEngine`` (the scheduler is reachable) over the tiny model."""
    engine_kwargs = dict(SCENARIO_ENGINE_ARGS)
    engine_kwargs.update(
        REAL_MODEL_ARGS if real_model else {"distributed_executor_backend": CountingExecutor}
    )
    engine_kwargs.update(kwargs)
    args = EngineArgs(
        model=str(model_dir), trace_path=trace_path, trace_level=trace_level, **engine_kwargs
    )
    return LLMEngine.from_engine_args(args, enable_multiprocessing=False)


def scheduler_of(engine: LLMEngine) -> Scheduler:
    return engine.engine_core.engine_core.scheduler


def params(max_tokens: int, real_model: bool, **kwargs) -> SamplingParams:
    kwargs.setdefault("temperature", 0.0)
    if real_model:
        # Random weights may sample EOS at any time; keep lengths predictable.
        kwargs.setdefault("ignore_eos", True)
    return SamplingParams(max_tokens=max_tokens, **kwargs)


def run_scenario(
    engine: LLMEngine,
    real_model: bool = False,
    after_each_change: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Drive ``engine`` through the scripted run; returns the final outputs by
    request id. ``after_each_change(label)`` is called after every step and
    after every add / abort done between steps."""
    check = after_each_change or (lambda label: None)
    finished: dict[str, Any] = {}

    def add(rid: str, prompt: str, sp: SamplingParams) -> None:
        engine.add_request(rid, {"prompt_token_ids": ids(prompt)}, sp)
        check(f"add {rid}")

    def step(label: str) -> None:
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
        check(label)

    check("start")
    add("a", SHARED_PREFIX, params(6, real_model))
    add("b", SHARED_PREFIX + " w30", params(6, real_model))
    add("long", words(10, 30), params(4, real_model))
    stop = {} if real_model else {"stop": ["w45"]}
    add("stop", "w40 w41", params(12, real_model, **stop))
    add("doomed", "w50 w51 w52", params(20, real_model))
    for i in range(2):
        step(f"step {i + 1}")
    engine.abort_request(["doomed"])
    check("abort doomed")
    n = 2
    while engine.has_unfinished_requests() and n < 60:
        n += 1
        step(f"step {n}")
        if n == 6:
            # The shared prefix again: its blocks may sit in the free queue by now.
            add("c", SHARED_PREFIX + " w31 w32", params(5, real_model))
            add("d", SHARED_PREFIX, params(3, real_model))
    # One last step tells the worker which requests finished.
    step("final")
    return finished


def record_scenario(
    model_dir, trace_path: str, trace_level: str, real_model: bool = False, **engine_kwargs
):
    """Run the scripted scenario on a fresh engine tracing to ``trace_path``;
    returns ``run_scenario``'s outputs (the engine is shut down either way)."""
    engine = make_engine(model_dir, trace_path, trace_level, real_model=real_model, **engine_kwargs)
    try:
        return run_scenario(engine, real_model=real_model)
    finally:
        engine.shutdown()


def replay_scenario_against_live_engine(
    model_dir, trace_path: str, real_model: bool = False, **engine_kwargs
) -> list[str]:
    """Run the scripted scenario at ``lifecycle`` and, after every step and
    every add / abort, rebuild the state from the trace written so far and
    compare it with the live scheduler and BlockPool. Returns the labels
    checked."""
    engine = make_engine(model_dir, trace_path, "lifecycle", real_model=real_model, **engine_kwargs)
    scheduler = scheduler_of(engine)
    checked: list[str] = []

    def compare(label: str) -> None:
        engine.tracer.flush()
        replay = TraceReplay(trace_path, snapshot_interval=4)
        assert replay.last_step == scheduler.step_counter
        assert_replay_matches_engine(replay.state_at(replay.last_step), scheduler, label)
        checked.append(label)

    try:
        run_scenario(engine, real_model=real_model, after_each_change=compare)
    finally:
        engine.shutdown()
    return checked


def assert_replay_matches_engine(state: EngineState, scheduler: Scheduler, label: str = "") -> None:
    """The replayed scheduler and KV state equals the live one, field by field."""
    where = f" ({label})" if label else ""
    pool = scheduler.kv_cache_manager.block_pool
    manager = scheduler.kv_cache_manager.coordinator.single_type_managers[0]
    assert state.num_blocks == pool.num_gpu_blocks, where
    live_free = [b.block_id for b in pool.free_block_queue.get_all_free_blocks()]
    assert state.free_queue == live_free, f"free queue differs{where}"
    assert state.num_free_blocks == pool.get_num_free_blocks(), where
    live_owners: dict[int, list[str]] = {b.block_id: [] for b in pool.blocks}
    for rid, blocks in manager.req_to_blocks.items():
        for b in blocks:
            live_owners[b.block_id].append(rid)
    for block in pool.blocks:
        replayed = state.block(block.block_id)
        assert replayed.ref_cnt == block.ref_cnt, f"block {block.block_id} ref_cnt{where}"
        live_hash = get_block_hash(block.block_hash).hex() if block.block_hash is not None else None
        assert replayed.block_hash == live_hash, f"block {block.block_id} hash{where}"
        assert sorted(replayed.owners) == sorted(live_owners[block.block_id]), (
            f"block {block.block_id} owners{where}"
        )
        assert replayed.is_null == block.is_null, where
    live_cached: dict[str, list[int]] = {}
    for key, entry in pool.cached_block_hash_to_block._cache.items():
        blocks = [entry] if not isinstance(entry, dict) else list(entry.values())
        live_cached[get_block_hash(key).hex()] = sorted(b.block_id for b in blocks)
    assert {h: sorted(v) for h, v in state.cached.items()} == live_cached, (
        f"prefix-cache map{where}"
    )
    assert state.running == [r.request_id for r in scheduler.running], f"running{where}"
    assert state.waiting == [r.request_id for r in scheduler.waiting], f"waiting{where}"
    live = scheduler.requests
    assert set(state.unfinished_requests()) == set(live), f"live requests{where}"
    for rid, request in live.items():
        r = state.requests[rid]
        assert r.status == request.status.name, f"{rid} status{where}"
        assert r.num_computed_tokens == request.num_computed_tokens, f"{rid} cursor{where}"
        assert r.num_tokens == request.num_tokens, f"{rid} num_tokens{where}"
        assert r.num_output_tokens == request.num_output_tokens, where
        assert r.num_preemptions == request.num_preemptions, where
        # Async scheduling: the tokens still coming from steps in flight.
        assert r.num_output_placeholders == request.num_output_placeholders, (
            f"{rid} placeholders{where}"
        )
        assert r.async_tokens_to_discard == request.async_tokens_to_discard, where
        assert r.block_ids == [b.block_id for b in manager.req_to_blocks.get(rid, [])], (
            f"{rid} block table{where}"
        )
