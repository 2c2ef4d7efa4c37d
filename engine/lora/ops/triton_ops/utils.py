"""Per-slice weight tables and tile sizes for the Triton LoRA kernels.

vLLM twin: ``vllm/lora/ops/triton_ops/utils.py`` (``_get_lora_a_ptr``,
``_get_lora_b_ptr``, ``get_lora_op_configs``).
Read it for how one kernel launch serves every slice of a fused layer (q, k,
v or gate, up): the slices' stacked weights are separate tensors, so the
launcher hands the kernel a small int64 table of their addresses (and, for
expand, each slice's width and first output column), which a program indexes
by its slice id and casts back to a pointer. The table is built once per
layer and looked up by the weights' addresses afterwards. Sessions: 06.

Simpler than vLLM: one table per op (vLLM keeps separate stride tensors and
skips the table for a single slice), and a few fixed rules for the tile sizes
instead of tuned per-GPU configs read from JSON files.
"""

from __future__ import annotations

import torch
import triton

_LORA_A_PTR_DICT: dict[tuple, torch.Tensor] = {}
_LORA_B_PTR_DICT: dict[tuple, torch.Tensor] = {}


def _check_weights(weights: tuple[torch.Tensor, ...] | list[torch.Tensor]) -> None:
    for w in weights:
        assert w.ndim == 3 and w.is_contiguous(), "stacked LoRA weights: contiguous [slots, n, k]"
        assert w.dtype == weights[0].dtype and w.device == weights[0].device
        assert w.shape[0] == weights[0].shape[0] and w.shape[2] == weights[0].shape[2]


def _get_lora_a_ptr(lora_a_weights, device: torch.device) -> torch.Tensor:
    """``int64 [num_slices]``: the address of each slice's ``A [slots, r, in]``
    (all slices share one shape, so one set of strides serves them)."""
    _check_weights(lora_a_weights)
    assert all(w.shape == lora_a_weights[0].shape for w in lora_a_weights)
    key = (str(device), *(w.data_ptr() for w in lora_a_weights))
    if (table := _LORA_A_PTR_DICT.get(key)) is None:
        table = torch.tensor([w.data_ptr() for w in lora_a_weights], dtype=torch.int64)
        _LORA_A_PTR_DICT[key] = table = table.to(device)
    return table


def _get_lora_b_ptr(lora_b_weights, offset_start: int, device: torch.device) -> torch.Tensor:
    """``int64 [num_slices, 3]``: per slice, the address of ``B [slots, n_i, r]``,
    ``n_i``, and its first column in the output (``offset_start`` + the widths
    before it). Widths may differ (GQA's q is wider than k and v)."""
    _check_weights(lora_b_weights)
    rows, column = [], offset_start
    for w in lora_b_weights:
        rows.append((w.data_ptr(), w.shape[1], column))
        column += w.shape[1]
    key = (str(device), *rows)
    if (table := _LORA_B_PTR_DICT.get(key)) is None:
        table = torch.tensor(rows, dtype=torch.int64)
        _LORA_B_PTR_DICT[key] = table = table.to(device)
    return table


def tile(n: int, low: int, high: int) -> int:
    """The power of two covering ``n``, clamped to ``[low, high]`` (``tl.dot``
    needs every side of a tile to be at least 16)."""
    return max(low, min(high, triton.next_power_of_2(max(n, 1))))


def dot_precision(dtype: torch.dtype) -> str:
    """``tl.dot``'s input precision: full fp32 ("ieee") for fp32 operands, which
    would otherwise be rounded to TF32 on the GPU; fp16/bf16 ignore it."""
    return "ieee" if dtype == torch.float32 else "tf32"
