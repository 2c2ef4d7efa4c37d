"""Messages between the front end and EngineCore, as msgspec structs.

vLLM twin: ``vllm/v1/engine/__init__.py``.
Read it for: exactly what crosses the process boundary -- an
``EngineCoreRequest`` goes in, ``EngineCoreOutputs`` (a batch of per-request
``EngineCoreOutput`` deltas) comes out. Everything is a msgspec struct so the
ZMQ hop is one encode and one decode. A message *to* EngineCore is the ZMQ
frames ``[request_type, msgpack payload, *aux buffers]`` where the first frame
is one ``EngineCoreRequestType`` byte (ADD / ABORT / UTILITY); a message
*from* it is ``[msgpack EngineCoreOutputs, *aux buffers]``, or the single
frame ``ENGINE_CORE_DEAD`` when the core is going down.
Sessions: 01 (engine loop).

Simpler than vLLM: the multimodal, pooling, prompt-embedding and
data-parallel fields of ``EngineCoreRequest`` exist but are always None; no
data-parallel waves, KV-transfer, streaming-input or tracing-header fields;
utility results must be msgpack-native values (vLLM can fall back to pickle
for them when insecure serialization is allowed).
"""

from __future__ import annotations

import enum
import time
from typing import Any

import msgspec

from engine.lora.request import LoRARequest
from engine.sampling_params import SamplingParams
from engine.v1.metrics.stats import PrefillStats, SchedulerStats
from engine.v1.outputs import LogprobsLists


class FinishReason(enum.IntEnum):
    """Why a request ended; sent as a small int, shown as its OpenAI string."""

    STOP = 0
    LENGTH = 1
    ABORT = 2
    ERROR = 3
    REPETITION = 4

    def __str__(self) -> str:
        return self.name.lower()


class EngineCoreEventType(enum.IntEnum):
    QUEUED = 1
    SCHEDULED = 2
    PREEMPTED = 3


class EngineCoreEvent(msgspec.Struct, array_like=True, omit_defaults=True):
    """A timestamped lifecycle event recorded inside EngineCore."""

    type: EngineCoreEventType
    timestamp: float

    @classmethod
    def new_event(cls, event_type: EngineCoreEventType, timestamp: float | None = None):
        return cls(event_type, time.monotonic() if timestamp is None else timestamp)


class EngineCoreRequest(msgspec.Struct, array_like=True, omit_defaults=True):
    """One request on its way to EngineCore.

    Two ids, as in vLLM: ``external_req_id`` is what the user passed;
    ``request_id`` starts as that same id and is replaced by
    ``InputProcessor.assign_request_id`` with ``"{external}-{8 random hex}"``,
    the id the core, the scheduler and the trace use. Two requests with the
    same user id can therefore be in flight at once.
    ``mm_features``, ``pooling_params``, ``prompt_embeds`` and
    ``data_parallel_rank`` are vLLM's fields for features Glassbox does not
    have: always None, kept so vLLM's keyword calls build a request.
    ``lora_request`` names the request's adapter (None: the base model).
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    arrival_time: float
    mm_features: None = None
    pooling_params: None = None
    lora_request: LoRARequest | None = None
    cache_salt: str | None = None
    data_parallel_rank: int | None = None
    prompt_embeds: None = None
    client_index: int = 0
    priority: int = 0
    external_req_id: str | None = None

    @property
    def params(self) -> SamplingParams:
        """The request's processed parameters (vLLM: sampling or pooling)."""
        return self.sampling_params


class EngineCoreOutput(msgspec.Struct, array_like=True, omit_defaults=True):
    """One request's delta from one engine step."""

    request_id: str
    new_token_ids: list[int]
    # One row per new token (see LogprobsLists), when logprobs were asked for.
    new_logprobs: LogprobsLists | None = None
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None
    events: list[EngineCoreEvent] | None = None
    # On the request's first output only: its prompt split into computed and
    # cached tokens (the front end's RequestOutput.num_cached_tokens).
    prefill_stats: PrefillStats | None = None
    # On the request's first output, if it asked for prompt_logprobs: one row
    # per prompt position after the first (vLLM's name; rows, not tensors, here).
    new_prompt_logprobs_tensors: LogprobsLists | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class UtilityOutput(msgspec.Struct, array_like=True):
    """The answer to one UTILITY call, matched to its caller by ``call_id``."""

    call_id: int
    # Set when the call raised; ``result`` is then None.
    failure_message: str | None = None
    result: Any = None


class EngineCoreOutputs(msgspec.Struct, array_like=True, omit_defaults=True):
    outputs: list[EngineCoreOutput] = []
    scheduler_stats: SchedulerStats | None = None
    timestamp: float = 0.0
    finished_requests: set[str] | None = None
    engine_index: int = 0
    # Set (and ``outputs`` empty) when this batch answers a utility call.
    utility_output: UtilityOutput | None = None

    def __post_init__(self) -> None:
        if self.timestamp == 0.0:
            self.timestamp = time.monotonic()


class EngineCoreRequestType(enum.Enum):
    """First frame of every message to EngineCore says what follows.

    ADD carries an ``EngineCoreRequest``; ABORT a list of request ids; UTILITY
    ``(client_index, call_id, method_name, args)``. WAKEUP and EXECUTOR_FAILED
    never cross the socket: the core puts WAKEUP on its own input queue to
    wake the idle busy loop when a shutdown is requested, and the executor's
    failure callback puts EXECUTOR_FAILED there when a worker process dies.
    vLLM's ``b"\\x02"`` (START_DP_WAVE, data parallel) has no twin.
    """

    ADD = b"\x00"
    ABORT = b"\x01"
    UTILITY = b"\x03"
    EXECUTOR_FAILED = b"\x04"
    WAKEUP = b"\x05"


class EngineCoreReadyResponse(msgspec.Struct):
    """EngineCore's first message on the input socket once it is built: the
    values the front end could not know before the KV cache was sized."""

    max_model_len: int
    num_gpu_blocks: int
