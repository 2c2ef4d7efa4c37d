"""GGUF on CUDA: the Triton dequantization kernel, and a GGUF model end to end.

Marked ``gpu``: skipped where torch sees no CUDA device (CI checks the same
kernel interpreted, at small shapes: tests/model_executor/test_gguf_triton.py).

* ``ggml_dequantize`` / ``ggml_dequantize_rows`` on CUDA tensors run the
  Triton kernel, and equal the torch code on the CPU bit for bit (float32),
  or its float32 result cast by torch (bfloat16, float16): Q4_0, Q4_1, Q8_0
  blocks of random bytes at model-sized shapes.
* Tiny Llamas written as GGUF files (Q4_1 with a tied head, Q4_0, and mixed
  formats with a float embedding) generate on CUDA, in float32, the same
  greedy tokens as their dequantized float folders on CUDA, logprobs within
  1e-4; the kernel is what dequantized their weights.
"""

from __future__ import annotations

from pathlib import Path

import gguf
import pytest
import torch

from engine.model_executor.layers.quantization import gguf_kernels
from engine.model_executor.layers.quantization.gguf_kernels import (
    GGML_Q4_0,
    GGML_Q4_1,
    GGML_Q8_0,
    ggml_dequantize,
    ggml_dequantize_rows,
)
from engine.v1.engine.utils import ENABLE_MULTIPROCESSING_ENV
from tests.helpers.gguf_checkpoints import random_blocks, save_dequantized, save_tiny_gguf
from tests.helpers.hf_checkpoints import TINY_CONFIG, save_tiny_checkpoint

pytestmark = pytest.mark.gpu

FORMATS = {"q4_0": GGML_Q4_0, "q4_1": GGML_Q4_1, "q8_0": GGML_Q8_0}
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


@pytest.fixture
def kernel_calls(monkeypatch) -> list[int]:
    """Count the kernel launches (``_dequantize_triton`` calls) of the test."""
    calls: list[int] = []
    launch = gguf_kernels._dequantize_triton

    def counted(*args, **kwargs):
        calls.append(1)
        return launch(*args, **kwargs)

    monkeypatch.setattr(gguf_kernels, "_dequantize_triton", counted)
    return calls


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("qtype", list(FORMATS.values()), ids=list(FORMATS))
@pytest.mark.parametrize("m,n", [(1, 32), (896, 4864), (4096, 4096)])
def test_kernel_equals_the_cpu_torch_code(qtype, dtype, m, n, kernel_calls) -> None:
    W = random_blocks(qtype, m, n, seed=m + n)
    want = ggml_dequantize(W, qtype, m, n).to(dtype)  # torch, CPU, then cast
    got = ggml_dequantize(W.cuda(), qtype, m, n, dtype)
    assert kernel_calls and got.is_cuda and got.dtype == dtype
    assert torch.equal(got.cpu(), want)


@pytest.mark.parametrize("qtype", list(FORMATS.values()), ids=list(FORMATS))
def test_embedding_rows_on_cuda(qtype, kernel_calls) -> None:
    table = random_blocks(qtype, 49152, 576, seed=1)  # SmolLM2's vocabulary
    ids = torch.randint(0, 49152, (3, 70), generator=torch.Generator().manual_seed(2))
    want = ggml_dequantize_rows(table, ids, qtype, 576, torch.bfloat16)
    got = ggml_dequantize_rows(table.cuda(), ids.cuda(), qtype, 576, torch.bfloat16)
    assert kernel_calls and got.shape == (3, 70, 576)
    assert torch.equal(got.cpu(), want)


Q = gguf.GGMLQuantizationType
PROMPTS = [
    {"prompt_token_ids": [(5 * i + 3 * j) % TINY_CONFIG["vocab_size"] for j in range(n)]}
    for i, n in enumerate((3, 17, 40))
]
VARIANTS = {
    "q4_1-tied": (lambda name: Q.Q4_1, True),
    "q4_0": (lambda name: Q.Q4_0, False),
    "mixed": (
        lambda name: Q.Q8_0 if "q_proj" in name else Q.F32 if "embed_tokens" in name else Q.Q4_1,
        False,
    ),
}


def _generate(model: str, device: str = "cuda", **kwargs) -> list:
    from engine import LLM, SamplingParams

    llm = LLM(
        model,
        skip_tokenizer_init=True,
        device=device,
        dtype="float32",
        optimization_level=0,
        max_model_len=128,
        num_gpu_blocks_override=64,
        **kwargs,
    )
    try:
        params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=3)
        return llm.generate(PROMPTS, params, use_tqdm=False)
    finally:
        llm.shutdown()


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_tiny_gguf_on_cuda_equals_its_float_model(
    variant: str, tmp_path: Path, monkeypatch, kernel_calls
) -> None:
    monkeypatch.setenv(ENABLE_MULTIPROCESSING_ENV, "0")  # the kernel count is in this process
    qtype_of, tied = VARIANTS[variant]
    hf = tmp_path / "hf"
    save_tiny_checkpoint("llama", hf, seed=3, tie_word_embeddings=tied)
    path = save_tiny_gguf(hf, tmp_path / "model.gguf", qtype_of)
    floats = save_dequantized(hf, tmp_path / "dequantized", qtype_of)
    want = _generate(str(floats))
    assert not kernel_calls
    got = _generate(str(path), hf_config_path=str(hf))
    assert kernel_calls
    for a, b in zip(got, want, strict=True):
        assert list(a.outputs[0].token_ids) == list(b.outputs[0].token_ids)
        for la, lb in zip(a.outputs[0].logprobs, b.outputs[0].logprobs, strict=True):
            assert la.keys() == lb.keys()
            assert all(abs(la[t].logprob - lb[t].logprob) <= 1e-4 for t in la)
