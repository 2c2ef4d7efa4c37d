"""A short profile of one decode step under each compilation / CUDA-graph mode.

    python benchmarks/gpu_profile_modes.py --out DIR [--batch 1] [--record [DIR]]

Qwen3-0.6B config, dummy bf16 weights, ``--batch`` requests decoding at context 512,
in-process (``EngineCore.step_fn``, the default async loop), under the four settings
that ``gpu_throughput.py --parts modes`` compares: ``-O0`` eager, ``-O0`` with
FULL_DECODE_ONLY graphs, ``-O1`` (PIECEWISE) and the default ``-O2``
(FULL_AND_PIECEWISE). Per mode, over 20 steps: wall time per step; GPU busy time
and kernels per step (torch.profiler's device events); the host's launches per
step (``cudaLaunchKernel`` and friends against ``cudaGraphLaunch``); the graph mode
the runner chose. That is what compilation fused and what the graphs saved: fewer,
larger kernels, and a handful of graph launches instead of hundreds of kernel
launches. Writes DIR/gpu_profile_modes_b<batch>_<gpu>.json; ``--device cpu`` is a
check of the script (the O0 setting alone: no graphs there).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from benchmarks import results_store  # noqa: E402
from benchmarks.gpu_profile_step import decode_core, sync  # noqa: E402
from benchmarks.gpu_throughput import COMPILED_MODES, model_dir  # noqa: E402
from engine.utils.torch_utils import release_device_memory  # noqa: E402

# name -> (optimization level, compilation_config); the default O2 first.
MODES = {"O2 FULL_AND_PIECEWISE (default)": (2, {}), "O0 eager": (0, {}), **COMPILED_MODES}
# Host-side CUDA runtime calls that each launch one kernel (or copy), and a graph's.
KERNEL_LAUNCHES = ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernelEx")
GRAPH_LAUNCH = "cudaGraphLaunch"


def profile_mode(path: str, level: int, compilation: dict, args) -> dict:
    start = time.perf_counter()
    core = decode_core(
        path, args.device, args.batch, optimization_level=level, compilation_config=compilation
    )
    startup = time.perf_counter() - start
    config = core.glassbox_config
    try:
        for _ in range(5):  # the prefill and the first decodes
            core.step_fn()
        sync(args.device)
        start = time.perf_counter()
        for _ in range(args.steps):
            core.step_fn()
        sync(args.device)
        wall_ms = (time.perf_counter() - start) / args.steps * 1e3
        activities = [torch.profiler.ProfilerActivity.CPU]
        if args.device == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        with torch.profiler.profile(activities=activities) as prof:
            for _ in range(args.steps):
                core.step_fn()
            sync(args.device)
        events = prof.events()
        device = [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA]
        host = [e.name for e in events if e.device_type == torch.autograd.DeviceType.CPU]
        runner = core.model_executor.driver_worker.model_runner
        return {
            "optimization_level": level,
            "cudagraph_mode": config.compilation_config.cudagraph_mode.name,
            "compilation_mode": config.compilation_config.mode.name,
            "engine_startup_seconds": startup,
            "wall_ms_per_step": wall_ms,
            "gpu_busy_ms_per_step": sum(e.device_time_total for e in device) / args.steps / 1e3,
            "gpu_kernels_per_step": len(device) / args.steps,
            "kernel_launches_per_step": sum(host.count(n) for n in KERNEL_LAUNCHES) / args.steps,
            "graph_launches_per_step": host.count(GRAPH_LAUNCH) / args.steps,
            # What the dispatcher gives a pure-decode batch of this size.
            "decode_graph_mode": runner.cudagraph_dispatcher.dispatch(
                args.batch, uniform_decode=True, query_len=1
            )[0].name,
        }
    finally:
        core.shutdown()
        del core
        release_device_memory()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="out", help="the directory to write the JSON into")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--device", default="cuda", help="cuda (the measurement) or cpu (a check)")
    ap.add_argument(
        "--modes", default="", help="comma-separated names from MODES (default: every mode)"
    )
    results_store.add_record_arguments(ap)
    args = ap.parse_args()
    picked = [name.strip() for name in args.modes.split(",") if name.strip()]
    unknown = [name for name in picked if name not in MODES]
    if unknown:
        ap.error(f"--modes: unknown mode {unknown[0]!r}; modes: {list(MODES)}")
    from engine.benchmarks.throughput import provenance

    path = model_dir()
    modes = MODES if args.device == "cuda" else {"O0 eager": (0, {})}
    if picked:
        modes = {name: MODES[name] for name in picked}
    result = {
        "benchmark": "gpu_profile_modes",
        **provenance(),
        "commit": results_store.commit_id(),
        "device": args.device,
        "batch": args.batch,
        "context": 512,
        "steps": args.steps,
        "model": "Qwen3-0.6B config, dummy weights, bf16",
        "modes": {},
    }
    out_path = results_store.output_path(args.out + "/", result)
    for name, (level, compilation) in modes.items():
        # A fresh process per mode: an in-process engine's CUDA graphs and
        # compiled code hold their memory until the process ends, and the next
        # engine would find none left for its KV blocks.
        with multiprocessing.get_context("spawn").Pool(1) as pool:
            result["modes"][name] = pool.apply(profile_mode, (path, level, compilation, args))
        print(name, json.dumps(result["modes"][name]), flush=True)
        out_path.write_text(results_store.dump_result(result))
    if args.record:
        stored = results_store.record(result, args.record, note=args.note)
        print(f"recorded {stored} (and its history line)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
