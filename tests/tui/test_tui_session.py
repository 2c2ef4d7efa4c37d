"""``tui.session``: lifecycles agree with the replay model step by step; bad
traces become one clear ``TraceLoadError`` message; the headless summary.
"""

from __future__ import annotations

import json
from pathlib import Path

import msgspec
import msgspec.structs
import pytest

from engine.tracing import (
    TRACE_FORMAT_VERSION,
    KVAllocated,
    KVTouched,
    RunnerBatch,
    SamplerSampled,
    SchedPreempted,
    SchedQueued,
    SchedStep,
    SchedUpdate,
    TraceEvent,
    TraceHeader,
    TraceReplay,
    load_trace,
)
from tests.tui.conftest import write_as_version_1_3
from tui.session import TraceLoadError, TraceSession, open_session, session_from_events
from tui.summary import compress_phases, request_summary
from tui.timelines import (
    DECODE,
    FINISHED,
    NOT_ARRIVED,
    PREEMPTED,
    PREFILL,
    RECOMPUTE,
    STALLED,
    WAITING,
)


def test_the_committed_trace_shows_what_it_should(small_session: TraceSession):
    # The run the TUI is demonstrated on: chunked prefill, prefix hits,
    # preemption, several requests sharing steps, full-level sampler stages.
    types = {type(e) for e in small_session.events}
    assert {SchedPreempted, KVTouched, SamplerSampled, RunnerBatch} <= types
    assert small_session.info.trace_level == "full"
    assert small_session.info.followed_request_id == "prompt"
    assert len(small_session.request_ids) >= 5
    assert any(
        e.kind == "prefill" and "chunk" in e.text
        for tl in small_session.timelines.values()
        for e in tl.events
    )
    assert small_session.token_texts, "glassbox trace adds token texts"


def test_phases_agree_with_the_replay_at_every_step(small_session: TraceSession):
    replay = TraceReplay(small_session.events, snapshot_interval=1)
    for step, state in zip(replay.steps, replay.iter_states()):
        sched = next((e for e in replay.events_at(step) if isinstance(e, SchedStep)), None)
        scheduled = sched.num_scheduled_tokens if sched is not None else {}
        preempted = {e.request_id for e in replay.events_at(step) if isinstance(e, SchedPreempted)}
        for rid, tl in small_session.timelines.items():
            phase = tl.phase_at(step)
            req = state.requests.get(rid)
            where = f"{rid} at step {step}: {phase!r}"
            if req is None:
                assert phase == NOT_ARRIVED, where
            elif req.is_finished:
                assert phase == FINISHED, where
                assert tl.finished_step is not None and tl.finished_step <= step
            elif rid in preempted:
                assert phase == PREEMPTED and rid in state.waiting, where
            elif rid in scheduled:
                assert phase in (PREFILL, RECOMPUTE, DECODE), where
                # A decode computes the one token not yet in the cache (after
                # the step the sampled one is that token again).
                decode = (
                    scheduled[rid] == 1
                    and req.num_computed_tokens - 1 >= req.num_prompt_tokens
                    and req.num_computed_tokens == req.num_tokens - 1
                )
                assert (phase == DECODE) == decode, where
            elif rid in state.running:
                assert phase == STALLED, where
            else:
                assert rid in state.waiting and phase == WAITING, where


def test_outputs_and_counts_match_the_trace(small_session: TraceSession):
    final = small_session.replay.final_state
    for rid, tl in small_session.timelines.items():
        req = final.requests[rid]
        assert len(tl.output_tokens) == req.num_output_tokens
        assert tl.num_preemptions == req.num_preemptions
        assert tl.finished_step == req.finished_step
        assert [t for _, t in tl.output_tokens] == [
            t
            for e in small_session.events
            if isinstance(e, SchedUpdate)
            for t in e.new_token_ids.get(rid, [])
        ]
        # "Next event" walks the lifecycle lines' start steps in order.
        steps = tl.event_steps()
        assert steps == sorted(set(steps)) and steps[0] == tl.queued_step
        assert small_session.next_event_step(rid, steps[0]) == (steps[1:] or [None])[0]


def test_view_cache_returns_the_same_view_and_evicts_lru(small_trace_path):
    session = open_session(small_trace_path, view_cache_size=4)
    calls = []
    real = session.replay.view
    session.replay.view = lambda step: calls.append(step) or real(step)
    for step in (1, 2, 3, 1, 2, 3, 4, 5):
        session.view(step)
    assert calls == [1, 2, 3, 4, 5]  # the second 1, 2, 3 were cache hits
    assert session.view(3) is session.view(3)
    assert calls == [1, 2, 3, 4, 5]
    session.view(1)  # 5 pushed out the least recently used view, step 1's
    assert calls == [1, 2, 3, 4, 5, 1]


def test_summary_tells_the_followed_request_story(small_session: TraceSession):
    text = request_summary(small_session)
    assert text.splitlines()[0].startswith("Trace ")
    assert "Request prompt (followed)" in text
    assert "queued:" in text and "admitted" in text and "finished:" in text
    assert "prefix-cache hit" in text
    assert "output (" in text and "tokens: " in text
    with pytest.raises(ValueError, match="request_id must be one of"):
        request_summary(small_session, "nope")
    assert compress_phases("w" * 3 + "p" + "d" * 100 + "f") == "w3 p d100 f"
    assert compress_phases("wpddf") == "wpddf"


# ---------------------------------------------------------------------------
# Ids: the engine's internal ids, and the ids the requests were sent under
# ---------------------------------------------------------------------------
def test_a_request_is_found_by_the_id_it_was_sent_under(internal_id_trace, internal_id_session):
    _, internal = internal_id_trace
    session = internal_id_session
    assert sorted(session.request_ids) == sorted(internal.values())  # keyed by internal id
    # trace.cli names the followed request by its internal id.
    assert session.info.followed_request_id == internal["prompt"]
    for sent, rid in internal.items():
        assert session.resolve_request_id(sent) == rid
        assert session.resolve_request_id(rid) == rid
        assert session.timelines[rid].external_req_id == sent
        assert session.request_label(rid) == sent  # what the request list shows
    assert session.resolve_request_id("nope") is None
    assert session.resolve_request_id("bg-5-") is None


def test_the_summary_names_both_ids(internal_id_trace, internal_id_session):
    _, internal = internal_id_trace
    text = request_summary(internal_id_session)
    assert f"Request prompt (followed; internal id {internal['prompt']})" in text
    text = request_summary(internal_id_session, "bg-5")  # the id it was sent under
    assert f"Request bg-5 (internal id {internal['bg-5']})" in text and "(followed" not in text
    assert request_summary(internal_id_session, internal["bg-5"]) == text
    assert "\n  bg-1       queued step" in text  # other requests by the id they were sent under
    with pytest.raises(ValueError, match=r"request_id must be one of .*\(bg-1, .*got 'nope'"):
        request_summary(internal_id_session, "nope")


def test_labels_stay_unambiguous(internal_id_trace):
    """Two requests sent under one id keep their internal ids in the list;
    the children of an n > 1 request are "<index>_<id>"."""
    events, internal = internal_id_trace

    def resent(e):
        if e.kind != "request.added":
            return e
        if e.external_req_id in ("bg-1", "bg-2"):  # sent twice under "bg"
            return msgspec.structs.replace(e, external_req_id="bg")
        if e.external_req_id in ("bg-4", "bg-5"):  # the children of one n = 2 request
            index = int(e.external_req_id[-1]) - 4
            return msgspec.structs.replace(
                e, external_req_id="pair", parent_request_id="pair-0000abcd", index=index
            )
        return e

    session = session_from_events([resent(e) for e in events])
    label = session.request_label
    assert (
        label(internal["bg-1"]) == internal["bg-1"] and label(internal["bg-2"]) == internal["bg-2"]
    )
    assert (label(internal["bg-4"]), label(internal["bg-5"])) == ("0_pair", "1_pair")
    assert label(internal["prompt"]) == "prompt"
    # The sent id leads to the earliest request sent under it; a label to its request.
    assert session.resolve_request_id("bg") == internal["bg-1"]
    assert session.resolve_request_id("pair") == internal["bg-4"]
    assert session.resolve_request_id("1_pair") == internal["bg-5"]


def test_the_lifecycle_says_why_a_request_was_preempted(small_session: TraceSession):
    """For another request's blocks, or (no ``for_request_id``) by
    ``reset_prefix_cache(reset_running_requests=True)``."""

    def preempted_lines(session: TraceSession) -> list[str]:
        return [e.text for e in session.timelines["bg-5"].events if e.kind == "preempted"]

    (line,) = preempted_lines(small_session)
    assert line.startswith("preempted to make room for bg-3: blocks freed")
    by_reset = [
        msgspec.structs.replace(e, for_request_id="") if isinstance(e, SchedPreempted) else e
        for e in small_session.events
    ]
    (line,) = preempted_lines(session_from_events(by_reset))
    assert line.startswith("preempted by reset_prefix_cache: blocks freed, back to the waiting")


# ---------------------------------------------------------------------------
# Bad input: one clear sentence, never a traceback
# ---------------------------------------------------------------------------
def _write(path: Path, lines: list) -> str:
    """JSON lines: typed events as the tracer writes them, dicts and strings as given."""

    def line(x) -> str:
        if isinstance(x, TraceEvent):
            return msgspec.json.encode(x).decode()
        return x if isinstance(x, str) else json.dumps(x)

    path.write_text("".join(line(x) + "\n" for x in lines))
    return str(path)


@pytest.fixture(scope="module")
def small_events(small_trace_path) -> list[TraceEvent]:
    return load_trace(small_trace_path)


def test_missing_directory_and_empty_files(tmp_path):
    with pytest.raises(TraceLoadError, match=r"no trace file at .*glassbox trace"):
        open_session(str(tmp_path / "nope.jsonl"))
    with pytest.raises(TraceLoadError, match="is a directory"):
        open_session(str(tmp_path))
    (tmp_path / "empty.jsonl").write_text("")
    with pytest.raises(TraceLoadError, match="is empty"):
        open_session(str(tmp_path / "empty.jsonl"))


def test_truncated_and_corrupt_files(tmp_path, small_trace_path):
    text = Path(small_trace_path).read_text()
    cut = tmp_path / "cut.jsonl"
    cut.write_text(text[: len(text) // 2])  # ends in the middle of a line
    with pytest.raises(TraceLoadError, match=r"is truncated: its last line \(line \d+\)"):
        open_session(str(cut))
    lines = text.splitlines(keepends=True)
    bad = tmp_path / "bad.jsonl"
    bad.write_text("".join(lines[:5]) + "{oops\n" + "".join(lines[5:]))
    with pytest.raises(TraceLoadError, match="is corrupt at line 6"):
        open_session(str(bad))


def test_json_that_is_not_a_trace(tmp_path):
    with pytest.raises(TraceLoadError, match="not a Glassbox trace"):
        open_session(_write(tmp_path / "a.jsonl", [{"hello": 1}, {"world": 2}]))
    with pytest.raises(TraceLoadError, match="not a Glassbox trace"):
        open_session(_write(tmp_path / "b.jsonl", [[1, 2, 3]]))
    # A lifecycle-less trace (only front-end events): nothing to replay.
    added = {
        "ts": 1,
        "pid": 1,
        "seq": 1,
        "kind": "request.added",
        "request_id": "a",
        "num_prompt_tokens": 3,
    }
    with pytest.raises(TraceLoadError, match="cannot be replayed: .*kv.init"):
        open_session(_write(tmp_path / "c.jsonl", [added]))
    # Events that load_trace did not read (plain dicts) are refused, not half-replayed.
    with pytest.raises(TraceLoadError, match="not a Glassbox trace: event 1 is a dict"):
        session_from_events([added])


def test_traces_from_another_version(tmp_path, small_events):
    # Announces a format this version does not read.
    header = TraceHeader(
        ts=0, pid=1, seq=0, trace_format_version="99", glassbox_version="7.1", trace_level="full"
    )
    with pytest.raises(TraceLoadError, match="trace format version '99'; this Glassbox reads"):
        session_from_events([header, *small_events], path="old.jsonl")
    # The same from a file (load_trace checks the header).
    path = _write(tmp_path / "v99.jsonl", [header, *small_events])
    with pytest.raises(
        TraceLoadError, match=r"version '99'; this Glassbox reads version 1\.x .*7\.1"
    ):
        open_session(path)
    # A header of this version, or none (version 1.0), opens.
    this_version = msgspec.structs.replace(header, trace_format_version=TRACE_FORMAT_VERSION)
    path = _write(tmp_path / "v1.jsonl", [this_version, *small_events])
    assert open_session(path).num_steps == session_from_events(small_events).num_steps
    path = _write(tmp_path / "none.jsonl", small_events)
    assert open_session(path).num_steps == session_from_events(small_events).num_steps
    # Written by a version whose events carried other field names.
    renamed = [
        {
            ("prompt_len" if k == "num_prompt_tokens" else k): v
            for k, v in msgspec.to_builtins(e).items()
        }
        if isinstance(e, SchedQueued)
        else e
        for e in small_events
    ]
    with pytest.raises(TraceLoadError, match="another version of Glassbox.*num_prompt_tokens"):
        open_session(_write(tmp_path / "renamed.jsonl", renamed))
    # Or whose block pool worked differently: the replay's own checks catch it.
    shuffled = [
        msgspec.structs.replace(e, block_ids=e.block_ids[::-1])
        if isinstance(e, KVAllocated) and len(e.block_ids) > 1
        else e
        for e in small_events
    ]
    with pytest.raises(TraceLoadError, match="cannot be replayed: .*another version"):
        session_from_events(shuffled, path="odd.jsonl")


def test_a_trace_cut_at_a_line_boundary_opens_as_truncated(
    cut_trace_path, small_trace_path, tmp_path
):
    """Every line that is left is a whole event, so only the missing
    ``trace.end`` tells: the session and the summary say it is truncated."""
    session = open_session(cut_trace_path)
    assert session.truncated is not None
    assert session.truncated.startswith(f"{cut_trace_path} is truncated: the process that wrote")
    assert request_summary(session).splitlines()[0] == f"WARNING: {session.truncated}."
    # The same run, whole: not truncated; a trace before 1.3 (no end line) never is.
    whole = write_as_version_1_3(load_trace(small_trace_path), tmp_path / "whole.jsonl")
    assert open_session(whole).truncated is None
    assert open_session(small_trace_path).truncated is None
    assert not request_summary(open_session(whole)).startswith("WARNING")


def test_a_truncated_trace_that_cannot_be_replayed_says_truncated_first(small_trace_path, tmp_path):
    events = load_trace(small_trace_path)
    # Cut before the kv.init line: nothing to replay.
    kv_init = next(i for i, e in enumerate(events) if e.kind == "kv.init")
    path = write_as_version_1_3(events[:kv_init], tmp_path / "early.jsonl", drop_last=1)
    with pytest.raises(TraceLoadError, match=r"is truncated: .*what is left cannot be replayed"):
        open_session(path)


def test_highlights_say_where_the_run_shows_what_the_followed_request_does_not(
    small_session: TraceSession,
):
    found = small_session.highlights()
    assert (found["preemption"].request_id, found["preemption"].step) == ("bg-5", 31)
    # bg-4 repeats your prompt: the largest prefix hit.
    assert (found["prefix hit"].request_id, found["prefix hit"].step) == ("bg-4", 12)
    assert found["chunked prefill"].request_id == "bg-3"
    assert found["chunked prefill"].text == "prefill in 3 chunks, steps 2-4"
    # Your prompt hits the shared system prompt, in one chunk, and is not preempted.
    elsewhere = small_session.highlights_elsewhere("prompt")
    assert [(h.what, h.request_id) for h in elsewhere] == [
        ("preemption", "bg-5"),
        ("chunked prefill", "bg-3"),
    ]
    assert [h.what for h in small_session.highlights_elsewhere("bg-5")] == ["chunked prefill"]
    summary = request_summary(small_session)
    assert "    preemption       bg-5, preempted at step 31 (--follow bg-5)" in summary
    of_bg5 = request_summary(small_session, "bg-5")
    assert "    chunked prefill  bg-3, prefill in 3 chunks" in of_bg5
    assert "    preemption  " not in of_bg5
