"""Fixtures of the TUI tests: the committed small trace and sessions opened on it.

``data/small_trace.jsonl`` (56 steps, 6 requests, < 300 KB) is a full-level
trace of the embedded SmolLM2-135M-Instruct on CPU, recorded with::

    .venv/bin/glassbox trace "What is the capital of France?" --headless \\
        --max-tokens 32 --trace-path tests/tui/data/small_trace.jsonl

It shows a queued prompt, prefix-cache hits on the shared system prompt, a
chunked long prompt, requests waiting for KV blocks, and one preemption (bg-5,
step 31) followed by a resume. After re-recording it (or when the replay
model's output changes), regenerate the SVG snapshots:
``.venv/bin/python -m pytest tests/tui/test_tui_snapshots.py --snapshot-update``
(and check the steps the snapshot tests pick still show what they say).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tui.session import TraceSession, open_session

DATA = Path(__file__).parent / "data"
SMALL_TRACE = DATA / "small_trace.jsonl"


@pytest.fixture(scope="session")
def small_trace_path() -> str:
    return str(SMALL_TRACE)


@pytest.fixture(scope="session")
def small_session(small_trace_path: str) -> TraceSession:
    return open_session(small_trace_path)


@pytest.fixture()
def fresh_session(small_trace_path: str) -> TraceSession:
    """A session of its own (the app's view cache starts empty)."""
    return open_session(small_trace_path)
