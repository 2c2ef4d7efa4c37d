"""The worker interface (vLLM twin: ``vllm/v1/worker/worker_base.py``, ``WorkerBase``).

A worker owns one device and one model runner. The executor only ever calls
the methods listed here. Sessions: 04, 07.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

from engine.config import GlassboxConfig


class WorkerBase(ABC):
    def __init__(self, glassbox_config: GlassboxConfig, local_rank: int = 0, rank: int = 0) -> None:
        self.glassbox_config = glassbox_config
        self.local_rank = local_rank
        self.rank = rank

    @abstractmethod
    def init_device(self) -> None: ...

    @abstractmethod
    def load_model(self) -> None: ...

    @abstractmethod
    def determine_available_memory(self) -> int: ...

    @abstractmethod
    def get_kv_cache_spec(self): ...

    @abstractmethod
    def initialize_from_config(self, kv_cache_config) -> None: ...

    @abstractmethod
    def execute_model(self, scheduler_output): ...

    @abstractmethod
    def sample_tokens(self, grammar_output=None): ...

    def shutdown(self) -> None:
        pass
