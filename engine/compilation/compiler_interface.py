"""The compilers a piece of the graph can go through: Inductor, or none.

vLLM twin: ``vllm/compilation/compiler_interface.py`` (``CompilerInterface``,
``InductorAdaptor``, ``EagerAdaptor``).
Read it for the seam between vLLM's backend and the compiler: a piece
(``torch.fx.GraphModule``) and example inputs in, a callable out. Inductor
fuses the piece's elementwise ops into generated kernels (Triton on CUDA,
C++/OpenMP on CPU) and keeps the matmuls as library calls.
Caching: Inductor's FX-graph cache stores the generated code under
``TORCHINDUCTOR_CACHE_DIR``; ``initialize_cache`` points it at our cache
folder for this model and code, so a second start-up finds its pieces there
(``compilation_counter.num_cache_hits``).
Sessions: 06 (compilation).

Options: ``CompilationConfig.inductor_compile_config`` patches every
compile, under the cache settings (vLLM's ``compiler_config``).

Simpler than vLLM: no standalone-compile artefacts saved next to the cache,
no AOT compile of the Dynamo bytecode (Dynamo traces again at every start),
no hijacking of Inductor's internals to record cache keys, no
``max_autotune`` / coordinate-descent tuning for a ``compile_sizes`` entry.
"""

from __future__ import annotations

import os
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from typing import Any

from torch import fx

from engine.compilation.counter import compilation_counter


class CompilerInterface(ABC):
    name: str
    # This compiler's share of compilation_counter (one model, one start-up).
    num_compiles = 0
    num_cache_hits = 0

    def initialize_cache(self, cache_dir: str) -> None:
        """Where compiled artefacts go (nothing for compilers without a cache)."""

    @abstractmethod
    def compile(
        self, graph: fx.GraphModule, example_inputs: Sequence[Any], runtime_shape: int | None
    ) -> Callable[..., Any]:
        """``runtime_shape``: the token count to specialise for, None for any."""


class EagerAdaptor(CompilerInterface):
    """Run the piece as traced: Dynamo's graph, no code generation. The split
    and the CUDA graphs still apply (vLLM's ``backend="eager"``)."""

    name = "eager"

    def compile(
        self, graph: fx.GraphModule, example_inputs: Sequence[Any], runtime_shape: int | None
    ) -> Callable[..., Any]:
        compilation_counter.num_backend_compilations += 1
        return graph


class InductorAdaptor(CompilerInterface):
    name = "inductor"

    def __init__(self, inductor_config: dict[str, Any] | None = None) -> None:
        # CompilationConfig.inductor_compile_config: options patched into every compile.
        self.inductor_config = dict(inductor_config or {})

    def initialize_cache(self, cache_dir: str) -> None:
        # Inductor reads the variable whenever it looks for its cache.
        os.makedirs(cache_dir, exist_ok=True)
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache_dir

    def compile(
        self, graph: fx.GraphModule, example_inputs: Sequence[Any], runtime_shape: int | None
    ) -> Callable[..., Any]:
        from torch._dynamo.utils import counters
        from torch._inductor.compile_fx import compile_fx

        hits_before = counters["inductor"]["fxgraph_cache_hit"]
        # With a fixed token count (runtime_shape) the inputs are concrete and
        # Inductor generates kernels for that size; otherwise for any size.
        patches = {**self.inductor_config, "fx_graph_cache": True, "fx_graph_remote_cache": False}
        compiled = compile_fx(graph, list(example_inputs), config_patches=patches)
        compilation_counter.num_backend_compilations += 1
        if counters["inductor"]["fxgraph_cache_hit"] > hits_before:
            compilation_counter.num_cache_hits += 1
            self.num_cache_hits += 1
        else:
            compilation_counter.num_inductor_compiles += 1
            self.num_compiles += 1
        return compiled


def make_compiler(backend: str, inductor_config: dict[str, Any] | None = None) -> CompilerInterface:
    if backend == "eager":
        return EagerAdaptor()
    return InductorAdaptor(inductor_config)
