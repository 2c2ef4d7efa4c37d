"""The persistent batch's row bookkeeping (engine/v1/worker/gpu_input_batch.py).

* Over many seeded random steps -- requests leaving, joining, rows condensed
  and swapped, outputs growing -- every persistent logits processor's per-row
  state equals that of a processor built fresh for the batch's current rows,
  and so do the logits it produces; the batch's own per-row arrays and its
  sampling metadata equal those of a batch built by adding the same requests
  in row order.
* ``swap_states`` exchanges everything a row holds and records a SWAP move;
  ``condense`` records UNIDIRECTIONAL moves for the logits processors.
* ``top_k`` is int32, as in vLLM.
* The builder's rule: once a step's freed rows have been read, no removal.
* On CUDA, handing a batch change to the processors never waits for the device.
"""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from engine.sampling_params import SamplingParams
from engine.v1.sample.logits_processor import (
    LogitBiasLogitsProcessor,
    MinPLogitsProcessor,
    MinTokensLogitsProcessor,
    MoveDirectionality,
    build_logitsprocs,
)
from engine.v1.worker.gpu_input_batch import CachedRequestState, InputBatch
from tests.v1.sample.utils import (
    fresh_logitsproc,
    make_glassbox_config,
    make_input_batch,
    make_request_state,
)

VOCAB = 24
MAX_REQS = 10


def random_params(rng: random.Random) -> SamplingParams:
    """A request that uses each feature with some probability."""
    kwargs: dict = {"temperature": rng.choice([0.0, 0.7, 1.3])}
    if rng.random() < 0.4:
        kwargs["min_p"] = rng.choice([0.05, 0.2])
    if rng.random() < 0.4:
        kwargs["logit_bias"] = {rng.randrange(VOCAB): rng.choice([-2.0, 1.5])}
    if rng.random() < 0.4:
        kwargs["min_tokens"] = rng.randint(1, 4)
        kwargs["stop_token_ids"] = rng.sample(range(VOCAB), rng.randint(1, 3))
    if rng.random() < 0.3:
        kwargs["top_k"] = rng.randint(1, 5)
    if rng.random() < 0.3:
        kwargs["presence_penalty"] = 0.5
    if rng.random() < 0.3:
        kwargs["allowed_token_ids"] = rng.sample(range(VOCAB), 4)
    if kwargs["temperature"] > 0 and rng.random() < 0.5:
        kwargs["seed"] = rng.randrange(1000)
    return SamplingParams(**kwargs)


def min_tokens_state(proc: MinTokensLogitsProcessor) -> dict:
    return {row: (n, list(out), set(stop)) for row, (n, out, stop) in proc.min_toks.items()}


def assert_processors_match_fresh(batch: InputBatch, states: dict[str, CachedRequestState]):
    """Each persistent processor against one built for the current rows."""
    rows = [states[req_id] for req_id in batch.req_ids]
    params = [r.sampling_params for r in rows]
    outputs = [r.output_token_ids for r in rows]
    n = len(rows)
    procs = {type(p): p for p in batch.logitsprocs.all}

    min_p, fresh_min_p = procs[MinPLogitsProcessor], fresh_logitsproc(MinPLogitsProcessor, params)
    assert min_p.min_p_cpu[:n].tolist() == fresh_min_p.min_p_cpu[:n].tolist()
    assert min_p.min_p_count == fresh_min_p.min_p_count
    bias = procs[LogitBiasLogitsProcessor]
    assert bias.biases == fresh_logitsproc(LogitBiasLogitsProcessor, params).biases
    min_toks = procs[MinTokensLogitsProcessor]
    fresh_min_toks = fresh_logitsproc(MinTokensLogitsProcessor, params, outputs)
    assert min_tokens_state(min_toks) == min_tokens_state(fresh_min_toks)

    logits = torch.randn(n, VOCAB)
    for proc, fresh in (
        (min_p, fresh_min_p),
        (bias, fresh_logitsproc(LogitBiasLogitsProcessor, params)),
        (min_toks, fresh_min_toks),
    ):
        assert torch.equal(proc.apply(logits.clone()), fresh.apply(logits.clone())), type(proc)


def assert_rows_match_reference(batch: InputBatch, states: dict[str, CachedRequestState]):
    """The batch's per-row state equals that of a batch that got the same
    requests added in row order, with no hole ever made."""
    ref = make_input_batch(MAX_REQS, vocab_size=VOCAB)
    for req_id in batch.req_ids:
        ref.add_request(states[req_id])
    ref.refresh_metadata()
    n = batch.num_reqs
    assert batch.req_ids == ref.req_ids
    assert batch.req_id_to_index == ref.req_id_to_index
    for name in (
        "num_tokens_no_spec",
        "num_prompt_tokens",
        "num_computed_tokens_cpu",
        "temperature_cpu",
        "top_p_cpu",
        "top_k_cpu",
        "frequency_penalties_cpu",
        "presence_penalties_cpu",
        "repetition_penalties_cpu",
    ):
        assert getattr(batch, name)[:n].tolist() == getattr(ref, name)[:n].tolist(), name
    for row in range(n):
        length = int(ref.num_tokens_no_spec[row])
        assert (
            batch.token_ids_cpu[row, :length].tolist() == ref.token_ids_cpu[row, :length].tolist()
        )
        blocks = int(ref.block_table.num_blocks_per_row[row])
        assert batch.block_table.num_blocks_per_row[row] == blocks
        assert (
            batch.block_table.block_table_np[row, :blocks].tolist()
            == ref.block_table.block_table_np[row, :blocks].tolist()
        )
    assert batch.generators == ref.generators
    assert batch.bad_words_token_ids == ref.bad_words_token_ids
    if ref.allowed_token_ids_mask_cpu_tensor is not None:
        assert batch.allowed_token_ids_mask_cpu_tensor is not None
        assert torch.equal(
            batch.allowed_token_ids_mask_cpu_tensor[:n], ref.allowed_token_ids_mask_cpu_tensor[:n]
        )
    md, ref_md = batch.sampling_metadata, ref.sampling_metadata
    assert md.output_token_ids == ref_md.output_token_ids
    assert (md.all_greedy, md.all_random, md.no_penalties) == (
        ref_md.all_greedy,
        ref_md.all_random,
        ref_md.no_penalties,
    )
    for name in ("temperature", "top_k", "top_p", "prompt_token_ids", "allowed_token_ids_mask"):
        a, b = getattr(md, name), getattr(ref_md, name)
        assert (a is None) == (b is None), name
        if a is not None:
            assert torch.equal(a, b), name


@pytest.mark.parametrize("seed", range(6))
def test_processors_follow_rows_through_random_steps(seed):
    rng = random.Random(seed)
    torch.manual_seed(seed)
    batch = make_input_batch(MAX_REQS, vocab_size=VOCAB)
    states: dict[str, CachedRequestState] = {}
    next_id = 0
    moves_seen: set[MoveDirectionality] = set()
    for _step in range(40):
        # Removals first (finished / unscheduled requests) ...
        for req_id in rng.sample(batch.req_ids, rng.randint(0, batch.num_reqs)):
            batch.remove_request(req_id)
        # ... then joins, which refill the lowest freed rows ...
        for _ in range(rng.randint(0, MAX_REQS - batch.num_reqs)):
            prompt = [rng.randrange(VOCAB) for _ in range(rng.randint(1, 6))]
            output = [rng.randrange(VOCAB) for _ in range(rng.randint(0, 3))]
            blocks = [rng.randrange(1, 50) for _ in range(rng.randint(1, 3))]
            state = make_request_state(
                f"r{next_id}", random_params(rng), prompt, output, block_ids=blocks
            )
            states[state.req_id] = state
            next_id += 1
            batch.add_request(state)
        # ... then condense, then swaps (a backend reordering the batch).
        batch.condense()
        for _ in range(rng.randint(0, 2) if batch.num_reqs > 1 else 0):
            i1, i2 = rng.sample(range(batch.num_reqs), 2)
            batch.swap_states(i1, i2)
        moves_seen |= {direction for _, _, direction in batch.batch_update_builder.moved}
        batch.refresh_metadata()

        assert_processors_match_fresh(batch, states)
        assert_rows_match_reference(batch, states)

        # The step samples: each row grows by one token.
        for row, req_id in enumerate(batch.req_ids):
            token = rng.randrange(VOCAB)
            states[req_id].output_token_ids.append(token)
            batch.append_token(row, token)
    assert moves_seen == set(MoveDirectionality)


def test_swap_states_exchanges_rows_and_records_a_swap():
    batch = make_input_batch(4, vocab_size=VOCAB)
    a = make_request_state(
        "a",
        SamplingParams(temperature=0.5, top_k=3, min_p=0.1, seed=7, allowed_token_ids=[1, 2]),
        [1, 2, 3],
        block_ids=[4, 5],
    )
    b = make_request_state(
        "b",
        SamplingParams(temperature=0.0, logit_bias={3: 1.0}, min_tokens=2, stop_token_ids=[0]),
        [9],
        output=[6],
        block_ids=[8],
    )
    b.sampling_params._bad_words_token_ids = [[5]]
    for state in (a, b):
        batch.add_request(state)
    batch.refresh_metadata()

    batch.swap_states(0, 1)
    assert batch.batch_update_builder.moved == [(0, 1, MoveDirectionality.SWAP)]
    batch.refresh_metadata()
    assert batch.req_ids == ["b", "a"] and batch.req_id_to_index == {"b": 0, "a": 1}
    assert batch.token_ids_cpu[0, :2].tolist() == [9, 6]
    assert batch.token_ids_cpu[1, :3].tolist() == [1, 2, 3]
    assert batch.num_tokens_no_spec[:2].tolist() == [2, 3]
    assert batch.block_table.block_table_np[0, :1].tolist() == [8]
    assert batch.block_table.block_table_np[1, :2].tolist() == [4, 5]
    assert set(batch.generators) == {1} and batch.bad_words_token_ids == {0: [[5]]}
    assert batch.allowed_token_ids_mask_cpu_tensor[
        1
    ].logical_not().nonzero().flatten().tolist() == [
        1,
        2,
    ]
    assert not batch.allowed_token_ids_mask_cpu_tensor[0].any()
    md = batch.sampling_metadata
    assert md.temperature.tolist() == pytest.approx([0.0, 0.5])
    assert md.top_k.tolist() == [VOCAB, 3]
    assert md.output_token_ids == [[6], []]
    procs = {type(p): p for p in batch.logitsprocs.all}
    assert procs[MinPLogitsProcessor].min_p.view(-1).tolist() == pytest.approx([0.0, 0.1])
    assert procs[LogitBiasLogitsProcessor].biases == {0: {3: 1.0}}
    assert set(procs[MinTokensLogitsProcessor].min_toks) == {0}


def test_condense_moves_the_last_rows_into_the_lowest_holes():
    batch = make_input_batch(6, vocab_size=VOCAB)
    for name in "abcde":
        batch.add_request(make_request_state(name, SamplingParams(), [1]))
    batch.refresh_metadata()
    for name in "bd":
        batch.remove_request(name)
    batch.condense()
    # e (row 4) fills b's hole (row 1); d's hole (row 3) is now the end.
    assert batch.req_ids == ["a", "e", "c"]
    assert batch.batch_update_builder.moved == [(4, 1, MoveDirectionality.UNIDIRECTIONAL)]
    update = batch.batch_update_builder.get_and_reset(batch.num_reqs)
    assert update is not None and update.batch_size == 3 and list(update.removed) == [3]


def test_a_new_request_takes_the_lowest_freed_row():
    batch = make_input_batch(6, vocab_size=VOCAB)
    for name in "abcd":
        batch.add_request(make_request_state(name, SamplingParams(), [1]))
    batch.refresh_metadata()
    batch.remove_request("c")
    batch.remove_request("b")
    assert batch.add_request(make_request_state("x", SamplingParams(), [1])) == 1
    assert batch.add_request(make_request_state("y", SamplingParams(), [1])) == 2
    assert batch.add_request(make_request_state("z", SamplingParams(), [1])) == 4
    batch.condense()
    assert batch.batch_update_builder.moved == []  # every hole was refilled
    assert batch.req_ids == ["a", "x", "y", "d", "z"]


def test_removal_after_the_freed_rows_were_read_is_refused():
    batch = make_input_batch(4, vocab_size=VOCAB)
    for name in "abc":
        batch.add_request(make_request_state(name, SamplingParams(), [1]))
    batch.refresh_metadata()
    batch.remove_request("a")
    batch.add_request(make_request_state("d", SamplingParams(), [1]))  # reads the freed rows
    with pytest.raises(RuntimeError, match="Cannot register new removed request"):
        batch.remove_request("b")


def test_top_k_is_int32_like_vllm():
    batch = make_input_batch(4, vocab_size=VOCAB)
    batch.add_request(make_request_state("a", SamplingParams(top_k=3), [1]))
    batch.refresh_metadata()
    assert batch.top_k.dtype == batch.top_k_cpu_tensor.dtype == torch.int32
    assert batch.sampling_metadata.top_k.dtype == torch.int32


def test_unsupported_request_fields_are_refused():
    batch = make_input_batch(4, vocab_size=VOCAB)
    state = make_request_state("a", SamplingParams(), [1])
    state.pooling_params = object()
    with pytest.raises(ValueError, match="request a: pooling_params is not supported"):
        batch.add_request(state)
    assert batch.num_reqs == 0
    with pytest.raises(ValueError, match="kernel_block_sizes must equal block_sizes"):
        InputBatch(
            max_num_reqs=2,
            max_model_len=8,
            max_num_batched_tokens=8,
            device=torch.device("cpu"),
            pin_memory=False,
            vocab_size=VOCAB,
            block_sizes=[4],
            kernel_block_sizes=[2],
        )


@pytest.mark.gpu
def test_processor_updates_never_wait_for_the_device():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    device = torch.device("cuda")
    batch = InputBatch(
        max_num_reqs=8,
        max_model_len=64,
        max_num_batched_tokens=64,
        device=device,
        pin_memory=True,
        vocab_size=VOCAB,
        block_sizes=[4],
        kernel_block_sizes=[4],
        logitsprocs=build_logitsprocs(make_glassbox_config(8), device, True),
    )
    params = [
        SamplingParams(temperature=0.8, min_p=0.1, seed=1),
        SamplingParams(temperature=0.0, logit_bias={7: 2.0}, min_tokens=2, stop_token_ids=[9]),
        SamplingParams(temperature=0.5, min_tokens=1, stop_token_ids=[3]),
    ]
    states = []
    for i, sp in enumerate(params):
        state = make_request_state(f"r{i}", sp, [1, 2, 3 + i])
        if sp.seed is not None:
            state.generator = torch.Generator(device="cuda").manual_seed(sp.seed)
        states.append(state)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for state in states:
            batch.add_request(state)
        batch.refresh_metadata()
        states[2].output_token_ids.append(0)  # r2 reaches min_tokens
        batch.remove_request("r0")
        batch.condense()
        batch.refresh_metadata()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    procs = {type(p): p for p in batch.logitsprocs.all}
    assert batch.req_ids == ["r2", "r1"]
    assert procs[MinPLogitsProcessor].min_p_count == 0
    assert procs[LogitBiasLogitsProcessor].biases == {1: {7: 2.0}}
    assert set(procs[MinTokensLogitsProcessor].min_toks) == {1}
    logits = torch.zeros(2, VOCAB, device=device)
    for proc in batch.logitsprocs.non_argmax_invariant:
        logits = proc.apply(logits)
    expected = np.zeros((2, VOCAB), dtype=np.float32)
    expected[1, 7] = 2.0
    expected[1, 9] = -np.inf
    assert logits.cpu().numpy().tolist() == expected.tolist()
