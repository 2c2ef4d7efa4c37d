"""EngineCore: the loop that owns the scheduler and the executor.

vLLM twin: ``vllm/v1/engine/core.py`` (``EngineCore``; the process wrapper
``EngineCoreProc`` arrives with the multi-process engine).
Read it for:
  * ``__init__`` -- build the executor, size and allocate the KV cache
    (``_initialize_kv_caches``), then build the scheduler with the final
    block count and the request block hasher;
  * ``step()`` -- the heart of V1: ``schedule()`` -> ``execute_model()`` ->
    (``sample_tokens()``) -> ``update_from_output()``. Nothing else happens
    in a step.
Sessions: 01 (engine loop).

Simpler than vLLM: no batch queue / pipelining, no structured-output grammar
bitmask, no utility RPCs.
"""

from __future__ import annotations

import logging
import time

from engine.config import GlassboxConfig
from engine.tracing import Tracer
from engine.v1.core.kv_cache_utils import get_kv_cache_config, get_request_block_hasher
from engine.v1.core.sched.scheduler import Scheduler
from engine.v1.engine import EngineCoreOutputs, EngineCoreRequest
from engine.v1.executor.abstract import Executor
from engine.v1.kv_cache_interface import KVCacheConfig
from engine.v1.outputs import ModelRunnerOutput
from engine.v1.request import Request, RequestStatus

logger = logging.getLogger(__name__)


class EngineCore:
    def __init__(
        self,
        glassbox_config: GlassboxConfig,
        executor_class: type[Executor],
        log_stats: bool = True,
        tracer: Tracer | None = None,
    ) -> None:
        self.glassbox_config = glassbox_config
        self.log_stats = log_stats
        if tracer is None:
            obs = glassbox_config.observability_config
            tracer = Tracer(obs.trace_path, obs.trace_level)
        # One tracer per process; the executor's in-process worker shares it.
        self.tracer = tracer
        self.model_executor = executor_class(glassbox_config, tracer=tracer)
        try:
            kv_cache_config = self._initialize_kv_caches(glassbox_config)
            self.kv_cache_config = kv_cache_config
            self.scheduler = Scheduler(
                scheduler_config=glassbox_config.scheduler_config,
                cache_config=glassbox_config.cache_config,
                kv_cache_config=kv_cache_config,
                log_stats=log_stats,
                tracer=tracer,
            )
        except BaseException:
            # Don't leave a loaded model (or worker processes) behind.
            self.model_executor.shutdown()
            raise
        cache_config = glassbox_config.cache_config
        self.request_block_hasher = (
            get_request_block_hasher(cache_config.block_size)
            if cache_config.enable_prefix_caching
            else None
        )

    def _initialize_kv_caches(self, config: GlassboxConfig) -> KVCacheConfig:
        """Profile, size and allocate the KV cache (vLLM's order of calls)."""
        start = time.perf_counter()
        kv_cache_specs = self.model_executor.get_kv_cache_specs()
        override = config.cache_config.num_gpu_blocks_override
        available_memory = 0 if override is not None else self.model_executor.determine_available_memory()
        kv_cache_config = get_kv_cache_config(
            kv_cache_specs,
            available_memory,
            max_model_len=config.model_config.max_model_len,
            num_gpu_blocks_override=override,
        )
        config.cache_config.num_gpu_blocks = kv_cache_config.num_blocks
        self.model_executor.initialize_from_config(kv_cache_config)
        logger.info(
            "KV cache: %d blocks of %d tokens (%.2fs)",
            kv_cache_config.num_blocks,
            config.cache_config.block_size,
            time.perf_counter() - start,
        )
        return kv_cache_config

    # -- requests ------------------------------------------------------------
    def preprocess_add_request(self, request: EngineCoreRequest) -> Request:
        return Request.from_engine_core_request(request, self.request_block_hasher)

    def add_request(self, request: Request | EngineCoreRequest) -> None:
        if isinstance(request, EngineCoreRequest):
            request = self.preprocess_add_request(request)
        self.scheduler.add_request(request)

    def abort_requests(self, request_ids: list[str]) -> None:
        self.scheduler.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED)

    # -- the loop ------------------------------------------------------------
    def execute_model_with_error_logging(self, scheduler_output) -> ModelRunnerOutput:
        try:
            output = self.model_executor.execute_model(scheduler_output)
            if output is None:
                output = self.model_executor.sample_tokens()
            return output
        except Exception:
            logger.exception("model execution failed at step %d", scheduler_output.step)
            raise

    def step(self) -> tuple[dict[int, EngineCoreOutputs], bool]:
        """One engine step. Returns outputs per client and whether the model ran."""
        if not self.scheduler.has_requests():
            return {}, False
        scheduler_output = self.scheduler.schedule()
        model_output = self.execute_model_with_error_logging(scheduler_output)
        engine_core_outputs = self.scheduler.update_from_output(scheduler_output, model_output)
        if self.tracer.lifecycle: self.tracer.flush()  # noqa: E701
        return engine_core_outputs, scheduler_output.total_num_scheduled_tokens > 0

    def reset_prefix_cache(self) -> bool:
        return self.scheduler.reset_prefix_cache()

    def shutdown(self) -> None:
        self.model_executor.shutdown()
        self.scheduler.shutdown()
