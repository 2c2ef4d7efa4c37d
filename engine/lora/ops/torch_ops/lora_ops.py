"""The two LoRA matmuls of punica, per token, in plain torch.

vLLM twin: ``vllm/lora/ops/torch_ops/lora_ops.py`` (``bgmv_shrink``,
``bgmv_expand_slice``).
Read it for the batched-gather idea behind multi-LoRA serving: every token
carries the slot of its request's adapter (``lora_indices``, -1: none); the
stacked weights of all slots are indexed per token, so one call serves a
batch mixing several adapters and the base model:

  shrink  ``out[t] = scaling * x[t] @ A[idx[t]]^T``   ``[T, in] -> [T, r]``
  expand  ``y[t, off:off+n] += s[t] @ B[idx[t]]^T``   ``[T, r] -> [T, n]``

Sessions: 06.
Simpler than vLLM: the per-token (bgmv) form only; vLLM also has segment
(sgmv) forms for prefill, where consecutive tokens share an adapter. On CUDA
Glassbox runs the Triton kernels of ``triton_ops/`` instead, which group the
tokens by adapter; these ops are their reference in the tests.
"""

from __future__ import annotations

import torch


def bgmv_shrink(
    inputs: torch.Tensor,  # [T, in]
    lora_a_weights: torch.Tensor,  # [num_slots, r, in]
    output_tensor: torch.Tensor,  # [T, r], written
    lora_indices_tensor: torch.Tensor,  # [T], -1: no adapter
    scaling: float = 1.0,
) -> None:
    selected = lora_a_weights[lora_indices_tensor.clamp(min=0)]  # [T, r, in]
    out = torch.einsum("ti,tri->tr", inputs.to(selected.dtype), selected) * scaling
    output_tensor.copy_(out.masked_fill((lora_indices_tensor < 0)[:, None], 0))


def bgmv_expand_slice(
    inputs: torch.Tensor,  # [T, r]
    lora_b_weights: torch.Tensor,  # [num_slots, n, r]
    output_tensor: torch.Tensor,  # [T, out], columns [slice_offset, +slice_size) updated
    lora_indices_tensor: torch.Tensor,  # [T]
    slice_offset: int,
    slice_size: int,
    add_inputs: bool = True,
) -> None:
    selected = lora_b_weights[lora_indices_tensor.clamp(min=0)]  # [T, n, r]
    out = torch.einsum("tr,tnr->tn", inputs.to(selected.dtype), selected)
    out = out.masked_fill((lora_indices_tensor < 0)[:, None], 0).to(output_tensor.dtype)
    target = output_tensor[:, slice_offset : slice_offset + slice_size]
    if add_inputs:
        target.add_(out)
    else:
        target.copy_(out)
