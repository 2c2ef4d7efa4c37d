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
Events of one process go to one file; in multi-process runs each process
writes ``<path>.<role>-<pid>.part`` and ``merge_trace_parts`` interleaves them
by time into ``<path>`` at shutdown.

``replay.py`` rebuilds the scheduler and KV-cache state at any step from a
trace (``TraceReplay``); ``perfetto.py`` turns a trace into Chrome/Perfetto
trace-event JSON (``export_perfetto``). The event kinds and their fields are
documented in ``docs/trace_format.md``.

This package is a leaf: it imports no other Glassbox module.
Sessions: all (the TUI and notebooks replay these traces).
"""

from __future__ import annotations

import enum
import glob
import heapq
import json
import os
import threading
import time
from collections.abc import Iterator
from typing import Any, TextIO


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


class Tracer:
    """Writes events of one process. ``lifecycle`` / ``full`` are plain bools
    so a disabled hook is a single attribute test."""

    def __init__(self, path: str | None = None, level: str | TraceLevel = TraceLevel.OFF) -> None:
        self.level = TraceLevel.parse(level)
        if self.level > TraceLevel.OFF and not path:
            raise ValueError("trace_path is required when trace_level is not 'off'")
        self.path = path
        self.lifecycle = self.level >= TraceLevel.LIFECYCLE
        self.full = self.level >= TraceLevel.FULL
        self.pid = os.getpid()
        self.step: int | None = None
        self._seq = 0
        self._lock = threading.Lock()
        self._file: TextIO | None = None
        if self.lifecycle:
            assert path is not None
            parent = os.path.dirname(os.path.abspath(path))
            os.makedirs(parent, exist_ok=True)
            self._file = open(path, "w", encoding="utf-8")

    def set_step(self, step: int | None) -> None:
        self.step = step

    def emit(self, kind: str, /, **fields: Any) -> None:
        """Record one event. Callers guard with ``if tracer.lifecycle:``."""
        if self._file is None:
            return
        with self._lock:
            self._seq += 1
            record = {"ts": time.time_ns(), "pid": self.pid, "seq": self._seq, "kind": kind}
            if self.step is not None and "step" not in fields:
                record["step"] = self.step
            record.update(fields)
            self._file.write(_encode(record) + "\n")

    def flush(self) -> None:
        if self._file is not None:
            with self._lock:
                self._file.flush()

    def close(self) -> None:
        if self._file is not None:
            with self._lock:
                self._file.close()
                self._file = None


def _jsonable(obj: Any) -> Any:
    # Sets (request id sets), enums and numpy scalars appear in hook fields.
    if isinstance(obj, (set, frozenset, tuple)):
        return sorted(obj) if isinstance(obj, (set, frozenset)) else list(obj)
    if isinstance(obj, enum.Enum):
        return obj.name
    if hasattr(obj, "item"):
        return obj.item()
    if isinstance(obj, bytes):
        return obj.hex()
    raise TypeError(f"trace field of type {type(obj).__name__} is not JSON serialisable")


# One encoder for every event (json.dumps with options builds a new one per call).
_encode = json.JSONEncoder(separators=(",", ":"), default=_jsonable, check_circular=False).encode

# The tracer of a component built without one: every hook is skipped.
NULL_TRACER = Tracer()


def part_path(path: str, role: str, pid: int | None = None) -> str:
    """Where process ``role`` writes its share of trace ``path``."""
    return f"{path}.{role}-{pid or os.getpid()}.part"


def _read_events(path: str) -> Iterator[dict[str, Any]]:
    with open(path, encoding="utf-8") as f:
        for line_no, line in enumerate(f, 1):
            line = line.strip()
            if not line:
                continue
            try:
                yield json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{line_no}: not a JSON trace event ({e})") from e


def _order_key(event: dict[str, Any]) -> tuple[int, int, int]:
    return (event["ts"], event["pid"], event.get("seq", 0))


def merge_trace_parts(path: str) -> str:
    """Interleave ``path`` (if it exists) and every ``path.*.part`` by time
    into ``path``; the part files are removed. Returns ``path``.

    A ``path`` whose events all precede the parts' first event is the trace
    of an earlier run under the same name: it is replaced, not merged.
    """
    sources = sorted(glob.glob(glob.escape(path) + ".*.part"))
    if not sources:
        return path
    streams = [sorted(_read_events(p), key=_order_key) for p in sources]
    if os.path.exists(path):
        existing = sorted(_read_events(path), key=_order_key)
        first_part_ts = min((s[0]["ts"] for s in streams if s), default=None)
        if existing and (first_part_ts is None or existing[-1]["ts"] >= first_part_ts):
            streams.append(existing)
    tmp = path + ".merging"
    with open(tmp, "w", encoding="utf-8") as out:
        for event in heapq.merge(*streams, key=_order_key):
            out.write(json.dumps(event, separators=(",", ":")) + "\n")
    os.replace(tmp, path)
    for p in sources:
        if p != path:
            os.remove(p)
    return path


def load_trace(path: str) -> list[dict[str, Any]]:
    """All events of a trace, ordered by time (then process, then sequence)."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"no trace at {path}")
    return sorted(_read_events(path), key=_order_key)


# The replay model and the Perfetto export build on the functions above.
from engine.tracing.perfetto import build_perfetto, export_perfetto  # noqa: E402
from engine.tracing.replay import (  # noqa: E402
    EngineState,
    ReplayError,
    StepView,
    TraceReplay,
)

__all__ = [
    "NULL_TRACER",
    "EngineState",
    "ReplayError",
    "StepView",
    "TraceLevel",
    "TraceReplay",
    "Tracer",
    "build_perfetto",
    "export_perfetto",
    "load_trace",
    "merge_trace_parts",
    "part_path",
]
