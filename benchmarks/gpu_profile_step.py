"""Where one decode step's time goes on the GPU (issue 7: explain missed targets).

Runs Qwen3-0.6B (dummy weights, bf16) in-process, one request decoding at
context 512 with CUDA graphs, and reports for 50 steps: wall time per step,
GPU time per step (CUDA events around the model call would hide host gaps,
so torch.profiler's device total is used), and the top host-side functions
from cProfile. Usage: python3 benchmarks/gpu_profile_step.py --out DIR [--record [RESULTS_DIR]]
Writes DIR/gpu_profile_step_b<batch>_<gpu>.json (the figures) and .txt (the
cProfile and torch.profiler tables); ``--record`` stores both in
benchmarks/results (``results_store.py``).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from benchmarks import results_store  # noqa: E402
from benchmarks.gpu_throughput import model_dir  # noqa: E402


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def decode_core(path: str, device: str, batch: int, **overrides):
    """An in-process EngineCore on the dummy Qwen3-0.6B at ``path`` with ``batch``
    requests of 512 prompt tokens added (400 tokens each to generate)."""
    from engine.engine.arg_utils import EngineArgs
    from engine.sampling_params import SamplingParams
    from engine.v1.engine.core import EngineCore
    from engine.v1.executor.abstract import Executor
    from engine.v1.request import Request

    eargs = EngineArgs(
        model=path,
        load_format="dummy",
        skip_tokenizer_init=True,
        max_model_len=4096,
        max_num_seqs=256,
        device=device,
        disable_log_stats=True,
        enable_prefix_caching=False,
        **overrides,
    )
    config = eargs.create_engine_config()
    core = EngineCore(config, Executor.get_class(config), log_stats=False)
    for i in range(batch):
        core.add_request(
            Request(
                f"r{i}",
                [(i + j) % 10000 for j in range(512)],
                SamplingParams(temperature=0, ignore_eos=True, max_tokens=400),
            )
        )
    return core


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="out", help="the directory to write the results into")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument(
        "--device", default="cuda", help="cuda (the measurement) or cpu (a check of this script)"
    )
    results_store.add_record_arguments(ap)
    args = ap.parse_args()
    from engine.benchmarks.throughput import provenance

    path = model_dir()
    core = decode_core(path, args.device, args.batch)
    for _ in range(5):
        core.step_fn()
    sync(args.device)
    steps = args.steps
    t = time.perf_counter()
    for _ in range(steps):
        core.step_fn()
    sync(args.device)
    wall_ms = (time.perf_counter() - t) / steps * 1e3

    prof = cProfile.Profile()
    prof.enable()
    for _ in range(steps):
        core.step_fn()
    sync(args.device)
    prof.disable()
    s = io.StringIO()
    pstats.Stats(prof, stream=s).sort_stats("cumulative").print_stats(45)

    with torch.profiler.profile(
        activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    ) as tp:
        for _ in range(10):
            core.step_fn()
        sync(args.device)
    table = tp.key_averages().table(sort_by="cuda_time_total", row_limit=25)
    gpu_us = sum(e.self_device_time_total for e in tp.key_averages()) / 10
    kernels = [e for e in tp.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    stats = pstats.Stats(prof)
    # Host time per phase of EngineCore.step (cumulative, ms per step).
    phases = {
        "EngineCore.step": "core.py:step",
        "EngineCore.step_with_batch_queue": "core.py:step_with_batch_queue",
        "AsyncGPUModelRunnerOutput.get_output (tokens wait)": "gpu_model_runner.py:get_output",
        "Scheduler.schedule": "scheduler.py:schedule",
        "GPUModelRunner.execute_model": "gpu_model_runner.py:execute_model",
        "GPUModelRunner._prepare_inputs": "gpu_model_runner.py:_prepare_inputs",
        "AttentionMetadataBuilder.build": ":build",
        "CUDAGraph.replay": "graphs.py:replay",
        "GPUModelRunner.sample_tokens": "gpu_model_runner.py:sample_tokens",
        "Sampler.forward": "sampler.py:forward",
        "Scheduler.update_from_output": "scheduler.py:update_from_output",
    }
    host_ms = {}
    for label, key in phases.items():
        file_part, func = key.split(":")
        total = sum(
            v[3] for (f, _, fn), v in stats.stats.items() if fn == func and f.endswith(file_part)
        )
        host_ms[label] = total / steps * 1e3
    result = {
        "benchmark": "gpu_profile_step",
        **provenance(),
        "commit": results_store.commit_id(),
        "device": args.device,
        "batch": args.batch,
        "model": "Qwen3-0.6B config, dummy weights, bf16",
        "context": 512,
        "wall_ms_per_step": wall_ms,
        "gpu_ms_per_step": gpu_us / 1e3,
        "gpu_kernels_per_step": len(kernels) / 10,
        "host_ms_per_step_under_cprofile": host_ms,
        "attention_backend": core.model_executor.driver_worker.model_runner.attn_backend.get_name(),
        "async_scheduling": core.async_scheduling,
    }
    print(json.dumps(result))
    text = json.dumps(result) + "\n\n" + s.getvalue() + "\n\n" + table
    out_path = results_store.output_path(args.out + "/", result)
    out_path.write_text(results_store.dump_result(result))
    out_path.with_suffix(".txt").write_text(text)
    if args.record:
        stored = results_store.record(result, args.record, text=text, note=args.note)
        print(f"recorded {stored} (and its history line)", flush=True)
    core.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
