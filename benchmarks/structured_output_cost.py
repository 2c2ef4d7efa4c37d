"""What structured outputs cost per decode step (issue 20, "Performance").

Each mode builds one in-process engine (``EngineCore``) and decodes a batch of
requests in steady state; the figure is the wall time per engine step over
``--steps`` steps, after every request has produced its first token:

  * ``free`` -- unconstrained requests;
  * ``json`` -- every request constrained by a JSON schema whose one string
    field needs at least 4,000 characters (``minLength``), so no request can
    finish inside the measured steps and every step masks every row.

Both with the engine's default loop (async scheduling: ``free_async``,
``json_async``) and with the serial loop (``free_serial``, ``json_serial``).
Under async scheduling a constrained request's next step cannot be *sampled*
before its previous token has advanced its grammar on the host: the engine
core defers that sampling until the previous step's output is read (vLLM's
``pending_structured_output_tokens``), so ``json_async`` loses the overlap of
host and device work that ``free_async`` has -- one wait for the device per
step that the unconstrained path does not have, as in vLLM. The mask itself
adds none: the bitmask goes to the device from pinned memory without a sync
(``tests/gpu/test_gpu_structured_outputs.py`` checks that under
``torch.cuda.set_sync_debug_mode("error")``).

Also measured: the grammar compile of the schema above and of a typical
4-field object schema, cold (a fresh ``GrammarCompiler``) and cached.

Models: on CUDA the Qwen3-0.6B config of ``benchmarks/gpu_throughput.py``
with dummy bf16 weights and, since no Qwen3 tokenizer exists offline,
SmolLM2's tokenizer (49,152 tokens) under Qwen3's 151,936-row vocabulary: the
bitmask and the masked logits have Qwen3's width, the ids beyond the
tokenizer are always masked. On the CPU the default model (SmolLM2-135M,
fp32, its own tokenizer). vLLM twin: none (vLLM's
``benchmarks/benchmark_serving_structured_output.py`` measures a server end
to end). Session 06.

Run:  python benchmarks/structured_output_cost.py --device cpu --out OUT/ [--batch-sizes 1,16,64]
Writes ``OUT/structured_output_cost_<machine>.json``; ``--record`` stores it in
benchmarks/results (``results_store.py``).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from benchmarks import results_store  # noqa: E402

LONG_STRING_SCHEMA = {
    "type": "object",
    "properties": {"text": {"type": "string", "minLength": 4000}},
    "required": ["text"],
}
TYPICAL_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 32},
        "age": {"type": "integer", "minimum": 0},
        "email": {"type": "string", "format": "email"},
        "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 5},
    },
    "required": ["name", "age"],
}
PROMPT_LEN = 64


def measure(kwargs: dict[str, Any], mode: str, batch: int, steps: int, device: str) -> dict:
    """Median step time of one mode at one batch size (a fresh engine)."""
    from engine.engine.arg_utils import EngineArgs
    from engine.sampling_params import SamplingParams, StructuredOutputsParams
    from engine.v1.engine.core import EngineCore
    from engine.v1.executor.abstract import Executor
    from engine.v1.request import Request

    gc.collect()  # the previous mode's engine
    if device == "cuda":
        torch.cuda.empty_cache()
    constrained, loop = mode.split("_")
    config = EngineArgs(
        **kwargs, max_num_seqs=max(batch, 8), async_scheduling=loop == "async"
    ).create_engine_config()
    core = EngineCore(config, Executor.get_class(config), log_stats=False)
    so = StructuredOutputsParams(json=LONG_STRING_SCHEMA) if constrained == "json" else None
    warmup = 5
    params = SamplingParams(
        temperature=1.0,
        seed=0,
        ignore_eos=True,
        max_tokens=steps + warmup + 8,
        structured_outputs=so,
    )
    if so is not None:
        params._validate_structured_outputs(config.structured_outputs_config)
    vocab = min(config.model_config.vocab_size, 49152)
    for i in range(batch):
        prompt = [(7 * i + 13 * j) % (vocab - 3) + 3 for j in range(PROMPT_LEN)]
        request = Request(f"r{i}", prompt, params.clone())
        if request.use_structured_output:
            core.structured_output_manager.grammar_init(request)
        core.scheduler.add_request(request)
    requests = list(core.scheduler.requests.values())

    def sync() -> None:
        if device == "cuda":
            torch.cuda.synchronize()

    def tokens() -> int:
        return min(len([t for t in r.output_token_ids if t >= 0]) for r in requests)

    def step() -> None:
        if not core.scheduler.has_requests():
            raise RuntimeError(f"{mode}: the requests ended before the measured steps")
        core.step_fn()

    while tokens() < warmup:
        step()
    sync()
    start_tokens, start = tokens(), time.perf_counter()
    samples = []
    last = start
    while tokens() < start_tokens + steps:
        before = tokens()
        step()
        if tokens() > before:
            now = time.perf_counter()
            samples.append((now - last) * 1e3 / (tokens() - before))
            last = now
    sync()
    elapsed = time.perf_counter() - start
    made = tokens() - start_tokens
    core.shutdown()
    return {
        "mode": mode,
        "batch": batch,
        "ms_per_step": elapsed * 1e3 / made,
        "median_step_ms": statistics.median(samples),
        "steps": made,
    }


def compile_times(tokenizer_path: str, vocab_size: int) -> dict[str, Any]:
    """Cold (fresh compiler) and cached compile times, seconds."""
    import xgrammar as xgr
    from transformers import AutoTokenizer

    info = xgr.TokenizerInfo.from_huggingface(
        AutoTokenizer.from_pretrained(tokenizer_path), vocab_size=vocab_size
    )
    out = {}
    for name, schema in (("long_string", LONG_STRING_SCHEMA), ("typical", TYPICAL_SCHEMA)):
        compiler = xgr.GrammarCompiler(info, max_threads=8, cache_enabled=True)
        spec = json.dumps(schema)
        t0 = time.perf_counter()
        compiler.compile_json_schema(spec, any_whitespace=True)
        t1 = time.perf_counter()
        compiler.compile_json_schema(spec, any_whitespace=True)
        t2 = time.perf_counter()
        out[name] = {"cold_s": t1 - t0, "cached_s": t2 - t1}
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="out/", help="directory (or file) for the JSON")
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--batch-sizes", default="1,16,64")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument(
        "--tokenizer", default=None, help="CUDA: tokenizer folder (default: the default model's)"
    )
    ap.add_argument(
        "--model", default=None, help="CPU: a model folder with a tokenizer (default: SmolLM2)"
    )
    results_store.add_record_arguments(ap)
    args = ap.parse_args(argv)
    from engine.benchmarks.throughput import provenance
    from engine.model_executor.model_loader.default_model import resolve_model

    common: dict[str, Any] = {
        "device": args.device,
        "disable_log_stats": True,
        "enable_prefix_caching": False,
        "max_model_len": 1024,
    }
    if args.device == "cuda":
        from benchmarks.gpu_throughput import QWEN3_0_6B, model_dir

        tokenizer = args.tokenizer or resolve_model("default")
        common.update(model=model_dir(QWEN3_0_6B), load_format="dummy", tokenizer=tokenizer)
        model_name = "Qwen3-0.6B config, dummy weights, bf16; SmolLM2 tokenizer"
        vocab_size = QWEN3_0_6B["vocab_size"]
    else:
        tokenizer = args.model or resolve_model("default")
        common.update(model=tokenizer)
        model_name = os.path.basename(args.model) if args.model else "SmolLM2-135M-Instruct, fp32"
        from transformers import AutoConfig

        vocab_size = AutoConfig.from_pretrained(tokenizer).vocab_size
    rows = []
    for batch in [int(x) for x in args.batch_sizes.split(",") if x]:
        for mode in ("free_async", "json_async", "free_serial", "json_serial"):
            row = measure(common, mode, batch, args.steps, args.device)
            rows.append(row)
            print(json.dumps(row), flush=True)
    base = {
        (r["batch"], r["mode"].split("_")[1]): r["ms_per_step"] for r in rows if "free" in r["mode"]
    }
    for r in rows:
        r["ratio_to_free"] = r["ms_per_step"] / base[(r["batch"], r["mode"].split("_")[1])]
    result = {
        "benchmark": "structured_output_cost",
        **provenance(),
        "commit": results_store.commit_id(),
        "device": args.device,
        "model": model_name,
        "prompt_len": PROMPT_LEN,
        "schema": LONG_STRING_SCHEMA,
        "compile": compile_times(tokenizer, vocab_size),
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
