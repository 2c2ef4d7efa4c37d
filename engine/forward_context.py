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

``no_compile_layers`` maps each attention layer's name to the layer itself:
attention runs as the custom op ``torch.ops.glassbox.unified_attention_with_output``,
whose arguments are tensors and the layer's name (what a compiled graph can
hold), so the op finds its layer, KV cache and metadata here.
Sessions: 04 (worker), 05 (attention).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from engine.config.compilation import CUDAGraphMode

_forward_context: ForwardContext | None = None


@dataclass(frozen=True)
class BatchDescriptor:
    """The key a CUDA graph is captured and looked up under: the padded token
    count, and for uniform batches (every request the same number of query
    tokens) the request count."""

    num_tokens: int
    num_reqs: int | None = None
    uniform: bool = False


@dataclass
class ForwardContext:
    # layer name -> that layer's attention metadata; None during profiling /
    # dummy runs (attention then writes no KV and returns zeros).
    attn_metadata: dict[str, Any] | None
    # layer name -> Attention module (CompilationConfig.static_forward_context).
    no_compile_layers: dict[str, Any] = field(default_factory=dict)
    # How this step runs (the dispatcher's answer): NONE eager, FULL one graph
    # for the whole model, PIECEWISE graphs around everything but attention.
    cudagraph_runtime_mode: CUDAGraphMode = CUDAGraphMode.NONE
    # The graph key for FULL / PIECEWISE (padded sizes); None when eager.
    batch_descriptor: BatchDescriptor | None = None
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
    cudagraph_runtime_mode: CUDAGraphMode = CUDAGraphMode.NONE,
    batch_descriptor: BatchDescriptor | None = None,
    step: int = 0,
) -> Iterator[ForwardContext]:
    """Install the context for one model call; ``glassbox_config`` supplies the
    attention layers by name (without it, only layers that do not go through
    the custom op can run)."""
    global _forward_context
    previous = _forward_context
    layers = {}
    if glassbox_config is not None:
        layers = glassbox_config.compilation_config.static_forward_context
    _forward_context = ForwardContext(
        attn_metadata=attn_metadata,
        no_compile_layers=layers,
        cudagraph_runtime_mode=cudagraph_runtime_mode,
        batch_descriptor=batch_descriptor,
        step=step,
    )
    try:
        yield _forward_context
    finally:
        _forward_context = previous
