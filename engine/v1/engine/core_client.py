"""How the front end talks to EngineCore.

vLLM twin: ``vllm/v1/engine/core_client.py`` (``EngineCoreClient``,
``InprocClient``, ``MPClient``, ``SyncMPClient``, ``AsyncMPClient``,
``BackgroundResources``).
Read it for: the front end never calls the scheduler directly; it goes through
a client.

* ``InprocClient`` holds EngineCore in the same process, so ``get_output()``
  *is* one ``EngineCore.step()``.
* ``MPClient`` starts EngineCore in its own process (``EngineCoreProc``) and
  talks to it over two ZMQ channels: requests go out of a ROUTER socket
  (bound here) to the core's DEALER, as frames ``[engine identity,
  request_type, msgpack, *aux]``; outputs come back from the core's PUSH into
  a PULL socket bound here. ``SyncMPClient`` (used by ``LLM``) reads that
  socket on a thread into a ``queue.Queue``; ``AsyncMPClient`` (used by
  ``AsyncLLM``) reads it in an asyncio task into an ``asyncio.Queue``.
* Engine death: a monitor thread waits on the process sentinel. The moment
  the process exits unexpectedly (crash, OOM-kill, SIGKILL) the client is
  marked dead, the reader is woken with ``EngineDeadError`` -- so every
  pending request fails within a moment -- and every later call raises
  ``EngineDeadError`` at once. A core that dies of a Python exception also
  says so itself with an ``ENGINE_CORE_DEAD`` frame.
Sessions: 01.

Simpler than vLLM: one engine (no data-parallel identities, waves or
coordinator), utility calls return msgpack-native values only.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import uuid
import weakref
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import msgspec
import zmq
import zmq.asyncio

from engine.config import GlassboxConfig
from engine.lora.request import LoRARequest
from engine.tracing import NULL_TRACER, Tracer
from engine.tracing.engine_trace import ClientTrace
from engine.utils.network_utils import remove_ipc_socket_file
from engine.v1.engine import (
    EngineCoreOutputs,
    EngineCoreReadyResponse,
    EngineCoreRequest,
    EngineCoreRequestType,
    UtilityOutput,
)
from engine.v1.engine.core import EngineCore, EngineCoreProc, worker_call
from engine.v1.engine.exceptions import EngineCoreUtilityError, EngineDeadError
from engine.v1.engine.utils import (
    CoreEngineProcManager,
    close_sockets,
    engine_ready_timeout_s,
    get_engine_zmq_addresses,
    launch_core_engines,
    make_zmq_socket,
)
from engine.v1.executor.abstract import Executor
from engine.v1.serial_utils import MsgpackDecoder, MsgpackEncoder, pickle_call, unpickle_call

logger = logging.getLogger(__name__)


class EngineCoreClient(ABC):
    @staticmethod
    def make_client(
        glassbox_config: GlassboxConfig,
        executor_class: type[Executor],
        log_stats: bool,
        tracer: Tracer | None = None,
        *,
        multiprocess_mode: bool = False,
        asyncio_mode: bool = False,
    ) -> EngineCoreClient:
        """In-process by default; ``multiprocess_mode`` starts EngineCoreProc."""
        if asyncio_mode and not multiprocess_mode:
            raise ValueError("asyncio_mode needs multiprocess_mode=True (as in vLLM)")
        if multiprocess_mode and asyncio_mode:
            return EngineCoreClient.make_async_mp_client(
                glassbox_config, executor_class, log_stats, tracer
            )
        if multiprocess_mode:
            return SyncMPClient(glassbox_config, executor_class, log_stats, tracer)
        return InprocClient(glassbox_config, executor_class, log_stats, tracer)

    @staticmethod
    def make_async_mp_client(
        glassbox_config: GlassboxConfig,
        executor_class: type[Executor],
        log_stats: bool,
        tracer: Tracer | None = None,
    ) -> AsyncMPClient:
        return AsyncMPClient(glassbox_config, executor_class, log_stats, tracer)

    @abstractmethod
    def shutdown(self, timeout: float | None = None) -> None: ...

    # Not abstract, as in vLLM: a client implements either the blocking
    # methods (InprocClient, SyncMPClient) or the ``*_async`` ones
    # (AsyncMPClient), and calling the other half is a programming error.
    def get_output(self) -> EngineCoreOutputs:
        raise NotImplementedError

    def add_request(self, request: EngineCoreRequest) -> None:
        raise NotImplementedError

    def abort_requests(self, request_ids: list[str]) -> None:
        raise NotImplementedError

    def reset_prefix_cache(
        self, reset_running_requests: bool = False, reset_connector: bool = False
    ) -> bool:
        raise NotImplementedError

    def profile(self, is_start: bool = True, profile_prefix: str | None = None) -> None:
        raise NotImplementedError

    def collective_rpc(
        self,
        method: str | Callable[..., Any],
        timeout: float | None = None,
        args: tuple = (),
        kwargs: dict[str, Any] | None = None,
    ) -> list[Any]:
        raise NotImplementedError

    def add_lora(self, lora_request: LoRARequest) -> bool:
        raise NotImplementedError

    def check_lora(self, lora_request: LoRARequest) -> None:
        raise NotImplementedError

    def remove_lora(self, lora_id: int) -> bool:
        raise NotImplementedError

    def list_loras(self) -> set[int]:
        raise NotImplementedError

    def pin_lora(self, lora_id: int) -> bool:
        raise NotImplementedError

    async def get_output_async(self) -> EngineCoreOutputs:
        raise NotImplementedError

    async def add_request_async(self, request: EngineCoreRequest) -> None:
        raise NotImplementedError

    async def abort_requests_async(self, request_ids: list[str]) -> None:
        raise NotImplementedError

    async def reset_prefix_cache_async(
        self, reset_running_requests: bool = False, reset_connector: bool = False
    ) -> bool:
        raise NotImplementedError

    async def profile_async(self, is_start: bool = True, profile_prefix: str | None = None) -> None:
        raise NotImplementedError

    async def collective_rpc_async(
        self,
        method: str | Callable[..., Any],
        timeout: float | None = None,
        args: tuple = (),
        kwargs: dict[str, Any] | None = None,
    ) -> list[Any]:
        raise NotImplementedError

    async def add_lora_async(self, lora_request: LoRARequest) -> bool:
        raise NotImplementedError

    async def check_lora_async(self, lora_request: LoRARequest) -> None:
        raise NotImplementedError

    async def pause_scheduler_async(self, mode: str = "abort", clear_cache: bool = True) -> None:
        raise NotImplementedError

    async def resume_scheduler_async(self) -> None:
        raise NotImplementedError

    async def is_scheduler_paused_async(self) -> bool:
        raise NotImplementedError

    async def remove_lora_async(self, lora_id: int) -> bool:
        raise NotImplementedError

    async def list_loras_async(self) -> set[int]:
        raise NotImplementedError

    async def pin_lora_async(self, lora_id: int) -> bool:
        raise NotImplementedError


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
        outputs, model_executed = self.engine_core.step_fn()
        self.engine_core.post_step(model_executed)
        return (outputs and outputs.get(0)) or EngineCoreOutputs()

    def add_request(self, request: EngineCoreRequest) -> None:
        self.engine_core.add_request(request)

    def abort_requests(self, request_ids: list[str]) -> None:
        if request_ids:
            self.engine_core.abort_requests(request_ids)

    def reset_prefix_cache(
        self, reset_running_requests: bool = False, reset_connector: bool = False
    ) -> bool:
        return self.engine_core.reset_prefix_cache(reset_running_requests, reset_connector)

    def profile(self, is_start: bool = True, profile_prefix: str | None = None) -> None:
        self.engine_core.profile(is_start, profile_prefix)

    def collective_rpc(self, method, timeout=None, args=(), kwargs=None) -> list[Any]:
        return self.engine_core.collective_rpc(method, timeout, args, kwargs)

    def add_lora(self, lora_request: LoRARequest) -> bool:
        return self.engine_core.add_lora(lora_request)

    def check_lora(self, lora_request: LoRARequest) -> None:
        self.engine_core.check_lora(lora_request)

    def remove_lora(self, lora_id: int) -> bool:
        return self.engine_core.remove_lora(lora_id)

    def list_loras(self) -> set[int]:
        return self.engine_core.list_loras()

    def pin_lora(self, lora_id: int) -> bool:
        return self.engine_core.pin_lora(lora_id)

    def shutdown(self, timeout: float | None = None) -> None:
        self.engine_core.shutdown()


@dataclass
class BackgroundResources:
    """Everything the client must release, held apart from the client so a
    ``weakref.finalize`` can release it without keeping the client alive."""

    ctx: zmq.Context
    engine_manager: CoreEngineProcManager | None = None
    output_socket: zmq.Socket | zmq.asyncio.Socket | None = None
    input_socket: zmq.Socket | zmq.asyncio.Socket | None = None
    output_queue_task: asyncio.Task | None = None
    # inproc address the sync output thread listens on for "stop".
    shutdown_path: str | None = None
    # Set once the core is gone; read by the IO thread/task and every call.
    engine_dead: bool = False
    # How long a stopping core may drain; None: its shutdown_timeout.
    shutdown_timeout: float | None = None
    # ipc:// addresses the client binds; their files are removed at the end.
    ipc_addresses: list[str] = field(default_factory=list)

    def __call__(self) -> None:
        # Stop the process first, while our PULL socket can still take its
        # last frames (and the client can still send aborts while it drains).
        if self.engine_manager is not None:
            self.engine_manager.shutdown(self.shutdown_timeout)
        self.engine_dead = True
        if isinstance(self.output_socket, zmq.asyncio.Socket):
            task = self.output_queue_task
            loop = task.get_loop() if task is not None else None
            sockets = (self.output_socket, self.input_socket)

            def close_sockets_and_tasks() -> None:
                # Cancelling the reader makes it hand EngineDeadError to
                # whoever waits on the outputs queue.
                if task is not None and not task.done():
                    task.cancel()
                close_sockets(sockets)

            if loop is not None and not loop.is_closed():
                if _in_loop(loop):
                    close_sockets_and_tasks()
                else:
                    loop.call_soon_threadsafe(close_sockets_and_tasks)
            else:
                close_sockets(sockets)
        else:
            close_sockets((self.input_socket,))
            if self.shutdown_path is not None:
                # The output socket belongs to the output thread; ask it to
                # stop. (If it has stopped on its own, it has started
                # terminating the context and there is no one to tell.)
                try:
                    with self.ctx.socket(zmq.PAIR) as shutdown_sender:
                        shutdown_sender.connect(self.shutdown_path)
                        shutdown_sender.send(b"")
                except zmq.ZMQError:
                    pass
            elif self.output_socket is not None:
                self.output_socket.close(linger=0)
        for address in self.ipc_addresses:
            remove_ipc_socket_file(address)

    def validate_alive(self, frames: Sequence[zmq.Frame]) -> None:
        if len(frames) == 1 and frames[0].buffer == EngineCoreProc.ENGINE_CORE_DEAD:
            self.engine_dead = True
            raise EngineDeadError()


def _in_loop(loop: asyncio.AbstractEventLoop) -> bool:
    try:
        return asyncio.get_running_loop() is loop
    except RuntimeError:
        return False


class MPClient(EngineCoreClient):
    """Base of the multi-process clients: sockets, process, handshake, monitor."""

    def __init__(
        self,
        asyncio_mode: bool,
        glassbox_config: GlassboxConfig,
        executor_class: type[Executor],
        log_stats: bool,
        tracer: Tracer | None = None,
    ) -> None:
        self.glassbox_config = glassbox_config
        # The front end's side of the process hop: requests sent, outputs received.
        self.trace = ClientTrace.create(tracer or NULL_TRACER)
        sync_ctx = zmq.Context(io_threads=2)
        self.ctx = zmq.asyncio.Context(sync_ctx) if asyncio_mode else sync_ctx
        # Registered first, so whatever exists is released even if start-up
        # fails half-way, or the client is garbage collected without shutdown().
        self.resources = BackgroundResources(ctx=sync_ctx)
        self._finalizer = weakref.finalize(self, self.resources)
        success = False
        try:
            addresses = get_engine_zmq_addresses()
            self.resources.ipc_addresses = [*addresses.inputs, *addresses.outputs]
            self.input_socket = self.resources.input_socket = make_zmq_socket(
                self.ctx, addresses.inputs[0], zmq.ROUTER, bind=True
            )
            self.resources.output_socket = make_zmq_socket(self.ctx, addresses.outputs[0], zmq.PULL)
            with launch_core_engines(
                glassbox_config, executor_class, log_stats, addresses
            ) as manager:
                self.resources.engine_manager = manager

            self.encoder = MsgpackEncoder()
            self.decoder = MsgpackDecoder(EngineCoreOutputs)
            # ZMQ identity of the one engine this client talks to.
            self.core_engine: bytes = (0).to_bytes(2, "little")
            self._wait_for_ready_message()
            # call_id -> future of a utility call in flight.
            self.utility_results: dict[int, Any] = {}
            self.start_engine_core_monitor()
            success = True
        finally:
            if not success:
                self._finalizer()

    def _wait_for_ready_message(self) -> None:
        """The core's first message on the input socket carries the values
        settled at start-up (the KV block count)."""
        sync_input_socket = zmq.Socket.shadow(self.input_socket)
        if not sync_input_socket.poll(timeout=int(engine_ready_timeout_s() * 1000)):
            raise TimeoutError("EngineCore never sent its ready message on the input socket")
        identity, payload = sync_input_socket.recv_multipart()
        if identity != self.core_engine:
            raise RuntimeError(f"ready message from an unexpected engine identity {identity!r}")
        response = msgspec.msgpack.decode(payload, type=EngineCoreReadyResponse)
        # The front end's config learns what the core decided.
        self.glassbox_config.cache_config.num_gpu_blocks = response.num_gpu_blocks
        model_config = self.glassbox_config.model_config
        model_config.max_model_len = min(
            model_config.max_model_len or response.max_model_len, response.max_model_len
        )

    @property
    def engine_core_pids(self) -> list[int]:
        manager = self.resources.engine_manager
        return [p.pid for p in manager.processes if p.pid is not None] if manager else []

    def shutdown(self, timeout: float | None = None) -> None:
        """Stop the EngineCore process and release the sockets. It drains for
        ``timeout`` seconds (None: its shutdown_timeout), then aborts the rest."""
        self.resources.shutdown_timeout = timeout
        self._finalizer()

    def _format_exception(self, e: BaseException) -> BaseException:
        return EngineDeadError(suppress_context=True) if self.resources.engine_dead else e

    def ensure_alive(self) -> None:
        if self.resources.engine_dead:
            raise EngineDeadError()

    def start_engine_core_monitor(self) -> None:
        engine_manager = self.resources.engine_manager
        if engine_manager is None:
            return
        self_ref = weakref.ref(self)

        def monitor_engine_cores() -> None:
            engine_manager.monitor_engine_liveness()
            client = self_ref()
            if client is None or not client._finalizer.alive or client.resources.engine_dead:
                return  # a normal shutdown, not a death
            logger.error(
                "EngineCore process died unexpectedly (exit code %s); failing all requests.",
                engine_manager.processes[0].exitcode,
            )
            # Marks the client dead and wakes the output reader, which hands
            # EngineDeadError to whoever is waiting for outputs.
            client._finalizer()

        threading.Thread(target=monitor_engine_cores, daemon=True, name="EngineCoreMonitor").start()


def _process_utility_output(output: UtilityOutput, utility_results: dict[int, Any]) -> None:
    future = utility_results.pop(output.call_id, None)
    if future is None or future.done():
        return
    if output.failure_message is not None:
        future.set_exception(EngineCoreUtilityError(output.failure_message))
    else:
        future.set_result(output.result)


def _fail_utility_calls(utility_results: dict[int, Any]) -> None:
    for future in list(utility_results.values()):
        if not future.done():
            future.set_exception(EngineDeadError())
    utility_results.clear()


class SyncMPClient(MPClient):
    """Blocking client for ``LLM``/``LLMEngine``."""

    def __init__(
        self,
        glassbox_config: GlassboxConfig,
        executor_class: type[Executor],
        log_stats: bool,
        tracer: Tracer | None = None,
    ) -> None:
        super().__init__(False, glassbox_config, executor_class, log_stats, tracer)
        self.outputs_queue: queue.Queue[EngineCoreOutputs | BaseException] = queue.Queue()

        # The thread must not reference the client (or it would never be
        # garbage collected): it gets only what it needs.
        ctx = self.ctx
        out_socket = self.resources.output_socket
        decoder = self.decoder
        utility_results = self.utility_results
        outputs_queue = self.outputs_queue
        resources = self.resources
        shutdown_path = resources.shutdown_path = get_open_zmq_inproc_path()
        shutdown_socket = ctx.socket(zmq.PAIR)
        shutdown_socket.bind(shutdown_path)

        def process_outputs_socket() -> None:
            assert isinstance(out_socket, zmq.Socket)
            try:
                poller = zmq.Poller()
                poller.register(shutdown_socket, zmq.POLLIN)
                poller.register(out_socket, zmq.POLLIN)
                while True:
                    socks = dict(poller.poll())
                    if shutdown_socket in socks:
                        break
                    frames = out_socket.recv_multipart(copy=False)
                    resources.validate_alive(frames)
                    outputs: EngineCoreOutputs = decoder.decode(frames)
                    if outputs.utility_output is not None:
                        _process_utility_output(outputs.utility_output, utility_results)
                    else:
                        outputs_queue.put_nowait(outputs)
                # Stopped by shutdown or by the death monitor: nothing more
                # will come, so nobody may keep waiting.
                outputs_queue.put_nowait(EngineDeadError())
            except Exception as e:
                outputs_queue.put_nowait(e)
            finally:
                _fail_utility_calls(utility_results)
                shutdown_socket.close(linger=0)
                out_socket.close(linger=0)
                # The last socket of this context is gone once the input
                # socket is closed too; terminating ends its IO threads.
                threading.Thread(target=ctx.term, daemon=True, name="ZMQContextTerm").start()

        self.output_queue_thread = threading.Thread(
            target=process_outputs_socket, name="EngineCoreOutputQueueThread", daemon=True
        )
        self.output_queue_thread.start()

    def get_output(self) -> EngineCoreOutputs:
        outputs = self.outputs_queue.get()
        if isinstance(outputs, BaseException):
            raise self._format_exception(outputs) from None
        self.trace.output_received(outputs)
        return outputs

    def _send_input(self, request_type: EngineCoreRequestType, request: Any) -> None:
        self.ensure_alive()
        self.trace.request_sent(request_type, request)
        # (identity, request type, msgpack, *aux buffers)
        message = (self.core_engine, request_type.value, *self.encoder.encode(request))
        self.input_socket.send_multipart(message, copy=False)

    def call_utility(self, method: str, *args: Any) -> Any:
        call_id = uuid.uuid4().int >> 64
        future: Future[Any] = Future()
        self.utility_results[call_id] = future
        self._send_input(EngineCoreRequestType.UTILITY, (0, call_id, method, args))
        return future.result()

    def add_request(self, request: EngineCoreRequest) -> None:
        self._send_input(EngineCoreRequestType.ADD, request)

    def abort_requests(self, request_ids: list[str]) -> None:
        if request_ids and not self.resources.engine_dead:
            self._send_input(EngineCoreRequestType.ABORT, list(request_ids))

    def reset_prefix_cache(
        self, reset_running_requests: bool = False, reset_connector: bool = False
    ) -> bool:
        return self.call_utility("reset_prefix_cache", reset_running_requests, reset_connector)

    def profile(self, is_start: bool = True, profile_prefix: str | None = None) -> None:
        self.call_utility("profile", is_start, profile_prefix)

    def collective_rpc(self, method, timeout=None, args=(), kwargs=None) -> list[Any]:
        worker_call(method, kwargs)  # a bad name fails here, not in the other process
        payload = pickle_call((method, timeout, args, kwargs), "collective_rpc")
        answer = self.call_utility("collective_rpc_serialized", payload)
        return unpickle_call(answer, "collective_rpc")

    def add_lora(self, lora_request: LoRARequest) -> bool:
        return self.call_utility("add_lora", lora_request)

    def check_lora(self, lora_request: LoRARequest) -> None:
        try:
            self.call_utility("check_lora", lora_request)
        except EngineCoreUtilityError as e:  # the adapter's fault: bad input, as in-process
            raise ValueError(e.reason) from None

    def remove_lora(self, lora_id: int) -> bool:
        return self.call_utility("remove_lora", lora_id)

    def list_loras(self) -> set[int]:
        return set(self.call_utility("list_loras"))

    def pin_lora(self, lora_id: int) -> bool:
        return self.call_utility("pin_lora", lora_id)


class AsyncMPClient(MPClient):
    """asyncio client for ``AsyncLLM``; all socket work happens on its event loop."""

    def __init__(
        self,
        glassbox_config: GlassboxConfig,
        executor_class: type[Executor],
        log_stats: bool,
        tracer: Tracer | None = None,
        client_index: int = 0,
    ) -> None:
        super().__init__(True, glassbox_config, executor_class, log_stats, tracer)
        self.client_index = client_index
        self.outputs_queue: asyncio.Queue[EngineCoreOutputs | BaseException] = asyncio.Queue()
        try:
            # Start reading now when there is a loop, so a core that dies
            # before the first request is noticed too.
            asyncio.get_running_loop()
            self._ensure_output_queue_task()
        except RuntimeError:
            pass

    def _ensure_output_queue_task(self) -> None:
        resources = self.resources
        if resources.output_queue_task is not None:
            return
        decoder = self.decoder
        utility_results = self.utility_results
        outputs_queue = self.outputs_queue
        output_socket = resources.output_socket
        assert output_socket is not None

        async def process_outputs_socket() -> None:
            try:
                while True:
                    frames = await output_socket.recv_multipart(copy=False)
                    resources.validate_alive(frames)
                    outputs: EngineCoreOutputs = decoder.decode(frames)
                    if outputs.utility_output is not None:
                        _process_utility_output(outputs.utility_output, utility_results)
                        continue
                    if outputs.outputs or outputs.scheduler_stats is not None:
                        outputs_queue.put_nowait(outputs)
            except Exception as e:
                _fail_utility_calls(utility_results)
                outputs_queue.put_nowait(e)
            except asyncio.CancelledError:
                # Cancelled by shutdown or by the death monitor.
                _fail_utility_calls(utility_results)
                outputs_queue.put_nowait(EngineDeadError())

        resources.output_queue_task = asyncio.create_task(
            process_outputs_socket(), name="EngineCoreOutputQueueTask"
        )
        if resources.engine_dead:
            # Died before the task existed: nothing can cancel it any more.
            resources.output_queue_task.cancel()

    async def get_output_async(self) -> EngineCoreOutputs:
        self._ensure_output_queue_task()
        outputs = await self.outputs_queue.get()
        if isinstance(outputs, BaseException):
            raise self._format_exception(outputs) from None
        self.trace.output_received(outputs)
        return outputs

    async def _send_input(self, request_type: EngineCoreRequestType, request: Any) -> None:
        self.ensure_alive()
        self.trace.request_sent(request_type, request)
        message = (self.core_engine, request_type.value, *self.encoder.encode(request))
        await self.input_socket.send_multipart(message, copy=False)

    async def call_utility_async(self, method: str, *args: Any) -> Any:
        call_id = uuid.uuid4().int >> 64
        future = asyncio.get_running_loop().create_future()
        self.utility_results[call_id] = future
        await self._send_input(
            EngineCoreRequestType.UTILITY, (self.client_index, call_id, method, args)
        )
        self._ensure_output_queue_task()
        return await future

    async def add_request_async(self, request: EngineCoreRequest) -> None:
        request.client_index = self.client_index
        await self._send_input(EngineCoreRequestType.ADD, request)
        self._ensure_output_queue_task()

    async def abort_requests_async(self, request_ids: list[str]) -> None:
        if request_ids and not self.resources.engine_dead:
            await self._send_input(EngineCoreRequestType.ABORT, list(request_ids))

    async def reset_prefix_cache_async(
        self, reset_running_requests: bool = False, reset_connector: bool = False
    ) -> bool:
        return await self.call_utility_async(
            "reset_prefix_cache", reset_running_requests, reset_connector
        )

    async def profile_async(self, is_start: bool = True, profile_prefix: str | None = None) -> None:
        await self.call_utility_async("profile", is_start, profile_prefix)

    async def collective_rpc_async(self, method, timeout=None, args=(), kwargs=None) -> list[Any]:
        worker_call(method, kwargs)  # a bad name fails here, not in the other process
        payload = pickle_call((method, timeout, args, kwargs), "collective_rpc")
        answer = await self.call_utility_async("collective_rpc_serialized", payload)
        return unpickle_call(answer, "collective_rpc")

    async def add_lora_async(self, lora_request: LoRARequest) -> bool:
        return await self.call_utility_async("add_lora", lora_request)

    async def pause_scheduler_async(self, mode: str = "abort", clear_cache: bool = True) -> None:
        await self.call_utility_async("pause_scheduler", mode, clear_cache)

    async def resume_scheduler_async(self) -> None:
        await self.call_utility_async("resume_scheduler")

    async def is_scheduler_paused_async(self) -> bool:
        return await self.call_utility_async("is_scheduler_paused")

    async def check_lora_async(self, lora_request: LoRARequest) -> None:
        try:
            await self.call_utility_async("check_lora", lora_request)
        except EngineCoreUtilityError as e:  # the adapter's fault: bad input, as in-process
            raise ValueError(e.reason) from None

    async def remove_lora_async(self, lora_id: int) -> bool:
        return await self.call_utility_async("remove_lora", lora_id)

    async def list_loras_async(self) -> set[int]:
        return set(await self.call_utility_async("list_loras"))

    async def pin_lora_async(self, lora_id: int) -> bool:
        return await self.call_utility_async("pin_lora", lora_id)


def get_open_zmq_inproc_path() -> str:
    return f"inproc://{uuid.uuid4()}"


__all__ = [
    "AsyncMPClient",
    "BackgroundResources",
    "EngineCoreClient",
    "InprocClient",
    "MPClient",
    "SyncMPClient",
]
