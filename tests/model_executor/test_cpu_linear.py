"""The oneDNN-prepacked CPU linear path against ``F.linear``.

``UnquantizedLinearMethod.process_weights_after_loading`` packs a CPU float32
``W`` once; ``apply`` then multiplies decode-sized inputs
(``CPU_PACKED_GEMM_MIN_ROWS..CPU_PACKED_GEMM_MAX_ROWS`` rows) against the
packed copy and everything else with ``F.linear``. Both must give the same
``x W^T + b`` to float32 rounding, for every linear layer type and input
shape, and layers the packer cannot handle must keep working unpacked.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine.model_executor.layers import linear
from engine.model_executor.layers.linear import (
    CPU_PACKED_GEMM_MAX_ROWS,
    CPU_PACKED_GEMM_MIN_ROWS,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
    dispatch_cpu_unquantized_gemm,
)

needs_onednn = pytest.mark.skipif(
    not linear._onednn_linear_available(), reason="this torch build has no oneDNN (mkldnn)"
)


def _filled(layer: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
    return layer


def _prepared(layer: torch.nn.Module) -> torch.nn.Module:
    layer.quant_method.process_weights_after_loading(layer)
    return layer


@needs_onednn
@pytest.mark.parametrize("rows", [1, 2, 7, 32, 100, 256, 257, 755])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_matches_f_linear(rows: int, bias: bool) -> None:
    layer = _prepared(_filled(ReplicatedLinear(576, 960, bias=bias)))
    assert layer.cpu_packed_weight is not None
    x = torch.randn(rows, 576, generator=torch.Generator().manual_seed(rows))
    with torch.inference_mode():
        out, _ = layer(x)
    expected = F.linear(x, layer.weight, layer.bias)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    if CPU_PACKED_GEMM_MIN_ROWS <= rows <= CPU_PACKED_GEMM_MAX_ROWS:
        # Decode-sized: the packed kernel ran (its result, bit for bit).
        packed = torch.ops.mkldnn._linear_pointwise(
            x, layer.cpu_packed_weight, layer.bias, "none", [], ""
        )
        assert torch.equal(out, packed)
    else:
        # One row or prefill-sized: plain F.linear, bit for bit.
        assert torch.equal(out, expected)


@needs_onednn
@pytest.mark.parametrize(
    "make",
    [
        lambda: QKVParallelLinear(64, 16, 4, 2, bias=True),
        lambda: MergedColumnParallelLinear(64, [96, 96], bias=False),
        lambda: RowParallelLinear(96, 64, bias=True),
    ],
    ids=["qkv", "merged_gate_up", "row"],
)
def test_every_linear_layer_type_agrees_after_packing(make) -> None:
    layer = _filled(make(), seed=1)
    plain = {k: v.clone() for k, v in layer.state_dict().items()}
    _prepared(layer)
    x = torch.randn(3, 5, layer.input_size)  # a 3-D input: 15 rows
    with torch.inference_mode():
        out, _ = layer(x)
    expected = F.linear(x, plain["weight"], plain.get("bias"))
    assert out.shape == expected.shape
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


@needs_onednn
def test_non_contiguous_input() -> None:
    layer = _prepared(_filled(RowParallelLinear(64, 32, bias=False)))
    x = torch.randn(64, 16).t()  # [16, 64], column-major
    assert not x.is_contiguous()
    out, _ = layer(x)
    torch.testing.assert_close(out, F.linear(x, layer.weight), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(
    "weight",
    [
        torch.zeros(8, 4, dtype=torch.float64),  # not float32
        torch.zeros(8, 4, device="meta"),  # not on the CPU
        torch.zeros(8),  # not a matrix
    ],
    ids=["float64", "meta", "1-d"],
)
def test_unpackable_weights_stay_unpacked(weight: torch.Tensor) -> None:
    layer = torch.nn.Module()
    layer.weight = torch.nn.Parameter(weight, requires_grad=False)
    dispatch_cpu_unquantized_gemm(layer)
    assert layer.cpu_packed_weight is None


def test_without_onednn_the_layer_falls_back_to_f_linear(monkeypatch) -> None:
    monkeypatch.setattr(linear, "_onednn_linear_available", lambda: False)
    layer = _prepared(_filled(ReplicatedLinear(16, 24, bias=True)))
    assert layer.cpu_packed_weight is None
    x = torch.randn(32, 16)
    out, _ = layer(x)
    assert torch.equal(out, F.linear(x, layer.weight, layer.bias))


@needs_onednn
def test_float64_layer_runs_unpacked() -> None:
    layer = _prepared(_filled(ReplicatedLinear(16, 24, bias=False, params_dtype=torch.float64)))
    assert layer.cpu_packed_weight is None
    x = torch.randn(32, 16, dtype=torch.float64)
    out, _ = layer(x)
    assert torch.equal(out, F.linear(x, layer.weight))


@needs_onednn
def test_model_runner_packs_every_linear_layer_after_loading(tmp_path) -> None:
    from engine.engine.arg_utils import EngineArgs
    from engine.model_executor.layers.linear import LinearBase
    from engine.v1.worker.gpu_model_runner import GPUModelRunner
    from tests.helpers.hf_checkpoints import save_tiny_checkpoint

    path = tmp_path / "tiny"
    save_tiny_checkpoint("qwen2", path)  # q/k/v with a bias
    config = EngineArgs(model=str(path), device="cpu", dtype="float32").create_engine_config()
    runner = GPUModelRunner(config, torch.device("cpu"))
    runner.load_model()
    linears = [m for m in runner.model.modules() if isinstance(m, LinearBase)]
    assert linears
    assert all(m.cpu_packed_weight is not None for m in linears)
