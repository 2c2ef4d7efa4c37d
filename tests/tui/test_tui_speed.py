"""Long traces: a run of thousands of steps opens at once (the app is up and
shows a loading indicator while a worker thread replays it), opens in a
bounded time, and stepping costs a few milliseconds of replay because step
views are cached and neighbours prefetched.

The trace is synthetic (``tests/tui/synthetic.py``): 3000 steps, hundreds of
requests, every event kind the replay model checks.
"""

from __future__ import annotations

import time

import pytest

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
    # ~1 s on an idle laptop core; generous for a loaded CI machine.
    assert elapsed < 20, f"opening {NUM_STEPS} steps took {elapsed:.1f} s"


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
