"""Metric snapshots returned by ``LLM.get_metrics()``.

vLLM twin: ``vllm/v1/metrics/reader.py`` (``Metric``, ``Counter``, ``Gauge``).
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
