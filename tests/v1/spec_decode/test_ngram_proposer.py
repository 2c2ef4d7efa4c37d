"""Tests for engine/v1/spec_decode/ngram_proposer.py (twin of
vllm/v1/spec_decode/ngram_proposer.py; vLLM's tests: tests/v1/spec_decode/test_ngram.py).

The matching rule asserted here is vLLM's kernel at 52a31cc: the longest
suffix n-gram within [min, max] wins, and among its occurrences the earliest
one; drafts may run into the suffix itself; at most k tokens, at most
max_model_len - T tokens, and never past the end of the history.
"""

from __future__ import annotations

import numpy as np

from engine.config import GlassboxConfig, ModelConfig
from engine.config.speculative import SpeculativeConfig
from engine.v1.spec_decode.ngram_proposer import (
    NgramProposer,
    _find_longest_matched_ngram_and_propose_tokens,
)


def make_proposer(min_n: int, max_n: int, k: int, max_model_len: int = 64) -> NgramProposer:
    config = GlassboxConfig(
        model_config=ModelConfig(
            model="glassbox-test-model", hf_config={"vocab_size": 32}, max_model_len=max_model_len
        ),
        speculative_config=SpeculativeConfig(
            method="ngram",
            num_speculative_tokens=k,
            prompt_lookup_min=min_n,
            prompt_lookup_max=max_n,
        ),
    )
    return NgramProposer(config)


def propose_one(tokens: list[int], min_n: int, max_n: int, k: int, max_model_len: int = 64):
    """Drafts for one request whose history is ``tokens`` and which just sampled."""
    token_ids_cpu = np.zeros((1, max_model_len), dtype=np.int64)
    token_ids_cpu[0, : len(tokens)] = tokens
    return make_proposer(min_n, max_n, k, max_model_len).propose(
        sampled_token_ids=[[tokens[-1] if tokens else 0]],
        num_tokens_no_spec=np.array([len(tokens)], dtype=np.int32),
        token_ids_cpu=token_ids_cpu,
    )[0]


def reference_drafts(tokens: list[int], min_n: int, max_n: int, k: int, max_model_len: int):
    """The rule written out naively: for n from max_n down to min_n, the first
    earlier window equal to the last n tokens (with a token after it)."""
    total = len(tokens)
    k = min(k, max_model_len - total)
    if k <= 0:
        return []
    for n in range(max_n, min_n - 1, -1):
        if n > total:
            continue
        suffix = tokens[total - n :]
        for start in range(0, total - n):
            if tokens[start : start + n] == suffix:
                return tokens[start + n : start + n + k]
    return []


# ---------------------------------------------------------------------------
# Which occurrence is drafted from
# ---------------------------------------------------------------------------
def test_longest_ngram_wins_over_an_earlier_shorter_one():
    # Suffix 1 2 3: the 3-gram occurs once (followed by 7); the 2-gram "2 3"
    # occurs earlier (followed by 9). Longest first picks 7.
    tokens = [2, 3, 9, 1, 2, 3, 7, 1, 2, 3]
    assert propose_one(tokens, min_n=2, max_n=3, k=1) == [7]


def test_earliest_occurrence_of_the_longest_ngram_wins():
    # "1 2 3" occurs three times before the suffix; vLLM drafts from the first.
    tokens = [1, 2, 3, 100, 1, 2, 3, 200, 1, 2, 3, 300, 1, 2, 3]
    assert propose_one(tokens, min_n=3, max_n=3, k=2) == [100, 1]
    # A shorter window makes an earlier occurrence of a 1-gram the winner.
    assert propose_one([1, 3, 6, 2, 3, 4, 1, 2, 3], min_n=1, max_n=1, k=2) == [6, 2]
    assert propose_one([1, 3, 6, 2, 3, 4, 1, 2, 3], min_n=2, max_n=2, k=3) == [4, 1, 2]


def test_prompt_lookup_max_caps_the_ngram_length():
    # The 3-gram "4 5 6" is followed by 8; with max 2 only "5 6" is searched,
    # whose earliest occurrence is followed by 9.
    tokens = [5, 6, 9, 4, 5, 6, 8, 4, 5, 6]
    assert propose_one(tokens, min_n=1, max_n=3, k=1) == [8]
    assert propose_one(tokens, min_n=1, max_n=2, k=1) == [9]


def test_prompt_lookup_min_rejects_shorter_matches():
    tokens = [1, 2, 3, 4, 1, 2, 3]  # the suffix "1 2 3" recurs, "4 1 2 3" does not
    assert propose_one(tokens, min_n=4, max_n=4, k=2) == []
    assert propose_one(tokens, min_n=3, max_n=4, k=2) == [4, 1]
    # Only the last token recurs: a 1-gram match, not enough for min 2.
    assert propose_one([7, 1, 8, 1], min_n=2, max_n=3, k=2) == []
    assert propose_one([7, 1, 8, 1], min_n=1, max_n=3, k=2) == [8, 1]


def test_no_match_no_drafts():
    assert propose_one([1, 2, 3, 4, 5], min_n=1, max_n=3, k=3) == []
    assert propose_one([4], min_n=1, max_n=1, k=3) == []  # nothing before the suffix
    assert propose_one([], min_n=1, max_n=1, k=3) == []


# ---------------------------------------------------------------------------
# How many drafts
# ---------------------------------------------------------------------------
def test_drafts_truncated_at_k():
    tokens = [1, 2, 3, 4, 5, 6, 1]
    assert propose_one(tokens, min_n=1, max_n=1, k=3) == [2, 3, 4]
    assert propose_one(tokens, min_n=1, max_n=1, k=1) == [2]


def test_drafts_stop_at_the_end_of_the_history_and_may_overlap_the_suffix():
    # "1" occurs first at 0; what follows it runs to the end, suffix included.
    assert propose_one([1, 2, 3, 4, 5, 6, 1], min_n=1, max_n=1, k=10) == [2, 3, 4, 5, 6, 1]
    # The occurrence of "1 1" at 0 overlaps the suffix "1 1" (at 2); only 2 tokens follow it.
    assert propose_one([1, 1, 1, 1], min_n=2, max_n=2, k=3) == [1, 1]


def test_drafts_capped_at_max_model_len():
    tokens = [1, 2, 3, 4, 1, 2, 3]  # 7 tokens; unbounded the drafts are 4 1 2
    assert propose_one(tokens, min_n=3, max_n=3, k=3, max_model_len=10) == [4, 1, 2]
    assert propose_one(tokens, min_n=3, max_n=3, k=3, max_model_len=9) == [4, 1]
    assert propose_one(tokens, min_n=3, max_n=3, k=3, max_model_len=8) == [4]
    assert propose_one(tokens, min_n=3, max_n=3, k=3, max_model_len=7) == []
    # The search function applies the same cap when called directly.
    got = _find_longest_matched_ngram_and_propose_tokens(
        np.array(tokens), min_ngram=3, max_ngram=3, max_model_len=8, k=3
    )
    assert got.tolist() == [4]


# ---------------------------------------------------------------------------
# A batch
# ---------------------------------------------------------------------------
def test_batch_mixes_rows_with_and_without_drafts():
    max_model_len = 12
    proposer = make_proposer(min_n=2, max_n=3, k=2, max_model_len=max_model_len)
    rows = [
        [1, 2, 3, 1, 2],  # 0: "1 2" recurs -> 3 1
        [4, 5, 6],  # 1: no match -> []
        [7, 8, 7, 8],  # 2: would match, but a prefill chunk sampled nothing -> []
        [1, 2, 9, 1, 2, 5, 5, 5, 5, 5, 1, 2],  # 3: at max_model_len -> []
        [9, 8, 1, 9, 8],  # 4: "9 8" recurs -> 1 9
        [3, 4, 5, 3, 4],  # 5: matches only if tokens past num_tokens_no_spec were read
    ]
    token_ids_cpu = np.full((8, max_model_len), -1, dtype=np.int64)  # more rows than requests
    for row, tokens in enumerate(rows):
        token_ids_cpu[row, : len(tokens)] = tokens
    num_tokens_no_spec = np.zeros(8, dtype=np.int32)
    num_tokens_no_spec[: len(rows)] = [len(t) for t in rows]
    # Row 5's history is only "3 4 5"; junk after it repeats "3 4".
    num_tokens_no_spec[5] = 3
    sampled = [[2], [6], [], [2], [8], [5]]

    drafts = proposer.propose(sampled, num_tokens_no_spec, token_ids_cpu)

    assert drafts == [[3, 1], [], [], [], [1, 9], []]
    assert all(type(t) is int for row in drafts for t in row)


def test_rows_are_independent_of_their_neighbours():
    # The same request gets the same drafts alone and in any row of a batch.
    rng = np.random.default_rng(1)
    histories = [rng.integers(0, 3, size=int(rng.integers(1, 20))).tolist() for _ in range(6)]
    proposer = make_proposer(min_n=1, max_n=4, k=3, max_model_len=32)
    alone = [propose_one(h, min_n=1, max_n=4, k=3, max_model_len=32) for h in histories]
    order = [3, 0, 5, 1, 4, 2]
    token_ids_cpu = np.zeros((6, 32), dtype=np.int64)
    for row, i in enumerate(order):
        token_ids_cpu[row, : len(histories[i])] = histories[i]
    num_tokens = np.array([len(histories[i]) for i in order], dtype=np.int32)
    batched = proposer.propose([[0]] * 6, num_tokens, token_ids_cpu)
    assert batched == [alone[i] for i in order]
    assert any(alone) and not all(alone)  # the histories exercise both outcomes


def test_matches_the_rule_written_out_on_random_histories():
    # Short histories over 3 tokens give many repeats, ties and overlaps.
    rng = np.random.default_rng(0)
    for _ in range(2000):
        tokens = rng.integers(0, 3, size=int(rng.integers(0, 25))).tolist()
        min_n = int(rng.integers(1, 4))
        max_n = int(rng.integers(min_n, 6))
        k = int(rng.integers(1, 6))
        max_model_len = len(tokens) + int(rng.integers(0, 6))
        got = _find_longest_matched_ngram_and_propose_tokens(
            np.array(tokens, dtype=np.int64), min_n, max_n, max_model_len, k
        ).tolist()
        assert got == reference_drafts(tokens, min_n, max_n, k, max_model_len), (
            tokens,
            min_n,
            max_n,
            k,
            max_model_len,
        )


# ---------------------------------------------------------------------------
# Built from the config
# ---------------------------------------------------------------------------
def test_proposer_reads_its_window_and_k_from_the_config():
    proposer = make_proposer(min_n=2, max_n=4, k=3, max_model_len=50)
    assert (proposer.min_n, proposer.max_n, proposer.k, proposer.max_model_len) == (2, 4, 3, 50)
    proposer.load_model()  # a no-op the runner may call on any proposer
