"""The trace format's version (engine/tracing/reader.py): the ``trace.header``
says ``"major.minor"``; a reader takes any minor version of its own major
(skipping, with a warning, kinds a newer minor added) and refuses another
major naming both versions. Traces written before headers existed, and the
first headers' plain ``1``, read as version 1.0. A line that is not JSON is
reported with its line number."""

from __future__ import annotations

import json

import pytest

from engine.tracing import (
    HEADER_KIND,
    TRACE_FORMAT_VERSION,
    KVInit,
    RequestAdded,
    TraceHeader,
    TraceVersionError,
    check_trace_version,
    load_trace,
    parse_version,
    read_events,
)

KV_INIT = {
    "kind": "kv.init",
    "ts": 2,
    "pid": 1,
    "seq": 1,
    "num_blocks": 4,
    "block_size": 2,
    "null_block_id": 0,
}
SCHED_UPDATE = {"kind": "sched.update", "ts": 4, "pid": 1, "seq": 3, "step": 1, "num_running": 0}


def _header(version, glassbox_version: str = "0.1.0") -> dict:
    return {
        "kind": HEADER_KIND,
        "ts": 1,
        "pid": 1,
        "trace_format_version": version,
        "glassbox_version": glassbox_version,
        "trace_level": "lifecycle",
    }


def _write(path, *records) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


def test_this_glassbox_writes_version_1_13():
    assert TRACE_FORMAT_VERSION == "1.13"
    assert parse_version(TRACE_FORMAT_VERSION) == (1, 13)
    assert parse_version(1) == (1, 0)  # the first headers' plain integer
    assert parse_version("2") == (2, 0)
    with pytest.raises(TraceVersionError, match="unreadable"):
        parse_version("one.two")


@pytest.mark.parametrize(
    "version",
    ["1.4", "1.3", "1.2", "1.1", "1.0", 1],
    ids=["1.4", "1.3", "1.2", "1.1", "1.0", "int-1"],
)
def test_a_header_of_major_version_1_loads(tmp_path, version):
    path = _write(tmp_path / "t.jsonl", _header(version), KV_INIT)
    (event,) = load_trace(path)
    assert type(event) is KVInit and event.num_blocks == 4 and event.step is None
    header, _ = load_trace(path, include_header=True)
    assert type(header) is TraceHeader
    assert parse_version(header.trace_format_version) == parse_version(version)


def test_an_engine_config_before_1_4_reads_as_synchronous(tmp_path):
    """1.4 added ``engine.config``'s ``async_scheduling``: a 1.3 line lacks
    it and reads False (the engine had no other loop then)."""
    config = {
        "kind": "engine.config",
        "ts": 2,
        "pid": 1,
        "seq": 1,
        "max_num_seqs": 4,
        "max_num_batched_tokens": 16,
        "max_model_len": 48,
        "enable_chunked_prefill": True,
        "long_prefill_token_threshold": 0,
        "policy": "fcfs",
        "block_size": 4,
        "enable_prefix_caching": True,
        "num_gpu_blocks": 16,
    }
    (old,) = load_trace(_write(tmp_path / "old.jsonl", _header("1.3"), config))
    assert old.async_scheduling is False
    new = dict(config, async_scheduling=True)
    (event,) = load_trace(_write(tmp_path / "new.jsonl", _header("1.4"), new))
    assert event.async_scheduling is True


def test_a_trace_without_a_header_is_version_1(tmp_path):
    """Written before headers existed: read as version 1."""
    path = _write(tmp_path / "old.jsonl", KV_INIT)
    (event,) = load_trace(path)
    assert type(event) is KVInit and (event.ts, event.pid, event.seq) == (2, 1, 1)
    check_trace_version([], "no headers")  # nothing to refuse


def test_a_trace_of_another_major_version_is_refused_naming_both_versions(tmp_path):
    path = _write(tmp_path / "future.jsonl", _header("2.0", glassbox_version="9.9.9"), KV_INIT)
    with pytest.raises(TraceVersionError) as info:
        load_trace(path)
    message = str(info.value)
    assert "trace format version '2.0'" in message  # the trace's
    assert "reads version 1.x" in message  # this Glassbox's
    assert "9.9.9" in message and str(path) in message
    assert isinstance(info.value, ValueError)
    # Every header counts: a merged trace with one part of another major is refused too.
    merged = _write(tmp_path / "merged.jsonl", _header("1.1"), _header("2.0"), KV_INIT)
    with pytest.raises(TraceVersionError, match="'2.0'"):
        load_trace(merged)
    with pytest.raises(TraceVersionError, match="'0.9'"):
        load_trace(_write(tmp_path / "past.jsonl", _header("0.9"), KV_INIT))


def test_a_newer_minor_version_loads_and_skips_kinds_it_does_not_know(tmp_path):
    """A newer minor version only adds kinds (and fields): the reader warns,
    naming the kind, and skips those lines; the rest loads."""
    unknown = {"kind": "sched.new_kind_of_1_13", "ts": 3, "pid": 1, "seq": 2, "what": [1, 2]}
    path = _write(tmp_path / "newer.jsonl", _header("1.13"), KV_INIT, unknown, SCHED_UPDATE)
    with pytest.warns(UserWarning, match=r"sched\.new_kind_of_1_13 \(1\)"):
        events = load_trace(path)
    assert [e.kind for e in events] == ["kv.init", "sched.update"]
    assert [e.seq for e in events] == [1, 3]


def test_a_newer_minor_versions_extra_fields_are_ignored(tmp_path):
    extra = dict(KV_INIT, field_added_in_1_13={"x": 1})
    (event,) = load_trace(_write(tmp_path / "newer.jsonl", _header("1.13"), extra))
    assert type(event) is KVInit and event.num_blocks == 4


@pytest.mark.parametrize("bad_line", ["{not json", "[1, 2", "plain text"])
def test_a_line_that_is_not_json_is_named_by_its_line_number(tmp_path, bad_line):
    path = tmp_path / "bad.jsonl"
    lines = [json.dumps(_header("1.1")), json.dumps(KV_INIT), bad_line, json.dumps(SCHED_UPDATE)]
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(ValueError, match=rf"{path}:3: not a JSON trace event"):
        load_trace(str(path))
    with pytest.raises(ValueError, match=rf"{path}:3: "):
        read_events(str(path))


def test_a_known_kind_with_wrong_fields_is_named_by_its_line_number(tmp_path):
    broken = dict(KV_INIT, num_blocks="four")
    path = _write(tmp_path / "wrong.jsonl", _header("1.1"), SCHED_UPDATE, broken)
    with pytest.raises(ValueError, match=rf"{tmp_path / 'wrong.jsonl'}:3: not a Glassbox trace"):
        load_trace(path)


def test_a_request_added_of_version_1_1_reads_without_the_external_id(tmp_path):
    """1.2 added ``request.added``'s ``external_req_id``; a 1.1 line without
    it loads with the field empty (its ``request_id`` is the id it was sent under)."""
    added = {
        "kind": "request.added",
        "ts": 3,
        "pid": 1,
        "seq": 2,
        "request_id": "r1",
        "num_prompt_tokens": 2,
    }
    (event,) = load_trace(_write(tmp_path / "old.jsonl", _header("1.1"), added))
    assert type(event) is RequestAdded
    assert (event.request_id, event.external_req_id, event.parent_request_id) == ("r1", "", None)
