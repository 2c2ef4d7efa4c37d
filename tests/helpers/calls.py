"""Record the calls of one public method of one object, the call still running.

Used by the CustomOp tests to check which implementation (``forward_cpu``,
``forward_cuda``, ...) a layer's ``forward`` really runs, without looking at
how the dispatch stores its choice.

Import with ``from tests.helpers.calls import record_calls``.
"""

from __future__ import annotations

import functools
from typing import Any


def record_calls(obj: Any, name: str) -> list[tuple[tuple[Any, ...], dict[str, Any]]]:
    """Replace ``obj.<name>`` on the instance by a wrapper that appends
    ``(args, kwargs)`` to the returned list, then calls the original.

    Install it before anything has kept a reference to the bound method (for
    a ``CustomOp``: before its first call, or after ``.to()``)."""
    calls: list[tuple[tuple[Any, ...], dict[str, Any]]] = []
    method = getattr(obj, name)

    @functools.wraps(method)
    def recorder(*args: Any, **kwargs: Any) -> Any:
        calls.append((args, kwargs))
        return method(*args, **kwargs)

    setattr(obj, name, recorder)
    return calls
