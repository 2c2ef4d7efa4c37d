"""The fused CPU helpers give bit-identical float32 results to the layers' ``forward_native``.

``engine/model_executor/layers/cpu_fused.py`` runs the same operations in the
same order as the reference paths, only in fewer torch ops and in place, so
the outputs must be *equal* (not merely close): that is what keeps greedy
parity with transformers unchanged when a layer's ``forward_cpu`` uses them.
"""

from __future__ import annotations

import pytest
import torch

from engine.model_executor.layers import cpu_fused
from engine.model_executor.layers.activation import SiluAndMul
from engine.model_executor.layers.layernorm import RMSNorm
from engine.model_executor.layers.rotary_embedding import get_rope
from engine.model_executor.layers.rotary_embedding.base import RotaryEmbedding
from tests.helpers.calls import record_calls


def _gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _norm(hidden: int, has_weight: bool = True) -> RMSNorm:
    norm = RMSNorm(hidden, eps=1e-5, has_weight=has_weight)
    if has_weight:
        with torch.no_grad():
            norm.weight.copy_(torch.rand(hidden, generator=_gen(1)) + 0.5)
    return norm


@pytest.mark.parametrize("shape", [(32, 576), (7, 64), (3, 4, 16)])
@pytest.mark.parametrize("has_weight", [True, False])
def test_rms_norm_equals_native(shape, has_weight):
    norm = _norm(shape[-1], has_weight)
    x = torch.randn(shape, generator=_gen()) * 3
    expected = norm.forward_native(x.clone())
    got = cpu_fused.rms_norm(x, norm.weight if has_weight else None, norm.variance_epsilon)
    assert torch.equal(got, expected)


@pytest.mark.parametrize("shape", [(32, 576), (755, 64)])
def test_fused_add_rms_norm_equals_native_in_place(shape):
    norm = _norm(shape[-1])
    x = torch.randn(shape, generator=_gen(2))
    residual = torch.randn(shape, generator=_gen(3))
    expected_out, expected_residual = norm.forward_native(x.clone(), residual.clone())
    cpu_fused.fused_add_rms_norm_(x, residual, norm.weight, norm.variance_epsilon)
    assert torch.equal(x, expected_out)
    assert torch.equal(residual, expected_residual)


def test_fused_add_rms_norm_rejects_bad_input():
    x = torch.randn(4, 8)
    with pytest.raises(ValueError, match="same shape"):
        cpu_fused.fused_add_rms_norm_(x, torch.randn(4, 9), None, 1e-6)
    with pytest.raises(ValueError, match="residual must be float32"):
        cpu_fused.fused_add_rms_norm_(x, torch.randn(4, 8, dtype=torch.float64), None, 1e-6)
    with pytest.raises(ValueError, match="x must be float32"):
        cpu_fused.rms_norm(torch.randn(4, 8, dtype=torch.bfloat16), None, 1e-6)


def _rope(head: int, rotary_dim: int, is_neox: bool) -> RotaryEmbedding:
    return RotaryEmbedding(head, rotary_dim, 2048, 10000.0, is_neox, torch.float32)


@pytest.mark.parametrize(
    "head, rotary_dim, is_neox",
    [(64, 64, True), (64, 64, False), (32, 16, True), (32, 16, False)],
    ids=["neox", "gptj", "partial-neox", "partial-gptj"],
)
@pytest.mark.parametrize("impl", ["cpu_fused", "cpp"])
def test_rotary_embedding_equals_native_on_qkv_views(head, rotary_dim, is_neox, impl):
    rope = _rope(head, rotary_dim, is_neox)
    h, h_kv, t = 9, 3, 37
    qkv = torch.randn(t, (h + 2 * h_kv) * head, generator=_gen(4))
    q, k, _ = qkv.split([h * head, h_kv * head, h_kv * head], dim=-1)  # strided views
    positions = torch.randint(0, 2000, (t,), generator=_gen(5))
    expected_q, expected_k = rope.forward_native(positions, q.clone(), k.clone())
    v_before = qkv[:, (h + h_kv) * head :].clone()
    # Both bit-identical to native (the C++ is built without FMA contraction).
    rotate = cpu_fused.rotary_embedding_ if impl == "cpu_fused" else _kernels().rotary_embedding
    rotate(positions, q, k, head, rope.cos_sin_cache, is_neox)
    assert torch.equal(q, expected_q)
    assert torch.equal(k, expected_k)
    assert torch.equal(qkv[:, (h + h_kv) * head :], v_before)  # v untouched


def test_rotary_embedding_query_only_and_3d():
    rope = get_rope(16, 256, is_neox_style=True, rope_parameters={"rope_theta": 500000.0})
    q = torch.randn(5, 4, 16, generator=_gen(6))
    positions = torch.arange(5)
    expected_q, _ = rope.forward_native(positions, q.clone(), None)
    cpu_fused.rotary_embedding_(positions, q, None, 16, rope.cos_sin_cache, True)
    assert torch.equal(q, expected_q)


def test_rotary_embedding_with_zero_tokens():
    # An empty batch slice must pass through (a bare `view(0, -1, head)` is ambiguous).
    rope = _rope(64, 64, True)
    q, k = torch.empty(0, 4 * 64), torch.empty(0, 2 * 64)
    positions = torch.empty(0, dtype=torch.long)
    out_q, out_k = rope.forward_native(positions, q.clone(), k.clone())
    assert out_q.shape == (0, 256) and out_k.shape == (0, 128)
    cpu_fused.rotary_embedding_(positions, q, k, 64, rope.cos_sin_cache, True)
    assert q.shape == (0, 256)


@pytest.mark.parametrize("shape", [(32, 3072), (5, 2, 8)])
def test_silu_and_mul_equals_native(shape):
    x = torch.randn(shape, generator=_gen(7))
    assert torch.equal(cpu_fused.silu_and_mul(x), SiluAndMul().forward_native(x))


@pytest.fixture(params=["cpp", "torch"])
def cpu_path(request):
    """``cpp``: the layers call csrc/cpu (built by make setup); ``torch``: cpu_fused."""
    from engine._cpu_ops import cpu_kernels, kernels_disabled

    if request.param == "torch":
        with kernels_disabled():
            yield request.param
    else:
        assert cpu_kernels() is not None, "run `python -m engine._cpu_ops -v` to see why"
        yield request.param


def test_layers_dispatch_to_forward_cpu_on_cpu_and_match_native(cpu_path):
    """Called as modules on CPU tensors, the layers take ``forward_cpu`` (the fused path):
    bit-identical to forward_native through cpu_fused, within float rounding through C++."""
    norm, act = _norm(64), SiluAndMul()
    rope = RotaryEmbedding(16, 16, 128, 10000.0, True, torch.float32)
    cpu_calls = {
        type(layer).__name__: record_calls(layer, "forward_cpu") for layer in (norm, act, rope)
    }
    x = torch.randn(5, 64, generator=_gen(2))
    residual = torch.randn(5, 64, generator=_gen(3))
    positions = torch.arange(5)
    q, k = torch.randn(5, 32, generator=_gen(4)), torch.randn(5, 16, generator=_gen(5))

    def same(a, b):
        if cpu_path == "torch":
            assert torch.equal(a, b)
        else:
            torch.testing.assert_close(a, b, rtol=2e-6, atol=2e-6)

    same(norm(x.clone()), norm.forward_native(x.clone()))
    out, res = norm(x.clone(), residual.clone())
    ref_out, ref_res = norm.forward_native(x.clone(), residual.clone())
    same(out, ref_out)
    assert torch.equal(res, ref_res)  # the residual add is one float add either way
    same(act(x), act.forward_native(x))
    rq, rk = rope(positions, q.clone(), k.clone())
    eq, ek = rope.forward_native(positions, q.clone(), k.clone())
    assert torch.equal(rq, eq) and torch.equal(rk, ek)  # no FMA contraction: same roundings
    # Every module call above ran forward_cpu (norm twice: with and without residual).
    assert {name: len(calls) for name, calls in cpu_calls.items()} == {
        "RMSNorm": 2,
        "SiluAndMul": 1,
        "RotaryEmbedding": 1,
    }


def test_forward_cpu_falls_back_to_native_for_bf16():
    norm = _norm(64).to(torch.bfloat16)
    x = torch.randn(5, 64, generator=_gen(6)).to(torch.bfloat16)
    residual = torch.randn(5, 64, generator=_gen(7)).to(torch.bfloat16)
    out, res = norm.forward_cpu(x.clone(), residual.clone())
    ref_out, ref_res = norm.forward_native(x.clone(), residual.clone())
    assert torch.equal(out, ref_out) and torch.equal(res, ref_res)


# --- the C++ kernels (csrc/cpu) on their own -----------------------------------


def _kernels():
    from engine._cpu_ops import cpu_kernels

    kernels = cpu_kernels()
    assert kernels is not None, "run `python -m engine._cpu_ops -v` to see why"
    return kernels


def test_cpp_norms_and_activation_match_native_on_wide_and_strided_rows():
    kernels = _kernels()
    norm = _norm(576)
    wide = torch.randn(33, 700, generator=_gen(16))
    x = wide[:, :576]  # rows with a stride of 700
    out = torch.empty(33, 576)
    kernels.rms_norm(out, x, norm.weight, 1e-5)
    torch.testing.assert_close(out, norm.forward_native(x.clone()), rtol=2e-6, atol=2e-6)
    residual = torch.randn(33, 576, generator=_gen(17))
    expected_x, expected_res = norm.forward_native(x.clone(), residual.clone())
    kernels.fused_add_rms_norm(x, residual, norm.weight, 1e-5)
    torch.testing.assert_close(x, expected_x, rtol=2e-6, atol=2e-6)
    assert torch.equal(residual, expected_res)
    # The columns outside the strided view are untouched.
    assert torch.equal(wide[:, 576:], torch.randn(33, 700, generator=_gen(16))[:, 576:])
    gate_up = torch.randn(7, 2 * 1536, generator=_gen(18)) * 4
    out = torch.empty(7, 1536)
    kernels.silu_and_mul(out, gate_up)
    torch.testing.assert_close(out, SiluAndMul().forward_native(gate_up), rtol=2e-6, atol=2e-6)


def test_cpp_kernels_reject_bad_input():
    kernels = _kernels()
    with pytest.raises(RuntimeError, match="float32"):
        kernels.rms_norm(
            torch.empty(2, 8, dtype=torch.float64), torch.randn(2, 8).double(), None, 1e-6
        )
    with pytest.raises(RuntimeError, match="same shape"):
        kernels.fused_add_rms_norm(torch.randn(2, 8), torch.randn(3, 8), None, 1e-6)
    with pytest.raises(RuntimeError, match="twice"):
        kernels.silu_and_mul(torch.empty(2, 8), torch.randn(2, 8))
    rope = _rope(16, 16, True)
    with pytest.raises(RuntimeError, match=r"position 5000 is outside \[0, 2048\)"):
        kernels.rotary_embedding(
            torch.tensor([5000]), torch.randn(1, 32), None, 16, rope.cos_sin_cache, True
        )
