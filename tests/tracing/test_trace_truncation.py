"""Truncated traces (engine/tracing/reader.py ``find_truncation``): from format
1.3 every writer ends its file with ``trace.end`` (``Tracer.close``), so a
file cut at a line boundary, or the part of a process that was killed, is
reported as truncated, naming the process; a trace of an earlier version,
which has no end line, is not. ``load_trace`` warns only where some writer
finished the file (a file nobody finished may be a live engine's);
``load_trace_checked`` reports every case, for the viewers."""

from __future__ import annotations

import json
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

from engine.tracing import (
    SchedQueued,
    Tracer,
    TraceTruncatedWarning,
    find_truncation,
    load_trace,
    load_trace_checked,
    merge_trace_parts,
    part_path,
)

ROOT = Path(__file__).resolve().parents[2]


def _queued(request_id: str) -> SchedQueued:
    return SchedQueued(request_id=request_id, num_prompt_tokens=1, max_tokens=1)


def _closed_trace(path: Path, n: int = 5) -> list[str]:
    tracer = Tracer(str(path), "lifecycle")
    for i in range(n):
        tracer.record(_queued(f"r{i}"))
    tracer.close()
    return path.read_text().splitlines(keepends=True)


def _load_quietly(path: Path):
    """load_trace, failing on any warning."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        return load_trace(str(path))


def test_a_closed_trace_is_complete(tmp_path):
    path = tmp_path / "t.jsonl"
    _closed_trace(path)
    events, truncated = load_trace_checked(str(path))
    assert truncated is None and len(events) == 5 == len(_load_quietly(path))


def test_a_trace_cut_at_a_line_boundary_is_reported_as_truncated(tmp_path):
    lines = _closed_trace(tmp_path / "full.jsonl")
    for keep in (len(lines) - 1, 3, 1):  # without the end line, and shorter still
        cut = tmp_path / f"cut{keep}.jsonl"
        cut.write_text("".join(lines[:keep]))
        events, truncated = load_trace_checked(str(cut))
        assert len(events) == keep - 1
        assert truncated is not None
        assert truncated.startswith(f"{cut} is truncated: the process that wrote it (pid ")
        assert "no trace.end line" in truncated and "killed" in truncated
        # No writer finished it: it may be a live engine's, so load_trace stays quiet.
        assert len(_load_quietly(cut)) == keep - 1


def test_lines_missing_in_the_middle_are_reported(tmp_path):
    lines = _closed_trace(tmp_path / "full.jsonl")
    holed = tmp_path / "holed.jsonl"
    holed.write_text("".join(lines[:2] + lines[4:]))  # two events gone, the end line kept
    with pytest.warns(TraceTruncatedWarning, match=r"wrote 5 events, 3 are here"):
        events = load_trace(str(holed))
    assert len(events) == 3
    _, truncated = load_trace_checked(str(holed))
    assert truncated is not None and "lines are missing" in truncated


@pytest.mark.parametrize("version", ["1.2", "1.1", 1])
def test_a_trace_before_version_1_3_has_no_end_line_and_is_not_truncated(tmp_path, version):
    header = {
        "kind": "trace.header",
        "ts": 1,
        "pid": 7,
        "trace_format_version": version,
        "glassbox_version": "0.1.0",
        "trace_level": "lifecycle",
    }
    event = {"kind": "kv.cache_reset", "ts": 2, "pid": 7, "seq": 1}
    path = tmp_path / "old.jsonl"
    path.write_text(json.dumps(header) + "\n" + json.dumps(event) + "\n")
    events, truncated = load_trace_checked(str(path))
    assert truncated is None and len(events) == 1
    # No header at all (before headers existed): nothing to check either.
    assert find_truncation(events) is None


_KILLED_CORE = """
import os, sys
sys.path.insert(0, {root!r})
from engine.tracing import SchedQueued, Tracer, part_path
tracer = Tracer(part_path({path!r}, "core"), "lifecycle")
tracer.record(SchedQueued(request_id="in-core", num_prompt_tokens=1, max_tokens=1))
tracer.flush()
os._exit(1)  # what a SIGKILL leaves: no close, no finalizer, no trace.end
"""


def test_the_part_of_a_killed_engine_core_makes_the_merged_trace_truncated(tmp_path):
    """Each process's tracer ends its own part; the part of a process that
    was killed has no end line, and the merged trace says which process."""
    path = str(tmp_path / "mp.jsonl")
    code = _KILLED_CORE.format(root=str(ROOT), path=path)
    subprocess.run([sys.executable, "-c", code], check=False, timeout=60)
    front = Tracer(part_path(path, "frontend"), "lifecycle")
    front.record(_queued("in-front-end"))
    front.close()
    merge_trace_parts(path)
    with pytest.warns(TraceTruncatedWarning) as caught:
        events = load_trace(path)
    assert {e.request_id for e in events} == {"in-core", "in-front-end"}
    (warning,) = caught
    message = str(warning.message)
    assert message.startswith(f"{path} is truncated: the engine core (pid ")
    assert "1 events here" in message and "the front end" not in message
    assert load_trace_checked(path)[1] == message


def test_a_tracer_whose_event_could_not_be_encoded_still_ends_complete(tmp_path):
    path = tmp_path / "bad.jsonl"
    tracer = Tracer(str(path), "lifecycle")
    tracer.record(_queued("ok"))
    tracer.record(SchedQueued(request_id=object(), num_prompt_tokens=1, max_tokens=1))
    with pytest.raises(TypeError, match="was not written"):
        tracer.close()
    events, truncated = load_trace_checked(str(path))
    assert [e.request_id for e in events] == ["ok"] and truncated is None
