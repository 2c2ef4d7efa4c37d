"""Unit tests of the AsyncScheduler (engine/v1/core/sched/async_scheduler.py).

The scheduler is driven the way ``EngineCore.step_with_batch_queue`` drives
it with a batch queue of two: step N+1 is scheduled (``launch_step``) before
step N's output is read back (``finish_step``). What the fake worker samples
is fixed at launch, as the runner decides it then: a request whose scheduled
tokens stop inside its prompt samples nothing, every other one token.

Every expected number is worked out in a comment from block_size = 16. The
placeholder rule used throughout: each step that will sample a token for a
request adds one ``num_output_placeholders``; each token read back removes
one. A decoding request therefore has ``num_computed_tokens = num_tokens +
num_output_placeholders - 1`` (the last placeholder's position is computed by
the next step).
"""

from __future__ import annotations

from collections import Counter

import pytest

from engine.utils.hashing import sha256
from engine.v1.core.kv_cache_utils import hash_block_tokens, make_block_hash_with_group_id
from engine.v1.core.sched.async_scheduler import AsyncScheduler
from engine.v1.engine import FinishReason
from engine.v1.request import RequestStatus
from tests.helpers.core import (
    DEFAULT_SAMPLED_TOKEN_ID,
    assert_block_pool_consistent,
    finish_step,
    get_request_block_ids,
    launch_step,
    make_request,
    make_scheduler,
)

BS = 16
EOS = 2
STOP = 4
TOK = DEFAULT_SAMPLED_TOKEN_ID  # what launch_step samples by default (100)


def prompt(num_tokens: int, start: int = 1000) -> list[int]:
    """``num_tokens`` distinct token ids; different ``start``s never share a block."""
    return list(range(start, start + num_tokens))


def async_scheduler(**kwargs) -> AsyncScheduler:
    sched = make_scheduler(async_scheduling=True, **kwargs)
    assert type(sched) is AsyncScheduler
    return sched


def block_ids(sched, req_id: str) -> list[int]:
    return get_request_block_ids(sched.kv_cache_manager, req_id)


def block_hashes(sched, req_id: str) -> list[bytes | None]:
    """The cached hash of each block in the request's table (None: not cached)."""
    pool = sched.kv_cache_manager.block_pool
    return [pool.blocks[i].block_hash for i in block_ids(sched, req_id)]


def expected_hash(tokens: list[int], num_blocks: int) -> bytes:
    """The hash of block ``num_blocks - 1`` of ``tokens``, chained from the
    start, computed here from the token ids (not from the request)."""
    parent = None
    for i in range(num_blocks):
        parent = hash_block_tokens(sha256, parent, tokens[i * BS : (i + 1) * BS], None)
    return make_block_hash_with_group_id(parent, 0)


def num_free(sched) -> int:
    return sched.kv_cache_manager.block_pool.get_num_free_blocks()


def assert_ref_counts_match_tables(sched) -> None:
    """Every block's ref_cnt is the number of block tables holding it, and
    the free queue is exactly the unreferenced blocks (the pool's own check)."""
    manager = sched.kv_cache_manager.coordinator.single_type_managers[0]
    holders = Counter(b.block_id for table in manager.req_to_blocks.values() for b in table)
    for block in sched.kv_cache_manager.block_pool.blocks:
        if not block.is_null:
            assert block.ref_cnt == holders[block.block_id], block
    assert_block_pool_consistent(sched.kv_cache_manager.block_pool)


def count_frees(monkeypatch: pytest.MonkeyPatch, sched) -> Counter:
    """Count ``kv_cache_manager.free`` calls per request id."""
    calls: Counter = Counter()
    original = sched.kv_cache_manager.free

    def free(request):
        calls[request.request_id] += 1
        original(request)

    monkeypatch.setattr(sched.kv_cache_manager, "free", free)
    return calls


# ---------------------------------------------------------------------------
# Placeholders
# ---------------------------------------------------------------------------
def test_placeholder_only_when_the_last_prompt_chunk_is_scheduled():
    # A 40-token prompt with a budget of 16: chunks of 16, 16, 8.
    sched = async_scheduler(max_num_batched_tokens=16)
    sched.add_request(make_request("r", prompt(40), max_tokens=5))
    r = sched.requests["r"]

    s1 = launch_step(sched)
    assert s1.scheduler_output.num_scheduled_tokens == {"r": 16}
    # 16 < 40: a mid-prompt chunk samples nothing, so no placeholder.
    assert (r.num_computed_tokens, r.num_output_placeholders) == (16, 0)
    assert s1.sampled == {"r": []}
    s2 = launch_step(sched)  # scheduled while chunk 1 is in flight
    assert s2.scheduler_output.num_scheduled_tokens == {"r": 16}
    assert (r.num_computed_tokens, r.num_output_placeholders) == (32, 0)
    assert finish_step(sched, s1).outputs == {}

    s3 = launch_step(sched)
    # The last 40 - 32 = 8 prompt tokens: this step samples the first output.
    assert s3.scheduler_output.num_scheduled_tokens == {"r": 8}
    assert (r.num_computed_tokens, r.num_output_placeholders) == (40, 1)
    assert not r.is_prefill_chunk
    assert s3.sampled == {"r": [TOK]}
    assert finish_step(sched, s2).outputs == {}  # chunk 2 sampled nothing
    assert r.num_output_placeholders == 1

    s4 = launch_step(sched, {"r": 201})
    # Decoding from the placeholder: 40 tokens + 1 placeholder - 40 computed = 1.
    assert s4.scheduler_output.num_scheduled_tokens == {"r": 1}
    assert (r.num_computed_tokens, r.num_output_placeholders) == (41, 2)
    out = finish_step(sched, s3).outputs
    assert out["r"].new_token_ids == [TOK]
    assert r.num_output_placeholders == 1
    assert list(r.output_token_ids) == [TOK]


def test_placeholders_in_steady_decode_and_in_cached_request_data():
    sched = async_scheduler()
    sched.add_request(make_request("r", prompt(8), max_tokens=50))
    r = sched.requests["r"]
    in_flight = [launch_step(sched, {"r": 200})]
    assert r.num_output_placeholders == 1  # the whole prompt: samples token 1
    for k in range(1, 8):
        step = launch_step(sched, {"r": 200 + k})
        # Two steps in flight, each sampling for r.
        assert r.num_output_placeholders == 2
        cached = step.scheduler_output.scheduled_cached_reqs
        assert cached.req_ids == ["r"]
        # Before this step: k - 1 tokens read back + 1 in flight. The worker
        # keeps the in-flight one as -1 in its list, so it is counted.
        assert cached.num_output_tokens == [(k - 1) + 1]
        # 8 prompt tokens + (k - 1) read back + 1 placeholder - 1 (not computed yet).
        assert cached.num_computed_tokens == [8 + k - 1]
        assert cached.all_token_ids == {}  # scheduled last step: no resend
        assert r.num_computed_tokens == 8 + k
        in_flight.append(step)

        out = finish_step(sched, in_flight.pop(0)).outputs
        assert out["r"].new_token_ids == [200 + k - 1]
        assert out["r"].finish_reason is None
        assert r.num_output_placeholders == 1
        assert list(r.output_token_ids) == [200 + i for i in range(k)]
        # num_computed_tokens = num_tokens + placeholders - 1.
        assert r.num_computed_tokens == r.num_tokens + r.num_output_placeholders - 1

    finish_step(sched, in_flight.pop(0))
    assert r.num_output_placeholders == 0
    assert list(r.output_token_ids) == [200 + i for i in range(8)]


@pytest.mark.parametrize("max_tokens", [1, 2, 3, 5])
def test_no_step_is_scheduled_once_the_step_in_flight_samples_the_last_token(max_tokens):
    # vLLM's rule (scheduler.py at 52a31cc, Glassbox the same): skip a running
    # request when placeholders > 0 and
    #   num_computed + 2 - placeholders >= num_prompt + max_tokens.
    # With one step in flight (placeholders = 1) and num_computed = num_tokens
    # (the placeholder's position is next), the left side is num_tokens + 1 =
    # prompt + outputs read back + the one in flight: the request is skipped
    # exactly when the step in flight samples its last allowed token.
    sched = async_scheduler()
    sched.add_request(make_request("r", prompt(8), max_tokens=max_tokens))
    r = sched.requests["r"]
    in_flight = [launch_step(sched)]
    sampling_steps = 1
    outputs = []
    while in_flight:
        if len(in_flight) < 2 and sched.has_requests():
            step = launch_step(sched)
            if "r" in step.scheduler_output.num_scheduled_tokens:
                sampling_steps += 1
                # Never more tokens coming than max_tokens allows.
                assert r.num_output_tokens + r.num_output_placeholders <= max_tokens
            in_flight.append(step)
        outputs.extend(finish_step(sched, in_flight.pop(0)).outputs.values())

    # Every sampled token was used: no step was scheduled for nothing.
    assert sampling_steps == max_tokens
    assert [o.new_token_ids for o in outputs] == [[TOK]] * max_tokens
    assert [o.finish_reason for o in outputs] == [None] * (max_tokens - 1) + [FinishReason.LENGTH]
    assert r.status == RequestStatus.FINISHED_LENGTH_CAPPED


# ---------------------------------------------------------------------------
# Prefix caching: only blocks whose tokens are all known
# ---------------------------------------------------------------------------
def test_block_whose_last_position_is_a_placeholder_gets_no_hash():
    # 15 prompt tokens: the first sampled token lands at position 15, the
    # last slot of block 0.
    sched = async_scheduler()
    p = prompt(15)
    sched.add_request(make_request("r", p, max_tokens=10))
    r = sched.requests["r"]

    s1 = launch_step(sched)
    assert block_hashes(sched, "r") == [None]  # 15 of 16 slots
    s2 = launch_step(sched, {"r": 201})
    # num_computed 16, placeholders 2: position 15 is scheduled (step 2 reads
    # it as input) but its token is unknown. allocate_slots caches
    # min(16, num_tokens = 15) tokens: 0 full blocks.
    assert (r.num_computed_tokens, r.num_output_placeholders) == (16, 2)
    assert block_hashes(sched, "r") == [None]

    finish_step(sched, s1)
    # Position 15 is known now (TOK), and the request can hash block 0, but
    # its KV is written by step 2, still in flight: cache_blocks goes up to
    # num_computed - placeholders = 16 - 1 = 15 tokens, 0 full blocks.
    assert r.num_tokens == 16 and len(r.block_hashes) == 1
    assert block_hashes(sched, "r") == [None]

    s3 = launch_step(sched, {"r": 202})
    # Step 3 runs after step 2 on the device; allocate_slots now caches
    # min(16 + 1, 16) = 16 tokens: block 0, with the hash of its real tokens.
    assert block_hashes(sched, "r") == [expected_hash(p + [TOK], 1), None]
    assert_ref_counts_match_tables(sched)
    finish_step(sched, s2)
    finish_step(sched, s3)
    assert list(r.output_token_ids) == [TOK, 201, 202]


def test_last_block_is_cached_when_its_token_arrives_even_without_another_step():
    # 15 prompt tokens, max_tokens 2: the first output completes block 0, and
    # the request is not scheduled again after step 2 (the max_tokens rule),
    # so allocate_slots never sees the full block: the update caches it.
    sched = async_scheduler()
    p = prompt(15)
    sched.add_request(make_request("r", p, max_tokens=2))
    s1 = launch_step(sched, {"r": 300})
    s2 = launch_step(sched, {"r": 301})  # num_computed 16, placeholders 2
    finish_step(sched, s1)  # 300 at position 15; cached up to 16 - 1 = 15: none
    assert block_hashes(sched, "r") == [None]  # positions 0..15: one block
    s3 = launch_step(sched)
    # 16 + 2 - 1 = 17 >= 15 + 2: skipped, nothing scheduled.
    assert s3.scheduler_output.num_scheduled_tokens == {}
    out = finish_step(sched, s2).outputs
    # 301 arrives: placeholders 0, cached up to 16 - 0 = 16 tokens (block 0),
    # then the request ends (length) and frees its blocks: block 0 stays
    # cached in the free queue.
    assert out["r"].finish_reason == FinishReason.LENGTH
    finish_step(sched, s3)
    assert num_free(sched) == 999
    pool = sched.kv_cache_manager.block_pool
    assert pool.blocks[1].block_hash == expected_hash(p + [300], 1)

    # A later prompt starting with those 16 tokens hits block 0.
    sched.add_request(make_request("s", p + [300, 7, 8], max_tokens=1))
    s4 = launch_step(sched)
    (new,) = s4.scheduler_output.scheduled_new_reqs
    assert new.num_computed_tokens == 16
    assert new.block_ids[0][0] == 1


# ---------------------------------------------------------------------------
# Requests that end while a step for them is in flight
# ---------------------------------------------------------------------------
@pytest.mark.parametrize(
    "stop_token, stop_reason", [(EOS, None), (STOP, STOP)], ids=["eos", "stop_token"]
)
def test_request_stopped_at_step_n_gets_nothing_from_step_n_plus_1(
    monkeypatch, stop_token, stop_reason
):
    sched = async_scheduler(num_blocks=10, max_model_len=128)
    frees = count_frees(monkeypatch, sched)
    sched.add_request(
        make_request("r", prompt(16), max_tokens=20, eos_token_id=EOS, stop_token_ids=[STOP])
    )
    sched.add_request(make_request("s", prompt(16, 2000), max_tokens=20, eos_token_id=EOS))
    r = sched.requests["r"]
    s1 = launch_step(sched, {"r": stop_token})
    s2 = launch_step(sched, {"r": 7, "s": 8})
    # Step 2 samples for r too: its frame carries a token that must be dropped.
    assert s2.sampled == {"r": [7], "s": [8]}
    # Each holds 2 blocks (16 prompt tokens + position 16): 9 - 4 = 5 free.
    assert num_free(sched) == 5

    out = finish_step(sched, s1).outputs
    assert out["r"].new_token_ids == [stop_token]
    assert out["r"].finish_reason == FinishReason.STOP
    assert out["r"].stop_reason == stop_reason
    assert r.status == RequestStatus.FINISHED_STOPPED
    assert "r" not in sched.requests and r not in sched.running
    assert frees["r"] == 1
    assert num_free(sched) == 7  # r's 2 blocks
    assert_ref_counts_match_tables(sched)

    s3 = launch_step(sched)
    assert s3.scheduler_output.finished_req_ids == {"r"}
    assert set(s3.scheduler_output.num_scheduled_tokens) == {"s"}
    out = finish_step(sched, s2).outputs
    assert set(out) == {"s"}  # r's token 7 was dropped
    assert list(r.output_token_ids) == [stop_token]
    assert frees["r"] == 1
    assert num_free(sched) == 7
    finish_step(sched, s3)
    assert frees["r"] == 1
    assert_ref_counts_match_tables(sched)


def test_abort_with_two_steps_in_flight(monkeypatch):
    # EngineCore aborts between two step_with_batch_queue calls (at most one
    # step in flight); two is what a deeper queue would see (vLLM's pipeline
    # parallelism), and the scheduler must not care.
    sched = async_scheduler(num_blocks=10, max_model_len=128)
    frees = count_frees(monkeypatch, sched)
    sched.add_request(make_request("r", prompt(16), max_tokens=20))
    sched.add_request(make_request("s", prompt(16, 2000), max_tokens=20))
    r = sched.requests["r"]
    s1 = launch_step(sched, {"r": 301, "s": 401})
    s2 = launch_step(sched, {"r": 302, "s": 402})
    assert r.num_output_placeholders == 2

    assert sched.finish_requests("r", RequestStatus.FINISHED_ABORTED) == [("r", 0)]
    assert frees["r"] == 1
    assert num_free(sched) == 7  # 9 usable - s's 2 blocks
    assert [q.request_id for q in sched.running] == ["s"]

    for step, token in ((s1, 401), (s2, 402)):
        out = finish_step(sched, step).outputs
        assert set(out) == {"s"}
        assert out["s"].new_token_ids == [token]
    assert list(r.output_token_ids) == []
    s3 = launch_step(sched)
    assert s3.scheduler_output.finished_req_ids == {"r"}
    assert set(s3.scheduler_output.num_scheduled_tokens) == {"s"}
    assert frees["r"] == 1
    assert_ref_counts_match_tables(sched)


# ---------------------------------------------------------------------------
# Preemption while a step is in flight
# ---------------------------------------------------------------------------
def preempt_b_with_its_token_in_flight(b_token: int):
    """A and B (16-token prompts) on 3 usable blocks: both are admitted (one
    block each) and sample in step 1; in step 2 A needs a block for position
    16, none is free, so B (the last running) is preempted while step 1, which
    samples B's first token, is still in flight."""
    sched = async_scheduler(num_blocks=4, max_model_len=48)
    sched.add_request(make_request("A", prompt(16), max_tokens=2, eos_token_id=EOS))
    sched.add_request(make_request("B", prompt(16, 2000), max_tokens=3, eos_token_id=EOS))
    b = sched.requests["B"]
    s1 = launch_step(sched, {"A": 301, "B": b_token})
    s2 = launch_step(sched, {"A": 302})
    assert s2.scheduler_output.preempted_req_ids == {"B"}
    assert s2.scheduler_output.num_scheduled_tokens == {"A": 1}
    assert b.status == RequestStatus.PREEMPTED
    assert b.num_computed_tokens == 0
    # Its token is still coming.
    assert b.num_output_placeholders == 1
    assert block_ids(sched, "B") == []
    assert [q.request_id for q in sched.waiting] == ["B"]
    return sched, s1, s2


def test_preempted_request_still_gets_its_in_flight_token():
    sched, s1, s2 = preempt_b_with_its_token_in_flight(b_token=401)
    b = sched.requests["B"]
    out = finish_step(sched, s1).outputs
    assert out["B"].new_token_ids == [401] and out["B"].finish_reason is None
    assert list(b.output_token_ids) == [401]
    assert b.num_output_placeholders == 0
    assert b.status == RequestStatus.PREEMPTED
    assert block_ids(sched, "B") == []  # nothing cached or allocated for it
    assert_ref_counts_match_tables(sched)

    # A: 16 + 1 computed, 1 read back + 1 in flight = max_tokens 2, so A is
    # skipped; B needs 2 blocks (17 tokens), only block 2 (its old prompt
    # block, a cache hit) is free: nothing runs.
    s3 = launch_step(sched)
    assert s3.scheduler_output.num_scheduled_tokens == {}
    out = finish_step(sched, s2).outputs
    assert out["A"].finish_reason == FinishReason.LENGTH
    finish_step(sched, s3)
    # B resumes with the token that arrived after its preemption; its prompt
    # block is a cache hit, so only position 16 (token 401) is computed.
    s4 = launch_step(sched, {"B": 402})
    cached = s4.scheduler_output.scheduled_cached_reqs
    assert cached.resumed_req_ids == {"B"}
    assert cached.all_token_ids["B"] == prompt(16, 2000) + [401]
    assert cached.num_output_tokens == [1]
    assert s4.scheduler_output.num_scheduled_tokens == {"B": 1}
    assert b.num_output_placeholders == 1
    finish_step(sched, s4)
    assert list(b.output_token_ids) == [401, 402]


def test_preempted_request_whose_in_flight_token_stops_it_leaves_the_waiting_queue():
    sched, s1, s2 = preempt_b_with_its_token_in_flight(b_token=EOS)
    b = sched.requests["B"]
    out = finish_step(sched, s1).outputs
    assert out["B"].new_token_ids == [EOS]
    assert out["B"].finish_reason == FinishReason.STOP
    assert b.status == RequestStatus.FINISHED_STOPPED
    assert "B" not in sched.requests
    assert list(sched.waiting) == [] and [q.request_id for q in sched.running] == ["A"]
    assert sched.get_request_counts() == (1, 0)
    assert_ref_counts_match_tables(sched)

    s3 = launch_step(sched)
    assert s3.scheduler_output.finished_req_ids == {"B"}
    for step in (s2, s3):
        out = finish_step(sched, step).outputs
        assert "B" not in out
    assert not sched.has_unfinished_requests()
    assert num_free(sched) == 3


# ---------------------------------------------------------------------------
# reset_prefix_cache(reset_running_requests=True) with steps in flight
# ---------------------------------------------------------------------------
@pytest.mark.parametrize("stale_token", [150, EOS], ids=["ordinary", "eos"])
def test_reset_prefix_cache_drops_the_stale_frame_of_a_step_in_flight(stale_token):
    # The engine resets between two step_with_batch_queue calls: one step in flight.
    sched = async_scheduler(num_blocks=20, max_model_len=128)
    p = prompt(20)
    sched.add_request(make_request("r", p, max_tokens=10, eos_token_id=EOS))
    r = sched.requests["r"]
    s1 = launch_step(sched, {"r": 101})
    s2 = launch_step(sched, {"r": stale_token})
    finish_step(sched, s1)
    assert list(r.output_token_ids) == [101]
    assert r.num_output_placeholders == 1  # step 2 in flight

    assert sched.reset_prefix_cache(reset_running_requests=True) is True
    assert r.status == RequestStatus.PREEMPTED and r.num_computed_tokens == 0
    # Step 2's frame will carry a token of a computation that is redone.
    assert (r.num_output_placeholders, r.async_tokens_to_discard) == (0, 1)
    assert num_free(sched) == 19
    assert all(b.block_hash is None for b in sched.kv_cache_manager.block_pool.blocks)

    s3 = launch_step(sched, {"r": 103})
    cached = s3.scheduler_output.scheduled_cached_reqs
    assert cached.resumed_req_ids == {"r"}
    # Its real tokens only (no placeholder, no stale token), recomputed from
    # 0 (the cache was reset): 20 + 1 tokens.
    assert cached.all_token_ids["r"] == p + [101]
    assert cached.num_computed_tokens == [0]
    assert cached.num_output_tokens == [1]
    assert s3.scheduler_output.num_scheduled_tokens == {"r": 21}
    assert (r.num_output_placeholders, r.async_tokens_to_discard) == (1, 1)

    out = finish_step(sched, s2).outputs
    assert out == {}  # stale: dropped, even an EOS
    assert list(r.output_token_ids) == [101]
    assert r.status == RequestStatus.RUNNING
    assert (r.num_output_placeholders, r.async_tokens_to_discard) == (1, 0)

    s4 = launch_step(sched, {"r": 104})
    # 21 tokens + 1 placeholder - 21 computed = 1.
    assert s4.scheduler_output.num_scheduled_tokens == {"r": 1}
    assert finish_step(sched, s3).outputs["r"].new_token_ids == [103]
    assert finish_step(sched, s4).outputs["r"].new_token_ids == [104]
    assert list(r.output_token_ids) == [101, 103, 104]
    assert r.num_output_placeholders == 0
    # The blocks cached since hold the real tokens.
    assert block_hashes(sched, "r")[0] == expected_hash(p + [101, 103, 104], 1)
    assert_ref_counts_match_tables(sched)


def test_reset_prefix_cache_with_two_steps_in_flight_drops_both_frames():
    # Two frames in flight (a deeper queue than EngineCore's, as in vLLM's
    # pipeline parallelism): the prompt step and the first decode step both
    # sample for r, so both are stale.
    sched = async_scheduler(num_blocks=20, max_model_len=128)
    p = prompt(20)
    sched.add_request(make_request("r", p, max_tokens=10, eos_token_id=EOS))
    r = sched.requests["r"]
    s1 = launch_step(sched, {"r": 101})
    s2 = launch_step(sched, {"r": 102})
    assert sched.reset_prefix_cache(reset_running_requests=True) is True
    assert (r.num_output_placeholders, r.async_tokens_to_discard) == (0, 2)

    assert finish_step(sched, s1).outputs == {}
    s3 = launch_step(sched, {"r": 103})
    # Nothing was read back: the whole prompt again, and nothing sent as output.
    assert s3.scheduler_output.scheduled_cached_reqs.all_token_ids["r"] == p
    assert s3.scheduler_output.num_scheduled_tokens == {"r": 20}
    assert finish_step(sched, s2).outputs == {}
    assert r.async_tokens_to_discard == 0
    assert finish_step(sched, s3).outputs["r"].new_token_ids == [103]
    assert list(r.output_token_ids) == [103]
    assert r.num_output_placeholders == 0
    assert_ref_counts_match_tables(sched)
