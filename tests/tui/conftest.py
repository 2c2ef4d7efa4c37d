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

import zlib
from pathlib import Path
from typing import Any

import msgspec
import pytest

from engine.tracing import EVENT_KINDS, TraceEnd, TraceEvent, TraceHeader, load_trace
from tui.session import TraceSession, open_session, session_from_events

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


# Fields whose strings are text, not request ids.
_TEXT_FIELDS = {"prompt", "text_delta", "token_texts", "sampling_params", "model", "stages"}


def with_internal_ids(events: list[TraceEvent]) -> tuple[list[TraceEvent], dict[str, str]]:
    """A trace of format 1.1 (request ids are the ids the requests were sent
    under) as Glassbox writes it since 1.2: every event names a request by an
    internal id (its id, "-" and 8 hex digits, fixed here), and
    ``request.added`` keeps the sent id in ``external_req_id``. Returns the
    events and {sent id: internal id}."""
    sent_ids = [e.request_id for e in events if e.kind == "request.added"]
    internal = {rid: f"{rid}-{zlib.crc32(rid.encode()):08x}" for rid in sent_ids}

    def rename(value: Any) -> Any:
        if type(value) is str:
            return internal.get(value, value)
        if type(value) is list:
            return [rename(v) for v in value]
        if type(value) is dict:
            return {internal.get(k, k): rename(v) for k, v in value.items()}
        return value

    out = []
    for e in events:
        raw = msgspec.to_builtins(e)
        raw = {k: v if k in _TEXT_FIELDS else rename(v) for k, v in raw.items()}
        if e.kind == "request.added":
            raw["external_req_id"] = e.request_id
        out.append(msgspec.convert(raw, EVENT_KINDS[e.kind]))
    return out, internal


@pytest.fixture(scope="session")
def internal_id_trace(small_trace_path: str) -> tuple[list[TraceEvent], dict[str, str]]:
    """The small trace with format 1.2's internal ids: (events, {sent id: internal id})."""
    return with_internal_ids(load_trace(small_trace_path))


@pytest.fixture()
def internal_id_session(internal_id_trace) -> TraceSession:
    return session_from_events(internal_id_trace[0])


def write_as_version_1_3(events: list[TraceEvent], path: Path, drop_last: int = 0) -> str:
    """``events`` as Glassbox writes a trace since format 1.3 (a header, the
    events, a ``trace.end`` counting them), without its last ``drop_last``
    lines: a file cut at a line boundary, as when the run is killed."""
    pid = events[0].pid
    header = TraceHeader(
        ts=events[0].ts - 1,
        pid=pid,
        trace_format_version="1.3",
        glassbox_version="0.1.0",
        trace_level="full",
    )
    end = TraceEnd(ts=events[-1].ts + 1, pid=pid, seq=events[-1].seq + 1, num_events=len(events))
    lines = msgspec.json.Encoder().encode_lines([header, *events, end]).splitlines(keepends=True)
    path.write_bytes(b"".join(lines[: len(lines) - drop_last]))
    return str(path)


@pytest.fixture(scope="session")
def cut_trace_path(tmp_path_factory, small_trace_path: str) -> str:
    """The small trace written as format 1.3 and cut before its last two
    lines (the token texts and the ``trace.end``): it still replays, with
    token ids where the texts were."""
    folder = tmp_path_factory.mktemp("cut")
    return write_as_version_1_3(load_trace(small_trace_path), folder / "cut.jsonl", drop_last=2)
