"""The contract every scheduler implements.

vLLM twin: ``vllm/v1/core/sched/interface.py`` (``SchedulerInterface``).
Read it for: the whole conversation EngineCore has with a scheduler --
``add_request``, ``schedule``, ``update_from_output``, ``finish_requests`` and
a few counters. Sessions: 01, 02.
"""

from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from collections.abc import Iterable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from engine.v1.core.sched.output import SchedulerOutput
    from engine.v1.engine import EngineCoreOutputs
    from engine.v1.metrics.stats import SchedulerStats
    from engine.v1.outputs import DraftTokenIds, ModelRunnerOutput
    from engine.v1.request import Request, RequestStatus
    from engine.v1.spec_decode.metrics import SpecDecodingStats


class PauseState(enum.IntEnum):
    """What a paused scheduler still schedules (``EngineCore.pause_scheduler``):
    everything (UNPAUSED), only the running requests (PAUSED_NEW: the waiting
    ones stay queued), or nothing (PAUSED_ALL: every request is frozen)."""

    UNPAUSED = 0
    PAUSED_NEW = 1
    PAUSED_ALL = 2


class SchedulerInterface(ABC):
    @abstractmethod
    def schedule(self) -> SchedulerOutput:
        """Decide which requests run this step and how many tokens each gets."""

    @abstractmethod
    def update_from_output(
        self, scheduler_output: SchedulerOutput, model_runner_output: ModelRunnerOutput
    ) -> dict[int, EngineCoreOutputs]:
        """Apply sampled tokens, check stop conditions, free finished requests.
        Returns outputs grouped by client index."""

    @abstractmethod
    def add_request(self, request: Request) -> None:
        """Queue a new request: in ``waiting``, or in ``skipped_waiting`` if
        its status says it is blocked (``WAITING_FOR_*``)."""

    @abstractmethod
    def finish_requests(
        self, request_ids: str | Iterable[str] | None, finished_status: RequestStatus
    ) -> list[tuple[str, int]]:
        """End requests from outside (aborts); None means all of them."""

    @abstractmethod
    def get_num_unfinished_requests(self) -> int: ...

    def has_unfinished_requests(self) -> bool:
        return self.get_num_unfinished_requests() > 0

    @abstractmethod
    def has_finished_requests(self) -> bool:
        """Finished ids still to be reported to the worker."""

    def has_requests(self) -> bool:
        """Anything to do at all: unfinished requests, or finished ones whose
        ids the worker has not been told yet."""
        return self.has_unfinished_requests() or self.has_finished_requests()

    @abstractmethod
    def get_request_counts(self) -> tuple[int, int]:
        """(num_running_reqs, num_waiting_reqs)."""

    @abstractmethod
    def make_stats(
        self, spec_decoding_stats: SpecDecodingStats | None = None
    ) -> SchedulerStats | None: ...

    @abstractmethod
    def update_draft_token_ids(self, draft_token_ids: DraftTokenIds) -> None:
        """Speculative decoding: the drafts proposed after the last step, for
        the next one to verify."""

    @abstractmethod
    def reset_prefix_cache(
        self, reset_running_requests: bool = False, reset_connector: bool = False
    ) -> bool:
        """Forget the prefix cache; with ``reset_running_requests`` preempt
        every running request first so that it cannot fail."""

    def shutdown(self) -> None:
        pass
