"""UniProcExecutor: one worker, in the EngineCore process.

vLLM twin: ``vllm/v1/executor/uniproc_executor.py`` (``UniProcExecutor``).
Read it for the shortest path from EngineCore to the model: every executor
call is a direct method call on the single ``Worker`` (vLLM routes the same
calls through ``collective_rpc`` so multi-process executors look identical).
With async scheduling ``sample_tokens(non_block=True)`` returns at once with
an ``AsyncOutputFuture``: the sampled ids are still on their way to the host,
and EngineCore schedules and launches the next step before it asks for them.
Sessions: 07 (executor).
"""

from __future__ import annotations

import functools
from concurrent.futures import Future
from functools import cached_property

from engine.v1.executor.abstract import Executor, WorkerMethod, done_future, worker_handlers
from engine.v1.outputs import AsyncModelRunnerOutput, ModelRunnerOutput
from engine.v1.worker.gpu_worker import Worker


class AsyncOutputFuture(Future):
    """A future over an ``AsyncModelRunnerOutput``: ``result()`` waits for its
    device-to-host copy (vLLM's, in ``uniproc_executor.py``)."""

    def __init__(self, async_output: AsyncModelRunnerOutput) -> None:
        super().__init__()
        self.async_output = async_output

    def result(self, timeout: float | None = None) -> ModelRunnerOutput:
        if timeout is not None:
            raise RuntimeError("AsyncOutputFuture.result() takes no timeout")
        if not super().done():
            try:
                self.set_result(self.async_output.get_output())
            except Exception as e:
                self.set_exception(e)
        return super().result()


class UniProcExecutor(Executor):
    def _init_executor(self) -> None:
        self.driver_worker: Worker | None = Worker(
            self.glassbox_config, local_rank=0, rank=0, tracer=self.tracer
        )
        self.driver_worker.init_device()
        self.driver_worker.load_model()

    def _worker(self) -> Worker:
        if self.driver_worker is None:
            raise RuntimeError("the executor has been shut down")
        return self.driver_worker

    def collective_rpc(
        self, method, args=(), non_block=False, unique_reply_rank=None, timeout=None
    ):
        """The one worker runs ``method`` here, in this thread (so ``timeout``
        cannot interrupt it); its answer as a list of one, as for many ranks.
        The executor's profile and adapter calls come through here."""
        worker = self._worker()
        if isinstance(method, WorkerMethod):
            call = functools.partial(worker_handlers(worker)[method], *args)
        else:
            call = functools.partial(method, worker, *args)

        def answer():
            result = call()
            return result if unique_reply_rank is not None else [result]

        return done_future(answer) if non_block else answer()

    def get_kv_cache_specs(self):
        return self._worker().get_kv_cache_spec()

    def determine_available_memory(self) -> int:
        return self._worker().determine_available_memory()

    def update_max_model_len(self, max_model_len: int) -> None:
        self._worker().update_max_model_len(max_model_len)

    def initialize_from_config(self, kv_cache_config) -> None:
        self._worker().initialize_from_config(kv_cache_config)

    def execute_model(self, scheduler_output, non_block=False):
        if non_block:
            return done_future(self._worker().execute_model, scheduler_output)
        return self._worker().execute_model(scheduler_output)

    def sample_tokens(self, grammar_output=None, non_block=False):
        if not non_block:
            output = self._worker().sample_tokens(grammar_output)
            return output.get_output() if isinstance(output, AsyncModelRunnerOutput) else output
        future = done_future(self._worker().sample_tokens, grammar_output)
        if future.exception() is None and isinstance(future.result(), AsyncModelRunnerOutput):
            return AsyncOutputFuture(future.result())
        return future

    def take_draft_token_ids(self):
        return self._worker().take_draft_token_ids()

    @cached_property
    def max_concurrent_batches(self) -> int:
        return 2 if self.glassbox_config.scheduler_config.async_scheduling else 1

    @classmethod
    def supports_async_scheduling(cls) -> bool:
        return True

    def shutdown(self) -> None:
        if self.driver_worker is not None:
            self.driver_worker.shutdown()
            self.driver_worker = None
