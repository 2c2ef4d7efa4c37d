"""Counters the scheduler keeps for metrics, and the stats it sends each step.

vLLM twin: ``vllm/v1/metrics/stats.py`` (``PrefixCacheStats``, ``SchedulerStats``,
``PrefillStats``).
Read it for what one engine step reports to the front end: the queue lengths,
the KV cache usage and the prefix-cache lookups since the last report; and,
per request, how its prompt splits into tokens computed and tokens found in
the cache (``PrefillStats``, which becomes ``RequestOutput.num_cached_tokens``).
``SchedulerStats`` rides on ``EngineCoreOutputs`` and ``PrefillStats`` on an
``EngineCoreOutput`` across the process hop; both are plain dataclasses, which
msgspec encodes and decodes like structs.
Sessions: 01 (metrics), 03 (prefix-cache hit rate).

Simpler than vLLM: no KV-connector, speculative-decoding, LoRA, CUDA-graph,
MFU or eviction stats in ``SchedulerStats``, no ``IterationStats`` or
``PromptTokenStats`` (the front end's ``StatLogger`` keeps its own token and
latency counters and does not split prompt tokens by source), no multimodal
cache stats. ``PrefillStats.num_external_cached_tokens`` is always 0 (no KV
connector).

Differs from vLLM on purpose: ``SchedulerStats.num_preemptions`` counts the
preemptions of the step; vLLM counts them in the front end from the
``PREEMPTED`` events of each request, which arrive only with the request's
next output. ``step_counter`` is the scheduler's step number (vLLM fills it
from the engine's step count for data-parallel load balancing, which
Glassbox does not have).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.v1.spec_decode.metrics import SpecDecodingStats


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
    # Speculative decoding: this step's drafts and acceptances (None: no drafts).
    spec_decoding_stats: SpecDecodingStats | None = None


@dataclass
class PrefillStats:
    """How one request's prompt was prefilled: computed, or found in a cache.

    ``num_cached_tokens`` = ``num_local_cached_tokens`` (this engine's prefix
    cache) + ``num_external_cached_tokens`` (a KV connector; always 0 in
    Glassbox); ``num_computed_tokens`` is the rest of the prompt, the tokens
    the model really runs. The scheduler fills it on each admission from the
    waiting queue until the request's first output carries it away
    (``Request.take_prefill_stats``): a request preempted after that keeps
    the numbers of its first prefill, one preempted before its first token
    gets those of the lookup it resumes with.
    """

    num_prompt_tokens: int = 0
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0
    num_local_cached_tokens: int = 0
    num_external_cached_tokens: int = 0

    def set(
        self,
        num_prompt_tokens: int,
        num_local_cached_tokens: int,
        num_external_cached_tokens: int,
    ) -> None:
        num_cached_tokens = num_local_cached_tokens + num_external_cached_tokens
        if num_cached_tokens > num_prompt_tokens:
            raise ValueError(
                f"num_cached_tokens ({num_cached_tokens}) must not exceed "
                f"num_prompt_tokens ({num_prompt_tokens})"
            )
        self.num_prompt_tokens = num_prompt_tokens
        self.num_computed_tokens = num_prompt_tokens - num_cached_tokens
        self.num_cached_tokens = num_cached_tokens
        self.num_local_cached_tokens = num_local_cached_tokens
        self.num_external_cached_tokens = num_external_cached_tokens
