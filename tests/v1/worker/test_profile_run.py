"""``GPUModelRunner.profile_run``: what the memory profile that sizes the KV
cache on a GPU runs (vLLM's ``profile_run`` + ``_dummy_sampler_run``).

The sampler's peak ([max_num_seqs, V] float32 logits, probabilities and the
sort top-p needs) grows with ``max_num_seqs``, which is 1024 by default on an
H200; left out of the profile, a full batch of top-p requests could run out
of memory the KV cache was given. Checked on the CPU by counting what runs.
"""

from __future__ import annotations

import pytest
import torch

from engine.engine.arg_utils import EngineArgs
from engine.sampling_params import SamplingParams
from engine.v1.engine.llm_engine import LLMEngine
from tests.helpers.tiny_model import make_tiny_model_dir

ENGINE_ARGS = dict(
    block_size=4,
    num_gpu_blocks_override=64,
    max_num_seqs=6,
    max_num_batched_tokens=64,
    max_model_len=64,
    load_format="dummy",
    device="cpu",
    dtype="float32",
    hf_overrides={"intermediate_size": 32},
)
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3}


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory):
    return make_tiny_model_dir(tmp_path_factory.mktemp("profile-run") / "tiny")


def make_engine(model_dir, **kwargs) -> LLMEngine:
    args = EngineArgs(model=str(model_dir), **{**ENGINE_ARGS, **kwargs})
    return LLMEngine.from_engine_args(args, enable_multiprocessing=False)


def runner_of(engine: LLMEngine):
    return engine.engine_core.engine_core.model_executor.driver_worker.model_runner


def record(monkeypatch, obj, name, calls, tag):
    original = getattr(obj, name)

    def wrapper(*args, **kwargs):
        calls.append((tag, args, kwargs))
        return original(*args, **kwargs)

    monkeypatch.setattr(obj, name, wrapper)


def greedy(engine: LLMEngine) -> list[int]:
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    engine.add_request("r", {"prompt_token_ids": [5, 6, 7, 5, 6, 7, 5]}, params)
    while True:
        for out in engine.step():
            if out.finished:
                return list(out.outputs[0].token_ids)


@pytest.mark.parametrize(
    "kwargs, sampler_calls",
    [
        ({}, 2),  # FlashInfer's path (on CUDA) and the seeded torch path
        ({"logprobs_mode": "processed_logprobs"}, 1),  # one path only, as in vLLM
    ],
)
def test_profile_run_samples_a_row_per_possible_request(
    tiny_model_dir, monkeypatch, kwargs, sampler_calls
):
    engine = make_engine(tiny_model_dir, **kwargs)
    try:
        runner = runner_of(engine)
        before = greedy(engine)
        calls: list = []
        record(monkeypatch, runner.sampler, "forward", calls, "sampler")
        runner.profile_run()
        assert len(calls) == sampler_calls
        for _, (logits, metadata), _ in calls:
            assert logits.shape == (6, runner.model_config.vocab_size)  # max_num_seqs rows
            assert metadata.top_k is not None and metadata.top_p is not None
            assert not (metadata.all_greedy or metadata.all_random)
        if sampler_calls == 2:
            assert calls[0][1][1].generators == {} and len(calls[1][1][1].generators) == 1
        # The profile leaves nothing behind that changes what the engine samples.
        assert greedy(engine) == before
    finally:
        engine.shutdown()


def test_profile_run_rejection_samples_k_drafts_a_request(tiny_model_dir, monkeypatch):
    engine = make_engine(tiny_model_dir, speculative_config=NGRAM)
    try:
        runner = runner_of(engine)
        calls: list = []
        record(monkeypatch, runner.rejection_sampler, "forward", calls, "rejection")
        runner.profile_run()
        assert len(calls) == 1
        drafts, draft_probs, target_logits, _ = calls[0][1]
        assert drafts.num_draft_tokens == [3] * 6 and draft_probs is None
        assert target_logits.shape == (6 * (1 + 3), runner.model_config.vocab_size)
    finally:
        engine.shutdown()


def test_profile_run_out_of_memory_in_the_sampler_names_the_knobs(tiny_model_dir, monkeypatch):
    engine = make_engine(tiny_model_dir)
    try:
        runner = runner_of(engine)

        def out_of_memory(*args, **kwargs):
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 4.00 GiB")

        monkeypatch.setattr(runner.sampler, "forward", out_of_memory)
        with pytest.raises(RuntimeError, match="6 dummy requests; lower max_num_seqs"):
            runner.profile_run()
    finally:
        engine.shutdown()
