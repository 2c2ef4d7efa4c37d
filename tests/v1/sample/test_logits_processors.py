"""Tests for the logits-editing steps: engine/v1/sample/logits_processor/
(min-p, logit bias, min-tokens; twin of vllm/v1/sample/logits_processor/),
engine/v1/sample/ops/bad_words.py and the allowed_token_ids mask.

Each is checked against a per-row Python reference, and through the Sampler
with greedy rows where the point is "this token can / cannot win". The
processors' persistent state is checked as it follows ``BatchUpdate``s (rows
removed, added, swapped, moved) and output lists growing; custom processors
load by class or by ``"module:Class"`` name.
"""

from __future__ import annotations

import math
import random

import pytest
import torch

from engine.sampling_params import SamplingParams
from engine.v1.sample.logits_processor import (
    STR_POOLING_REJECTS_LOGITSPROCS,
    BatchUpdate,
    BatchUpdateBuilder,
    LogitBiasLogitsProcessor,
    MinPLogitsProcessor,
    MinTokensLogitsProcessor,
    MoveDirectionality,
    build_logitsprocs,
    process_dict_updates,
    validate_logits_processors_parameters,
)
from engine.v1.sample.metadata import build_sampling_metadata
from engine.v1.sample.ops.bad_words import apply_bad_words
from engine.v1.sample.sampler import Sampler
from tests.v1.sample.utils import (
    BanTokenLogitsProcessor,
    fresh_logitsproc,
    make_glassbox_config,
)

NEG_INF = float("-inf")


def metadata(params, vocab, outputs=None, prompts=None):
    n = len(params)
    outputs = outputs if outputs is not None else [[] for _ in range(n)]
    prompts = prompts if prompts is not None else [[0] for _ in range(n)]
    return build_sampling_metadata(params, prompts, outputs, {}, vocab, "cpu")


def greedy(**kwargs) -> SamplingParams:
    return SamplingParams(temperature=0.0, **kwargs)


# --------------------------------------------------------------------------
# min-p
# --------------------------------------------------------------------------


def ref_min_p(row: list[float], min_p: float) -> list[float]:
    top = max(row)
    weights = [math.exp(v - top) for v in row]
    probs = [w / sum(weights) for w in weights]
    cutoff = min_p * max(probs)
    return [v if p >= cutoff else NEG_INF for v, p in zip(row, probs)]


def test_min_p_matches_reference():
    gen = torch.Generator().manual_seed(0)
    min_ps = [0.0, 0.01, 0.05, 0.1, 0.3, 0.5, 0.9, 1.0]
    logits = torch.randn(len(min_ps), 30, generator=gen) * 2
    proc = fresh_logitsproc(MinPLogitsProcessor, [SamplingParams(min_p=m) for m in min_ps])
    out = proc.apply(logits.clone())
    for r, m in enumerate(min_ps):
        assert out[r].tolist() == pytest.approx(ref_min_p(logits[r].tolist(), m)), f"min_p={m}"


def test_min_p_is_argmax_invariant_and_inactive_when_unused():
    proc = fresh_logitsproc(MinPLogitsProcessor, [SamplingParams()])
    assert proc.is_argmax_invariant()
    assert not proc.is_active()
    logits = torch.randn(1, 5)
    assert torch.equal(proc.apply(logits.clone()), logits)


def test_min_p_runs_after_temperature():
    # p(token 1) / p(token 0) = e^-2 ~ 0.135 at T=1 (cut by min_p=0.2), but
    # e^-0.5 ~ 0.61 at T=4 (kept). Sampling many times at T=4 must produce it.
    torch.manual_seed(0)
    draws = 2000
    params = [SamplingParams(temperature=4.0, min_p=0.2)] * draws
    logits = torch.tensor([[2.0, 0.0, -30.0]]).expand(draws, -1).clone()
    out = Sampler()(logits, metadata(params, 3)).sampled_token_ids.view(-1)
    assert (out == 1).sum() > 0.2 * draws
    assert (out == 2).sum() == 0  # -30/4 = -7.5: far below 0.2 * max


# --------------------------------------------------------------------------
# logit bias
# --------------------------------------------------------------------------


def test_logit_bias_matches_reference():
    rng = random.Random(1)
    vocab = 12
    biases = [None, {0: 5.0}, {3: -2.5, 7: 1.25, 11: 100.0}, {}, {5: -100.0}]
    params = [SamplingParams(logit_bias=b) for b in biases]
    logits = torch.tensor([[rng.uniform(-3, 3) for _ in range(vocab)] for _ in biases])
    proc = fresh_logitsproc(LogitBiasLogitsProcessor, params)
    assert not proc.is_argmax_invariant()
    out = proc.apply(logits.clone())
    for r, bias in enumerate(biases):
        expected = logits[r].tolist()
        for token, value in (bias or {}).items():
            expected[token] += value
        assert out[r].tolist() == pytest.approx(expected), f"row {r}"
    assert proc.biases == {1: {0: 5.0}, 2: {3: -2.5, 7: 1.25, 11: 100.0}, 4: {5: -100.0}}


def test_logit_bias_changes_the_greedy_choice():
    logits = torch.tensor([[3.0, 1.0, 2.0], [3.0, 1.0, 2.0]])
    params = [greedy(logit_bias={1: 2.5}), greedy()]
    out = Sampler()(logits, metadata(params, 3))
    assert out.sampled_token_ids.tolist() == [[1], [0]]


def test_out_of_vocab_logit_bias_is_a_clear_error():
    with pytest.raises(ValueError, match=r"logit_bias of request row 0 .*\[0, 3\]"):
        metadata([SamplingParams(logit_bias={4: 1.0})], 4)


# --------------------------------------------------------------------------
# min tokens
# --------------------------------------------------------------------------


def test_min_tokens_masks_stop_ids_until_reached():
    eos = 4
    params = SamplingParams(temperature=0.0, min_tokens=3, stop_token_ids=[2], max_tokens=10)
    params.update_from_generation_config({}, eos_token_id=eos)
    assert params.all_stop_token_ids == {2, eos}
    # EOS is the best token, stop id 2 the second best, token 0 the third.
    logits = torch.tensor([[1.0, -1.0, 2.0, -2.0, 3.0]])
    sampler = Sampler()
    output: list[int] = []
    for step in range(5):
        md = metadata([params], 5, outputs=[output])
        token = int(sampler(logits, md).sampled_token_ids[0, 0])
        if step < 3:
            assert token == 0, f"step {step}: stop tokens must be masked"
        else:
            assert token == eos
        output.append(token)


def test_min_tokens_processor_state_and_masking():
    rows = [
        SamplingParams(min_tokens=2, stop_token_ids=[1, 3]),  # 1 generated: still short
        SamplingParams(min_tokens=2, stop_token_ids=[1]),  # 2 generated: reached
        SamplingParams(stop_token_ids=[0]),  # no min_tokens
    ]
    outputs = [[5], [5, 6], []]
    proc = fresh_logitsproc(MinTokensLogitsProcessor, rows, outputs)
    assert not proc.is_argmax_invariant()
    assert set(proc.min_toks) == {0}
    logits = torch.zeros(3, 6)
    out = proc.apply(logits.clone())
    expected = torch.zeros(3, 6)
    expected[0, [1, 3]] = NEG_INF
    assert torch.equal(out, expected)


# --------------------------------------------------------------------------
# allowed_token_ids
# --------------------------------------------------------------------------


def test_allowed_token_ids_mask_and_sampling():
    vocab = 10
    params = [greedy(allowed_token_ids=[2, 7]), greedy(), SamplingParams(allowed_token_ids=[4])]
    md = metadata(params, vocab)
    mask = md.allowed_token_ids_mask
    expected = torch.zeros(3, vocab, dtype=torch.bool)
    expected[0] = True
    expected[0, [2, 7]] = False
    expected[2] = True
    expected[2, 4] = False
    assert torch.equal(mask, expected)

    logits = torch.arange(vocab, dtype=torch.float32).repeat(3, 1)  # token 9 is best
    out = Sampler()(logits, md)
    assert out.sampled_token_ids.view(-1).tolist() == [7, 9, 4]
    assert metadata([SamplingParams()], vocab).allowed_token_ids_mask is None


def test_allowed_tokens_mask_wins_over_logit_bias():
    # Masking happens before the bias, so -inf + 100 stays -inf.
    logits = torch.tensor([[0.0, 1.0, 2.0]])
    md = metadata([greedy(allowed_token_ids=[0, 1], logit_bias={2: 100.0})], 3)
    assert Sampler()(logits, md).sampled_token_ids.tolist() == [[1]]


def test_out_of_vocab_allowed_token_is_a_clear_error():
    with pytest.raises(ValueError, match="allowed_token_ids of request row 0"):
        metadata([SamplingParams(allowed_token_ids=[1, 10])], 10)


# --------------------------------------------------------------------------
# bad words
# --------------------------------------------------------------------------


class WordTokenizer:
    """Whitespace tokenizer over a fixed word list: word i -> id i."""

    def __init__(self, words: list[str]) -> None:
        self.ids = {w: i for i, w in enumerate(words)}

    def __len__(self) -> int:
        return len(self.ids)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [self.ids[w] for w in text.split()]


def ref_bad_words(row: list[float], bad_words: list[list[int]], output: list[int]) -> list[float]:
    out = list(row)
    for word in bad_words:
        prefix, last = word[:-1], word[-1]
        if len(prefix) <= len(output) and (not prefix or output[-len(prefix) :] == prefix):
            out[last] = NEG_INF
    return out


def test_bad_words_match_reference():
    rng = random.Random(3)
    vocab = 6
    for _ in range(200):
        rows = 4
        bad = {
            r: [
                [rng.randrange(vocab) for _ in range(rng.randint(1, 3))]
                for _ in range(rng.randint(1, 3))
            ]
            for r in range(rows)
            if rng.random() < 0.75
        }
        outputs = [[rng.randrange(vocab) for _ in range(rng.randint(0, 4))] for _ in range(rows)]
        logits = torch.randn(rows, vocab)
        got = logits.clone()
        apply_bad_words(got, bad, outputs)
        for r in range(rows):
            expected = ref_bad_words(logits[r].tolist(), bad.get(r, []), outputs[r])
            assert got[r].tolist() == pytest.approx(expected)


def test_bad_words_through_the_sampler():
    words = ["the", "big", "bad", "wolf", "cat", "sat"]
    tok = WordTokenizer(words)
    params = greedy(bad_words=["cat", "bad wolf"])
    params.update_from_tokenizer(tok)
    assert params.bad_words_token_ids == [[4], [2, 3]]

    vocab = len(words)
    # "wolf" is the best token, "cat" the second best, then "sat".
    logits = torch.tensor([[0.0, 0.0, 0.0, 3.0, 2.0, 1.0]])
    sampler = Sampler()

    def next_token(output: list[int], prompt: list[int]) -> int:
        md = metadata([params], vocab, outputs=[output], prompts=[prompt])
        return int(sampler(logits, md).sampled_token_ids[0, 0])

    # "wolf" is only banned right after "bad"; "cat" is always banned.
    assert next_token([0, 1], prompt=[0]) == 3
    assert next_token([0, 2], prompt=[0]) == 5
    # The prefix must be in the *generated* tokens; the prompt does not count.
    assert next_token([], prompt=[2]) == 3
    assert next_token([2, 0], prompt=[0]) == 3  # "bad" not the most recent token


def test_build_logitsprocs_builds_every_builtin_once_in_its_group():
    procs = build_logitsprocs(make_glassbox_config(), torch.device("cpu"), is_pin_memory=False)
    assert [type(p) for p in procs.non_argmax_invariant] == [
        MinTokensLogitsProcessor,
        LogitBiasLogitsProcessor,
    ]
    assert [type(p) for p in procs.argmax_invariant] == [MinPLogitsProcessor]
    # Built before any request: nothing to do until rows arrive.
    assert not any(p.is_active() for p in procs.all)


# --------------------------------------------------------------------------
# Persistent state: BatchUpdate, BatchUpdateBuilder, custom processors
# --------------------------------------------------------------------------


def test_process_dict_updates_applies_removed_added_moved():
    entries = {0: "a", 2: "c", 3: "d"}
    params = SamplingParams(logit_bias={1: 1.0})
    update = BatchUpdate(
        batch_size=3,
        removed=[3],
        added=[(1, params, [0], []), (2, SamplingParams(), [0], [])],
        moved=[(0, 1, MoveDirectionality.SWAP), (1, 4, MoveDirectionality.UNIDIRECTIONAL)],
    )
    changed = process_dict_updates(entries, update, lambda p, _, __: p.logit_bias or None)
    # removed 3; added 1 (state) and 2 (no state: "c" dropped); swap 0<->1; move 1 -> 4.
    assert changed and entries == {0: {1: 1.0}, 4: "a"}
    assert not process_dict_updates(entries, None, lambda p, _, __: None)


def test_min_p_follows_a_swap_and_a_condense_move():
    proc = fresh_logitsproc(
        MinPLogitsProcessor,
        [SamplingParams(min_p=0.5), SamplingParams(), SamplingParams(min_p=0.25)],
    )
    proc.update_state(
        BatchUpdate(batch_size=3, removed=[], added=[], moved=[(0, 1, MoveDirectionality.SWAP)])
    )
    assert proc.min_p.view(-1).tolist() == [0.0, 0.5, 0.25]
    # Row 0 leaves; condense moves row 2 into it.
    proc.update_state(
        BatchUpdate(
            batch_size=2,
            removed=[0],
            added=[],
            moved=[(2, 0, MoveDirectionality.UNIDIRECTIONAL)],
        )
    )
    assert proc.min_p.view(-1).tolist() == [0.25, 0.5] and proc.min_p_count == 2
    assert proc.get_min_p_by_index(2) == 0.0


def test_min_tokens_drops_a_row_once_its_output_list_is_long_enough():
    output: list[int] = []
    proc = fresh_logitsproc(
        MinTokensLogitsProcessor, [SamplingParams(min_tokens=2, stop_token_ids=[1])], [output]
    )
    for _ in range(2):
        assert set(proc.min_toks) == {0}
        output.append(5)  # the request's own list, as the runner appends to it
        proc.update_state(None)
    assert proc.min_toks == {} and not proc.is_active()
    logits = torch.zeros(1, 3)
    assert torch.equal(proc.apply(logits.clone()), logits)


def test_batch_update_builder_hands_out_the_lowest_freed_row_first():
    builder = BatchUpdateBuilder()
    assert builder.get_and_reset(0) is None  # nothing happened
    for row in (4, 1, 3):
        builder.removed_append(row)
    assert builder.peek_removed() == 1 and builder.pop_removed() == 1
    assert builder.removed == [4, 3]
    update = builder.get_and_reset(batch_size=3)
    assert update is not None and list(update.removed) == [4, 3]
    assert builder.get_and_reset(3) is None and not builder.has_removed()
    builder.removed_append(0)  # a new step may remove again
    assert builder.reset() and not builder.has_removed()


def test_custom_processors_by_class_or_name_run_after_the_builtins():
    config = make_glassbox_config()
    cpu = torch.device("cpu")
    for custom in (BanTokenLogitsProcessor, "tests.v1.sample.utils:BanTokenLogitsProcessor"):
        procs = build_logitsprocs(config, cpu, False, custom_logitsprocs=[custom])
        assert [type(p) for p in procs.non_argmax_invariant] == [
            MinTokensLogitsProcessor,
            LogitBiasLogitsProcessor,
            BanTokenLogitsProcessor,
        ]
    banned = greedy(extra_args={"ban_token": 2})
    md = metadata([banned, greedy()], 3)
    md.logitsprocs = procs
    added = [(0, banned, [0], []), (1, greedy(), [0], [])]
    for proc in procs.all:
        proc.update_state(BatchUpdate(batch_size=2, removed=[], added=added, moved=[]))
    logits = torch.tensor([[0.0, 1.0, 2.0], [0.0, 1.0, 2.0]])
    assert Sampler()(logits, md).sampled_token_ids.view(-1).tolist() == [1, 2]

    validate_logits_processors_parameters([BanTokenLogitsProcessor], banned)
    with pytest.raises(ValueError, match="ban_token must be an int"):
        validate_logits_processors_parameters(
            [BanTokenLogitsProcessor], SamplingParams(extra_args={"ban_token": "x"})
        )


def test_bad_custom_processors_are_clear_errors():
    config, cpu = make_glassbox_config(), torch.device("cpu")
    with pytest.raises(ValueError, match="is not a subclass of LogitsProcessor"):
        build_logitsprocs(config, cpu, False, custom_logitsprocs=[dict])
    with pytest.raises(RuntimeError, match="Failed to load 0th LogitsProcessor plugin"):
        build_logitsprocs(config, cpu, False, custom_logitsprocs=["no_such_module:Proc"])
    with pytest.raises(ValueError, match=STR_POOLING_REJECTS_LOGITSPROCS):
        build_logitsprocs(config, cpu, False, True, [BanTokenLogitsProcessor])
    assert list(build_logitsprocs(config, cpu, False, is_pooling_model=True).all) == []
