"""A trace of the multi-process engine: the front end and the engine core
write separate part files that are merged into one trace by time, and the
replay and the Perfetto export read it like an in-process one (with flow
arrows across the real process hop). Also ``merge_trace_parts`` itself."""

from __future__ import annotations

import json

from engine.sampling_params import SamplingParams
from engine.tracing import (
    TraceReplay,
    build_perfetto,
    find_truncation,
    load_trace,
    merge_trace_parts,
    read_events,
)
from tests.helpers.engine_fixtures import ids
from tests.tracing.scenario import REAL_MODEL_ARGS, SCENARIO_ENGINE_ARGS
from tests.tracing.test_trace_perfetto import validate_trace_events


def test_multiprocess_trace_replays_and_exports(tiny_model_dir, tmp_path):
    from engine.engine.arg_utils import EngineArgs
    from engine.v1.engine.llm_engine import LLMEngine

    trace = str(tmp_path / "mp.jsonl")
    args = EngineArgs(
        model=str(tiny_model_dir),
        trace_path=trace,
        trace_level="lifecycle",
        **SCENARIO_ENGINE_ARGS,
        **REAL_MODEL_ARGS,
    )
    engine = LLMEngine.from_engine_args(args, enable_multiprocessing=True)
    try:
        for i in range(3):
            engine.add_request(
                str(i),
                {"prompt_token_ids": ids("w1 w2 w3 w4 w5 w6") + ids(f"w{20 + i}")},
                SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True),
            )
        while engine.has_unfinished_requests():
            engine.step()
    finally:
        engine.shutdown()
    events = load_trace(trace)
    assert not list(tmp_path.glob("*.part"))
    pids = {e.pid for e in events}
    assert len(pids) == 2
    core_pid = next(e.pid for e in events if e.kind == "kv.init")
    front_pid = (pids - {core_pid}).pop()
    front_kinds = {e.kind for e in events if e.pid == front_pid}
    assert front_kinds >= {"request.added", "request.output"}
    # Each process closed its part: a header naming its role, and a trace.end.
    lines = read_events(trace)
    roles = {e.pid: e.role for e in lines if e.kind == "trace.header"}
    assert roles == {core_pid: "core", front_pid: "frontend"}
    assert {e.pid for e in lines if e.kind == "trace.end"} == pids
    assert find_truncation(lines) is None
    replay = TraceReplay(events)
    assert replay.final_state.unfinished_requests() == {}
    assert {r.status for r in replay.final_state.requests.values()} == {"FINISHED_LENGTH_CAPPED"}
    # Front-end events carry no step; the replay places them by time.
    step_of_outputs = [replay.step_of(e) for e in events if e.kind == "request.output"]
    assert step_of_outputs == sorted(step_of_outputs) and min(step_of_outputs) >= 1
    doc = build_perfetto(events)
    validate_trace_events(doc)
    flows = [ev for ev in doc["traceEvents"] if ev["ph"] in "sf"]
    crossing = {(ev["name"], ev["ph"], ev["pid"]) for ev in flows}
    assert ("request in", "s", front_pid) in crossing and ("request in", "f", core_pid) in crossing
    # The multi-process engine's own hop events carry the arrows.
    hops = {"request.sent", "request.received", "output.sent", "output.received"}
    assert hops <= {e.kind for e in events}
    assert ("outputs", "s", core_pid) in crossing and ("outputs", "f", front_pid) in crossing
    # The default loop is async: a step's outputs are sent after the next step
    # was scheduled, yet each output.sent carries the step whose tokens it holds.
    assert next(e for e in events if e.kind == "engine.config").async_scheduling
    updated = [e.step for e in events if e.kind == "sched.update" and e.new_token_ids]
    sent = [e.step for e in events if e.kind == "output.sent" and e.request_ids]
    assert sent == updated and len(sent) >= 4
    sched_seq = {e.step: e.seq for e in events if e.kind == "sched.step"}
    outputs = [e for e in events if e.kind == "output.sent" and e.request_ids]
    assert any(e.step + 1 in sched_seq and sched_seq[e.step + 1] < e.seq for e in outputs)


def _write(path, events):
    path.write_text("".join(json.dumps(e) + "\n" for e in events))


def test_merge_trace_parts(tmp_path):
    path = tmp_path / "t.jsonl"

    def ev(pid, seq, ts):
        return {"kind": "kv.cache_reset", "ts": ts, "pid": pid, "seq": seq}

    # A previous run's merged trace under the same name is replaced...
    _write(path, [ev(9, 1, 10), ev(9, 2, 20)])
    _write(tmp_path / "t.jsonl.frontend-1.part", [ev(1, 1, 100), ev(1, 2, 300)])
    _write(tmp_path / "t.jsonl.core-2.part", [ev(2, 1, 200), ev(2, 2, 300)])
    assert merge_trace_parts(str(path)) == str(path)
    merged = [(e.pid, e.ts) for e in load_trace(str(path))]
    assert merged == [(1, 100), (2, 200), (1, 300), (2, 300)]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["t.jsonl"]
    # ...while one written during this run is merged in.
    _write(tmp_path / "t.jsonl.core-3.part", [ev(3, 1, 250)])
    merge_trace_parts(str(path))
    assert [e.ts for e in load_trace(str(path))] == [100, 200, 250, 300, 300]
    # Nothing to merge: the trace is left alone.
    merge_trace_parts(str(path))
    assert len(load_trace(str(path))) == 5
