"""The tracer app driven by Textual's Pilot, checked against the replay model.

Every panel must show the step the scrubber shows, for the followed request,
and agree with ``engine.tracing.TraceReplay`` (a fresh replay, not the app's
cached views): the scheduler's queues, each request's status, the followed
request's block table, the runner's batch rows, the sampler's chosen token.
"""

from __future__ import annotations

import pytest

from engine.tracing import (
    KVEvicted,
    SchedAdmitted,
    SchedFinished,
    SchedPreempted,
    TraceReplay,
)
from tests.tui.pilot_helpers import assert_panels_match_replay, wait_ready
from tui.app import PANEL_IDS, TraceApp
from tui.widgets.help import HelpScreen, help_text
from tui.widgets.kv_blocks import KVBlocksPanel
from tui.widgets.lifecycle import LifecyclePanel
from tui.widgets.requests import RequestList
from tui.widgets.runner import RunnerPanel
from tui.widgets.scrubber import Scrubber

pytestmark = pytest.mark.asyncio

SIZE = (120, 40)


def footer_keys(app: TraceApp) -> dict[str, str]:
    """What the footer shows: key -> description."""
    return {
        key: active.binding.description
        for key, active in app.screen.active_bindings.items()
        if active.binding.show
    }


def interesting_steps(replay: TraceReplay) -> list[int]:
    types = (SchedPreempted, SchedAdmitted, SchedFinished, KVEvicted)
    return sorted({replay.step_of(e) for e in replay.events if isinstance(e, types)})


async def test_stepping_moves_every_panel_consistently_with_the_replay(fresh_session):
    replay = TraceReplay(fresh_session.events)
    app = TraceApp(fresh_session)
    async with app.run_test(size=SIZE) as pilot:
        await wait_ready(app, pilot)
        # It opens where the followed request arrives (step 1 at the earliest).
        assert app.follow == fresh_session.info.followed_request_id
        assert app.step == max(1, fresh_session.timelines[app.follow].queued_step)
        await pilot.press("home")
        assert app.step == 0
        assert_panels_match_replay(app, replay, fresh_session)
        for _ in range(min(16, replay.last_step)):
            before = app.step
            await pilot.press("right")
            assert app.step == before + 1
            assert_panels_match_replay(app, replay, fresh_session)
        await pilot.press("left")
        assert_panels_match_replay(app, replay, fresh_session)
        for _ in range(3):
            await pilot.press("shift+right")
            assert_panels_match_replay(app, replay, fresh_session)
        await pilot.press("end")
        assert app.step == replay.last_step
        assert_panels_match_replay(app, replay, fresh_session)
        # Every step where the scheduler preempted, admitted or finished a
        # request, following each request it touched.
        for step in interesting_steps(replay):
            for rid in {
                e.request_id
                for e in replay.events_at(step)
                if isinstance(e, (SchedPreempted, SchedAdmitted, SchedFinished))
            }:
                app.follow = rid
                app.go_to_step(step)
                await pilot.pause()
                assert_panels_match_replay(app, replay, fresh_session)
        await pilot.press("right")  # past the end: stays
        assert app.step == replay.last_step


async def test_events_play_and_the_palette_move_the_step(fresh_session):
    app = TraceApp(fresh_session, step=0)
    async with app.run_test(size=SIZE) as pilot:
        await wait_ready(app, pilot)
        # n / p: the followed request's next / previous lifecycle event.
        steps = fresh_session.timelines[app.follow].event_steps()
        visited = []
        for _ in steps:
            before = app.step
            await pilot.press("n")
            if app.step == before:
                break
            visited.append(app.step)
        assert visited == [s for s in steps if s > 0]
        await pilot.press("p")
        assert app.step == ([s for s in steps if s < visited[-1]] or [0])[-1]
        # space plays (at 16 steps/s after two +), space again pauses.
        await pilot.press("home", "plus", "plus")
        assert app.speed == 16
        await pilot.press("space")
        assert app.playing
        await pilot.pause(0.5)
        await pilot.press("space")
        assert not app.playing
        reached = app.step
        assert reached >= 2
        await pilot.pause(0.2)
        assert app.step == reached  # paused means paused
        await pilot.press("minus")
        assert app.speed == 8
        # ctrl+p, a number, Enter: go to that step.
        await pilot.press("ctrl+p")
        await pilot.pause(0.2)
        await pilot.press("1", "2")
        await pilot.pause(0.3)
        await pilot.press("enter")
        await pilot.pause(0.1)
        assert app.step == 12


async def test_switching_the_followed_request(fresh_session):
    replay = TraceReplay(fresh_session.events)
    ids = fresh_session.request_ids
    assert len(ids) >= 3
    app = TraceApp(fresh_session, step=replay.last_step // 2)
    async with app.run_test(size=SIZE) as pilot:
        await wait_ready(app, pilot)
        first = app.follow
        await pilot.press("f")
        assert app.follow == ids[(ids.index(first) + 1) % len(ids)]
        assert_panels_match_replay(app, replay, fresh_session)
        await pilot.press("F")
        assert app.follow == first
        # Pick one in the request list: focus it, move down twice, Enter.
        await pilot.press("1")
        assert app.focused is app.query_one(RequestList)
        await pilot.press("down", "down", "enter")
        target = ids[(ids.index(first) + 2) % len(ids)]
        assert app.follow == target
        assert app.query_one(LifecyclePanel).border_title == f"Lifecycle of {target}"
        assert_panels_match_replay(app, replay, fresh_session)
        # The command palette can follow a request too.
        await pilot.press("ctrl+p")
        await pilot.pause(0.2)
        await pilot.press(*f"follow request {first}")
        await pilot.pause(0.3)
        await pilot.press("enter")
        await pilot.pause(0.1)
        assert app.follow == first


async def test_following_a_request_by_the_id_it_was_sent_under(
    internal_id_trace, internal_id_session
):
    """A trace of format 1.2 names requests by internal ids: ``follow`` takes
    the id a request was sent under, the request list shows those ids, and the
    panels agree with the replay as for any trace."""
    _, internal = internal_id_trace
    session = internal_id_session
    replay = TraceReplay(session.events)
    app = TraceApp(session, follow="bg-5", step=31)
    async with app.run_test(size=SIZE) as pilot:
        await wait_ready(app, pilot)
        assert app.follow == internal["bg-5"]
        assert app.query_one(LifecyclePanel).border_title == f"Lifecycle of {internal['bg-5']}"
        lines = app.query_one(RequestList).lines
        labels = [line.split()[1] for line in lines]  # after the "●" of its colour
        assert labels == [session.timelines[r].external_req_id for r in session.request_ids]
        assert lines[session.request_ids.index(internal["bg-5"])].startswith("▶")
        assert_panels_match_replay(app, replay, session)
        # The command palette offers each request under the id it was sent with.
        await pilot.press("ctrl+p")
        await pilot.pause(0.2)
        await pilot.press(*"follow request bg-1")
        await pilot.pause(0.3)
        await pilot.press("enter")
        await pilot.pause(0.1)
        assert app.follow == internal["bg-1"]


async def test_help_zoom_theme_resize_and_quit(fresh_session):
    app = TraceApp(fresh_session)
    async with app.run_test(size=(100, 30)) as pilot:
        await wait_ready(app, pilot)
        # Readable at 100x30: every panel gets a usable area...
        for panel_id in ("lifecycle", "scheduler", "kv", "runner", "sampler", "requests"):
            region = app.query_one(f"#{panel_id}").region
            assert region.width >= 30 and region.height >= 8, (panel_id, region)
        # ...and lines are laid out for the panel's width, not cut by the screen.
        runner = app.query_one(RunnerPanel)
        narrow = runner.content_width()
        assert all(len(line.rstrip()) <= narrow for line in runner.plain_text().splitlines())
        # It scales up: a bigger terminal gives the panels more room.
        await pilot.resize_terminal(160, 50)
        await pilot.pause()
        assert runner.content_width() > narrow + 10
        assert runner.shown_step == app.step
        # ? opens the help; it is modal, so the step keys do nothing under it.
        await pilot.press("question_mark")
        assert isinstance(app.screen, HelpScreen)
        text = help_text()
        assert "KV blocks" in text and "quit" in text
        assert app.screen.query_one("#help-text").size.height > 10
        step = app.step
        await pilot.press("right")
        assert app.step == step
        await pilot.press("escape")
        assert not isinstance(app.screen, HelpScreen)
        # z zooms the focused panel (4 = KV blocks), which the footer names, and back.
        assert footer_keys(app)["z"] == "Zoom Requests"  # the request list has the focus
        await pilot.press(str(PANEL_IDS.index("kv") + 1))
        assert footer_keys(app)["z"] == "Zoom KV blocks"
        await pilot.press("z")
        kv = app.query_one(KVBlocksPanel)
        assert app.screen.maximized is kv
        await pilot.pause()
        assert kv.content_width() > 140
        assert footer_keys(app)["z"] == "Unzoom"
        await pilot.press("z")
        assert app.screen.maximized is None
        assert footer_keys(app)["z"] == "Zoom KV blocks"
        for i, panel_id in enumerate(PANEL_IDS):  # every panel says it
            await pilot.press(str(i + 1))
            title = "Requests" if panel_id == "requests" else app.query_one(f"#{panel_id}").TITLE
            assert footer_keys(app)["z"] == f"Zoom {title}", panel_id
        # t: light theme and back.
        await pilot.press("t")
        assert app.theme == "textual-light"
        await pilot.press("t")
        assert app.theme == "textual-dark"
        await pilot.press("q")
        await pilot.pause()
    assert app.return_code == 0
    assert not app.is_running


async def test_the_app_reports_a_bad_trace_instead_of_crashing(tmp_path):
    missing = tmp_path / "missing.jsonl"
    app = TraceApp(str(missing))
    async with app.run_test(size=(100, 30)) as pilot:
        await wait_ready(app, pilot)
        assert app.error is not None and "no trace file" in app.error
        shown = str(app.query_one("#error").render())
        assert "Cannot open the trace" in shown and "no trace file" in shown
        await pilot.press("right", "n", "f", "space")  # nothing to step: no crash
        await pilot.press("q")
    assert app.return_code == 0

    truncated = tmp_path / "truncated.jsonl"
    truncated.write_text('{"ts": 1, "pid": 1, "seq": 1, "kind": "kv.init", "num_blo')
    app = TraceApp(str(truncated))
    async with app.run_test(size=(100, 30)) as pilot:
        await wait_ready(app, pilot)
        assert app.error is not None and "truncated" in app.error

    # Written by a Glassbox whose trace format this one does not read: the
    # message names both versions (no traceback, no half-drawn panels).
    future = tmp_path / "future.jsonl"
    future.write_text(
        '{"kind": "trace.header", "ts": 1, "pid": 1, "seq": 0, "trace_format_version": "2.0", '
        '"glassbox_version": "9.0.0"}\n{"kind": "kv.init", "ts": 2, "pid": 1, "seq": 1}\n'
    )
    app = TraceApp(str(future))
    async with app.run_test(size=(100, 30)) as pilot:
        await wait_ready(app, pilot)
        assert app.error is not None and not app.ready
        shown = str(app.query_one("#error").render())
        assert "trace format version '2.0'; this Glassbox reads version 1" in shown
        assert "9.0.0" in shown and "Traceback" not in shown


async def test_the_kv_key_and_the_lifecycle_say_what_they_mean(fresh_session):
    app = TraceApp(fresh_session, step=4)
    async with app.run_test(size=(100, 30)) as pilot:
        await wait_ready(app, pilot)
        kv = app.query_one(KVBlocksPanel).plain_text(200).splitlines()
        # The counts come first; the key under the grid has no numbers to read as counts.
        assert kv[0].strip() == "18 used · 0 free (0 cached)"
        assert kv[-1].strip() == "key: used shared cached free ∅ null"
        # Your prompt is not preempted and prefills in one chunk: the lifecycle
        # names the requests that show those, and how to follow them.
        lifecycle = app.query_one(LifecyclePanel).plain_text(200)
        assert "Elsewhere (follow: f or ⏎):" in lifecycle
        assert "bg-5 preempted at step 31" in lifecycle
        assert "bg-3 prefill in 3 chunks, steps 2-4" in lifecycle
        await pilot.press("f", "f")  # to bg-5: it shows a preemption
        assert app.follow == "bg-5"
        lifecycle = app.query_one(LifecyclePanel).plain_text(200)
        assert "bg-3 prefill in 3 chunks" in lifecycle and "preempted at step" not in lifecycle


async def test_a_truncated_trace_says_so_on_screen(cut_trace_path):
    app = TraceApp(cut_trace_path)
    async with app.run_test(size=(100, 30)) as pilot:
        await wait_ready(app, pilot)
        assert app.ready and app.error is None
        assert app.session is not None and "is truncated" in (app.session.truncated or "")
        notes = [n.message for n in app._notifications]  # the toast shown at start
        assert notes == [app.session.truncated]
        assert "⚠ truncated" in app.query_one(Scrubber).renderable.plain
        await pilot.press("q")
