"""The Triton GGUF dequantization kernel (gguf_kernels.py) against the torch code.

On CUDA ``ggml_dequantize`` and ``ggml_dequantize_rows`` run
``_ggml_dequantize_kernel``; here it runs in Triton's NumPy interpreter, in a
worker process started with ``TRITON_INTERPRET=1`` (see
tests/helpers/triton_interpret.py), at small shapes. The GPU versions of these
checks (larger shapes, and a GGUF model end to end) are in
tests/gpu/test_gpu_gguf.py.

* Q4_0, Q4_1, Q8_0 blocks of random bytes (every quant bit pattern, scales of
  either sign, zero and subnormal), block counts that do not fill the last
  program's tile, tiles across row boundaries, rows of a wider byte buffer,
  zero rows: float32 results equal the torch code's bit for bit, bfloat16 and
  float16 results equal its float32 result cast by torch.
* The embedding variant (row ids read by the kernel) equals
  ``ggml_dequantize_rows``.
* Compiled for sm_90 (no GPU needed) with the options the launcher passes,
  the kernel has no fused multiply-add: Q4_1's ``d * q + m`` rounds twice on
  the GPU too.
"""

from __future__ import annotations

import textwrap

import pytest
import torch

from engine.model_executor.layers.quantization.gguf_kernels import (
    GGML_Q4_0,
    GGML_Q4_1,
    GGML_Q8_0,
)
from tests.helpers.triton_interpret import interpreting_worker, run_without_interpreter

FORMATS = {"q4_0": GGML_Q4_0, "q4_1": GGML_Q4_1, "q8_0": GGML_Q8_0}
KERNELS = "engine.model_executor.layers.quantization.gguf_kernels"


@pytest.fixture(scope="module")
def kernels():
    """``kernels(check, *args)`` runs ``check(*args)`` in an interpreting worker."""
    with interpreting_worker(KERNELS, "_ggml_dequantize_kernel") as run:
        yield run


# ----------------------------------------------------------------------------
# Checks (run in the worker)
# ----------------------------------------------------------------------------
def check_dequantize(qtype: int) -> None:
    from engine.model_executor.layers.quantization.gguf_kernels import (
        _dequantize_triton,
        ggml_dequantize,
    )
    from tests.helpers.gguf_checkpoints import random_blocks

    # 16 blocks per program: 5 x 3 blocks leave the tile part empty, 37 x 2
    # spread tiles over row boundaries, 1 x 32 is one block, 0 rows none.
    for seed, (m, n) in enumerate([(5, 96), (37, 64), (1, 32), (0, 64)]):
        W = random_blocks(qtype, m, n, seed)
        want = ggml_dequantize(W, qtype, m, n)  # the torch code, float32
        got = _dequantize_triton(W, None, qtype, n, torch.float32)
        assert torch.equal(got, want), f"float32 [{m}, {n}]"
        for dtype in (torch.bfloat16, torch.float16):
            got = _dequantize_triton(W, None, qtype, n, dtype)
            assert got.dtype == dtype and torch.equal(got, want.to(dtype)), f"{dtype} [{m}, {n}]"
    # Rows of a wider buffer: row stride larger than the row.
    wide = random_blocks(qtype, 6, 128, seed=9)
    W = wide[:, : wide.shape[1] // 2]
    got = _dequantize_triton(W, None, qtype, 64, torch.float32)
    assert torch.equal(got, ggml_dequantize(W, qtype, 6, 64)), "row-strided"


def check_dequantize_rows(qtype: int) -> None:
    from engine.model_executor.layers.quantization.gguf_kernels import (
        _dequantize_triton,
        ggml_dequantize_rows,
    )
    from tests.helpers.gguf_checkpoints import random_blocks

    table = random_blocks(qtype, 11, 64, seed=3)
    for ids in (torch.tensor([[10, 0, 3], [3, 3, 7]]), torch.tensor([5], dtype=torch.int32)):
        want = ggml_dequantize_rows(table, ids, qtype, 64, torch.bfloat16)
        got = _dequantize_triton(table, ids.reshape(-1), qtype, 64, torch.bfloat16)
        assert torch.equal(got.reshape(*ids.shape, 64), want), f"ids {ids.tolist()}"


# ----------------------------------------------------------------------------
# Tests
# ----------------------------------------------------------------------------
@pytest.mark.parametrize("qtype", list(FORMATS.values()), ids=list(FORMATS))
def test_kernel_equals_torch_code(kernels, qtype):
    kernels(check_dequantize, qtype)


@pytest.mark.parametrize("qtype", list(FORMATS.values()), ids=list(FORMATS))
def test_kernel_reads_embedding_rows(kernels, qtype):
    kernels(check_dequantize_rows, qtype)


_COMPILE_SCRIPT = textwrap.dedent(
    """
    import re
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from engine.model_executor.layers.quantization import gguf_kernels as K

    fn = K._ggml_dequantize_kernel
    for qtype, nbytes in K.BYTES_PER_BLOCK.items():
        for out in ("fp32", "bf16", "fp16"):
            for has_rows in (False, True):
                constexprs = dict(QUANT_TYPE=qtype, NBYTES=nbytes, HAS_ROWS=has_rows,
                                  OUT_BF16=out == "bf16", BLOCKS=K._BLOCKS_PER_PROGRAM)
                types = {"w_ptr": "*u8", "rows_ptr": "*i64", "out_ptr": "*" + out}
                signature = {n: "constexpr" if n in constexprs else types.get(n, "i32")
                             for n in fn.arg_names}
                kernel = triton.compile(ASTSource(fn, signature, constexprs),
                                        target=GPUTarget("cuda", 90, 32),
                                        options=K._COMPILE_OPTIONS)
                ptx = kernel.asm["ptx"]
                assert "mul.rn.f32" in ptx and not re.search(r"\\bfma\\.", ptx), (qtype, out)
    print("compiled")
    """
)


def test_kernel_compiles_for_sm90_without_fma():
    """Lower the kernel for an H100/H200 in a fresh process without TRITON_INTERPRET:
    every format, output dtype and row mode; the PTX multiplies with ``mul.rn``
    (never contracted) and has no ``fma``."""
    result = run_without_interpreter(_COMPILE_SCRIPT)
    assert result.returncode == 0 and "compiled" in result.stdout, result.stderr[-4000:]
