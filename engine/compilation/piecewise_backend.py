"""One piece of the split graph: compiled for any token count, and again for
the sizes asked for.

vLLM twin: ``vllm/compilation/piecewise_backend.py`` (``PiecewiseBackend``).
Read it for shape specialisation: Dynamo traced the model with the token
count as a symbol, so each piece first gets code that works for every count.
A size listed in ``CompilationConfig.compile_sizes`` gets code of its own,
generated the first time a batch of exactly that many tokens runs; ``__call__``
picks the specialised code when the size matches. The piece receives the
token count as one of its arguments (an ``int`` at run time, a ``SymInt``
while tracing): ``sym_shape_indices`` says which.
Sessions: 06 (compilation).

Simpler than vLLM: sizes compile lazily on first use (vLLM compiles every
range and size at start-up and can save them as standalone artefacts); no
compile ranges.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from torch import fx

from engine.compilation.compiler_interface import CompilerInterface


class PiecewiseBackend:
    def __init__(
        self,
        graph: fx.GraphModule,
        compile_sizes: list[int],
        piecewise_compile_index: int,
        total_piecewise_compiles: int,
        sym_shape_indices: list[int],
        compiled_graph_for_general_shape: Callable[..., Any],
        compiler: CompilerInterface,
    ) -> None:
        self.graph = graph
        self.piecewise_compile_index = piecewise_compile_index
        self.total_piecewise_compiles = total_piecewise_compiles
        self.sym_shape_indices = sym_shape_indices
        self.compiled_graph_for_general_shape = compiled_graph_for_general_shape
        self.compiler = compiler
        # token count -> its specialised code (None until first run at that size).
        self.concrete_size_entries: dict[int, Callable[..., Any] | None] = {
            size: None for size in compile_sizes
        }
        # Seconds spent compiling each size, for the start-up trace.
        self.compile_seconds: dict[int, float] = {}

    def __call__(self, *args: Any) -> Any:
        if not self.sym_shape_indices:
            # A piece that does not depend on the token count.
            return self.compiled_graph_for_general_shape(*args)
        runtime_shape = args[self.sym_shape_indices[0]]
        if runtime_shape not in self.concrete_size_entries:
            return self.compiled_graph_for_general_shape(*args)
        runnable = self.concrete_size_entries[runtime_shape]
        if runnable is None:
            start = time.perf_counter()
            runnable = self.compiler.compile(self.graph, args, runtime_shape)
            self.concrete_size_entries[runtime_shape] = runnable
            self.compile_seconds[runtime_shape] = time.perf_counter() - start
        return runnable(*args)
