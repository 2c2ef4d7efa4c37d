"""The replay model's API (engine/tracing/replay.py) beyond the live
comparison: step views, the batch layout it derives when no runner traced
the step, the priority queue, and the errors it raises on a trace that
contradicts it."""

from __future__ import annotations

import copy

import msgspec
import msgspec.structs
import pytest

from engine.sampling_params import SamplingParams
from engine.tracing import ReplayError, TraceReplay, load_trace
from tests.helpers.engine_fixtures import ids
from tests.tracing.scenario import (
    assert_replay_matches_engine,
    make_engine,
    record_scenario,
    scheduler_of,
)


@pytest.fixture(scope="module")
def real_trace(tiny_model_dir, tmp_path_factory):
    trace = str(tmp_path_factory.mktemp("replay-model") / "run.jsonl")
    record_scenario(tiny_model_dir, trace, "lifecycle", real_model=True)
    return trace


def _by_request(slot) -> str:
    return slot.request_id


def test_scheduler_derived_batch_equals_the_runners(real_trace):
    """With runner events removed, the replay derives each step's batch from
    the scheduler's decision and its own block tables; it must be the batch
    the runner actually built (rows, positions and KV slots)."""
    events = load_trace(real_trace)
    with_runner = TraceReplay(events)
    without = TraceReplay([e for e in events if not e.kind.startswith(("runner.", "sampler."))])
    compared = 0
    for step in with_runner.steps:
        a, b = with_runner.view(step), without.view(step)
        if a.batch_source == "none":
            continue
        assert (a.batch_source, b.batch_source) == ("runner", "scheduler")
        # Row order differs: the runner condenses.
        assert sorted(a.batch, key=_by_request) == sorted(b.batch, key=_by_request), f"step {step}"
        assert [s.request_id for s in a.sampler] == [s.request_id for s in a.batch if s.sampled]
        assert b.sampler == []
        compared += 1
    assert compared >= 10


def test_view_of_a_step(real_trace):
    replay = TraceReplay(real_trace)
    view = replay.view(1)
    assert view.sched_step.step == 1
    assert view.waiting == view.state.waiting and view.running == view.state.running
    assert set(view.new_token_ids) <= set(view.sched_step.num_scheduled_tokens)
    assert all(e.step == 1 for e in view.events if e.step is not None)
    assert replay.view(0).sched_step is None and replay.view(0).batch == []
    with pytest.raises(ValueError, match="step must be an int"):
        replay.state_at(replay.last_step + 1)
    with pytest.raises(ValueError, match="block_id must be"):
        view.state.block(10_000)
    (doomed,) = replay.external_req_ids["doomed"]  # the engine's id for it
    events = replay.request_events(doomed)
    assert events[0].kind == "request.added" and events[0].external_req_id == "doomed"
    kinds = [e.kind for e in events]
    # The front end forgets it first, then the core finishes it (and frees any blocks).
    assert kinds.index("request.finished") < kinds.index("sched.finished")
    assert kinds[-1] in ("sched.finished", "kv.freed")
    final = replay.final_state
    assert final.unfinished_requests() == {}
    assert final.requests[doomed].status == "FINISHED_ABORTED"
    assert final.kv_cache_usage == 0.0
    assert len(final.free_queue) == 15


def test_external_req_ids_lead_from_the_sent_id_to_the_engines(tiny_model_dir, tmp_path):
    """Each request added under one id gets its own internal id (the id, "-"
    and 8 hex digits, as add_request returns it); an n > 1 request's children
    are "<index>_<parent's internal id>" and name the parent in request.added."""
    trace = str(tmp_path / "ids.jsonl")
    engine = make_engine(tiny_model_dir, trace, "lifecycle")
    params = SamplingParams(temperature=0.0, max_tokens=2)
    try:
        first = engine.add_request("same", {"prompt_token_ids": ids("w1 w2")}, params)
        second = engine.add_request("same", {"prompt_token_ids": ids("w3 w4")}, params)
        pair = engine.add_request(
            "pair", {"prompt_token_ids": ids("w5 w6")}, SamplingParams(max_tokens=2, n=2)
        )
        sent_under = {}
        while engine.has_unfinished_requests():
            for out in engine.step():
                sent_under.setdefault(out.request_id, []).append(out)
    finally:
        engine.shutdown()
    assert set(sent_under) == {"same", "pair"}  # outputs carry the id they were sent under
    assert first != second and first.startswith("same-") and second.startswith("same-")
    assert len(first) == len(second) == len("same-") + 8
    replay = TraceReplay(trace)
    assert replay.external_req_ids == {"same": [first, second], "pair": [f"0_{pair}", f"1_{pair}"]}
    added = {e.request_id: e for e in replay.events if e.kind == "request.added"}
    assert added[first].parent_request_id is None
    for child in (f"0_{pair}", f"1_{pair}"):
        assert added[child].parent_request_id == pair and added[child].external_req_id == "pair"
        assert replay.final_state.requests[child].status == "FINISHED_LENGTH_CAPPED"
    # A trace before format 1.2 has no external ids: nothing to map.
    old = [
        msgspec.structs.replace(e, external_req_id="") if e.kind == "request.added" else e
        for e in replay.events
    ]
    assert TraceReplay(old).external_req_ids == {}


def test_priority_policy_queue_order(tiny_model_dir, tmp_path):
    trace = str(tmp_path / "prio.jsonl")
    engine = make_engine(tiny_model_dir, trace, "lifecycle", scheduling_policy="priority")
    scheduler = scheduler_of(engine)
    try:
        for i, prio in enumerate([3, 1, 2, 1, 0, 5]):
            engine.add_request(
                f"r{i}",
                {"prompt_token_ids": ids(f"w{i} w{i + 10} w{i + 20} w{i + 30} w{i + 40}")},
                SamplingParams(temperature=0.0, max_tokens=8),
                priority=prio,
            )
        for _ in range(4):
            engine.step()
            engine.tracer.flush()
            replay = TraceReplay(trace)
            assert_replay_matches_engine(replay.state_at(replay.last_step), scheduler)
        engine.add_request(
            "late",
            {"prompt_token_ids": ids("w1 w2")},
            SamplingParams(temperature=0.0, max_tokens=2),
            priority=-1,
        )
        while engine.has_unfinished_requests():
            engine.step()
            engine.tracer.flush()
            replay = TraceReplay(trace)
            assert_replay_matches_engine(replay.state_at(replay.last_step), scheduler)
    finally:
        engine.shutdown()


def test_a_trace_that_contradicts_the_model_raises(real_trace, tmp_path):
    events = load_trace(real_trace)
    # Drop the first allocation: the next one pops a block that is not at the head.
    first_alloc = next(i for i, e in enumerate(events) if e.kind == "kv.allocated")
    with pytest.raises(ReplayError):
        TraceReplay(events[:first_alloc] + events[first_alloc + 1 :])
    # Lie about the queue length in one step.
    broken = [copy.copy(e) for e in events]
    step_event = next(e for e in broken if e.kind == "sched.step")
    step_event.num_waiting += 1
    with pytest.raises(ReplayError, match="waiting"):
        TraceReplay(broken)
    with pytest.raises(ReplayError, match="no kv.init"):
        TraceReplay([e for e in events if e.kind != "kv.init"])
    path = tmp_path / "lines.jsonl"
    path.write_bytes(msgspec.json.Encoder().encode_lines(events))
    assert TraceReplay(str(path)).last_step == TraceReplay(events).last_step
    with pytest.raises(ValueError, match="snapshot_interval"):
        TraceReplay(events, snapshot_interval=0)
