"""The tracer: one per process, it keeps typed events and writes them as JSON lines.

vLLM twin: none (vLLM exports OpenTelemetry spans, ``vllm/tracing/``). Read
it for how a hook's event reaches the file cheaply: ``Tracer.record`` stamps
the event (time, step) and appends it to a list; the list is encoded in one
msgspec call and written when it holds ``buffer_size`` events, on ``flush()``
and on ``close()``. ``EngineCore`` flushes every step while the device runs
the forward it has just launched; docs/trace_format.md ("Why the engine core
flushes every step") says why every step and not every few.

``SubsystemTrace`` is the base of the small trace objects each subsystem
receives at construction (``SchedulerTrace``, ``SamplerTrace``, ...; the
pattern of vLLM's ``KVCacheMetricsCollector`` in ``BlockPool``): the host
file calls one at a few named points, and all event building happens there.
With tracing off a subsystem holds its class's ``NULL`` instance, whose hooks
do nothing.

Crashes: a process that dies without closing its tracer (SIGKILL,
``os._exit``, a segfault) loses the events still in the list, at most
``buffer_size`` (in the engine core, about the last step and a half). A
tracer nobody closed is written out when it is garbage collected or the
interpreter exits. Closing writes a ``trace.end`` line last (with the
number of events written), so a reader can tell a finished file from one
whose writer was killed or that was cut short (``reader.find_truncation``).

Sessions: all.
"""

from __future__ import annotations

import enum
import os
import sys
import threading
import time
import weakref
from typing import Any, BinaryIO, ClassVar

import msgspec

from engine.tracing.events import TRACE_FORMAT_VERSION, TraceEnd, TraceEvent, TraceHeader

# Events kept in memory before they are encoded and written: a crash loses at most these.
DEFAULT_BUFFER_SIZE = 1024


class TraceLevel(enum.IntEnum):
    OFF = 0
    LIFECYCLE = 1  # requests, scheduler, KV cache, batches, forwards, sampled tokens
    FULL = 2  # + the sampler's top candidates per stage and the runner's inputs

    @classmethod
    def parse(cls, value: str | int | TraceLevel) -> TraceLevel:
        if isinstance(value, TraceLevel):
            return value
        if isinstance(value, str) and value.upper() in cls.__members__:
            return cls[value.upper()]
        raise ValueError(f"trace_level must be one of 'off', 'lifecycle', 'full', got {value!r}")


def _jsonable(obj: Any) -> Any:
    # msgspec encodes structs, str/int/float/bool/None, lists and dicts itself;
    # this hook sees the rest: numpy scalars and 0-d tensors appear in fields.
    if hasattr(obj, "item"):
        return obj.item()
    raise TypeError(f"trace field of type {type(obj).__name__} is not JSON serialisable")


def _glassbox_version() -> str:
    # Read the top package's version without importing it (this package is a leaf).
    top = sys.modules.get(__name__.split(".", 1)[0])
    version = getattr(top, "__version__", None)
    return str(version) if version is not None else "unknown"


class EventRows:
    """Several events of one kind recorded by one ``Tracer.record_rows`` call:
    column name -> one value per event. The events are built when the batch
    is encoded, off the hook's path."""

    __slots__ = ("event_type", "columns", "ts", "step")

    def __init__(
        self, event_type: type[TraceEvent], columns: dict[str, list[Any]], ts: int, step: int | None
    ) -> None:
        self.event_type = event_type
        self.columns = columns
        self.ts = ts
        self.step = step

    def events(self) -> list[TraceEvent]:
        names = list(self.columns)
        make = self.event_type
        # A "step" column wins over the step the rows were recorded in.
        return [
            make(**{"ts": self.ts, "step": self.step, **dict(zip(names, values))})
            for values in zip(*self.columns.values())
        ]


class _TraceWriter:
    """The file side of a ``Tracer``: the event list, its encoder and the file.

    Separate from ``Tracer`` so that a finalizer can flush it without keeping
    the tracer alive. ``events`` is never replaced: ``record`` appends to it
    from any thread, ``write_pending`` encodes and removes a prefix of it.
    """

    def __init__(
        self, path: str, pid: int, level: TraceLevel, role: str = "", rank: int | None = None
    ) -> None:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        # Unbuffered: ``events`` is the buffer; every batch is one write() to the OS.
        self.file: BinaryIO | None = open(path, "wb", buffering=0)
        self.pid = pid
        self.rank = rank  # the tensor-parallel rank of a worker process, else None
        self.seq = 0  # seq of the last event written
        self.num_written = 0  # event lines written (the header not counted)
        self.events: list[TraceEvent | EventRows] = []
        self.lock = threading.Lock()
        self.encoder = msgspec.json.Encoder(enc_hook=_jsonable)
        header = TraceHeader(
            ts=time.time_ns(),
            pid=pid,
            tp_rank=rank,
            trace_format_version=TRACE_FORMAT_VERSION,
            glassbox_version=_glassbox_version(),
            trace_level=level.name.lower(),
            role=role,
        )
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
                del events[:n]  # events recorded meanwhile stay for the next batch
                self._write(self._encode(batch))

    def _encode(self, batch: list[TraceEvent | EventRows]) -> bytes:
        """The batch as JSON lines, numbered. An event that cannot be built or
        encoded (a hook passed a value JSON cannot hold) is left out: the
        others are written, then a ``TypeError`` names it."""
        pid, seq, rank = self.pid, self.seq, self.rank
        records: list[TraceEvent] = []
        failure: tuple[str, Exception] | None = None
        for item in batch:
            try:
                events = item.events() if type(item) is EventRows else (item,)
            except (TypeError, ValueError) as e:  # rows that do not make their events
                failure = failure or (item.event_type.kind, e)  # type: ignore[union-attr]
                continue
            for event in events:
                seq += 1
                event.pid = pid
                event.seq = seq
                event.tp_rank = rank
                records.append(event)
        self.seq = seq
        try:
            data = self.encoder.encode_lines(records)
            self.num_written += len(records)
        except (TypeError, msgspec.EncodeError, OverflowError):
            lines = []
            for event in records:
                try:
                    lines.append(self.encoder.encode(event) + b"\n")
                except (TypeError, msgspec.EncodeError, OverflowError) as e:
                    failure = failure or (event.kind, e)
            data = b"".join(lines)
            self.num_written += len(lines)
        if failure is not None:
            self._write(data)
            raise TypeError(f"trace event {failure[0]!r} was not written: {failure[1]}")
        return data

    def close(self) -> None:
        try:
            self.write_pending()
        finally:
            with self.lock:
                if self.file is not None:
                    try:
                        # Last: the file is finished (also after an event that could
                        # not be encoded: ``num_events`` counts the lines written).
                        self.seq += 1
                        end = TraceEnd(
                            ts=time.time_ns(),
                            pid=self.pid,
                            seq=self.seq,
                            num_events=self.num_written,
                        )
                        self._write(self.encoder.encode(end) + b"\n")
                    finally:
                        self.file.close()
                        self.file = None


class Tracer:
    """Writes the events of one process to ``path``. ``lifecycle`` and ``full``
    say what the level asks for; with level ``off`` nothing is written and
    no file is created. ``role``: what the header calls the process (default:
    the ``<role>`` of a ``part_path``, else empty). ``rank``: the
    tensor-parallel rank of a worker process, written into every event."""

    def __init__(
        self,
        path: str | None = None,
        level: str | TraceLevel = TraceLevel.OFF,
        buffer_size: int = DEFAULT_BUFFER_SIZE,
        role: str | None = None,
        rank: int | None = None,
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
        # The engine step the events being recorded belong to (set by the scheduler).
        self.step: int | None = None
        # The step ``schedule()`` built last (set by the scheduler). With async
        # scheduling ``step`` goes back to the previous step while its output
        # is applied; work for the newest step done meanwhile (a deferred
        # step's grammar bitmask) names this one.
        self.scheduled_step: int | None = None
        self.buffer_size = buffer_size
        self._writer: _TraceWriter | None = None
        # The writer's event list while the tracer is open, None otherwise.
        self._events: list[TraceEvent | EventRows] | None = None
        if self.lifecycle:
            assert path is not None
            if role is None:
                role = part_role(path)
            self._writer = _TraceWriter(path, self.pid, self.level, role, rank)
            self._events = self._writer.events
            # Written out if the tracer is dropped (or the interpreter exits) unclosed.
            self._finalizer = weakref.finalize(self, self._writer.close)

    def set_step(self, step: int | None) -> None:
        self.step = step

    def record(self, event: TraceEvent) -> None:
        """Keep one event, stamped with the time and (unless it names one) the
        current step. The event is encoded later: do not change it afterwards."""
        events = self._events
        if events is None:
            return
        event.ts = _time_ns()
        if event.step is None:
            event.step = self.step
        events.append(event)
        if len(events) >= self.buffer_size:
            self._write_pending()

    def record_rows(self, event_type: type[TraceEvent], columns: dict[str, list[Any]]) -> None:
        """Keep one ``event_type`` event per row: event ``j`` gets
        ``columns[name][j]`` for every column. The same events as a loop of
        ``record`` calls (one ``ts``), for the cost of one: they are built when
        the batch is encoded. For the per-request events of a step."""
        events = self._events
        if events is None:
            return
        lengths = {len(values) for values in columns.values()}
        if len(lengths) > 1:
            raise ValueError(f"{event_type.kind}: columns of different lengths {sorted(lengths)}")
        unknown = columns.keys() - set(event_type.__struct_fields__)
        if unknown:
            raise ValueError(f"{event_type.kind} has no field(s) {sorted(unknown)}")
        events.append(EventRows(event_type, columns, _time_ns(), self.step))
        if len(events) >= self.buffer_size:
            self._write_pending()

    def _write_pending(self) -> None:
        writer = self._writer
        if writer is not None:
            writer.write_pending()

    def flush(self) -> None:
        """Encode and write every event recorded so far: the file is complete
        up to here, so another process can ``load_trace`` it."""
        if self._events:  # None once closed (and then the writer is gone too)
            self._write_pending()

    def close(self) -> None:
        """Write what is buffered and close the file; later events are dropped."""
        if self._writer is not None:
            self._events = None
            self._writer = None
            self._finalizer()  # writer.close(), once


_time_ns = time.time_ns

# The tracer of a process that does not trace: nothing is kept.
NULL_TRACER = Tracer()


def part_path(path: str, role: str, pid: int | None = None) -> str:
    """Where process ``role`` writes its share of trace ``path``."""
    return f"{path}.{role}-{pid or os.getpid()}.part"


def part_role(path: str) -> str:
    """The ``role`` of a ``part_path`` (``run.jsonl.core-12.part`` -> ``core``);
    empty for any other path."""
    if not path.endswith(".part"):
        return ""
    role, _, pid = path[: -len(".part")].rpartition(".")[2].rpartition("-")
    return role if role and pid.isdigit() else ""


def _do_nothing(*args: Any, **kwargs: Any) -> None:
    return None


class SubsystemTrace:
    """Base of the trace object a subsystem receives at construction.

    A subclass defines one method per named point of its subsystem (the
    hooks); each builds its event from what the host passes and records it.
    For every subclass, ``__init_subclass__`` also derives a twin whose hooks
    do nothing and keeps one instance of it as ``NULL``: what a subsystem
    holds when tracing is off (``create`` picks). Hooks only read what they
    are given; they never change engine state. A subclass whose ``__init__``
    builds other trace objects must be defined after their classes.
    """

    enabled: ClassVar[bool] = True
    NULL: ClassVar[Any]  # the do-nothing instance of each subclass

    def __init__(self, tracer: Tracer) -> None:
        self.tracer = tracer
        self.full = tracer.full

    @classmethod
    def create(cls, tracer: Tracer) -> Any:
        """The trace object for ``tracer``: ``cls.NULL`` unless it records."""
        return cls(tracer) if tracer.lifecycle else cls.NULL

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if not cls.enabled:  # the do-nothing twin being defined below
            return
        hooks = {
            name: _do_nothing
            for klass in cls.__mro__
            if issubclass(klass, SubsystemTrace) and klass is not SubsystemTrace
            for name, value in vars(klass).items()
            if callable(value) and not name.startswith("_") and name != "create"
        }
        null_cls = type(f"Null{cls.__name__}", (cls,), {"enabled": False, **hooks})
        cls.NULL = null_cls(NULL_TRACER)


__all__ = [
    "DEFAULT_BUFFER_SIZE",
    "NULL_TRACER",
    "EventRows",
    "SubsystemTrace",
    "TraceLevel",
    "Tracer",
    "part_path",
    "part_role",
]
