"""The fused Triton ops on CUDA against the layers' forward_native, in bf16 and fp32.

Marked ``gpu``: skipped where torch sees no CUDA device (CI runs the same
checks interpreted, at small fp32 shapes: tests/model_executor/test_custom_ops.py).

* Real shapes (Qwen3-0.6B: hidden 1024, 16 q / 8 kv heads of 128, inter 3072;
  plus a non-power-of-two hidden and head size), 0 / 1 / many tokens,
  row-strided q/k views of a qkv output.
* fp32: within 1e-5 of forward_native. bf16: within one or two bf16 ulps
  (the kernels round where torch rounds), and ``fused_add_rms_norm``'s new
  residual is bit-identical.
* No op synchronises with the host (``torch.cuda.set_sync_debug_mode``), and a
  CUDA graph of the ops replays correctly on new inputs.
* The persistent sampling metadata refreshes without a host sync.
* End to end, a tiny Qwen3 (fused q/k norm + RoPE path) generates the same
  greedy tokens with custom ops on and off (fp32, CUDA graphs on).
"""

from __future__ import annotations

import pytest
import torch

from engine.model_executor.custom_op import DISABLE_CUSTOM_OPS_ENV
from engine.model_executor.layers.activation import SiluAndMul
from engine.model_executor.layers.layernorm import RMSNorm
from engine.model_executor.layers.rotary_embedding import RotaryEmbedding
from tests.helpers.calls import record_calls
from tests.helpers.gpu import decode_graphs

pytestmark = pytest.mark.gpu

DTYPES = [torch.float32, torch.bfloat16]


def _tol(dtype: torch.dtype) -> dict:
    # bf16 ulp is 2**-8 relative; torch rounds after every op of the rotation,
    # the kernel once, so allow two ulps plus a small absolute floor.
    if dtype == torch.float32:
        return {"atol": 1e-5, "rtol": 1e-5}
    return {"atol": 2e-2, "rtol": 8e-3}


def _randn(*shape, dtype, seed=0, scale=1.0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    return (torch.randn(*shape, generator=g, device="cuda") * scale).to(dtype)


def _norm(hidden, dtype, seed=1):
    norm = RMSNorm(hidden, eps=1e-6, dtype=dtype).cuda()
    norm.weight.data = _randn(hidden, dtype=dtype, seed=seed, scale=0.5) + 1
    return norm


@pytest.fixture(autouse=True)
def _custom_ops_on(monkeypatch):
    monkeypatch.delenv(DISABLE_CUSTOM_OPS_ENV, raising=False)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_tokens", [0, 1, 7, 300])
@pytest.mark.parametrize("hidden", [1024, 896])
def test_rms_norm(dtype, num_tokens, hidden):
    norm = _norm(hidden, dtype)
    cuda_calls = record_calls(norm, "forward_cuda")
    x = _randn(num_tokens, hidden, dtype=dtype, seed=2, scale=3)
    out = norm(x)
    assert len(cuda_calls) == 1  # the module call ran the kernel path
    torch.testing.assert_close(out, norm.forward_native(x), **_tol(dtype))
    # Row-strided: a column slice of a wider buffer.
    wide = _randn(num_tokens, hidden + 64, dtype=dtype, seed=3)
    x = wide[:, 32 : 32 + hidden]
    torch.testing.assert_close(norm(x), norm.forward_native(x), **_tol(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_tokens", [0, 1, 7, 300])
def test_fused_add_rms_norm_in_place(dtype, num_tokens):
    norm = _norm(1024, dtype)
    x = _randn(num_tokens, 1024, dtype=dtype, seed=4, scale=2)
    r = _randn(num_tokens, 1024, dtype=dtype, seed=5, scale=2)
    expected_out, expected_residual = norm.forward_native(x.clone(), r.clone())
    out, residual = norm(x, r)
    assert out is x and residual is r
    torch.testing.assert_close(residual, expected_residual, atol=0, rtol=0)
    torch.testing.assert_close(out, expected_out, **_tol(dtype))


def test_bf16_rounding_matches_torch_almost_everywhere():
    """The kernels round where torch rounds: at most a sliver of bf16 elements
    may differ (by one ulp, from a different float32 summation order)."""
    norm = _norm(1024, torch.bfloat16)
    x = _randn(256, 1024, dtype=torch.bfloat16, seed=6, scale=3)
    differ = (norm(x) != norm.forward_native(x)).float().mean().item()
    assert differ < 0.01, differ


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("is_neox", [True, False])
@pytest.mark.parametrize("head_size,rotary_dim", [(128, 128), (128, 64), (80, 80)])
@pytest.mark.parametrize("num_tokens", [0, 1, 5, 513])
def test_rotary_embedding(dtype, is_neox, head_size, rotary_dim, num_tokens):
    heads, kv_heads = 16, 8
    with torch.device("cuda"):
        rope = RotaryEmbedding(head_size, rotary_dim, 4096, 1e6, is_neox, dtype)
    qkv = _randn(num_tokens, (heads + 2 * kv_heads) * head_size, dtype=dtype, seed=7)
    q, k, v = qkv.split([heads * head_size, kv_heads * head_size, kv_heads * head_size], dim=-1)
    positions = torch.randint(0, 4096, (num_tokens,), device="cuda")
    expected_q, expected_k = rope.forward_native(positions, q.clone(), k.clone())
    v_before = v.clone()
    cuda_calls = record_calls(rope, "forward_cuda")
    out_q, out_k = rope(positions, q, k)
    assert len(cuda_calls) == 1  # the module call ran the kernel path
    assert out_q is q and out_k is k
    torch.testing.assert_close(q, expected_q, **_tol(dtype))
    torch.testing.assert_close(k, expected_k, **_tol(dtype))
    assert torch.equal(v, v_before)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("is_neox", [True, False])
@pytest.mark.parametrize("head_dim", [128, 80])
@pytest.mark.parametrize("num_tokens", [0, 1, 5, 513])
def test_fused_qk_norm_rope_matches_unfused(dtype, is_neox, head_dim, num_tokens):
    from engine import _custom_ops as ops

    heads, kv_heads = 16, 8
    with torch.device("cuda"):
        rope = RotaryEmbedding(head_dim, head_dim, 4096, 1e6, is_neox, dtype)
    q_norm, k_norm = _norm(head_dim, dtype, seed=8), _norm(head_dim, dtype, seed=9)
    qkv = _randn(num_tokens, (heads + 2 * kv_heads) * head_dim, dtype=dtype, seed=10, scale=2)
    q, k, v = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    positions = torch.randint(0, 4096, (num_tokens,), device="cuda")
    q_ref = q_norm.forward_native(q.reshape(num_tokens, heads, head_dim)).view(q.shape)
    k_ref = k_norm.forward_native(k.reshape(num_tokens, kv_heads, head_dim)).view(k.shape)
    q_ref, k_ref = rope.forward_native(positions, q_ref, k_ref)
    v_before = v.clone()
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
    torch.testing.assert_close(q, q_ref, **_tol(dtype))
    torch.testing.assert_close(k, k_ref, **_tol(dtype))
    assert torch.equal(v, v_before)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_tokens", [0, 1, 300])
@pytest.mark.parametrize("inter", [3072, 11008])
def test_silu_and_mul(dtype, num_tokens, inter):
    act = SiluAndMul()
    cuda_calls = record_calls(act, "forward_cuda")
    x = _randn(num_tokens, 2 * inter, dtype=dtype, seed=11, scale=3)
    out = act(x)
    assert len(cuda_calls) == 1  # the module call ran the kernel path
    torch.testing.assert_close(out, act.forward_native(x), **_tol(dtype))


def _decoder_ops(norm, rope, act, x, r, qkv, positions, gate_up):
    """One layer's worth of the fused ops, as the model calls them."""
    h, r = norm(x, r)
    q, k, _ = qkv.split([16 * 128, 8 * 128, 8 * 128], dim=-1)
    rope(positions, q, k)
    return h, r, act(gate_up)


def test_ops_never_sync_and_replay_in_a_cuda_graph():
    dtype = torch.bfloat16
    norm = _norm(1024, dtype)
    with torch.device("cuda"):
        rope = RotaryEmbedding(128, 128, 4096, 1e6, True, dtype)
    act = SiluAndMul()

    def fresh(seed):
        return (
            _randn(4, 1024, dtype=dtype, seed=seed),
            _randn(4, 1024, dtype=dtype, seed=seed + 1),
            _randn(4, 32 * 128, dtype=dtype, seed=seed + 2),
            torch.randint(0, 4096, (4,), device="cuda"),
            _randn(4, 2 * 3072, dtype=dtype, seed=seed + 3),
        )

    static = fresh(0)
    _decoder_ops(norm, rope, act, *[t.clone() for t in static])  # compile outside the graph
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        _decoder_ops(norm, rope, act, *[t.clone() for t in static])
    finally:
        torch.cuda.set_sync_debug_mode("default")

    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        h, r, gated = _decoder_ops(norm, rope, act, *static)
    new = fresh(100)
    for dst, src in zip(static, new):
        dst.copy_(src)
    graph.replay()
    torch.cuda.synchronize()
    x, res, qkv, positions, gate_up = new
    h_ref, r_ref = norm.forward_native(x, res)
    q, k, _ = qkv.split([16 * 128, 8 * 128, 8 * 128], dim=-1)
    q_ref, k_ref = rope.forward_native(positions, q, k)
    torch.testing.assert_close(h, h_ref, **_tol(dtype))
    torch.testing.assert_close(r, r_ref, atol=0, rtol=0)
    torch.testing.assert_close(static[2][:, : 16 * 128], q_ref, **_tol(dtype))
    torch.testing.assert_close(static[2][:, 16 * 128 : 24 * 128], k_ref, **_tol(dtype))
    torch.testing.assert_close(gated, act.forward_native(gate_up), **_tol(dtype))


def test_sampling_metadata_refresh_does_not_sync():
    from engine.sampling_params import SamplingParams
    from engine.v1.sample.logits_processor import build_logitsprocs
    from engine.v1.worker.gpu_input_batch import CachedRequestState, InputBatch
    from tests.v1.sample.utils import make_glassbox_config

    device = torch.device("cuda")
    batch = InputBatch(
        max_num_reqs=8,
        max_model_len=64,
        max_num_batched_tokens=64,
        device=device,
        pin_memory=True,
        vocab_size=128,
        block_sizes=[4],
        kernel_block_sizes=[4],
        logitsprocs=build_logitsprocs(make_glassbox_config(8), device, True),
    )
    params = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.8, top_k=5, top_p=0.9, seed=1),
        SamplingParams(temperature=0.5, repetition_penalty=1.2, allowed_token_ids=[1, 2, 3]),
    ]
    for i, sp in enumerate(params):
        gen = torch.Generator(device="cuda").manual_seed(sp.seed) if sp.seed is not None else None
        batch.add_request(
            CachedRequestState(
                req_id=f"r{i}",
                prompt_token_ids=[1, 2, 3 + i],
                mm_features=[],
                sampling_params=sp,
                generator=gen,
                block_ids=([1],),
                num_computed_tokens=0,
                output_token_ids=[],
            )
        )
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        batch.refresh_metadata()
        md = batch.sampling_metadata
        batch.refresh_metadata()
        assert batch.sampling_metadata is md
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert md.temperature.is_cuda and md.top_k.tolist() == [128, 5, 128]
    assert md.prompt_token_ids.tolist() == [[1, 2, 3], [1, 2, 4], [1, 2, 5]]
    assert md.allowed_token_ids_mask[2].logical_not().nonzero().flatten().tolist() == [1, 2, 3]


@pytest.fixture(scope="module")
def tiny_qwen3(tmp_path_factory):
    from tests.helpers.hf_checkpoints import save_tiny_checkpoint

    path = tmp_path_factory.mktemp("tiny_qwen3")
    save_tiny_checkpoint("qwen3", path)
    return str(path)


def _greedy(model, dtype, logprobs=None):
    from engine import LLM, SamplingParams

    g = torch.Generator().manual_seed(1)
    prompts = [
        {"prompt_token_ids": torch.randint(3, 256, (n,), generator=g).tolist()}
        for n in (3, 17, 64, 150)
    ]
    llm = LLM(
        model,
        skip_tokenizer_init=True,
        device="cuda",
        dtype=dtype,
        max_model_len=512,
        num_gpu_blocks_override=128,
        max_num_seqs=8,
        **decode_graphs(),
    )
    outs = llm.generate(
        prompts,
        SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=logprobs),
        use_tqdm=False,
    )
    llm.shutdown()
    return [o.outputs[0] for o in outs]


def test_qwen3_custom_ops_on_and_off_agree(tiny_qwen3, monkeypatch):
    fused = _greedy(tiny_qwen3, "float32")
    monkeypatch.setenv(DISABLE_CUSTOM_OPS_ENV, "1")
    native = _greedy(tiny_qwen3, "float32")
    assert [o.token_ids for o in fused] == [o.token_ids for o in native]


def test_qwen3_bf16_logprobs_close_with_and_without_custom_ops(tiny_qwen3, monkeypatch):
    # bf16 rounds differently with and without fusion (the Triton ops keep fp32
    # between stages; the native path rounds after each op), so compare each to
    # an fp32 run: the fused path must be no farther from fp32 than the native one.
    reference = _greedy(tiny_qwen3, "float32", logprobs=5)
    fused = _greedy(tiny_qwen3, "bfloat16", logprobs=5)
    monkeypatch.setenv(DISABLE_CUSTOM_OPS_ENV, "1")
    native = _greedy(tiny_qwen3, "bfloat16", logprobs=5)
    fused_err = native_err = 0.0
    for ref, a, b in zip(reference, fused, native):
        # The first generated position: same prompt, so no earlier divergence.
        first_ref, first_a, first_b = ref.logprobs[0], a.logprobs[0], b.logprobs[0]
        common = set(first_ref) & set(first_a) & set(first_b)
        assert len(common) >= 3, (first_ref, first_a, first_b)
        for token in common:
            fused_err = max(fused_err, abs(first_a[token].logprob - first_ref[token].logprob))
            native_err = max(native_err, abs(first_b[token].logprob - first_ref[token].logprob))
    assert fused_err < 0.1, (fused_err, native_err)
    assert fused_err <= 1.5 * native_err + 1e-2, (fused_err, native_err)
