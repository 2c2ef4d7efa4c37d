"""The replay model: the engine's scheduler and KV-cache state at any step of a trace.

vLLM twin: none (vLLM has no event trace to replay). ``TraceReplay`` feeds
the scheduler process's events to an ``EngineState`` (``replay_state.py``:
what each event changes) and adds random access and per-step views, so a
learner (or the TUI, or a notebook) can stop at any step and look at the
queues, every request and block, the batch the model runner built and what
the sampler chose.

Read it for: how a step of the trace is found and shown (``view``).
Sessions: all (the TUI and notebooks are built on it).

"State at step n" is the engine as of just before step n+1's ``schedule()``:
step n has been scheduled, and requests added or aborted after it are
included (the tracer stamps those events with step n). Step 0 is the engine
before its first step. Building a ``TraceReplay`` replays the whole trace
once, so a trace the model contradicts raises ``ReplayError`` right away.

The engine process's events are applied in the order it wrote them (``seq``),
not grouped by their ``step``. Without async scheduling the two are the
same: each step is scheduled, run and updated before the next begins. With
async scheduling (the default) step n+1 is scheduled and launched before
step n's output is read, so step n's ``sched.update`` (and its
``runner.forward`` / ``sampler.sampled``, its finishes and frees) come after
step n+1's ``sched.step``, still stamped n. The state at step n is then the
engine with step n in flight: step n-1's tokens applied, step n's on their
way -- each request it samples for holds a placeholder
(``ReplayRequest.num_output_placeholders``), as in the engine's
``AsyncScheduler``. ``StepView`` says when each step was scheduled,
launched, consumed and updated (``StepPhases``) and which steps were in
flight together; traces before 1.4 have no launch / consume events, and the
replay takes ``sched.step`` and ``sched.update`` for them.

Random access: it keeps a copy of the state every ``snapshot_interval``
steps and replays forward from the nearest one, so any step of a run of
thousands is a copy plus at most ``snapshot_interval - 1`` steps of events
away. Copies share the requests copy-on-write (``replay_state.py``), so a
snapshot costs the per-block arrays and the queues, not every request the
run ever had. Step views (``view``) are built on demand.

Speculative decoding: a step verifies the drafts proposed after the step
before it (``spec.proposed``, written by the runner), scheduled after each
request's known tokens (``sched.step``'s ``scheduled_spec_decode_tokens``,
counted in ``num_scheduled_tokens``); ``spec.verified`` says how many the
target accepted and which token it added, and the cursor steps back over
the rejected ones. ``StepView.spec`` (a ``SpecDecodeStep``) keeps, per
request, the drafts and their fate (``SpecDecodeRow``) and the drafts
proposed for the next step.

Structured outputs: a constrained request waits for its grammar to compile
(``so.compile_started`` .. ``so.ready``) in the scheduler's second queue,
``skipped_waiting`` (``EngineState.skipped_waiting``; FCFS serves it first).
Once running, each step that samples for it builds a bitmask row of the
tokens its grammar allows (``so.bitmask``), the runner masks the logits
with it (``so.masked``, level ``full``: which of the best raw candidates it
removed) and the matcher accepts the sampled token (``so.advanced``).
``StepView.structured_output`` (a ``StructuredOutputStep``) keeps, per
constrained request (``StructuredOutputRow``), whether it waits for its
grammar, the compile, and the step's mask and its effect
(``GrammarMaskEffect``).

Tensor parallelism: the worker processes' calls (``worker.rpc_received`` /
``worker.rpc_done``) give ``StepView.ranks``, one ``RankStep`` per rank
(``replay_ranks.py``): when it took the step off the broadcast ring, its
forward and sampling time, its all-reduces and all-gathers. Only rank 0
records the runner's events; its ``runner.forward`` gives the phases' forward.

Ids: the engine's events name a request by its internal id (the id it was
sent under, ``-`` and 8 random hex digits, as vLLM's ``assign_request_id``
makes it); ``external_req_ids`` finds the internal ids of a user's id.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from functools import cached_property

from engine.tracing.events import (
    EngineConfig,
    EngineOutputReady,
    EngineStepLaunched,
    GrammarAdvanced,
    GrammarBitmask,
    GrammarCompileStarted,
    GrammarMasked,
    GrammarRolledBack,
    KVInit,
    RequestAdded,
    RunnerBatch,
    RunnerForward,
    SamplerSampled,
    SchedStep,
    SchedUpdate,
    SpecProposed,
    SpecVerified,
    TraceEvent,
)
from engine.tracing.reader import gc_paused, load_trace
from engine.tracing.replay_ranks import RankStep, rank_steps, rpc_calls
from engine.tracing.replay_state import (
    PREEMPTED,
    RUNNING,
    STATE_KINDS,
    STATE_TYPES,
    WAITING,
    WAITING_FOR_GRAMMAR,
    EngineState,
    ReplayBlock,
    ReplayError,
    ReplayRequest,
)


@dataclass
class BatchSlot:
    """One row of the batch the model ran in a step."""

    request_id: str
    query_len: int  # tokens computed this step
    num_computed_tokens: int  # context before this step: positions start here
    seq_len: int  # context after this step
    # Runs of KV slots written this step: [block id, first offset, count].
    slot_mapping: list[list[int]]
    sampled: bool  # False: a prefill chunk whose sample is thrown away


@dataclass
class StepPhases:
    """When one step went through the engine loop (wall-clock ns, the
    engine process's clock; None where the trace has no event for it).

    scheduled: ``schedule()`` ran from ``schedule_start_ts`` to ``scheduled_ts``
    (``sched.step``); launched: the forward (and sampling) queued on the
    device (``engine.step_launched``, format 1.4); consumed: its sampled
    tokens reached the host after the host waited ``wait_ns`` for them
    (``engine.output_ready``, 1.4); updated: ``update_from_output()`` ran
    from ``update_start_ts`` to ``updated_ts`` (``sched.update``). The step is
    in flight from launch to consumption (``in_flight_span``)."""

    step: int
    schedule_start_ts: int | None = None
    scheduled_ts: int | None = None
    launched_ts: int | None = None
    # Steps in flight right after the launch, this one included (1 or 2).
    num_in_flight: int | None = None
    forward_start_ts: int | None = None
    forward_ns: int | None = None
    output_ready_ts: int | None = None
    wait_ns: int | None = None
    update_start_ts: int | None = None
    updated_ts: int | None = None

    @property
    def in_flight_span(self) -> tuple[int, int] | None:
        """(start, end) ns of the time the step was in flight: launch to
        consumption; before format 1.4, the end of ``schedule()`` to the
        start of ``update_from_output()``. None when either end is missing."""
        start = self.launched_ts if self.launched_ts is not None else self.scheduled_ts
        end = self.output_ready_ts if self.output_ready_ts is not None else self.update_start_ts
        if start is None or end is None:
            return None
        return start, max(start, end)


@dataclass(frozen=True)
class SpecDecodeRow:
    """One request's drafts in one step and their fate (``spec.verified``).
    Greedy example, drafts ``[a, b, c]``: the target agrees with ``a`` and
    ``b``, not ``c``, and picks ``d`` there: ``num_accepted`` 2,
    ``token_ids`` ``[a, b, d]``, ``d`` the recovered token, 1 rejected. Had
    it agreed with all three, ``token_ids`` would end in a bonus token (the
    target's pick after ``c``)."""

    request_id: str
    draft_token_ids: list[int]  # the drafts verified, in order
    num_accepted: int  # leading drafts the target agreed with
    token_ids: list[int]  # what the step produced: the accepted drafts + one of the target's
    num_rejected: int
    num_computed_tokens: int  # the cursor after the rollback
    # What the request kept (``sched.update``): ``token_ids``, or fewer when a
    # stop or ``max_tokens`` ended it within them.
    new_token_ids: list[int]

    @property
    def accepted_token_ids(self) -> list[int]:
        return self.draft_token_ids[: self.num_accepted]

    @property
    def rejected_token_ids(self) -> list[int]:
        return self.draft_token_ids[self.num_accepted :]

    @property
    def all_accepted(self) -> bool:
        return self.num_rejected == 0

    @property
    def bonus_token_id(self) -> int | None:
        """Every draft accepted: the target's token after the last one."""
        return self.token_ids[-1] if self.all_accepted and self.token_ids else None

    @property
    def recovered_token_id(self) -> int | None:
        """A draft rejected: the target's token in place of the first rejected one."""
        return self.token_ids[-1] if not self.all_accepted and self.token_ids else None

    @property
    def num_computed_tokens_scheduled(self) -> int:
        """The cursor ``schedule()`` left, the drafts counted (before the rollback)."""
        return self.num_computed_tokens + self.num_rejected


@dataclass
class SpecDecodeStep:
    """Speculative decoding in one step: the verdict on each request's drafts
    (in the order the scheduler wrote them) and the drafts the proposer made
    after the step, for the next one to verify (cut short or dropped there
    when the budget or the request's end says so)."""

    verified: dict[str, SpecDecodeRow] = field(default_factory=dict)
    proposed: dict[str, list[int]] = field(default_factory=dict)
    method: str | None = None  # the proposer's (``spec.proposed``), None when it proposed none

    @property
    def num_draft_tokens(self) -> int:
        return sum(len(r.draft_token_ids) for r in self.verified.values())

    @property
    def num_accepted_tokens(self) -> int:
        return sum(r.num_accepted for r in self.verified.values())


@dataclass(frozen=True)
class GrammarMaskEffect:
    """Trace level ``full`` (``so.masked``): what the grammar's bitmask did to
    a request's row of logits before the sampler saw it. The sampler's
    stages (``SamplerSampled.stages``) start from the masked row, so its
    ``raw`` candidates are the allowed ones; these are the model's own."""

    num_allowed: int  # tokens left with a finite logit
    # Of the 5 highest raw logits, the tokens the mask removed (best first).
    masked_top_token_ids: list[int]
    top_token_id_before: int  # the model's argmax
    top_token_id_after: int  # the argmax among the allowed tokens

    @property
    def changed_top(self) -> bool:
        """The model's favourite token was not allowed."""
        return self.top_token_id_before != self.top_token_id_after


@dataclass(frozen=True)
class StructuredOutputRow:
    """One constrained request at one step: its grammar, whether it still
    waits for it (``WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR``, in
    ``skipped_waiting``), and what the step's mask did. The compile's
    fields are None until the compile thread finished (as of this step)."""

    request_id: str
    grammar_kind: str  # JSON, JSON_OBJECT, REGEX, GRAMMAR or CHOICE
    waiting_for_grammar: bool  # after this step, still blocked on the compile
    compile_s: float | None  # seconds in the compiler (so.compiled)
    cache_hit: bool | None  # xgrammar's cache already held the compiled grammar
    compile_error: str  # why the compile failed ("" when it did not)
    compiled_step: int | None  # the step the engine was in when the compile finished
    ready_step: int | None  # the step whose schedule() found the grammar compiled
    # This step's bitmask (``so.bitmask``): rows (1 + drafts; 0: the step
    # masked nothing for it) and the tokens the first row allows, of ``vocab_size``.
    num_rows: int = 0
    num_allowed: int | None = None
    vocab_size: int | None = None
    # Level ``full``: the mask's effect on the row the sampler draws from.
    mask: GrammarMaskEffect | None = None
    # What the matcher accepted after the step (``so.advanced``): the
    # request's new tokens, all it has accepted so far, and whether the
    # grammar is now complete.
    accepted_token_ids: list[int] = field(default_factory=list)
    num_processed_tokens: int | None = None
    terminated: bool = False
    # Speculative decoding: drafts the matcher stepped over and back while
    # the rows were filled (``so.rollback``).
    num_rolled_back: int = 0

    @property
    def masked(self) -> bool:
        """The step sampled for it under a bitmask."""
        return self.num_allowed is not None

    @property
    def allowed_fraction(self) -> float | None:
        """``num_allowed`` over the vocabulary (None without both)."""
        if self.num_allowed is None or not self.vocab_size:
            return None
        return self.num_allowed / self.vocab_size


@dataclass
class StructuredOutputStep:
    """Structured outputs in one step: every constrained request alive in it
    (queued and not finished before it), in the order the state holds them."""

    requests: dict[str, StructuredOutputRow] = field(default_factory=dict)

    @property
    def waiting_for_grammar(self) -> list[str]:
        """Requests still waiting for their grammar after the step."""
        return [r for r, row in self.requests.items() if row.waiting_for_grammar]

    @property
    def masked(self) -> list[str]:
        """Requests the step sampled for under a bitmask."""
        return [r for r, row in self.requests.items() if row.masked]


@dataclass
class StepView:
    """Everything the trace says about one step, with the state after it."""

    step: int
    state: EngineState
    # The scheduler's decision (the ``sched.step`` event), None for step 0.
    sched_step: SchedStep | None
    # Rows of the batch, from ``runner.batch`` when the runner traced it,
    # otherwise derived from the scheduler's decision and the block tables.
    batch: list[BatchSlot]
    batch_source: str  # "runner", "scheduler" or "none"
    runner_batch: RunnerBatch | None
    # One ``sampler.sampled`` event per kept sample (empty when no real sampler ran).
    sampler: list[SamplerSampled]
    # Tokens each request received this step (from ``sched.update``).
    new_token_ids: dict[str, list[int]]
    events: list[TraceEvent]
    # When the step was scheduled, launched, consumed and updated (None for step 0).
    phases: StepPhases | None = None
    # Steps in flight right after this one was launched, oldest first, this
    # one included: [n-1, n] when step n was scheduled before step n-1's
    # tokens were read (async scheduling), [n] otherwise; [] for step 0.
    in_flight: list[int] = field(default_factory=list)
    # Async scheduling, per request scheduled this step: its placeholders at
    # the end of schedule() (tokens the steps in flight, this one included,
    # will sample for it), and how many of the tokens it computes this step
    # are placeholders themselves (the previous step's samples, whose ids the
    # runner takes on the device). Requests with none are left out.
    num_output_placeholders: dict[str, int] = field(default_factory=dict)
    num_placeholder_inputs: dict[str, int] = field(default_factory=dict)
    # Speculative decoding: the drafts verified this step and proposed after
    # it; None when the step has neither (always, without speculation).
    spec: SpecDecodeStep | None = None
    # Structured outputs: the constrained requests alive in this step, their
    # grammars and masks; None when there is none (always, without them).
    structured_output: StructuredOutputStep | None = None
    # Tensor parallelism: each rank's share of the step, by rank ([] with one rank).
    ranks: list[RankStep] = field(default_factory=list)

    @property
    def waiting(self) -> list[str]:
        return self.state.waiting

    @property
    def running(self) -> list[str]:
        return self.state.running


class TraceReplay:
    """Random access to the engine's state at every step of a trace.

    ``TraceReplay(events_or_path)``; ``replay.steps`` is ``range(0, last + 1)``;
    ``replay.state_at(n)`` returns an ``EngineState`` (a copy; see ``state_at``);
    ``replay.view(n)`` adds the step's decision, batch layout and sampler view.
    """

    def __init__(self, trace: str | Iterable[TraceEvent], snapshot_interval: int = 32) -> None:
        if not isinstance(snapshot_interval, int) or snapshot_interval < 1:
            raise ValueError(f"snapshot_interval must be an int >= 1, got {snapshot_interval!r}")
        events = load_trace(trace) if isinstance(trace, str) else list(trace)
        self.events = events
        self.snapshot_interval = snapshot_interval
        init = [e for e in events if type(e) is KVInit]
        if not init:
            raise ReplayError("the trace has no kv.init event (was trace_level 'off'?)")
        if len(init) > 1:
            raise ReplayError("the trace holds more than one engine (several kv.init events)")
        self.engine_pid = engine_pid = init[0].pid
        with gc_paused():
            # The engine process's events in its own order: seq, not wall time.
            core = [e for e in events if e.pid == engine_pid]
            core.sort(key=_seq)
            self.core_events = core
            self._index(events, core)
            self._replay_all()

    def _index(self, events: list[TraceEvent], core: list[TraceEvent]) -> None:
        """Group the events by step: the state events, and every event (views).

        A state event is applied with the newest step scheduled when it was
        written: with async scheduling step n's update comes after step n+1's
        schedule (still stamped n) and belongs to the state at step n+1, the
        order the engine applied it in."""
        state_events: dict[int, list[TraceEvent]] = {}
        starts: list[tuple[int, int]] = []  # (ts, step) where each step's events begin
        newest = -1
        for e in core:
            if type(e) in STATE_TYPES:
                step = e.step or 0
                if step > newest:
                    newest = step
                    starts.append((e.ts, step))
                group = state_events.get(newest)
                if group is None:
                    group = state_events[newest] = []
                group.append(e)
        self._state_events = state_events
        self._step_starts = starts
        self.last_step = max(state_events, default=0)
        self._index_phases(core)
        # Every event of a step, any process (for views and exports).
        all_events: dict[int, list[TraceEvent]] = {}
        step_of = self.step_of
        phases = self.step_phases
        for e in events:
            step = e.step
            if step is None:
                step = step_of(e)
            elif e.tp_rank == 0 and type(e) is RunnerForward and step in phases:
                _set_forward(phases[step], e)  # the runner of a TP run: rank 0's process
            group = all_events.get(step)
            if group is None:
                group = all_events[step] = []
            group.append(e)
        self._all_events = all_events

    def _index_phases(self, core: list[TraceEvent]) -> None:
        """Each step's ``StepPhases``, and the steps in flight after each
        launch (from the engine's own order: launch and consumption events,
        or ``sched.step`` and ``sched.update`` in traces before 1.4)."""
        phases: dict[int, StepPhases] = {}
        launched = any(type(e) is EngineStepLaunched for e in core)
        start_type, end_type = (
            (EngineStepLaunched, EngineOutputReady) if launched else (SchedStep, SchedUpdate)
        )
        in_flight: list[int] = []
        in_flight_after_launch: dict[int, list[int]] = {}
        self.config: EngineConfig | None = None
        for e in core:
            t = type(e)
            if t is EngineConfig and self.config is None:
                self.config = e
                continue
            step = e.step
            if step is None or t not in _PHASE_TYPES:
                continue
            p = phases.get(step)
            if p is None:
                p = phases[step] = StepPhases(step)
            if t is SchedStep:
                p.scheduled_ts = e.ts
                p.schedule_start_ts = e.ts - e.duration_ns
            elif t is EngineStepLaunched:
                p.launched_ts = e.ts
                p.num_in_flight = e.num_in_flight
            elif t is RunnerForward:
                _set_forward(p, e)
            elif t is EngineOutputReady:
                p.output_ready_ts = e.ts
                p.wait_ns = e.wait_ns
            elif t is SchedUpdate:
                p.updated_ts = e.ts
                p.update_start_ts = e.ts - e.duration_ns
            if t is start_type:
                in_flight.append(step)
                in_flight_after_launch[step] = list(in_flight)
            elif t is end_type and step in in_flight:
                in_flight.remove(step)
        self.step_phases: dict[int, StepPhases] = phases
        self._in_flight_after_launch = in_flight_after_launch

    @property
    def async_scheduling(self) -> bool:
        """The run scheduled asynchronously: its ``engine.config`` says so
        (format 1.4), or a step was launched while another was in flight."""
        if self.config is not None and self.config.async_scheduling:
            return True
        return bool(self.overlapped_steps)

    @cached_property
    def overlapped_steps(self) -> list[int]:
        """Steps launched while an earlier step was still in flight (its
        tokens not yet read): every step but the first of a run with async
        scheduling, none without."""
        return [s for s, steps in sorted(self._in_flight_after_launch.items()) if len(steps) > 1]

    @cached_property
    def speculative(self) -> bool:
        """The run decoded speculatively: it holds ``spec.proposed`` or
        ``spec.verified`` events (format 1.5)."""
        return any(type(e) in (SpecProposed, SpecVerified) for e in self.core_events)

    @cached_property
    def spec_method(self) -> str | None:
        """The proposer's method as ``spec.proposed`` names it (e.g.
        ``ngram``); None when no event names one."""
        return next(
            (e.method for e in self.core_events if type(e) is SpecProposed and e.method), None
        )

    @cached_property
    def structured_outputs(self) -> bool:
        """The run had constrained requests: it holds ``so.compile_started``
        events (format 1.7)."""
        return any(type(e) is GrammarCompileStarted for e in self.core_events)

    @property
    def max_in_flight(self) -> int:
        """The most steps that were in flight at once (0: no step ran)."""
        return max((len(steps) for steps in self._in_flight_after_launch.values()), default=0)

    def in_flight_after_launch(self, step: int) -> list[int]:
        """The steps in flight right after ``step`` was launched, oldest first,
        ``step`` included ([] for a step that was never launched)."""
        return list(self._in_flight_after_launch.get(step, ()))

    @cached_property
    def _rank_steps(self) -> dict[int, list[RankStep]]:
        launched = {s: p.launched_ts for s, p in self.step_phases.items() if p.launched_ts}
        return rank_steps(rpc_calls(self.events), launched)

    @cached_property
    def tp_ranks(self) -> list[int]:
        """The tensor-parallel ranks whose worker processes wrote events ([]: one rank)."""
        return sorted({e.tp_rank for e in self.events if e.tp_rank is not None})

    def ranks_at(self, step: int) -> list[RankStep]:
        """Each tensor-parallel rank's share of ``step``, by rank ([] with one
        rank, or for a step no rank ran)."""
        self._check_step(step)
        return list(self._rank_steps.get(step, ()))

    def in_flight_at(self, ts: int) -> list[int]:
        """The steps in flight at wall-clock time ``ts`` (ns), oldest first:
        launched at or before ``ts``, tokens not yet read by then (or never:
        a step still in flight when the trace ends)."""
        out = []
        for step in sorted(self.step_phases):
            p = self.step_phases[step]
            start = p.launched_ts if p.launched_ts is not None else p.scheduled_ts
            end = p.output_ready_ts if p.output_ready_ts is not None else p.update_start_ts
            # A step whose tokens were never read (the trace ended) stays in flight.
            if start is not None and start <= ts and (end is None or ts < end):
                out.append(step)
        return out

    def _replay_all(self) -> None:
        """One pass over the trace: checks it, keeps the snapshots, each
        step's placeholders at the end of its schedule() and the final state."""
        self._snapshots: dict[int, EngineState] = {}
        # Step -> ({request: placeholders}, {request: placeholder inputs}), async only.
        self._placeholders: dict[int, tuple[dict[str, int], dict[str, int]]] = {}
        state = EngineState()
        interval = self.snapshot_interval
        for step in self.steps:
            for e in self._state_events.get(step, ()):
                state.apply(e)
                if type(e) is SchedStep and state.async_scheduling:
                    self._note_placeholders(state, e)
            state.step = step
            if step % interval == 0:
                self._snapshots[step] = state.copy()
        self._final = state

    def _note_placeholders(self, state: EngineState, sched: SchedStep) -> None:
        placeholders, inputs = {}, {}
        for rid in sched.num_scheduled_tokens:
            req = state.requests[rid]
            if req.num_output_placeholders:
                placeholders[rid] = req.num_output_placeholders
            # Positions past the tokens the host knows hold placeholders.
            n = req.num_computed_tokens - max(
                req.num_tokens, req.num_computed_tokens - sched.num_scheduled_tokens[rid]
            )
            if n > 0:
                inputs[rid] = n
        if placeholders or inputs:
            self._placeholders[sched.step or 0] = (placeholders, inputs)

    @property
    def steps(self) -> range:
        return range(0, self.last_step + 1)

    def step_of(self, event: TraceEvent) -> int:
        """The step an event belongs to: its ``step`` field, or (events of a
        process that never saw a step, e.g. a separate front end) the step the
        engine was in at that time."""
        if event.step is not None:
            return event.step
        i = bisect.bisect_right(self._step_starts, (event.ts, float("inf"))) - 1
        return self._step_starts[i][1] if i >= 0 else 0

    def _check_step(self, step: int) -> None:
        if not isinstance(step, int) or not 0 <= step <= self.last_step:
            raise ValueError(f"step must be an int in [0, {self.last_step}], got {step!r}")

    def state_at(self, step: int) -> EngineState:
        """The state after ``step``: a copy whose queues and block arrays are
        its own to change; its requests are shared copy-on-write with the
        snapshots (``apply`` copies before changing one; treat them as read-only)."""
        self._check_step(step)
        base = step - step % self.snapshot_interval
        state = self._snapshots[base].copy()
        for s in range(base + 1, step + 1):
            self._advance(state, s)
        return state

    def _advance(self, state: EngineState, step: int) -> None:
        """Apply ``step``'s state events to ``state`` (the state after ``step - 1``)."""
        for e in self._state_events.get(step, ()):
            state.apply(e)
        state.step = step

    def events_at(self, step: int) -> list[TraceEvent]:
        """Every event of ``step``, from every process, in time order."""
        self._check_step(step)
        return list(self._all_events.get(step, ()))

    def view(self, step: int) -> StepView:
        state = self.state_at(step)
        events = self.events_at(step)
        sched = next((e for e in events if type(e) is SchedStep), None)
        update = next((e for e in events if type(e) is SchedUpdate), None)
        runner_batch = next((e for e in events if type(e) is RunnerBatch), None)
        sampler = [e for e in events if type(e) is SamplerSampled]
        if runner_batch is not None:
            discarded = set(runner_batch.discard_req_ids)
            batch = [
                BatchSlot(
                    request_id=rid,
                    query_len=q,
                    num_computed_tokens=c,
                    seq_len=s,
                    slot_mapping=slots,
                    sampled=rid not in discarded,
                )
                for rid, q, c, s, slots in zip(
                    runner_batch.req_ids,
                    runner_batch.query_lens,
                    runner_batch.num_computed_tokens,
                    runner_batch.seq_lens,
                    runner_batch.slot_mapping,
                )
            ]
            source = "runner"
        elif sched is not None and sched.num_scheduled_tokens:
            batch = self._batch_from_scheduler(step, sched)
            source = "scheduler"
        else:
            batch, source = [], "none"
        placeholders, inputs = self._placeholders.get(step, ({}, {}))
        new_token_ids = dict(update.new_token_ids) if update else {}
        return StepView(
            step=step,
            state=state,
            sched_step=sched,
            batch=batch,
            batch_source=source,
            runner_batch=runner_batch,
            sampler=sampler,
            new_token_ids=new_token_ids,
            events=events,
            phases=self.step_phases.get(step),
            in_flight=self.in_flight_after_launch(step),
            num_output_placeholders=dict(placeholders),
            num_placeholder_inputs=dict(inputs),
            spec=_spec_step(events, new_token_ids, self._proposals(step - 1)),
            structured_output=(
                _structured_output_step(step, state, events) if self.structured_outputs else None
            ),
            ranks=self.ranks_at(step),
        )

    def _proposals(self, step: int) -> dict[str, list[int]]:
        """The drafts the runner proposed after ``step`` (what the next step verifies)."""
        if step < 0:
            return {}
        events = self._all_events.get(step, ())
        return {e.request_id: list(e.draft_token_ids) for e in events if type(e) is SpecProposed}

    def _batch_from_scheduler(self, step: int, sched: SchedStep) -> list[BatchSlot]:
        """The layout a runner would build from this step's ``SchedulerOutput``:
        rows in scheduling order, positions from the computed-token cursors,
        slots from the block tables as they were when the step was scheduled."""
        # State at the end of schedule(): replay the step up to sched.step.
        state = self.state_at(step - 1)
        for e in self._state_events.get(step, ()):
            state.apply(e)
            if e is sched:
                break
        slots = []
        # Async scheduling: the step samples for the requests it gave a placeholder.
        sampling = state.sampling_requests(step) if state.async_scheduling else None
        for rid, n in sched.num_scheduled_tokens.items():
            req = state.requests[rid]
            seq_len = req.num_computed_tokens  # already advanced by sched.step
            start = seq_len - n
            runs = []
            pos = start
            while pos < seq_len:
                index, offset = divmod(pos, state.block_size)
                count = min(state.block_size - offset, seq_len - pos)
                runs.append([req.block_ids[index], offset, count])
                pos += count
            slots.append(
                BatchSlot(
                    request_id=rid,
                    query_len=n,
                    num_computed_tokens=start,
                    seq_len=seq_len,
                    slot_mapping=runs,
                    sampled=seq_len >= req.num_tokens if sampling is None else rid in sampling,
                )
            )
        return slots

    def iter_states(self) -> Iterator[EngineState]:
        """The state after each step, in order, in one forward pass (the
        yielded object is reused: copy it to keep it)."""
        state = EngineState()
        for step in self.steps:
            self._advance(state, step)
            yield state

    @property
    def final_state(self) -> EngineState:
        return self._final.copy()

    @cached_property
    def external_req_ids(self) -> dict[str, list[str]]:
        """The id each request was sent under -> the internal ids of the
        requests added under it, in the order they were added (an ``n > 1``
        request: its children). From ``request.added``; empty for traces
        before format 1.2."""
        ids: dict[str, list[str]] = {}
        for e in self.events:
            if type(e) is RequestAdded and e.external_req_id:
                ids.setdefault(e.external_req_id, []).append(e.request_id)
        return ids

    def request_events(self, request_id: str) -> list[TraceEvent]:
        """Every event that names ``request_id`` (an internal id), in time order."""
        return [e for e in self.events if _names_request(e, request_id)]


def _spec_step(
    events: list[TraceEvent],
    new_token_ids: dict[str, list[int]],
    previous_proposals: dict[str, list[int]],
) -> SpecDecodeStep | None:
    """The step's ``spec.verified`` and ``spec.proposed`` events as a
    ``SpecDecodeStep``; None when it has neither. Under async scheduling the
    scheduler verified -1 placeholders: the ids are the runner's proposals
    after the previous step (``previous_proposals``)."""
    spec: SpecDecodeStep | None = None
    for e in events:
        t = type(e)
        if t is SpecVerified:
            if spec is None:
                spec = SpecDecodeStep()
            drafts = list(e.draft_token_ids)
            proposed = previous_proposals.get(e.request_id, [])
            if drafts and all(d < 0 for d in drafts) and len(proposed) >= len(drafts):
                drafts = proposed[: len(drafts)]
            spec.verified[e.request_id] = SpecDecodeRow(
                request_id=e.request_id,
                draft_token_ids=drafts,
                num_accepted=e.num_accepted,
                token_ids=list(e.token_ids),
                num_rejected=e.num_rejected,
                num_computed_tokens=e.num_computed_tokens,
                new_token_ids=list(new_token_ids.get(e.request_id, ())),
            )
        elif t is SpecProposed:
            if spec is None:
                spec = SpecDecodeStep()
            spec.proposed[e.request_id] = list(e.draft_token_ids)
            spec.method = e.method or spec.method
    return spec


def _structured_output_step(
    step: int, state: EngineState, events: list[TraceEvent]
) -> StructuredOutputStep | None:
    """The constrained requests alive at ``step`` (from ``state``, the state
    after it) with the step's grammar events; None when there is none."""
    bitmask: dict[str, tuple[int, int, int]] = {}  # id -> (rows, allowed, vocabulary)
    masked: dict[str, GrammarMasked] = {}
    advanced: dict[str, GrammarAdvanced] = {}
    rolled_back: dict[str, int] = {}
    for e in events:
        t = type(e)
        if t is GrammarBitmask:
            for rid, rows, allowed in zip(e.request_ids, e.num_rows, e.num_allowed):
                bitmask[rid] = (rows, allowed, e.vocab_size)
        elif t is GrammarMasked:
            masked[e.request_id] = e
        elif t is GrammarAdvanced:
            advanced[e.request_id] = e
        elif t is GrammarRolledBack:
            rolled_back[e.request_id] = rolled_back.get(e.request_id, 0) + e.num_tokens
    out = StructuredOutputStep()
    for rid, req in state.requests.items():
        if req.grammar_kind is None:
            continue
        if req.is_finished and req.finished_step is not None and req.finished_step < step:
            continue
        rows, allowed, vocab = bitmask.get(rid, (0, None, None))
        m = masked.get(rid)
        a = advanced.get(rid)
        out.requests[rid] = StructuredOutputRow(
            request_id=rid,
            grammar_kind=req.grammar_kind,
            waiting_for_grammar=req.status == WAITING_FOR_GRAMMAR,
            compile_s=req.grammar_compile_s,
            cache_hit=req.grammar_cache_hit,
            compile_error=req.grammar_error,
            compiled_step=req.grammar_compiled_step,
            ready_step=req.grammar_ready_step,
            num_rows=rows,
            num_allowed=allowed,
            vocab_size=vocab or None,
            mask=(
                GrammarMaskEffect(
                    num_allowed=m.num_allowed,
                    masked_top_token_ids=list(m.masked_top_token_ids),
                    top_token_id_before=m.top_token_id_before,
                    top_token_id_after=m.top_token_id_after,
                )
                if m is not None
                else None
            ),
            accepted_token_ids=list(a.token_ids) if a is not None else [],
            num_processed_tokens=a.num_processed_tokens if a is not None else None,
            terminated=a.terminated if a is not None else False,
            num_rolled_back=rolled_back.get(rid, 0),
        )
    return out if out.requests else None


def _set_forward(p: StepPhases, e: RunnerForward) -> None:
    p.forward_ns = e.duration_ns
    p.forward_start_ts = e.start_ts if e.start_ts is not None else e.ts - e.duration_ns


def _seq(event: TraceEvent) -> int:
    return event.seq


# The events a step's phases are read from.
_PHASE_TYPES = frozenset(
    (SchedStep, EngineStepLaunched, RunnerForward, EngineOutputReady, SchedUpdate)
)


def _names_request(event: TraceEvent, request_id: str) -> bool:
    if getattr(event, "request_id", None) == request_id:
        return True
    ids = getattr(event, "request_ids", None)
    return ids is not None and request_id in ids


__all__ = [
    "PREEMPTED",
    "RUNNING",
    "STATE_KINDS",
    "STATE_TYPES",
    "WAITING",
    "WAITING_FOR_GRAMMAR",
    "BatchSlot",
    "EngineState",
    "GrammarMaskEffect",
    "RankStep",
    "ReplayBlock",
    "ReplayError",
    "ReplayRequest",
    "SpecDecodeRow",
    "SpecDecodeStep",
    "StepPhases",
    "StepView",
    "StructuredOutputRow",
    "StructuredOutputStep",
    "TraceReplay",
]
