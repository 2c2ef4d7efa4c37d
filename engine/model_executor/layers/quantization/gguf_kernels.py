"""GGUF dequantization: llama.cpp's block formats back to floats (torch; Triton on CUDA).

vLLM twin: ``vllm/_custom_ops.py`` (``ggml_dequantize``, a wrapper around
CUDA kernels under ``csrc/quantization/gguf/``).
Read it for what a GGUF quantized tensor is. Each row of ``W [out, in]`` is
cut into blocks of 32 weights along ``in``; a block stores one or two fp16
numbers and 32 small integers, and the weights are rebuilt from them:

  Q8_0  34 bytes: d (fp16), 32 x int8 q             w = d * q
  Q4_0  18 bytes: d (fp16), 16 bytes of 4-bit q     w = d * (q - 8)
  Q4_1  20 bytes: d, m (fp16), 16 bytes of 4-bit q  w = d * q + m

In the 4-bit formats byte j of a block holds weight j in its low nibble and
weight j + 16 in its high nibble. So 32 fp32 weights (128 bytes) become 20
bytes in Q4_1: 6.4x smaller. The raw data of a quantized ``[out, in]``
tensor is ``uint8 [out, in / 32 * bytes_per_block]``: rows stay rows, which
is why the loader can concatenate the rows of q, k and v like plain weights.
Sessions: 06 (quantization).

The arithmetic is done in float32 in the same order as the ``gguf`` package's
numpy reference (``gguf.quants``), so the results are bit-identical to it,
and to the float32 folder the default model was converted into.

Two implementations of one contract: torch code (CPU, and anything not on
CUDA) and, for CUDA tensors, ``_ggml_dequantize_kernel`` (Triton). Each
program of the kernel takes a tile of ``BLOCKS`` consecutive blocks of the
flattened ``[m, n / 32]`` block grid, so block ``b`` writes outputs
``32 b .. 32 b + 31``; it reads a block's fp16 scale as two bytes combined
into a 16-bit word and bitcast (no alignment needed), and does the same
float32 operations in the same order as the torch code, with FMA contraction
off (``enable_fp_fusion=False``: ``d * q + m`` must round twice, as numpy
does), then casts to the output dtype (bfloat16 rounded to nearest even by
hand, as torch and CUDA round; Triton's interpreter would truncate). For the
embedding the kernel reads the table's rows through the token ids, without
gathering them first. Checked in Triton's interpreter and compiled for
sm_90 (tests/model_executor/test_gguf_triton.py); not yet run on a GPU.

Simpler than vLLM: the whole weight is dequantized before a plain matmul;
vLLM's CUDA path also has fused matrix-vector (MMVQ) and matrix-matrix (MMQ)
kernels that read the blocks directly, and k-quant / i-quant formats; our
dequantization kernel is Triton rather than CUDA C++, for three formats.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# GGML type ids (gguf.GGMLQuantizationType) of the formats handled here.
GGML_F32, GGML_F16, GGML_Q4_0, GGML_Q4_1, GGML_Q8_0, GGML_BF16 = 0, 1, 2, 3, 8, 30
UNQUANTIZED_TYPES = {GGML_F32, GGML_F16, GGML_BF16}
DEQUANT_TYPES = {GGML_Q4_0, GGML_Q4_1, GGML_Q8_0}
GGML_TYPE_NAMES = {0: "F32", 1: "F16", 2: "Q4_0", 3: "Q4_1", 8: "Q8_0", 30: "BF16"}
BLOCK_SIZE = 32  # weights per block in every format above
BYTES_PER_BLOCK = {GGML_Q4_0: 18, GGML_Q4_1: 20, GGML_Q8_0: 34}


def ggml_type_name(quant_type: int) -> str:
    """``3`` -> ``"Q4_1"`` (the ``gguf`` package knows every format's name)."""
    try:
        from gguf import GGMLQuantizationType

        return GGMLQuantizationType(quant_type).name
    except (ImportError, ValueError):
        return GGML_TYPE_NAMES.get(quant_type, f"GGML type {quant_type}")


def _fp16(blocks: torch.Tensor, start: int) -> torch.Tensor:
    """The fp16 stored at byte ``start`` of every block, as float32 ``[..., 1]``."""
    return blocks[..., start : start + 2].contiguous().view(torch.float16).float()


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """``uint8 [..., 16]`` -> the 32 four-bit values: low nibbles, then high."""
    return torch.cat([qs & 0x0F, qs >> 4], dim=-1)


def _check(W: torch.Tensor, quant_type: int, m: int, n: int) -> int:
    """Bytes per block of ``quant_type``, once ``W`` is ``uint8 [m, n / 32 * that]``."""
    if quant_type not in DEQUANT_TYPES:
        raise ValueError(f"cannot dequantize {ggml_type_name(quant_type)}")
    nbytes = BYTES_PER_BLOCK[quant_type]
    if n % BLOCK_SIZE or W.dtype != torch.uint8 or tuple(W.shape) != (m, n // BLOCK_SIZE * nbytes):
        raise ValueError(
            f"{ggml_type_name(quant_type)} data for a [{m}, {n}] weight must be uint8 "
            f"[{m}, {n // BLOCK_SIZE * nbytes}] with {BLOCK_SIZE} | {n}; got "
            f"{str(W.dtype).removeprefix('torch.')} {list(W.shape)}"
        )
    return nbytes


def ggml_dequantize(
    W: torch.Tensor, quant_type: int, m: int, n: int, dtype: torch.dtype | None = None
) -> torch.Tensor:
    """``W`` (raw GGUF rows, ``uint8 [m, n / 32 * bytes_per_block]``) -> ``[m, n]``.

    ``dtype``: the result's dtype (default float32; the maths is float32).
    On CUDA the Triton kernel runs, elsewhere the torch code; same bits.
    """
    nbytes = _check(W, quant_type, m, n)
    if W.is_cuda:
        return _dequantize_triton(W, None, quant_type, n, dtype or torch.float32)
    blocks = W.reshape(m, n // BLOCK_SIZE, nbytes)  # [m, blocks per row, bytes per block]
    d = _fp16(blocks, 0)  # [m, nb, 1]
    if quant_type == GGML_Q8_0:
        q = blocks[..., 2:].contiguous().view(torch.int8).float()  # [m, nb, 32]
        w = d * q
    elif quant_type == GGML_Q4_0:
        q = (_nibbles(blocks[..., 2:]).to(torch.int8) - 8).float()
        w = d * q
    else:  # Q4_1
        q = _nibbles(blocks[..., 4:]).float()
        w = d * q + _fp16(blocks, 2)
    return w.reshape(m, n).to(dtype or torch.float32)


def ggml_dequantize_rows(
    W: torch.Tensor, rows: torch.Tensor, quant_type: int, n: int, dtype: torch.dtype
) -> torch.Tensor:
    """Only the rows ``rows`` (any shape of indices) of a quantized ``[*, n]``
    table: an embedding lookup without dequantizing the whole vocabulary.
    On CUDA the kernel reads the rows in place (ids are not range-checked:
    the engine checks prompt ids against the vocabulary)."""
    if W.is_cuda:
        _check(W, quant_type, W.shape[0], n)
        out = _dequantize_triton(W, rows.reshape(-1), quant_type, n, dtype)
    else:
        picked = W[rows.reshape(-1)]
        out = ggml_dequantize(picked, quant_type, picked.shape[0], n, dtype)
    return out.reshape(*rows.shape, n)


# ----------------------------------------------------------------------------
# The Triton kernel (CUDA; on the CPU only under TRITON_INTERPRET=1, in tests)
# ----------------------------------------------------------------------------
_BLOCKS_PER_PROGRAM = 16  # GGUF blocks (of 32 weights) per program: 512 outputs
# No FMA contraction: Q4_1's d * q + m rounds twice, as in torch and numpy
# (with contraction the PTX of the Q4_1 kernel has fma.rn.f32 instead).
_COMPILE_OPTIONS = {"enable_fp_fusion": False}


@triton.jit
def _load_fp16(ptr, mask):
    """The fp16 stored little-endian at bytes ``ptr``, ``ptr + 1``, as float32."""
    lo = tl.load(ptr, mask=mask, other=0).to(tl.uint16)
    hi = tl.load(ptr + 1, mask=mask, other=0).to(tl.uint16)
    return (lo | (hi << 8)).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _cast(w, OUT_BF16: tl.constexpr, out_dtype: tl.constexpr):
    """float32 -> the output dtype, rounding as torch's ``.to`` does. bfloat16
    is rounded to nearest even by hand (torch's own bit trick, NaN kept):
    CUDA's conversion rounds so too, but Triton's interpreter truncates."""
    if OUT_BF16:
        u = w.to(tl.uint32, bitcast=True)
        u = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
        u = tl.where(w != w, 0x7FC0, u)
        return u.to(tl.uint16).to(tl.bfloat16, bitcast=True)
    else:
        return w.to(out_dtype)


@triton.jit
def _ggml_dequantize_kernel(
    w_ptr,  # uint8 [rows, blocks_per_row * NBYTES], row stride w_row_stride
    rows_ptr,  # int [num_out_rows]: which row of w each output row is (HAS_ROWS)
    out_ptr,  # [num_out_rows, blocks_per_row * 32], contiguous
    num_blocks,  # num_out_rows * blocks_per_row
    blocks_per_row,
    w_row_stride,
    QUANT_TYPE: tl.constexpr,  # GGML_Q4_0 (2), GGML_Q4_1 (3) or GGML_Q8_0 (8)
    NBYTES: tl.constexpr,  # bytes per block: 18, 20, 34
    HAS_ROWS: tl.constexpr,
    OUT_BF16: tl.constexpr,
    BLOCKS: tl.constexpr,  # blocks per program
):
    b = tl.program_id(0).to(tl.int64) * BLOCKS + tl.arange(0, BLOCKS)  # flat block ids
    mask = b < num_blocks
    out_row = b // blocks_per_row
    if HAS_ROWS:
        src_row = tl.load(rows_ptr + out_row, mask=mask, other=0).to(tl.int64)
    else:
        src_row = out_row
    block = w_ptr + src_row * w_row_stride + (b % blocks_per_row) * NBYTES  # [BLOCKS]
    d = _load_fp16(block, mask)[:, None]  # [BLOCKS, 1]
    out = out_ptr + b[:, None] * 32  # block b's 32 outputs start at 32 b
    out_dtype = out_ptr.dtype.element_ty
    if QUANT_TYPE == 8:  # Q8_0: 32 signed bytes after d
        j = tl.arange(0, 32)[None, :]
        q = tl.load(block[:, None] + 2 + j, mask=mask[:, None], other=0)
        w = d * q.to(tl.int8, bitcast=True).to(tl.float32)
        tl.store(out + j, _cast(w, OUT_BF16, out_dtype), mask=mask[:, None])
    else:  # 4-bit: byte j holds weight j (low nibble) and weight j + 16 (high)
        j = tl.arange(0, 16)[None, :]
        if QUANT_TYPE == 2:  # Q4_0: d, 16 bytes; w = d * (q - 8)
            qs = tl.load(block[:, None] + 2 + j, mask=mask[:, None], other=0)
            w_lo = d * ((qs & 0x0F).to(tl.int32) - 8).to(tl.float32)
            w_hi = d * ((qs >> 4).to(tl.int32) - 8).to(tl.float32)
        else:  # Q4_1: d, m, 16 bytes; w = d * q + m (two roundings: no FMA)
            m = _load_fp16(block + 2, mask)[:, None]
            qs = tl.load(block[:, None] + 4 + j, mask=mask[:, None], other=0)
            w_lo = d * (qs & 0x0F).to(tl.float32) + m
            w_hi = d * (qs >> 4).to(tl.float32) + m
        tl.store(out + j, _cast(w_lo, OUT_BF16, out_dtype), mask=mask[:, None])
        tl.store(out + 16 + j, _cast(w_hi, OUT_BF16, out_dtype), mask=mask[:, None])


def _dequantize_triton(
    W: torch.Tensor, rows: torch.Tensor | None, quant_type: int, n: int, dtype: torch.dtype
) -> torch.Tensor:
    """Launch the kernel: all of ``W``'s rows (``rows=None``) or ``W[rows]``."""
    if W.shape[1] and W.stride(1) != 1:
        raise ValueError(f"GGUF data must have contiguous rows, got strides {W.stride()}")
    num_rows = W.shape[0] if rows is None else rows.numel()
    out = torch.empty(num_rows, n, dtype=dtype, device=W.device)
    num_blocks = num_rows * (n // BLOCK_SIZE)
    if num_blocks == 0:
        return out
    _ggml_dequantize_kernel[(triton.cdiv(num_blocks, _BLOCKS_PER_PROGRAM),)](
        W,
        W if rows is None else rows,  # unread without HAS_ROWS
        out,
        num_blocks,
        n // BLOCK_SIZE,
        W.stride(0),
        QUANT_TYPE=quant_type,
        NBYTES=BYTES_PER_BLOCK[quant_type],
        HAS_ROWS=rows is not None,
        OUT_BF16=dtype == torch.bfloat16,
        BLOCKS=_BLOCKS_PER_PROGRAM,
        **_COMPILE_OPTIONS,
    )
    return out
