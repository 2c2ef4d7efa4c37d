"""The replay model against the live engine: after every step (and every
add / abort in between) of the scripted run, the KV state, queues and
requests rebuilt from the trace equal the engine's own objects.

Twin of nothing in vLLM; it checks ``engine/tracing/replay.py`` against
``engine/v1/core/`` (block_pool, single_type_kv_cache_manager, scheduler).
"""

from __future__ import annotations

import pytest

from engine.tracing import TraceReplay, load_trace
from tests.helpers.engine_fixtures import ids
from tests.tracing.scenario import (
    SHARED_PREFIX,
    assert_replay_matches_engine,
    make_engine,
    params,
    replay_scenario_against_live_engine,
    run_scenario,
    scheduler_of,
)


@pytest.mark.parametrize(
    ("real_model", "async_scheduling"),
    [(False, False), (True, True), (True, False)],
    ids=["counting", "tiny-llama-async", "tiny-llama-sync"],
)
def test_replay_equals_live_block_pool_after_every_step(
    tiny_model_dir, tmp_path, real_model, async_scheduling
):
    """The counting executor cannot schedule asynchronously; the tiny model
    runs both loops. With async scheduling step n's update is written after
    step n+1's schedule, and the replay must still equal the engine after
    every step, placeholders included."""
    trace = str(tmp_path / "run.jsonl")
    kwargs = {"async_scheduling": False} if real_model and not async_scheduling else {}
    checked = replay_scenario_against_live_engine(
        tiny_model_dir, trace, real_model=real_model, **kwargs
    )
    assert sum(label.startswith("step") for label in checked) >= 10

    # The run really went through every path the replay must model.
    events = load_trace(trace)
    kinds = [e.kind for e in events]
    for kind in ("sched.preempted", "kv.evicted", "kv.touched", "kv.freed", "kv.cached"):
        assert kind in kinds, kind
    (config,) = [e for e in events if e.kind == "engine.config"]
    assert config.async_scheduling is async_scheduling
    replay = TraceReplay(events)
    placeholders = [
        r.num_output_placeholders for s in replay.iter_states() for r in s.requests.values()
    ]
    assert (max(placeholders) > 0) is async_scheduling


def test_replay_random_access_equals_forward_pass(tiny_model_dir, tmp_path):
    trace = str(tmp_path / "run.jsonl")
    engine = make_engine(tiny_model_dir, trace, "lifecycle")
    try:
        run_scenario(engine)
    finally:
        engine.shutdown()
    dense = TraceReplay(trace, snapshot_interval=1)
    sparse = TraceReplay(trace, snapshot_interval=7)
    forward = [
        (
            s.step,
            list(s.waiting),
            list(s.running),
            list(s.ref_cnt),
            s.free_queue,
            {h: list(v) for h, v in s.cached.items()},
        )
        for s in dense.iter_states()
    ]
    # Backwards, so every lookup starts from a snapshot, not from the last one.
    for step in reversed(sparse.steps):
        s = sparse.state_at(step)
        assert (s.step, s.waiting, s.running, s.ref_cnt, s.free_queue, s.cached) == forward[step]
    # A returned state is a private copy.
    s = sparse.state_at(3)
    s.waiting.append("intruder")
    s.ref_cnt[1] += 5
    assert "intruder" not in sparse.state_at(3).waiting
    assert sparse.state_at(3).ref_cnt[1] == forward[3][3][1]


@pytest.mark.parametrize("real_model", [False, True], ids=["counting-sync", "tiny-llama-async"])
def test_replay_follows_a_reset_that_preempts_the_running_requests(
    tiny_model_dir, tmp_path, real_model
):
    """``reset_prefix_cache(reset_running_requests=True)`` preempts every
    running request (from the tail: ``sched.preempted`` with no
    ``for_request_id``), then forgets every hash (``kv.cache_reset``); the
    replay follows and still equals the engine, to the end of the run. With
    async scheduling a step is in flight at the reset: its frames for the
    preempted requests are dropped (``async_tokens_to_discard``)."""
    trace = str(tmp_path / "reset.jsonl")
    engine = make_engine(tiny_model_dir, trace, "lifecycle", real_model=real_model)
    scheduler = scheduler_of(engine)
    try:
        for name, prompt in (("x", SHARED_PREFIX), ("y", SHARED_PREFIX + " w30")):
            engine.add_request(name, {"prompt_token_ids": ids(prompt)}, params(6, real_model))
        engine.step()
        engine.step()
        running = [r.request_id for r in scheduler.running]
        assert len(running) == 2
        assert scheduler.reset_prefix_cache(reset_running_requests=True)
        engine.tracer.flush()
        replay = TraceReplay(trace)
        state = replay.state_at(replay.last_step)
        assert_replay_matches_engine(state, scheduler, "after the reset")
        assert state.running == [] and state.waiting == running and state.cached == {}
        discards = [state.requests[rid].async_tokens_to_discard for rid in running]
        assert discards == ([1, 1] if real_model else [0, 0])
        preempted = [e for e in replay.events if e.kind == "sched.preempted"]
        assert [e.request_id for e in preempted] == running[::-1]
        assert all(e.for_request_id == "" for e in preempted)
        kinds = [e.kind for e in replay.events]
        assert kinds.index("kv.cache_reset") > max(
            i for i, k in enumerate(kinds) if k == "sched.preempted"
        )
        while engine.has_unfinished_requests():
            engine.step()
        engine.tracer.flush()
        replay = TraceReplay(trace)
        assert_replay_matches_engine(replay.state_at(replay.last_step), scheduler, "the end")
        assert all(r.num_preemptions == 1 for r in replay.final_state.requests.values())
    finally:
        engine.shutdown()
