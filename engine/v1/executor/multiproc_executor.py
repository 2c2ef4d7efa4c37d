"""MultiprocExecutor: one worker process per tensor-parallel rank on this machine.

vLLM twin: ``vllm/v1/executor/multiproc_executor.py`` (``MultiprocExecutor``,
``WorkerProc``, ``FutureWrapper``). Read it for the round trip of a step:
  1. EngineCore calls ``execute_model(scheduler_output)``; the executor puts
     one message -- (method, args, output rank) -- on ``rpc_broadcast_mq``, a
     shared-memory ring that every worker reads (``MessageQueue``,
     ``engine/distributed/device_communicators/shm_broadcast.py``);
  2. every ``WorkerProc`` takes it off the ring in its busy loop and runs
     the same method on its own ``Worker``: all ranks run the same step on
     their slice of the model, meeting in the all-reduces;
  3. only the output rank (rank 0) answers, on its own one-reader queue
     (``worker_response_mq``); the others answer only calls that ask every
     rank (start-up, KV sizing). Nothing is gathered from every rank per step.
With ``non_block=True`` the call returns a ``FutureWrapper`` at once: the
answers come back in the order the calls went out, so a future reads every
older answer before its own (that is how EngineCore keeps two steps in flight
with async scheduling). A monitor thread watches the worker processes: when
one dies, the executor is failed, waiting calls raise at once, and EngineCore
is told through ``register_failure_callback``.
Sessions: 07 (executor).

Simpler than vLLM: one machine (Ray spans machines), no pipeline or data
parallelism, no KV-connector output aggregation; a call names its method
with ``WorkerMethod`` (a fixed table) or passes a function, instead of
looking the method up by its name on the worker.
"""

from __future__ import annotations

import contextlib
import enum
import logging
import os
import pickle
import queue
import signal
import threading
import weakref
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from multiprocessing import connection
from multiprocessing.process import BaseProcess
from typing import Any

from engine.distributed.device_communicators.shm_broadcast import (
    Handle,
    MessageQueue,
    unlink_orphaned_segment,
)
from engine.distributed.parallel_state import get_tp_group
from engine.utils.network_utils import (
    get_distributed_init_method,
    get_loopback_ip,
    get_open_port,
    remove_ipc_socket_file,
)
from engine.utils.system_utils import get_mp_context
from engine.v1.engine.utils import process_ended
from engine.v1.executor.abstract import Executor, WorkerMethod, worker_handlers
from engine.v1.outputs import AsyncModelRunnerOutput

logger = logging.getLogger(__name__)

# How long start-up may take per worker (load a model, join the others).
WORKER_READY_TIMEOUT_S = float(os.environ.get("GLASSBOX_WORKER_READY_TIMEOUT_S", "600"))
# After SIGTERM, how long workers get to exit before SIGKILL (vLLM: 4 s).
WORKER_TERMINATE_GRACE_S = 4.0
# When a rank reports an error, how long to look for a dead peer that caused it.
WORKER_DEATH_GRACE_S = 1.0


def _function_name(function: Callable[..., Any]) -> str:
    """A function's name for messages (a ``functools.partial``: its function's)."""
    function = getattr(function, "func", function)
    return getattr(function, "__qualname__", repr(function))


class ResponseStatus(enum.Enum):
    SUCCESS = enum.auto()
    FAILURE = enum.auto()


@dataclass
class WorkerRequest:
    """One message on the broadcast ring. A function call travels as
    ``function``: its pickled ``(function, args)``, unpickled by the worker
    inside the call, so one it cannot load fails that call, not the worker."""

    method: WorkerMethod | str  # a WorkerMethod, or the function's name
    args: tuple[Any, ...]
    # The one rank that answers; None: every rank answers.
    unique_reply_rank: int | None
    function: bytes | None = None
    # The last message: finish what came before it, then leave the loop.
    stop: bool = False

    @classmethod
    def make(
        cls, method: WorkerMethod | Callable[..., Any], args: tuple[Any, ...], reply: int | None
    ) -> WorkerRequest:
        if isinstance(method, WorkerMethod):
            return cls(method, args, reply)
        try:
            payload = pickle.dumps((method, args), protocol=5)
        except (pickle.PicklingError, AttributeError, TypeError) as e:
            raise ValueError(
                f"collective_rpc cannot send {_function_name(method)} to the workers ({e}); "
                "pass a top-level function of an importable module"
            ) from e
        return cls(_function_name(method), (), reply, payload)

    @classmethod
    def last(cls) -> WorkerRequest:
        """The stop message: no call, nobody answers."""
        return cls("stop", (), None, stop=True)

    def call(self, handlers: dict[WorkerMethod, Callable[..., Any]], worker: Any) -> Any:
        if isinstance(self.method, WorkerMethod):
            return handlers[self.method](*self.args)
        assert self.function is not None
        try:
            function, args = pickle.loads(self.function)
        except Exception as e:
            raise RuntimeError(
                f"the worker cannot load {self.method} ({type(e).__name__}: {e}); a function "
                "run by collective_rpc must be importable from a module the workers can import"
            ) from e
        return function(worker, *args)


@dataclass
class WorkerProcHandle:
    """The executor's view of one started worker."""

    proc: BaseProcess
    rank: int
    worker_response_mq: MessageQueue | None  # None until the worker reports ready
    death_writer: Any  # our end of the worker's death pipe


class FutureWrapper(Future):
    """A call's answer, read from the response queues when first asked for.
    Answers arrive in call order: reading this one first reads every older
    pending one (``futures_queue``)."""

    def __init__(self, futures_queue: deque[FutureWrapper], get_response: Callable[[], Any]):
        super().__init__()
        self.futures_queue = futures_queue
        self.get_response = get_response
        futures_queue.appendleft(self)

    def result(self, timeout: float | None = None) -> Any:
        if timeout is not None:
            raise RuntimeError("FutureWrapper.result() takes no timeout")
        while not self.done():
            older = self.futures_queue.pop()
            older._wait_for_response()
        return super().result()

    def _wait_for_response(self) -> None:
        try:
            self.set_result(self.get_response())
        except Exception as e:
            self.set_exception(e)


class MultiprocExecutor(Executor):
    def _init_executor(self) -> None:
        parallel_config = self.glassbox_config.parallel_config
        self.world_size = parallel_config.world_size
        self.is_failed = False
        self.shutdown_event = threading.Event()
        self.failure_callback: Callable[[], None] | None = None
        self.futures_queue: deque[FutureWrapper] = deque()
        self.workers: list[WorkerProcHandle] = []
        # Ranks meet here for torch.distributed (one machine: loopback).
        init_method = get_distributed_init_method(get_loopback_ip(), get_open_port())
        # Every rank reads every call from this ring.
        self.rpc_broadcast_mq = MessageQueue(self.world_size, self.world_size)
        handle = self.rpc_broadcast_mq.export_handle()
        # Shut the workers down even if shutdown() is never called.
        self._finalizer = weakref.finalize(self, _shutdown_workers, self.workers, None)
        try:
            self._start_workers(handle, init_method)
            # Both sides of each queue meet: the broadcast ring, then each answer queue.
            self.rpc_broadcast_mq.wait_until_ready(timeout=WORKER_READY_TIMEOUT_S)
            for worker in self.workers:
                worker.worker_response_mq.wait_until_ready(timeout=WORKER_READY_TIMEOUT_S)
        except BaseException:
            self.shutdown()
            raise
        self.start_worker_monitor()
        self.output_rank = 0

    def _start_workers(self, handle: Handle, init_method: str) -> None:
        context = get_mp_context()
        obs = self.glassbox_config.observability_config
        ready_readers = []
        # A forked worker starts with copies of our ends of the death pipes
        # made so far; it closes them, or it would never see EOF on its own.
        death_writer_fds: list[int] = []
        for rank in range(self.world_size):
            ready_reader, ready_writer = context.Pipe(duplex=False)
            death_reader, death_writer = context.Pipe(duplex=False)
            death_writer_fds.append(death_writer.fileno())
            proc = context.Process(
                target=WorkerProc.worker_main,
                name=f"GlassboxWorker_TP{rank}",
                kwargs={
                    "glassbox_config": self.glassbox_config,
                    "rank": rank,
                    "local_rank": rank,
                    "distributed_init_method": init_method,
                    "input_shm_handle": handle,
                    "ready_pipe": ready_writer,
                    "death_pipe": death_reader,
                    "inherited_fds": list(death_writer_fds)
                    if context.get_start_method() == "fork"
                    else [],
                    "trace_path": obs.trace_path if obs.trace_level != "off" else None,
                    "trace_level": obs.trace_level,
                },
                daemon=True,
            )
            proc.start()
            ready_writer.close()
            death_reader.close()
            # Registered at once, so a failed start-up still stops every worker.
            self.workers.append(WorkerProcHandle(proc, rank, None, death_writer))
            ready_readers.append(ready_reader)
        for worker, ready_reader in zip(self.workers, ready_readers):
            response_handle = _wait_for_ready(worker.proc, worker.rank, ready_reader)
            worker.worker_response_mq = MessageQueue.create_from_handle(response_handle, 0)

    # -- failure ----------------------------------------------------------------------
    def start_worker_monitor(self) -> None:
        """A thread that waits on the workers' process sentinels: a worker that
        exits while the executor runs fails the executor at once."""

        def monitor_workers() -> None:
            dead = self._dead_worker(timeout=None)
            if self.shutdown_event.is_set() or dead is None:
                return
            self.is_failed = True
            logger.error(
                "Worker TP%d (pid %s) died unexpectedly (exit code %s); shutting down the "
                "executor.",
                dead.rank,
                dead.proc.pid,
                dead.proc.exitcode,
            )
            self.shutdown_event.set()  # calls waiting for an answer raise now
            callback = self.failure_callback
            if callback is not None:
                callback()

        threading.Thread(target=monitor_workers, daemon=True, name="MultiprocWorkerMonitor").start()

    def register_failure_callback(self, callback: Callable[[], None]) -> None:
        if self.is_failed:
            callback()
        else:
            self.failure_callback = callback

    def check_health(self) -> None:
        if self.is_failed:
            raise RuntimeError("the executor failed: a worker process died")

    def _dead_worker(self, timeout: float | None) -> WorkerProcHandle | None:
        """The first worker whose process exits within ``timeout`` seconds (None:
        however long it takes), reaped so that its exit code is known."""
        sentinels = {w.proc.sentinel: w for w in self.workers}
        died = connection.wait(list(sentinels), timeout=timeout)
        if not died:
            return None
        dead = sentinels[died[0]]
        dead.proc.join(timeout=1)
        return dead

    def _failure_message(self, name: str, error: Any) -> str:
        """A rank's error, or the death that caused it: a rank in a collective
        with a killed peer fails too (gloo: "Connection reset by peer"), often
        before the monitor has seen the death."""
        dead = self._dead_worker(timeout=WORKER_DEATH_GRACE_S)
        if dead is None:
            return f"worker failed in {name}: {error}"
        return (
            f"worker failed in {name}: worker process died (TP{dead.rank}, pid {dead.proc.pid}, "
            f"exit code {dead.proc.exitcode}); another rank then reported: {error}"
        )

    # -- calls ------------------------------------------------------------------------
    def collective_rpc(
        self,
        method: WorkerMethod | Callable[..., Any],
        args: tuple[Any, ...] = (),
        non_block: bool = False,
        unique_reply_rank: int | None = None,
        timeout: float | None = None,
    ) -> Any:
        """Run ``method`` on every worker. A ``WorkerMethod`` names a ``Worker``
        method; a function is called as ``method(worker, *args)`` (it must be
        importable by name in the workers). Returns the list of every rank's
        result, or only ``unique_reply_rank``'s."""
        if self.is_failed or self.shutdown_event.is_set():
            raise RuntimeError("the executor is failed or shut down; no call can run")
        request = WorkerRequest.make(method, args, unique_reply_rank)
        try:
            self.rpc_broadcast_mq.enqueue(request)
        except (pickle.PicklingError, AttributeError, TypeError) as e:
            name = getattr(request.method, "value", request.method)
            raise ValueError(
                f"collective_rpc cannot send the arguments of {name} to the workers ({e}); "
                "pass top-level functions of an importable module"
            ) from e
        if unique_reply_rank is not None:
            response_mqs = [self.workers[unique_reply_rank].worker_response_mq]
        else:
            response_mqs = [w.worker_response_mq for w in self.workers]
        name = method.value if isinstance(method, WorkerMethod) else _function_name(method)

        def get_response() -> Any:
            answers = []
            # Every answer is read, failed or not, so none is left for the next call.
            for mq in response_mqs:
                try:
                    answers.append(mq.dequeue(timeout=timeout, cancel=self.shutdown_event))
                except RuntimeError as e:
                    raise RuntimeError(
                        f"{name}: no answer from the workers ({e}); a worker process died "
                        "or the executor was shut down"
                    ) from None
            for status, result in answers:
                if status != ResponseStatus.SUCCESS:
                    raise RuntimeError(self._failure_message(name, result))
            results = [result for _, result in answers]
            return results[0] if unique_reply_rank is not None else results

        if non_block:
            return FutureWrapper(self.futures_queue, get_response)
        if self.futures_queue:  # older answers come first
            return FutureWrapper(self.futures_queue, get_response).result()
        return get_response()

    @property
    def max_concurrent_batches(self) -> int:
        return 2 if self.glassbox_config.scheduler_config.async_scheduling else 1

    @classmethod
    def supports_async_scheduling(cls) -> bool:
        return True

    def shutdown(self) -> None:
        """Stop every worker (SIGTERM, then SIGKILL) and free the queues. Safe twice."""
        if getattr(self, "_shut_down", False):
            return
        self._shut_down = True
        asked = False
        if not self.is_failed and all(w.worker_response_mq for w in self.workers):
            # Ask first: each worker finishes the calls before this one (a step
            # may still be in flight) and exits, its trace complete.
            with contextlib.suppress(Exception):
                self.rpc_broadcast_mq.enqueue(WorkerRequest.last(), timeout=1)
                asked = True
        self.shutdown_event.set()
        if self._finalizer.detach() is not None:
            _shutdown_workers(self.workers, self.rpc_broadcast_mq, asked)


def _wait_for_ready(proc: BaseProcess, rank: int, ready_reader: Any) -> Handle:
    """The worker's response-queue handle, once it has loaded its shard; a
    worker that fails or dies during start-up raises here."""
    try:
        ready = connection.wait([ready_reader, proc.sentinel], timeout=WORKER_READY_TIMEOUT_S)
        if not ready:
            raise RuntimeError(
                f"worker TP{rank} did not start within {WORKER_READY_TIMEOUT_S:.0f} s "
                "(GLASSBOX_WORKER_READY_TIMEOUT_S)"
            )
        try:
            status, payload = ready_reader.recv()
        except EOFError:
            raise RuntimeError(
                f"worker TP{rank} (pid {proc.pid}) died during start-up (exit code {proc.exitcode})"
            ) from None
        if status != ResponseStatus.SUCCESS:
            raise RuntimeError(f"worker TP{rank} failed to start: {payload}")
        return payload
    finally:
        ready_reader.close()


def _shutdown_workers(
    workers: list[WorkerProcHandle], rpc_mq: MessageQueue | None, asked_to_stop: bool = False
) -> None:
    procs = [w.proc for w in workers if w.proc.pid is not None]
    for proc in procs:
        if asked_to_stop:  # give them the time to leave on their own
            proc.join(timeout=WORKER_TERMINATE_GRACE_S)
        if proc.is_alive():
            proc.terminate()
    for proc in procs:
        proc.join(timeout=WORKER_TERMINATE_GRACE_S)
        if not process_ended(proc):
            logger.warning("worker %s did not exit after SIGTERM; killing it", proc.name)
            proc.kill()
            proc.join(timeout=5)
    for worker in workers:
        with contextlib.suppress(Exception):
            worker.death_writer.close()
        mq = worker.worker_response_mq
        if mq is None:
            continue
        # A killed worker could not remove its answer queue's segment and
        # socket file: we do.
        killed = worker.proc.exitcode not in (0, None)
        name = mq.buffer.name if killed and mq.buffer else None
        mq.close()
        if name is not None:
            unlink_orphaned_segment(name)
        if killed:
            remove_ipc_socket_file(mq.handle.local_subscribe_addr)
    if rpc_mq is not None:
        rpc_mq.close()


class WorkerProc:
    """The process side of one rank: a ``Worker`` and the loop that serves
    the executor's calls."""

    def __init__(
        self,
        glassbox_config: Any,
        rank: int,
        local_rank: int,
        distributed_init_method: str,
        input_shm_handle: Handle,
        tracer: Any,
    ) -> None:
        from engine.tracing.worker_trace import WorkerProcTrace
        from engine.v1.worker.gpu_worker import Worker

        self.rank = rank
        self.trace = WorkerProcTrace.create(tracer)
        self.worker = Worker(
            glassbox_config,
            local_rank=local_rank,
            rank=rank,
            tracer=tracer,
            distributed_init_method=distributed_init_method,
            is_driver_worker=rank == 0,
            local_world_size=glassbox_config.parallel_config.world_size,
        )
        self.rpc_broadcast_mq = MessageQueue.create_from_handle(input_shm_handle, rank)
        # This rank's answers: one reader (the executor).
        self.worker_response_mq = MessageQueue(1, 1)
        self.worker.init_device()
        self.worker.load_model()
        self.handlers = worker_handlers(self.worker)
        # With async scheduling a sampled output is still on its way to the
        # host: a thread waits for it and answers, so the loop can take the
        # next call meanwhile. Every answer goes through it, in order.
        self.async_output_queue: queue.Queue[Any] = queue.Queue()
        self.async_output_thread = threading.Thread(
            target=self.async_output_busy_loop, daemon=True, name="WorkerAsyncOutputCopy"
        )
        self.async_output_thread.start()

    @staticmethod
    def worker_main(
        *,
        glassbox_config: Any,
        rank: int,
        local_rank: int,
        distributed_init_method: str,
        input_shm_handle: Handle,
        ready_pipe: Any,
        death_pipe: Any,
        inherited_fds: list[int],
        trace_path: str | None,
        trace_level: str,
    ) -> None:
        """Entry point of a worker process."""
        from engine.tracing import Tracer, part_path

        for fd in inherited_fds:
            with contextlib.suppress(OSError):
                os.close(fd)

        logging.basicConfig(
            level=os.environ.get("GLASSBOX_LOGGING_LEVEL", "INFO"),
            format=f"(Worker_TP{rank} pid=%(process)d) %(levelname)s %(name)s: %(message)s",
            force=True,
        )
        shutdown_requested = threading.Event()

        def signal_handler(signum: int, frame: Any) -> None:
            if not shutdown_requested.is_set():
                shutdown_requested.set()
                raise SystemExit

        signal.signal(signal.SIGTERM, signal_handler)
        signal.signal(signal.SIGINT, signal_handler)
        tracer = (
            Tracer(part_path(trace_path, f"worker{rank}"), trace_level, rank=rank)
            if trace_path
            else Tracer()
        )
        worker_proc: WorkerProc | None = None
        try:
            _watch_death_pipe(death_pipe, shutdown_requested)
            try:
                worker_proc = WorkerProc(
                    glassbox_config,
                    rank,
                    local_rank,
                    distributed_init_method,
                    input_shm_handle,
                    tracer,
                )
            except Exception as e:
                logger.exception("worker TP%d failed to start", rank)
                ready_pipe.send((ResponseStatus.FAILURE, f"{type(e).__name__}: {e}"))
                return
            ready_pipe.send(
                (ResponseStatus.SUCCESS, worker_proc.worker_response_mq.export_handle())
            )
            ready_pipe.close()
            worker_proc.rpc_broadcast_mq.wait_until_ready(timeout=WORKER_READY_TIMEOUT_S)
            worker_proc.worker_response_mq.wait_until_ready(timeout=WORKER_READY_TIMEOUT_S)
            worker_proc.worker_busy_loop(shutdown_requested)
        except SystemExit:
            logger.debug("worker TP%d exiting", rank)
        finally:
            if worker_proc is not None:
                worker_proc.shutdown()
            tracer.close()

    def worker_busy_loop(self, cancel: threading.Event) -> None:
        """Take calls off the broadcast ring until shut down."""
        while True:
            try:
                request: WorkerRequest = self.rpc_broadcast_mq.dequeue(cancel=cancel)
            except RuntimeError:
                return  # cancelled: the executor is shutting down
            if request.stop:
                return
            replies = request.unique_reply_rank in (None, self.rank)
            self.trace.rpc_received(request.method, request.args)
            try:
                answer = (ResponseStatus.SUCCESS, request.call(self.handlers, self.worker))
            except Exception as e:
                logger.exception("worker TP%d: %s failed", self.rank, request.method)
                answer = (ResponseStatus.FAILURE, f"{type(e).__name__}: {e}")
            self.trace.rpc_done(request.method, request.args, get_tp_group(), replies)
            if replies:
                self.async_output_queue.put(answer)

    def async_output_busy_loop(self) -> None:
        while True:
            status, output = self.async_output_queue.get()
            if status is None:
                return
            if isinstance(output, AsyncModelRunnerOutput):
                try:
                    output = output.get_output()
                except Exception as e:
                    status, output = ResponseStatus.FAILURE, f"{type(e).__name__}: {e}"
            try:
                self.worker_response_mq.enqueue((status, output))
            except RuntimeError:
                return  # the queue was closed: shutting down

    def shutdown(self) -> None:
        self.async_output_queue.put((None, None))
        self.async_output_thread.join(timeout=5)
        self.worker.shutdown()
        self.rpc_broadcast_mq.close()
        self.worker_response_mq.close()


def _watch_death_pipe(death_pipe: Any, shutdown_requested: threading.Event) -> None:
    """Exit when the executor's process dies (its end of the pipe closes),
    even if it was SIGKILLed: no orphaned workers."""

    def wait_for_parent_death() -> None:
        try:
            death_pipe.recv()
        except (EOFError, OSError):
            pass
        if not shutdown_requested.is_set():
            logger.warning("the executor's process is gone; exiting")
            os._exit(1)

    threading.Thread(target=wait_for_parent_death, daemon=True, name="DeathPipeMonitor").start()
