"""LLMEngine: the synchronous front end used by ``LLM``.

vLLM twin: ``vllm/v1/engine/llm_engine.py`` (``LLMEngine``).
Read it for the front-end half of one step:
  ``add_request``: prompt -> ``InputProcessor`` -> ``EngineCoreRequest`` ->
  core client (``n > 1`` becomes ``n`` child requests first);
  ``step``: core client ``get_output()`` (one EngineCore step) ->
  ``OutputProcessor`` (text, stop strings, grouping) -> ``RequestOutput`` list,
  and aborts in the core any request a stop string ended.
Sessions: 01 (engine loop).
"""

from __future__ import annotations

import logging
from typing import Any

from engine.config import GlassboxConfig
from engine.engine.arg_utils import EngineArgs
from engine.outputs import RequestOutput
from engine.sampling_params import SamplingParams
from engine.tracing import Tracer
from engine.transformers_utils.tokenizer import get_tokenizer
from engine.v1.engine.core_client import EngineCoreClient
from engine.v1.engine.input_processor import InputProcessor, PromptType
from engine.v1.engine.output_processor import OutputProcessor
from engine.v1.engine.parallel_sampling import ParentRequest
from engine.v1.executor.abstract import Executor
from engine.v1.metrics.loggers import StatLogger
from engine.v1.metrics.reader import Metric

logger = logging.getLogger(__name__)


class LLMEngine:
    def __init__(
        self,
        glassbox_config: GlassboxConfig,
        executor_class: type[Executor],
        log_stats: bool = True,
    ) -> None:
        self.glassbox_config = glassbox_config
        self.model_config = glassbox_config.model_config
        self.log_stats = log_stats
        model_config = glassbox_config.model_config
        self.tokenizer: Any | None = (
            None
            if model_config.skip_tokenizer_init
            else get_tokenizer(model_config.tokenizer or model_config.model)
        )
        self.input_processor = InputProcessor(glassbox_config, self.tokenizer)
        self.output_processor = OutputProcessor(self.tokenizer)
        self.stat_logger = StatLogger(model_config.model) if log_stats else None
        obs = glassbox_config.observability_config
        self.tracer = Tracer(obs.trace_path, obs.trace_level)
        try:
            self.engine_core = EngineCoreClient.make_client(
                glassbox_config, executor_class, log_stats, self.tracer
            )
        except BaseException:
            self.tracer.close()
            raise

    @classmethod
    def from_engine_args(cls, engine_args: EngineArgs) -> LLMEngine:
        config = engine_args.create_engine_config()
        return cls(
            config,
            executor_class=Executor.get_class(config),
            log_stats=not engine_args.disable_log_stats,
        )

    # -- requests --------------------------------------------------------------
    def add_request(
        self,
        request_id: str,
        prompt: PromptType,
        params: SamplingParams,
        arrival_time: float | None = None,
        priority: int = 0,
    ) -> None:
        if not isinstance(request_id, str) or not request_id:
            raise ValueError(f"request_id must be a non-empty string, got {request_id!r}")
        if request_id in self.output_processor.request_states or (
            request_id in self.output_processor.parent_requests
        ):
            raise ValueError(f"request_id {request_id!r} is already in use")
        prompt_text, request = self.input_processor.process_inputs(
            request_id, prompt, params, arrival_time, priority
        )
        n = request.sampling_params.n
        if n == 1:
            self.output_processor.add_request(request, prompt_text)
            self.engine_core.add_request(request)
            return
        parent = ParentRequest(request_id, request.sampling_params)
        for index in range(n):
            child_id, child_params = parent.get_child_info(index)
            child = request.__copy__()
            child.request_id = child_id
            child.sampling_params = child_params
            self.output_processor.add_request(child, prompt_text, parent, index)
            self.engine_core.add_request(child)

    def abort_request(self, request_ids: list[str]) -> None:
        to_abort = self.output_processor.abort_requests(list(request_ids))
        self.engine_core.abort_requests(to_abort)

    def step(self) -> list[RequestOutput]:
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
        return processed.request_outputs

    # -- state -------------------------------------------------------------------
    def has_unfinished_requests(self) -> bool:
        return self.output_processor.has_unfinished_requests()

    def get_num_unfinished_requests(self) -> int:
        return self.output_processor.get_num_unfinished_requests()

    def get_metrics(self) -> list[Metric]:
        if self.stat_logger is None:
            raise RuntimeError("metrics are off: the engine was built with disable_log_stats=True")
        return self.stat_logger.get_metrics()

    def get_tokenizer(self) -> Any:
        if self.tokenizer is None:
            raise ValueError("no tokenizer: the engine was built with skip_tokenizer_init=True")
        return self.tokenizer

    def reset_prefix_cache(self) -> bool:
        return self.engine_core.reset_prefix_cache()

    def shutdown(self) -> None:
        self.engine_core.shutdown()
        self.tracer.close()
