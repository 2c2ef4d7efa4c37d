"""Metric snapshots returned by ``LLM.get_metrics()``.

vLLM twin: ``vllm/v1/metrics/reader.py`` (``Metric``, ``Counter``, ``Gauge``,
``Histogram``).
Sessions: 01, 03.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Metric:
    name: str
    labels: dict[str, str] = field(default_factory=dict)


@dataclass
class Counter(Metric):
    """Monotonic total since the engine started."""

    value: int = 0


@dataclass
class Gauge(Metric):
    """Value at the last engine step."""

    value: float = 0.0


@dataclass
class Histogram(Metric):
    """Observations since the engine started, Prometheus-style: ``buckets``
    maps each upper bound (``"0.1"``, ..., ``"+Inf"``) to the *cumulative*
    number of observations at or below it."""

    count: int = 0
    sum: float = 0.0
    buckets: dict[str, int] = field(default_factory=dict)
