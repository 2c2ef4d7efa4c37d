"""Tests for engine/v1/sample/ops/topk_topp_sampler.py (twin of
vllm/v1/sample/ops/topk_topp_sampler.py).

Top-k and top-p masks are checked row by row against plain-Python reference
filters; the random draw is checked for seeded reproducibility and against
the target distribution.
"""

from __future__ import annotations

import math

import pytest
import torch

from engine.v1.sample.ops.topk_topp_sampler import (
    TopKTopPSampler,
    apply_top_k_top_p,
    apply_top_k_top_p_pytorch,
    random_sample,
)

NEG_INF = float("-inf")


# --------------------------------------------------------------------------
# Reference filters: one row at a time, Python floats.
# --------------------------------------------------------------------------


def ref_top_k(row: list[float], k: int) -> set[int]:
    """Indices kept by top-k: every token >= the k-th largest value (ties kept)."""
    k = min(k, len(row))
    kth = sorted(row, reverse=True)[k - 1]
    return {i for i, v in enumerate(row) if v >= kth}


def ref_top_p(row: list[float], p: float, candidates: set[int]) -> set[int]:
    """Of ``candidates``, the most likely tokens until their mass reaches p
    (the crossing token included), plus anything tied with the last kept one."""
    finite = [i for i in candidates if row[i] != NEG_INF]
    top = max(row[i] for i in finite)
    weights = {i: math.exp(row[i] - top) for i in finite}
    total = sum(weights.values())
    order = sorted(finite, key=lambda i: row[i], reverse=True)
    kept: list[int] = []
    mass = 0.0
    for i in order:
        kept.append(i)
        mass += weights[i] / total
        if mass >= p:
            break
    last_value = row[kept[-1]]
    return set(kept) | {i for i in finite if row[i] == last_value}


def kept_indices(filtered_row: torch.Tensor) -> set[int]:
    return {i for i, v in enumerate(filtered_row.tolist()) if v != NEG_INF}


def test_no_filters_returns_logits_unchanged():
    logits = torch.randn(3, 7)
    before = logits.clone()
    assert torch.equal(apply_top_k_top_p(logits, None, None), before)


def test_top_k_matches_reference_per_row():
    gen = torch.Generator().manual_seed(0)
    vocab = 50
    logits = torch.randn(16, vocab, generator=gen)
    k = torch.tensor([1, 2, 3, 5, 8, 13, 21, 34, 49, 50, 50, 1, 10, 25, 40, 7])
    out = apply_top_k_top_p(logits.clone(), k, None)
    for row in range(logits.shape[0]):
        expected = ref_top_k(logits[row].tolist(), int(k[row]))
        assert kept_indices(out[row]) == expected, f"row {row}, k={int(k[row])}"
        # Kept logits keep their value.
        kept = sorted(expected)
        assert torch.equal(out[row, kept], logits[row, kept])


def test_top_k_keeps_all_tokens_tied_with_the_kth():
    logits = torch.tensor([[2.0, 0.0, 2.0, 1.0, 2.0, -1.0]])
    out = apply_top_k_top_p(logits.clone(), torch.tensor([2]), None)
    assert kept_indices(out[0]) == {0, 2, 4}


def test_top_k_equal_to_vocab_keeps_everything():
    logits = torch.randn(4, 9)
    out = apply_top_k_top_p(logits.clone(), torch.full((4,), 9), None)
    assert torch.equal(out, logits)


@pytest.mark.parametrize("seed", range(5))
def test_top_p_matches_reference_per_row(seed):
    gen = torch.Generator().manual_seed(seed)
    vocab = 40
    logits = torch.randn(12, vocab, generator=gen) * 2
    p = torch.tensor([0.05, 0.1, 0.25, 0.4, 0.5, 0.6, 0.75, 0.9, 0.95, 0.99, 0.999, 1.0])
    out = apply_top_k_top_p(logits.clone(), None, p)
    for row in range(logits.shape[0]):
        values = logits[row].tolist()
        expected = ref_top_p(values, float(p[row]), set(range(vocab)))
        assert kept_indices(out[row]) == expected, f"row {row}, p={float(p[row])}"


@pytest.mark.parametrize("seed", range(5))
def test_top_k_then_top_p_matches_reference(seed):
    gen = torch.Generator().manual_seed(100 + seed)
    vocab = 30
    logits = torch.randn(8, vocab, generator=gen) * 3
    k = torch.tensor([1, 3, 5, 10, 30, 15, 2, 30])
    p = torch.tensor([0.5, 0.9, 0.3, 0.8, 0.6, 1.0, 0.99, 1.0])
    out = apply_top_k_top_p(logits.clone(), k, p)
    for row in range(logits.shape[0]):
        values = logits[row].tolist()
        after_k = ref_top_k(values, int(k[row]))
        expected = ref_top_p(values, float(p[row]), after_k)
        assert kept_indices(out[row]) == expected, f"row {row}"


def test_top_p_keeps_every_token_tied_at_the_boundary():
    # Probabilities ~ [0.47, 0.17, 0.17, 0.17, 0.02]: p = 0.55 is crossed
    # inside the tie group {1, 2, 3}; all of it is kept.
    logits = torch.tensor([[2.0, 1.0, 1.0, 1.0, -1.0]])
    out = apply_top_k_top_p(logits.clone(), None, torch.tensor([0.55]))
    assert kept_indices(out[0]) == {0, 1, 2, 3}
    # A perfectly flat row keeps everything, whatever p is.
    flat = torch.zeros(1, 6)
    out = apply_top_k_top_p(flat.clone(), None, torch.tensor([0.1]))
    assert kept_indices(out[0]) == set(range(6))


def test_top_p_one_keeps_even_vanishingly_unlikely_tokens():
    logits = torch.tensor([[0.0, -30.0, -60.0, -80.0, 5.0]])
    out = apply_top_k_top_p(logits.clone(), None, torch.tensor([1.0]))
    assert torch.equal(out, logits)


def test_tiny_top_p_keeps_only_the_most_likely_token():
    logits = torch.randn(5, 20, generator=torch.Generator().manual_seed(3))
    out = apply_top_k_top_p(logits.clone(), None, torch.full((5,), 1e-6))
    for row in range(5):
        assert kept_indices(out[row]) == {int(logits[row].argmax())}


def test_rows_already_masked_to_minus_inf_stay_masked():
    logits = torch.tensor([[NEG_INF, 1.0, 0.5, NEG_INF, 0.0]])
    out = apply_top_k_top_p(logits.clone(), torch.tensor([5]), torch.tensor([1.0]))
    assert kept_indices(out[0]) == {1, 2, 4}
    out = apply_top_k_top_p(logits.clone(), torch.tensor([2]), torch.tensor([0.99]))
    assert kept_indices(out[0]) == {1, 2}


# --------------------------------------------------------------------------
# random_sample / TopKTopPSampler
# --------------------------------------------------------------------------


def empirical(samples: torch.Tensor, vocab: int) -> torch.Tensor:
    return torch.bincount(samples, minlength=vocab).double() / samples.numel()


def test_random_sample_matches_the_distribution():
    torch.manual_seed(1234)
    probs = torch.tensor([0.5, 0.25, 0.15, 0.07, 0.03, 0.0])
    draws = 20_000
    samples = random_sample(probs.expand(draws, -1).clone(), {})
    freq = empirical(samples, len(probs))
    # Std of each frequency is at most sqrt(0.25 / 20000) ~ 0.0035.
    assert (freq - probs.double()).abs().max() < 0.015
    assert freq[-1] == 0  # probability 0 is never drawn


def test_seeded_rows_are_reproducible_and_independent_of_the_batch():
    vocab = 12
    probs_row = torch.softmax(torch.randn(vocab, generator=torch.Generator().manual_seed(7)), -1)

    def draw_alone(seed: int, steps: int) -> list[int]:
        gen = torch.Generator().manual_seed(seed)
        return [
            int(random_sample(probs_row.unsqueeze(0).clone(), {0: gen})[0]) for _ in range(steps)
        ]

    def draw_in_batch(seed: int, steps: int, batch: int, row: int) -> list[int]:
        gen = torch.Generator().manual_seed(seed)
        out = []
        for _ in range(steps):
            # Other rows: different distributions, sampled from the global RNG.
            others = torch.softmax(torch.randn(batch, vocab), -1)
            others[row] = probs_row
            out.append(int(random_sample(others, {row: gen})[row]))
        return out

    reference = draw_alone(42, 30)
    assert draw_alone(42, 30) == reference
    torch.manual_seed(0)
    assert draw_in_batch(42, 30, batch=5, row=3) == reference
    torch.manual_seed(99)
    assert draw_in_batch(42, 30, batch=9, row=0) == reference


def test_all_rows_seeded_never_touch_the_global_rng():
    probs = torch.softmax(torch.randn(3, 10), -1)
    torch.manual_seed(5)
    state = torch.get_rng_state()
    random_sample(probs.clone(), {i: torch.Generator().manual_seed(i) for i in range(3)})
    assert torch.equal(torch.get_rng_state(), state)


def test_different_seeds_give_different_draws():
    vocab = 8
    probs = torch.full((1, vocab), 1.0 / vocab)
    gen_a = torch.Generator().manual_seed(1)
    gen_b = torch.Generator().manual_seed(2)
    a = [int(random_sample(probs.clone(), {0: gen_a})[0]) for _ in range(400)]
    b = [int(random_sample(probs.clone(), {0: gen_b})[0]) for _ in range(400)]
    agreement = sum(x == y for x, y in zip(a, b)) / len(a)
    # Independent uniform draws agree 1/8 of the time; identical streams always.
    assert agreement < 0.3


def test_seeded_draws_follow_the_distribution():
    # A per-request generator must give the right distribution too.
    probs = torch.tensor([[0.6, 0.3, 0.1]])
    gen = torch.Generator().manual_seed(3)
    samples = torch.stack([random_sample(probs.clone(), {0: gen})[0] for _ in range(4000)])
    freq = empirical(samples, 3)
    assert (freq - probs[0].double()).abs().max() < 0.03


def test_topk_topp_sampler_draws_from_the_renormalised_kept_set():
    torch.manual_seed(77)
    logits_row = torch.tensor([3.0, 2.5, 2.0, 1.0, 0.0, -1.0])
    draws = 20_000
    k = torch.full((draws,), 4)
    p = torch.full((draws,), 0.8)
    sampler = TopKTopPSampler()
    samples, processed = sampler(logits_row.expand(draws, -1).clone(), {}, k, p)
    assert processed is None
    kept = ref_top_p(logits_row.tolist(), 0.8, ref_top_k(logits_row.tolist(), 4))
    target = torch.zeros(6, dtype=torch.float64)
    target[sorted(kept)] = torch.softmax(logits_row[sorted(kept)].double(), -1)
    freq = empirical(samples, 6)
    assert (freq - target).abs().max() < 0.015
    assert set(samples.unique().tolist()) <= kept


def test_pytorch_filter_under_vllms_name_takes_int32_k_and_a_shared_p():
    gen = torch.Generator().manual_seed(21)
    logits = torch.randn(6, 40, generator=gen)
    k = torch.tensor([1, 3, 40, 7, 2, 40], dtype=torch.int32)  # as the batch stores it
    top_k_only = apply_top_k_top_p_pytorch(logits.clone(), k, None)
    # p = 1 (one value for every row) keeps everything top-k kept.
    with_p = apply_top_k_top_p_pytorch(logits.clone(), k, torch.tensor([1.0]))
    assert torch.equal(top_k_only, with_p)
    assert (top_k_only > float("-inf")).sum(-1).tolist() == [1, 3, 40, 7, 2, 40]
    assert torch.equal(apply_top_k_top_p(logits.clone(), k, None), top_k_only)
