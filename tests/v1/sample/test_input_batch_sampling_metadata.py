"""The persistent batch's sampling metadata (engine/v1/worker/gpu_input_batch.py,
``InputBatch.refresh_metadata`` / ``sampling_metadata``) against
``build_sampling_metadata``.

* Over several steps of a mixed batch -- greedy, seeded random with top-k /
  top-p / min-p, penalties, logprobs, allowed ids, bad words, logit bias,
  min-tokens -- with requests joining, leaving and rows being condensed, the
  Sampler draws the same tokens (and logprobs) from either metadata.
* The flags come from the per-feature request sets: an all-greedy batch
  copies nothing to the device (no temperature at all), and an unchanged
  batch reuses last step's metadata object.
* Per-row values follow their request through ``condense()``; removed rows
  leave no trace (allowed-ids mask, generators, bad words).
* A request with an out-of-vocab id is refused before the batch changes.
"""

from __future__ import annotations

import pytest
import torch

from engine.sampling_params import SamplingParams
from engine.v1.sample.metadata import build_sampling_metadata
from engine.v1.sample.sampler import Sampler
from engine.v1.worker.gpu_input_batch import CachedRequestState, InputBatch
from tests.v1.sample.utils import make_input_batch
from tests.v1.sample.utils import make_request_state as make_state

VOCAB = 32


def make_batch(max_num_reqs: int = 8) -> InputBatch:
    return make_input_batch(max_num_reqs, vocab_size=VOCAB)


MIXED = {
    "greedy": SamplingParams(temperature=0.0, logprobs=2),
    "topk": SamplingParams(temperature=0.8, top_k=4, seed=1),
    "topp": SamplingParams(temperature=1.2, top_p=0.6, seed=2, logprobs=0),
    "minp": SamplingParams(temperature=1.0, min_p=0.2, seed=3),
    "penalties": SamplingParams(
        temperature=0.7,
        seed=4,
        repetition_penalty=1.3,
        frequency_penalty=0.5,
        presence_penalty=0.2,
    ),
    "allowed": SamplingParams(temperature=0.0, allowed_token_ids=[3, 5, 7, 11]),
    "bad_words": SamplingParams(temperature=0.9, seed=5, bad_words=None),
    "bias": SamplingParams(temperature=0.0, logit_bias={6: 30.0}),
    "min_tokens": SamplingParams(
        temperature=0.0, min_tokens=2, stop_token_ids=[9], ignore_eos=True
    ),
}
MIXED["bad_words"]._bad_words_token_ids = [[4], [8, 12]]


def reference_metadata(
    batch: InputBatch,
    states: dict[str, CachedRequestState],
    ref_generators: dict[str, torch.Generator],
):
    """build_sampling_metadata for the batch's current rows (its own generators)."""
    reqs = [states[req_id] for req_id in batch.req_ids]
    generators = {
        row: ref_generators[r.req_id] for row, r in enumerate(reqs) if r.req_id in ref_generators
    }
    return build_sampling_metadata(
        [r.sampling_params for r in reqs],
        [r.prompt_token_ids for r in reqs],
        [r.output_token_ids for r in reqs],
        generators,
        VOCAB,
        "cpu",
    )


def test_mixed_batch_samples_the_same_tokens_across_joins_and_leaves():
    batch = make_batch()
    states: dict[str, CachedRequestState] = {}
    ref_generators: dict[str, torch.Generator] = {}
    sampler = Sampler()
    g = torch.Generator().manual_seed(0)

    def add(req_id: str) -> None:
        params = MIXED[req_id]
        prompt = torch.randint(0, VOCAB, (5,), generator=g).tolist()
        states[req_id] = make_state(req_id, params, prompt)
        batch.add_request(states[req_id])
        if params.seed is not None:
            ref_generators[req_id] = torch.Generator().manual_seed(params.seed)

    # Step schedule: which requests join / leave before each step.
    schedule = [
        (["greedy", "topk", "topp", "minp", "penalties"], []),
        (["allowed", "bad_words"], []),
        ([], ["topk"]),  # a hole in row 1, filled from the end by condense()
        (["bias", "min_tokens"], ["greedy"]),
        ([], []),
        ([], []),  # min_tokens satisfied from here on: its processor drops out
        (["topk"], ["penalties", "allowed"]),
    ]
    for step, (joins, leaves) in enumerate(schedule):
        for req_id in leaves:
            batch.remove_request(req_id)
            ref_generators.pop(req_id, None)
        for req_id in joins:
            add(req_id)
        batch.condense()
        logits = torch.randn(batch.num_reqs, VOCAB, generator=g) * 3
        ref = reference_metadata(batch, states, ref_generators)
        batch.refresh_metadata()
        ours = batch.sampling_metadata

        assert (ours.all_greedy, ours.all_random, ours.no_penalties, ours.max_num_logprobs) == (
            ref.all_greedy,
            ref.all_random,
            ref.no_penalties,
            ref.max_num_logprobs,
        ), step
        torch.manual_seed(step)  # unseeded rows draw from the global RNG
        out_ref = sampler(logits.clone(), ref)
        torch.manual_seed(step)
        out = sampler(logits.clone(), ours)
        assert torch.equal(out.sampled_token_ids, out_ref.sampled_token_ids), step
        if ref.max_num_logprobs is not None:
            assert torch.equal(out.logprobs_tensors.logprobs, out_ref.logprobs_tensors.logprobs)
        for row, token in enumerate(out.sampled_token_ids[:, 0].tolist()):
            states[batch.req_ids[row]].output_token_ids.append(token)
            batch.append_token(row, token)

    assert set(batch.req_ids) == {"topp", "minp", "bad_words", "bias", "min_tokens", "topk"}


def test_all_greedy_batch_copies_nothing_and_reuses_its_metadata():
    batch = make_batch()
    # The device-side per-row buffers, marked: a host -> device copy of any
    # sampling parameter would overwrite the mark.
    device_buffers = {
        name: getattr(batch, name)
        for name in (
            "temperature",
            "top_p",
            "top_k",
            "frequency_penalties",
            "presence_penalties",
            "repetition_penalties",
        )
    }
    for buffer in device_buffers.values():
        buffer.fill_(-7)
    marked = {name: buffer.clone() for name, buffer in device_buffers.items()}

    def untouched() -> bool:
        return all(torch.equal(device_buffers[name], marked[name]) for name in marked)

    states = [make_state(f"r{i}", SamplingParams(temperature=0.0), [1, 2, 3]) for i in range(3)]
    for state in states:
        batch.add_request(state)
    batch.refresh_metadata()
    md = batch.sampling_metadata
    assert md.all_greedy and not md.all_random and md.no_penalties
    assert md.top_p is None and md.top_k is None and md.allowed_token_ids_mask is None
    assert md.prompt_token_ids is None and not any(p.is_active() for p in md.logitsprocs.all)
    assert md.temperature is None
    assert untouched()  # nothing crossed to the device
    # Nothing changed: the same object stays, no new work.
    batch.refresh_metadata()
    assert batch.sampling_metadata is md and untouched()
    # A token appended to a request is seen through the same object.
    states[0].output_token_ids.append(7)
    batch.refresh_metadata()
    assert batch.sampling_metadata.output_token_ids[0] == [7]


def test_params_follow_requests_when_they_join_leave_and_move():
    batch = make_batch()
    batch.add_request(make_state("a", SamplingParams(temperature=0.3, top_k=2), [1]))
    batch.add_request(make_state("b", SamplingParams(temperature=0.0), [2]))
    batch.add_request(
        make_state(
            "c",
            SamplingParams(temperature=0.9, top_k=5, top_p=0.5, allowed_token_ids=[4, 5], seed=1),
            [3],
        )
    )
    batch.refresh_metadata()
    md = batch.sampling_metadata
    assert not md.all_greedy and not md.all_random
    torch.testing.assert_close(md.temperature, torch.tensor([0.3, 0.0, 0.9]))
    assert md.top_k.tolist() == [2, VOCAB, 5]  # off is stored as V
    torch.testing.assert_close(md.top_p, torch.tensor([1.0, 1.0, 0.5]))
    assert md.allowed_token_ids_mask[2].logical_not().nonzero().flatten().tolist() == [4, 5]
    assert not md.allowed_token_ids_mask[:2].any()
    assert set(md.generators) == {2}

    # "a" leaves: "c" moves from row 2 into row 0 and takes its values along.
    batch.remove_request("a")
    batch.condense()
    batch.refresh_metadata()
    md2 = batch.sampling_metadata
    assert md2 is not md
    assert batch.req_ids == ["c", "b"]
    assert not md2.all_greedy and not md2.all_random
    torch.testing.assert_close(md2.temperature, torch.tensor([0.9, 0.0]))
    assert md2.top_k.tolist() == [5, VOCAB]
    torch.testing.assert_close(md2.top_p, torch.tensor([0.5, 1.0]))
    assert md2.allowed_token_ids_mask[0].logical_not().nonzero().flatten().tolist() == [4, 5]
    assert not md2.allowed_token_ids_mask[1].any()
    assert set(md2.generators) == {0}

    # "b", the only greedy request, leaves: every row is random now.
    batch.remove_request("b")
    batch.condense()
    batch.refresh_metadata()
    md3 = batch.sampling_metadata
    assert md3.all_random and md3.top_k.tolist() == [5]
    # "c" leaves: no row of the mask stays set for the next request in row 0.
    batch.remove_request("c")
    batch.condense()
    batch.add_request(make_state("d", SamplingParams(temperature=0.0), [1]))
    batch.refresh_metadata()
    md4 = batch.sampling_metadata
    assert md4.all_greedy and md4.allowed_token_ids_mask is None and md4.top_p is None
    assert md4.top_k is None and md4.generators == {}
    assert not batch.allowed_token_ids_mask_cpu_tensor.any()


def test_penalties_prompt_tensor_and_min_tokens_processor():
    batch = make_batch()
    batch.add_request(make_state("p", SamplingParams(presence_penalty=1.0, seed=1), [3, 4, 5]))
    m = make_state("m", SamplingParams(min_tokens=1, stop_token_ids=[2], temperature=0.0), [6])
    batch.add_request(m)
    batch.refresh_metadata()
    md = batch.sampling_metadata
    assert not md.no_penalties
    assert md.prompt_token_ids.tolist() == [[3, 4, 5], [6, VOCAB, VOCAB]]  # padded with V
    torch.testing.assert_close(md.presence_penalties, torch.tensor([1.0, 0.0]))
    active = [type(p).__name__ for p in md.logitsprocs.non_argmax_invariant if p.is_active()]
    assert active == ["MinTokensLogitsProcessor"]
    # "m" has its one token: min-tokens stops masking on the next step.
    m.output_token_ids.append(0)
    batch.refresh_metadata()
    assert batch.sampling_metadata is md
    assert not any(p.is_active() for p in md.logitsprocs.non_argmax_invariant)


def test_bad_requests_are_refused_before_the_batch_changes():
    batch = make_batch()
    batch.add_request(make_state("ok", SamplingParams(), [1]))
    with pytest.raises(ValueError, match=r"allowed_token_ids of request row 1 .*\[0, 31\]"):
        batch.add_request(make_state("bad", SamplingParams(allowed_token_ids=[1, VOCAB]), [1]))
    with pytest.raises(ValueError, match="seed=3 but no generator"):
        state = make_state("seeded", SamplingParams(seed=3), [1])
        state.generator = None
        batch.add_request(state)
    assert batch.req_ids == ["ok"] and batch.random_reqs == {"ok"}
    # Penalties index a [N, V] tensor with every row's prompt ids.
    batch.add_request(make_state("pen", SamplingParams(repetition_penalty=1.2), [VOCAB + 3]))
    with pytest.raises(ValueError, match=r"prompt_token_ids of request row 1 .*\[35\]"):
        batch.refresh_metadata()
    with pytest.raises(ValueError, match="vocab_size must be a positive int"):
        make_input_batch(2, vocab_size=0)
