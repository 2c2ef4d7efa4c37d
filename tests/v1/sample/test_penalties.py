"""Tests for engine/v1/sample/ops/penalties.py (twin of
vllm/v1/sample/ops/penalties.py + apply_penalties in
vllm/model_executor/layers/utils.py).

Checked against a per-row Python reference: repetition over prompt + output
tokens, frequency and presence over output tokens only.
"""

from __future__ import annotations

import random

import pytest
import torch

from engine.sampling_params import SamplingParams
from engine.v1.sample.metadata import build_sampling_metadata
from engine.v1.sample.ops.penalties import (
    apply_all_penalties,
    get_token_bin_counts_and_mask,
    make_padded_token_tensor,
)
from engine.v1.sample.sampler import Sampler


def ref_penalties(
    logits: list[float],
    prompt: list[int],
    output: list[int],
    repetition: float,
    frequency: float,
    presence: float,
) -> list[float]:
    out = list(logits)
    for token in set(prompt) | set(output):
        out[token] = out[token] / repetition if out[token] > 0 else out[token] * repetition
    for token in set(output):
        out[token] -= frequency * output.count(token)
        out[token] -= presence
    return out


def run_penalties(logits, prompts, outputs, rep, freq, pres):
    vocab = logits.shape[1]
    return apply_all_penalties(
        logits.clone(),
        make_padded_token_tensor(prompts, vocab, "cpu"),
        torch.tensor(pres, dtype=torch.float32),
        torch.tensor(freq, dtype=torch.float32),
        torch.tensor(rep, dtype=torch.float32),
        outputs,
    )


@pytest.mark.parametrize("seed", range(6))
def test_penalties_match_reference(seed):
    rng = random.Random(seed)
    vocab, rows = 25, 7
    logits = torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * 3
    prompts = [[rng.randrange(vocab) for _ in range(rng.randrange(0, 12))] for _ in range(rows)]
    outputs = [[rng.randrange(vocab) for _ in range(rng.randrange(0, 12))] for _ in range(rows)]
    rep = [rng.choice([1.0, 0.5, 1.3, 2.0]) for _ in range(rows)]
    freq = [rng.choice([0.0, -1.0, 0.4, 2.0]) for _ in range(rows)]
    pres = [rng.choice([0.0, -0.5, 1.0, 2.0]) for _ in range(rows)]
    got = run_penalties(logits, prompts, outputs, rep, freq, pres)
    for r in range(rows):
        expected = ref_penalties(
            logits[r].tolist(), prompts[r], outputs[r], rep[r], freq[r], pres[r]
        )
        assert got[r].tolist() == pytest.approx(expected, rel=1e-5, abs=1e-5), f"row {r}"


def test_frequency_and_presence_ignore_prompt_tokens():
    logits = torch.zeros(1, 6)
    got = run_penalties(logits, [[1, 1, 2]], [[3, 3, 3, 4]], [1.0], [0.5], [0.25])
    # Prompt-only tokens 1 and 2 are untouched; 3 seen 3x, 4 seen once.
    assert got[0].tolist() == pytest.approx([0.0, 0.0, 0.0, -1.75, -0.75, 0.0])


def test_repetition_penalty_divides_positive_and_multiplies_negative_logits():
    logits = torch.tensor([[2.0, -2.0, 2.0, -2.0]])
    got = run_penalties(logits, [[0]], [[1]], [2.0], [0.0], [0.0])
    # Tokens 0 (prompt) and 1 (output) move towards 0 and below; 2, 3 unseen.
    assert got[0].tolist() == pytest.approx([1.0, -4.0, 2.0, -2.0])
    # Counting does not matter for repetition: seen once == seen many times.
    got_many = run_penalties(logits, [[0, 0, 0]], [[1, 1]], [2.0], [0.0], [0.0])
    assert torch.equal(got, got_many)


def test_bin_counts_ignore_the_padding_id():
    tokens = torch.tensor([[0, 2, 2, 5, 5], [1, 5, 5, 5, 5]])  # 5 = pad for vocab 5
    counts, mask = get_token_bin_counts_and_mask(tokens, 5, 2)
    assert counts.tolist() == [[1, 0, 2, 0, 0], [0, 1, 0, 0, 0]]
    assert mask.tolist() == [[True, False, True, False, False], [False, True, False, False, False]]


def test_metadata_penalty_fields():
    params = [SamplingParams(), SamplingParams(repetition_penalty=1.5, frequency_penalty=0.5)]
    md = build_sampling_metadata(params, [[1, 2, 3], [4]], [[], [0]], {}, 8, "cpu")
    assert not md.no_penalties
    assert md.prompt_token_ids.tolist() == [[1, 2, 3], [4, 8, 8]]
    assert md.repetition_penalties.tolist() == [1.0, 1.5]
    assert md.frequency_penalties.tolist() == [0.0, 0.5]
    assert md.presence_penalties.tolist() == [0.0, 0.0]

    md = build_sampling_metadata([SamplingParams()], [[1]], [[]], {}, 8, "cpu")
    assert md.no_penalties and md.prompt_token_ids is None


def test_sampler_applies_penalties_to_greedy_rows():
    # Token 0 would win, but it was generated twice and the frequency penalty
    # pushes it below token 1; token 2 in the prompt is hit by repetition only.
    logits = torch.tensor([[3.0, 2.0, 2.5, -1.0]])
    params = [SamplingParams(temperature=0.0, frequency_penalty=1.0, repetition_penalty=2.0)]
    md = build_sampling_metadata(params, [[2]], [[0, 0]], {}, 4, "cpu")
    out = Sampler()(logits, md)
    # 0: 3/2 - 2 = -0.5; 1: 2.0; 2: 2.5/2 = 1.25.
    assert out.sampled_token_ids.tolist() == [[1]]


def test_out_of_vocab_prompt_token_is_a_clear_error():
    params = [SamplingParams(presence_penalty=1.0)]
    with pytest.raises(ValueError, match="prompt_token_ids of request row 0"):
        build_sampling_metadata(params, [[3, 9]], [[]], {}, 8, "cpu")
