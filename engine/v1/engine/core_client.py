"""How the front end talks to EngineCore.

vLLM twin: ``vllm/v1/engine/core_client.py`` (``EngineCoreClient``,
``InprocClient``; ``SyncMPClient``/``AsyncMPClient`` arrive with the
multi-process engine).
Read it for: the front end never calls the scheduler directly; it goes through
a client. ``InprocClient`` holds EngineCore in the same process, so
``get_output()`` *is* one ``EngineCore.step()``.
Sessions: 01.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

from engine.config import GlassboxConfig
from engine.tracing import Tracer
from engine.v1.engine import EngineCoreOutputs, EngineCoreRequest
from engine.v1.engine.core import EngineCore
from engine.v1.executor.abstract import Executor


class EngineCoreClient(ABC):
    @staticmethod
    def make_client(
        glassbox_config: GlassboxConfig,
        executor_class: type[Executor],
        log_stats: bool,
        tracer: Tracer | None = None,
    ) -> EngineCoreClient:
        return InprocClient(glassbox_config, executor_class, log_stats, tracer)

    @abstractmethod
    def get_output(self) -> EngineCoreOutputs: ...

    @abstractmethod
    def add_request(self, request: EngineCoreRequest) -> None: ...

    @abstractmethod
    def abort_requests(self, request_ids: list[str]) -> None: ...

    @abstractmethod
    def shutdown(self) -> None: ...


class InprocClient(EngineCoreClient):
    def __init__(
        self,
        glassbox_config: GlassboxConfig,
        executor_class: type[Executor],
        log_stats: bool,
        tracer: Tracer | None = None,
    ) -> None:
        # In-process: front end and core share one tracer (one pid, one file).
        self.engine_core = EngineCore(glassbox_config, executor_class, log_stats, tracer)

    def get_output(self) -> EngineCoreOutputs:
        outputs, _ = self.engine_core.step()
        return outputs.get(0) or EngineCoreOutputs()

    def add_request(self, request: EngineCoreRequest) -> None:
        self.engine_core.add_request(request)

    def abort_requests(self, request_ids: list[str]) -> None:
        if request_ids:
            self.engine_core.abort_requests(request_ids)

    def reset_prefix_cache(self) -> bool:
        return self.engine_core.reset_prefix_cache()

    def shutdown(self) -> None:
        self.engine_core.shutdown()
