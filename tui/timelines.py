"""Per-request lifecycles built from a trace: the TUI's timelines and lifecycle panel.

vLLM twin: none (vLLM has no trace viewer). Read it for how the scheduler
process's events, in the engine's own order, become what a person follows:
one phase per step (waiting, prefill or recompute chunk, decode, stalled,
preempted, finished) and one line per thing that happened to the request.
``build_timelines`` walks the events once; each event type it reads has its
own handler (``_TimelineBuilder.HANDLERS``). ``session.py`` opens a trace and
calls it.

Async scheduling (the engine's default): step n+1 is scheduled before step
n's tokens are read, so step n's ``sched.update`` and finishes arrive after
step n+1's ``sched.step``. The builder keeps each request's placeholders
(tokens coming from steps in flight, as ``AsyncScheduler`` counts them) so a
decode reads as a decode, lists the lines in step order, and ends a request
at the step that finished it: a step already scheduled past its end only
gets a note (its token is dropped).

Speculative decoding: a decode step may verify drafts too (``sched.step``'s
``scheduled_spec_decode_tokens``): it still reads as a decode, the cursor
steps back over the rejected drafts (``spec.verified``), and a decode line
counts its drafts and the accepted ones.

Structured outputs: a constrained request waits for its grammar to compile
(``so.compile_started``, before its ``sched.queued``, to ``so.ready``) in
the scheduler's ``skipped_waiting`` queue: its own phase (``GRAMMAR``) and
one lifecycle line over those steps, noting the compile (``so.compiled``:
its time, a cache hit) and the step that found it ready.

Ids: the engine knows a request by its internal id (the user's id, ``-``
and 8 random hex digits, as vLLM's), and so do the timelines; each
timeline also keeps the id the user gave (``request.added``'s
``external_req_id``) and a short ``label`` for the request list.
Sessions: all.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar

from engine.tracing import (
    GrammarCompiled,
    GrammarCompileStarted,
    GrammarReady,
    KVAllocated,
    KVAllocationFailed,
    KVCacheHit,
    RequestAdded,
    RequestOutputEvent,
    SamplingParamsSummary,
    SchedAdmitted,
    SchedFinished,
    SchedPreempted,
    SchedQueued,
    SchedStep,
    SchedUpdate,
    SpecVerified,
    TraceEvent,
    TraceReplay,
)

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


def visible_whitespace(text: str) -> str:
    return text.replace("\n", "↵").replace("\t", "⇥")


# Phase of a request in one step (one character per step on the timeline).
NOT_ARRIVED = " "
WAITING = "w"
GRAMMAR = "g"  # queued, waiting for its grammar to compile (structured outputs)
PREFILL = "p"
RECOMPUTE = "r"
DECODE = "d"
STALLED = "s"  # running, but the step gave it no tokens
PREEMPTED = "x"
FINISHED = "f"
PHASE_NAMES = {
    NOT_ARRIVED: "not arrived",
    WAITING: "waiting",
    GRAMMAR: "waiting for grammar",
    PREFILL: "prefill chunk",
    RECOMPUTE: "recompute chunk",
    DECODE: "decode",
    STALLED: "running, not scheduled",
    PREEMPTED: "preempted",
    FINISHED: "finished",
}


@dataclass
class LifecycleEvent:
    """One line of a request's lifecycle: something that happened at a step
    (or over a run of steps, for decoding)."""

    step: int
    kind: str  # queued, grammar, admitted, resumed, prefill, recompute, first_token,
    #            decode, stalled, blocked, preempted, finished
    text: str
    end_step: int | None = None  # last step of a range (decode/stalled/blocked runs)
    notes: list[str] = field(default_factory=list)
    # A decode range with speculative decoding: drafts verified, and accepted.
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0

    @property
    def last_step(self) -> int:
        return self.step if self.end_step is None else self.end_step

    def covers(self, step: int) -> bool:
        return self.step <= step <= self.last_step


@dataclass
class RequestTimeline:
    """Everything one request went through, indexed by step."""

    request_id: str  # the internal id: what every event of the engine names it by
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
    # Prefix-cache hit of its last admission before its first output token.
    num_cached_tokens: int = 0
    # The id the user gave (a child of ``n > 1``: its parent's); None in
    # traces before format 1.2 and for a request without ``request.added``.
    external_req_id: str | None = None
    # What the request list calls it: the user's id (a child: "<index>_<id>")
    # when that names no other request of the trace, else ``request_id``.
    label: str = ""
    # Its LoRA adapter's name; "" for the base model (and traces before 1.9).
    lora_name: str = ""

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
    # Async scheduling: tokens coming from steps in flight, frames to drop
    # after a reset_prefix_cache preemption, the last step that scheduled it.
    placeholders: int = 0
    discard: int = 0
    last_scheduled_step: int | None = None
    # Structured outputs: the line of its wait for the grammar, open until so.ready.
    grammar_open: LifecycleEvent | None = None


def _fmt_blocks(ids: list[int]) -> str:
    return " ".join(str(b) for b in ids)


def _finish_text(status: str, reason: str | None) -> str:
    if status == "FINISHED_ABORTED" or reason == "abort":
        return "aborted"
    if status == "FINISHED_LENGTH_CAPPED" or reason == "length":
        return "length (max_tokens or max_model_len reached)"
    if reason == "stop":
        return "stop (EOS, stop token or stop string)"
    if reason == "repetition":
        return "repetition (the output ended in a repeated pattern)"
    return f"{status.lower()} ({reason})"


# When two things happen to a request in one step, the timeline shows the weightier.
_PHASE_PRIORITY = {
    WAITING: 0,
    GRAMMAR: 0,
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
        # Placeholders exist where the engine ran AsyncScheduler (as the replay counts them).
        self.async_scheduling = replay.config is not None and replay.config.async_scheduling
        # Async: step in flight -> the requests it samples a token for.
        self.sampling: dict[int, list[str]] = {}
        # Structured outputs: grammar kind and compile of requests not queued yet.
        self.grammar_pending: dict[str, tuple[str, GrammarCompiled | None]] = {}

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
        self._label()
        return self.timelines

    # -- helpers -----------------------------------------------------------------
    def set_phase(self, lv: _Live, step: int, phase: str) -> None:
        phases = lv.tl.phases
        i = step - lv.tl.queued_step
        while len(phases) <= i:
            # A step with no news for the request continues its last phase.
            prev = phases[-1] if phases else WAITING
            if prev == GRAMMAR:
                phases.append(GRAMMAR)
            else:
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
            external_req_id=(a.external_req_id or None) if a is not None else None,
            label=rid,
            lora_name=a.lora_name if a is not None else "",
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
        grammar = self.grammar_pending.pop(rid, None)
        if grammar is not None:
            kind, compiled = grammar
            self.set_phase(lv, step, GRAMMAR)
            ev = LifecycleEvent(
                step,
                "grammar",
                f"waiting for its {kind} grammar to compile (on a thread; queued in "
                "skipped_waiting)",
            )
            tl.events.append(ev)
            lv.grammar_open = ev
            if compiled is not None:
                self.on_grammar_compiled(compiled, step)

    def on_grammar_compile_started(self, e: GrammarCompileStarted, step: int) -> None:
        """Before the request's ``sched.queued`` (the engine core starts the
        compile, then queues the request)."""
        self.grammar_pending[e.request_id] = (e.grammar_kind, None)

    def on_grammar_compiled(self, e: GrammarCompiled, step: int) -> None:
        lv = self.live.get(e.request_id)
        if lv is None:
            pending = self.grammar_pending.get(e.request_id)
            if pending is not None:  # a cache hit can beat the request's sched.queued
                self.grammar_pending[e.request_id] = (pending[0], e)
            return
        if e.error:
            note = f"the compile failed at step {step}: {e.error}"
        else:
            hit = "a cache hit" if e.cache_hit else "not cached"
            note = f"compiled in {e.compile_s * 1e3:.1f} ms ({hit}) at step {step}"
        target = lv.grammar_open
        if target is None:
            target = next((ev for ev in reversed(lv.tl.events) if ev.kind == "grammar"), None)
        if target is not None:
            target.notes.append(note)

    def on_grammar_ready(self, e: GrammarReady, step: int) -> None:
        """``schedule()`` found the grammar compiled: the wait ends before this step."""
        lv = self.live.get(e.request_id)
        if lv is None:
            return
        ev = lv.grammar_open
        lv.grammar_open = None
        if ev is not None:
            if step - 1 > ev.step:
                ev.end_step = step - 1
            ev.notes.append(f"ready at step {step}: WAITING again, first in line")
        self.set_phase(lv, step, WAITING)

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
        if lv.num_output == 0:  # as the engine's PrefillStats: kept once a token is out
            tl.num_cached_tokens = lv.cursor
        text = f"resumed: recompute from token {lv.cursor}" if resumed else "admitted"
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
        if not e.for_request_id:  # a reset: the frames in flight will be dropped
            lv.discard, lv.placeholders = lv.placeholders, 0
        self.set_phase(lv, step, PREEMPTED)
        self.close_ranges(lv)
        # No for_request_id: reset_prefix_cache(reset_running_requests=True) preempted it.
        why = (
            f"to make room for {e.for_request_id}" if e.for_request_id else "by reset_prefix_cache"
        )
        tl.events.append(
            LifecycleEvent(
                step,
                "preempted",
                f"preempted {why}: blocks freed, "
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
        sampling = []
        spec_tokens = e.scheduled_spec_decode_tokens
        for r, n in scheduled.items():
            lvr = self.live.get(r)
            if lvr is None:
                continue
            tl = lvr.tl
            # Tokens known or coming (placeholders are counted, as the scheduler does).
            num_tokens = tl.num_prompt_tokens + lvr.num_output + lvr.placeholders
            start = lvr.cursor
            lvr.cursor += n
            lvr.last_scheduled_step = step
            # A decode: the last known token, and any drafts after it.
            num_drafts = len(spec_tokens.get(r, ())) if spec_tokens else 0
            if self.async_scheduling and lvr.cursor >= num_tokens:
                # This step samples a token for it, plus one per draft if all hold.
                lvr.placeholders += 1 + num_drafts
                sampling.append(r)
            new_blocks = lvr.allocated.pop(step, [])
            if n == 1 + num_drafts and start == num_tokens - 1 and start >= tl.num_prompt_tokens:
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
        if sampling:
            self.sampling[step] = sampling

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

    def on_spec_verified(self, e: SpecVerified, step: int) -> None:
        """The drafts' verdict: the cursor steps back over the rejected ones
        (the placeholders too, as the scheduler does); the decode line counts them."""
        lv = self.live.get(e.request_id)
        if lv is None:
            return
        if lv.cursor > 0:
            lv.cursor -= e.num_rejected
        if lv.placeholders > 0:
            lv.placeholders -= e.num_rejected
        decode = lv.decode_open
        if decode is not None and decode.covers(step):
            decode.num_draft_tokens += len(e.draft_token_ids)
            decode.num_accepted_tokens += e.num_accepted

    def on_sched_update(self, e: SchedUpdate, step: int) -> None:
        # Each token appended retires a placeholder; a frame from before a
        # reset is dropped instead (the engine's async_tokens_to_discard).
        for r in self.sampling.pop(step, ()):
            lvr = self.live.get(r)
            if lvr is None or lvr.tl.finished_step is not None:
                continue
            if lvr.discard:
                lvr.discard -= 1
            else:
                lvr.placeholders = max(0, lvr.placeholders - len(e.new_token_ids.get(r, ())))
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
                # Decoding starts after the first token (with async scheduling
                # a decode of a later step may already be open: it stays).
                if lvr.decode_open is not None and lvr.decode_open.step <= step:
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
        if lv.grammar_open is not None:  # aborted while waiting for its grammar
            if step > lv.grammar_open.step:
                lv.grammar_open.end_step = step
            lv.grammar_open = None
        tl.finish_reason = e.finish_reason
        self.set_phase(lv, step, FINISHED)
        self.close_ranges(lv)
        num_output = e.num_output_tokens
        text = (
            f"finished: {_finish_text(e.status, tl.finish_reason)} after {num_output} "
            f"output token{'s' if num_output != 1 else ''}; its blocks go back to the pool"
        )
        if lv.last_scheduled_step is not None and lv.last_scheduled_step > step:
            # Async scheduling: the next step was scheduled before this one's tokens were read.
            text += (
                f" (step {lv.last_scheduled_step}, scheduled before this was known, "
                "computes a token that is dropped)"
            )
        tl.events.append(LifecycleEvent(step, "finished", text))

    # The engine events a lifecycle is built from.
    HANDLERS: ClassVar[dict[type[TraceEvent], Callable[[_TimelineBuilder, Any, int], None]]] = {
        SchedQueued: on_sched_queued,
        GrammarCompileStarted: on_grammar_compile_started,
        GrammarCompiled: on_grammar_compiled,
        GrammarReady: on_grammar_ready,
        KVCacheHit: on_kv_cache_hit,
        KVAllocated: on_kv_allocated,
        KVAllocationFailed: on_kv_allocation_failed,
        SchedAdmitted: on_sched_admitted,
        SchedPreempted: on_sched_preempted,
        SchedStep: on_sched_step,
        SchedUpdate: on_sched_update,
        SpecVerified: on_spec_verified,
        SchedFinished: on_sched_finished,
    }

    def _label(self) -> None:
        """Each request's ``label``: the user's id where it names this request
        alone (two requests sent under one id keep their internal ids)."""
        wanted: dict[str, str] = {}
        for rid, tl in self.timelines.items():
            a = self.added.get(rid)
            if tl.external_req_id is None or a is None:
                wanted[rid] = rid
            elif a.parent_request_id is not None:
                wanted[rid] = f"{a.index}_{tl.external_req_id}"
            else:
                wanted[rid] = tl.external_req_id
        uses = Counter(wanted.values())
        for rid, tl in self.timelines.items():
            label = wanted[rid]
            unique = uses[label] == 1 and (label == rid or label not in self.timelines)
            tl.label = label if unique else rid

    def _finish(self, last_step: int) -> None:
        """Close every timeline at the end of the trace and word its range lines."""
        for lv in self.live.values():
            tl = lv.tl
            if tl.finished_step is None:
                # Still alive when the trace ends: its phase runs on to the last step.
                self.set_phase(lv, last_step, GRAMMAR if lv.grammar_open else WAITING)
                if lv.grammar_open is not None and last_step > lv.grammar_open.step:
                    lv.grammar_open.end_step = last_step
            else:
                end = tl.finished_step
                del tl.phases[end - tl.queued_step + 1 :]
                # Async scheduling: a step scheduled past the finish (its
                # token dropped) is no part of the request's life.
                kept = []
                for ev in tl.events:
                    if ev.step <= end:
                        if ev.end_step is not None and ev.end_step > end:
                            ev.end_step = end if end > ev.step else None
                        kept.append(ev)
                tl.events = kept
            # In step order: an async step's update comes after the next schedule.
            tl.events.sort(key=lambda ev: ev.step)
            for ev in tl.events:
                n = ev.last_step - ev.step + 1
                if ev.kind == "decode" and ev.num_draft_tokens:
                    tokens = sum(ev.covers(s) for s, _ in tl.output_tokens)
                    ev.text = (
                        f"decoding: {tokens} tokens in {n} step{'s' if n != 1 else ''}, "
                        f"{ev.num_accepted_tokens} of {ev.num_draft_tokens} drafts accepted"
                    )
                elif ev.kind == "decode":
                    ev.text = f"decoding: {n} token{'s' if n != 1 else ''}, one per step"
                elif ev.kind in ("stalled", "blocked") and n > 1:
                    ev.text += f" (x{n} steps)"
                if ev.notes:
                    ev.text += "; " + "; ".join(ev.notes)


def build_timelines(
    replay: TraceReplay, token_texts: dict[int, str] | None = None
) -> dict[str, RequestTimeline]:
    """Walk the scheduler process's events once and build every request's lifecycle."""
    return _TimelineBuilder(replay, token_texts).build()
