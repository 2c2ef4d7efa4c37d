"""AsyncLLM: the asyncio front end the API server runs on.

vLLM twin: ``vllm/v1/engine/async_llm.py`` (``AsyncLLM``) and
``RequestOutputCollector`` from ``vllm/v1/engine/output_processor.py``.
Read it for how one process serves many concurrent streams while EngineCore
steps in another:

* ``generate()`` -- an async generator per request: ``add_request`` (prompt ->
  ``EngineCoreRequest`` -> ZMQ) returns a ``RequestOutputCollector``, and the
  generator yields whatever lands in it until the request is finished. If the
  caller stops iterating (a client disconnected, the task was cancelled),
  the request is aborted in the core so its KV blocks go back to the pool.
* ``output_handler`` -- one background task (started by
  ``_run_output_handler``) that pulls ``EngineCoreOutputs`` off the socket,
  runs the ``OutputProcessor`` (detokenize, stop strings, n-grouping) and puts
  each ``RequestOutput`` in its request's collector. Stop strings found here
  are aborted in the core; metrics are recorded here.
* A collector holds at most one pending output: if the producer gets ahead of
  a slow consumer, DELTA outputs are merged (``RequestOutput.add``), so a slow
  client never makes the handler wait.
* Engine death -- the client turns it into ``EngineDeadError``; the handler
  hands it to every collector, and ``errored`` / ``check_health`` report it.
Sessions: 01 (engine loop across two processes).

Simpler than vLLM: no LoRA, pooling, streaming-input generators, pause/resume,
sleep mode or data parallelism. The collector lives here next to its only
user, and outputs are routed to collectors by request id, so the same
``OutputProcessor`` serves ``LLMEngine`` and ``AsyncLLM`` unchanged.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncGenerator, Iterable
from typing import Any

from engine.config import GlassboxConfig
from engine.engine.arg_utils import EngineArgs
from engine.outputs import RequestOutput
from engine.sampling_params import RequestOutputKind, SamplingParams
from engine.tracing import Tracer, merge_trace_parts, part_path
from engine.tracing.engine_trace import OutputProcessorTrace
from engine.transformers_utils.tokenizer import get_tokenizer
from engine.v1.engine import EngineCoreRequest, FinishReason
from engine.v1.engine.core_client import AsyncMPClient, EngineCoreClient
from engine.v1.engine.exceptions import EngineDeadError, EngineGenerateError
from engine.v1.engine.input_processor import InputProcessor, PromptType
from engine.v1.engine.output_processor import OutputProcessor
from engine.v1.engine.parallel_sampling import ParentRequest
from engine.v1.executor.abstract import Executor
from engine.v1.metrics.loggers import StatLogger
from engine.v1.metrics.reader import Histogram, Metric

logger = logging.getLogger(__name__)

# Outputs processed between two yields to the event loop, so one huge batch
# cannot starve the HTTP handlers (vLLM: VLLM_V1_OUTPUT_PROC_CHUNK_SIZE).
OUTPUT_PROC_CHUNK_SIZE = 128


class RequestOutputCollector:
    """Hand-off point between the output handler (producer) and one
    ``generate()`` (consumer). Holds one output; newer DELTA outputs are
    merged into it, newer CUMULATIVE/FINAL_ONLY ones replace it."""

    def __init__(self, output_kind: RequestOutputKind, request_id: str) -> None:
        self.aggregate = output_kind == RequestOutputKind.DELTA
        self.request_id = request_id
        self.output: RequestOutput | BaseException | None = None
        self.ready = asyncio.Event()

    def put(self, output: RequestOutput | BaseException) -> None:
        if self.output is None or isinstance(output, BaseException):
            self.output = output
            self.ready.set()
        elif isinstance(self.output, RequestOutput):
            # Keeps the samples of an n > 1 request apart by index.
            self.output.add(output, aggregate=self.aggregate)

    async def get(self) -> RequestOutput:
        while (output := self.output) is None:
            await self.ready.wait()
        self.output = None
        self.ready.clear()
        if isinstance(output, BaseException):
            raise output
        return output

    def get_nowait(self) -> RequestOutput | None:
        output = self.output
        if output is not None:
            self.output = None
            self.ready.clear()
        if isinstance(output, BaseException):
            raise output
        return output


class AsyncLLM:
    def __init__(
        self,
        glassbox_config: GlassboxConfig,
        executor_class: type[Executor],
        log_stats: bool = True,
        log_requests: bool = False,
    ) -> None:
        self.glassbox_config = glassbox_config
        self.model_config = glassbox_config.model_config
        self.log_requests = log_requests
        self.log_stats = log_stats
        model_config = glassbox_config.model_config
        self.tokenizer: Any | None = (
            None
            if model_config.skip_tokenizer_init
            else get_tokenizer(model_config.tokenizer or model_config.model)
        )
        obs = glassbox_config.observability_config
        self._trace_path = obs.trace_path if obs.trace_level != "off" and obs.trace_path else None
        # This process's part of the trace; EngineCore writes its own.
        self.tracer = Tracer(
            part_path(self._trace_path, "frontend") if self._trace_path else None, obs.trace_level
        )
        self.input_processor = InputProcessor(glassbox_config, self.tokenizer)
        self.output_processor = OutputProcessor(
            self.tokenizer, OutputProcessorTrace.create(self.tracer)
        )
        self.stat_logger = StatLogger(model_config.model) if log_stats else None
        # request id (the parent's for n > 1) -> where its outputs go.
        self.collectors: dict[str, RequestOutputCollector] = {}
        try:
            # EngineCore starts in its own process here (vLLM: always, for AsyncLLM).
            self.engine_core: AsyncMPClient = EngineCoreClient.make_async_mp_client(
                glassbox_config, executor_class, log_stats, self.tracer
            )
        except BaseException:
            self.tracer.close()
            raise
        if self.stat_logger is not None:
            self.stat_logger.log_engine_initialized(
                glassbox_config.cache_config.block_size, glassbox_config.cache_config.num_gpu_blocks
            )
        self.output_handler: asyncio.Task | None = None
        self._shut_down = False
        try:
            # Start reading outputs now if we are inside an event loop.
            asyncio.get_running_loop()
            self._run_output_handler()
        except RuntimeError:
            pass

    @classmethod
    def from_engine_args(cls, engine_args: EngineArgs, log_requests: bool = False) -> AsyncLLM:
        config = engine_args.create_engine_config()
        return cls(
            config,
            executor_class=Executor.get_class(config),
            log_stats=not engine_args.disable_log_stats,
            log_requests=log_requests,
        )

    def __del__(self) -> None:
        if not getattr(self, "_shut_down", True):
            self.shutdown()

    def shutdown(self) -> None:
        """Stop EngineCore, the output handler and merge the trace parts."""
        if self._shut_down:
            return
        self._shut_down = True
        if (engine_core := getattr(self, "engine_core", None)) is not None:
            engine_core.shutdown()
        handler = self.output_handler
        if handler is not None and not handler.done():
            loop = handler.get_loop()
            if not loop.is_closed():
                loop.call_soon_threadsafe(handler.cancel)
        self.tracer.close()
        if self._trace_path is not None:
            merge_trace_parts(self._trace_path)

    # -- requests ------------------------------------------------------------------
    async def add_request(
        self,
        request_id: str,
        prompt: PromptType,
        params: SamplingParams,
        arrival_time: float | None = None,
        priority: int = 0,
    ) -> RequestOutputCollector:
        """Validate, tokenize and send one request; returns its collector."""
        if self.errored:
            raise EngineDeadError()
        if not isinstance(request_id, str) or not request_id:
            raise ValueError(f"request_id must be a non-empty string, got {request_id!r}")
        if request_id in self.collectors or request_id in self.output_processor.request_states:
            raise ValueError(f"request_id {request_id!r} is already in use")
        prompt_text, request = self.input_processor.process_inputs(
            request_id, prompt, params, arrival_time, priority
        )
        # Started on the first request rather than in __init__, so an
        # AsyncLLM can be built before the event loop exists.
        self._run_output_handler()
        collector = RequestOutputCollector(request.sampling_params.output_kind, request_id)
        self.collectors[request_id] = collector
        n = request.sampling_params.n
        if n == 1:
            await self._add_request(request, prompt_text, None, 0)
            return collector
        parent = ParentRequest(request_id, request.sampling_params)
        for index in range(n):
            child_id, child_params = parent.get_child_info(index)
            child = request.__copy__()
            child.request_id = child_id
            child.sampling_params = child_params
            await self._add_request(child, prompt_text, parent, index)
        return collector

    async def _add_request(
        self,
        request: EngineCoreRequest,
        prompt_text: str | None,
        parent: ParentRequest | None,
        index: int,
    ) -> None:
        self.output_processor.add_request(request, prompt_text, parent, index)
        if self.stat_logger is not None:
            self.stat_logger.add_request(request.request_id, request.arrival_time)
        await self.engine_core.add_request_async(request)
        if self.log_requests:
            logger.info("Added request %s.", request.request_id)

    async def generate(
        self,
        prompt: PromptType,
        sampling_params: SamplingParams,
        request_id: str,
        *,
        priority: int = 0,
    ) -> AsyncGenerator[RequestOutput, None]:
        """Yield the request's ``RequestOutput``s until it is finished.

        Errors: ``ValueError`` for a bad request (nothing was sent),
        ``EngineDeadError`` when the core is gone, ``EngineGenerateError`` for
        anything else (the request is aborted; the engine keeps serving)."""
        collector: RequestOutputCollector | None = None
        try:
            collector = await self.add_request(
                request_id, prompt, sampling_params, priority=priority
            )
            finished = False
            while not finished:
                # Take what is there without a task switch when possible.
                out = collector.get_nowait() or await collector.get()
                finished = out.finished
                yield out
        except (asyncio.CancelledError, GeneratorExit):
            # The consumer went away (client disconnect, cancelled task).
            if collector is not None and not self.errored:
                # Shielded: a cancelled scope must not stop the abort itself.
                await asyncio.shield(self.abort(collector.request_id, internal=True))
            if self.log_requests:
                logger.info("Request %s aborted.", request_id)
            raise
        except EngineDeadError:
            if self.log_requests:
                logger.info("Request %s failed (engine dead).", request_id)
            raise
        except ValueError:
            if self.log_requests:
                logger.info("Request %s failed (bad request).", request_id)
            raise
        except Exception as e:
            if collector is not None:
                await self.abort(collector.request_id, internal=True)
            raise EngineGenerateError(f"request {request_id} failed: {e}") from e

    async def abort(self, request_id: str | Iterable[str], internal: bool = False) -> None:
        """Abort requests in the front end and in EngineCore. An external
        abort also ends the request's ``generate()`` with finish_reason "abort"."""
        request_ids = [request_id] if isinstance(request_id, str) else list(request_id)
        states = self.output_processor.request_states
        # Build the final "abort" outputs before the states are dropped.
        final: dict[str, RequestOutput] = {}
        if not internal:
            for rid in request_ids:
                parent = self.output_processor.parent_requests.get(rid)
                children = sorted(parent.child_requests) if parent else [rid]
                completions = []
                for c in children:
                    if c in states:
                        states[c]._new_tokens = 0  # nothing new since the last output
                        completions.append(
                            states[c].make_completion_output(FinishReason.ABORT, None, True)
                        )
                first = next((states[c] for c in children if c in states), None)
                if first is not None:
                    final[rid] = RequestOutput(
                        request_id=rid,
                        prompt=first.prompt,
                        prompt_token_ids=first.prompt_token_ids,
                        prompt_logprobs=None,
                        outputs=completions,
                        finished=True,
                        num_cached_tokens=first.num_cached_tokens,
                    )
        to_abort = self.output_processor.abort_requests(request_ids)
        if self.stat_logger is not None:
            self.stat_logger.forget_requests(to_abort)
        for rid in request_ids:
            collector = self.collectors.pop(rid, None)
            if collector is not None and rid in final:
                collector.put(final[rid])
        await self.engine_core.abort_requests_async(to_abort)
        if self.log_requests:
            logger.info("Aborted request(s) %s.", ",".join(request_ids))

    # -- the output handler --------------------------------------------------------
    def _run_output_handler(self) -> None:
        if self.output_handler is not None:
            return
        # The task must not hold a reference to self, or an AsyncLLM that is
        # dropped without shutdown() would never be collected.
        engine_core = self.engine_core
        output_processor = self.output_processor
        collectors = self.collectors
        stat_logger = self.stat_logger

        async def output_handler() -> None:
            try:
                while True:
                    # 1) Pull a batch from EngineCore.
                    outputs = await engine_core.get_output_async()
                    batch = outputs.outputs
                    reqs_to_abort: list[str] = []
                    for start in range(0, max(len(batch), 1), OUTPUT_PROC_CHUNK_SIZE):
                        # 2) Detokenize, check stop strings, group n > 1.
                        processed = output_processor.process_outputs(
                            batch[start : start + OUTPUT_PROC_CHUNK_SIZE]
                        )
                        # 3) Hand each RequestOutput to its generate().
                        for request_output in processed.request_outputs:
                            collector = collectors.get(request_output.request_id)
                            if collector is None:
                                continue
                            collector.put(request_output)
                            if request_output.finished:
                                del collectors[request_output.request_id]
                        reqs_to_abort += processed.reqs_to_abort
                        if stat_logger is not None:
                            stat_logger.record_tokens(
                                processed.num_prompt_tokens, processed.num_generation_tokens
                            )
                        if start + OUTPUT_PROC_CHUNK_SIZE < len(batch):
                            await asyncio.sleep(0)
                    # 4) Requests a stop string ended are still running in the core.
                    if reqs_to_abort:
                        await engine_core.abort_requests_async(reqs_to_abort)
                    # 5) Metrics.
                    if stat_logger is not None:
                        if outputs.scheduler_stats is not None:
                            stat_logger.record_scheduler_stats(outputs.scheduler_stats)
                        stat_logger.record_iteration(outputs, reqs_to_abort)
            except Exception as e:
                if not isinstance(e, EngineDeadError):
                    logger.exception("AsyncLLM output_handler failed.")
                # Every waiting generate() raises it.
                for collector in list(collectors.values()):
                    collector.put(e)
                collectors.clear()

        self.output_handler = asyncio.create_task(output_handler(), name="AsyncLLMOutputHandler")

    # -- state -----------------------------------------------------------------------
    @property
    def is_running(self) -> bool:
        return self.output_handler is None or not self.output_handler.done()

    @property
    def is_stopped(self) -> bool:
        return self.errored

    @property
    def errored(self) -> bool:
        return self.engine_core.resources.engine_dead or not self.is_running

    @property
    def dead_error(self) -> BaseException:
        return EngineDeadError()

    async def check_health(self) -> None:
        """Raises ``EngineDeadError`` once the engine cannot serve any more."""
        if self.errored:
            raise self.dead_error

    def get_tokenizer(self) -> Any:
        if self.tokenizer is None:
            raise ValueError("no tokenizer: the engine was built with skip_tokenizer_init=True")
        return self.tokenizer

    async def reset_prefix_cache(self) -> bool:
        return await self.engine_core.reset_prefix_cache_async()

    def get_metrics(self) -> list[Metric]:
        if self.stat_logger is None:
            raise RuntimeError("metrics are off: the engine was built with disable_log_stats=True")
        return self.stat_logger.get_metrics()

    def get_histograms(self) -> list[Histogram]:
        if self.stat_logger is None:
            raise RuntimeError("metrics are off: the engine was built with disable_log_stats=True")
        return self.stat_logger.get_histograms()

    def render_prometheus(self) -> str:
        if self.stat_logger is None:
            raise RuntimeError("metrics are off: the engine was built with disable_log_stats=True")
        return self.stat_logger.render_prometheus()
