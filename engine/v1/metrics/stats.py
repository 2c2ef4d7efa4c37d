"""Counters the scheduler keeps for metrics, and the stats it sends each step.

vLLM twin: ``vllm/v1/metrics/stats.py`` (``PrefixCacheStats``, ``SchedulerStats``).
Read it for what one engine step reports to the front end: the queue lengths,
the KV cache usage and the prefix-cache lookups since the last report.
``SchedulerStats`` rides on ``EngineCoreOutputs`` across the process hop; it
is a plain dataclass, which msgspec encodes and decodes like a struct.
Sessions: 01 (metrics), 03 (prefix-cache hit rate).

Simpler than vLLM: no KV-connector, speculative-decoding, LoRA, CUDA-graph,
MFU or eviction stats in ``SchedulerStats``, no ``PrefillStats`` and no
``IterationStats`` (the front end's ``StatLogger`` keeps its own token and
latency counters), no multimodal cache stats.

Differs from vLLM on purpose: ``SchedulerStats.num_preemptions`` counts the
preemptions of the step; vLLM counts them in the front end from the
``PREEMPTED`` events of each request, which arrive only with the request's
next output. ``step_counter`` is the scheduler's step number (vLLM fills it
from the engine's step count for data-parallel load balancing, which
Glassbox does not have).
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class PrefixCacheStats:
    """Prefix-cache lookups since the last report, counted in tokens."""

    # True when reset_prefix_cache() succeeded since the last report.
    reset: bool = False
    requests: int = 0
    queries: int = 0
    hits: int = 0
    preempted_requests: int = 0
    preempted_queries: int = 0
    preempted_hits: int = 0

    def record(self, num_tokens: int, num_hits: int, preempted: bool) -> None:
        # Re-lookups after a preemption are counted apart: they would inflate
        # the hit rate with the request's own blocks.
        if preempted:
            self.preempted_requests += 1
            self.preempted_queries += num_tokens
            self.preempted_hits += num_hits
        else:
            self.requests += 1
            self.queries += num_tokens
            self.hits += num_hits


@dataclass
class SchedulerStats:
    """The scheduler's state after one step (``Scheduler.make_stats``)."""

    num_running_reqs: int = 0
    # Waiting for space or budget (the ``waiting`` queue).
    num_waiting_reqs: int = 0
    # Waiting for something else, e.g. a grammar (the ``skipped_waiting`` queue).
    num_skipped_waiting_reqs: int = 0
    step_counter: int = 0
    kv_cache_usage: float = 0.0
    # Lookups of this step only; the front end adds them up.
    prefix_cache_stats: PrefixCacheStats = field(default_factory=PrefixCacheStats)
    # Preemptions during this step (Glassbox's own field).
    num_preemptions: int = 0
