"""Collecting one step's batch changes, and holding the built processors.

vLLM twin: ``vllm/v1/sample/logits_processor/state.py``
(``BatchUpdateBuilder``, ``LogitsProcessors``).
Read it for:

- ``BatchUpdateBuilder``: the ``InputBatch`` records every row it frees
  (``removed_append``), fills (``added``) and moves (``moved``) during
  ``_update_states``; ``get_and_reset`` turns them into one ``BatchUpdate``
  for the processors. It also decides where a new request goes: the lowest
  freed row (``pop_removed``), so holes are refilled before the batch grows
  and ``condense`` has less to move.
- ``LogitsProcessors``: the engine's processors, split once into the two
  groups the Sampler runs at different points.

Sessions: 04 (the persistent batch), 05.

The rule the builder enforces: all removals of a step come first. Once the
freed rows have been read (by an add choosing its row, or by ``condense``),
another removal would make that choice stale, so it raises. A step runs:
remove ..., add ..., condense, (swap ...), ``get_and_reset``.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from itertools import chain

from engine.v1.sample.logits_processor.interface import (
    AddedRequest,
    BatchUpdate,
    LogitsProcessor,
    MovedRequest,
    RemovedRequest,
)


class BatchUpdateBuilder:
    """One step's added / removed / moved rows, built up by the InputBatch."""

    def __init__(
        self,
        removed: list[RemovedRequest] | None = None,
        added: list[AddedRequest] | None = None,
        moved: list[MovedRequest] | None = None,
    ) -> None:
        self._removed: list[RemovedRequest] = removed or []
        self.added: list[AddedRequest] = added or []
        self.moved: list[MovedRequest] = moved or []
        # Set once the freed rows have been read; no removal may follow.
        self._is_removed_sorted = False
        # Any add or removal this step (what a batch without processors needs).
        self.batch_changed = False

    def _ensure_removed_sorted(self) -> None:
        # Highest first, so the lowest freed row is at the end: pop() is O(1).
        if not self._is_removed_sorted:
            self._removed.sort(reverse=True)
            self._is_removed_sorted = True

    @property
    def removed(self) -> list[RemovedRequest]:
        """The freed rows not yet refilled, highest first."""
        self._ensure_removed_sorted()
        return self._removed

    def removed_append(self, index: int) -> None:
        """Record that row ``index`` was freed."""
        if self._is_removed_sorted:
            raise RuntimeError(
                "Cannot register new removed request after self.removed has been read."
            )
        self._removed.append(index)
        self.batch_changed = True

    def has_removed(self) -> bool:
        return bool(self._removed)

    def peek_removed(self) -> int | None:
        """The lowest freed row, or None."""
        if not self._removed:
            return None
        self._ensure_removed_sorted()
        return self._removed[-1]

    def pop_removed(self) -> int | None:
        """Take the lowest freed row (a new request or condense fills it)."""
        if not self._removed:
            return None
        self._ensure_removed_sorted()
        return self._removed.pop()

    def reset(self) -> bool:
        """Forget this step's changes; returns whether there were any."""
        changed = self.batch_changed
        self._removed.clear()
        self.added.clear()
        self.moved.clear()
        self._is_removed_sorted = False
        self.batch_changed = False
        return changed

    def get_and_reset(self, batch_size: int) -> BatchUpdate | None:
        """This step's changes as a BatchUpdate (None if there were none),
        and a clean builder for the next step."""
        self._is_removed_sorted = False
        self.batch_changed = False
        if not (self._removed or self.added or self.moved):
            return None
        # Hand the lists over and start new ones: the update keeps its own.
        update = BatchUpdate(
            batch_size=batch_size, removed=self._removed, added=self.added, moved=self.moved
        )
        self._removed, self.added, self.moved = [], [], []
        return update


class LogitsProcessors:
    """The engine's processors, split by whether they can move the argmax."""

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
