"""The three built-in logits processors: min-p, logit bias, min-tokens.

vLLM twin: ``vllm/v1/sample/logits_processor/builtin.py``.
Read it for what each one does to a row of logits, and how each keeps its
per-row state in step with the persistent batch:

- ``MinPLogitsProcessor`` (argmax-invariant, runs after temperature): drop
  every token whose probability is below ``min_p`` times the row's largest
  probability. Adapts to how peaked the distribution is, unlike top-p.
  State: one ``min_p`` value per row in a preallocated host array (0 = off),
  copied to a device twin only when a row changed.
- ``LogitBiasLogitsProcessor`` (can change the argmax): add
  ``params.logit_bias[token_id]`` to that token's logit. State: ``biases``,
  {row: {token: bias}} for the rows that have one.
- ``MinTokensLogitsProcessor`` (can change the argmax): while a request has
  generated fewer than ``min_tokens`` tokens, set the logits of its stop
  tokens (``params.all_stop_token_ids``: stop_token_ids plus EOS ids) to -inf
  so it cannot end early. State: ``min_toks``, {row: (min_tokens, the
  request's own output list, stop ids)}; because the list is the request's
  own, ``update_state`` sees it grow and drops the row once it is long enough.

The two sparse ones share ``process_dict_updates``, which applies a
``BatchUpdate`` to a {row: state} dict. Each processor rebuilds its device
tensors only when its state changed, so a steady decode batch costs nothing.

Sessions: 05.

Simpler than vLLM: no speculative-decoding variant of min-tokens
(``apply_with_spec_decode``). Index tensors are int64 (vLLM: int32).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, TypeVar

import torch

from engine.sampling_params import SamplingParams
from engine.v1.sample.logits_processor.interface import (
    BatchUpdate,
    LogitsProcessor,
    MoveDirectionality,
)

if TYPE_CHECKING:
    from engine.config import GlassboxConfig

T = TypeVar("T")


class MinPLogitsProcessor(LogitsProcessor):
    def __init__(
        self, glassbox_config: GlassboxConfig, device: torch.device, is_pin_memory: bool
    ) -> None:
        max_num_reqs = glassbox_config.scheduler_config.max_num_seqs
        # Rows with min_p > 0; apply() is a no-op while this is 0.
        self.min_p_count = 0
        self.min_p_cpu_tensor = torch.zeros(
            max_num_reqs, dtype=torch.float32, pin_memory=is_pin_memory
        )
        self.min_p_cpu = self.min_p_cpu_tensor.numpy()
        # On the CPU the host array is the tensor apply() reads: no copy.
        self.use_double_tensor = torch.device(device).type != "cpu"
        if self.use_double_tensor:
            self.min_p_device = torch.empty(max_num_reqs, dtype=torch.float32, device=device)
        else:
            self.min_p_device = self.min_p_cpu_tensor
        # [batch_size, 1]: the live rows, shaped to broadcast over the vocab.
        self.min_p: torch.Tensor = self.min_p_device[:0].unsqueeze(1)

    def is_argmax_invariant(self) -> bool:
        # The most likely token always passes its own threshold.
        return True

    def is_active(self) -> bool:
        return self.min_p_count > 0

    def get_min_p_by_index(self, index: int) -> float:
        return float(self.min_p_cpu[index])

    def _set(self, row: int, value: float) -> bool:
        """Row ``row`` now has ``value``; returns whether it changed."""
        old = float(self.min_p_cpu[row])
        if old == value:
            return False
        self.min_p_count += (value > 0) - (old > 0)
        self.min_p_cpu[row] = value
        return True

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        if batch_update is None:
            return
        changed = False
        for row in batch_update.removed:
            changed |= self._set(row, 0.0)
        for row, params, _, _ in batch_update.added:
            changed |= self._set(row, params.min_p)
        for a, b, direction in batch_update.moved:
            value_a, value_b = float(self.min_p_cpu[a]), float(self.min_p_cpu[b])
            if direction == MoveDirectionality.SWAP:
                self.min_p_cpu[a], self.min_p_cpu[b] = value_b, value_a
                changed |= value_a != value_b
            else:
                changed |= self._set(b, value_a)
                changed |= self._set(a, 0.0)
        size = batch_update.batch_size
        if self.min_p_count and (changed or self.min_p.shape[0] != size):
            rows = self.min_p_device[:size]
            if self.use_double_tensor:
                rows.copy_(self.min_p_cpu_tensor[:size], non_blocking=True)
            self.min_p = rows.unsqueeze(1)

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        if not self.min_p_count:
            return logits
        probs = logits.softmax(dim=-1)
        max_prob = probs.amax(dim=-1, keepdim=True)  # [N, 1]
        return logits.masked_fill_(probs < max_prob * self.min_p, float("-inf"))


class LogitBiasLogitsProcessor(LogitsProcessor):
    def __init__(
        self, glassbox_config: GlassboxConfig, device: torch.device, is_pin_memory: bool
    ) -> None:
        self.device = device
        self.pin_memory = is_pin_memory
        # row -> {token_id: bias}, only rows with a non-empty logit_bias.
        self.biases: dict[int, dict[int, float]] = {}
        # Flat (row, token) coordinates and the bias to add at each.
        self.bias_tensor = self._device_tensor([], torch.float32)
        self.logits_slice = (
            self._device_tensor([], torch.int64),
            self._device_tensor([], torch.int64),
        )

    def is_argmax_invariant(self) -> bool:
        return False

    def is_active(self) -> bool:
        return bool(self.biases)

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        if not process_dict_updates(
            self.biases, batch_update, lambda params, _, __: params.logit_bias or None
        ):
            return
        rows: list[int] = []
        token_ids: list[int] = []
        values: list[float] = []
        for row, bias in self.biases.items():
            rows.extend([row] * len(bias))
            token_ids.extend(bias.keys())
            values.extend(bias.values())
        self.bias_tensor = self._device_tensor(values, torch.float32)
        self.logits_slice = (
            self._device_tensor(rows, torch.int64),
            self._device_tensor(token_ids, torch.int64),
        )

    def _device_tensor(self, data: list, dtype: torch.dtype) -> torch.Tensor:
        host = torch.tensor(data, dtype=dtype, pin_memory=self.pin_memory)
        return host.to(self.device, non_blocking=True)

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        if self.biases:
            # Each (row, token) pair appears once, so += cannot lose an update.
            logits[self.logits_slice] += self.bias_tensor.to(logits.dtype)
        return logits


class MinTokensLogitsProcessor(LogitsProcessor):
    def __init__(
        self, glassbox_config: GlassboxConfig, device: torch.device, is_pin_memory: bool
    ) -> None:
        self.device = device
        self.pin_memory = is_pin_memory
        # row -> (min_tokens, the request's output ids, stop ids to mask), only
        # rows still short of their minimum.
        self.min_toks: dict[int, tuple[int, Sequence[int], set[int]]] = {}
        self.logits_slice = (
            self._device_tensor([], torch.int64),
            self._device_tensor([], torch.int64),
        )

    def is_argmax_invariant(self) -> bool:
        # Hiding EOS can change which token is most likely.
        return False

    def is_active(self) -> bool:
        return bool(self.min_toks)

    @staticmethod
    def add_request(
        params: SamplingParams, _: list[int] | None, output_tok_ids: list[int]
    ) -> tuple[int, Sequence[int], set[int]] | None:
        """The row's state, or None when min_tokens is off or already met."""
        if not params.min_tokens or len(output_tok_ids) >= params.min_tokens:
            return None
        return params.min_tokens, output_tok_ids, params.all_stop_token_ids

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        changed = process_dict_updates(self.min_toks, batch_update, self.add_request)
        # The output lists grew since the last step: drop rows that are done.
        reached = [row for row, (n, out, _) in self.min_toks.items() if len(out) >= n]
        for row in reached:
            del self.min_toks[row]
        if not (changed or reached):
            return
        rows: list[int] = []
        token_ids: list[int] = []
        for row, (_, _, stop_ids) in self.min_toks.items():
            rows.extend([row] * len(stop_ids))
            token_ids.extend(sorted(stop_ids))
        self.logits_slice = (
            self._device_tensor(rows, torch.int64),
            self._device_tensor(token_ids, torch.int64),
        )

    def _device_tensor(self, data: list, dtype: torch.dtype) -> torch.Tensor:
        host = torch.tensor(data, dtype=dtype, pin_memory=self.pin_memory)
        return host.to(self.device, non_blocking=True)

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        if self.min_toks:
            logits[self.logits_slice] = float("-inf")
        return logits


def process_dict_updates(
    req_entries: dict[int, T],
    batch_update: BatchUpdate | None,
    new_state: Callable[[SamplingParams, list[int] | None, list[int]], T | None],
) -> bool:
    """Apply ``batch_update`` to ``req_entries`` ({row: state}, rows that need
    the processor only). ``new_state(params, prompt ids, output ids)`` gives an
    added row's state, or None if the processor ignores that request.
    Returns whether any entry changed."""
    if batch_update is None:
        return False
    changed = False
    for row in batch_update.removed:
        changed |= req_entries.pop(row, None) is not None
    for row, params, prompt_tok_ids, output_tok_ids in batch_update.added:
        state = new_state(params, prompt_tok_ids, output_tok_ids)
        if state is not None:
            req_entries[row] = state
            changed = True
        else:
            # The row's previous holder may have used the processor.
            changed |= req_entries.pop(row, None) is not None
    for a, b, direction in batch_update.moved:
        entry_a = req_entries.pop(a, None)
        entry_b = req_entries.pop(b, None)
        if entry_a is not None:
            req_entries[b] = entry_a
            changed = True
        if entry_b is not None:
            changed = True
            if direction == MoveDirectionality.SWAP:
                req_entries[a] = entry_b
    return changed
