"""The tracer on a structured-output run: the grammar's mask in the Sampler
panel, the wait for the grammar in the request list, the Scheduler panel
and the lifecycle.

The run is the tracing tests' (``tests/tracing/test_structured_output_trace.py``:
the default model at ``full``, a JSON-schema request sampled at T=1 that
waits for its grammar for a step or more, an unconstrained request, and a
second constrained request whose compile is a cache hit), opened with the
token texts ``glassbox trace`` would add. For every step that masks the
followed request's logits the Sampler panel says how many tokens the mask
allowed and, at ``full``, the model's top token before and after the mask
and which of its top candidates the mask removed, with their texts; while
the grammar compiles the panels say the request is waiting for it; every
panel agrees with the replay model.
"""

from __future__ import annotations

import io
import re

import pytest
from rich.console import Console

from engine.tracing import GrammarMasked, TraceReplay, TraceTokenTexts, load_trace
from tests.tracing.test_structured_output_trace import (
    PERSON,
    PLAIN,
    StructuredOutputRun,
    record_structured_output_run,
)
from tests.tui.pilot_helpers import assert_panels_match_replay, ids_after, wait_ready
from tui.app import TraceApp
from tui.session import TraceSession, session_from_events
from tui.summary import request_summary
from tui.widgets.common import StepContext
from tui.widgets.lifecycle import LifecyclePanel
from tui.widgets.requests import RequestList
from tui.widgets.sampler import SamplerPanel, render_sampler
from tui.widgets.scheduler import SchedulerPanel


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> StructuredOutputRun:
    return record_structured_output_run(tmp_path_factory.mktemp("tui-structured"))


@pytest.fixture(scope="module")
def session(run) -> TraceSession:
    """With the token texts, as ``glassbox trace`` records them."""
    events = load_trace(run.path)
    last = events[-1]
    texts = TraceTokenTexts(ts=last.ts + 1, pid=last.pid, token_texts=run.token_texts)
    return session_from_events([*events, texts], path=run.path)


def _plain(renderable, width: int = 160) -> str:
    console = Console(width=width, record=True, color_system=None, file=io.StringIO())
    console.print(renderable)
    return console.export_text()


def _ctx(session: TraceSession, step: int, follow: str) -> StepContext:
    return StepContext(session, step, session.view(step), follow)


def _label(session: TraceSession, token_id: int) -> str:
    """How the panel names a candidate: ``'text' #id`` (``#id`` without texts)."""
    text = session.token_text(token_id)
    if text is None:
        return f"#{token_id}"
    shown = repr(text.replace("\n", "↵").replace("\t", "⇥"))
    return (shown if len(shown) <= 12 else shown[:11] + "…") + f" #{token_id}"


def _masked_steps(session: TraceSession, rid: str) -> list[int]:
    steps = []
    for step in session.replay.steps:
        so = session.view(step).structured_output
        if so is not None and rid in so.masked:
            steps.append(step)
    return steps


def test_sampler_panel_shows_what_the_mask_did(run, session):
    rid = run.ids[PERSON]
    steps = _masked_steps(session, rid)
    assert len(steps) >= 8
    changed = 0
    for step in steps:
        row = session.view(step).structured_output.requests[rid]
        mask = row.mask
        text = _plain(render_sampler(_ctx(session, step, rid), 160))
        assert f"grammar JSON: {row.num_allowed:,} of 49,152 tokens allowed" in text, text
        before = _label(session, mask.top_token_id_before)
        after = _label(session, mask.top_token_id_after)
        if mask.changed_top:
            assert f"model's top {before} ✗ masked → top allowed {after}" in text, text
            changed += 1
        else:
            assert f"model's top {before} ✓ allowed" in text, text
        removed = next((x for x in text.splitlines() if x.startswith("masked away")), None)
        if mask.masked_top_token_ids:
            shown = ", ".join(_label(session, t) for t in mask.masked_top_token_ids)
            assert removed == f"masked away of its top 5: {shown}", text
        else:
            assert removed is None, text
        assert "the logprob and the stages below come from the masked logits" in text
        # The chosen token is one the mask allowed, and it is still the "chose" line.
        assert text.startswith("chose "), text
    # The model's own favourite is masked away at some step (JSON's first
    # token: the model does not start with "{" on its own).
    assert changed >= 1
    # Candidates are shown with their text: every id the mask removed has one.
    assert all(
        str(t) in run.token_texts
        for e in session.events
        if isinstance(e, GrammarMasked)
        for t in e.masked_top_token_ids
    )


def test_sampler_panel_while_the_grammar_compiles(run, session):
    rid = run.ids[PERSON]
    waiting = [
        s
        for s in session.replay.steps
        if (so := session.view(s).structured_output) is not None and rid in so.waiting_for_grammar
    ]
    assert waiting
    for step in waiting:
        text = _plain(render_sampler(_ctx(session, step, rid), 160))
        assert text.startswith(f"{rid} is waiting for its JSON grammar to compile"), text
        assert "skipped_waiting" in text and "chose" not in text
        row = session.view(step).structured_output.requests[rid]
        assert ("It compiled in" in text) is (row.compile_s is not None), text


def test_an_unconstrained_request_shows_no_grammar(run, session):
    rid = run.ids[PLAIN]
    for step in session.replay.steps:
        assert "grammar" not in _plain(render_sampler(_ctx(session, step, rid), 160))


def test_without_token_texts_candidates_are_ids(run):
    plain = session_from_events(load_trace(run.path))
    rid = run.ids[PERSON]
    step = _masked_steps(plain, rid)[0]
    mask = plain.view(step).structured_output.requests[rid].mask
    text = _plain(render_sampler(_ctx(plain, step, rid), 160))
    assert f"model's top #{mask.top_token_id_before} " in text, text


def test_a_lifecycle_trace_says_what_the_mask_removed_needs_full(run):
    events = [e for e in load_trace(run.path) if not isinstance(e, GrammarMasked)]
    lifecycle = session_from_events(events)
    rid = run.ids[PERSON]
    step = _masked_steps(lifecycle, rid)[0]
    text = _plain(render_sampler(_ctx(lifecycle, step, rid), 160))
    assert "tokens allowed" in text
    assert "What the mask removed needs a full trace (--trace-level full)." in text, text


def test_lifecycle_and_summary_show_the_wait_for_the_grammar(run, session):
    rid = run.ids[PERSON]
    tl = session.timelines[rid]
    replay = session.replay
    ready = next(e.step for e in session.events if e.kind == "so.ready" and e.request_id == rid)
    assert tl.phases[: ready - tl.queued_step] == ["g"] * (ready - tl.queued_step)
    assert tl.phase_at(ready) == "p"  # admitted at once: the prompt's prefill
    (line,) = [ev for ev in tl.events if ev.kind == "grammar"]
    assert line.step == tl.queued_step and line.last_step == ready - 1
    compiled = replay.state_at(replay.last_step).requests[rid]
    assert line.text.startswith("waiting for its JSON grammar to compile"), line.text
    assert f"compiled in {compiled.grammar_compile_s * 1e3:.1f} ms (not cached)" in line.text
    assert f"ready at step {ready}" in line.text
    # The cache hit of the second request with the same schema.
    again = [t for r, t in session.timelines.items() if r not in (rid, run.ids[PLAIN])]
    (again_line,) = [ev for ev in again[0].events if ev.kind == "grammar"]
    assert "(a cache hit)" in again_line.text, again_line.text
    summary = request_summary(session, rid)
    assert "g waiting for grammar" in summary
    assert "waiting for its JSON grammar to compile" in summary
    assert "g waiting for grammar" not in request_summary(session, run.ids[PLAIN])


@pytest.mark.asyncio
async def test_the_panels_show_the_wait_and_agree_with_the_replay(run, session):
    rid = run.ids[PERSON]
    replay = TraceReplay(run.path)
    waiting = next(s for s in replay.steps if rid in replay.state_at(s).skipped_waiting and s > 0)
    app = TraceApp(session, follow=rid, step=waiting)
    async with app.run_test(size=(140, 45)) as pilot:
        await wait_ready(app, pilot)
        assert app.error is None
        line = dict(zip(session.request_ids, app.query_one(RequestList).lines))[rid]
        assert "waiting for grammar" in line, line
        sched = app.query_one(SchedulerPanel).plain_text(200)
        # The second waiting queue, under the first.
        assert re.search(
            rf"^skipped 1\s+{re.escape(rid)}\s+skipped_waiting: compiling their grammar",
            sched,
            re.MULTILINE,
        ), sched
        assert ids_after(sched, "waiting") == replay.state_at(waiting).waiting
        lifecycle = app.query_one(LifecyclePanel).plain_text(200)
        assert "┄grammar" in lifecycle and "waiting for its JSON grammar" in lifecycle
        assert "waiting for grammar" in app.query_one(LifecyclePanel).border_subtitle
        sampler = app.query_one(SamplerPanel).plain_text(200)
        assert "is waiting for its JSON grammar to compile" in sampler
        # Every panel agrees with the replay, through the wait and the masked steps.
        for _ in range(6):
            assert_panels_match_replay(app, replay, session)
            await pilot.press("right")
        sampler = app.query_one(SamplerPanel).plain_text(200)
        assert "tokens allowed" in sampler, sampler
