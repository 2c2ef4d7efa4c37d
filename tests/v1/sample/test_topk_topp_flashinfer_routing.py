"""When ``TopKTopPSampler`` hands the draw to FlashInfer, and when it must not.

CPU-only: FlashInfer's sampler is replaced by a stub that records its calls,
so the routing is checked without flashinfer or a GPU (tests/gpu/test_flashinfer.py
checks the real kernels' distribution on the H200).
"""

from __future__ import annotations

import pytest
import torch

from engine.tracing import Tracer
from engine.tracing.worker_trace import SamplerTrace
from engine.v1.sample import sampler as sampler_module
from engine.v1.sample.ops import topk_topp_sampler as ops


@pytest.fixture
def stub(monkeypatch):
    calls = []

    def fake_flashinfer_sample(logits, k, p):
        calls.append((k, p))
        return torch.zeros(logits.shape[0], dtype=torch.int64)

    monkeypatch.setattr(ops, "flashinfer_sample", fake_flashinfer_sample)
    monkeypatch.setattr(ops, "flashinfer_sampling_available", lambda: True)
    monkeypatch.delenv(ops.USE_FLASHINFER_SAMPLER_ENV, raising=False)
    return calls


def test_cpu_logits_never_use_flashinfer(stub):
    logits = torch.randn(2, 10)
    tokens, _ = ops.TopKTopPSampler()(logits, {}, torch.tensor([3, 3]), None)
    assert stub == [] and tokens.shape == (2,)


def test_cuda_path_routing(stub):
    sampler = ops.TopKTopPSampler()
    logits = torch.randn(2, 10)
    k, p = torch.tensor([3, 5]), torch.tensor([0.9, 0.8])
    # Top-k and/or top-p, no generators: FlashInfer.
    sampler.forward_cuda(logits.clone(), {}, k, p)
    sampler.forward_cuda(logits.clone(), {}, None, p)
    assert len(stub) == 2

    # Seeded rows: the torch path, the same tokens as forward_native.
    def gen():
        return {i: torch.Generator().manual_seed(7 + i) for i in range(2)}

    seeded, _ = sampler.forward_cuda(logits.clone(), gen(), k, p)
    assert torch.equal(seeded, sampler.forward_native(logits.clone(), gen(), k, p)[0])
    # No filter at all: the exponential race needs no FlashInfer.
    sampler.forward_cuda(logits.clone(), {}, None, None)
    assert len(stub) == 2


def test_flashinfer_unavailable_falls_back(stub, monkeypatch):
    monkeypatch.setattr(ops, "flashinfer_sampling_available", lambda: False)
    ops.TopKTopPSampler().forward_cuda(torch.randn(2, 10), {}, torch.tensor([3, 3]), None)
    assert stub == []


def test_switches_off(stub, monkeypatch, tmp_path):
    assert ops.TopKTopPSampler().use_flashinfer
    assert not ops.TopKTopPSampler(keep_filtered_logits=True).use_flashinfer
    monkeypatch.setenv(ops.USE_FLASHINFER_SAMPLER_ENV, "0")
    assert not ops.TopKTopPSampler().use_flashinfer
    monkeypatch.delenv(ops.USE_FLASHINFER_SAMPLER_ENV)
    # A ``full`` trace reads the filtered logits back, so the sampler keeps the torch filter.
    full = Tracer(str(tmp_path / "t.jsonl"), "full")
    assert not sampler_module.Sampler(trace=SamplerTrace(full)).topk_topp_sampler.use_flashinfer
    assert sampler_module.Sampler().topk_topp_sampler.use_flashinfer
