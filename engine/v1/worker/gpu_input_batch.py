"""The persistent batch: per-request state that survives from step to step.

vLLM twin: ``vllm/v1/worker/gpu_input_batch.py`` (``CachedRequestState``,
``InputBatch.add_request`` / ``remove_request`` / ``swap_states`` /
``condense`` / ``refresh_metadata`` / ``_make_sampling_metadata``).
Read it for: rebuilding the batch every step would cost O(all tokens) of
Python work, so the runner keeps one row per running request -- its token ids
and its block table -- in preallocated numpy arrays, and only edits rows:
finished, preempted or unscheduled requests leave a hole, new ones take the
lowest hole (or a new row at the end), ``condense()`` moves the last rows
into the remaining holes so rows ``0..num_reqs-1`` are dense, and
``swap_states(i, j)`` exchanges two rows (how vLLM's attention backends put
decodes before prefills).

Every such edit is also recorded in ``batch_update_builder`` (a
``BatchUpdateBuilder``): rows removed, added (with the request's params and
its live output list) and moved (``UNIDIRECTIONAL`` for a condense move,
``SWAP`` for a swap). ``refresh_metadata()`` turns the step's record into one
``BatchUpdate`` and hands it to every logits processor (``update_state``), so
the processors -- built once by the runner and kept here in ``logitsprocs``
-- keep their per-row state in step with the rows. A step runs: removals,
adds, ``condense()``, (swaps), ``refresh_metadata()``.

The sampling parameters live here the same way: one entry per row in CPU
arrays (numpy views of pinned tensors on CUDA) with a device twin each
(``temperature`` / ``temperature_cpu``, ``top_p``, ``top_k``, the three
penalties), plus sets of request ids that use each feature (``greedy_reqs``,
``random_reqs``, ``top_p_reqs``, ...). The sets make the batch-wide flags free
(``all_greedy`` is "no random requests"), and ``refresh_metadata`` rebuilds the
``SamplingMetadata`` only when the batch changed -- copying just the fields
some row uses, asynchronously. A steady decode batch reuses last step's
metadata with no host work and no host-device sync.
Sessions: 04 (worker), 05 (sampling metadata).

Async scheduling (``prev_sampled_token_ids``, ``prev_req_id_to_index``,
``update_async_output_token_ids``): a step's sampled ids stay on the device
and the rows get a -1 placeholder; the next step reads the real ids on the
device, and the output lists get them once their host copy is done.

Simpler than vLLM: one KV cache group (``block_sizes`` has one entry and the
kernel block size is the block size); no pooling, multimodal inputs, prompt
embeddings, thinking budgets or ``logprob_token_ids``.
``output_token_ids`` is always handed to the sampler (vLLM leaves it empty
when no penalty, bad word or custom processor reads it).

Differs from vLLM on purpose: ``token_ids_cpu`` is int64 (vLLM: int32), the
dtype of the model's input ids, so a step's ids need no conversion; requests
and params are validated on ``add_request`` (a bad one leaves the batch as
it was).

Reusing the pinned buffers is safe because of the step's order: the copies
queued by ``refresh_metadata`` run before the sampler on the same stream, the
sampler's ``.tolist()`` waits for them, and the CPU arrays are only rewritten
by the next step's ``_update_states``. (vLLM relies on the same ordering.)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from engine.sampling_params import SamplingParams, SamplingType
from engine.v1.outputs import LogprobsTensors
from engine.v1.sample.logits_processor import (
    BatchUpdateBuilder,
    LogitsProcessors,
    MoveDirectionality,
)
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
    # Always empty: no multimodal inputs (vLLM's field, so its call sites run).
    mm_features: list[Any]
    sampling_params: SamplingParams
    generator: torch.Generator | None
    # One list of block ids per KV cache group (Glassbox has one group).
    block_ids: tuple[list[int], ...]
    num_computed_tokens: int
    # The request's generated ids; the batch and the logits processors keep
    # references to this very list.
    output_token_ids: list[int]
    # The request's adapter (a LoRARequest; None: the base model).
    lora_request: Any = None
    # Prompt logprobs gathered so far, while its prefill runs in chunks
    # ([P - 1, k + 1] on the host); None before the first chunk and after the last.
    in_progress_prompt_logprobs_cpu: LogprobsTensors | None = None
    # Always None: no prompt embeddings or pooling models yet.
    prompt_embeds: torch.Tensor | None = None
    pooling_params: Any = None

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def get_token_id(self, idx: int) -> int:
        """The token at position ``idx`` of prompt + output; -1 past the end."""
        if idx < self.num_prompt_tokens:
            return self.prompt_token_ids[idx]
        idx -= self.num_prompt_tokens
        return self.output_token_ids[idx] if idx < len(self.output_token_ids) else -1


class InputBatch:
    def __init__(
        self,
        max_num_reqs: int,
        max_model_len: int,
        max_num_batched_tokens: int,
        device: torch.device,
        pin_memory: bool,
        vocab_size: int,
        block_sizes: list[int],
        kernel_block_sizes: list[int],
        max_num_blocks_per_req: list[int] | None = None,
        logitsprocs: LogitsProcessors | None = None,
    ) -> None:
        if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size < 1:
            raise ValueError(f"vocab_size must be a positive int, got {vocab_size!r}")
        if len(block_sizes) != 1:
            raise ValueError(
                f"block_sizes must have one entry (one KV cache group), got {block_sizes}"
            )
        if list(kernel_block_sizes) != list(block_sizes):
            raise ValueError(
                f"kernel_block_sizes must equal block_sizes, got {kernel_block_sizes} "
                f"and {block_sizes}"
            )
        self.max_num_reqs = max_num_reqs
        self.max_model_len = max_model_len
        self.max_num_batched_tokens = max_num_batched_tokens
        self.device = torch.device(device)
        # Pinned host memory makes the host->device copies asynchronous.
        self.pin_memory = pin_memory
        self.vocab_size = vocab_size

        # Row -> request id; None marks a hole left by a removed request.
        self._req_ids: list[str | None] = []
        self.req_id_to_index: dict[str, int] = {}
        # Row -> the request's own output list (None in a hole).
        self.req_output_token_ids: list[list[int] | None] = []
        # Row -> this step's draft tokens (always [] without speculative decoding).
        self.spec_token_ids: list[list[int]] = []

        self.token_ids_cpu = np.zeros((max_num_reqs, max_model_len), dtype=np.int64)
        # Prompt + output tokens known per row (vLLM's name: drafts not included).
        self.num_tokens_no_spec = np.zeros(max_num_reqs, dtype=np.int32)
        self.num_prompt_tokens = np.zeros(max_num_reqs, dtype=np.int32)
        self.num_computed_tokens_cpu = np.zeros(max_num_reqs, dtype=np.int32)
        block_size = block_sizes[0]
        if max_num_blocks_per_req is None:
            max_blocks = -(-max_model_len // block_size)
        else:
            (max_blocks,) = max_num_blocks_per_req
        self.block_table = BlockTable(block_size, max_num_reqs, max_blocks, self.device)

        # --- Sampling parameters: CPU value per row + device twin -----------
        self.temperature, self.temperature_cpu_tensor, self.temperature_cpu = self._per_row_buffers(
            torch.float32
        )
        self.greedy_reqs: set[str] = set()
        self.random_reqs: set[str] = set()
        self.top_p, self.top_p_cpu_tensor, self.top_p_cpu = self._per_row_buffers(torch.float32)
        self.top_p_reqs: set[str] = set()
        # top_k: 0 (off) and k >= V are stored as V, like build_sampling_metadata.
        self.top_k, self.top_k_cpu_tensor, self.top_k_cpu = self._per_row_buffers(torch.int32)
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

        # Async scheduling: the last step's sampled ids, still on the device
        # ([num_reqs of that step, 1]), and each request's row in that step
        # (rows that sampled nothing left out). The next step's inputs take
        # their last token from there instead of from token_ids_cpu (-1).
        self.prev_sampled_token_ids: torch.Tensor | None = None
        self.prev_req_id_to_index: dict[str, int] | None = None
        # Async scheduling: the host copy of those ids and the event that says
        # the copy is done, to replace the -1 placeholders in output lists.
        self.sampled_token_ids_cpu: torch.Tensor | None = None
        self.async_copy_ready_event: Any = None

        # This step's added / removed / moved rows, for the logits processors.
        self.batch_update_builder = BatchUpdateBuilder()
        # Built once by the runner (``build_logitsprocs``); none if not given.
        self.logitsprocs = logitsprocs or LogitsProcessors()
        self.sampling_metadata = self._make_sampling_metadata()

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

    @property
    def no_allowed_token_ids(self) -> bool:
        return not self.has_allowed_token_ids

    # ------------------------------------------------------------------
    # Rows joining and leaving
    # ------------------------------------------------------------------
    def _check_request(self, request: CachedRequestState, row: int) -> None:
        """Raise before any row is touched: a bad request leaves the batch as it was."""
        if request.req_id in self.req_id_to_index:
            raise RuntimeError(f"{request.req_id} is already in the batch")
        if row >= self.max_num_reqs:
            raise RuntimeError(f"more than max_num_reqs={self.max_num_reqs} requests in the batch")
        if row > len(self._req_ids):
            raise RuntimeError("add_request() after condense() in one step: add requests first")
        unsupported = {
            "mm_features": request.mm_features,
            "prompt_embeds": request.prompt_embeds,
            "pooling_params": request.pooling_params,
        }
        for name, value in unsupported.items():
            if value is not None and not (isinstance(value, list) and not value):
                raise ValueError(f"request {request.req_id}: {name} is not supported by Glassbox")
        sp = request.sampling_params
        validate_request_token_ids(row, sp, request.output_token_ids, self.vocab_size)
        if sp.sampling_type == SamplingType.RANDOM_SEED and request.generator is None:
            raise ValueError(
                f"request {request.req_id} has seed={sp.seed} but no generator; "
                "seeded requests must sample with their own torch.Generator."
            )

    def add_request(self, request: CachedRequestState) -> int:
        """Put a request in the lowest freed row (or a new row); returns its row."""
        builder = self.batch_update_builder
        peeked = builder.peek_removed()
        row = self.num_reqs if peeked is None else peeked
        self._check_request(request, row)
        if peeked is not None:
            builder.pop_removed()
        builder.batch_changed = True
        builder.added.append(
            (row, request.sampling_params, request.prompt_token_ids, request.output_token_ids)
        )

        req_id = request.req_id
        if row == len(self._req_ids):
            self._req_ids.append(req_id)
            self.req_output_token_ids.append(request.output_token_ids)
            self.spec_token_ids.append([])
        else:
            self._req_ids[row] = req_id
            self.req_output_token_ids[row] = request.output_token_ids
            self.spec_token_ids[row].clear()
        self.req_id_to_index[req_id] = row

        tokens = request.all_token_ids
        self.token_ids_cpu[row, : len(tokens)] = tokens
        self.num_tokens_no_spec[row] = len(tokens)
        self.num_prompt_tokens[row] = request.num_prompt_tokens
        self.num_computed_tokens_cpu[row] = request.num_computed_tokens
        self.block_table.add_row(request.block_ids[0], row)
        self._add_sampling_params(request, row)
        return row

    def _add_sampling_params(self, request: CachedRequestState, row: int) -> None:
        req_id, sp, vocab = request.req_id, request.sampling_params, self.vocab_size
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
        if request.generator is not None:
            self.generators[row] = request.generator
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

    def remove_request(self, req_id: str) -> int | None:
        """Free the request's row (a hole until a new request or ``condense``
        fills it); returns the row, or None if the request is not here."""
        row = self.req_id_to_index.pop(req_id, None)
        if row is None:
            return None
        self.batch_update_builder.removed_append(row)
        if self.prev_req_id_to_index is not None:
            self.prev_req_id_to_index.pop(req_id, None)
        self._req_ids[row] = None
        self.req_output_token_ids[row] = None
        self.spec_token_ids[row].clear()
        for reqs in (
            self.greedy_reqs,
            self.random_reqs,
            self.top_p_reqs,
            self.top_k_reqs,
            self.frequency_penalties_reqs,
            self.presence_penalties_reqs,
            self.repetition_penalties_reqs,
            self.has_allowed_token_ids,
        ):
            reqs.discard(req_id)
        self.num_logprobs.pop(req_id, None)
        self.generators.pop(row, None)
        self.bad_words_token_ids.pop(row, None)
        if self.allowed_token_ids_mask_cpu_tensor is not None:
            self.allowed_token_ids_mask_cpu_tensor[row] = False
        return row

    # ------------------------------------------------------------------
    # Rows moving
    # ------------------------------------------------------------------
    def _get_active_token_count(self, row: int) -> int:
        return int(self.num_tokens_no_spec[row]) + len(self.spec_token_ids[row])

    def _per_row_arrays(self) -> tuple[np.ndarray, ...]:
        """The host arrays with one entry per row, moved with their request."""
        return (
            self.num_tokens_no_spec,
            self.num_prompt_tokens,
            self.num_computed_tokens_cpu,
            self.temperature_cpu,
            self.top_p_cpu,
            self.top_k_cpu,
            self.frequency_penalties_cpu,
            self.presence_penalties_cpu,
            self.repetition_penalties_cpu,
        )

    def swap_states(self, i1: int, i2: int) -> None:
        """Exchange the requests of rows ``i1`` and ``i2`` (both live)."""
        id1, id2 = self._req_ids[i1], self._req_ids[i2]
        assert id1 is not None and id2 is not None, "swap_states() needs two live rows"
        n = max(self._get_active_token_count(i1), self._get_active_token_count(i2))
        pair, swapped = [i1, i2], [i2, i1]

        self._req_ids[i1], self._req_ids[i2] = id2, id1
        self.req_id_to_index[id1], self.req_id_to_index[id2] = i2, i1
        for per_row in (self.req_output_token_ids, self.spec_token_ids):
            per_row[i1], per_row[i2] = per_row[i2], per_row[i1]
        # Fancy indexing copies the right-hand side first, so this is a true swap.
        self.token_ids_cpu[pair, :n] = self.token_ids_cpu[swapped, :n]
        for values in self._per_row_arrays():
            values[pair] = values[swapped]
        self.block_table.swap_row(i1, i2)
        for by_row in (self.generators, self.bad_words_token_ids):
            _swap_dict_values(by_row, i1, i2)
        if self.allowed_token_ids_mask_cpu_tensor is not None:
            mask = self.allowed_token_ids_mask_cpu_tensor
            mask[pair] = mask[swapped]
        self.batch_update_builder.moved.append((i1, i2, MoveDirectionality.SWAP))

    def condense(self) -> None:
        """Fill holes with rows from the end so rows 0..num_reqs-1 are live.

        Each move (last live row -> lowest hole) is recorded for the logits
        processors; holes already at the end are just cut off."""
        builder = self.batch_update_builder
        num_reqs = self.num_reqs
        empty_rows = builder.removed  # highest first; the lowest is popped below
        if not empty_rows:
            return  # every freed row was refilled by a new request
        if num_reqs == 0:
            self._req_ids.clear()
            self.req_output_token_ids.clear()
            self.spec_token_ids.clear()
            return
        last = num_reqs + len(empty_rows) - 1
        while empty_rows:
            while last in empty_rows:
                last -= 1
            hole = builder.peek_removed()
            assert hole is not None
            if hole >= last:
                break  # the remaining holes are all past the live rows
            builder.pop_removed()
            self._move_row(last, hole)
            builder.moved.append((last, hole, MoveDirectionality.UNIDIRECTIONAL))
            last -= 1
        del self._req_ids[num_reqs:]
        del self.req_output_token_ids[num_reqs:]
        del self.spec_token_ids[num_reqs:]

    def _move_row(self, src: int, dst: int) -> None:
        """Move the request in row ``src`` into the hole at ``dst``."""
        req_id = self._req_ids[src]
        assert req_id is not None
        n = self._get_active_token_count(src)
        self._req_ids[dst], self._req_ids[src] = req_id, None
        self.req_id_to_index[req_id] = dst
        self.req_output_token_ids[dst] = self.req_output_token_ids[src]
        self.req_output_token_ids[src] = None
        self.spec_token_ids[dst], self.spec_token_ids[src] = self.spec_token_ids[src], []
        self.token_ids_cpu[dst, :n] = self.token_ids_cpu[src, :n]
        for values in self._per_row_arrays():
            values[dst] = values[src]
        self.block_table.move_row(src, dst)
        for by_row in (self.generators, self.bad_words_token_ids):
            if src in by_row:
                by_row[dst] = by_row.pop(src)
        if self.allowed_token_ids_mask_cpu_tensor is not None:
            mask = self.allowed_token_ids_mask_cpu_tensor
            mask[dst] = mask[src]
            mask[src] = False

    def append_token(self, row: int, token_id: int) -> None:
        n = int(self.num_tokens_no_spec[row])
        self.token_ids_cpu[row, n] = token_id
        self.num_tokens_no_spec[row] = n + 1

    # ------------------------------------------------------------------
    # Async scheduling: placeholders
    # ------------------------------------------------------------------
    def set_async_sampled_token_ids(
        self, sampled_token_ids_cpu: torch.Tensor, async_copy_ready_event: Any
    ) -> None:
        """Keep the host copy of this step's sampled ids ([num_reqs, 1], filled
        once ``async_copy_ready_event`` completes; None on the CPU) for
        ``update_async_output_token_ids``."""
        self.sampled_token_ids_cpu = sampled_token_ids_cpu
        self.async_copy_ready_event = async_copy_ready_event

    def update_async_output_token_ids(self) -> None:
        """Replace the -1 placeholder at the end of each output list with the
        id the previous step sampled, once its host copy is done. Called just
        before sampling, and only if sampling reads output ids."""
        if self.sampled_token_ids_cpu is None or not self.prev_req_id_to_index:
            return
        sampled: list[list[int]] | None = None
        for row, req_id in enumerate(self.req_ids):
            prev_row = self.prev_req_id_to_index.get(req_id)
            output_ids = self.req_output_token_ids[row]
            if prev_row is None or not output_ids or output_ids[-1] != -1:
                continue
            if sampled is None:
                if self.async_copy_ready_event is not None:
                    self.async_copy_ready_event.synchronize()
                sampled = self.sampled_token_ids_cpu.tolist()
            output_ids[-1] = sampled[prev_row][0]

    # ------------------------------------------------------------------
    # Sampling metadata
    # ------------------------------------------------------------------
    def refresh_metadata(self) -> None:
        """Hand this step's batch changes to the logits processors, and
        rebuild ``sampling_metadata`` if the batch changed. Call once per
        step, after ``condense()``."""
        batch_update = self.batch_update_builder.get_and_reset(self.num_reqs)
        # Every step, even unchanged: output lists grew (min-tokens watches them).
        for proc in self.logitsprocs.all:
            proc.update_state(batch_update)
        if batch_update is not None:
            self.sampling_metadata = self._make_sampling_metadata()

    def _copy_rows(self, cpu_tensor: torch.Tensor, device_tensor: torch.Tensor) -> torch.Tensor:
        """Copy rows 0..num_reqs-1 host -> device without waiting; returns the device rows."""
        n = self.num_reqs
        return device_tensor[:n].copy_(cpu_tensor[:n], non_blocking=True)

    def _make_sampling_metadata(self) -> SamplingMetadata:
        num_reqs = self.num_reqs
        temperature = None
        if not self.all_greedy:
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
        if not self.no_allowed_token_ids:
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
            generators=self.generators,
            max_num_logprobs=self.max_num_logprobs,
            no_penalties=self.no_penalties,
            prompt_token_ids=prompt_token_ids,
            frequency_penalties=self.frequency_penalties[:num_reqs],
            presence_penalties=self.presence_penalties[:num_reqs],
            repetition_penalties=self.repetition_penalties[:num_reqs],
            # The requests' own lists: tokens appended later are seen next step.
            output_token_ids=self.req_output_token_ids,  # type: ignore[arg-type]
            allowed_token_ids_mask=allowed_token_ids_mask,
            bad_words_token_ids=self.bad_words_token_ids,
            logitsprocs=self.logitsprocs,
            spec_token_ids=self.spec_token_ids,
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


def _swap_dict_values(d: dict[int, Any], a: int, b: int) -> None:
    """Exchange the entries of keys a and b (either may be missing)."""
    value_a, value_b = d.pop(a, None), d.pop(b, None)
    if value_a is not None:
        d[b] = value_a
    if value_b is not None:
        d[a] = value_b
