"""The Triton LoRA kernels (engine/lora/ops/triton_ops/) against the torch ops.

On CUDA ``PunicaWrapperGPU`` runs ``lora_shrink`` and ``lora_expand``; here
they run in Triton's NumPy interpreter, in a worker process started with
``TRITON_INTERPRET=1`` (see tests/helpers/triton_interpret.py), at small
shapes in float32. The GPU versions (bf16/fp16 at model-sized shapes, and an
engine serving a mixed batch) are in tests/gpu/test_gpu_lora.py.

* ``LoRAKernelMeta``: the grouping of a known mapping (sorted indices, counts,
  start locations), refilled in place by a shorter step; too many tokens refused.
* ``lora_shrink`` / ``lora_expand`` equal ``bgmv_shrink`` / ``bgmv_expand_slice``
  over unsorted token -> slot maps mixing three slots and -1, a slot with no
  tokens, all tokens -1, one token, a slot with more tokens than one tile of
  rows; one slice and three slices of unequal widths (q/k/v under GQA); rank 8
  (masked to a 16-wide tile) and 16; widths below, at and above one ``BLOCK_K``
  step; the no-adapter early exit both on the host and inside the kernels;
  ``offset_start``, ``add_inputs=False``.
* ``PunicaWrapperGPU.add_lora_linear`` equals ``PunicaWrapperCPU.add_lora_linear``
  step after step (adapters of rank 8 and a zero-padded rank 4), with inputs
  padded past the step's tokens, and with no adapter at all.
* ``get_punica_wrapper`` keeps the torch ops off CUDA.
* Compiled for sm_90 (no GPU needed), both kernels lower in fp32, bf16 and
  fp16: the 16-bit ones on tensor-core ``mma`` instructions, the fp32 ones
  without TF32.
"""

from __future__ import annotations

import textwrap

import pytest
import torch

from engine.lora.ops.triton_ops import LoRAKernelMeta
from tests.helpers.triton_interpret import interpreting_worker, run_without_interpreter

KERNELS = "engine.lora.ops.triton_ops.lora_shrink_op"
MAX_LORAS = 3

# Both sides accumulate fp32 products of O(1) values over at most 96 terms
# (inputs ~ N(0, 1), weights ~ N(0, 1/in)), in different orders (einsum vs
# tiles of tl.dot); the measured gap is ~1e-6 absolute, and 1e-5 leaves room
# without hiding a wrong row, slot or column, which would be off by O(1).
RTOL = ATOL = 1e-5

# Token -> slot maps (-1: the base model), none sorted.
MAPPINGS = {
    # slot 1 has no token; groups interleaved with -1.
    "mixed": [2, -1, 0, 2, 0, -1, 2, 0, 2, -1, 0, 0, 2, -1, 2, 0, -1, 2, 0],
    "every_slot": [1, 0, -1, 2, 1, 1, -1, 0, 2, 2, 1, 0, -1, 1, 2, 0, 1, -1, 2, 1],
    "one_token": [1],
    "all_base": [-1] * 9,
    # 70 tokens of slot 0: two tiles of 64 rows.
    "long_group": [0] * 30 + [-1, 2] + [0] * 40,
}


@pytest.fixture(scope="module")
def kernels():
    """``kernels(check, *args)`` runs ``check(*args)`` in an interpreting worker."""
    with interpreting_worker(KERNELS, "_lora_shrink_kernel") as run:
        yield run


# ----------------------------------------------------------------------------
# Checks (run in the worker)
# ----------------------------------------------------------------------------
def _weights(gen, shape, fan_in):
    return torch.randn(*shape, generator=gen) / fan_in**0.5


def check_ops_equal_torch(mapping_name: str, in_size: int, rank: int, widths: tuple) -> None:
    from engine.lora.ops.torch_ops import bgmv_expand_slice, bgmv_shrink
    from engine.lora.ops.triton_ops import LoRAKernelMeta, lora_expand, lora_shrink

    mapping = torch.tensor(MAPPINGS[mapping_name])
    T, S = mapping.numel(), len(widths)
    gen = torch.Generator().manual_seed(T * in_size + rank)
    x = torch.randn(T, in_size, generator=gen)
    A = [_weights(gen, (MAX_LORAS, rank, in_size), in_size) for _ in widths]
    B = [_weights(gen, (MAX_LORAS, n, rank), rank) for n in widths]
    meta = LoRAKernelMeta.make(MAX_LORAS, 128, "cpu")
    meta.prepare_tensors(mapping)
    assert meta.no_lora == (mapping_name == "all_base")

    want_s = torch.empty(S, T, rank)
    for s in range(S):
        bgmv_shrink(x, A[s], want_s[s], mapping, 0.5)
    offset = 3  # columns before the slices: offset_start
    y0 = torch.randn(T, offset + sum(widths) + 2, generator=gen)
    want_y = y0.clone()
    col = offset
    for s, n in enumerate(widths):
        bgmv_expand_slice(want_s[s], B[s], want_y, mapping, col, n)
        col += n

    # The host's flag as prepared, then forced off: the kernels skip -1 themselves.
    for no_lora in {meta.no_lora, False}:
        args = (*meta.meta_args(T)[:-1], no_lora)
        got_s = torch.full((S, T, rank), float("nan"))  # every entry must be written
        lora_shrink(x, A, got_s, *args, 0.5)
        torch.testing.assert_close(got_s, want_s, rtol=RTOL, atol=ATOL)
        got_y = y0.clone()
        lora_expand(want_s, B, got_y, *args, offset_start=offset)
        torch.testing.assert_close(got_y, want_y, rtol=RTOL, atol=ATOL)

    # add_inputs=False writes the adapter rows' product over what was there.
    got_y = torch.zeros_like(y0)
    lora_expand(want_s, B, got_y, *meta.meta_args(T), offset_start=offset, add_inputs=False)
    want_y = torch.zeros_like(y0)
    col = offset
    for s, n in enumerate(widths):
        bgmv_expand_slice(want_s[s], B[s], want_y, mapping, col, n, add_inputs=False)
        col += n
    torch.testing.assert_close(got_y, want_y, rtol=RTOL, atol=ATOL)


def check_wrapper_equals_cpu_wrapper() -> None:
    from engine.lora.punica_wrapper.punica_cpu import PunicaWrapperCPU
    from engine.lora.punica_wrapper.punica_gpu import PunicaWrapperGPU

    gen = torch.Generator().manual_seed(0)
    in_size, rank, widths = 48, 8, (32, 16, 16)
    # A q/k/v layer as BaseLinearLayerWithLoRA holds it: slot 2 a rank-4
    # adapter zero-padded to rank 8, and no k adapter in slot 0.
    A = [_weights(gen, (MAX_LORAS, rank, in_size), in_size) for _ in widths]
    B = [_weights(gen, (MAX_LORAS, n, rank), rank) for n in widths]
    for a, b in zip(A, B, strict=True):
        a[2, 4:] = 0
        b[2, :, 4:] = 0
    A[1][0] = 0
    B[1][0] = 0
    cpu = PunicaWrapperCPU(32, "cpu")
    gpu = PunicaWrapperGPU(32, "cpu", max_loras=MAX_LORAS)
    steps = [  # (mapping, rows of x: more than the step's tokens when padded)
        (MAPPINGS["every_slot"], 20),
        (MAPPINGS["mixed"][:7], 12),  # a shorter step after a longer one, padded
        ([-1, -1, -1], 3),
        ([2, 2, 0, 1], 4),
    ]
    for mapping, rows in steps:
        mapping = torch.tensor(mapping, dtype=torch.long)
        for wrapper in (cpu, gpu):
            wrapper.update_metadata(mapping)
        x = torch.randn(rows, in_size, generator=gen)
        y = torch.randn(rows, sum(widths), generator=gen)
        want, got = y.clone(), y.clone()
        cpu.add_lora_linear(want, x, tuple(A), tuple(B), 0.75, widths)
        gpu.add_lora_linear(got, x, tuple(A), tuple(B), 0.75, widths)
        torch.testing.assert_close(got, want, rtol=RTOL, atol=ATOL)
        if all(s < 0 for s in mapping.tolist()):
            assert torch.equal(got, y)


# ----------------------------------------------------------------------------
# Tests
# ----------------------------------------------------------------------------
def test_kernel_meta_groups_tokens_by_slot() -> None:
    meta = LoRAKernelMeta.make(max_loras=4, max_num_tokens=10, device="cpu")
    meta.prepare_tensors(torch.tensor([1, -1, 0, 1, -1, 2, 1]))
    assert meta.token_indices_sorted_by_lora_ids[:7].tolist() == [1, 4, 2, 0, 3, 6, 5]
    assert meta.active_lora_ids.tolist() == [-1, 0, 1, 2, 3]
    assert meta.num_tokens_per_lora.tolist() == [2, 1, 3, 1, 0]
    assert meta.lora_token_start_loc.tolist() == [0, 2, 3, 6, 7, 7]
    assert not meta.no_lora and meta.num_tokens == 7
    buffers = [meta.token_indices_sorted_by_lora_ids, meta.num_tokens_per_lora]
    # A shorter step: refilled in place, nothing left of the last one.
    meta.prepare_tensors(torch.tensor([3, 3, -1], dtype=torch.int32))
    assert meta.token_indices_sorted_by_lora_ids is buffers[0]
    assert meta.num_tokens_per_lora is buffers[1]
    assert meta.token_lora_mapping.tolist() == [3, 3, -1] + [-1] * 7
    assert meta.token_indices_sorted_by_lora_ids[:3].tolist() == [2, 0, 1]
    assert meta.num_tokens_per_lora.tolist() == [1, 0, 0, 0, 2]
    assert meta.lora_token_start_loc.tolist() == [0, 1, 1, 1, 1, 3]
    mapping, sorted_ids, *_, no_lora = meta.meta_args(5)
    assert mapping.tolist() == [3, 3, -1, -1, -1] and sorted_ids.numel() == 5 and not no_lora
    meta.prepare_tensors(torch.full((4,), -1))
    assert meta.no_lora and meta.num_tokens_per_lora.tolist() == [4, 0, 0, 0, 0]
    with pytest.raises(ValueError, match="11 tokens in a step; LoRAKernelMeta holds 10"):
        meta.prepare_tensors(torch.zeros(11, dtype=torch.long))
    with pytest.raises(ValueError, match="slot 4 >= max_loras 4"):
        meta.prepare_tensors(torch.tensor([0, 4]))


@pytest.mark.parametrize(
    "mapping_name,in_size,rank,widths",
    [
        ("mixed", 40, 8, (64,)),
        ("every_slot", 64, 16, (32, 16, 16)),
        ("one_token", 96, 8, (32, 16, 16)),
        ("all_base", 40, 16, (64,)),
        ("long_group", 40, 16, (24, 8, 8)),
    ],
)
def test_shrink_and_expand_equal_torch_ops(kernels, mapping_name, in_size, rank, widths) -> None:
    kernels(check_ops_equal_torch, mapping_name, in_size, rank, widths)


def test_gpu_wrapper_equals_cpu_wrapper(kernels) -> None:
    kernels(check_wrapper_equals_cpu_wrapper)


def test_selector_keeps_torch_ops_off_cuda() -> None:
    from engine.lora.punica_wrapper import get_punica_wrapper
    from engine.lora.punica_wrapper.punica_cpu import PunicaWrapperCPU

    assert type(get_punica_wrapper(16, "cpu", max_loras=2)) is PunicaWrapperCPU


_COMPILE_SCRIPT = textwrap.dedent(
    """
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from engine.lora.ops.triton_ops import lora_expand_op, lora_shrink_op

    INDEX = ["token_indices_sorted_by_lora_ids", "num_tokens_per_lora",
             "lora_token_start_loc", "lora_ids"]

    def ptx(fn, types, constexprs):
        types = {**types, **{name: "*i64" for name in INDEX}}
        signature = {n: "constexpr" if n in constexprs else types.get(n, "i32")
                     for n in fn.arg_names}
        kernel = triton.compile(ASTSource(fn, signature, constexprs),
                                target=GPUTarget("cuda", 90, 32))
        return kernel.asm["ptx"]

    for dt in ("fp32", "bf16", "fp16"):
        precision = "ieee" if dt == "fp32" else "tf32"
        shrink = ptx(
            lora_shrink_op._lora_shrink_kernel,
            {"input_ptr": "*" + dt, "lora_ptr": "*" + dt, "lora_ptr_table": "*i64",
             "out_ptr": "*fp32", "scaling": "fp32"},
            dict(K=1024, BLOCK_M=16, BLOCK_N=16, BLOCK_K=64, DOT_PRECISION=precision),
        )
        expand = ptx(
            lora_expand_op._lora_expand_kernel,
            {"input_ptr": "*fp32", "lora_ptr": "*" + dt, "lora_table": "*i64",
             "out_ptr": "*" + dt},
            dict(K=16, BLOCK_M=64, BLOCK_N=64, BLOCK_K=16, ADD_INPUTS=True,
                 DOT_PRECISION=precision),
        )
        for code in (shrink, expand):
            if dt == "fp32":
                assert "tf32" not in code, dt
            else:
                assert "mma" in code, dt
    print("compiled")
    """
)


def test_kernels_compile_for_sm90():
    """Lower both kernels for an H100/H200 in a fresh process without TRITON_INTERPRET."""
    result = run_without_interpreter(_COMPILE_SCRIPT)
    assert result.returncode == 0 and "compiled" in result.stdout, result.stderr[-4000:]
