"""Unit tests of ``Request`` and ``RequestStatus`` (engine/v1/request.py).

The constructor takes vLLM's arguments in vLLM's order; the arguments for
features Glassbox does not have must be left unset, and say so when they
are not.
"""

from __future__ import annotations

import inspect

import pytest

from engine.v1.engine import EngineCoreRequest, FinishReason
from engine.v1.metrics.stats import PrefillStats
from engine.v1.request import Request, RequestStatus
from tests.helpers.core import make_request, make_sampling_params


def test_constructor_arguments_in_vllms_order():
    names = list(inspect.signature(Request).parameters)
    assert names == [
        "request_id",
        "prompt_token_ids",
        "sampling_params",
        "pooling_params",
        "client_index",
        "arrival_time",
        "prompt_embeds",
        "prompt_is_token_ids",
        "mm_features",
        "lora_request",
        "cache_salt",
        "priority",
        "trace_headers",
        "block_hasher",
    ]


def test_vllm_style_positional_call_builds_a_waiting_request():
    params = make_sampling_params(max_tokens=7)
    request = Request("r1", [11, 12, 13], params, None, 3, 5.0)
    assert request.request_id == "r1"
    assert request.client_index == 3
    assert request.arrival_time == 5.0
    assert request.status == RequestStatus.WAITING
    assert request.max_tokens == 7
    assert request.num_prompt_tokens == request.num_tokens == 3
    # The seams for features Glassbox does not have stay empty.
    assert request.pooling_params is None
    assert request.prompt_embeds is None
    assert request.mm_features == []
    assert request.lora_request is None
    assert request.structured_output_request is None
    assert request.use_structured_output is False
    assert request.num_output_placeholders == 0
    assert request.kv_transfer_params is None
    assert request.trace_headers is None


def test_empty_mm_features_list_is_accepted():
    request = Request("r", [1, 2], make_sampling_params(), pooling_params=None, mm_features=[])
    assert request.mm_features == []


@pytest.mark.parametrize(
    "field, value",
    [
        ("pooling_params", object()),
        ("prompt_embeds", object()),
        ("prompt_is_token_ids", [True, True]),
        ("mm_features", [object()]),
    ],
)
def test_unsupported_field_raises_naming_it(field, value):
    with pytest.raises(ValueError, match=field) as excinfo:
        Request("r", [1, 2], make_sampling_params(), **{field: value})
    assert "\n" not in str(excinfo.value)


def test_no_sampling_params_raises_vllms_error():
    with pytest.raises(ValueError, match="sampling_params and pooling_params can't both be unset"):
        Request("r", [1, 2], None, None)


def test_empty_prompt_raises():
    with pytest.raises(ValueError, match="prompt_token_ids must not be empty"):
        Request("r", [], make_sampling_params())


def test_lora_request_and_trace_headers_are_kept():
    lora = object()
    request = Request(
        "r", [1, 2], make_sampling_params(), lora_request=lora, trace_headers={"k": "v"}
    )
    assert request.lora_request is lora
    assert request.trace_headers == {"k": "v"}


def test_kv_transfer_params_come_from_extra_args():
    params = make_sampling_params(extra_args={"kv_transfer_params": {"remote": "p0"}})
    request = Request("r", [1, 2], params)
    assert request.kv_transfer_params == {"remote": "p0"}


def test_from_engine_core_request_copies_every_field():
    params = make_sampling_params(max_tokens=4)
    ecr = EngineCoreRequest(
        request_id="abc-0123abcd",
        prompt_token_ids=[5, 6, 7],
        sampling_params=params,
        arrival_time=12.5,
        cache_salt="salt",
        client_index=2,
        priority=-1,
    )
    hasher_calls: list[str] = []

    def hasher(request: Request) -> list:
        hasher_calls.append(request.request_id)
        return []

    request = Request.from_engine_core_request(ecr, hasher)
    assert request.request_id == "abc-0123abcd"
    assert request.prompt_token_ids == [5, 6, 7]
    assert request.sampling_params is params
    assert request.arrival_time == 12.5
    assert request.cache_salt == "salt"
    assert request.client_index == 2
    assert request.priority == -1
    assert request.pooling_params is None and request.lora_request is None
    assert hasher_calls == ["abc-0123abcd"]  # the block hasher ran once, at construction


def test_lt_orders_by_priority_then_arrival_then_id():
    a = make_request("a", [1], priority=1, arrival_time=2.0)
    b = make_request("b", [1], priority=0, arrival_time=9.0)
    c = make_request("c", [1], priority=1, arrival_time=1.0)
    d = make_request("d", [1], priority=1, arrival_time=1.0)
    assert sorted([a, b, c, d]) == [b, c, d, a]
    # Same priority, time and id: object identity decides, so sorting never fails.
    e1 = make_request("e", [1], priority=0, arrival_time=1.0)
    e2 = make_request("e", [1], priority=0, arrival_time=1.0)
    assert (e1 < e2) != (e2 < e1)


def test_request_status_order_and_finished_states():
    # vLLM's order: the blocked waiting states sit between WAITING and RUNNING,
    # and everything after PREEMPTED is finished.
    assert list(RequestStatus)[:6] == [
        RequestStatus.WAITING,
        RequestStatus.WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR,
        RequestStatus.WAITING_FOR_REMOTE_KVS,
        RequestStatus.WAITING_FOR_STREAMING_REQ,
        RequestStatus.RUNNING,
        RequestStatus.PREEMPTED,
    ]
    for status in RequestStatus:
        finished = status.name.startswith("FINISHED_")
        assert RequestStatus.is_finished(status) is finished, status
    assert RequestStatus.get_finished_reason(RequestStatus.FINISHED_IGNORED) == FinishReason.LENGTH
    repetition = RequestStatus.get_finished_reason(RequestStatus.FINISHED_REPETITION)
    assert repetition == FinishReason.REPETITION and str(repetition) == "repetition"
    assert RequestStatus.get_finished_reason(RequestStatus.WAITING_FOR_REMOTE_KVS) is None


def test_use_structured_output_follows_structured_output_request():
    request = make_request("r", [1, 2])

    class Ready:
        grammar = object()

    request.structured_output_request = Ready()
    assert request.use_structured_output is True


def test_prefill_stats_start_empty_and_are_taken_once():
    request = make_request("p", [7, 8, 9])
    assert request.prefill_stats == PrefillStats()
    request.prefill_stats.set(
        num_prompt_tokens=3, num_local_cached_tokens=0, num_external_cached_tokens=0
    )
    taken = request.take_prefill_stats()
    assert taken is not None and taken.num_computed_tokens == 3
    assert request.prefill_stats is None
    assert request.take_prefill_stats() is None
