"""What one verification step costs against a plain decode step (issue 19, "Performance").

Speculation pays only if a verification step -- each request runs 1 + k query
tokens, its last token and its k drafts -- costs less than the tokens it gains.
This measures the cost side: one engine step, in-process (``EngineCore.step``,
the serial loop that speculation uses), at a given batch size and context
~512, for

  * ``decode_graphs`` -- plain decode, CUDA graphs (the engine's default);
  * ``decode_eager`` -- plain decode without graphs (``enforce_eager``): it
    separates the graphs' gain from the verification's cost (with
    ``TRITON_ATTN`` a step where every request verifies k drafts replays a
    graph of its own, captured for query length 1 + k; with FlashInfer it
    runs eagerly);
  * ``verify_k<K>`` -- n-gram speculation with k = K, where before every timed
    step each request is handed exactly K drafts through
    ``Scheduler.update_draft_token_ids`` (what ``EngineCore.post_step`` does
    with real drafts), so every step verifies K drafts per request whatever
    prompt lookup would have found. With dummy weights nearly all drafts are
    rejected: a step advances each request by about one token, and its cost
    is what is measured. The n-gram proposer still runs after each step (its
    host time is in the figure; its drafts are replaced).

Per mode and batch size: the median and p90 of the step time (wall clock,
synchronised), and ``ratio_to_decode_graphs``. That ratio is the mean
acceptance length (1 + accepted drafts per verification, vLLM's figure) a
method must reach for speculation to break even against graphed decoding.

Model: the Qwen3-0.6B config of ``benchmarks/gpu_throughput.py`` with dummy
bf16 weights on CUDA; ``--device cpu`` runs a tiny Qwen3-shaped config (fp32)
to check the script. vLLM twin: none (vLLM's benchmarks measure speculation
end to end, ``vllm bench``); read ``vllm/v1/spec_decode/metrics.py`` for the
acceptance length. Session 06.

Run:  python benchmarks/spec_verify_cost.py --out OUT/ [--batch-sizes 1,8,32] [--ks 1,3,5]
Writes ``OUT/spec_verify_cost_<machine>.json``; ``--record`` stores it in
benchmarks/results (``results_store.py``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from benchmarks import results_store  # noqa: E402
from benchmarks.gpu_throughput import QWEN3_0_6B, model_dir  # noqa: E402
from engine.utils.torch_utils import release_device_memory  # noqa: E402

CONTEXT = 512
# A Qwen3-shaped model small enough for a CPU check of the script.
TINY_QWEN3 = {
    **QWEN3_0_6B,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "vocab_size": 512,
}


def measure(
    model: str, device: str, mode: str, k: int, batch: int, steps: int, warmup: int
) -> dict[str, Any]:
    """Step times of one mode at one batch size (a fresh engine each)."""
    from engine.engine.arg_utils import EngineArgs
    from engine.sampling_params import SamplingParams
    from engine.v1.engine.core import EngineCore
    from engine.v1.executor.abstract import Executor
    from engine.v1.outputs import DraftTokenIds
    from engine.v1.request import Request

    kwargs: dict[str, Any] = {
        "model": model,
        "load_format": "dummy",
        "skip_tokenizer_init": True,
        "max_model_len": 1024,
        "max_num_seqs": max(batch, 8),
        "device": device,
        "disable_log_stats": True,
        "enable_prefix_caching": False,
        "async_scheduling": False,
        "enforce_eager": mode == "decode_eager",
        # Every request may reach max_model_len, whatever memory is free.
        "num_gpu_blocks_override": batch * 1024 // 16 + 1,
    }
    if k:
        kwargs["speculative_config"] = {
            "method": "ngram",
            "num_speculative_tokens": k,
            "prompt_lookup_min": 1,
            "prompt_lookup_max": 1,
        }
    config = EngineArgs(**kwargs).create_engine_config()
    core = EngineCore(config, Executor.get_class(config), log_stats=False)
    vocab = config.model_config.vocab_size
    req_ids = [f"r{i}" for i in range(batch)]
    params = SamplingParams(temperature=0, ignore_eos=True, max_tokens=(steps + warmup + 4) * 2)
    for i, req_id in enumerate(req_ids):
        prompt = [(7 * i + 13 * j) % (vocab - 3) + 3 for j in range(CONTEXT)]
        core.add_request(Request(req_id, prompt, params))
    # The drafts each step verified per request, read off the scheduler's output.
    verified: list[int] = []
    schedule = core.scheduler.schedule

    def recording_schedule():
        out = schedule()
        spec = out.scheduled_spec_decode_tokens
        verified.append(min((len(spec.get(r, ())) for r in req_ids), default=0))
        return out

    core.scheduler.schedule = recording_schedule  # type: ignore[method-assign]

    def sync() -> None:
        if device == "cuda":
            torch.cuda.synchronize()

    # The prefills (several steps at large batches): every request decodes after.
    while any(not r.output_token_ids for r in core.scheduler.requests.values()):
        core.step()
    times = []
    for i in range(warmup + steps):
        if k:
            drafts = [[(3 * i + j) % (vocab - 3) + 3 for j in range(k)] for _ in req_ids]
            core.scheduler.update_draft_token_ids(DraftTokenIds(req_ids, drafts))
        sync()
        start = time.perf_counter()
        core.step()
        sync()
        times.append((time.perf_counter() - start) * 1e3)
    core.shutdown()
    del core
    release_device_memory()
    timed = sorted(times[warmup:])
    return {
        "mode": mode,
        "k": k,
        "batch": batch,
        "median_ms": statistics.median(timed),
        "p90_ms": timed[min(len(timed) - 1, int(0.9 * len(timed)))],
        "steps": steps,
        # Drafts verified per request in each timed step (k when the injection worked).
        "drafts_verified_per_request": sorted(set(verified[-steps:])),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="out/", help="directory (or file) for the JSON")
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--batch-sizes", default="1,8,32")
    ap.add_argument("--ks", default="1,3,5")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=5)
    results_store.add_record_arguments(ap)
    args = ap.parse_args(argv)
    from engine.benchmarks.throughput import provenance

    if args.device == "cuda":
        model_config, model_name = QWEN3_0_6B, "Qwen3-0.6B config, dummy weights, bf16"
    else:
        model_config, model_name = TINY_QWEN3, "tiny Qwen3 config, dummy weights, fp32"
    model = model_dir(model_config)
    ks = [int(x) for x in args.ks.split(",") if x]
    modes = [("decode_graphs", 0), ("decode_eager", 0)] + [(f"verify_k{k}", k) for k in ks]
    rows = []
    for batch in [int(x) for x in args.batch_sizes.split(",") if x]:
        for mode, k in modes:
            row = measure(model, args.device, mode, k, batch, args.steps, args.warmup)
            rows.append(row)
            print(json.dumps(row), flush=True)
    base = {r["batch"]: r["median_ms"] for r in rows if r["mode"] == "decode_graphs"}
    for r in rows:
        r["ratio_to_decode_graphs"] = r["median_ms"] / base[r["batch"]]
    machine = provenance()
    result = {
        "benchmark": "spec_verify_cost",
        **machine,
        "commit": results_store.commit_id(),
        "device": args.device,
        "model": model_name,
        "context": CONTEXT,
        "attention_backend": os.environ.get("GLASSBOX_ATTENTION_BACKEND", "default"),
        "results": rows,
    }
    path = results_store.output_path(args.out, result)
    path.write_text(results_store.dump_result(result))
    print(f"wrote {path}")
    if args.record:
        results_store.record(result, args.record, note=args.note)
    return 0


if __name__ == "__main__":
    sys.exit(main())
