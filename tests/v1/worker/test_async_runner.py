"""The model runner's side of async scheduling, on the CPU.

* ``InputBatch.update_async_output_token_ids`` puts the ids a step sampled
  in place of the -1 placeholders the runner left in the output lists (what
  penalties read), following each request to its new row.
* A thrown-away sample (a row in the middle of its prompt) does not advance
  the row's seeded generator: a seed gives the same tokens however the
  prompt is chunked, with async scheduling on or off.
* The runner's host lists end in a placeholder after a step, and the next
  step's input id is the sampled one (taken on the device).
"""

from __future__ import annotations

import pytest
import torch

from engine.engine.arg_utils import EngineArgs
from engine.sampling_params import SamplingParams
from engine.v1.engine.llm_engine import LLMEngine
from engine.v1.worker.gpu_model_runner import GPUModelRunner
from tests.helpers.engine_fixtures import ids
from tests.helpers.tiny_model import make_tiny_model_dir
from tests.v1.sample.utils import make_input_batch, make_request_state

ENGINE_ARGS = dict(
    block_size=4,
    num_gpu_blocks_override=64,
    max_num_seqs=4,
    max_model_len=64,
    load_format="dummy",
    device="cpu",
    dtype="float32",
    hf_overrides={"intermediate_size": 32},
)


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory):
    return make_tiny_model_dir(tmp_path_factory.mktemp("async-runner") / "tiny")


def test_placeholders_are_replaced_by_request_not_by_row():
    batch = make_input_batch()
    params = SamplingParams(temperature=0.0)
    a = make_request_state("a", params, [1, 2], output=[7, -1])
    b = make_request_state("b", params, [3], output=[-1])
    c = make_request_state("c", params, [4], output=[9])  # sampled nothing last step
    for state in (b, a, c):
        batch.add_request(state)
    # Last step: a was row 0 and sampled 11, b row 1 and sampled 12.
    batch.prev_req_id_to_index = {"a": 0, "b": 1}
    batch.set_async_sampled_token_ids(torch.tensor([[11], [12]], dtype=torch.int32), None)
    batch.update_async_output_token_ids()
    assert a.output_token_ids == [7, 11]
    assert b.output_token_ids == [12]
    assert c.output_token_ids == [9]
    # The lists the sampler reads are the requests' own.
    assert batch.req_output_token_ids[batch.req_id_to_index["a"]] is a.output_token_ids


def run(model_dir, *, async_scheduling, budget, prompt, params):
    args = EngineArgs(
        model=str(model_dir),
        async_scheduling=async_scheduling,
        max_num_batched_tokens=budget,
        **ENGINE_ARGS,
    )
    engine = LLMEngine.from_engine_args(args, enable_multiprocessing=False)
    try:
        engine.add_request("r", {"prompt_token_ids": prompt}, params)
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    return out.outputs[0].token_ids
    finally:
        engine.shutdown()
    raise AssertionError("the request never finished")


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_seeded_tokens_do_not_depend_on_chunking(tiny_model_dir, async_scheduling):
    prompt = ids("w1 w2 w3 w4 w5 w6 w7 w8 w9 w10 w11 w12 w13")
    params = SamplingParams(temperature=1.0, seed=7, max_tokens=8, ignore_eos=True)
    whole = run(
        tiny_model_dir, async_scheduling=async_scheduling, budget=64, prompt=prompt, params=params
    )
    # Four chunks: three samples of this row are thrown away before the first kept one.
    chunked = run(
        tiny_model_dir, async_scheduling=async_scheduling, budget=4, prompt=prompt, params=params
    )
    assert chunked == whole
    # And not a constant: another seed draws other tokens.
    other = SamplingParams(temperature=1.0, seed=8, max_tokens=8, ignore_eos=True)
    assert (
        run(
            tiny_model_dir,
            async_scheduling=async_scheduling,
            budget=64,
            prompt=prompt,
            params=other,
        )
        != whole
    )


def test_next_input_is_the_sampled_id_taken_on_the_device(tiny_model_dir, monkeypatch):
    """After each step the runner's own list ends in -1; the next forward's
    first input id is the token the step sampled."""
    seen: list[tuple[list[int], int]] = []
    execute_model = GPUModelRunner.execute_model

    def recording_execute_model(runner, scheduler_output):
        result = execute_model(runner, scheduler_output)
        if scheduler_output.total_num_scheduled_tokens and runner.input_batch.num_reqs == 1:
            seen.append(
                (
                    list(runner.input_batch.req_output_token_ids[0] or []),
                    int(runner.input_ids[scheduler_output.total_num_scheduled_tokens - 1]),
                )
            )
        return result

    monkeypatch.setattr(GPUModelRunner, "execute_model", recording_execute_model)
    tokens = run(
        tiny_model_dir,
        async_scheduling=True,
        budget=64,
        prompt=ids("w1 w2 w3"),
        params=SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True),
    )
    # Step k (k >= 1) feeds the token step k-1 sampled; the host list still
    # ends in its placeholder when the step is launched.
    decode_steps = seen[1:]
    assert len(decode_steps) >= 4
    for k, (host_outputs, input_id) in enumerate(decode_steps):
        assert host_outputs[-1] == -1
        assert input_id == tokens[k]


def late_penalty_run(model_dir, async_scheduling):
    """A greedy request decodes alone for a while (sampling reads no output
    ids, so nothing asks for its placeholders); then a request with penalties
    joins and the sampler reads every row's output ids."""
    args = EngineArgs(
        model=str(model_dir),
        async_scheduling=async_scheduling,
        max_num_batched_tokens=64,
        **ENGINE_ARGS,
    )
    engine = LLMEngine.from_engine_args(args, enable_multiprocessing=False)
    greedy = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    penalized = SamplingParams(
        temperature=0.0,
        repetition_penalty=1.5,
        frequency_penalty=0.5,
        max_tokens=8,
        ignore_eos=True,
    )
    done = {}
    try:
        engine.add_request("alone", {"prompt_token_ids": ids("w1 w2 w3")}, greedy)
        for _ in range(8):
            engine.step()
        engine.add_request("late", {"prompt_token_ids": ids("w4 w5")}, penalized)
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    done[out.request_id] = out.outputs[0].token_ids
    finally:
        engine.shutdown()
    return done


def test_penalties_read_real_ids_after_steps_that_did_not_need_them(tiny_model_dir):
    overlapped = late_penalty_run(tiny_model_dir, True)
    assert overlapped == late_penalty_run(tiny_model_dir, False)
    assert len(overlapped["alone"]) == 20 and len(overlapped["late"]) == 8
