"""Long traces: a run of thousands of steps opens at once (the app is up and
shows a loading view while a worker thread replays it), opens in a bounded
time, and stepping costs a few milliseconds of replay because step views are
cached and neighbours prefetched.

Bounds on time are generous (a loaded CI machine): about 0.15 s to open the
3000-step trace and a few ms per step on an idle core. What does not depend
on the machine is checked exactly: the state at any step costs one snapshot
copy plus the events of at most ``snapshot_interval - 1`` steps, and a copy
shares the requests instead of copying them.

The trace is synthetic (``tests/tui/synthetic.py``): 3000 steps, hundreds of
requests, every event kind the replay model checks.
"""

from __future__ import annotations

import time

import pytest

from engine.tracing import EngineState, SchedStep
from tests.tui.pilot_helpers import wait_ready
from tests.tui.synthetic import write_synthetic_trace
from tui.app import LoadingView, TraceApp
from tui.session import open_session

NUM_STEPS = 3000


@pytest.fixture(scope="module")
def long_trace(tmp_path_factory) -> str:
    return str(write_synthetic_trace(tmp_path_factory.mktemp("long") / "long.jsonl", NUM_STEPS))


def test_a_long_trace_opens_in_bounded_time(long_trace):
    start = time.perf_counter()
    session = open_session(long_trace)
    elapsed = time.perf_counter() - start
    assert session.last_step == NUM_STEPS
    assert len(session.request_ids) > 300
    # ~0.15 s on an idle core; generous for a loaded CI machine.
    assert elapsed < 3, f"opening {NUM_STEPS} steps took {elapsed:.1f} s"


def test_any_step_is_a_snapshot_copy_plus_a_few_steps_of_events(long_trace, monkeypatch):
    session = open_session(long_trace)
    replay = session.replay
    interval = replay.snapshot_interval
    assert 16 <= interval <= 64
    applied, copies = [], []
    real_apply, real_copy = EngineState.apply, EngineState.copy
    monkeypatch.setattr(
        EngineState, "apply", lambda self, e: applied.append(e) or real_apply(self, e)
    )
    monkeypatch.setattr(EngineState, "copy", lambda self: copies.append(1) or real_copy(self))
    for step in (0, 1, interval - 1, interval, 1500, 1500 + interval - 1, NUM_STEPS - 1, NUM_STEPS):
        applied.clear()
        copies.clear()
        state = replay.state_at(step)
        base = step - step % interval
        assert len(copies) == 1, step
        expected = [e for s in range(base + 1, step + 1) for e in replay._state_events.get(s, ())]
        assert applied == expected, step  # the events after the snapshot, nothing else
        assert len(applied) <= 8 * (interval - 1)  # this trace: a handful of events per step
        assert state.step == step


def test_a_snapshot_copy_shares_the_requests_copy_on_write(long_trace):
    replay = open_session(long_trace).replay
    step = 1500 - 1500 % replay.snapshot_interval
    snapshot = replay._snapshots[step]
    state = replay.state_at(step)
    finished = [rid for rid, r in state.requests.items() if r.is_finished]
    assert len(finished) > 100
    assert all(state.requests[rid] is snapshot.requests[rid] for rid in state.requests)
    # Changing a request goes through a private copy; the snapshot keeps its own.
    running = state.running[0]
    before = snapshot.requests[running].num_computed_tokens
    state.apply(
        SchedStep(
            pid=replay.engine_pid,
            step=step,
            token_budget=5,
            token_budget_left=0,
            num_scheduled_tokens={running: 5},
            num_running=len(state.running),
            num_waiting=len(state.waiting),
        )
    )
    assert state.requests[running] is not snapshot.requests[running]
    assert state.requests[running].num_computed_tokens == before + 5
    assert snapshot.requests[running].num_computed_tokens == before
    assert replay.state_at(step).requests[running].num_computed_tokens == before


@pytest.mark.asyncio
async def test_the_app_is_up_at_once_and_stepping_stays_fast(long_trace):
    app = TraceApp(long_trace, step=NUM_STEPS // 2)
    async with app.run_test(size=(100, 30)) as pilot:
        # The screen is up before the trace is replayed: a loading view, not a blank terminal.
        assert app.query(LoadingView) or app.ready
        await wait_ready(app, pilot)
        assert app.error is None and app.step == NUM_STEPS // 2
        session = app.session
        replayed = []
        real_view = session.replay.view
        session.replay.view = lambda step: replayed.append(step) or real_view(step)
        # Stepping forward: each step was prefetched while the previous one was shown.
        await pilot.pause(0.2)
        timings = []
        for _ in range(10):
            assert session.is_cached(app.step + 1)
            start = time.perf_counter()
            app.step += 1  # the watcher redraws every panel synchronously
            timings.append(time.perf_counter() - start)
            await pilot.pause(0.1)
        # Stepping back over the same steps replays nothing.
        before = len(replayed)
        for _ in range(10):
            app.step -= 1
        assert len(replayed) == before
        # A far jump costs one replay (snapshot copy + at most snapshot_interval steps).
        start = time.perf_counter()
        app.go_to_step(123)
        jump = time.perf_counter() - start
    mean = sum(timings) / len(timings)
    print(f"mean step {mean * 1000:.1f} ms, jump {jump * 1000:.1f} ms")
    # A few ms on an idle machine; bounds generous for a loaded one.
    assert mean < 0.25, f"a step took {mean * 1000:.0f} ms on average"
    assert jump < 1.0, f"a jump took {jump * 1000:.0f} ms"
