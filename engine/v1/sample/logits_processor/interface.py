"""The contract every logits processor follows.

vLLM twin: ``vllm/v1/sample/logits_processor/interface.py``
(``LogitsProcessor``, ``BatchUpdate``, ``MoveDirectionality``).
Read it for: the two questions the Sampler asks a processor -- "change these
logits" (``apply``) and "could you change which token is the argmax?"
(``is_argmax_invariant``). The answer decides *where* it runs: processors that
can change the argmax (min-tokens, logit bias) run before greedy sampling, on
every row; argmax-invariant ones (min-p) only matter for random sampling and
run after temperature scaling.
Sessions: 05, 06 (custom logits processors).

Simpler than vLLM: vLLM's processors are long-lived objects built once from
the engine config; each step the persistent batch sends them a
``BatchUpdate`` (rows added / removed / moved) and they patch their
per-row state incrementally, which avoids rebuilding tensors for a batch that
barely changed. Glassbox builds fresh processors for every step straight
from the batch's ``SamplingParams`` and output token ids (the constructor
below replaces ``update_state``). Same results, much less bookkeeping, more
Python work per step.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence

import torch

from engine.sampling_params import SamplingParams


class LogitsProcessor(ABC):
    @abstractmethod
    def __init__(
        self,
        params: Sequence[SamplingParams],
        output_token_ids: Sequence[Sequence[int]],
        device: torch.device | str,
    ) -> None:
        """Capture this step's per-row state. Row i is request i of the batch:
        ``params[i]`` and its generated ids so far ``output_token_ids[i]``."""

    @abstractmethod
    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """Transform logits [N, V] (may be in place) and return them."""

    @abstractmethod
    def is_argmax_invariant(self) -> bool:
        """True if this processor can never change a row's argmax."""

    def is_active(self) -> bool:
        """False when no row of this batch uses the processor (apply is a no-op)."""
        return True
