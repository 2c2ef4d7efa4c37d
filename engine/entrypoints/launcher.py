"""serve_http: run uvicorn around the app, and stop the engine and the server in order.

vLLM twin: ``vllm/entrypoints/launcher.py`` (``serve_http``, ``watchdog_loop``,
``terminate_if_errored``). Read it for what happens on SIGTERM or Ctrl-C:

1. the listening socket closes (no new connections) and ``AsyncLLM`` refuses
   new requests on open ones (HTTP 503);
2. ``AsyncLLM.shutdown`` runs off the event loop, so the streams in flight
   keep receiving tokens while EngineCore drains them for ``shutdown_timeout``
   seconds; it then aborts the rest (their streams end with finish_reason
   "abort") and exits;
3. uvicorn closes the connections, now idle, and the server returns.

A second Ctrl-C ends the drain at once. With ``keep_alive_on_engine_death``
off, a watchdog stops the server once EngineCore is dead (vLLM's default).
Sessions: 01.

Differs from vLLM on purpose: the drain is built into uvicorn's own
``shutdown`` (``GracefulServer``) rather than a second signal handler next to
uvicorn's, and the signal uvicorn re-raises when it returns is consumed here,
so a SIGTERM'd server exits through its normal path (exit code 0, trace
merged) instead of dying by the signal.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import socket
import threading
from collections.abc import Iterator

import uvicorn

from engine.v1.engine.async_llm import AsyncLLM

logger = logging.getLogger(__name__)

# How often the watchdog checks the engine (vLLM: VLLM_WATCHDOG_TIME_S).
WATCHDOG_TIME_S = 5.0
# After the drain, how long uvicorn waits for responses still being written.
CONNECTION_CLOSE_TIMEOUT_S = 5


class GracefulServer(uvicorn.Server):
    """A uvicorn server whose shutdown first stops the engine: drain, abort the
    rest, then close the connections."""

    def __init__(self, config: uvicorn.Config, engine_client: AsyncLLM) -> None:
        super().__init__(config)
        self.engine_client = engine_client
        # Responses left after the drain are cut after this long.
        config.timeout_graceful_shutdown = CONNECTION_CLOSE_TIMEOUT_S

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        for server in self.servers:
            server.close()  # stop accepting; open connections stay
        loop = asyncio.get_running_loop()
        stopping = loop.run_in_executor(None, self.engine_client.shutdown)
        while not stopping.done():
            if self.force_exit:  # a second Ctrl-C: end the drain now
                abort_drain(self.engine_client)
                self.force_exit = False
            await asyncio.wait([stopping], timeout=0.1)
        await stopping
        await super().shutdown(sockets)


def abort_drain(engine_client: AsyncLLM) -> None:
    """A second signal makes a draining EngineCore abort what is left."""
    for pid in engine_client.engine_core.engine_core_pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)


async def serve_http(
    server: GracefulServer, sock: socket.socket, keep_alive_on_engine_death: bool = True
) -> None:
    """Serve on ``sock`` until SIGTERM/SIGINT (or a dead engine, when not kept alive)."""
    loop = asyncio.get_running_loop()
    watchdog = (
        None
        if keep_alive_on_engine_death
        else loop.create_task(watchdog_loop(server, server.engine_client))
    )
    try:
        with consume_reraised_signals():
            await server.serve(sockets=[sock])
    finally:
        if watchdog is not None:
            watchdog.cancel()


@contextlib.contextmanager
def consume_reraised_signals() -> Iterator[None]:
    """uvicorn re-raises the signal that stopped it once ``serve`` returns;
    the engine is already stopped by then, so let the caller return normally."""
    if not _on_main_thread():
        yield
        return
    previous = {sig: signal.signal(sig, _note_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _note_signal(signum: int, frame: object) -> None:
    logger.debug("Signal %d after the server stopped; already shut down.", signum)


def _on_main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()


async def watchdog_loop(server: uvicorn.Server, engine_client: AsyncLLM) -> None:
    """Stop the server once EngineCore is dead (``--no-keep-alive-on-engine-death``)."""
    while True:
        await asyncio.sleep(WATCHDOG_TIME_S)
        terminate_if_errored(server, engine_client)


def terminate_if_errored(server: uvicorn.Server, engine_client: AsyncLLM) -> None:
    if engine_client.errored and not server.should_exit:
        logger.error("EngineCore is dead; stopping the API server.")
        server.should_exit = True


__all__ = ["GracefulServer", "serve_http", "terminate_if_errored", "watchdog_loop"]
