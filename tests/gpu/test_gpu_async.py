"""Async scheduling on CUDA: the side-stream copies, events and device-side
input ids give the same tokens as the serial loop.

Marked ``gpu``: skipped where torch sees no CUDA device (CI), run by
``make test-gpu`` on the GPU machine. fp32, so that the two loops (which
batch rows differently) agree token for token on a random tiny model.
"""

from __future__ import annotations

import pytest

from engine import LLM, SamplingParams
from tests.helpers.gpu import decode_graphs
from tests.helpers.hf_checkpoints import random_prompts, save_random_llama

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    return save_random_llama(
        tmp_path_factory.mktemp("tiny_llama_async"), hidden_size=128, intermediate_size=256
    )


PARAMS = [
    SamplingParams(temperature=0, max_tokens=24, ignore_eos=True),
    SamplingParams(temperature=0.9, seed=5, max_tokens=24, ignore_eos=True),
    SamplingParams(
        temperature=0,
        repetition_penalty=1.3,
        frequency_penalty=0.4,
        presence_penalty=0.2,
        max_tokens=24,
        ignore_eos=True,
    ),
    SamplingParams(temperature=0.7, seed=11, top_k=20, max_tokens=24, ignore_eos=True),
    SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=3),
    SamplingParams(temperature=0, max_tokens=7, ignore_eos=True),
]


def _run(model, async_scheduling, **kw):
    llm = LLM(
        model,
        skip_tokenizer_init=True,
        device="cuda",
        dtype="float32",
        max_model_len=512,
        async_scheduling=async_scheduling,
        **decode_graphs(**kw),
    )
    prompts = random_prompts([3, 17, 64, 150, 300, 5], 1)
    outs = llm.generate(prompts, PARAMS, use_tqdm=False)
    llm.shutdown()
    return [
        (
            o.outputs[0].token_ids,
            [sorted(p) for p in (o.outputs[0].logprobs or [])],
        )
        for o in outs
    ]


@pytest.mark.parametrize(
    "engine_kw",
    [
        dict(num_gpu_blocks_override=256),  # CUDA graphs for the decodes
        dict(num_gpu_blocks_override=40, max_num_batched_tokens=64),  # chunks + preemption
        dict(num_gpu_blocks_override=256, enforce_eager=True),
    ],
    ids=["graphs", "chunked-preempted", "eager"],
)
def test_async_equals_sync_on_cuda(tiny_llama, engine_kw):
    sync = _run(tiny_llama, False, **engine_kw)
    overlapped = _run(tiny_llama, True, **engine_kw)
    assert [t for t, _ in overlapped] == [t for t, _ in sync]
    # The logprob rows name the same candidates in both loops.
    assert [lp for _, lp in overlapped] == [lp for _, lp in sync]
