"""Structured outputs on CUDA: xgrammar's GPU kernel masks exactly what its
CPU path masks, without a host sync, and the engine's constrained requests
hold their grammar on the device with every attention backend and CUDA
graphs, serial and async.

Marked ``gpu``: skipped where torch sees no CUDA device (CI), run by
``make test-gpu`` / ``scripts/gpu_run.sh so``. The model is the CPU tests'
tiny word-level Llama (tests/v1/structured_output/test_structured_outputs.py),
widened to head size 64 (FlashInfer's smallest), in bf16.
"""

from __future__ import annotations

import math
import re

import numpy as np
import pytest
import torch

from engine import LLM, SamplingParams
from engine.sampling_params import StructuredOutputsParams
from engine.v1.core.sched.output import GrammarOutput
from engine.v1.structured_output.utils import apply_grammar_bitmask
from tests.helpers.gpu import decode_graphs
from tests.helpers.hf_checkpoints import save_tiny_checkpoint
from tests.helpers.tiny_model import make_tiny_model_dir
from tests.v1.structured_output.test_structured_outputs import (
    EOS,
    MODEL_VOCAB,
    PROMPT,
    REGEX,
    W,
    words,
)

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def word_model(tmp_path_factory):
    path = tmp_path_factory.mktemp("so_gpu") / "word_llama"
    make_tiny_model_dir(path)
    save_tiny_checkpoint(
        "llama", path, vocab_size=MODEL_VOCAB, hidden_size=256, intermediate_size=512
    )
    return path


def _grammar_output(num_rows: int, vocab: int, seed: int) -> GrammarOutput:
    rng = np.random.default_rng(seed)
    bits = rng.integers(-(2**31), 2**31, size=(num_rows, (vocab + 31) // 32), dtype=np.int64)
    return GrammarOutput([f"r{i}" for i in range(num_rows)], bits.astype(np.int32))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpu_mask_equals_cpu_and_does_not_sync(dtype) -> None:
    """Rows r1 and r3 of 5 constrained (one with 2 draft rows): the CUDA
    kernel's result equals the CPU path's, bit for bit, and copying the mask
    in and applying it makes no host sync."""
    vocab = 151936  # Qwen3's width
    req_ids = ["r0", "r1", "r2", "r3", "r4"]
    num_drafts = {"r3": 2}
    gout = _grammar_output(4, vocab, seed=0)  # r1: 1 row, r3: 3 rows
    gout.structured_output_request_ids = ["r1", "r3"]
    logits = torch.randn(7, vocab, generator=torch.Generator().manual_seed(1)).to(dtype)
    expected = logits.clone()
    apply_grammar_bitmask(gout, req_ids, num_drafts, expected)
    on_gpu = logits.cuda()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        apply_grammar_bitmask(gout, req_ids, num_drafts, on_gpu)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert torch.equal(on_gpu.cpu(), expected)
    assert torch.isinf(expected[1]).any() and torch.isfinite(expected[0]).all()


@pytest.mark.parametrize("backend", ["TRITON_ATTN", "FLASHINFER"])
@pytest.mark.parametrize("async_scheduling", [False, True])
def test_gpu_engine_mask_is_exact(word_model, backend, async_scheduling, monkeypatch) -> None:
    monkeypatch.setenv("GLASSBOX_ATTENTION_BACKEND", backend)
    llm = LLM(
        str(word_model),
        device="cuda",
        dtype="bfloat16",
        max_model_len=256,
        max_logprobs=-1,  # logprobs=-1 below: every row's finite entries
        async_scheduling=async_scheduling,
        **decode_graphs(),
    )
    try:
        by_hand = [{W["w1"]}, {W["w2"], W["w3"]}, {W["w5"]}, {EOS}]
        params = [
            SamplingParams(
                temperature=5.0,
                seed=s,
                max_tokens=10,
                logprobs=-1,
                structured_outputs=StructuredOutputsParams(regex=REGEX),
            )
            for s in range(8)
        ]
        free = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
        outs = llm.generate([PROMPT] * 9, [*params, free], use_tqdm=False)
        for out in outs[:8]:
            c = out.outputs[0]
            assert c.finish_reason == "stop"
            assert re.fullmatch(REGEX, words(c.token_ids))
            for step, logprobs in enumerate(c.logprobs):
                allowed = {t for t, lp in logprobs.items() if lp.logprob > -math.inf}
                assert allowed == by_hand[step]
        assert len(outs[8].outputs[0].token_ids) == 12
    finally:
        llm.llm_engine.shutdown()


def test_gpu_full_trace_records_the_mask_and_the_ranks(word_model, tmp_path) -> None:
    """Trace level full on CUDA: so.masked per constrained step, and the
    chosen token's rank before the mask beside its rank after it."""
    from engine.tracing import GrammarMasked, SamplerSampled, load_trace

    path = tmp_path / "so.jsonl"
    llm = LLM(
        str(word_model),
        device="cuda",
        dtype="bfloat16",
        max_model_len=256,
        trace_path=str(path),
        trace_level="full",
        **decode_graphs(),
    )
    try:
        params = SamplingParams(
            temperature=1.0,
            seed=0,
            max_tokens=10,
            structured_outputs=StructuredOutputsParams(regex=REGEX),
        )
        free = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
        outs = llm.generate([PROMPT, PROMPT], [params, free], use_tqdm=False)
        assert re.fullmatch(REGEX, words(outs[0].outputs[0].token_ids))
    finally:
        llm.llm_engine.shutdown()
    events = load_trace(str(path))
    masked = {e.step for e in events if isinstance(e, GrammarMasked)}
    assert len(masked) == 4  # w1, w2|w3, w5, EOS
    samples = [e for e in events if isinstance(e, SamplerSampled) and e.step in masked]
    ranks = [(e.rank, e.rank_before_mask) for e in samples if e.rank_before_mask is not None]
    assert len(ranks) == 4 and all(1 <= after <= before for after, before in ranks)
