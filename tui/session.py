"""One recorded run, opened for the TUI and the headless summary.

vLLM twin: none (vLLM has no trace viewer). Read it for how a viewer turns a
Glassbox trace into what a person wants to see: the replay model
(``engine.tracing.TraceReplay``) gives the engine's state after any step; this
module adds what a viewer needs on top -- a per-request lifecycle (when it
waited, ran prefill chunks, decoded, stalled, was preempted, finished), token
texts, colours, and a cache of step views so scrubbing back and forth never
replays the same step twice.

The TUI reads runs only through ``engine.tracing`` (``load_trace``,
``TraceReplay`` and the typed event classes); everything here is derived from
the events.
Sessions: all (the tracer TUI follows one request through every subsystem).
"""

from __future__ import annotations

import json
import os
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar

from engine.tracing import (
    EVENT_KINDS,
    EngineConfig,
    KVAllocated,
    KVAllocationFailed,
    KVCacheHit,
    KVInit,
    ReplayError,
    RequestAdded,
    RequestOutputEvent,
    RunnerInit,
    SamplerSampled,
    SamplingParamsSummary,
    SchedAdmitted,
    SchedFinished,
    SchedPreempted,
    SchedQueued,
    SchedStep,
    SchedUpdate,
    StepView,
    TraceCli,
    TraceEvent,
    TraceHeader,
    TraceReplay,
    TraceTokenTexts,
    TraceVersionError,
    check_trace_version,
    gc_paused,
    load_trace,
)

# ``glassbox trace`` adds two events to the trace it records (through the
# engine's own tracer): ``TraceCli`` (which request the user typed) and
# ``TraceTokenTexts`` (the text of every token id the run mentions; the
# engine records ids only).

# Request colours: the "tab10" palette, mid-luminance, so every one reads on
# a dark and on a light background.
REQUEST_COLOURS = (
    "#1f77b4",
    "#ff7f0e",
    "#2ca02c",
    "#9467bd",
    "#17becf",
    "#e377c2",
    "#8c564b",
    "#bcbd22",
    "#7f7f7f",
    "#d62728",  # last: red also marks preemptions
)

# Phase of a request in one step (one character per step on the timeline).
NOT_ARRIVED = " "
WAITING = "w"
PREFILL = "p"
RECOMPUTE = "r"
DECODE = "d"
STALLED = "s"  # running, but the step gave it no tokens
PREEMPTED = "x"
FINISHED = "f"
PHASE_NAMES = {
    NOT_ARRIVED: "not arrived",
    WAITING: "waiting",
    PREFILL: "prefill chunk",
    RECOMPUTE: "recompute chunk",
    DECODE: "decode",
    STALLED: "running, not scheduled",
    PREEMPTED: "preempted",
    FINISHED: "finished",
}


class TraceLoadError(Exception):
    """A trace that cannot be shown; the message says why, in one sentence or two."""


@dataclass
class LifecycleEvent:
    """One line of a request's lifecycle: something that happened at a step
    (or over a run of steps, for decoding)."""

    step: int
    kind: str  # queued, admitted, resumed, prefill, recompute, first_token, decode,
    #            stalled, blocked, preempted, finished
    text: str
    end_step: int | None = None  # last step of a range (decode/stalled/blocked runs)
    notes: list[str] = field(default_factory=list)

    @property
    def last_step(self) -> int:
        return self.step if self.end_step is None else self.end_step

    def covers(self, step: int) -> bool:
        return self.step <= step <= self.last_step


@dataclass
class RequestTimeline:
    """Everything one request went through, indexed by step."""

    request_id: str
    index: int  # arrival order in the trace
    colour: str
    prompt: str | None
    prompt_token_ids: list[int] | None
    num_prompt_tokens: int
    max_tokens: int
    sampling_params: SamplingParamsSummary | None  # None without a ``request.added``
    queued_step: int
    # phases[i] is the phase at step queued_step + i.
    phases: list[str] = field(default_factory=list)
    events: list[LifecycleEvent] = field(default_factory=list)
    # (step, token id) for every output token, in order.
    output_tokens: list[tuple[int, int]] = field(default_factory=list)
    # (step, text) from the front end's detokenizer (``request.output``).
    text_deltas: list[tuple[int, str]] = field(default_factory=list)
    finished_step: int | None = None
    finish_reason: str | None = None
    num_preemptions: int = 0
    num_cached_tokens: int = 0  # prefix-cache hit at first admission

    def phase_at(self, step: int) -> str:
        """The phase at ``step``: NOT_ARRIVED before it is queued, FINISHED
        from its last step on."""
        i = step - self.queued_step
        if i < 0:
            return NOT_ARRIVED
        if i >= len(self.phases):
            return FINISHED if self.finished_step is not None else self.phases[-1]
        return self.phases[i]

    @property
    def last_step(self) -> int:
        return self.queued_step + len(self.phases) - 1

    def event_steps(self) -> list[int]:
        """Steps where a lifecycle line starts (for 'jump to next event')."""
        return sorted({e.step for e in self.events})

    def event_index_at(self, step: int) -> int | None:
        """The lifecycle line that covers ``step`` (the latest one starting at or before it)."""
        best = None
        for i, e in enumerate(self.events):
            if e.step <= step:
                best = i
        return best

    def output_ids_until(self, step: int) -> list[int]:
        return [t for s, t in self.output_tokens if s <= step]


@dataclass
class RunInfo:
    """Settings of the run, from ``engine.config`` / ``runner.init`` / ``trace.cli``."""

    model: str | None
    device: str | None
    attn_backend: str | None
    dtype: str | None
    block_size: int
    num_blocks: int
    max_num_batched_tokens: int | None
    max_num_seqs: int | None
    enable_prefix_caching: bool | None
    policy: str
    followed_request_id: str | None
    trace_level: str  # "full" when sampler stages / runner inputs are present


class TraceSession:
    """A trace opened for viewing: replay + lifecycles + token texts + a view cache."""

    def __init__(
        self,
        events: list[TraceEvent],
        path: str | None = None,
        view_cache_size: int = 512,
        snapshot_interval: int | None = None,
    ) -> None:
        self.path = path
        if snapshot_interval is None:
            # Fewer snapshots for long runs: building is a copy per snapshot,
            # a view is a copy plus at most snapshot_interval steps of events.
            # (The events are in time order: the last step is near the end.)
            last = max((e.step or 0 for e in events[-1000:]), default=0)
            snapshot_interval = max(16, min(64, last // 40))
        self.replay = TraceReplay(events, snapshot_interval=snapshot_interval)
        self.events = self.replay.events
        self._views: OrderedDict[int, StepView] = OrderedDict()
        self._view_cache_size = view_cache_size
        self.token_texts: dict[int, str] = {}
        cli: TraceCli | None = None
        runner_init: RunnerInit | None = None
        config: EngineConfig | None = None
        kv_init: KVInit | None = None
        has_stages = False
        for e in self.events:
            if isinstance(e, TraceTokenTexts):
                self.token_texts.update({int(k): v for k, v in e.token_texts.items()})
            elif isinstance(e, TraceCli):
                cli = e
            elif isinstance(e, RunnerInit):
                runner_init = e
            elif isinstance(e, SamplerSampled) and e.stages is not None:
                has_stages = True
            elif isinstance(e, EngineConfig) and config is None:
                config = e
            elif isinstance(e, KVInit) and kv_init is None:
                kv_init = e
        assert kv_init is not None  # TraceReplay refuses a trace without one
        self.timelines: dict[str, RequestTimeline] = _build_timelines(self.replay, self.token_texts)
        self.request_ids: list[str] = sorted(self.timelines, key=lambda r: self.timelines[r].index)
        followed = cli.follow_request_id if cli is not None else None
        if followed not in self.timelines:
            followed = self.request_ids[0] if self.request_ids else None
        self.info = RunInfo(
            model=(runner_init.model if runner_init else None) or (cli.model if cli else None),
            device=runner_init.device if runner_init else None,
            attn_backend=runner_init.attn_backend if runner_init else None,
            dtype=runner_init.dtype if runner_init else None,
            block_size=kv_init.block_size,
            num_blocks=kv_init.num_blocks,
            max_num_batched_tokens=config.max_num_batched_tokens if config else None,
            max_num_seqs=config.max_num_seqs if config else None,
            enable_prefix_caching=config.enable_prefix_caching if config else None,
            policy=config.policy if config else "fcfs",
            followed_request_id=followed,
            trace_level="full" if has_stages else "lifecycle",
        )

    # -- steps -------------------------------------------------------------------
    @property
    def last_step(self) -> int:
        return self.replay.last_step

    @property
    def num_steps(self) -> int:
        return self.replay.last_step + 1

    def view(self, step: int) -> StepView:
        """The replay model's view of ``step`` (cached; least recently used evicted)."""
        view = self._views.get(step)
        if view is not None:
            self._views.move_to_end(step)
            return view
        view = self.replay.view(step)
        self._views[step] = view
        if len(self._views) > self._view_cache_size:
            self._views.popitem(last=False)
        return view

    def is_cached(self, step: int) -> bool:
        return step in self._views

    # -- tokens ------------------------------------------------------------------
    def token_text(self, token_id: int) -> str | None:
        return self.token_texts.get(token_id)

    def output_pieces(self, request_id: str, step: int) -> list[str]:
        """The output so far, one string per token (or per detokenizer delta
        when the trace has no token texts)."""
        tl = self.timelines[request_id]
        ids = tl.output_ids_until(step)
        if ids and all(t in self.token_texts for t in ids):
            return [self.token_texts[t] for t in ids]
        if tl.text_deltas:
            return [text for s, text in tl.text_deltas if s <= step and text]
        return [f"#{t} " for t in ids]

    def request_colour(self, request_id: str) -> str:
        tl = self.timelines.get(request_id)
        return tl.colour if tl is not None else REQUEST_COLOURS[-1]

    def next_event_step(self, request_id: str, step: int) -> int | None:
        later = [s for s in self.timelines[request_id].event_steps() if s > step]
        return later[0] if later else None

    def previous_event_step(self, request_id: str, step: int) -> int | None:
        earlier = [s for s in self.timelines[request_id].event_steps() if s < step]
        return earlier[-1] if earlier else None


def visible_whitespace(text: str) -> str:
    return text.replace("\n", "↵").replace("\t", "⇥")


def check_trace_file(path: str) -> None:
    """Cheap checks before a trace is opened: the file exists, is a file, is
    not empty. Raises ``TraceLoadError`` with a message a user can act on."""
    if not os.path.exists(path):
        raise TraceLoadError(
            f'no trace file at {path}. Record one with: glassbox trace "Your prompt" '
            "--trace-path " + path
        )
    if os.path.isdir(path):
        raise TraceLoadError(f"{path} is a directory, not a trace file (.jsonl)")
    if os.path.getsize(path) == 0:
        raise TraceLoadError(
            f"{path} is empty (was the run traced with trace_level 'off', or killed at once?)"
        )


def open_session(path: str, **kwargs: Any) -> TraceSession:
    """Load and check a trace file; every problem becomes a ``TraceLoadError``
    whose message a user can act on (never a traceback)."""
    check_trace_file(path)
    try:
        events = load_trace(path)
    except TraceVersionError as e:
        raise TraceLoadError(str(e)) from None
    except ValueError as e:
        raise TraceLoadError(_describe_bad_line(path, e)) from None
    except (OSError, UnicodeDecodeError) as e:
        raise TraceLoadError(f"cannot read {path}: {e}") from None
    return session_from_events(events, path=path, **kwargs)


def session_from_events(
    events: list[TraceEvent], path: str | None = None, **kwargs: Any
) -> TraceSession:
    where = path or "the trace"
    if not events:
        raise TraceLoadError(
            f"{where} holds no events (was the run traced with trace_level 'off'?)"
        )
    for i, e in enumerate(events):
        if not isinstance(e, TraceEvent):
            raise TraceLoadError(
                f"{where} is not a Glassbox trace: event {i + 1} is a {type(e).__name__}, "
                "not a trace event (read traces with engine.tracing.load_trace)"
            )
    try:
        # Normally none left: load_trace checks and drops the headers.
        check_trace_version([e for e in events if isinstance(e, TraceHeader)], where)
    except TraceVersionError as e:
        raise TraceLoadError(str(e)) from None
    try:
        with gc_paused():
            return TraceSession(events, path=path, **kwargs)
    except ReplayError as e:
        raise TraceLoadError(
            f"{where} cannot be replayed: {e}. It may be incomplete, or written by another "
            "version of Glassbox"
        ) from None


def _other_version(path: str, lines: list[bytes]) -> str | None:
    """The version error of a trace whose header announces another major
    version: its events may not decode here, and that is the reason to give."""
    for line in lines:
        if b'"trace.header"' not in line:
            continue
        try:
            raw = json.loads(line)
        except ValueError:
            continue
        if not isinstance(raw, dict) or raw.get("kind") != TraceHeader.kind:
            continue
        header = TraceHeader(
            trace_format_version=str(raw.get("trace_format_version")),
            glassbox_version=str(raw.get("glassbox_version", "?")),
            trace_level=str(raw.get("trace_level", "?")),
        )
        try:
            check_trace_version([header], path)
        except TraceVersionError as e:
            return str(e)
    return None


def _describe_bad_line(path: str, error: ValueError) -> str:
    """The reader's error about one line, as a sentence: cut off, corrupt,
    not a trace at all, or an event of another version of the format."""
    message = str(error)
    # load_trace says "<path>:<line>: not a JSON trace event (...)" for a line
    # that is not JSON, "... not a Glassbox trace event (...)" for one that is.
    line_no = None
    head = message[len(path) + 1 :] if message.startswith(path + ":") else ""
    if head.split(":", 1)[0].isdigit():
        line_no = int(head.split(":", 1)[0])
    if line_no is None:
        return f"{path} is not a Glassbox trace ({message})"
    with open(path, "rb") as f:
        lines = f.read().split(b"\n")  # numbered as the reader numbers them
    version_error = _other_version(path, lines)
    if version_error is not None:
        return version_error
    last_line = max((i for i, line in enumerate(lines, 1) if line.strip()), default=0)
    try:
        raw = json.loads(lines[line_no - 1])
    except (ValueError, IndexError):
        if line_no >= last_line:
            return (
                f"{path} is truncated: its last line (line {line_no}) is not a complete JSON "
                "event. The run was probably interrupted while writing; record it again"
            )
        return f"{path} is corrupt at line {line_no}: it is not a JSON trace event"
    kind = raw.get("kind") if isinstance(raw, dict) else None
    if kind not in EVENT_KINDS:
        return (
            f"{path} is not a Glassbox trace: line {line_no} is JSON but lacks the ts/pid/kind "
            "fields every trace event has"
        )
    _, found, detail = message.partition(" event (")
    detail = detail.removesuffix(")") if found else message
    return (
        f"{path} looks like a trace from another version of Glassbox: its {kind} event at line "
        f"{line_no} lacks or mistypes a field this version needs ({detail}). Record it again "
        "with this version (glassbox trace ...)"
    )


# ---------------------------------------------------------------------------
# Lifecycles
# ---------------------------------------------------------------------------
@dataclass
class _Live:
    """Running counters of one request while the events are walked."""

    tl: RequestTimeline
    cursor: int = 0
    num_output: int = 0
    ever_preempted: bool = False
    pending_hit: KVCacheHit | None = None
    allocated: dict[int, list[int]] = field(default_factory=dict)  # step -> new block ids
    decode_open: LifecycleEvent | None = None
    range_open: LifecycleEvent | None = None  # stalled / blocked run


def _fmt_blocks(ids: list[int]) -> str:
    return " ".join(str(b) for b in ids)


def _finish_text(status: str, reason: str | None) -> str:
    if status == "FINISHED_ABORTED" or reason == "abort":
        return "aborted"
    if status == "FINISHED_LENGTH_CAPPED" or reason == "length":
        return "length (max_tokens or max_model_len reached)"
    if reason == "stop":
        return "stop (EOS, stop token or stop string)"
    return f"{status.lower()} ({reason})"


# When two things happen to a request in one step, the timeline shows the weightier.
_PHASE_PRIORITY = {
    WAITING: 0,
    STALLED: 1,
    DECODE: 2,
    PREFILL: 3,
    RECOMPUTE: 3,
    FINISHED: 4,
    PREEMPTED: 5,
}


class _TimelineBuilder:
    """Builds every request's lifecycle from the scheduler process's events:
    one handler per event type it reads (``HANDLERS``), fed in the engine's
    own order by ``build``; the other events are skipped at once."""

    def __init__(self, replay: TraceReplay, token_texts: dict[int, str] | None) -> None:
        self.replay = replay
        self.token_texts = token_texts or {}
        self.added = {e.request_id: e for e in replay.events if isinstance(e, RequestAdded)}
        self.live: dict[str, _Live] = {}
        self.running: set[str] = set()  # admitted and neither preempted nor finished since
        self.timelines: dict[str, RequestTimeline] = {}

    def build(self) -> dict[str, RequestTimeline]:
        handlers = self.HANDLERS
        step_of = self.replay.step_of
        for e in self.replay.core_events:  # the engine process's events, in its own order
            handler = handlers.get(type(e))
            if handler is None:
                continue
            step = e.step
            if step is None:
                step = step_of(e)
            handler(self, e, step)
        # The front end's detokenized text (its own process in multi-process runs).
        for e in self.replay.events:
            if isinstance(e, RequestOutputEvent) and e.text_delta and e.request_id in self.live:
                self.live[e.request_id].tl.text_deltas.append((step_of(e), e.text_delta))
        self._finish(self.replay.last_step)
        return self.timelines

    # -- helpers -----------------------------------------------------------------
    def set_phase(self, lv: _Live, step: int, phase: str) -> None:
        phases = lv.tl.phases
        i = step - lv.tl.queued_step
        while len(phases) <= i:
            # A step with no news for the request continues its last phase.
            prev = phases[-1] if phases else WAITING
            phases.append(WAITING if prev in (WAITING, PREEMPTED) else STALLED)
        if _PHASE_PRIORITY[phase] >= _PHASE_PRIORITY[phases[i]]:
            phases[i] = phase

    @staticmethod
    def close_ranges(lv: _Live) -> None:
        lv.decode_open = None
        lv.range_open = None

    # -- one handler per event type ------------------------------------------------
    def on_sched_queued(self, e: SchedQueued, step: int) -> None:
        rid = e.request_id
        a = self.added.get(rid)
        index = len(self.timelines)
        tl = RequestTimeline(
            request_id=rid,
            index=index,
            colour=REQUEST_COLOURS[index % len(REQUEST_COLOURS)],
            prompt=a.prompt if a is not None else None,
            prompt_token_ids=a.prompt_token_ids if a is not None else None,
            num_prompt_tokens=e.num_prompt_tokens,
            max_tokens=e.max_tokens,
            sampling_params=a.sampling_params if a is not None else None,
            queued_step=step,
        )
        self.timelines[rid] = tl
        lv = self.live[rid] = _Live(tl)
        self.set_phase(lv, step, WAITING)
        tl.events.append(
            LifecycleEvent(
                step,
                "queued",
                f"queued: {tl.num_prompt_tokens}-token prompt, up to {tl.max_tokens} new "
                f"tokens, {e.num_block_hashes} full blocks hashed",
            )
        )

    def on_kv_cache_hit(self, e: KVCacheHit, step: int) -> None:
        lv = self.live.get(e.request_id)
        if lv is not None:
            lv.pending_hit = e

    def on_kv_allocated(self, e: KVAllocated, step: int) -> None:
        lv = self.live.get(e.request_id)
        if lv is not None:
            lv.allocated.setdefault(step, []).extend(e.block_ids)

    def on_kv_allocation_failed(self, e: KVAllocationFailed, step: int) -> None:
        lv = self.live.get(e.request_id)
        if lv is None:
            return
        text = f"blocked: needs {e.num_blocks_needed} blocks, {e.num_free_blocks} free"
        blocked = lv.range_open
        if blocked is not None and blocked.kind == "blocked" and blocked.last_step >= step - 1:
            blocked.end_step = step
        else:
            ev = LifecycleEvent(step, "blocked", text)
            lv.tl.events.append(ev)
            self.close_ranges(lv)
            lv.range_open = ev

    def on_sched_admitted(self, e: SchedAdmitted, step: int) -> None:
        lv = self.live.get(e.request_id)
        if lv is None:
            return
        tl = lv.tl
        resumed = e.resumed or lv.ever_preempted
        lv.cursor = e.num_computed_tokens
        self.running.add(e.request_id)
        hit = lv.pending_hit
        lv.pending_hit = None
        hit_blocks = hit.block_ids if hit is not None else []
        if resumed:
            text = f"resumed: recompute from token {lv.cursor}"
        else:
            tl.num_cached_tokens = lv.cursor
            text = "admitted"
        if lv.cursor:
            text += (
                f" (prefix-cache hit: {lv.cursor} of {tl.num_prompt_tokens + lv.num_output} "
                f"tokens, blocks {_fmt_blocks(hit_blocks)})"
            )
        else:
            text += " (no prefix-cache hit)"
        self.close_ranges(lv)
        tl.events.append(LifecycleEvent(step, "resumed" if resumed else "admitted", text))

    def on_sched_preempted(self, e: SchedPreempted, step: int) -> None:
        lv = self.live.get(e.request_id)
        if lv is None:
            return
        tl = lv.tl
        self.running.discard(e.request_id)
        lv.ever_preempted = True
        tl.num_preemptions += 1
        lv.cursor = 0
        self.set_phase(lv, step, PREEMPTED)
        self.close_ranges(lv)
        by = e.for_request_id
        tl.events.append(
            LifecycleEvent(
                step,
                "preempted",
                f"preempted{' to make room for ' + by if by else ''}: blocks freed, "
                f"back to the waiting queue ({e.num_tokens} tokens to recompute)",
            )
        )

    def on_sched_step(self, e: SchedStep, step: int) -> None:
        scheduled = e.num_scheduled_tokens
        # Running requests the step gave no tokens: stalled (one range per run of steps).
        for r in self.running - scheduled.keys():
            lvr = self.live[r]
            self.set_phase(lvr, step, STALLED)
            stalled = lvr.range_open
            if stalled is not None and stalled.kind == "stalled" and stalled.last_step == step - 1:
                stalled.end_step = step
            else:
                ev = LifecycleEvent(
                    step,
                    "stalled",
                    "running, but no tokens this step (token budget spent by requests ahead)",
                )
                lvr.tl.events.append(ev)
                lvr.decode_open = None
                lvr.range_open = ev
        for r, n in scheduled.items():
            lvr = self.live.get(r)
            if lvr is None:
                continue
            tl = lvr.tl
            num_tokens = tl.num_prompt_tokens + lvr.num_output
            start = lvr.cursor
            lvr.cursor += n
            new_blocks = lvr.allocated.pop(step, [])
            if n == 1 and start == num_tokens - 1 and start >= tl.num_prompt_tokens:
                self._decode(lvr, step, new_blocks)
                continue
            self.close_ranges(lvr)
            phase = RECOMPUTE if lvr.ever_preempted else PREFILL
            self.set_phase(lvr, step, phase)
            label = "recompute" if phase == RECOMPUTE else "prefill"
            part = "" if lvr.cursor >= num_tokens and start == 0 else " chunk"
            blocks = f"; new blocks {_fmt_blocks(new_blocks)}" if new_blocks else ""
            tl.events.append(
                LifecycleEvent(
                    step,
                    label,
                    f"{label}{part}: tokens {start}-{lvr.cursor - 1} ({n} of {num_tokens}){blocks}",
                )
            )

    def _decode(self, lvr: _Live, step: int, new_blocks: list[int]) -> None:
        """One decode token: extends the open decode range or starts one."""
        self.set_phase(lvr, step, DECODE)
        note = f"new block {_fmt_blocks(new_blocks)} at step {step}" if new_blocks else None
        if lvr.decode_open is not None and lvr.decode_open.last_step == step - 1:
            lvr.decode_open.end_step = step
            if note:
                lvr.decode_open.notes.append(note)
        else:
            ev = LifecycleEvent(step, "decode", "decoding")
            if note:
                ev.notes.append(note)
            lvr.tl.events.append(ev)
            self.close_ranges(lvr)
            lvr.decode_open = ev

    def on_sched_update(self, e: SchedUpdate, step: int) -> None:
        for r, tokens in e.new_token_ids.items():
            lvr = self.live.get(r)
            if lvr is None or not tokens:
                continue
            if not lvr.tl.output_tokens:
                text = self.token_texts.get(tokens[0])
                shown = f" {visible_whitespace(text)!r}" if text is not None else f" #{tokens[0]}"
                lvr.tl.events.append(
                    LifecycleEvent(step, "first_token", f"first output token:{shown}")
                )
                lvr.decode_open = None
            lvr.num_output += len(tokens)
            lvr.tl.output_tokens.extend((step, t) for t in tokens)

    def on_sched_finished(self, e: SchedFinished, step: int) -> None:
        lv = self.live.get(e.request_id)
        if lv is None:
            return
        tl = lv.tl
        self.running.discard(e.request_id)
        tl.finished_step = step
        tl.finish_reason = e.finish_reason
        self.set_phase(lv, step, FINISHED)
        self.close_ranges(lv)
        num_output = e.num_output_tokens
        tl.events.append(
            LifecycleEvent(
                step,
                "finished",
                f"finished: {_finish_text(e.status, tl.finish_reason)} after {num_output} "
                f"output token{'s' if num_output != 1 else ''}; its blocks go back to the pool",
            )
        )

    # The engine events a lifecycle is built from.
    HANDLERS: ClassVar[dict[type[TraceEvent], Callable[[_TimelineBuilder, Any, int], None]]] = {
        SchedQueued: on_sched_queued,
        KVCacheHit: on_kv_cache_hit,
        KVAllocated: on_kv_allocated,
        KVAllocationFailed: on_kv_allocation_failed,
        SchedAdmitted: on_sched_admitted,
        SchedPreempted: on_sched_preempted,
        SchedStep: on_sched_step,
        SchedUpdate: on_sched_update,
        SchedFinished: on_sched_finished,
    }

    def _finish(self, last_step: int) -> None:
        """Close every timeline at the end of the trace and word its range lines."""
        for lv in self.live.values():
            tl = lv.tl
            if tl.finished_step is None:
                # Still alive when the trace ends: its phase runs on to the last step.
                self.set_phase(lv, last_step, WAITING)
            else:
                del tl.phases[tl.finished_step - tl.queued_step + 1 :]
            for ev in tl.events:
                n = ev.last_step - ev.step + 1
                if ev.kind == "decode":
                    ev.text = f"decoding: {n} token{'s' if n != 1 else ''}, one per step"
                elif ev.kind in ("stalled", "blocked") and n > 1:
                    ev.text += f" (x{n} steps)"
                if ev.notes:
                    ev.text += "; " + "; ".join(ev.notes)


def _build_timelines(
    replay: TraceReplay, token_texts: dict[int, str] | None = None
) -> dict[str, RequestTimeline]:
    """Walk the scheduler process's events once and build every request's lifecycle."""
    return _TimelineBuilder(replay, token_texts).build()
