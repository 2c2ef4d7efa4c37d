"""GPU throughput and decode latency on the H200 (issue 7 benchmarks).

The measurements are ``engine/benchmarks`` (the code behind ``glassbox bench
throughput|latency``); this script runs them on the issue's settings, in one
process, and writes one JSON with everything the docs table needs:

* throughput: nano-vllm's bench.py workload exactly -- 256 sequences, seed 0,
  prompts of randint(100, 1024) tokens drawn from randint(0, 10000), outputs
  of randint(100, 1024) tokens, ignore_eos, temperature 0.6 -- on the
  Qwen3-0.6B config with dummy weights, bf16; output tokens / wall time;
  ``throughput_cudagraphs`` is the default engine (on CUDA optimization level
  O2: compiled, FULL_AND_PIECEWISE graphs), ``throughput_eager`` is -O0;
* HF transformers' continuous batching on the same prompts (token ids) and
  output lengths, EOS off, same temperature (``throughput.run_hf``), and our
  ratio to it. It is capped so the call fits the GPU machine's time limit:
  ``--hf-num-prompts N`` runs it on the first N requests only (then Glassbox
  runs those N as well and the ratio compares the two on the same N), and
  ``--hf-timeout-s`` stops it; a stopped run still gives an upper bound on its
  throughput (all requested tokens over the time allowed), hence a lower
  bound on our ratio. The JSON says which of these applied;
* roofline: the least time the run could take from bytes moved (weights per
  step, K/V read per decode token) over the copy bandwidth measured in this
  run (``engine/benchmarks/roofline.py``, ../shared/reference/perf.md
  section 6), and the fraction of it reached;
* decode latency per step at batch 1, 16, 64, 256 with context 512, the
  default engine and -O0, against the weight + KV-read floor;
* ``--parts modes`` (not in the default set): the same workload under each
  level and graph mode (``throughput_compiled``: O1 = compiled + PIECEWISE,
  compiled + FULL_DECODE_ONLY, and O0 + FULL_DECODE_ONLY, the engine before
  compilation), and the batch-1 and batch-64 decode steps of the last
  (``decode_latency_o0_full_decode_only``) beside the default's;
* ``--parts lora`` (not in the default set): the workload with LoRA on
  (eager, as Glassbox runs LoRA), once with every request on the base model
  (``throughput_lora_engine_base_only``) and once spread over 4 random
  rank-16 adapters on all seven projections plus the base model
  (``throughput_mixed_lora``).
* ``--parts fp8`` (not in the default set): the default engine with
  ``quantization="fp8"`` (online W8A8, per-tensor scales) on the same
  workload (``throughput_fp8``) and its batch-1 and batch-64 decode steps
  (``decode_latency_fp8``), beside the bf16 figures.

* ``--parts tp`` (not in the default set; two GPUs): the default engine at
  ``tensor_parallel_size=2`` (``mp`` workers, NCCL) on the same workload
  (``throughput_tp2``) and its batch-1 and batch-64 decode steps
  (``decode_latency_tp2``), beside the TP=1 figures of ``throughput`` and
  ``latency``.

Usage: python3 benchmarks/gpu_throughput.py --out DIR [--parts throughput,eager,hf,latency]
       [--hf-num-prompts N] [--hf-timeout-s S] [--record [RESULTS_DIR]]
Writes DIR/gpu_throughput_<gpu>.json (``gpu_throughput_h200.json`` on an H200)
after every part (a run cut short keeps what it measured); ``--record``
stores the finished run in benchmarks/results (``results_store.py``).
"""

from __future__ import annotations

import argparse
import atexit
import json
import os
import shutil
import sys
import tempfile
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch

from benchmarks import results_store
from engine.benchmarks.datasets import sample_random_requests
from engine.benchmarks.latency import run_decode_latency
from engine.benchmarks.roofline import (
    count_model_bytes,
    decode_step_floor_seconds,
    measure_copy_bandwidth,
)
from engine.benchmarks.throughput import (
    describe_engine,
    provenance,
    roofline_for,
    run_glassbox,
    run_hf,
)
from engine.engine.arg_utils import EngineArgs

QWEN3_0_6B = {
    "architectures": ["Qwen3ForCausalLM"],
    "model_type": "qwen3",
    "hidden_size": 1024,
    "intermediate_size": 3072,
    "num_hidden_layers": 28,
    "num_attention_heads": 16,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "vocab_size": 151936,
    "rope_theta": 1000000,
    "rope_scaling": None,
    "tie_word_embeddings": True,
    "rms_norm_eps": 1e-6,
    "max_position_embeddings": 40960,
    "attention_bias": False,
    "hidden_act": "silu",
    "bos_token_id": 151643,
    "eos_token_id": 151645,
    "torch_dtype": "bfloat16",
}
TARGETS = {
    "throughput_tokens_per_s": 25000,
    "ratio_to_transformers": 20,
    "decode_step_batch1_ms": 1.0,
}
ALL_PARTS = ("throughput", "eager", "hf", "latency", "modes", "fp8", "lora", "tp")
# The ``lora`` part: adapters of this rank over the seven projections.
LORA_RANK = 16
NUM_ADAPTERS = 4
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# The ``modes`` part: the compiled model (CompilationMode.VLLM_COMPILE) under
# each CUDA-graph mode, on the same workload, and its batch-1 decode step.
# name -> (optimization level, compilation_config): the default O2 is
# throughput_cudagraphs and -O0 (no graphs) throughput_eager.
COMPILED_MODES = {
    "O1 PIECEWISE": (1, {}),
    "O2 FULL_DECODE_ONLY": (2, {"cudagraph_mode": "FULL_DECODE_ONLY"}),
    "O0 FULL_DECODE_ONLY": (0, {"cudagraph_mode": "FULL_DECODE_ONLY"}),
    # The default without vLLM's GPU Inductor options (horizontal fusion): what they save.
    "O2 without combo kernels": (
        2,
        {"inductor_compile_config": {"combo_kernels": False, "benchmark_combo_kernel": False}},
    ),
}


def model_dir(config: dict | None = None) -> str:
    """A folder holding only ``config.json`` (the Qwen3-0.6B config unless
    ``config``), for dummy weights."""
    d = tempfile.mkdtemp(prefix="qwen3-0.6b-" if config is None else "model-")
    atexit.register(shutil.rmtree, d, True)
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump(QWEN3_0_6B if config is None else config, f)
    return d


def write_random_adapter(
    config: dict, out_dir: str, seed: int, rank: int = LORA_RANK, scale: float = 0.01
) -> str:
    """A PEFT LoRA folder for ``config``'s model with random A and B (small, so
    the outputs stay finite) over ``LORA_TARGETS``: what a real adapter costs,
    without peft on the GPU machine."""
    import torch
    from safetensors.torch import save_file

    hidden, inter = config["hidden_size"], config["intermediate_size"]
    head = config.get("head_dim") or hidden // config["num_attention_heads"]
    q, kv = config["num_attention_heads"] * head, config["num_key_value_heads"] * head
    shapes = {  # module -> (in, out)
        "self_attn.q_proj": (hidden, q),
        "self_attn.k_proj": (hidden, kv),
        "self_attn.v_proj": (hidden, kv),
        "self_attn.o_proj": (q, hidden),
        "mlp.gate_proj": (hidden, inter),
        "mlp.up_proj": (hidden, inter),
        "mlp.down_proj": (inter, hidden),
    }
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(config["num_hidden_layers"]):
        for module, (n_in, n_out) in shapes.items():
            key = f"base_model.model.model.layers.{layer}.{module}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, n_in, generator=g) * scale
            tensors[f"{key}.lora_B.weight"] = torch.randn(n_out, rank, generator=g) * scale
    os.makedirs(out_dir, exist_ok=True)
    save_file(
        {k: v.to(torch.bfloat16).contiguous() for k, v in tensors.items()},
        os.path.join(out_dir, "adapter_model.safetensors"),
    )
    with open(os.path.join(out_dir, "adapter_config.json"), "w") as f:
        json.dump(
            {
                "peft_type": "LORA",
                "r": rank,
                "lora_alpha": 2 * rank,
                "target_modules": list(LORA_TARGETS),
                "bias": "none",
            },
            f,
        )
    return out_dir


def run_mixed_lora(requests: list, args: EngineArgs, adapter_dirs: list[str]) -> dict:
    """The workload with request i on adapter i % (len + 1) (the last share: the
    base model), on an engine with LoRA on."""
    import dataclasses

    from engine import LLM, SamplingParams
    from engine.lora.request import LoRARequest

    fields = {f.name: getattr(args, f.name) for f in dataclasses.fields(args)}
    start = time.perf_counter()
    llm = LLM(**fields)
    startup = time.perf_counter() - start
    adapters = [LoRARequest(f"a{i}", i + 1, d) for i, d in enumerate(adapter_dirs)] + [None]
    try:
        warm = [{"prompt_token_ids": requests[0].prompt_token_ids[:16]}] * len(adapters)
        llm.generate(
            warm,
            SamplingParams(max_tokens=8, ignore_eos=True),
            lora_request=adapters,
            use_tqdm=False,
        )
        params = [
            SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=r.expected_output_len)
            for r in requests
        ]
        prompts = [{"prompt_token_ids": r.prompt_token_ids} for r in requests]
        per_request = [adapters[i % len(adapters)] for i in range(len(requests))]
        torch_sync()
        start = time.perf_counter()
        outputs = llm.generate(prompts, params, lora_request=per_request, use_tqdm=False)
        elapsed = time.perf_counter() - start
    finally:
        llm.shutdown()
    out_tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    return {
        "elapsed_time": elapsed,
        "num_requests": len(requests),
        "total_output_tokens": out_tokens,
        "output_tokens_per_second": out_tokens / elapsed,
        "engine_startup_seconds": startup,
        "num_adapters": len(adapter_dirs),
        "lora_rank": LORA_RANK,
        "requests_on_base_model": sum(1 for a in per_request if a is None),
    }


def torch_sync() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def engine_args(path: str, enforce_eager: bool, **overrides) -> EngineArgs:
    kwargs = {
        "model": path,
        "load_format": "dummy",
        "skip_tokenizer_init": True,
        "max_model_len": 4096,
        "max_num_seqs": 256,
        "max_num_batched_tokens": 16384,
        "enforce_eager": enforce_eager,
        "device": "cuda",
    }
    kwargs.update(overrides)
    return EngineArgs(**kwargs)


def missed_by(result: dict) -> dict:
    """For each target with a figure: how far off it is (or that it is met)."""
    out = {}
    tp = result.get("throughput_cudagraphs", {}).get("output_tokens_per_second")
    if tp is not None:
        t = TARGETS["throughput_tokens_per_s"]
        out["throughput"] = f"{tp:,.0f} tok/s is {tp / t:.0%} of the {t:,} target" + (
            " (met)" if tp >= t else ""
        )
    ratio = result.get("ratio_to_transformers")
    if ratio is not None:
        t = TARGETS["ratio_to_transformers"]
        kind = "at least " if result.get("ratio_is_lower_bound") else ""
        out["ratio_to_transformers"] = f"{kind}{ratio:.1f}x against the {t}x target" + (
            " (met)" if ratio >= t else ""
        )
    b1 = result.get("decode_latency_cudagraphs", {}).get("1", {}).get("mean_ms")
    if b1 is not None:
        t = TARGETS["decode_step_batch1_ms"]
        out["decode_batch1"] = f"{b1:.2f} ms is {b1 / t:.1f}x the {t} ms target" + (
            " (met)" if b1 <= t else ""
        )
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="out", help="the directory to write the JSON into")
    ap.add_argument(
        "--parts",
        default=",".join(p for p in ALL_PARTS if p not in ("modes", "fp8", "tp")),
        help=f"comma-separated subset of {ALL_PARTS}",
    )
    ap.add_argument(
        "--hf-num-prompts",
        type=int,
        default=256,
        help="HF baseline on the first N requests (default all)",
    )
    ap.add_argument(
        "--hf-timeout-s", type=float, default=240.0, help="stop the HF baseline after this long"
    )
    results_store.add_record_arguments(ap)
    args = ap.parse_args()
    parts = [p.strip() for p in args.parts.split(",") if p.strip()]
    unknown = sorted(set(parts) - set(ALL_PARTS))
    if unknown:
        ap.error(f"--parts: unknown {unknown}; choose from {list(ALL_PARTS)}")
    if not 1 <= args.hf_num_prompts <= 256:
        ap.error(f"--hf-num-prompts must be in [1, 256], got {args.hf_num_prompts}")
    path = model_dir()
    requests = sample_random_requests()  # nano-vllm's workload

    result = {
        "benchmark": "gpu_throughput",
        **provenance(),
        "commit": results_store.commit_id(),
        "model": "Qwen3-0.6B config, dummy weights, bf16",
        "workload": "nano-vllm bench.py: 256 seqs, seed 0, in 100-1024, out 100-1024, "
        "T=0.6, ignore_eos",
        "engine": describe_engine(engine_args(path, enforce_eager=False)),
        "targets": TARGETS,
    }

    out_path = results_store.output_path(args.out + "/", result)

    def save():
        result["missed_by"] = missed_by(result)
        with open(out_path, "w") as f:
            json.dump(result, f, indent=1)

    bandwidth = measure_copy_bandwidth()
    result["copy_bandwidth_GBps"] = bandwidth / 1e9
    result["roofline"] = roofline_for(requests, engine_args(path, False), bandwidth)
    save()

    def attempt(name, fn):
        try:
            value = fn()
        except Exception:  # noqa: BLE001 -- keep the other parts' figures; say what failed
            result[name] = {"error": traceback.format_exc(limit=8)}
            print(name, "FAILED\n", result[name]["error"], flush=True)
            save()
            return None
        result[name] = value
        print(name, json.dumps(value)[:2000], flush=True)
        save()
        return value

    bound_tps = result["roofline"]["output_tokens_per_second"]
    for name, eager in (("throughput_cudagraphs", False), ("throughput_eager", True)):
        if ("throughput" if not eager else "eager") not in parts:
            continue
        r = attempt(name, lambda eager=eager: run_glassbox(requests, engine_args(path, eager)))
        if r is not None:
            r["fraction_of_roofline"] = r["output_tokens_per_second"] / bound_tps
            save()

    if "hf" in parts:
        hf_requests = requests[: args.hf_num_prompts]
        hf = attempt(
            "hf_transformers_continuous_batching",
            lambda: run_hf(
                hf_requests,
                path,
                device="cuda",
                load_format="dummy",
                temperature=0.6,
                max_batch_tokens=16384,
                max_requests_per_batch=256,
                timeout_s=args.hf_timeout_s,
            ),
        )
        if hf is not None:
            hf["capped_to_first_n_prompts"] = (
                args.hf_num_prompts if args.hf_num_prompts < len(requests) else None
            )
            hf["timeout_s"] = args.hf_timeout_s
            ours = result.get("throughput_cudagraphs")
            if args.hf_num_prompts < len(requests):
                # Compare on the same prompts: Glassbox on the same subset.
                ours = attempt(
                    "throughput_cudagraphs_on_hf_subset",
                    lambda: run_glassbox(hf_requests, engine_args(path, False)),
                )
            if ours is not None and "output_tokens_per_second" in ours:
                if hf["completed"]:
                    result["ratio_to_transformers"] = (
                        ours["output_tokens_per_second"] / hf["output_tokens_per_second"]
                    )
                    result["ratio_is_lower_bound"] = False
                else:
                    # Stopped at the timeout: it could not have produced all the
                    # requested tokens faster than in that time.
                    requested = sum(r.expected_output_len for r in hf_requests)
                    hf["output_tokens_per_second_upper_bound"] = requested / args.hf_timeout_s
                    result["ratio_to_transformers"] = (
                        ours["output_tokens_per_second"]
                        / hf["output_tokens_per_second_upper_bound"]
                    )
                    result["ratio_is_lower_bound"] = True
            save()

    if "latency" in parts:
        model_bytes = count_model_bytes(
            engine_args(path, False).create_engine_config().model_config, torch.bfloat16
        )
        for name, eager in (("decode_latency_cudagraphs", False), ("decode_latency_eager", True)):
            per_batch = attempt(
                name,
                lambda eager=eager: run_decode_latency(
                    engine_args(path, eager, enable_prefix_caching=False),
                    [1, 16, 64, 256],
                    input_len=512,
                    num_iters=32,
                    num_iters_warmup=4,
                ),
            )
            if per_batch is not None:
                for entry in per_batch.values():
                    entry["floor_ms"] = 1e3 * decode_step_floor_seconds(
                        entry["batch_size"], 512, model_bytes, bandwidth
                    )
                    entry["ms_per_step"] = entry["mean_ms"]  # the name the first results file used
                save()
        torch.cuda.empty_cache()

    if "modes" in parts:
        compiled: dict = result.setdefault("throughput_compiled", {})
        for mode, (level, compilation) in COMPILED_MODES.items():
            r = attempt(
                f"throughput_compiled_{mode}",
                lambda o=level, c=compilation: run_glassbox(
                    requests,
                    engine_args(path, False, optimization_level=o, compilation_config=c),
                ),
            )
            if r is not None:
                r["fraction_of_roofline"] = r["output_tokens_per_second"] / bound_tps
                compiled[mode] = result.pop(f"throughput_compiled_{mode}")
                save()
        attempt(
            "decode_latency_o0_full_decode_only",
            lambda: run_decode_latency(
                engine_args(
                    path,
                    False,
                    enable_prefix_caching=False,
                    optimization_level=0,
                    compilation_config={"cudagraph_mode": "FULL_DECODE_ONLY"},
                ),
                [1, 64],
                input_len=512,
                num_iters=32,
                num_iters_warmup=4,
            ),
        )

    if "fp8" in parts:
        r = attempt(
            "throughput_fp8",
            lambda: run_glassbox(requests, engine_args(path, False, quantization="fp8")),
        )
        if r is not None:
            r["fraction_of_roofline"] = r["output_tokens_per_second"] / bound_tps
            save()
        attempt(
            "decode_latency_fp8",
            lambda: run_decode_latency(
                engine_args(path, False, enable_prefix_caching=False, quantization="fp8"),
                [1, 64],
                input_len=512,
                num_iters=32,
                num_iters_warmup=4,
            ),
        )

    if "lora" in parts:
        root = tempfile.mkdtemp(prefix="lora-adapters-")
        atexit.register(shutil.rmtree, root, True)
        dirs = [
            write_random_adapter(QWEN3_0_6B, os.path.join(root, f"a{i}"), seed=i)
            for i in range(NUM_ADAPTERS)
        ]
        lora = {"enable_lora": True, "max_loras": NUM_ADAPTERS, "max_lora_rank": LORA_RANK}
        # LoRA runs eagerly in Glassbox: the base model on the same eager engine
        # (no adapters requested) separates the adapters' cost from the graphs'.
        attempt(
            "throughput_lora_engine_base_only",
            lambda: run_mixed_lora(requests, engine_args(path, True, **lora), []),
        )
        attempt(
            "throughput_mixed_lora",
            lambda: run_mixed_lora(requests, engine_args(path, True, **lora), dirs),
        )

    if "tp" in parts:
        tp2 = {"tensor_parallel_size": 2}
        attempt("throughput_tp2", lambda: run_glassbox(requests, engine_args(path, False, **tp2)))
        attempt(
            "decode_latency_tp2",
            lambda: run_decode_latency(
                engine_args(path, False, enable_prefix_caching=False, **tp2),
                [1, 64],
                input_len=512,
                num_iters=32,
                num_iters_warmup=4,
            ),
        )

    save()
    if args.record:
        stored = results_store.record(result, args.record, note=args.note)
        print(f"recorded {stored} (and its history line)", flush=True)
    print(
        json.dumps(
            {k: v for k, v in result.items() if not k.startswith("decode_latency")}, indent=1
        )[:6000]
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
