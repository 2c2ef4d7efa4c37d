"""PunicaWrapperBase: each step's token -> adapter-slot map, and the LoRA
contribution of a linear layer computed from it.

vLLM twin: ``vllm/lora/punica_wrapper/punica_base.py`` (``PunicaWrapperBase``:
``update_metadata``, ``token_lora_indices``, ``add_shrink``, ``add_expand``,
``add_lora_linear``).
Read it for the split of multi-LoRA work: once per step the runner hands over
which slot each scheduled token's request uses (-1: the base model alone);
then every LoRA layer calls ``add_lora_linear`` with its stacked per-slot
weights, one (A, B) pair per output slice (q, k, v or gate, up). The wrapper
owns a fixed buffer of ``max_num_batched_tokens`` indices, so the layers keep
reading the same tensor step after step. Sessions: 06.

Simpler than vLLM: no embedding or logits LoRA (the vocabulary is the base
model's), no prefill segment metadata.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch


class PunicaWrapperBase(ABC):
    def __init__(self, max_num_batched_tokens: int, device: torch.device | str) -> None:
        self._token_lora_indices = torch.full(
            (max_num_batched_tokens,), -1, dtype=torch.long, device=device
        )
        self.num_tokens = 0

    def update_metadata(self, token_lora_mapping: torch.Tensor) -> None:
        """The step's slot per token (``[T]``, -1: no adapter)."""
        n = token_lora_mapping.numel()
        if n > self._token_lora_indices.numel():
            raise ValueError(
                f"{n} tokens in a step; the LoRA index buffer holds "
                f"{self._token_lora_indices.numel()} (max_num_batched_tokens)"
            )
        self._token_lora_indices[:n].copy_(token_lora_mapping, non_blocking=True)
        self._token_lora_indices[n:].fill_(-1)
        self.num_tokens = n

    @property
    def token_lora_indices(self) -> torch.Tensor:
        return self._token_lora_indices

    def _indices_for(self, x: torch.Tensor) -> torch.Tensor:
        # A layer may run on padded inputs (more rows than the step's tokens):
        # the extra rows read -1 and get nothing added.
        return self._token_lora_indices[: x.shape[0]]

    @abstractmethod
    def add_shrink(
        self,
        y: torch.Tensor,  # [num_slices, T, r]
        x: torch.Tensor,  # [T, in]
        lora_a_stacked: tuple[torch.Tensor, ...],  # each [num_slots, r, in]
        scale: float,
    ) -> None:
        """``y[i] = scale * x @ A_i[slot]^T`` for each slice ``i``."""

    @abstractmethod
    def add_expand(
        self,
        y: torch.Tensor,  # [T, out]
        x: torch.Tensor,  # [num_slices, T, r]
        lora_b_stacked: tuple[torch.Tensor, ...],  # each [num_slots, n_i, r]
        output_slices: tuple[int, ...],
    ) -> None:
        """``y[:, slice i] += x[i] @ B_i[slot]^T`` for each slice ``i``."""

    def add_lora_linear(
        self,
        y: torch.Tensor,  # [T, out], the base layer's output, updated in place
        x: torch.Tensor,  # [T, in]
        lora_a_stacked: tuple[torch.Tensor, ...],
        lora_b_stacked: tuple[torch.Tensor, ...],
        scale: float,
        output_slices: tuple[int, ...],
    ) -> None:
        """``y[:, slice i] += scale * x @ A_i[slot]^T @ B_i[slot]^T`` per token."""
        rank = lora_a_stacked[0].shape[1]
        buffer = torch.empty(len(output_slices), x.shape[0], rank, dtype=x.dtype, device=x.device)
        self.add_shrink(buffer, x, lora_a_stacked, scale)
        self.add_expand(y, buffer, lora_b_stacked, output_slices)
