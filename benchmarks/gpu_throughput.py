"""GPU throughput and decode latency on the H200 (issue 7 benchmarks).

* throughput: nano-vllm's bench.py workload exactly -- 256 sequences, seed 0,
  prompts of randint(100, 1024) tokens drawn from randint(0, 10000), outputs of
  randint(100, 1024) tokens, ignore_eos, temperature 0.6 -- on the Qwen3-0.6B
  config with dummy weights; throughput = output tokens / wall time.
* roofline: the lower bound on that run's time from bytes moved (weights once
  per step, KV reads per decode token) over the copy bandwidth measured in the
  same run (../shared/reference/perf.md section 6).
* decode latency per step at batch 1, 16, 64, 256 with context 512, CUDA
  graphs on and off, against the weight + KV-read floor.

Usage: python3 benchmarks/gpu_throughput.py --out DIR [--skip-hf]
Writes DIR/gpu_throughput.json.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import random
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

QWEN3_0_6B = {
    "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 1024,
    "intermediate_size": 3072, "num_hidden_layers": 28, "num_attention_heads": 16,
    "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 151936, "rope_theta": 1000000,
    "rope_scaling": None, "tie_word_embeddings": True, "rms_norm_eps": 1e-6,
    "max_position_embeddings": 40960, "attention_bias": False, "hidden_act": "silu",
    "bos_token_id": 151643, "eos_token_id": 151645, "torch_dtype": "bfloat16",
}
PARAMS_NON_EMB = 596_049_920 - 151936 * 1024
KV_BYTES_PER_TOKEN = 2 * 28 * 8 * 128 * 2


def model_dir() -> str:
    d = tempfile.mkdtemp(prefix="qwen3-0.6b-")
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump(QWEN3_0_6B, f)
    return d


def nano_vllm_workload():
    random.seed(0)
    num_seqs, max_in, max_out = 256, 1024, 1024
    prompts = [[random.randint(0, 10000) for _ in range(random.randint(100, max_in))] for _ in range(num_seqs)]
    out_lens = [random.randint(100, max_out) for _ in range(num_seqs)]
    return prompts, out_lens


def measure_bandwidth() -> float:
    x = torch.empty(2 * 1024**3 // 2, dtype=torch.bfloat16, device="cuda")
    y = torch.empty_like(x)
    for _ in range(3):
        y.copy_(x)
    torch.cuda.synchronize()
    t = time.perf_counter()
    n = 10
    for _ in range(n):
        y.copy_(x)
    torch.cuda.synchronize()
    dt = (time.perf_counter() - t) / n
    del x, y
    torch.cuda.empty_cache()
    return 2 * 2 * 1024**3 / dt  # read + write bytes per second


def roofline_seconds(prompts, out_lens, bw: float) -> float:
    weight_bytes = 2 * (PARAMS_NON_EMB + 151936 * 1024)
    kv_reads = sum(len(p) * o + o * (o - 1) // 2 for p, o in zip(prompts, out_lens))
    decode_steps = max(out_lens)
    prefill_tokens = sum(len(p) for p in prompts)
    return (weight_bytes * decode_steps + kv_reads * KV_BYTES_PER_TOKEN
            + prefill_tokens * KV_BYTES_PER_TOKEN) / bw


def run_throughput(path: str, enforce_eager: bool):
    from engine import LLM, SamplingParams

    prompts, out_lens = nano_vllm_workload()
    llm = LLM(path, load_format="dummy", skip_tokenizer_init=True, max_model_len=4096,
              max_num_seqs=256, max_num_batched_tokens=16384, enforce_eager=enforce_eager,
              device="cuda")
    llm.generate([{"prompt_token_ids": [1, 2, 3]}], SamplingParams(max_tokens=8), use_tqdm=False)
    params = [SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=n) for n in out_lens]
    torch.cuda.synchronize()
    t = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    torch.cuda.synchronize()
    dt = time.perf_counter() - t
    produced = sum(len(o.outputs[0].token_ids) for o in outs)
    metrics = {m.name: m.value for m in llm.get_metrics()}
    llm.shutdown()
    del llm
    torch.cuda.empty_cache()
    return {"seconds": dt, "output_tokens": produced, "tokens_per_s": produced / dt,
            "prompt_tokens": sum(map(len, prompts)), "num_preemptions": metrics.get("glassbox:num_preemptions")}


def run_decode_latency(path: str, enforce_eager: bool, batch_sizes=(1, 16, 64, 256), ctx=512, steps=32):
    """Per-step time of pure decode at a fixed context, via EngineCore steps."""
    from engine.engine.arg_utils import EngineArgs
    from engine.sampling_params import SamplingParams
    from engine.v1.engine.core import EngineCore
    from engine.v1.executor.abstract import Executor
    from engine.v1.request import Request

    results = {}
    args = EngineArgs(model=path, load_format="dummy", skip_tokenizer_init=True, max_model_len=4096,
                      max_num_seqs=256, max_num_batched_tokens=16384, enforce_eager=enforce_eager,
                      device="cuda", disable_log_stats=True, enable_prefix_caching=False)
    config = args.create_engine_config()
    core = EngineCore(config, Executor.get_class(config), log_stats=False)
    for b in batch_sizes:
        for i in range(b):
            sp = SamplingParams(temperature=0, ignore_eos=True, max_tokens=steps + 4)
            core.add_request(Request(f"b{b}-{i}", [(i * 7 + j) % 10000 for j in range(ctx)], sp))
        # Prefill until every request is decoding.
        while any(r.num_computed_tokens < r.num_tokens - 1 or r.num_output_tokens == 0
                  for r in core.scheduler.running) or core.scheduler.waiting:
            core.step()
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(steps):
            core.step()
        torch.cuda.synchronize()
        per_step = (time.perf_counter() - t) / steps
        core.scheduler.finish_requests(None, __import__("engine.v1.request", fromlist=["RequestStatus"]).RequestStatus.FINISHED_ABORTED)
        core.step()
        floor = (2 * (PARAMS_NON_EMB + 151936 * 1024) + b * ctx * KV_BYTES_PER_TOKEN) / 4.3e12
        results[str(b)] = {"ms_per_step": per_step * 1e3, "floor_ms": floor * 1e3}
    core.shutdown()
    torch.cuda.empty_cache()
    return results


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="out")
    ap.add_argument("--skip-latency", action="store_true")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    path = model_dir()
    commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    result = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
        "gpu": torch.cuda.get_device_name(), "commit": commit or os.environ.get("GLASSBOX_COMMIT"),
        "torch": torch.__version__, "model": "Qwen3-0.6B config, dummy weights, bf16",
        "workload": "nano-vllm bench.py: 256 seqs, seed 0, in 100-1024, out 100-1024, T=0.6, ignore_eos",
    }
    bw = measure_bandwidth()
    result["copy_bandwidth_GBps"] = bw / 1e9
    prompts, out_lens = nano_vllm_workload()
    bound = roofline_seconds(prompts, out_lens, bw)
    result["roofline"] = {"seconds": bound, "tokens_per_s": sum(out_lens) / bound}
    for name, eager in (("cudagraphs", False), ("eager", True)):
        r = run_throughput(path, eager)
        r["fraction_of_roofline"] = r["tokens_per_s"] / result["roofline"]["tokens_per_s"]
        result[f"throughput_{name}"] = r
        print(name, json.dumps(r), flush=True)
        with open(os.path.join(args.out, "gpu_throughput.json"), "w") as f:
            json.dump(result, f, indent=1)
    if not args.skip_latency:
        for name, eager in (("cudagraphs", False), ("eager", True)):
            result[f"decode_latency_{name}"] = run_decode_latency(path, eager)
            print(name, json.dumps(result[f"decode_latency_{name}"]), flush=True)
            with open(os.path.join(args.out, "gpu_throughput.json"), "w") as f:
                json.dump(result, f, indent=1)
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
