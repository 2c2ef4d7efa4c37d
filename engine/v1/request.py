"""The request state machine as the scheduler sees it.

vLLM twin: ``vllm/v1/request.py`` (``Request``, ``RequestStatus``).
Read it for: the one rule the V1 scheduler is built on -- a request is just
``all_token_ids`` (prompt + generated) and a cursor ``num_computed_tokens``
saying how many of them already have KV in the cache. Prefill, chunked
prefill, prefix-cache hits, decode and recompute-after-preemption are all
"move the cursor toward ``num_tokens``".
Sessions: 02 (scheduler), 03 (KV cache: ``block_hashes``).

Simpler than vLLM: no multimodal features, LoRA, pooling, structured output,
streaming sessions, KV transfer, or async-scheduling placeholders.
"""

from __future__ import annotations

import enum
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from engine.v1.engine import EngineCoreEvent, EngineCoreEventType, FinishReason
from engine.v1.utils import ConstantList

if TYPE_CHECKING:
    from engine.sampling_params import SamplingParams
    from engine.v1.core.kv_cache_utils import BlockHash
    from engine.v1.engine import EngineCoreRequest


class RequestStatus(enum.IntEnum):
    """Where a request is in its life. Order matters: every member after
    PREEMPTED is a finished state."""

    WAITING = enum.auto()
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH_CAPPED = enum.auto()
    FINISHED_ABORTED = enum.auto()
    FINISHED_IGNORED = enum.auto()

    def __str__(self) -> str:
        return self.name

    @staticmethod
    def is_finished(status: RequestStatus) -> bool:
        return status > RequestStatus.PREEMPTED

    @staticmethod
    def get_finished_reason(status: RequestStatus) -> FinishReason | None:
        return _FINISHED_REASON_MAP.get(status)


_FINISHED_REASON_MAP = {
    RequestStatus.FINISHED_STOPPED: FinishReason.STOP,
    RequestStatus.FINISHED_LENGTH_CAPPED: FinishReason.LENGTH,
    RequestStatus.FINISHED_ABORTED: FinishReason.ABORT,
    # A prompt longer than the model allows is "ignored" and reported as length.
    RequestStatus.FINISHED_IGNORED: FinishReason.LENGTH,
}


class Request:
    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        client_index: int = 0,
        arrival_time: float | None = None,
        priority: int = 0,
        cache_salt: str | None = None,
        block_hasher: Callable[[Request], list[BlockHash]] | None = None,
    ) -> None:
        if not prompt_token_ids:
            raise ValueError(f"request {request_id!r}: prompt_token_ids must not be empty")
        self.request_id = request_id
        self.client_index = client_index
        self.priority = priority
        self.sampling_params = sampling_params
        self.arrival_time = arrival_time if arrival_time is not None else time.time()
        self.cache_salt = cache_salt

        self.status = RequestStatus.WAITING
        self.events: list[EngineCoreEvent] = []
        # Which stop token id / stop string ended the request, if any.
        self.stop_reason: int | str | None = None

        if sampling_params.max_tokens is None:
            raise ValueError(
                f"request {request_id!r}: sampling_params.max_tokens must be resolved "
                "(the input processor fills it from max_model_len) before scheduling"
            )
        self.max_tokens: int = sampling_params.max_tokens

        self.prompt_token_ids = list(prompt_token_ids)
        self.num_prompt_tokens = len(self.prompt_token_ids)
        self._output_token_ids: list[int] = []
        self._all_token_ids: list[int] = self.prompt_token_ids.copy()
        # Read-only views handed to everyone else.
        self.output_token_ids = ConstantList(self._output_token_ids)
        self.all_token_ids = ConstantList(self._all_token_ids)

        # Draft tokens from a speculator (kept for the seam; no speculator yet).
        self.spec_token_ids: list[int] = []
        # The cursor: tokens whose KV is (or will be, after this step) in cache.
        self.num_computed_tokens = 0
        # Prompt tokens served from the prefix cache the first time it was
        # scheduled (-1 until then). Reported as RequestOutput.num_cached_tokens.
        self.num_cached_tokens = -1
        self.num_preemptions = 0
        # True while the tokens scheduled so far stop short of num_tokens.
        self.is_prefill_chunk = False

        # Opt-out of prefix-cache *reads* (its blocks are still cached for
        # others); set when every prompt token must really be computed.
        self.skip_reading_prefix_cache = bool(
            getattr(sampling_params, "skip_reading_prefix_cache", None)
        )

        # Chained hashes of every *full* block of all_token_ids.
        self.block_hashes: list[BlockHash] = []
        self._block_hasher = block_hasher
        self.update_block_hashes()

    @classmethod
    def from_engine_core_request(
        cls,
        request: EngineCoreRequest,
        block_hasher: Callable[[Request], list[BlockHash]] | None,
    ) -> Request:
        return cls(
            request_id=request.request_id,
            prompt_token_ids=request.prompt_token_ids,
            sampling_params=request.sampling_params,
            client_index=request.client_index,
            arrival_time=request.arrival_time,
            priority=request.priority,
            cache_salt=request.cache_salt,
            block_hasher=block_hasher,
        )

    # -- token bookkeeping -------------------------------------------------
    def append_output_token_ids(self, token_ids: int | list[int]) -> None:
        if isinstance(token_ids, int):
            token_ids = [token_ids]
        self._output_token_ids.extend(token_ids)
        self._all_token_ids.extend(token_ids)
        # A generated token may complete a block: hash it so it can be cached.
        self.update_block_hashes()

    def update_block_hashes(self) -> None:
        if self._block_hasher is not None:
            self.block_hashes.extend(self._block_hasher(self))

    @property
    def num_tokens(self) -> int:
        return len(self._all_token_ids)

    @property
    def num_tokens_with_spec(self) -> int:
        return len(self._all_token_ids) + len(self.spec_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self._output_token_ids)

    # -- status --------------------------------------------------------------
    def is_finished(self) -> bool:
        return RequestStatus.is_finished(self.status)

    def get_finished_reason(self) -> FinishReason | None:
        return RequestStatus.get_finished_reason(self.status)

    def record_event(self, event_type: EngineCoreEventType, timestamp: float | None = None) -> None:
        self.events.append(EngineCoreEvent.new_event(event_type, timestamp))

    def take_events(self) -> list[EngineCoreEvent] | None:
        if not self.events:
            return None
        events, self.events = self.events, []
        return events

    def __lt__(self, other: Request) -> bool:
        """Priority-queue order: lower priority value first, then earlier
        arrival, then request id -- the same tie-breaks as vLLM."""
        if self.priority != other.priority:
            return self.priority < other.priority
        if self.arrival_time != other.arrival_time:
            return self.arrival_time < other.arrival_time
        if self.request_id != other.request_id:
            return self.request_id < other.request_id
        return id(self) < id(other)

    def __repr__(self) -> str:
        return (
            f"Request(id={self.request_id!r}, status={self.status}, "
            f"num_tokens={self.num_tokens}, num_computed_tokens={self.num_computed_tokens}, "
            f"priority={self.priority})"
        )
