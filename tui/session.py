"""One recorded run, opened for the TUI and the headless summary.

vLLM twin: none (vLLM has no trace viewer). Read it for how a viewer turns a
Glassbox trace into what a person wants to see: the replay model
(``engine.tracing.TraceReplay``) gives the engine's state after any step; this
module adds what a viewer needs on top -- the per-request lifecycles
(``timelines.py``: when each request waited, ran prefill chunks, decoded,
stalled, was preempted, finished), token texts, colours, and a cache of step
views so scrubbing back and forth never replays the same step twice.

The TUI reads runs only through ``engine.tracing`` (``load_trace_checked``,
``TraceReplay`` and the typed event classes); everything here is derived from
the events. ``highlights`` names where the run shows what it was built to
teach (a preemption, a prefix hit, a chunked prefill), so a viewer can say
where to look when the followed request shows none of it. Requests are
keyed by their internal ids, as in the trace; ``resolve_request_id`` also
takes the id the user gave.
Sessions: all (the tracer TUI follows one request through every subsystem).
"""

from __future__ import annotations

import json
import os
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from engine.tracing import (
    EVENT_KINDS,
    EngineConfig,
    KVInit,
    ReplayError,
    RunnerCompiled,
    RunnerInit,
    SamplerSampled,
    StepView,
    TraceCli,
    TraceEvent,
    TraceHeader,
    TraceReplay,
    TraceTokenTexts,
    TraceVersionError,
    check_trace_version,
    gc_paused,
    load_trace_checked,
)
from tui.timelines import (
    REQUEST_COLOURS,
    RequestTimeline,
    build_timelines,
)

# ``glassbox trace`` adds two events to the trace it records (through the
# engine's own tracer): ``TraceCli`` (which request holds the user's prompt) and
# ``TraceTokenTexts`` (the text of every token id the run mentions; the
# engine records ids only).


class TraceLoadError(Exception):
    """A trace that cannot be shown; the message says why, in one sentence or two."""


@dataclass(frozen=True)
class Highlight:
    """Where a run shows one thing worth seeing: ``what`` (``HIGHLIGHTS``)
    happens to ``request_id`` at ``step``; ``text`` says it in a few words."""

    what: str
    request_id: str
    step: int
    text: str


# What ``TraceSession.highlights`` looks for, in the order it lists them.
HIGHLIGHTS = ("preemption", "prefix hit", "chunked prefill")


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
    followed_request_id: str | None  # internal id
    trace_level: str  # "full" when sampler stages / runner inputs are present
    # How the model was compiled, e.g. "VLLM_COMPILE: 31 pieces" (None: eager).
    compilation: str | None = None


def _compilation_label(event: RunnerCompiled | None) -> str | None:
    if event is None:
        return None
    if not event.num_pieces:
        return f"{event.mode} ({event.backend})"
    return f"{event.mode}: {event.num_pieces} {event.backend} pieces"


class TraceSession:
    """A trace opened for viewing: replay + lifecycles + token texts + a view cache."""

    def __init__(
        self,
        events: list[TraceEvent],
        path: str | None = None,
        view_cache_size: int = 512,
        snapshot_interval: int | None = None,
        truncated: str | None = None,
    ) -> None:
        self.path = path
        # Why the trace is incomplete (``find_truncation``), or None: shown by
        # the app and the summary, as the last steps and texts may be missing.
        self.truncated = truncated
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
        compiled: RunnerCompiled | None = None
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
            elif isinstance(e, RunnerCompiled):
                compiled = e
            elif isinstance(e, SamplerSampled) and e.stages is not None:
                has_stages = True
            elif isinstance(e, EngineConfig) and config is None:
                config = e
            elif isinstance(e, KVInit) and kv_init is None:
                kv_init = e
        assert kv_init is not None  # TraceReplay refuses a trace without one
        self.timelines: dict[str, RequestTimeline] = build_timelines(self.replay, self.token_texts)
        self.request_ids: list[str] = sorted(self.timelines, key=lambda r: self.timelines[r].index)
        self._highlights: dict[str, Highlight] | None = None
        # Traces before format 1.2 name the followed request by the user's id.
        followed = self.resolve_request_id(cli.follow_request_id) if cli is not None else None
        if followed is None:
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
            compilation=_compilation_label(compiled),
        )

    # -- ids ---------------------------------------------------------------------
    def resolve_request_id(self, request_id: str) -> str | None:
        """The internal id of the request ``request_id`` names: an internal id
        as it is, else the label the request list shows, else the id the user
        gave (the earliest request sent under it; ``n > 1``: its first child).
        None when it names no request of the trace."""
        if request_id in self.timelines:
            return request_id
        for attribute in ("label", "external_req_id"):
            for rid in self.request_ids:
                if getattr(self.timelines[rid], attribute) == request_id:
                    return rid
        return None

    # -- highlights ----------------------------------------------------------------
    def highlights(self) -> dict[str, Highlight]:
        """For each of ``HIGHLIGHTS`` the run shows, where to see it: the first
        preemption, the largest prefix hit, the prompt prefilled in the most
        chunks. Computed once."""
        if self._highlights is None:
            found: dict[str, Highlight] = {}
            preempted = [
                (ev.step, tl.index, rid)
                for rid, tl in self.timelines.items()
                for ev in tl.events
                if ev.kind == "preempted"
            ]
            if preempted:
                step, _, rid = min(preempted)
                found["preemption"] = Highlight(
                    "preemption", rid, step, f"preempted at step {step}"
                )
            hits = [(tl.num_cached_tokens, -tl.index, rid) for rid, tl in self.timelines.items()]
            best = max(hits, default=None)
            if best is not None and best[0] > 0:
                tl = self.timelines[best[2]]
                step = next((e.step for e in tl.events if e.kind == "admitted"), tl.queued_step)
                found["prefix hit"] = Highlight(
                    "prefix hit",
                    tl.request_id,
                    step,
                    f"prefix hit of {tl.num_cached_tokens}/{tl.num_prompt_tokens} prompt tokens "
                    f"at step {step}",
                )
            chunks = [
                ([e.step for e in tl.events if e.kind == "prefill"], -tl.index, rid)
                for rid, tl in self.timelines.items()
            ]
            most = max(chunks, key=lambda c: (len(c[0]), c[1]), default=None)
            if most is not None and len(most[0]) > 1:
                steps = most[0]
                found["chunked prefill"] = Highlight(
                    "chunked prefill",
                    most[2],
                    steps[0],
                    f"prefill in {len(steps)} chunks, steps {steps[0]}-{steps[-1]}",
                )
            self._highlights = found
        return self._highlights

    def highlights_elsewhere(self, request_id: str | None) -> list[Highlight]:
        """The highlights of the run that ``request_id``'s own lifecycle lacks
        (each shown by another request), in ``HIGHLIGHTS`` order."""
        tl = self.timelines.get(request_id) if request_id is not None else None
        if tl is None:
            return []
        has = {
            "preemption": tl.num_preemptions > 0,
            "prefix hit": tl.num_cached_tokens > 0,
            "chunked prefill": sum(e.kind == "prefill" for e in tl.events) > 1,
        }
        found = self.highlights()
        return [found[what] for what in HIGHLIGHTS if what in found and not has[what]]

    def request_label(self, request_id: str) -> str:
        """What the request list calls ``request_id`` (an internal id): the
        user's id where that is unambiguous."""
        tl = self.timelines.get(request_id)
        return tl.label if tl is not None else request_id

    def request_lora(self, request_id: str) -> str:
        """The LoRA adapter ``request_id`` runs with ("" for the base model)."""
        tl = self.timelines.get(request_id)
        return tl.lora_name if tl is not None else ""

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
        events, truncated = load_trace_checked(path)
    except TraceVersionError as e:
        raise TraceLoadError(str(e)) from None
    except ValueError as e:
        raise TraceLoadError(_describe_bad_line(path, e)) from None
    except (OSError, UnicodeDecodeError) as e:
        raise TraceLoadError(f"cannot read {path}: {e}") from None
    return session_from_events(events, path=path, truncated=truncated, **kwargs)


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
        truncated = kwargs.get("truncated")
        if truncated:
            raise TraceLoadError(f"{truncated}; what is left cannot be replayed: {e}") from None
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
