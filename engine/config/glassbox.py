"""GlassboxConfig: every sub-config in one object handed to each component.

vLLM twin: ``vllm/config/vllm.py`` (``VllmConfig``). Sessions: 01.

``shutdown_timeout`` is vLLM's field: how long a stopping engine lets the
requests in flight run before it aborts them. 0 (the default, as in vLLM)
aborts at once; ``glassbox serve`` defaults it to 30.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.config.cache import CacheConfig
from engine.config.compilation import CompilationConfig
from engine.config.device import DeviceConfig
from engine.config.load import LoadConfig
from engine.config.model import ModelConfig
from engine.config.observability import ObservabilityConfig
from engine.config.parallel import ParallelConfig
from engine.config.scheduler import SchedulerConfig


@dataclass
class GlassboxConfig:
    model_config: ModelConfig
    cache_config: CacheConfig = field(default_factory=CacheConfig)
    scheduler_config: SchedulerConfig = field(default_factory=SchedulerConfig)
    load_config: LoadConfig = field(default_factory=LoadConfig)
    parallel_config: ParallelConfig = field(default_factory=ParallelConfig)
    device_config: DeviceConfig = field(default_factory=DeviceConfig)
    observability_config: ObservabilityConfig = field(default_factory=ObservabilityConfig)
    compilation_config: CompilationConfig = field(default_factory=CompilationConfig)
    shutdown_timeout: int = 0
    """Seconds a stopping engine lets the requests in flight finish before it
    aborts them; 0 aborts them at once."""

    def __post_init__(self) -> None:
        if not isinstance(self.shutdown_timeout, int) or self.shutdown_timeout < 0:
            raise ValueError(
                f"shutdown_timeout must be an integer >= 0 (seconds), got {self.shutdown_timeout!r}"
            )
