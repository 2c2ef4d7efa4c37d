"""Async scheduling in the trace, the replay model and the Perfetto export.

The scripted scenario on the real tiny model, recorded twice: with the
engine's default loop (async scheduling: step n+1 is scheduled and launched
before step n's tokens are read) and with ``async_scheduling=False``. The
replay must read both orders, give each step's phases (scheduled,
launched, consumed, updated), the steps in flight together and the
placeholders, and the export must draw overlapping steps on separate
"steps in flight" threads. ``test_trace_replay_live.py`` checks the
replayed state against the live engine after every step in both loops.
"""

from __future__ import annotations

from collections import defaultdict

import msgspec
import pytest

from engine.tracing import (
    EVENT_KINDS,
    TraceReplay,
    build_perfetto,
    load_trace,
)
from engine.tracing.perfetto import TID_IN_FLIGHT
from tests.tracing.test_trace_perfetto import validate_trace_events

NEW_IN_1_4 = ("engine.step_launched", "engine.output_ready")


@pytest.fixture(scope="module")
def async_events(full_real_scenario):
    return load_trace(full_real_scenario[0])


@pytest.fixture(scope="module")
def sync_events(full_real_scenario_sync):
    return load_trace(full_real_scenario_sync[0])


def _by_step(events, kind):
    return {e.step: e for e in events if e.kind == kind}


def _as_version_1_3(events):
    """The events as a 1.3 trace holds them: no launch / consume events, no
    ``engine.config.async_scheduling``."""
    out = []
    for e in events:
        if e.kind in NEW_IN_1_4:
            continue
        if e.kind == "engine.config":
            raw = msgspec.to_builtins(e)
            raw.pop("async_scheduling", None)
            e = msgspec.convert(raw, EVENT_KINDS[e.kind])
        out.append(e)
    return out


def test_async_trace_schedules_the_next_step_before_reading_this_ones_tokens(async_events):
    (config,) = [e for e in async_events if e.kind == "engine.config"]
    assert config.async_scheduling
    sched = _by_step(async_events, "sched.step")
    launched = _by_step(async_events, "engine.step_launched")
    ready = _by_step(async_events, "engine.output_ready")
    update = _by_step(async_events, "sched.update")
    last = max(sched)
    assert set(launched) == set(sched)
    # The scenario's last, empty step is still in flight when the engine shuts down.
    assert set(ready) == set(update) == set(range(1, last))
    for s in range(1, last):
        # Each step: scheduled, launched, then (after the next step's
        # schedule and launch) its tokens read, then the update.
        assert sched[s].seq < launched[s].seq < ready[s].seq < update[s].seq, s
        assert launched[s + 1].seq < ready[s].seq, s
        assert launched[s + 1].num_in_flight == 2, s
    assert launched[1].num_in_flight == 1

    replay = TraceReplay(async_events)
    assert replay.async_scheduling and replay.max_in_flight == 2
    assert replay.overlapped_steps == list(range(2, last + 1))
    assert replay.view(1).in_flight == [1] and replay.view(0).in_flight == []
    for s in range(2, last + 1):
        view = replay.view(s)
        assert view.in_flight == [s - 1, s], s
        p = view.phases
        assert p.schedule_start_ts <= p.scheduled_ts <= p.launched_ts
        assert p.launched_ts == launched[s].ts and p.num_in_flight == 2
        # In time too: launched before step s-1's tokens were read.
        assert p.launched_ts < replay.step_phases[s - 1].output_ready_ts
        assert replay.in_flight_at(p.launched_ts) == [s - 1, s]
        # The state at step s: step s in flight, nothing else.
        assert view.state.in_flight == [s], s
    p = replay.step_phases[2]
    assert p.output_ready_ts == ready[2].ts and p.wait_ns == ready[2].wait_ns
    assert p.update_start_ts <= p.updated_ts == update[2].ts
    assert p.in_flight_span == (launched[2].ts, ready[2].ts)


def test_sync_trace_runs_one_step_at_a_time(sync_events):
    (config,) = [e for e in sync_events if e.kind == "engine.config"]
    assert not config.async_scheduling
    sched = _by_step(sync_events, "sched.step")
    update = _by_step(sync_events, "sched.update")
    launched = _by_step(sync_events, "engine.step_launched")
    for s in sorted(sched)[:-1]:
        assert update[s].seq < sched[s + 1].seq, s
        assert launched[s].num_in_flight == 1
    replay = TraceReplay(sync_events)
    assert not replay.async_scheduling and replay.overlapped_steps == []
    assert replay.max_in_flight == 1
    for s in replay.steps[1:]:
        view = replay.view(s)
        assert view.in_flight == [s] and view.state.in_flight == []
        assert view.num_output_placeholders == {} and view.num_placeholder_inputs == {}
        assert all(r.num_output_placeholders == 0 for r in view.state.requests.values())
        p = view.phases
        assert p.scheduled_ts <= p.launched_ts <= p.output_ready_ts <= p.updated_ts
        assert replay.in_flight_at(p.launched_ts) == [s]


def test_placeholders_are_the_tokens_of_the_steps_in_flight(async_events):
    """Derived from other events than the replay's: a request has a
    placeholder in the state at step s exactly when step s sampled a token
    for it (``sampler.sampled``), and computes a placeholder at step s
    exactly when step s-1 sampled for it (that token was not yet read)."""
    replay = TraceReplay(async_events)
    sampled = defaultdict(set)
    for e in async_events:
        if e.kind == "sampler.sampled":
            sampled[e.step].add(e.request_id)
    num_placeholders = 0
    for s in replay.steps[1:]:
        view = replay.view(s)
        unfinished = view.state.unfinished_requests()
        for rid, req in unfinished.items():
            expected = 1 if rid in sampled[s] else 0
            assert req.num_output_placeholders == expected, (s, rid)
            num_placeholders += expected
        scheduled = view.sched_step.num_scheduled_tokens
        expected_inputs = {r: 1 for r in scheduled if r in sampled[s - 1]}
        assert view.num_placeholder_inputs == expected_inputs, s
        # At the end of schedule(): the previous step's token and this one's.
        for rid in scheduled:
            coming = (rid in sampled[s - 1]) + (rid in sampled[s])
            assert view.num_output_placeholders.get(rid, 0) == coming, (s, rid)
    assert num_placeholders >= 20  # the run decodes for many steps


def test_finished_requests_keep_only_the_placeholders_of_dropped_frames(async_events):
    """The update that finishes a request retires its own placeholder (its
    ``sched.finished`` is written first, from inside ``update_from_output``);
    only the frames of steps still in flight when it finished are left, as on
    the engine's Request. A length cap is foreseen by the scheduler, so those
    requests end with none."""
    final = TraceReplay(async_events).final_state
    last_tokens, sampled, reasons = {}, defaultdict(set), {}
    for e in async_events:
        if e.kind == "sched.update":
            for rid in e.new_token_ids:
                last_tokens[rid] = e.step
        elif e.kind == "sampler.sampled":
            sampled[e.request_id].add(e.step)
        elif e.kind == "sched.finished":
            reasons[e.request_id] = e.finish_reason
    checked = 0
    for rid, req in final.requests.items():
        if not req.is_finished or rid not in last_tokens:
            continue
        dropped = sum(s > last_tokens[rid] for s in sampled[rid])
        assert req.num_output_placeholders == dropped, (rid, reasons.get(rid))
        if reasons.get(rid) == "length":
            assert dropped == 0, rid
        checked += 1
    assert checked >= 3 and "length" in reasons.values()


def test_a_trace_without_the_1_4_events_replays_to_the_same_states(async_events, sync_events):
    """A 1.3 trace has no launch / consume events: the replay takes the
    states from the same events (equal at every step), and the steps in
    flight from ``sched.step`` / ``sched.update``: still the overlap of an
    async run, still none of a sync one."""
    for events, overlapped in ((async_events, True), (sync_events, False)):
        full, old = TraceReplay(events), TraceReplay(_as_version_1_3(events))
        assert old.last_step == full.last_step
        for a, b in zip(full.iter_states(), old.iter_states()):
            assert (a.step, a.waiting, a.running, a.ref_cnt, a.free_queue) == (
                b.step,
                b.waiting,
                b.running,
                b.ref_cnt,
                b.free_queue,
            )
            assert {r: q.num_computed_tokens for r, q in a.requests.items()} == {
                r: q.num_computed_tokens for r, q in b.requests.items()
            }
        # Without engine.config.async_scheduling the replay counts no placeholders.
        assert not any(
            r.num_output_placeholders for s in old.iter_states() for r in s.requests.values()
        )
        assert old.async_scheduling is overlapped
        assert bool(old.overlapped_steps) is overlapped
        p = old.step_phases[2]
        assert p.launched_ts is None and p.output_ready_ts is None
        assert p.in_flight_span == (p.scheduled_ts, p.update_start_ts)
    assert TraceReplay(_as_version_1_3(async_events)).view(3).in_flight == [2, 3]
    assert TraceReplay(_as_version_1_3(sync_events)).view(3).in_flight == [3]


def _in_flight_slices(doc):
    return [ev for ev in doc["traceEvents"] if ev["ph"] == "X" and ev["tid"] >= TID_IN_FLIGHT]


def test_export_draws_overlapping_steps_in_flight(async_events, sync_events):
    """One ``step N`` slice per step from launch to tokens read, on the
    ``steps in flight`` threads: with async scheduling step N+1's slice
    overlaps step N's (so they sit on two threads, steps alternating), and
    step N+1's ``schedule()`` on the host lies inside step N's slice;
    without it, every step on one thread and no overlap."""
    doc = build_perfetto(async_events)
    validate_trace_events(doc)
    slices = {int(ev["name"].split()[1]): ev for ev in _in_flight_slices(doc)}
    steps = sorted(slices)
    assert steps == sorted(e.step for e in async_events if e.kind == "sched.step")
    assert {ev["tid"] for ev in slices.values()} == {TID_IN_FLIGHT, TID_IN_FLIGHT + 1}
    schedules = {
        ev["args"]["step"]: ev
        for ev in doc["traceEvents"]
        if ev["ph"] == "X" and ev["name"] == "schedule()"
    }
    for s in steps[:-1]:
        a, b = slices[s], slices[s + 1]
        assert b["ts"] < a["ts"] + a["dur"], s  # overlap
        assert a["tid"] != b["tid"]
        assert a["ts"] <= schedules[s + 1]["ts"] <= a["ts"] + a["dur"], s
        assert b["args"]["num_in_flight"] == 2
    assert slices[steps[-1]]["args"]["in_flight_at_trace_end"] is True
    threads = {
        (ev["tid"], ev["args"]["name"])
        for ev in doc["traceEvents"]
        if ev["ph"] == "M" and ev["name"] == "thread_name"
    }
    assert {
        (TID_IN_FLIGHT, "steps in flight"),
        (TID_IN_FLIGHT + 1, "steps in flight (2)"),
    } <= threads
    waits = [ev for ev in doc["traceEvents"] if ev.get("name") == "wait for tokens"]
    assert len(waits) == len(steps) - 1

    doc = build_perfetto(sync_events)
    validate_trace_events(doc)
    slices = sorted(_in_flight_slices(doc), key=lambda ev: ev["ts"])
    assert {ev["tid"] for ev in slices} == {TID_IN_FLIGHT}
    assert len(slices) == sum(e.kind == "sched.step" for e in sync_events)
    for a, b in zip(slices, slices[1:]):
        assert a["ts"] + a["dur"] <= b["ts"]


def test_export_of_a_1_3_trace_still_has_a_slice_per_step(async_events):
    doc = build_perfetto(_as_version_1_3(async_events))
    validate_trace_events(doc)
    slices = _in_flight_slices(doc)
    assert len(slices) == sum(e.kind == "sched.step" for e in async_events)
    assert not any(ev.get("name") == "wait for tokens" for ev in doc["traceEvents"])
