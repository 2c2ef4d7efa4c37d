"""Export a Glassbox trace as Chrome / Perfetto trace-event JSON.

vLLM twin: none (vLLM exports OpenTelemetry spans; its profiler writes
PyTorch's Chrome traces of kernels). Open the file in ui.perfetto.dev or
chrome://tracing.

Read it for how engine events map onto a timeline:

  * per request, async spans (``ph`` b/e, one ``id`` each): on the front end
    ``request <id>`` from ``request.added`` to ``request.finished`` (spans
    are named by the internal id; its args add the id the user gave,
    ``external_req_id``), with an instant (``n``) per output; in the engine
    core ``core <id>`` from ``sched.queued`` to ``sched.finished``, split
    into ``waiting`` / ``running`` / ``preempted`` phases, with instants for
    prefix-cache lookups, tokens and (speculative decoding) the verdict on
    its drafts (``drafts verified``). Front end and core get separate ids
    because their lifetimes overlap without nesting (a stop string ends the
    request in the front end before the core hears of it);
  * per engine step, complete slices (``ph`` X): on the ``scheduler``
    thread (the host's loop) ``schedule()``, ``wait for tokens`` (the host
    blocked on the step's sampled tokens) and ``update_from_output()``, each
    with its ``step`` in the args; on the ``steps in flight`` threads one
    ``step N`` slice per step, from its launch (``engine.step_launched``) to
    the moment its tokens were read (``engine.output_ready``; traces before
    1.4: the end of ``schedule()`` to the start of ``update_from_output()``).
    With async scheduling step N+1 is launched before step N's tokens are
    read, so their slices overlap: each goes on the first ``steps in
    flight`` thread free at its start (two threads then, steps alternating),
    and step N+1's ``schedule()`` on the host lies inside step N's slice.
    The ``model runner`` thread has ``forward`` (on CUDA, GPU time placed at
    the launch, and never before the previous forward's end: one stream);
  * counters (``ph`` C): KV blocks (used / free but still cached / free and
    empty, stacked to the usable pool), queue lengths, scheduled tokens;
  * flow arrows (``ph`` s/f) across the front end <-> engine-core hop, one
    per request going in and one per output coming back: between the
    process-hop events (``request.sent`` -> ``request.received``,
    ``output.sent`` -> ``output.received``, matched by their request ids) when
    the trace has them,
    otherwise ``request.added`` -> ``sched.queued`` and ``sched.update`` ->
    ``request.output``. Flow ends bind to small slices on an ``io`` thread;
  * KV and API events as instants (``ph`` i) on their own threads, the
    runner's (``runner.batch``, ``sampler.sampled``, ``spec.proposed``,
    ``so.masked``, ...) on the ``model runner`` thread;
  * structured outputs: each grammar's compile as a slice on the engine
    core's ``grammar compile`` thread (the compiler's time, ``compile_s``,
    ending at ``so.compiled``; concurrent compiles on lanes of their own),
    the request's core span in a ``waiting for grammar`` phase from
    ``sched.queued`` to ``so.ready``, and each step's ``so.bitmask`` (and
    ``so.advanced``, ``so.rollback``) as instants on the ``scheduler`` thread;
  * tensor parallelism: a process track per worker rank, ``worker TP<rank>
    (pid N)``, whose ``rpcs`` thread has a slice per call the rank took off
    the broadcast ring (``worker.rpc_received`` to ``seconds`` later,
    ``worker.rpc_done``), named by method and step (``execute_model step
    3``), its args the collectives it ran; rank 0's track also holds the
    model runner. Flows: ``SchedulerOutput`` from the end of the step's
    ``schedule()`` to each rank's ``execute_model``, and ``ModelRunnerOutput``
    from the answering rank's last call of the step to the engine's
    ``engine.output_ready`` (both on the ``engine core io`` thread);
  * names for every process and thread (``ph`` M).

Timestamps are microseconds since the first event. Slices on one thread are
clamped so they never overlap (Perfetto moves overlapping slices to a
separate track).
Sessions: all.
"""

from __future__ import annotations

import json
import os
from collections import defaultdict
from collections.abc import Iterable
from typing import Any

import msgspec

from engine.tracing.events import TraceEvent, TraceHeader
from engine.tracing.reader import load_trace
from engine.tracing.replay_ranks import EXECUTE_MODEL, SAMPLE_TOKENS, RpcCall, rpc_calls
from engine.tracing.replay_state import STATE_KINDS, EngineState

# Thread ids of the logical tracks inside one process.
TID_SCHEDULER = 1
TID_RUNNER = 2
TID_KV = 3
TID_FRONTEND = 4
TID_CORE_IO = 5
TID_API = 6
# The "steps in flight" threads: 7, 8, ... (two with async scheduling).
TID_IN_FLIGHT = 7
# A worker rank's calls off the broadcast ring (tensor parallelism).
TID_WORKER_RPC = 24
# The "grammar compile" threads: 32, 33, ... (one per compile running at once).
TID_GRAMMAR = 32
_THREAD_NAMES = {
    TID_SCHEDULER: "scheduler",
    TID_RUNNER: "model runner",
    TID_KV: "KV cache",
    TID_FRONTEND: "front end",
    TID_CORE_IO: "engine core io",
    TID_API: "API server",
    TID_IN_FLIGHT: "steps in flight",
    TID_WORKER_RPC: "rpcs",
}
_FRONTEND_KINDS = ("request.added", "request.output", "request.finished")
# Worker events drawn as instants on the model runner's thread.
_RUNNER_INSTANTS = (
    "runner.batch",
    "runner.init",
    "runner.inputs",
    "sampler.sampled",
    "spec.proposed",
    "so.masked",
)
# Structured-output events drawn as instants on the scheduler's thread.
_GRAMMAR_INSTANTS = ("so.bitmask", "so.advanced", "so.rollback")
_HOP_KINDS = ("request.sent", "request.received", "output.sent", "output.received")
# Width of the small slices flow arrows bind to (µs).
_POINT_US = 1.0


def export_perfetto(trace: str | Iterable[TraceEvent], out_path: str) -> dict[str, Any]:
    """Write ``trace`` (a path or loaded events) as trace-event JSON to
    ``out_path``; returns the JSON object written."""
    events = load_trace(trace) if isinstance(trace, str) else list(trace)
    doc = build_perfetto(events)
    parent = os.path.dirname(os.path.abspath(out_path))
    os.makedirs(parent, exist_ok=True)
    with open(out_path, "w", encoding="utf-8") as f:
        json.dump(doc, f, separators=(",", ":"))
    return doc


def build_perfetto(events: Iterable[TraceEvent]) -> dict[str, Any]:
    """The trace-event JSON object for loaded ``events``."""
    return _Builder(events).build()


class _Builder:
    def __init__(self, events: Iterable[TraceEvent]) -> None:
        # Headers describe the file, not the run (and their ts would move t0).
        self.events = sorted(
            (e for e in events if type(e) is not TraceHeader),
            key=lambda e: (e.ts, e.pid, e.seq),
        )
        self.t0 = self.events[0].ts if self.events else 0
        self.out: list[dict[str, Any]] = []
        # (pid, tid) -> list of [start_us, end_us, name, args] X slices.
        self.slices: dict[tuple[int, int], list[list[Any]]] = defaultdict(list)
        self.flows: list[dict[str, Any]] = []
        self.async_ids: dict[tuple[str, str], int] = {}
        self.threads_used: set[tuple[int, int]] = set()
        self.roles: dict[int, set[str]] = defaultdict(set)
        # pid -> tensor-parallel rank of each worker process.
        self.tp_ranks: dict[int, int] = {
            e.pid: e.tp_rank for e in self.events if e.tp_rank is not None
        }
        # Worker calls: (start, end) µs of each one's slice (see _worker_rpcs).
        self.rpc_spans: list[tuple[RpcCall, float, float]] = []

    def us(self, ts_ns: int) -> float:
        return (ts_ns - self.t0) / 1000.0

    def span_before(self, e: Any) -> tuple[float, float]:
        """(start, end) in µs of the work an event reports when it ends: it
        was emitted at ``ts``, ``duration_ns`` after the work began."""
        end = self.us(e.ts)
        return end - e.duration_ns / 1000.0, end

    def async_id(self, layer: str, request_id: str) -> int:
        key = (layer, request_id)
        if key not in self.async_ids:
            self.async_ids[key] = len(self.async_ids) + 1
        return self.async_ids[key]

    # ------------------------------------------------------------------
    def build(self) -> dict[str, Any]:
        for e in self.events:
            kind = e.kind
            if kind in ("spec.proposed", "so.masked") or kind.startswith(("runner.", "sampler.")):
                self.roles[e.pid].add("worker")
            elif kind in ("request.received", "output.sent", "spec.verified") or kind.startswith(
                ("sched.", "kv.", "engine.", "so.")
            ):
                self.roles[e.pid].add("engine core")
            elif kind.startswith("request."):
                self.roles[e.pid].add("front end")
            elif kind.startswith("api."):
                self.roles[e.pid].add("API server")
        self._steps()
        self._runner()
        self._worker_rpcs()
        self._grammar()
        self._kv_instants()
        self._counters()
        self._core_requests()
        self._frontend_requests()
        self._flows()
        self._api()
        self._emit_slices()
        self._metadata()
        self.out.sort(key=lambda ev: (ev["ph"] != "M", ev.get("ts", 0.0)))
        return {
            "traceEvents": self.out,
            "displayTimeUnit": "ms",
            "otherData": {"source": "glassbox", "t0_ns": self.t0},
        }

    def add_slice(self, pid: int, tid: int, start: float, end: float, name: str, args=None):
        self.slices[(pid, tid)].append([start, max(end, start), name, args or {}])

    # -- engine steps -----------------------------------------------------------
    def _steps(self) -> None:
        by_step: dict[tuple[int, int], dict[str, Any]] = defaultdict(dict)
        kinds = ("sched.step", "sched.update", "engine.step_launched", "engine.output_ready")
        for e in self.events:
            if e.kind in kinds and e.step is not None:
                by_step[(e.pid, e.step)][e.kind] = e
        last_us: dict[int, float] = {}
        for e in self.events:
            last_us[e.pid] = self.us(e.ts)
        # pid -> [(start, end, step, args)] of each step's time in flight.
        in_flight: dict[int, list[tuple[float, float, int, dict[str, Any]]]] = defaultdict(list)
        for (pid, step), parts in sorted(by_step.items()):
            sched, update = parts.get("sched.step"), parts.get("sched.update")
            launched, ready = parts.get("engine.step_launched"), parts.get("engine.output_ready")
            args: dict[str, Any] = {"step": step}
            if sched is not None:
                args.update(
                    total_num_scheduled_tokens=sched.total_num_scheduled_tokens,
                    num_running=sched.num_running,
                    num_waiting=sched.num_waiting,
                )
                self.add_slice(
                    pid,
                    TID_SCHEDULER,
                    *self.span_before(sched),
                    "schedule()",
                    {
                        "step": step,
                        "num_scheduled_tokens": sched.num_scheduled_tokens,
                        "new": sched.new_req_ids,
                        "resumed": sched.resumed_req_ids,
                        "preempted": sched.preempted_req_ids,
                        "token_budget_left": sched.token_budget_left,
                    },
                )
            if ready is not None:
                end = self.us(ready.ts)
                self.add_slice(
                    pid,
                    TID_SCHEDULER,
                    end - ready.wait_ns / 1000.0,
                    end,
                    "wait for tokens",
                    {"step": step, "wait_ms": ready.wait_ns / 1e6},
                )
            if update is not None:
                self.add_slice(
                    pid,
                    TID_SCHEDULER,
                    *self.span_before(update),
                    "update_from_output()",
                    {
                        "step": step,
                        "new_token_ids": update.new_token_ids,
                        "finished": update.finished,
                    },
                )
            # In flight: launch to tokens read (before 1.4: schedule()'s end to update's start).
            start = self.us(launched.ts) if launched is not None else None
            if start is None and sched is not None:
                start = self.us(sched.ts)
            end = self.us(ready.ts) if ready is not None else None
            if end is None and update is not None:
                end = self.span_before(update)[0]
            if start is not None and end is None:
                # Still in flight when the trace ends (e.g. an empty last step
                # that only told the worker which requests finished).
                end = last_us[pid]
                args["in_flight_at_trace_end"] = True
            if start is not None and end is not None:
                if launched is not None:
                    args["num_in_flight"] = launched.num_in_flight
                if ready is not None:
                    args["wait_ms"] = ready.wait_ns / 1e6
                in_flight[pid].append((start, max(start, end), step, args))
        for pid, spans in in_flight.items():
            # Each step on the first lane free at its launch: overlapping steps
            # (async scheduling) get a lane each, so none is clipped into another.
            lane_ends: list[float] = []
            for start, end, step, args in sorted(spans, key=lambda s: (s[0], s[2])):
                lane = next((i for i, t in enumerate(lane_ends) if t <= start), len(lane_ends))
                if lane == len(lane_ends):
                    lane_ends.append(end)
                lane_ends[lane] = end
                self.add_slice(pid, TID_IN_FLIGHT + lane, start, end, f"step {step}", args)

    def _runner(self) -> None:
        forwards: dict[int, list[list[Any]]] = defaultdict(list)
        for e in self.events:
            if e.kind == "runner.forward":
                # Placed by start_ts (launch time): on CUDA the event is written
                # after sampling, so ts is later than the forward's end.
                if e.start_ts is not None:
                    start = self.us(e.start_ts)
                    end = start + e.duration_ns / 1000.0
                else:  # traces before 1.1: ts is the end
                    start, end = self.span_before(e)
                forwards[e.pid].append(
                    [
                        start,
                        end,
                        {
                            "step": e.step,
                            "num_tokens": e.num_tokens,
                            "duration_ms": e.duration_ns / 1e6,
                        },
                    ]
                )
            elif e.kind in _RUNNER_INSTANTS:
                self._instant(e, TID_RUNNER, e.kind, _event_args(e))
        for pid, items in forwards.items():
            # Launched while the previous forward still ran (async scheduling on
            # CUDA), a forward starts on the device when that one ends.
            previous_end = float("-inf")
            for start, end, args in sorted(items, key=lambda f: f[0]):
                shift = max(0.0, previous_end - start)
                start, end = start + shift, end + shift
                previous_end = end
                self.add_slice(pid, TID_RUNNER, start, end, "forward", args)

    def _worker_rpcs(self) -> None:
        """Tensor parallelism: each call a worker rank took off the broadcast
        ring, as a slice on its ``rpcs`` thread (one call at a time per rank)."""
        last_us: dict[int, float] = {}
        for e in self.events:
            last_us[e.pid] = self.us(e.ts)
        by_pid: dict[int, list[RpcCall]] = defaultdict(list)
        for call in rpc_calls(self.events):
            by_pid[call.pid].append(call)
        for pid, calls in by_pid.items():
            for i, call in enumerate(calls):
                start = self.us(call.received_ts)
                done = call.done
                end = start + done.seconds * 1e6 if done is not None else last_us[pid]
                if i + 1 < len(calls):  # never into the next call (clocks of µs)
                    end = min(end, self.us(calls[i + 1].received_ts))
                end = max(start, end)
                name = call.method if call.step is None else f"{call.method} step {call.step}"
                args: dict[str, Any] = {
                    "method": call.method,
                    "step": call.step,
                    "tp_rank": call.tp_rank,
                }
                if done is None:
                    args["unfinished"] = True
                else:
                    args.update(
                        seconds=done.seconds,
                        all_reduce_count=done.all_reduce_count,
                        all_gather_count=done.all_gather_count,
                        collective_ms=done.collective_seconds * 1e3,
                        collective_bytes=done.collective_bytes,
                        replied=done.replied,
                    )
                self.add_slice(pid, TID_WORKER_RPC, start, end, name, args)
                self.rpc_spans.append((call, start, end))

    def _grammar(self) -> None:
        """Compiles as slices (the compiler's time, ending at ``so.compiled``)
        on the ``grammar compile`` lanes; the per-step grammar events as
        instants on the scheduler's thread."""
        started: dict[str, TraceEvent] = {}
        compiles: dict[int, list[tuple[float, float, str, dict[str, Any]]]] = defaultdict(list)
        for e in self.events:
            k = e.kind
            if k == "so.compile_started":
                started[e.request_id] = e
            elif k == "so.compiled":
                end = self.us(e.ts)
                start = end - e.compile_s * 1e6
                args: dict[str, Any] = {
                    "request_id": e.request_id,
                    "grammar_kind": e.grammar_kind,
                    "compile_ms": e.compile_s * 1e3,
                    "cache_hit": e.cache_hit,
                }
                first = started.pop(e.request_id, None)
                if first is not None:
                    # Time in the pool's queue before a thread took it up.
                    args["queued_ms"] = max(0.0, start - self.us(first.ts)) / 1e3
                if e.error:
                    args["error"] = e.error
                compiles[e.pid].append((start, end, f"compile {e.grammar_kind}", args))
            elif k in _GRAMMAR_INSTANTS:
                self._instant(e, TID_SCHEDULER, k, _event_args(e))
        for pid, spans in compiles.items():
            lane_ends: list[float] = []
            for start, end, name, args in sorted(spans, key=lambda c: c[0]):
                lane = next((i for i, t in enumerate(lane_ends) if t <= start), len(lane_ends))
                if lane == len(lane_ends):
                    lane_ends.append(end)
                lane_ends[lane] = end
                self.add_slice(pid, TID_GRAMMAR + lane, start, end, name, args)

    def _kv_instants(self) -> None:
        for e in self.events:
            k = e.kind
            if k.startswith("kv.") or k in ("engine.config", "engine.profile", "sched.preempted"):
                tid = TID_KV if k.startswith("kv.") else TID_SCHEDULER
                self._instant(e, tid, k, _event_args(e))

    def _instant(self, e: TraceEvent, tid: int, name: str, args: dict[str, Any]) -> None:
        self.threads_used.add((e.pid, tid))
        self.out.append(
            {
                "name": name,
                "cat": e.kind.split(".")[0],
                "ph": "i",
                "s": "t",
                "ts": self.us(e.ts),
                "pid": e.pid,
                "tid": tid,
                "args": args,
            }
        )

    # -- counters --------------------------------------------------------------------
    def _counters(self) -> None:
        state = EngineState()
        engine_pids = {e.pid for e in self.events if e.kind == "kv.init"}
        # Structured outputs: the second waiting queue too.
        skipped = any(e.kind == "so.compile_started" for e in self.events)
        core = sorted(
            (e for e in self.events if e.pid in engine_pids and e.kind in STATE_KINDS),
            key=lambda e: (e.pid, e.seq),
        )
        for e in core:
            state.apply(e)
            if e.kind not in ("kv.init", "sched.step", "sched.update"):
                continue
            ts, pid = self.us(e.ts), e.pid
            usable = max(state.num_blocks - 1, 0)
            cached_free = state.num_cached_free_blocks
            self.out.append(
                {
                    "name": "KV cache blocks",
                    "ph": "C",
                    "ts": ts,
                    "pid": pid,
                    "tid": TID_KV,
                    "args": {
                        "used": usable - state.num_free_blocks,
                        "free (cached)": cached_free,
                        "free (empty)": state.num_free_blocks - cached_free,
                    },
                }
            )
            counts = {"running": len(state.running), "waiting": len(state.waiting)}
            if skipped:
                counts["skipped waiting"] = len(state.skipped_waiting)
            self.out.append(
                {
                    "name": "requests",
                    "ph": "C",
                    "ts": ts,
                    "pid": pid,
                    "tid": TID_SCHEDULER,
                    "args": counts,
                }
            )
            if e.kind == "sched.step":
                self.out.append(
                    {
                        "name": "scheduled tokens",
                        "ph": "C",
                        "ts": ts,
                        "pid": pid,
                        "tid": TID_SCHEDULER,
                        "args": {"tokens": e.total_num_scheduled_tokens},
                    }
                )

    # -- per-request async spans -------------------------------------------------
    def _core_requests(self) -> None:
        open_phase: dict[str, tuple[str, TraceEvent]] = {}
        opened: dict[str, TraceEvent] = {}
        last_ts = self.events[-1].ts if self.events else 0

        def b(e, name, rid, args=None):
            self.out.append(
                {
                    "name": name,
                    "cat": "request.core",
                    "ph": "b",
                    "id": self.async_id("core", rid),
                    "ts": self.us(e.ts),
                    "pid": e.pid,
                    "tid": TID_SCHEDULER,
                    "args": args or {"request_id": rid},
                }
            )

        def end(ts_ns, pid, name, rid):
            self.out.append(
                {
                    "name": name,
                    "cat": "request.core",
                    "ph": "e",
                    "id": self.async_id("core", rid),
                    "ts": self.us(ts_ns),
                    "pid": pid,
                    "tid": TID_SCHEDULER,
                }
            )

        def phase(e, rid, name):
            if rid in open_phase:
                old, _ = open_phase.pop(rid)
                end(e.ts, e.pid, old, rid)
            if name is not None:
                b(e, name, rid)
                open_phase[rid] = (name, e)

        def n(e, name, rid, args):
            self.out.append(
                {
                    "name": name,
                    "cat": "request.core",
                    "ph": "n",
                    "id": self.async_id("core", rid),
                    "ts": self.us(e.ts),
                    "pid": e.pid,
                    "tid": TID_SCHEDULER,
                    "args": args,
                }
            )

        grammar: set[str] = set()  # constrained requests not yet queued
        for e in self.events:
            k = e.kind
            rid = getattr(e, "request_id", None)
            if k == "so.compile_started":
                grammar.add(rid)
            elif k == "sched.queued":
                b(
                    e,
                    f"core {rid}",
                    rid,
                    {"request_id": rid, "num_prompt_tokens": e.num_prompt_tokens},
                )
                opened[rid] = e
                if rid in grammar:
                    grammar.discard(rid)
                    phase(e, rid, "waiting for grammar")
                else:
                    phase(e, rid, "waiting")
            elif rid not in opened and k != "sched.update":
                continue
            elif k == "so.ready":
                phase(e, rid, "waiting")
            elif k == "so.compiled":
                n(
                    e,
                    "grammar compiled",
                    rid,
                    {"compile_ms": e.compile_s * 1e3, "cache_hit": e.cache_hit, "error": e.error},
                )
            elif k == "sched.admitted":
                phase(e, rid, "running")
            elif k == "sched.preempted":
                phase(e, rid, "preempted")
            elif k == "kv.cache_hit":
                n(e, "prefix-cache lookup", rid, {"num_cached_tokens": e.num_cached_tokens})
            elif k == "spec.verified":
                n(
                    e,
                    "drafts verified",
                    rid,
                    {
                        "draft_token_ids": e.draft_token_ids,
                        "num_accepted": e.num_accepted,
                        "token_ids": e.token_ids,
                        "num_rejected": e.num_rejected,
                        "num_computed_tokens": e.num_computed_tokens,
                    },
                )
            elif k == "sched.update":
                for r, tokens in e.new_token_ids.items():
                    if r in opened:
                        n(e, "tokens", r, {"token_ids": tokens})
            elif k == "sched.finished":
                phase(e, rid, None)
                end(e.ts, e.pid, f"core {rid}", rid)
                del opened[rid]
        for rid, first in opened.items():
            if rid in open_phase:
                name, _ = open_phase.pop(rid)
                end(last_ts, first.pid, name, rid)
            end(last_ts, first.pid, f"core {rid}", rid)

    def _frontend_requests(self) -> None:
        opened: dict[str, TraceEvent] = {}
        last_ts = self.events[-1].ts if self.events else 0
        for e in self.events:
            k = e.kind
            if k not in _FRONTEND_KINDS:
                continue
            rid = e.request_id
            base = {
                "cat": "request",
                "id": self.async_id("front", rid),
                "pid": e.pid,
                "tid": TID_FRONTEND,
                "ts": self.us(e.ts),
            }
            if k == "request.added":
                self.out.append(
                    {
                        **base,
                        "name": f"request {rid}",
                        "ph": "b",
                        "args": {
                            "request_id": rid,
                            "external_req_id": e.external_req_id,
                            "prompt": e.prompt,
                            "num_prompt_tokens": e.num_prompt_tokens,
                        },
                    }
                )
                opened[rid] = e
            elif rid not in opened:
                continue
            elif k == "request.output":
                self.out.append(
                    {
                        **base,
                        "name": "output",
                        "ph": "n",
                        "args": {"new_token_ids": e.new_token_ids, "text_delta": e.text_delta},
                    }
                )
            elif k == "request.finished":
                self.out.append(
                    {
                        **base,
                        "name": f"request {rid}",
                        "ph": "e",
                        "args": {"finish_reason": e.finish_reason},
                    }
                )
                del opened[rid]
        for rid, first in opened.items():
            self.out.append(
                {
                    "name": f"request {rid}",
                    "cat": "request",
                    "ph": "e",
                    "id": self.async_id("front", rid),
                    "pid": first.pid,
                    "tid": TID_FRONTEND,
                    "ts": self.us(last_ts),
                }
            )

    # -- flows across the process hop ---------------------------------------------
    def _flows(self) -> None:
        kinds = {e.kind for e in self.events}
        use_hops_in = "request.sent" in kinds and "request.received" in kinds
        use_hops_out = "output.sent" in kinds and "output.received" in kinds
        # (pid, tid) -> [(ts_us, flow event)] to place on point slices later.
        self.point_events: dict[tuple[int, int], list[tuple[float, dict[str, Any], str]]] = (
            defaultdict(list)
        )
        flow_id = 0

        def pair(src: TraceEvent, dst: TraceEvent, name: str, src_tid: int, dst_tid: int):
            nonlocal flow_id
            flow_id += 1
            s_ts, f_ts = self.us(src.ts), self.us(dst.ts)
            if f_ts < s_ts:  # clocks of two processes disagree: never draw backwards
                f_ts = s_ts
            self.point_events[(src.pid, src_tid)].append(
                (
                    s_ts,
                    {
                        "name": name,
                        "cat": "hop",
                        "ph": "s",
                        "id": flow_id,
                        "ts": s_ts,
                        "pid": src.pid,
                        "tid": src_tid,
                    },
                    src.kind,
                )
            )
            self.point_events[(dst.pid, dst_tid)].append(
                (
                    f_ts,
                    {
                        "name": name,
                        "cat": "hop",
                        "ph": "f",
                        "bp": "e",
                        "id": flow_id,
                        "ts": f_ts,
                        "pid": dst.pid,
                        "tid": dst_tid,
                    },
                    dst.kind,
                )
            )

        # Requests going in.
        src_kind, dst_kind = (
            ("request.sent", "request.received")
            if use_hops_in
            else ("request.added", "sched.queued")
        )
        pending: dict[str, list[TraceEvent]] = defaultdict(list)
        for e in self.events:
            if e.kind == src_kind:
                for rid in _request_ids(e):
                    pending[rid].append(e)
            elif e.kind == dst_kind:
                for rid in _request_ids(e):
                    if pending[rid]:
                        pair(pending[rid].pop(0), e, "request in", TID_FRONTEND, TID_CORE_IO)
        # Outputs coming back.
        if use_hops_out:
            # A batch received pairs with the oldest unmatched batch sent for the
            # same requests (a batch the front end never read has no partner).
            unmatched: list[TraceEvent] = []
            for e in self.events:
                if e.kind == "output.sent":
                    unmatched.append(e)
                elif e.kind == "output.received":
                    ids = _request_ids(e)
                    match = next((s for s in unmatched if _request_ids(s) == ids), None)
                    if match is not None:
                        unmatched.remove(match)
                        pair(match, e, "outputs", TID_CORE_IO, TID_FRONTEND)
        else:
            waiting_output: dict[str, list[TraceEvent]] = defaultdict(list)
            for e in self.events:
                if e.kind == "sched.update":
                    for rid in e.new_token_ids:
                        waiting_output[rid].append(e)
                elif e.kind == "request.output" and waiting_output[e.request_id]:
                    pair(
                        waiting_output[e.request_id].pop(0), e, "output", TID_CORE_IO, TID_FRONTEND
                    )
        self._rank_flows(flow_id)

    def _rank_flows(self, flow_id: int) -> None:
        """Tensor parallelism: ``SchedulerOutput`` from the end of each step's
        ``schedule()`` (it goes on the ring right after) to every rank's
        ``execute_model``, and ``ModelRunnerOutput`` from the answering rank's
        last call of the step (``sample_tokens`` when it sampled) to the
        engine's ``engine.output_ready``. The engine's ends bind to point
        slices on its ``engine core io`` thread, the ranks' to their calls."""
        if not self.rpc_spans:
            return
        scheduled: dict[int, TraceEvent] = {}
        ready: dict[int, TraceEvent] = {}
        for e in self.events:
            if e.step is not None and e.tp_rank is None:
                if e.kind == "sched.step":
                    scheduled.setdefault(e.step, e)
                elif e.kind == "engine.output_ready":
                    ready.setdefault(e.step, e)
        answers: dict[int, tuple[RpcCall, float, float]] = {}
        for call, start, end in self.rpc_spans:
            if call.step is None or call.method not in (EXECUTE_MODEL, SAMPLE_TOKENS):
                continue
            if call.done is not None and call.done.replied:
                answers[call.step] = (call, start, end)  # the step's last answer wins
            sched = scheduled.get(call.step)
            if call.method != EXECUTE_MODEL or sched is None:
                continue
            flow_id += 1
            # The receive is on the rank's clock (one machine: the same clock).
            src_ts = min(self.us(sched.ts), start)
            self._rank_flow(flow_id, "SchedulerOutput", sched, src_ts, call.pid, start, False)
        for step, (call, start, end) in sorted(answers.items()):
            out = ready.get(step)
            if out is None:
                continue
            flow_id += 1
            src_ts = max(start, end - min(_POINT_US, (end - start) / 2))
            dst_ts = max(self.us(out.ts), src_ts)
            self._rank_flow(flow_id, "ModelRunnerOutput", out, dst_ts, call.pid, src_ts, True)

    def _rank_flow(
        self,
        flow_id: int,
        name: str,
        engine_event: TraceEvent,
        engine_ts: float,
        rank_pid: int,
        rank_ts: float,
        to_engine: bool,
    ) -> None:
        """One flow between the engine (a point slice on its io thread) and a
        rank's call (bound to its slice)."""
        base = {"name": name, "cat": "rpc", "id": flow_id}
        engine_end = {**base, "ts": engine_ts, "pid": engine_event.pid, "tid": TID_CORE_IO}
        rank_end = {**base, "ts": rank_ts, "pid": rank_pid, "tid": TID_WORKER_RPC}
        start, finish = (rank_end, engine_end) if to_engine else (engine_end, rank_end)
        start["ph"] = "s"
        finish.update(ph="f", bp="e")
        self.out.append(rank_end)
        self.point_events[(engine_event.pid, TID_CORE_IO)].append(
            (engine_ts, engine_end, engine_event.kind)
        )

    def _api(self) -> None:
        for e in self.events:
            if e.kind.startswith("api."):
                self._instant(e, TID_API, e.kind, _event_args(e))

    # -- slices (with the point slices flows bind to) -----------------------------
    def _emit_slices(self) -> None:
        for (pid, tid), points in self.point_events.items():
            points.sort(key=lambda p: p[0])
            i = 0
            while i < len(points):
                ts = points[i][0]
                j = i
                names = []
                while j < len(points) and points[j][0] == ts:
                    names.append(points[j][2])
                    self.out.append(points[j][1])
                    j += 1
                end = ts + _POINT_US
                if j < len(points):
                    end = min(end, points[j][0])
                self.add_slice(pid, tid, ts, end, names[0], {"events": names})
                i = j
        for (pid, tid), slices in self.slices.items():
            self.threads_used.add((pid, tid))
            # Parents before children: start ascending, longer first.
            slices.sort(key=lambda s: (s[0], -(s[1] - s[0])))
            stack: list[list[Any]] = []
            for s in slices:
                while stack and stack[-1][1] <= s[0]:
                    stack.pop()
                if stack and s[1] > stack[-1][1]:
                    s[1] = stack[-1][1]  # clip to the enclosing slice
                stack.append(s)
                self.out.append(
                    {
                        "name": s[2],
                        "cat": "engine",
                        "ph": "X",
                        "ts": s[0],
                        "dur": s[1] - s[0],
                        "pid": pid,
                        "tid": tid,
                        "args": s[3],
                    }
                )

    def _metadata(self) -> None:
        pids = {e.pid for e in self.events}
        for pid in sorted(pids):
            roles = self.roles.get(pid) or {"process"}
            order = ["API server", "front end", "engine core", "worker", "process"]
            label = " + ".join(r for r in order if r in roles)
            if pid in self.tp_ranks:
                label = f"worker TP{self.tp_ranks[pid]}"
            self.out.append(
                {
                    "name": "process_name",
                    "ph": "M",
                    "pid": pid,
                    "tid": 0,
                    "args": {"name": f"{label} (pid {pid})"},
                }
            )
        tracks = {
            (ev["pid"], ev["tid"]) for ev in self.out if ev["ph"] in ("b", "e", "n", "C", "s", "f")
        }
        for pid, tid in sorted(self.threads_used | tracks):
            self.out.append(
                {
                    "name": "thread_name",
                    "ph": "M",
                    "pid": pid,
                    "tid": tid,
                    "args": {"name": _thread_name(tid)},
                }
            )


def _thread_name(tid: int) -> str:
    if tid >= TID_GRAMMAR:
        lane = tid - TID_GRAMMAR
        return "grammar compile" + (f" ({lane + 1})" if lane else "")
    if tid in _THREAD_NAMES:
        return _THREAD_NAMES[tid]
    if tid > TID_IN_FLIGHT:
        # The second lane holds the steps launched while another was in flight.
        return f"steps in flight ({tid - TID_IN_FLIGHT + 1})"
    return f"track {tid}"


def _event_args(event: TraceEvent) -> dict[str, Any]:
    """An event's own fields (every field but the envelope), as instant args."""
    fields = msgspec.to_builtins(event)
    return {k: v for k, v in fields.items() if k not in ("ts", "pid", "seq", "kind")}


def _request_ids(event: TraceEvent) -> list[str]:
    request_id = getattr(event, "request_id", None)
    if request_id is not None:
        return [request_id]
    return list(getattr(event, "request_ids", None) or ())


__all__ = ["build_perfetto", "export_perfetto"]
