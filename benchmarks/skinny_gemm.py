"""Decode-sized GEMMs: cuBLAS (``F.linear``) against the Triton skinny GEMM, per layer shape.

    python benchmarks/skinny_gemm.py --out DIR [--rows 1,4,8] [--record] [--note TEXT]

For each linear layer of the Qwen3-0.6B config (qkv, o, gate_up, down, the LM head) and
each row count, times one call of ``F.linear`` and of ``engine.model_executor.layers.
skinny_gemm.skinny_gemm`` under each tile in ``CONFIGS``, and reports the fastest tile, its
error against ``F.linear`` and the weights' bytes over the time (TB/s). Each timing replays
a CUDA graph of ``CALLS`` calls, as the engine replays a decode step, so launch cost is the
graph's and not Python's; the calls cycle through copies of the weight whose total exceeds
the L2 cache, so every call reads its weight from HBM as a decode step does (one read per
weight per step). The JSON goes to ``DIR/skinny_gemm_<gpu>.json``.

``--device cpu`` runs the shapes scaled down through the same code (a check of the script,
not a measurement; under ``TRITON_INTERPRET=1``).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from benchmarks import results_store  # noqa: E402

# (name, N, K) of Qwen3-0.6B: hidden 1024, 16 q heads and 8 kv heads of 128, MLP 3072,
# vocabulary 151,936 (perf.md §9).
SHAPES = [
    ("qkv_proj", 4096, 1024),
    ("o_proj", 1024, 2048),
    ("gate_up_proj", 6144, 1024),
    ("down_proj", 1024, 3072),
    ("lm_head", 151936, 1024),
]
# Tiles tried: (block_n, block_k, num_warps, num_stages). One row multiplies and sums
# (any block_n); several rows use tl.dot, which needs block_n >= 16.
CONFIGS = [
    (4, 512, 4, 3),
    (8, 256, 4, 3),
    (8, 512, 4, 3),
    (16, 256, 4, 3),
    (16, 512, 4, 3),
    (32, 256, 4, 3),
    (32, 128, 4, 4),
    (64, 128, 4, 4),
]
CALLS = 50  # calls per graph replay
L2_BYTES = 60 * 2**20  # above the H200's 50 MB L2: copies of the weight spill out of it


def time_calls(fn, copies: int, replays: int) -> float:
    """Microseconds per call of ``fn(i)`` (i picks the weight copy), from a CUDA graph."""
    import torch

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for i in range(3):  # warm-up outside the capture (Triton compiles here)
            fn(i % copies)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(CALLS):
            fn(i % copies)
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e3 / (replays * CALLS)


def measure(device: str, rows_list: list[int], replays: int) -> dict:
    import torch
    import torch.nn.functional as F

    from engine.model_executor.layers.skinny_gemm import SkinnyGemmConfig, skinny_gemm

    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    scale = 1 if device == "cuda" else 64  # the CPU check runs small shapes
    torch.manual_seed(0)
    shapes = {}
    for name, n, k in SHAPES:
        n, k = max(n // scale, 16), max(k // scale, 16)
        nbytes = n * k * torch.finfo(dtype).bits // 8
        copies = max(2, -(-L2_BYTES // nbytes)) if device == "cuda" else 2
        weights = [torch.randn(n, k, device=device, dtype=dtype) / k**0.5 for _ in range(copies)]
        per_rows = {}
        for rows in rows_list:
            x = torch.randn(rows, k, device=device, dtype=dtype)
            ref = F.linear(x.float(), weights[0].float())
            entry = {}
            if device == "cuda":
                entry["cublas_us"] = time_calls(
                    lambda i, x=x, ws=weights: F.linear(x, ws[i]), copies, replays
                )
            tiles = {}
            for bn, bk, warps, stages in CONFIGS:
                if rows > 1 and bn < 16:
                    continue
                cfg = SkinnyGemmConfig(bn, bk, warps, stages)
                got = skinny_gemm(x, weights[0], config=cfg)
                err = (got.float() - ref).abs().max().item()
                tile = {"max_abs_err": err}
                if device == "cuda":
                    tile["us"] = time_calls(
                        lambda i, c=cfg, x=x, ws=weights: skinny_gemm(x, ws[i], config=c),
                        copies,
                        replays,
                    )
                tiles[f"n{bn}_k{bk}_w{warps}_s{stages}"] = tile
            entry["tiles"] = tiles
            cublas_err = (F.linear(x, weights[0]).float() - ref).abs().max().item()
            entry["cublas_max_abs_err"] = cublas_err
            if device == "cuda":
                best = min(tiles, key=lambda t: tiles[t]["us"])
                entry["best_tile"] = best
                entry["best_us"] = tiles[best]["us"]
                entry["speedup_over_cublas"] = entry["cublas_us"] / entry["best_us"]
                entry["best_tb_per_s"] = nbytes / (entry["best_us"] * 1e-6) / 1e12
                entry["cublas_tb_per_s"] = nbytes / (entry["cublas_us"] * 1e-6) / 1e12
            per_rows[str(rows)] = entry
            print(
                name, rows, json.dumps({k: v for k, v in entry.items() if k != "tiles"}), flush=True
            )
        shapes[name] = {"n": n, "k": k, "weight_bytes": nbytes, "copies": copies, "rows": per_rows}
    return shapes


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="out", help="the directory to write the JSON into")
    ap.add_argument("--rows", default="1,4,8", help="row counts of x (comma-separated)")
    ap.add_argument("--replays", type=int, default=20, help="graph replays per timing")
    ap.add_argument("--device", default="cuda", help="cuda (the measurement) or cpu (a check)")
    results_store.add_record_arguments(ap)
    args = ap.parse_args()
    rows_list = [int(r) for r in args.rows.split(",") if r.strip()]
    from engine.benchmarks.throughput import provenance

    result = {
        "benchmark": "skinny_gemm",
        **provenance(),
        "commit": results_store.commit_id(),
        "device": args.device,
        "model": "Qwen3-0.6B linear shapes, random bf16 weights",
        "calls_per_graph": CALLS,
    }
    t0 = time.perf_counter()
    result["shapes"] = measure(args.device, rows_list, args.replays)
    result["wall_s"] = round(time.perf_counter() - t0, 1)
    out_path = results_store.output_path(args.out + "/", result)
    out_path.write_text(results_store.dump_result(result))
    print(f"wrote {out_path} in {result['wall_s']} s", flush=True)
    if args.record:
        stored = results_store.record(result, args.record, note=args.note)
        print(f"recorded {stored} (and its history line)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
