"""The request state machine as the scheduler sees it.

vLLM twin: ``vllm/v1/request.py`` (``Request``, ``RequestStatus``).
Read it for: the one rule the V1 scheduler is built on -- a request is just
``all_token_ids`` (prompt + generated) and a cursor ``num_computed_tokens``
saying how many of them already have KV in the cache. Prefill, chunked
prefill, prefix-cache hits, decode and recompute-after-preemption are all
"move the cursor toward ``num_tokens``". The ``WAITING_FOR_*`` statuses mark
a waiting request that is blocked on something other than space (a grammar
still compiling, remote KV, more streamed input); the scheduler parks those
in its ``skipped_waiting`` queue.
Sessions: 02 (scheduler), 03 (KV cache: ``block_hashes``).

The constructor takes vLLM's arguments in vLLM's order. ``pooling_params``,
``mm_features``, ``prompt_embeds`` and ``prompt_is_token_ids`` are for
features Glassbox does not have: a value other than None (or an empty
``mm_features``) raises ValueError naming the field. ``lora_request`` is
the request's adapter (a ``LoRARequest``; None: the base model). A request
whose sampling parameters carry
``structured_outputs`` starts in ``WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR``
with a ``structured_output_request`` (session 06).

Simpler than vLLM: no streaming-input sessions (``resumable``), reasoning
parser state, NaN counting, or a ``FINISHED_ERROR`` status (a grammar that
fails to compile ends the request as ``FINISHED_ABORTED``). ``prefill_stats``
never counts external (KV connector) tokens.

Differs from vLLM on purpose: ``pooling_params`` defaults to None (vLLM
requires it).
"""

from __future__ import annotations

import enum
import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from engine.v1.engine import EngineCoreEvent, EngineCoreEventType, FinishReason
from engine.v1.metrics.stats import PrefillStats
from engine.v1.structured_output.request import StructuredOutputRequest
from engine.v1.utils import ConstantList

if TYPE_CHECKING:
    from engine.sampling_params import SamplingParams
    from engine.v1.core.kv_cache_utils import BlockHash
    from engine.v1.engine import EngineCoreRequest


class RequestStatus(enum.IntEnum):
    """Where a request is in its life. Order matters: every member after
    PREEMPTED is a finished state."""

    WAITING = enum.auto()
    # Blocked waiting states: the request sits in ``skipped_waiting``.
    WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR = enum.auto()
    WAITING_FOR_REMOTE_KVS = enum.auto()
    WAITING_FOR_STREAMING_REQ = enum.auto()
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH_CAPPED = enum.auto()
    FINISHED_ABORTED = enum.auto()
    FINISHED_IGNORED = enum.auto()
    FINISHED_REPETITION = enum.auto()

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
    RequestStatus.FINISHED_REPETITION: FinishReason.REPETITION,
}


class Request:
    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int] | None,
        sampling_params: SamplingParams | None,
        pooling_params: object | None = None,
        client_index: int = 0,
        arrival_time: float | None = None,
        prompt_embeds: object | None = None,
        prompt_is_token_ids: list[bool] | None = None,
        mm_features: list[Any] | None = None,
        lora_request: object | None = None,
        cache_salt: str | None = None,
        priority: int = 0,
        trace_headers: Mapping[str, str] | None = None,
        block_hasher: Callable[[Request], list[BlockHash]] | None = None,
    ) -> None:
        self.request_id = request_id
        self.client_index = client_index
        self.priority = priority
        self.sampling_params = sampling_params
        self.pooling_params = pooling_params
        # Its adapter: the scheduler counts it, the prefix cache hashes its name.
        self.lora_request = lora_request
        # A constrained request waits for its grammar before it may be scheduled.
        self.structured_output_request: StructuredOutputRequest | None = (
            StructuredOutputRequest.from_sampling_params(sampling_params)
        )
        self.arrival_time = arrival_time if arrival_time is not None else time.time()

        self.status = RequestStatus.WAITING
        if self.structured_output_request is not None:
            self.status = RequestStatus.WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR
        self.events: list[EngineCoreEvent] = []
        # Which stop token id / stop string ended the request, if any.
        self.stop_reason: int | str | None = None
        # Parameters for a KV connector (vLLM's disaggregated prefill); unused here.
        self.kv_transfer_params: dict[str, Any] | None = None

        if pooling_params is not None:
            raise ValueError(
                f"request {request_id!r}: pooling_params is not supported "
                "(Glassbox serves generative models only)"
            )
        if sampling_params is None:
            raise ValueError("sampling_params and pooling_params can't both be unset")
        if sampling_params.max_tokens is None:
            raise ValueError(
                f"request {request_id!r}: sampling_params.max_tokens must be resolved "
                "(the input processor fills it from max_model_len) before scheduling"
            )
        self.max_tokens: int = sampling_params.max_tokens
        if sampling_params.extra_args is not None:
            self.kv_transfer_params = sampling_params.extra_args.get("kv_transfer_params")

        if prompt_embeds is not None or prompt_is_token_ids is not None:
            field = "prompt_embeds" if prompt_embeds is not None else "prompt_is_token_ids"
            raise ValueError(
                f"request {request_id!r}: {field} is not supported (Glassbox takes token ids)"
            )
        if mm_features:
            raise ValueError(
                f"request {request_id!r}: mm_features is not supported "
                "(Glassbox serves text-only models)"
            )
        if not prompt_token_ids:
            raise ValueError(f"request {request_id!r}: prompt_token_ids must not be empty")
        self.prompt_token_ids = list(prompt_token_ids)
        self.prompt_embeds = None
        self.prompt_is_token_ids = None
        self.num_prompt_tokens = len(self.prompt_token_ids)
        self._output_token_ids: list[int] = []
        self._all_token_ids: list[int] = self.prompt_token_ids.copy()
        # Async scheduling: tokens that steps in flight will sample, not yet in
        # the output list. All but the newest are already inputs of a later
        # step, so their positions count in num_computed_tokens.
        self.num_output_placeholders = 0
        # Async scheduling: frames still in flight when reset_prefix_cache
        # preempted the request; their tokens are dropped when they arrive.
        self.async_tokens_to_discard = 0

        # Speculative decoding: the drafts the proposer made after the last
        # step (``Scheduler.update_draft_token_ids``), verified by the next.
        self.spec_token_ids: list[int] = []
        # The cursor: tokens whose KV is (or will be, after this step) in cache.
        self.num_computed_tokens = 0
        self.cache_salt = cache_salt
        self.mm_features: list[Any] = []

        # Read-only views handed to everyone else.
        self.output_token_ids = ConstantList(self._output_token_ids)
        self.all_token_ids = ConstantList(self._all_token_ids)
        self.trace_headers = trace_headers

        # True while the tokens scheduled so far stop short of num_tokens.
        self.is_prefill_chunk = False
        self.num_preemptions = 0
        # Filled by the scheduler at admission; handed to the first output
        # (take_prefill_stats), None after that.
        self.prefill_stats: PrefillStats | None = PrefillStats()

        # Chained hashes of every *full* block of all_token_ids.
        self.block_hashes: list[BlockHash] = []
        self._block_hasher = block_hasher
        self.update_block_hashes()

        # Opt-out of prefix-cache *reads* (its blocks are still cached for
        # others); set when every prompt token must really be computed.
        self.skip_reading_prefix_cache = bool(sampling_params.skip_reading_prefix_cache)

    @classmethod
    def from_engine_core_request(
        cls,
        request: EngineCoreRequest,
        block_hasher: Callable[[Request], list[BlockHash]] | None,
    ) -> Request:
        return cls(
            request_id=request.request_id,
            client_index=request.client_index,
            prompt_token_ids=request.prompt_token_ids,
            prompt_embeds=request.prompt_embeds,
            mm_features=request.mm_features,
            sampling_params=request.sampling_params,
            pooling_params=request.pooling_params,
            arrival_time=request.arrival_time,
            lora_request=request.lora_request,
            cache_salt=request.cache_salt,
            priority=request.priority,
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

    @property
    def use_structured_output(self) -> bool:
        return self.structured_output_request is not None

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

    def take_prefill_stats(self) -> PrefillStats | None:
        """The prefill numbers, once: the first output takes them, later ones get None."""
        prefill_stats, self.prefill_stats = self.prefill_stats, None
        return prefill_stats

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
