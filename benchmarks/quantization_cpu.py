"""The embedded model from its Q4_1 GGUF file against its float32 conversion, on the CPU.

Each variant runs in a process of its own (so its resident memory is its
own): load ``LLM("default")`` or ``LLM("default", quantization="gguf")``,
then generate ``--num-prompts`` prompts of ``--input-len`` tokens,
``--output-len`` greedy tokens each (EOS ignored), all in one batch. Reported
per variant: the parameters' bytes as stored, the process's resident memory
after loading and after generating (psutil RSS), load time, output tokens per
second, and whether the tokens equal the float32 model's.

Usage: python benchmarks/quantization_cpu.py --out DIR/ [--record]
Writes ``DIR/quantization_cpu.json``; ``--record`` stores it in
benchmarks/results (``results_store.py``).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks import results_store

VARIANTS = {"float32": None, "gguf_q4_1": "gguf"}


def run_variant(quantization: str | None, num_prompts: int, input_len: int, output_len: int):
    """In this process: load, generate, measure (called in a child process)."""
    import psutil

    os.environ["GLASSBOX_ENABLE_MULTIPROCESSING"] = "0"
    from engine import LLM, SamplingParams

    proc = psutil.Process()
    start = time.perf_counter()
    llm = LLM("default", quantization=quantization, max_model_len=1024)
    load_s = time.perf_counter() - start
    runner = llm.llm_engine.engine_core.engine_core.model_executor.driver_worker.model_runner
    weight_bytes = sum(p.numel() * p.element_size() for p in runner.model.parameters())
    rss_loaded = proc.memory_info().rss
    prompts = [
        {"prompt_token_ids": [(17 * i + 29 * j) % 40000 + 100 for j in range(input_len)]}
        for i in range(num_prompts)
    ]
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    llm.generate(prompts[:1], SamplingParams(max_tokens=2), use_tqdm=False)  # warm-up
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    gen_s = time.perf_counter() - start
    result = {
        "weight_bytes": weight_bytes,
        "rss_after_load_bytes": rss_loaded,
        "rss_after_generate_bytes": proc.memory_info().rss,
        "load_s": load_s,
        "generate_s": gen_s,
        "output_tokens_per_second": num_prompts * output_len / gen_s,
        "token_ids": [list(o.outputs[0].token_ids) for o in outs],
    }
    llm.shutdown()
    return result


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="out/")
    ap.add_argument("--num-prompts", type=int, default=4)
    ap.add_argument("--input-len", type=int, default=64)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--child", choices=list(VARIANTS), help=argparse.SUPPRESS)
    results_store.add_record_arguments(ap)
    args = ap.parse_args()
    sizes = (args.num_prompts, args.input_len, args.output_len)
    if args.child:
        print(json.dumps(run_variant(VARIANTS[args.child], *sizes)))
        return 0
    import platform

    import torch

    variants = {}
    for name in VARIANTS:
        child = [sys.executable, __file__, "--child", name, "--num-prompts", str(sizes[0])]
        child += ["--input-len", str(sizes[1]), "--output-len", str(sizes[2])]
        out = subprocess.run(child, check=True, capture_output=True, text=True).stdout
        variants[name] = json.loads(out.strip().splitlines()[-1])
        print(name, {k: v for k, v in variants[name].items() if k != "token_ids"}, flush=True)
    reference = variants["float32"]
    for v in variants.values():
        v["tokens_equal_float32"] = v["token_ids"] == reference["token_ids"]
        v["weight_fraction_of_float32"] = v["weight_bytes"] / reference["weight_bytes"]
    for v in variants.values():
        del v["token_ids"]
    result = {
        "benchmark": "quantization",
        "device": "cpu",
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "commit": results_store.commit_id(),
        "machine": {"cpu": platform.processor() or platform.machine(), "cpus": os.cpu_count()},
        "torch": torch.__version__,
        "model": "SmolLM2-135M-Instruct (default)",
        "num_prompts": sizes[0],
        "input_len": sizes[1],
        "output_len": sizes[2],
        "variants": variants,
    }
    path = results_store.output_path(args.out, result)
    path.write_text(results_store.dump_result(result))
    print(f"wrote {path}")
    if args.record:
        print(f"recorded {results_store.record(result, args.record, note=args.note)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
