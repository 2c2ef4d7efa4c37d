"""``SamplingParams.repetition_detection`` (vLLM's ``RepetitionDetectionParams``):
a request whose output ends in a token pattern repeated ``min_count`` times
back to back finishes with status ``FINISHED_REPETITION``, finish_reason
"repetition" and stop_reason "repetition_detected".

* ``check_sequence_repetition`` against a brute-force oracle (Hypothesis) and
  on examples; bad parameters name the field.
* Through the engine (``CountingExecutor``: next token = last + 1, modulo a
  10-token vocabulary, so the output repeats with period 10): the request
  ends after exactly ``10 * min_count`` tokens, not at ``max_tokens``.
"""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from engine.sampling_params import RepetitionDetectionParams, SamplingParams
from engine.v1.core.sched.utils import check_sequence_repetition
from tests.helpers.engine_fixtures import make_llm
from tests.helpers.tiny_model import make_tiny_model_dir


def _oracle(tokens: list[int], params: RepetitionDetectionParams) -> bool:
    if params.max_pattern_size == 0:
        return False
    for size in range(max(params.min_pattern_size, 1), params.max_pattern_size + 1):
        span = size * params.min_count
        if span <= len(tokens):
            tail = tokens[len(tokens) - span :]
            if tail == tail[:size] * params.min_count:
                return True
    return False


@given(
    tokens=st.lists(st.integers(0, 2), max_size=30),
    sizes=st.tuples(st.integers(0, 6), st.integers(0, 6)),
    count=st.integers(2, 5),
)
def test_detection_equals_a_brute_force_oracle(tokens, sizes, count) -> None:
    low, high = sorted(sizes)
    params = RepetitionDetectionParams(max_pattern_size=high, min_pattern_size=low, min_count=count)
    assert check_sequence_repetition(tokens, params) == _oracle(tokens, params)


def test_examples() -> None:
    abc3 = [9, 1, 2, 3, 1, 2, 3, 1, 2, 3]
    assert check_sequence_repetition(abc3, RepetitionDetectionParams(3, 0, 3))
    assert not check_sequence_repetition(abc3, RepetitionDetectionParams(3, 0, 4))
    assert not check_sequence_repetition(abc3, RepetitionDetectionParams(2, 0, 2))  # size 3 only
    assert check_sequence_repetition([5, 5], RepetitionDetectionParams(1, 1, 2))
    assert not check_sequence_repetition([5, 5], RepetitionDetectionParams(0, 0, 0))  # off


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"max_pattern_size": -1}, r"repetition_detection.max_pattern_size must be an int >= 0"),
        (
            {"max_pattern_size": 2, "min_pattern_size": 3, "min_count": 2},
            r"min_pattern_size \(3\) must be <= max_pattern_size \(2\)",
        ),
        ({"max_pattern_size": 4, "min_count": 1}, r"min_count must be >= 2 to detect a repeat"),
        ({"max_pattern_size": 4, "count": 2}, r"unknown field\(s\) \['count'\]"),
    ],
)
def test_bad_parameters_name_the_field(fields, message) -> None:
    with pytest.raises(ValueError, match=message):
        SamplingParams.from_optional(repetition_detection=fields)


@pytest.mark.parametrize("min_count", [2, 3])
def test_the_engine_stops_a_repeating_output(tmp_path, min_count) -> None:
    model_dir = make_tiny_model_dir(tmp_path / "tiny", num_words=3)  # vocabulary of 10
    llm = make_llm(model_dir)
    params = SamplingParams(
        max_tokens=100,
        ignore_eos=True,
        repetition_detection=RepetitionDetectionParams(10, 0, min_count),
    )
    try:
        (out,) = llm.generate([{"prompt_token_ids": [5]}], params, use_tqdm=False)
    finally:
        llm.shutdown()
    completion = out.outputs[0]
    assert len(completion.token_ids) == 10 * min_count
    assert completion.finish_reason == "repetition"
    assert completion.stop_reason == "repetition_detected"
