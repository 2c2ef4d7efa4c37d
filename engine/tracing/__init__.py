"""Tracing: typed lifecycle events from every subsystem, one JSON object per line.

vLLM twin: ``vllm/tracing/`` (vLLM exports OpenTelemetry spans per request;
Glassbox records a finer event stream -- every scheduling decision, KV block
move and sampling step -- so a run can be replayed step by step).

Read it for the hook convention every subsystem follows::

    if self.tracer.lifecycle: self.tracer.emit("kv.allocated", request_id=rid, block_ids=ids)

One line; when tracing is off (the default) it costs one attribute read and
the arguments are never built; it never changes control flow. ``lifecycle``
covers requests, scheduler, KV, batches and outputs; ``full`` adds per-step
sampler detail and runner input summaries (``if self.tracer.full: ...``).

Every event carries ``ts`` (wall-clock ns, comparable across processes),
``pid``, ``seq`` (per-process order for equal timestamps) and ``kind``; the
tracer adds ``step`` (the engine step being built/run) where one is set.
Events of one process go to one file, which opens with a ``trace.header``
event (the format version, checked by ``load_trace``); in multi-process runs
each process writes ``<path>.<role>-<pid>.part`` and ``merge_trace_parts``
interleaves them by time into ``<path>`` at shutdown.

Cost: ``emit`` only appends ``(kind, ts, step, fields)`` to an in-memory
list; the events are JSON-encoded (msgspec, one call per batch) and written
when the list holds ``buffer_size`` events, on ``flush()`` (EngineCore
flushes every step, while the device runs the forward it has just launched)
and on ``close()``. Flushing every step, not every few, also keeps the
garbage collector out of it: events kept past a collection are container
objects it must scan and promote, and a few hundred of them (a few steps'
worth) were enough to trigger collections every step and, now and then, a
full one (see ``flush``). So a hook costs about a
microsecond, not the several a dict copy + ``json`` encode + ``write`` per
event cost. Two consequences: a hook must pass values it will not mutate
afterwards (fresh lists, scalars -- every hook in the engine does), and a
process that dies without closing its tracer (SIGKILL, ``os._exit``, a
segfault) loses the events still in the list, at most ``buffer_size`` (in
the engine core, at most the last step and a half). A tracer that is never closed
is flushed when it is garbage collected or the interpreter exits.

``replay.py`` rebuilds the scheduler and KV-cache state at any step from a
trace (``TraceReplay``); ``perfetto.py`` turns a trace into Chrome/Perfetto
trace-event JSON (``export_perfetto``). The event kinds and their fields are
documented in ``docs/trace_format.md``.

This package is a leaf: it imports no other Glassbox module.
Sessions: all (the TUI and notebooks replay these traces).
"""

from __future__ import annotations

import enum
import gc
import glob
import heapq
import json
import os
import sys
import threading
import time
import weakref
from collections.abc import Iterable
from typing import Any, BinaryIO

import msgspec

# Version of the event format (kinds, fields and their meaning). Bumped when a
# reader of the previous version would misread a new trace (a field renamed or
# re-defined, a kind that changes state); new kinds and new fields do not bump
# it. Traces written before the ``trace.header`` event existed are version 1.
TRACE_FORMAT_VERSION = 1
HEADER_KIND = "trace.header"

# Events kept in memory before they are encoded and written (see the module
# docstring): a few hundred KB of Python objects; a crash loses at most these.
DEFAULT_BUFFER_SIZE = 1024


class TraceLevel(enum.IntEnum):
    OFF = 0
    LIFECYCLE = 1
    FULL = 2

    @classmethod
    def parse(cls, value: str | int | TraceLevel) -> TraceLevel:
        if isinstance(value, TraceLevel):
            return value
        if isinstance(value, str) and value.upper() in cls.__members__:
            return cls[value.upper()]
        raise ValueError(f"trace_level must be one of 'off', 'lifecycle', 'full', got {value!r}")


class TraceVersionError(ValueError):
    """A trace written in a format version this Glassbox does not read."""


def _jsonable(obj: Any) -> Any:
    # msgspec encodes str/int/float/bool/None, lists, tuples and dicts itself;
    # this hook sees the rest. Numpy scalars and 0-d tensors appear in fields.
    if hasattr(obj, "item"):
        return obj.item()
    raise TypeError(f"trace field of type {type(obj).__name__} is not JSON serialisable")


def _glassbox_version() -> str:
    # The parent package is always imported before this one; read its version
    # without importing anything (this package stays a leaf).
    version = getattr(sys.modules.get(__name__.rpartition(".")[0]), "__version__", None)
    return str(version) if version is not None else "unknown"


class _Rows:
    """The fields of the events of one ``Tracer.emit_rows`` call: column name
    -> one value per event. Kept as is until the batch is encoded."""

    __slots__ = ("columns",)

    def __init__(self, columns: dict[str, list[Any]]) -> None:
        self.columns = columns


class _TraceWriter:
    """The file side of a ``Tracer``: the event list, its encoder and the file.

    Separate from ``Tracer`` so that a finalizer can flush it without keeping
    the tracer alive. ``events`` is never replaced: ``emit`` appends to it
    from any thread, ``write_pending`` encodes and removes a prefix of it.
    """

    def __init__(self, path: str, pid: int, level: TraceLevel) -> None:
        parent = os.path.dirname(os.path.abspath(path))
        os.makedirs(parent, exist_ok=True)
        # Unbuffered: ``events`` is the buffer; every batch is one write() to the OS.
        self.file: BinaryIO | None = open(path, "wb", buffering=0)
        self.pid = pid
        self.seq = 0  # seq of the last event written
        self.events: list[tuple[str, int, int | None, dict[str, Any] | _Rows]] = []
        self.lock = threading.Lock()
        self.encoder = msgspec.json.Encoder(enc_hook=_jsonable)
        header = {
            "ts": time.time_ns(),
            "pid": pid,
            "seq": 0,
            "kind": HEADER_KIND,
            "trace_format_version": TRACE_FORMAT_VERSION,
            "glassbox_version": _glassbox_version(),
            "trace_level": level.name.lower(),
        }
        self._write(self.encoder.encode(header) + b"\n")

    def _write(self, data: bytes) -> None:
        view = memoryview(data)
        while view:  # a raw file may take less than all (rarely: signals, a full disk)
            assert self.file is not None
            view = view[self.file.write(view) :]

    def write_pending(self) -> None:
        with self.lock:
            if self.file is None:
                return
            events = self.events
            n = len(events)
            if n:
                batch = events[:n]
                del events[:n]  # events appended meanwhile stay for the next batch
                self._write(self._encode(batch))

    def _encode(self, batch: list[tuple[str, int, int | None, dict[str, Any] | _Rows]]) -> bytes:
        pid, seq = self.pid, self.seq
        records = []
        append = records.append
        for kind, ts, step, fields in batch:
            if type(fields) is _Rows:  # emit_rows: one event per row
                names = list(fields.columns)
                for values in zip(*fields.columns.values()):
                    seq += 1
                    record = {"ts": ts, "pid": pid, "seq": seq, "kind": kind}
                    if step is not None and "step" not in fields.columns:
                        record["step"] = step
                    record.update(zip(names, values))
                    append(record)
                continue
            seq += 1
            if step is None or "step" in fields:
                append({"ts": ts, "pid": pid, "seq": seq, "kind": kind, **fields})
            else:
                append({"ts": ts, "pid": pid, "seq": seq, "kind": kind, "step": step, **fields})
        self.seq = seq
        try:
            return self.encoder.encode_lines(records)
        except (TypeError, msgspec.EncodeError, OverflowError):
            pass
        # A hook passed a value JSON cannot hold: write the others, then say which.
        good, bad = [], None
        for record in records:
            try:
                good.append(self.encoder.encode(record) + b"\n")
            except (TypeError, msgspec.EncodeError, OverflowError) as e:
                bad = bad or (record["kind"], e)
        self._write(b"".join(good))
        assert bad is not None
        raise TypeError(f"trace event {bad[0]!r} was not written: {bad[1]}")

    def close(self) -> None:
        try:
            self.write_pending()
        finally:
            with self.lock:
                if self.file is not None:
                    self.file.close()
                    self.file = None


class Tracer:
    """Writes events of one process. ``lifecycle`` / ``full`` are plain bools
    so a disabled hook is a single attribute test."""

    def __init__(
        self,
        path: str | None = None,
        level: str | TraceLevel = TraceLevel.OFF,
        buffer_size: int = DEFAULT_BUFFER_SIZE,
    ) -> None:
        self.level = TraceLevel.parse(level)
        if self.level > TraceLevel.OFF and not path:
            raise ValueError("trace_path is required when trace_level is not 'off'")
        if not isinstance(buffer_size, int) or buffer_size < 1:
            raise ValueError(f"buffer_size must be an int >= 1, got {buffer_size!r}")
        self.path = path
        self.lifecycle = self.level >= TraceLevel.LIFECYCLE
        self.full = self.level >= TraceLevel.FULL
        self.pid = os.getpid()
        self.step: int | None = None
        self.buffer_size = buffer_size
        self._writer: _TraceWriter | None = None
        # The writer's event list while the tracer is open, None otherwise.
        self._events: list[tuple[str, int, int | None, dict[str, Any] | _Rows]] | None = None
        if self.lifecycle:
            assert path is not None
            self._writer = _TraceWriter(path, self.pid, self.level)
            self._events = self._writer.events
            # Written out if the tracer is dropped (or the interpreter exits) unclosed.
            self._finalizer = weakref.finalize(self, self._writer.close)

    def set_step(self, step: int | None) -> None:
        self.step = step

    def emit(self, kind: str, /, **fields: Any) -> None:
        """Record one event. Callers guard with ``if tracer.lifecycle:``.

        The event is kept as ``(kind, ts, step, fields)`` and encoded later:
        ``fields`` must not be mutated after the call."""
        events = self._events
        if events is None:
            return
        events.append((kind, _time_ns(), self.step, fields))
        if len(events) >= self.buffer_size:
            writer = self._writer
            if writer is not None:
                writer.write_pending()

    def emit_rows(self, kind: str, columns: dict[str, list[Any]], /) -> None:
        """Record one event per row: event ``j`` holds ``columns[name][j]``
        for every column, in the columns' order. The same events as a loop
        of ``emit`` calls, for the cost of one: the per-row dicts are built
        when the batch is encoded, which ``EngineCore`` does while the next
        forward runs. For per-request events of a step (``sampler.sampled``)."""
        events = self._events
        if events is None:
            return
        lengths = {len(values) for values in columns.values()}
        if len(lengths) > 1:
            raise ValueError(f"{kind}: columns of different lengths {sorted(lengths)}")
        events.append((kind, _time_ns(), self.step, _Rows(columns)))
        if len(events) >= self.buffer_size:
            writer = self._writer
            if writer is not None:
                writer.write_pending()

    def flush(self) -> None:
        """Encode and write every event emitted so far (the file is complete
        up to here: another process can ``load_trace`` it).

        ``EngineCore`` calls it every step while the forward runs. Waiting for
        a few steps' events first saves writes but costs more than it saves:
        CPython's garbage collector counts every container object allocated
        and not yet freed, so events held past ~700 of them (about 250
        ``lifecycle`` events, fewer at ``full``) start a young-generation
        collection that scans them and moves the survivors to an older
        generation; enough promotions start a full collection of the
        process's heap (~0.1 s with torch loaded). Written every step, a
        step's events are freed before the collector ever sees them."""
        events = self._events  # None once closed (and then the writer is gone too)
        if events:
            assert self._writer is not None
            self._writer.write_pending()

    def close(self) -> None:
        """Write what is buffered and close the file; later events are dropped."""
        if self._writer is not None:
            self._events = None
            self._writer = None
            self._finalizer()  # writer.close(), once


_time_ns = time.time_ns

# The tracer of a component built without one: every hook is skipped.
NULL_TRACER = Tracer()


def part_path(path: str, role: str, pid: int | None = None) -> str:
    """Where process ``role`` writes its share of trace ``path``."""
    return f"{path}.{role}-{pid or os.getpid()}.part"


_decoder = msgspec.json.Decoder()


def _read_events(path: str) -> list[Any]:
    """Every JSON line of ``path``, decoded (not yet checked or sorted)."""
    with open(path, "rb") as f:
        data = f.read()
    lines = data.split(b"\n")
    if lines and not lines[-1].strip():
        lines.pop()
    try:
        # Fast path: the whole file as one JSON array, one msgspec call.
        return _decoder.decode(b"[" + b",".join(lines) + b"]")
    except msgspec.DecodeError:
        pass  # a blank or bad line (or NaN, which only json reads): go line by line
    events = []
    for line_no, line in enumerate(lines, 1):
        line = line.strip()
        if not line:
            continue
        try:
            events.append(_decoder.decode(line))
        except msgspec.DecodeError:
            try:
                events.append(json.loads(line))
            except (json.JSONDecodeError, UnicodeDecodeError) as e:
                raise ValueError(f"{path}:{line_no}: not a JSON trace event ({e})") from e
    return events


class _GCPaused:
    """Pause the cyclic garbage collector while a large trace is decoded and
    indexed: those steps make many objects and free none, and the collector
    would scan them again and again (a third of the time, for a large trace).
    Nothing here creates cycles; collection resumes when the block exits."""

    def __enter__(self) -> None:
        self.was_enabled = gc.isenabled()
        gc.disable()

    def __exit__(self, *exc: object) -> None:
        if self.was_enabled:
            gc.enable()


def _order_key(event: dict[str, Any]) -> tuple[int, int, int]:
    return (event["ts"], event["pid"], event.get("seq", 0))


def check_trace_version(events: Iterable[dict[str, Any]], where: str = "the trace") -> None:
    """Raise ``TraceVersionError`` if a ``trace.header`` in ``events`` announces
    a format version other than ``TRACE_FORMAT_VERSION``. A trace without a
    header is version 1 (it was written before headers existed)."""
    for e in events:
        if not isinstance(e, dict) or e.get("kind") != HEADER_KIND:
            continue
        version = e.get("trace_format_version")
        if version != TRACE_FORMAT_VERSION:
            written_by = e.get("glassbox_version", "unknown")
            raise TraceVersionError(
                f"{where} uses trace format version {version!r}; this Glassbox reads version "
                f"{TRACE_FORMAT_VERSION} (the trace was written by Glassbox {written_by}, this "
                f"is Glassbox {_glassbox_version()}). Record it again with this version, or "
                "open it with the version that wrote it"
            )


def merge_trace_parts(path: str) -> str:
    """Interleave ``path`` (if it exists) and every ``path.*.part`` by time
    into ``path``; the part files are removed. Returns ``path``.

    A ``path`` whose events all precede the parts' first event is the trace
    of an earlier run under the same name: it is replaced, not merged. Each
    part's ``trace.header`` is kept (one per process; the earliest is first).
    """
    sources = sorted(glob.glob(glob.escape(path) + ".*.part"))
    if not sources:
        return path
    with _GCPaused():
        streams = [sorted(_read_events(p), key=_order_key) for p in sources]
        existing = sorted(_read_events(path), key=_order_key) if os.path.exists(path) else []
    first_part_ts = min((s[0]["ts"] for s in streams if s), default=None)
    if existing and (first_part_ts is None or existing[-1]["ts"] >= first_part_ts):
        streams.append(existing)
    tmp = path + ".merging"
    encoder = msgspec.json.Encoder()
    with open(tmp, "wb") as out:
        out.write(encoder.encode_lines(list(heapq.merge(*streams, key=_order_key))))
    os.replace(tmp, path)
    for p in sources:
        if p != path:
            os.remove(p)
    return path


def load_trace(path: str, include_header: bool = False) -> list[dict[str, Any]]:
    """All events of a trace, ordered by time (then process, then sequence).

    The ``trace.header`` line(s) are checked (``check_trace_version``) and
    left out unless ``include_header``. Raises ``FileNotFoundError``,
    ``ValueError`` for a line that is not JSON (naming the line),
    ``TraceVersionError`` (a ``ValueError``) for a trace of another format
    version, and ``KeyError`` / ``TypeError`` for JSON lines that are not
    events (no ``ts`` / ``pid``)."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"no trace at {path}")
    with _GCPaused():
        events = _read_events(path)
        # Headers open the file (one per process in a merged trace).
        headers = [
            i for i, e in enumerate(events) if isinstance(e, dict) and e.get("kind") == HEADER_KIND
        ]
        check_trace_version([events[i] for i in headers], path)
        if headers and not include_header:
            for i in reversed(headers):
                del events[i]
        events.sort(key=_order_key)
    return events


# The replay model and the Perfetto export build on the functions above.
from engine.tracing.perfetto import build_perfetto, export_perfetto  # noqa: E402
from engine.tracing.replay import (  # noqa: E402
    EngineState,
    ReplayError,
    StepView,
    TraceReplay,
)

__all__ = [
    "DEFAULT_BUFFER_SIZE",
    "HEADER_KIND",
    "NULL_TRACER",
    "TRACE_FORMAT_VERSION",
    "EngineState",
    "ReplayError",
    "StepView",
    "TraceLevel",
    "TraceReplay",
    "TraceVersionError",
    "Tracer",
    "build_perfetto",
    "check_trace_version",
    "export_perfetto",
    "load_trace",
    "merge_trace_parts",
    "part_path",
]
