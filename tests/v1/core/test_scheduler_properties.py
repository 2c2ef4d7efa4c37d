"""Property tests of the V1 scheduler + KV cache manager, driven by Hypothesis.

A ``RuleBasedStateMachine`` plays EngineCore against a real ``Scheduler`` on a
small KV pool (so preemption is common): it adds requests (random lengths,
some sharing prefixes from a small pool so that prefix-cache hits happen,
random priorities, some parked on a grammar that is "compiled" later),
runs steps with a hand-made worker output (random EOS, stop tokens and
ordinary tokens), aborts random requests (also while a step is "on the
GPU"), and drains. After every operation it checks the
bookkeeping that must hold whatever the schedule looked like:

  * every block's ``ref_cnt`` equals the number of block tables holding it;
  * the free queue holds exactly the blocks with ``ref_cnt == 0`` (the null
    block excluded), each once;
  * no block appears twice in one table; the null block is in no table and
    not in the free queue;
  * a block's cached hash always matches the hash of the tokens the request
    holding it has at that position (a prefix hit never shares wrong KV);
  * running + waiting + skipped_waiting are exactly the live requests, with
    the right statuses, and every running request's table covers exactly its
    computed tokens; a request whose grammar is not ready is never scheduled;
  * every step respects the token budget, ``max_num_seqs``, the long-prefill
    threshold, "no admissions after a preemption", and finishes exactly the
    requests an independent stop-condition oracle says it should;
  * finished ids reach the worker in the next ``SchedulerOutput`` exactly once;
  * a drain ends every request, ties on ``(priority, arrival_time)``
    included (vLLM's default admission, ``scheduler_reserve_full_isl``, keeps
    two tied requests from preempting each other in turn);
  * once everything has ended (drained or aborted), every block but the null
    block is free.

Settings: 150 examples x up to 40 rules per policy, derandomized under the
"ci" profile (tests/conftest.py).
"""

from __future__ import annotations

from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from engine.v1.core.kv_cache_utils import make_block_hash_with_group_id
from engine.v1.engine import FinishReason
from engine.v1.request import Request, RequestStatus
from engine.v1.utils import cdiv
from tests.helpers.core import (
    AnyTokenGrammar,
    make_model_runner_output,
    make_request,
    make_scheduler,
)

BLOCK_SIZE = 16
EOS = 2
STOP = 4
# Sampled tokens come from a tiny vocabulary so that generated blocks of
# different requests sometimes hash alike.
VOCAB = list(range(5, 13))
# Prompts start with a slice of one of these (or nothing), so prompts share
# whole blocks and the prefix cache gets hits.
PREFIX_POOL = [list(range(1000 * k, 1000 * k + 64)) for k in range(1, 4)]
GRAMMAR = RequestStatus.WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR


class FakeGrammarRequest:
    """Stands in for vLLM's StructuredOutputRequest: ``grammar`` is None
    until compiled."""

    grammar: AnyTokenGrammar | None = None


MAX_DRAIN_STEPS = 3000


def expected_finish(request: Request, max_model_len: int) -> tuple[FinishReason | None, int | None]:
    """Independent oracle of the stop rules after the last appended token."""
    params = request.sampling_params
    outputs = request.output_token_ids
    if len(outputs) < params.min_tokens:
        return None, None
    last = outputs[-1]
    if not params.ignore_eos and last == EOS:
        return FinishReason.STOP, None
    if last in params.stop_token_ids:
        return FinishReason.STOP, last
    if request.num_tokens >= max_model_len or len(outputs) >= params.max_tokens:
        return FinishReason.LENGTH, None
    return None, None


class SchedulerMachine(RuleBasedStateMachine):
    POLICY = "fcfs"

    def __init__(self) -> None:
        super().__init__()
        self.sched = None
        self.live: dict[str, Request] = {}
        self.ended: set[str] = set()
        # Ended since the last schedule(): the next SchedulerOutput must list them.
        self.pending_finished: set[str] = set()
        self.next_id = 0
        self.clock = 0.0
        # Requests the worker has been told about (NewRequestData sent once).
        self.ever_scheduled: set[str] = set()
        self.prev_scheduled: set[str] = set()

    # ------------------------------------------------------------------ set-up
    @initialize(
        max_model_len=st.sampled_from([128, 96, 64, 48]),
        extra_blocks=st.integers(0, 4),
        enable_chunked_prefill=st.booleans(),
        enable_prefix_caching=st.booleans(),
        budget=st.sampled_from([64, 32, 160, 16, 100, 8, 1]),
        max_num_seqs=st.sampled_from([4, 2, 8, 3, 6, 1]),
        threshold=st.sampled_from([0, 0, 1, 7, 16, 40]),
        num_initial_requests=st.integers(2, 8),
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
        self.chunked = enable_chunked_prefill
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
        )
        # Start every run with a workload, so that short runs still schedule.
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
        prefix = prefix[:prefix_len]
        tokens = (prefix + suffix)[: self.max_model_len - 1] or [VOCAB[0]]
        max_tokens = data.draw(st.sampled_from([40, 24, 17, 8, 3, 1]), label="max_tokens")
        # min_tokens stays within the room left in the context window. Past
        # it a request could neither stop (min_tokens not yet met, so the
        # length check is never reached) nor be scheduled (its next position
        # would be max_model_len): it would stay RUNNING forever. vLLM's
        # check_stop has the same order, so the input must keep it in range.
        room = self.max_model_len - len(tokens)
        min_tokens = data.draw(st.integers(0, min(max_tokens, room, 3)), label="min_tokens")
        ignore_eos = data.draw(st.booleans(), label="ignore_eos") and data.draw(st.booleans())
        use_stop = data.draw(st.booleans(), label="use_stop")
        priority = data.draw(st.integers(0, 3), label="priority")
        # Now and then a request arrives at the same time as the one before,
        # so some tie on (priority, arrival_time), as the n > 1 children of
        # one request do. The PRIORITY victim is then the first tied request
        # in the running list (vLLM's rule); admitted by first chunk only, two
        # of them can preempt each other for ever (test_scheduler.py), but not
        # with the default full-sequence admission used here.
        if not data.draw(st.booleans(), label="same_arrival_time"):
            self.clock += 1.0

        # A quarter of the requests wait for a grammar first (skipped_waiting).
        park = data.draw(st.booleans(), label="park") and data.draw(st.booleans())

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
        if park:
            request.status = GRAMMAR
            request.structured_output_request = FakeGrammarRequest()
        self.sched.add_request(request)
        self.live[req_id] = request
        assert request.status == (GRAMMAR if park else RequestStatus.WAITING)
        assert (request in self.sched.skipped_waiting) == park

    def _compile_grammars(self, req_ids) -> None:
        for req_id in req_ids:
            self.live[req_id].structured_output_request.grammar = AnyTokenGrammar()

    def _uncompiled(self) -> list[str]:
        return sorted(
            rid
            for rid, r in self.live.items()
            if r.structured_output_request is not None
            and r.structured_output_request.grammar is None
        )

    @precondition(lambda self: self.sched is not None and self._uncompiled())
    @rule(data=st.data())
    def compile_grammars(self, data):
        self._compile_grammars(
            data.draw(st.lists(st.sampled_from(self._uncompiled()), min_size=1), label="ids")
        )

    @rule(
        num_steps=st.integers(1, 6),
        # EOS and STOP are 1 in 18 each, and last (Hypothesis favours the first
        # choices): requests usually live long enough to cross block boundaries.
        tokens=st.lists(st.sampled_from([*VOCAB, *VOCAB, EOS, STOP]), min_size=7, max_size=7),
        abort_in_flight=st.sampled_from([(), (), (), (0,), (1,), (2, 0)]),
    )
    def step(self, num_steps, tokens, abort_in_flight):
        for n in range(num_steps):
            # Only the first of these steps may see a mid-step abort.
            self._step(
                lambda i, n=n: tokens[(i + n) % len(tokens)], abort_in_flight if n == 0 else ()
            )
            if n + 1 < num_steps:
                self.check_blocks()
                self.check_queues()

    @rule(data=st.data())
    def abort(self, data):
        ids = sorted(self.live)
        chosen = data.draw(st.lists(st.sampled_from(ids), max_size=3), label="ids") if ids else []
        extra = data.draw(st.sampled_from([[], ["unknown"], sorted(self.ended)[:1]]), label="extra")
        self._abort(chosen + extra)

    def _abort(self, request_ids: list[str]) -> None:
        result = self.sched.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED)
        expected = list(dict.fromkeys(i for i in request_ids if i in self.live))
        assert [rid for rid, _ in result] == expected
        for req_id in expected:
            request = self.live.pop(req_id)
            assert request.status == RequestStatus.FINISHED_ABORTED
            self.ended.add(req_id)
            self.pending_finished.add(req_id)

    @precondition(lambda self: len(self.live) > 0)
    @rule()
    def drain(self):
        """Step with EOS everywhere until every request has ended."""
        self._compile_grammars(self._uncompiled())
        for _ in range(MAX_DRAIN_STEPS):
            if not self.live:
                break
            self._step(lambda i: EOS, [])
            self.check_blocks()
            self.check_queues()
        assert not self.live, f"requests never finished: {sorted(self.live)}"
        assert not self.sched.has_unfinished_requests()
        self.check_all_blocks_free()

    # ------------------------------------------------------------------ a step
    def _step(self, pick_token, abort_in_flight):
        sched = self.sched
        preempted_before = {
            r.request_id for r in sched.waiting if r.status == RequestStatus.PREEMPTED
        }
        out = sched.schedule()

        assert out.finished_req_ids == self.pending_finished
        self.pending_finished = set()

        scheduled = out.num_scheduled_tokens
        assert out.total_num_scheduled_tokens == sum(scheduled.values()) <= self.budget
        assert all(n > 0 for n in scheduled.values())
        if self.threshold:
            assert all(n <= self.threshold for n in scheduled.values())
        assert len(sched.running) <= self.max_num_seqs

        new_ids = [n.req_id for n in out.scheduled_new_reqs]
        cached = out.scheduled_cached_reqs
        assert len(set(new_ids) | set(cached.req_ids)) == len(new_ids) + len(cached.req_ids)
        assert set(new_ids) | set(cached.req_ids) == set(scheduled)
        # The diff protocol: full request data exactly once, the first time it
        # is scheduled; a preempted request comes back as "resumed"; full token
        # lists go to every cached request the worker did not see last step.
        assert not set(new_ids) & self.ever_scheduled
        assert set(cached.req_ids) <= self.ever_scheduled
        assert cached.resumed_req_ids == set(cached.req_ids) & preempted_before
        assert set(cached.all_token_ids) == set(cached.req_ids) - self.prev_scheduled
        assert len(cached.new_block_ids) == len(cached.num_computed_tokens) == cached.num_reqs
        self.ever_scheduled |= set(scheduled)
        self.prev_scheduled = set(scheduled)
        assert not (out.preempted_req_ids & set(scheduled))
        if out.preempted_req_ids:
            # Nobody is admitted in a step that preempted.
            assert new_ids == [] and cached.resumed_req_ids == set()
        if out.preempted_req_ids:
            event("step preempted a request")
        if cached.resumed_req_ids:
            event("step resumed a preempted request")
        if any(n.num_computed_tokens for n in out.scheduled_new_reqs):
            event("step admitted a request with a prefix-cache hit")
        for req_id in out.preempted_req_ids:
            request = self.live[req_id]
            assert request.status == RequestStatus.PREEMPTED
            assert request.num_computed_tokens == 0
        for new in out.scheduled_new_reqs:
            request = self.live[new.req_id]
            if request.structured_output_request is not None:
                assert request.structured_output_request.grammar is not None
                event("step admitted a request whose grammar had been compiled")
            assert new.num_computed_tokens % BLOCK_SIZE == 0
            assert new.num_computed_tokens < request.num_tokens
            if not self.caching:
                assert new.num_computed_tokens == 0
            assert new.num_computed_tokens + scheduled[new.req_id] == request.num_computed_tokens
            assert new.block_ids == (self._table(new.req_id),)
        for req_id, num_computed, new_blocks in zip(
            cached.req_ids, cached.num_computed_tokens, cached.new_block_ids
        ):
            request = self.live[req_id]
            assert num_computed + scheduled[req_id] == request.num_computed_tokens
            if req_id in cached.resumed_req_ids:
                assert cached.all_token_ids[req_id] == list(request.all_token_ids)
                assert new_blocks == (self._table(req_id),)
        for req_id in scheduled:
            request = self.live[req_id]
            assert request.status == RequestStatus.RUNNING
            assert request.num_computed_tokens <= request.num_tokens
            assert request.is_prefill_chunk == (request.num_computed_tokens < request.num_tokens)
            if (
                not self.chunked
                and not self.threshold
                and (req_id in new_ids or req_id in cached.resumed_req_ids)
            ):
                # Without chunking (and no threshold clamping) a prompt runs whole.
                assert not request.is_prefill_chunk

        # The fake worker: a request at the end of its sequence samples one token.
        sampled: dict[str, list[int]] = {}
        for i, req_id in enumerate(scheduled):
            request = self.live[req_id]
            sampled[req_id] = [] if request.is_prefill_chunk else [pick_token(i)]
        mro = make_model_runner_output(sched, out, sampled)

        # Some clients disconnect while the step runs.
        ids = list(scheduled)
        aborted_now = {ids[i] for i in abort_in_flight if i < len(ids)}
        if aborted_now:
            event("abort while the step was running")
            result = sched.finish_requests(aborted_now, RequestStatus.FINISHED_ABORTED)
            assert {rid for rid, _ in result} == aborted_now
            for req_id in aborted_now:
                self.live.pop(req_id)
                self.ended.add(req_id)
                self.pending_finished.add(req_id)

        before = {
            rid: list(self.live[rid].output_token_ids) for rid in scheduled if rid in self.live
        }
        engine_core_outputs = sched.update_from_output(out, mro)
        outputs = {o.request_id: o for eco in engine_core_outputs.values() for o in eco.outputs}
        assert set(outputs) <= set(scheduled) - aborted_now

        for req_id, old_outputs in before.items():
            request = self.live[req_id]
            new_tokens = sampled[req_id]
            assert list(request.output_token_ids) == old_outputs + new_tokens
            if not new_tokens:
                assert req_id not in outputs
                continue
            output = outputs[req_id]
            assert output.new_token_ids == new_tokens
            reason, stop_reason = expected_finish(request, self.max_model_len)
            assert output.finish_reason == reason, (req_id, request.output_token_ids)
            if reason is None:
                assert request.status == RequestStatus.RUNNING
                assert req_id in sched.requests
            else:
                event(f"finished: {reason}")
                assert output.stop_reason == stop_reason
                assert request.is_finished()
                assert req_id not in sched.requests
                assert request not in sched.running
                self.live.pop(req_id)
                self.ended.add(req_id)
                self.pending_finished.add(req_id)

        stats = engine_core_outputs[0].scheduler_stats
        assert stats.num_running_reqs == len(sched.running)
        assert stats.num_waiting_reqs == len(sched.waiting)
        assert stats.num_skipped_waiting_reqs == len(sched.skipped_waiting)
        assert stats.num_preemptions == len(out.preempted_req_ids)
        assert 0.0 <= stats.kv_cache_usage <= 1.0
        assert 0 <= stats.prefix_cache_stats.hits <= stats.prefix_cache_stats.queries

    # ------------------------------------------------------------------ checks
    def _manager(self):
        return self.sched.kv_cache_manager.coordinator.single_type_managers[0]

    def _table(self, req_id: str) -> list[int]:
        return [b.block_id for b in self._manager().req_to_blocks.get(req_id, [])]

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
            assert null not in table, f"{req_id} holds the null block"
            for block in table:
                assert pool.blocks[block.block_id] is block
                holders[block.block_id] += 1
        for block in pool.blocks:
            if block.is_null:
                continue
            assert block.ref_cnt == holders[block.block_id], block

        free = pool.free_block_queue.get_all_free_blocks()
        free_ids = [b.block_id for b in free]
        assert len(free_ids) == len(set(free_ids)), f"duplicate free blocks: {free_ids}"
        assert null not in free
        assert null.block_id == 0 and null.is_null and null.ref_cnt == 0
        assert set(free_ids) == {
            b.block_id for b in pool.blocks if b.ref_cnt == 0 and not b.is_null
        }
        assert pool.get_num_free_blocks() == len(free_ids)

        # A cached block's hash is the hash of the tokens at its position in
        # every request that holds it (hits never share wrong contents).
        for req_id, table in tables.items():
            request = self.sched.requests[req_id]
            for i, block in enumerate(table):
                if block.block_hash is not None:
                    assert i < len(request.block_hashes)
                    assert block.block_hash == make_block_hash_with_group_id(
                        request.block_hashes[i], 0
                    )
        if not self.caching:
            assert all(b.block_hash is None for b in pool.blocks)

    @invariant()
    def check_queues(self):
        if self.sched is None:
            return
        sched = self.sched
        running = [r.request_id for r in sched.running]
        waiting = [r.request_id for r in [*sched.waiting, *sched.skipped_waiting]]
        assert len(running) == len(set(running)) and len(waiting) == len(set(waiting))
        assert not set(running) & set(waiting)
        assert set(running) | set(waiting) == set(self.live) == set(sched.requests)
        assert sched.get_num_unfinished_requests() == len(self.live)
        assert len(running) <= self.max_num_seqs
        for request in sched.running:
            assert request.status == RequestStatus.RUNNING
            assert request is self.live[request.request_id]
            # The table covers exactly the tokens computed so far.
            assert len(self._table(request.request_id)) == cdiv(
                request.num_computed_tokens, BLOCK_SIZE
            )
            assert 0 < request.num_computed_tokens <= request.num_tokens < self.max_model_len
        for request in sched.waiting:
            assert request.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED)
            assert (request.status == RequestStatus.PREEMPTED) == (request.num_preemptions > 0)
            assert request.num_computed_tokens == 0
            assert self._table(request.request_id) == []
        for request in sched.skipped_waiting:
            # Parked on its grammar, or promoted and not admitted yet.
            assert request.status in (GRAMMAR, RequestStatus.WAITING)
            assert request.structured_output_request is not None
            assert request.num_preemptions == 0 and request.num_computed_tokens == 0
            assert self._table(request.request_id) == []
        assert set(self._manager().req_to_blocks) == set(running)
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
        self.live.clear()
        self.check_queues()
        self.check_blocks()
        self.check_all_blocks_free()
        out = self.sched.schedule()
        assert out.finished_req_ids == self.pending_finished
        assert out.num_scheduled_tokens == {}
        assert not self.sched.has_requests()


class FCFSSchedulerMachine(SchedulerMachine):
    POLICY = "fcfs"


class PrioritySchedulerMachine(SchedulerMachine):
    POLICY = "priority"


_SETTINGS = settings(
    max_examples=150,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)

TestFCFSScheduler = FCFSSchedulerMachine.TestCase
TestFCFSScheduler.settings = _SETTINGS
TestPriorityScheduler = PrioritySchedulerMachine.TestCase
TestPriorityScheduler.settings = _SETTINGS
