"""The Dynamo backend: split the model's graph at the attention ops and
compile every piece in between.

vLLM twin: ``vllm/compilation/backends.py`` (``VllmBackend``,
``split_graph``, ``PiecewiseCompileInterpreter``).
Read it for the piecewise design. Dynamo hands ``GlassboxBackend`` one FX
graph of the whole ``forward(input_ids, positions)``, with the token count
as a symbol. ``split_graph`` cuts it at every ``splitting_ops`` node (the
attention custom op), so a model of L layers becomes 2L + 1 submodules:
L + 1 pieces of ordinary tensor maths (embedding + first q/k/v; o-proj,
MLP, norms and the next q/k/v; ...; the last MLP and the final norm) and L
attention calls between them. ``PiecewiseCompileInterpreter`` runs the split
graph once on fake tensors so each piece sees example inputs of the right
shapes, compiles it (Inductor, or eager) and, on CUDA with graphs on, wraps
it in a PIECEWISE ``CUDAGraphWrapper``. Attention
stays outside every piece: it reads the step's metadata and may launch
shape-dependent kernels, which a graph could not replay for a mixed batch.
Sessions: 06 (compilation).

Simpler than vLLM: no custom Inductor passes (fusions of norm + quant,
all-reduce + norm, ...), no Inductor graph partition, no merging of
allocation-only pieces; the cache is Inductor's own (compiler_interface.py).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from collections.abc import Sequence
from typing import Any

import torch
from torch import fx
from torch.fx.passes.split_module import split_module

from engine.compilation.compiler_interface import make_compiler
from engine.compilation.counter import compilation_counter
from engine.compilation.cuda_graph import CUDAGraphWrapper
from engine.compilation.piecewise_backend import PiecewiseBackend
from engine.config.compilation import CompilationConfig, CUDAGraphMode

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class SplitItem:
    submod_name: str
    graph_id: int
    is_splitting_graph: bool  # an attention call, run eagerly
    graph: fx.GraphModule


def resolve_defined_ops(op_names: list[str]) -> list[Any]:
    """``"glassbox::unified_attention_with_output"`` -> the op packet and its
    overloads, as they appear as FX node targets."""
    targets: list[Any] = []
    for name in op_names:
        namespace, _, op = name.partition("::")
        packet = getattr(getattr(torch.ops, namespace), op)
        targets.append(packet)
        targets.extend(getattr(packet, overload) for overload in packet.overloads())
    return targets


def split_graph(
    graph: fx.GraphModule, splitting_ops: list[str]
) -> tuple[fx.GraphModule, list[SplitItem]]:
    """Cut ``graph`` before and after every splitting op. Each splitting op
    gets a submodule of its own; the nodes between two of them share one."""
    targets = resolve_defined_ops(splitting_ops)
    subgraph_id = 0
    node_to_subgraph_id: dict[fx.Node, int] = {}
    split_op_graphs: list[int] = []
    for node in graph.graph.nodes:
        if node.op in ("placeholder", "output"):
            continue
        if node.op == "call_function" and node.target in targets:
            subgraph_id += 1
            node_to_subgraph_id[node] = subgraph_id
            split_op_graphs.append(subgraph_id)
            subgraph_id += 1
        else:
            node_to_subgraph_id[node] = subgraph_id
    # keep_original_order: the pieces run in the order the model wrote them.
    split_gm = split_module(
        graph, None, lambda node: node_to_subgraph_id[node], keep_original_order=True
    )
    items = []
    names = [name for (name, _) in split_gm.named_modules() if "." not in name and name]
    for name in names:
        graph_id = int(name.replace("submod_", ""))
        module = getattr(split_gm, name)
        items.append(SplitItem(name, graph_id, graph_id in split_op_graphs, module))
    items.sort(key=lambda item: item.graph_id)
    return split_gm, items


class PiecewiseCompileInterpreter(torch.fx.Interpreter):
    """Runs the split graph on fake tensors; each piece it reaches is compiled
    for a symbolic token count with the inputs it just received, then
    replaced (in the split graph) by its ``PiecewiseBackend``."""

    def __init__(
        self,
        module: fx.GraphModule,
        compile_submod_names: list[str],
        backend: GlassboxBackend,
    ) -> None:
        super().__init__(module)
        self.fake_mode = torch._guards.detect_fake_mode()
        self.compile_submod_names = compile_submod_names
        self.backend = backend

    def run(self, *args: Any) -> Any:
        # Parameters arrive as real tensors; the whole run must be fake.
        fake_args = [
            self.fake_mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args
        ]
        with self.fake_mode:
            return super().run(*fake_args)

    def call_module(self, target: Any, args: Any, kwargs: Any) -> Any:
        output = super().call_module(target, args, kwargs)
        if target in self.compile_submod_names:
            index = self.compile_submod_names.index(target)
            submod = self.fetch_attr(target)
            sym_shape_indices = [i for i, a in enumerate(args) if isinstance(a, torch.SymInt)]
            piece = self.backend.compile_piece(submod, args, index, sym_shape_indices)
            # Not setattr: nn.Module would refuse a child that is not a Module.
            self.module.__dict__[target] = piece
        return output


class GlassboxBackend:
    """The ``backend=`` torch.compile gets under ``CompilationMode.VLLM_COMPILE``."""

    def __init__(
        self,
        compilation_config: CompilationConfig,
        cache_key: str,
        device_type: str,
        graph_pool: Any = None,
    ) -> None:
        self.compilation_config = compilation_config
        self.compiler = make_compiler(
            compilation_config.backend, compilation_config.inductor_compile_config
        )
        self.cache_dir = os.path.join(compilation_config.resolved_cache_dir(), cache_key)
        self.device_type = device_type
        self.graph_pool = graph_pool
        self.split_gm: fx.GraphModule | None = None
        self.piecewise_graphs: list[SplitItem] = []
        self.compile_seconds = 0.0
        self.total_piecewise_compiles = 0
        # Every piece's backend, in model order (their per-size compile times).
        self.piecewise_backends: list[PiecewiseBackend] = []

    def compile_piece(
        self,
        submod: fx.GraphModule,
        example_inputs: Sequence[Any],
        index: int,
        sym_shape_indices: list[int],
    ) -> Any:
        general = self.compiler.compile(submod, example_inputs, runtime_shape=None)
        backend = PiecewiseBackend(
            submod,
            list(self.compilation_config.compile_sizes or []),
            index,
            self.total_piecewise_compiles,
            sym_shape_indices,
            general,
            self.compiler,
        )
        self.piecewise_backends.append(backend)
        piece: Any = backend
        # Wrapped whenever graphs are on: the runner settles the mode (FULL may
        # become FULL_AND_PIECEWISE) after the model is compiled; a wrapper
        # calls straight through in any step that is not PIECEWISE.
        mode = self.compilation_config.cudagraph_mode
        if self.device_type == "cuda" and mode != CUDAGraphMode.NONE:
            piece = CUDAGraphWrapper(piece, CUDAGraphMode.PIECEWISE, self.graph_pool)
        return piece

    def release(self) -> None:
        """Drop the split graph, its pieces and their CUDA graphs, and the
        config (its ``static_forward_context`` reaches the KV cache): Dynamo
        keeps every backend it was given for the life of the process."""
        self.split_gm = None
        self.piecewise_graphs = []
        self.piecewise_backends = []
        self.compilation_config = None  # type: ignore[assignment]

    def __call__(self, graph: fx.GraphModule, example_inputs: Sequence[Any]) -> Any:
        compilation_counter.num_graphs_seen += 1
        start = time.perf_counter()
        self.compiler.initialize_cache(self.cache_dir)
        splitting_ops = self.compilation_config.splitting_ops or []
        self.split_gm, self.piecewise_graphs = split_graph(graph, splitting_ops)
        compilation_counter.num_piecewise_graphs_seen += len(self.piecewise_graphs)
        submod_names = [
            item.submod_name for item in self.piecewise_graphs if not item.is_splitting_graph
        ]
        compilation_counter.num_piecewise_capturable_graphs_seen += len(submod_names)
        self.total_piecewise_compiles = len(submod_names)
        PiecewiseCompileInterpreter(self.split_gm, submod_names, self).run(*example_inputs)
        self.compile_seconds = time.perf_counter() - start
        logger.info(
            "compiled %d pieces (%d attention splits) with %s in %.1fs; cache %s",
            len(submod_names),
            len(self.piecewise_graphs) - len(submod_names),
            self.compiler.name,
            self.compile_seconds,
            self.cache_dir,
        )
        return self.split_gm
