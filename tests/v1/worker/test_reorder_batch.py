"""Putting decodes before prefills in the persistent batch.

The reorder function (engine/v1/attention/backends/utils.py) and the runner's
step that calls it (``GPUModelRunner._may_reorder_batch``):

* crafted batches end in the order decodes, short extends, long extends,
  prefills, with the exact rows expected;
* on random batches: only misplaced rows move, at most one swap fewer than
  there are of them, and a two-run batch costs exactly one swap per decode
  sitting among the prefills; the logits processors and every per-row array
  follow the swaps;
* end to end on the CPU with a real (random-weight) model: a step that puts a
  new prefill in front of decodes is reordered when the attention builder
  asks for it, and every request -- greedy, seeded random, with min-p,
  logit bias, min-tokens and logprobs -- gets the same tokens as without
  reordering, with the runner's outputs under the right request ids.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from engine.engine.arg_utils import EngineArgs
from engine.sampling_params import SamplingParams
from engine.v1.attention.backends import cpu_attn
from engine.v1.attention.backends.utils import (
    DECODE,
    LONG_EXTEND,
    PREFILL,
    SHORT_EXTEND,
    batch_regions,
    reorder_batch_to_split_decodes_and_prefills,
)
from engine.v1.engine.llm_engine import LLMEngine
from engine.v1.outputs import AsyncModelRunnerOutput
from engine.v1.sample.logits_processor import MoveDirectionality
from engine.v1.worker.gpu_input_batch import CachedRequestState, InputBatch
from engine.v1.worker.gpu_model_runner import GPUModelRunner
from tests.helpers.engine_fixtures import ids
from tests.helpers.tiny_model import make_tiny_model_dir
from tests.v1.sample.utils import make_input_batch, make_request_state
from tests.v1.worker.test_gpu_input_batch import (
    VOCAB,
    assert_processors_match_fresh,
    assert_rows_match_reference,
    random_params,
)

# ----------------------------------------------------------------------------
# The reorder function on crafted batches
# ----------------------------------------------------------------------------


@dataclass
class Row:
    scheduled: int  # tokens scheduled this step
    computed: int  # tokens already in the KV cache
    prompt: int  # prompt length
    outputs: int = 0  # tokens generated so far


def build_batch(
    rows: list[Row], params: list[SamplingParams] | None = None
) -> tuple[InputBatch, SimpleNamespace, dict[str, CachedRequestState]]:
    """A persistent batch with request ``r{i}`` in row i, and a stand-in for
    the scheduler output (the reorder reads only ``num_scheduled_tokens``)."""
    batch = make_input_batch(max(len(rows), 1), vocab_size=VOCAB, max_model_len=128)
    states = {}
    for i, row in enumerate(rows):
        sp = params[i] if params is not None else SamplingParams(temperature=0.0)
        prompt = [(i + t) % VOCAB for t in range(row.prompt)]
        output = [(2 * i + t) % VOCAB for t in range(row.outputs)]
        state = make_request_state(f"r{i}", sp, prompt, output, block_ids=[i + 1])
        state.num_computed_tokens = row.computed
        states[state.req_id] = state
        batch.add_request(state)
    batch.refresh_metadata()
    scheduled = {f"r{i}": row.scheduled for i, row in enumerate(rows)}
    return batch, SimpleNamespace(num_scheduled_tokens=scheduled), states


def record_swaps(batch: InputBatch) -> list[tuple[int, int]]:
    swaps: list[tuple[int, int]] = []
    swap = batch.swap_states

    def recording_swap(i1: int, i2: int) -> None:
        swaps.append((i1, i2))
        swap(i1, i2)

    batch.swap_states = recording_swap  # type: ignore[method-assign]
    return swaps


def regions_of(batch: InputBatch, scheduler_output, threshold: int) -> list[int]:
    n = batch.num_reqs
    scheduled = np.array([scheduler_output.num_scheduled_tokens[r] for r in batch.req_ids])
    return batch_regions(
        scheduled, batch.num_computed_tokens_cpu[:n], batch.num_prompt_tokens[:n], threshold
    ).tolist()


P, D = Row(9, 0, 9), Row(1, 12, 12)  # a first prompt chunk, a decode

CASES = {
    # name: (rows, threshold, expected order of request ids, swaps)
    "prefill_before_two_decodes": ([Row(7, 0, 7), Row(1, 9, 9), Row(1, 4, 4)], 1, [2, 1, 0], 1),
    "only_misplaced_rows_move": ([D, P, D, D, P], 1, [0, 3, 2, 1, 4], 1),
    "four_runs_reversed": (
        [Row(5, 0, 5), Row(4, 6, 12), Row(2, 6, 12), Row(2, 12, 12)],
        2,
        [3, 2, 1, 0],
        2,
    ),
    "three_cycle_under_a_higher_threshold": (
        [Row(3, 0, 3), Row(3, 8, 8), Row(4, 8, 8)],
        3,
        [1, 2, 0],
        2,
    ),
    "one_token_prompt_is_a_prefill": ([Row(1, 0, 1), Row(1, 5, 5)], 1, [1, 0], 1),
    "recompute_after_preemption_is_a_prefill": (
        [Row(6, 0, 4, outputs=2), Row(1, 6, 4, outputs=3)],
        1,
        [1, 0],
        1,
    ),
    "short_extend_before_long_extend": ([Row(5, 4, 20), Row(1, 10, 20), D], 1, [2, 1, 0], 1),
    "already_in_order": ([D, Row(1, 3, 8), Row(6, 3, 20), P], 1, [0, 1, 2, 3], 0),
    "all_prefills": ([P, Row(3, 0, 3)], 1, [0, 1], 0),
    "single_request": ([P], 1, [0], 0),
}


@pytest.mark.parametrize("rows, threshold, expected, num_swaps", CASES.values(), ids=CASES.keys())
def test_crafted_batches(rows, threshold, expected, num_swaps):
    batch, sched, _ = build_batch(rows)
    swaps = record_swaps(batch)
    changed = reorder_batch_to_split_decodes_and_prefills(batch, sched, decode_threshold=threshold)
    assert batch.req_ids == [f"r{i}" for i in expected]
    assert changed == (num_swaps > 0) and len(swaps) == num_swaps
    assert regions_of(batch, sched, threshold) == sorted(regions_of(batch, sched, threshold))
    moved = batch.batch_update_builder.moved
    assert moved == [(i1, i2, MoveDirectionality.SWAP) for i1, i2 in swaps]


def test_regions():
    scheduled = np.array([1, 1, 5, 1, 2])
    computed = np.array([7, 3, 3, 0, 0])
    prompt = np.array([7, 8, 8, 1, 9])
    assert batch_regions(scheduled, computed, prompt, 1).tolist() == [
        DECODE,
        SHORT_EXTEND,
        LONG_EXTEND,
        PREFILL,
        PREFILL,
    ]
    # A 2-token step of a finished prompt (a decode with one draft) under threshold 2.
    assert batch_regions(np.array([2]), np.array([7]), np.array([7]), 2).tolist() == [DECODE]


# ----------------------------------------------------------------------------
# Random batches: minimal moves, and everything follows the rows
# ----------------------------------------------------------------------------


def random_row(rng: random.Random, threshold: int) -> Row:
    prompt = rng.randint(1, 20)
    kind = rng.choice(["decode", "short", "long", "prefill"])
    if kind == "prefill":
        return Row(rng.randint(1, prompt), 0, prompt)
    if kind == "decode":
        outputs = rng.randint(0, 5)
        return Row(rng.randint(1, threshold), prompt + outputs, prompt, outputs)
    prompt = max(prompt, threshold + 2)
    computed = rng.randint(1, prompt - 1)
    left = prompt - computed
    if kind == "short":
        return Row(rng.randint(1, min(threshold, left)), computed, prompt)
    return Row(rng.randint(threshold + 1, max(threshold + 1, left)), computed, prompt)


@pytest.mark.parametrize("seed", range(8))
def test_random_batches(seed):
    rng = random.Random(seed)
    torch.manual_seed(seed)
    threshold = rng.choice([1, 1, 3])
    two_runs = seed % 2 == 0  # decodes and prefills only
    rows = []
    for _ in range(rng.randint(1, 10)):
        row = random_row(rng, threshold)
        if two_runs and 0 < row.computed < row.prompt:
            row = Row(row.prompt, 0, row.prompt)
        rows.append(row)
    params = [random_params(rng) for _ in rows]
    batch, sched, states = build_batch(rows, params)
    before = list(batch.req_ids)
    region = dict(zip(before, regions_of(batch, sched, threshold)))
    target = sorted(region.values())
    misplaced = {i for i, r in enumerate(before) if region[r] != target[i]}
    swaps = record_swaps(batch)

    changed = reorder_batch_to_split_decodes_and_prefills(batch, sched, decode_threshold=threshold)

    after = batch.req_ids
    assert [region[r] for r in after] == target
    assert changed == bool(swaps) == bool(misplaced)
    # Rows in their run never move; only misplaced rows are swapped, and each
    # swap settles one request for good: a cycle of k rows costs k - 1 swaps.
    assert all(after[i] == before[i] for i in range(len(before)) if i not in misplaced)
    assert all(i1 in misplaced and i2 in misplaced for i1, i2 in swaps)
    assert len(swaps) <= max(len(misplaced) - 1, 0)
    if two_runs:
        # Each swap puts a decode and a prefill in place: the fewest possible.
        assert len(swaps) == len(misplaced) // 2
    # The logits processors get the swaps and match the new rows; so do the
    # batch's per-row arrays and the sampling metadata.
    batch.refresh_metadata()
    assert_processors_match_fresh(batch, states)
    assert_rows_match_reference(batch, states)


# ----------------------------------------------------------------------------
# End to end on the CPU: same tokens with and without reordering
# ----------------------------------------------------------------------------

ENGINE_ARGS = dict(
    block_size=4,
    num_gpu_blocks_override=64,
    max_num_batched_tokens=16,
    max_num_seqs=4,
    max_model_len=64,
    # A random Llama with the tiny checkpoint's shapes (its config lacks an MLP width).
    load_format="dummy",
    device="cpu",
    dtype="float32",
    hf_overrides={"intermediate_size": 32},
)
STOP = ids("w30")[0]
BIASED = ids("w10")[0]


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory):
    return make_tiny_model_dir(tmp_path_factory.mktemp("reorder") / "tiny")


def mixed_run(model_dir, monkeypatch, reorder: bool, async_scheduling: bool = True):
    """Four requests decode; when the first finishes, a 20-token prompt takes
    its row (row 0), in front of the three decodes. Returns per-request
    outputs, the runner's (req_ids, sampled) per step, and the swaps made.
    With async scheduling the rows move while the last step's sampled ids
    are still on the device: the next inputs must follow them."""
    # The CPU builder asks for decodes first on CPU families outside this list.
    families = () if reorder else ("x86", "arm", "powerpc", "s390x", "riscv", "other", "unknown")
    monkeypatch.setattr(cpu_attn, "_CPU_ARCH_PREFER_MIXED_BATCH", families)
    steps: list[tuple[list[str], list[list[int]]]] = []
    swaps: list[tuple[int, int]] = []
    sample_tokens, swap_states = GPUModelRunner.sample_tokens, InputBatch.swap_states

    def record(out):
        assert out.req_id_to_index == {r: i for i, r in enumerate(out.req_ids)}
        # Internal ids are "<user id>-<random suffix>": keep the user's part.
        user_ids = [r.rsplit("-", 1)[0] for r in out.req_ids]
        steps.append((user_ids, [list(t) for t in out.sampled_token_ids]))

    def recording_sample_tokens(runner, grammar_output=None):
        out = sample_tokens(runner, grammar_output)
        if not isinstance(out, AsyncModelRunnerOutput):
            record(out)
            return out
        get_output = out.get_output

        def recorded_get_output():
            result = get_output()
            record(result)
            return result

        out.get_output = recorded_get_output
        return out

    def recording_swap(batch, i1, i2):
        swaps.append((i1, i2))
        swap_states(batch, i1, i2)

    monkeypatch.setattr(GPUModelRunner, "sample_tokens", recording_sample_tokens)
    monkeypatch.setattr(InputBatch, "swap_states", recording_swap)

    args = EngineArgs(model=str(model_dir), async_scheduling=async_scheduling, **ENGINE_ARGS)
    engine = LLMEngine.from_engine_args(args, enable_multiprocessing=False)
    common = dict(ignore_eos=True)
    requests = {
        "a": ("w1 w2 w3", SamplingParams(temperature=0.0, max_tokens=2, **common)),
        "seeded": (
            "w4 w5",
            SamplingParams(temperature=1.0, min_p=0.2, seed=3, max_tokens=10, **common),
        ),
        "bias": (
            "w6 w7 w8",
            SamplingParams(temperature=0.0, logit_bias={BIASED: 50.0}, max_tokens=10, **common),
        ),
        "min_tokens": (
            "w9",
            SamplingParams(
                temperature=0.0,
                min_tokens=4,
                stop_token_ids=[STOP],
                logit_bias={STOP: 50.0},
                max_tokens=10,
            ),
        ),
    }
    late = (
        "w40 " * 20,
        SamplingParams(temperature=0.8, seed=9, min_p=0.05, logprobs=2, max_tokens=4, **common),
    )
    for rid, (prompt, sp) in requests.items():
        engine.add_request(rid, {"prompt_token_ids": ids(prompt)}, sp)
    outputs = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                c = out.outputs[0]
                lps = [sorted(pos.items()) for pos in c.logprobs or []]
                outputs[out.request_id] = (c.token_ids, c.finish_reason, lps)
                if out.request_id == "a":
                    engine.add_request("late", {"prompt_token_ids": ids(late[0])}, late[1])
    engine.shutdown()
    return outputs, steps, swaps


def test_reordering_changes_no_token(tiny_model_dir, monkeypatch):
    # The serial loop, where "late" lands in front of the decodes and is swapped.
    with monkeypatch.context() as m:
        plain, plain_steps, plain_swaps = mixed_run(
            tiny_model_dir, m, reorder=False, async_scheduling=False
        )
    with monkeypatch.context() as m:
        reordered, reordered_steps, reordered_swaps = mixed_run(
            tiny_model_dir, m, reorder=True, async_scheduling=False
        )

    assert plain_swaps == []
    # "late" took row 0 in front of three decodes: one swap sends it to the end.
    assert [set(pair) for pair in reordered_swaps] == [{0, 3}]
    assert reordered == plain
    # Processors followed their requests through the swap.
    assert reordered["bias"][0] == [BIASED] * 10
    tokens, reason, _ = reordered["min_tokens"]
    assert STOP not in tokens[:4] and tokens[4:] == [STOP] and reason == "stop"
    assert len(reordered["late"][2]) == 4  # logprobs kept for the moved request
    # Step by step, the runner hands out the same token per request id, while
    # the row order differed in some step.
    assert len(plain_steps) == len(reordered_steps)
    for (ids_a, tok_a), (ids_b, tok_b) in zip(plain_steps, reordered_steps):
        assert dict(zip(ids_a, tok_a)) == dict(zip(ids_b, tok_b))
    assert any(a[0] != b[0] for a, b in zip(plain_steps, reordered_steps))


def test_async_scheduling_follows_moved_rows(tiny_model_dir, monkeypatch):
    """With async scheduling a step's sampled ids stay on the device and the
    next step takes its inputs from them by request: here ``condense`` moves
    a request to another row while its last token is still a placeholder."""
    with monkeypatch.context() as m:
        overlapped, steps, _ = mixed_run(tiny_model_dir, m, reorder=True, async_scheduling=True)
    with monkeypatch.context() as m:
        serial, _, _ = mixed_run(tiny_model_dir, m, reorder=True, async_scheduling=False)
    assert any(
        prev_ids.index(r) != ids_now.index(r)
        for (prev_ids, _), (ids_now, _) in zip(steps, steps[1:])
        for r in set(prev_ids) & set(ids_now)
    )
    # Same tokens and finish reasons; logprobs to float32 rounding (the two
    # loops batch rows differently, and a matmul may sum in another order).
    assert overlapped.keys() == serial.keys()
    for rid, (tokens, reason, logprobs) in serial.items():
        assert overlapped[rid][:2] == (tokens, reason), rid
        for got, want in zip(overlapped[rid][2], logprobs, strict=True):
            assert [t for t, _ in got] == [t for t, _ in want]
            assert [lp.logprob for _, lp in got] == pytest.approx(
                [lp.logprob for _, lp in want], abs=1e-4
            )
