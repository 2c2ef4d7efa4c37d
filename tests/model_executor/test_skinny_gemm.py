"""The Triton skinny GEMM (engine/model_executor/layers/skinny_gemm.py) against F.linear.

The kernel runs in Triton's NumPy interpreter in a worker process
(tests/helpers/triton_interpret.py), in float32 at small shapes: the sums are float32 in
both, in a different order, so the tolerance is a few float32 ulps of the outputs (~1).
Covered: one row (the multiply-and-sum path) and 2..16 rows (the tl.dot path), N and K
that are not multiples of the tile, a bias, a strided x, leading batch dims, zero rows,
and the argument checks. The GPU timing against cuBLAS is benchmarks/skinny_gemm.py.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine.model_executor.layers.skinny_gemm import (
    SKINNY_GEMM_MAX_ROWS,
    SkinnyGemmConfig,
    skinny_gemm,
)
from tests.helpers.triton_interpret import interpreting_worker

TOL = {"atol": 1e-5, "rtol": 1e-5}


@pytest.fixture(scope="module")
def kernels():
    with interpreting_worker(
        "engine.model_executor.layers.skinny_gemm", "_skinny_gemm_kernel"
    ) as run:
        yield run


def check_matches_linear(rows: int, n: int, k: int, bias: bool, block_n: int, block_k: int):
    torch.manual_seed(rows * 1000 + n + k)
    x = torch.randn(rows, k)
    w = torch.randn(n, k) / k**0.5
    b = torch.randn(n) if bias else None
    got = skinny_gemm(x, w, b, SkinnyGemmConfig(block_n=block_n, block_k=block_k))
    assert got.shape == (rows, n) and got.dtype == x.dtype
    torch.testing.assert_close(got, F.linear(x, w, b), **TOL)


def check_views_and_empty():
    torch.manual_seed(0)
    w = torch.randn(40, 48)
    # x as a column slice of a wider tensor (row stride 96), with leading dims [2, 3].
    wide = torch.randn(2, 3, 96)
    x = wide[..., :48]
    got = skinny_gemm(x, w)
    assert got.shape == (2, 3, 40)
    torch.testing.assert_close(got, F.linear(x, w), **TOL)
    empty = skinny_gemm(torch.randn(0, 48), w)
    assert empty.shape == (0, 40)


@pytest.mark.parametrize(
    "rows,n,k,bias,block_n,block_k",
    [
        (1, 40, 48, False, 8, 32),  # N and K not multiples of the tile
        (1, 64, 64, True, 16, 64),
        (3, 40, 80, True, 16, 32),  # tl.dot path, ragged
        (SKINNY_GEMM_MAX_ROWS, 32, 64, False, 32, 16),
    ],
)
def test_matches_linear(kernels, rows, n, k, bias, block_n, block_k):
    kernels(check_matches_linear, rows, n, k, bias, block_n, block_k)


def test_views_and_empty(kernels):
    kernels(check_views_and_empty)


def test_rejects_bad_arguments():
    x, w = torch.randn(2, 8), torch.randn(4, 8)
    with pytest.raises(ValueError, match=r"weight must be \[N, 8\]"):
        skinny_gemm(x, torch.randn(4, 6))
    with pytest.raises(ValueError, match="contiguous"):
        skinny_gemm(x, torch.randn(8, 4).t())
    with pytest.raises(ValueError, match="torch.float16"):
        skinny_gemm(x.half(), w)
    with pytest.raises(ValueError, match=r"bias must be \[4\]"):
        skinny_gemm(x, w, torch.randn(5))
    with pytest.raises(ValueError, match="at most 16"):
        skinny_gemm(torch.randn(SKINNY_GEMM_MAX_ROWS + 1, 8), w)
