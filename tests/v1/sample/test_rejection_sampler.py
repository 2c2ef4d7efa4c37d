"""Tests for engine/v1/sample/rejection_sampler.py (twin of vllm/v1/sample/rejection_sampler.py)
and engine/v1/spec_decode/metadata.py.

- Greedy rows: the accepted prefix plus the target's token, case by case, and
  token-for-token equal to step-by-step greedy decoding with the plain Sampler
  when penalties, bad words, min-tokens and allowed_token_ids must see the drafts.
- Random rows: drafts equal to the target are always accepted; the first
  emitted token follows the target distribution (chi-square goodness of fit at
  a fixed seed, significance 0.001) for good, bad, adversarial and point-mass
  (n-gram) drafts, with the acceptance rate sum_x min(p, q) checked too; seeded
  requests reproduce whatever shares their batch.
- parse_output, logprobs of the emitted tokens (raw and processed modes),
  SpecDecodeMetadata.
- Triton kernels against the torch path, exactly (token ids), on the CPU in
  Triton's interpreter (a worker process started with TRITON_INTERPRET=1, see
  tests/helpers/triton_interpret.py) or compiled where there is CUDA; a compile
  check for sm_90; a ``gpu`` test at real vocabulary size.
"""

from __future__ import annotations

import math
import textwrap

import numpy as np
import pytest
import torch

# Patches Triton 3.6's interpreter so a loaded scalar can bound a ``range`` (our
# kernels loop over each request's draft count); see its docstring.
import engine.v1.attention.ops  # noqa: F401
from engine.sampling_params import SamplingParams
from engine.v1.outputs import LogprobsTensors
from engine.v1.sample import rejection_sampler as rs
from engine.v1.sample.metadata import SamplingMetadata, build_sampling_metadata
from engine.v1.sample.rejection_sampler import PLACEHOLDER_TOKEN_ID, RejectionSampler
from engine.v1.sample.sampler import Sampler
from engine.v1.spec_decode.metadata import SpecDecodeMetadata
from tests.helpers.triton_interpret import interpreting_worker, run_without_interpreter

HAS_CUDA = torch.cuda.device_count() > 0  # NVML: is_available() would poison fork
# Small Triton checks: compiled on the GPU when there is one, else interpreted on the CPU.
SMALL_DEVICE = "cuda" if HAS_CUDA else "cpu"
VOCAB = 10


# ----------------------------------------------------------------------------
# Building a step
# ----------------------------------------------------------------------------
def spec_metadata(drafts: list[list[int]], device: str = "cpu") -> SpecDecodeMetadata:
    """The runner's layout: request i's target rows, then its bonus row."""
    num_drafts = [len(d) for d in drafts]
    target_rows: list[int] = []
    bonus_rows: list[int] = []
    row = 0
    for n in num_drafts:
        target_rows.extend(range(row, row + n))
        bonus_rows.append(row + n)
        row += n + 1

    def i32(values) -> torch.Tensor:
        return torch.tensor(list(values), dtype=torch.int32, device=device)

    return SpecDecodeMetadata(
        draft_token_ids=i32(t for d in drafts for t in d),
        num_draft_tokens=num_drafts,
        cu_num_draft_tokens=i32(np.cumsum(num_drafts)),
        cu_num_sampled_tokens=i32(np.cumsum([n + 1 for n in num_drafts])),
        target_logits_indices=i32(target_rows),
        bonus_logits_indices=i32(bonus_rows),
        logits_indices=i32(range(row)),
    )


def sampling_metadata(
    params: list[SamplingParams],
    drafts: list[list[int]],
    vocab: int = VOCAB,
    generators: dict[int, torch.Generator] | None = None,
    outputs: list[list[int]] | None = None,
    prompts: list[list[int]] | None = None,
    device: str = "cpu",
) -> SamplingMetadata:
    n = len(params)
    md = build_sampling_metadata(
        params,
        prompts if prompts is not None else [[0] for _ in range(n)],
        outputs if outputs is not None else [[] for _ in range(n)],
        generators or {},
        vocab,
        device,
    )
    md.spec_token_ids = drafts
    return md


def peaked_logits(argmax_rows: list[list[int]], vocab: int = VOCAB, seed: int = 0):
    """Logits rows in the step's layout (per request: one per draft, then the
    bonus row) whose argmax is the given token."""
    tokens = [t for row in argmax_rows for t in row]
    logits = torch.randn(len(tokens), vocab, generator=torch.Generator().manual_seed(seed))
    logits[torch.arange(len(tokens)), tokens] += 10.0
    return logits


def verify(
    drafts: list[list[int]],
    logits: torch.Tensor,
    md: SamplingMetadata,
    draft_probs: torch.Tensor | None = None,
    use_triton: bool = False,
    sampler: Sampler | None = None,
):
    """RejectionSampler.forward on a step; returns its SamplerOutput."""
    rejection_sampler = RejectionSampler(sampler or Sampler(), use_triton=use_triton)
    device = logits.device.type
    return rejection_sampler(spec_metadata(drafts, device), draft_probs, logits, md)


# ----------------------------------------------------------------------------
# Greedy
# ----------------------------------------------------------------------------
# (drafts, argmax of each logits row -- per request its target rows then its bonus row, expected)
GREEDY_CASES = {
    "all_accepted_plus_bonus": ([[1, 2, 3]], [[1, 2, 3, 5]], [[1, 2, 3, 5]]),
    "first_rejected": ([[1, 2, 3]], [[4, 2, 3, 5]], [[4, -1, -1, -1]]),
    "mid_rejected": ([[1, 2, 3]], [[1, 6, 3, 5]], [[1, 6, -1, -1]]),
    "last_rejected": ([[1, 2, 3]], [[1, 2, 7, 5]], [[1, 2, 7, -1]]),
    "no_drafts": ([[]], [[5]], [[5]]),
    "mixed_batch": (
        [[1, 2, 3], [], [4, 5], [6], [8, 8]],
        [[1, 2, 0, 9], [5], [4, 5, 8], [2, 7], [8, 8, 8]],
        [[1, 2, 0, -1], [5, -1, -1, -1], [4, 5, 8, -1], [2, -1, -1, -1], [8, 8, 8, -1]],
    ),
}


def run_greedy_case(case: str, use_triton: bool, device: str = "cpu") -> None:
    drafts, argmaxes, expected = GREEDY_CASES[case]
    md = sampling_metadata([SamplingParams(temperature=0.0)] * len(drafts), drafts, device=device)
    out = verify(drafts, peaked_logits(argmaxes).to(device), md, use_triton=use_triton)
    assert out.sampled_token_ids.dtype == torch.int32
    assert out.sampled_token_ids.tolist() == expected, case


@pytest.mark.parametrize("case", list(GREEDY_CASES))
def test_greedy_accepts_the_matching_prefix(case):
    run_greedy_case(case, use_triton=False)


def sequential_greedy(
    logits: torch.Tensor, sp: SamplingParams, prompt: list[int], output: list[int], drafts
) -> list[int]:
    """Step-by-step greedy decoding with the plain Sampler, judged against the
    drafts: row j is sampled with ``output + drafts[:j]`` as the generated ids."""
    emitted = []
    for j in range(len(drafts) + 1):
        md = build_sampling_metadata([sp], [prompt], [output + drafts[:j]], {}, VOCAB, "cpu")
        token = int(Sampler()(logits[j : j + 1], md).sampled_token_ids)
        emitted.append(token)
        if j == len(drafts) or token != drafts[j]:
            break
    return emitted


def test_greedy_equals_sequential_decoding_with_penalties_bad_words_and_masks():
    """Each request's options change the argmax once its own drafts count as
    generated; the batch must give what decoding token by token gives."""
    bad_words = SamplingParams(temperature=0.0)
    bad_words._bad_words_token_ids = [[7, 9], [3]]
    requests = [
        # (params, prompt, output, favourite token of every row, mismatch position)
        (SamplingParams(temperature=0.0, frequency_penalty=2.0), [1], [], 7, None),
        (bad_words, [1], [2], 9, None),  # row 0 boosted to 7, so 9 is banned on row 1
        (SamplingParams(temperature=0.0, min_tokens=3, stop_token_ids=[4]), [1], [5], 4, 2),
        (SamplingParams(temperature=0.0, allowed_token_ids=[1, 3, 5, 8]), [1], [], 0, 1),
        (SamplingParams(temperature=0.0, repetition_penalty=3.0), [6, 6], [], 6, None),
        (SamplingParams(temperature=0.0, presence_penalty=1.5), [1], [8], 8, 0),
        (SamplingParams(temperature=0.0), [1], [], 2, None),
    ]
    num_drafts = [3, 2, 3, 3, 2, 2, 0]
    gen = torch.Generator().manual_seed(5)
    rows, drafts, expected = [], [], []
    for req, ((sp, prompt, output, favourite, mismatch), n) in enumerate(zip(requests, num_drafts)):
        logits = torch.randn(n + 1, VOCAB, generator=gen) * 0.3
        logits[:, favourite] += 1.0
        if req == 1:
            logits[0, 7] += 2.0
        # Drafts the sequential decoder agrees with, except at ``mismatch``.
        d: list[int] = []
        for j in range(n):
            token = sequential_greedy(logits[j:], sp, prompt, output + d, [])[0]
            d.append((token + 1) % VOCAB if j == mismatch else token)
        rows.append(logits)
        drafts.append(d)
        expected.append(sequential_greedy(logits, sp, prompt, output, d))
    md = sampling_metadata(
        [r[0] for r in requests],
        drafts,
        prompts=[r[1] for r in requests],
        outputs=[r[2] for r in requests],
    )
    out = verify(drafts, torch.cat(rows), md)
    got = RejectionSampler.parse_output(out.sampled_token_ids, VOCAB).sampled_token_ids
    assert got == expected
    assert [len(row) for row in got] == [4, 3, 3, 2, 3, 1, 1]


def test_caller_logits_are_not_modified():
    drafts = [[1, 2], [3]]
    params = [SamplingParams(temperature=0.7, top_k=3, presence_penalty=1.0, logprobs=2)] * 2
    logits = torch.randn(5, VOCAB, generator=torch.Generator().manual_seed(3))
    before = logits.clone()
    verify(drafts, logits, sampling_metadata(params, drafts))
    assert torch.equal(logits, before)


# ----------------------------------------------------------------------------
# Random: acceptance and the output distribution
# ----------------------------------------------------------------------------
def test_drafts_from_the_target_distribution_are_all_accepted():
    """q == p: every draft passes p >= u * q (u < 1). Temperature and top-k
    must be applied to the target rows exactly as to the draft's q."""
    torch.manual_seed(0)
    num_reqs, k, temperature = 200, 4, 0.7
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(num_reqs * (k + 1), VOCAB, generator=gen) * 2
    target_rows = spec_metadata([[0] * k] * num_reqs).target_logits_indices.long()
    # Divided by a tensor, as the sampler does (a Python scalar may round differently).
    constrained = logits[target_rows] / torch.full((len(target_rows), 1), temperature)
    kth = constrained.topk(6, dim=-1).values[:, -1:]
    q = constrained.masked_fill(constrained < kth, float("-inf")).softmax(-1)
    draft_tokens = torch.multinomial(q, 1, generator=gen).view(num_reqs, k).tolist()
    params = [SamplingParams(temperature=temperature, top_k=6)] * num_reqs
    out = verify(draft_tokens, logits, sampling_metadata(params, draft_tokens), draft_probs=q)
    tokens = out.sampled_token_ids
    assert tokens[:, :k].tolist() == draft_tokens
    assert (tokens[:, k] >= 0).all()


P_TARGET = [0.4, 0.25, 0.2, 0.1, 0.05]
# name -> (the distribution the drafts are drawn from, whether the proposer gives
# it as draft_probs). Without draft_probs each draft is a point mass, as n-gram's.
DRAFTS = {
    "good": ([0.35, 0.3, 0.2, 0.1, 0.05], True),
    "bad": ([0.2, 0.2, 0.2, 0.2, 0.2], True),
    "adversarial": ([0.01, 0.01, 0.01, 0.02, 0.95], True),  # mass where p has least
    "disjoint": ([0.0, 0.0, 0.0, 0.3, 0.7], True),  # never drafts the likely tokens
    # (Uniformly drawn point masses would hide a residual that keeps the draft token:
    # the bias averages out over drafts. Skewed draws expose it.)
    "point_mass_likely": ([0.6, 0.1, 0.1, 0.1, 0.1], False),
    "point_mass_rare": ([0.1, 0.1, 0.1, 0.1, 0.6], False),
}
NUM_SAMPLES = 20_000
ALPHA = 1e-3  # significance of each goodness-of-fit test


def chi2_sf_even_df(x: float, df: int) -> float:
    """P(chi2_df >= x) for even df: exp(-x/2) * sum_{i < df/2} (x/2)^i / i!."""
    half = x / 2
    return math.exp(-half) * sum(half**i / math.factorial(i) for i in range(df // 2))


def first_token_sample(draft: str, temperature: float = 1.0, top_k: int = 0, seed: int = 0):
    """NUM_SAMPLES requests with 1-3 drafts each, drawn from DRAFTS[draft]; the
    target's logits are log p on every row. Returns the output tokens."""
    q, given = DRAFTS[draft]
    vocab = len(P_TARGET)
    gen = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    num_drafts = [1 + i % 3 for i in range(NUM_SAMPLES)]
    total = sum(num_drafts)
    q_rows = torch.tensor([q] * total)
    flat = torch.multinomial(q_rows, 1, replacement=True, generator=gen).view(-1).tolist()
    drafts, start = [], 0
    for n in num_drafts:
        drafts.append(flat[start : start + n])
        start += n
    logits = torch.tensor(P_TARGET).log().expand(total + NUM_SAMPLES, vocab).contiguous()
    params = [SamplingParams(temperature=temperature, top_k=top_k)] * NUM_SAMPLES
    md = sampling_metadata(params, drafts, vocab=vocab)
    out = verify(drafts, logits, md, draft_probs=q_rows if given else None)
    return out.sampled_token_ids


def expected_distribution(temperature: float, top_k: int) -> torch.Tensor:
    p = torch.tensor(P_TARGET, dtype=torch.float64) ** (1 / temperature)
    if top_k:
        p[p.argsort(descending=True)[top_k:]] = 0
    return p / p.sum()


def assert_follows(first: torch.Tensor, expected: torch.Tensor) -> None:
    counts = torch.bincount(first.long(), minlength=len(expected)).double()
    assert counts[expected == 0].sum() == 0, counts.tolist()
    kept = expected > 0
    observed, want = counts[kept], expected[kept] * NUM_SAMPLES
    statistic = float(((observed - want) ** 2 / want).sum())
    df = int(kept.sum()) - 1
    assert df % 2 == 0
    p_value = chi2_sf_even_df(statistic, df)
    assert p_value > ALPHA, (counts.tolist(), (expected * NUM_SAMPLES).tolist(), statistic)


@pytest.mark.parametrize("draft", list(DRAFTS))
def test_first_token_follows_the_target_distribution(draft):
    """Whatever the drafts, the first emitted token ~ p (chi-square, 4 degrees of
    freedom, alpha = 0.001). The first draft is accepted with probability
    sum_x min(p(x), q(x)); for point masses drawn from w, sum_x w(x) p(x)."""
    tokens = first_token_sample(draft)
    assert_follows(tokens[:, 0], expected_distribution(1.0, 0))

    q, given = DRAFTS[draft]
    pairs = zip(P_TARGET, q)
    accept_rate = sum(min(p, w) if given else p * w for p, w in pairs)
    # Draft 0 accepted <=> slot 1 holds a token (every request has >= 1 draft).
    observed = float((tokens[:, 1] != PLACEHOLDER_TOKEN_ID).double().mean())
    sigma = math.sqrt(accept_rate * (1 - accept_rate) / NUM_SAMPLES)
    assert abs(observed - accept_rate) < 5 * sigma, (observed, accept_rate)


@pytest.mark.parametrize("draft", ["adversarial", "point_mass_rare"])
def test_first_token_follows_the_constrained_target(draft):
    """Temperature 0.5 and top-k 3 shape the target rows: the output follows
    softmax(log p / 0.5) over the 3 most likely tokens (2 degrees of freedom)."""
    tokens = first_token_sample(draft, temperature=0.5, top_k=3, seed=1)
    assert_follows(tokens[:, 0], expected_distribution(0.5, 3))


def test_bad_words_apply_to_random_target_rows():
    """A banned draft has target probability 0: always rejected, never recovered."""
    sp = SamplingParams(temperature=1.0)
    sp._bad_words_token_ids = [[7]]
    drafts = [[7, 7]] * 50
    logits = torch.zeros(150, VOCAB)
    logits[:, 7] = 5.0
    out = verify(drafts, logits, sampling_metadata([sp] * 50, drafts)).sampled_token_ids
    assert (out[:, 0] != 7).all() and (out[:, 1:] == PLACEHOLDER_TOKEN_ID).all()


# ----------------------------------------------------------------------------
# Seeds
# ----------------------------------------------------------------------------
SEEDED_VOCAB = 64


def run_seeded(seed: int, position: int, others: list[SamplingParams]) -> list[list[int]]:
    """Three steps of a seeded request (4 drafts from a poor draft distribution)
    at ``position`` in a batch with ``others``; returns its output rows."""
    generator = torch.Generator().manual_seed(seed)
    data = torch.Generator().manual_seed(99)
    rows = []
    for _ in range(3):
        seeded_logits = torch.randn(5, SEEDED_VOCAB, generator=data)
        seeded_q = torch.rand(4, SEEDED_VOCAB, generator=data).softmax(-1)
        seeded_drafts = torch.randint(0, SEEDED_VOCAB, (4,), generator=data).tolist()
        params, drafts = list(others), [[1, 2]] * len(others)
        params.insert(position, SamplingParams(temperature=1.0, seed=seed))
        drafts.insert(position, seeded_drafts)
        logits = torch.randn(3 * len(others) + 5, SEEDED_VOCAB)
        q = torch.rand(2 * len(others) + 4, SEEDED_VOCAB).softmax(-1)
        md = spec_metadata(drafts)
        target = md.target_logits_indices.long()
        own_rows = target[2 * position : 2 * position + 4]
        logits[own_rows] = seeded_logits[:4]
        logits[md.bonus_logits_indices[position]] = seeded_logits[4]
        q[2 * position : 2 * position + 4] = seeded_q
        smd = sampling_metadata(params, drafts, SEEDED_VOCAB, generators={position: generator})
        out = verify(drafts, logits, smd, draft_probs=q).sampled_token_ids
        rows.append(out[position].tolist())
    return rows


def test_seeded_request_reproduces_across_batch_compositions():
    torch.manual_seed(1)
    alone = run_seeded(1234, 0, [])
    torch.manual_seed(2)
    mixed = [SamplingParams(), SamplingParams(temperature=0.0), SamplingParams(top_k=5)]
    assert run_seeded(1234, 2, mixed) == alone
    torch.manual_seed(3)
    assert run_seeded(1234, 1, [SamplingParams(temperature=0.5)]) == alone
    # Not vacuous: another seed gives other tokens.
    assert run_seeded(4321, 0, []) != alone


def test_seeded_request_without_drafts_draws_only_its_bonus_token():
    """No drafts: no uniform or recovered-token draws from its generator."""
    logits = torch.randn(1, VOCAB, generator=torch.Generator().manual_seed(0))
    used = torch.Generator().manual_seed(8)
    verify([[]], logits, sampling_metadata([SamplingParams(seed=8)], [[]], generators={0: used}))
    plain = torch.Generator().manual_seed(8)
    Sampler()(logits, sampling_metadata([SamplingParams(seed=8)], [[]], generators={0: plain}))
    assert torch.equal(used.get_state(), plain.get_state())


# ----------------------------------------------------------------------------
# parse_output and logprobs
# ----------------------------------------------------------------------------
def test_parse_output_drops_placeholders_big_ids_and_discarded_rows():
    out = torch.tensor([[1, 2, -1], [3, -1, -1], [4, 5, 6], [7, 100, -1]], dtype=torch.int32)
    rows = torch.arange(12, dtype=torch.float32).unsqueeze(1)
    logprobs = LogprobsTensors(rows.long(), rows, torch.arange(12))
    parsed = RejectionSampler.parse_output(
        out, 50, discard_req_indices=[1], logprobs_tensors=logprobs
    )
    assert parsed.sampled_token_ids == [[1, 2], [], [4, 5, 6], [7]]
    # One logprobs row per returned token, in order (slots 0, 1, 6, 7, 8, 9).
    assert parsed.logprobs.sampled_token_ranks == [0, 1, 6, 7, 8, 9]
    assert parsed.logprobs.logprobs == [[0.0], [1.0], [6.0], [7.0], [8.0], [9.0]]
    tokens, lists = RejectionSampler.parse_output(out, 50)  # unpacks like vLLM's tuple
    assert tokens[1] == [3] and lists is None


@pytest.mark.parametrize("mode", ["raw_logprobs", "processed_logprobs", "raw_logits"])
def test_logprobs_of_emitted_tokens(mode):
    """Each returned token's logprobs row is its own logits row's: raw, or after
    temperature (processed); the sampled token first, then the top 2, and its rank."""
    drafts = [[3, 1], [], [2, 2, 2]]
    params = [
        SamplingParams(temperature=0.0, logprobs=2),
        SamplingParams(temperature=0.5, seed=1, logprobs=1),
        SamplingParams(temperature=2.0, seed=2),
    ]
    gens = {1: torch.Generator().manual_seed(1), 2: torch.Generator().manual_seed(2)}
    logits = torch.randn(8, VOCAB, generator=torch.Generator().manual_seed(4))
    logits[0, 3] += 4  # request 0 accepts its first draft
    out = verify(
        drafts, logits, sampling_metadata(params, drafts, generators=gens), sampler=Sampler(mode)
    )
    parsed = RejectionSampler.parse_output(
        out.sampled_token_ids, VOCAB, logprobs_tensors=out.logprobs_tensors
    )
    temperatures = [1.0, 0.5, 2.0]
    first_row = [0, 3, 4]
    lp_row = 0
    for req, tokens in enumerate(parsed.sampled_token_ids):
        for j, token in enumerate(tokens):
            row = logits[first_row[req] + j]
            if mode == "processed_logprobs":
                row = row / temperatures[req]
            want = row if mode == "raw_logits" else row.log_softmax(-1)
            top = want.topk(2)
            assert parsed.logprobs.logprob_token_ids[lp_row] == [token, *top.indices.tolist()]
            assert parsed.logprobs.logprobs[lp_row] == pytest.approx(
                [want[token].item(), *top.values.tolist()], abs=1e-6
            )
            assert parsed.logprobs.sampled_token_ranks[lp_row] == int((want >= want[token]).sum())
            lp_row += 1
    assert lp_row == len(parsed.logprobs.logprobs) == sum(map(len, parsed.sampled_token_ids))
    assert parsed.sampled_token_ids[0][0] == 3


# ----------------------------------------------------------------------------
# SpecDecodeMetadata and errors
# ----------------------------------------------------------------------------
def test_spec_decode_metadata_make_dummy_shapes():
    md = SpecDecodeMetadata.make_dummy([[5, 6], [], [7]], torch.device("cpu"))
    assert md.max_spec_len == 2 and md.num_draft_tokens == [2, 0, 1]
    assert md.draft_token_ids.tolist() == [5, 6, 7]
    assert md.cu_num_draft_tokens.tolist() == [2, 2, 3]
    assert md.cu_num_sampled_tokens.tolist() == [3, 4, 6]
    assert md.target_logits_indices.shape == (3,) and md.bonus_logits_indices.shape == (3,)
    assert md.logits_indices.shape == (6,)
    assert SpecDecodeMetadata.make_dummy([], torch.device("cpu")).max_spec_len == 0


def test_unsupported_options_are_clear_errors():
    drafts = [[1] * 129]
    md = sampling_metadata([SamplingParams(temperature=0.0)], drafts)
    with pytest.raises(ValueError, match="at most 128 draft tokens"):
        verify(drafts, torch.zeros(130, VOCAB), md)
    drafts = [[1]]
    md = sampling_metadata([SamplingParams(temperature=0.0, logit_bias={2: 1.0})], drafts)
    with pytest.raises(ValueError, match="LogitBiasLogitsProcessor is active"):
        verify(drafts, torch.zeros(2, VOCAB), md)


# ----------------------------------------------------------------------------
# Triton kernels == torch path
# ----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def kernels():
    """``kernels(check, *args)`` runs ``check(*args)`` where Triton kernels can run:
    here when there is CUDA, else in an interpreting worker process."""
    if HAS_CUDA:
        yield lambda check, *args: check(*args)
        return
    with interpreting_worker(
        "engine.v1.sample.rejection_sampler", "rejection_random_sample_kernel"
    ) as run:
        yield run


def check_greedy_cases_with_triton() -> None:
    for case in GREEDY_CASES:
        run_greedy_case(case, use_triton=True, device=SMALL_DEVICE)


def random_step(seed: int, device: str, vocab: int = 37):
    """A mixed step: greedy, random, seeded rows; 0-4 drafts; options on some rows."""
    gen = torch.Generator().manual_seed(seed)
    num_drafts = [3, 0, 2, 4, 1, 3, 4]
    drafts = [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in num_drafts]
    params = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=1.0, seed=seed),
        SamplingParams(temperature=0.8, top_k=5),
        SamplingParams(temperature=1.2, top_p=0.8, seed=seed + 1, presence_penalty=0.5),
        SamplingParams(temperature=0.0, repetition_penalty=1.3),
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=0.6, seed=seed + 2),
    ]
    total = sum(num_drafts)
    logits = torch.randn(total + len(drafts), vocab, generator=gen) * 2
    # Make the greedy rows' drafts match their argmax sometimes.
    q = torch.randn(total, vocab, generator=gen).softmax(-1)
    return drafts, params, logits.to(device), q.to(device)


def run_step(seed: int, use_triton: bool, with_q: bool, device: str) -> torch.Tensor:
    drafts, params, logits, q = random_step(seed, device)
    generators = {
        row: torch.Generator(device=device).manual_seed(sp.seed)
        for row, sp in enumerate(params)
        if sp.seed is not None
    }
    md = sampling_metadata(params, drafts, 37, generators=generators, device=device)
    torch.manual_seed(seed)
    out = verify(drafts, logits, md, draft_probs=q if with_q else None, use_triton=use_triton)
    return out.sampled_token_ids.cpu()


def check_forward_triton_matches_torch() -> None:
    outputs = []
    for seed in range(6):
        for with_q in (True, False):
            torch_out = run_step(seed, False, with_q, SMALL_DEVICE)
            triton_out = run_step(seed, True, with_q, SMALL_DEVICE)
            assert torch.equal(torch_out, triton_out), (seed, with_q, torch_out, triton_out)
            outputs.append(torch_out)
    # Not vacuous: rejections, recoveries and bonus tokens all happened.
    stacked = torch.cat(outputs)
    assert (stacked == PLACEHOLDER_TOKEN_ID).any() and (stacked[:, 1:] >= 0).any()


def check_recovered_tokens_kernel_matches_torch() -> None:
    """Ties (first index wins, also across tiles), a zero residual, point masses."""
    device = SMALL_DEVICE
    gen = torch.Generator().manual_seed(0)
    vocab, num_drafts = 40, [2, 0, 3]
    cu = torch.tensor(np.cumsum(num_drafts), dtype=torch.int32, device=device)
    draft_ids = torch.tensor([5, 17, 0, 33, 39], dtype=torch.int32, device=device)
    target = torch.rand(5, vocab, generator=gen).softmax(-1)
    draft = torch.rand(5, vocab, generator=gen).softmax(-1)
    # Row 1: equal residual at 3, 20 and 36 (tiles 0, 1, 2 with block 16), nothing else.
    target[1], draft[1] = 0.0, 0.0
    target[1, [3, 20, 36]] = 0.25
    draft[2] = target[2]  # all-zero residual: token 0
    inv_q = torch.rand(3, vocab, generator=gen) + 1
    inv_q[0] = 1.0  # request 0 (rows 0 and 1) scores by residual alone
    target, draft, inv_q = target.to(device), draft.to(device), inv_q.to(device)
    for probs in (draft, None):
        want = rs.sample_recovered_tokens_torch(cu, draft_ids, probs, target, inv_q)
        for block in (16, 64):
            got = torch.empty_like(draft_ids)
            rs.sample_recovered_tokens_kernel[(3, 3)](
                got, cu, draft_ids, probs, target, inv_q, vocab,
                BLOCK_SIZE=block, NO_DRAFT_PROBS=probs is None,
            )  # fmt: skip
            assert torch.equal(got, want), (probs is None, block, got, want)
    want = rs.sample_recovered_tokens_torch(cu, draft_ids, draft, target, inv_q)
    assert want[1].item() == 3 and want[2].item() == 0


def check_accept_boundary_matches_torch() -> None:
    """u exactly at p / q accepts (p >= u * q); just above rejects."""
    device = SMALL_DEVICE
    cu = torch.tensor([1, 2, 3, 4], dtype=torch.int32, device=device)
    draft_ids = torch.tensor([1, 1, 1, 1], dtype=torch.int32, device=device)
    target = torch.tensor([[0.5, 0.5]] * 4, device=device)
    draft = torch.tensor([[0.0, 1.0], [0.0, 1.0], [1.0, 0.0], [0.5, 0.5]], device=device)
    uniform = torch.tensor([0.5, 0.5000001, 0.0, 0.999], dtype=torch.float64, device=device)
    bonus = torch.tensor([[7], [7], [7], [7]], dtype=torch.int32, device=device)
    recovered = torch.tensor([0, 0, 0, 0], dtype=torch.int32, device=device)
    is_greedy = torch.zeros(4, dtype=torch.bool, device=device)
    for probs in (draft, None):
        outs = []
        for use_triton in (False, True):
            out = torch.full((4, 2), -1, dtype=torch.int32, device=device)
            args = (out, cu, draft_ids, probs, target, bonus, recovered, uniform, is_greedy, 1)
            if use_triton:
                rs.rejection_random_sample_kernel[(4,)](*args, 2, NO_DRAFT_PROBS=probs is None)
            else:
                rs.rejection_random_sample_torch(*args)
            outs.append(out.cpu().tolist())
        assert outs[0] == outs[1], outs
        # Accept at u = p / q, reject just above; with q: q(d) = 0 rejects and
        # p / q = 1 accepts any u < 1; without q (q(d) = 1): u = 0 accepts, 0.999 rejects.
        want = (
            [[1, 7], [0, -1], [0, -1], [1, 7]]
            if probs is not None
            else [[1, 7], [0, -1], [1, 7], [0, -1]]
        )
        assert outs[0] == want, (probs is None, outs[0])


def check_expand_matches_torch() -> None:
    device = SMALL_DEVICE
    cu = torch.tensor([2, 2, 5, 6], dtype=torch.int32, device=device)
    for x, replace_from, replace_to in (
        (torch.tensor([0.0, 2.0, 3.0, 0.0], device=device), 0, 1),
        (torch.tensor([4, 9, 2, 7], dtype=torch.int32, device=device), 0, 0),
    ):
        want = rs.expand_batch_to_tokens(x, cu, 6, replace_from, replace_to, use_triton=False)
        got = rs.expand_batch_to_tokens(x, cu, 6, replace_from, replace_to, use_triton=True)
        assert torch.equal(got, want) and got.dtype == x.dtype, (got, want)
    assert want.tolist() == [4, 4, 2, 2, 2, 7]


def test_triton_greedy_cases(kernels):
    kernels(check_greedy_cases_with_triton)


def test_triton_forward_matches_torch(kernels):
    kernels(check_forward_triton_matches_torch)


def test_triton_recovered_tokens_match_torch(kernels):
    kernels(check_recovered_tokens_kernel_matches_torch)


def test_triton_accept_boundary_matches_torch(kernels):
    kernels(check_accept_boundary_matches_torch)


def test_triton_expand_matches_torch(kernels):
    kernels(check_expand_matches_torch)


_COMPILE_SCRIPT = textwrap.dedent(
    """
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from engine.v1.sample import rejection_sampler as rs

    target = GPUTarget("cuda", 90, 32)  # H100 / H200

    def compile_kernel(fn, types, constexprs):
        signature = {n: "constexpr" if n in constexprs else types[n] for n in fn.arg_names}
        triton.compile(ASTSource(fn, signature, constexprs), target=target)

    common = dict(output_token_ids_ptr="*i32", cu_num_draft_tokens_ptr="*i32",
                  draft_token_ids_ptr="*i32", bonus_token_ids_ptr="*i32", max_spec_len="i32")
    for is_greedy in ("*i1", None):
        types = dict(common, target_argmax_ptr="*i64", is_greedy_ptr=is_greedy)
        compile_kernel(rs.rejection_greedy_sample_kernel, types,
                       {} if is_greedy else {"is_greedy_ptr": None})
    for no_q in (True, False):
        types = dict(common, draft_probs_ptr="*fp32", target_probs_ptr="*fp32",
                     recovered_token_ids_ptr="*i32", uniform_probs_ptr="*fp64",
                     is_greedy_ptr="*i1", vocab_size="i32")
        constexprs = {"NO_DRAFT_PROBS": no_q, **({"draft_probs_ptr": None} if no_q else {})}
        compile_kernel(rs.rejection_random_sample_kernel, types, constexprs)
        types = dict(output_token_ids_ptr="*i32", cu_num_draft_tokens_ptr="*i32",
                     draft_token_ids_ptr="*i32", draft_probs_ptr="*fp32",
                     target_probs_ptr="*fp32", inv_q_ptr="*fp32", vocab_size="i32")
        constexprs = {"BLOCK_SIZE": 8192, "NO_DRAFT_PROBS": no_q,
                      **({"draft_probs_ptr": None} if no_q else {})}
        compile_kernel(rs.sample_recovered_tokens_kernel, types, constexprs)
    for value in ("fp32", "i32"):
        types = dict(output_ptr="*" + value, input_ptr="*" + value, cu_num_tokens_ptr="*i32",
                     replace_from="i32", replace_to="i32")
        compile_kernel(rs.expand_kernel, types, {"MAX_NUM_TOKENS": 128})
    print("compiled")
    """
)


def test_kernels_compile_for_sm90():
    """Lower every kernel for sm_90 in a fresh process without TRITON_INTERPRET."""
    result = run_without_interpreter(_COMPILE_SCRIPT)
    assert result.returncode == 0 and "compiled" in result.stdout, result.stderr[-4000:]


@pytest.mark.gpu
@pytest.mark.parametrize("with_q", [True, False], ids=["draft_probs", "point_mass"])
def test_gpu_triton_matches_torch_at_real_vocab(with_q):
    """Compiled kernels, Qwen3's vocabulary (151936), 64 requests with 0-5 drafts."""
    vocab, device = 151_936, "cuda"
    gen = torch.Generator().manual_seed(0)
    num_drafts = [i % 6 for i in range(64)]
    drafts = [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in num_drafts]
    temps = [0.0, 1.0, 0.7, 1.3]
    params = [
        SamplingParams(temperature=temps[i % 4], seed=i if i % 3 == 0 else None, top_k=50 * (i % 2))
        for i in range(64)
    ]
    total = sum(num_drafts)
    logits = (torch.randn(total + 64, vocab, generator=gen) * 3).to(device)
    target_rows = spec_metadata(drafts).target_logits_indices.long()
    # Drafts that are often right: the greedy rows' argmax, the random rows' likely tokens.
    flat = logits[target_rows.to(device)].argmax(-1).cpu().to(torch.int32)
    keep = torch.rand(total, generator=gen) < 0.7
    start = 0
    for d in drafts:
        for j in range(len(d)):
            if keep[start + j]:
                d[j] = int(flat[start + j])
        start += len(d)
    q = (torch.randn(total, vocab, generator=gen) * 3).softmax(-1).to(device) if with_q else None
    outs = []
    for use_triton in (False, True):
        generators = {
            row: torch.Generator(device=device).manual_seed(sp.seed)
            for row, sp in enumerate(params)
            if sp.seed is not None
        }
        md = sampling_metadata(params, drafts, vocab, generators=generators, device=device)
        torch.manual_seed(0)
        outs.append(verify(drafts, logits, md, draft_probs=q, use_triton=use_triton))
    assert torch.equal(outs[0].sampled_token_ids, outs[1].sampled_token_ids)
    accepted = (outs[0].sampled_token_ids[:, 1:] >= 0).sum().item()
    assert accepted > 0
