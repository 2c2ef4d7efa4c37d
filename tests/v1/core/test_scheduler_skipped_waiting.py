"""The scheduler's second waiting queue, ``skipped_waiting``.

A waiting request blocked on something other than space (a grammar still
compiling, remote KV, more streamed input: a ``WAITING_FOR_*`` status) is
parked in ``skipped_waiting``; requests behind it are admitted past it, and
it is promoted back to WAITING once what it waits for is ready. Glassbox
has no structured outputs yet, so these tests park a request by hand, as
vLLM's own tests do: a status plus a small stand-in for vLLM's
``StructuredOutputRequest`` whose ``grammar`` is None until "compiled".
"""

from __future__ import annotations

import pytest

from engine.v1.request import Request, RequestStatus
from tests.helpers.core import AnyTokenGrammar, make_request, make_scheduler, run_step

GRAMMAR = RequestStatus.WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR


class FakeStructuredOutputRequest:
    """vLLM's attribute name: ``grammar`` is None while compiling."""

    def __init__(self) -> None:
        self.grammar: object | None = None


def prompt(num_tokens: int, start: int) -> list[int]:
    return list(range(start, start + num_tokens))


def grammar_request(req_id: str, start: int, num_tokens: int = 10, **kwargs) -> Request:
    request = make_request(req_id, prompt(num_tokens, start), **kwargs)
    request.status = GRAMMAR
    request.structured_output_request = FakeStructuredOutputRequest()
    return request


def ids(queue) -> list[str]:
    return [r.request_id for r in queue]


def scheduled_ids(step) -> list[str]:
    return list(step.scheduler_output.num_scheduled_tokens)


def test_blocked_request_is_parked_and_others_are_admitted_past_it():
    sched = make_scheduler()
    g = grammar_request("g", 1000)
    sched.add_request(g)
    assert ids(sched.skipped_waiting) == ["g"] and ids(sched.waiting) == []
    sched.add_request(make_request("a", prompt(10, 2000)))
    sched.add_request(make_request("b", prompt(10, 3000)))

    step = run_step(sched)
    assert scheduled_ids(step) == ["a", "b"]
    assert ids(sched.skipped_waiting) == ["g"] and g.status == GRAMMAR
    assert g.num_computed_tokens == 0
    assert sched.kv_cache_manager.get_blocks("g").blocks == ((),)  # nothing allocated

    stats = step.stats
    assert (stats.num_running_reqs, stats.num_waiting_reqs, stats.num_skipped_waiting_reqs) == (
        2,
        0,
        1,
    )
    assert sched.get_request_counts() == (2, 1)
    assert sched.get_num_unfinished_requests() == 3
    assert sched.has_unfinished_requests()


def test_parked_request_is_promoted_when_its_grammar_is_ready():
    sched = make_scheduler()
    g = grammar_request("g", 1000)
    sched.add_request(g)
    sched.add_request(make_request("a", prompt(10, 2000)))
    run_step(sched)
    run_step(sched)  # still compiling: g stays parked
    assert ids(sched.skipped_waiting) == ["g"]

    g.structured_output_request.grammar = AnyTokenGrammar()  # compiled
    step = run_step(sched)
    assert [r.req_id for r in step.scheduler_output.scheduled_new_reqs] == ["g"]
    assert step.scheduler_output.num_scheduled_tokens["g"] == 10
    assert g.status == RequestStatus.RUNNING
    assert len(sched.skipped_waiting) == 0
    assert step.stats.num_skipped_waiting_reqs == 0


def test_promoted_request_that_does_not_fit_waits_at_the_head_as_waiting():
    # Budget 12, chunked prefill off: a whole prompt must fit in one step.
    sched = make_scheduler(
        max_num_batched_tokens=12, max_model_len=12, enable_chunked_prefill=False
    )
    sched.add_request(make_request("a", prompt(10, 2000), max_tokens=2))
    run_step(sched)  # a's prompt
    g = grammar_request("g", 1000, num_tokens=12)
    g.structured_output_request.grammar = AnyTokenGrammar()  # ready
    sched.add_request(g)
    sched.add_request(make_request("b", prompt(10, 3000)))

    # a decodes (1 token, 11 left). g is promoted but its 12 tokens do not fit:
    # admission stops there, so b is not tried either.
    step = run_step(sched)
    assert scheduled_ids(step) == ["a"]
    assert g.status == RequestStatus.WAITING
    assert ids(sched.skipped_waiting) == ["g"] and ids(sched.waiting) == ["b"]
    # a has finished: g goes first and takes the whole budget.
    assert scheduled_ids(run_step(sched)) == ["g"]


def test_several_parked_requests_keep_their_order():
    sched = make_scheduler()
    parked = [grammar_request(f"g{i}", 1000 * (i + 1)) for i in range(3)]
    for request in parked:
        sched.add_request(request)
    sched.add_request(make_request("a", prompt(10, 9000)))
    run_step(sched)
    run_step(sched)
    assert ids(sched.skipped_waiting) == ["g0", "g1", "g2"]

    # Only the middle one becomes ready: it runs, the others keep their order.
    parked[1].structured_output_request.grammar = AnyTokenGrammar()
    step = run_step(sched)
    assert [r.req_id for r in step.scheduler_output.scheduled_new_reqs] == ["g1"]
    assert ids(sched.skipped_waiting) == ["g0", "g2"]


@pytest.mark.parametrize("status", [GRAMMAR, RequestStatus.WAITING_FOR_REMOTE_KVS])
def test_abort_while_parked_frees_everything(status):
    sched = make_scheduler(num_blocks=20, max_model_len=160)
    request = make_request("p", prompt(10, 1000))
    request.status = status
    sched.add_request(request)
    sched.add_request(make_request("a", prompt(10, 2000)))
    run_step(sched)
    free_before = sched.kv_cache_manager.block_pool.get_num_free_blocks()

    assert sched.finish_requests("p", RequestStatus.FINISHED_ABORTED) == [("p", 0)]
    assert request.status == RequestStatus.FINISHED_ABORTED
    assert "p" not in sched.requests
    assert len(sched.skipped_waiting) == 0 and ids(sched.waiting) == []
    assert sched.get_num_unfinished_requests() == 1
    assert sched.kv_cache_manager.block_pool.get_num_free_blocks() == free_before
    # The worker hears about it once, in the next step.
    assert run_step(sched).scheduler_output.finished_req_ids == {"p"}


def test_abort_all_reaches_parked_requests():
    sched = make_scheduler()
    sched.add_request(grammar_request("g", 1000))
    sched.add_request(make_request("a", prompt(10, 2000)))
    run_step(sched)
    aborted = sched.finish_requests(None, RequestStatus.FINISHED_ABORTED)
    assert sorted(aborted) == [("a", 0), ("g", 0)]
    assert not sched.has_unfinished_requests()
    assert len(sched.skipped_waiting) == 0 and sched.requests == {}


def test_remote_kv_request_is_never_promoted():
    # No KV connector in Glassbox: nothing marks its KV as received.
    sched = make_scheduler()
    request = make_request("r", prompt(10, 1000))
    request.status = RequestStatus.WAITING_FOR_REMOTE_KVS
    sched.add_request(request)
    for _ in range(3):
        assert scheduled_ids(run_step(sched)) == []
    assert ids(sched.skipped_waiting) == ["r"]
    assert sched.has_unfinished_requests()


def test_priority_picks_the_better_head_of_the_two_queues():
    # One running slot at a time, so each step admits exactly one request.
    sched = make_scheduler(policy="priority", max_num_seqs=1)
    g = grammar_request("g", 1000, priority=1, arrival_time=1.0, max_tokens=1)
    g.structured_output_request.grammar = AnyTokenGrammar()  # ready at once
    sched.add_request(g)
    sched.add_request(
        make_request("w0", prompt(10, 2000), priority=0, arrival_time=2.0, max_tokens=1)
    )
    sched.add_request(
        make_request("w2", prompt(10, 3000), priority=2, arrival_time=0.5, max_tokens=1)
    )
    assert ids(sched.skipped_waiting) == ["g"] and ids(sched.waiting) == ["w0", "w2"]

    order = []
    for _ in range(3):
        step = run_step(sched)
        order += [r.req_id for r in step.scheduler_output.scheduled_new_reqs]
    # Priority first across both queues (w0: 0, g: 1, w2: 2), not queue first.
    assert order == ["w0", "g", "w2"]


def test_priority_skips_a_blocked_head_and_admits_worse_requests():
    sched = make_scheduler(policy="priority")
    sched.add_request(grammar_request("g", 1000, priority=0, arrival_time=1.0))
    sched.add_request(make_request("w", prompt(10, 2000), priority=5, arrival_time=2.0))
    step = run_step(sched)
    assert scheduled_ids(step) == ["w"]
    assert ids(sched.skipped_waiting) == ["g"]


def test_fcfs_takes_skipped_waiting_first():
    sched = make_scheduler(max_num_seqs=1)
    sched.add_request(make_request("w", prompt(10, 2000), arrival_time=1.0, max_tokens=1))
    g = grammar_request("g", 1000, arrival_time=2.0, max_tokens=1)
    g.structured_output_request.grammar = AnyTokenGrammar()
    sched.add_request(g)
    # FCFS looks at skipped_waiting first (its requests were passed over
    # before), so g, ready now, goes before w although it arrived later.
    assert scheduled_ids(run_step(sched)) == ["g"]
    assert scheduled_ids(run_step(sched)) == ["w"]
