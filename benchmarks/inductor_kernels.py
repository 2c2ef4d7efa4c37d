"""Which kernels Inductor would launch on a GPU for each compiled piece, found on the CPU.

    python benchmarks/inductor_kernels.py [--layers 3] [--combo] [--show-code DIR]

The Qwen3-0.6B config (``--layers`` of its 28 layers), dummy bf16 weights, compiled
the default way (``-O2``: the graph cut at attention, the layers' plain-torch code, no
custom ops) in an engine on the CPU. Each piece the backend would hand to Inductor is
kept, then given to Inductor again with ``cpu_backend="triton"``: its Triton code
generator, which makes the fusion decisions it makes for CUDA (the same scheduler and
the same Triton rules; launch parameters differ, kernel boundaries do not). The code is
generated, never compiled: the script stops when Inductor would load the module, and
lists, per piece, the Triton kernels and the library calls (``extern_kernels.mm``: the
GEMMs, cuBLAS on a GPU). ``--combo`` adds vLLM's GPU options ``combo_kernels`` (Inductor
otherwise keeps CPU nodes out of combo kernels; here they stand in for CUDA ones).
Run it as a script: it patches Inductor and Triton for the rest of its process.

Why: on the H200 the compiled default runs 83 more kernels per decode step than the
eager engine (docs/gpu.md); this shows which (docs/compilation.md, "Inductor's
options"). Attention runs between the pieces and is not counted here.
"""

from __future__ import annotations

import argparse
import atexit
import json
import os
import re
import shutil
import sys
import tempfile
from dataclasses import dataclass

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@dataclass
class PieceKernels:
    index: int
    triton: list[str]  # the Triton kernels' names, in launch order
    extern: list[str]  # library calls (``mm``)
    code: str  # the module Inductor generated


def capture_pieces(layers: int) -> list[tuple[object, list]]:
    """The (graph, example inputs) of every piece a ``-O2`` engine compiles."""
    import torch._inductor.compile_fx as compile_fx_module

    from benchmarks.gpu_throughput import model_dir
    from engine import LLM, SamplingParams

    captured: list[tuple[object, list]] = []
    real = compile_fx_module.compile_fx
    cache_dir = tempfile.mkdtemp(prefix="inductor-kernels-")
    atexit.register(shutil.rmtree, cache_dir, True)

    def keep(graph, example_inputs, config_patches=None, **kwargs):
        captured.append((graph, list(example_inputs)))
        return graph  # the piece runs as traced

    with open(os.path.join(model_dir(), "config.json")) as f:
        config = json.load(f)
    config["num_hidden_layers"] = layers
    compile_fx_module.compile_fx = keep
    try:
        llm = LLM(
            model_dir(config),
            load_format="dummy",
            dtype="bfloat16",
            skip_tokenizer_init=True,
            max_model_len=256,
            num_gpu_blocks_override=32,
            max_num_seqs=4,
            compilation_config={"mode": 3, "cache_dir": cache_dir},
        )
        llm.generate([{"prompt_token_ids": [1, 2, 3]}], SamplingParams(max_tokens=2))
        llm.llm_engine.engine_core.shutdown()
    finally:
        compile_fx_module.compile_fx = real
    return captured


def _generate_only() -> list[str]:
    """Let Inductor's Triton back end run without a GPU: a stand-in sm_90 target, and a
    stop where the generated module would be loaded. Returns the list the code lands in."""
    import torch._inductor.codecache as codecache
    import torch.utils._triton as torch_triton
    from triton.backends.compiler import GPUTarget
    from triton.runtime.driver import driver

    class StandInDriver:
        def get_current_target(self):
            return GPUTarget("cuda", 90, 32)

        def get_current_device(self):
            return 0

    driver.set_active(StandInDriver())
    torch_triton.triton_hash_with_backend = lambda: "STAND-IN"
    generated: list[str] = []

    def stop(cls, key, path, *args, **kwargs):
        with open(path) as f:
            generated.append(f.read())
        raise _Generated

    codecache.PyCodeCache.load_by_key_path = classmethod(stop)
    return generated


class _Generated(BaseException):
    """Not an Exception: Inductor wraps those in its own error."""


def _combo_groups_with_cpu_nodes() -> None:
    from torch._inductor import config
    from torch._inductor.scheduler import ForeachKernelSchedulerNode

    def group(scheduler):
        size = config.combo_kernel_max_num_nodes
        groups = []
        for nodes in scheduler._topological_sort_nodes():
            groups.extend(nodes[i : i + size] for i in range(0, len(nodes), size))
        return groups

    ForeachKernelSchedulerNode.set_group_algorithm_for_combo_kernels(group)


def lower(captured: list[tuple[object, list]], combo: bool) -> list[PieceKernels]:
    from torch._inductor.compile_fx import compile_fx

    generated = _generate_only()
    patches = {
        "cpu_backend": "triton",
        "fx_graph_cache": False,
        "enable_auto_functionalized_v2": False,
    }
    if combo:
        patches.update(combo_kernels=True, benchmark_combo_kernel=False)
        _combo_groups_with_cpu_nodes()
    pieces = []
    for index, (graph, inputs) in enumerate(captured):
        generated.clear()
        try:
            compile_fx(graph, inputs, config_patches=patches)
        except _Generated:
            pass
        code = generated[-1]
        pieces.append(
            PieceKernels(
                index,
                re.findall(r"^\s+(triton_\w+)\.run\(", code, re.M),
                re.findall(r"extern_kernels\.(\w+)\(", code),
                code,
            )
        )
    return pieces


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=3, help="layers of the Qwen3-0.6B config")
    ap.add_argument("--combo", action="store_true", help="with vLLM's combo_kernels")
    ap.add_argument("--show-code", metavar="DIR", help="write each piece's generated code here")
    args = ap.parse_args()
    os.environ.setdefault("GLASSBOX_ENABLE_MULTIPROCESSING", "0")  # keep the pieces here
    captured = capture_pieces(args.layers)
    for piece in lower(captured, args.combo):
        print(
            f"piece {piece.index}: {len(piece.triton)} Triton + {len(piece.extern)} library "
            f"kernels ({', '.join(piece.extern)})"
        )
        for name in piece.triton:
            print(f"    {name}")
        if args.show_code:
            os.makedirs(args.show_code, exist_ok=True)
            with open(os.path.join(args.show_code, f"piece_{piece.index}.py"), "w") as f:
                f.write(piece.code)
    return 0


if __name__ == "__main__":
    sys.exit(main())
