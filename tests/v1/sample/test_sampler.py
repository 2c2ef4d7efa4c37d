"""Tests for engine/v1/sample/sampler.py (twin of vllm/v1/sample/sampler.py)
and engine/v1/sample/metadata.py.

Covers the order of operations end to end: greedy rows, temperature,
logprobs from the raw logits, seeded reproducibility across batch
compositions, and that unseeded sampling follows softmax(processed logits / T)
after min-p / top-k / top-p, checked against a Python reference pipeline.
"""

from __future__ import annotations

import math

import pytest
import torch

from engine.sampling_params import SamplingParams
from engine.v1.outputs import LogprobsLists, LogprobsTensors, SamplerOutput
from engine.v1.sample.metadata import build_sampling_metadata
from engine.v1.sample.sampler import Sampler

VOCAB = 16


def make_metadata(params, vocab=VOCAB, generators=None, outputs=None, prompts=None):
    n = len(params)
    return build_sampling_metadata(
        params,
        prompts if prompts is not None else [[1, 2] for _ in range(n)],
        outputs if outputs is not None else [[] for _ in range(n)],
        generators or {},
        vocab,
        "cpu",
    )


def random_logits(rows: int, vocab: int = VOCAB, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * 2


# --------------------------------------------------------------------------
# Output shapes, greedy, temperature
# --------------------------------------------------------------------------


def test_output_shape_and_dtype():
    logits = random_logits(3)
    out = Sampler()(
        logits,
        make_metadata(
            [SamplingParams(temperature=0.0), SamplingParams(), SamplingParams(temperature=0.5)]
        ),
    )
    assert isinstance(out, SamplerOutput)
    assert out.sampled_token_ids.shape == (3, 1)
    assert out.sampled_token_ids.dtype == torch.int32
    assert out.logprobs_tensors is None


def test_all_greedy_batch_is_argmax():
    logits = random_logits(6, seed=1)
    md = make_metadata([SamplingParams(temperature=0.0)] * 6)
    assert md.all_greedy and not md.all_random
    out = Sampler()(logits, md)
    assert out.sampled_token_ids.view(-1).tolist() == logits.argmax(-1).tolist()


def test_greedy_rows_in_a_mixed_batch_are_argmax():
    logits = random_logits(8, seed=2)
    params = [
        SamplingParams(temperature=0.0) if i % 2 == 0 else SamplingParams(temperature=1.5)
        for i in range(8)
    ]
    md = make_metadata(params)
    assert not md.all_greedy and not md.all_random
    assert md.temperature.tolist() == [0.0, 1.5] * 4
    for _ in range(20):
        out = Sampler()(logits, md).sampled_token_ids.view(-1)
        assert out[0::2].tolist() == logits[0::2].argmax(-1).tolist()


def test_top_k_1_equals_greedy():
    logits = random_logits(10, seed=3)
    params = [SamplingParams(temperature=t, top_k=1) for t in (0.3, 0.7, 1.0, 1.5, 2.0) * 2]
    md = make_metadata(params)
    assert md.all_random
    for _ in range(10):
        out = Sampler()(logits, md)
        assert out.sampled_token_ids.view(-1).tolist() == logits.argmax(-1).tolist()


def test_caller_logits_are_not_modified():
    logits = random_logits(2, seed=4)
    before = logits.clone()
    params = [
        SamplingParams(
            temperature=0.7,
            top_k=3,
            top_p=0.8,
            min_p=0.1,
            repetition_penalty=1.3,
            logit_bias={0: 3.0},
        ),
        SamplingParams(temperature=0.0, allowed_token_ids=[1, 2]),
    ]
    Sampler()(logits, make_metadata(params))
    assert torch.equal(logits, before)


def test_bfloat16_logits_are_handled_in_float32():
    logits = random_logits(3, seed=5).to(torch.bfloat16)
    md = make_metadata([SamplingParams(temperature=0.0, logprobs=2)] * 3)
    out = Sampler()(logits, md)
    assert out.sampled_token_ids.view(-1).tolist() == logits.float().argmax(-1).tolist()
    lp = out.logprobs_tensors
    assert lp.logprobs.dtype == torch.float32
    expected = torch.log_softmax(logits.float(), dim=-1)
    assert torch.allclose(
        lp.logprobs[:, 0], expected.gather(1, lp.logprob_token_ids[:, :1]).view(-1)
    )


def test_empty_batch():
    md = make_metadata([])
    out = Sampler()(torch.empty(0, VOCAB), md)
    assert out.sampled_token_ids.shape == (0, 1)


# --------------------------------------------------------------------------
# Distributions: compare many draws against a reference pipeline
# --------------------------------------------------------------------------


def reference_probs(logits_row: list[float], sp: SamplingParams) -> list[float]:
    """Python reference of the random path: temperature, min-p, top-k, top-p."""
    vocab = len(logits_row)
    scaled = [v / sp.temperature for v in logits_row]

    def softmax(values):
        finite = [v for v in values if v != -math.inf]
        top = max(finite)
        w = [math.exp(v - top) if v != -math.inf else 0.0 for v in values]
        s = sum(w)
        return [x / s for x in w]

    if sp.min_p > 0:
        probs = softmax(scaled)
        cutoff = sp.min_p * max(probs)
        scaled = [v if p >= cutoff else -math.inf for v, p in zip(scaled, probs)]
    if 0 < sp.top_k < vocab:
        kth = sorted(scaled, reverse=True)[sp.top_k - 1]
        scaled = [v if v >= kth else -math.inf for v in scaled]
    if sp.top_p < 1:
        probs = softmax(scaled)
        order = sorted(range(vocab), key=lambda i: scaled[i], reverse=True)
        mass, kept = 0.0, []
        for i in order:
            kept.append(i)
            mass += probs[i]
            if mass >= sp.top_p:
                break
        last = scaled[kept[-1]]
        scaled = [v if v >= last else -math.inf for v in scaled]
    return softmax(scaled)


@pytest.mark.parametrize(
    "sp",
    [
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=0.5),
        SamplingParams(temperature=2.0),
        SamplingParams(temperature=0.8, top_k=3),
        SamplingParams(temperature=1.2, top_p=0.7),
        SamplingParams(temperature=1.5, min_p=0.15),
        SamplingParams(temperature=1.3, top_k=4, top_p=0.85, min_p=0.05),
    ],
    ids=["T1", "T0.5", "T2", "topk3", "topp0.7", "minp0.15", "all"],
)
def test_unseeded_sampling_matches_reference_distribution(sp):
    torch.manual_seed(2024)
    vocab = 6
    row = [1.5, 1.0, 0.6, 0.2, -0.5, -1.5]
    draws = 20_000
    logits = torch.tensor(row).expand(draws, -1).clone()
    out = Sampler()(logits, make_metadata([sp] * draws, vocab=vocab))
    samples = out.sampled_token_ids.view(-1).long()
    freq = torch.bincount(samples, minlength=vocab).double() / draws
    expected = torch.tensor(reference_probs(row, sp), dtype=torch.float64)
    # Each frequency has std <= sqrt(0.25 / 20000) ~ 0.0035.
    assert (freq - expected).abs().max() < 0.015, (freq.tolist(), expected.tolist())
    assert torch.all(freq[expected == 0] == 0)


# --------------------------------------------------------------------------
# Seeds
# --------------------------------------------------------------------------


def seeded_target_logits() -> torch.Tensor:
    # A fairly flat row, so independent draws rarely agree.
    return torch.randn(VOCAB, generator=torch.Generator().manual_seed(77)) * 0.5


def run_seeded_request(
    seed: int, position: int, others: list[SamplingParams], steps: int = 25
) -> list[int]:
    """Generate ``steps`` tokens for a seeded request sitting at ``position`` in a
    batch with ``others``; returns only the seeded request's tokens."""
    generator = torch.Generator().manual_seed(seed)
    seeded = SamplingParams(temperature=1.0, top_p=0.95, seed=seed)
    params = list(others)
    params.insert(position, seeded)
    target_logits = seeded_target_logits()
    tokens: list[int] = []
    for _ in range(steps):
        logits = torch.randn(len(params), VOCAB) * 2
        logits[position] = target_logits
        md = make_metadata(params, generators={position: generator})
        tokens.append(int(Sampler()(logits, md).sampled_token_ids[position, 0]))
    return tokens


def test_same_seed_same_tokens_across_runs_and_batch_compositions():
    alone = run_seeded_request(1234, 0, [])
    assert run_seeded_request(1234, 0, []) == alone
    torch.manual_seed(1)
    mixed = [SamplingParams(), SamplingParams(temperature=0.0), SamplingParams(top_k=5)]
    assert run_seeded_request(1234, 2, mixed) == alone
    torch.manual_seed(2)
    other_seeded_neighbour = [SamplingParams(temperature=0.9), SamplingParams(temperature=0.3)]
    assert run_seeded_request(1234, 1, other_seeded_neighbour) == alone
    assert len(set(alone)) > 1  # the test would be vacuous if the row were deterministic


def test_different_seeds_give_different_tokens():
    a = run_seeded_request(1, 0, [], steps=200)
    b = run_seeded_request(2, 0, [], steps=200)
    agreement = sum(x == y for x, y in zip(a, b)) / len(a)
    # Independent draws from the same distribution agree with probability
    # sum(p_i^2) (< 0.15 for this row); identical streams would agree always.
    probs = torch.softmax(seeded_target_logits(), -1)
    assert (probs**2).sum() < 0.15
    assert agreement < 0.35


def test_seeded_request_without_generator_is_rejected():
    with pytest.raises(ValueError, match="request row 1 has seed=5 but no entry in generators"):
        make_metadata([SamplingParams(), SamplingParams(seed=5)])


def test_generators_for_unknown_rows_are_rejected():
    with pytest.raises(ValueError, match="generators keys"):
        make_metadata([SamplingParams()], generators={3: torch.Generator()})


# --------------------------------------------------------------------------
# Logprobs
# --------------------------------------------------------------------------


def test_logprobs_come_from_raw_logits_with_ranks():
    logits = random_logits(4, seed=9)
    params = [
        SamplingParams(temperature=0.7, logprobs=3, repetition_penalty=1.5, top_k=2),
        SamplingParams(temperature=0.0, logprobs=1, logit_bias={0: 50.0}),
        SamplingParams(temperature=1.0),  # asked for none; still gets a row
        SamplingParams(temperature=0.0, logprobs=0, allowed_token_ids=[5]),
    ]
    md = make_metadata(params, outputs=[[3], [], [], []])
    assert md.max_num_logprobs == 3
    out = Sampler()(logits, md)
    lp = out.logprobs_tensors
    assert isinstance(lp, LogprobsTensors)
    assert lp.logprob_token_ids.shape == (4, 4) and lp.logprob_token_ids.dtype == torch.int64
    assert lp.logprobs.shape == (4, 4) and lp.logprobs.dtype == torch.float32
    assert lp.selected_token_ranks.shape == (4,) and lp.selected_token_ranks.dtype == torch.int64

    sampled = out.sampled_token_ids.view(-1).tolist()
    assert sampled[1] == 0 and sampled[3] == 5  # bias / whitelist steered the choice...
    raw = torch.log_softmax(logits, dim=-1)  # ...but logprobs ignore both
    for r in range(4):
        row = raw[r].tolist()
        ids = lp.logprob_token_ids[r].tolist()
        assert ids[0] == sampled[r]
        assert lp.logprobs[r, 0].item() == pytest.approx(row[sampled[r]], abs=1e-6)
        expected_top = sorted(range(VOCAB), key=lambda i: row[i], reverse=True)[:3]
        assert ids[1:] == expected_top
        assert lp.logprobs[r, 1:].tolist() == pytest.approx(
            [row[i] for i in expected_top], abs=1e-6
        )
        expected_rank = sum(1 for v in row if v >= row[sampled[r]])
        assert lp.selected_token_ranks[r].item() == expected_rank


def test_logprobs_zero_gives_only_the_sampled_token():
    logits = random_logits(2, seed=10)
    out = Sampler()(logits, make_metadata([SamplingParams(temperature=0.0, logprobs=0)] * 2))
    lp = out.logprobs_tensors
    assert lp.logprob_token_ids.shape == (2, 1)
    assert lp.selected_token_ranks.tolist() == [1, 1]  # greedy picks rank 1


def test_logprobs_minus_one_is_the_whole_vocab():
    logits = random_logits(1, seed=11)
    md = make_metadata([SamplingParams(logprobs=-1)])
    assert md.max_num_logprobs == VOCAB
    lp = Sampler()(logits, md).logprobs_tensors
    assert lp.logprobs.shape == (1, VOCAB + 1)
    assert torch.allclose(lp.logprobs[0, 1:].exp().sum(), torch.tensor(1.0))
    # More than the vocabulary is the same as all of it.
    assert make_metadata([SamplingParams(logprobs=100)]).max_num_logprobs == VOCAB


def test_rank_counts_ties_as_ahead():
    logits = torch.tensor([[1.0, 1.0, 0.0, 1.0]])
    md = make_metadata([SamplingParams(temperature=0.0, logprobs=1)], vocab=4)
    lp = Sampler()(logits, md).logprobs_tensors
    assert lp.selected_token_ranks.tolist() == [3]


def test_tolists_gives_engine_logprobs_lists():
    lp = LogprobsTensors(
        torch.tensor([[3, 3, 1]]), torch.tensor([[-0.5, -0.5, -1.5]]), torch.tensor([1])
    )
    lists = lp.tolists()
    assert isinstance(lists, LogprobsLists)
    assert lists == LogprobsLists([[3, 3, 1]], [[-0.5, -0.5, -1.5]], [1])
    assert type(lists.logprob_token_ids[0][0]) is int


# --------------------------------------------------------------------------
# Metadata
# --------------------------------------------------------------------------


def test_metadata_flags_and_per_row_tensors():
    params = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.5, top_k=4, top_p=0.9),
        SamplingParams(top_k=100),  # larger than the vocab: off
        SamplingParams(),
    ]
    md = make_metadata(params)
    assert md.temperature.tolist() == [0.0, 0.5, 1.0, 1.0]
    assert md.top_k.tolist() == [VOCAB, 4, VOCAB, VOCAB]
    assert md.top_p.tolist() == pytest.approx([1.0, 0.9, 1.0, 1.0])
    assert md.no_penalties and md.max_num_logprobs is None
    assert md.bad_words_token_ids == {} and md.allowed_token_ids_mask is None

    md = make_metadata([SamplingParams(top_k=VOCAB), SamplingParams()])
    assert md.all_random and md.top_k is None and md.top_p is None


def test_mismatched_lengths_and_bad_logits_shape_are_clear_errors():
    with pytest.raises(ValueError, match="one entry per request"):
        build_sampling_metadata([SamplingParams()], [[1], [2]], [[]], {}, VOCAB, "cpu")
    with pytest.raises(ValueError, match="vocab_size must be a positive int"):
        build_sampling_metadata([SamplingParams()], [[1]], [[]], {}, 0, "cpu")
    md = make_metadata([SamplingParams()] * 2)
    with pytest.raises(ValueError, match=r"logits must have shape \[num_requests=2"):
        Sampler()(torch.randn(3, VOCAB), md)


def test_apply_temperature_leaves_greedy_rows_finite():
    logits = torch.tensor([[1.0, -2.0], [1.0, -2.0]])
    out = Sampler.apply_temperature(logits.clone(), torch.tensor([0.0, 0.5]), all_random=False)
    # Greedy rows are divided by 1 (not 0), so no inf/NaN reaches the random path.
    assert out.tolist() == [[1.0, -2.0], [2.0, -4.0]]


# --------------------------------------------------------------------------
# vLLM's call signatures: logprobs modes, bonus tokens, sample()'s pair
# --------------------------------------------------------------------------


def test_logprobs_modes():
    logits = random_logits(2, seed=12)
    params = [SamplingParams(temperature=0.0, logprobs=2, repetition_penalty=2.0)] * 2
    md = make_metadata(params, prompts=[[int(logits[0].argmax())], [0]])
    raw = Sampler()(logits.clone(), md).logprobs_tensors
    assert torch.allclose(raw.logprobs[:, 1:], logits.log_softmax(-1).topk(2).values)
    raw_logits = Sampler("raw_logits")(logits.clone(), md).logprobs_tensors
    assert torch.allclose(raw_logits.logprobs[:, 1:], logits.topk(2).values)
    # Processed: after the penalty, which demotes row 0's raw argmax.
    processed = Sampler()(logits.clone(), md, logprobs_mode_override="processed_logprobs")
    tokens = processed.sampled_token_ids.view(-1).tolist()
    lp = processed.logprobs_tensors
    assert lp.logprob_token_ids[:, 1].tolist() == tokens  # greedy: the processed top-1
    assert tokens[0] != int(logits[0].argmax())
    with pytest.raises(ValueError, match="logprobs_mode must be one of"):
        Sampler()(logits.clone(), md, logprobs_mode_override="softmax")


def test_processed_logits_of_a_random_batch_are_the_filtered_ones():
    logits = random_logits(2, seed=13)
    params = [SamplingParams(temperature=0.5, top_k=2, logprobs=3, seed=s) for s in (1, 2)]
    gens = {i: torch.Generator().manual_seed(i + 1) for i in range(2)}
    md = make_metadata(params, generators=gens)
    lp = Sampler("processed_logits")(logits.clone(), md).logprobs_tensors
    # Temperature-scaled, top-2 kept, the rest -inf.
    assert torch.allclose(lp.logprobs[:, 1:3], logits.topk(2).values / 0.5)
    assert torch.isinf(lp.logprobs[:, 3]).all()


def test_bonus_token_penalties_see_the_draft_tokens():
    logits = torch.zeros(1, VOCAB)
    logits[0, 3] = 1.0  # the best token, unless it was generated or drafted
    md = make_metadata([SamplingParams(temperature=0.0, presence_penalty=2.0)])
    md.spec_token_ids = [[3]]
    sampler = Sampler()
    assert sampler(logits, md).sampled_token_ids.item() == 3
    assert sampler(logits, md, predict_bonus_token=True).sampled_token_ids.item() != 3
    edited = sampler.apply_logits_processors(logits.clone(), md, predict_bonus_token=True)
    assert edited[0, 3].item() == pytest.approx(-1.0)
    # apply_penalties takes the output ids explicitly, as vLLM's does.
    penalised = Sampler.apply_penalties(logits.clone(), md, [[3, 3]])
    assert penalised[0, 3].item() == pytest.approx(-1.0)


def test_sample_returns_tokens_and_processed_logprobs():
    logits = random_logits(3, seed=14)
    md = make_metadata([SamplingParams(temperature=0.0)] * 3)
    tokens, processed = Sampler().sample(logits.clone(), md)
    assert tokens.tolist() == logits.argmax(-1).tolist() and processed is None
    md = make_metadata([SamplingParams(temperature=0.0, logprobs=1)] * 3)
    _, processed = Sampler().sample(logits.clone(), md, "processed_logprobs")
    assert torch.allclose(processed, logits.log_softmax(-1))


def test_minus_one_logprobs_return_the_whole_distribution_unsorted():
    logits = random_logits(2, seed=15)
    md = make_metadata([SamplingParams(temperature=0.0)] * 2)
    md.max_num_logprobs = -1  # a caller's own metadata (the batch stores -1 as V)
    lp = Sampler()(logits.clone(), md).logprobs_tensors
    assert lp.logprob_token_ids.numel() == 0 and lp.selected_token_ranks.numel() == 0
    assert torch.allclose(lp.logprobs, logits.log_softmax(-1))
