"""The worker's copy of every running request's block table.

vLLM twin: ``vllm/v1/worker/block_table.py`` (``BlockTable``, ``compute_slot_mapping``).
Read it for: block ids arrive from the scheduler as deltas; the worker keeps
them in a dense ``[max_num_reqs, max_num_blocks_per_req]`` array (one row per
batch slot) that is copied to the device each step, and turns token positions
into cache slots: ``slot = block_table[row, pos // block_size] * block_size
+ pos % block_size``. A row follows its request when the batch moves it
(``move_row`` for ``condense``, ``swap_row`` for ``swap_states``).
Sessions: 04 (worker), 03 (where the block ids come from).
"""

from __future__ import annotations

import numpy as np
import torch


class BlockTable:
    def __init__(
        self, block_size: int, max_num_reqs: int, max_num_blocks_per_req: int, device: torch.device
    ):
        self.block_size = block_size
        self.max_num_reqs = max_num_reqs
        self.max_num_blocks_per_req = max_num_blocks_per_req
        self.device = device
        self.block_table_np = np.zeros((max_num_reqs, max_num_blocks_per_req), dtype=np.int32)
        self.num_blocks_per_row = np.zeros(max_num_reqs, dtype=np.int32)
        self.block_table = torch.zeros(
            (max_num_reqs, max_num_blocks_per_req), dtype=torch.int32, device=device
        )

    def append_row(self, block_ids: list[int], row_idx: int) -> None:
        if not block_ids:
            return
        start = int(self.num_blocks_per_row[row_idx])
        end = start + len(block_ids)
        if end > self.max_num_blocks_per_req:
            raise RuntimeError(f"row {row_idx}: {end} blocks exceed max_num_blocks_per_req")
        self.block_table_np[row_idx, start:end] = block_ids
        self.num_blocks_per_row[row_idx] = end

    def add_row(self, block_ids: list[int], row_idx: int) -> None:
        self.num_blocks_per_row[row_idx] = 0
        self.append_row(block_ids, row_idx)

    def move_row(self, src: int, tgt: int) -> None:
        n = int(self.num_blocks_per_row[src])
        self.block_table_np[tgt, :n] = self.block_table_np[src, :n]
        self.num_blocks_per_row[tgt] = n

    def swap_row(self, src: int, tgt: int) -> None:
        pair, swapped = [src, tgt], [tgt, src]
        self.num_blocks_per_row[pair] = self.num_blocks_per_row[swapped]
        self.block_table_np[pair] = self.block_table_np[swapped]

    def compute_slot_mapping(self, req_indices: np.ndarray, positions: np.ndarray) -> np.ndarray:
        """Flat cache slot of each token (row req_indices[t], position positions[t])."""
        block_numbers = self.block_table_np[req_indices, positions // self.block_size]
        return block_numbers.astype(np.int64) * self.block_size + positions % self.block_size

    def commit_block_table(self, num_reqs: int) -> torch.Tensor:
        """Copy the live rows to the device; returns the device view."""
        self.block_table[:num_reqs].copy_(
            torch.from_numpy(self.block_table_np[:num_reqs]), non_blocking=True
        )
        return self.block_table[:num_reqs]
