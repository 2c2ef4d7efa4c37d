"""Tests for engine/outputs.py and engine/logprobs.py (twins of vllm/outputs.py and
vllm/logprobs.py)."""

from __future__ import annotations

import pytest

from engine.logprobs import (
    Logprob,
    append_logprobs_for_next_position,
    create_prompt_logprobs,
    create_sample_logprobs,
)
from engine.outputs import CompletionOutput, RequestOutput


def _lp(token_id: int, value: float) -> dict[int, Logprob]:
    return {token_id: Logprob(logprob=value, rank=1, decoded_token=str(token_id))}


def _completion(
    index=0, text="", token_ids=(), logprobs=None, finish_reason=None, stop_reason=None, cum=None
):
    return CompletionOutput(
        index=index,
        text=text,
        token_ids=list(token_ids),
        cumulative_logprob=cum,
        logprobs=logprobs,
        finish_reason=finish_reason,
        stop_reason=stop_reason,
    )


def _request(outputs, finished=False, request_id="req-0"):
    return RequestOutput(
        request_id=request_id,
        prompt="Hi",
        prompt_token_ids=[1, 2],
        prompt_logprobs=None,
        outputs=outputs,
        finished=finished,
    )


# --------------------------------------------------------------------------
# CompletionOutput
# --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("reason", "done"), [(None, False), ("stop", True), ("length", True), ("abort", True)]
)
def test_completion_finished(reason, done):
    assert _completion(finish_reason=reason).finished() is done


def test_completion_defaults_and_repr():
    c = CompletionOutput(
        index=1, text="a'b", token_ids=(5, 6), cumulative_logprob=-1.5, logprobs=None
    )
    assert c.finish_reason is None and c.stop_reason is None
    text = repr(c)
    assert text.startswith('CompletionOutput(index=1, text="a\'b", token_ids=[5, 6]')
    assert "cumulative_logprob=-1.5" in text and "finish_reason=None" in text


# --------------------------------------------------------------------------
# RequestOutput
# --------------------------------------------------------------------------


def test_request_output_fields_and_defaults():
    out = _request([_completion()])
    assert out.request_id == "req-0"
    assert out.prompt == "Hi" and out.prompt_token_ids == [1, 2]
    assert out.metrics is None and out.num_cached_tokens is None
    assert out.finished is False
    # vLLM's fields for features Glassbox lacks exist, and stay None.
    assert (out.lora_request, out.encoder_prompt, out.kv_transfer_params) == (None, None, None)
    assert _completion().routed_experts is None and _completion().lora_request is None


def test_request_output_ignores_unknown_keywords_with_a_warning(caplog):
    """As vLLM's: code written for a newer engine still runs (vLLM warns once)."""
    with caplog.at_level("WARNING", logger="engine.outputs"):
        out = RequestOutput("r", None, None, None, [], False, some_future_field=3)
        RequestOutput("r", None, None, None, [], False, some_future_field=4)
    assert not hasattr(out, "some_future_field")
    warnings = [r.getMessage() for r in caplog.records]
    assert warnings == ["RequestOutput: Ignoring extra arguments: {'some_future_field': 3}"]


def test_request_output_repr():
    out = _request([_completion(text="x")], finished=True)
    text = repr(out)
    assert text.startswith("RequestOutput(request_id=req-0, prompt='Hi', prompt_token_ids=[1, 2]")
    assert "outputs=[CompletionOutput(index=0, text='x'" in text
    assert "finished=True" in text and "num_cached_tokens=None" in text


def test_add_aggregate_concatenates_deltas():
    first = _request(
        [
            _completion(
                text="Hel", token_ids=[10, 11], logprobs=[_lp(10, -0.1), _lp(11, -0.2)], cum=-0.3
            )
        ]
    )
    second = _request(
        [
            _completion(
                text="lo",
                token_ids=[12],
                logprobs=[_lp(12, -0.4)],
                cum=-0.7,
                finish_reason="stop",
                stop_reason=99,
            )
        ],
        finished=True,
    )
    first.add(second, aggregate=True)
    (merged,) = first.outputs
    assert merged.text == "Hello"
    assert merged.token_ids == [10, 11, 12]
    assert [list(d) for d in merged.logprobs] == [[10], [11], [12]]
    assert merged.cumulative_logprob == -0.7
    assert merged.finish_reason == "stop" and merged.stop_reason == 99
    assert merged.finished()
    assert first.finished is True


def test_add_aggregate_handles_tuple_token_ids_and_missing_logprobs():
    older = CompletionOutput(
        index=0, text="a", token_ids=(1,), cumulative_logprob=None, logprobs=None
    )
    first = _request([older])
    first.add(
        _request([_completion(text="b", token_ids=[2], logprobs=[_lp(2, -1.0)])]), aggregate=True
    )
    assert first.outputs[0].token_ids == [1, 2]
    assert first.outputs[0].logprobs == [_lp(2, -1.0)]
    # An empty delta changes only the per-sample summary fields.
    first.add(_request([_completion(finish_reason="length")]), aggregate=True)
    assert first.outputs[0].text == "ab" and first.outputs[0].token_ids == [1, 2]
    assert first.outputs[0].finish_reason == "length"


def test_add_without_aggregate_replaces_same_index():
    first = _request([_completion(text="Hel", token_ids=[10, 11])])
    newer = _completion(text="Hello", token_ids=[10, 11, 12])
    first.add(_request([newer]), aggregate=False)
    assert first.outputs == [newer]
    assert first.outputs[0] is newer
    assert first.finished is False


def test_add_appends_new_indices_for_n_greater_than_one():
    first = _request([_completion(index=1, text="b")])
    first.add(
        _request([_completion(index=0, text="a"), _completion(index=1, text="B")]), aggregate=True
    )
    assert [(c.index, c.text) for c in first.outputs] == [(1, "bB"), (0, "a")]
    first.add(
        _request([_completion(index=0, text="A"), _completion(index=2, text="c")]), aggregate=False
    )
    assert [(c.index, c.text) for c in first.outputs] == [(1, "bB"), (0, "A"), (2, "c")]


def test_add_keeps_finished_once_set():
    first = _request([_completion()], finished=True)
    first.add(_request([_completion()], finished=False), aggregate=True)
    assert first.finished is True


def test_add_rejects_other_request():
    with pytest.raises(ValueError, match="cannot merge outputs of different requests"):
        _request([]).add(_request([], request_id="req-1"), aggregate=True)


def test_request_output_equality():
    assert _request([_completion(text="x")]) == _request([_completion(text="x")])
    assert _request([_completion(text="x")]) != _request([_completion(text="y")])


# --------------------------------------------------------------------------
# logprobs helpers
# --------------------------------------------------------------------------


def test_logprob_defaults():
    lp = Logprob(logprob=-0.5)
    assert lp.rank is None and lp.decoded_token is None


def test_create_containers():
    assert create_prompt_logprobs() == [None]
    assert create_sample_logprobs() == []
    for make in (create_prompt_logprobs, create_sample_logprobs):
        with pytest.raises(ValueError, match="flat_logprobs=True is not supported"):
            make(flat_logprobs=True)


def test_append_sampled_token_then_top_k():
    logprobs = create_sample_logprobs()
    # Sampled token 42 had vocab rank 3; the top-2 are 7 and 9.
    append_logprobs_for_next_position(
        logprobs, [42, 7, 9], [-2.0, -0.1, -0.5], ["x", "a", "b"], rank=3, num_logprobs=2
    )
    (position,) = logprobs
    assert position == {
        42: Logprob(-2.0, 3, "x"),
        7: Logprob(-0.1, 1, "a"),
        9: Logprob(-0.5, 2, "b"),
    }


def test_append_sampled_token_inside_top_k_collapses():
    logprobs = create_prompt_logprobs()
    append_logprobs_for_next_position(
        logprobs, [7, 7, 9], [-0.1, -0.1, -0.5], [None, None, None], rank=1, num_logprobs=2
    )
    assert logprobs[0] is None
    assert logprobs[1] == {7: Logprob(-0.1, 1, None), 9: Logprob(-0.5, 2, None)}


def test_append_full_vocab_and_zero_top_k():
    logprobs = create_sample_logprobs()
    append_logprobs_for_next_position(
        logprobs,
        [2, 0, 1, 2],
        [-1.2, -0.3, -0.9, -1.2],
        ["c", "a", "b", "c"],
        rank=3,
        num_logprobs=-1,
    )
    assert {t: lp.rank for t, lp in logprobs[0].items()} == {0: 1, 1: 2, 2: 3}
    append_logprobs_for_next_position(logprobs, [5], [-0.2], ["z"], rank=4, num_logprobs=0)
    assert logprobs[1] == {5: Logprob(-0.2, 4, "z")}


def test_append_rejects_mismatched_lengths():
    with pytest.raises(
        ValueError, match="token_ids and logprobs must have the same length, got 2 and 1"
    ):
        append_logprobs_for_next_position([], [1, 2], [-0.1], [None, None], rank=1, num_logprobs=1)
