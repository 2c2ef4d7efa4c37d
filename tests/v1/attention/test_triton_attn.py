"""The Triton attention backend against the plain-torch oracle (``cpu_attn``).

Each case scatters a batch of requests over random, non-contiguous KV blocks
of a cache filled with noise (so reading a wrong block shows), runs both
backends on identical copies, and compares outputs and the caches after the
K/V write. Query/key/value are views of one fused QKV tensor, as the models
pass them.

Where the kernels run:
  * without CUDA (CI), the small-shape checks run on the CPU in Triton's NumPy
    interpreter (fp32, tolerance 1e-4), in a worker process -- see
    ``kernels`` below for why not in this one;
  * with CUDA, the same small checks run compiled on the GPU, in this
    process, and the tests marked ``gpu`` add realistic shapes in fp32 (1e-4)
    and bf16 (relative error <= 1e-2), plus a CUDA-graph capture/replay of
    decode steps.
``test_kernels_compile_for_sm90`` compiles every kernel for an H100/H200
target even without a GPU, so a GPU-only compile error shows up in CI.
"""

from __future__ import annotations

import random
import sys
import textwrap
from types import SimpleNamespace

import pytest
import torch

from engine.config.device import DeviceConfig
from engine.v1.attention.backend import CommonAttentionMetadata
from engine.v1.attention.backends.triton_attn import (
    TritonAttentionBackend,
    TritonAttentionImpl,
    TritonAttentionMetadataBuilder,
)
from engine.v1.attention.ops import (
    triton_decode_attention,
    triton_reshape_and_cache_flash,
)
from engine.v1.attention.selector import ATTENTION_BACKEND_ENV, get_attn_backend
from tests.helpers.attention_batches import cpu_attn_fp32, scatter_requests
from tests.helpers.triton_interpret import interpreting_worker, run_without_interpreter

HAS_CUDA = torch.cuda.device_count() > 0  # NVML: is_available() would poison fork
# Small checks: compiled on the GPU when there is one, else interpreted on the CPU.
SMALL_DEVICE = torch.device("cuda" if HAS_CUDA else "cpu")


@pytest.fixture(scope="module")
def kernels():
    """``kernels(check, *args)`` runs ``check(*args)`` where Triton kernels can run.

    With CUDA: here, compiled. Without: in a worker process started with
    ``TRITON_INTERPRET=1`` (``tests/helpers/triton_interpret.py`` says why a
    fresh process). Checks are module-level functions (picklable).
    """
    if HAS_CUDA:
        yield lambda check, *args: check(*args)
        return
    with interpreting_worker(
        "engine.v1.attention.ops.triton_unified_attention", "kernel_unified_attention"
    ) as run:
        yield run


# ----------------------------------------------------------------------------
# Building a batch and running both backends
# ----------------------------------------------------------------------------
def make_batch(
    contexts, *, H, H_KV, D, BS, dtype, device, seed=0, pad_reqs=0, pad_tokens=0, pad_style="empty"
):
    """contexts: per request (num_cached_tokens, num_new_tokens).

    Padding as for a CUDA-graph batch: ``pad_tokens`` tokens with slot -1 and
    ``pad_reqs`` requests with seq_len 0, either of length 0
    (``pad_style="empty"``) or owning one padding token each ("one_token").
    """
    kv_cache, tables, slots, q, k, v = scatter_requests(
        contexts,
        H=H,
        H_KV=H_KV,
        D=D,
        BS=BS,
        dtype=dtype,
        device=device,
        seed=seed,
        num_pad_slots=pad_tokens,
    )
    num_tokens = len(slots)

    num_reqs = len(contexts) + pad_reqs
    max_blocks = max(len(t) for t in tables)
    block_table = torch.zeros(num_reqs, max_blocks, dtype=torch.int32)
    for i, t in enumerate(tables):
        block_table[i, : len(t)] = torch.tensor(t)
    if pad_style == "one_token" and pad_reqs != pad_tokens:
        raise ValueError("pad_style='one_token' needs pad_reqs == pad_tokens")
    query_lens = [n for _, n in contexts] + [0 if pad_style == "empty" else 1] * pad_reqs
    qsl = torch.zeros(num_reqs + 1, dtype=torch.int32)
    qsl[1:] = torch.tensor(query_lens).cumsum(0)
    seq_lens = torch.tensor([c + n for c, n in contexts] + [0] * pad_reqs, dtype=torch.int32)
    common = CommonAttentionMetadata(
        query_start_loc=qsl.to(device),
        query_start_loc_cpu=qsl,
        seq_lens=seq_lens.to(device),
        _seq_lens_cpu=seq_lens,
        num_reqs=num_reqs,
        num_actual_tokens=num_tokens,
        max_query_len=max(query_lens),
        max_seq_len=int(seq_lens.max()),
        block_table_tensor=block_table.to(device),
        slot_mapping=torch.tensor(slots, dtype=torch.int64).to(device),
    )
    return SimpleNamespace(
        q=q,
        k=k,
        v=v,
        kv_cache=kv_cache.to(device),
        common=common,
        contexts=contexts,
        slots=slots,
        H=H,
        H_KV=H_KV,
        D=D,
        BS=BS,
    )


def reference(b):
    """cpu_attn in float32 (on the batch's device) on float32 copies of the inputs.

    Real requests only: cpu_attn knows nothing of padding. Returns (output of
    the real tokens, cache after the write).
    """
    n_real = sum(n for _, n in b.contexts)
    r = len(b.contexts)
    c = b.common
    qsl = c.query_start_loc_cpu[: r + 1]
    common = CommonAttentionMetadata(
        query_start_loc=qsl.to(c.query_start_loc.device),
        query_start_loc_cpu=qsl,
        seq_lens=c.seq_lens[:r],
        _seq_lens_cpu=c.seq_lens_cpu[:r],
        num_reqs=r,
        num_actual_tokens=n_real,
        max_query_len=int((qsl[1:] - qsl[:-1]).max()),
        max_seq_len=int(c.seq_lens_cpu[:r].max()),
        block_table_tensor=c.block_table_tensor[:r],
        slot_mapping=c.slot_mapping[:n_real],
    )
    return cpu_attn_fp32(b, common)


def run_triton(b, split_kv_max_reqs=None):
    """TRITON_ATTN on a copy of the cache; returns (output, cache, impl, metadata)."""
    impl = TritonAttentionImpl(b.H, b.D, b.D**-0.5, b.H_KV)
    if split_kv_max_reqs is not None:
        impl.split_kv_max_reqs = split_kv_max_reqs
    cache = b.kv_cache.clone()
    out = torch.full_like(b.q, float("nan"))  # untouched rows stay NaN
    md = TritonAttentionMetadataBuilder(b.BS, b.q.device).build(b.common)
    impl.forward(None, b.q, b.k, b.v, cache, md, out)
    return out, cache, impl, md


def check_fp32(b, split_kv_max_reqs=None, expect_split=None):
    out, cache, impl, md = run_triton(b, split_kv_max_reqs)
    if expect_split is not None:
        assert impl.use_split_kv(md) is expect_split
    ref_out, ref_cache = reference(b)
    n_real = ref_out.shape[0]
    torch.testing.assert_close(out[:n_real], ref_out, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(cache, ref_cache, atol=0, rtol=0)  # copies are exact
    return out


def relative_error(x: torch.Tensor, ref: torch.Tensor) -> float:
    return float((x.float() - ref).norm() / ref.norm())


DECODES = [(9, 1), (3, 1), (15, 1)]
CASES = {
    "prefill": [(0, 7)],
    "one_token_prompt": [(0, 1)],
    "decodes": DECODES,
    "prefix_hit_prefill": [(8, 5)],  # two cached blocks, then a prefill
    "chunk_mid_block": [(6, 4)],  # a chunked prefill resuming mid-block
    "mixed": [(0, 10), (12, 1), (4, 6), (2, 1)],
    "long_prefill_many_tiles": [(37, 45), (0, 70)],  # > one 32-key tile, > one query block
}


# ----------------------------------------------------------------------------
# Small shapes: interpreter on CPU (CI), compiled on CUDA when present.
# Each check_* function runs inside ``kernels`` (maybe in the worker).
# ----------------------------------------------------------------------------
def check_case(contexts, H=4, H_KV=2, D=16, split_kv_max_reqs=None, expect_split=None, seed=0):
    b = make_batch(
        contexts, H=H, H_KV=H_KV, D=D, BS=4, dtype=torch.float32, device=SMALL_DEVICE, seed=seed
    )
    check_fp32(b, split_kv_max_reqs, expect_split)


@pytest.mark.parametrize("case", list(CASES))
def test_matches_cpu_attn(kernels, case):
    kernels(check_case, CASES[case])


@pytest.mark.parametrize("path", ["unified", "split_kv"])
def test_decode_paths(kernels, path):
    """Decode-only batches through either kernel (auto picks split-KV when small)."""
    if path == "unified":
        kernels(check_case, DECODES, 4, 2, 16, 0, False)
    else:
        kernels(check_case, DECODES, 4, 2, 16, None, True)  # 3 requests <= 128 // 2: automatic


@pytest.mark.parametrize("head_size", [64, 80])
@pytest.mark.parametrize("num_heads,num_kv_heads", [(2, 2), (4, 2), (8, 2), (6, 2)])
def test_gqa_and_head_sizes(kernels, num_heads, num_kv_heads, head_size):
    """GQA ratios 1, 2, 4 and 3 (a group that is not a power of two), head
    sizes 64 and 80 (not a power of two: padded to 128 and masked); a mixed
    batch (unified kernel) and a decode batch (split-KV)."""
    kernels(check_case, [(0, 6), (13, 1), (5, 4)], num_heads, num_kv_heads, head_size)
    kernels(check_case, [(20, 1), (0, 1)], num_heads, num_kv_heads, head_size, None, True, 1)


def check_split_kv_context_lengths():
    contexts = [(0, 1), (15, 1), (16, 1), (255, 1), (256, 1), (600, 1)]
    b = make_batch(contexts, H=4, H_KV=2, D=16, BS=4, dtype=torch.float32, device=SMALL_DEVICE)
    c = b.common
    key_cache, value_cache = b.kv_cache.unbind(0)
    triton_reshape_and_cache_flash.triton_reshape_and_cache_flash(
        b.k, b.v, key_cache, value_cache, c.slot_mapping
    )
    split_out = torch.empty(
        len(contexts), b.H, triton_decode_attention.NUM_KV_SPLITS, b.D, device=SMALL_DEVICE
    )
    split_lse = torch.empty(split_out.shape[:3], device=SMALL_DEVICE)
    out = torch.empty_like(b.q)
    triton_decode_attention.decode_attention_fwd(
        b.q,
        key_cache,
        value_cache,
        out,
        c.query_start_loc,
        c.seq_lens,
        c.block_table_tensor,
        split_out,
        split_lse,
        b.D**-0.5,
    )
    ref_out, _ = reference(b)
    torch.testing.assert_close(out, ref_out, atol=1e-4, rtol=1e-4)


def test_split_kv_decode_context_lengths(kernels):
    """decode_attention_fwd on its own: contexts that end inside, exactly at
    and just past slice boundaries (16 slices of 16-key tiles), and one
    spanning many slices, with more than one tile per slice."""
    kernels(check_split_kv_context_lengths)


def test_split_kv_workspace_is_checked():
    q = torch.zeros(2, 4, 16)
    cache = torch.zeros(3, 4, 2, 16)
    qsl = torch.tensor([0, 1, 2], dtype=torch.int32)
    args = (q, cache, cache, q.clone(), qsl, qsl[1:], torch.zeros(2, 1, dtype=torch.int32))
    with pytest.raises(ValueError, match="too small"):
        triton_decode_attention.decode_attention_fwd(
            *args, torch.zeros(1, 4, 16, 16), torch.zeros(1, 4, 16), 1.0
        )
    with pytest.raises(ValueError, match="power of two"):
        triton_decode_attention.decode_attention_fwd(
            *args, torch.zeros(2, 4, 12, 16), torch.zeros(2, 4, 12), 1.0
        )


def check_padded_decode_batch(path, pad_style):
    b = make_batch(
        DECODES,
        H=4,
        H_KV=2,
        D=16,
        BS=4,
        dtype=torch.float32,
        device=SMALL_DEVICE,
        pad_reqs=2,
        pad_tokens=2,
        pad_style=pad_style,
    )
    out = check_fp32(
        b, split_kv_max_reqs=0 if path == "unified" else None, expect_split=path == "split_kv"
    )
    padding_rows = out[len(DECODES) :]
    if pad_style == "empty":
        assert torch.isnan(padding_rows).all()
    else:
        assert torch.count_nonzero(padding_rows) == 0


@pytest.mark.parametrize("pad_style", ["empty", "one_token"])
@pytest.mark.parametrize("path", ["unified", "split_kv"])
def test_padded_decode_batch(kernels, path, pad_style):
    """A decode batch padded as for a CUDA graph: two tokens with slot -1 and
    two requests with seq_len 0 (of length 0, or owning one padding token
    each). Real rows match; padding writes nothing to the cache; padding rows
    are left alone (no owner) or zero (an owner with an empty context)."""
    kernels(check_padded_decode_batch, path, pad_style)


def check_reshape_and_cache():
    H_KV, D, BS, num_blocks = 2, 80, 4, 6
    k = torch.randn(5, H_KV, 2 * D, device=SMALL_DEVICE)[..., :D]  # strided rows and heads
    v = torch.randn(5, H_KV, D, device=SMALL_DEVICE)
    kv_cache = torch.randn(2, num_blocks, BS, H_KV, D, device=SMALL_DEVICE)
    before = kv_cache.clone()
    slots = torch.tensor([13, 2, -1, 23, -1], dtype=torch.int64, device=SMALL_DEVICE)
    key_cache, value_cache = kv_cache.unbind(0)
    triton_reshape_and_cache_flash.triton_reshape_and_cache_flash(
        k, v, key_cache, value_cache, slots
    )
    expected = before.clone()
    for t, s in enumerate(slots.tolist()):
        if s >= 0:
            expected[0, s // BS, s % BS], expected[1, s // BS, s % BS] = k[t], v[t]
    torch.testing.assert_close(kv_cache, expected, atol=0, rtol=0)


def test_reshape_and_cache_writes_only_real_slots(kernels):
    kernels(check_reshape_and_cache)


def check_non_causal():
    b = make_batch(
        [(3, 5), (0, 6)], H=4, H_KV=2, D=16, BS=4, dtype=torch.float32, device=SMALL_DEVICE
    )
    b.common.causal = False
    out, cache, _, _ = run_triton(b)
    start = 0
    for i, (cached, new) in enumerate(b.contexts):
        seq_len = cached + new
        blocks = b.common.block_table_tensor[i, : -(-seq_len // b.BS)].long()
        k = cache[0][blocks].flatten(0, 1)[:seq_len].repeat_interleave(2, dim=1)  # [L, H, D]
        v = cache[1][blocks].flatten(0, 1)[:seq_len].repeat_interleave(2, dim=1)
        q = b.q[start : start + new]
        probs = (torch.einsum("qhd,khd->hqk", q, k) * b.D**-0.5).softmax(-1)
        torch.testing.assert_close(
            out[start : start + new], torch.einsum("hqk,khd->qhd", probs, v), atol=1e-4, rtol=1e-4
        )
        start += new


def test_non_causal_attends_to_whole_context(kernels):
    """causal=False (encoder-style): every query row sees every key."""
    kernels(check_non_causal)


def test_profile_run_returns_zeros_without_metadata():
    impl = TritonAttentionImpl(4, 16, 0.25, 2)
    out = torch.ones(3, 4, 16)
    impl.forward(
        None, torch.randn(3, 4, 16), torch.randn(3, 2, 16), torch.randn(3, 2, 16), None, None, out
    )
    assert torch.count_nonzero(out) == 0


def test_bad_shapes_are_rejected():
    with pytest.raises(ValueError, match="num_kv_heads"):
        TritonAttentionImpl(6, 64, 0.125, 4)
    with pytest.raises(ValueError, match="head_size"):
        TritonAttentionImpl(4, 512, 0.125, 2)


def test_backend_interface():
    assert TritonAttentionBackend.get_name() == "TRITON_ATTN"
    assert TritonAttentionBackend.get_impl_cls() is TritonAttentionImpl
    assert TritonAttentionBackend.get_builder_cls() is TritonAttentionMetadataBuilder
    assert TritonAttentionBackend.supports_cudagraph is True
    # Mixed batches in any order, as vLLM's: the runner never reorders for it.
    assert TritonAttentionMetadataBuilder(16, SMALL_DEVICE).reorder_batch_threshold is None
    assert TritonAttentionBackend.get_kv_cache_shape(10, 16, 8, 128) == (2, 10, 16, 8, 128)


def test_metadata_holds_no_host_tensors():
    """forward must not sync with the host: everything it reads per request is
    on the batch's device (CPU here only because the batch is)."""
    b = make_batch(
        CASES["mixed"], H=4, H_KV=2, D=16, BS=4, dtype=torch.float32, device=SMALL_DEVICE
    )
    md = TritonAttentionMetadataBuilder(b.BS, SMALL_DEVICE).build(b.common)
    tensors = [v for v in vars(md).values() if isinstance(v, torch.Tensor)]
    assert len(tensors) == 4 and all(t.device.type == SMALL_DEVICE.type for t in tensors)
    # Views of the runner's buffers, not copies (persistent addresses for CUDA graphs).
    assert md.block_table.data_ptr() == b.common.block_table_tensor.data_ptr()
    assert md.slot_mapping.data_ptr() == b.common.slot_mapping.data_ptr()


# ----------------------------------------------------------------------------
# The kernels compile for the GPU (no GPU needed)
# ----------------------------------------------------------------------------
_COMPILE_SCRIPT = textwrap.dedent(
    """
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from engine.v1.attention.ops import triton_decode_attention as dec
    from engine.v1.attention.ops import triton_reshape_and_cache_flash as rc
    from engine.v1.attention.ops import triton_unified_attention as ua

    target = GPUTarget("cuda", 90, 32)  # H100 / H200

    def compile_kernel(fn, types, constexprs):
        signature = {n: "constexpr" if n in constexprs else types(n) for n in fn.arg_names}
        # As the launcher does at run time: pointers and strides divisible by 16.
        attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(fn.arg_names)
                 if n not in constexprs and (signature[n].startswith("*") or "stride" in n)}
        kernel = triton.compile(ASTSource(fn, signature, constexprs, attrs), target=target)
        assert kernel.metadata.shared <= 227 * 1024, (fn.__name__, kernel.metadata.shared)

    def types_for(dtype):
        def types(name):
            if name in ("block_tables_ptr", "seq_lens_ptr", "query_start_loc_ptr"):
                return "*i32"
            if name == "slot_mapping_ptr":
                return "*i64"
            if name in ("split_out_ptr", "split_lse_ptr"):
                return "*fp32"
            if name.endswith("_ptr"):
                return "*" + dtype
            return "fp32" if name == "scale" else "i32"
        return types

    # A handful of representative specialisations (each costs seconds to build).
    cases = (("bf16", 128, 2, 64), ("fp32", 128, 4, 16), ("bf16", 80, 3, 16))
    for dtype, head_size, group, block_m in cases:
        precision = "ieee" if dtype == "fp32" else "tf32"
        padded = triton.next_power_of_2(head_size)
        compile_kernel(ua.kernel_unified_attention, types_for(dtype), dict(
            num_queries_per_kv=group, BLOCK_SIZE=16, HEAD_SIZE=head_size,
            HEAD_SIZE_PADDED=padded, TILE_SIZE=32, BLOCK_Q=block_m // group, BLOCK_M=block_m,
            CAUSAL=True, DOT_PRECISION=precision))
        compile_kernel(dec._fwd_grouped_kernel_stage1, types_for(dtype), dict(
            num_queries_per_kv=group, BLOCK_H=16, BLOCK_SIZE=16, HEAD_SIZE=head_size,
            HEAD_SIZE_PADDED=padded, TILE_SIZE=16, NUM_KV_SPLITS=16, DOT_PRECISION=precision))
    # The launcher turns integer arguments equal to 1 into constants (one request,
    # one block per row): the loop-carried binary search must still type-check.
    compile_kernel(ua.kernel_unified_attention, types_for("bf16"), dict(
        num_seqs=1, block_table_stride=1, num_queries_per_kv=2, BLOCK_SIZE=16, HEAD_SIZE=128,
        HEAD_SIZE_PADDED=128, TILE_SIZE=32, BLOCK_Q=8, BLOCK_M=16, CAUSAL=False,
        DOT_PRECISION="tf32"))
    compile_kernel(dec._fwd_kernel_stage2, types_for("bf16"), dict(
        HEAD_SIZE=80, HEAD_SIZE_PADDED=128, TILE_SIZE=16, NUM_KV_SPLITS=16))
    compile_kernel(rc.reshape_and_cache_kernel_flash, types_for("bf16"), dict(
        BLOCK_SIZE=16, HEAD_SIZE=80, HEAD_SIZE_PADDED=128))
    print("compiled")
    """
)


def test_kernels_compile_for_sm90():
    """Lower every kernel to a cubin for sm_90 (bf16 and fp32; head sizes 128
    and 80; GQA groups 2, 4, 3; 16- and 64-row tiles). Runs in a fresh process
    without TRITON_INTERPRET, since in this process the kernels may be
    interpreted."""
    result = run_without_interpreter(_COMPILE_SCRIPT)
    assert result.returncode == 0 and "compiled" in result.stdout, result.stderr[-4000:]


# ----------------------------------------------------------------------------
# Selector
# ----------------------------------------------------------------------------
def _config(device: str):
    return SimpleNamespace(device_config=DeviceConfig(device))


@pytest.fixture
def no_backend_env(monkeypatch):
    monkeypatch.delenv(ATTENTION_BACKEND_ENV, raising=False)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    return monkeypatch


def test_selector_defaults(no_backend_env):
    assert get_attn_backend(None).get_name() == "CPU_ATTN"
    assert get_attn_backend(_config("cpu")).get_name() == "CPU_ATTN"
    # CUDA without FlashInfer (a None entry in sys.modules makes the import fail).
    no_backend_env.setitem(sys.modules, "engine.v1.attention.backends.flashinfer", None)
    assert get_attn_backend(_config("cuda")) is TritonAttentionBackend


def test_selector_prefers_flashinfer_when_importable(no_backend_env):
    fake_backend = type("FlashInferBackend", (), {})
    fake_module = SimpleNamespace(FlashInferBackend=fake_backend)
    no_backend_env.setitem(sys.modules, "engine.v1.attention.backends.flashinfer", fake_module)
    assert get_attn_backend(_config("cuda")) is fake_backend
    assert get_attn_backend(_config("cpu")).get_name() == "CPU_ATTN"


def test_selector_env_override(no_backend_env):
    no_backend_env.setenv(ATTENTION_BACKEND_ENV, "CPU_ATTN")
    assert get_attn_backend(_config("cuda")).get_name() == "CPU_ATTN"

    no_backend_env.setenv(ATTENTION_BACKEND_ENV, "TRITON_ATTN")
    assert get_attn_backend(_config("cuda")) is TritonAttentionBackend
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        get_attn_backend(_config("cpu"))
    no_backend_env.setenv("TRITON_INTERPRET", "1")
    assert get_attn_backend(_config("cpu")) is TritonAttentionBackend

    no_backend_env.setenv(ATTENTION_BACKEND_ENV, "FLASHINFER")
    with pytest.raises(ValueError, match="CUDA"):
        get_attn_backend(_config("cpu"))
    no_backend_env.setitem(sys.modules, "engine.v1.attention.backends.flashinfer", None)
    with pytest.raises(ImportError):  # asked for explicitly: no silent fallback
        get_attn_backend(_config("cuda"))

    no_backend_env.setenv(ATTENTION_BACKEND_ENV, "FLASH_ATTN")
    with pytest.raises(ValueError, match="CPU_ATTN.*FLASHINFER.*TRITON_ATTN"):
        get_attn_backend(_config("cpu"))


# ----------------------------------------------------------------------------
# GPU: realistic shapes, fp32 and bf16, CUDA graphs
# ----------------------------------------------------------------------------
GPU_SHAPE = {"H": 16, "H_KV": 8, "D": 128, "BS": 16}


def _decodes(n, seed, max_context=2048):
    rng = random.Random(seed)
    return [(rng.randint(0, max_context - 1), 1) for _ in range(n)]


GPU_CASES = {
    "prefill": ([(0, 2048), (0, 513), (0, 1), (0, 77)], None),
    "prefix_hit_and_chunks": ([(1024, 512), (777, 1271), (16, 300), (2000, 48)], None),
    "decode_64_unified": (_decodes(64, 0), None),  # 64 > 128 // 8: unified kernel
    "decode_64_split_kv": (_decodes(64, 1), 64),  # forced split-KV at the same batch
    "decode_8_split_kv": (_decodes(8, 2), None),  # small batch: split-KV automatically
    "mixed": (_decodes(32, 3) + [(0, 700), (1500, 300)], None),
}


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("case", list(GPU_CASES))
def test_gpu_matches_cpu_attn(case, dtype):
    contexts, split_kv_max_reqs = GPU_CASES[case]
    b = make_batch(contexts, dtype=dtype, device=torch.device("cuda"), seed=7, **GPU_SHAPE)
    if dtype == torch.float32:
        check_fp32(b, split_kv_max_reqs)
        return
    out, cache, _, _ = run_triton(b, split_kv_max_reqs)
    ref_out, ref_cache = reference(b)
    assert torch.equal(cache.float(), ref_cache)  # the K/V write is a copy
    assert not torch.isnan(out).any()
    start = 0
    for i, (_, new) in enumerate(contexts):  # per request, so one bad request cannot hide
        err = relative_error(out[start : start + new], ref_out[start : start + new])
        assert err <= 1e-2, f"request {i} {contexts[i]}: relative error {err:.2e}"
        start += new


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("head_size", [128, 80])
@pytest.mark.parametrize("num_heads,num_kv_heads", [(16, 16), (16, 8), (16, 4), (12, 4)])
def test_gpu_gqa_and_head_sizes(num_heads, num_kv_heads, head_size, dtype):
    """Compiled kernels at GQA ratios 1, 2, 4, 3 and head sizes 128 and 80: a
    mixed batch (unified kernel) and a small decode batch (split-KV)."""
    shape = {"H": num_heads, "H_KV": num_kv_heads, "D": head_size, "BS": 16}
    for contexts, expect_split in (
        ([(0, 300), (100, 1), (520, 47), (1000, 1)], False),
        (_decodes(6, 5), True),
    ):
        b = make_batch(contexts, dtype=dtype, device=torch.device("cuda"), seed=3, **shape)
        if dtype == torch.float32:
            check_fp32(b, expect_split=expect_split)
            continue
        out, cache, impl, md = run_triton(b)
        assert impl.use_split_kv(md) is expect_split
        ref_out, ref_cache = reference(b)
        assert torch.equal(cache.float(), ref_cache)
        err = relative_error(out, ref_out)
        assert err <= 1e-2, f"relative error {err:.2e}"


@pytest.mark.gpu
@pytest.mark.parametrize(
    "num_reqs,split_kv_max_reqs", [(4, None), (32, None)], ids=["split_kv", "unified"]
)
def test_gpu_cuda_graph_decode_replay(num_reqs, split_kv_max_reqs):
    """Capture one decode step in a CUDA graph over persistent metadata
    buffers, then replay it for two different steps (new contexts, block
    tables, slots and Q/K/V copied into the same buffers): each replay equals
    the eager reference."""
    device = torch.device("cuda")
    H, H_KV, D, BS = GPU_SHAPE["H"], GPU_SHAPE["H_KV"], GPU_SHAPE["D"], GPU_SHAPE["BS"]
    max_blocks = 2048 // BS
    steps = [
        make_batch(
            _decodes(num_reqs, seed), dtype=torch.float32, device=device, seed=seed, **GPU_SHAPE
        )
        for seed in (11, 12)
    ]
    num_blocks = max(s.kv_cache.shape[1] for s in steps)

    # Persistent buffers: the graph records their addresses.
    kv_cache = torch.zeros(2, num_blocks, BS, H_KV, D, device=device)
    qsl = torch.arange(num_reqs + 1, dtype=torch.int32, device=device)
    seq_lens = torch.ones(num_reqs, dtype=torch.int32, device=device)
    block_table = torch.zeros(num_reqs, max_blocks, dtype=torch.int32, device=device)
    slot_mapping = torch.full((num_reqs,), -1, dtype=torch.int64, device=device)
    q = torch.zeros(num_reqs, H, D, device=device)
    k = torch.zeros(num_reqs, H_KV, D, device=device)
    v = torch.zeros(num_reqs, H_KV, D, device=device)
    out = torch.zeros(num_reqs, H, D, device=device)
    common = CommonAttentionMetadata(
        query_start_loc=qsl,
        query_start_loc_cpu=qsl.cpu(),
        seq_lens=seq_lens,
        _seq_lens_cpu=seq_lens.cpu(),
        num_reqs=num_reqs,
        num_actual_tokens=num_reqs,
        max_query_len=1,
        max_seq_len=2048,
        block_table_tensor=block_table,
        slot_mapping=slot_mapping,
    )
    impl = TritonAttentionImpl(H, D, D**-0.5, H_KV)
    if split_kv_max_reqs is not None:
        impl.split_kv_max_reqs = split_kv_max_reqs
    md = TritonAttentionMetadataBuilder(BS, device).build(common)

    def load(step):
        kv_cache.zero_()
        kv_cache[:, : step.kv_cache.shape[1]].copy_(step.kv_cache)
        seq_lens.copy_(step.common.seq_lens)
        block_table.zero_()
        block_table[:, : step.common.block_table_tensor.shape[1]].copy_(
            step.common.block_table_tensor
        )
        slot_mapping.copy_(step.common.slot_mapping)
        q.copy_(step.q), k.copy_(step.k), v.copy_(step.v)

    # Warm up eagerly on a side stream (compiles the kernels, allocates the
    # split-KV workspace), then capture.
    load(steps[0])
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        impl.forward(None, q, k, v, kv_cache, md, out)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        impl.forward(None, q, k, v, kv_cache, md, out)

    for step in steps:
        load(step)
        out.zero_()
        graph.replay()
        torch.cuda.synchronize()
        ref_out, ref_cache = reference(step)
        torch.testing.assert_close(out, ref_out, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(kv_cache[:, : step.kv_cache.shape[1]], ref_cache, atol=0, rtol=0)
