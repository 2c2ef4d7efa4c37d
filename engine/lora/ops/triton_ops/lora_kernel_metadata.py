"""LoRAKernelMeta: a step's tokens grouped by adapter slot, for the Triton LoRA kernels.

vLLM twin: ``vllm/lora/ops/triton_ops/lora_kernel_metadata.py`` (``LoRAKernelMeta``:
``make``, ``prepare_tensors``, ``meta_args``).
Read it for how the kernels find each adapter's tokens without a Python loop.
The runner hands over one slot per token (-1: the base model alone), in batch
order, adapters mixed. Once per step the tokens are sorted by slot (a stable
sort, so each group keeps batch order) and counted; a kernel program handling
slot ``s`` then reads its rows as a contiguous run of the sorted indices::

  token_lora_mapping                 [ 1, -1,  0,  1, -1,  2,  1]
  token_indices_sorted_by_lora_ids   [ 1,  4,  2,  0,  3,  6,  5]
  active_lora_ids                    [-1,  0,  1,  2,  3]          (max_loras = 4)
  num_tokens_per_lora                [ 2,  1,  3,  1,  0]
  lora_token_start_loc               [ 0,  2,  3,  6,  7,  7]

Slot ``active_lora_ids[i]`` owns ``token_indices_sorted_by_lora_ids[start:start + n]``
with ``start = lora_token_start_loc[i]``, ``n = num_tokens_per_lora[i]``. All
buffers are allocated once, for ``max_num_tokens`` tokens and ``max_loras``
slots, and refilled in place (the fixed addresses a CUDA graph would need).
Sessions: 06.

Simpler than vLLM: ``active_lora_ids`` is the fixed list ``-1, 0, ..., max_loras - 1``
and idle slots just count 0 tokens. vLLM lists only the ids present
(``torch.unique``, whose size the host must read back) and can shrink the
kernels' grid to their number (with CUDA-graph capture sizes for it); here the
counts come from a scatter-add into the fixed buffer, so preparing a step
never waits on the device, and the grid always spans ``max_loras + 1`` slots,
whose idle programs return at once. The "no adapter at all" flag is read on
the host only when the mapping is already there (as the runner's is).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class LoRAKernelMeta:
    token_lora_mapping: torch.Tensor  # [max_num_tokens], slot per token (-1: none)
    token_indices_sorted_by_lora_ids: torch.Tensor  # [max_num_tokens]
    active_lora_ids: torch.Tensor  # [max_loras + 1]: -1, 0, 1, ..., max_loras - 1
    num_tokens_per_lora: torch.Tensor  # [max_loras + 1]
    lora_token_start_loc: torch.Tensor  # [max_loras + 2], [0] is always 0
    _ones: torch.Tensor  # [max_num_tokens], the addend of the count
    # Host-side: tokens in the prepared step, and whether none of them has an
    # adapter (the launchers then skip the kernels).
    num_tokens: int = 0
    no_lora: bool = True

    @staticmethod
    def make(max_loras: int, max_num_tokens: int, device: torch.device | str) -> LoRAKernelMeta:
        def buffer(n: int) -> torch.Tensor:
            return torch.zeros(n, dtype=torch.long, device=device)

        return LoRAKernelMeta(
            token_lora_mapping=buffer(max_num_tokens).fill_(-1),
            token_indices_sorted_by_lora_ids=buffer(max_num_tokens),
            # Sorted ascending, -1 first: the order in which a stable sort
            # lays the groups out, so start_loc is a plain running sum.
            active_lora_ids=torch.arange(-1, max_loras, dtype=torch.long, device=device),
            num_tokens_per_lora=buffer(max_loras + 1),
            lora_token_start_loc=buffer(max_loras + 2),
            _ones=torch.ones(max_num_tokens, dtype=torch.long, device=device),
        )

    def prepare_tensors(self, token_lora_mapping: torch.Tensor) -> None:
        """Group the step's tokens (``[T]``, slot per token, -1: none) by slot."""
        n = token_lora_mapping.numel()
        capacity = self.token_lora_mapping.numel()
        if n > capacity:
            raise ValueError(f"{n} tokens in a step; LoRAKernelMeta holds {capacity}")
        max_loras = self.active_lora_ids.numel() - 1
        self.num_tokens = n
        # Free on the host, where the runner builds the mapping; a device
        # mapping is not read back (the kernels' programs skip -1 themselves).
        on_host = token_lora_mapping.device.type == "cpu"
        self.no_lora = on_host and bool((token_lora_mapping < 0).all())
        if on_host and n and int(token_lora_mapping.max()) >= max_loras:
            raise ValueError(f"slot {int(token_lora_mapping.max())} >= max_loras {max_loras}")

        mapping = self.token_lora_mapping[:n]
        mapping.copy_(token_lora_mapping, non_blocking=True)
        self.token_lora_mapping[n:].fill_(-1)  # rows past the step (padding): no adapter
        _, order = torch.sort(mapping, stable=True)
        self.token_indices_sorted_by_lora_ids[:n].copy_(order)
        # Counts per slot, -1 at index 0: a scatter-add into the fixed buffer
        # (torch.unique or bincount would size their output from the data).
        self.num_tokens_per_lora.zero_()
        self.num_tokens_per_lora.scatter_add_(0, mapping + 1, self._ones[:n])
        torch.cumsum(self.num_tokens_per_lora, 0, out=self.lora_token_start_loc[1:])

    def meta_args(
        self, token_nums: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, bool]:
        """What ``lora_shrink`` / ``lora_expand`` take after their tensors, in order:
        the mapping and sorted indices for ``token_nums`` rows, the per-slot
        counts, start locations and ids, and the host's no-adapter flag."""
        return (
            self.token_lora_mapping[:token_nums],
            self.token_indices_sorted_by_lora_ids[:token_nums],
            self.num_tokens_per_lora,
            self.lora_token_start_loc,
            self.active_lora_ids,
            self.no_lora,
        )
