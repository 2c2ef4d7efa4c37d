"""Async scheduling on and off, side by side (issue 18).

The same measurements with ``async_scheduling=False`` (the serial loop:
schedule, forward, wait, update) and ``True`` (vLLM's default: step N+1 is
scheduled and launched before step N's tokens are read), interleaved round
by round so background load hits both alike; medians over rounds.

  * throughput -- CPU: the workload of ``cpu_vs_transformers.py`` (32 chat
    questions through ``LLM.chat``, 64 tokens each, greedy, EOS ignored) on
    the default model; CUDA: nano-vllm's workload (256 sequences, in and out
    100-1024 tokens, T=0.6) on the Qwen3-0.6B config with dummy bf16 weights.
    Output tokens per second of one ``generate``/``chat`` call.
  * client inter-token time at batch 1 -- ``engine.benchmarks.latency.
    run_client_itl``: the gaps between a request's tokens as they reach the
    front end (EngineCore in its own process), median.
  * decode step at batch 1 (and 16, 64 on CUDA) -- ``run_decode_latency``:
    the time per ``EngineCore.step_fn()`` call in steady decoding.

Run:  .venv/bin/python benchmarks/async_scheduling.py --device cpu --rounds 3 --out OUT/
      python3 benchmarks/async_scheduling.py --device cuda --rounds 2 --out $OUT/   (the H200)
Writes ``OUT/async_scheduling_<machine>.json`` (``_cpu`` or ``_h200``);
``--record`` stores it in benchmarks/results (``results_store.py``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import traceback
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from benchmarks import results_store  # noqa: E402

MODES = {"sync": False, "async": True}


def cpu_setup() -> dict[str, Any]:
    from benchmarks.cpu_vs_transformers import QUESTIONS, conversations
    from engine.model_executor.model_loader.default_model import get_default_model_path

    path = get_default_model_path()

    def engine_kwargs(async_scheduling: bool, **extra: Any) -> dict[str, Any]:
        return dict(model=path, device="cpu", async_scheduling=async_scheduling, **extra)

    def throughput(async_scheduling: bool) -> dict[str, Any]:
        from engine import LLM, SamplingParams

        llm = LLM(**engine_kwargs(async_scheduling))
        try:
            params = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
            llm.chat(conversations(QUESTIONS[:2]), params, use_tqdm=False)  # warm-up
            llm.reset_prefix_cache()
            start = time.perf_counter()
            outs = llm.chat(conversations(QUESTIONS), params, use_tqdm=False)
            elapsed = time.perf_counter() - start
        finally:
            llm.shutdown()
        tokens = sum(len(o.outputs[0].token_ids) for o in outs)
        return {"output_tokens": tokens, "seconds": elapsed, "tokens_per_s": tokens / elapsed}

    return {
        "model": "SmolLM2-135M-Instruct (default model), float32",
        "throughput_workload": "cpu_vs_transformers: 32 chat questions, 64 tokens, greedy",
        "engine_args": lambda a, **extra: _engine_args(engine_kwargs(a, **extra)),
        "throughput": throughput,
        "itl": {"input_len": 128, "output_len": 64},
        "latency": {"batch_sizes": [1], "input_len": 128, "num_iters": 32},
    }


def cuda_setup() -> dict[str, Any]:
    from benchmarks.gpu_throughput import engine_args, model_dir
    from engine.benchmarks.datasets import sample_random_requests
    from engine.benchmarks.throughput import run_glassbox

    path = model_dir()
    requests = sample_random_requests()

    def throughput(async_scheduling: bool) -> dict[str, Any]:
        r = run_glassbox(requests, engine_args(path, False, async_scheduling=async_scheduling))
        return {
            "output_tokens": r["total_output_tokens"],
            "seconds": r["elapsed_time"],
            "tokens_per_s": r["output_tokens_per_second"],
        }

    return {
        "model": "Qwen3-0.6B config, dummy weights, bf16",
        "throughput_workload": "nano-vllm bench.py: 256 seqs, in/out 100-1024, T=0.6",
        "engine_args": lambda a, **extra: engine_args(path, False, async_scheduling=a, **extra),
        "throughput": throughput,
        "itl": {"input_len": 512, "output_len": 128},
        "latency": {"batch_sizes": [1, 16, 64], "input_len": 512, "num_iters": 64},
    }


def _engine_args(kwargs: dict[str, Any]) -> Any:
    from engine.engine.arg_utils import EngineArgs

    return EngineArgs(**kwargs)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--rounds", type=int, default=2, help="rounds of every mode (interleaved)")
    ap.add_argument(
        "--parts", default="itl,latency,throughput", help="comma-separated: itl,latency,throughput"
    )
    ap.add_argument("--out", default="out/", help="a directory (OUT/<series>.json) or a file")
    results_store.add_record_arguments(ap)
    args = ap.parse_args(argv)
    if args.rounds < 1:
        ap.error(f"--rounds must be >= 1, got {args.rounds}")
    parts = [p.strip() for p in args.parts.split(",") if p.strip()]
    unknown = set(parts) - {"itl", "latency", "throughput"}
    if unknown:
        ap.error(f"--parts: unknown {sorted(unknown)}")

    from engine.benchmarks.latency import run_client_itl, run_decode_latency
    from engine.benchmarks.throughput import provenance

    setup = cuda_setup() if args.device == "cuda" else cpu_setup()
    result: dict[str, Any] = {
        "benchmark": "async_scheduling",
        "device": args.device,
        **provenance(),
        "commit": results_store.commit_id(),
        "model": setup["model"],
        "throughput_workload": setup["throughput_workload"],
        "itl_settings": setup["itl"],
        "latency_settings": setup["latency"],
        "rounds": args.rounds,
        "cpu_count": os.cpu_count(),
        "runs": {mode: {part: [] for part in parts} for mode in MODES},
    }
    out_path = results_store.output_path(args.out, result)

    def save() -> None:
        result["summary"] = summarize(result["runs"])
        out_path.write_text(results_store.dump_result(result))

    for round_index in range(args.rounds):
        for mode, async_scheduling in MODES.items():
            for part in parts:
                try:
                    if part == "throughput":
                        value = setup["throughput"](async_scheduling)
                    elif part == "itl":
                        value = run_client_itl(
                            setup["engine_args"](async_scheduling, skip_tokenizer_init=True),
                            1,
                            setup["itl"]["input_len"],
                            setup["itl"]["output_len"],
                        )
                    else:
                        value = run_decode_latency(
                            setup["engine_args"](async_scheduling, enable_prefix_caching=False),
                            setup["latency"]["batch_sizes"],
                            input_len=setup["latency"]["input_len"],
                            num_iters=setup["latency"]["num_iters"],
                        )
                        for entry in value.values():
                            entry.pop("step_ms", None)
                except Exception:  # noqa: BLE001 -- keep the other figures; say what failed
                    value = {"error": traceback.format_exc(limit=8)}
                result["runs"][mode][part].append(value)
                print(
                    f"round {round_index} {mode:5s} {part}: {json.dumps(value)[:400]}", flush=True
                )
                save()
    save()
    print(json.dumps(result["summary"], indent=1))
    if args.record:
        stored = results_store.record(result, args.record, note=args.note)
        print(f"recorded {stored} (and its history line)")
    return 0


def summarize(runs: dict[str, dict[str, list[Any]]]) -> dict[str, Any]:
    """Medians over rounds, per mode, and async's change against sync."""
    summary: dict[str, Any] = {}
    for mode, parts in runs.items():
        s: dict[str, Any] = {}
        ok = {p: [r for r in rs if "error" not in r] for p, rs in parts.items()}
        if ok.get("throughput"):
            s["throughput_tokens_per_s"] = statistics.median(
                r["tokens_per_s"] for r in ok["throughput"]
            )
        if ok.get("itl"):
            s["client_itl_batch1_median_ms"] = statistics.median(
                r["median_itl_ms"] for r in ok["itl"]
            )
        if ok.get("latency"):
            for b in ok["latency"][0]:
                s[f"decode_step_batch{b}_median_ms"] = statistics.median(
                    r[b]["median_ms"] for r in ok["latency"] if b in r
                )
        summary[mode] = s
    if summary.get("sync") and summary.get("async"):
        summary["async_over_sync"] = {
            k: summary["async"][k] / summary["sync"][k]
            for k in summary["async"]
            if k in summary["sync"] and summary["sync"][k]
        }
    return summary


if __name__ == "__main__":
    sys.exit(main())
