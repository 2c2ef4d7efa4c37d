"""The executor: EngineCore's handle on the worker(s) that own the model.

vLLM twin: ``vllm/v1/executor/abstract.py`` (``Executor``).
Read it for the four things EngineCore asks of the model side:
  1. ``get_kv_cache_specs()`` -- what one KV block costs per attention layer;
  2. ``determine_available_memory()`` -- bytes left for KV after a profile run;
  3. ``initialize_from_config(kv_cache_config)`` -- allocate the KV tensors;
  4. ``execute_model(scheduler_output)`` then ``sample_tokens(grammar_output)``
     -- one step, in two phases (forward, then sampling), as vLLM V1 does.
     With ``non_block=True`` both return a ``Future``; an in-process executor
     runs the call first and returns it done (``done_future``), its result or
     its exception inside -- or, for an asynchronous output, a future whose
     ``result()`` waits for the device-to-host copy (``AsyncOutputFuture``).
  5. ``max_concurrent_batches`` -- 2 with async scheduling: EngineCore keeps
     two steps in flight (its batch queue).
``Executor.get_class`` picks the implementation from
``distributed_executor_backend``: ``"uni"`` (one in-process worker),
``"mp"`` (a worker process per rank, ``multiproc_executor.py``), ``"ray"``
(a Ray actor per rank, ``ray_executor.py``), or any ``Executor`` subclass
passed in directly, which is how tests and experiments plug in their own.
Sessions: 04 (worker), 07 (executor).
"""

from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from collections.abc import Callable
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

from engine.tracing import NULL_TRACER, Tracer

if TYPE_CHECKING:
    from engine.config import GlassboxConfig
    from engine.lora.request import LoRARequest
    from engine.v1.core.sched.output import GrammarOutput, SchedulerOutput
    from engine.v1.kv_cache_interface import KVCacheConfig, KVCacheSpec
    from engine.v1.outputs import DraftTokenIds, ModelRunnerOutput


class WorkerMethod(str, enum.Enum):
    """What an executor may ask its workers to do: the ``Worker`` method of
    the same name (vLLM passes the name as a string)."""

    GET_KV_CACHE_SPEC = "get_kv_cache_spec"
    DETERMINE_AVAILABLE_MEMORY = "determine_available_memory"
    INITIALIZE_FROM_CONFIG = "initialize_from_config"
    UPDATE_MAX_MODEL_LEN = "update_max_model_len"
    EXECUTE_MODEL = "execute_model"
    SAMPLE_TOKENS = "sample_tokens"
    TAKE_DRAFT_TOKEN_IDS = "take_draft_token_ids"
    APPLY_MODEL = "apply_model"
    PROFILE = "profile"
    ADD_LORA = "add_lora"
    CHECK_LORA = "check_lora"
    REMOVE_LORA = "remove_lora"
    PIN_LORA = "pin_lora"
    LIST_LORAS = "list_loras"


def worker_handlers(worker: Any) -> dict[WorkerMethod, Callable[..., Any]]:
    """Each ``WorkerMethod`` -> the worker's bound method (the one dispatch table)."""
    return {
        WorkerMethod.GET_KV_CACHE_SPEC: worker.get_kv_cache_spec,
        WorkerMethod.DETERMINE_AVAILABLE_MEMORY: worker.determine_available_memory,
        WorkerMethod.UPDATE_MAX_MODEL_LEN: worker.update_max_model_len,
        WorkerMethod.INITIALIZE_FROM_CONFIG: worker.initialize_from_config,
        WorkerMethod.EXECUTE_MODEL: worker.execute_model,
        WorkerMethod.SAMPLE_TOKENS: worker.sample_tokens,
        WorkerMethod.TAKE_DRAFT_TOKEN_IDS: worker.take_draft_token_ids,
        WorkerMethod.APPLY_MODEL: worker.apply_model,
        WorkerMethod.PROFILE: worker.profile,
        WorkerMethod.ADD_LORA: worker.add_lora,
        WorkerMethod.CHECK_LORA: worker.check_lora,
        WorkerMethod.REMOVE_LORA: worker.remove_lora,
        WorkerMethod.PIN_LORA: worker.pin_lora,
        WorkerMethod.LIST_LORAS: worker.list_loras,
    }


class Executor(ABC):
    def __init__(self, glassbox_config: GlassboxConfig, tracer: Tracer = NULL_TRACER) -> None:
        self.glassbox_config = glassbox_config
        # The EngineCore process's tracer; in-process workers share it.
        self.tracer = tracer
        self._init_executor()

    @staticmethod
    def get_class(glassbox_config: GlassboxConfig) -> type[Executor]:
        backend = glassbox_config.parallel_config.distributed_executor_backend
        if isinstance(backend, type):
            if not issubclass(backend, Executor):
                raise TypeError(
                    "distributed_executor_backend must be a subclass of Executor, "
                    f"got {backend.__name__}"
                )
            return backend
        if backend in (None, "uni"):
            from engine.v1.executor.uniproc_executor import UniProcExecutor

            return UniProcExecutor
        if backend == "mp":
            from engine.v1.executor.multiproc_executor import MultiprocExecutor

            return MultiprocExecutor
        if backend == "ray":
            from engine.v1.executor.ray_executor import RayDistributedExecutor

            return RayDistributedExecutor
        raise ValueError(
            f"unknown distributed_executor_backend {backend!r}; use 'uni', 'mp' or 'ray'"
        )

    @abstractmethod
    def _init_executor(self) -> None:
        """Start the worker(s) and load the model."""

    # The executor's calls, as vLLM's base class writes them: each one is a
    # collective_rpc to the workers; an in-process executor overrides them
    # with direct calls.
    output_rank = 0  # the rank whose answer a step's calls wait for

    def collective_rpc(
        self,
        method: WorkerMethod | Callable[..., Any],
        args: tuple[Any, ...] = (),
        non_block: bool = False,
        unique_reply_rank: int | None = None,
        timeout: float | None = None,
    ) -> Any:
        """Run ``method`` on every worker: a ``WorkerMethod`` names a ``Worker``
        method, a function is called as ``method(worker, *args)``. Returns every
        rank's result, or only ``unique_reply_rank``'s (a future if ``non_block``);
        ``TimeoutError`` when the answers take more than ``timeout`` seconds."""
        raise NotImplementedError(f"{type(self).__name__} has no collective_rpc")

    def get_kv_cache_specs(self) -> dict[str, KVCacheSpec]:
        """Attention layer name -> its KV cache spec (every rank has the same
        layers, each with its share of the heads: rank 0's)."""
        return self.collective_rpc(WorkerMethod.GET_KV_CACHE_SPEC, unique_reply_rank=0)

    def determine_available_memory(self) -> int:
        """Bytes the KV cache may use: the same block count on every rank, so
        the rank with the least memory decides."""
        return min(self.collective_rpc(WorkerMethod.DETERMINE_AVAILABLE_MEMORY))

    def update_max_model_len(self, max_model_len: int) -> None:
        """Tell every worker the auto-fitted ``max_model_len`` (``-1`` asked)."""
        self.collective_rpc(WorkerMethod.UPDATE_MAX_MODEL_LEN, (max_model_len,))

    def initialize_from_config(self, kv_cache_config: KVCacheConfig) -> None:
        """Allocate the KV cache tensors (and capture graphs, warm up)."""
        self.collective_rpc(WorkerMethod.INITIALIZE_FROM_CONFIG, (kv_cache_config,))

    def execute_model(
        self, scheduler_output: SchedulerOutput, non_block: bool = False
    ) -> ModelRunnerOutput | None | Future[ModelRunnerOutput | None]:
        """Run the forward pass. May return the sampled output directly, or
        None, in which case ``sample_tokens`` finishes the step."""
        return self.collective_rpc(
            WorkerMethod.EXECUTE_MODEL,
            (scheduler_output,),
            non_block=non_block,
            unique_reply_rank=self.output_rank,
        )

    def sample_tokens(
        self, grammar_output: GrammarOutput | None = None, non_block: bool = False
    ) -> ModelRunnerOutput | Future[ModelRunnerOutput]:
        """Sample the step ``execute_model`` ran, masking the constrained
        rows with ``grammar_output`` (structured outputs) first."""
        return self.collective_rpc(
            WorkerMethod.SAMPLE_TOKENS,
            (grammar_output,),
            non_block=non_block,
            unique_reply_rank=self.output_rank,
        )

    def take_draft_token_ids(self) -> DraftTokenIds | None:
        """Speculative decoding: the drafts the worker proposed after the last
        step (None when it proposed none)."""
        return self.collective_rpc(
            WorkerMethod.TAKE_DRAFT_TOKEN_IDS, unique_reply_rank=self.output_rank
        )

    def profile(self, is_start: bool = True, profile_prefix: str | None = None) -> None:
        """Open or close every worker's profiling window (each writes its own trace)."""
        self.collective_rpc(WorkerMethod.PROFILE, (is_start, profile_prefix))

    # LoRA adapters: every rank holds every adapter (its slice of each weight).
    def add_lora(self, lora_request: LoRARequest) -> bool:
        """Load an adapter into every worker's host memory (False: it was loaded)."""
        return all(self.collective_rpc(WorkerMethod.ADD_LORA, (lora_request,)))

    def check_lora(self, lora_request: LoRARequest) -> None:
        """Every worker reads the adapter and checks it fits, keeping nothing."""
        self.collective_rpc(WorkerMethod.CHECK_LORA, (lora_request,))

    def remove_lora(self, lora_id: int) -> bool:
        return all(self.collective_rpc(WorkerMethod.REMOVE_LORA, (lora_id,)))

    def pin_lora(self, lora_id: int) -> bool:
        return all(self.collective_rpc(WorkerMethod.PIN_LORA, (lora_id,)))

    def list_loras(self) -> set[int]:
        return self.collective_rpc(WorkerMethod.LIST_LORAS, unique_reply_rank=0)

    def register_failure_callback(self, callback: Callable[[], None]) -> None:  # noqa: B027
        """``callback`` runs (once, on another thread) if the executor fails
        outside a call, e.g. when a worker process dies. An in-process
        executor never does: its failures raise inside the call."""

    def shutdown(self) -> None:
        """Release workers and device memory. Safe to call twice."""

    @property
    def max_concurrent_batches(self) -> int:
        """How many steps EngineCore may have in flight: above 1 it runs
        ``step_with_batch_queue``."""
        return 1

    @classmethod
    def supports_async_scheduling(cls) -> bool:
        """Whether this executor can take step N+1 before step N's output is
        read (vLLM's default for a new executor: no)."""
        return False


def done_future(fn: Callable[..., Any], *args: Any) -> Future[Any]:
    """``fn(*args)``, run now, as a completed ``Future`` holding its result or
    its exception: what an in-process executor returns for ``non_block=True``.
    Glassbox's own helper; vLLM's ``UniProcExecutor.collective_rpc`` does the
    same inline."""
    future: Future[Any] = Future()
    try:
        future.set_result(fn(*args))
    except Exception as e:
        future.set_exception(e)
    return future
