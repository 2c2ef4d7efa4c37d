"""EngineCore: the loop that owns the scheduler and the executor.

vLLM twin: ``vllm/v1/engine/core.py`` (``EngineCore``, ``EngineCoreProc``).
Read it for:
  * ``__init__`` -- build the executor, size and allocate the KV cache
    (``_initialize_kv_caches``), then build the scheduler with the final
    block count and the request block hasher;
  * ``step()`` -- the heart of V1: ``schedule()`` -> ``execute_model()`` ->
    (``sample_tokens()``) -> ``update_from_output()``, as vLLM's, with its
    error-detail context around the model's part. Nothing else happens in a
    step.
  * ``step_with_batch_queue()`` -- the same four calls, overlapped (vLLM's
    default, with async scheduling): the executor may hold two steps
    (``max_concurrent_batches``), so step N+1 is scheduled and launched
    before step N's tokens are read. ``step_fn`` is whichever of the two the
    executor allows, chosen once at start-up.
  * ``post_step()`` -- after each step (the busy loop and the in-process
    client call it): with speculative decoding on the serial loop, the
    drafts the worker proposed go to the scheduler for the next step
    (under async scheduling they stay in the worker, on the device).
  * ``EngineCoreProc`` -- the same core in its own process. Three threads:
    the input thread reads ZMQ frames, decodes them and puts
    ``(request_type, request)`` on ``input_queue``; the busy loop
    (``run_busy_loop``: ``_process_input_queue`` then
    ``_process_engine_step``) is the only thread that touches the scheduler;
    the output thread encodes ``EngineCoreOutputs`` from ``output_queue`` and
    pushes them out. Socket IO and msgpack work release the GIL or overlap
    with the model, so the API server never waits on a step and a step never
    waits on the network.
Sessions: 01 (engine loop).

Shutdown (SIGTERM/SIGINT, or the front end's death): new requests are
refused, the ones in flight run for ``shutdown_timeout`` seconds
(``_handle_shutdown``; 0 aborts them at once, as in vLLM), the rest are
aborted, and the loop ends once the scheduler is empty.

Structured outputs (session 06): the core owns the
``StructuredOutputManager``; ``add_request`` starts the grammar's compile,
and each step asks the scheduler for the bitmask (``get_grammar_bitmask``)
while the forward runs, then passes it to ``sample_tokens``. In the batch
queue a step whose constrained request still has a token in flight
(``pending_structured_output_tokens``) is *deferred*: its sampling waits
until the previous step's output has advanced the grammar.

Simpler than vLLM: no ``update_draft_token_ids_in_output`` (structured
outputs with drafts kept in the worker under async scheduling are refused by
the input processor), no data parallelism, no separate aborts queue
(aborts are read between steps), no pipeline parallelism. ``log_error_detail``
logs a summary of the step instead of vLLM's full dump of the config and the
scheduler output.

Differs from vLLM on purpose: when the drain time is up, the core aborts what
is left (finish_reason "abort") and exits by itself; vLLM's front end kills
the process at that point. A second SIGTERM/SIGINT ends the drain at once.

Tracing (Glassbox's own): ``EngineCoreTrace`` (``engine/tracing/
engine_trace.py``) writes the process's trace while the device runs each
forward and records the process hop (requests received, outputs sent).
"""

from __future__ import annotations

import contextlib
import enum
import functools
import inspect
import logging
import os
import queue
import signal
import threading
import time
import typing
from collections import defaultdict, deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from typing import Any

import msgspec
import zmq

from engine.config import GlassboxConfig
from engine.lora.request import LoRARequest
from engine.tracing import Tracer, part_path
from engine.tracing.core_trace import SchedulerTrace, StructuredOutputTrace
from engine.tracing.engine_trace import EngineCoreTrace
from engine.utils.hashing import get_hash_fn_by_name
from engine.utils.network_utils import remove_ipc_socket_file
from engine.v1.core.kv_cache_utils import (
    BlockHash,
    generate_scheduler_kv_cache_config,
    get_kv_cache_configs,
    get_request_block_hasher,
    init_none_hash,
    resolve_kv_cache_block_sizes,
)
from engine.v1.core.sched.interface import PauseState
from engine.v1.core.sched.output import SchedulerOutput
from engine.v1.core.sched.scheduler import Scheduler
from engine.v1.engine import (
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreReadyResponse,
    EngineCoreRequest,
    EngineCoreRequestType,
    FinishReason,
    UtilityOutput,
)
from engine.v1.engine.utils import (
    EngineHandshakeMetadata,
    EngineZmqAddresses,
    SignalCallback,
    make_zmq_socket,
)
from engine.v1.executor.abstract import Executor, WorkerMethod
from engine.v1.kv_cache_interface import KVCacheConfig
from engine.v1.outputs import ModelRunnerOutput
from engine.v1.request import Request, RequestStatus
from engine.v1.serial_utils import MsgpackDecoder, MsgpackEncoder, pickle_call, unpickle_call
from engine.v1.structured_output import StructuredOutputManager

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
        self.trace = EngineCoreTrace.create(tracer)
        self.model_executor = executor_class(glassbox_config, tracer=tracer)
        try:
            kv_cache_config = self._initialize_kv_caches(glassbox_config)
            self.kv_cache_config = kv_cache_config
            self.structured_output_manager = StructuredOutputManager(
                glassbox_config, trace=StructuredOutputTrace.create(tracer)
            )
            # One engine per front end, so no per-client finished sets.
            scheduler_cls = glassbox_config.scheduler_config.get_scheduler_cls()
            self.scheduler: Scheduler = scheduler_cls(  # type: ignore[assignment]
                glassbox_config=glassbox_config,
                kv_cache_config=kv_cache_config,
                structured_output_manager=self.structured_output_manager,
                include_finished_set=False,
                log_stats=log_stats,
                block_size=glassbox_config.cache_config.block_size,
                trace=SchedulerTrace.create(tracer),
            )
        except BaseException:
            # Don't leave a loaded model (or worker processes) behind.
            self.model_executor.shutdown()
            raise
        # The batch queue: with async scheduling the executor takes a second
        # step before the first one's output is read. Each entry is (future of
        # the sampled output, its SchedulerOutput); newest on the left.
        self.batch_queue_size = self.model_executor.max_concurrent_batches
        self.batch_queue: deque[tuple[Future[ModelRunnerOutput], SchedulerOutput]] | None = None
        if self.batch_queue_size > 1:
            self.batch_queue = deque(maxlen=self.batch_queue_size)
        self.step_fn = self.step if self.batch_queue is None else self.step_with_batch_queue
        self.async_scheduling = glassbox_config.scheduler_config.async_scheduling
        self.use_spec_decode = glassbox_config.speculative_config is not None

        cache_config = glassbox_config.cache_config
        self.request_block_hasher: Callable[[Request], list[BlockHash]] | None = None
        if cache_config.enable_prefix_caching:
            caching_hash_fn = get_hash_fn_by_name(cache_config.prefix_caching_hash_algo)
            init_none_hash(caching_hash_fn)
            _, hash_block_size = resolve_kv_cache_block_sizes(kv_cache_config, glassbox_config)
            self.request_block_hasher = get_request_block_hasher(hash_block_size, caching_hash_fn)

    def _initialize_kv_caches(self, config: GlassboxConfig) -> KVCacheConfig:
        """Profile, size and allocate the KV cache (vLLM's order of calls)."""
        start = time.perf_counter()
        kv_cache_specs = self.model_executor.get_kv_cache_specs()
        override = config.cache_config.num_gpu_blocks_override
        available_memory = (
            0 if override is not None else self.model_executor.determine_available_memory()
        )
        max_model_len_before = config.model_config.max_model_len
        # One worker: vLLM's per-worker lists have one entry each.
        kv_cache_configs = get_kv_cache_configs(config, [kv_cache_specs], [available_memory])
        if config.model_config.max_model_len != max_model_len_before:
            # max_model_len=-1 was fitted to the pool: workers in other processes
            # hold their own copy of the config.
            self.model_executor.update_max_model_len(config.model_config.max_model_len)
        kv_cache_config = generate_scheduler_kv_cache_config(kv_cache_configs)
        config.cache_config.num_gpu_blocks = kv_cache_config.num_blocks
        self.model_executor.initialize_from_config(kv_cache_configs[0])
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
        if request.use_structured_output:
            # Compiles on the manager's threads; the scheduler waits for it.
            self.structured_output_manager.grammar_init(request)
        self.scheduler.add_request(request)

    def abort_requests(self, request_ids: list[str]) -> None:
        self.scheduler.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED)

    # -- the loop ------------------------------------------------------------
    @contextlib.contextmanager
    def log_error_detail(self, scheduler_output: SchedulerOutput) -> Iterator[None]:
        """Log what the step was doing if the model's part of it fails."""
        try:
            yield
        except Exception:
            logger.exception(
                "model execution failed at step %d: %d requests, %d tokens scheduled (%s)",
                scheduler_output.step,
                len(scheduler_output.num_scheduled_tokens),
                scheduler_output.total_num_scheduled_tokens,
                scheduler_output.num_scheduled_tokens,
            )
            raise

    def step(self) -> tuple[dict[int, EngineCoreOutputs], bool]:
        """Schedule, execute, sample, update. Returns the outputs per client and
        whether the model ran."""
        # Requests in the scheduler: unfinished, or finished and not yet dropped by the worker.
        if not self.scheduler.has_requests():
            return {}, False
        scheduler_output = self.scheduler.schedule()
        future = self.model_executor.execute_model(scheduler_output, non_block=True)
        self.trace.step_launched(scheduler_output.step, num_in_flight=1)
        # While the forward runs: the bitmask rows of the constrained requests.
        grammar_output = self.scheduler.get_grammar_bitmask(scheduler_output)
        self.trace.waiting_for_output()
        with self.log_error_detail(scheduler_output):
            model_output = future.result()
            if model_output is None:
                model_output = self.model_executor.sample_tokens(grammar_output)
        self.trace.output_ready(scheduler_output.step)
        engine_core_outputs = self.scheduler.update_from_output(scheduler_output, model_output)
        self.trace.step_done(self.scheduler, engine_core_outputs)
        return engine_core_outputs, scheduler_output.total_num_scheduled_tokens > 0

    def post_step(self, model_executed: bool) -> None:
        """Speculative decoding on the serial loop: hand the scheduler the
        drafts the worker proposed after this step, for the next one to
        verify. (With async scheduling the drafts never leave the worker.)"""
        if not self.async_scheduling and self.use_spec_decode and model_executed:
            draft_token_ids = self.model_executor.take_draft_token_ids()
            if draft_token_ids is not None:
                self.scheduler.update_draft_token_ids(draft_token_ids)

    def step_with_batch_queue(self) -> tuple[dict[int, EngineCoreOutputs] | None, bool]:
        """One turn of the loop with a batch queue (async scheduling).

        1. If the scheduler has work, schedule a step and launch it --
           forward and sampling -- without waiting for it. If the queue is
           not yet full and the oldest step is still running, return at once
           (None): keeping the device fed comes before reading outputs.
        2. Otherwise wait for the oldest step in the queue and update the
           scheduler from its output.
        In steady decoding this alternates: launch N+1, read N, launch N+2,
        read N+1 -- the host's scheduling and output work for one step runs
        while the device computes the other.
        """
        batch_queue = self.batch_queue
        assert batch_queue is not None and len(batch_queue) < self.batch_queue_size
        model_executed = False
        deferred_scheduler_output: SchedulerOutput | None = None
        if self.scheduler.has_requests():
            scheduler_output = self.scheduler.schedule()
            with self.log_error_detail(scheduler_output):
                exec_future = self.model_executor.execute_model(scheduler_output, non_block=True)
                if exec_future.done():
                    exec_future.result()  # a forward that failed raises here, not in sampling
            model_executed = scheduler_output.total_num_scheduled_tokens > 0
            if not model_executed:
                future = exec_future  # nothing to sample: its (empty) output
            elif scheduler_output.pending_structured_output_tokens:
                # A grammar still lacks the token in flight: sample below,
                # once the previous step's output has advanced it.
                deferred_scheduler_output = scheduler_output
            else:
                grammar_output = self.scheduler.get_grammar_bitmask(scheduler_output)
                future = self.model_executor.sample_tokens(grammar_output, non_block=True)
            if deferred_scheduler_output is None:
                batch_queue.appendleft((future, scheduler_output))
                self.trace.step_launched(scheduler_output.step, len(batch_queue))
                if (
                    model_executed
                    and len(batch_queue) < self.batch_queue_size
                    and not batch_queue[-1][0].done()
                ):
                    return None, True
        elif not batch_queue:
            return None, False

        # Wait for the oldest step in flight.
        future, scheduler_output = batch_queue.pop()
        self.trace.waiting_for_output()
        with self.log_error_detail(scheduler_output):
            model_output = future.result()
        self.trace.output_ready(scheduler_output.step)
        engine_core_outputs = self.scheduler.update_from_output(scheduler_output, model_output)
        if deferred_scheduler_output is not None:
            # The grammars have their tokens now: mask and sample the deferred step.
            grammar_output = self.scheduler.get_grammar_bitmask(deferred_scheduler_output)
            future = self.model_executor.sample_tokens(grammar_output, non_block=True)
            batch_queue.appendleft((future, deferred_scheduler_output))
            self.trace.step_launched(deferred_scheduler_output.step, len(batch_queue))
        self.trace.step_done(self.scheduler, engine_core_outputs, batch_queue)
        return engine_core_outputs, model_executed

    def reset_prefix_cache(
        self, reset_running_requests: bool = False, reset_connector: bool = False
    ) -> bool:
        return self.scheduler.reset_prefix_cache(reset_running_requests, reset_connector)

    # -- pausing (pause_generation / resume_generation) ------------------------------
    def pause_scheduler(self, mode: str = "abort", clear_cache: bool = True) -> Future | None:
        """Stop taking on work until ``resume_scheduler``. ``abort``: end every
        request now; ``keep``: freeze them where they are; ``wait`` (another
        process only): let the running ones finish, queue new ones. With
        ``clear_cache`` the prefix cache is emptied once nothing runs. Returns
        None when done, or a Future the busy loop completes once idle."""
        state = pause_state_for(mode)
        if mode == "wait":
            raise ValueError("pause mode 'wait' needs EngineCore in its own process")
        if mode == "abort":
            self.scheduler.finish_requests(None, RequestStatus.FINISHED_ABORTED)
        self.scheduler.set_pause_state(state)
        if clear_cache:
            self._reset_caches()
        return None

    def resume_scheduler(self) -> None:
        """Schedule again; requests queued while paused are admitted."""
        self.scheduler.set_pause_state(PauseState.UNPAUSED)

    def is_scheduler_paused(self) -> bool:
        return self.scheduler.pause_state != PauseState.UNPAUSED

    def _reset_caches(self) -> None:
        # Frozen requests (keep) give their blocks back: they recompute on resume.
        self.reset_prefix_cache(reset_running_requests=True, reset_connector=True)

    def collective_rpc(
        self,
        method: str | Callable[..., Any],
        timeout: float | None = None,
        args: tuple = (),
        kwargs: dict[str, Any] | None = None,
    ) -> list[Any]:
        """Every worker's answer to ``method``: a function, called as
        ``method(worker, *args, **kwargs)``, or the name of a ``WorkerMethod``."""
        call = worker_call(method, kwargs)
        return self.model_executor.collective_rpc(call, tuple(args), timeout=timeout)

    def collective_rpc_serialized(self, payload: bytes) -> bytes:
        """Glassbox's own: ``collective_rpc`` sent by a front end in another
        process, call and answers pickled (only when the user allowed it)."""
        method, timeout, args, kwargs = unpickle_call(payload, "collective_rpc")
        return pickle_call(self.collective_rpc(method, timeout, args, kwargs), "collective_rpc")

    # LoRA adapters, as utility calls too (vLLM's names).
    def add_lora(self, lora_request: LoRARequest) -> bool:
        return self.model_executor.add_lora(lora_request)

    def check_lora(self, lora_request: LoRARequest) -> None:
        """Glassbox's own: read an adapter and check it fits, keeping nothing.
        The front end asks the first time a request names an adapter, so a
        broken one fails that request, not the step that would load it."""
        self.model_executor.check_lora(lora_request)

    def remove_lora(self, lora_id: int) -> bool:
        return self.model_executor.remove_lora(lora_id)

    def list_loras(self) -> set[int]:
        return self.model_executor.list_loras()

    def pin_lora(self, lora_id: int) -> bool:
        return self.model_executor.pin_lora(lora_id)

    def profile(self, is_start: bool = True, profile_prefix: str | None = None) -> None:
        """Open or close the workers' profiling window (a utility call)."""
        self.model_executor.profile(is_start, profile_prefix)
        self.trace.profiled(is_start, profile_prefix)

    def get_num_unfinished_requests(self) -> int:
        """Glassbox's own utility call (tests and the front end ask it)."""
        return self.scheduler.get_num_unfinished_requests()

    def shutdown(self) -> None:
        self.structured_output_manager.clear_backend()
        self.model_executor.shutdown()
        self.scheduler.shutdown()


# How often an idle busy loop wakes to let pending signal handlers run.
IDLE_WAKE_S = 0.1
# How long EngineCore waits for the front end to answer its HELLO.
HANDSHAKE_TIMEOUT_MINS = 5
# After the parent dies, how long a clean exit may take before a hard one.
PARENT_DEATH_EXIT_GRACE_S = 10.0


def pause_state_for(mode: str) -> PauseState:
    """The scheduler's state for a pause mode: ``keep`` freezes everything;
    ``abort`` and ``wait`` still let the running requests step (none are
    left after an abort)."""
    if mode not in ("abort", "wait", "keep"):
        raise ValueError(f"pause mode must be 'abort', 'wait' or 'keep', got {mode!r}")
    return PauseState.PAUSED_ALL if mode == "keep" else PauseState.PAUSED_NEW


def _utility_failure(method_name: str, error: Exception) -> str:
    """What the client raises (``EngineCoreUtilityError``) for a failed utility call."""
    return f"call to {method_name} failed: {error}"


def worker_call(
    method: str | Callable[..., Any], kwargs: dict[str, Any] | None
) -> WorkerMethod | Callable[..., Any]:
    """What ``collective_rpc`` hands the executor: a name becomes its
    ``WorkerMethod`` (the one table of worker calls), keyword arguments are
    bound into the function."""
    if isinstance(method, str):
        try:
            worker_method = WorkerMethod(method)
        except ValueError:
            names = ", ".join(m.value for m in WorkerMethod)
            raise ValueError(
                f"collective_rpc: the workers have no method {method!r} to call by name "
                f"({names}); pass a function(worker, ...) instead"
            ) from None
        if kwargs:
            raise ValueError("collective_rpc: keyword arguments go with a function, not a name")
        return worker_method
    if not callable(method):
        raise TypeError(f"collective_rpc: method must be a name or a function, got {method!r}")
    return functools.partial(method, **kwargs) if kwargs else method


def _convert_msgspec_args(method: Callable[..., Any], args: tuple) -> tuple:
    """A utility call's arguments arrive as plain msgpack values: turn each one
    whose parameter is a msgspec struct (``add_lora``'s ``LoRARequest``) back
    into that struct."""
    try:
        hints = typing.get_type_hints(method)
    except NameError:  # an annotation only a type checker can resolve: no structs
        return args
    converted = []
    for name, value in zip(inspect.signature(method).parameters, args):
        hint = hints.get(name)
        if isinstance(hint, type) and issubclass(hint, msgspec.Struct):
            value = value if isinstance(value, hint) else msgspec.convert(value, hint)
        converted.append(value)
    return (*converted, *args[len(converted) :])


class EngineShutdownState(enum.IntEnum):
    RUNNING = 0
    REQUESTED = 1  # by SIGTERM/SIGINT or the parent's death
    SHUTTING_DOWN = 2  # draining (no new requests), then aborting what is left


class EngineCoreProc(EngineCore):
    """EngineCore behind ZMQ sockets, in a process of its own."""

    # Sent alone as one frame when the core dies, so the front end fails fast.
    ENGINE_CORE_DEAD = b"ENGINE_CORE_DEAD"
    # Tells the output thread to flush and stop (never leaves the process).
    _OUTPUT_THREAD_STOP = b"STOP"

    def __init__(
        self,
        glassbox_config: GlassboxConfig,
        executor_class: type[Executor],
        log_stats: bool,
        handshake_address: str,
        engine_index: int = 0,
    ) -> None:
        # (request_type, request) from the input thread to the busy loop.
        self.input_queue: queue.Queue[tuple[EngineCoreRequestType, Any]] = queue.Queue()
        # (client_index, outputs) from the busy loop to the output thread.
        self.output_queue: queue.Queue[tuple[int, EngineCoreOutputs] | bytes] = queue.Queue()
        self.engine_index = engine_index
        identity = engine_index.to_bytes(length=2, byteorder="little")
        self.shutdown_state = EngineShutdownState.RUNNING
        # Set when a shutdown is requested: monotonic time the drain ends.
        self._drain_deadline = 0.0
        self._skip_drain = False  # the front end is gone, or a second signal came
        self.output_thread: threading.Thread | None = None
        # Run once the engine has no work (a pause in "wait" mode completes there).
        self._idle_state_callbacks: list[Callable[[], None]] = []

        # This process's own trace part; the front end merges the parts.
        obs = glassbox_config.observability_config
        tracer = (
            Tracer(part_path(obs.trace_path, "core"), obs.trace_level)
            if obs.trace_level != "off" and obs.trace_path
            else Tracer()
        )
        try:
            with self._perform_handshake(handshake_address, identity) as addresses:
                # The front end's socket files: if it is killed, we remove them.
                self.front_end_addresses = [*addresses.inputs, *addresses.outputs]
                super().__init__(glassbox_config, executor_class, log_stats, tracer)
                # A worker process that dies wakes the busy loop, which then fails.
                self.model_executor.register_failure_callback(self._executor_failed)
                ready_event = threading.Event()
                input_thread = threading.Thread(
                    target=self.process_input_sockets,
                    args=(addresses.inputs[0], identity, ready_event),
                    daemon=True,
                    name="EngineCoreInputThread",
                )
                input_thread.start()
                self.output_thread = threading.Thread(
                    target=self.process_output_sockets,
                    args=(addresses.outputs[0], engine_index),
                    daemon=True,
                    name="EngineCoreOutputThread",
                )
                self.output_thread.start()
                # READY (sent when the block exits) must follow the input
                # socket's first message, which the front end waits for next.
                while not ready_event.wait(timeout=10):
                    if not input_thread.is_alive():
                        raise RuntimeError("the EngineCore input thread died during start-up")
        except BaseException:
            tracer.close()
            raise

    # -- start-up ------------------------------------------------------------------
    @contextlib.contextmanager
    def _perform_handshake(
        self, handshake_address: str, identity: bytes
    ) -> Iterator[EngineZmqAddresses]:
        """HELLO -> addresses; the caller builds the engine; then READY."""
        ctx = zmq.Context()
        try:
            with make_zmq_socket(
                ctx, handshake_address, zmq.DEALER, identity=identity, linger=5000, bind=False
            ) as handshake_socket:
                handshake_socket.send(msgspec.msgpack.encode({"status": "HELLO"}))
                if not handshake_socket.poll(timeout=HANDSHAKE_TIMEOUT_MINS * 60_000):
                    raise RuntimeError(
                        f"no answer from the front end within {HANDSHAKE_TIMEOUT_MINS} minutes"
                    )
                init = msgspec.msgpack.decode(handshake_socket.recv(), type=EngineHandshakeMetadata)
                try:
                    yield init.addresses
                except BaseException as e:
                    # Tell the front end why, so it can raise the same kind of
                    # error (a bad model path stays a ValueError over there).
                    handshake_socket.send(
                        msgspec.msgpack.encode(
                            {"status": "FAILED", "error_type": type(e).__name__, "message": str(e)}
                        )
                    )
                    raise
                handshake_socket.send(msgspec.msgpack.encode({"status": "READY"}))
        finally:
            ctx.destroy(linger=5000)

    @staticmethod
    def run_engine_core(
        *args: Any, death_pipe: Any = None, inherited_fds: list[int] | None = None, **kwargs: Any
    ) -> None:
        """Entry point of the EngineCore process: build, loop, clean up.
        ``inherited_fds``: descriptors a forked child must close at once (the
        parent's end of the death pipe)."""
        for fd in inherited_fds or ():
            with contextlib.suppress(OSError):
                os.close(fd)
        # force: a forked child inherits the parent's handlers; its own go to stderr.
        logging.basicConfig(
            level=os.environ.get("GLASSBOX_LOGGING_LEVEL", "INFO"),
            format="(EngineCore pid=%(process)d) %(levelname)s %(name)s: %(message)s",
            force=True,
        )
        engine_core: EngineCoreProc | None = None
        signal_callback: SignalCallback | None = None

        def request_shutdown() -> None:
            assert engine_core is not None
            engine_core.shutdown_state = max(
                engine_core.shutdown_state, EngineShutdownState.REQUESTED
            )
            engine_core.input_queue.put_nowait((EngineCoreRequestType.WAKEUP, None))

        def signal_handler(signum, frame) -> None:
            if engine_core is None:
                # Still starting up: there is nothing to drain, just leave.
                raise SystemExit(0)
            # Only flip state and poke the helper thread: see SignalCallback.
            if engine_core.shutdown_state != EngineShutdownState.RUNNING:
                engine_core._skip_drain = True  # a second signal ends the drain
            engine_core.shutdown_state = max(
                engine_core.shutdown_state, EngineShutdownState.REQUESTED
            )
            if signal_callback is not None:
                signal_callback.trigger()

        signal.signal(signal.SIGTERM, signal_handler)
        signal.signal(signal.SIGINT, signal_handler)
        try:
            engine_core = EngineCoreProc(*args, **kwargs)
            signal_callback = SignalCallback(request_shutdown)
            if engine_core.shutdown_state != EngineShutdownState.RUNNING:
                signal_callback.trigger()  # a signal arrived in between
            if death_pipe is not None:
                engine_core.watch_parent(death_pipe, request_shutdown)
            engine_core.run_busy_loop()
        except SystemExit:
            logger.debug("EngineCore exiting.")
            raise
        except Exception:
            if engine_core is None:
                logger.exception("EngineCore failed to start.")
            else:
                logger.exception("EngineCore hit a fatal error.")
                engine_core._send_engine_dead()
            raise
        finally:
            if signal_callback is not None:
                signal_callback.stop()
            # Our handlers stay until the shutdown is over: the front end's
            # SIGTERM must not cut short the executor's stopping its workers.
            if engine_core is not None:
                engine_core.shutdown()
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            signal.signal(signal.SIGINT, signal.SIG_DFL)

    def watch_parent(self, death_pipe: Any, request_shutdown) -> None:
        """Exit when the front end dies, even if it was SIGKILLed: no orphans.
        Glassbox's own: vLLM's workers watch a death pipe like this one
        (``WorkerProc.monitor_death_pipe`` in ``multiproc_executor.py``)."""

        def wait_for_parent_death() -> None:
            try:
                death_pipe.recv()
            except (EOFError, OSError):
                pass
            logger.warning("The front-end process is gone; EngineCore is shutting down.")
            for address in self.front_end_addresses:
                remove_ipc_socket_file(address)  # the front end had no chance to
            self._skip_drain = True
            request_shutdown()
            # A clean exit aborts requests and finishes the step in flight;
            # if that takes too long, leave anyway.
            time.sleep(PARENT_DEATH_EXIT_GRACE_S)
            os._exit(1)

        threading.Thread(
            target=wait_for_parent_death, daemon=True, name="ParentDeathWatcher"
        ).start()

    # -- pausing -----------------------------------------------------------------------
    def pause_scheduler(self, mode: str = "abort", clear_cache: bool = True) -> Future | None:
        """As ``EngineCore.pause_scheduler``; the aborts are reported to the
        clients, and the pause completes (the Future) only once nothing runs."""
        state = pause_state_for(mode)
        if mode == "abort":
            aborted = self.scheduler.finish_requests(None, RequestStatus.FINISHED_ABORTED)
            self._send_abort_outputs(aborted)
        self.scheduler.set_pause_state(state)
        if not self.has_work():
            if clear_cache:
                self._reset_caches()
            return None
        future: Future[None] = Future()

        def when_idle() -> None:
            if clear_cache:
                self._reset_caches()
            future.set_result(None)

        self._idle_state_callbacks.append(when_idle)
        return future

    def _notify_idle_state_callbacks(self) -> None:
        while self._idle_state_callbacks:
            self._idle_state_callbacks.pop(0)()

    # -- the busy loop ---------------------------------------------------------------
    def has_work(self) -> bool:
        return self.scheduler.has_requests() or bool(self.batch_queue)

    def is_running(self) -> bool:
        return self.shutdown_state == EngineShutdownState.RUNNING

    def run_busy_loop(self) -> None:
        while self._handle_shutdown():
            # 1) Wait for work (blocking only while there is nothing to step).
            self._process_input_queue()
            # 2) One engine step; its outputs go to the output thread.
            self._process_engine_step()
        raise SystemExit

    def _process_input_queue(self) -> None:
        if not self.has_work():
            self._notify_idle_state_callbacks()
        while not self.has_work() and self.is_running():
            try:
                # Wake now and then: a SIGTERM the kernel delivered to another
                # thread runs its Python handler only when this thread runs
                # bytecode, and a get() without timeout never would.
                request_type, request = self.input_queue.get(timeout=IDLE_WAKE_S)
            except queue.Empty:
                continue
            self._handle_client_request(request_type, request)
        # Take everything else that arrived during the last step, without waiting.
        while not self.input_queue.empty():
            request_type, request = self.input_queue.get_nowait()
            self._handle_client_request(request_type, request)

    def _process_engine_step(self) -> bool:
        outputs, model_executed = self.step_fn()
        for client_index, engine_core_outputs in (outputs or {}).items():
            self._put_output(client_index, engine_core_outputs)
        self.post_step(model_executed)
        return model_executed

    def _handle_shutdown(self) -> bool:
        """True while the loop should keep going. A requested shutdown lets the
        requests in flight run for ``shutdown_timeout`` seconds, then aborts
        the rest; the loop ends once the scheduler is empty."""
        if self.shutdown_state == EngineShutdownState.RUNNING:
            return True
        if self.shutdown_state == EngineShutdownState.REQUESTED:
            timeout = 0 if self._skip_drain else self.glassbox_config.shutdown_timeout
            self._drain_deadline = time.monotonic() + timeout
            num_requests = self.scheduler.get_num_unfinished_requests()
            if num_requests and timeout:
                logger.info(
                    "Shutdown requested: %d request(s) in flight; draining for up to %d s "
                    "(shutdown_timeout).",
                    num_requests,
                    timeout,
                )
            self.shutdown_state = EngineShutdownState.SHUTTING_DOWN
        drain_over = self._skip_drain or time.monotonic() >= self._drain_deadline
        if drain_over and self.scheduler.pause_state != PauseState.UNPAUSED:
            # A paused scheduler hides what it holds: unpause, so all of it is aborted.
            self.scheduler.set_pause_state(PauseState.UNPAUSED)
        if drain_over and self.scheduler.has_unfinished_requests():
            aborted = self.scheduler.finish_requests(None, RequestStatus.FINISHED_ABORTED)
            logger.info("Shutdown: aborting %d unfinished request(s).", len(aborted))
            self._send_abort_outputs(aborted)
        # Aborted requests still need one step to reach the worker; then exit.
        return self.has_work()

    def _executor_failed(self) -> None:
        self.input_queue.put_nowait((EngineCoreRequestType.EXECUTOR_FAILED, b""))

    def _handle_client_request(self, request_type: EngineCoreRequestType, request: Any) -> None:
        if request_type == EngineCoreRequestType.WAKEUP:
            return
        if request_type == EngineCoreRequestType.EXECUTOR_FAILED:
            raise RuntimeError("the executor failed: a worker process died")
        if request_type == EngineCoreRequestType.ADD:
            if not self.is_running():
                logger.info("Rejecting request %s: shutting down.", request.request_id)
                self._send_finish_outputs(
                    [request.request_id], request.client_index, FinishReason.ABORT
                )
                return
            try:
                self.add_request(request)
            except ValueError:
                # e.g. a duplicate id: fail this request, keep serving.
                logger.exception("Could not add request %s", request.request_id)
                self._send_finish_outputs(
                    [request.request_id], request.client_index, FinishReason.ERROR
                )
        elif request_type == EngineCoreRequestType.ABORT:
            self.abort_requests(request)
        elif request_type == EngineCoreRequestType.UTILITY:
            client_index, call_id, method_name, args = request
            output = UtilityOutput(call_id)
            try:
                if method_name.startswith("_") or not callable(getattr(self, method_name, None)):
                    raise AttributeError(f"EngineCore has no utility method {method_name!r}")
                method = getattr(self, method_name)
                result = method(*_convert_msgspec_args(method, args))
                if isinstance(result, Future):  # answered when it completes (a pause)
                    result.add_done_callback(
                        functools.partial(
                            self._send_utility_result, client_index, method_name, output
                        )
                    )
                    return
                output.result = result
            except Exception as e:
                logger.exception("Utility call %s failed", method_name)
                output.failure_message = _utility_failure(method_name, e)
            self._put_output(client_index, EngineCoreOutputs(utility_output=output))
        else:
            logger.error("Unknown request type %r from the front end", request_type)

    # -- outputs -------------------------------------------------------------------
    def _put_output(self, client_index: int, outputs: EngineCoreOutputs) -> None:
        """Hand a batch to the output thread (Glassbox's own helper; vLLM puts
        on ``output_queue`` inline)."""
        self.trace.output_sent(outputs)
        self.output_queue.put_nowait((client_index, outputs))

    def _send_finish_outputs(
        self, request_ids: list[str], client_index: int, reason: FinishReason
    ) -> None:
        """Finish ``request_ids`` with ``reason`` and no tokens (Glassbox's own helper)."""
        outputs = [
            EngineCoreOutput(request_id=rid, new_token_ids=[], finish_reason=reason)
            for rid in request_ids
        ]
        self._put_output(
            client_index, EngineCoreOutputs(outputs=outputs, finished_requests=set(request_ids))
        )

    def _send_utility_result(
        self, client_index: int, method_name: str, output: UtilityOutput, future: Future
    ) -> None:
        try:
            output.result = future.result()
        except Exception as e:
            output.failure_message = _utility_failure(method_name, e)
        self._put_output(client_index, EngineCoreOutputs(utility_output=output))

    def _send_abort_outputs(self, aborted: list[tuple[str, int]]) -> None:
        by_client: dict[int, list[str]] = defaultdict(list)
        for request_id, client_index in aborted:
            by_client[client_index].append(request_id)
        for client_index, request_ids in by_client.items():
            self._send_finish_outputs(request_ids, client_index, FinishReason.ABORT)

    def _send_engine_dead(self) -> None:
        self.output_queue.put_nowait(EngineCoreProc.ENGINE_CORE_DEAD)
        if self.output_thread is not None:
            self.output_thread.join(timeout=5.0)
            if self.output_thread.is_alive():
                logger.critical("Could not tell the front end that EngineCore died.")

    # -- IO threads ------------------------------------------------------------------
    def process_input_sockets(
        self, input_address: str, identity: bytes, ready_event: threading.Event
    ) -> None:
        """Input thread: DEALER socket -> decode -> ``input_queue``."""
        add_request_decoder = MsgpackDecoder(EngineCoreRequest)
        generic_decoder = MsgpackDecoder()
        with (
            zmq.Context() as ctx,
            make_zmq_socket(
                ctx, input_address, zmq.DEALER, identity=identity, bind=False, linger=0
            ) as input_socket,
        ):
            # The ROUTER can only address us once it has heard from us.
            input_socket.send(
                msgspec.msgpack.encode(
                    EngineCoreReadyResponse(
                        max_model_len=self.glassbox_config.model_config.max_model_len or 0,
                        num_gpu_blocks=self.glassbox_config.cache_config.num_gpu_blocks or 0,
                    )
                )
            )
            ready_event.set()
            del ready_event
            while True:
                type_frame, *data_frames = input_socket.recv_multipart(copy=False)
                request_type = EngineCoreRequestType(bytes(type_frame.buffer))
                request: Any
                if request_type == EngineCoreRequestType.ADD:
                    core_request: EngineCoreRequest = add_request_decoder.decode(data_frames)
                    try:
                        request = self.preprocess_add_request(core_request)
                    except Exception:
                        logger.exception(
                            "Could not pre-process request %s", core_request.request_id
                        )
                        self._send_finish_outputs(
                            [core_request.request_id], core_request.client_index, FinishReason.ERROR
                        )
                        continue
                else:
                    request = generic_decoder.decode(data_frames)
                self.trace.request_received(request_type, request)
                self.input_queue.put_nowait((request_type, request))

    def process_output_sockets(self, output_address: str, engine_index: int) -> None:
        """Output thread: ``output_queue`` -> encode -> PUSH socket."""
        encoder = MsgpackEncoder()
        # Linger so that the last outputs (or ENGINE_CORE_DEAD) still go out
        # when the socket closes.
        with (
            zmq.Context() as ctx,
            make_zmq_socket(
                ctx, output_address, zmq.PUSH, bind=False, linger=4000
            ) as output_socket,
        ):
            while True:
                output = self.output_queue.get()
                if output == EngineCoreProc.ENGINE_CORE_DEAD:
                    output_socket.send(output)
                    break
                if output == EngineCoreProc._OUTPUT_THREAD_STOP:
                    break
                assert not isinstance(output, bytes)
                _client_index, outputs = output
                outputs.engine_index = engine_index
                output_socket.send_multipart(encoder.encode(outputs), copy=False)

    def shutdown(self) -> None:
        # Flush what the output thread still holds before the process ends.
        if self.output_thread is not None and self.output_thread.is_alive():
            self.output_queue.put_nowait(EngineCoreProc._OUTPUT_THREAD_STOP)
            self.output_thread.join(timeout=5.0)
        super().shutdown()
        self.tracer.close()
