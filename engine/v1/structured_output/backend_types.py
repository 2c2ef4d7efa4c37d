"""The two interfaces a structured-output backend implements.

vLLM twin: ``vllm/v1/structured_output/backend_types.py``.
Read it for the split of work: a ``StructuredOutputBackend`` lives once per
engine (it owns the tokenizer's vocabulary and a grammar compiler) and turns a
request's constraint into a ``StructuredOutputGrammar``, which lives once per
request and is a cursor into the compiled grammar (xgrammar calls it a
matcher): it accepts sampled tokens, rolls back rejected drafts, and writes
the set of tokens allowed next into one row of a bitmask.
Sessions: 06 (advanced: structured outputs).

Simpler than vLLM: no ``STRUCTURAL_TAG`` option (tool-call tags); one backend
(xgrammar).
"""

from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch


class StructuredOutputOptions(enum.Enum):
    JSON = enum.auto()
    JSON_OBJECT = enum.auto()
    REGEX = enum.auto()
    GRAMMAR = enum.auto()
    CHOICE = enum.auto()


# (kind, spec as a string): what a compiled grammar is cached under.
StructuredOutputKey = tuple[StructuredOutputOptions, str]


class StructuredOutputGrammar(ABC):
    """One request's position in its compiled grammar."""

    @abstractmethod
    def accept_tokens(self, request_id: str, tokens: list[int]) -> bool:
        """Advance over ``tokens``; False (and no advance past the first
        refused token) when the grammar does not allow one of them."""

    @abstractmethod
    def validate_tokens(self, tokens: list[int]) -> list[int]:
        """The longest prefix of ``tokens`` the grammar allows from here,
        leaving the state unchanged (used on drafts)."""

    @abstractmethod
    def rollback(self, num_tokens: int) -> None:
        """Undo the last ``num_tokens`` accepted tokens."""

    @abstractmethod
    def fill_bitmask(self, bitmask: torch.Tensor, batch_index: int) -> None:
        """Write the tokens allowed next into row ``batch_index`` (bit set =
        allowed; 32 tokens per int32)."""

    @abstractmethod
    def is_terminated(self) -> bool:
        """True once the grammar has accepted a stop token."""

    @abstractmethod
    def reset(self) -> None:
        """Back to the start of the grammar."""


@dataclass
class StructuredOutputBackend(ABC):
    """Per-engine compiler of constraints into grammars."""

    glassbox_config: Any
    tokenizer: Any
    vocab_size: int

    @abstractmethod
    def compile_grammar(
        self, request_type: StructuredOutputOptions, grammar_spec: str
    ) -> StructuredOutputGrammar:
        """Compile (or take from the cache) and return a fresh matcher."""

    @abstractmethod
    def allocate_token_bitmask(self, max_num_seqs: int) -> torch.Tensor:
        """An int32 bitmask of ``max_num_seqs`` rows covering the vocabulary."""

    @abstractmethod
    def destroy(self) -> None:
        """Release the compiler."""
