"""Helpers shared by the TUI tests: wait for the app, and check every panel
against a fresh replay of the trace."""

from __future__ import annotations

import re

from engine.tracing import SchedPreempted, StepView, TraceReplay
from tui.app import TraceApp
from tui.session import TraceSession
from tui.widgets.common import Panel
from tui.widgets.kv_blocks import KVBlocksPanel
from tui.widgets.lifecycle import LifecyclePanel
from tui.widgets.requests import RequestList
from tui.widgets.runner import RunnerPanel
from tui.widgets.sampler import SamplerPanel
from tui.widgets.scheduler import SchedulerPanel
from tui.widgets.scrubber import Scrubber


async def wait_ready(app_or_pilot, pilot=None) -> None:
    """Until the trace is open and the panels are up (or an error is shown).
    ``wait_ready(app, pilot)``, or ``wait_ready(pilot)`` as a snapshot's run_before."""
    if pilot is None:
        pilot, app = app_or_pilot, app_or_pilot.app
    else:
        app = app_or_pilot
    for _ in range(500):
        if app.ready or app.error is not None:
            break
        await pilot.pause(0.02)
    await pilot.pause()


def ids_after(text: str, label: str) -> list[str]:
    """Request ids on the panel line that starts with ``label`` (e.g. 'running 3')."""
    for line in text.splitlines():
        m = re.match(rf"\s*{label} (\d+)\s+(.*)$", line)
        if m:
            rest = m.group(2).strip()
            return [] if rest == "none" else rest.split()
    raise AssertionError(f"no '{label}' line in:\n{text}")


def assert_panels_match_replay(app: TraceApp, replay: TraceReplay, session: TraceSession) -> None:
    """Every panel shows ``app.step`` for ``app.follow`` and agrees with ``replay``."""
    step, follow = app.step, app.follow
    view: StepView = replay.view(step)
    state = view.state
    for panel in app.query(Panel):
        assert (panel.shown_step, panel.shown_follow) == (step, follow), panel.id
    scrubber = app.query_one(Scrubber).renderable.plain
    assert re.search(rf"step\s+{step} / {replay.last_step}\b", scrubber), scrubber
    # Scheduler: who got tokens, and the queues after the step, in order.
    sched = app.query_one(SchedulerPanel).plain_text(200)
    assert ids_after(sched, "running") == state.running
    assert ids_after(sched, "waiting") == state.waiting
    if view.sched_step is not None:
        for rid, n in view.sched_step.num_scheduled_tokens.items():
            assert re.search(
                rf"^{re.escape(rid)}\s+(prefill|decode|recompute)\s+{n}\b", sched, re.MULTILINE
            ), (rid, n, sched)
        for e in view.events:
            if isinstance(e, SchedPreempted):
                assert re.search(rf"preempted\s+.*\b{re.escape(e.request_id)}\b", sched)
    # Requests: each line's status agrees with the replayed request.
    lines = dict(zip(session.request_ids, app.query_one(RequestList).lines))
    for rid, line in lines.items():
        # Listed under the id it was sent with (or its internal id), maybe cut short.
        shown, label = line.split()[1], session.request_label(rid)
        assert shown == label or (shown.endswith("…") and label.startswith(shown[:-1])), line
        req = state.requests.get(rid)
        if req is None:
            assert "not yet" in line, line
        elif req.is_finished:
            assert "done" in line, line
        elif req.status == "RUNNING":
            kind = "prefill" if req.num_computed_tokens < req.num_prompt_tokens else "decode"
            assert kind in line, line
        elif req.status == "PREEMPTED":
            assert "preempted" in line, line
        else:
            assert "waiting" in line, line
    # KV: usage and the followed request's block table, block for block.
    kv = app.query_one(KVBlocksPanel).plain_text(200)
    used = state.num_blocks - 1 - state.num_free_blocks
    assert f"{used} used · {state.num_free_blocks} free" in kv
    req = state.requests.get(follow)
    table = re.findall(r"^\s*(\d+)→\s+(\d+)\s", kv, re.MULTILINE)
    expected = [] if req is None else [(str(i), str(b)) for i, b in enumerate(req.block_ids)]
    assert table == expected, kv
    # Runner: one row per batch slot, with its query length and positions.
    runner = app.query_one(RunnerPanel).plain_text(200)
    if not view.batch:
        assert "No batch ran" in runner or "nothing has run" in runner
    for slot in view.batch:
        first, last = slot.num_computed_tokens, slot.seq_len - 1
        pos = str(first) if first == last else f"{first}-{last}"
        assert re.search(
            rf"^{re.escape(slot.request_id[:9])}\S*\s+{slot.query_len}\s+{pos}\s",
            runner,
            re.MULTILINE,
        ), (slot, runner)
    # Sampler: the followed request's chosen token, or why there is none.
    sampler = app.query_one(SamplerPanel).plain_text(200)
    sample = next((e for e in view.sampler if e.request_id == follow), None)
    if sample is not None:
        text = session.token_text(sample.token_id)
        shown = repr(text.replace("\n", "↵")) if text is not None else f"#{sample.token_id}"
        assert f"chose {shown}" in sampler, sampler
    else:
        assert "chose" not in sampler
    # Lifecycle: the lines that cover this step are highlighted (▶); between
    # events the latest earlier line is marked (▷).
    tl = session.timelines[follow]
    events = app.query_one(LifecyclePanel).plain_text(200)
    covering = [e for e in tl.events if e.covers(step)]
    marks = [line for line in events.splitlines() if line.lstrip().startswith(("▶", "▷"))]
    if covering:
        assert len(marks) == len(covering) and all(m.lstrip()[0] == "▶" for m in marks), events
    elif step >= tl.queued_step:
        assert len(marks) == 1 and marks[0].lstrip()[0] == "▷", events
