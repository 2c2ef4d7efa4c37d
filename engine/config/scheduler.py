"""SchedulerConfig: the token budget and the admission rules.

vLLM twin: ``vllm/config/scheduler.py`` (``SchedulerConfig``).
Read it for: ``max_num_batched_tokens`` (the per-step token budget, the master
knob of continuous batching), ``max_num_seqs``, ``enable_chunked_prefill``,
``long_prefill_token_threshold``, ``scheduler_reserve_full_isl`` and
``policy``.
Sessions: 02 (scheduler).

``async_scheduling`` (None until ``GlassboxConfig`` resolves it, by vLLM's
rules: on unless the executor cannot overlap steps) picks the scheduler class
(``get_scheduler_cls``): ``AsyncScheduler`` or ``Scheduler``.

Simpler than vLLM: no encoder budget, no partial-prefill limits, no pause
states, no custom ``scheduler_cls``.

Differs from vLLM on purpose: a ``max_num_batched_tokens`` below
``max_num_seqs`` is accepted (vLLM refuses it): the sessions use budgets of a
few dozen tokens, beside the default ``max_num_seqs``, to make chunking
visible in a few steps. And ``max_waiting_requests`` (Glassbox's own; vLLM
queues without limit) bounds how many sequences may wait beyond a full batch
in the API server, so a flood of requests gets quick 503s instead of queueing
for hours. It is enforced by ``AsyncLLM.add_request``; ``LLM`` queues every
prompt it is given, as in vLLM.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    from engine.v1.core.sched.interface import SchedulerInterface

SchedulerPolicy = Literal["fcfs", "priority"]


@dataclass
class SchedulerConfig:
    DEFAULT_MAX_NUM_BATCHED_TOKENS = 2048
    DEFAULT_MAX_NUM_SEQS = 128
    DEFAULT_MAX_WAITING_REQUESTS = 1024

    max_model_len: int = 8192
    max_num_batched_tokens: int = DEFAULT_MAX_NUM_BATCHED_TOKENS
    max_num_seqs: int = DEFAULT_MAX_NUM_SEQS
    enable_chunked_prefill: bool = True
    long_prefill_token_threshold: int = 0
    """When > 0, no request gets more than this many new tokens in one step."""
    policy: SchedulerPolicy = "fcfs"
    scheduler_reserve_full_isl: bool = True
    """Admit a waiting request only if the KV cache can hold its whole prompt,
    not just the first chunk: with chunked prefill, checking only the chunk
    admits more requests than can finish and they preempt one another."""
    stream_interval: int = 1
    """Streamed (DELTA) outputs go to the user every this many tokens (and
    at a request's first token and its end). 1 sends each token at once;
    more means fewer, larger chunks and less front-end work per token."""
    async_scheduling: bool | None = None
    """Schedule step N+1 while step N runs on the device (vLLM's default); None:
    on unless the executor cannot overlap steps. --no-async-scheduling runs the
    serial loop."""
    max_waiting_requests: int = DEFAULT_MAX_WAITING_REQUESTS
    """The server refuses new requests (HTTP 503) once max_num_seqs + this many
    sequences are unfinished (a request with n samples counts n); -1 means no
    limit, as in vLLM. Glassbox's own option.

    Enforced by AsyncLLM.add_request (EngineOverloadedError); LLM queues every
    prompt. The default, 1024, is well above any load one engine serves
    promptly, yet stops a single client from queueing hours of work."""

    def __post_init__(self) -> None:
        for name in ("max_model_len", "max_num_batched_tokens", "max_num_seqs"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        if not isinstance(self.long_prefill_token_threshold, int) or (
            self.long_prefill_token_threshold < 0
        ):
            raise ValueError(
                "long_prefill_token_threshold must be an integer >= 0, "
                f"got {self.long_prefill_token_threshold!r}"
            )
        if not isinstance(self.stream_interval, int) or self.stream_interval < 1:
            raise ValueError(
                f"stream_interval must be an integer >= 1, got {self.stream_interval!r}"
            )
        if not isinstance(self.max_waiting_requests, int) or self.max_waiting_requests < -1:
            raise ValueError(
                "max_waiting_requests must be an integer >= 0, or -1 for no limit, "
                f"got {self.max_waiting_requests!r}"
            )
        if self.async_scheduling not in (None, True, False):
            raise ValueError(
                f"async_scheduling must be True, False or None, got {self.async_scheduling!r}"
            )
        if self.policy not in ("fcfs", "priority"):
            raise ValueError(f"scheduling_policy must be 'fcfs' or 'priority', got {self.policy!r}")
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            # Same rule as vLLM: without chunking a whole prompt must fit in one step.
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) is smaller than "
                f"max_model_len ({self.max_model_len}) while chunked prefill is disabled; "
                "such prompts could never be scheduled. Raise max_num_batched_tokens, "
                "lower max_model_len, or enable chunked prefill."
            )

    def get_scheduler_cls(self) -> type[SchedulerInterface]:
        if self.async_scheduling:
            from engine.v1.core.sched.async_scheduler import AsyncScheduler

            return AsyncScheduler
        from engine.v1.core.sched.scheduler import Scheduler

        return Scheduler

    @property
    def max_num_scheduled_tokens(self) -> int:
        return self.max_num_batched_tokens

    @property
    def max_unfinished_sequences(self) -> int | None:
        """How many sequences AsyncLLM holds at most (None: no limit)."""
        if self.max_waiting_requests == -1:
            return None
        return self.max_num_seqs + self.max_waiting_requests
