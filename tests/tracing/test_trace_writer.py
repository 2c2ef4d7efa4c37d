"""The tracer's file side (engine/tracing/__init__.py): the ``trace.header``
line and its version check, buffered emission (what is on disk when, what a
crash loses), the encoding (the same JSON lines the per-event encoder wrote),
threads, and the rule that the package is a leaf.

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

import numpy as np
import pytest
import torch

from engine.tracing import (
    DEFAULT_BUFFER_SIZE,
    HEADER_KIND,
    TRACE_FORMAT_VERSION,
    Tracer,
    TraceVersionError,
    build_perfetto,
    load_trace,
    merge_trace_parts,
)
from engine.tracing.tensors import HostListsCopy, array_summaries
from tests.tracing.scenario import make_engine, run_scenario

ROOT = Path(__file__).resolve().parents[2]


def _lines(path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines()]


def test_the_file_opens_with_a_header(tmp_path):
    path = tmp_path / "t.jsonl"
    tracer = Tracer(str(path), "full")
    tracer.emit("kv.init", num_blocks=4, block_size=2, null_block_id=0, enable_caching=True)
    tracer.close()
    header, event = _lines(path)
    assert header["kind"] == HEADER_KIND and header["seq"] == 0
    assert header["trace_format_version"] == TRACE_FORMAT_VERSION == 1
    assert header["glassbox_version"] == __import__("engine").__version__
    assert header["trace_level"] == "full" and header["pid"] == event["pid"]
    assert header["ts"] <= event["ts"]
    # load_trace checks the header and leaves it out, unless asked.
    assert [e["kind"] for e in load_trace(str(path))] == ["kv.init"]
    assert [e["kind"] for e in load_trace(str(path), include_header=True)] == [HEADER_KIND, "kv.init"]


def test_a_trace_of_another_format_version_is_refused_with_both_versions(tmp_path):
    path = tmp_path / "future.jsonl"
    header = {"ts": 1, "pid": 1, "seq": 0, "kind": HEADER_KIND, "trace_format_version": 2,
              "glassbox_version": "9.9.9"}
    event = {"ts": 2, "pid": 1, "seq": 1, "kind": "kv.init"}
    path.write_text(json.dumps(header) + "\n" + json.dumps(event) + "\n")
    with pytest.raises(TraceVersionError) as info:
        load_trace(str(path))
    message = str(info.value)
    assert "trace format version 2" in message and f"reads version {TRACE_FORMAT_VERSION}" in message
    assert "9.9.9" in message and str(path) in message
    assert isinstance(info.value, ValueError)
    # No header at all: written before headers existed, read as version 1.
    path.write_text(json.dumps(event) + "\n")
    assert load_trace(str(path)) == [event]


def test_events_are_buffered_until_a_flush_point(tmp_path):
    path = tmp_path / "b.jsonl"
    tracer = Tracer(str(path), "lifecycle", buffer_size=4)
    tracer.set_step(7)
    for i in range(3):
        tracer.emit("sched.queued", request_id=f"r{i}")
    assert [e["kind"] for e in _lines(path)] == [HEADER_KIND]
    tracer.emit("sched.queued", request_id="r3")  # the fourth: the buffer is written
    assert [e.get("request_id") for e in _lines(path)[1:]] == ["r0", "r1", "r2", "r3"]
    tracer.emit("kv.freed", request_id="r0", step=3)  # an explicit step wins
    assert len(_lines(path)) == 5  # kept until a flush point
    tracer.flush()  # flush(): everything, readable by another process
    events = load_trace(str(path))
    assert [e["seq"] for e in events] == [1, 2, 3, 4, 5]
    assert [e["step"] for e in events] == [7, 7, 7, 7, 3]
    tracer.close()
    tracer.emit("sched.queued", request_id="late")  # after close: dropped
    tracer.flush()
    tracer.close()
    assert len(load_trace(str(path))) == 5
    with pytest.raises(ValueError, match="buffer_size must be"):
        Tracer(str(tmp_path / "x.jsonl"), "lifecycle", buffer_size=0)


_CHILD = """
import os, sys
sys.path.insert(0, {root!r})
from engine.tracing import Tracer
tracer = Tracer({path!r}, "lifecycle", buffer_size=10)
for i in range(25):
    tracer.emit("sched.queued", request_id=f"r{{i}}")
if {crash}:
    os._exit(1)  # no close, no finalizers: what a SIGKILL or a segfault leaves
# A normal exit without close(): the finalizer writes the rest.
"""


def test_the_engine_core_writes_every_step_while_the_forward_runs(tiny_model_dir, tmp_path):
    """The engine core flushes once per step, right after launching the
    forward: when the model runs, every event up to that step's scheduling
    is in the file, and the tracer holds only what came after. (Holding
    several steps' events lets the garbage collector scan and promote them:
    see ``Tracer.flush``.)"""
    trace = str(tmp_path / "run.jsonl")
    engine = make_engine(tiny_model_dir, trace, "lifecycle", real_model=True)
    core = engine.engine_core.engine_core
    seen: list[tuple[int, int, int]] = []
    original = core.model_executor.sample_tokens

    def sample_tokens_after_the_flush(*args, **kwargs):
        steps = [e["step"] for e in load_trace(trace) if e["kind"] == "sched.step"]
        seen.append((core.scheduler.step_counter, steps[-1], len(engine.tracer._events)))
        return original(*args, **kwargs)

    core.model_executor.sample_tokens = sample_tokens_after_the_flush
    try:
        run_scenario(engine, real_model=True)
    finally:
        engine.shutdown()
    assert len(seen) >= 10
    for step, last_written_step, held in seen:
        assert last_written_step == step and held == 0, (step, last_written_step, held)


@pytest.mark.parametrize("crash", [True, False], ids=["crash", "exit-unclosed"])
def test_what_a_process_that_never_closes_its_tracer_leaves(tmp_path, crash):
    path = tmp_path / "child.jsonl"
    code = _CHILD.format(root=str(ROOT), path=str(path), crash=crash)
    subprocess.run([sys.executable, "-c", code], check=False, timeout=60)
    events = load_trace(str(path))
    if crash:
        # The two full buffers were written; the last 5 events (< buffer_size) are lost.
        assert [e["request_id"] for e in events] == [f"r{i}" for i in range(20)]
    else:
        assert len(events) == 25


def test_the_encoding_is_the_json_the_per_event_encoder_wrote(tmp_path):
    """The same JSON objects, keys in the same order, as ``json.dumps`` of
    ``{ts, pid, seq, kind, step?, **fields}`` (what the tracer wrote before it
    buffered); only number and non-ASCII spelling may differ (1e-05 is
    written 0.00001, text as UTF-8 rather than \\u escapes)."""
    path = tmp_path / "e.jsonl"
    tracer = Tracer(str(path), "full")
    fields = [
        {"request_id": "é✓", "text_delta": "line\n\"quoted\"\t",
         "num_scheduled_tokens": {"b": 2, "a": 1}},
        {"block_ids": (3, 1, 2), "logprob": -0.123456789012345, "kv_cache_usage": 1e-05,
         "ok": True, "stop_reason": None, "big": 1_800_000_000_000_000_123},
        {"token_id": np.int64(42), "prob": np.float32(0.25), "tensor": torch.tensor(7)},
        {"stages": [{"stage": "raw", "token_ids": [1, 2], "probs": [0.5, 0.25]}], "step": 99},
        {},
    ]
    tracer.set_step(5)
    for f in fields:
        tracer.emit("sampler.sampled", **f)
    tracer.close()
    lines = Path(path).read_text().splitlines()[1:]
    for line, f, seq in zip(lines, fields, range(1, 6)):
        record = json.loads(line)
        expected = {"ts": record["ts"], "pid": tracer.pid, "seq": seq, "kind": "sampler.sampled"}
        if "step" not in f:
            expected["step"] = 5
        plain = json.loads(json.dumps(f, default=lambda o: o.item() if hasattr(o, "item") else list(o)))
        expected.update(plain)
        assert list(record.items()) == list(expected.items())
    assert "é✓" in Path(path).read_text(encoding="utf-8")


@pytest.mark.parametrize("buffer_size", [1, DEFAULT_BUFFER_SIZE])
def test_emit_rows_writes_what_a_loop_of_emits_writes(tmp_path, buffer_size):
    """``emit_rows`` defers building the per-row dicts to the encoder; the
    lines are those of one ``emit`` per row (ts apart), seq numbers running
    on across ordinary events, a ``step`` column winning over the tracer's."""
    columns = {"request_id": ["a", "b", "c"], "row": [0, 2, 5], "token_id": [7, 8, 9],
               "logprob": [-0.5, -1.25, 0.0], "greedy": [True, False, True]}
    written = {}
    for how in ("rows", "loop"):
        path = tmp_path / f"{how}.jsonl"
        tracer = Tracer(str(path), "lifecycle", buffer_size=buffer_size)
        tracer.set_step(3)
        tracer.emit("sched.step", num_running=3)
        if how == "rows":
            tracer.emit_rows("sampler.sampled", columns)
            tracer.emit_rows("sampler.sampled", {"request_id": [], "row": []})  # no rows: no lines
            tracer.emit_rows("x.rows", {"step": [10, 11], "v": [1, 2]})
        else:
            for j in range(3):
                tracer.emit("sampler.sampled", **{k: v[j] for k, v in columns.items()})
            tracer.emit("x.rows", step=10, v=1)
            tracer.emit("x.rows", step=11, v=2)
        tracer.emit("sched.update", num_running=0)
        tracer.close()
        written[how] = [{k: v for k, v in e.items() if k != "ts"} for e in _lines(path)[1:]]
    assert written["rows"] == written["loop"]
    assert [e["seq"] for e in written["rows"]] == list(range(1, 8))
    assert [list(e) for e in written["rows"]][1] == ["pid", "seq", "kind", "step", *columns]


def test_emit_rows_refuses_columns_of_different_lengths(tmp_path):
    tracer = Tracer(str(tmp_path / "r.jsonl"), "lifecycle")
    with pytest.raises(ValueError, match=r"sampler.sampled: columns of different lengths \[2, 3\]"):
        tracer.emit_rows("sampler.sampled", {"request_id": ["a", "b"], "row": [0, 1, 2]})
    tracer.close()
    Tracer().emit_rows("sampler.sampled", {"a": [1], "b": [1, 2]})  # off: nothing is looked at


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
        torch.float32: [0, 5, 6], torch.int64: [1, 4], torch.bool: [2], torch.bfloat16: [3],
    }
    assert gathered.groups[torch.float32][1].tolist() == [0.5, -1.25, 3.25, 2.0]
    assert gathered.lists() == [t.tolist() for t in tensors]
    assert HostListsCopy().lists() == []


def test_host_lists_copy_reuses_its_staging_buffers():
    """With ``staging`` (the sampler's per-step copies) each dtype's host buffer
    is allocated once, grown when a later copy needs more, else reused."""
    staging: dict[torch.dtype, torch.Tensor] = {}
    first = [torch.tensor([0.5, -1.25, 2.0]), torch.tensor([1, 2])]
    assert HostListsCopy(*first, gather=True, staging=staging).lists() == [t.tolist() for t in first]
    buffers = {dtype: t.data_ptr() for dtype, t in staging.items()}
    assert {dtype: t.numel() for dtype, t in staging.items()} == {torch.float32: 3, torch.int64: 2}
    smaller = [torch.tensor([4.0]), torch.tensor([9, 8])]
    assert HostListsCopy(*smaller, gather=True, staging=staging).lists() == [[4.0], [9, 8]]
    assert {dtype: t.data_ptr() for dtype, t in staging.items()} == buffers  # reused
    larger = [torch.arange(5, dtype=torch.float32), torch.tensor([7])]
    assert HostListsCopy(*larger, gather=True, staging=staging).lists() == [t.tolist() for t in larger]
    assert staging[torch.float32].numel() == 6  # grown: twice the old size, at least what is needed
    assert staging[torch.int64].data_ptr() == buffers[torch.int64]


def test_a_field_json_cannot_hold_fails_loudly_and_the_rest_is_written(tmp_path):
    path = tmp_path / "bad.jsonl"
    tracer = Tracer(str(path), "lifecycle")
    tracer.emit("kv.init", num_blocks=1)
    tracer.emit("sched.step", oops=object())
    tracer.emit("sched.update", num_running=0)
    with pytest.raises(TypeError, match="'sched.step' was not written"):
        tracer.flush()
    tracer.close()
    assert [e["kind"] for e in load_trace(str(path))] == ["kv.init", "sched.update"]


def test_threads_emitting_at_once_lose_nothing(tmp_path):
    path = tmp_path / "threads.jsonl"
    tracer = Tracer(str(path), "lifecycle", buffer_size=16)

    def work(name: str) -> None:
        for i in range(500):
            tracer.emit("request.output", request_id=f"{name}-{i}")

    threads = [threading.Thread(target=work, args=(f"t{k}",)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    tracer.close()
    events = load_trace(str(path))
    assert sorted(e["seq"] for e in events) == list(range(1, 2001))
    for k in range(4):  # each thread's events in its own order
        mine = [e["request_id"] for e in sorted(events, key=lambda e: e["seq"])
                if e["request_id"].startswith(f"t{k}-")]
        assert mine == [f"t{k}-{i}" for i in range(500)]


def test_merged_parts_keep_one_header_per_process_earliest_first(tmp_path):
    path = str(tmp_path / "mp.jsonl")
    front = Tracer(f"{path}.frontend-1.part", "lifecycle")
    core = Tracer(f"{path}.core-2.part", "lifecycle")
    front.emit("request.added", request_id="r")
    core.emit("kv.init", num_blocks=2, block_size=4, null_block_id=0, enable_caching=True)
    front.close()
    core.close()
    merge_trace_parts(path)
    events = load_trace(path, include_header=True)
    assert [e["kind"] for e in events[:2]] == [HEADER_KIND, HEADER_KIND]
    assert Path(path).read_text().splitlines()[0].startswith('{"ts":')
    assert json.loads(Path(path).read_text().splitlines()[0])["kind"] == HEADER_KIND
    assert [e["kind"] for e in load_trace(path)] == ["request.added", "kv.init"]
    # The Perfetto export leaves headers out (their ts would shift the timeline).
    assert build_perfetto(load_trace(path, include_header=True)) == build_perfetto(load_trace(path))


def _plain_json_types(value, where: str, bad: list[str]) -> None:
    if type(value) in (str, int, float, bool) or value is None:
        return
    if type(value) in (list, tuple):
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
    real_emit = Tracer.emit

    def checking_emit(self, kind, /, **fields):
        for name, value in fields.items():
            _plain_json_types(value, f"{kind}.{name}", bad)
        return real_emit(self, kind, **fields)

    real_emit_rows = Tracer.emit_rows

    def checking_emit_rows(self, kind, columns, /):
        for name, values in columns.items():
            _plain_json_types(values, f"{kind}.{name}", bad)
        return real_emit_rows(self, kind, columns)

    monkeypatch.setattr(Tracer, "emit", checking_emit)
    monkeypatch.setattr(Tracer, "emit_rows", checking_emit_rows)
    runs = {}
    for name, buffer_size in (("at-once", 1), ("buffered", DEFAULT_BUFFER_SIZE)):
        trace = str(tmp_path / f"{name}.jsonl")
        engine = make_engine(tiny_model_dir, trace, "full", real_model=True)
        engine.tracer.buffer_size = buffer_size  # in-process: one tracer for all
        try:
            run_scenario(engine, real_model=True)
        finally:
            engine.shutdown()
        clock = ("ts", "arrival_time", "duration_ns", "start_ts")
        runs[name] = [{k: v for k, v in e.items() if k not in clock} for e in load_trace(trace)]
    assert not bad, sorted(set(bad))
    assert runs["at-once"] == runs["buffered"]


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
    assert summaries["long"] == {"shape": [100], "dtype": "int32", "min": 0, "max": 99,
                                 "head": list(range(32)), "tail": list(range(68, 100))}
    assert summaries["short"] == {"shape": [3], "dtype": "int64", "min": -3, "max": 9,
                                  "values": [5, -3, 9]}
    assert summaries["table"]["values"] == [[1, 2, 3], [4, 5, 6]]
    assert summaries["wide"]["head"] == list(range(32)) and summaries["wide"]["tail"] == list(range(268, 300))
    assert summaries["empty"] == {"shape": [0], "dtype": "int64", "values": []}
    # Plain Python values: JSON-encodable, and what torch's tolist() gives for the same data.
    assert all(type(v) is int for v in summaries["long"]["head"] + [summaries["long"]["min"]])
    assert summaries["table"] == {
        "shape": [2, 3], "dtype": "int32", "min": 1, "max": 6,
        "values": torch.tensor([[1, 2, 3], [4, 5, 6]], dtype=torch.int32).tolist(),
    }


def test_the_tracing_package_is_a_leaf():
    """engine/tracing imports no other Glassbox module, and only tensors.py
    (used by the runner and sampler) imports torch: engine/v1/core stays torch-free."""
    for path in sorted((ROOT / "engine" / "tracing").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [node.module or ""]
            else:
                continue
            for name in names:
                if name == "engine" or name.startswith("engine."):
                    assert name.startswith("engine.tracing"), f"{path.name} imports {name}"
                if name.split(".")[0] == "torch":
                    assert path.name == "tensors.py", f"{path.name} imports torch"
    code = "import sys; import engine.tracing; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT,
                         check=False)
    assert out.stdout.strip() == "False", out.stderr
