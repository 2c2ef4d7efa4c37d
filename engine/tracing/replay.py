"""The replay model: the engine's scheduler and KV-cache state, rebuilt from a trace.

vLLM twin: none (vLLM has no event trace to replay). It re-enacts, event by
event, what ``engine/v1/core/sched/scheduler.py``, ``kv_cache_manager.py``,
``single_type_kv_cache_manager.py`` and ``block_pool.py`` did, so a learner
(or the TUI, or a notebook) can stop at any step and look at:

  * the waiting queue and the running list, in order;
  * every request's status, token counts, computed-token cursor and block table;
  * every block's reference count, owner(s), prefix-cache hash and place in
    the free queue -- reproduced exactly, by modelling
    ``FreeKVCacheBlockQueue``: ids in order minus the null block at start-up,
    ``popleft`` for new blocks, unlink on a prefix hit of a free block,
    append at the tail (in the given, tail-first order) on free;
  * the batch the model runner built and what the sampler chose.

Read it for: which event changes which piece of state (``EngineState.apply``).
Sessions: all (the TUI and notebooks are built on it).

"State at step n" is the engine as of just before step n+1's ``schedule()``:
step n has run, and requests added or aborted after it are included (the
tracer stamps those events with step n). Step 0 is the engine before its
first step. The replay checks itself as it goes -- a popped block that is not
the one the engine allocated, or queue lengths that differ from the counts in
``sched.step`` -- and raises ``ReplayError`` rather than show a wrong picture.

Random access: ``TraceReplay`` keeps a full copy of the state every
``snapshot_interval`` steps and replays forward from the nearest one, so any
step of a run of thousands is a copy plus at most ``snapshot_interval`` steps
of events away.
"""

from __future__ import annotations

import bisect
import copy
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

from engine.tracing import load_trace

# Kinds whose effect on the state is applied, in the scheduler process's order.
STATE_KINDS = frozenset(
    {
        "engine.config",
        "kv.init",
        "kv.touched",
        "kv.allocated",
        "kv.cached",
        "kv.evicted",
        "kv.freed",
        "kv.cache_reset",
        "sched.queued",
        "sched.admitted",
        "sched.preempted",
        "sched.step",
        "sched.update",
        "sched.finished",
    }
)

WAITING, RUNNING, PREEMPTED = "WAITING", "RUNNING", "PREEMPTED"


class ReplayError(RuntimeError):
    """The trace contradicts the replay model (a bug in one or the other, or
    an incomplete trace)."""


@dataclass
class ReplayRequest:
    """One request as the scheduler saw it."""

    request_id: str
    status: str  # WAITING, RUNNING, PREEMPTED or FINISHED_* (RequestStatus names)
    num_prompt_tokens: int
    max_tokens: int
    priority: int = 0
    arrival_time: float = 0.0
    num_output_tokens: int = 0
    # Tokens whose KV is (or will be, once the step runs) in the cache.
    num_computed_tokens: int = 0
    # Prompt tokens served by the prefix cache when first scheduled (-1: not yet).
    num_cached_tokens: int = -1
    num_preemptions: int = 0
    block_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    # Steps at which it was admitted, preempted, finished.
    admitted_steps: list[int] = field(default_factory=list)
    preempted_steps: list[int] = field(default_factory=list)
    finished_step: int | None = None

    @property
    def num_tokens(self) -> int:
        return self.num_prompt_tokens + self.num_output_tokens

    @property
    def is_finished(self) -> bool:
        return self.status.startswith("FINISHED")

    @property
    def is_prefill_chunk(self) -> bool:
        return self.status == RUNNING and self.num_computed_tokens < self.num_tokens


@dataclass(frozen=True)
class ReplayBlock:
    """A read-only view of one KV block."""

    block_id: int
    ref_cnt: int
    block_hash: str | None  # hex of the hash (group id not included)
    owners: tuple[str, ...]  # request ids whose block table holds it
    is_null: bool
    free_queue_position: int | None  # 0 = head (evicted first); None: not free


class EngineState:
    """Scheduler + KV state after some prefix of the trace. Mutated by ``apply``."""

    def __init__(self) -> None:
        self.step = 0
        self.config: dict[str, Any] = {}
        self.policy = "fcfs"
        self.waiting: list[str] = []
        self.running: list[str] = []
        self.requests: dict[str, ReplayRequest] = {}
        # KV pool: parallel per-block arrays (cheap to copy for snapshots).
        self.num_blocks = 0
        self.block_size = 0
        self.null_block_id: int | None = None
        self.ref_cnt: list[int] = []
        self.block_hash: list[str | None] = []
        self.owners: list[tuple[str, ...]] = []
        # Free queue as a doubly linked list over block ids; HEAD/TAIL are
        # sentinels at indices num_blocks and num_blocks + 1.
        self._next: list[int] = []
        self._prev: list[int] = []
        self.num_free_blocks = 0
        # block hash hex -> ids of the blocks cached under it (usually one).
        self.cached: dict[str, list[int]] = {}
        # The last scheduler / update decision applied.
        self.last_sched_step: dict[str, Any] | None = None
        self.last_update: dict[str, Any] | None = None

    # -- copying ----------------------------------------------------------------
    def copy(self) -> EngineState:
        new = EngineState.__new__(EngineState)
        new.__dict__.update(self.__dict__)
        new.waiting = list(self.waiting)
        new.running = list(self.running)
        new.requests = {rid: _copy_request(r) for rid, r in self.requests.items()}
        new.ref_cnt = list(self.ref_cnt)
        new.block_hash = list(self.block_hash)
        new.owners = list(self.owners)
        new._next = list(self._next)
        new._prev = list(self._prev)
        new.cached = {h: list(ids) for h, ids in self.cached.items()}
        return new

    # -- free queue ---------------------------------------------------------------
    @property
    def _head(self) -> int:
        return self.num_blocks

    @property
    def _tail(self) -> int:
        return self.num_blocks + 1

    def _in_free_queue(self, block_id: int) -> bool:
        return self._next[block_id] != -1

    def _unlink(self, block_id: int) -> None:
        if not self._in_free_queue(block_id):
            raise ReplayError(f"block {block_id} left the free queue but was not in it")
        p, n = self._prev[block_id], self._next[block_id]
        self._next[p] = n
        self._prev[n] = p
        self._next[block_id] = self._prev[block_id] = -1
        self.num_free_blocks -= 1

    def _append(self, block_id: int) -> None:
        if self._in_free_queue(block_id):
            raise ReplayError(f"block {block_id} appended to the free queue twice")
        last = self._prev[self._tail]
        self._next[last] = block_id
        self._prev[block_id] = last
        self._next[block_id] = self._tail
        self._prev[self._tail] = block_id
        self.num_free_blocks += 1

    @property
    def free_queue(self) -> list[int]:
        """Free block ids, head (evicted first) to tail."""
        out = []
        b = self._next[self._head] if self.num_blocks else -1
        while b not in (-1, self._tail):
            out.append(b)
            b = self._next[b]
        return out

    # -- views ------------------------------------------------------------------
    def block(self, block_id: int) -> ReplayBlock:
        if not 0 <= block_id < self.num_blocks:
            raise ValueError(f"block_id must be in [0, {self.num_blocks - 1}], got {block_id}")
        position = None
        if self._in_free_queue(block_id):
            position = self.free_queue.index(block_id)
        return ReplayBlock(
            block_id=block_id,
            ref_cnt=self.ref_cnt[block_id],
            block_hash=self.block_hash[block_id],
            owners=self.owners[block_id],
            is_null=block_id == self.null_block_id,
            free_queue_position=position,
        )

    @property
    def blocks(self) -> list[ReplayBlock]:
        positions = {b: i for i, b in enumerate(self.free_queue)}
        return [
            ReplayBlock(
                block_id=i,
                ref_cnt=self.ref_cnt[i],
                block_hash=self.block_hash[i],
                owners=self.owners[i],
                is_null=i == self.null_block_id,
                free_queue_position=positions.get(i),
            )
            for i in range(self.num_blocks)
        ]

    @property
    def kv_cache_usage(self) -> float:
        """Fraction of usable blocks in use (the scheduler's ``kv_cache_usage``)."""
        usable = self.num_blocks - 1
        return 1.0 - self.num_free_blocks / usable if usable > 0 else 0.0

    @property
    def num_cached_free_blocks(self) -> int:
        """Free blocks that still hold a cached prefix (a later hit can revive them)."""
        return sum(1 for b in self.free_queue if self.block_hash[b] is not None)

    def unfinished_requests(self) -> dict[str, ReplayRequest]:
        return {rid: r for rid, r in self.requests.items() if not r.is_finished}

    # -- events -------------------------------------------------------------------
    def apply(self, event: dict[str, Any]) -> None:
        """Apply one scheduler-process event (kinds in ``STATE_KINDS``)."""
        kind = event["kind"]
        step = event.get("step")
        if step is not None:
            self.step = step
        handler = _HANDLERS.get(kind)
        if handler is not None:
            handler(self, event)

    def _request(self, event: dict[str, Any]) -> ReplayRequest:
        rid = event["request_id"]
        try:
            return self.requests[rid]
        except KeyError:
            raise ReplayError(
                f"{event['kind']} for request {rid!r}, which the trace never queued"
            ) from None

    def _on_config(self, e: dict[str, Any]) -> None:
        self.config = {k: v for k, v in e.items() if k not in ("ts", "pid", "seq", "kind", "step")}
        self.policy = e.get("policy", "fcfs")

    def _on_init(self, e: dict[str, Any]) -> None:
        n = e["num_blocks"]
        self.num_blocks = n
        self.block_size = e["block_size"]
        self.null_block_id = e["null_block_id"]
        self.ref_cnt = [0] * n
        self.block_hash = [None] * n
        self.owners = [()] * n
        self._next = [-1] * (n + 2)
        self._prev = [-1] * (n + 2)
        self._next[self._head] = self._tail
        self._prev[self._tail] = self._head
        self.num_free_blocks = 0
        self.cached = {}
        for b in range(n):
            if b != self.null_block_id:
                self._append(b)

    def _on_touched(self, e: dict[str, Any]) -> None:
        req = self._request(e)
        for b in e["block_ids"]:
            if self.ref_cnt[b] == 0 and b != self.null_block_id:
                self._unlink(b)
            self.ref_cnt[b] += 1
            self.owners[b] = (*self.owners[b], req.request_id)
        req.block_ids.extend(e["block_ids"])

    def _on_allocated(self, e: dict[str, Any]) -> None:
        req = self._request(e)
        for b in e["block_ids"]:
            head = self._next[self._head]
            if head != b:
                raise ReplayError(
                    f"step {self.step}: the engine allocated block {b} to {req.request_id} "
                    f"but the free queue's head is {head if head != self._tail else 'empty'}"
                )
            self._unlink(b)
            if self.ref_cnt[b] != 0:
                raise ReplayError(f"block {b} was free with ref_cnt {self.ref_cnt[b]}")
            if self.block_hash[b] is not None:
                raise ReplayError(f"block {b} was reused while still cached (no kv.evicted)")
            self.ref_cnt[b] = 1
            self.owners[b] = (req.request_id,)
        req.block_ids.extend(e["block_ids"])

    def _on_cached(self, e: dict[str, Any]) -> None:
        b, h = e["block_id"], e["block_hash"]
        if self.block_hash[b] is not None:
            raise ReplayError(f"block {b} cached twice without an eviction")
        self.block_hash[b] = h
        self.cached.setdefault(h, []).append(b)

    def _on_evicted(self, e: dict[str, Any]) -> None:
        b, h = e["block_id"], e["block_hash"]
        if self.block_hash[b] != h:
            raise ReplayError(f"block {b} evicted under hash {h[:8]} it does not carry")
        self.block_hash[b] = None
        ids = self.cached.get(h, [])
        if b in ids:
            ids.remove(b)
        if not ids:
            self.cached.pop(h, None)

    def _on_freed(self, e: dict[str, Any]) -> None:
        req = self._request(e)
        rid = req.request_id
        to_queue = []
        for b in e["block_ids"]:
            self.ref_cnt[b] -= 1
            owners = list(self.owners[b])
            if rid in owners:
                owners.remove(rid)
            self.owners[b] = tuple(owners)
            if b == self.null_block_id:
                continue
            if self.ref_cnt[b] < 0:
                raise ReplayError(f"block {b}: ref_cnt below zero after {rid} freed it")
            if self.ref_cnt[b] == 0:
                to_queue.append(b)
        for b in to_queue:
            self._append(b)
        expected = e.get("to_free_queue")
        if expected is not None and expected != to_queue:
            raise ReplayError(
                f"step {self.step}: {rid} freed blocks {e['block_ids']}; the replay returned "
                f"{to_queue} to the free queue, the engine {expected}"
            )
        req.block_ids = []

    def _on_cache_reset(self, e: dict[str, Any]) -> None:
        self.block_hash = [None] * self.num_blocks
        self.cached = {}

    def _on_queued(self, e: dict[str, Any]) -> None:
        rid = e["request_id"]
        self.requests[rid] = ReplayRequest(
            request_id=rid,
            status=WAITING,
            num_prompt_tokens=e["num_prompt_tokens"],
            max_tokens=e.get("max_tokens", 0),
            priority=e.get("priority", 0),
            arrival_time=e.get("arrival_time", 0.0),
        )
        self._enqueue(rid, front=False)

    def _enqueue(self, rid: str, front: bool) -> None:
        if self.policy == "priority":
            # The heap's pop order: (priority, arrival_time, request_id).
            req = self.requests[rid]
            key = (req.priority, req.arrival_time, rid)
            keys = [self._priority_key(r) for r in self.waiting]
            self.waiting.insert(bisect.bisect_right(keys, key), rid)
        elif front:
            self.waiting.insert(0, rid)
        else:
            self.waiting.append(rid)

    def _priority_key(self, rid: str) -> tuple[int, float, str]:
        r = self.requests[rid]
        return (r.priority, r.arrival_time, rid)

    def _on_admitted(self, e: dict[str, Any]) -> None:
        req = self._request(e)
        rid = req.request_id
        if not self.waiting or self.waiting[0] != rid:
            raise ReplayError(
                f"step {self.step}: {rid} was admitted but the head of the waiting queue is "
                f"{self.waiting[0] if self.waiting else 'nothing'}"
            )
        self.waiting.pop(0)
        self.running.append(rid)
        req.status = RUNNING
        req.num_computed_tokens = e["num_computed_tokens"]
        if req.num_cached_tokens < 0:
            req.num_cached_tokens = e["num_computed_tokens"]
        req.admitted_steps.append(self.step)

    def _on_preempted(self, e: dict[str, Any]) -> None:
        req = self._request(e)
        rid = req.request_id
        if rid not in self.running:
            raise ReplayError(f"step {self.step}: {rid} preempted but not running")
        self.running.remove(rid)
        req.status = PREEMPTED
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        req.preempted_steps.append(self.step)
        self._enqueue(rid, front=True)

    def _on_step(self, e: dict[str, Any]) -> None:
        for rid, n in e["num_scheduled_tokens"].items():
            self.requests[rid].num_computed_tokens += n
        self.last_sched_step = e
        self._check_counts(e)

    def _on_update(self, e: dict[str, Any]) -> None:
        for rid, tokens in e["new_token_ids"].items():
            req = self.requests.get(rid)
            if req is not None:
                req.num_output_tokens += len(tokens)
        self.last_update = e
        self._check_counts(e)

    def _check_counts(self, e: dict[str, Any]) -> None:
        if "num_running" in e and (len(self.running), len(self.waiting)) != (
            e["num_running"],
            e["num_waiting"],
        ):
            raise ReplayError(
                f"step {self.step} ({e['kind']}): the engine had {e['num_running']} running / "
                f"{e['num_waiting']} waiting, the replay {len(self.running)} / {len(self.waiting)}"
            )

    def _on_finished(self, e: dict[str, Any]) -> None:
        req = self._request(e)
        rid = req.request_id
        if rid in self.running:
            self.running.remove(rid)
        elif rid in self.waiting:
            self.waiting.remove(rid)
        req.status = e["status"]
        req.finish_reason = e.get("finish_reason")
        req.finished_step = self.step


_HANDLERS = {
    "engine.config": EngineState._on_config,
    "kv.init": EngineState._on_init,
    "kv.touched": EngineState._on_touched,
    "kv.allocated": EngineState._on_allocated,
    "kv.cached": EngineState._on_cached,
    "kv.evicted": EngineState._on_evicted,
    "kv.freed": EngineState._on_freed,
    "kv.cache_reset": EngineState._on_cache_reset,
    "sched.queued": EngineState._on_queued,
    "sched.admitted": EngineState._on_admitted,
    "sched.preempted": EngineState._on_preempted,
    "sched.step": EngineState._on_step,
    "sched.update": EngineState._on_update,
    "sched.finished": EngineState._on_finished,
}


def _copy_request(r: ReplayRequest) -> ReplayRequest:
    new = copy.copy(r)
    new.block_ids = list(r.block_ids)
    new.admitted_steps = list(r.admitted_steps)
    new.preempted_steps = list(r.preempted_steps)
    return new


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
    sched_step: dict[str, Any] | None
    # Rows of the batch, from ``runner.batch`` when the runner traced it,
    # otherwise derived from the scheduler's decision and the block tables.
    batch: list[BatchSlot]
    batch_source: str  # "runner", "scheduler" or "none"
    runner_batch: dict[str, Any] | None
    # One ``sampler.sampled`` event per kept sample (empty when no real sampler ran).
    sampler: list[dict[str, Any]]
    # Tokens each request received this step (from ``sched.update``).
    new_token_ids: dict[str, list[int]]
    events: list[dict[str, Any]]

    @property
    def waiting(self) -> list[str]:
        return self.state.waiting

    @property
    def running(self) -> list[str]:
        return self.state.running


class TraceReplay:
    """Random access to the engine's state at every step of a trace.

    ``TraceReplay(events_or_path)``; ``replay.steps`` is ``range(0, last + 1)``;
    ``replay.state_at(n)`` returns an ``EngineState`` (a private copy);
    ``replay.view(n)`` adds the step's decision, batch layout and sampler view.
    """

    def __init__(
        self, trace: str | Iterable[dict[str, Any]], snapshot_interval: int = 32
    ) -> None:
        if snapshot_interval < 1:
            raise ValueError(f"snapshot_interval must be >= 1, got {snapshot_interval}")
        events = load_trace(trace) if isinstance(trace, str) else list(trace)
        self.events = events
        self.snapshot_interval = snapshot_interval
        init = [e for e in events if e["kind"] == "kv.init"]
        if not init:
            raise ReplayError("the trace has no kv.init event (was trace_level 'off'?)")
        if len({e["pid"] for e in init}) > 1 or len(init) > 1:
            raise ReplayError("the trace holds more than one engine (several kv.init events)")
        self.engine_pid = init[0]["pid"]
        # The scheduler process's own order is authoritative (seq), not wall time.
        core = sorted(
            (e for e in events if e["pid"] == self.engine_pid and e["kind"] in STATE_KINDS),
            key=lambda e: e.get("seq", 0),
        )
        self._state_events: dict[int, list[dict[str, Any]]] = {}
        for e in core:
            self._state_events.setdefault(e.get("step") or 0, []).append(e)
        self.last_step = max(self._state_events, default=0)
        self._step_starts = self._compute_step_starts(core)
        # Every event of a step, any process (for views and exports).
        self._all_events: dict[int, list[dict[str, Any]]] = {}
        for e in events:
            self._all_events.setdefault(self.step_of(e), []).append(e)
        self._snapshots: dict[int, EngineState] = {}
        state = EngineState()
        for step in self.steps:
            for e in self._state_events.get(step, ()):
                state.apply(e)
            state.step = step
            if step % snapshot_interval == 0:
                self._snapshots[step] = state.copy()
        self._final = state

    @property
    def steps(self) -> range:
        return range(0, self.last_step + 1)

    def _compute_step_starts(self, core: list[dict[str, Any]]) -> list[tuple[int, int]]:
        starts: list[tuple[int, int]] = []
        for e in core:
            step = e.get("step") or 0
            if not starts or starts[-1][1] != step:
                starts.append((e["ts"], step))
        return starts

    def step_of(self, event: dict[str, Any]) -> int:
        """The step an event belongs to: its ``step`` field, or (events of a
        process that never saw a step, e.g. a separate front end) the step the
        engine was in at that time."""
        step = event.get("step")
        if step is not None:
            return step
        i = bisect.bisect_right(self._step_starts, (event["ts"], float("inf"))) - 1
        return self._step_starts[i][1] if i >= 0 else 0

    def _check_step(self, step: int) -> None:
        if not isinstance(step, int) or not 0 <= step <= self.last_step:
            raise ValueError(f"step must be an int in [0, {self.last_step}], got {step!r}")

    def state_at(self, step: int) -> EngineState:
        """The state after ``step`` (a copy: changing it changes nothing here)."""
        self._check_step(step)
        base = step - step % self.snapshot_interval
        state = self._snapshots[base].copy()
        for s in range(base + 1, step + 1):
            for e in self._state_events.get(s, ()):
                state.apply(e)
            state.step = s
        return state

    def events_at(self, step: int) -> list[dict[str, Any]]:
        """Every event of ``step``, from every process, in time order."""
        self._check_step(step)
        return list(self._all_events.get(step, ()))

    def view(self, step: int) -> StepView:
        state = self.state_at(step)
        events = self.events_at(step)
        sched = next((e for e in events if e["kind"] == "sched.step"), None)
        update = next((e for e in events if e["kind"] == "sched.update"), None)
        runner_batch = next((e for e in events if e["kind"] == "runner.batch"), None)
        sampler = [e for e in events if e["kind"] == "sampler.sampled"]
        if runner_batch is not None:
            discarded = set(runner_batch.get("discard_req_ids", ()))
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
                    runner_batch["req_ids"],
                    runner_batch["query_lens"],
                    runner_batch["num_computed_tokens"],
                    runner_batch["seq_lens"],
                    runner_batch["slot_mapping"],
                )
            ]
            source = "runner"
        elif sched is not None and sched["num_scheduled_tokens"]:
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
            new_token_ids=dict(update["new_token_ids"]) if update else {},
            events=events,
        )

    def _batch_from_scheduler(self, step: int, sched: dict[str, Any]) -> list[BatchSlot]:
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
        for rid, n in sched["num_scheduled_tokens"].items():
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
            for e in self._state_events.get(step, ()):
                state.apply(e)
            state.step = step
            yield state

    @property
    def final_state(self) -> EngineState:
        return self._final.copy()

    def request_events(self, request_id: str) -> list[dict[str, Any]]:
        """Every event that names ``request_id``, in time order."""
        return [e for e in self.events if _names_request(e, request_id)]


def _names_request(event: dict[str, Any], request_id: str) -> bool:
    if event.get("request_id") == request_id:
        return True
    ids = event.get("request_ids")
    return isinstance(ids, list) and request_id in ids


__all__ = [
    "BatchSlot",
    "EngineState",
    "ReplayBlock",
    "ReplayError",
    "ReplayRequest",
    "StepView",
    "TraceReplay",
]
