"""LLMEngine: the synchronous front end used by ``LLM``.

vLLM twin: ``vllm/v1/engine/llm_engine.py`` (``LLMEngine``).
Read it for the front-end half of one step:
  ``add_request``: prompt -> ``InputProcessor`` -> ``EngineCoreRequest`` ->
  internal id (``assign_request_id``) -> core client (``n > 1`` becomes ``n``
  child requests first); returns the internal id;
  ``step``: core client ``get_output()`` (one EngineCore step) ->
  ``OutputProcessor`` (text, stop strings, grouping) -> ``RequestOutput`` list
  (under the user's ids), and aborts in the core any request a stop string
  ended;
  ``abort_request(ids)``: the user's ids, or internal ones with ``internal=True``.

As in vLLM, EngineCore runs in its own process by default (``SyncMPClient``;
``get_output()`` then waits for the next batch off the socket). Set
``GLASSBOX_ENABLE_MULTIPROCESSING=0`` -- the twin of
``VLLM_ENABLE_V1_MULTIPROCESSING=0`` -- to keep it in this process
(``InprocClient``), where a debugger or a test can reach the scheduler
directly. Both give the same outputs. The child is forked by default (so
it needs no ``__main__`` guard and takes any executor class); when it is
spawned the executor class travels by import path and must be top-level.
Sessions: 01 (engine loop).

Differs from vLLM on purpose: ``add_request`` is all-or-nothing -- if a part
of the request fails to reach the core, what was registered is removed and
the parts already sent are aborted.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Callable
from copy import copy
from typing import Any

from engine.config import GlassboxConfig
from engine.engine.arg_utils import EngineArgs
from engine.lora.request import LoRARequest
from engine.outputs import RequestOutput
from engine.sampling_params import SamplingParams
from engine.tracing import Tracer, merge_trace_parts, part_path
from engine.tracing.engine_trace import OutputProcessorTrace
from engine.transformers_utils.tokenizer import get_tokenizer
from engine.usage.usage_lib import UsageContext
from engine.v1.engine import EngineCoreRequest
from engine.v1.engine.core_client import EngineCoreClient
from engine.v1.engine.input_processor import InputProcessor, PromptType
from engine.v1.engine.output_processor import OutputProcessor
from engine.v1.engine.parallel_sampling import ParentRequest
from engine.v1.engine.utils import multiprocessing_enabled
from engine.v1.executor.abstract import Executor
from engine.v1.metrics.loggers import METRICS_OFF, StatLogger
from engine.v1.metrics.reader import Metric

logger = logging.getLogger(__name__)


class LLMEngine:
    def __init__(
        self,
        glassbox_config: GlassboxConfig,
        executor_class: type[Executor],
        log_stats: bool = True,
        multiprocess_mode: bool | None = None,
    ) -> None:
        self.glassbox_config = glassbox_config
        self.model_config = glassbox_config.model_config
        self.log_stats = log_stats
        if multiprocess_mode is None:
            multiprocess_mode = multiprocessing_enabled()
        self.multiprocess_mode = multiprocess_mode
        model_config = glassbox_config.model_config
        self.tokenizer: Any | None = (
            None
            if model_config.skip_tokenizer_init
            else get_tokenizer(model_config.tokenizer or model_config.model)
        )
        obs = glassbox_config.observability_config
        tracing = obs.trace_level != "off" and bool(obs.trace_path)
        # Multi-process: each process writes its own part of the trace, and
        # the parts are merged once the core has exited (see shutdown).
        trace_file = (
            part_path(obs.trace_path, "frontend")
            if tracing and multiprocess_mode
            else obs.trace_path
        )
        self.tracer = Tracer(trace_file, obs.trace_level)
        self.input_processor = InputProcessor(glassbox_config, self.tokenizer)
        # Adapters the workers have read once and found to fit (_check_new_adapter).
        self._checked_loras: set[LoRARequest] = set()
        self.output_processor = OutputProcessor(
            self.tokenizer,
            log_stats=log_stats,
            stream_interval=glassbox_config.scheduler_config.stream_interval,
            trace=OutputProcessorTrace.create(self.tracer),
        )
        self.stat_logger = (
            StatLogger(model_config.served_model_name, glassbox_config.num_speculative_tokens)
            if log_stats
            else None
        )
        try:
            self.engine_core = EngineCoreClient.make_client(
                glassbox_config,
                executor_class,
                log_stats,
                self.tracer,
                multiprocess_mode=multiprocess_mode,
            )
        except BaseException:
            self.tracer.close()
            raise
        if self.stat_logger is not None:
            self.stat_logger.log_engine_initialized(
                glassbox_config.cache_config.block_size, glassbox_config.cache_config.num_gpu_blocks
            )
        # Runs on shutdown() or when the engine is garbage collected.
        self._finalizer = weakref.finalize(
            self,
            _shutdown_engine,
            self.engine_core,
            self.tracer,
            # Worker processes (tensor parallelism) write parts even in-process.
            obs.trace_path if tracing else None,
        )

    @classmethod
    def from_engine_args(
        cls,
        engine_args: EngineArgs,
        usage_context: UsageContext = UsageContext.ENGINE_CONTEXT,
        enable_multiprocessing: bool | None = None,
    ) -> LLMEngine:
        """``enable_multiprocessing=None`` follows GLASSBOX_ENABLE_MULTIPROCESSING;
        ``usage_context`` picks the batch defaults (``LLM`` passes LLM_CLASS)."""
        config = engine_args.create_engine_config(usage_context)
        return cls(
            config,
            executor_class=Executor.get_class(config),
            log_stats=not engine_args.disable_log_stats,
            multiprocess_mode=enable_multiprocessing,
        )

    # -- requests --------------------------------------------------------------
    def add_request(
        self,
        request_id: str,
        prompt: PromptType,
        params: SamplingParams,
        arrival_time: float | None = None,
        priority: int = 0,
        lora_request: LoRARequest | None = None,
    ) -> str:
        """Queue one request; returns its internal id. Outputs come back from
        ``step()`` under ``request_id`` (which may be reused at any time)."""
        if not isinstance(request_id, str):
            raise TypeError(f"request_id must be a string, got {type(request_id)}")
        if not request_id:
            raise ValueError("request_id must be a non-empty string, got ''")
        self._check_new_adapter(lora_request)
        prompt_text, request = self.input_processor.process_inputs(
            request_id, prompt, params, arrival_time, priority, lora_request
        )
        self.input_processor.assign_request_id(request)
        internal_id = request.request_id
        # Internal ids handed to the core, to take back if a later part fails.
        sent: list[str] = []
        try:
            n = request.sampling_params.n
            if n == 1:
                self._add_request(request, prompt_text, None, 0, sent)
                return internal_id
            # Fan out the children (n > 1).
            parent = ParentRequest(request)
            for index in range(n):
                child_id, child_params = parent.get_child_info(index)
                child = request if index == n - 1 else copy(request)
                child.request_id = child_id
                child.sampling_params = child_params
                self._add_request(child, prompt_text, parent, index, sent)
            return internal_id
        except BaseException:
            forgotten = self.output_processor.abort_requests([internal_id], internal=True)
            if self.stat_logger is not None:
                self.stat_logger.forget_requests(forgotten)
            if sent:
                try:
                    self.engine_core.abort_requests(sent)
                except Exception:
                    logger.exception("Could not abort the sent parts of request %s.", internal_id)
            raise

    def _add_request(
        self,
        request: EngineCoreRequest,
        prompt_text: str | None,
        parent: ParentRequest | None,
        index: int,
        sent: list[str],
    ) -> None:
        self.output_processor.add_request(request, prompt_text, parent, index)
        if self.stat_logger is not None:
            self.stat_logger.add_request(request.request_id, request.arrival_time)
        sent.append(request.request_id)  # aborting an id the core never got is harmless
        self.engine_core.add_request(request)

    def abort_request(self, request_ids: list[str], internal: bool = False) -> None:
        """Abort in the front end and in EngineCore: the user's ids, or
        internal ids (an ``n > 1`` request's id aborts all its children)."""
        to_abort = self.output_processor.abort_requests(list(request_ids), internal)
        if self.stat_logger is not None:
            self.stat_logger.record_aborted(to_abort)
        self.engine_core.abort_requests(to_abort)

    def step(self) -> list[RequestOutput]:
        if self.multiprocess_mode and not self.has_unfinished_requests():
            # In-process, a step with nothing to do is a no-op; over ZMQ it
            # would wait for a batch that never comes.
            return []
        outputs = self.engine_core.get_output()
        processed = self.output_processor.process_outputs(outputs.outputs)
        # A stop string ended these; EngineCore still thinks they are running.
        self.engine_core.abort_requests(processed.reqs_to_abort)
        if self.stat_logger is not None:
            if outputs.scheduler_stats is not None:
                self.stat_logger.record_scheduler_stats(outputs.scheduler_stats)
            self.stat_logger.record_tokens(
                processed.num_prompt_tokens, processed.num_generation_tokens
            )
            self.stat_logger.record_iteration(outputs, processed.reqs_to_abort)
        return processed.request_outputs

    # -- state -------------------------------------------------------------------
    def has_unfinished_requests(self) -> bool:
        return self.output_processor.has_unfinished_requests()

    def get_num_unfinished_requests(self) -> int:
        return self.output_processor.get_num_unfinished_requests()

    def get_metrics(self) -> list[Metric]:
        if self.stat_logger is None:
            raise RuntimeError(METRICS_OFF)
        return self.stat_logger.get_metrics()

    def get_tokenizer(self) -> Any:
        if self.tokenizer is None:
            raise ValueError("no tokenizer: the engine was built with skip_tokenizer_init=True")
        return self.tokenizer

    def reset_prefix_cache(
        self, reset_running_requests: bool = False, reset_connector: bool = False
    ) -> bool:
        return self.engine_core.reset_prefix_cache(reset_running_requests, reset_connector)

    def _check_new_adapter(self, lora_request: LoRARequest | None) -> None:
        """Glassbox's own: the first request naming an adapter has the workers
        read it (``check_lora``), so a broken one is a ValueError here rather
        than a failure in the step that would load it (vLLM's engine dies there)."""
        if lora_request is None or lora_request in self._checked_loras:
            return
        self.input_processor._validate_lora_request(lora_request)
        self.engine_core.check_lora(lora_request)
        self._checked_loras.add(lora_request)

    def add_lora(self, lora_request: LoRARequest) -> bool:
        """Load an adapter into the workers now, before a request names it: a
        broken one fails here. False: it was loaded already."""
        self.input_processor._validate_lora_request(lora_request)
        added = self.engine_core.add_lora(lora_request)
        self._checked_loras.add(lora_request)
        return added

    def remove_lora(self, lora_id: int) -> bool:
        """Drop a loaded adapter (a request still naming it loads it again)."""
        return self.engine_core.remove_lora(lora_id)

    def list_loras(self) -> set[int]:
        """Ids of the adapters loaded in the workers' host memory."""
        return self.engine_core.list_loras()

    def pin_lora(self, lora_id: int) -> bool:
        """Keep a loaded adapter in host memory: the LRU never evicts it."""
        return self.engine_core.pin_lora(lora_id)

    def collective_rpc(
        self,
        method: str | Callable[..., Any],
        timeout: float | None = None,
        args: tuple = (),
        kwargs: dict[str, Any] | None = None,
    ) -> list[Any]:
        """Every worker's answer to ``method(worker, *args, **kwargs)`` (a
        top-level function, or a ``WorkerMethod`` name); across processes
        only with ``GLASSBOX_ALLOW_INSECURE_SERIALIZATION=1``."""
        return self.engine_core.collective_rpc(method, timeout, args, kwargs)

    def apply_model(self, func: Callable[[Any], Any]) -> list[Any]:
        """``func(model)`` in every worker, one answer per rank."""
        return self.collective_rpc("apply_model", args=(func,))

    def start_profile(self, profile_prefix: str | None = None) -> None:
        self.engine_core.profile(True, profile_prefix)

    def stop_profile(self) -> None:
        self.engine_core.profile(False)

    def shutdown(self) -> None:
        """Stop EngineCore (its process, in multi-process mode) and close the
        trace. Safe to call twice."""
        self._finalizer()


def _shutdown_engine(engine_core: EngineCoreClient, tracer: Tracer, merge_path: str | None) -> None:
    engine_core.shutdown()  # in multi-process mode: returns once the core has exited
    tracer.close()
    if merge_path is not None:
        merge_trace_parts(merge_path)
