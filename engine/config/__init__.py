"""Engine configuration, one dataclass per concern (vLLM twin: ``vllm/config/``)."""

from engine.config.cache import CacheConfig
from engine.config.compilation import CompilationConfig, CUDAGraphMode
from engine.config.device import DeviceConfig
from engine.config.glassbox import GlassboxConfig
from engine.config.load import LoadConfig
from engine.config.lora import LoRAConfig
from engine.config.model import ModelConfig
from engine.config.observability import ObservabilityConfig
from engine.config.parallel import ParallelConfig
from engine.config.profiler import ProfilerConfig
from engine.config.scheduler import SchedulerConfig
from engine.config.speculative import SpeculativeConfig
from engine.config.structured_outputs import StructuredOutputsConfig

__all__ = [
    "CacheConfig",
    "CompilationConfig",
    "CUDAGraphMode",
    "DeviceConfig",
    "GlassboxConfig",
    "LoadConfig",
    "LoRAConfig",
    "ModelConfig",
    "ObservabilityConfig",
    "ParallelConfig",
    "ProfilerConfig",
    "SchedulerConfig",
    "SpeculativeConfig",
    "StructuredOutputsConfig",
]
