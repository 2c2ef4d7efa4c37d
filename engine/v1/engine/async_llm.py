"""AsyncLLM: the asyncio front end the API server runs on.

vLLM twin: ``vllm/v1/engine/async_llm.py`` (``AsyncLLM``).
Read it for how one process serves many concurrent streams while EngineCore
steps in another:

* ``generate()`` -- an async generator per request: ``add_request`` (prompt ->
  ``EngineCoreRequest`` -> internal id -> ZMQ) returns a
  ``RequestOutputCollector`` (see output_processor.py), and the generator
  yields whatever lands in it until the request is finished. If the caller
  stops iterating (a client disconnected, the task was cancelled), the
  request is aborted in the core by its internal id so its KV blocks go back
  to the pool.
* ``output_handler`` -- one background task (started by
  ``_run_output_handler``) that pulls ``EngineCoreOutputs`` off the socket and
  runs the ``OutputProcessor`` (detokenize, stop strings, n-grouping), which
  puts each ``RequestOutput`` in its request's collector. Stop strings found
  there are aborted in the core; metrics are recorded here.
* ``abort(request_id)`` takes the user's id (every request sent under it is
  aborted and its ``generate()`` ends with finish_reason "abort");
  ``abort(..., internal=True)`` takes internal ids.
* Engine death -- the client turns it into ``EngineDeadError``; the handler
  hands it to every collector, and ``errored`` / ``check_health`` report it.
``start_profile`` / ``stop_profile`` open a profiling window in the workers
and, with the torch profiler, one in this process too (``FrontendProfiler``).
Sessions: 01 (engine loop across two processes).

``pause_generation`` / ``resume_generation`` hold the scheduler back (a
``PauseState``) while, say, a trainer swaps the weights.

Simpler than vLLM: no pooling, streaming-input generators, sleep mode,
weight-transfer calls or data parallelism.

Differs from vLLM on purpose: ``add_request`` is all-or-nothing -- if
anything fails before every part of the request reached the core, what was
registered (output-processor state, stat entry, children already sent) is
removed again, so a failed request leaks nothing. And it refuses a request
once ``max_num_seqs + max_waiting_requests`` sequences are unfinished
(``EngineOverloadedError``, HTTP 503): vLLM has no such limit and queues
whatever arrives.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncGenerator, Callable, Iterable
from copy import copy
from typing import Any

from engine.config import GlassboxConfig
from engine.engine.arg_utils import EngineArgs
from engine.lora.request import LoRARequest
from engine.outputs import RequestOutput
from engine.profiler.wrapper import FrontendProfiler
from engine.sampling_params import SamplingParams
from engine.tracing import Tracer, merge_trace_parts, part_path
from engine.tracing.engine_trace import OutputProcessorTrace
from engine.transformers_utils.tokenizer import get_tokenizer
from engine.usage.usage_lib import UsageContext
from engine.v1.engine import EngineCoreRequest
from engine.v1.engine.core import pause_state_for
from engine.v1.engine.core_client import AsyncMPClient, EngineCoreClient
from engine.v1.engine.exceptions import (
    EngineDeadError,
    EngineGenerateError,
    EngineOverloadedError,
    EngineShuttingDownError,
)
from engine.v1.engine.input_processor import InputProcessor, PromptType
from engine.v1.engine.output_processor import OutputProcessor, RequestOutputCollector
from engine.v1.engine.parallel_sampling import ParentRequest
from engine.v1.executor.abstract import Executor
from engine.v1.metrics.loggers import METRICS_OFF, StatLogger
from engine.v1.metrics.reader import Histogram, Metric

logger = logging.getLogger(__name__)

# Outputs processed between two yields to the event loop, so one huge batch
# cannot starve the HTTP handlers (vLLM: VLLM_V1_OUTPUT_PROC_CHUNK_SIZE).
OUTPUT_PROC_CHUNK_SIZE = 128


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
        self.profiler = FrontendProfiler.create(glassbox_config.profiler_config)
        self.output_handler: asyncio.Task | None = None
        self._shut_down = False
        self.max_unfinished_sequences = glassbox_config.scheduler_config.max_unfinished_sequences
        # Sequences of add_request calls in progress that are not yet in the
        # output processor (which counts the registered ones).
        self._num_unregistered = 0
        try:
            # Start reading outputs now if we are inside an event loop.
            asyncio.get_running_loop()
            self._run_output_handler()
        except RuntimeError:
            pass

    @classmethod
    def from_engine_args(
        cls,
        engine_args: EngineArgs,
        usage_context: UsageContext = UsageContext.ENGINE_CONTEXT,
        log_requests: bool = False,
    ) -> AsyncLLM:
        """``usage_context`` picks the batch defaults (the server passes OPENAI_API_SERVER)."""
        config = engine_args.create_engine_config(usage_context)
        return cls(
            config,
            executor_class=Executor.get_class(config),
            log_stats=not engine_args.disable_log_stats,
            log_requests=log_requests,
        )

    def __del__(self) -> None:
        if not getattr(self, "_shut_down", True):
            self.shutdown()

    def shutdown(self, timeout: float | None = None) -> None:
        """Stop EngineCore, the output handler, and merge the trace parts.

        New requests are refused from the first line on (``EngineShuttingDownError``).
        EngineCore lets the requests in flight run for its ``shutdown_timeout``
        and aborts the rest; ``timeout`` overrides how long this call waits for
        that drain. Run it off the event loop (``run_in_executor``) to keep
        streaming while the engine drains. Whatever is still unfinished here
        afterwards ends with finish_reason "abort"."""
        if self._shut_down:
            return
        self._shut_down = True
        if (engine_core := getattr(self, "engine_core", None)) is not None:
            engine_core.shutdown(timeout)
        if (profiler := getattr(self, "profiler", None)) is not None:
            profiler.shutdown()  # a window still open writes its trace
        handler = self.output_handler
        if handler is not None and not handler.done():
            loop = handler.get_loop()
            if not loop.is_closed():
                loop.call_soon_threadsafe(self._abort_unfinished_and_stop, handler)
        self.tracer.close()
        if self._trace_path is not None:
            merge_trace_parts(self._trace_path)

    def _abort_unfinished_and_stop(self, handler: asyncio.Task) -> None:
        """On the event loop, after EngineCore exited: finish what it left behind."""
        leftover = list(self.output_processor.request_states)
        self.output_processor.abort_requests(leftover, internal=True)
        if self.stat_logger is not None:
            self.stat_logger.record_aborted(leftover)
        handler.cancel()

    # -- requests ------------------------------------------------------------------
    async def add_request(
        self,
        request_id: str,
        prompt: PromptType,
        params: SamplingParams,
        arrival_time: float | None = None,
        priority: int = 0,
        lora_request: LoRARequest | None = None,
    ) -> RequestOutputCollector:
        """Validate, tokenize and send one request; returns its collector
        (whose ``request_id`` is the internal id)."""
        if self._shut_down:
            raise EngineShuttingDownError()
        if self.errored:
            raise EngineDeadError()
        if not isinstance(request_id, str) or not request_id:
            # A ValueError, so generate() reports it as a bad request.
            raise ValueError(f"request_id must be a non-empty string, got {request_id!r}")
        await self._check_new_adapter(lora_request)
        num_sequences = params.n if isinstance(params, SamplingParams) else 1
        # Before tokenizing: an overloaded engine should not spend work on it.
        self.check_capacity(num_sequences)
        prompt_text, request = self.input_processor.process_inputs(
            request_id, prompt, params, arrival_time, priority, lora_request
        )
        self.input_processor.assign_request_id(request)
        # Started on the first request rather than in __init__, so an
        # AsyncLLM can be built before the event loop exists.
        self._run_output_handler()
        queue = RequestOutputCollector(request.sampling_params.output_kind, request.request_id)
        # Internal ids handed to the core, to take back if a later part fails.
        sent: list[str] = []
        # Held from the check above (no await since) until each part is registered.
        self._num_unregistered += num_sequences
        try:
            params = request.sampling_params
            if params.n == 1:
                await self._add_request(request, prompt_text, None, 0, queue, sent)
                return queue
            # Fan out the children (n > 1).
            parent = ParentRequest(request)
            for index in range(params.n):
                child_id, child_params = parent.get_child_info(index)
                child = request if index == params.n - 1 else copy(request)
                child.request_id = child_id
                child.sampling_params = child_params
                await self._add_request(child, prompt_text, parent, index, queue, sent)
            return queue
        except BaseException:
            await self._undo_add_request(queue.request_id, sent)
            raise
        finally:
            self._num_unregistered -= num_sequences - len(sent)

    def check_capacity(self, num_sequences: int) -> None:
        """Raise ``EngineOverloadedError`` unless ``num_sequences`` more fit
        under ``max_num_seqs + max_waiting_requests`` now, or ``ValueError``
        if they never could."""
        limit = self.max_unfinished_sequences
        if limit is None:
            return
        if num_sequences > limit:
            raise ValueError(
                f"n (times the number of prompts) asks for {num_sequences} sequences, more than "
                f"the engine ever holds at once (max_num_seqs + max_waiting_requests = {limit})."
            )
        unfinished = self.output_processor.get_num_unfinished_requests() + self._num_unregistered
        if unfinished + num_sequences > limit:
            raise EngineOverloadedError(
                f"The server is overloaded: {unfinished} sequences are unfinished and at most "
                f"{limit} (max_num_seqs + max_waiting_requests) may be; retry later."
            )

    async def _add_request(
        self,
        request: EngineCoreRequest,
        prompt_text: str | None,
        parent: ParentRequest | None,
        index: int,
        queue: RequestOutputCollector,
        sent: list[str],
    ) -> None:
        self.output_processor.add_request(request, prompt_text, parent, index, queue)
        # Counted before the send: a cancelled send may still have reached the core.
        sent.append(request.request_id)
        self._num_unregistered -= 1
        if self.stat_logger is not None:
            self.stat_logger.add_request(request.request_id, request.arrival_time)
        await self.engine_core.add_request_async(request)
        if self.log_requests:
            logger.info("Added request %s.", request.request_id)

    async def _undo_add_request(self, internal_id: str, sent: list[str]) -> None:
        """Forget a request whose ``add_request`` failed part-way."""
        forgotten = self.output_processor.abort_requests([internal_id], internal=True)
        if self.stat_logger is not None:
            self.stat_logger.forget_requests(forgotten)
        if sent and not self.errored:
            try:
                await asyncio.shield(self.engine_core.abort_requests_async(sent))
            except Exception:
                logger.exception("Could not abort the sent parts of request %s.", internal_id)

    async def generate(
        self,
        prompt: PromptType,
        sampling_params: SamplingParams,
        request_id: str,
        *,
        priority: int = 0,
        lora_request: LoRARequest | None = None,
    ) -> AsyncGenerator[RequestOutput, None]:
        """Yield the request's ``RequestOutput``s until it is finished.

        Errors: ``ValueError`` for a bad request (nothing was sent),
        ``EngineDeadError`` when the core is gone, ``EngineGenerateError`` for
        anything else (the request is aborted; the engine keeps serving)."""
        queue: RequestOutputCollector | None = None
        try:
            queue = await self.add_request(
                request_id, prompt, sampling_params, priority=priority, lora_request=lora_request
            )
            finished = False
            while not finished:
                # Take what is there without a task switch when possible.
                out = queue.get_nowait() or await queue.get()
                finished = out.finished
                yield out
        except (asyncio.CancelledError, GeneratorExit):
            # The consumer went away (client disconnect, cancelled task).
            if queue is not None and not self.errored:
                # Shielded: a cancelled scope must not stop the abort itself.
                await asyncio.shield(self.abort(queue.request_id, internal=True))
            if self.log_requests:
                logger.info("Request %s aborted.", request_id)
            raise
        except (EngineDeadError, EngineOverloadedError) as e:
            if self.log_requests:
                logger.info("Request %s failed (%s).", request_id, type(e).__name__)
            raise
        except ValueError:
            if self.log_requests:
                logger.info("Request %s failed (bad request).", request_id)
            raise
        except Exception as e:
            if queue is not None:
                await self.abort(queue.request_id, internal=True)
            raise EngineGenerateError(f"request {request_id} failed: {e}") from e

    async def abort(self, request_id: str | Iterable[str], internal: bool = False) -> None:
        """Abort requests in the front end and in EngineCore.

        ``internal=False``: the user's ids; each ``generate()`` running under
        one ends with a last output whose finish_reason is "abort".
        ``internal=True``: internal ids (what a collector's ``request_id`` is)."""
        request_ids = [request_id] if isinstance(request_id, str) else list(request_id)
        to_abort = self.output_processor.abort_requests(request_ids, internal)
        if self.stat_logger is not None:
            self.stat_logger.record_aborted(to_abort)
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
        stat_logger = self.stat_logger

        async def output_handler() -> None:
            try:
                while True:
                    # 1) Pull a batch from EngineCore.
                    outputs = await engine_core.get_output_async()
                    batch = outputs.outputs
                    reqs_to_abort: list[str] = []
                    for start in range(0, max(len(batch), 1), OUTPUT_PROC_CHUNK_SIZE):
                        # 2) Detokenize, check stop strings, group n > 1; each
                        # RequestOutput goes into its request's collector.
                        processed = output_processor.process_outputs(
                            batch[start : start + OUTPUT_PROC_CHUNK_SIZE]
                        )
                        reqs_to_abort += processed.reqs_to_abort
                        if stat_logger is not None:
                            stat_logger.record_tokens(
                                processed.num_prompt_tokens, processed.num_generation_tokens
                            )
                        if start + OUTPUT_PROC_CHUNK_SIZE < len(batch):
                            await asyncio.sleep(0)
                    # 3) Requests a stop string ended are still running in the core.
                    if reqs_to_abort:
                        await engine_core.abort_requests_async(reqs_to_abort)
                    # 4) Metrics.
                    if stat_logger is not None:
                        if outputs.scheduler_stats is not None:
                            stat_logger.record_scheduler_stats(outputs.scheduler_stats)
                        stat_logger.record_iteration(outputs, reqs_to_abort)
            except Exception as e:
                if not isinstance(e, EngineDeadError):
                    logger.exception("AsyncLLM output_handler failed.")
                if stat_logger is not None:
                    stat_logger.record_engine_dead(output_processor.request_states)
                # Every waiting generate() raises it.
                output_processor.propagate_error(e)

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

    async def reset_prefix_cache(
        self, reset_running_requests: bool = False, reset_connector: bool = False
    ) -> bool:
        return await self.engine_core.reset_prefix_cache_async(
            reset_running_requests, reset_connector
        )

    async def _check_new_adapter(self, lora_request: LoRARequest | None) -> None:
        """Glassbox's own: the first request naming an adapter has the workers
        read it (``check_lora``): a broken one is a ValueError (HTTP 400)
        rather than a failure in the step that would load it."""
        if lora_request is None or lora_request in self._checked_loras:
            return
        self.input_processor._validate_lora_request(lora_request)
        await self.engine_core.check_lora_async(lora_request)
        self._checked_loras.add(lora_request)

    async def add_lora(self, lora_request: LoRARequest) -> bool:
        """Load an adapter into the workers now (the server's load endpoint)."""
        self.input_processor._validate_lora_request(lora_request)
        added = await self.engine_core.add_lora_async(lora_request)
        self._checked_loras.add(lora_request)
        return added

    async def remove_lora(self, lora_id: int) -> bool:
        return await self.engine_core.remove_lora_async(lora_id)

    async def list_loras(self) -> set[int]:
        return await self.engine_core.list_loras_async()

    async def pin_lora(self, lora_id: int) -> bool:
        return await self.engine_core.pin_lora_async(lora_id)

    async def collective_rpc(
        self,
        method: str | Callable[..., Any],
        timeout: float | None = None,
        args: tuple = (),
        kwargs: dict[str, Any] | None = None,
    ) -> list[Any]:
        """Every worker's answer to ``method(worker, *args, **kwargs)`` (needs
        ``GLASSBOX_ALLOW_INSECURE_SERIALIZATION=1``: EngineCore is another process)."""
        return await self.engine_core.collective_rpc_async(method, timeout, args, kwargs)

    async def pause_generation(self, *, mode: str = "abort", clear_cache: bool = True) -> None:
        """Stop generating until ``resume_generation`` (e.g. to swap weights).
        ``abort``: requests in flight end now (finish_reason "abort"); ``wait``:
        they finish first; ``keep``: they freeze and go on after the resume.
        New requests are accepted and queued. ``clear_cache``: empty the prefix
        cache once nothing runs. Returns when the pause is complete."""
        pause_state_for(mode)  # a bad mode is the caller's error, before any call
        await self.engine_core.pause_scheduler_async(mode, clear_cache)

    async def resume_generation(self) -> None:
        await self.engine_core.resume_scheduler_async()

    async def is_paused(self) -> bool:
        return await self.engine_core.is_scheduler_paused_async()

    async def start_profile(self, profile_prefix: str | None = None) -> None:
        calls = [self.engine_core.profile_async(True, profile_prefix)]
        if self.profiler is not None:
            calls.append(self.profiler.start())
        await asyncio.gather(*calls)

    async def stop_profile(self) -> None:
        calls = [self.engine_core.profile_async(False)]
        if self.profiler is not None:
            calls.append(self.profiler.stop())
        await asyncio.gather(*calls)

    def get_metrics(self) -> list[Metric]:
        if self.stat_logger is None:
            raise RuntimeError(METRICS_OFF)
        return self.stat_logger.get_metrics()

    def get_histograms(self) -> list[Histogram]:
        if self.stat_logger is None:
            raise RuntimeError(METRICS_OFF)
        return self.stat_logger.get_histograms()

    def render_prometheus(self) -> str:
        if self.stat_logger is None:
            raise RuntimeError(METRICS_OFF)
        return self.stat_logger.render_prometheus()
