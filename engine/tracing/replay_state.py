"""The replay model's state: the scheduler's queues and the KV-cache pool as
events change them, one event at a time.

vLLM twin: none (vLLM has no event trace to replay). ``EngineState.apply``
re-enacts, event by event, what ``engine/v1/core/sched/scheduler.py``,
``kv_cache_manager.py``, ``single_type_kv_cache_manager.py`` and
``block_pool.py`` did, so a learner can stop at any step and look at:

  * the waiting queue and the running list, in order;
  * every request's status, token counts, computed-token cursor and block table;
  * every block's reference count, owner(s), prefix-cache hash and place in
    the free queue -- reproduced exactly, by modelling
    ``FreeKVCacheBlockQueue``: ids in order minus the null block at start-up,
    ``popleft`` for new blocks, unlink on a prefix hit of a free block,
    append at the tail (in the given, tail-first order) on free;
  * with async scheduling (``engine/v1/core/sched/async_scheduler.py``),
    each request's placeholders -- tokens sampled by steps still in flight,
    ``num_output_placeholders`` -- and the steps in flight (``in_flight``);
  * with speculative decoding, the rollback of the cursor: ``sched.step``
    advances it over the drafts too, ``spec.verified`` steps it back over
    the rejected ones (``Scheduler.update_from_output``), and each request
    counts its drafts and the accepted ones;
  * with structured outputs, the scheduler's second waiting queue,
    ``skipped_waiting``: a constrained request is queued there in
    ``WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR`` (``so.compile_started`` comes
    before its ``sched.queued``), is set back to ``WAITING`` by ``so.ready``
    and admitted from there; FCFS serves ``skipped_waiting`` first, setting
    aside the requests still blocked. Each request keeps its grammar's kind
    and compile (``so.compiled``).

Read it for: which event changes which piece of state (``EngineState.apply``
and the ``_on_*`` handlers). ``replay.py`` (``TraceReplay``) drives it over a
whole trace. Sessions: all (the TUI and notebooks are built on it).

Copies are cheap, because a trace of thousands of steps keeps many
(snapshots, cached views): the per-block arrays and the queues are copied,
the requests are shared copy-on-write -- a state changes a request only
after replacing it with a copy of its own (``_mutable``), and the lists in
``cached`` are replaced, never changed in place. Treat the ``ReplayRequest``
objects and ``cached`` lists of a state you were given as read-only (copy
one to edit it); the state's own lists (``waiting``, ``ref_cnt``, ...) are
yours.

The replay checks itself as it goes -- a popped block that is not the one
the engine allocated, or queue lengths that differ from the counts in
``sched.step`` -- and raises ``ReplayError`` rather than show a wrong picture.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field
from typing import Any

from engine.tracing.events import (
    EngineConfig,
    GrammarCompiled,
    GrammarCompileStarted,
    GrammarReady,
    KVAllocated,
    KVCached,
    KVCacheReset,
    KVEvicted,
    KVFreed,
    KVInit,
    KVTouched,
    SchedAdmitted,
    SchedFinished,
    SchedPreempted,
    SchedQueued,
    SchedStep,
    SchedUpdate,
    SpecVerified,
    TraceEvent,
)

WAITING, RUNNING, PREEMPTED = "WAITING", "RUNNING", "PREEMPTED"
# Structured outputs: queued (in ``skipped_waiting``) until the grammar compiles.
WAITING_FOR_GRAMMAR = "WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR"


class ReplayError(RuntimeError):
    """The trace contradicts the replay model (a bug in one or the other, or
    an incomplete trace)."""


@dataclass
class ReplayRequest:
    """One request as the scheduler saw it."""

    request_id: str
    # RequestStatus names: WAITING, WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR
    # (``WAITING_FOR_GRAMMAR``), RUNNING, PREEMPTED or FINISHED_*.
    status: str
    num_prompt_tokens: int
    max_tokens: int
    priority: int = 0
    arrival_time: float = 0.0
    num_output_tokens: int = 0
    # Tokens whose KV is (or will be, once the step runs) in the cache.
    num_computed_tokens: int = 0
    # Prompt tokens served by the prefix cache at its last admission before
    # its first output token (-1: never admitted).
    num_cached_tokens: int = -1
    num_preemptions: int = 0
    # Async scheduling: tokens that steps in flight will sample for it (all but
    # the newest already fed a later step: their positions count in
    # num_computed_tokens), and frames still to drop after a
    # reset_prefix_cache preemption (the engine's fields).
    num_output_placeholders: int = 0
    async_tokens_to_discard: int = 0
    # Speculative decoding: drafts verified for it so far, and how many the
    # target accepted (``spec.verified``).
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    # Structured outputs: the grammar's kind (``so.compile_started``; None:
    # not constrained), its compile (``so.compiled``: None until then) and the
    # step whose schedule() found it compiled (``so.ready``).
    grammar_kind: str | None = None
    grammar_compile_s: float | None = None
    grammar_cache_hit: bool | None = None
    grammar_error: str = ""
    grammar_compiled_step: int | None = None
    grammar_ready_step: int | None = None
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
    def waiting_for_grammar(self) -> bool:
        """Queued in ``skipped_waiting`` until its grammar has compiled."""
        return self.status == WAITING_FOR_GRAMMAR

    @property
    def is_prefill_chunk(self) -> bool:
        """Running, and the next scheduled tokens are still prompt (or
        recomputed) tokens: a placeholder's position is not one of them."""
        return self.status == RUNNING and self.num_computed_tokens < (
            self.num_tokens + self.num_output_placeholders
        )


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
        self.config: EngineConfig | None = None
        self.policy = "fcfs"
        self.waiting: list[str] = []
        self.running: list[str] = []
        # The second waiting queue (``Scheduler.skipped_waiting``): requests
        # waiting for their grammar, and those promoted but not yet admitted.
        self.skipped_waiting: list[str] = []
        self.requests: dict[str, ReplayRequest] = {}
        # Grammar events of requests not queued yet: id -> (kind, so.compiled or None).
        self._grammar_pending: dict[str, tuple[str, Any]] = {}
        # Requests this state may change in place (it made or copied them);
        # the others are shared with copies of it (see the module docstring).
        self._owned: set[str] = set()
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
        self.last_sched_step: SchedStep | None = None
        self.last_update: SchedUpdate | None = None
        # Steps scheduled whose output has not been applied yet, oldest first:
        # with async scheduling the step just scheduled, and for a moment (from
        # the next schedule() to this one's update) two.
        self.in_flight: list[int] = []
        # Step in flight -> the requests it samples a token for (their placeholders).
        self._sampling: dict[int, tuple[str, ...]] = {}

    # -- copying ----------------------------------------------------------------
    def copy(self) -> EngineState:
        """An independent state (the requests are shared copy-on-write: from
        now on neither side changes a shared one in place)."""
        new = EngineState.__new__(EngineState)
        new.__dict__.update(self.__dict__)
        new.waiting = list(self.waiting)
        new.running = list(self.running)
        new.skipped_waiting = list(self.skipped_waiting)
        new._grammar_pending = dict(self._grammar_pending)  # of tuples
        new.requests = dict(self.requests)
        new._owned = set()
        self._owned = set()
        new.ref_cnt = list(self.ref_cnt)
        new.block_hash = list(self.block_hash)
        new.owners = list(self.owners)  # of tuples
        new._next = list(self._next)
        new._prev = list(self._prev)
        new.cached = dict(self.cached)  # its lists are replaced, never changed
        new.in_flight = list(self.in_flight)
        new._sampling = dict(self._sampling)  # of tuples
        return new

    def sampling_requests(self, step: int) -> tuple[str, ...]:
        """Async scheduling: the requests step ``step`` (in flight) samples a
        token for; () once its output is applied, or without async scheduling."""
        return self._sampling.get(step, ())

    @property
    def async_scheduling(self) -> bool:
        """The engine scheduled asynchronously (``engine.config``; False before 1.4)."""
        return self.config is not None and self.config.async_scheduling

    def _mutable(self, rid: str) -> ReplayRequest:
        """Request ``rid``, safe to change in place (a copy if it was shared)."""
        req = self.requests[rid]
        if rid not in self._owned:
            req = _copy_request(req)
            self.requests[rid] = req
            self._owned.add(rid)
        return req

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
        return self._block_view(block_id, position)

    @property
    def blocks(self) -> list[ReplayBlock]:
        positions = {b: i for i, b in enumerate(self.free_queue)}
        return [self._block_view(i, positions.get(i)) for i in range(self.num_blocks)]

    def _block_view(self, block_id: int, free_queue_position: int | None) -> ReplayBlock:
        return ReplayBlock(
            block_id=block_id,
            ref_cnt=self.ref_cnt[block_id],
            block_hash=self.block_hash[block_id],
            owners=self.owners[block_id],
            is_null=block_id == self.null_block_id,
            free_queue_position=free_queue_position,
        )

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
    def apply(self, event: TraceEvent) -> None:
        """Apply one scheduler-process event (types in ``STATE_TYPES``)."""
        if event.step is not None:
            self.step = event.step
        handler = _HANDLERS.get(type(event))
        if handler is not None:
            handler(self, event)

    def _request(self, event: Any) -> ReplayRequest:
        """The event's request, ready to be changed."""
        rid = event.request_id
        try:
            return self._mutable(rid)
        except KeyError:
            raise ReplayError(
                f"{event.kind} for request {rid!r}, which the trace never queued"
            ) from None

    def _on_config(self, e: EngineConfig) -> None:
        self.config = e
        self.policy = e.policy

    def _on_init(self, e: KVInit) -> None:
        n = e.num_blocks
        self.num_blocks = n
        self.block_size = e.block_size
        self.null_block_id = e.null_block_id
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

    def _on_touched(self, e: KVTouched) -> None:
        req = self._request(e)
        for b in e.block_ids:
            if self.ref_cnt[b] == 0 and b != self.null_block_id:
                self._unlink(b)
            self.ref_cnt[b] += 1
            self.owners[b] = (*self.owners[b], req.request_id)
        req.block_ids.extend(e.block_ids)

    def _on_allocated(self, e: KVAllocated) -> None:
        req = self._request(e)
        for b in e.block_ids:
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
        req.block_ids.extend(e.block_ids)

    def _on_cached(self, e: KVCached) -> None:
        b, h = e.block_id, e.block_hash
        if self.block_hash[b] is not None:
            raise ReplayError(f"block {b} cached twice without an eviction")
        self.block_hash[b] = h
        self.cached[h] = [*self.cached.get(h, ()), b]

    def _on_evicted(self, e: KVEvicted) -> None:
        b, h = e.block_id, e.block_hash
        if self.block_hash[b] != h:
            raise ReplayError(f"block {b} evicted under hash {h[:8]} it does not carry")
        self.block_hash[b] = None
        ids = [other for other in self.cached.get(h, ()) if other != b]
        if ids:
            self.cached[h] = ids
        else:
            self.cached.pop(h, None)

    def _on_freed(self, e: KVFreed) -> None:
        req = self._request(e)
        rid = req.request_id
        to_queue = []
        for b in e.block_ids:
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
        if e.to_free_queue != to_queue:
            raise ReplayError(
                f"step {self.step}: {rid} freed blocks {e.block_ids}; the replay returned "
                f"{to_queue} to the free queue, the engine {e.to_free_queue}"
            )
        req.block_ids = []

    def _on_cache_reset(self, e: KVCacheReset) -> None:
        self.block_hash = [None] * self.num_blocks
        self.cached = {}

    def _on_queued(self, e: SchedQueued) -> None:
        rid = e.request_id
        req = self.requests[rid] = ReplayRequest(
            request_id=rid,
            status=WAITING,
            num_prompt_tokens=e.num_prompt_tokens,
            max_tokens=e.max_tokens,
            priority=e.priority,
            arrival_time=e.arrival_time,
        )
        self._owned.add(rid)
        grammar = self._grammar_pending.pop(rid, None)
        if grammar is None:
            self._enqueue(rid, front=False)
            return
        # Structured outputs: the request starts blocked, in skipped_waiting.
        req.grammar_kind, compiled = grammar
        if compiled is not None:
            self._note_compiled(req, compiled)
        req.status = WAITING_FOR_GRAMMAR
        self._insert(self.skipped_waiting, rid, front=False)

    def _enqueue(self, rid: str, front: bool) -> None:
        self._insert(self.waiting, rid, front)

    def _insert(self, queue: list[str], rid: str, front: bool) -> None:
        if self.policy == "priority":
            # The heap's pop order: (priority, arrival_time, request_id), Request.__lt__'s.
            key = self._priority_key(rid)
            keys = [self._priority_key(r) for r in queue]
            queue.insert(bisect.bisect_right(keys, key), rid)
        elif front:
            queue.insert(0, rid)
        else:
            queue.append(rid)

    def _priority_key(self, rid: str) -> tuple[int, float, str]:
        r = self.requests[rid]
        return (r.priority, r.arrival_time, rid)

    def _on_admitted(self, e: SchedAdmitted) -> None:
        req = self._request(e)
        rid = req.request_id
        # FCFS takes skipped_waiting first, setting aside the requests at its
        # head that are still blocked; PRIORITY the better of the two heads.
        skipped = self.skipped_waiting
        blocked = [r for r in skipped if self.requests[r].waiting_for_grammar]
        if req.waiting_for_grammar:
            raise ReplayError(
                f"step {self.step}: {rid} was admitted while waiting for its grammar (no so.ready)"
            )
        if rid in skipped:
            ahead = skipped[: skipped.index(rid)]
            if self.policy != "priority" and any(r not in blocked for r in ahead):
                raise ReplayError(
                    f"step {self.step}: {rid} was admitted from skipped_waiting behind "
                    f"{[r for r in ahead if r not in blocked]}, which were not blocked"
                )
            skipped.remove(rid)
        else:
            if not self.waiting or self.waiting[0] != rid:
                raise ReplayError(
                    f"step {self.step}: {rid} was admitted but the head of the waiting queue "
                    f"is {self.waiting[0] if self.waiting else 'nothing'}"
                )
            if self.policy != "priority" and len(blocked) < len(skipped):
                raise ReplayError(
                    f"step {self.step}: {rid} was admitted from the waiting queue while "
                    f"skipped_waiting held {[r for r in skipped if r not in blocked]}, "
                    "which FCFS serves first"
                )
            self.waiting.pop(0)
        self.running.append(rid)
        req.status = RUNNING
        req.num_computed_tokens = e.num_computed_tokens
        if req.num_output_tokens == 0:  # as the engine's PrefillStats: kept once a token is out
            req.num_cached_tokens = e.num_computed_tokens
        req.admitted_steps.append(self.step)

    def _on_preempted(self, e: SchedPreempted) -> None:
        req = self._request(e)
        rid = req.request_id
        if rid not in self.running:
            raise ReplayError(f"step {self.step}: {rid} preempted but not running")
        self.running.remove(rid)
        req.status = PREEMPTED
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        req.preempted_steps.append(self.step)
        if not e.for_request_id:
            # reset_prefix_cache: the frames of the steps in flight are stale
            # (the request recomputes from scratch); its placeholders go.
            # An ordinary preemption keeps them: those tokens are still valid.
            req.async_tokens_to_discard = req.num_output_placeholders
            req.num_output_placeholders = 0
        self._enqueue(rid, front=True)

    def _on_step(self, e: SchedStep) -> None:
        sampling = []
        placeholders = self.async_scheduling
        spec_tokens = e.scheduled_spec_decode_tokens or {}
        for rid, n in e.num_scheduled_tokens.items():
            req = self._mutable(rid)
            # Sampled unless a chunk that ends before the last known (or coming) token.
            samples = req.num_computed_tokens + n >= req.num_tokens + req.num_output_placeholders
            req.num_computed_tokens += n
            if placeholders and samples:
                # One token, plus one per draft if all are accepted (AsyncScheduler).
                req.num_output_placeholders += 1 + len(spec_tokens.get(rid, ()))
                sampling.append(rid)
        step = e.step if e.step is not None else self.step
        self.in_flight.append(step)
        if sampling:
            self._sampling[step] = tuple(sampling)
        self.last_sched_step = e
        self._check_counts(e)

    def _on_update(self, e: SchedUpdate) -> None:
        new_token_ids = e.new_token_ids
        step = e.step if e.step is not None else self.step
        # Each request the step sampled for retires one placeholder per token
        # appended, or drops the frame after a reset (async_tokens_to_discard).
        for rid in self._sampling.pop(step, ()):
            req = self.requests.get(rid)
            # A request that finished while the step was in flight drops its
            # frame; one this very update finished (its sched.finished came
            # first, from inside update_from_output) still retires it.
            if req is None or (req.is_finished and rid not in new_token_ids):
                continue
            req = self._mutable(rid)
            if req.async_tokens_to_discard > 0:
                req.async_tokens_to_discard -= 1
                if rid in new_token_ids:
                    raise ReplayError(
                        f"step {step}: {rid} got tokens from a frame the engine should "
                        "have dropped (reset_prefix_cache preempted it in flight)"
                    )
            else:
                req.num_output_placeholders -= len(new_token_ids.get(rid, ()))
                if req.num_output_placeholders < 0:
                    raise ReplayError(f"step {step}: {rid} got more tokens than were coming")
        for rid, tokens in new_token_ids.items():
            if rid in self.requests:
                self._mutable(rid).num_output_tokens += len(tokens)
        if step in self.in_flight:
            self.in_flight.remove(step)
        self.last_update = e
        self._check_counts(e)

    def _on_spec_verified(self, e: SpecVerified) -> None:
        """The drafts' verdict, before the step's tokens are appended: the
        positions of the rejected drafts were computed for nothing, so the
        cursor (and, with async scheduling, the placeholders) steps back over
        them, each only where above 0, as the scheduler does."""
        req = self._request(e)
        if req.num_computed_tokens > 0:
            req.num_computed_tokens -= e.num_rejected
        if req.num_output_placeholders > 0:
            req.num_output_placeholders -= e.num_rejected
        req.num_draft_tokens += len(e.draft_token_ids)
        req.num_accepted_tokens += e.num_accepted
        if req.num_computed_tokens != e.num_computed_tokens:
            raise ReplayError(
                f"step {self.step}: {req.request_id} rejected {e.num_rejected} drafts; the "
                f"replay's cursor is then {req.num_computed_tokens}, the engine's "
                f"{e.num_computed_tokens}"
            )

    def _check_counts(self, e: SchedStep | SchedUpdate) -> None:
        if (len(self.running), len(self.waiting)) != (e.num_running, e.num_waiting):
            raise ReplayError(
                f"step {self.step} ({e.kind}): the engine had {e.num_running} running / "
                f"{e.num_waiting} waiting, the replay {len(self.running)} / {len(self.waiting)}"
            )
        # Traces before 1.7 leave it out (0); nothing was ever skipped then.
        if len(self.skipped_waiting) != e.num_skipped_waiting:
            raise ReplayError(
                f"step {self.step} ({e.kind}): the engine had {e.num_skipped_waiting} "
                f"requests in skipped_waiting, the replay {len(self.skipped_waiting)}"
            )

    def _on_finished(self, e: SchedFinished) -> None:
        req = self._request(e)
        rid = req.request_id
        if rid in self.running:
            self.running.remove(rid)
        elif rid in self.waiting:
            self.waiting.remove(rid)
        elif rid in self.skipped_waiting:
            self.skipped_waiting.remove(rid)
        req.status = e.status
        req.finish_reason = e.finish_reason
        req.finished_step = self.step

    def _on_compile_started(self, e: GrammarCompileStarted) -> None:
        """Before the request's ``sched.queued``: noted until it is queued."""
        rid = e.request_id
        if rid in self.requests:
            self._mutable(rid).grammar_kind = e.grammar_kind
        else:
            self._grammar_pending[rid] = (e.grammar_kind, None)

    def _on_compiled(self, e: GrammarCompiled) -> None:
        rid = e.request_id
        if rid in self.requests:
            self._note_compiled(self._mutable(rid), e)
        elif rid in self._grammar_pending:  # a cache hit, before sched.queued
            self._grammar_pending[rid] = (self._grammar_pending[rid][0], e)

    def _note_compiled(self, req: ReplayRequest, e: GrammarCompiled) -> None:
        req.grammar_compile_s = e.compile_s
        req.grammar_cache_hit = e.cache_hit
        req.grammar_error = e.error
        req.grammar_compiled_step = e.step if e.step is not None else self.step

    def _on_ready(self, e: GrammarReady) -> None:
        req = self._request(e)
        if not req.waiting_for_grammar or req.request_id not in self.skipped_waiting:
            raise ReplayError(
                f"step {self.step}: so.ready for {req.request_id}, which was not waiting for "
                f"its grammar in skipped_waiting (status {req.status})"
            )
        req.status = WAITING
        req.grammar_ready_step = self.step


_HANDLERS: dict[type[TraceEvent], Any] = {
    EngineConfig: EngineState._on_config,
    KVInit: EngineState._on_init,
    KVTouched: EngineState._on_touched,
    KVAllocated: EngineState._on_allocated,
    KVCached: EngineState._on_cached,
    KVEvicted: EngineState._on_evicted,
    KVFreed: EngineState._on_freed,
    KVCacheReset: EngineState._on_cache_reset,
    SchedQueued: EngineState._on_queued,
    SchedAdmitted: EngineState._on_admitted,
    SchedPreempted: EngineState._on_preempted,
    SchedStep: EngineState._on_step,
    SchedUpdate: EngineState._on_update,
    SpecVerified: EngineState._on_spec_verified,
    SchedFinished: EngineState._on_finished,
    GrammarCompileStarted: EngineState._on_compile_started,
    GrammarCompiled: EngineState._on_compiled,
    GrammarReady: EngineState._on_ready,
}

# Event types whose effect on the state is applied, in the scheduler process's order.
STATE_TYPES = frozenset(_HANDLERS)
# Their kinds, e.g. "sched.step".
STATE_KINDS = frozenset(cls.kind for cls in _HANDLERS)


def _copy_request(r: ReplayRequest) -> ReplayRequest:
    new = ReplayRequest.__new__(ReplayRequest)
    new.__dict__.update(r.__dict__)
    new.block_ids = list(r.block_ids)
    new.admitted_steps = list(r.admitted_steps)
    new.preempted_steps = list(r.preempted_steps)
    return new


__all__ = [
    "PREEMPTED",
    "RUNNING",
    "STATE_KINDS",
    "STATE_TYPES",
    "WAITING",
    "WAITING_FOR_GRAMMAR",
    "EngineState",
    "ReplayBlock",
    "ReplayError",
    "ReplayRequest",
]
