"""The contract every logits processor follows, and the batch-change message.

vLLM twin: ``vllm/v1/sample/logits_processor/interface.py``
(``LogitsProcessor``, ``BatchUpdate``, ``MoveDirectionality``).
Read it for:

- the two questions the Sampler asks a processor -- "change these logits"
  (``apply``) and "could you change which token is the argmax?"
  (``is_argmax_invariant``). The answer decides *where* it runs: processors
  that can change the argmax (min-tokens, logit bias) run before greedy
  sampling, on every row; argmax-invariant ones (min-p) only matter for random
  sampling and run after temperature scaling.
- the life of a processor: it is built once per engine from the config
  (``__init__(glassbox_config, device, is_pin_memory)``) and lives as long as
  the persistent batch. Before every step the batch calls
  ``update_state(batch_update)`` with what changed since the last step --
  rows added (with the request's params and a *reference* to its growing list
  of output ids), rows removed, rows moved -- or ``None`` when nothing changed.
  The processor patches its per-row state from that, so a batch that barely
  changes costs it almost nothing.

A ``BatchUpdate`` is read in the order removed, added, moved. The
``InputBatch`` never reports a row as both removed and added in one update: a
new request that takes a freed row simply replaces it (``added`` overwrites
whatever the row held). A move is ``(a, b, UNIDIRECTIONAL)`` -- row ``a``'s
request now lives in row ``b`` and row ``a`` is empty (what ``condense`` does)
-- or ``(a, b, SWAP)`` -- the two rows traded places (``swap_states``).

Sessions: 05, 06 (custom logits processors).

Simpler than vLLM: no ``AdapterLogitsProcessor`` (the wrapper that turns
per-request callables into a batch processor). With speculative decoding
only min-tokens runs (on the drafts, inside the rejection sampler), as in vLLM.

Glassbox addition: ``is_active()`` (default True) tells the sampler trace
whether ``apply`` would change anything this step, so a stage no row uses is
not recorded; vLLM's processors only return early inside ``apply``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum, auto
from typing import TYPE_CHECKING

import torch

from engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from engine.config import GlassboxConfig


class MoveDirectionality(Enum):
    # Row a's request now lives in row b; row a is left empty.
    UNIDIRECTIONAL = auto()
    # Rows a and b traded their requests.
    SWAP = auto()


# The row a request left.
RemovedRequest = int
# (row, params, prompt ids, output ids): the output list is the request's own,
# so a processor that keeps it sees every token appended later.
AddedRequest = tuple[int, SamplingParams, list[int] | None, list[int]]
# (row a, row b, how).
MovedRequest = tuple[int, int, MoveDirectionality]


@dataclass(frozen=True)
class BatchUpdate:
    """How the persistent batch changed since the last step."""

    batch_size: int  # rows 0..batch_size-1 are live after this update
    removed: Sequence[RemovedRequest]
    added: Sequence[AddedRequest]
    moved: Sequence[MovedRequest]


class LogitsProcessor(ABC):
    @classmethod
    def validate_params(cls, sampling_params: SamplingParams) -> None:
        """Raise ValueError if this processor cannot serve ``sampling_params``.

        Called when a request arrives, before it reaches the batch."""
        return None

    @abstractmethod
    def __init__(
        self, glassbox_config: GlassboxConfig, device: torch.device, is_pin_memory: bool
    ) -> None:
        """Built once per engine. ``is_pin_memory``: stage host -> device
        copies in pinned memory so they do not block."""

    @abstractmethod
    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """Transform logits [N, V] (may be in place) and return them."""

    @abstractmethod
    def is_argmax_invariant(self) -> bool:
        """True if this processor can never change a row's argmax."""

    @abstractmethod
    def update_state(self, batch_update: BatchUpdate | None) -> None:
        """Called before every step. ``batch_update`` is None when no row was
        added, removed or moved; output lists may still have grown."""

    def is_active(self) -> bool:
        """False when ``apply`` would leave every row unchanged this step."""
        return True
