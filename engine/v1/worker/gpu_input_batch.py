"""The persistent batch: per-request state that survives from step to step.

vLLM twin: ``vllm/v1/worker/gpu_input_batch.py`` (``CachedRequestState``,
``InputBatch.add_request`` / ``remove_request`` / ``condense`` /
``refresh_metadata`` / ``_make_sampling_metadata``).
Read it for: rebuilding the batch every step would cost O(all tokens) of
Python work, so the runner keeps one row per running request -- its token ids
and its block table -- in preallocated numpy arrays, and only edits rows:
new requests take a free row, finished or preempted ones leave a hole,
``condense()`` moves the last rows into the holes so rows ``0..num_reqs-1``
are dense.

The sampling parameters live here the same way: one entry per row in CPU
arrays (numpy views of pinned tensors on CUDA) with a device twin each
(``temperature`` / ``temperature_cpu``, ``top_p``, ``top_k``, the three
penalties), plus sets of request ids that use each feature (``greedy_reqs``,
``random_reqs``, ``top_p_reqs``, ...). The sets make the batch-wide flags free
(``all_greedy`` is "no random requests"), and ``refresh_metadata`` rebuilds the
``SamplingMetadata`` only when a request joined or left -- copying just the
fields some row uses, asynchronously. A steady decode batch reuses last step's
metadata with no host work and no host-device sync.
Sessions: 04 (worker), 05 (sampling metadata).

Simpler than vLLM:
- Logits processors (min-p, logit bias, min-tokens) are rebuilt with
  ``build_logitsprocs`` when the batch changes -- and every step while a row
  has ``min_tokens``, whose state moves with each token; their constructors
  still make small blocking copies. vLLM keeps them alive and feeds them
  ``BatchUpdate`` deltas. A batch that uses none of the three builds none.
- No swap-based reordering (``swap_states``), spec-decode tokens, LoRA,
  pooling, prompt embeddings or thinking budgets.

Reusing the pinned buffers is safe because of the step's order: the copies
queued by ``refresh_metadata`` run after the forward on the same stream, the
sampler's ``.tolist()`` waits for them, and the CPU arrays are only rewritten
by the next step's ``_update_states``. (vLLM relies on the same ordering.)
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from engine.sampling_params import SamplingParams, SamplingType
from engine.v1.sample.logits_processor import LogitsProcessors, build_logitsprocs
from engine.v1.sample.metadata import (
    SamplingMetadata,
    validate_request_token_ids,
)
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
        vocab_size: int,
    ) -> None:
        if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size < 1:
            raise ValueError(f"vocab_size must be a positive int, got {vocab_size!r}")
        self.max_num_reqs = max_num_reqs
        self.max_model_len = max_model_len
        self.device = torch.device(device)
        self.vocab_size = vocab_size
        # Row -> request id; None marks a hole left by a removed request.
        self._req_ids: list[str | None] = []
        self.req_id_to_index: dict[str, int] = {}
        self.token_ids_cpu = np.zeros((max_num_reqs, max_model_len), dtype=np.int64)
        self.num_tokens = np.zeros(max_num_reqs, dtype=np.int32)
        self.num_prompt_tokens = np.zeros(max_num_reqs, dtype=np.int32)
        self.num_computed_tokens_cpu = np.zeros(max_num_reqs, dtype=np.int32)
        max_blocks = -(-max_model_len // block_size)
        self.block_table = BlockTable(block_size, max_num_reqs, max_blocks, device)
        self.requests: list[CachedRequestState | None] = []

        # --- Sampling parameters: CPU value per row + device twin -----------
        # Pinned host memory makes the host->device copies asynchronous.
        self.pin_memory = self.device.type == "cuda"
        self.temperature, self.temperature_cpu_tensor, self.temperature_cpu = self._per_row_buffers(
            torch.float32
        )
        self.greedy_reqs: set[str] = set()
        self.random_reqs: set[str] = set()
        # All-greedy batches hand the sampler these zeros: nothing to copy.
        self._zero_temperature = torch.zeros(max_num_reqs, dtype=torch.float32, device=device)
        self.top_p, self.top_p_cpu_tensor, self.top_p_cpu = self._per_row_buffers(torch.float32)
        self.top_p_reqs: set[str] = set()
        # top_k: 0 (off) and k >= V are stored as V, like build_sampling_metadata.
        self.top_k, self.top_k_cpu_tensor, self.top_k_cpu = self._per_row_buffers(torch.int64)
        self.top_k_reqs: set[str] = set()
        (
            self.frequency_penalties,
            self.frequency_penalties_cpu_tensor,
            self.frequency_penalties_cpu,
        ) = self._per_row_buffers(torch.float32)
        self.frequency_penalties_reqs: set[str] = set()
        (
            self.presence_penalties,
            self.presence_penalties_cpu_tensor,
            self.presence_penalties_cpu,
        ) = self._per_row_buffers(torch.float32)
        self.presence_penalties_reqs: set[str] = set()
        (
            self.repetition_penalties,
            self.repetition_penalties_cpu_tensor,
            self.repetition_penalties_cpu,
        ) = self._per_row_buffers(torch.float32)
        self.repetition_penalties_reqs: set[str] = set()
        # [max_num_reqs, V] bool, True = token NOT allowed; allocated on first use.
        self.allowed_token_ids_mask: torch.Tensor | None = None
        self.allowed_token_ids_mask_cpu_tensor: torch.Tensor | None = None
        self.has_allowed_token_ids: set[str] = set()
        # row -> the request's bad words / own seeded generator.
        self.bad_words_token_ids: dict[int, list[list[int]]] = {}
        self.generators: dict[int, torch.Generator] = {}
        # req_id -> logprobs asked for (-1 stored as V).
        self.num_logprobs: dict[str, int] = {}
        # Requests that need a built-in logits processor / min_tokens in particular.
        self.logitsprocs_reqs: set[str] = set()
        self.min_tokens_reqs: set[str] = set()

        # Set by add/remove; refresh_metadata() rebuilds when it is set.
        self.batch_changed = True
        self.sampling_metadata: SamplingMetadata | None = None

    def _per_row_buffers(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, np.ndarray]:
        """(device tensor, CPU tensor, numpy view of the CPU tensor), [max_num_reqs] each."""
        device_tensor = torch.zeros(self.max_num_reqs, dtype=dtype, device=self.device)
        cpu_tensor = torch.zeros(self.max_num_reqs, dtype=dtype, pin_memory=self.pin_memory)
        return device_tensor, cpu_tensor, cpu_tensor.numpy()

    @property
    def req_ids(self) -> list[str]:
        assert None not in self._req_ids, "condense() before reading req_ids"
        return self._req_ids  # type: ignore[return-value]

    @property
    def num_reqs(self) -> int:
        return len(self.req_id_to_index)

    @property
    def all_greedy(self) -> bool:
        return not self.random_reqs

    @property
    def all_random(self) -> bool:
        return not self.greedy_reqs and bool(self.random_reqs)

    @property
    def no_top_p(self) -> bool:
        return not self.top_p_reqs

    @property
    def no_top_k(self) -> bool:
        return not self.top_k_reqs

    @property
    def no_penalties(self) -> bool:
        return not (
            self.frequency_penalties_reqs
            or self.presence_penalties_reqs
            or self.repetition_penalties_reqs
        )

    @property
    def max_num_logprobs(self) -> int | None:
        return max(self.num_logprobs.values()) if self.num_logprobs else None

    def add_request(self, state: CachedRequestState) -> int:
        """Put a request in the first hole (or a new row); returns its row."""
        if state.req_id in self.req_id_to_index:
            raise RuntimeError(f"{state.req_id} is already in the batch")
        row = self._req_ids.index(None) if None in self._req_ids else len(self._req_ids)
        if row >= self.max_num_reqs:
            raise RuntimeError(f"more than max_num_reqs={self.max_num_reqs} requests in the batch")
        # Check before touching any row: a bad request leaves the batch as it was.
        sp = state.sampling_params
        validate_request_token_ids(row, sp, state.output_token_ids, self.vocab_size)
        if sp.sampling_type == SamplingType.RANDOM_SEED and state.generator is None:
            raise ValueError(
                f"request {state.req_id} has seed={sp.seed} but no generator; "
                "seeded requests must sample with their own torch.Generator."
            )
        if row == len(self._req_ids):
            self._req_ids.append(state.req_id)
            self.requests.append(state)
        else:
            self._req_ids[row] = state.req_id
            self.requests[row] = state
        self.req_id_to_index[state.req_id] = row
        tokens = state.all_token_ids
        self.token_ids_cpu[row, : len(tokens)] = tokens
        self.num_tokens[row] = len(tokens)
        self.num_prompt_tokens[row] = len(state.prompt_token_ids)
        self.num_computed_tokens_cpu[row] = state.num_computed_tokens
        self.block_table.add_row(state.block_ids, row)
        self._add_sampling_params(state, row)
        self.batch_changed = True
        return row

    def _add_sampling_params(self, state: CachedRequestState, row: int) -> None:
        req_id, sp, vocab = state.req_id, state.sampling_params, self.vocab_size
        if sp.sampling_type == SamplingType.GREEDY:
            self.temperature_cpu[row] = 0.0
            self.greedy_reqs.add(req_id)
        else:
            self.temperature_cpu[row] = sp.temperature
            self.random_reqs.add(req_id)
        self.top_p_cpu[row] = sp.top_p
        if sp.top_p < 1.0:
            self.top_p_reqs.add(req_id)
        if 0 < sp.top_k < vocab:
            self.top_k_cpu[row] = sp.top_k
            self.top_k_reqs.add(req_id)
        else:
            self.top_k_cpu[row] = vocab
        self.frequency_penalties_cpu[row] = sp.frequency_penalty
        if sp.frequency_penalty != 0.0:
            self.frequency_penalties_reqs.add(req_id)
        self.presence_penalties_cpu[row] = sp.presence_penalty
        if sp.presence_penalty != 0.0:
            self.presence_penalties_reqs.add(req_id)
        self.repetition_penalties_cpu[row] = sp.repetition_penalty
        if sp.repetition_penalty != 1.0:
            self.repetition_penalties_reqs.add(req_id)
        if state.generator is not None:
            self.generators[row] = state.generator
        if sp.logprobs is not None:
            self.num_logprobs[req_id] = vocab if sp.logprobs == -1 else min(sp.logprobs, vocab)
        if sp.allowed_token_ids:
            if self.allowed_token_ids_mask_cpu_tensor is None:
                shape = (self.max_num_reqs, vocab)
                self.allowed_token_ids_mask = torch.zeros(
                    shape, dtype=torch.bool, device=self.device
                )
                self.allowed_token_ids_mask_cpu_tensor = torch.zeros(
                    shape, dtype=torch.bool, pin_memory=self.pin_memory
                )
            self.allowed_token_ids_mask_cpu_tensor[row] = True
            self.allowed_token_ids_mask_cpu_tensor[row, sp.allowed_token_ids] = False
            self.has_allowed_token_ids.add(req_id)
        if sp.bad_words_token_ids:
            self.bad_words_token_ids[row] = sp.bad_words_token_ids
        if sp.min_p > 0 or sp.logit_bias or sp.min_tokens:
            self.logitsprocs_reqs.add(req_id)
        if sp.min_tokens:
            self.min_tokens_reqs.add(req_id)

    def remove_request(self, req_id: str) -> int | None:
        row = self.req_id_to_index.pop(req_id, None)
        if row is None:
            return None
        self._req_ids[row] = None
        self.requests[row] = None
        for reqs in (
            self.greedy_reqs,
            self.random_reqs,
            self.top_p_reqs,
            self.top_k_reqs,
            self.frequency_penalties_reqs,
            self.presence_penalties_reqs,
            self.repetition_penalties_reqs,
            self.logitsprocs_reqs,
            self.min_tokens_reqs,
        ):
            reqs.discard(req_id)
        self.num_logprobs.pop(req_id, None)
        self.generators.pop(row, None)
        self.bad_words_token_ids.pop(row, None)
        if req_id in self.has_allowed_token_ids:
            self.has_allowed_token_ids.discard(req_id)
            assert self.allowed_token_ids_mask_cpu_tensor is not None
            self.allowed_token_ids_mask_cpu_tensor[row] = False
        self.batch_changed = True
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
            self.num_prompt_tokens[hole] = self.num_prompt_tokens[last]
            self.num_computed_tokens_cpu[hole] = self.num_computed_tokens_cpu[last]
            self.block_table.move_row(last, hole)
            self._move_sampling_params(last, hole)

    def _move_sampling_params(self, src: int, dst: int) -> None:
        for values in (
            self.temperature_cpu,
            self.top_p_cpu,
            self.top_k_cpu,
            self.frequency_penalties_cpu,
            self.presence_penalties_cpu,
            self.repetition_penalties_cpu,
        ):
            values[dst] = values[src]
        for by_row in (self.generators, self.bad_words_token_ids):
            if src in by_row:
                by_row[dst] = by_row.pop(src)
        if self.allowed_token_ids_mask_cpu_tensor is not None:
            self.allowed_token_ids_mask_cpu_tensor[dst] = self.allowed_token_ids_mask_cpu_tensor[
                src
            ]
            self.allowed_token_ids_mask_cpu_tensor[src] = False

    def append_token(self, row: int, token_id: int) -> None:
        n = int(self.num_tokens[row])
        self.token_ids_cpu[row, n] = token_id
        self.num_tokens[row] = n + 1

    # ------------------------------------------------------------------
    # Sampling metadata
    # ------------------------------------------------------------------
    def refresh_metadata(self) -> SamplingMetadata:
        """This step's SamplingMetadata: rebuilt if a request joined or left,
        else last step's (with fresh logits processors while a row has
        ``min_tokens``). Call after ``condense()``."""
        if self.batch_changed or self.sampling_metadata is None:
            self.sampling_metadata = self._make_sampling_metadata()
            self.batch_changed = False
        elif self.min_tokens_reqs:
            self.sampling_metadata.logitsprocs = self._make_logitsprocs()
        return self.sampling_metadata

    def _copy_rows(self, cpu_tensor: torch.Tensor, device_tensor: torch.Tensor) -> torch.Tensor:
        """Copy rows 0..num_reqs-1 host -> device without waiting; returns the device rows."""
        n = self.num_reqs
        return device_tensor[:n].copy_(cpu_tensor[:n], non_blocking=True)

    def _make_logitsprocs(self) -> LogitsProcessors:
        if not self.logitsprocs_reqs:
            return LogitsProcessors()
        reqs = self._live_requests()
        return build_logitsprocs(
            [r.sampling_params for r in reqs], [r.output_token_ids for r in reqs], self.device
        )

    def _live_requests(self) -> list[CachedRequestState]:
        assert None not in self.requests, "condense() before building sampling metadata"
        return self.requests  # type: ignore[return-value]

    def _make_sampling_metadata(self) -> SamplingMetadata:
        num_reqs = self.num_reqs
        reqs = self._live_requests()
        if self.all_greedy:
            temperature = self._zero_temperature[:num_reqs]
        else:
            temperature = self._copy_rows(self.temperature_cpu_tensor, self.temperature)
        top_p = None if self.no_top_p else self._copy_rows(self.top_p_cpu_tensor, self.top_p)
        top_k = None if self.no_top_k else self._copy_rows(self.top_k_cpu_tensor, self.top_k)

        prompt_token_ids = None
        if not self.no_penalties:
            self._copy_rows(self.frequency_penalties_cpu_tensor, self.frequency_penalties)
            self._copy_rows(self.presence_penalties_cpu_tensor, self.presence_penalties)
            self._copy_rows(self.repetition_penalties_cpu_tensor, self.repetition_penalties)
            prompt_token_ids = self._make_prompt_token_ids_cpu_tensor().to(
                self.device, non_blocking=True
            )

        allowed_token_ids_mask = None
        if self.has_allowed_token_ids:
            assert self.allowed_token_ids_mask_cpu_tensor is not None
            assert self.allowed_token_ids_mask is not None
            allowed_token_ids_mask = self._copy_rows(
                self.allowed_token_ids_mask_cpu_tensor, self.allowed_token_ids_mask
            )

        return SamplingMetadata(
            temperature=temperature,
            all_greedy=self.all_greedy,
            all_random=self.all_random,
            top_p=top_p,
            top_k=top_k,
            generators=dict(self.generators),
            max_num_logprobs=self.max_num_logprobs,
            no_penalties=self.no_penalties,
            prompt_token_ids=prompt_token_ids,
            frequency_penalties=self.frequency_penalties[:num_reqs],
            presence_penalties=self.presence_penalties[:num_reqs],
            repetition_penalties=self.repetition_penalties[:num_reqs],
            # The requests' own lists: tokens appended later are seen next step.
            output_token_ids=[r.output_token_ids for r in reqs],
            allowed_token_ids_mask=allowed_token_ids_mask,
            bad_words_token_ids=dict(self.bad_words_token_ids),
            logitsprocs=self._make_logitsprocs(),
            temperature_cpu=self.temperature_cpu[:num_reqs],
        )

    def _make_prompt_token_ids_cpu_tensor(self) -> torch.Tensor:
        """[num_reqs, longest prompt] int64, padded with V (an id no token has)."""
        num_reqs = self.num_reqs
        max_prompt_len = int(self.num_prompt_tokens[:num_reqs].max()) if num_reqs else 0
        prompt_cpu = torch.empty(
            (num_reqs, max_prompt_len), dtype=torch.int64, pin_memory=self.pin_memory
        )
        prompt = prompt_cpu.numpy()
        prompt[:] = self.token_ids_cpu[:num_reqs, :max_prompt_len]
        in_prompt = np.arange(max_prompt_len) < self.num_prompt_tokens[:num_reqs, None]
        out_of_vocab = in_prompt & ((prompt < 0) | (prompt >= self.vocab_size))
        prompt[~in_prompt] = self.vocab_size
        if out_of_vocab.any():
            row = int(np.nonzero(out_of_vocab.any(axis=1))[0][0])
            bad = prompt[row][out_of_vocab[row]].tolist()
            raise ValueError(
                f"prompt_token_ids of request row {row} must be token ids in "
                f"[0, {self.vocab_size - 1}] (vocab size {self.vocab_size}), got {bad}."
            )
        return prompt_cpu
