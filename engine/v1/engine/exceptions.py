"""The errors a front end sees when generation fails.

vLLM twin: ``vllm/v1/engine/exceptions.py``.
Read it for the split the API server relies on: ``EngineGenerateError`` is one
request going wrong (the engine keeps serving others); ``EngineDeadError``
means the EngineCore process is gone, every pending and future request fails
with it, and ``/health`` turns unhealthy. ``EngineOverloadedError`` and
``EngineShuttingDownError`` are Glassbox's own: the waiting-queue limit, or a
shutdown in progress, refused a request before it was sent. So is
``EngineCoreUtilityError``: a utility call (``add_lora``, ``profile``, ...)
raised inside EngineCore, which keeps serving.
Sessions: 01 (engine loop across two processes).
"""

from __future__ import annotations


class EngineGenerateError(Exception):
    """``AsyncLLM.generate()`` failed for this request only; recoverable."""


class EngineDeadError(Exception):
    """The EngineCore process died or shut down; not recoverable."""

    def __init__(self, *args: object, suppress_context: bool = False) -> None:
        message = (
            "EngineCore is dead: the engine process exited or crashed, so this "
            "request cannot be served. Check the log above for its root cause."
        )
        super().__init__(message, *args)
        # Hide the low-level socket error the death was detected through.
        self.__suppress_context__ = suppress_context


class EngineCoreUtilityError(RuntimeError):
    """A utility call raised inside EngineCore: ``"call to <method> failed:
    <reason>"``, with ``reason`` (what it raised with) kept apart for callers
    that report it as the user's error."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        _, found, reason = message.partition(" failed: ")
        self.reason = reason if found else message


class EngineOverloadedError(Exception):
    """The engine already holds as many unfinished sequences as
    ``max_num_seqs + max_waiting_requests``; nothing was sent. Retrying later
    may succeed (the server answers 503 with ``Retry-After``)."""


class EngineShuttingDownError(EngineDeadError):
    """The engine is shutting down: the requests in flight may still finish,
    new ones are refused (the server answers 503)."""

    def __init__(self) -> None:
        Exception.__init__(
            self, "The engine is shutting down (or has shut down) and takes no new requests."
        )
