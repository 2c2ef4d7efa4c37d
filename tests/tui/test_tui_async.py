"""The tracer on a run with async scheduling (the engine's default) and on
the same run without it.

The scripted tracing scenario on the real tiny model, recorded in both
loops. With async scheduling step n's output is read after step n+1 was
scheduled: the lifecycles must still read as prefill, decode, finish; the
scheduler panel marks the placeholder tokens; the runner panel's engine
loop draws step n+1 scheduled inside step n's time in flight; the summary
says whether the run was async and how many steps overlapped; and every
panel agrees with the replay model at every step.
"""

from __future__ import annotations

import io
import re

import pytest
from rich.console import Console

from engine.tracing import TraceReplay
from tests.helpers.tiny_model import make_tiny_model_dir
from tests.tracing.scenario import record_scenario
from tests.tui.pilot_helpers import assert_panels_match_replay, wait_ready
from tui.app import TraceApp
from tui.session import TraceSession, open_session
from tui.summary import request_summary
from tui.widgets.common import StepContext
from tui.widgets.loop import LOOP_GLYPHS, render_engine_loop
from tui.widgets.runner import render_runner
from tui.widgets.scheduler import PLACEHOLDER, render_scheduler


@pytest.fixture(scope="module")
def traces(tmp_path_factory) -> dict[str, str]:
    """{"async": path, "sync": path}: the scenario in both loops."""
    folder = tmp_path_factory.mktemp("tui-async")
    model = make_tiny_model_dir(folder / "tiny")
    out = {}
    for name, kwargs in (("async", {}), ("sync", {"async_scheduling": False})):
        out[name] = str(folder / f"{name}.jsonl")
        record_scenario(model, out[name], "lifecycle", real_model=True, **kwargs)
    return out


@pytest.fixture(scope="module")
def sessions(traces) -> dict[str, TraceSession]:
    return {name: open_session(path) for name, path in traces.items()}


def _plain(renderable, width: int = 200) -> str:
    console = Console(width=width, record=True, color_system=None, file=io.StringIO())
    console.print(renderable)
    return console.export_text()


def _ctx(session: TraceSession, step: int) -> StepContext:
    return StepContext(session, step, session.view(step), session.info.followed_request_id)


def test_async_lifecycles_read_as_prefill_decode_finish(sessions):
    """Step n's tokens arrive after step n+1's schedule: a decode must not
    read as a one-token prefill chunk, the lines stay in step order, and a
    request ends at the step that finished it. Requests a and b run the same
    steps in both loops, so their lifecycles are the same."""
    asy, syn = sessions["async"], sessions["sync"]
    for rid, tl in asy.timelines.items():
        steps = [ev.step for ev in tl.events]
        assert steps == sorted(steps), rid
        for ev in tl.events:
            if ev.kind == "prefill":  # prompt tokens only
                last = int(re.search(r"tokens \d+-(\d+)", ev.text).group(1))
                assert last < tl.num_prompt_tokens, (rid, ev.text)
            if tl.finished_step is not None:
                assert ev.last_step <= tl.finished_step, (rid, ev.text)
        if tl.num_preemptions == 0 and len(tl.output_tokens) > 2:
            assert "d" in tl.phases, rid
    decode_steps = sum(tl.phases.count("d") for tl in asy.timelines.values())
    assert decode_steps >= 20
    for label in ("a", "b"):
        a = asy.timelines[asy.resolve_request_id(label)]
        s = syn.timelines[syn.resolve_request_id(label)]
        assert [(e.step, e.end_step, e.kind) for e in a.events] == [
            (e.step, e.end_step, e.kind) for e in s.events
        ]
        assert a.phases == s.phases


def test_summary_says_whether_the_run_was_async(sessions):
    asy, syn = sessions["async"], sessions["sync"]
    overlapped = len(asy.replay.overlapped_steps)
    assert overlapped == asy.last_step - 1  # every step but the first
    text = request_summary(asy)
    assert (
        f"Engine loop: async scheduling, up to 2 steps in flight; {overlapped} of "
        f"{asy.last_step} steps were scheduled and launched before the previous step's tokens "
        "were read" in text
    )
    text = request_summary(syn)
    assert f"Engine loop: synchronous, one step in flight at a time ({syn.last_step} steps)" in (
        text
    )


def test_scheduler_panel_marks_placeholder_tokens(sessions):
    session = sessions["async"]
    marked = 0
    for step in session.replay.steps[2:]:
        ctx = _ctx(session, step)
        text = _plain(render_scheduler(ctx, 120))
        view = ctx.view
        if view.sched_step is None or not view.sched_step.num_scheduled_tokens:
            continue
        assert f"scheduled while step {step - 1} in flight (async scheduling)" in text
        for rid in view.sched_step.num_scheduled_tokens:
            row = next(line for line in text.splitlines() if line.startswith(rid))
            assert (f"{PLACEHOLDER}tok" in row) is (rid in view.num_placeholder_inputs)
            marked += rid in view.num_placeholder_inputs
        assert (f"{PLACEHOLDER} placeholder: a token step {step - 1}" in text) is bool(
            view.num_placeholder_inputs
        )
    assert marked >= 20
    session = sessions["sync"]
    for step in session.replay.steps[1:]:
        text = _plain(render_scheduler(_ctx(session, step), 120))
        assert PLACEHOLDER not in text and "in flight" not in text


def _strip_rows(text: str) -> dict[int, str]:
    """The engine loop's rows: step -> its cells (after the label)."""
    rows = {}
    for line in text.splitlines():
        m = re.match(r"step (\d+)\s", line)
        if m and not line.startswith(f"step {m.group(1)}:"):
            rows[int(m.group(1))] = line[8:]
    return rows


def _first(cells: str) -> int:
    return len(cells) - len(cells.lstrip())


def _last(cells: str) -> int:
    return len(cells.rstrip()) - 1


def test_runner_panel_draws_the_next_step_inside_this_ones_time_in_flight(sessions):
    schedule, in_flight = LOOP_GLYPHS["schedule"][0], LOOP_GLYPHS["in flight"][0]
    session = sessions["async"]
    for step in range(2, session.last_step - 1):
        ctx = _ctx(session, step)
        text = _plain(render_runner(ctx, 100))
        assert "Engine loop" in text
        rows = _strip_rows(text)
        assert sorted(rows) == [step - 1, step, step + 1], (step, text)
        # Step n+1's schedule() starts before step n's life (to its update)
        # is over, and step n's before step n-1's is: the rows overlap. (A
        # cell is a slice of time; the comparisons allow two moments to share one.)
        this, nxt, before = rows[step], rows[step + 1], rows[step - 1]
        assert in_flight in this and schedule in nxt
        assert _first(nxt) <= _last(this) and _first(this) <= _last(before), text
        assert f"launched while step {step - 1} was in flight" in text
    session = sessions["sync"]
    for step in range(1, session.last_step + 1):
        ctx = _ctx(session, step)
        text = _plain(render_runner(ctx, 100))
        assert list(_strip_rows(text)) == [step], text
        assert "no other step in flight with it" in text


def test_no_engine_loop_for_a_trace_without_launch_times(small_session):
    """The committed trace predates format 1.4: no strip (and no placeholder)."""
    for step in (0, 4, 31):
        ctx = _ctx(small_session, step)
        assert render_engine_loop(ctx, 80) is None
        assert PLACEHOLDER not in _plain(render_scheduler(ctx, 120))


@pytest.mark.asyncio
async def test_every_panel_agrees_with_the_replay_at_every_step_of_an_async_run(traces):
    replay = TraceReplay(traces["async"])
    app = TraceApp(traces["async"], follow="stop")  # preempted, then resumed
    async with app.run_test(size=(120, 40)) as pilot:
        await wait_ready(app, pilot)
        assert app.error is None
        await pilot.press("home")
        for _ in range(replay.last_step + 1):
            assert_panels_match_replay(app, replay, app.session)
            await pilot.press("right")
        assert app.step == replay.last_step
