"""Capture a callable into CUDA graphs, one per batch descriptor, and replay them.

vLLM twin: ``vllm/compilation/cuda_graph.py`` (``CUDAGraphWrapper``,
``CUDAGraphEntry``).
Read it for how one wrapper serves both graph modes. A wrapper has a mode,
FULL (it wraps the whole model; the runner builds it) or PIECEWISE (it
wraps one compiled piece between two attentions; the backend builds it). On
each call it reads the forward context: when the step's
``cudagraph_runtime_mode`` is its own mode it captures a graph for the
step's ``batch_descriptor`` the first time and replays it afterwards;
otherwise it just calls through. So in a PIECEWISE step the pieces replay
their graphs and attention runs eagerly between them, and in a FULL step the
outer wrapper replays and the pieces inside never run.

Inputs are not copied: a graph replays on the addresses it was captured
with, so callers pass slices of persistent buffers (the runner's
``input_ids`` / ``positions``; inside the model, tensors the previous graph
produced in the shared memory pool).
Sessions: 04 (worker), 06 (CUDA graphs).

vLLM keeps one pool per process (``current_platform.get_global_graph_pool()``) and a
process runs one engine; a notebook or a test process runs engines one after another,
so here each engine's model runner starts a pool of its own (``new_global_graph_pool``).

Simpler than vLLM: no graph-pool id hand-off to NCCL, no offloader hooks,
no per-step statistics table, no debug-mode address checks, no options
(``CUDAGraphOptions``: outputs are always held weakly).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch

from engine.compilation.counter import compilation_counter
from engine.config.compilation import CUDAGraphMode
from engine.forward_context import (
    BatchDescriptor,
    get_forward_context,
    is_forward_context_available,
)
from engine.utils.torch_utils import weak_ref_tensors

_global_graph_pool: Any = None


def get_global_graph_pool() -> Any:
    """The memory pool the CUDA graphs of the engine being built capture into."""
    return _global_graph_pool if _global_graph_pool is not None else new_global_graph_pool()


def new_global_graph_pool() -> Any:
    """Start a fresh pool for the next engine of this process (its model runner calls
    this). PyTorch retires a pool once the last graph captured into it is freed, and
    refuses a capture into a retired pool, so an engine built after another was shut
    down (or garbage-collected) must not reuse that engine's pool."""
    global _global_graph_pool
    _global_graph_pool = torch.cuda.graph_pool_handle()
    return _global_graph_pool


@dataclasses.dataclass
class CUDAGraphEntry:
    batch_descriptor: BatchDescriptor
    cudagraph: torch.cuda.CUDAGraph | None = None
    output: Any = None  # what the captured call returned; replay refills it


class CUDAGraphWrapper:
    def __init__(
        self,
        runnable: Callable[..., Any],
        runtime_mode: CUDAGraphMode,
        graph_pool: Any,
    ) -> None:
        if runtime_mode not in (CUDAGraphMode.FULL, CUDAGraphMode.PIECEWISE):
            raise ValueError(f"a CUDAGraphWrapper runs FULL or PIECEWISE, not {runtime_mode}")
        self.runnable = runnable
        self.runtime_mode = runtime_mode
        # One pool for every graph of the model: graphs replay one at a time,
        # so they can share memory (vLLM: current_platform's global pool).
        self.graph_pool = graph_pool
        self.concrete_cudagraph_entries: dict[BatchDescriptor, CUDAGraphEntry] = {}

    def __getattr__(self, key: str) -> Any:
        # The wrapped model's methods (compute_logits, ...) stay reachable.
        return getattr(self.runnable, key)

    def unwrap(self) -> Callable[..., Any]:
        return self.runnable

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if not is_forward_context_available():
            return self.runnable(*args, **kwargs)
        forward_context = get_forward_context()
        mode = forward_context.cudagraph_runtime_mode
        if mode != self.runtime_mode:
            return self.runnable(*args, **kwargs)
        key = forward_context.batch_descriptor
        assert key is not None, f"a {mode} step needs a batch descriptor"
        entry = self.concrete_cudagraph_entries.get(key)
        if entry is None:
            entry = self.concrete_cudagraph_entries[key] = CUDAGraphEntry(batch_descriptor=key)
        if entry.cudagraph is None:
            cudagraph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(cudagraph, pool=self.graph_pool):
                output = self.runnable(*args, **kwargs)
            # Held weakly: the pool's memory stays free for other captures, and
            # each replay rewrites these addresses (read them before the next).
            entry.output = weak_ref_tensors(output)
            entry.cudagraph = cudagraph
            compilation_counter.num_cudagraph_captured += 1
            return output
        entry.cudagraph.replay()
        return entry.output
