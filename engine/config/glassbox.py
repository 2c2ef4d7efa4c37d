"""GlassboxConfig: every sub-config in one object handed to each component.

vLLM twin: ``vllm/config/vllm.py`` (``VllmConfig``). Sessions: 01.
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
