"""Property tests of the AsyncScheduler with a batch queue of two, driven by Hypothesis.

A ``RuleBasedStateMachine`` plays ``EngineCore.step_with_batch_queue``
against a real ``AsyncScheduler`` on a small KV pool (so preemption is
common): step N+1 is scheduled before step N is read back. Rules add requests
(some sharing prefixes, for prefix-cache hits), launch a step (schedule, and
fix the token the fake worker samples for each request that samples),
consume the oldest step in flight (``update_from_output`` with a hand-made
``ModelRunnerOutput``: random EOS, stop and ordinary tokens), run whole
``step_with_batch_queue`` turns, abort random requests (also with one or two
steps in flight), call ``reset_prefix_cache(reset_running_requests=True)``
and drain.

The test keeps its own model of what the client must see: the tokens each
step samples, which frames went stale (a ``reset_prefix_cache`` preempted
the request while they were in flight), and each request's tokens so far;
the stop rules are re-derived independently. After every rule it checks:

  * every block's ``ref_cnt`` equals the number of block tables holding it;
    the free queue is exactly the ``ref_cnt == 0`` blocks (null block
    excluded), each once (a double free would break one of these);
  * every cached block of a request lies within its known tokens (never at a
    placeholder position) and carries the hash of the tokens the client was
    sent, computed here from the token ids; the update caches at least up to
    ``num_computed_tokens - num_output_placeholders``;
  * ``num_output_placeholders`` is the number of steps in flight that sample
    for the request (stale frames excluded), ``async_tokens_to_discard`` the
    number of its stale ones; so ``0 <= placeholders <= in-flight steps that
    sample for it``;
  * running + waiting are exactly the live requests, with the right statuses;
  * no ``EngineCoreOutput`` for a request after its finished one (or after an
    abort), no token after a stop, each read-back token exactly the one its
    step sampled, finish reasons as the oracle says; no step samples a token
    that the length limits make useless; ``CachedRequestData`` counts the
    placeholders and never resends a placeholder;
  * after a drain every block but the null block is free and the last
    scheduler stats (running, waiting, KV usage) are zero.

EngineCore resets the prefix cache and aborts between two
``step_with_batch_queue`` calls, when at most one step is in flight; aborts
are also tried with two (what a deeper queue would see), resets are not
(see the note on ``reset_prefix_cache``).

Settings: 150 examples x up to 40 rules, derandomized under the "ci" profile
(tests/conftest.py).
"""

from __future__ import annotations

from collections import deque

from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from engine.utils.hashing import sha256
from engine.v1.core.kv_cache_utils import hash_block_tokens, make_block_hash_with_group_id
from engine.v1.core.sched.async_scheduler import AsyncScheduler
from engine.v1.engine import FinishReason
from engine.v1.request import Request, RequestStatus
from engine.v1.utils import cdiv
from tests.helpers.core import (
    InFlightStep,
    finish_step,
    launch_step,
    make_request,
    make_scheduler,
)

BLOCK_SIZE = 16
BATCH_QUEUE_SIZE = 2  # Executor.max_concurrent_batches with async scheduling
EOS = 2
STOP = 4
# A tiny vocabulary, so generated blocks of different requests sometimes hash alike.
VOCAB = list(range(5, 13))
# Prompts start with a slice of one of these (or nothing): shared whole blocks.
PREFIX_POOL = [list(range(1000 * k, 1000 * k + 64)) for k in range(1, 4)]
MAX_DRAIN_TURNS = 3000


class Step:
    """A launched step as the test sees it."""

    def __init__(self, launched: InFlightStep) -> None:
        self.launched = launched
        # req id -> the token the worker samples for it ([] inside a prompt).
        self.sampled = launched.sampled
        # Requests whose frame in this step is stale (reset_prefix_cache).
        self.stale: set[str] = set()

    def samples_for(self, req_id: str) -> bool:
        return bool(self.sampled.get(req_id))


def chain_hashes(tokens: list[int], num_blocks: int) -> list[bytes]:
    """The cache keys of the first ``num_blocks`` blocks of ``tokens``."""
    keys, parent = [], None
    for i in range(num_blocks):
        parent = hash_block_tokens(
            sha256, parent, tokens[i * BLOCK_SIZE : (i + 1) * BLOCK_SIZE], None
        )
        keys.append(make_block_hash_with_group_id(parent, 0))
    return keys


class AsyncSchedulerMachine(RuleBasedStateMachine):
    POLICY = "fcfs"

    def __init__(self) -> None:
        super().__init__()
        self.sched: AsyncScheduler | None = None
        self.live: dict[str, Request] = {}
        self.prompts: dict[str, list[int]] = {}
        # Tokens the client received, per request (the oracle's view).
        self.tokens: dict[str, list[int]] = {}
        self.ended: set[str] = set()
        # Ended since the last schedule(): the next SchedulerOutput lists them.
        self.pending_finished: set[str] = set()
        self.in_flight: deque[Step] = deque()
        self.last_stats = None
        self.next_id = 0
        self.clock = 0.0

    # ------------------------------------------------------------------ set-up
    @initialize(
        max_model_len=st.sampled_from([96, 64, 48, 128]),
        extra_blocks=st.sampled_from([0, 0, 1, 2, 4]),
        enable_chunked_prefill=st.booleans(),
        enable_prefix_caching=st.sampled_from([True, True, False]),
        budget=st.sampled_from([64, 32, 160, 16, 100, 8, 1]),
        max_num_seqs=st.sampled_from([4, 2, 8, 3, 1]),
        threshold=st.sampled_from([0, 0, 7, 16, 40]),
        num_initial_requests=st.integers(2, 6),
        data=st.data(),
    )
    def setup(
        self,
        max_model_len,
        extra_blocks,
        enable_chunked_prefill,
        enable_prefix_caching,
        budget,
        max_num_seqs,
        threshold,
        num_initial_requests,
        data,
    ):
        if not enable_chunked_prefill:
            budget = max(budget, max_model_len)
        self.num_blocks = cdiv(max_model_len, BLOCK_SIZE) + 1 + extra_blocks
        self.max_model_len = max_model_len
        self.budget = budget
        self.max_num_seqs = max_num_seqs
        self.threshold = threshold
        self.caching = enable_prefix_caching
        self.sched = make_scheduler(
            num_blocks=self.num_blocks,
            block_size=BLOCK_SIZE,
            max_model_len=max_model_len,
            max_num_batched_tokens=budget,
            max_num_seqs=max_num_seqs,
            enable_chunked_prefill=enable_chunked_prefill,
            long_prefill_token_threshold=threshold,
            policy=self.POLICY,
            enable_prefix_caching=enable_prefix_caching,
            async_scheduling=True,
        )
        assert type(self.sched) is AsyncScheduler
        for _ in range(num_initial_requests):
            self._add_request(data)

    # ------------------------------------------------------------------ rules
    @rule(num_requests=st.integers(1, 3), data=st.data())
    def add_requests(self, num_requests, data):
        for _ in range(num_requests):
            self._add_request(data)

    def _add_request(self, data):
        prefix = data.draw(st.sampled_from([*PREFIX_POOL, []]), label="prefix")
        prefix_len = data.draw(st.sampled_from([32, 48, 16, 40, 64, 0]), label="prefix_len")
        suffix_len = data.draw(st.sampled_from([7, 15, 20, 1, 0, 33]), label="suffix_len")
        suffix = data.draw(
            st.lists(st.sampled_from(VOCAB), min_size=suffix_len, max_size=suffix_len),
            label="suffix",
        )
        tokens = (prefix[:prefix_len] + suffix)[: self.max_model_len - 1] or [VOCAB[0]]
        max_tokens = data.draw(st.sampled_from([40, 24, 17, 8, 3, 2, 1]), label="max_tokens")
        # min_tokens within the room left in the window (else the request
        # could neither stop nor be scheduled; see the sync machine).
        room = self.max_model_len - len(tokens)
        min_tokens = data.draw(st.integers(0, min(max_tokens, room, 3)), label="min_tokens")
        ignore_eos = data.draw(st.booleans(), label="ignore_eos") and data.draw(st.booleans())
        use_stop = data.draw(st.booleans(), label="use_stop")
        priority = data.draw(st.integers(0, 3), label="priority")
        if not data.draw(st.booleans(), label="same_arrival_time"):
            self.clock += 1.0
        req_id = f"r{self.next_id}"
        self.next_id += 1
        request = make_request(
            req_id,
            tokens,
            max_tokens=max_tokens,
            block_size=BLOCK_SIZE,
            priority=priority,
            arrival_time=self.clock,
            min_tokens=min_tokens,
            ignore_eos=ignore_eos,
            stop_token_ids=[STOP] if use_stop else None,
            eos_token_id=EOS,
        )
        self.sched.add_request(request)
        self.live[req_id] = request
        self.prompts[req_id] = list(tokens)
        self.tokens[req_id] = []

    @precondition(lambda self: len(self.in_flight) < BATCH_QUEUE_SIZE and self.sched.has_requests())
    @rule(tokens=st.lists(st.sampled_from([*VOCAB, *VOCAB, EOS, STOP]), min_size=5, max_size=5))
    def launch(self, tokens):
        """Schedule a step while (at most) one other is in flight."""
        self._launch(lambda i: tokens[i % len(tokens)])

    @precondition(lambda self: len(self.in_flight) > 0)
    @rule()
    def consume(self):
        """Read back the oldest step in flight."""
        self._consume()

    @precondition(lambda self: len(self.in_flight) < BATCH_QUEUE_SIZE)
    @rule(
        num_turns=st.integers(1, 8),
        tokens=st.lists(st.sampled_from([*VOCAB, *VOCAB, EOS, STOP]), min_size=7, max_size=7),
        oldest_done=st.sampled_from([False, False, True]),
    )
    def engine_turns(self, num_turns, tokens, oldest_done):
        """Whole ``step_with_batch_queue`` calls; ``oldest_done``: the oldest
        step has already finished when checked (then it is read back at once)."""
        for n in range(num_turns):
            self._engine_turn(lambda i, n=n: tokens[(i + n) % len(tokens)], oldest_done)
            self.check_all()

    @rule(data=st.data())
    def abort(self, data):
        ids = sorted(self.live)
        chosen = data.draw(st.lists(st.sampled_from(ids), max_size=3), label="ids") if ids else []
        extra = data.draw(st.sampled_from([[], ["unknown"], sorted(self.ended)[:1]]), label="extra")
        if self.in_flight:
            event(f"abort with {len(self.in_flight)} step(s) in flight")
        request_ids = chosen + extra
        result = self.sched.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED)
        expected = list(dict.fromkeys(i for i in request_ids if i in self.live))
        assert [rid for rid, _ in result] == expected
        for req_id in expected:
            request = self.live.pop(req_id)
            assert request.status == RequestStatus.FINISHED_ABORTED
            self.ended.add(req_id)
            self.pending_finished.add(req_id)

    # Only with at most one step in flight, as EngineCore calls it between two
    # step_with_batch_queue calls. With two in flight, a request reset, resumed
    # by the next step and reset again before its first stale frame arrived
    # would be told to discard only its new placeholders
    # (``async_tokens_to_discard = num_output_placeholders``, as in vLLM).
    @precondition(lambda self: self.sched is not None and len(self.in_flight) <= 1)
    @rule()
    def reset_prefix_cache(self):
        sched = self.sched
        running = [r.request_id for r in sched.running]
        # Their frames in flight carry tokens of a computation that is redone.
        for step in self.in_flight:
            for req_id in running:
                if step.samples_for(req_id):
                    step.stale.add(req_id)
                    event("reset_prefix_cache with a sampling step in flight")
        waiting_before = [r.request_id for r in sched.waiting]
        assert sched.reset_prefix_cache(reset_running_requests=True) is True
        assert sched.running == []
        waiting_after = [r.request_id for r in sched.waiting]
        if self.POLICY == "fcfs":
            # Back to the front of the waiting queue, in their running order.
            assert waiting_after == running + waiting_before
        assert sorted(waiting_after) == sorted(running + waiting_before)
        for req_id in running:
            request = self.live[req_id]
            assert request.status == RequestStatus.PREEMPTED
            assert request.num_computed_tokens == 0
        pool = sched.kv_cache_manager.block_pool
        assert pool.get_num_free_blocks() == self.num_blocks - 1
        assert all(b.block_hash is None for b in pool.blocks)

    @precondition(lambda self: self.sched is not None and (self.live or self.in_flight))
    @rule()
    def drain(self):
        """Run the engine loop, sampling EOS everywhere, until nothing is left."""
        while len(self.in_flight) >= BATCH_QUEUE_SIZE:  # as after a launch
            self._consume()
        for _ in range(MAX_DRAIN_TURNS):
            if not (self.live or self.in_flight or self.sched.has_requests()):
                break
            self._engine_turn(lambda i: EOS, oldest_done=False)
            self.check_all()
        assert not self.live, f"requests never finished: {sorted(self.live)}"
        assert not self.in_flight and not self.sched.has_requests()
        self.check_all_blocks_free()
        stats = self.last_stats
        assert stats.num_running_reqs == 0 and stats.num_waiting_reqs == 0
        assert stats.kv_cache_usage == 0.0

    # ------------------------------------------------------------------ the engine
    def _engine_turn(self, pick_token, oldest_done: bool) -> None:
        """One ``EngineCore.step_with_batch_queue`` call, same control flow."""
        assert len(self.in_flight) < BATCH_QUEUE_SIZE
        if self.sched.has_requests():
            step = self._launch(pick_token)
            executed = step.launched.scheduler_output.total_num_scheduled_tokens > 0
            if executed and len(self.in_flight) < BATCH_QUEUE_SIZE and not oldest_done:
                return
        elif not self.in_flight:
            return
        self._consume()

    def _in_flight_sampling(self, req_id: str) -> tuple[int, int]:
        """(fresh, stale) frames in flight that carry a token for the request."""
        fresh = sum(1 for s in self.in_flight if s.samples_for(req_id) and req_id not in s.stale)
        stale = sum(1 for s in self.in_flight if s.samples_for(req_id) and req_id in s.stale)
        return fresh, stale

    def _launch(self, pick_token) -> Step:
        sched = self.sched
        preempted_before = {
            r.request_id for r in sched.waiting if r.status == RequestStatus.PREEMPTED
        }
        # Before schedule(): what the worker is owed for each cached request.
        fresh_before = {rid: self._in_flight_sampling(rid)[0] for rid in self.live}
        launched = launch_step(sched)
        out = launched.scheduler_output
        scheduled = out.num_scheduled_tokens
        for i, req_id in enumerate(scheduled):
            if launched.sampled[req_id]:  # it samples: pick its token
                launched.sampled[req_id] = [pick_token(i)]
        step = Step(launched)

        assert out.finished_req_ids == self.pending_finished
        self.pending_finished = set()
        assert out.total_num_scheduled_tokens == sum(scheduled.values()) <= self.budget
        assert all(n > 0 for n in scheduled.values())
        if self.threshold:
            assert all(n <= self.threshold for n in scheduled.values())
        assert not (out.preempted_req_ids & set(scheduled))
        if out.preempted_req_ids:
            event("step preempted a request")
            assert out.scheduled_new_reqs == [] and not out.scheduled_cached_reqs.resumed_req_ids
        for req_id in out.preempted_req_ids:
            request = self.live[req_id]
            assert request.status == RequestStatus.PREEMPTED
            assert request.num_computed_tokens == 0
            if self._in_flight_sampling(req_id)[0]:
                event("preempted with its token in flight")
        if any(n.num_computed_tokens for n in out.scheduled_new_reqs):
            event("step admitted a request with a prefix-cache hit")

        cached = out.scheduled_cached_reqs
        assert cached.resumed_req_ids == set(cached.req_ids) & preempted_before
        for i, req_id in enumerate(cached.req_ids):
            request = self.live[req_id]
            # Placeholders count as output tokens: the worker holds them as -1.
            assert cached.num_output_tokens[i] == len(self.tokens[req_id]) + fresh_before[req_id]
            assert cached.num_computed_tokens[i] + scheduled[req_id] == request.num_computed_tokens
            if req_id in cached.all_token_ids:
                # A full list goes only to a request with nothing in flight
                # for it: it holds real tokens only.
                assert fresh_before[req_id] == 0
                assert cached.all_token_ids[req_id] == self.prompts[req_id] + self.tokens[req_id]
        for new in out.scheduled_new_reqs:
            assert new.prompt_token_ids == self.prompts[new.req_id]

        for req_id in scheduled:
            request = self.live[req_id]
            assert request.status == RequestStatus.RUNNING
            if step.samples_for(req_id):
                # A step is never scheduled for a token the length limits
                # already rule out (vLLM's max_tokens rule, the window cap).
                coming = len(self.tokens[req_id]) + fresh_before[req_id]
                assert coming < request.max_tokens, (req_id, coming)
                assert len(self.prompts[req_id]) + coming < self.max_model_len
            else:
                assert request.is_prefill_chunk
                assert request.num_output_placeholders == fresh_before[req_id]
        self.in_flight.append(step)
        return step

    def _consume(self) -> None:
        sched = self.sched
        step = self.in_flight.popleft()
        out = step.launched.scheduler_output
        status_before = {rid: r.status for rid, r in self.live.items()}
        result = finish_step(sched, step.launched)
        outputs = [o for eco in result.engine_core_outputs.values() for o in eco.outputs]
        by_id = {o.request_id: o for o in outputs}
        assert len(by_id) == len(outputs), "two outputs for one request in one step"
        assert set(by_id) <= set(out.num_scheduled_tokens)
        for req_id in out.num_scheduled_tokens:
            sampled = step.sampled[req_id]
            if req_id not in self.live:
                # Finished or aborted since the launch: nothing reaches the client.
                assert req_id not in by_id, f"output for {req_id} after it ended"
                if sampled:
                    event("dropped the frame of an ended request")
                continue
            request = self.live[req_id]
            if not sampled or req_id in step.stale:
                assert req_id not in by_id
                assert list(request.output_token_ids) == self.tokens[req_id]
                if sampled:
                    event("dropped a stale frame")
                continue
            self.tokens[req_id] += sampled
            assert list(request.output_token_ids) == self.tokens[req_id]
            output = by_id[req_id]
            assert output.new_token_ids == sampled
            reason, stop_reason = self._expected_finish(req_id)
            assert output.finish_reason == reason, (req_id, self.tokens[req_id])
            if reason is None:
                assert not request.is_finished()
                assert req_id in sched.requests
                continue
            event(f"finished: {reason}")
            if request.num_output_placeholders or self._in_flight_sampling(req_id)[0]:
                event("finished with a step for it still in flight")
            if status_before[req_id] == RequestStatus.PREEMPTED:
                event("finished while preempted (its token was in flight)")
            assert output.stop_reason == stop_reason
            assert request.is_finished()
            assert req_id not in sched.requests
            assert request not in sched.running and request not in sched.waiting
            self.live.pop(req_id)
            self.ended.add(req_id)
            self.pending_finished.add(req_id)

        stats = result.stats
        assert stats.num_running_reqs == len(sched.running)
        assert stats.num_waiting_reqs == len(sched.waiting)
        assert 0.0 <= stats.kv_cache_usage <= 1.0
        self.last_stats = stats

    def _expected_finish(self, req_id: str) -> tuple[FinishReason | None, int | None]:
        """The stop rules, re-derived, after the last token the client got."""
        params = self.live[req_id].sampling_params
        outputs = self.tokens[req_id]
        if len(outputs) < params.min_tokens:
            return None, None
        last = outputs[-1]
        if not params.ignore_eos and last == EOS:
            return FinishReason.STOP, None
        if last in params.stop_token_ids:
            return FinishReason.STOP, last
        num_tokens = len(self.prompts[req_id]) + len(outputs)
        if num_tokens >= self.max_model_len or len(outputs) >= params.max_tokens:
            return FinishReason.LENGTH, None
        return None, None

    # ------------------------------------------------------------------ checks
    def _manager(self):
        return self.sched.kv_cache_manager.coordinator.single_type_managers[0]

    def _table(self, req_id: str) -> list:
        return self._manager().req_to_blocks.get(req_id, [])

    def check_all(self) -> None:
        self.check_blocks()
        self.check_requests()

    @invariant()
    def check_blocks(self):
        if self.sched is None:
            return
        pool = self.sched.kv_cache_manager.block_pool
        tables = self._manager().req_to_blocks
        null = pool.null_block
        holders = {block.block_id: 0 for block in pool.blocks}
        for req_id, table in tables.items():
            ids = [b.block_id for b in table]
            assert len(ids) == len(set(ids)), f"{req_id} holds a block twice: {ids}"
            assert null not in table
            for block in table:
                holders[block.block_id] += 1
        for block in pool.blocks:
            if not block.is_null:
                assert block.ref_cnt == holders[block.block_id], block
        free_ids = [b.block_id for b in pool.free_block_queue.get_all_free_blocks()]
        assert len(free_ids) == len(set(free_ids)), f"a block is free twice: {free_ids}"
        assert null.block_id not in free_ids and null.ref_cnt == 0
        assert set(free_ids) == {
            b.block_id for b in pool.blocks if b.ref_cnt == 0 and not b.is_null
        }
        assert pool.get_num_free_blocks() == len(free_ids)

        for req_id, table in tables.items():
            request = self.sched.requests[req_id]
            known = self.prompts[req_id] + self.tokens[req_id]
            hashed = [i for i, b in enumerate(table) if b.block_hash is not None]
            # Cached blocks are a prefix of the table ...
            assert hashed == list(range(len(hashed))), (req_id, hashed)
            # ... whose tokens are all known: never a placeholder position,
            # and never beyond what is computed or scheduled.
            assert len(hashed) * BLOCK_SIZE <= min(len(known), request.num_computed_tokens)
            expected = chain_hashes(known, len(hashed))
            for i in hashed:
                assert table[i].block_hash == expected[i], (req_id, i)
            if self.caching:
                # Everything known and computed is cached (the update caches up
                # to num_computed - placeholders).
                lower = request.num_computed_tokens - request.num_output_placeholders
                assert len(hashed) >= lower // BLOCK_SIZE, (req_id, len(hashed), lower)
        if not self.caching:
            assert all(b.block_hash is None for b in pool.blocks)

    @invariant()
    def check_requests(self):
        if self.sched is None:
            return
        sched = self.sched
        running = [r.request_id for r in sched.running]
        waiting = [r.request_id for r in sched.waiting]
        assert len(running) == len(set(running)) and len(waiting) == len(set(waiting))
        assert not set(running) & set(waiting)
        assert not sched.skipped_waiting
        assert set(running) | set(waiting) == set(self.live) == set(sched.requests)
        assert sched.get_num_unfinished_requests() == len(self.live)
        assert len(running) <= self.max_num_seqs
        assert set(self._manager().req_to_blocks) == set(running)
        for req_id, request in self.live.items():
            fresh, stale = self._in_flight_sampling(req_id)
            # One placeholder per step in flight that samples for it.
            assert request.num_output_placeholders == fresh, (req_id, fresh)
            assert request.async_tokens_to_discard == stale, (req_id, stale)
            assert list(request.output_token_ids) == self.tokens[req_id]
        for request in sched.running:
            assert request.status == RequestStatus.RUNNING
            assert len(self._table(request.request_id)) == cdiv(
                request.num_computed_tokens, BLOCK_SIZE
            )
            assert 0 < request.num_computed_tokens < self.max_model_len
            if request.num_output_placeholders:
                # The last placeholder's position is the next to compute.
                assert request.num_computed_tokens == (
                    request.num_tokens + request.num_output_placeholders - 1
                )
        for request in sched.waiting:
            assert request.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED)
            assert request.num_computed_tokens == 0
            assert self._table(request.request_id) == []
        for req_id in self.ended:
            assert req_id not in sched.requests
        assert sched.has_finished_requests() == bool(self.pending_finished)

    def check_all_blocks_free(self):
        pool = self.sched.kv_cache_manager.block_pool
        assert pool.get_num_free_blocks() == self.num_blocks - 1
        assert all(b.ref_cnt == 0 for b in pool.blocks)
        assert self._manager().req_to_blocks == {}
        assert self.sched.kv_cache_manager.usage == 0.0

    def teardown(self):
        if self.sched is None:
            return
        result = self.sched.finish_requests(None, RequestStatus.FINISHED_ABORTED)
        assert {rid for rid, _ in result} == set(self.live)
        self.pending_finished |= set(self.live)
        self.ended |= set(self.live)
        self.live.clear()
        while self.in_flight:
            self._consume()
        self.check_all()
        self.check_all_blocks_free()
        out = self.sched.schedule()
        assert out.finished_req_ids == self.pending_finished
        assert out.num_scheduled_tokens == {}
        assert not self.sched.has_requests()


class FCFSAsyncSchedulerMachine(AsyncSchedulerMachine):
    POLICY = "fcfs"


class PriorityAsyncSchedulerMachine(AsyncSchedulerMachine):
    POLICY = "priority"


_SETTINGS = settings(
    max_examples=150,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)

TestFCFSAsyncScheduler = FCFSAsyncSchedulerMachine.TestCase
TestFCFSAsyncScheduler.settings = _SETTINGS
TestPriorityAsyncScheduler = PriorityAsyncSchedulerMachine.TestCase
TestPriorityAsyncScheduler.settings = _SETTINGS
