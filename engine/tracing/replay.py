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
step n has run, and requests added or aborted after it are included (the
tracer stamps those events with step n). Step 0 is the engine before its
first step. Building a ``TraceReplay`` replays the whole trace once, so a
trace the model contradicts raises ``ReplayError`` right away.

Random access: it keeps a copy of the state every ``snapshot_interval``
steps and replays forward from the nearest one, so any step of a run of
thousands is a copy plus at most ``snapshot_interval - 1`` steps of events
away. Copies share the requests copy-on-write (``replay_state.py``), so a
snapshot costs the per-block arrays and the queues, not every request the
run ever had. Step views (``view``) are built on demand.

Ids: the engine's events name a request by its internal id (the id it was
sent under, ``-`` and 8 random hex digits, as vLLM's ``assign_request_id``
makes it); ``external_req_ids`` finds the internal ids of a user's id.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from functools import cached_property

from engine.tracing.events import (
    KVInit,
    RequestAdded,
    RunnerBatch,
    SamplerSampled,
    SchedStep,
    SchedUpdate,
    TraceEvent,
)
from engine.tracing.reader import gc_paused, load_trace
from engine.tracing.replay_state import (
    PREEMPTED,
    RUNNING,
    STATE_KINDS,
    STATE_TYPES,
    WAITING,
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
        """Group the events by step: the state events, and every event (views)."""
        state_events: dict[int, list[TraceEvent]] = {}
        starts: list[tuple[int, int]] = []  # (ts, step) where each step's events begin
        last = None
        for e in core:
            if type(e) in STATE_TYPES:
                step = e.step or 0
                group = state_events.get(step)
                if group is None:
                    group = state_events[step] = []
                group.append(e)
                if step != last:
                    starts.append((e.ts, step))
                    last = step
        self._state_events = state_events
        self._step_starts = starts
        self.last_step = max(state_events, default=0)
        # Every event of a step, any process (for views and exports).
        all_events: dict[int, list[TraceEvent]] = {}
        step_of = self.step_of
        for e in events:
            step = e.step
            if step is None:
                step = step_of(e)
            group = all_events.get(step)
            if group is None:
                group = all_events[step] = []
            group.append(e)
        self._all_events = all_events

    def _replay_all(self) -> None:
        """One pass over the trace: checks it, keeps the snapshots and the final state."""
        self._snapshots: dict[int, EngineState] = {}
        state = EngineState()
        interval = self.snapshot_interval
        for step in self.steps:
            self._advance(state, step)
            if step % interval == 0:
                self._snapshots[step] = state.copy()
        self._final = state

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
        return StepView(
            step=step,
            state=state,
            sched_step=sched,
            batch=batch,
            batch_source=source,
            runner_batch=runner_batch,
            sampler=sampler,
            new_token_ids=dict(update.new_token_ids) if update else {},
            events=events,
        )

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
                    sampled=seq_len >= req.num_tokens,
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


def _seq(event: TraceEvent) -> int:
    return event.seq


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
    "BatchSlot",
    "EngineState",
    "ReplayBlock",
    "ReplayError",
    "ReplayRequest",
    "StepView",
    "TraceReplay",
]
