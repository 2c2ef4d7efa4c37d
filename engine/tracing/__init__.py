"""Tracing: typed events from every subsystem, written as JSON lines, replayed step by step.

vLLM twin: ``vllm/tracing/`` (vLLM exports OpenTelemetry spans per request;
Glassbox records a finer event stream -- every scheduling decision, KV block
move and sampling step -- so that a run can be replayed). The modules:

  * ``events.py``   -- one struct per event kind (the format; docs/trace_format.md);
  * ``tracer.py``   -- ``Tracer`` (one per process, writes the file) and
    ``SubsystemTrace``, the base of the trace objects subsystems receive;
  * ``core_trace.py``, ``engine_trace.py``, ``worker_trace.py`` -- those
    trace objects (``SchedulerTrace``, ``KVCacheTrace``,
    ``StructuredOutputTrace``, ``EngineCoreTrace``, ``OutputProcessorTrace``,
    ``ClientTrace``, ``ServerTrace``, ``RunnerTrace``, ``SamplerTrace``):
    where every event is built;
  * ``reader.py``   -- ``load_trace``, ``merge_trace_parts``, version checks,
    ``find_truncation`` (a writer that did not finish its file);
  * ``replay.py`` / ``replay_state.py`` -- ``TraceReplay``: the engine's state
    at any step; ``replay_ranks.py`` -- each tensor-parallel rank's share of a
    step (``RankStep``); ``perfetto.py`` -- ``export_perfetto``.

This package is a leaf: it imports no other Glassbox module. It only
re-exports; the replay model, the Perfetto export and the worker's trace
objects (which need torch) are imported on first use, so an engine process
never loads them. Sessions: all.
"""

from __future__ import annotations

import importlib
from typing import Any

from engine.tracing.events import *  # noqa: F403 (the event classes)
from engine.tracing.events import __all__ as _event_names
from engine.tracing.reader import (
    TraceTruncatedWarning,
    TraceVersionError,
    check_trace_version,
    find_truncation,
    gc_paused,
    load_trace,
    load_trace_checked,
    merge_trace_parts,
    parse_version,
    read_events,
)
from engine.tracing.tracer import (
    DEFAULT_BUFFER_SIZE,
    NULL_TRACER,
    SubsystemTrace,
    TraceLevel,
    Tracer,
    part_path,
)

# Imported when first asked for: name -> module.
_LAZY = {
    "BatchSlot": "engine.tracing.replay",
    "EngineState": "engine.tracing.replay",
    "GrammarMaskEffect": "engine.tracing.replay",
    "RankStep": "engine.tracing.replay_ranks",
    "ReplayBlock": "engine.tracing.replay",
    "ReplayError": "engine.tracing.replay",
    "ReplayRequest": "engine.tracing.replay",
    "RpcCall": "engine.tracing.replay_ranks",
    "SpecDecodeRow": "engine.tracing.replay",
    "SpecDecodeStep": "engine.tracing.replay",
    "StepPhases": "engine.tracing.replay",
    "StepView": "engine.tracing.replay",
    "StructuredOutputRow": "engine.tracing.replay",
    "StructuredOutputStep": "engine.tracing.replay",
    "TraceReplay": "engine.tracing.replay",
    "WAITING_FOR_GRAMMAR": "engine.tracing.replay",
    "build_perfetto": "engine.tracing.perfetto",
    "export_perfetto": "engine.tracing.perfetto",
    "rpc_calls": "engine.tracing.replay_ranks",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)


__all__ = [
    *_event_names,
    *_LAZY,
    "DEFAULT_BUFFER_SIZE",
    "NULL_TRACER",
    "SubsystemTrace",
    "TraceLevel",
    "TraceTruncatedWarning",
    "TraceVersionError",
    "Tracer",
    "check_trace_version",
    "find_truncation",
    "gc_paused",
    "load_trace",
    "load_trace_checked",
    "merge_trace_parts",
    "parse_version",
    "part_path",
    "read_events",
]
