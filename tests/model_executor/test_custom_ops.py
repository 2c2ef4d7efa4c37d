"""The fused Triton ops (engine/_custom_ops.py) against the layers' forward_native,
and the CustomOp dispatch (engine/model_executor/custom_op.py).

Where the kernels run here: on the CPU, in Triton's NumPy interpreter, in a
worker process started with ``TRITON_INTERPRET=1`` (Triton reads the variable
when ``@triton.jit`` decorates a function, and in a full test run triton has
already been imported in this process -- see
tests/helpers/triton_interpret.py, shared with tests/v1/attention/test_triton_attn.py).
Shapes are small and float32, tolerance 1e-5. The GPU versions of these checks (bf16 and fp32,
real shapes, CUDA graphs) are in tests/gpu/test_custom_ops_gpu.py.

Every check compares an op with the torch code it replaces:
  * ``rms_norm`` / ``fused_add_rms_norm`` with ``RMSNorm.forward_native``,
    including the in-place contract (input <- normed sum, residual <- sum),
    row-strided inputs and Qwen3's [T, heads, D] view of a qkv column slice;
  * ``rotary_embedding`` with ``RotaryEmbedding.forward_native``: neox and
    GPT-J pairing, partial rotary_dim, key or no key, q/k as views of qkv;
  * ``fused_qk_norm_rope`` with per-head ``RMSNorm`` followed by RoPE;
  * ``silu_and_mul`` with ``SiluAndMul.forward_native``;
and zero tokens launch nothing. ``test_kernels_compile_for_sm90`` lowers every
kernel for an H100/H200 in bf16, fp16 and fp32 without a GPU.
"""

from __future__ import annotations

import textwrap

import pytest
import torch

from engine.model_executor.custom_op import (
    DISABLE_CUSTOM_OPS_ENV,
    CustomOp,
    op_registry,
)
from engine.model_executor.layers.activation import SiluAndMul
from engine.model_executor.layers.layernorm import RMSNorm
from engine.model_executor.layers.rotary_embedding import (
    Llama3RotaryEmbedding,
    RotaryEmbedding,
)
from tests.helpers.calls import record_calls
from tests.helpers.triton_interpret import interpreting_worker, run_without_interpreter

TOL = {"atol": 1e-5, "rtol": 1e-5}
# forward_cpu against forward_native in float32: csrc/cpu sums the squares of a
# norm in an order set by the machine's SIMD width, torch in its own, so the
# results may differ by a few float32 ulps (2e-6 ~ 16 ulps at 1.0).
CPU_TOL = {"atol": 2e-6, "rtol": 2e-6}


@pytest.fixture(scope="module")
def kernels():
    """``kernels(check, *args)`` runs ``check(*args)`` in an interpreting worker."""
    with interpreting_worker("engine._custom_ops", "_rms_norm_kernel") as run:
        yield run


def _norm(hidden: int, seed: int = 0) -> RMSNorm:
    norm = RMSNorm(hidden, eps=1e-6, dtype=torch.float32)
    norm.weight.data = torch.randn(hidden, generator=torch.Generator().manual_seed(seed))
    return norm


# ----------------------------------------------------------------------------
# Checks (run in the worker)
# ----------------------------------------------------------------------------
def check_rms_norm():
    from engine import _custom_ops as ops

    g = torch.Generator().manual_seed(1)
    norm = _norm(40)
    wide = torch.randn(6, 100, generator=g)
    cases = {
        "contiguous": torch.randn(5, 40, generator=g),
        "row-strided": wide[:, 10:50],  # a column slice: row stride 100
        "one row": torch.randn(1, 40, generator=g),
        "3d": torch.randn(2, 3, 40, generator=g),
    }
    for name, x in cases.items():
        out = torch.empty(x.shape)
        ops.rms_norm(out, x, norm.weight, norm.variance_epsilon)
        torch.testing.assert_close(out, norm.forward_native(x), **TOL, msg=name)
        torch.testing.assert_close(norm.forward_cuda(x), norm.forward_native(x), **TOL, msg=name)

    # Qwen3's q norm: [T, heads, D] view of the q columns of a qkv row.
    head_norm = _norm(16, seed=2)
    qkv = torch.randn(4, (3 + 1 + 1) * 16, generator=g)
    q = qkv[:, : 3 * 16].view(4, 3, 16)
    assert not q.is_contiguous()
    torch.testing.assert_close(head_norm.forward_cuda(q), head_norm.forward_native(q), **TOL)

    empty = torch.empty(0, 40)
    ops.rms_norm(torch.empty(0, 40), empty, norm.weight, 1e-6)  # no launch, no error


def check_fused_add_rms_norm():
    from engine import _custom_ops as ops

    g = torch.Generator().manual_seed(3)
    norm = _norm(40)
    for name, (x, r) in {
        "contiguous": (torch.randn(5, 40, generator=g), torch.randn(5, 40, generator=g)),
        "row-strided": (torch.randn(5, 64, generator=g)[:, 4:44], torch.randn(5, 40, generator=g)),
    }.items():
        expected_out, expected_residual = norm.forward_native(x.clone(), r.clone())
        x_buffer = x.clone() if x.is_contiguous() else None
        out, residual = norm.forward_cuda(x, r)
        # vLLM's contract: the same tensors come back, updated in place.
        assert out is x and residual is r, name
        torch.testing.assert_close(x, expected_out, **TOL, msg=name)
        torch.testing.assert_close(r, expected_residual, atol=0, rtol=0, msg=name)
        if x_buffer is not None:
            assert not torch.equal(x, x_buffer)

    # Columns outside a strided view are untouched.
    base = torch.randn(3, 64, generator=g)
    before = base.clone()
    x, r = base[:, 8:48], torch.randn(3, 40, generator=g)
    ops.fused_add_rms_norm(x, r, norm.weight, 1e-6)
    torch.testing.assert_close(base[:, :8], before[:, :8], atol=0, rtol=0)
    torch.testing.assert_close(base[:, 48:], before[:, 48:], atol=0, rtol=0)

    ops.fused_add_rms_norm(torch.empty(0, 40), torch.empty(0, 40), norm.weight, 1e-6)


def _qkv(num_tokens, heads, kv_heads, head_size, seed):
    g = torch.Generator().manual_seed(seed)
    qkv = torch.randn(num_tokens, (heads + 2 * kv_heads) * head_size, generator=g)
    q, k, v = qkv.split([heads * head_size, kv_heads * head_size, kv_heads * head_size], dim=-1)
    return qkv, q, k, v


def check_rotary_embedding():
    from engine import _custom_ops as ops

    positions = torch.tensor([0, 5, 3, 63, 17])
    for is_neox in (True, False):
        for rotary_dim in (16, 12):  # full and partial RoPE
            rope = RotaryEmbedding(16, rotary_dim, 64, 10000.0, is_neox, torch.float32)
            name = f"neox={is_neox} rotary_dim={rotary_dim}"
            _, q, k, v = _qkv(5, 4, 2, 16, seed=rotary_dim)
            v_before = v.clone()
            expected_q, expected_k = rope.forward_native(positions, q.clone(), k.clone())
            out_q, out_k = rope.forward_cuda(positions, q, k)
            assert out_q is q and out_k is k, name  # in place, as vLLM's op
            torch.testing.assert_close(q, expected_q, **TOL, msg=name)
            torch.testing.assert_close(k, expected_k, **TOL, msg=name)
            torch.testing.assert_close(v, v_before, atol=0, rtol=0, msg=name)

            # No key; [T, heads, head_size] layout.
            _, q, _, _ = _qkv(5, 4, 2, 16, seed=7)
            expected_q, _ = rope.forward_native(positions, q.clone())
            q3 = q.view(5, 4, 16)
            ops.rotary_embedding(positions, q3, None, 16, rope.cos_sin_cache, is_neox)
            torch.testing.assert_close(q, expected_q, **TOL, msg=name)

    # Llama 3's scaled frequencies only change the cache.
    rope = Llama3RotaryEmbedding(16, 16, 64, 500000.0, True, torch.float32, 8.0, 1.0, 4.0, 32)
    _, q, k, _ = _qkv(5, 4, 2, 16, seed=9)
    expected_q, expected_k = rope.forward_native(positions, q.clone(), k.clone())
    rope.forward_cuda(positions, q, k)
    torch.testing.assert_close(q, expected_q, **TOL)
    torch.testing.assert_close(k, expected_k, **TOL)

    ops.rotary_embedding(
        torch.empty(0, dtype=torch.long),
        torch.empty(0, 64),
        torch.empty(0, 32),
        16,
        rope.cos_sin_cache,
        True,
    )


def check_fused_qk_norm_rope():
    from engine import _custom_ops as ops

    positions = torch.tensor([0, 9, 2, 31])
    heads, kv_heads = 4, 2
    for head_dim, rotary_dim in ((16, 16), (24, 24), (16, 8)):  # pow2, not pow2, partial
        for is_neox in (True, False):
            name = f"head_dim={head_dim} rotary_dim={rotary_dim} neox={is_neox}"
            rope = RotaryEmbedding(head_dim, rotary_dim, 32, 10000.0, is_neox, torch.float32)
            q_norm, k_norm = _norm(head_dim, seed=1), _norm(head_dim, seed=2)
            qkv, q, k, v = _qkv(4, heads, kv_heads, head_dim, seed=head_dim + rotary_dim)
            v_before = v.clone()
            # The unfused Qwen3 path.
            q_ref = q_norm.forward_native(q.reshape(4, heads, head_dim)).view(q.shape)
            k_ref = k_norm.forward_native(k.reshape(4, kv_heads, head_dim)).view(k.shape)
            q_ref, k_ref = rope.forward_native(positions, q_ref, k_ref)

            ops.fused_qk_norm_rope(
                qkv,
                heads,
                kv_heads,
                kv_heads,
                head_dim,
                1e-6,
                q_norm.weight,
                k_norm.weight,
                rope.cos_sin_cache,
                is_neox,
                positions,
            )
            torch.testing.assert_close(q, q_ref, **TOL, msg=name)
            torch.testing.assert_close(k, k_ref, **TOL, msg=name)
            torch.testing.assert_close(v, v_before, atol=0, rtol=0, msg=name)

    ops.fused_qk_norm_rope(
        torch.empty(0, 8 * 16),
        4,
        2,
        2,
        16,
        1e-6,
        _norm(16).weight,
        _norm(16).weight,
        RotaryEmbedding(16, 16, 8, 10000.0, True, torch.float32).cos_sin_cache,
        True,
        torch.empty(0, dtype=torch.long),
    )


def check_silu_and_mul():
    from engine import _custom_ops as ops

    g = torch.Generator().manual_seed(5)
    act = SiluAndMul()
    for name, x in {
        "two column blocks": torch.randn(3, 2 * 1100, generator=g) * 4,
        "3d": torch.randn(2, 3, 10, generator=g),
        "row-strided": torch.randn(4, 40, generator=g)[:, :20],
    }.items():
        torch.testing.assert_close(act.forward_cuda(x), act.forward_native(x), **TOL, msg=name)
    ops.silu_and_mul(torch.empty(0, 4), torch.empty(0, 8))


@pytest.mark.parametrize(
    "check",
    [
        check_rms_norm,
        check_fused_add_rms_norm,
        check_rotary_embedding,
        check_fused_qk_norm_rope,
        check_silu_and_mul,
    ],
    ids=lambda f: f.__name__.removeprefix("check_"),
)
def test_op_matches_forward_native(kernels, check):
    kernels(check)


# ----------------------------------------------------------------------------
# Argument checks (raise before any launch: no interpreter needed)
# ----------------------------------------------------------------------------
def test_ops_reject_bad_arguments():
    from engine import _custom_ops as ops

    w = torch.ones(8)
    with pytest.raises(ValueError, match="share one dtype"):
        ops.rms_norm(torch.empty(2, 8), torch.randn(2, 8), w.half(), 1e-6)
    with pytest.raises(ValueError, match="contiguous last dimension"):
        ops.rms_norm(torch.empty(2, 8), torch.randn(8, 2).t(), w, 1e-6)
    with pytest.raises(ValueError, match="weight must have shape"):
        ops.fused_add_rms_norm(torch.randn(2, 8), torch.randn(2, 8), torch.ones(4), 1e-6)
    with pytest.raises(ValueError, match="even last dimension"):
        ops.silu_and_mul(torch.empty(2, 2), torch.randn(2, 5))
    cache = torch.randn(16, 20)
    with pytest.raises(ValueError, match="rotary_dim even and <= head_size=16"):
        ops.rotary_embedding(
            torch.zeros(2, dtype=torch.long), torch.randn(2, 32), None, 16, cache, True
        )
    with pytest.raises(ValueError, match="query must be"):
        ops.rotary_embedding(
            torch.zeros(3, dtype=torch.long), torch.randn(2, 32), None, 16, cache[:, :16], True
        )
    with pytest.raises(ValueError, match="qkv must be"):
        ops.fused_qk_norm_rope(
            torch.randn(2, 64), 2, 1, 1, 8, 1e-6, w, w, cache[:, :8], True, torch.zeros(2)
        )


# ----------------------------------------------------------------------------
# CustomOp dispatch
# ----------------------------------------------------------------------------
@pytest.fixture
def custom_ops_env(monkeypatch):
    monkeypatch.delenv(DISABLE_CUSTOM_OPS_ENV, raising=False)
    return monkeypatch


def test_registered_names_are_vllms():
    assert op_registry["rms_norm"] is RMSNorm
    assert op_registry["silu_and_mul"] is SiluAndMul
    assert op_registry["rotary_embedding"] is RotaryEmbedding
    assert Llama3RotaryEmbedding.name == "rotary_embedding"  # inherits its parent's op
    with pytest.raises(ValueError, match="already registered"):
        CustomOp.register("rms_norm")(type("Other", (CustomOp,), {}))


def test_dispatch_picks_by_device_once(custom_ops_env):
    norm = _norm(8)
    assert norm.dispatch_forward(torch.device("cuda")) == norm.forward_cuda
    assert norm.dispatch_forward(torch.device("cpu")) == norm.forward_cpu
    assert norm.dispatch_forward(torch.device("meta")) == norm.forward_native

    calls = []
    original = norm.dispatch_forward
    custom_ops_env.setattr(norm, "dispatch_forward", lambda d: calls.append(d) or original(d))
    cpu_calls = record_calls(norm, "forward_cpu")
    x = torch.randn(3, 8)
    for _ in range(3):
        torch.testing.assert_close(norm(x), norm.forward_native(x), **CPU_TOL)
    assert calls == [torch.device("cpu")]  # chosen on the first call only
    assert len(cpu_calls) == 3  # ... and every call ran forward_cpu
    norm.to(torch.float64)  # moving the module chooses again on the next call
    norm(x.double())
    assert len(calls) == 2


def test_env_var_forces_native(custom_ops_env):
    custom_ops_env.setenv(DISABLE_CUSTOM_OPS_ENV, "1")
    assert not RMSNorm.enabled() and not SiluAndMul.enabled()
    norm = _norm(8)
    assert norm.dispatch_forward(torch.device("cuda")) == norm.forward_native

    custom_ops_env.setenv(DISABLE_CUSTOM_OPS_ENV, "rms_norm, rotary_embedding")
    assert not RMSNorm.enabled() and not RotaryEmbedding.enabled() and SiluAndMul.enabled()
    act = SiluAndMul()
    assert act.dispatch_forward(torch.device("cuda")) == act.forward_cuda

    custom_ops_env.setenv(DISABLE_CUSTOM_OPS_ENV, "0")
    assert RMSNorm.enabled()
    custom_ops_env.setenv(DISABLE_CUSTOM_OPS_ENV, "rms_nrom")
    with pytest.raises(ValueError, match="unknown \\['rms_nrom'\\]"):
        RMSNorm.enabled()


def test_cpu_forward_matches_native(custom_ops_env):
    """On the CPU the layers run forward_cpu (the C++ of csrc/cpu when built, else cpu_fused):
    fewer ops, in place, equal to forward_native up to float rounding (RoPE bit for bit)."""
    g = torch.Generator().manual_seed(0)
    norm, act = _norm(16), SiluAndMul()
    rope = RotaryEmbedding(8, 8, 32, 10000.0, True, torch.float32)
    x, r = torch.randn(4, 16, generator=g), torch.randn(4, 16, generator=g)
    torch.testing.assert_close(norm(x.clone()), norm.forward_native(x), **CPU_TOL)
    ours = norm(x.clone(), r.clone())
    for a, b in zip(ours, norm.forward_native(x, r)):
        torch.testing.assert_close(a, b, **CPU_TOL)
    torch.testing.assert_close(act(x), act.forward_native(x), **CPU_TOL)
    pos = torch.tensor([1, 2, 3, 4])
    qkv = torch.randn(4, 24, generator=g)  # q and k as column views of one qkv row, as in a model
    q_ref, k_ref = rope.forward_native(pos, qkv[:, :16], qkv[:, 16:])
    q, k = rope(pos, qkv[:, :16].clone(), qkv[:, 16:].clone())
    assert torch.equal(q, q_ref) and torch.equal(k, k_ref)


# ----------------------------------------------------------------------------
# The kernels compile for the GPU (no GPU needed)
# ----------------------------------------------------------------------------
_COMPILE_SCRIPT = textwrap.dedent(
    """
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from engine import _custom_ops as ops

    target = GPUTarget("cuda", 90, 32)  # H100 / H200

    def compile_kernel(fn, dtype, constexprs):
        def type_of(name):
            if name == "positions_ptr":
                return "*i64"
            if name == "cos_sin_cache_ptr":
                return "*fp32" if dtype == "fp32" else "*" + dtype
            if name.endswith("_ptr"):
                return "*" + dtype
            return "fp32" if name == "eps" else "i32"
        signature = {n: "constexpr" if n in constexprs else type_of(n) for n in fn.arg_names}
        # As the launcher does at run time: pointers and strides divisible by 16.
        attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(fn.arg_names)
                 if n not in constexprs and (signature[n].startswith("*") or "stride" in n)}
        triton.compile(ASTSource(fn, signature, constexprs, attrs), target=target)

    for dtype in ("bf16", "fp16", "fp32"):
        compile_kernel(ops._rms_norm_kernel, dtype, dict(BLOCK=1024))
        compile_kernel(ops._fused_add_rms_norm_kernel, dtype, dict(BLOCK=4096))
        compile_kernel(ops._silu_and_mul_kernel, dtype, dict(BLOCK=1024))
        for is_neox in (True, False):
            compile_kernel(ops._rotary_embedding_kernel, dtype, dict(IS_NEOX=is_neox, HALF_PAD=64))
            compile_kernel(ops._fused_qk_norm_rope_kernel, dtype,
                           dict(IS_NEOX=is_neox, D_PAD=128, HALF_PAD=64))
    print("compiled")
    """
)


def test_kernels_compile_for_sm90():
    """Lower every kernel to a cubin for sm_90 in a fresh process without
    TRITON_INTERPRET (in this process the kernels may be interpreted)."""
    result = run_without_interpreter(_COMPILE_SCRIPT)
    assert result.returncode == 0 and "compiled" in result.stdout, result.stderr[-4000:]
