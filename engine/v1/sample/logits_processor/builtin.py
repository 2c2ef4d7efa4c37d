"""The three built-in logits processors: min-p, logit bias, min-tokens.

vLLM twin: ``vllm/v1/sample/logits_processor/builtin.py``.
Read it for what each one does to a row of logits:

- ``MinPLogitsProcessor`` (argmax-invariant, runs after temperature): drop
  every token whose probability is below ``min_p`` times the row's largest
  probability. Adapts to how peaked the distribution is, unlike top-p.
- ``LogitBiasLogitsProcessor`` (can change the argmax): add
  ``params.logit_bias[token_id]`` to that token's logit.
- ``MinTokensLogitsProcessor`` (can change the argmax): while a request has
  generated fewer than ``min_tokens`` tokens, set the logits of its stop
  tokens (``params.all_stop_token_ids``: stop_token_ids plus EOS ids) to -inf
  so it cannot end early.

Sessions: 05.

Simpler than vLLM: each processor is built fresh for one step from the
batch's SamplingParams and output ids (see ``interface.py``); vLLM keeps them
alive across steps and updates their per-row state from ``BatchUpdate``
messages (``process_dict_updates``). The per-row state has vLLM's attribute
names: ``min_p``, ``biases``, ``min_toks``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from engine.sampling_params import SamplingParams
from engine.v1.sample.logits_processor.interface import LogitsProcessor


class MinPLogitsProcessor(LogitsProcessor):
    def __init__(
        self,
        params: Sequence[SamplingParams],
        output_token_ids: Sequence[Sequence[int]],
        device: torch.device | str,
    ) -> None:
        min_p_values = [sp.min_p for sp in params]
        self.min_p_count = sum(1 for v in min_p_values if v > 0)
        # [N, 1] float32; 0 for rows that do not use min-p (nothing is below 0).
        self.min_p = torch.tensor(min_p_values, dtype=torch.float32, device=device).unsqueeze(1)

    def is_argmax_invariant(self) -> bool:
        # The most likely token always passes its own threshold.
        return True

    def is_active(self) -> bool:
        return self.min_p_count > 0

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        if not self.min_p_count:
            return logits
        probs = logits.softmax(dim=-1)
        max_prob = probs.amax(dim=-1, keepdim=True)  # [N, 1]
        return logits.masked_fill_(probs < max_prob * self.min_p, float("-inf"))


class LogitBiasLogitsProcessor(LogitsProcessor):
    def __init__(
        self,
        params: Sequence[SamplingParams],
        output_token_ids: Sequence[Sequence[int]],
        device: torch.device | str,
    ) -> None:
        # row -> {token_id: bias}, only rows with a non-empty logit_bias.
        self.biases: dict[int, dict[int, float]] = {
            row: dict(sp.logit_bias) for row, sp in enumerate(params) if sp.logit_bias
        }
        rows: list[int] = []
        token_ids: list[int] = []
        values: list[float] = []
        for row, bias in self.biases.items():
            rows.extend([row] * len(bias))
            token_ids.extend(bias.keys())
            values.extend(bias.values())
        # Flat (row, token) coordinates and the bias to add at each.
        self.logits_slice = (
            torch.tensor(rows, dtype=torch.int64, device=device),
            torch.tensor(token_ids, dtype=torch.int64, device=device),
        )
        self.bias_tensor = torch.tensor(values, dtype=torch.float32, device=device)

    def is_argmax_invariant(self) -> bool:
        return False

    def is_active(self) -> bool:
        return bool(self.biases)

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        if self.biases:
            # Each (row, token) pair appears once, so += cannot lose an update.
            logits[self.logits_slice] += self.bias_tensor.to(logits.dtype)
        return logits


class MinTokensLogitsProcessor(LogitsProcessor):
    def __init__(
        self,
        params: Sequence[SamplingParams],
        output_token_ids: Sequence[Sequence[int]],
        device: torch.device | str,
    ) -> None:
        # row -> (min_tokens, generated ids so far, stop ids to mask), only rows
        # still short of their minimum.
        self.min_toks: dict[int, tuple[int, Sequence[int], set[int]]] = {
            row: (sp.min_tokens, output_token_ids[row], sp.all_stop_token_ids)
            for row, sp in enumerate(params)
            if sp.min_tokens and len(output_token_ids[row]) < sp.min_tokens
        }
        rows: list[int] = []
        token_ids: list[int] = []
        for row, (_, _, stop_ids) in self.min_toks.items():
            rows.extend([row] * len(stop_ids))
            token_ids.extend(sorted(stop_ids))
        self.logits_slice = (
            torch.tensor(rows, dtype=torch.int64, device=device),
            torch.tensor(token_ids, dtype=torch.int64, device=device),
        )

    def is_argmax_invariant(self) -> bool:
        # Hiding EOS can change which token is most likely.
        return False

    def is_active(self) -> bool:
        return bool(self.min_toks)

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        if self.min_toks:
            logits[self.logits_slice] = float("-inf")
        return logits
