"""Counters the scheduler keeps for metrics.

vLLM twin: ``vllm/v1/metrics/stats.py`` (``PrefixCacheStats``, ``SchedulerStats``
lives in ``engine/v1/engine/__init__.py`` here because it crosses the process hop).
Sessions: 03 (prefix-cache hit rate).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class PrefixCacheStats:
    """Prefix-cache lookups since the last reset, counted in tokens."""

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
