"""The forward context: the one per-step global in the engine.

vLLM twin: ``vllm/forward_context.py`` (``ForwardContext``,
``set_forward_context``, ``get_forward_context``).

Why a global: the model's ``forward(input_ids, positions)`` signature is the
same as in transformers and knows nothing about paged KV caches. The model
runner builds per-layer attention metadata (block tables, slot mapping, query
offsets) for the step and installs it here; each ``Attention`` layer, deep
inside the model, fetches its entry by layer name. Nothing else travels this
way, and the context only exists inside ``with set_forward_context(...)``
around one model call -- reading it anywhere else is an error.
Sessions: 04 (worker), 05 (attention).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

_forward_context: ForwardContext | None = None


@dataclass
class ForwardContext:
    # layer name -> that layer's attention metadata; None during profiling /
    # dummy runs (attention then writes no KV and returns zeros).
    attn_metadata: dict[str, Any] | None
    # Which CUDA graph mode this step runs in ("NONE" on CPU / eager).
    cudagraph_runtime_mode: str = "NONE"
    # Step number, for trace events emitted from inside the model.
    step: int = 0
    additional_kwargs: dict[str, Any] = field(default_factory=dict)


def get_forward_context() -> ForwardContext:
    if _forward_context is None:
        raise RuntimeError(
            "no forward context: attention layers can only run inside "
            "set_forward_context(...) (the model runner sets it around each forward)"
        )
    return _forward_context


def is_forward_context_available() -> bool:
    return _forward_context is not None


@contextlib.contextmanager
def set_forward_context(
    attn_metadata: dict[str, Any] | None,
    glassbox_config: Any = None,
    *,
    cudagraph_runtime_mode: str = "NONE",
    step: int = 0,
) -> Iterator[ForwardContext]:
    """Install the context for one model call (``glassbox_config`` is accepted
    for vLLM's signature; nothing in it is needed per step yet)."""
    global _forward_context
    previous = _forward_context
    _forward_context = ForwardContext(
        attn_metadata=attn_metadata, cudagraph_runtime_mode=cudagraph_runtime_mode, step=step
    )
    try:
        yield _forward_context
    finally:
        _forward_context = previous
