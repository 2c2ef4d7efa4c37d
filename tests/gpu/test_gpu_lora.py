"""LoRA on CUDA: the Triton shrink/expand kernels, and an engine serving a mixed batch.

Marked ``gpu``: skipped where torch sees no CUDA device (CI checks the same
kernels interpreted, at small shapes: tests/lora/test_lora_triton.py).

* ``lora_shrink`` / ``lora_expand`` in bfloat16, float16 and float32 at model
  sizes (1, 64 and 512 tokens of width 1024, rank 16, 4 slots of which one is
  idle, q/k/v slices 1024/256/256) equal the torch ops computed in float32
  from the same values: float32 within 1e-5 (``tl.dot`` in full fp32, no
  TF32), 16-bit within the one rounding of the stored result.
* ``get_punica_wrapper`` picks ``PunicaWrapperGPU`` on CUDA; its
  ``add_lora_linear`` in bfloat16 is within bfloat16 rounding of a float32
  reference.
* Preparing a step's metadata and running both kernels waits on the device
  nowhere (``torch.cuda.set_sync_debug_mode("error")``), from a device or a
  host mapping, once the per-layer weight tables exist.
* ``LLM(enable_lora=True)`` on CUDA, float32: one batch mixing two adapters
  (rank 8, and rank 4 with rsLoRA) and the base model gives each request the
  greedy tokens it gets alone, and HF ``peft``'s; the Triton kernels ran.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine.lora.ops.torch_ops import bgmv_expand_slice, bgmv_shrink
from engine.lora.ops.triton_ops import LoRAKernelMeta, lora_expand, lora_shrink

pytestmark = pytest.mark.gpu

SLOTS, IN, RANK, WIDTHS = 4, 1024, 16, (1024, 256, 256)
# |got - want| <= rtol * |want| + atol: half an ulp of the stored dtype is
# 2^-9 (bf16), 2^-12 (fp16) relative; the float32 accumulations differ only
# in order (~1e-6 at these sizes).
TOLERANCE = {
    torch.bfloat16: {"rtol": 2**-8, "atol": 1e-4},
    torch.float16: {"rtol": 2**-10, "atol": 1e-4},
    torch.float32: {"rtol": 1e-5, "atol": 1e-5},
}


def _mapping(num_tokens: int, seed: int) -> torch.Tensor:
    """Unsorted slots 0, 1, 3 and -1; slot 2 idle."""
    gen = torch.Generator().manual_seed(seed)
    choices = torch.tensor([-1, 0, 1, 3])
    return choices[torch.randint(0, 4, (num_tokens,), generator=gen)]


def _layer(dtype: torch.dtype, seed: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    A = [torch.randn(SLOTS, RANK, IN, generator=gen) / IN**0.5 for _ in WIDTHS]
    B = [torch.randn(SLOTS, n, RANK, generator=gen) / RANK**0.5 for n in WIDTHS]
    return [a.to("cuda", dtype) for a in A], [b.to("cuda", dtype) for b in B]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("num_tokens", [1, 64, 512])
def test_kernels_equal_torch_ops(dtype: torch.dtype, num_tokens: int) -> None:
    mapping = _mapping(num_tokens, seed=num_tokens)
    A, B = _layer(dtype, seed=num_tokens + 1)
    gen = torch.Generator().manual_seed(num_tokens + 2)
    x = torch.randn(num_tokens, IN, generator=gen).to("cuda", dtype)
    y0 = torch.randn(num_tokens, sum(WIDTHS), generator=gen).to("cuda", dtype)
    meta = LoRAKernelMeta.make(SLOTS, 1024, "cuda")
    meta.prepare_tensors(mapping)
    args = meta.meta_args(num_tokens)
    m = mapping.cuda()

    # Shrink into float32, as PunicaWrapperGPU does.
    got_s = torch.full((len(WIDTHS), num_tokens, RANK), float("nan"), device="cuda")
    lora_shrink(x, A, got_s, *args, 0.5)
    want_s = torch.empty_like(got_s)
    for s, a in enumerate(A):
        bgmv_shrink(x.float(), a.float(), want_s[s], m, 0.5)
    torch.testing.assert_close(got_s, want_s, rtol=1e-4, atol=1e-4)

    got_y = y0.clone()
    lora_expand(want_s, B, got_y, *args)
    want_y = y0.float()
    col = 0
    for s, (b, n) in enumerate(zip(B, WIDTHS, strict=True)):
        # The kernel rounds its float32 input to the weights' dtype before the dot.
        bgmv_expand_slice(want_s[s].to(dtype).float(), b.float(), want_y, m, col, n)
        col += n
    torch.testing.assert_close(got_y.float(), want_y, **TOLERANCE[dtype])
    base = (m < 0).nonzero().flatten()
    assert torch.equal(got_y[base], y0[base])  # base-model rows untouched


def test_selector_and_wrapper_in_bf16() -> None:
    from engine.lora.punica_wrapper import get_punica_wrapper
    from engine.lora.punica_wrapper.punica_gpu import PunicaWrapperGPU

    wrapper = get_punica_wrapper(1024, "cuda", max_loras=SLOTS)
    assert type(wrapper) is PunicaWrapperGPU
    mapping = _mapping(300, seed=7)
    wrapper.update_metadata(mapping)
    A, B = _layer(torch.bfloat16, seed=8)
    gen = torch.Generator().manual_seed(9)
    x = torch.randn(300, IN, generator=gen).to("cuda", torch.bfloat16)
    y = torch.randn(300, sum(WIDTHS), generator=gen).to("cuda", torch.bfloat16)
    want = y.float()
    m = mapping.cuda()
    col = 0
    for a, b, n in zip(A, B, WIDTHS, strict=True):
        s = torch.empty(300, RANK, device="cuda")
        bgmv_shrink(x.float(), a.float(), s, m, 0.25)
        bgmv_expand_slice(s, b.float(), want, m, col, n)
        col += n
    got = y.clone()
    wrapper.add_lora_linear(got, x, tuple(A), tuple(B), 0.25, WIDTHS)
    # Rounding: the shrunk vector to bf16 for the dot, then the sum once.
    torch.testing.assert_close(got.float(), want, rtol=2**-7, atol=1e-2)


@pytest.mark.parametrize("mapping_on", ["cuda", "cpu"])
def test_no_host_sync(mapping_on: str) -> None:
    A, B = _layer(torch.bfloat16, seed=10)
    x = torch.randn(64, IN, device="cuda", dtype=torch.bfloat16)
    y = torch.zeros(64, sum(WIDTHS), device="cuda", dtype=torch.bfloat16)
    s = torch.empty(len(WIDTHS), 64, RANK, device="cuda")
    meta = LoRAKernelMeta.make(SLOTS, 1024, "cuda")

    def step(mapping: torch.Tensor) -> None:
        meta.prepare_tensors(mapping)
        lora_shrink(x, A, s, *meta.meta_args(64), 1.0)
        lora_expand(s, B, y, *meta.meta_args(64))

    step(_mapping(64, seed=11).to(mapping_on))  # compiles, builds the weight tables
    torch.cuda.synchronize()
    mapping = _mapping(64, seed=12).to(mapping_on)
    torch.cuda.set_sync_debug_mode("error")
    try:
        step(mapping)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()


def test_engine_mixed_batch_equals_each_alone_and_peft(tmp_path: Path, monkeypatch) -> None:
    from engine import LLM, SamplingParams
    from engine.lora.punica_wrapper import punica_gpu
    from engine.lora.request import LoRARequest
    from engine.v1.engine.utils import ENABLE_MULTIPROCESSING_ENV
    from tests.helpers.hf_checkpoints import TINY_CONFIG, hf_greedy, save_tiny_checkpoint
    from tests.helpers.lora_adapters import save_peft_adapter

    monkeypatch.setenv(ENABLE_MULTIPROCESSING_ENV, "0")  # the launch count is in this process
    launches: list[int] = []
    shrink = punica_gpu.lora_shrink

    def counted(*args, **kwargs):
        launches.append(1)
        return shrink(*args, **kwargs)

    monkeypatch.setattr(punica_gpu, "lora_shrink", counted)

    vocab = TINY_CONFIG["vocab_size"]
    prompts = [[(7 * j + 3 * i) % vocab for j in range(n)] for i, n in enumerate((12, 7, 20))]
    base = save_tiny_checkpoint("llama", tmp_path / "base", seed=1)
    peft = {
        "a": save_peft_adapter(tmp_path / "base", tmp_path / "a", seed=1, r=8),
        "b": save_peft_adapter(tmp_path / "base", tmp_path / "b", seed=2, r=4, use_rslora=True),
    }
    requests = {
        "a": LoRARequest("a", 1, str(tmp_path / "a")),
        "b": LoRARequest("b", 2, str(tmp_path / "b")),
        "base": None,
    }
    names = ["a", "b", "base"]
    want = [hf_greedy(peft.get(n, base), p, 6) for n, p in zip(names, prompts, strict=True)]

    llm = LLM(
        str(tmp_path / "base"),
        enable_lora=True,
        max_loras=2,
        max_lora_rank=8,
        device="cuda",
        dtype="float32",
        optimization_level=0,
        skip_tokenizer_init=True,
        max_model_len=64,
        num_gpu_blocks_override=32,
    )
    try:
        params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=2)
        batch = [{"prompt_token_ids": p} for p in prompts]
        mixed = llm.generate(batch, params, lora_request=[requests[n] for n in names])
        alone = [
            llm.generate([b], params, lora_request=requests[n])[0]
            for b, n in zip(batch, names, strict=True)
        ]
    finally:
        llm.shutdown()
    assert launches, "the Triton LoRA kernels did not run"
    for got, single, ref in zip(mixed, alone, want, strict=True):
        assert list(got.outputs[0].token_ids) == list(single.outputs[0].token_ids)
        assert list(got.outputs[0].token_ids) == ref.token_ids
        for pos, logprobs in enumerate(got.outputs[0].logprobs):
            for token, lp in logprobs.items():
                assert abs(lp.logprob - ref.logprobs[pos, token].item()) <= 1e-3, (pos, token)
