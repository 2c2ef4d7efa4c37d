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

Simpler than vLLM: no multimodal features, LoRA, pooling, data-parallel waves
or KV-transfer fields; utility results must be msgpack-native values (vLLM can
fall back to pickle for them when insecure serialization is allowed).
"""

from __future__ import annotations

import enum
import time
from typing import Any

import msgspec

from engine.sampling_params import SamplingParams
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
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    arrival_time: float
    priority: int = 0
    client_index: int = 0
    cache_salt: str | None = None


class EngineCoreOutput(msgspec.Struct, array_like=True, omit_defaults=True):
    """One request's delta from one engine step."""

    request_id: str
    new_token_ids: list[int]
    # One row per new token (see LogprobsLists), when logprobs were asked for.
    new_logprobs: LogprobsLists | None = None
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None
    events: list[EngineCoreEvent] | None = None
    num_cached_tokens: int = 0

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class SchedulerStats(msgspec.Struct, omit_defaults=True):
    """Snapshot of scheduler state after a step (vLLM: v1/metrics/stats.py)."""

    num_running_reqs: int = 0
    num_waiting_reqs: int = 0
    kv_cache_usage: float = 0.0
    num_preemptions: int = 0  # preemptions during this step
    prefix_cache_queries: int = 0  # tokens looked up this step
    prefix_cache_hits: int = 0  # tokens found this step


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
    ``(client_index, call_id, method_name, args)``. WAKEUP never crosses the
    socket: the core puts it on its own input queue to wake the idle busy
    loop when a shutdown is requested. vLLM's ``b"\\x02"`` (START_DP_WAVE,
    data parallel) and ``b"\\x04"`` (EXECUTOR_FAILED, from its multi-process
    executor's failure callback) have no twin: Glassbox's in-process executor
    raises inside the step instead.
    """

    ADD = b"\x00"
    ABORT = b"\x01"
    UTILITY = b"\x03"
    WAKEUP = b"\x05"


class EngineCoreReadyResponse(msgspec.Struct):
    """EngineCore's first message on the input socket once it is built: the
    values the front end could not know before the KV cache was sized."""

    max_model_len: int
    num_gpu_blocks: int
