"""ObservabilityConfig: where the trace goes and how much it records.

vLLM twin: ``vllm/config/observability.py`` (``ObservabilityConfig``; vLLM's
fields are about OpenTelemetry export, ours about the Glassbox event trace).
Sessions: all.
"""

from __future__ import annotations

from dataclasses import dataclass

TRACE_LEVELS = ("off", "lifecycle", "full")


@dataclass
class ObservabilityConfig:
    trace_path: str | None = None
    trace_level: str = "off"

    def __post_init__(self) -> None:
        if self.trace_level not in TRACE_LEVELS:
            raise ValueError(f"trace_level must be one of {TRACE_LEVELS}, got {self.trace_level!r}")
        if self.trace_level != "off" and not self.trace_path:
            raise ValueError(f"trace_path is required when trace_level={self.trace_level!r}")
        if self.trace_path and self.trace_level == "off":
            # A path alone means "trace": vLLM-style flags shouldn't need two switches.
            self.trace_level = "lifecycle"
