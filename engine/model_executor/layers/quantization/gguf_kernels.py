"""GGUF dequantization: llama.cpp's block formats back to floats, in torch.

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
and to the float32 folder the default model was converted into. Simpler
than vLLM: the whole weight is dequantized before a plain matmul; vLLM's
CUDA path also has fused matrix-vector (MMVQ) and matrix-matrix (MMQ)
kernels that read the blocks directly, and k-quant / i-quant formats.
"""

from __future__ import annotations

import torch

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


def ggml_dequantize(
    W: torch.Tensor, quant_type: int, m: int, n: int, dtype: torch.dtype | None = None
) -> torch.Tensor:
    """``W`` (raw GGUF rows, ``uint8 [m, n / 32 * bytes_per_block]``) -> ``[m, n]``.

    ``dtype``: the result's dtype (default float32; the maths is float32).
    """
    if quant_type not in DEQUANT_TYPES:
        raise ValueError(f"cannot dequantize {ggml_type_name(quant_type)}")
    nbytes = BYTES_PER_BLOCK[quant_type]
    if n % BLOCK_SIZE or W.dtype != torch.uint8 or tuple(W.shape) != (m, n // BLOCK_SIZE * nbytes):
        raise ValueError(
            f"{ggml_type_name(quant_type)} data for a [{m}, {n}] weight must be uint8 "
            f"[{m}, {n // BLOCK_SIZE * nbytes}] with {BLOCK_SIZE} | {n}; got "
            f"{str(W.dtype).removeprefix('torch.')} {list(W.shape)}"
        )
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
    table: an embedding lookup without dequantizing the whole vocabulary."""
    picked = W[rows.reshape(-1)]
    out = ggml_dequantize(picked, quant_type, picked.shape[0], n, dtype)
    return out.reshape(*rows.shape, n)
