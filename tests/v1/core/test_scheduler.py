"""Unit tests of the V1 scheduler (engine/v1/core/sched/scheduler.py).

The scenarios follow vLLM's tests/v1/core/test_scheduler.py: build a real
Scheduler over a small KV pool, call ``schedule()``, hand-build the
``ModelRunnerOutput`` a worker would return (a request still inside its prompt
samples ``[]``, every other one samples one token), then
``update_from_output()``. Every expected number below is worked out in the
comments from block_size = 16 and the pool size, so a failure points at the
rule that broke.

Block ids: a pool of N blocks hands out ids 1..N-1 (0 is the null block) from
the head of its free queue, which starts in id order; a freed request's blocks
go to the tail, last block first.
"""

from __future__ import annotations

import pytest

from engine.config.scheduler import SchedulerConfig
from engine.utils.hashing import sha256
from engine.v1.core.kv_cache_utils import get_request_block_hasher
from engine.v1.core.sched.request_queue import SchedulingPolicy
from engine.v1.engine import EngineCoreEventType, FinishReason
from engine.v1.metrics.stats import PrefillStats
from engine.v1.outputs import LogprobsLists, ModelRunnerOutput
from engine.v1.request import Request, RequestStatus
from tests.helpers.core import (
    DEFAULT_SAMPLED_TOKEN_ID,
    free_block_ids,
    get_request_block_ids,
    make_model_runner_output,
    make_request,
    make_sampling_params,
    make_scheduler,
    run_step,
)

EOS = 2
TOK = DEFAULT_SAMPLED_TOKEN_ID  # what run_step samples by default (100)


def prompt(num_tokens: int, start: int = 1000) -> list[int]:
    """``num_tokens`` distinct token ids; different ``start``s never share a block."""
    return list(range(start, start + num_tokens))


def num_free(scheduler) -> int:
    return scheduler.kv_cache_manager.block_pool.get_num_free_blocks()


def block_ids(scheduler, req_id: str) -> list[int]:
    return get_request_block_ids(scheduler.kv_cache_manager, req_id)


def waiting_ids(scheduler) -> list[str]:
    return [r.request_id for r in scheduler.waiting]


def running_ids(scheduler) -> list[str]:
    return [r.request_id for r in scheduler.running]


# ---------------------------------------------------------------------------
# Adding requests
# ---------------------------------------------------------------------------
def test_add_request_queues_as_waiting():
    sched = make_scheduler()
    for i in range(3):
        sched.add_request(make_request(f"r{i}", prompt(10, 1000 * i)))
    assert waiting_ids(sched) == ["r0", "r1", "r2"]
    assert sched.running == []
    assert sched.get_num_unfinished_requests() == 3
    assert sched.get_request_counts() == (0, 3)
    assert sched.has_unfinished_requests() and sched.has_requests()
    assert not sched.has_finished_requests()
    assert all(r.status == RequestStatus.WAITING for r in sched.waiting)
    # QUEUED is recorded on arrival (log_stats defaults to True).
    assert [e.type for e in sched.requests["r0"].events] == [EngineCoreEventType.QUEUED]


def test_constructor_takes_the_whole_config_like_vllm():
    import inspect

    from engine.config import CacheConfig, GlassboxConfig
    from engine.v1.core.sched.scheduler import Scheduler
    from tests.helpers.core import make_kv_cache_config, make_model_config

    assert list(inspect.signature(Scheduler).parameters) == [
        "glassbox_config",
        "kv_cache_config",
        "structured_output_manager",
        "block_size",
        "hash_block_size",
        "include_finished_set",
        "log_stats",
        "trace",
    ]
    config = GlassboxConfig(
        model_config=make_model_config(max_model_len=64),
        cache_config=CacheConfig(block_size=16, num_gpu_blocks_override=10),
        scheduler_config=SchedulerConfig(max_model_len=128, max_num_seqs=3),
    )
    manager = object()
    sched = Scheduler(config, make_kv_cache_config(10, max_model_len=64), manager, 16)
    # max_model_len comes from the model config, as in vLLM.
    assert sched.max_model_len == 64
    assert sched.max_num_running_reqs == 3
    assert sched.block_size == 16
    assert sched.structured_output_manager is manager
    assert sched.log_stats is False and sched.make_stats() is None
    assert sched.finished_req_ids_dict is None


def test_duplicate_request_id_is_rejected():
    sched = make_scheduler()
    first = make_request("dup", prompt(10))
    sched.add_request(first)
    with pytest.raises(ValueError, match="dup"):
        sched.add_request(make_request("dup", prompt(5, 5000)))
    # The original is untouched and still the only entry.
    assert sched.requests["dup"] is first
    assert waiting_ids(sched) == ["dup"]


def test_empty_scheduler_schedules_nothing():
    sched = make_scheduler()
    out = sched.schedule()
    assert out.num_scheduled_tokens == {}
    assert out.total_num_scheduled_tokens == 0
    assert out.scheduled_new_reqs == []
    assert out.scheduled_cached_reqs.num_reqs == 0
    assert out.num_common_prefix_blocks == [0]
    assert not sched.has_requests()


# ---------------------------------------------------------------------------
# Chunked prefill and the token budget
# ---------------------------------------------------------------------------
def test_long_prompt_is_split_into_budget_sized_chunks():
    sched = make_scheduler(num_blocks=100, max_num_batched_tokens=64)
    sched.add_request(make_request("A", prompt(150), max_tokens=5))
    req = sched.requests["A"]

    # Step 1: 64 of 150 prompt tokens -> 4 blocks (1..4); nothing sampled.
    step = run_step(sched)
    out = step.scheduler_output
    assert out.num_scheduled_tokens == {"A": 64}
    assert out.total_num_scheduled_tokens == 64
    assert [n.req_id for n in out.scheduled_new_reqs] == ["A"]
    assert out.scheduled_new_reqs[0].block_ids == ([1, 2, 3, 4],)
    assert out.scheduled_new_reqs[0].num_computed_tokens == 0
    assert req.is_prefill_chunk and req.num_computed_tokens == 64
    assert step.model_runner_output.sampled_token_ids == [[]]
    assert "A" not in step.outputs and req.num_output_tokens == 0

    # Step 2: the next 64 (cursor 64 -> 128): blocks 5..8.
    step = run_step(sched)
    out = step.scheduler_output
    assert out.num_scheduled_tokens == {"A": 64}
    assert out.scheduled_new_reqs == []
    cached = out.scheduled_cached_reqs
    assert cached.req_ids == ["A"]
    assert cached.new_block_ids == [([5, 6, 7, 8],)]
    assert cached.num_computed_tokens == [64]
    assert cached.num_output_tokens == [0]
    assert cached.resumed_req_ids == set() and cached.all_token_ids == {}
    assert req.is_prefill_chunk and req.num_computed_tokens == 128
    assert "A" not in step.outputs

    # Step 3: the last 22 tokens (128 -> 150): cdiv(150, 16) = 10 blocks, so
    # 9 and 10 are new. The prompt is done, so the model samples a token.
    step = run_step(sched)
    assert step.scheduler_output.num_scheduled_tokens == {"A": 22}
    assert step.scheduler_output.scheduled_cached_reqs.new_block_ids == [([9, 10],)]
    assert not req.is_prefill_chunk and req.num_computed_tokens == 150
    assert step.outputs["A"].new_token_ids == [TOK]
    assert req.output_token_ids == [TOK]

    # Step 4: a plain decode; token 151 still fits in block 10 (160 slots).
    step = run_step(sched)
    assert step.scheduler_output.num_scheduled_tokens == {"A": 1}
    assert step.scheduler_output.scheduled_cached_reqs.new_block_ids == [None]
    assert step.scheduler_output.scheduled_cached_reqs.num_computed_tokens == [150]
    assert block_ids(sched, "A") == list(range(1, 11))


def test_budget_is_shared_across_requests_every_step():
    sched = make_scheduler(num_blocks=100, max_num_batched_tokens=100)
    sched.add_request(make_request("A", prompt(70, 1000), max_tokens=3))
    sched.add_request(make_request("B", prompt(50, 2000), max_tokens=3))
    sched.add_request(make_request("C", prompt(30, 3000), max_tokens=3))

    expected = [
        {"A": 70, "B": 30},  # B gets the 30 tokens left; C does not start
        {"A": 1, "B": 20, "C": 30},  # running first (A decode, B's last chunk)
        {"A": 1, "B": 1, "C": 1},
        {"B": 1, "C": 1},  # A hit max_tokens=3 in the previous step
    ]  # B and C sampled their 3rd token in the last step
    for want in expected:
        step = run_step(sched)
        assert step.scheduler_output.num_scheduled_tokens == want
        assert step.scheduler_output.total_num_scheduled_tokens == sum(want.values()) <= 100
    assert not sched.has_unfinished_requests()


def test_budget_never_exceeded_with_many_prompts():
    budget = 48
    sched = make_scheduler(num_blocks=200, max_num_batched_tokens=budget)
    lengths = [5, 90, 33, 47, 16, 130, 1, 64]
    for i, n in enumerate(lengths):
        sched.add_request(make_request(f"r{i}", prompt(n, 1000 * (i + 1)), max_tokens=4))
    num_steps = 0
    total_work = 0
    while sched.has_unfinished_requests():
        step = run_step(sched)
        num_steps += 1
        scheduled = step.scheduler_output.num_scheduled_tokens
        assert sum(scheduled.values()) == step.scheduler_output.total_num_scheduled_tokens
        assert 0 < step.scheduler_output.total_num_scheduled_tokens <= budget
        assert all(n > 0 for n in scheduled.values())
        total_work += step.scheduler_output.total_num_scheduled_tokens
        assert num_steps < 100
    # Every prompt token and every decode input was computed exactly once (no
    # preemption, no shared prefixes): sum(prompts) = 386, plus 3 decode
    # steps per request (4 outputs, the first one sampled off the prompt).
    assert total_work == sum(lengths) + 3 * len(lengths) == 410
    # 410 tokens at <= 48 per step take at least 9 steps.
    assert num_steps >= 9
    assert num_free(sched) == 199


def test_long_prefill_token_threshold_clamps_each_request():
    sched = make_scheduler(
        num_blocks=100, max_num_batched_tokens=100, long_prefill_token_threshold=32
    )
    sched.add_request(make_request("A", prompt(100, 1000), max_tokens=10))
    sched.add_request(make_request("B", prompt(40, 2000), max_tokens=10))

    expected = [
        {"A": 32, "B": 32},  # both clamped to 32 although 36 tokens of budget are left
        {"A": 32, "B": 8},  # running A clamped again; B's remainder is under the threshold
        {"A": 32, "B": 1},
        {"A": 4, "B": 1},
        {"A": 1, "B": 1},
    ]
    for want in expected:
        assert run_step(sched).scheduler_output.num_scheduled_tokens == want
    assert sched.requests["A"].num_output_tokens == 2
    assert sched.requests["B"].num_output_tokens == 4


def test_chunked_prefill_off_requires_budget_of_max_model_len():
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        SchedulerConfig(max_model_len=256, max_num_batched_tokens=128, enable_chunked_prefill=False)
    # Equal is fine.
    SchedulerConfig(max_model_len=128, max_num_batched_tokens=128, enable_chunked_prefill=False)


def test_chunked_prefill_off_prompt_waits_for_a_whole_step_and_blocks_later_waiters():
    sched = make_scheduler(
        num_blocks=100, max_model_len=128, max_num_batched_tokens=128, enable_chunked_prefill=False
    )
    sched.add_request(make_request("A", prompt(100, 1000), max_tokens=5))
    sched.add_request(make_request("B", prompt(50, 2000), max_tokens=5))
    sched.add_request(make_request("C", prompt(10, 3000), max_tokens=5))

    # B needs 50 > 28 tokens left: it is not chunked, it waits -- and C, which
    # would fit, waits behind it.
    step = run_step(sched)
    assert step.scheduler_output.num_scheduled_tokens == {"A": 100}
    assert waiting_ids(sched) == ["B", "C"]
    assert sched.requests["B"].num_computed_tokens == 0

    step = run_step(sched)
    assert step.scheduler_output.num_scheduled_tokens == {"A": 1, "B": 50, "C": 10}
    assert not sched.requests["B"].is_prefill_chunk


def test_chunked_prefill_on_same_workload_chunks_instead():
    sched = make_scheduler(num_blocks=100, max_model_len=128, max_num_batched_tokens=128)
    sched.add_request(make_request("A", prompt(100, 1000), max_tokens=5))
    sched.add_request(make_request("B", prompt(50, 2000), max_tokens=5))
    sched.add_request(make_request("C", prompt(10, 3000), max_tokens=5))
    step = run_step(sched)
    assert step.scheduler_output.num_scheduled_tokens == {"A": 100, "B": 28}
    assert sched.requests["B"].is_prefill_chunk
    assert "B" not in step.outputs
    step = run_step(sched)
    assert step.scheduler_output.num_scheduled_tokens == {"A": 1, "B": 22, "C": 10}


# ---------------------------------------------------------------------------
# Order: running before waiting, max_num_seqs, head-of-line blocking
# ---------------------------------------------------------------------------
def test_running_requests_are_scheduled_before_waiting_ones():
    sched = make_scheduler(num_blocks=100, max_num_batched_tokens=64)
    sched.add_request(make_request("A", prompt(10, 1000), max_tokens=10))
    run_step(sched)
    sched.add_request(make_request("B", prompt(100, 2000), max_tokens=10))

    out = run_step(sched).scheduler_output
    # A's decode is planned first; B only gets what is left: 64 - 1 = 63.
    assert list(out.num_scheduled_tokens.items()) == [("A", 1), ("B", 63)]
    assert out.scheduled_cached_reqs.req_ids == ["A"]
    assert [n.req_id for n in out.scheduled_new_reqs] == ["B"]
    assert running_ids(sched) == ["A", "B"]


def test_waiting_requests_only_get_budget_left_after_running():
    sched = make_scheduler(num_blocks=100, max_num_batched_tokens=64)
    sched.add_request(make_request("A", prompt(200, 1000), max_tokens=10))
    run_step(sched)
    sched.add_request(make_request("B", prompt(20, 2000), max_tokens=10))

    # A's remaining prompt (136 tokens) eats the whole budget twice more; B,
    # although short, is not started until A's last chunk leaves room.
    for computed in (128, 192):
        out = run_step(sched).scheduler_output
        assert out.num_scheduled_tokens == {"A": 64}
        assert sched.requests["A"].num_computed_tokens == computed
        assert waiting_ids(sched) == ["B"]
    out = run_step(sched).scheduler_output
    assert out.num_scheduled_tokens == {"A": 8, "B": 20}


def test_max_num_seqs_caps_running_requests():
    sched = make_scheduler(num_blocks=100, max_num_seqs=2)
    sched.add_request(make_request("A", prompt(10, 1000), max_tokens=1))
    sched.add_request(make_request("B", prompt(10, 2000), max_tokens=5))
    sched.add_request(make_request("C", prompt(10, 3000), max_tokens=5))

    step = run_step(sched)
    assert step.scheduler_output.num_scheduled_tokens == {"A": 10, "B": 10}
    assert waiting_ids(sched) == ["C"]
    # A finished (max_tokens=1) in that step, which frees a seat for C.
    assert step.outputs["A"].finish_reason == FinishReason.LENGTH
    step = run_step(sched)
    assert step.scheduler_output.num_scheduled_tokens == {"B": 1, "C": 10}
    assert len(sched.running) == 2


def test_waiting_request_that_does_not_fit_blocks_admission_fcfs():
    # 11 blocks -> 10 usable; max_model_len 160 needs all 10.
    sched = make_scheduler(num_blocks=11, max_model_len=160)
    sched.add_request(make_request("A", prompt(96, 1000), max_tokens=50))
    run_step(sched)  # A: 96 tokens = 6 blocks
    assert num_free(sched) == 4
    sched.add_request(make_request("B", prompt(80, 2000)))  # needs 5 blocks
    sched.add_request(make_request("C", prompt(16, 3000)))  # needs 1 block

    # A's decode takes a 7th block (token 97); 3 are left. B needs 5 and stops
    # admission; C, which would fit, is not admitted past it.
    step = run_step(sched)
    assert step.scheduler_output.num_scheduled_tokens == {"A": 1}
    assert step.scheduler_output.preempted_req_ids == set()
    assert waiting_ids(sched) == ["B", "C"]
    assert num_free(sched) == 3
    # A waiting request is never a reason to preempt a running one.
    assert sched.requests["A"].status == RequestStatus.RUNNING


# ---------------------------------------------------------------------------
# Preemption
# ---------------------------------------------------------------------------
@pytest.mark.parametrize("enable_prefix_caching", [True, False])
def test_fcfs_preempts_last_running_request_and_resumes_it(enable_prefix_caching):
    # 5 blocks -> 4 usable (ids 1..4).
    sched = make_scheduler(
        num_blocks=5, max_model_len=64, enable_prefix_caching=enable_prefix_caching
    )
    sched.add_request(make_request("A", prompt(31, 1000), max_tokens=3))
    sched.add_request(make_request("B", prompt(20, 2000), max_tokens=10))
    req_a, req_b = sched.requests["A"], sched.requests["B"]

    # Step 1: A 31 tokens -> blocks [1, 2]; B 20 tokens -> blocks [3, 4]. Pool full.
    step = run_step(sched)
    assert step.scheduler_output.num_scheduled_tokens == {"A": 31, "B": 20}
    assert block_ids(sched, "A") == [1, 2] and block_ids(sched, "B") == [3, 4]
    assert num_free(sched) == 0
    # Step 2: A's 32nd token and B's 21st still fit their blocks.
    step = run_step(sched)
    assert step.scheduler_output.num_scheduled_tokens == {"A": 1, "B": 1}
    assert step.scheduler_output.preempted_req_ids == set()
    sched.add_request(make_request("C", prompt(4, 3000), max_tokens=10))

    # Step 3: A's 33rd token needs a 3rd block and none is free. FCFS evicts
    # the *last* running request, B: its blocks go back (tail first -> free
    # queue [4, 3]) and A takes block 4. C would now fit in block 3, but
    # nobody is admitted in a step that preempted.
    step = run_step(sched)
    out = step.scheduler_output
    assert out.num_scheduled_tokens == {"A": 1}
    assert out.preempted_req_ids == {"B"}
    assert out.scheduled_new_reqs == []
    assert req_b.status == RequestStatus.PREEMPTED
    assert req_b.num_computed_tokens == 0
    assert req_b.num_preemptions == 1
    assert req_b.output_token_ids == [TOK, TOK]  # its outputs are kept
    assert "B" not in sched.kv_cache_manager.coordinator.single_type_managers[0].req_to_blocks
    assert waiting_ids(sched) == ["B", "C"]  # prepended ahead of C
    assert [e.type for e in req_b.events][-1] == EngineCoreEventType.PREEMPTED
    # A reached max_tokens=3 in this step and was freed too.
    assert step.outputs["A"].finish_reason == FinishReason.LENGTH
    assert step.stats.num_preemptions == 1
    assert step.stats.num_running_reqs == 0 and step.stats.num_waiting_reqs == 2
    assert step.stats.kv_cache_usage == 0.0
    assert sched.num_preemptions_total == 1
    # Free queue: [3] + A's blocks tail first [4, 2, 1].
    assert free_block_ids(sched.kv_cache_manager.block_pool) == [3, 4, 2, 1]

    # Step 4: B resumes and recomputes prompt + both outputs (22 tokens). With
    # prefix caching its first block (block 3, 16 prompt tokens) is still
    # cached, so only 6 tokens run; without caching all 22 do. Either way its
    # table is [3, 4]; C gets block 2.
    step = run_step(sched)
    out = step.scheduler_output
    if enable_prefix_caching:
        assert out.num_scheduled_tokens == {"B": 6, "C": 4}
        expected_computed = 16
    else:
        assert out.num_scheduled_tokens == {"B": 22, "C": 4}
        expected_computed = 0
    cached = out.scheduled_cached_reqs
    assert cached.req_ids == ["B"]
    assert cached.resumed_req_ids == {"B"}
    assert cached.all_token_ids == {"B": prompt(20, 2000) + [TOK, TOK]}
    assert cached.new_block_ids == [([3, 4],)]
    assert cached.num_computed_tokens == [expected_computed]
    assert cached.num_output_tokens == [2]
    assert [n.req_id for n in out.scheduled_new_reqs] == ["C"]
    assert out.scheduled_new_reqs[0].block_ids == ([2],)
    assert req_b.status == RequestStatus.RUNNING
    assert not req_b.is_prefill_chunk
    assert step.outputs["B"].new_token_ids == [TOK]  # resumed B samples right away
    assert req_b.output_token_ids == [TOK, TOK, TOK]
    # Re-lookups of a preempted request are kept out of the hit-rate counters:
    # only C's 4-token lookup counts.
    assert step.stats.prefix_cache_stats.queries == (4 if enable_prefix_caching else 0)
    assert step.stats.prefix_cache_stats.hits == 0
    assert req_a.is_finished()


def test_fcfs_request_preempts_itself_when_it_is_last():
    sched = make_scheduler(num_blocks=5, max_model_len=64)
    sched.add_request(make_request("A", prompt(20, 1000), max_tokens=10))
    sched.add_request(make_request("B", prompt(31, 2000), max_tokens=10))
    run_step(sched)  # A -> [1, 2], B -> [3, 4]
    run_step(sched)  # A 22 tokens, B 33 tokens, nothing new allocated
    assert num_free(sched) == 0

    # A's decode fits; B's needs a 3rd block, and the last running request is
    # B itself, so B is preempted and nothing else is tried.
    step = run_step(sched)
    assert step.scheduler_output.num_scheduled_tokens == {"A": 1}
    assert step.scheduler_output.preempted_req_ids == {"B"}
    assert sched.requests["B"].status == RequestStatus.PREEMPTED
    assert running_ids(sched) == ["A"] and waiting_ids(sched) == ["B"]
    assert num_free(sched) == 2


def test_resumed_request_recomputes_in_chunks():
    # Budget 16 and no prefix caching: B is preempted in the middle of its
    # prompt and then recomputed chunk by chunk. Admission checks only the
    # next chunk (scheduler_reserve_full_isl off), so B resumes in 1 free block.
    sched = make_scheduler(
        num_blocks=5,
        max_model_len=64,
        max_num_batched_tokens=16,
        enable_prefix_caching=False,
        scheduler_reserve_full_isl=False,
    )
    sched.add_request(make_request("A", prompt(31, 1000), max_tokens=4))
    sched.add_request(make_request("B", prompt(20, 2000), max_tokens=10))
    req_b = sched.requests["B"]
    expected = [
        {"A": 16},  # A -> [1]
        {"A": 15, "B": 1},  # A -> [1, 2] and samples; B -> [3]
        {"A": 1, "B": 15},  # both inside their blocks; B now at 16 of 20
    ]
    for want in expected:
        assert run_step(sched).scheduler_output.num_scheduled_tokens == want
    assert num_free(sched) == 1

    # A's 33rd token takes block 4; B's next 4 tokens need a 2nd block, none
    # is left, and B is the last running request: it preempts itself.
    out = run_step(sched).scheduler_output
    assert out.num_scheduled_tokens == {"A": 1}
    assert out.preempted_req_ids == {"B"}
    assert req_b.num_output_tokens == 0

    # B resumes with 15 of its 20 tokens: still a chunk, so it samples nothing.
    step = run_step(sched)
    out = step.scheduler_output
    assert out.num_scheduled_tokens == {"A": 1, "B": 15}
    assert out.scheduled_cached_reqs.resumed_req_ids == {"B"}
    assert out.scheduled_cached_reqs.all_token_ids == {"B": prompt(20, 2000)}
    assert out.scheduled_new_reqs == []
    assert req_b.is_prefill_chunk
    assert "B" not in step.outputs
    assert step.outputs["A"].finish_reason == FinishReason.LENGTH  # 4th token

    # The rest of the recompute: a plain cached request again.
    step = run_step(sched)
    cached = step.scheduler_output.scheduled_cached_reqs
    assert step.scheduler_output.num_scheduled_tokens == {"B": 5}
    assert cached.resumed_req_ids == set() and cached.all_token_ids == {}
    assert cached.num_computed_tokens == [15]
    assert not req_b.is_prefill_chunk
    assert step.outputs["B"].new_token_ids == [TOK]


def test_priority_preempts_worst_priority_then_latest_arrival():
    # 7 blocks -> 6 usable.
    sched = make_scheduler(num_blocks=7, max_model_len=64, policy="priority")
    assert sched.policy == SchedulingPolicy.PRIORITY
    sched.add_request(make_request("B", prompt(20, 1000), priority=1, arrival_time=1.0))
    run_step(sched)  # B: 2 blocks
    sched.add_request(make_request("A", prompt(20, 2000), priority=1, arrival_time=2.0))
    sched.add_request(make_request("H", prompt(31, 3000), priority=0, arrival_time=3.0))

    # H (priority 0) is admitted before A; the pool is then full.
    step = run_step(sched)
    assert list(step.scheduler_output.num_scheduled_tokens.items()) == [
        ("B", 1),
        ("H", 31),
        ("A", 20),
    ]
    assert running_ids(sched) == ["B", "H", "A"]
    assert num_free(sched) == 0
    run_step(sched)  # everyone decodes inside their blocks; H now has 33 tokens

    # H needs a 3rd block. The victim is max(priority, arrival_time): B and A
    # share priority 1 and A arrived later (2.0 > 1.0) -> A, although B comes
    # first in the running list.
    step = run_step(sched)
    out = step.scheduler_output
    assert out.preempted_req_ids == {"A"}
    assert out.num_scheduled_tokens == {"B": 1, "H": 1}
    assert out.total_num_scheduled_tokens == 2
    assert out.scheduled_cached_reqs.req_ids == ["B", "H"]
    assert sched.requests["A"].status == RequestStatus.PREEMPTED
    assert sched.requests["A"].num_computed_tokens == 0
    assert running_ids(sched) == ["B", "H"] and waiting_ids(sched) == ["A"]
    assert num_free(sched) == 1  # A's 2 blocks back, H took one
    assert "A" not in step.outputs


@pytest.mark.parametrize("first, second", [("a", "b"), ("b", "a")])
def test_priority_tie_preempts_the_first_tied_request_in_the_running_list(first, second):
    # 5 blocks -> 4 usable. Both requests share (priority, arrival_time), as the
    # n > 1 children of one request do; the running list is in admission order.
    sched = make_scheduler(num_blocks=5, max_model_len=64, policy="priority")
    sched.add_request(make_request(first, prompt(30, 1000), priority=1, arrival_time=1.0))
    run_step(sched)  # first: 30 tokens -> blocks [1, 2]; 31 tokens after sampling
    sched.add_request(make_request(second, prompt(32, 2000), priority=1, arrival_time=1.0))
    step = run_step(sched)  # first decodes in place; second takes [3, 4]
    assert list(step.scheduler_output.num_scheduled_tokens.items()) == [(first, 1), (second, 32)]
    assert running_ids(sched) == [first, second]
    assert num_free(sched) == 0

    # first decodes inside its 2nd block; second's decode needs a 3rd block.
    # max() over the running list keeps the first of the tied: first, whatever
    # the ids, although it was already scheduled in this step (its token goes
    # back to the budget). Its blocks go to the free queue's tail last block
    # first ([2, 1]); second takes block 2.
    step = run_step(sched)
    out = step.scheduler_output
    assert out.preempted_req_ids == {first}
    assert out.num_scheduled_tokens == {second: 1}
    assert sched.requests[first].status == RequestStatus.PREEMPTED
    assert sched.requests[first].num_computed_tokens == 0
    assert running_ids(sched) == [second] and waiting_ids(sched) == [first]
    assert block_ids(sched, second) == [3, 4, 2]
    assert num_free(sched) == 1
    assert step.stats.num_preemptions == 1


def _run_two_tied_chunked_requests(
    enable_prefix_caching: bool, max_steps: int, scheduler_reserve_full_isl: bool = True
):
    """Two 17-token prompts tied on (priority, arrival_time), 16-token chunks,
    4 usable blocks of 16. Returns (finished ids, preempted ids step by step)."""
    sched = make_scheduler(
        num_blocks=5,
        max_model_len=64,
        long_prefill_token_threshold=16,
        policy="priority",
        enable_prefix_caching=enable_prefix_caching,
        scheduler_reserve_full_isl=scheduler_reserve_full_isl,
    )
    for rid, start in (("x", 1000), ("y", 2000)):
        request = make_request(
            rid, prompt(17, start), max_tokens=47, ignore_eos=True, priority=0, arrival_time=1.0
        )
        sched.add_request(request)
    finished: set[str] = set()
    preempted: list[str] = []
    for _ in range(max_steps):
        step = run_step(sched)
        preempted += sorted(step.scheduler_output.preempted_req_ids)
        for outputs in step.engine_core_outputs.values():
            finished |= {o.request_id for o in outputs.outputs if o.finish_reason is not None}
        if finished == {"x", "y"}:
            assert sched.get_num_unfinished_requests() == 0 and num_free(sched) == 4
            break
    return finished, preempted


@pytest.mark.parametrize("enable_prefix_caching", [True, False])
def test_two_tied_requests_with_chunked_prefill_both_finish(enable_prefix_caching):
    # vLLM's defaults: a preempted request is readmitted only when its whole
    # sequence fits, so it cannot take the blocks the other needs next.
    finished, _ = _run_two_tied_chunked_requests(enable_prefix_caching, max_steps=400)
    assert finished == {"x", "y"}


def test_two_tied_requests_with_chunked_prefill_both_finish_with_prefix_caching_only():
    # Admission by first chunk only: x is preempted once; on readmission it
    # gets its computed block back from the prefix cache instead of
    # recomputing it, and the pair never falls into the loop of the next test.
    finished, _ = _run_two_tied_chunked_requests(
        enable_prefix_caching=True, max_steps=400, scheduler_reserve_full_isl=False
    )
    assert finished == {"x", "y"}


def test_two_tied_requests_admitted_by_first_chunk_preempt_each_other_in_turn():
    # vLLM's tie-break, kept as is: with admission by first chunk and no prefix
    # cache, a readmitted request recomputes from 0 and, on its next chunk,
    # takes the blocks the other one needs; they preempt each other for ever.
    finished, preempted = _run_two_tied_chunked_requests(
        enable_prefix_caching=False, max_steps=200, scheduler_reserve_full_isl=False
    )
    assert finished == set()
    assert len(preempted) > 20
    assert all(a != b for a, b in zip(preempted, preempted[1:]))


def test_priority_victim_scheduled_earlier_in_step_gets_its_budget_refunded():
    # 5 blocks -> 4 usable; budget 24.
    # R's 40-token prompt needs 3 blocks: admitted by its first chunk only.
    sched = make_scheduler(
        num_blocks=5,
        max_model_len=64,
        max_num_batched_tokens=24,
        policy="priority",
        scheduler_reserve_full_isl=False,
    )
    sched.add_request(make_request("L", prompt(30, 1000), priority=9, arrival_time=1.0))
    step = run_step(sched)  # L: 24 of 30 -> 2 blocks
    assert step.scheduler_output.num_scheduled_tokens == {"L": 24}
    sched.add_request(make_request("H", prompt(16, 2000), priority=0, arrival_time=2.0))
    sched.add_request(make_request("R", prompt(40, 3000), priority=1, arrival_time=3.0))

    # L finishes its prompt (6), H takes 16 (1 block), R gets the 2 left (1 block).
    step = run_step(sched)
    assert list(step.scheduler_output.num_scheduled_tokens.items()) == [
        ("L", 6),
        ("H", 16),
        ("R", 2),
    ]
    assert running_ids(sched) == ["L", "H", "R"]
    assert num_free(sched) == 0

    # L decodes (1 token, budget 23 left), then H's decode needs a 2nd block:
    # the victim is L (priority 9), already scheduled -> its token goes back
    # to the budget. After H (1), R's chunk gets 24 - 1 = 23 tokens, not 22,
    # and fits in the block L freed (H took the other).
    step = run_step(sched)
    out = step.scheduler_output
    assert out.preempted_req_ids == {"L"}
    assert list(out.num_scheduled_tokens.items()) == [("H", 1), ("R", 23)]
    assert out.total_num_scheduled_tokens == 24
    assert out.scheduled_cached_reqs.req_ids == ["H", "R"]
    assert sched.requests["R"].num_computed_tokens == 25
    assert sched.requests["L"].status == RequestStatus.PREEMPTED
    assert num_free(sched) == 0
    assert step.stats.num_preemptions == 1


def test_priority_request_preempts_itself():
    sched = make_scheduler(num_blocks=5, max_model_len=64, policy="priority")
    sched.add_request(make_request("L", prompt(31, 1000), priority=9, arrival_time=1.0))
    run_step(sched)  # L: 31 tokens, blocks [1, 2]; 32 tokens after sampling
    sched.add_request(make_request("H", prompt(32, 2000), priority=0, arrival_time=2.0))
    step = run_step(sched)  # L decodes in place, H takes [3, 4]
    assert step.scheduler_output.num_scheduled_tokens == {"L": 1, "H": 32}
    assert num_free(sched) == 0

    # L (first in the running list) needs a 3rd block. The worst running
    # request is L itself: it is preempted and the running loop stops, so H
    # is not scheduled in this step at all.
    step = run_step(sched)
    out = step.scheduler_output
    assert out.preempted_req_ids == {"L"}
    assert out.num_scheduled_tokens == {}
    assert out.total_num_scheduled_tokens == 0
    assert step.model_runner_output.req_ids == []
    assert sched.requests["L"].status == RequestStatus.PREEMPTED
    assert running_ids(sched) == ["H"] and waiting_ids(sched) == ["L"]
    assert num_free(sched) == 2

    # Next step H runs again. It was not scheduled in the previous step, so
    # the worker gets its full token list again (it is not "resumed").
    out = run_step(sched).scheduler_output
    assert out.num_scheduled_tokens["H"] == 1
    cached = out.scheduled_cached_reqs
    assert cached.req_ids[0] == "H"
    assert cached.all_token_ids["H"] == prompt(32, 2000) + [TOK]
    assert "H" not in cached.resumed_req_ids


def test_priority_preempted_request_rejoins_waiting_in_priority_order():
    sched = make_scheduler(num_blocks=5, max_model_len=64, policy="priority")
    sched.add_request(make_request("L", prompt(31, 1000), priority=9, arrival_time=1.0))
    run_step(sched)
    sched.add_request(make_request("H", prompt(32, 2000), priority=0, arrival_time=2.0))
    run_step(sched)
    sched.add_request(make_request("M", prompt(8, 3000), priority=5, arrival_time=3.0))
    run_step(sched)  # L preempts itself (see above)
    # The priority queue has no "front": M (priority 5) comes before L (9).
    assert waiting_ids(sched) == ["M", "L"]


# ---------------------------------------------------------------------------
# Stop conditions
# ---------------------------------------------------------------------------
def _prefill(sched, req_id: str, tokens: list[int]):
    """Run one step in which ``req_id`` (alone) samples ``tokens``."""
    return run_step(sched, sampled={req_id: tokens})


def test_eos_stops_request():
    sched = make_scheduler()
    sched.add_request(make_request("A", prompt(10), max_tokens=10, eos_token_id=EOS))
    step = _prefill(sched, "A", [7])
    assert step.outputs["A"].finish_reason is None
    step = _prefill(sched, "A", [EOS])
    out = step.outputs["A"]
    assert out.new_token_ids == [EOS]
    assert out.finish_reason == FinishReason.STOP and str(out.finish_reason) == "stop"
    assert out.stop_reason is None
    assert out.finished
    assert "A" not in sched.requests and sched.running == []
    assert num_free(sched) == 999
    # The worker hears about it in the next SchedulerOutput, exactly once.
    assert sched.has_finished_requests()
    assert sched.schedule().finished_req_ids == {"A"}
    assert sched.schedule().finished_req_ids == set()


def test_eos_without_ignore_is_request_status_finished_stopped():
    sched = make_scheduler()
    req = make_request("A", prompt(10), max_tokens=10, eos_token_id=EOS)
    sched.add_request(req)
    _prefill(sched, "A", [EOS])
    assert req.status == RequestStatus.FINISHED_STOPPED
    assert req.output_token_ids == [EOS]


def test_ignore_eos_keeps_generating_until_max_tokens():
    sched = make_scheduler()
    req = make_request("A", prompt(10), max_tokens=3, eos_token_id=EOS, ignore_eos=True)
    assert req.sampling_params.eos_token_id is None
    sched.add_request(req)
    assert _prefill(sched, "A", [EOS]).outputs["A"].finish_reason is None
    assert _prefill(sched, "A", [EOS]).outputs["A"].finish_reason is None
    out = _prefill(sched, "A", [EOS]).outputs["A"]
    assert out.finish_reason == FinishReason.LENGTH
    assert req.status == RequestStatus.FINISHED_LENGTH_CAPPED
    assert req.output_token_ids == [EOS, EOS, EOS]


def test_stop_token_id_stops_with_stop_reason():
    sched = make_scheduler()
    req = make_request("A", prompt(10), max_tokens=10, stop_token_ids=[43, 44], eos_token_id=EOS)
    sched.add_request(req)
    _prefill(sched, "A", [7])
    out = _prefill(sched, "A", [44]).outputs["A"]
    assert out.finish_reason == FinishReason.STOP
    assert out.stop_reason == 44
    assert out.new_token_ids == [44]  # the stop token stays in the output
    assert req.status == RequestStatus.FINISHED_STOPPED


def test_max_tokens_stops_with_length():
    sched = make_scheduler()
    req = make_request("A", prompt(10), max_tokens=3)
    sched.add_request(req)
    reasons = [run_step(sched).outputs["A"].finish_reason for _ in range(3)]
    assert reasons == [None, None, FinishReason.LENGTH]
    assert req.status == RequestStatus.FINISHED_LENGTH_CAPPED
    assert req.num_output_tokens == 3
    assert not sched.has_unfinished_requests()


def test_eos_on_last_allowed_token_is_stop_not_length():
    sched = make_scheduler()
    sched.add_request(make_request("A", prompt(10), max_tokens=2, eos_token_id=EOS))
    _prefill(sched, "A", [7])
    assert _prefill(sched, "A", [EOS]).outputs["A"].finish_reason == FinishReason.STOP


def test_min_tokens_suppresses_eos_and_stop_tokens_until_reached():
    sched = make_scheduler()
    req = make_request(
        "A", prompt(10), max_tokens=10, min_tokens=3, stop_token_ids=[43], eos_token_id=EOS
    )
    sched.add_request(req)
    assert _prefill(sched, "A", [EOS]).outputs["A"].finish_reason is None  # 1 < 3
    assert _prefill(sched, "A", [43]).outputs["A"].finish_reason is None  # 2 < 3
    out = _prefill(sched, "A", [43]).outputs["A"]  # 3 >= 3
    assert out.finish_reason == FinishReason.STOP and out.stop_reason == 43
    assert req.output_token_ids == [EOS, 43, 43]


def test_min_tokens_then_eos():
    sched = make_scheduler()
    req = make_request("A", prompt(10), max_tokens=10, min_tokens=2, eos_token_id=EOS)
    sched.add_request(req)
    assert _prefill(sched, "A", [EOS]).outputs["A"].finish_reason is None
    out = _prefill(sched, "A", [EOS]).outputs["A"]
    assert out.finish_reason == FinishReason.STOP and out.stop_reason is None


def test_max_model_len_caps_generation():
    sched = make_scheduler(num_blocks=10, max_model_len=48)
    req = make_request("A", prompt(40), max_tokens=100)
    sched.add_request(req)
    step = run_step(sched)
    assert step.scheduler_output.num_scheduled_tokens == {"A": 40}
    reasons = [step.outputs["A"].finish_reason]
    while sched.has_unfinished_requests():
        step = run_step(sched)
        assert step.scheduler_output.num_scheduled_tokens == {"A": 1}
        reasons.append(step.outputs["A"].finish_reason)
    # 48 - 40 = 8 tokens, the last one length-capped.
    assert reasons == [None] * 7 + [FinishReason.LENGTH]
    assert req.num_tokens == 48 and req.num_output_tokens == 8
    assert req.status == RequestStatus.FINISHED_LENGTH_CAPPED


@pytest.mark.parametrize(
    ("params", "sampled", "kept", "reason", "stop_reason"),
    [
        (dict(eos_token_id=EOS), [5, EOS, 6, 7], [5, EOS], FinishReason.STOP, None),
        (dict(stop_token_ids=[43]), [5, 43, 6], [5, 43], FinishReason.STOP, 43),
        (dict(max_tokens=2), [5, 6, 7, 8], [5, 6], FinishReason.LENGTH, None),
        (dict(min_tokens=2, eos_token_id=EOS), [EOS, EOS, 6], [EOS, EOS], FinishReason.STOP, None),
    ],
)
def test_tokens_after_stop_in_same_step_are_dropped(params, sampled, kept, reason, stop_reason):
    params = {"max_tokens": 10, **params}
    sched = make_scheduler()
    req = make_request("A", prompt(10), **params)
    sched.add_request(req)
    out = _prefill(sched, "A", sampled).outputs["A"]
    assert out.new_token_ids == kept
    assert out.finish_reason == reason
    assert out.stop_reason == stop_reason
    assert list(req.output_token_ids) == kept


def test_finished_requests_are_removed_and_others_keep_running():
    sched = make_scheduler(num_blocks=50, max_model_len=128)
    sched.add_request(make_request("A", prompt(20, 1000), max_tokens=10, eos_token_id=EOS))
    sched.add_request(make_request("B", prompt(20, 2000), max_tokens=10, eos_token_id=EOS))
    sched.add_request(make_request("C", prompt(20, 3000), max_tokens=10, eos_token_id=EOS))
    step = run_step(sched, sampled={"B": [EOS]})
    assert {rid for rid, o in step.outputs.items() if o.finished} == {"B"}
    assert running_ids(sched) == ["A", "C"]
    # A and C hold 2 blocks each, B's went back.
    assert num_free(sched) == 49 - 4
    out = sched.schedule()
    assert out.finished_req_ids == {"B"}
    assert out.num_scheduled_tokens == {"A": 1, "C": 1}


# ---------------------------------------------------------------------------
# Aborts (finish_requests)
# ---------------------------------------------------------------------------
def test_abort_waiting_request():
    sched = make_scheduler(num_blocks=20, max_model_len=128)
    sched.add_request(make_request("A", prompt(10)))
    sched.add_request(make_request("B", prompt(10, 2000)))
    assert sched.finish_requests("A", RequestStatus.FINISHED_ABORTED) == [("A", 0)]
    assert waiting_ids(sched) == ["B"]
    assert "A" not in sched.requests
    assert sched.get_num_unfinished_requests() == 1
    assert num_free(sched) == 19
    out = sched.schedule()
    assert out.finished_req_ids == {"A"}
    assert list(out.num_scheduled_tokens) == ["B"]
    assert sched.schedule().finished_req_ids == set()


def test_abort_running_request_frees_its_blocks():
    sched = make_scheduler(num_blocks=20, max_model_len=128)
    req = make_request("A", prompt(40), max_tokens=10)
    sched.add_request(req)
    run_step(sched)
    assert num_free(sched) == 19 - 3
    assert sched.finish_requests(["A"], RequestStatus.FINISHED_ABORTED) == [("A", 0)]
    assert req.status == RequestStatus.FINISHED_ABORTED
    assert req.get_finished_reason() == FinishReason.ABORT
    assert sched.running == [] and "A" not in sched.requests
    assert num_free(sched) == 19
    assert sched.kv_cache_manager.usage == 0.0
    assert not sched.has_unfinished_requests() and sched.has_requests()
    out = sched.schedule()
    assert out.finished_req_ids == {"A"} and out.num_scheduled_tokens == {}
    assert sched.schedule().finished_req_ids == set()
    assert not sched.has_requests()


def test_abort_preempted_request():
    sched = make_scheduler(num_blocks=5, max_model_len=64)
    sched.add_request(make_request("A", prompt(31, 1000), max_tokens=10))
    sched.add_request(make_request("B", prompt(20, 2000), max_tokens=10))
    for _ in range(3):
        run_step(sched)
    assert sched.requests["B"].status == RequestStatus.PREEMPTED
    assert sched.finish_requests("B", RequestStatus.FINISHED_ABORTED) == [("B", 0)]
    assert len(sched.waiting) == 0
    sched.finish_requests("A", RequestStatus.FINISHED_ABORTED)
    assert num_free(sched) == 4
    assert sched.schedule().finished_req_ids == {"A", "B"}


def test_abort_unknown_and_already_finished_ids_is_a_no_op():
    sched = make_scheduler()
    sched.add_request(make_request("A", prompt(10), max_tokens=1))
    sched.add_request(make_request("B", prompt(10, 2000), max_tokens=5))
    run_step(sched)  # A finishes (max_tokens=1)
    assert "A" not in sched.requests
    sched.schedule()  # consumes the finished id
    assert sched.finish_requests(["A", "nope"], RequestStatus.FINISHED_ABORTED) == []
    assert running_ids(sched) == ["B"]
    assert sched.requests["B"].status == RequestStatus.RUNNING
    assert sched.finished_req_ids == set()
    # Aborting the same id twice reports it once.
    assert sched.finish_requests(["B", "B"], RequestStatus.FINISHED_ABORTED) == [("B", 0)]
    assert sched.finish_requests(["B"], RequestStatus.FINISHED_ABORTED) == []


def test_abort_all_with_none():
    sched = make_scheduler(num_blocks=5, max_model_len=64)
    sched.add_request(make_request("A", prompt(31, 1000), max_tokens=10))
    sched.add_request(make_request("B", prompt(20, 2000), max_tokens=10))
    for _ in range(3):
        run_step(sched)  # A running, B preempted
    sched.add_request(make_request("C", prompt(5, 3000)))
    finished = sched.finish_requests(None, RequestStatus.FINISHED_ABORTED)
    assert sorted(finished) == [("A", 0), ("B", 0), ("C", 0)]
    assert sched.requests == {} and sched.running == [] and len(sched.waiting) == 0
    assert num_free(sched) == 4
    assert sched.schedule().finished_req_ids == {"A", "B", "C"}


def test_finish_requests_rejects_a_non_finished_status():
    sched = make_scheduler()
    sched.add_request(make_request("A", prompt(10)))
    with pytest.raises(ValueError, match="finished_status"):
        sched.finish_requests("A", RequestStatus.RUNNING)
    assert sched.requests["A"].status == RequestStatus.WAITING


def test_abort_during_step_drops_that_requests_tokens():
    sched = make_scheduler()
    sched.add_request(make_request("A", prompt(10, 1000), max_tokens=10))
    sched.add_request(make_request("B", prompt(10, 2000), max_tokens=10))
    out = sched.schedule()
    mro = make_model_runner_output(sched, out)
    # The client disconnects while the step runs.
    sched.finish_requests("A", RequestStatus.FINISHED_ABORTED)
    eco = sched.update_from_output(out, mro)
    assert [o.request_id for o in eco[0].outputs] == ["B"]
    assert running_ids(sched) == ["B"]
    assert num_free(sched) == 999 - 1
    assert sched.schedule().finished_req_ids == {"A"}


# ---------------------------------------------------------------------------
# What the worker is told: NewRequestData / CachedRequestData
# ---------------------------------------------------------------------------
def test_new_request_data_contents():
    sched = make_scheduler(num_blocks=20, max_model_len=128)
    req = make_request("A", prompt(40), max_tokens=10, temperature=0.0)
    sched.add_request(req)
    out = sched.schedule()
    (new,) = out.scheduled_new_reqs
    assert new.req_id == "A"
    assert new.prompt_token_ids == prompt(40)
    assert new.sampling_params is req.sampling_params
    assert new.block_ids == ([1, 2, 3],)  # cdiv(40, 16) = 3
    assert new.num_computed_tokens == 0
    assert out.scheduled_cached_reqs.num_reqs == 0
    assert out.num_common_prefix_blocks == [3]  # only one request holds blocks
    assert out.step == 1


@pytest.mark.parametrize("enable_prefix_caching", [True, False])
def test_prefix_cache_hit_shows_in_new_request_data(enable_prefix_caching):
    sched = make_scheduler(
        num_blocks=20, max_model_len=128, enable_prefix_caching=enable_prefix_caching
    )
    shared = prompt(32, 500)
    sched.add_request(make_request("A", shared + prompt(8, 1000), max_tokens=1))
    step = run_step(sched)  # A: blocks [1, 2, 3]; finishes and frees them
    assert step.outputs["A"].prefill_stats.num_cached_tokens == 0
    assert step.stats.prefix_cache_stats.queries == (40 if enable_prefix_caching else 0)
    assert step.stats.prefix_cache_stats.hits == 0

    sched.add_request(make_request("B", shared + prompt(10, 2000), max_tokens=1))
    step = run_step(sched)
    (new,) = step.scheduler_output.scheduled_new_reqs
    if enable_prefix_caching:
        # Blocks 1 and 2 (A's two full blocks) are reused; one new block is
        # taken from the head of the free queue (4: 1..3 were returned to the tail).
        assert new.block_ids == ([1, 2, 4],)
        assert new.num_computed_tokens == 32
        assert step.scheduler_output.num_scheduled_tokens == {"B": 10}
        assert step.outputs["B"].prefill_stats.num_cached_tokens == 32
        assert step.stats.prefix_cache_stats.queries == 42
        assert step.stats.prefix_cache_stats.hits == 32
    else:
        assert new.block_ids == ([4, 5, 6],)
        assert new.num_computed_tokens == 0
        assert step.scheduler_output.num_scheduled_tokens == {"B": 42}
        assert step.outputs["B"].prefill_stats.num_cached_tokens == 0
        assert step.stats.prefix_cache_stats.queries == 0


def test_prefill_stats_of_a_cold_prompt_and_of_a_prefix_hit():
    sched = make_scheduler(num_blocks=20, max_model_len=128)
    shared = prompt(48, 700)
    sched.add_request(make_request("cold", shared + prompt(5, 1500), max_tokens=2))
    step = run_step(sched)
    # Nothing cached yet: all 53 prompt tokens are computed.
    assert step.outputs["cold"].prefill_stats == PrefillStats(
        num_prompt_tokens=53,
        num_computed_tokens=53,
        num_cached_tokens=0,
        num_local_cached_tokens=0,
        num_external_cached_tokens=0,
    )
    # Only the first output carries them; the request gave them away.
    step = run_step(sched)
    assert step.outputs["cold"].finish_reason == FinishReason.LENGTH
    assert step.outputs["cold"].prefill_stats is None

    # 48 shared tokens = 3 full blocks of 16 found in the cache; 7 left to run.
    sched.add_request(make_request("warm", shared + prompt(7, 2500), max_tokens=1))
    req = sched.requests["warm"]
    step = run_step(sched)
    assert step.outputs["warm"].prefill_stats == PrefillStats(
        num_prompt_tokens=55,
        num_computed_tokens=7,
        num_cached_tokens=48,
        num_local_cached_tokens=48,
        num_external_cached_tokens=0,
    )
    assert req.prefill_stats is None


def test_prefill_stats_keep_the_first_prefill_of_a_request_preempted_after_its_first_token():
    # The scenario of test_fcfs_preempts_last_running_request_and_resumes_it:
    # B's resumed lookup finds 16 tokens, but B's first output already went
    # out with its cold prefill, so nothing more is reported.
    sched = make_scheduler(num_blocks=5, max_model_len=64)
    sched.add_request(make_request("A", prompt(31, 1000), max_tokens=3))
    sched.add_request(make_request("B", prompt(20, 2000), max_tokens=10))
    req_b = sched.requests["B"]
    step = run_step(sched)
    assert step.outputs["B"].prefill_stats.num_cached_tokens == 0
    run_step(sched)
    sched.add_request(make_request("C", prompt(4, 3000), max_tokens=10))
    assert run_step(sched).scheduler_output.preempted_req_ids == {"B"}
    step = run_step(sched)
    assert step.scheduler_output.scheduled_cached_reqs.num_computed_tokens == [16]
    assert step.outputs["B"].new_token_ids == [TOK]
    assert step.outputs["B"].prefill_stats is None
    assert req_b.prefill_stats is None


def test_prefill_stats_of_a_request_preempted_before_its_first_token_are_its_resumed_ones():
    # As in vLLM: the stats are filled at every admission until the first
    # output takes them. B is preempted inside its prompt (no token yet);
    # its one full block stays cached, so the resumed lookup finds it.
    sched = make_scheduler(
        num_blocks=5,
        max_model_len=64,
        max_num_batched_tokens=16,
        scheduler_reserve_full_isl=False,
    )
    sched.add_request(make_request("A", prompt(31, 1000), max_tokens=4))
    sched.add_request(make_request("B", prompt(20, 2000), max_tokens=10))
    req_b = sched.requests["B"]
    for want in ({"A": 16}, {"A": 15, "B": 1}, {"A": 1, "B": 15}):
        assert run_step(sched).scheduler_output.num_scheduled_tokens == want
    # First admission was cold; B has not produced a token yet.
    assert req_b.prefill_stats.num_cached_tokens == 0
    assert run_step(sched).scheduler_output.preempted_req_ids == {"B"}
    assert req_b.num_output_tokens == 0

    # B's cached block is free but kept; B resumes once A is done.
    steps = [run_step(sched) for _ in range(2)]
    assert "B" not in steps[0].outputs  # A finishes; B does not fit yet
    step = steps[1]
    assert step.scheduler_output.scheduled_cached_reqs.resumed_req_ids == {"B"}
    assert step.scheduler_output.num_scheduled_tokens["B"] == 4
    assert step.outputs["B"].prefill_stats == PrefillStats(
        num_prompt_tokens=20,
        num_computed_tokens=4,
        num_cached_tokens=16,
        num_local_cached_tokens=16,
        num_external_cached_tokens=0,
    )


def test_identical_prompt_hit_is_capped_below_full_length():
    # The last prompt token is always recomputed: a repeated 32-token prompt
    # hits one block (16 tokens), not two.
    sched = make_scheduler(num_blocks=20, max_model_len=128)
    sched.add_request(make_request("A", prompt(32), max_tokens=1))
    run_step(sched)
    sched.add_request(make_request("B", prompt(32), max_tokens=1))
    step = run_step(sched)
    assert step.scheduler_output.scheduled_new_reqs[0].num_computed_tokens == 16
    assert step.scheduler_output.num_scheduled_tokens == {"B": 16}


def test_cached_request_data_for_decodes_and_common_prefix():
    sched = make_scheduler(num_blocks=20, max_model_len=128)
    shared = prompt(32, 500)
    sched.add_request(make_request("A", shared + prompt(8, 1000), max_tokens=10))
    run_step(sched)  # A -> [1, 2, 3], 41 tokens after sampling
    sched.add_request(make_request("B", shared + prompt(1, 2000), max_tokens=10))

    out = run_step(sched).scheduler_output
    cached = out.scheduled_cached_reqs
    assert cached.req_ids == ["A"]
    assert cached.new_block_ids == [None]  # token 41 fits in block 3
    assert cached.num_computed_tokens == [40]
    assert cached.num_output_tokens == [1]
    assert cached.all_token_ids == {}  # A was scheduled in the previous step
    assert cached.resumed_req_ids == set()
    (new,) = out.scheduled_new_reqs
    assert new.block_ids == ([1, 2, 4],)
    assert new.num_computed_tokens == 32
    # A and B both hold blocks 1 and 2.
    assert out.num_common_prefix_blocks == [2]

    out = run_step(sched).scheduler_output
    cached = out.scheduled_cached_reqs
    assert cached.req_ids == ["A", "B"]
    assert cached.new_block_ids == [None, None]
    assert cached.num_computed_tokens == [41, 33]
    assert cached.num_output_tokens == [2, 1]


def test_cached_request_data_new_block_on_boundary():
    sched = make_scheduler(num_blocks=20, max_model_len=128)
    sched.add_request(make_request("A", prompt(32), max_tokens=10))
    run_step(sched)  # blocks [1, 2], exactly full
    out = run_step(sched).scheduler_output  # token 33 needs block 3
    assert out.scheduled_cached_reqs.new_block_ids == [([3],)]
    assert block_ids(sched, "A") == [1, 2, 3]


# ---------------------------------------------------------------------------
# EngineCoreOutputs: per-client grouping, stats, logprobs
# ---------------------------------------------------------------------------
def _request_for_client(req_id, tokens, client_index, **params):
    return Request(
        req_id,
        tokens,
        make_sampling_params(**params),
        client_index=client_index,
        arrival_time=0.0,
        block_hasher=get_request_block_hasher(16, sha256),
    )


def test_outputs_are_grouped_by_client_index():
    sched = make_scheduler()
    sched.add_request(_request_for_client("a0", prompt(10, 1000), 0, max_tokens=5))
    sched.add_request(_request_for_client("b1", prompt(10, 2000), 1, max_tokens=5))
    sched.add_request(_request_for_client("c1", prompt(10, 3000), 1, max_tokens=1))
    step = run_step(sched)
    eco = step.engine_core_outputs
    assert set(eco) == {0, 1}
    assert [o.request_id for o in eco[0].outputs] == ["a0"]
    assert [o.request_id for o in eco[1].outputs] == ["b1", "c1"]
    assert eco[1].outputs[1].finish_reason == FinishReason.LENGTH
    # Scheduler stats ride on client 0's batch only.
    assert eco[0].scheduler_stats is not None
    assert eco[1].scheduler_stats is None
    # Events: QUEUED then SCHEDULED, handed over once.
    assert [e.type for e in eco[0].outputs[0].events] == [
        EngineCoreEventType.QUEUED,
        EngineCoreEventType.SCHEDULED,
    ]
    assert run_step(sched).outputs["a0"].events is None


def test_include_finished_set_tells_each_client_its_finished_ids():
    sched = make_scheduler(include_finished_set=True)
    sched.add_request(_request_for_client("a0", prompt(10, 1000), 0, max_tokens=1))
    sched.add_request(_request_for_client("b1", prompt(10, 2000), 1, max_tokens=3))
    sched.add_request(_request_for_client("c1", prompt(10, 3000), 1, max_tokens=3))
    eco = run_step(sched).engine_core_outputs
    assert eco[0].finished_requests == {"a0"}
    assert eco[1].finished_requests is None
    # An abort between steps is reported with the next batch of that client,
    # even one without outputs of its own.
    sched.finish_requests("c1", RequestStatus.FINISHED_ABORTED)
    sched.finish_requests("b1", RequestStatus.FINISHED_ABORTED)
    eco = run_step(sched).engine_core_outputs
    assert eco[1].outputs == [] and eco[1].finished_requests == {"b1", "c1"}
    assert eco[0].finished_requests is None
    # Reported once.
    assert 1 not in run_step(sched).engine_core_outputs


def test_without_include_finished_set_no_finished_sets():
    sched = make_scheduler()
    sched.add_request(make_request("a", prompt(10, 1000), max_tokens=1))
    assert run_step(sched).engine_core_outputs[0].finished_requests is None


def test_stats_go_to_client_zero_even_without_its_outputs():
    sched = make_scheduler()
    sched.add_request(_request_for_client("b1", prompt(10, 2000), 1, max_tokens=5))
    eco = run_step(sched).engine_core_outputs
    assert set(eco) == {0, 1}
    assert eco[0].outputs == []
    assert eco[0].scheduler_stats.num_running_reqs == 1


def test_log_stats_off_gives_no_stats():
    sched = make_scheduler(log_stats=False)
    assert sched.make_stats() is None
    sched.add_request(_request_for_client("b1", prompt(10, 2000), 1, max_tokens=5))
    step = run_step(sched)
    assert set(step.engine_core_outputs) == {1}
    assert step.engine_core_outputs[1].scheduler_stats is None
    assert step.outputs["b1"].events is None


def test_scheduler_stats_counters():
    # 11 blocks -> 10 usable, so kv_cache_usage moves in steps of 0.1.
    sched = make_scheduler(num_blocks=11, max_model_len=160, max_num_seqs=2)
    sched.add_request(make_request("A", prompt(40, 1000), max_tokens=5))
    sched.add_request(make_request("B", prompt(20, 2000), max_tokens=5))
    sched.add_request(make_request("C", prompt(8, 3000), max_tokens=5))
    stats = run_step(sched).stats
    assert stats.num_running_reqs == 2  # max_num_seqs
    assert stats.num_waiting_reqs == 1
    assert stats.kv_cache_usage == pytest.approx(0.5)  # 3 + 2 blocks
    assert stats.prefix_cache_stats.queries == 60 and stats.prefix_cache_stats.hits == 0
    assert stats.num_preemptions == 0
    # The counters are per step: the next step does no lookups.
    stats = run_step(sched).stats
    assert stats.prefix_cache_stats.queries == 0 and stats.prefix_cache_stats.hits == 0
    assert stats.kv_cache_usage == pytest.approx(0.5)


def test_logprobs_rows_follow_the_model_runner_order():
    sched = make_scheduler()
    sched.add_request(make_request("A", prompt(10, 1000), max_tokens=5, logprobs=1))
    sched.add_request(make_request("B", prompt(10, 2000), max_tokens=5, logprobs=1))
    out = sched.schedule()
    logprobs = LogprobsLists(
        logprob_token_ids=[[11, 11], [22, 22]],
        logprobs=[[-0.1, -0.1], [-0.2, -0.2]],
        sampled_token_ranks=[1, 1],
    )
    mro = make_model_runner_output(sched, out, sampled={"A": [11], "B": [22]}, logprobs=logprobs)
    outputs = {o.request_id: o for o in sched.update_from_output(out, mro)[0].outputs}
    assert outputs["A"].new_logprobs.logprob_token_ids == [[11, 11]]
    assert outputs["B"].new_logprobs.logprob_token_ids == [[22, 22]]


def test_logprobs_rows_follow_req_ids_even_when_the_worker_reorders_requests():
    # ModelRunnerOutput's rows follow *its* req_ids order, which a worker's
    # persistent batch need not keep equal to the scheduler's dict order.
    sched = make_scheduler()
    sched.add_request(make_request("A", prompt(10, 1000), max_tokens=5, logprobs=1))
    sched.add_request(make_request("B", prompt(10, 2000), max_tokens=5, logprobs=1))
    out = sched.schedule()
    assert list(out.num_scheduled_tokens) == ["A", "B"]
    mro = ModelRunnerOutput(
        req_ids=["B", "A"],
        req_id_to_index={"B": 0, "A": 1},
        sampled_token_ids=[[22], [11]],
        logprobs=LogprobsLists(
            logprob_token_ids=[[22, 22], [11, 11]],
            logprobs=[[-0.2, -0.2], [-0.1, -0.1]],
            sampled_token_ranks=[1, 1],
        ),
    )
    outputs = {o.request_id: o for o in sched.update_from_output(out, mro)[0].outputs}
    assert outputs["A"].new_token_ids == [11]
    assert outputs["B"].new_token_ids == [22]
    assert outputs["A"].new_logprobs.logprob_token_ids == [[11, 11]]
    assert outputs["B"].new_logprobs.logprob_token_ids == [[22, 22]]


def test_logprobs_none_when_request_did_not_ask():
    sched = make_scheduler()
    sched.add_request(make_request("A", prompt(10, 1000), max_tokens=5))
    out = sched.schedule()
    mro = make_model_runner_output(sched, out, logprobs=LogprobsLists([[TOK]], [[-0.5]], [1]))
    (output,) = sched.update_from_output(out, mro)[0].outputs
    assert output.new_logprobs is None


# ---------------------------------------------------------------------------
# Prefix cache reset
# ---------------------------------------------------------------------------
def test_reset_prefix_cache_only_when_idle():
    sched = make_scheduler(num_blocks=20, max_model_len=128)
    sched.add_request(make_request("A", prompt(40), max_tokens=2))
    run_step(sched)
    assert sched.reset_prefix_cache() is False  # A still holds blocks
    run_step(sched)  # A finishes
    assert sched.reset_prefix_cache() is True
    sched.add_request(make_request("B", prompt(40), max_tokens=1))
    out = sched.schedule()
    assert out.scheduled_new_reqs[0].num_computed_tokens == 0  # nothing to hit anymore


def test_reset_prefix_cache_with_running_requests_preempts_them_first():
    sched = make_scheduler(num_blocks=20, max_model_len=128)
    for rid, start in (("A", 1000), ("B", 2000), ("C", 3000)):
        sched.add_request(make_request(rid, prompt(20, start), max_tokens=5))
    run_step(sched)
    assert running_ids(sched) == ["A", "B", "C"]
    assert sched.reset_prefix_cache() is False  # refused: blocks in use, nothing moved
    assert running_ids(sched) == ["A", "B", "C"]

    assert sched.reset_prefix_cache(reset_running_requests=True) is True
    assert running_ids(sched) == []
    assert waiting_ids(sched) == ["A", "B", "C"]  # their running order
    assert all(sched.requests[r].status == RequestStatus.PREEMPTED for r in "ABC")
    assert all(sched.requests[r].num_computed_tokens == 0 for r in "ABC")
    assert num_free(sched) == 19
    assert sched.kv_cache_manager.block_pool.cached_block_hash_to_block._cache == {}

    # They come back as resumed, recompute everything (no cache hit is left)
    # and the worker gets their whole token lists again.
    step = run_step(sched)
    cached = step.scheduler_output.scheduled_cached_reqs
    assert cached.resumed_req_ids == {"A", "B", "C"}
    assert cached.all_token_ids["A"] == prompt(20, 1000) + [TOK]
    assert step.scheduler_output.num_scheduled_tokens == {"A": 21, "B": 21, "C": 21}
    assert step.stats.num_preemptions == 3
    assert step.stats.prefix_cache_stats.reset is True


def test_reset_prefix_cache_reset_running_requests_with_nothing_running():
    sched = make_scheduler()
    assert sched.reset_prefix_cache(reset_running_requests=True) is True
    assert sched.reset_prefix_cache(reset_connector=True) is True  # no connector: a no-op


def test_reset_prefix_cache_keeps_priority_order_of_preempted_requests():
    sched = make_scheduler(num_blocks=20, max_model_len=128, policy="priority")
    sched.add_request(make_request("low", prompt(10, 1000), priority=5, arrival_time=1.0))
    sched.add_request(make_request("high", prompt(10, 2000), priority=0, arrival_time=2.0))
    run_step(sched)
    assert sched.reset_prefix_cache(reset_running_requests=True) is True
    assert waiting_ids(sched) == ["high", "low"]


@pytest.mark.parametrize("reserve_full_isl, admitted", [(True, False), (False, True)])
def test_admission_checks_the_whole_prompt_by_default(reserve_full_isl, admitted):
    # 4 usable blocks of 16. A holds 2; B's 40-token prompt needs 3, its first
    # 16-token chunk only 1. vLLM's default admits B only when all 3 fit.
    sched = make_scheduler(
        num_blocks=5,
        max_model_len=64,
        long_prefill_token_threshold=16,
        scheduler_reserve_full_isl=reserve_full_isl,
    )
    sched.add_request(make_request("A", prompt(17, 1000), max_tokens=8))
    run_step(sched)
    run_step(sched)  # A: 17 computed -> 2 blocks
    assert num_free(sched) == 2
    sched.add_request(make_request("B", prompt(40, 2000), max_tokens=4))
    out = run_step(sched).scheduler_output
    assert ("B" in out.num_scheduled_tokens) is admitted
    if admitted:
        assert out.num_scheduled_tokens["B"] == 16
    else:
        assert [r.request_id for r in sched.waiting] == ["B"]
