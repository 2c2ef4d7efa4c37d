"""Tests for engine/v1/engine/parallel_sampling.py (twin of
vllm/v1/engine/parallel_sampling.py): child ids and params, and how the
children's outputs become the parent's."""

from __future__ import annotations

import pytest

from engine.outputs import CompletionOutput
from engine.sampling_params import RequestOutputKind, SamplingParams
from engine.v1.engine import EngineCoreRequest
from engine.v1.engine.parallel_sampling import ParentRequest

DELTA = RequestOutputKind.DELTA
CUMULATIVE = RequestOutputKind.CUMULATIVE
FINAL_ONLY = RequestOutputKind.FINAL_ONLY


def parent_of(n: int, kind=CUMULATIVE, seed=None) -> ParentRequest:
    params = SamplingParams(n=n, temperature=0.8, seed=seed, output_kind=kind)
    request = EngineCoreRequest(
        request_id="story-9f8e7d6c",
        prompt_token_ids=[4, 5],
        sampling_params=params,
        arrival_time=0.0,
        external_req_id="story",
    )
    return ParentRequest(request)


def sample(index: int, text: str, finished: bool = False) -> CompletionOutput:
    return CompletionOutput(
        index=index,
        text=text,
        token_ids=[],
        cumulative_logprob=None,
        logprobs=None,
        finish_reason="stop" if finished else None,
    )


def test_ids_come_from_the_internal_id():
    parent = parent_of(2)
    assert (parent.request_id, parent.external_req_id, parent.n) == ("story-9f8e7d6c", "story", 2)
    assert [parent.get_child_info(i)[0] for i in range(2)] == [
        "0_story-9f8e7d6c",
        "1_story-9f8e7d6c",
    ]
    assert parent.child_requests == {"0_story-9f8e7d6c", "1_story-9f8e7d6c"}


def test_the_request_must_have_its_internal_id():
    request = EngineCoreRequest("story", [4], SamplingParams(n=2), 0.0)
    with pytest.raises(AssertionError, match="assign_request_id"):
        ParentRequest(request)


def test_child_params():
    seeded = parent_of(3, seed=40)
    children = [seeded.get_child_info(i)[1] for i in range(3)]
    assert [p.seed for p in children] == [40, 41, 42] and {p.n for p in children} == {1}
    assert seeded.sampling_params.n == 3 and seeded.sampling_params.seed == 40
    unseeded = parent_of(3)
    a, b = (unseeded.get_child_info(i)[1] for i in range(2))
    assert a is b and a.seed is None  # nothing differs, so one object serves all


@pytest.mark.parametrize("kind", [DELTA, CUMULATIVE])
def test_streaming_sends_each_update_and_a_finished_sample_once(kind):
    parent = parent_of(2, kind)
    first, second = (parent.get_child_info(i)[0] for i in range(2))
    a, b = sample(0, "once"), sample(1, "twice")
    assert parent.get_outputs(first, a) == ([a], False)
    assert parent.get_outputs(second, b) == ([b], False)
    b_done = sample(1, "twice upon", finished=True)
    assert parent.get_outputs(second, b_done) == ([b_done], False)
    # The same finished sample again (e.g. a late abort): nothing to send.
    assert parent.get_outputs(second, b_done) == ([], False)
    a_done = sample(0, "once more", finished=True)
    assert parent.get_outputs(first, a_done) == ([a_done], True)
    assert parent.get_outputs(first, a_done) == ([], True)
    assert parent.child_requests == set()


def test_final_only_sends_all_samples_together_at_the_end():
    parent = parent_of(3, FINAL_ONLY)
    ids = [parent.get_child_info(i)[0] for i in range(3)]
    done = [sample(i, f"end {i}", finished=True) for i in range(3)]
    # Finishing out of order: nothing until the last one.
    assert parent.get_outputs(ids[2], done[2]) == ([], False)
    assert parent.get_outputs(ids[0], sample(0, "so far")) == ([], False)
    assert parent.get_outputs(ids[0], done[0]) == ([], False)
    outputs, finished = parent.get_outputs(ids[1], done[1])
    assert finished and outputs == done  # ordered by index


def test_longest_child_is_observed():
    parent = parent_of(3)
    assert [parent.observe_num_generation_tokens(n) for n in (4, 9, 2)] == [4, 9, 9]
    assert parent.max_num_generation_tokens == 9
