"""Reading traces back: typed events from a file, part files merged, versions checked.

vLLM twin: none. Read it for the contract of a trace file: JSON lines, each
one event of ``events.py``, a ``trace.header`` first and (from format 1.3) a
``trace.end`` last per process. ``load_trace`` returns the events as their
classes (``SchedStep``, ``KVAllocated``, ...), ordered by time;
``merge_trace_parts`` interleaves the files the processes of a multi-process
run wrote; ``find_truncation`` says whether every writer finished its file.
Used by the replay model, the Perfetto export, the TUI, the notebooks and
the CLI; no engine process imports it while it runs (except ``glassbox
trace``, which reads its own trace back at the end).

Sessions: all.
"""

from __future__ import annotations

import contextlib
import gc
import glob
import heapq
import json
import os
import warnings
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Union

import msgspec

from engine.tracing.events import (
    EVENT_KINDS,
    EVENT_TYPES,
    HEADER_KIND,
    TRACE_FORMAT_VERSION,
    TraceEnd,
    TraceEvent,
    TraceHeader,
)
from engine.tracing.tracer import _glassbox_version

AnyEvent = Union[EVENT_TYPES]  # noqa: UP007 (a runtime union of the classes)
_list_decoder = msgspec.json.Decoder(list[AnyEvent])
_event_decoder = msgspec.json.Decoder(AnyEvent)
_MAJOR_VERSION = int(TRACE_FORMAT_VERSION.split(".")[0])


class TraceVersionError(ValueError):
    """A trace written in a format version this Glassbox does not read."""


class TraceTruncatedWarning(UserWarning):
    """A trace some of whose writers did not finish it (``find_truncation``)."""


# The first format version whose writers end their file with ``trace.end``.
END_MARKER_VERSION = (1, 3)
# What the truncation message calls a process, by its header's ``role``.
_ROLE_NAMES = {"core": "the engine core", "frontend": "the front end"}


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """Pause the cyclic garbage collector while a large trace is decoded and
    indexed: those steps make many objects and free none, and the collector
    would scan them again and again (a third of the time, for a large trace).
    Nothing here makes cycles; collection resumes when the block exits."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def read_events(path: str, check_version: bool = False) -> list[TraceEvent]:
    """Every event of ``path`` in file order, headers included (not sorted).
    ``check_version``: first refuse a file whose header announces another
    major version (``TraceVersionError``), before its lines are decoded. A
    kind this Glassbox does not know (a newer minor version of the format)
    is skipped with a warning; a line that is not an event raises
    ``ValueError`` naming the line."""
    with open(path, "rb") as f:
        data = f.read()
    lines = data.split(b"\n")
    if lines and not lines[-1].strip():
        lines.pop()
    if check_version:
        _check_header_lines(lines, path)
    try:
        # Fast path: the whole file as one JSON array, one msgspec call.
        return _list_decoder.decode(b"[" + b",".join(lines) + b"]")
    except msgspec.DecodeError:
        pass  # a blank, bad or unknown line: go line by line to find it
    events: list[TraceEvent] = []
    unknown: dict[str, int] = {}
    for line_no, line in enumerate(lines, 1):
        line = line.strip()
        if not line:
            continue
        try:
            events.append(_event_decoder.decode(line))
            continue
        except msgspec.DecodeError as e:
            error: Exception = e
        try:
            raw = json.loads(line)  # also reads NaN / Infinity, which msgspec refuses
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ValueError(f"{path}:{line_no}: not a JSON trace event ({e})") from e
        kind = raw.get("kind") if isinstance(raw, dict) else None
        if isinstance(kind, str) and kind not in EVENT_KINDS:
            unknown[kind] = unknown.get(kind, 0) + 1
            continue
        if isinstance(kind, str):
            try:  # e.g. NaN, which msgspec's JSON reader refuses and json reads
                events.append(msgspec.convert(raw, AnyEvent))
                continue
            except msgspec.ValidationError as e:
                error = e
        raise ValueError(f"{path}:{line_no}: not a Glassbox trace event ({error})")
    if unknown:
        listed = ", ".join(f"{k} ({n})" for k, n in sorted(unknown.items()))
        warnings.warn(
            f"{path}: skipped events of kinds this Glassbox does not know: {listed}",
            stacklevel=2,
        )
    return events


def parse_version(version: str | int) -> tuple[int, int]:
    """``"1.1"`` -> (1, 1); the plain ``1`` of the first headers -> (1, 0)."""
    if isinstance(version, int):
        return version, 0
    major, _, minor = str(version).partition(".")
    try:
        return int(major), int(minor or 0)
    except ValueError:
        raise TraceVersionError(f"unreadable trace_format_version {version!r}") from None


def check_trace_version(headers: Iterable[TraceHeader], where: str = "the trace") -> None:
    """Raise ``TraceVersionError`` if a header announces a major format version
    other than this Glassbox's. A trace without a header is version 1.0."""
    for header in headers:
        _check_version(header.trace_format_version, header.glassbox_version, where)


def _check_version(version: object, written_by: object, where: str) -> None:
    major, _ = parse_version(version)  # type: ignore[arg-type]
    if major != _MAJOR_VERSION:
        raise TraceVersionError(
            f"{where} uses trace format version {version!r}; this Glassbox reads version "
            f"{_MAJOR_VERSION}.x (the trace was written by Glassbox {written_by}, this is "
            f"Glassbox {_glassbox_version()}). Record it again with this version, or open it "
            "with the version that wrote it"
        )


def _check_header_lines(lines: list[bytes], where: str) -> None:
    """The version check on the raw header lines, so that a trace of another
    major version is refused as such even when its events would not decode."""
    for line in lines:
        if HEADER_KIND.encode() not in line:
            continue
        try:
            raw = json.loads(line)
        except (json.JSONDecodeError, UnicodeDecodeError):
            continue  # not a header after all; decoding reports the line
        if isinstance(raw, dict) and raw.get("kind") == HEADER_KIND:
            _check_version(raw.get("trace_format_version"), raw.get("glassbox_version"), where)


def _order_key(event: TraceEvent) -> tuple[int, int, int]:
    return (event.ts, event.pid, event.seq)


def load_trace(path: str, include_header: bool = False) -> list[TraceEvent]:
    """All events of a trace, ordered by time (then process, then sequence).

    The ``trace.header`` line(s) are checked (``check_trace_version``) and
    left out unless ``include_header``; the ``trace.end`` lines are always
    left out (``read_events`` returns them). Raises ``FileNotFoundError``,
    ``ValueError`` for a line that is not an event (naming the line), and
    ``TraceVersionError`` (a ``ValueError``) for another major version.

    Warns (``TraceTruncatedWarning``) when some writer finished the trace
    and another did not, or lines are missing (``find_truncation``). A
    trace no writer has finished yet is not warned about: it may still be
    being written (a live engine flushes every step, and notebooks read it
    then); ``load_trace_checked`` reports it too."""
    events, problem = _load(path, include_header)
    if problem is not None and problem.finished_by_some:
        warnings.warn(problem.message, TraceTruncatedWarning, stacklevel=2)
    return events


def load_trace_checked(path: str) -> tuple[list[TraceEvent], str | None]:
    """``load_trace(path)``'s events and, instead of a warning, what
    ``find_truncation`` says (None: every writer finished the file). For
    viewers of recorded runs (the TUI, ``--summary``), where a file nobody
    finished was cut short or its process killed."""
    events, problem = _load(path, include_header=False)
    return events, problem.message if problem is not None else None


def _load(path: str, include_header: bool) -> tuple[list[TraceEvent], _Truncation | None]:
    if not os.path.isfile(path):
        raise FileNotFoundError(f"no trace at {path}")
    with gc_paused():
        events = read_events(path, check_version=True)
        problem = _truncation(events, path)
        events = [
            e
            for e in events
            if type(e) is not TraceEnd and (include_header or type(e) is not TraceHeader)
        ]
        events.sort(key=_order_key)
    return events, problem


def find_truncation(events: Iterable[TraceEvent], where: str = "the trace") -> str | None:
    """Why the trace is incomplete, in a sentence naming the process(es), or
    None. From format 1.3 every writer ends its file with ``trace.end``
    (``Tracer.close``): a header of 1.3 or later without one from the same
    process means that process was killed, or the file was cut short (or
    is still being written). A ``trace.end`` whose ``num_events`` exceeds
    the process's events in the file means lines are missing. Headers of
    earlier versions are never called truncated. ``events``: every line of
    the file, as ``read_events`` returns them."""
    problem = _truncation(events, where)
    return problem.message if problem is not None else None


@dataclass
class _Truncation:
    message: str
    finished_by_some: bool  # some writer's trace.end is there: the file is not being written


def _truncation(events: Iterable[TraceEvent], where: str) -> _Truncation | None:
    events = events if isinstance(events, list) else list(events)
    headers: dict[int, list[TraceHeader]] = {}
    for e in events:
        if type(e) is TraceHeader:
            headers.setdefault(e.pid, []).append(e)
    checked = {}  # pid -> its headers, for writers that end their files
    for pid, written in headers.items():
        try:
            if min(parse_version(h.trace_format_version) for h in written) >= END_MARKER_VERSION:
                checked[pid] = written
        except TraceVersionError:
            pass  # the version check reports it
    if not checked:
        return None  # written before writers ended their files: nothing to check
    ends = [e for e in events if type(e) is TraceEnd]
    expected: dict[int, int] = {}
    for end in ends:
        expected[end.pid] = expected.get(end.pid, 0) + end.num_events
    found = Counter(e.pid for e in events)  # headers and ends included: subtracted below
    unfinished: list[str] = []
    short: list[str] = []
    for pid, written in checked.items():
        name = _process_name(written[0])
        num_ends = sum(end.pid == pid for end in ends)
        here = found[pid] - len(written) - num_ends
        if num_ends < len(written):
            unfinished.append(f"{name} (pid {pid}; {here} events here)")
        elif here < expected.get(pid, 0):
            short.append(f"{name} (pid {pid}) wrote {expected[pid]} events, {here} are here")
    if unfinished:
        who = " and ".join(unfinished)
        message = (
            f"{where} is truncated: {who} did not finish writing it (no trace.end line). "
            "The process was killed, or the file was cut short (or is still being written): "
            "the last events are missing"
        )
        return _Truncation(message, finished_by_some=bool(ends))
    if short:
        message = f"{where} is truncated: " + "; ".join(short) + " (lines are missing)"
        return _Truncation(message, finished_by_some=True)
    return None


def _process_name(header: TraceHeader) -> str:
    role = header.role
    if not role:
        return "the process that wrote it"
    return _ROLE_NAMES.get(role, f"the {role} process")


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
    with gc_paused():
        streams = [sorted(read_events(p), key=_order_key) for p in sources]
        existing = sorted(read_events(path), key=_order_key) if os.path.exists(path) else []
    first_part_ts = min((s[0].ts for s in streams if s), default=None)
    if existing and (first_part_ts is None or existing[-1].ts >= first_part_ts):
        streams.append(existing)
    tmp = path + ".merging"
    with open(tmp, "wb") as out:
        out.write(msgspec.json.Encoder().encode_lines(list(heapq.merge(*streams, key=_order_key))))
    os.replace(tmp, path)
    for p in sources:
        if p != path:
            os.remove(p)
    return path


__all__ = [
    "END_MARKER_VERSION",
    "HEADER_KIND",
    "TraceTruncatedWarning",
    "TraceVersionError",
    "check_trace_version",
    "find_truncation",
    "gc_paused",
    "load_trace",
    "load_trace_checked",
    "merge_trace_parts",
    "parse_version",
    "read_events",
]
