"""Turning per-step stats into the ``glassbox:`` metrics.

vLLM twin: ``vllm/v1/metrics/loggers.py`` (``PrometheusStatLogger``: the same
metric names with the ``vllm:`` prefix). Read it for what each metric
measures:

  glassbox:num_requests_running   gauge   requests in the running list
  glassbox:num_requests_waiting   gauge   requests in the waiting queue
  glassbox:kv_cache_usage_perc    gauge   used / usable KV blocks, 0..1
  glassbox:num_preemptions        counter preemptions since start
  glassbox:prefix_cache_queries   counter prompt tokens looked up in the prefix cache
  glassbox:prefix_cache_hits      counter of those, tokens found
  glassbox:prompt_tokens          counter prompt tokens of requests that produced output
  glassbox:generation_tokens      counter tokens generated

Sessions: 01, 03.

Simpler than vLLM: kept in memory (the Prometheus endpoint arrives with the
server); no latency histograms yet.
"""

from __future__ import annotations

from engine.v1.engine import SchedulerStats
from engine.v1.metrics.reader import Counter, Gauge, Metric


class StatLogger:
    def __init__(self, model_name: str) -> None:
        self.labels = {"model_name": model_name}
        self.last_scheduler_stats = SchedulerStats()
        self.num_preemptions = 0
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0
        self.prompt_tokens = 0
        self.generation_tokens = 0

    def record_scheduler_stats(self, stats: SchedulerStats) -> None:
        self.last_scheduler_stats = stats
        self.num_preemptions += stats.num_preemptions
        self.prefix_cache_queries += stats.prefix_cache_queries
        self.prefix_cache_hits += stats.prefix_cache_hits

    def record_tokens(self, num_prompt_tokens: int, num_generation_tokens: int) -> None:
        self.prompt_tokens += num_prompt_tokens
        self.generation_tokens += num_generation_tokens

    def get_metrics(self) -> list[Metric]:
        s = self.last_scheduler_stats
        labels = dict(self.labels)
        return [
            Gauge("glassbox:num_requests_running", dict(labels), float(s.num_running_reqs)),
            Gauge("glassbox:num_requests_waiting", dict(labels), float(s.num_waiting_reqs)),
            Gauge("glassbox:kv_cache_usage_perc", dict(labels), s.kv_cache_usage),
            Counter("glassbox:num_preemptions", dict(labels), self.num_preemptions),
            Counter("glassbox:prefix_cache_queries", dict(labels), self.prefix_cache_queries),
            Counter("glassbox:prefix_cache_hits", dict(labels), self.prefix_cache_hits),
            Counter("glassbox:prompt_tokens", dict(labels), self.prompt_tokens),
            Counter("glassbox:generation_tokens", dict(labels), self.generation_tokens),
        ]
