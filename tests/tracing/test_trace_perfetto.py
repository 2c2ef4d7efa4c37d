"""The Perfetto / Chrome trace-event export (engine/tracing/perfetto.py) and
``glassbox trace-export``.

Perfetto's Python trace processor needs a ``trace_processor_shell`` binary
that it downloads at run time, which an offline machine cannot do, so the
output is checked against the trace-event format's rules instead
(docs: Chrome "Trace Event Format"; Perfetto's JSON importer):

  * the file is ``{"traceEvents": [...]}`` and every event has the fields
    its ``ph`` requires, with µs timestamps;
  * complete slices (X) on one (pid, tid) nest: two either nest or are disjoint;
  * async spans (b/e) balance per (cat, id), as a stack, names matching;
    their instants (n) fall inside an open span;
  * every flow start (s) has one finish (f) with the same id, cat and name,
    not earlier, and each lies inside a slice on its own thread (that is
    what flow events bind to);
  * counters (C) carry numeric series; metadata (M) names processes/threads.
"""

from __future__ import annotations

import json
from collections import defaultdict

import pytest

from engine.entrypoints.cli.main import main
from engine.tracing import Tracer, build_perfetto, export_perfetto, load_trace
from tests.tracing.scenario import internal_ids

REQUIRED = {
    "X": {"name", "ts", "dur", "pid", "tid"},
    "i": {"name", "ts", "pid", "tid", "s"},
    "C": {"name", "ts", "pid", "args"},
    "b": {"name", "cat", "id", "ts", "pid"},
    "n": {"name", "cat", "id", "ts", "pid"},
    "e": {"name", "cat", "id", "ts", "pid"},
    "s": {"name", "cat", "id", "ts", "pid", "tid"},
    "f": {"name", "cat", "id", "ts", "pid", "tid"},
    "M": {"name", "pid", "args"},
}


def validate_trace_events(doc: dict) -> dict[str, int]:
    """Assert ``doc`` follows the trace-event rules above; returns counts per ph."""
    assert isinstance(doc, dict) and isinstance(doc["traceEvents"], list)
    json.dumps(doc)  # serialisable as is
    counts: dict[str, int] = defaultdict(int)
    slices = defaultdict(list)
    for ev in doc["traceEvents"]:
        ph = ev["ph"]
        assert ph in REQUIRED, f"unexpected phase {ph!r}"
        missing = REQUIRED[ph] - set(ev)
        assert not missing, f"{ph} event lacks {missing}: {ev}"
        counts[ph] += 1
        if ph != "M":
            assert isinstance(ev["ts"], (int, float)) and ev["ts"] >= 0
        if ph == "X":
            assert ev["dur"] >= 0
            slices[(ev["pid"], ev["tid"])].append((ev["ts"], ev["ts"] + ev["dur"], ev["name"]))
        if ph == "C":
            assert ev["args"] and all(isinstance(v, (int, float)) for v in ev["args"].values())
        if ph == "M":
            assert ev["name"] in ("process_name", "thread_name") and ev["args"]["name"]
        if ph == "i":
            assert ev["s"] in ("g", "p", "t")
    # X slices nest per thread.
    eps = 1e-6
    for track, items in slices.items():
        items.sort(key=lambda s: (s[0], -(s[1] - s[0])))
        stack = []
        for start, end, name in items:
            while stack and stack[-1][1] <= start + eps:
                stack.pop()
            if stack:
                assert end <= stack[-1][1] + eps, f"{name} overlaps {stack[-1][2]} on {track}"
            stack.append((start, end, name))
    # Async spans balance per (cat, id), in time order (stable for equal ts).
    events = sorted((ev for ev in doc["traceEvents"] if ev["ph"] in "bne"), key=lambda ev: ev["ts"])
    open_spans = defaultdict(list)
    for ev in events:
        key = (ev["cat"], ev["id"])
        if ev["ph"] == "b":
            open_spans[key].append(ev["name"])
        elif ev["ph"] == "n":
            assert open_spans[key], f"instant outside any span: {ev}"
        else:
            assert open_spans[key] and open_spans[key][-1] == ev["name"], f"unbalanced e: {ev}"
            open_spans[key].pop()
    assert not any(open_spans.values()), "async spans left open"
    # Flows pair up and bind to slices on their threads.
    starts = {ev["id"]: ev for ev in doc["traceEvents"] if ev["ph"] == "s"}
    finishes = {ev["id"]: ev for ev in doc["traceEvents"] if ev["ph"] == "f"}
    assert len(starts) == counts["s"] and len(finishes) == counts["f"], "flow ids repeat"
    assert set(starts) == set(finishes)
    for fid, s in starts.items():
        f = finishes[fid]
        assert (s["cat"], s["name"]) == (f["cat"], f["name"])
        assert f["ts"] >= s["ts"]
        assert f.get("bp") == "e"
        for ev in (s, f):
            assert any(
                a <= ev["ts"] + eps and ev["ts"] <= b + eps
                for a, b, _ in slices[(ev["pid"], ev["tid"])]
            ), f"flow event binds to no slice: {ev}"
    return dict(counts)


@pytest.fixture(scope="module")
def scenario_trace(full_real_scenario):
    return full_real_scenario[0]


def test_export_of_a_real_run_is_valid(scenario_trace, tmp_path):
    out = tmp_path / "out.json"
    doc = export_perfetto(scenario_trace, str(out))
    assert json.loads(out.read_text()) == doc
    counts = validate_trace_events(doc)
    for ph in ("X", "b", "e", "n", "C", "s", "f", "M", "i"):
        assert counts.get(ph, 0) > 0, ph
    events = load_trace(scenario_trace)
    num_steps = sum(e.kind == "sched.step" for e in events)
    names = [ev["name"] for ev in doc["traceEvents"] if ev["ph"] == "X"]
    assert sum(n.startswith("step ") for n in names) == num_steps
    assert names.count("schedule()") == num_steps
    assert names.count("forward") == sum(e.kind == "runner.forward" for e in events)
    # One front-end span and one core span per request, named by the internal
    # id; the front-end span's args also give the id the request was sent under.
    spans = {ev["name"] for ev in doc["traceEvents"] if ev["ph"] == "b"}
    internal = internal_ids(events)
    for sent in ("a", "b", "long", "stop", "doomed", "c", "d"):
        rid = internal[sent]
        assert f"request {rid}" in spans and f"core {rid}" in spans
        (begin,) = [
            ev for ev in doc["traceEvents"] if ev["ph"] == "b" and ev["name"] == f"request {rid}"
        ]
        assert begin["args"]["request_id"] == rid
        assert begin["args"]["external_req_id"] == sent
    assert {"waiting", "running", "preempted"} <= spans
    counters = {ev["name"] for ev in doc["traceEvents"] if ev["ph"] == "C"}
    assert {"KV cache blocks", "requests", "scheduled tokens"} <= counters
    # Without process-hop events, flows join request.added -> sched.queued and
    # sched.update -> request.output: one per request in, one per output back.
    flows = [ev for ev in doc["traceEvents"] if ev["ph"] == "s"]
    outputs = sum(e.kind == "request.output" for e in events)
    assert sum(f["name"] == "request in" for f in flows) == 7
    assert sum(f["name"] == "output" for f in flows) == outputs


def test_forward_slice_is_placed_by_start_ts_when_present(tmp_path):
    """On CUDA ``runner.forward`` is written after sampling; its slice starts at
    ``start_ts``. A version-1 trace's forward without ``start_ts`` (written on
    CPU right after the forward) ends at its ``ts``."""
    base = 1_000_000_000_000
    fields = {"kind": "runner.forward", "pid": 1, "num_tokens": 4, "num_logits": 4}
    events = [
        {
            **fields,
            "ts": base + 9_000_000,
            "seq": 1,
            "step": 1,
            "duration_ns": 2_000_000,
            "start_ts": base + 1_000_000,
        },
        {**fields, "ts": base + 20_000_000, "seq": 2, "step": 2, "duration_ns": 3_000_000},
    ]
    path = tmp_path / "forwards.jsonl"
    path.write_text("".join(json.dumps(e) + "\n" for e in events))
    doc = build_perfetto(load_trace(str(path)))
    slices = sorted(
        (ev for ev in doc["traceEvents"] if ev["ph"] == "X" and ev["name"] == "forward"),
        key=lambda ev: ev["ts"],
    )
    assert [(s["ts"] - slices[0]["ts"], s["dur"]) for s in slices] == [(0, 2000), (16000, 3000)]


def test_a_forward_launched_while_the_previous_one_runs_starts_at_its_end(tmp_path):
    """Async scheduling on CUDA: step 2's forward is launched (``start_ts``)
    while step 1's still runs on the device; one stream runs them one after
    the other, so its slice starts where step 1's ends, with its own length."""
    base = 1_000_000_000_000
    fields = {"kind": "runner.forward", "pid": 1, "num_tokens": 4, "num_logits": 4}
    events = [
        {"kind": "kv.cache_reset", "pid": 1, "ts": base, "seq": 1},  # the trace's start
        {**fields, "ts": base + 9_000_000, "seq": 2, "step": 1, "duration_ns": 4_000_000,
         "start_ts": base + 1_000_000},
        {**fields, "ts": base + 10_000_000, "seq": 3, "step": 2, "duration_ns": 3_000_000,
         "start_ts": base + 2_000_000},
    ]  # fmt: skip
    path = tmp_path / "forwards.jsonl"
    path.write_text("".join(json.dumps(e) + "\n" for e in events))
    doc = build_perfetto(load_trace(str(path)))
    validate_trace_events(doc)
    slices = sorted(
        (ev for ev in doc["traceEvents"] if ev["ph"] == "X" and ev["name"] == "forward"),
        key=lambda ev: ev["ts"],
    )
    t0 = slices[0]["ts"]
    assert [(s["args"]["step"], s["ts"] - t0, s["dur"]) for s in slices] == [
        (1, 0, 4000),
        (2, 4000, 3000),
    ]


def test_kv_counter_adds_up_to_the_usable_pool(scenario_trace):
    doc = build_perfetto(load_trace(scenario_trace))
    kv = [ev for ev in doc["traceEvents"] if ev["ph"] == "C" and ev["name"] == "KV cache blocks"]
    assert kv
    for ev in kv:
        assert sum(ev["args"].values()) == 15  # 16 blocks minus the null block
    assert max(ev["args"]["used"] for ev in kv) > 0
    assert any(ev["args"]["free (cached)"] > 0 for ev in kv)


def test_process_hop_events_become_flows_across_processes(tmp_path):
    """A two-process trace (front end + engine core) with the hop events the
    multi-process engine writes: flows go between the processes."""
    front, core = tmp_path / "run.jsonl.frontend-1.part", tmp_path / "run.jsonl.core-2.part"
    ts = 1_800_000_000_000_000_000

    def ev(pid, seq, dt, kind, **fields):
        return {"ts": ts + dt * 1000, "pid": pid, "seq": seq, "kind": kind, **fields}

    front_events = [
        ev(1, 1, 0, "api.request", request_id="r1", endpoint="/v1/completions"),
        ev(1, 2, 5, "request.added", request_id="r1", num_prompt_tokens=3),
        ev(1, 3, 6, "request.sent", type="add", request_id="r1"),
        ev(1, 4, 90, "output.received", request_ids=["r1"]),
        ev(1, 5, 91, "request.output", request_id="r1", new_token_ids=[7], text_delta="x"),
        ev(1, 6, 92, "request.finished", request_id="r1", finish_reason="length"),
        ev(1, 7, 95, "api.chunk", request_id="r1", num_bytes=12),
    ]
    core_events = [
        ev(2, 1, 1, "kv.init", num_blocks=4, block_size=4, null_block_id=0, enable_caching=True),
        ev(2, 2, 20, "request.received", type="add", request_id="r1"),
        ev(2, 3, 21, "sched.queued", request_id="r1", num_prompt_tokens=3, max_tokens=1),
        ev(
            2,
            4,
            30,
            "sched.admitted",
            step=1,
            request_id="r1",
            resumed=False,
            num_computed_tokens=0,
            num_new_tokens=3,
            num_tokens=3,
        ),
        ev(2, 5, 31, "kv.allocated", step=1, request_id="r1", block_ids=[1], num_blocks=1),
        ev(
            2,
            6,
            32,
            "sched.step",
            step=1,
            token_budget=16,
            token_budget_left=13,
            num_scheduled_tokens={"r1": 3},
            total_num_scheduled_tokens=3,
            num_running=1,
            num_waiting=0,
            duration_ns=3000,
        ),
        ev(
            2,
            7,
            60,
            "sched.finished",
            step=1,
            request_id="r1",
            status="FINISHED_LENGTH_CAPPED",
            finish_reason="length",
        ),
        ev(2, 8, 61, "kv.freed", step=1, request_id="r1", block_ids=[1], to_free_queue=[1]),
        ev(
            2,
            9,
            62,
            "sched.update",
            step=1,
            new_token_ids={"r1": [7]},
            finished={"r1": "length"},
            num_running=0,
            num_waiting=0,
            duration_ns=2000,
        ),
        ev(2, 10, 70, "output.sent", request_ids=["r1"]),
    ]
    for path, evs in ((front, front_events), (core, core_events)):
        path.write_text("".join(json.dumps(e) + "\n" for e in evs))
    out = tmp_path / "out.json"
    assert main(["trace-export", str(tmp_path / "run.jsonl"), "-o", str(out)]) == 0
    assert (tmp_path / "run.jsonl").exists() and not front.exists()  # parts were merged
    doc = json.loads(out.read_text())
    validate_trace_events(doc)
    flows = {ev["id"]: [] for ev in doc["traceEvents"] if ev["ph"] == "s"}
    for e in doc["traceEvents"]:
        if e["ph"] in "sf":
            flows[e["id"]].append((e["ph"], e["pid"]))
    assert sorted(flows.values()) == [[("s", 1), ("f", 2)], [("s", 2), ("f", 1)]]
    names = {
        e["args"]["name"]
        for e in doc["traceEvents"]
        if e["ph"] == "M" and e["name"] == "process_name"
    }
    assert names == {"API server + front end (pid 1)", "engine core (pid 2)"}
    assert {e["name"] for e in doc["traceEvents"] if e["ph"] == "i"} >= {"api.request", "api.chunk"}


def test_cli_trace_export(scenario_trace, tmp_path, capsys):
    out = tmp_path / "cli.json"
    assert main(["trace-export", scenario_trace, "-o", str(out)]) == 0
    assert "trace events" in capsys.readouterr().out
    validate_trace_events(json.loads(out.read_text()))
    assert main(["trace-export", str(tmp_path / "missing.jsonl"), "-o", str(out)]) == 2
    assert "no trace at" in capsys.readouterr().err
    bad = tmp_path / "bad.jsonl"
    bad.write_text("{not json\n")
    assert main(["trace-export", str(bad), "-o", str(out)]) == 2
    assert "not a JSON trace event" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["trace-export", scenario_trace])  # -o is required


def test_validator_rejects_overlapping_slices_and_open_spans():
    """The checks above can fail."""
    bad_nesting = {
        "traceEvents": [
            {"name": "a", "ph": "X", "ts": 0, "dur": 10, "pid": 1, "tid": 1},
            {"name": "b", "ph": "X", "ts": 5, "dur": 10, "pid": 1, "tid": 1},
        ]
    }
    with pytest.raises(AssertionError, match="overlaps"):
        validate_trace_events(bad_nesting)
    open_span = {"traceEvents": [{"name": "r", "cat": "c", "ph": "b", "id": 1, "ts": 0, "pid": 1}]}
    with pytest.raises(AssertionError, match="left open"):
        validate_trace_events(open_span)
    lonely_flow = {
        "traceEvents": [
            {"name": "a", "ph": "X", "ts": 0, "dur": 10, "pid": 1, "tid": 1},
            {"name": "h", "cat": "hop", "ph": "s", "id": 1, "ts": 1, "pid": 1, "tid": 1},
        ]
    }
    with pytest.raises(AssertionError):
        validate_trace_events(lonely_flow)


def test_export_of_an_empty_tracer_file_is_refused(tmp_path, capsys):
    path = tmp_path / "empty.jsonl"
    Tracer(str(path), "lifecycle").close()
    assert main(["trace-export", str(path), "-o", str(tmp_path / "o.json")]) == 2
    assert "holds no events" in capsys.readouterr().err
