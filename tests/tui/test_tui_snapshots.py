"""SVG snapshots of the tracer's main screen at chosen steps of the committed
small trace (pytest-textual-snapshot). The SVGs under ``__snapshots__`` are
committed; after an intended change of the screen (or of the replay model's
output, or a Textual upgrade), regenerate them with::

    .venv/bin/python -m pytest tests/tui/test_tui_snapshots.py --snapshot-update

and look at the new SVGs before committing them.
"""

from __future__ import annotations

import pytest

from tests.tui.pilot_helpers import wait_ready
from tui.app import TraceApp
from tui.session import open_session

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


def app_at(
    small_trace_path: str, step: int, follow: str | None = None, theme: str | None = None
) -> TraceApp:
    return TraceApp(open_session(small_trace_path), follow=follow, step=step, theme=theme)


def test_snapshot_prompt_admitted_with_a_prefix_hit(snap_compare, small_trace_path):
    # Step 4: the prompt is admitted after waiting, hits 3 cached blocks of
    # the shared system prompt, prefills the rest and samples its first token.
    assert snap_compare(app_at(small_trace_path, 4), terminal_size=(100, 30), run_before=wait_ready)


def test_snapshot_a_preemption(snap_compare, small_trace_path):
    # Step 31: bg-5 is preempted so bg-3 can grow; its blocks go back.
    assert snap_compare(
        app_at(small_trace_path, 31, follow="bg-5"), terminal_size=(100, 30), run_before=wait_ready
    )


def test_snapshot_decoding_light_theme_larger_terminal(snap_compare, small_trace_path):
    assert snap_compare(
        app_at(small_trace_path, 8, theme="textual-light"),
        terminal_size=(140, 40),
        run_before=wait_ready,
    )


def test_snapshot_help_screen(snap_compare, small_trace_path):
    async def open_help(pilot) -> None:
        await wait_ready(pilot.app, pilot)
        await pilot.press("question_mark")
        await pilot.pause()

    assert snap_compare(app_at(small_trace_path, 4), terminal_size=(100, 30), run_before=open_help)
