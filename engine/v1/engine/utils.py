"""Starting, watching and stopping the EngineCore process.

vLLM twin: ``vllm/v1/engine/utils.py`` (``CoreEngineProcManager``,
``launch_core_engines``, ``wait_for_engine_startup``, ``SignalCallback``) and
the ZMQ helpers of ``vllm/utils/network_utils.py`` (``make_zmq_socket``,
``get_open_zmq_ipc_path``).
Read it for the start-up handshake, in order:

  1. the front end binds its input ROUTER and output PULL sockets and a
     handshake ROUTER, then starts the process;
  2. EngineCore connects a DEALER to the handshake socket and says HELLO;
  3. the front end answers with the input/output addresses
     (``EngineHandshakeMetadata``);
  4. EngineCore loads the model, sizes the KV cache, starts its IO threads
     (the input thread's first message tells the front end the block count)
     and says READY on the handshake socket.

If start-up fails in the child, it sends FAILED with the error's type and
message and the front end raises the same built-in exception type (vLLM only
says "initialization failed, see above"); if the process dies without a word,
start-up fails at once with its exit code instead of waiting out a timeout.
Sessions: 01 (engine loop across two processes).

The process is started as vLLM's: ``fork`` unless CUDA is already
initialised in this process or ``GLASSBOX_WORKER_MULTIPROC_METHOD=spawn``
(``get_mp_context`` in ``engine/utils/system_utils.py``).

Simpler than vLLM: one engine (no data parallelism, coordinator or Ray), IPC
addresses only. The parent-death pipe is the trick vLLM's multiproc executor
uses for its workers, applied here to EngineCore itself.
"""

from __future__ import annotations

import builtins
import contextlib
import logging
import os
import pickle
import tempfile
import threading
import time
import uuid
import weakref
from collections.abc import Callable, Iterator
from multiprocessing import connection
from multiprocessing.process import BaseProcess
from typing import TYPE_CHECKING, Any

import msgspec
import zmq

from engine.utils.network_utils import remove_ipc_socket_file
from engine.utils.system_utils import get_mp_context

if TYPE_CHECKING:
    from engine.config import GlassboxConfig
    from engine.v1.executor.abstract import Executor

logger = logging.getLogger(__name__)

# How long the front end waits for EngineCore to load the model and say READY.
ENGINE_READY_TIMEOUT_S_ENV = "GLASSBOX_ENGINE_READY_TIMEOUT_S"
DEFAULT_ENGINE_READY_TIMEOUT_S = 600
# The twin of VLLM_ENABLE_V1_MULTIPROCESSING.
ENABLE_MULTIPROCESSING_ENV = "GLASSBOX_ENABLE_MULTIPROCESSING"
STARTUP_POLL_PERIOD_MS = 10_000
# The longest one engine step may take (vLLM: VLLM_ENGINE_ITERATION_TIMEOUT_S).
# A SIGTERM is handled between steps, so a stopping EngineCore gets this long
# beyond its drain time before it is SIGKILLed.
ENGINE_ITERATION_TIMEOUT_S_ENV = "GLASSBOX_ENGINE_ITERATION_TIMEOUT_S"
DEFAULT_ENGINE_ITERATION_TIMEOUT_S = 60
# After this long, say why the front end is still waiting.
SHUTDOWN_NOTICE_AFTER_S = 3.0


def multiprocessing_enabled() -> bool:
    """Whether ``LLM``/``LLMEngine`` run EngineCore in its own process
    (``GLASSBOX_ENABLE_MULTIPROCESSING``, default on as in vLLM)."""
    raw = os.environ.get(ENABLE_MULTIPROCESSING_ENV, "1").strip().lower()
    if raw in ("1", "true", "yes", "on"):
        return True
    if raw in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"{ENABLE_MULTIPROCESSING_ENV} must be 0 or 1, got {raw!r}")


def _positive_seconds_env(name: str, default: float) -> float:
    raw = os.environ.get(name, str(default))
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if value <= 0:
        raise ValueError(f"{name} must be a positive number, got {raw!r}")
    return value


def engine_ready_timeout_s() -> float:
    return _positive_seconds_env(ENGINE_READY_TIMEOUT_S_ENV, DEFAULT_ENGINE_READY_TIMEOUT_S)


def engine_iteration_timeout_s() -> float:
    return _positive_seconds_env(ENGINE_ITERATION_TIMEOUT_S_ENV, DEFAULT_ENGINE_ITERATION_TIMEOUT_S)


# ---------------------------------------------------------------------------
# ZMQ helpers
# ---------------------------------------------------------------------------
def get_open_zmq_ipc_path() -> str:
    return f"ipc://{tempfile.gettempdir()}/glassbox-{uuid.uuid4().hex[:16]}"


def make_zmq_socket(
    ctx: zmq.Context | zmq.asyncio.Context,  # type: ignore[name-defined]
    path: str,
    socket_type: int,
    bind: bool | None = None,
    identity: bytes | None = None,
    linger: int | None = None,
) -> zmq.Socket:
    """A socket bound or connected to ``path``. By default the front end's
    sockets (ROUTER, PULL) bind and EngineCore's (DEALER, PUSH) connect."""
    socket = ctx.socket(socket_type)
    bind = _binds(socket_type, bind)
    # No high-water mark: outputs must never be dropped or block the loop.
    socket.setsockopt(zmq.SNDHWM, 0)
    socket.setsockopt(zmq.RCVHWM, 0)
    if identity is not None:
        socket.setsockopt(zmq.IDENTITY, identity)
    if linger is not None:
        socket.setsockopt(zmq.LINGER, linger)
    if bind:
        socket.bind(path)
    else:
        socket.connect(path)
    return socket


def _binds(socket_type: int, bind: bool | None) -> bool:
    if bind is None:
        return socket_type not in (zmq.PUSH, zmq.SUB, zmq.XSUB, zmq.DEALER)
    return bind


@contextlib.contextmanager
def zmq_socket_ctx(path: str, socket_type: int, bind: bool | None = None) -> Iterator[zmq.Socket]:
    """A throw-away context and socket (the handshake socket), closed on exit;
    the side that bound it also removes its ipc socket file."""
    ctx = zmq.Context()
    socket = None
    try:
        socket = make_zmq_socket(ctx, path, socket_type, bind=bind, linger=0)
        with socket:
            yield socket
    finally:
        ctx.destroy(linger=0)
        if socket is not None and _binds(socket_type, bind):
            remove_ipc_socket_file(path)


def close_sockets(sockets) -> None:
    for socket in sockets:
        if socket is not None:
            socket.close(linger=0)


# ---------------------------------------------------------------------------
# Handshake messages
# ---------------------------------------------------------------------------
class EngineZmqAddresses(msgspec.Struct):
    # Front end's input ROUTER address(es), EngineCore connects DEALERs there.
    inputs: list[str]
    # Front end's output PULL address(es), EngineCore connects PUSHes there.
    outputs: list[str]


class EngineHandshakeMetadata(msgspec.Struct):
    """The front end's answer to HELLO: where to connect for real traffic."""

    addresses: EngineZmqAddresses


def get_engine_zmq_addresses() -> EngineZmqAddresses:
    return EngineZmqAddresses(inputs=[get_open_zmq_ipc_path()], outputs=[get_open_zmq_ipc_path()])


# ---------------------------------------------------------------------------
# The process
# ---------------------------------------------------------------------------
class CoreEngineProcManager:
    """Starts the EngineCore process and stops it (SIGTERM, then SIGKILL)."""

    def __init__(
        self,
        glassbox_config: GlassboxConfig,
        executor_class: type[Executor],
        log_stats: bool,
        handshake_address: str,
        engine_index: int = 0,
    ) -> None:
        from engine.v1.engine.core import EngineCoreProc

        context = get_mp_context()
        self.start_method = context.get_start_method()
        # The child holds the read end; this process holds the only write
        # end. When this process dies -- even by SIGKILL -- the OS closes the
        # write end and the child's read fails with EOF: its cue to exit.
        death_reader, self.death_writer = context.Pipe(duplex=False)
        # A forked child starts with copies of this process's descriptors: it
        # must close its copy of the write end, or it would never see EOF.
        inherited_fds = [self.death_writer.fileno()] if self.start_method == "fork" else []
        self.processes: list[BaseProcess] = [
            context.Process(
                target=EngineCoreProc.run_engine_core,
                name="EngineCore",
                kwargs={
                    "glassbox_config": glassbox_config,
                    "executor_class": executor_class,
                    "log_stats": log_stats,
                    "handshake_address": handshake_address,
                    "death_pipe": death_reader,
                    "inherited_fds": inherited_fds,
                    "engine_index": engine_index,
                },
                daemon=False,
            )
        ]
        # EngineCore may drain this long after SIGTERM before it exits.
        self.shutdown_timeout = float(glassbox_config.shutdown_timeout)
        self._finalizer = weakref.finalize(
            self, shutdown, self.processes, self.death_writer, self.shutdown_timeout
        )
        self.manager_stopped = threading.Event()
        self.failed_proc_name: str | None = None
        try:
            for proc in self.processes:
                try:
                    proc.start()
                except (pickle.PicklingError, AttributeError, TypeError) as e:
                    # spawn pickles the config and the executor class (by name).
                    raise TypeError(
                        "the engine configuration cannot be sent to the EngineCore process: "
                        f"{e}. distributed_executor_backend must be a top-level class that "
                        "can be imported by its module path (not one defined inside a "
                        "function); or set GLASSBOX_ENABLE_MULTIPROCESSING=0 to run "
                        "EngineCore in this process"
                    ) from e
        finally:
            death_reader.close()
            if self.finished_procs():
                self.shutdown()

    def shutdown(self, timeout: float | None = None) -> None:
        """Stop EngineCore; ``timeout``: its drain time (default: shutdown_timeout)."""
        self.manager_stopped.set()
        if self._finalizer.detach() is not None:
            drain = self.shutdown_timeout if timeout is None else timeout
            shutdown(self.processes, self.death_writer, timeout=drain)

    def monitor_engine_liveness(self) -> None:
        """Block until a process exits (or ``shutdown`` is called)."""
        sentinel_to_proc = {proc.sentinel: proc for proc in self.processes}
        while sentinel_to_proc and not self.manager_stopped.is_set():
            died = connection.wait(list(sentinel_to_proc), timeout=1)
            for sentinel in died:
                proc = sentinel_to_proc.pop(sentinel)
                if proc.exitcode != 0 and not self.manager_stopped.is_set():
                    self.failed_proc_name = proc.name
            if died:
                break
        self.shutdown()

    def sentinels(self) -> list[int]:
        return [proc.sentinel for proc in self.processes]

    def finished_procs(self) -> dict[str, int]:
        return {p.name: p.exitcode for p in self.processes if p.exitcode is not None}


def process_ended(proc: BaseProcess) -> bool:
    """Whether ``proc`` has exited. Its sentinel turns readable when it does;
    ``is_alive()`` alone can answer True for a process that another thread
    (the liveness monitor, reading ``exitcode``) is reaping at that moment,
    which made shutdown SIGKILL an engine that had already exited."""
    return proc.exitcode is not None or bool(connection.wait([proc.sentinel], timeout=0))


def shutdown(
    procs: list[BaseProcess], death_writer: Any = None, timeout: float | None = None
) -> None:
    """SIGTERM, wait, then SIGKILL what is left.

    EngineCore handles SIGTERM between two steps: it drains for its
    ``shutdown_timeout``, aborts the rest and exits. A step cannot be
    interrupted, and on a busy CPU one long prefill step can take many
    seconds, so the wait is ``timeout`` (the drain time) plus the longest a
    step may take. Killing it earlier would lose its trace part."""
    procs = [p for p in procs if p.pid is not None]  # never started: nothing to stop
    for proc in procs:
        if proc.is_alive():
            proc.terminate()
    started = time.monotonic()
    deadline = started + (timeout or 0.0) + engine_iteration_timeout_s()
    notice_at = started + (timeout or 0.0) + SHUTDOWN_NOTICE_AFTER_S
    for proc in procs:
        proc.join(timeout=max(0.0, min(notice_at, deadline) - time.monotonic()))
        if not process_ended(proc) and time.monotonic() < deadline:
            logger.info(
                "Waiting up to %.0f s more for EngineCore (pid %s) to finish its current step "
                "(%s).",
                deadline - time.monotonic(),
                proc.pid,
                ENGINE_ITERATION_TIMEOUT_S_ENV,
            )
            proc.join(timeout=max(0.0, deadline - time.monotonic()))
        if not process_ended(proc):
            logger.warning(
                "EngineCore (pid %s) did not exit %.0f s after SIGTERM; killing it",
                proc.pid,
                time.monotonic() - started,
            )
            proc.kill()
            proc.join(timeout=5)
    if death_writer is not None:
        death_writer.close()


@contextlib.contextmanager
def launch_core_engines(
    glassbox_config: GlassboxConfig,
    executor_class: type[Executor],
    log_stats: bool,
    addresses: EngineZmqAddresses,
) -> Iterator[CoreEngineProcManager]:
    """Start EngineCore; after the caller's block, wait until it is READY."""
    handshake_address = get_open_zmq_ipc_path()
    with zmq_socket_ctx(handshake_address, zmq.ROUTER, bind=True) as handshake_socket:
        manager = CoreEngineProcManager(
            glassbox_config, executor_class, log_stats, handshake_address
        )
        try:
            yield manager
            wait_for_engine_startup(handshake_socket, addresses, manager)
        except BaseException:
            manager.shutdown()
            raise


def wait_for_engine_startup(
    handshake_socket: zmq.Socket,
    addresses: EngineZmqAddresses,
    proc_manager: CoreEngineProcManager,
) -> None:
    poller = zmq.Poller()
    poller.register(handshake_socket, zmq.POLLIN)
    for sentinel in proc_manager.sentinels():
        poller.register(sentinel, zmq.POLLIN)
    timeout_s = engine_ready_timeout_s()
    waited_ms = 0
    state = "NEW"
    while state != "READY":
        events = poller.poll(STARTUP_POLL_PERIOD_MS)
        if not events:
            waited_ms += STARTUP_POLL_PERIOD_MS
            if waited_ms >= timeout_s * 1000:
                raise TimeoutError(
                    f"EngineCore did not become ready within {timeout_s:.0f}s; raise "
                    f"{ENGINE_READY_TIMEOUT_S_ENV} if the model is slow to load"
                )
            logger.debug("Waiting for EngineCore to %s.", "connect" if state == "NEW" else "start")
            continue
        if any(sock is not handshake_socket for sock, _ in events):
            for proc in proc_manager.processes:
                proc.join(timeout=5)  # the sentinel fires a moment before the exit code is known
            raise RuntimeError(
                "EngineCore initialization failed; see the error above. Exited "
                f"process(es) and exit codes: {proc_manager.finished_procs()}. (The "
                f"process was started with {proc_manager.start_method!r}; with 'spawn' a "
                "script that builds an engine at import time needs an "
                '`if __name__ == "__main__":` guard.)'
            )
        _identity, payload = handshake_socket.recv_multipart()
        message = msgspec.msgpack.decode(payload)
        status = message["status"]
        if status == "FAILED":
            raise startup_error(message["error_type"], message["message"])
        if status == "HELLO" and state == "NEW":
            handshake_socket.send_multipart(
                (_identity, msgspec.msgpack.encode(EngineHandshakeMetadata(addresses)))
            )
            state = "CONNECTED"
        elif status == "READY" and state == "CONNECTED":
            state = "READY"
        else:
            raise RuntimeError(f"unexpected {status} message from EngineCore in state {state}")


def startup_error(error_type: str, message: str) -> Exception:
    """Rebuild the error EngineCore failed to start with: a built-in exception
    type (ValueError, FileNotFoundError, ...) keeps its type and message."""
    cls = getattr(builtins, error_type, None)
    if isinstance(cls, type) and issubclass(cls, Exception):
        try:
            return cls(message)
        except Exception:
            pass
    return RuntimeError(f"EngineCore failed to start: {error_type}: {message}")


class SignalCallback:
    """Runs ``callback`` on a helper thread when ``trigger()`` is called.

    A signal handler may interrupt the main thread while it holds the input
    queue's lock, so the handler itself must not touch the queue; it only sets
    an event, and this thread does the queue work."""

    def __init__(self, callback: Callable[[], None]) -> None:
        self._callback = callback
        self._event = threading.Event()
        self._stopped = False
        self._thread = threading.Thread(target=self._run, daemon=True, name="SignalCallback")
        self._thread.start()

    def _run(self) -> None:
        self._event.wait()
        if not self._stopped:
            self._callback()

    def trigger(self) -> None:
        self._event.set()

    def stop(self) -> None:
        self._stopped = True
        self._event.set()
