"""Counts of what compilation did, for tests, logs and the trace.

vLLM twin: ``vllm/compilation/counter.py`` (``compilation_counter``).
Read it to see what a start-up with compilation does: one Dynamo graph per
compiled model, split into pieces, each compiled by Inductor (or found in its
cache), then CUDA graphs captured. Tests compare two snapshots
(``clone()``) around an engine start.
Sessions: 06 (compilation).

Simpler than vLLM: no counters for AOT artefacts or custom passes.
"""

from __future__ import annotations

import copy
import dataclasses


@dataclasses.dataclass
class CompilationCounter:
    num_models_seen: int = 0  # models built with compilation on
    num_graphs_seen: int = 0  # Dynamo graphs handed to our backend
    num_piecewise_graphs_seen: int = 0  # pieces after the split, attention included
    num_piecewise_capturable_graphs_seen: int = 0  # pieces a CUDA graph may capture
    num_backend_compilations: int = 0  # calls into Inductor (or eager), all shapes
    num_inductor_compiles: int = 0  # of those, Inductor runs that compiled code
    num_cache_hits: int = 0  # of those, Inductor runs served from its FX-graph cache
    num_cudagraph_captured: int = 0  # CUDA graphs captured, FULL and PIECEWISE

    def clone(self) -> CompilationCounter:
        return copy.deepcopy(self)


# One per process: the engine core's model is the one being compiled.
compilation_counter = CompilationCounter()
