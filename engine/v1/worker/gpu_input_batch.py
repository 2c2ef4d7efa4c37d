"""The persistent batch: per-request state that survives from step to step.

vLLM twin: ``vllm/v1/worker/gpu_input_batch.py`` (``CachedRequestState``,
``InputBatch.add_request`` / ``remove_request`` / ``condense``).
Read it for: rebuilding the batch every step would cost O(all tokens) of
Python work, so the runner keeps one row per running request -- its token ids
and its block table -- in preallocated numpy arrays, and only edits rows:
new requests take a free row, finished or preempted ones leave a hole,
``condense()`` moves the last rows into the holes so rows ``0..num_reqs-1``
are dense.
Sessions: 04 (worker).

Simpler than vLLM: sampling parameters are not mirrored into per-row device
tensors; the sampler's metadata is rebuilt from the rows each step
(``engine.v1.sample.metadata.build_sampling_metadata``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from engine.sampling_params import SamplingParams
from engine.v1.worker.block_table import BlockTable


@dataclass
class CachedRequestState:
    """Everything the worker remembers about one request."""

    req_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    generator: torch.Generator | None
    block_ids: list[int]
    num_computed_tokens: int
    output_token_ids: list[int] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids


class InputBatch:
    def __init__(
        self,
        max_num_reqs: int,
        max_model_len: int,
        block_size: int,
        device: torch.device,
    ) -> None:
        self.max_num_reqs = max_num_reqs
        self.max_model_len = max_model_len
        # Row -> request id; None marks a hole left by a removed request.
        self._req_ids: list[str | None] = []
        self.req_id_to_index: dict[str, int] = {}
        self.token_ids_cpu = np.zeros((max_num_reqs, max_model_len), dtype=np.int64)
        self.num_tokens = np.zeros(max_num_reqs, dtype=np.int32)
        self.num_computed_tokens_cpu = np.zeros(max_num_reqs, dtype=np.int32)
        max_blocks = -(-max_model_len // block_size)
        self.block_table = BlockTable(block_size, max_num_reqs, max_blocks, device)
        self.requests: list[CachedRequestState | None] = []

    @property
    def req_ids(self) -> list[str]:
        assert None not in self._req_ids, "condense() before reading req_ids"
        return self._req_ids  # type: ignore[return-value]

    @property
    def num_reqs(self) -> int:
        return len(self.req_id_to_index)

    def add_request(self, state: CachedRequestState) -> int:
        """Put a request in the first hole (or a new row); returns its row."""
        if state.req_id in self.req_id_to_index:
            raise RuntimeError(f"{state.req_id} is already in the batch")
        try:
            row = self._req_ids.index(None)
            self._req_ids[row] = state.req_id
            self.requests[row] = state
        except ValueError:
            row = len(self._req_ids)
            if row >= self.max_num_reqs:
                raise RuntimeError(f"more than max_num_reqs={self.max_num_reqs} requests in the batch")
            self._req_ids.append(state.req_id)
            self.requests.append(state)
        self.req_id_to_index[state.req_id] = row
        tokens = state.all_token_ids
        self.token_ids_cpu[row, : len(tokens)] = tokens
        self.num_tokens[row] = len(tokens)
        self.num_computed_tokens_cpu[row] = state.num_computed_tokens
        self.block_table.add_row(state.block_ids, row)
        return row

    def remove_request(self, req_id: str) -> int | None:
        row = self.req_id_to_index.pop(req_id, None)
        if row is None:
            return None
        self._req_ids[row] = None
        self.requests[row] = None
        return row

    def condense(self) -> None:
        """Fill holes with rows from the end so rows 0..num_reqs-1 are live."""
        num_reqs = self.num_reqs
        while len(self._req_ids) > num_reqs:
            last = len(self._req_ids) - 1
            req_id = self._req_ids.pop()
            state = self.requests.pop()
            if req_id is None:
                continue
            hole = self._req_ids.index(None)
            self._req_ids[hole] = req_id
            self.requests[hole] = state
            self.req_id_to_index[req_id] = hole
            n = int(self.num_tokens[last])
            self.token_ids_cpu[hole, :n] = self.token_ids_cpu[last, :n]
            self.num_tokens[hole] = n
            self.num_computed_tokens_cpu[hole] = self.num_computed_tokens_cpu[last]
            self.block_table.move_row(last, hole)

    def append_token(self, row: int, token_id: int) -> None:
        n = int(self.num_tokens[row])
        self.token_ids_cpu[row, n] = token_id
        self.num_tokens[row] = n + 1
