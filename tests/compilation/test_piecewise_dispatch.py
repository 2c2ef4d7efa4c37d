"""Piecewise CUDA graphs, the host half: modes, dispatch and padding.

What a GPU is not needed for: how ``CompilationConfig`` settles the graph
mode (vLLM's downgrades), which key the dispatcher picks for a batch under
FULL_AND_PIECEWISE, and that the runner's piecewise padding (tokens padded to
a capture size, slots -1, attention over the real tokens only) changes no
output and writes no KV. The last runs the CPU engine with the dispatcher
forced into FULL_AND_PIECEWISE: the steps are padded exactly as on CUDA,
only no graph replays (``tests/gpu/test_gpu_compile.py`` covers that).
"""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest
import torch

from engine import LLM, SamplingParams
from engine.config.compilation import CompilationConfig, CUDAGraphMode
from engine.tracing import RunnerBatch, load_trace
from engine.v1.cudagraph_dispatcher import BatchDescriptor, CudagraphDispatcher
from engine.v1.engine.utils import ENABLE_MULTIPROCESSING_ENV
from tests.helpers.hf_checkpoints import save_tiny_checkpoint

M = CUDAGraphMode


def _support(name: str) -> SimpleNamespace:
    return SimpleNamespace(name=name)  # an AttentionCGSupport member, by name


def _dispatcher(mode: CUDAGraphMode, sizes=(1, 2, 4, 8, 16, 32), max_num_reqs=8):
    config = CompilationConfig(cudagraph_mode=mode, cudagraph_capture_sizes=list(sizes))
    d = CudagraphDispatcher(config, max_num_tokens=32, max_num_reqs=max_num_reqs)
    d.captured.update(d.decode_keys() + d.piecewise_keys())
    return d


def test_full_and_piecewise_dispatch():
    d = _dispatcher(M.FULL_AND_PIECEWISE)
    # Decodes replay the model's graph (up to max_num_reqs requests)...
    assert d.dispatch(3, uniform_decode=True) == (M.FULL, BatchDescriptor(4, 4, True))
    # ...a mixed batch the pieces' graphs, padded in tokens only.
    assert d.dispatch(11, uniform_decode=False) == (M.PIECEWISE, BatchDescriptor(16))
    # 12 decodes: more requests than any FULL graph holds, so piecewise.
    assert d.dispatch(12, uniform_decode=True) == (M.PIECEWISE, BatchDescriptor(16))
    assert d.dispatch(33, uniform_decode=False)[0] == M.NONE  # past the largest size
    assert d.piecewise_keys() == [BatchDescriptor(s) for s in (1, 2, 4, 8, 16, 32)]


def test_piecewise_only_and_uncaptured_keys():
    d = _dispatcher(M.PIECEWISE)
    assert d.decode_keys() == []
    assert d.dispatch(3, uniform_decode=True) == (M.PIECEWISE, BatchDescriptor(4))
    d.captured.discard(BatchDescriptor(4))
    assert d.dispatch(3, uniform_decode=True)[0] == M.NONE  # never replay what was not captured
    assert _dispatcher(M.FULL_DECODE_ONLY).piecewise_keys() == []


def test_piecewise_modes_need_the_piecewise_compiler(caplog):
    config = CompilationConfig(cudagraph_mode="FULL_AND_PIECEWISE")  # mode NONE
    config.finalize(16, enforce_eager=False)
    assert config.cudagraph_mode == M.NONE
    assert "needs compilation mode VLLM_COMPILE" in caplog.text
    config = CompilationConfig(mode=3, cudagraph_mode="FULL_AND_PIECEWISE")
    config.finalize(16, enforce_eager=False, max_num_batched_tokens=2048)
    assert config.cudagraph_mode == M.FULL_AND_PIECEWISE
    # Mixed batches replay graphs too: twice max_num_seqs (vLLM's bound).
    assert config.cudagraph_capture_sizes == [1, 2, 4, 8, 16, 24, 32]
    # A largest size off the 8-stride is not captured; vLLM truncates it to the list's end.
    config = CompilationConfig(mode=3, cudagraph_mode="PIECEWISE", max_cudagraph_capture_size=12)
    config.finalize(16, enforce_eager=False)
    assert config.cudagraph_capture_sizes == [1, 2, 4, 8]
    assert config.max_cudagraph_capture_size == 8
    assert "Truncating max_cudagraph_capture_size to 8" in caplog.text


@pytest.mark.parametrize(
    "mode,compile_mode,support,expected",
    [
        # FULL for mixed batches needs ALWAYS; with attention split out -> FULL_AND_PIECEWISE.
        (M.FULL, 3, "UNIFORM_BATCH", M.FULL_AND_PIECEWISE),
        (M.FULL, 0, "UNIFORM_BATCH", M.FULL_DECODE_ONLY),
        (M.FULL_DECODE_ONLY, 3, "UNIFORM_SINGLE_TOKEN_DECODE", M.FULL_DECODE_ONLY),
        (M.FULL_AND_PIECEWISE, 3, "NEVER", M.PIECEWISE),
        (M.FULL_DECODE_ONLY, 0, "NEVER", M.NONE),
        (M.PIECEWISE, 3, "NEVER", M.PIECEWISE),
    ],
)
def test_resolve_cudagraph_mode(mode, compile_mode, support, expected, caplog):
    config = CompilationConfig(mode=compile_mode, cudagraph_mode=mode)
    assert config.resolve_cudagraph_mode(_support(support), "TRITON_ATTN") == expected
    assert config.cudagraph_mode == expected
    if expected != mode:
        assert f"setting cudagraph_mode={expected.name}" in caplog.text


def test_full_with_a_backend_that_never_captures_is_an_error():
    config = CompilationConfig(mode=3, cudagraph_mode="FULL")
    with pytest.raises(ValueError, match="cudagraph_mode FULL is not supported with the X"):
        config.resolve_cudagraph_mode(_support("NEVER"), "X")


def _run(model: str, trace: str, force_piecewise: bool):
    previous = os.environ.get(ENABLE_MULTIPROCESSING_ENV)
    os.environ[ENABLE_MULTIPROCESSING_ENV] = "0"
    try:
        llm = LLM(
            model,
            skip_tokenizer_init=True,
            max_model_len=128,
            max_num_batched_tokens=24,
            num_gpu_blocks_override=48,
            trace_path=trace,
        )
    finally:
        if previous is None:
            del os.environ[ENABLE_MULTIPROCESSING_ENV]
        else:
            os.environ[ENABLE_MULTIPROCESSING_ENV] = previous
    runner = llm.llm_engine.engine_core.engine_core.model_executor.driver_worker.model_runner
    if force_piecewise:
        dispatcher = runner.cudagraph_dispatcher
        dispatcher.mode = M.FULL_AND_PIECEWISE
        dispatcher.piecewise_capture_sizes = [8, 16, 32]
        dispatcher.captured.update(dispatcher.piecewise_keys())
    prompts = [
        {"prompt_token_ids": [(5 * i + j) % 200 + 3 for j in range(n)]}
        for i, n in enumerate((7, 30, 13))
    ]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=3)
    outputs = llm.generate(prompts, params)
    kv = [t.clone() for t in runner.kv_caches]
    llm.shutdown()
    return outputs, kv


def test_piecewise_padding_changes_no_output_and_writes_no_kv(tmp_path):
    model = tmp_path / "llama"
    save_tiny_checkpoint("llama", model, seed=0)
    plain, plain_kv = _run(str(model), str(tmp_path / "plain.jsonl"), force_piecewise=False)
    padded, padded_kv = _run(str(model), str(tmp_path / "pw.jsonl"), force_piecewise=True)
    batches = [e for e in load_trace(str(tmp_path / "pw.jsonl")) if isinstance(e, RunnerBatch)]
    piecewise = [b for b in batches if b.cudagraph_mode == "PIECEWISE"]
    # Mixed steps of 24 tokens pad to 32, decodes of 3 to 8.
    assert any(b.num_tokens_padded > b.num_tokens for b in piecewise)
    assert {b.num_tokens_padded for b in piecewise} <= {8, 16, 32}
    for a, b in zip(plain, padded, strict=True):
        assert list(a.outputs[0].token_ids) == list(b.outputs[0].token_ids)
        for la, lb in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
            for token, entry in la.items():
                # fp32; a GEMM over more rows may block the sums differently.
                assert abs(entry.logprob - lb[token].logprob) < 1e-5
    # Padding slots are -1: the caches hold the same K/V, the null block included.
    for a, b in zip(plain_kv, padded_kv, strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=0)
