"""The tracer on an n-gram speculative-decoding run.

The scripted spec run of the tracing tests (``tests/tracing/spec_scenario.py``:
drafts rejected, partly and fully accepted, a budget that cuts drafts short,
a preemption) on the real tiny model at ``full``. For every request at every
step that verified drafts, the Sampler panel shows the draft row -- each
draft, its verdict and the target's tokens, ending in the recovered or the
bonus token -- and the drafts proposed for the next step; the Scheduler
panel counts the drafts in the request's tokens at the positions they had
before the rollback; the KV panel shows each rollback of the cursor; the
lifecycle's decode line counts drafts; and every panel agrees with the
replay model at every step.
"""

from __future__ import annotations

import io
import json
import re

import pytest
from rich.console import Console

from engine.tracing import SpecVerified, TraceReplay
from tests.helpers.tiny_model import make_tiny_model_dir
from tests.tracing.spec_scenario import record_spec_scenario
from tests.tui.pilot_helpers import assert_panels_match_replay, wait_ready
from tui.app import TraceApp
from tui.session import TraceSession, open_session
from tui.widgets.common import StepContext
from tui.widgets.kv_blocks import render_kv
from tui.widgets.sampler import render_sampler
from tui.widgets.scheduler import render_scheduler


@pytest.fixture(scope="module")
def spec_trace(tmp_path_factory) -> str:
    folder = tmp_path_factory.mktemp("tui-spec")
    path = str(folder / "spec.jsonl")
    record_spec_scenario(make_tiny_model_dir(folder / "tiny"), path, "full")
    return path


@pytest.fixture(scope="module")
def session(spec_trace) -> TraceSession:
    return open_session(spec_trace)


def _plain(renderable, width: int = 160) -> str:
    console = Console(width=width, record=True, color_system=None, file=io.StringIO())
    console.print(renderable)
    return console.export_text()


def _ctx(session: TraceSession, step: int, follow: str) -> StepContext:
    return StepContext(session, step, session.view(step), follow)


def _cells(text: str, label: str) -> list[str] | None:
    """The cells of the draft table's row ``label`` (``drafts``, ``verdict``,
    ``target``), or None when the panel has no such row."""
    for line in text.splitlines():
        if re.match(rf"{label}\s", line):
            return line.split()[1:]
    return None


def _label(token_id: int) -> str:
    return f"#{token_id}"  # the run records no token texts


def _verdicts(session: TraceSession) -> list[SpecVerified]:
    return [e for e in session.events if isinstance(e, SpecVerified)]


def test_sampler_panel_shows_each_drafts_fate_and_the_next_drafts(session):
    assert not session.token_texts
    fates = set()
    for e in _verdicts(session):
        ctx = _ctx(session, e.step, e.request_id)
        text = _plain(render_sampler(ctx, 150))
        acc, rej, own = e.num_accepted, e.num_rejected, e.token_ids[-1]
        drafts = [_label(t) for t in e.draft_token_ids]
        verdict = ["✓"] * acc + ["✗"] * rej
        target = [_label(t) for t in e.draft_token_ids[:acc]] + [_label(own)]
        if rej:
            target += ["·"] * (rej - 1)
        else:
            verdict.append("bonus")
        assert _cells(text, "drafts") == drafts, text
        assert _cells(text, "verdict") == verdict, text
        assert _cells(text, "target") == target, text
        n = len(e.draft_token_ids)
        if rej:
            before = e.num_computed_tokens + rej
            assert (
                f"{acc} of {n} drafts accepted; {rej} rejected: the target's {_label(own)} "
                f"replaces {_label(e.draft_token_ids[acc])}; cursor rolled back {before} → "
                f"{e.num_computed_tokens}"
            ) in text, text
        else:
            assert f"all {n} drafts accepted, plus the bonus token {_label(own)}" in text, text
        assert "chose" in text and "bonus position" in text
        fates.add("none" if acc == 0 else "all" if rej == 0 else "some")
    assert fates == {"none", "some", "all"}
    # The drafts proposed after a step, for each request it ran.
    shown = 0
    for step in session.replay.steps:
        spec = session.view(step).spec
        for rid, drafts in spec.proposed.items() if spec is not None else ():
            text = _plain(render_sampler(_ctx(session, step, rid), 150))
            line = next(x for x in text.splitlines() if x.startswith("next drafts"))
            assert line.startswith(f"next drafts (ngram): {' '.join(map(_label, drafts))} — ")
            finished = session.view(step).state.requests[rid].is_finished
            assert ("dropped: the request finished" in line) is finished, line
            shown += 1
    assert shown >= 10


def test_no_draft_row_where_a_request_verified_no_drafts(session):
    """A step that ran the request without drafts (its prefill, a decode
    the proposer found no match for) shows no draft row."""
    quiet = 0
    for step in session.replay.steps:
        view = session.view(step)
        if view.sched_step is None:
            continue
        verified = view.spec.verified if view.spec is not None else {}
        for rid in view.sched_step.num_scheduled_tokens:
            if rid in verified:
                continue
            text = _plain(render_sampler(_ctx(session, step, rid), 150))
            assert _cells(text, "verdict") is None and "bonus position" not in text, text
            quiet += 1
    assert quiet >= 5


def test_scheduler_panel_counts_the_drafts_at_their_positions_before_the_rollback(session):
    for e in _verdicts(session):
        view = session.view(e.step)
        n = view.sched_step.num_scheduled_tokens[e.request_id]
        last = e.num_computed_tokens + e.num_rejected - 1
        k = len(e.draft_token_ids)
        text = _plain(render_scheduler(_ctx(session, e.step, e.request_id), 150))
        row = rf"^{re.escape(e.request_id)}\s+decode\s+{n}\s+tok {last - n + 1}-{last} "
        assert re.search(row + rf"\({k} drafts?\)\s*$", text, re.MULTILINE), (e, text)


def test_kv_panel_shows_each_rollback_of_the_cursor(session):
    verdicts = _verdicts(session)
    rollbacks = 0
    for step in session.replay.steps:
        text = _plain(render_kv(_ctx(session, step, session.request_ids[0]), 150))
        lines = [x for x in text.splitlines() if x.startswith("rollback")]
        expected = [e for e in verdicts if e.step == step and e.num_rejected]
        assert len(lines) == len(expected), text
        for line, e in zip(lines, expected):
            before, n = e.num_computed_tokens + e.num_rejected, e.num_rejected
            assert re.match(
                rf"rollback\s+{re.escape(e.request_id)} cursor {before} → "
                rf"{e.num_computed_tokens}: {n} rejected drafts?' slots will be written again",
                line,
            ), line
        rollbacks += len(lines)
    assert rollbacks >= 2


def test_decode_lines_count_drafts_and_steps_with_drafts_read_as_decode(session):
    verdicts = _verdicts(session)
    for rid, tl in session.timelines.items():
        mine = [e for e in verdicts if e.request_id == rid]
        for e in mine:
            assert tl.phase_at(e.step) in ("d", "f"), (rid, e.step, tl.phases)
        counts = [
            tuple(map(int, m.groups()))
            for ev in tl.events
            if ev.kind == "decode" and (m := re.search(r"(\d+) of (\d+) drafts accepted", ev.text))
        ]
        assert (sum(a for a, _ in counts), sum(d for _, d in counts)) == (
            sum(e.num_accepted for e in mine),
            sum(len(e.draft_token_ids) for e in mine),
        ), (rid, [ev.text for ev in tl.events])
        assert bool(counts) is bool(mine)


@pytest.mark.asyncio
async def test_every_panel_agrees_with_the_replay_at_every_step_of_a_spec_run(spec_trace):
    replay = TraceReplay(spec_trace)
    app = TraceApp(spec_trace, follow="partial")
    async with app.run_test(size=(120, 40)) as pilot:
        await wait_ready(app, pilot)
        assert app.error is None
        await pilot.press("home")
        for _ in range(replay.last_step + 1):
            assert_panels_match_replay(app, replay, app.session)
            await pilot.press("right")
        assert app.step == replay.last_step


def test_kv_panel_shows_a_model_drafters_lookahead_slots(session, tmp_path):
    """A draft model makes the scheduler reserve k slots after each scheduled
    request's tokens (``sched.step``'s ``num_lookahead_tokens``); the block
    table says so. n-gram reserves none: no such line."""
    from tests.tracing.scenario import make_engine
    from tests.tracing.spec_scenario import SPEC_CONFIG, SPEC_ENGINE_ARGS, run_spec_scenario

    model_dir = make_tiny_model_dir(tmp_path / "tiny")
    # The draft reads config.json alone (the target's hf_overrides are its own).
    config = json.loads((model_dir / "config.json").read_text())
    (model_dir / "config.json").write_text(json.dumps({**config, "intermediate_size": 32}))
    path = str(tmp_path / "draft.jsonl")
    spec = {"method": "draft_model", "model": str(model_dir), "num_speculative_tokens": 3}
    engine = make_engine(
        model_dir, path, "lifecycle", real_model=True, speculative_config=spec, **SPEC_ENGINE_ARGS
    )
    try:
        run_spec_scenario(engine)
    finally:
        engine.shutdown()
    draft = open_session(path)
    steps = [e for e in draft.events if e.kind == "sched.step" and e.num_scheduled_tokens]
    assert steps and all(e.num_lookahead_tokens == 3 for e in steps)
    shown = 0
    for e in steps:
        for rid in e.num_scheduled_tokens:
            text = _plain(render_kv(_ctx(draft, e.step, rid), 150))
            if "block table (" not in text:
                continue  # finished in this step: its blocks are gone
            expected = f"+ 3 lookahead slots reserved after its {e.num_scheduled_tokens[rid]} "
            assert expected in text, text
            shown += 1
    assert shown > 10
    assert SPEC_CONFIG["method"] == "ngram"
    for step in session.replay.steps:
        for rid in session.request_ids:
            assert "lookahead" not in _plain(render_kv(_ctx(session, step, rid), 150))
