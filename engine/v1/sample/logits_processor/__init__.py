"""Logits processors: the built-in list and the per-step container.

vLLM twin: ``vllm/v1/sample/logits_processor/__init__.py``
(``BUILTIN_LOGITS_PROCESSORS``, plugin loading, ``build_logitsprocs``) and
``logits_processor/state.py`` (``LogitsProcessors``, the container that splits
processors into argmax-invariant and not).
Read it for: which processors exist and how the Sampler finds them
(``sampling_metadata.logitsprocs.non_argmax_invariant`` before greedy
sampling, ``.argmax_invariant`` after temperature).
Sessions: 05, 06.

Simpler than vLLM: no plugin entry points or ``--logits-processors`` custom
classes, and processors are rebuilt for every step from the batch (see
``interface.py``), so ``build_logitsprocs`` takes the batch rather than the
engine config.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from itertools import chain

import torch

from engine.sampling_params import SamplingParams
from engine.v1.sample.logits_processor.builtin import (
    LogitBiasLogitsProcessor,
    MinPLogitsProcessor,
    MinTokensLogitsProcessor,
)
from engine.v1.sample.logits_processor.interface import LogitsProcessor

# Applied in this order within each group (vLLM's order).
BUILTIN_LOGITS_PROCESSORS: list[type[LogitsProcessor]] = [
    MinTokensLogitsProcessor,
    LogitBiasLogitsProcessor,
    MinPLogitsProcessor,
]


class LogitsProcessors:
    """The processors for one step, split by whether they can move the argmax."""

    def __init__(self, logitsprocs: Iterable[LogitsProcessor] | None = None) -> None:
        self.argmax_invariant: list[LogitsProcessor] = []
        self.non_argmax_invariant: list[LogitsProcessor] = []
        for proc in logitsprocs or ():
            if proc.is_argmax_invariant():
                self.argmax_invariant.append(proc)
            else:
                self.non_argmax_invariant.append(proc)

    @property
    def all(self) -> Iterator[LogitsProcessor]:
        return chain(self.argmax_invariant, self.non_argmax_invariant)

    def __repr__(self) -> str:
        def names(procs: list[LogitsProcessor]) -> str:
            return ", ".join(type(p).__name__ for p in procs)

        return (
            f"LogitsProcessors(non_argmax_invariant=[{names(self.non_argmax_invariant)}], "
            f"argmax_invariant=[{names(self.argmax_invariant)}])"
        )


def build_logitsprocs(
    params: Sequence[SamplingParams],
    output_token_ids: Sequence[Sequence[int]],
    device: torch.device | str,
) -> LogitsProcessors:
    """Build the built-in processors for this batch, keeping only those some row uses."""
    procs = (cls(params, output_token_ids, device) for cls in BUILTIN_LOGITS_PROCESSORS)
    return LogitsProcessors(proc for proc in procs if proc.is_active())


__all__ = [
    "BUILTIN_LOGITS_PROCESSORS",
    "LogitBiasLogitsProcessor",
    "LogitsProcessor",
    "LogitsProcessors",
    "MinPLogitsProcessor",
    "MinTokensLogitsProcessor",
    "build_logitsprocs",
]
