"""FP8 W8A8 with per-tensor weight scales, on the CPU (torch's own ``_scaled_mm``).

* ``scaled_fp8_quant`` maps ``max|x|`` onto 448 (e4m3's largest number) and
  rounds every entry to e4m3: within half a step (1/16 relative) of ``x``;
  per token, each row's own max.
* ``apply_fp8_linear`` equals the reference: both operands dequantized, then
  an fp32 matmul; with per-token scales too (``_scaled_mm``'s row-wise mode).
* Dynamic activation scales are per token where vLLM uses them (CUDA, sm89+)
  and per tensor elsewhere; per tensor, a token's rounding depends on the
  rest of its batch, per token it does not.
* Online quantization (``quantization="fp8"`` on a float checkpoint) against
  transformers with the same arithmetic simulated in hooks (weights rounded
  through fp8 with one scale per fused group, each linear input rounded
  through fp8 with a scale per call, or per row where the engine is made to
  pick per-token scales): the same greedy tokens, logprobs within 1e-3 (fp32;
  the matmuls differ in summation order, which can move a value across an fp8
  rounding boundary).
* An fp8 checkpoint (``quantization_config.quant_method: fp8``) is detected
  from config.json and equals online quantization when its shards share a
  scale; shards with their own scales are requantized to the largest.
* Bad input fails with one line.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine import LLM, SamplingParams
from engine.model_executor.layers.quantization import fp8
from engine.model_executor.layers.quantization.fp8 import (
    Fp8Config,
    apply_fp8_linear,
    column_scales,
    use_per_token_activations,
)
from engine.model_executor.layers.quantization.input_quant_fp8 import (
    FP8_DTYPE,
    FP8_MAX,
    QuantFP8,
    scaled_fp8_quant,
)
from engine.model_executor.layers.quantization.utils.quant_utils import GroupShape
from tests.helpers.hf_checkpoints import TINY_CONFIG, hf_greedy, save_tiny_checkpoint

pytestmark = pytest.mark.usefixtures("in_process_engine")

PROMPT = [(7 * j + 5) % TINY_CONFIG["vocab_size"] for j in range(21)]
ENGINE = {"skip_tokenizer_init": True, "max_model_len": 128, "num_gpu_blocks_override": 32}
GROUPS = (("q_proj", "k_proj", "v_proj"), ("o_proj",), ("gate_proj", "up_proj"), ("down_proj",))


def _round_trip(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return (x / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE).float() * scale


def test_scaled_fp8_quant_maps_the_largest_entry_to_448() -> None:
    x = torch.randn(64, 96) * 3
    q, scale = scaled_fp8_quant(x)
    assert q.dtype == FP8_DTYPE and scale.shape == ()
    assert q.float().abs().max().item() == FP8_MAX
    err = (q.float() * scale - x).abs()
    assert bool((err <= x.abs() / 16 + scale * 2**-9).all())  # half a step, or a subnormal's
    zero_q, zero_scale = scaled_fp8_quant(torch.zeros(4, 4))
    assert zero_scale > 0 and not zero_q.float().any()


def test_apply_fp8_linear_equals_the_dequantized_reference() -> None:
    x, w, bias = torch.randn(5, 64), torch.randn(48, 64), torch.randn(48)
    qw, sw = scaled_fp8_quant(w)
    out = apply_fp8_linear(x, qw.t(), sw, None, bias, QuantFP8(static=False))
    qx, sx = scaled_fp8_quant(x)
    ref = (qx.float() * sx) @ (qw.float() * sw).t() + bias
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


def test_per_token_scales_map_each_rows_largest_entry_to_448() -> None:
    x = torch.randn(6, 96) * torch.tensor([0.01, 1, 3, 100, 1e-3, 7]).unsqueeze(1)
    q, scale = scaled_fp8_quant(x, use_per_token_if_dynamic=True)
    assert scale.shape == (6, 1)
    assert torch.equal(q.float().abs().amax(dim=1), torch.full((6,), FP8_MAX))
    err = (q.float() * scale - x).abs()
    assert bool((err <= x.abs() / 16 + scale * 2**-9).all())


@pytest.mark.parametrize("use_scaled_mm", [True, False])
@pytest.mark.parametrize("given_columns", [True, False])
def test_apply_fp8_linear_per_token_equals_the_dequantized_reference(
    use_scaled_mm: bool, given_columns: bool
) -> None:
    x, w = torch.randn(5, 64) * torch.arange(1, 6).unsqueeze(1), torch.randn(48, 64)
    qw, sw = scaled_fp8_quant(w)
    columns = column_scales(sw, 48) if given_columns else None
    quant = QuantFP8(static=False, group_shape=GroupShape.PER_TOKEN)
    out = apply_fp8_linear(x, qw.t(), sw, None, None, quant, use_scaled_mm, columns)
    qx, sx = scaled_fp8_quant(x, use_per_token_if_dynamic=True)
    ref = (qx.float() * sx) @ (qw.float() * sw).t()
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


def test_per_tensor_rounding_depends_on_the_batch_and_per_token_does_not() -> None:
    """The reason vLLM quantizes activations per token where it can: one
    large token in the batch coarsens every other token's per-tensor scale."""
    alone = torch.randn(1, 64)
    batch = torch.cat([alone, torch.randn(1, 64) * 50])
    per_tensor, per_token = QuantFP8(False), QuantFP8(False, GroupShape.PER_TOKEN)
    assert not torch.equal(per_tensor(alone)[0].float(), per_tensor(batch)[0][:1].float())
    (q1, s1), (q2, s2) = per_token(alone), per_token(batch)
    assert torch.equal(q1.float(), q2[:1].float()) and torch.equal(s1, s2[:1])


def test_per_token_scales_on_the_devices_vllm_uses_them(monkeypatch) -> None:
    """vLLM: per token where its CUTLASS fp8 kernel runs (CUDA sm89+); cuBLAS's
    row-wise mode gives float32 outputs from sm90 on."""
    cuda, cpu = torch.device("cuda", 0), torch.device("cpu")
    assert not use_per_token_activations(cpu, torch.bfloat16)
    for capability, dtype, want in [
        ((9, 0), torch.float32, True),
        ((9, 0), torch.bfloat16, True),
        ((8, 9), torch.bfloat16, True),
        ((8, 9), torch.float32, False),
        ((8, 0), torch.bfloat16, False),
    ]:
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d, c=capability: c)
        assert use_per_token_activations(cuda, dtype) is want, (capability, dtype)


@pytest.mark.parametrize(
    "bad,message",
    [
        ({"static": True, "group_shape": GroupShape.PER_TOKEN}, "PER_TENSOR only"),
        ({"static": False, "group_shape": GroupShape(1, 128)}, "PER_TENSOR or PER_TOKEN"),
    ],
)
def test_bad_quantizer_shapes_fail_clearly(bad: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        QuantFP8(**bad)


def _hf_with_fp8_arithmetic(path: Path, per_token: bool = False) -> torch.nn.Module:
    """transformers' model doing what the engine's fp8 layers do."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    for layer in model.model.layers:
        modules = {**dict(layer.self_attn.named_children()), **dict(layer.mlp.named_children())}
        for group in GROUPS:
            linears = [modules[name] for name in group]
            scale = max(m.weight.abs().max() for m in linears) / FP8_MAX
            for m in linears:
                m.weight.data = _round_trip(m.weight.data, scale)
                m.register_forward_pre_hook(
                    lambda _, args: (
                        _round_trip(
                            args[0],
                            (
                                args[0].abs().amax(-1, keepdim=True)
                                if per_token
                                else args[0].abs().max()
                            )
                            / FP8_MAX,
                        ),
                    )
                )
    return model


@pytest.mark.parametrize("per_token", [False, True])
def test_online_fp8_matches_transformers_with_the_same_rounding(
    tmp_path: Path, per_token: bool, monkeypatch
) -> None:
    hf = tmp_path / "hf"
    save_tiny_checkpoint("llama", hf, seed=5)
    want = hf_greedy(_hf_with_fp8_arithmetic(hf, per_token), PROMPT, 8)
    if per_token:  # what CUDA sm89+ picks, here on the CPU (row-wise _scaled_mm)
        monkeypatch.setattr(fp8, "use_per_token_activations", lambda device, dtype: True)
    llm = LLM(str(hf), quantization="fp8", **ENGINE)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=3)
    (out,) = llm.generate([{"prompt_token_ids": PROMPT}], params, use_tqdm=False)
    runner = llm.llm_engine.engine_core.engine_core.model_executor.driver_worker.model_runner
    qkv = runner.model.model.layers[0].self_attn.qkv_proj
    llm.shutdown()
    assert qkv.weight.dtype == FP8_DTYPE and type(qkv.quant_method).__name__ == (
        "Fp8OnlineLinearMethod"
    )
    shape = GroupShape.PER_TOKEN if per_token else GroupShape.PER_TENSOR
    assert qkv.quant_method.quant.group_shape == shape
    assert list(out.outputs[0].token_ids) == want.token_ids
    for pos, logprobs in enumerate(out.outputs[0].logprobs):
        for token, lp in logprobs.items():
            assert abs(lp.logprob - want.logprobs[pos, token].item()) <= 1e-3, (pos, token)


def _save_fp8_checkpoint(hf: Path, out: Path, shared_scales: bool, static: bool = False) -> Path:
    """``hf`` with every linear weight in e4m3 and a per-tensor ``weight_scale``
    (``shared_scales``: one scale per fused group, as online quantization has)."""
    out.mkdir()
    tensors = load_file(str(hf / "model.safetensors"))
    saved = {}
    for name, w in tensors.items():
        module, _, kind = name.rpartition(".")
        proj = module.rpartition(".")[2]
        group = next((g for g in GROUPS if proj in g), None)
        if group is None or kind != "weight":
            saved[name] = w
            continue
        prefix = module.rpartition(".")[0]
        members = [tensors[f"{prefix}.{p}.weight"] for p in group] if shared_scales else [w]
        scale = max(m.abs().max() for m in members) / FP8_MAX
        saved[name] = (w / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
        saved[f"{module}.weight_scale"] = scale.reshape(()).float()
        if static:
            saved[f"{module}.input_scale"] = torch.tensor(0.05)
    save_file(saved, str(out / "model.safetensors"))
    config = json.loads((hf / "config.json").read_text())
    config["quantization_config"] = {
        "quant_method": "fp8",
        "activation_scheme": "static" if static else "dynamic",
    }
    (out / "config.json").write_text(json.dumps(config))
    return out


def _greedy(model: str, **kwargs) -> list:
    llm = LLM(model, **ENGINE, **kwargs)
    try:
        params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=3)
        return llm.generate([{"prompt_token_ids": PROMPT}], params, use_tqdm=False)
    finally:
        llm.shutdown()


def test_fp8_checkpoint_equals_online_quantization(tmp_path: Path) -> None:
    hf = tmp_path / "hf"
    save_tiny_checkpoint("llama", hf, seed=5)
    (online,) = _greedy(str(hf), quantization="fp8")
    (stored,) = _greedy(str(_save_fp8_checkpoint(hf, tmp_path / "fp8", shared_scales=True)))
    assert stored.outputs[0].token_ids == online.outputs[0].token_ids
    for a, b in zip(stored.outputs[0].logprobs, online.outputs[0].logprobs, strict=True):
        assert all(abs(a[t].logprob - b[t].logprob) <= 1e-5 for t in a)
    # Shards with scales of their own load too (requantized to the largest).
    (own,) = _greedy(str(_save_fp8_checkpoint(hf, tmp_path / "own", shared_scales=False)))
    assert len(own.outputs[0].token_ids) == 8


def test_shards_are_requantized_to_the_largest_scale() -> None:
    from engine.model_executor.layers.linear import MergedColumnParallelLinear

    config = Fp8Config(is_checkpoint_fp8_serialized=True)
    layer = MergedColumnParallelLinear(64, [32, 32], bias=False, quant_config=config)
    gate, up = torch.randn(32, 64), torch.randn(32, 64) * 4
    for shard, w in enumerate((gate, up)):
        q, s = scaled_fp8_quant(w)
        layer.weight_loader(layer.weight, q, shard)
        layer.weight_scale.weight_loader(layer.weight_scale, s, shard)
    layer.quant_method.process_weights_after_loading(layer)
    assert layer.weight_scale.shape == () and layer.weight.shape == (64, 64)
    dequantized = (layer.weight.float() * layer.weight_scale).t()
    err = (dequantized - torch.cat([gate, up])).abs()
    assert bool((err <= 2 * (torch.cat([gate, up]).abs() / 16 + layer.weight_scale)).all())


def test_static_activation_scale_is_the_checkpoints(tmp_path: Path) -> None:
    hf = tmp_path / "hf"
    save_tiny_checkpoint("llama", hf, seed=5)
    llm = LLM(str(_save_fp8_checkpoint(hf, tmp_path / "s", True, static=True)), **ENGINE)
    runner = llm.llm_engine.engine_core.engine_core.model_executor.driver_worker.model_runner
    o_proj = runner.model.model.layers[0].self_attn.o_proj
    (out,) = llm.generate([{"prompt_token_ids": PROMPT}], SamplingParams(max_tokens=2))
    llm.shutdown()
    assert o_proj.input_scale.item() == pytest.approx(0.05) and o_proj.quant_method.quant.static
    assert len(out.outputs[0].token_ids) == 2


@pytest.mark.parametrize(
    "quant_config,kwargs,message",
    [
        ({"quant_method": "awq"}, {}, "is quantized with 'awq'"),
        ({"quant_method": "fp8", "weight_block_size": [128, 128]}, {}, "block-wise FP8"),
        ({"quant_method": "fp8", "activation_scheme": "per-row"}, {}, "activation_scheme must"),
    ],
)
def test_bad_checkpoints_name_the_problem(
    quant_config: dict, kwargs: dict, message: str, tmp_path: Path
) -> None:
    from engine.engine.arg_utils import EngineArgs

    hf = tmp_path / "hf"
    save_tiny_checkpoint("llama", hf, seed=0)
    config = json.loads((hf / "config.json").read_text())
    (hf / "config.json").write_text(json.dumps({**config, "quantization_config": quant_config}))
    with pytest.raises(ValueError, match=message):
        EngineArgs(model=str(hf), skip_tokenizer_init=True, **kwargs).create_engine_config()


def test_a_gguf_file_with_an_fp8_config_is_refused(tmp_path: Path) -> None:
    import gguf

    from engine.engine.arg_utils import EngineArgs
    from tests.helpers.gguf_checkpoints import save_tiny_gguf

    hf = tmp_path / "hf"
    save_tiny_checkpoint("llama", hf, seed=0)
    path = save_tiny_gguf(hf, tmp_path / "m.gguf", lambda n: gguf.GGMLQuantizationType.Q8_0)
    config = json.loads((hf / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8"}
    (hf / "config.json").write_text(json.dumps(config))
    args = EngineArgs(model=str(path), hf_config_path=str(hf), skip_tokenizer_init=True)
    with pytest.raises(ValueError, match="quantization='gguf' does not match the checkpoint"):
        args.create_engine_config()


@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])
def test_qwen_layers_get_the_fp8_method(arch: str, tmp_path: Path) -> None:
    save_tiny_checkpoint(arch, tmp_path / arch, seed=0)
    llm = LLM(str(tmp_path / arch), quantization="fp8", **ENGINE)
    runner = llm.llm_engine.engine_core.engine_core.model_executor.driver_worker.model_runner
    (out,) = llm.generate([{"prompt_token_ids": PROMPT}], SamplingParams(max_tokens=3))
    llm.shutdown()
    layer = runner.model.model.layers[0]
    for module in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.down_proj):
        assert type(module.quant_method).__name__ == "Fp8OnlineLinearMethod"
        assert module.weight.dtype == FP8_DTYPE
    assert len(out.outputs[0].token_ids) == 3
