"""The tracer's file side (engine/tracing/tracer.py): the ``trace.header``
line, buffered recording (what is on disk when, what a crash loses), the
encoding (JSON lines equal to what ``json.dumps`` writes for each event),
``record_rows``, threads, and the rule that only the worker's trace objects
import torch. Version checks on reading: test_trace_version.py.

Also ``engine/tracing/tensors.py``: values gathered for one device-to-host
copy are exactly what ``tolist`` gives.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
import threading
from pathlib import Path

import msgspec
import numpy as np
import pytest
import torch

from engine.tracing import (
    DEFAULT_BUFFER_SIZE,
    END_KIND,
    HEADER_KIND,
    TRACE_FORMAT_VERSION,
    KVCacheReset,
    KVFreed,
    KVInit,
    RequestAdded,
    RequestOutputEvent,
    SamplerSampled,
    SamplerStage,
    SchedFinished,
    SchedQueued,
    SchedStep,
    SchedUpdate,
    TraceEnd,
    TraceHeader,
    Tracer,
    build_perfetto,
    find_truncation,
    load_trace,
    merge_trace_parts,
    read_events,
)
from engine.tracing.tensors import HostListsCopy, array_summaries
from tests.tracing.scenario import internal_ids, make_engine, run_scenario

ROOT = Path(__file__).resolve().parents[2]


def _lines(path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines()]


def _queued(request_id: str, **fields) -> SchedQueued:
    return SchedQueued(request_id=request_id, num_prompt_tokens=1, max_tokens=1, **fields)


def _kv_init() -> KVInit:
    return KVInit(num_blocks=4, block_size=2, null_block_id=0, enable_caching=True)


def test_the_file_opens_with_a_header(tmp_path):
    path = tmp_path / "t.jsonl"
    tracer = Tracer(str(path), "full")
    tracer.record(_kv_init())
    tracer.close()
    header, event, end = _lines(path)
    assert header["kind"] == HEADER_KIND and "seq" not in header  # seq 0: the default
    assert header["trace_format_version"] == TRACE_FORMAT_VERSION == "1.13"
    assert header["glassbox_version"] == __import__("engine").__version__
    assert header["trace_level"] == "full" and header["pid"] == event["pid"]
    assert "role" not in header  # not a part file: no role
    assert header["ts"] <= event["ts"]
    # Closing ends the file with trace.end, counting the events written.
    assert end == {
        "kind": END_KIND,
        "ts": end["ts"],
        "pid": event["pid"],
        "seq": 2,
        "num_events": 1,
    }
    assert event["ts"] <= end["ts"]
    # load_trace checks the header and leaves it out, unless asked; the end always.
    assert [e.kind for e in load_trace(str(path))] == ["kv.init"]
    with_header = load_trace(str(path), include_header=True)
    assert [e.kind for e in with_header] == [HEADER_KIND, "kv.init"]
    assert type(with_header[0]) is TraceHeader and with_header[0].seq == 0
    assert with_header[1].seq == 1
    every_line = read_events(str(path))
    assert type(every_line[-1]) is TraceEnd and every_line[-1].num_events == 1
    assert find_truncation(every_line) is None


def test_events_are_buffered_until_a_flush_point(tmp_path):
    path = tmp_path / "b.jsonl"
    tracer = Tracer(str(path), "lifecycle", buffer_size=4)
    tracer.set_step(7)
    for i in range(3):
        tracer.record(_queued(f"r{i}"))
    assert [e["kind"] for e in _lines(path)] == [HEADER_KIND]
    tracer.record(_queued("r3"))  # the fourth: the buffer is written
    assert [e.get("request_id") for e in _lines(path)[1:]] == ["r0", "r1", "r2", "r3"]
    tracer.record(KVFreed(request_id="r0", block_ids=[1], step=3))  # an explicit step wins
    assert len(_lines(path)) == 5  # kept until a flush point
    tracer.flush()  # flush(): everything, readable by another process
    events = load_trace(str(path))
    assert [e.seq for e in events] == [1, 2, 3, 4, 5]
    assert [e.step for e in events] == [7, 7, 7, 7, 3]
    tracer.close()
    tracer.record(_queued("late"))  # after close: dropped
    tracer.flush()
    tracer.close()
    assert len(load_trace(str(path))) == 5
    with pytest.raises(ValueError, match="buffer_size must be"):
        Tracer(str(tmp_path / "x.jsonl"), "lifecycle", buffer_size=0)


_CHILD = """
import os, sys
sys.path.insert(0, {root!r})
from engine.tracing import SchedQueued, Tracer
tracer = Tracer({path!r}, "lifecycle", buffer_size=10)
for i in range(25):
    tracer.record(SchedQueued(request_id=f"r{{i}}", num_prompt_tokens=1, max_tokens=1))
if {crash}:
    os._exit(1)  # no close, no finalizers: what a SIGKILL or a segfault leaves
# A normal exit without close(): the finalizer writes the rest.
"""


@pytest.mark.parametrize("async_scheduling", [True, False], ids=["async", "sync"])
def test_the_engine_core_writes_every_step_while_the_forward_runs(
    tiny_model_dir, tmp_path, async_scheduling
):
    """The engine core flushes once per step, as it launches the step
    (``engine.step_launched``): from then on, while the device runs it, every
    event up to that launch is in the file and the tracer holds nothing
    (docs/trace_format.md: why every step). The same in both loops."""
    trace = str(tmp_path / "run.jsonl")
    engine = make_engine(
        tiny_model_dir, trace, "lifecycle", real_model=True, async_scheduling=async_scheduling
    )
    core = engine.engine_core.engine_core
    assert (core.batch_queue is not None) is async_scheduling
    tracer = engine.tracer  # in-process: one tracer for all
    tracer.flush()  # the set-up's events: counted from the file
    recorded = [len(load_trace(trace))]  # events handed to the tracer so far
    record, record_rows = tracer.record, tracer.record_rows

    def counting_record(event):
        recorded[0] += 1
        record(event)

    def counting_record_rows(event_type, columns):
        recorded[0] += len(next(iter(columns.values()), []))
        record_rows(event_type, columns)

    tracer.record, tracer.record_rows = counting_record, counting_record_rows
    seen: list[tuple[int, int, int, int]] = []
    step_launched = core.trace.step_launched

    def check_after_the_launch(step, num_in_flight):
        step_launched(step, num_in_flight)
        written = load_trace(trace)
        scheduled = [e.step for e in written if e.kind == "sched.step"]
        launched = [e.step for e in written if e.kind == "engine.step_launched"]
        held = recorded[0] - len(written)
        seen.append((core.scheduler.step_counter, scheduled[-1], launched[-1], held))

    core.trace.step_launched = check_after_the_launch
    try:
        run_scenario(engine, real_model=True)
    finally:
        engine.shutdown()
    assert len(seen) >= 10
    for step, last_scheduled, last_launched, held in seen:
        assert last_scheduled == last_launched == step and held == 0, seen


@pytest.mark.parametrize("crash", [True, False], ids=["crash", "exit-unclosed"])
def test_what_a_process_that_never_closes_its_tracer_leaves(tmp_path, crash):
    path = tmp_path / "child.jsonl"
    code = _CHILD.format(root=str(ROOT), path=str(path), crash=crash)
    subprocess.run([sys.executable, "-c", code], check=False, timeout=60)
    events = load_trace(str(path))
    truncated = find_truncation(read_events(str(path)), "child")
    if crash:
        # The two full buffers were written; the last 5 events (< buffer_size) are lost.
        assert [e.request_id for e in events] == [f"r{i}" for i in range(20)]
        assert truncated is not None and truncated.startswith("child is truncated")
    else:
        # The finalizer wrote the rest and the end line.
        assert len(events) == 25 and truncated is None


def _as_item(value):
    return value.item() if hasattr(value, "item") else list(value)


def test_the_encoding_is_the_json_json_dumps_writes(tmp_path):
    """Each line is the JSON object ``json.dumps`` writes for ``{kind, ts,
    pid, seq, step?, **fields}`` with the fields in the class's order and
    those at their default left out; only number and non-ASCII spelling may
    differ (1e-05 is written 0.00001, text as UTF-8 rather than \\u escapes).
    Numpy scalars and 0-d tensors are written as their values."""
    path = tmp_path / "e.jsonl"
    tracer = Tracer(str(path), "full")
    cases = [
        (
            RequestOutputEvent(request_id="é✓", new_token_ids=[1], text_delta='line\n"quoted"\t'),
            {"request_id": "é✓", "new_token_ids": [1], "text_delta": 'line\n"quoted"\t'},
        ),
        (
            SchedStep(
                token_budget=16,
                token_budget_left=13,
                num_scheduled_tokens={"b": 2, "a": 1},
                total_num_scheduled_tokens=3,
                kv_cache_usage=1e-05,
                duration_ns=1_800_000_000_000_000_123,
            ),
            {
                "token_budget": 16,
                "token_budget_left": 13,
                "num_scheduled_tokens": {"b": 2, "a": 1},
                "total_num_scheduled_tokens": 3,
                "kv_cache_usage": 1e-05,
                "duration_ns": 1_800_000_000_000_000_123,
            },
        ),
        (
            SchedQueued(
                request_id="q", num_prompt_tokens=3, max_tokens=2, arrival_time=-0.123456789012345
            ),
            {
                "request_id": "q",
                "num_prompt_tokens": 3,
                "max_tokens": 2,
                "arrival_time": -0.123456789012345,
            },
        ),
        (
            SchedFinished(
                request_id="f", status="FINISHED_STOPPED", finish_reason="stop", stop_reason=None
            ),
            {"request_id": "f", "status": "FINISHED_STOPPED", "finish_reason": "stop"},
        ),
        (
            SamplerSampled(
                request_id="s",
                row=torch.tensor(7),
                token_id=np.int64(42),
                logprob=np.float32(0.25),
                greedy=True,
                stages=[SamplerStage(stage="raw", token_ids=(1, 2), probs=[0.5, 0.25])],
                step=99,
            ),
            {
                "request_id": "s",
                "row": torch.tensor(7),
                "token_id": np.int64(42),
                "logprob": np.float32(0.25),
                "greedy": True,
                "stages": [{"stage": "raw", "token_ids": (1, 2), "probs": [0.5, 0.25]}],
            },
        ),
        (KVCacheReset(), {}),
    ]
    tracer.set_step(5)
    for event, _ in cases:
        tracer.record(event)
    tracer.close()
    *lines, end = Path(path).read_text().splitlines()[1:]
    assert len(lines) == len(cases) and json.loads(end)["kind"] == END_KIND
    for line, (event, fields), seq in zip(lines, cases, range(1, len(cases) + 1)):
        record = json.loads(line)
        expected = {"kind": event.kind, "ts": record["ts"], "pid": tracer.pid, "seq": seq}
        expected["step"] = 99 if event.kind == "sampler.sampled" else 5
        expected.update(json.loads(json.dumps(fields, default=_as_item)))
        assert list(record.items()) == list(expected.items())
    assert "é✓" in Path(path).read_text(encoding="utf-8")


_ROW_COLUMNS = {
    "request_id": ["a", "b", "c"],
    "row": [0, 2, 5],
    "token_id": [7, 8, 9],
    "logprob": [-0.5, -1.25, 0.0],
    "greedy": [True, False, True],
}


@pytest.mark.parametrize("buffer_size", [1, DEFAULT_BUFFER_SIZE])
def test_record_rows_writes_what_a_loop_of_records_writes(tmp_path, buffer_size):
    """``record_rows`` defers building the per-row events to the encoder; the
    lines are those of one ``record`` per row (ts apart), seq numbers running
    on across ordinary events, a ``step`` column winning over the tracer's."""
    columns = _ROW_COLUMNS
    finished = {
        "step": [10, 11],
        "request_id": ["x", "y"],
        "status": ["FINISHED_STOPPED"] * 2,
        "finish_reason": ["stop"] * 2,
    }
    written = {}
    for how in ("rows", "loop"):
        path = tmp_path / f"{how}.jsonl"
        tracer = Tracer(str(path), "lifecycle", buffer_size=buffer_size)
        tracer.set_step(3)
        tracer.record(SchedStep(token_budget=16, token_budget_left=16, num_running=3))
        if how == "rows":
            tracer.record_rows(SamplerSampled, columns)
            empty = {"request_id": [], "row": [], "token_id": [], "logprob": []}
            tracer.record_rows(SamplerSampled, empty)  # no rows: no lines
            tracer.record_rows(SchedFinished, finished)
        else:
            for j in range(3):
                tracer.record(SamplerSampled(**{k: v[j] for k, v in columns.items()}))
            for j in range(2):
                tracer.record(SchedFinished(**{k: v[j] for k, v in finished.items()}))
        tracer.record(SchedUpdate(num_running=0))
        tracer.close()
        *events, end = _lines(path)[1:]
        assert end["kind"] == END_KIND and end["num_events"] == len(events) == 7
        written[how] = [{k: v for k, v in e.items() if k != "ts"} for e in events]
    assert written["rows"] == written["loop"]
    assert [e["seq"] for e in written["rows"]] == list(range(1, 8))
    assert [e["step"] for e in written["rows"]] == [3, 3, 3, 3, 10, 11, 3]
    assert list(written["rows"][1]) == ["kind", "pid", "seq", "step", *columns]


def test_record_rows_refuses_columns_of_different_lengths(tmp_path):
    tracer = Tracer(str(tmp_path / "r.jsonl"), "lifecycle")
    with pytest.raises(ValueError, match=r"sampler.sampled: columns of different lengths \[2, 3\]"):
        tracer.record_rows(SamplerSampled, {"request_id": ["a", "b"], "row": [0, 1, 2]})
    tracer.close()
    Tracer().record_rows(SamplerSampled, {"a": [1], "b": [1, 2]})  # off: nothing is looked at


def test_host_lists_copy_equals_tolist_on_the_cpu():
    tensors = [
        torch.tensor([0.5, -1.25]),
        torch.tensor([[1, 2], [3, 4]]),
        torch.tensor([True]),
        torch.tensor([[[1.5, 2.0]], [[3.0, -4.0]]], dtype=torch.bfloat16),
        torch.tensor([7, 8, 9]),
        torch.tensor(3.25),
        torch.tensor([2.0]),
    ]
    assert HostListsCopy(*tensors).lists() == [t.tolist() for t in tensors]
    assert HostListsCopy(*tensors).groups == {}  # nothing on a device: nothing copied
    gathered = HostListsCopy(*tensors, gather=True)
    # One buffer per dtype, its tensors end to end in order; nothing cast.
    assert {dtype: idx for dtype, (idx, _) in gathered.groups.items()} == {
        torch.float32: [0, 5, 6],
        torch.int64: [1, 4],
        torch.bool: [2],
        torch.bfloat16: [3],
    }
    assert gathered.groups[torch.float32][1].tolist() == [0.5, -1.25, 3.25, 2.0]
    assert gathered.lists() == [t.tolist() for t in tensors]
    assert HostListsCopy().lists() == []


def test_host_lists_copy_reuses_its_staging_buffers():
    """With ``staging`` (the sampler's per-step copies) each dtype's host buffer
    is allocated once, grown when a later copy needs more, else reused."""
    staging: dict[torch.dtype, torch.Tensor] = {}
    first = [torch.tensor([0.5, -1.25, 2.0]), torch.tensor([1, 2])]
    assert HostListsCopy(*first, gather=True, staging=staging).lists() == [
        t.tolist() for t in first
    ]
    buffers = {dtype: t.data_ptr() for dtype, t in staging.items()}
    assert {dtype: t.numel() for dtype, t in staging.items()} == {torch.float32: 3, torch.int64: 2}
    smaller = [torch.tensor([4.0]), torch.tensor([9, 8])]
    assert HostListsCopy(*smaller, gather=True, staging=staging).lists() == [[4.0], [9, 8]]
    assert {dtype: t.data_ptr() for dtype, t in staging.items()} == buffers  # reused
    larger = [torch.arange(5, dtype=torch.float32), torch.tensor([7])]
    assert HostListsCopy(*larger, gather=True, staging=staging).lists() == [
        t.tolist() for t in larger
    ]
    assert staging[torch.float32].numel() == 6  # grown: twice the old size, at least what is needed
    assert staging[torch.int64].data_ptr() == buffers[torch.int64]


def test_a_field_json_cannot_hold_fails_loudly_and_the_rest_is_written(tmp_path):
    path = tmp_path / "bad.jsonl"
    tracer = Tracer(str(path), "lifecycle")
    tracer.record(_kv_init())
    tracer.record(SchedStep(token_budget=object(), token_budget_left=0))
    tracer.record(SchedUpdate(num_running=0))
    with pytest.raises(TypeError, match="'sched.step' was not written"):
        tracer.flush()
    tracer.close()
    assert [e.kind for e in load_trace(str(path))] == ["kv.init", "sched.update"]


def test_rows_that_cannot_be_built_fail_loudly_and_the_rest_is_written(tmp_path):
    """A ``record_rows`` column the event has no field for is refused at the
    hook; rows missing a required field fail at the next flush point, like a
    value JSON cannot hold, and the events recorded beside them are written."""
    path = tmp_path / "bad_rows.jsonl"
    tracer = Tracer(str(path), "lifecycle")
    with pytest.raises(ValueError, match="no_such_field"):
        tracer.record_rows(SamplerSampled, {**_ROW_COLUMNS, "no_such_field": [1, 2, 3]})
    tracer.record(_kv_init())
    without_logprob = {k: v for k, v in _ROW_COLUMNS.items() if k != "logprob"}
    tracer.record_rows(SamplerSampled, without_logprob)
    tracer.record(SchedUpdate(num_running=0))
    with pytest.raises(TypeError, match="sampler.sampled.*logprob"):
        tracer.flush()
    tracer.close()
    assert [e.kind for e in load_trace(str(path))] == ["kv.init", "sched.update"]


def test_threads_recording_at_once_lose_nothing(tmp_path):
    path = tmp_path / "threads.jsonl"
    tracer = Tracer(str(path), "lifecycle", buffer_size=16)

    def work(name: str) -> None:
        for i in range(500):
            tracer.record(RequestOutputEvent(request_id=f"{name}-{i}"))

    threads = [threading.Thread(target=work, args=(f"t{k}",)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    tracer.close()
    events = load_trace(str(path))
    assert sorted(e.seq for e in events) == list(range(1, 2001))
    for k in range(4):  # each thread's events in its own order
        mine = [
            e.request_id
            for e in sorted(events, key=lambda e: e.seq)
            if e.request_id.startswith(f"t{k}-")
        ]
        assert mine == [f"t{k}-{i}" for i in range(500)]


def test_merged_parts_keep_one_header_per_process_earliest_first(tmp_path):
    path = str(tmp_path / "mp.jsonl")
    front = Tracer(f"{path}.frontend-1.part", "lifecycle")
    core = Tracer(f"{path}.core-2.part", "lifecycle")
    front.record(RequestAdded(request_id="r", num_prompt_tokens=1))
    core.record(_kv_init())
    front.close()
    core.close()
    merge_trace_parts(path)
    events = load_trace(path, include_header=True)
    assert [e.kind for e in events[:2]] == [HEADER_KIND, HEADER_KIND]
    assert Path(path).read_text().splitlines()[0].startswith('{"kind":"trace.header",')
    assert json.loads(Path(path).read_text().splitlines()[0])["kind"] == HEADER_KIND
    assert [e.kind for e in load_trace(path)] == ["request.added", "kv.init"]
    # The Perfetto export leaves headers out (their ts would shift the timeline).
    assert build_perfetto(load_trace(path, include_header=True)) == build_perfetto(load_trace(path))


def _plain_json_types(value, where: str, bad: list[str]) -> None:
    if type(value) in (str, int, float, bool) or value is None:
        return
    if isinstance(value, msgspec.Struct):  # the event's own nested structs
        for name in value.__struct_fields__:
            _plain_json_types(getattr(value, name), f"{where}.{name}", bad)
    elif type(value) in (list, tuple):
        for v in value:
            _plain_json_types(v, where, bad)
    elif type(value) is dict:
        for k, v in value.items():
            if type(k) is not str:
                bad.append(f"{where}: key {k!r} ({type(k).__name__})")
            _plain_json_types(v, where, bad)
    else:
        bad.append(f"{where}: {type(value).__name__}")


def test_hooks_pass_plain_values_that_stay_put_until_written(tiny_model_dir, tmp_path, monkeypatch):
    """Encoding waits for a flush point, so a hook must pass values it will
    not change afterwards, of plain JSON types (a set or an enum would be
    written differently by the batch encoder). A run traced with a buffer of
    one event (encoded at once) and one with the default buffer give the
    same events, and every field of every hook is a plain JSON value."""
    bad: list[str] = []
    real_record = Tracer.record

    def checking_record(self, event):
        for name in event.__struct_fields__:
            _plain_json_types(getattr(event, name), f"{event.kind}.{name}", bad)
        return real_record(self, event)

    real_record_rows = Tracer.record_rows

    def checking_record_rows(self, event_type, columns):
        for name, values in columns.items():
            _plain_json_types(values, f"{event_type.kind}.{name}", bad)
        return real_record_rows(self, event_type, columns)

    monkeypatch.setattr(Tracer, "record", checking_record)
    monkeypatch.setattr(Tracer, "record_rows", checking_record_rows)
    runs = {}
    for name, buffer_size in (("at-once", 1), ("buffered", DEFAULT_BUFFER_SIZE)):
        trace = str(tmp_path / f"{name}.jsonl")
        engine = make_engine(tiny_model_dir, trace, "full", real_model=True)
        engine.tracer.buffer_size = buffer_size  # in-process: one tracer for all
        try:
            run_scenario(engine, real_model=True)
        finally:
            engine.shutdown()
        clock = ("ts", "arrival_time", "duration_ns", "start_ts", "wait_ns")
        events = load_trace(trace)
        # Internal ids end in random hex: compare by the id each was sent under.
        sent = {internal: user for user, internal in internal_ids(events).items()}
        runs[name] = [
            _renamed({k: v for k, v in msgspec.to_builtins(e).items() if k not in clock}, sent)
            for e in events
        ]
    assert not bad, sorted(set(bad))
    assert runs["at-once"] == runs["buffered"]


def _renamed(value, names: dict[str, str]):
    """``value`` (plain JSON) with every string that is a key of ``names``,
    as a value or as a dict key, replaced by its name."""
    if type(value) is str:
        return names.get(value, value)
    if type(value) is list:
        return [_renamed(v, names) for v in value]
    if type(value) is dict:
        return {names.get(k, k): _renamed(v, names) for k, v in value.items()}
    return value


def test_host_lists_gathered_equal_tolist():
    tensors = [
        torch.tensor([3, 1, 2]),
        torch.tensor([0.5, -1.25, 3.0e-7], dtype=torch.float32),
        torch.tensor([True, False]),
        torch.tensor([[1.5, 2.0]], dtype=torch.bfloat16),
        torch.tensor(2**40),
        torch.tensor([7], dtype=torch.int32),
    ]
    assert HostListsCopy(*tensors, gather=True).lists() == [t.tolist() for t in tensors]
    ints = [torch.tensor([1, 2], dtype=torch.int32), torch.tensor([True]), torch.tensor(-5)]
    assert HostListsCopy(*ints, gather=True).lists() == [t.tolist() for t in ints]


def test_array_summaries():
    summaries = array_summaries(
        long=np.arange(100, dtype=np.int32),
        short=np.array([5, -3, 9], dtype=np.int64),
        table=np.array([[1, 2, 3], [4, 5, 6]], dtype=np.int32),
        wide=np.arange(300, dtype=np.int32).reshape(2, 150),
        empty=np.zeros(0, dtype=np.int64),
    )
    plain = {name: msgspec.to_builtins(s) for name, s in summaries.items()}
    assert plain["long"] == {
        "shape": [100],
        "dtype": "int32",
        "min": 0,
        "max": 99,
        "head": list(range(32)),
        "tail": list(range(68, 100)),
    }
    assert plain["short"] == {
        "shape": [3],
        "dtype": "int64",
        "min": -3,
        "max": 9,
        "values": [5, -3, 9],
    }
    assert summaries["table"].values == [[1, 2, 3], [4, 5, 6]]
    assert summaries["wide"].head == list(range(32))
    assert summaries["wide"].tail == list(range(268, 300))
    assert plain["empty"] == {"shape": [0], "dtype": "int64", "values": []}
    # Plain Python values: JSON-encodable, and what torch's tolist() gives for the same data.
    assert all(type(v) is int for v in summaries["long"].head + [summaries["long"].min])
    assert plain["table"] == {
        "shape": [2, 3],
        "dtype": "int32",
        "min": 1,
        "max": 6,
        "values": torch.tensor([[1, 2, 3], [4, 5, 6]], dtype=torch.int32).tolist(),
    }


# The modules of engine/tracing that may import torch: the worker's trace
# objects and the tensor helpers they use (the runner and sampler import them).
TORCH_MODULES = {"tensors.py", "worker_trace.py"}


def test_only_the_worker_side_of_tracing_imports_torch():
    """engine/v1/core stays torch-free: of engine/tracing only the worker's
    modules import torch, and importing the package does not load it (which
    engine/tracing modules may import: tests/test_architecture.py)."""
    for path in sorted((ROOT / "engine" / "tracing").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [node.module or ""]
            else:
                continue
            for name in names:
                if name.split(".")[0] == "torch":
                    assert path.name in TORCH_MODULES, f"{path.name} imports torch"
    code = "import sys; import engine.tracing; print('torch' in sys.modules)"
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=False
    )
    assert out.stdout.strip() == "False", out.stderr
