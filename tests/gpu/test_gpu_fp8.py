"""FP8 on the H200: ``torch._scaled_mm`` against the dequantized reference,
per tensor and per token (cuBLAS's row-wise mode), and an fp8 engine on CUDA
against the same engine on the CPU (float32 activations on both, the CPU made
to use per-token scales as CUDA does, so only the fp8 GEMM implementation
differs), compared token by token on the CPU's greedy continuations (teacher
forced: each position is a request of its own). Engines run in this process."""

from __future__ import annotations

import pytest
import torch

from engine.model_executor.layers.quantization import fp8
from engine.model_executor.layers.quantization.fp8 import apply_fp8_linear
from engine.model_executor.layers.quantization.input_quant_fp8 import QuantFP8, scaled_fp8_quant
from engine.model_executor.layers.quantization.utils.quant_utils import GroupShape
from tests.helpers.gpu import decode_graphs
from tests.helpers.hf_checkpoints import TINY_CONFIG, save_tiny_checkpoint

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("in_process_engine")]


@pytest.mark.parametrize("group_shape", [GroupShape.PER_TENSOR, GroupShape.PER_TOKEN])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_scaled_mm_equals_the_reference(dtype, group_shape) -> None:
    x = torch.randn(37, 256, device="cuda", dtype=dtype)
    x *= torch.linspace(0.1, 10, 37, device="cuda", dtype=dtype).unsqueeze(1)
    w = torch.randn(512, 256, device="cuda", dtype=dtype)
    qw, sw = scaled_fp8_quant(w)
    out = apply_fp8_linear(x, qw.t(), sw, None, None, QuantFP8(False, group_shape))
    qx, sx = scaled_fp8_quant(x, use_per_token_if_dynamic=group_shape == GroupShape.PER_TOKEN)
    ref = ((qx.float() * sx) @ (qw.float() * sw).t()).to(dtype)
    # bf16: the output's rounding. float32: Hopper's fp8 tensor cores keep
    # about 14 bits of the running sum (DeepSeek-V3 report, 3.3.2), so over
    # K=256 an output can be off by ~1e-3 of the largest.
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-3
    # Per token: compared row by row, each against its own largest entry.
    scale = ref.abs().amax(dim=-1, keepdim=True) if group_shape.is_per_token() else ref.abs().max()
    assert bool(((out - ref).abs() <= tol * ref.abs() + tol * scale).all())


# Teacher-forced comparison of the fp8 engine on CUDA with the CPU's. A dynamic
# fp8 activation keeps 3 mantissa bits, so a difference in the last bits of a
# GEMM (Hopper's fp8 tensor cores keep ~14 bits of the running sum) can move an
# activation across a rounding step, 1/16 of its size, and that grows from layer
# to layer: free-running greedy decoding may part at the first tokens. The
# bounds sit above what such noise does on the CPU and below per-tensor scales
# on one side (docs/quantization.md, "On the H200", has the measurements).
FORCED_MEAN = 0.2
FORCED_MAX = 1.0


def test_fp8_engine_on_cuda_matches_the_cpu(tmp_path, monkeypatch) -> None:
    from engine import LLM, SamplingParams

    save_tiny_checkpoint("llama", tmp_path / "hf", seed=5)
    vocab = TINY_CONFIG["vocab_size"]
    prompts = [[(11 * i + 7 * j) % vocab for j in range(n)] for i, n in enumerate((5, 21, 40))]
    # On the CPU vLLM (and Glassbox) quantize activations per tensor; here the
    # CPU run takes per-token scales, which the H200 picks by itself.
    cuda_choice = fp8.use_per_token_activations
    monkeypatch.setattr(
        fp8, "use_per_token_activations", lambda d, t: d.type == "cpu" or cuda_choice(d, t)
    )
    one_token = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True, logprobs=20)
    forced: list[tuple[list[int], int]] = []  # (context, the CPU's next token)
    scores, shapes = {}, {}
    for device in ("cpu", "cuda"):
        llm = LLM(
            str(tmp_path / "hf"),
            skip_tokenizer_init=True,
            device=device,
            dtype="float32",
            quantization="fp8",
            max_model_len=128,
            num_gpu_blocks_override=64,
            **decode_graphs(),
        )
        runner = llm.llm_engine.engine_core.engine_core.model_executor.driver_worker.model_runner
        shapes[device] = runner.model.model.layers[0].mlp.down_proj.quant_method.quant.group_shape
        if not forced:  # the CPU's greedy continuations, 8 positions per prompt
            greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
            outs = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy, use_tqdm=False)
            for p, o in zip(prompts, outs):
                seq = p + list(o.outputs[0].token_ids)
                forced += [(seq[: len(p) + k], seq[len(p) + k]) for k in range(8)]
        outs = llm.generate(
            [{"prompt_token_ids": ctx} for ctx, _ in forced], one_token, use_tqdm=False
        )
        scores[device] = [o.outputs[0].logprobs[0].get(t) for (_, t), o in zip(forced, outs)]
        llm.shutdown()
    assert shapes == {"cpu": GroupShape.PER_TOKEN, "cuda": GroupShape.PER_TOKEN}
    missing = [i for i, lp in enumerate(scores["cuda"]) if lp is None]
    assert not missing, f"positions {missing}: the CPU's token is not in CUDA's top 20"
    diffs = [abs(a.logprob - b.logprob) for a, b in zip(scores["cpu"], scores["cuda"])]
    mean = sum(diffs) / len(diffs)
    assert mean < FORCED_MEAN and max(diffs) < FORCED_MAX, (
        f"forced-token logprobs differ by {mean:.3f} on average, {max(diffs):.3f} at most"
    )
