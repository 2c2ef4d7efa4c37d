"""Turning per-step stats into the ``glassbox:`` metrics.

vLLM twin: ``vllm/v1/metrics/loggers.py`` (``PrometheusStatLogger``: the same
metric names with the ``vllm:`` prefix). Read it for what each metric
measures:

  glassbox:num_requests_running   gauge   requests in the running list
  glassbox:num_requests_waiting   gauge   requests in both waiting queues
                                          (waiting + skipped_waiting)
  glassbox:kv_cache_usage_perc    gauge   used / usable KV blocks, 0..1
  glassbox:num_preemptions        counter preemptions since start
  glassbox:prefix_cache_queries   counter prompt tokens looked up in the prefix cache
  glassbox:prefix_cache_hits      counter of those, tokens found
  glassbox:prompt_tokens          counter prompt tokens of requests that produced output
  glassbox:generation_tokens      counter tokens generated

with speculative decoding on, also (counters; mean acceptance length =
1 + accepted_tokens / drafts):

  glassbox:spec_decode_num_drafts                requests that verified drafts, per step
  glassbox:spec_decode_num_draft_tokens          draft tokens verified
  glassbox:spec_decode_num_accepted_tokens       of those, accepted
  glassbox:spec_decode_num_accepted_tokens_per_pos   accepted at draft position N (label position)

and the latency histograms (seconds, vLLM's bucket bounds):

  glassbox:time_to_first_token_seconds  arrival in the front end -> first token back there
  glassbox:inter_token_latency_seconds  between two consecutive token batches of a request
                                        (EngineCore step timestamps)
  glassbox:e2e_request_latency_seconds  arrival -> the request finished
  glassbox:request_success              counter per finished_reason (stop, length, ...)
  glassbox:cache_config_info            gauge fixed at 1; labels say block_size and num_gpu_blocks
  glassbox:engine_dead                  gauge 1 once EngineCore is gone (Glassbox's own)

``render_prometheus()`` writes all of them in the Prometheus text format
(counters get the ``_total`` suffix there, as prometheus_client writes them),
which is what ``GET /metrics`` returns.
Sessions: 01, 03.

Simpler than vLLM: no prometheus_client registry or multiprocess mode (the
front end is one process and renders its own numbers), no per-engine labels,
no ``num_requests_waiting_by_reason`` split (the two waiting queues are
summed), and the per-request timing state lives here (keyed by request id)
instead of in the output processor's ``RequestState``.

Differs from vLLM on purpose: the API server outlives a dead EngineCore (see
api_server.py), so the numbers must say so: ``record_engine_dead`` zeroes the
queue and cache gauges, counts the requests that were in flight as
finished_reason "error", and sets ``glassbox:engine_dead`` to 1.
"""

from __future__ import annotations

import bisect
import math
import time
from collections.abc import Iterable
from dataclasses import dataclass, field

from engine.v1.engine import EngineCoreOutputs
from engine.v1.metrics.reader import Counter, Gauge, Histogram, Metric
from engine.v1.metrics.stats import SchedulerStats
from engine.v1.spec_decode.metrics import SpecDecodingStats

# What get_metrics() says on an engine without statistics.
METRICS_OFF = (
    "metrics are off: the engine was built with disable_log_stats=True (LLM's default, "
    "as in vLLM); pass disable_log_stats=False"
)

TTFT_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
    5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip
ITL_BUCKETS = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5,
    5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
)  # fmt: skip
REQUEST_LATENCY_BUCKETS = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
    60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0,
)  # fmt: skip

_HELP = {
    "glassbox:num_requests_running": "Number of requests in the running list.",
    "glassbox:num_requests_waiting": "Number of requests waiting to be scheduled.",
    "glassbox:kv_cache_usage_perc": "Fraction of usable KV-cache blocks in use (0 to 1).",
    "glassbox:num_preemptions": "Cumulative number of preemptions.",
    "glassbox:prefix_cache_queries": "Prompt tokens looked up in the prefix cache.",
    "glassbox:prefix_cache_hits": "Prompt tokens found in the prefix cache.",
    "glassbox:spec_decode_num_drafts": "Number of spec decoding drafts.",
    "glassbox:spec_decode_num_draft_tokens": "Number of draft tokens.",
    "glassbox:spec_decode_num_accepted_tokens": "Number of accepted tokens.",
    "glassbox:spec_decode_num_accepted_tokens_per_pos": "Accepted tokens per draft position.",
    "glassbox:prompt_tokens": "Prompt tokens of requests that produced output.",
    "glassbox:generation_tokens": "Generated tokens.",
    "glassbox:time_to_first_token_seconds": "Histogram of time to first token in seconds.",
    "glassbox:inter_token_latency_seconds": "Histogram of inter-token latency in seconds.",
    "glassbox:e2e_request_latency_seconds": "Histogram of end-to-end request latency in seconds.",
    "glassbox:request_success": "Finished requests, by finish reason.",
    "glassbox:cache_config_info": "KV cache configuration (value is always 1).",
    "glassbox:engine_dead": "1 once the EngineCore process is gone, else 0.",
}


@dataclass
class HistogramState:
    """Bucket counts (not cumulative) plus count and sum."""

    bounds: tuple[float, ...]
    counts: list[int] = field(init=False)
    count: int = 0
    sum: float = 0.0

    def __post_init__(self) -> None:
        self.counts = [0] * (len(self.bounds) + 1)  # the last one is +Inf

    def observe(self, value: float) -> None:
        # Prometheus buckets are "less than or equal to the bound".
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.count += 1
        self.sum += value

    def cumulative(self) -> dict[str, int]:
        out: dict[str, int] = {}
        running = 0
        for bound, n in zip((*self.bounds, math.inf), self.counts):
            running += n
            out[_format_bound(bound)] = running
        return out


def _format_bound(bound: float) -> str:
    return "+Inf" if bound == math.inf else repr(float(bound))


@dataclass
class _RequestTimes:
    arrival_time: float  # wall clock, seconds (EngineCoreRequest.arrival_time)
    last_token_ts: float | None = None  # EngineCore monotonic timestamp


class StatLogger:
    def __init__(self, model_name: str, num_spec_tokens: int = 0) -> None:
        self.labels = {"model_name": model_name}
        # Speculative decoding: every step's stats summed (num_spec_tokens > 0:
        # its counters are shown).
        self.num_spec_tokens = num_spec_tokens
        self.spec_decoding = SpecDecodingStats.new(num_spec_tokens)
        self.last_scheduler_stats = SchedulerStats()
        self.num_preemptions = 0
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.time_to_first_token = HistogramState(TTFT_BUCKETS)
        self.inter_token_latency = HistogramState(ITL_BUCKETS)
        self.e2e_request_latency = HistogramState(REQUEST_LATENCY_BUCKETS)
        self.request_success: dict[str, int] = {}
        self.cache_config_info: dict[str, str] | None = None
        self._requests: dict[str, _RequestTimes] = {}
        self.engine_dead = False

    # -- recording -----------------------------------------------------------------
    def log_engine_initialized(self, block_size: int, num_gpu_blocks: int | None) -> None:
        self.cache_config_info = {
            "block_size": str(block_size),
            "num_gpu_blocks": str(num_gpu_blocks or 0),
        }

    def record_scheduler_stats(self, stats: SchedulerStats) -> None:
        self.last_scheduler_stats = stats
        self.num_preemptions += stats.num_preemptions
        self.prefix_cache_queries += stats.prefix_cache_stats.queries
        self.prefix_cache_hits += stats.prefix_cache_stats.hits
        if stats.spec_decoding_stats is not None:
            self.spec_decoding.add(stats.spec_decoding_stats)

    def record_tokens(self, num_prompt_tokens: int, num_generation_tokens: int) -> None:
        self.prompt_tokens += num_prompt_tokens
        self.generation_tokens += num_generation_tokens

    def add_request(self, request_id: str, arrival_time: float) -> None:
        """Start timing a request sent to EngineCore (each child of an n > 1 one)."""
        self._requests[request_id] = _RequestTimes(arrival_time)

    def forget_requests(self, request_ids: Iterable[str]) -> None:
        """Stop timing requests that were never really added."""
        for request_id in request_ids:
            self._requests.pop(request_id, None)

    def record_aborted(self, request_ids: Iterable[str]) -> None:
        """Requests the user aborted end with finished_reason "abort"."""
        for request_id in request_ids:
            if self._requests.pop(request_id, None) is not None:
                self.request_success["abort"] = self.request_success.get("abort", 0) + 1

    def record_engine_dead(self, request_ids: Iterable[str]) -> None:
        """EngineCore is gone: nothing runs or waits any more, and the requests
        that were in flight (``request_ids``) failed."""
        self.engine_dead = True
        self.last_scheduler_stats = SchedulerStats()
        for request_id in request_ids:
            if self._requests.pop(request_id, None) is not None:
                self.request_success["error"] = self.request_success.get("error", 0) + 1

    def record_iteration(
        self,
        outputs: EngineCoreOutputs,
        stop_string_finished: Iterable[str] = (),
        now: float | None = None,
    ) -> None:
        """Latencies from one batch of EngineCore outputs. ``stop_string_finished``
        are requests the front end ended on a stop string (reason "stop")."""
        now = time.time() if now is None else now
        stopped_here = set(stop_string_finished)
        for output in outputs.outputs:
            times = self._requests.get(output.request_id)
            if times is None:
                continue
            if output.new_token_ids:
                if times.last_token_ts is None:
                    self.time_to_first_token.observe(max(0.0, now - times.arrival_time))
                else:
                    self.inter_token_latency.observe(
                        max(0.0, outputs.timestamp - times.last_token_ts)
                    )
                times.last_token_ts = outputs.timestamp
            reason = None
            if output.request_id in stopped_here:
                reason = "stop"
            elif output.finish_reason is not None:
                reason = str(output.finish_reason)
            if reason is not None:
                del self._requests[output.request_id]
                self.e2e_request_latency.observe(max(0.0, now - times.arrival_time))
                self.request_success[reason] = self.request_success.get(reason, 0) + 1

    # -- reading -----------------------------------------------------------------
    def get_metrics(self) -> list[Metric]:
        s = self.last_scheduler_stats
        labels = dict(self.labels)
        return [
            Gauge("glassbox:num_requests_running", dict(labels), float(s.num_running_reqs)),
            Gauge(
                "glassbox:num_requests_waiting",
                dict(labels),
                float(s.num_waiting_reqs + s.num_skipped_waiting_reqs),
            ),
            Gauge("glassbox:kv_cache_usage_perc", dict(labels), s.kv_cache_usage),
            Counter("glassbox:num_preemptions", dict(labels), self.num_preemptions),
            Counter("glassbox:prefix_cache_queries", dict(labels), self.prefix_cache_queries),
            Counter("glassbox:prefix_cache_hits", dict(labels), self.prefix_cache_hits),
            Counter("glassbox:prompt_tokens", dict(labels), self.prompt_tokens),
            Counter("glassbox:generation_tokens", dict(labels), self.generation_tokens),
            Gauge("glassbox:engine_dead", dict(labels), float(self.engine_dead)),
            *self._spec_decode_metrics(),
        ]

    def _spec_decode_metrics(self) -> list[Metric]:
        if not self.num_spec_tokens:
            return []
        totals, labels = self.spec_decoding, self.labels
        return [
            Counter("glassbox:spec_decode_num_drafts", dict(labels), totals.num_drafts),
            Counter("glassbox:spec_decode_num_draft_tokens", dict(labels), totals.num_draft_tokens),
            Counter(
                "glassbox:spec_decode_num_accepted_tokens", dict(labels), totals.num_accepted_tokens
            ),
            *(
                Counter(
                    "glassbox:spec_decode_num_accepted_tokens_per_pos",
                    {**labels, "position": str(pos)},
                    n,
                )
                for pos, n in enumerate(totals.num_accepted_tokens_per_pos)
            ),
        ]

    def get_histograms(self) -> list[Histogram]:
        return [
            Histogram(name, dict(self.labels), h.count, h.sum, h.cumulative())
            for name, h in (
                ("glassbox:time_to_first_token_seconds", self.time_to_first_token),
                ("glassbox:inter_token_latency_seconds", self.inter_token_latency),
                ("glassbox:e2e_request_latency_seconds", self.e2e_request_latency),
            )
        ]

    def render_prometheus(self) -> str:
        """Every metric in the Prometheus text exposition format (version 0.0.4)."""
        lines: list[str] = []
        headed: set[str] = set()

        def header(name: str, family: str, kind: str) -> None:
            # Once per family: a labelled counter has one line per label set.
            if name in headed:
                return
            headed.add(name)
            lines.append(f"# HELP {name} {_HELP[family]}")
            lines.append(f"# TYPE {name} {kind}")

        for metric in self.get_metrics():
            if isinstance(metric, Counter):
                name = metric.name + "_total"
                header(name, metric.name, "counter")
                lines.append(f"{name}{_labels(metric.labels)} {float(metric.value)!r}")
            else:
                header(metric.name, metric.name, "gauge")
                lines.append(f"{metric.name}{_labels(metric.labels)} {float(metric.value)!r}")
        header("glassbox:request_success_total", "glassbox:request_success", "counter")
        for reason in ("stop", "length", "abort", "error", "repetition"):
            count = self.request_success.get(reason, 0)
            labels = _labels({**self.labels, "finished_reason": reason})
            lines.append(f"glassbox:request_success_total{labels} {float(count)!r}")
        for hist in self.get_histograms():
            header(hist.name, hist.name, "histogram")
            for bound, count in hist.buckets.items():
                lines.append(
                    f"{hist.name}_bucket{_labels({**hist.labels, 'le': bound})} {float(count)!r}"
                )
            lines.append(f"{hist.name}_count{_labels(hist.labels)} {float(hist.count)!r}")
            lines.append(f"{hist.name}_sum{_labels(hist.labels)} {float(hist.sum)!r}")
        if self.cache_config_info is not None:
            header("glassbox:cache_config_info", "glassbox:cache_config_info", "gauge")
            lines.append(f"glassbox:cache_config_info{_labels(self.cache_config_info)} 1.0")
        return "\n".join(lines) + "\n"


def _labels(labels: dict[str, str]) -> str:
    if not labels:
        return ""
    body = ",".join(f'{k}="{_escape(v)}"' for k, v in sorted(labels.items()))
    return "{" + body + "}"


def _escape(value: str) -> str:
    return str(value).replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')
