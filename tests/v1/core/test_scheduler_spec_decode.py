"""The scheduler's side of speculative decoding (engine/v1/core/sched/scheduler.py).

vLLM's tests of the same bookkeeping live in tests/v1/core/test_scheduler.py
(``test_schedule_spec_decoding_stats``, ``test_spec_decoding_with_*``). Here a
real ``Scheduler`` with an n-gram ``SpeculativeConfig`` is driven by hand, as
EngineCore's serial loop drives it: ``schedule()``, a hand-made
``ModelRunnerOutput`` (a request with drafts returns its accepted drafts plus
one token of the target's own), ``update_from_output()``, then
``update_draft_token_ids()`` with the drafts the proposer would have made.

What must hold:
  * drafts are scheduled after a running request's known tokens
    (``num_scheduled_tokens = 1 + k``, ``scheduled_spec_decode_tokens``), cut
    short by the token budget, the long-prefill threshold and
    ``max_model_len``;
  * ``update_from_output`` steps ``num_computed_tokens`` back over the
    rejected drafts (none, some, all accepted), keeps their blocks, and never
    lets a rejected draft into the prefix cache;
  * drafts for a prefill chunk, a finished, an aborted or an unknown request
    are ignored; preemption (FCFS, and the refund of an already scheduled
    victim under PRIORITY) drops them;
  * a stop token or ``max_tokens`` inside the accepted drafts ends the request
    there, the tokens after it discarded;
  * n-gram reserves no lookahead slots (EAGLE / a draft model would);
  * a Hypothesis state machine (the one of test_scheduler_properties.py, with
    random drafts and acceptances) keeps the block and queue invariants, and
    every request's output is what the fake runner emitted, cut at its stop.

Block size 16 throughout; a pool of N blocks has ids 1..N-1 (0 is the null block).
"""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import initialize, invariant, rule

from engine.config import SpeculativeConfig
from engine.v1.core.sched.scheduler import Scheduler
from engine.v1.engine import FinishReason
from engine.v1.outputs import DraftTokenIds
from engine.v1.request import Request, RequestStatus
from engine.v1.utils import cdiv
from tests.helpers.core import (
    get_request_block_ids,
    make_model_runner_output,
    make_request,
    make_scheduler,
    run_step,
)
from tests.v1.core.test_scheduler_properties import (
    BLOCK_SIZE,
    EOS,
    STOP,
    VOCAB,
    SchedulerMachine,
)

K = 3  # num_speculative_tokens
TOK = 100  # the token a request samples by default in these tests


def make_spec_scheduler(
    k: int = K, method: str = "ngram", include_finished_set: bool = False, **kwargs
) -> Scheduler:
    """``make_scheduler(**kwargs)``'s scheduler, built from the same configs
    plus a ``SpeculativeConfig`` with ``k`` drafts per step.

    ``method="ngram"`` goes through ``GlassboxConfig``'s checks. Any other
    method is set on the config afterwards (GlassboxConfig does not run it
    yet): only the scheduler's reading of it (lookahead slots) is tested.
    """
    plain = make_scheduler(include_finished_set=include_finished_set, **kwargs)
    if method == "ngram":
        spec = SpeculativeConfig(
            method="ngram", num_speculative_tokens=k, prompt_lookup_min=1, prompt_lookup_max=3
        )
        # async_scheduling back to unset: GlassboxConfig resolves it again
        # (n-gram turns it off).
        config = dataclasses.replace(
            plain.glassbox_config,
            scheduler_config=dataclasses.replace(plain.scheduler_config, async_scheduling=None),
            speculative_config=spec,
        )
        assert not config.scheduler_config.async_scheduling
    else:
        config = dataclasses.replace(plain.glassbox_config)
        config.speculative_config = SpeculativeConfig(
            method=method, model=f"{method}-head", num_speculative_tokens=k
        )
    return Scheduler(
        config,
        plain.kv_cache_config,
        None,
        plain.block_size,
        include_finished_set=include_finished_set,
        log_stats=True,
    )


def prompt(num_tokens: int, start: int = 1000) -> list[int]:
    return list(range(start, start + num_tokens))


def set_drafts(scheduler: Scheduler, drafts: dict[str, list[int]]) -> None:
    """What EngineCore.post_step does with the proposer's drafts."""
    scheduler.update_draft_token_ids(DraftTokenIds(list(drafts), list(drafts.values())))


def block_ids(scheduler: Scheduler, req_id: str) -> list[int]:
    return get_request_block_ids(scheduler.kv_cache_manager, req_id)


def num_free(scheduler: Scheduler) -> int:
    return scheduler.kv_cache_manager.block_pool.get_num_free_blocks()


def start_decoding(scheduler: Scheduler, *requests: Request) -> None:
    """Add the requests and run their prompts (one step, each samples TOK)."""
    for request in requests:
        scheduler.add_request(request)
    step = run_step(scheduler, default_token_id=TOK)
    assert set(step.scheduler_output.num_scheduled_tokens) == {r.request_id for r in requests}
    for request in requests:
        assert request.output_token_ids == [TOK]
        assert request.num_computed_tokens == request.num_tokens - 1


# ---------------------------------------------------------------------------
# Drafts are scheduled after the known tokens
# ---------------------------------------------------------------------------
def test_ngram_config_sets_k_and_no_lookahead():
    scheduler = make_spec_scheduler(k=4)
    assert scheduler.num_spec_tokens == 4
    # n-gram drafts are made on the host after the step: no KV slot to reserve.
    assert scheduler.num_lookahead_tokens == 0
    assert make_scheduler().num_spec_tokens == 0


@pytest.mark.parametrize(("method", "expected_blocks"), [("ngram", 1), ("eagle", 2)])
def test_lookahead_slots_only_for_model_proposers(method, expected_blocks):
    """A 15-token prompt plus one sampled token fills block 1 exactly. The
    decode step writes position 15: n-gram needs no more; EAGLE reserves k
    slots beyond it, i.e. a second block (vLLM's num_lookahead_tokens)."""
    scheduler = make_spec_scheduler(method=method, num_blocks=10, max_model_len=128)
    assert scheduler.num_lookahead_tokens == (0 if method == "ngram" else K)
    request = make_request("a", prompt(15))
    scheduler.add_request(request)
    # A fresh prompt reserves no lookahead (nothing drafted yet).
    run_step(scheduler, default_token_id=TOK)
    assert len(block_ids(scheduler, "a")) == 1
    run_step(scheduler, default_token_id=TOK)
    assert len(block_ids(scheduler, "a")) == expected_blocks


def test_drafts_scheduled_after_known_tokens():
    scheduler = make_spec_scheduler()
    request = make_request("a", prompt(10), max_tokens=20)
    start_decoding(scheduler, request)  # 11 tokens, 10 computed
    set_drafts(scheduler, {"a": [7, 8, 9]})
    assert request.spec_token_ids == [7, 8, 9]
    assert request.num_tokens == 11 and request.num_tokens_with_spec == 14

    out = scheduler.schedule()
    # The last known token and the three drafts: positions 10..13.
    assert out.num_scheduled_tokens == {"a": 1 + 3}
    assert out.total_num_scheduled_tokens == 4
    assert out.scheduled_spec_decode_tokens == {"a": [7, 8, 9]}
    assert out.scheduled_cached_reqs.num_computed_tokens == [10]
    # The drafts are not tokens of the request, and are spent once scheduled.
    assert request.num_tokens == 11
    assert request.spec_token_ids == []
    assert request.num_computed_tokens == 14


def test_request_without_drafts_schedules_one_token():
    scheduler = make_spec_scheduler()
    a, b = make_request("a", prompt(10)), make_request("b", prompt(10, start=2000))
    start_decoding(scheduler, a, b)
    set_drafts(scheduler, {"a": [7, 8], "b": []})
    out = scheduler.schedule()
    assert out.num_scheduled_tokens == {"a": 3, "b": 1}
    assert out.scheduled_spec_decode_tokens == {"a": [7, 8]}


# ---------------------------------------------------------------------------
# Rollback of num_computed_tokens
# ---------------------------------------------------------------------------
@pytest.mark.parametrize("num_accepted", [0, 1, 2, 3])
def test_rollback_by_rejected_drafts(num_accepted):
    """A 14-token prompt and one sampled token: 15 tokens, 14 computed. The
    drafts take positions 14..17, so the step needs a second block. The
    runner returns the accepted drafts plus one token of its own; the cursor
    lands on the last of them (not computed yet), whatever was rejected."""
    scheduler = make_spec_scheduler(num_blocks=10, max_model_len=128)
    request = make_request("a", prompt(14), max_tokens=50)
    start_decoding(scheduler, request)
    drafts = [7, 8, 9]
    set_drafts(scheduler, {"a": drafts})
    free_before = num_free(scheduler)

    out = scheduler.schedule()
    assert out.num_scheduled_tokens == {"a": 4}
    assert request.num_computed_tokens == 18
    table = block_ids(scheduler, "a")
    assert len(table) == 2 and num_free(scheduler) == free_before - 1

    generated = drafts[:num_accepted] + [55]
    mro = make_model_runner_output(scheduler, out, {"a": generated})
    outputs = scheduler.update_from_output(out, mro)[0].outputs
    assert [o.new_token_ids for o in outputs] == [generated]
    assert request.output_token_ids == [TOK, *generated]
    # 18 scheduled positions minus the rejected drafts.
    assert request.num_computed_tokens == 18 - (3 - num_accepted) == 15 + num_accepted
    assert request.num_computed_tokens == request.num_tokens - 1
    # vLLM keeps the blocks of rejected positions: the next steps overwrite them.
    assert block_ids(scheduler, "a") == table
    assert num_free(scheduler) == free_before - 1

    # The next step starts at the rolled-back cursor, in the same blocks.
    out = scheduler.schedule()
    assert out.scheduled_cached_reqs.num_computed_tokens == [15 + num_accepted]
    assert out.num_scheduled_tokens == {"a": 1}
    assert out.scheduled_cached_reqs.new_block_ids == [None]
    assert block_ids(scheduler, "a") == table


def test_rollback_with_two_requests_in_one_step():
    """Rollback is per request: one accepts everything, the other nothing."""
    scheduler = make_spec_scheduler()
    a, b = make_request("a", prompt(5)), make_request("b", prompt(9, start=2000))
    start_decoding(scheduler, a, b)  # a: 6 tokens / 5 computed; b: 10 / 9
    set_drafts(scheduler, {"a": [1, 2, 3], "b": [4, 5]})
    step = run_step(scheduler, {"a": [1, 2, 3, 60], "b": [61]})
    assert step.scheduler_output.num_scheduled_tokens == {"a": 4, "b": 3}
    assert step.outputs["a"].new_token_ids == [1, 2, 3, 60]
    assert step.outputs["b"].new_token_ids == [61]
    assert (a.num_computed_tokens, a.num_tokens) == (9, 10)
    assert (b.num_computed_tokens, b.num_tokens) == (10, 11)


# ---------------------------------------------------------------------------
# Truncation: budget, long-prefill threshold, max_model_len
# ---------------------------------------------------------------------------
@pytest.mark.parametrize(("budget", "b_drafts"), [(8, [21, 22, 23]), (6, [21]), (5, None)])
def test_drafts_truncated_by_token_budget(budget, b_drafts):
    """Two 2-token prompts (one step). Next step a takes 1 + 3;
    b gets what is left: 4, 2 (one draft) or 1 (no draft, nothing in
    scheduled_spec_decode_tokens). Drafts that did not fit are dropped."""
    scheduler = make_spec_scheduler(max_num_batched_tokens=budget)
    a, b = make_request("a", prompt(2)), make_request("b", prompt(2, start=2000))
    start_decoding(scheduler, a, b)
    set_drafts(scheduler, {"a": [11, 12, 13], "b": [21, 22, 23]})
    out = scheduler.schedule()
    num_b = budget - 4
    assert out.num_scheduled_tokens == {"a": 4, "b": num_b}
    expected = {"a": [11, 12, 13]}
    if b_drafts is not None:
        expected["b"] = b_drafts
    assert out.scheduled_spec_decode_tokens == expected
    assert a.spec_token_ids == b.spec_token_ids == []
    # b accepts every draft it verified.
    generated = {"a": [11, 12, 13, 14], "b": [*(b_drafts or []), 30]}
    mro = make_model_runner_output(scheduler, out, generated)
    scheduler.update_from_output(out, mro)
    assert b.output_token_ids == [TOK, *generated["b"]]
    assert b.num_computed_tokens == b.num_tokens - 1 == 2 + num_b


def test_request_left_out_by_the_budget_keeps_its_drafts():
    """Budget 4: a's step (1 + 3) uses it all, so b is not reached and keeps
    its drafts (its tokens did not move, so they still fit); the next step
    verifies them in what a leaves."""
    scheduler = make_spec_scheduler(max_num_batched_tokens=4)
    a, b = make_request("a", prompt(2)), make_request("b", prompt(2, start=2000))
    start_decoding(scheduler, a, b)
    set_drafts(scheduler, {"a": [11, 12, 13], "b": [21, 22, 23]})
    step = run_step(scheduler, {"a": [11, 12, 13, 14]})
    assert step.scheduler_output.num_scheduled_tokens == {"a": 4}
    assert b.spec_token_ids == [21, 22, 23]
    out = scheduler.schedule()
    assert out.num_scheduled_tokens == {"a": 1, "b": 3}
    assert out.scheduled_spec_decode_tokens == {"b": [21, 22]}


def test_drafts_truncated_by_long_prefill_threshold():
    """vLLM clamps every running request by the threshold, drafts included."""
    scheduler = make_spec_scheduler(long_prefill_token_threshold=2)
    request = make_request("a", prompt(2))
    start_decoding(scheduler, request)
    set_drafts(scheduler, {"a": [11, 12, 13]})
    out = scheduler.schedule()
    assert out.num_scheduled_tokens == {"a": 2}
    assert out.scheduled_spec_decode_tokens == {"a": [11]}


@pytest.mark.parametrize(
    ("prompt_len", "expected_drafts"),
    [(10, [11, 12, 13]), (11, [11, 12, 13]), (12, [11, 12]), (14, None)],
)
def test_drafts_truncated_by_max_model_len(prompt_len, expected_drafts):
    """max_model_len 16: the last position a step may compute is 15. After
    the prompt and one sampled token the request is at ``prompt_len``; the
    drafts get positions up to 15 at most. Everything accepted reaches 16
    tokens: finished by length, with no token past the window."""
    scheduler = make_spec_scheduler(num_blocks=2, max_model_len=16)
    request = make_request("a", prompt(prompt_len), max_tokens=50)
    start_decoding(scheduler, request)
    set_drafts(scheduler, {"a": [11, 12, 13]})
    out = scheduler.schedule()
    num_drafts = len(expected_drafts or [])
    assert out.num_scheduled_tokens == {"a": 1 + num_drafts}
    assert out.scheduled_spec_decode_tokens == ({"a": expected_drafts} if expected_drafts else {})
    assert request.num_computed_tokens <= 15
    generated = [*(expected_drafts or []), 40]
    mro = make_model_runner_output(scheduler, out, {"a": generated})
    outputs = scheduler.update_from_output(out, mro)[0].outputs
    assert request.num_tokens <= 16
    if prompt_len + 1 + len(generated) == 16:
        assert outputs[0].finish_reason == FinishReason.LENGTH
        assert outputs[0].new_token_ids == generated
        assert num_free(scheduler) == 1
    else:
        assert outputs[0].finish_reason is None


# ---------------------------------------------------------------------------
# Drafts that must be ignored or dropped
# ---------------------------------------------------------------------------
def test_drafts_for_a_prefill_chunk_are_ignored():
    scheduler = make_spec_scheduler(max_num_batched_tokens=8)
    request = make_request("a", prompt(20))
    scheduler.add_request(request)
    run_step(scheduler)  # positions 0..7: mid-prompt, samples nothing
    assert request.is_prefill_chunk
    set_drafts(scheduler, {"a": [1, 2, 3]})
    assert request.spec_token_ids == []
    out = scheduler.schedule()
    assert out.num_scheduled_tokens == {"a": 8}
    assert out.scheduled_spec_decode_tokens == {}


def test_drafts_for_finished_aborted_or_unknown_requests_are_ignored():
    scheduler = make_spec_scheduler()
    a = make_request("a", prompt(4), eos_token_id=EOS)
    b = make_request("b", prompt(4, start=2000))
    c = make_request("c", prompt(4, start=3000))
    start_decoding(scheduler, a, b, c)
    step = run_step(scheduler, {"a": [EOS]})  # a stops
    assert step.outputs["a"].finish_reason == FinishReason.STOP
    scheduler.finish_requests("b", RequestStatus.FINISHED_ABORTED)
    set_drafts(scheduler, {"a": [1, 2], "b": [3, 4], "gone": [5], "c": [6, 7]})
    assert a.spec_token_ids == [] and b.spec_token_ids == []
    assert c.spec_token_ids == [6, 7]
    assert set(scheduler.requests) == {"c"}
    out = scheduler.schedule()
    assert out.num_scheduled_tokens == {"c": 3}
    assert out.scheduled_spec_decode_tokens == {"c": [6, 7]}


def test_abort_while_drafts_are_verified():
    """Aborted while its verification step runs: the runner's tokens are
    dropped, and its blocks are already back in the pool."""
    scheduler = make_spec_scheduler(num_blocks=10, max_model_len=128)
    request = make_request("a", prompt(14))
    start_decoding(scheduler, request)
    set_drafts(scheduler, {"a": [1, 2, 3]})
    out = scheduler.schedule()
    scheduler.finish_requests("a", RequestStatus.FINISHED_ABORTED)
    assert num_free(scheduler) == 9
    mro = make_model_runner_output(scheduler, out, {"a": [1, 2, 3, 4]})
    assert scheduler.update_from_output(out, mro)[0].outputs == []
    assert request.output_token_ids == [TOK]
    set_drafts(scheduler, {"a": [5]})
    assert scheduler.schedule().num_scheduled_tokens == {}


def test_fcfs_preemption_drops_drafts():
    """Two usable blocks, two 15-token prompts (one block each). Both have
    drafts; a's reach position 18, so a needs a second block and b (the
    tail) is preempted before its turn: its drafts are gone and it
    recomputes from zero, without drafts."""
    scheduler = make_spec_scheduler(num_blocks=3, max_model_len=32)
    a, b = make_request("a", prompt(15)), make_request("b", prompt(15, start=2000))
    start_decoding(scheduler, a, b)
    set_drafts(scheduler, {"a": [1, 2, 3], "b": [4, 5, 6]})
    out = scheduler.schedule()
    assert out.preempted_req_ids == {"b"}
    assert out.num_scheduled_tokens == {"a": 4}
    assert out.scheduled_spec_decode_tokens == {"a": [1, 2, 3]}
    assert b.status == RequestStatus.PREEMPTED
    assert b.spec_token_ids == [] and b.num_computed_tokens == 0


def test_preempt_request_clears_drafts():
    scheduler = make_spec_scheduler()
    request = make_request("a", prompt(5))
    start_decoding(scheduler, request)
    set_drafts(scheduler, {"a": [1, 2, 3]})
    scheduler.running.remove(request)
    scheduler._preempt_request(request, 0.0)
    assert request.spec_token_ids == []
    out = scheduler.schedule()
    # Back as a resumed request: its 6 tokens recomputed, no drafts.
    assert out.num_scheduled_tokens == {"a": 6}
    assert out.scheduled_spec_decode_tokens == {}


def test_priority_preemption_refund_drops_scheduled_drafts():
    """PRIORITY, 3 usable blocks. a (priority 1, the worse) is admitted
    first; b (priority 0) later with a 31-token prompt. a's drafts fit in
    its block and are scheduled first; b's drafts need a 4th block, so the
    victim is a, already scheduled: its tokens are refunded and its drafts
    must leave scheduled_spec_decode_tokens with it."""
    scheduler = make_spec_scheduler(num_blocks=4, max_model_len=48, policy="priority")
    a = make_request("a", prompt(5), priority=1, arrival_time=1.0)
    b = make_request("b", prompt(31, start=2000), priority=0, arrival_time=2.0)
    start_decoding(scheduler, a)  # a: 6 tokens
    scheduler.add_request(b)
    run_step(scheduler, default_token_id=TOK)  # a decodes, b's prompt runs
    assert [r.request_id for r in scheduler.running] == ["a", "b"]
    assert num_free(scheduler) == 0
    set_drafts(scheduler, {"a": [1, 2, 3], "b": [4, 5, 6]})
    out = scheduler.schedule()
    assert out.preempted_req_ids == {"a"}
    assert out.num_scheduled_tokens == {"b": 4}
    assert out.total_num_scheduled_tokens == 4
    assert out.scheduled_spec_decode_tokens == {"b": [4, 5, 6]}
    assert a.spec_token_ids == [] and a.num_computed_tokens == 0
    assert a.status == RequestStatus.PREEMPTED


# ---------------------------------------------------------------------------
# Stops inside the accepted drafts
# ---------------------------------------------------------------------------
@pytest.mark.parametrize("stop", ["stop_token", "eos"])
def test_stop_token_inside_accepted_drafts(stop):
    stop_id = STOP if stop == "stop_token" else EOS
    scheduler = make_spec_scheduler()
    request = make_request(
        "a",
        prompt(5),
        max_tokens=20,
        eos_token_id=EOS,
        stop_token_ids=[STOP] if stop == "stop_token" else None,
    )
    start_decoding(scheduler, request)
    set_drafts(scheduler, {"a": [7, stop_id, 9]})
    step = run_step(scheduler, {"a": [7, stop_id, 9, 11]})  # all accepted + bonus
    output = step.outputs["a"]
    # The tokens after the stop are discarded.
    assert output.new_token_ids == [7, stop_id]
    assert request.output_token_ids == [TOK, 7, stop_id]
    assert output.finish_reason == FinishReason.STOP
    assert output.stop_reason == (STOP if stop == "stop_token" else None)
    assert "a" not in scheduler.requests and num_free(scheduler) == 999


def test_min_tokens_hides_a_stop_inside_drafts():
    """min_tokens counts per token: an EOS before it is reached does not
    stop, a later one inside the same step does."""
    scheduler = make_spec_scheduler()
    request = make_request("a", prompt(5), max_tokens=20, eos_token_id=EOS, min_tokens=3)
    start_decoding(scheduler, request)
    set_drafts(scheduler, {"a": [EOS, EOS, 9]})
    output = run_step(scheduler, {"a": [EOS, EOS, 9, 10]}).outputs["a"]
    assert output.new_token_ids == [EOS, EOS]
    assert request.output_token_ids == [TOK, EOS, EOS]
    assert output.finish_reason == FinishReason.STOP


def test_max_tokens_reached_inside_drafts():
    scheduler = make_spec_scheduler()
    request = make_request("a", prompt(5), max_tokens=3)
    start_decoding(scheduler, request)
    set_drafts(scheduler, {"a": [7, 8, 9]})
    output = run_step(scheduler, {"a": [7, 8, 9, 10]}).outputs["a"]
    assert output.new_token_ids == [7, 8]
    assert request.output_token_ids == [TOK, 7, 8]
    assert output.finish_reason == FinishReason.LENGTH
    assert "a" not in scheduler.requests


# ---------------------------------------------------------------------------
# The prefix cache only ever holds verified tokens
# ---------------------------------------------------------------------------
def test_prefix_cache_never_holds_rejected_drafts():
    """13-token prompt P, sampled s0: 14 tokens. Step 2 verifies drafts
    a b c at positions 13..16, so block 1 would be full *with the drafts*
    (P s0 a b); they are rejected for x. Step 3 verifies y z w at 14..17,
    all accepted (+ bonus v): block 1 is now P s0 x y, all verified, and is
    cached by the next allocation. A prompt that follows the rejected path
    must find no hit; one that follows the verified path must hit 16 tokens."""
    scheduler = make_spec_scheduler(num_blocks=10, max_model_len=128)
    manager = scheduler.kv_cache_manager
    p = prompt(13)
    s0, (a, b, c), x, (y, z, w), v = TOK, (201, 202, 203), 300, (301, 302, 303), 304
    request = make_request("r", p, max_tokens=50)
    start_decoding(scheduler, request)

    set_drafts(scheduler, {"r": [a, b, c]})
    out = scheduler.schedule()
    assert out.num_scheduled_tokens == {"r": 4}
    assert len(block_ids(scheduler, "r")) == 2
    update = make_model_runner_output(scheduler, out, {"r": [x]})
    scheduler.update_from_output(out, update)
    assert request.all_token_ids == [*p, s0, x]

    set_drafts(scheduler, {"r": [y, z, w]})
    run_step(scheduler, {"r": [y, z, w, v]})
    assert request.all_token_ids == [*p, s0, x, y, z, w, v]
    run_step(scheduler, default_token_id=TOK)  # caches block 1
    (first, second) = (manager.block_pool.blocks[i] for i in block_ids(scheduler, "r"))
    assert len(request.block_hashes) == 1
    assert first.block_hash is not None and second.block_hash is None

    rejected_path = make_request("probe1", [*p, s0, a, b, 5])
    verified_path = make_request("probe2", [*p, s0, x, y, 5])
    assert manager.get_computed_blocks(rejected_path)[1] == 0
    hit_blocks, num_hit = manager.get_computed_blocks(verified_path)
    assert num_hit == 16
    assert hit_blocks.blocks[0][0] is first


def test_no_block_is_cached_while_its_tokens_are_drafts():
    """Right after scheduling drafts that fill a block, the block has no hash."""
    scheduler = make_spec_scheduler(num_blocks=10, max_model_len=128)
    request = make_request("r", prompt(13))
    start_decoding(scheduler, request)
    set_drafts(scheduler, {"r": [201, 202, 203]})
    scheduler.schedule()
    pool = scheduler.kv_cache_manager.block_pool
    assert all(pool.blocks[i].block_hash is None for i in block_ids(scheduler, "r"))
    assert request.block_hashes == []


# ---------------------------------------------------------------------------
# Hypothesis: the scheduler state machine with random drafts
# ---------------------------------------------------------------------------
DRAFT_TOKENS = [*VOCAB, *VOCAB, EOS, STOP]


def _finish(params, num_prompt_tokens, outputs, max_model_len):
    """The stop rules after the last of ``outputs`` (an independent oracle)."""
    if len(outputs) < params.min_tokens:
        return None, None
    last = outputs[-1]
    if not params.ignore_eos and last == EOS:
        return FinishReason.STOP, None
    if last in params.stop_token_ids:
        return FinishReason.STOP, last
    if num_prompt_tokens + len(outputs) >= max_model_len or len(outputs) >= params.max_tokens:
        return FinishReason.LENGTH, None
    return None, None


def expected_kept(request: Request, before: list[int], emitted: list[int], max_model_len: int):
    """The prefix of ``emitted`` the scheduler must keep, and the finish."""
    outputs = list(before)
    for i, token in enumerate(emitted):
        outputs.append(token)
        reason, stop_reason = _finish(
            request.sampling_params, request.num_prompt_tokens, outputs, max_model_len
        )
        if reason is not None:
            return emitted[: i + 1], reason, stop_reason
    return list(emitted), None, None


class SpecSchedulerMachine(SchedulerMachine):
    """``SchedulerMachine``'s rules and block invariants, on a scheduler with
    n-gram speculation; steps return random accepted prefixes of the drafts,
    and the fake proposer hands every scheduled request random drafts
    (prefill chunks, finished and aborted ones included: they must be ignored)."""

    @initialize(
        max_model_len=st.sampled_from([128, 96, 64, 48]),
        extra_blocks=st.integers(0, 4),
        enable_chunked_prefill=st.booleans(),
        enable_prefix_caching=st.booleans(),
        budget=st.sampled_from([64, 32, 160, 16, 100, 8, 3, 1]),
        max_num_seqs=st.sampled_from([4, 2, 8, 3, 6, 1]),
        threshold=st.sampled_from([0, 0, 1, 7, 16, 40]),
        num_initial_requests=st.integers(2, 8),
        k=st.integers(1, 4),
        data=st.data(),
    )
    def setup(self, k, **kwargs):
        # The parent builds a plain scheduler and queues the first requests;
        # rebuild it with speculation and queue the same requests again.
        super().setup(**kwargs)
        self.k = k
        # The config refuses a budget below one request's 1 + k tokens.
        self.budget = max(self.budget, 1 + k)
        self.sched = make_spec_scheduler(
            k=k,
            num_blocks=self.num_blocks,
            block_size=BLOCK_SIZE,
            max_model_len=self.max_model_len,
            max_num_batched_tokens=self.budget,
            max_num_seqs=self.max_num_seqs,
            enable_chunked_prefill=self.chunked,
            long_prefill_token_threshold=self.threshold,
            policy=self.POLICY,
            enable_prefix_caching=self.caching,
        )
        for request in self.live.values():
            self.sched.add_request(request)
        # req_id -> the furthest position + 1 it had slots for since admission.
        self.high_water: dict[str, int] = {}

    @rule(
        num_steps=st.integers(1, 6),
        tokens=st.lists(st.sampled_from(DRAFT_TOKENS), min_size=7, max_size=7),
        accepts=st.lists(st.integers(0, 4), min_size=7, max_size=7),
        drafts=st.lists(
            st.lists(st.sampled_from(DRAFT_TOKENS), max_size=4), min_size=7, max_size=7
        ),
        abort_in_flight=st.sampled_from([(), (), (), (0,), (1,), (2, 0)]),
    )
    def step(self, num_steps, tokens, accepts, drafts, abort_in_flight):
        for n in range(num_steps):
            self._spec_step(
                lambda i, n=n: tokens[(i + n) % 7],
                lambda i, n=n: accepts[(i + n) % 7],
                lambda i, n=n: drafts[(i + n) % 7],
                abort_in_flight if n == 0 else (),
            )
            if n + 1 < num_steps:
                self.check_blocks()
                self.check_queues()

    def _step(self, pick_token, abort_in_flight):
        # The parent's drain: EOS as the target's own token, after two
        # accepted drafts.
        self._spec_step(pick_token, lambda i: 2, lambda i: [VOCAB[0], VOCAB[1]], abort_in_flight)

    def _spec_step(self, pick_token, pick_accept, pick_drafts, abort_in_flight):
        sched = self.sched
        before = {
            rid: (r.status, r.num_computed_tokens, r.num_tokens, list(r.spec_token_ids))
            for rid, r in self.live.items()
        }
        out = sched.schedule()
        assert out.finished_req_ids == self.pending_finished
        self.pending_finished = set()
        scheduled = out.num_scheduled_tokens
        assert out.total_num_scheduled_tokens == sum(scheduled.values()) <= self.budget
        assert set(out.scheduled_spec_decode_tokens) <= set(scheduled)
        assert not out.preempted_req_ids & set(scheduled)

        for req_id in out.preempted_req_ids:
            request = self.live[req_id]
            assert request.status == RequestStatus.PREEMPTED
            assert request.num_computed_tokens == 0 and request.spec_token_ids == []
            self.high_water.pop(req_id, None)
            event("preempted a request")
        for req_id, num_new in scheduled.items():
            request = self.live[req_id]
            status, computed, num_tokens, drafts = before[req_id]
            spec = out.scheduled_spec_decode_tokens.get(req_id, [])
            if status == RequestStatus.RUNNING:
                # The drafts follow the known tokens, as many as were scheduled.
                assert request.num_computed_tokens == computed + num_new
                assert spec == drafts[: max(0, computed + num_new - num_tokens)]
                if spec:
                    event(f"verified {len(spec)} of {len(drafts)} drafts")
                if 0 < len(spec) < len(drafts):
                    event("drafts truncated")
            else:
                assert spec == [] and drafts == []  # admitted: nothing drafted yet
            assert request.spec_token_ids == []
            assert request.num_computed_tokens <= request.num_tokens + len(spec)
            assert request.num_computed_tokens <= self.max_model_len - 1
            self.high_water[req_id] = max(
                self.high_water.get(req_id, 0), request.num_computed_tokens
            )

        # The fake runner: accepted drafts plus one token of the target's own.
        sampled: dict[str, list[int]] = {}
        for i, req_id in enumerate(scheduled):
            request = self.live[req_id]
            if request.is_prefill_chunk:
                sampled[req_id] = []
                continue
            spec = out.scheduled_spec_decode_tokens.get(req_id, [])
            num_accepted = min(pick_accept(i), len(spec))
            if num_accepted < len(spec):
                event("rejected drafts")
            sampled[req_id] = [*spec[:num_accepted], pick_token(i)]
        mro = make_model_runner_output(sched, out, sampled)

        ids = list(scheduled)
        aborted_now = {ids[i] for i in abort_in_flight if i < len(ids)}
        if aborted_now:
            result = sched.finish_requests(aborted_now, RequestStatus.FINISHED_ABORTED)
            assert {rid for rid, _ in result} == aborted_now
            for req_id in aborted_now:
                self.live.pop(req_id)
                self.high_water.pop(req_id, None)
                self.ended.add(req_id)
                self.pending_finished.add(req_id)

        outputs_before = {
            rid: list(self.live[rid].output_token_ids) for rid in scheduled if rid in self.live
        }
        engine_core_outputs = sched.update_from_output(out, mro)
        outputs = {o.request_id: o for eco in engine_core_outputs.values() for o in eco.outputs}
        assert set(outputs) <= set(scheduled) - aborted_now

        for req_id, old in outputs_before.items():
            request = self.live[req_id]
            emitted = sampled[req_id]
            kept, reason, stop_reason = expected_kept(request, old, emitted, self.max_model_len)
            # The client sees exactly what the runner emitted, cut at the stop.
            assert list(request.output_token_ids) == old + kept
            if not emitted:
                assert req_id not in outputs
                assert request.num_computed_tokens < request.num_tokens
                continue
            output = outputs[req_id]
            assert output.new_token_ids == kept
            assert output.finish_reason == reason
            if len(kept) < len(emitted):
                event("stopped inside the drafts")
            if reason is None:
                assert request.status == RequestStatus.RUNNING
                # Rolled back over the rejected drafts: only the last token
                # (the target's own) is still to be computed.
                assert request.num_computed_tokens == request.num_tokens - 1
            else:
                assert output.stop_reason == stop_reason
                assert request.is_finished() and req_id not in sched.requests
                self.live.pop(req_id)
                self.high_water.pop(req_id, None)
                self.ended.add(req_id)
                self.pending_finished.add(req_id)

        # The proposer: drafts for every row of the step.
        drafts = [list(pick_drafts(i))[: self.k] for i in range(len(ids))]
        sched.update_draft_token_ids(DraftTokenIds([*ids, "unknown"], [*drafts, [VOCAB[0]]]))
        for req_id, draft in zip(ids, drafts):
            request = self.live.get(req_id)
            if request is None:
                continue
            assert request.spec_token_ids == ([] if request.is_prefill_chunk else draft)

    @invariant()
    def check_queues(self):
        """The parent's queue checks, with the table rule of speculation: a
        running request holds the blocks of the furthest position it was
        scheduled to, rejected drafts included (no block freed on rollback,
        no lookahead for n-gram)."""
        if self.sched is None:
            return
        sched = self.sched
        running = [r.request_id for r in sched.running]
        waiting = [r.request_id for r in [*sched.waiting, *sched.skipped_waiting]]
        assert len(running) == len(set(running)) and len(waiting) == len(set(waiting))
        assert set(running) | set(waiting) == set(self.live) == set(sched.requests)
        assert not set(running) & set(waiting)
        for request in sched.running:
            req_id = request.request_id
            assert request.status == RequestStatus.RUNNING
            assert 0 < request.num_computed_tokens <= request.num_tokens < self.max_model_len
            assert len(self._table(req_id)) == cdiv(self.high_water[req_id], BLOCK_SIZE)
            assert len(self._table(req_id)) >= cdiv(request.num_computed_tokens, BLOCK_SIZE)
        for request in [*sched.waiting, *sched.skipped_waiting]:
            assert request.num_computed_tokens == 0
            assert request.spec_token_ids == []
            assert self._table(request.request_id) == []
        assert set(self._manager().req_to_blocks) == set(running)
        for req_id in self.ended:
            assert req_id not in sched.requests


class FCFSSpecSchedulerMachine(SpecSchedulerMachine):
    POLICY = "fcfs"


class PrioritySpecSchedulerMachine(SpecSchedulerMachine):
    POLICY = "priority"


_SETTINGS = settings(
    max_examples=60,
    stateful_step_count=30,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)

TestFCFSSpecScheduler = FCFSSpecSchedulerMachine.TestCase
TestFCFSSpecScheduler.settings = _SETTINGS
TestPrioritySpecScheduler = PrioritySpecSchedulerMachine.TestCase
TestPrioritySpecScheduler.settings = _SETTINGS
