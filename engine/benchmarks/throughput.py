"""``glassbox bench throughput``: offline output tokens per second.

vLLM twin: ``vllm/benchmarks/throughput.py`` (``add_cli_args``, ``main``,
``run_vllm``, ``run_hf``). Read it for how an offline throughput figure is
made: build the requests (here nano-vllm's workload by default, see
``datasets.py``), start the engine, warm it up, then time one
``LLM.generate`` over all of them -- wall time from the first request to the
last token, so prefill counts -- and divide the output tokens by it (the
``output_tokens_per_second`` figure nano-vllm and vLLM report; total tokens
per second is printed beside it, as vLLM does).

``--backend hf`` runs the same requests through HF transformers' continuous
batching instead (``run_hf``): the manager behind ``model.generate_batch``,
fed request by request so each keeps its own output length, with EOS turned
off and the same temperature. It is the peer the issue's targets are set
against. vLLM's ``run_hf`` batches plain ``generate`` calls instead.

On CUDA the result also carries the roofline: the least time the run could
take, from bytes moved over the copy bandwidth measured in the same run
(``roofline.py``), and the fraction of that bound reached.
Sessions: 06 (performance).

Simpler than vLLM: token-id prompts only (no tokenizer, datasets, LoRA,
multimodal or async engine), no profiler hook.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import inspect
import json
import os
import subprocess
import sys
import time
from typing import Any

from engine.benchmarks.datasets import (
    SampleRequest,
    parse_len_range,
    sample_random_requests,
)
from engine.usage.usage_lib import UsageContext


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    from engine.entrypoints.openai.cli_args import add_engine_args

    parser.add_argument(
        "--backend",
        choices=["glassbox", "hf"],
        default="glassbox",
        help="glassbox (this engine) or hf (transformers continuous batching on the same requests)",
    )
    parser.add_argument(
        "--num-prompts", type=int, default=256, help="number of requests (default 256)"
    )
    parser.add_argument(
        "--input-len",
        default="100-1024",
        help="prompt length N or MIN-MAX, inclusive (default 100-1024)",
    )
    parser.add_argument(
        "--output-len",
        default="100-1024",
        help="output length N or MIN-MAX, inclusive (default 100-1024)",
    )
    parser.add_argument(
        "--max-token-id",
        type=int,
        default=10000,
        help=(
            "prompt token ids are drawn from 0..MAX "
            "(default 10000; capped at the vocabulary size - 1)"
        ),
    )
    parser.add_argument(
        "--temperature", type=float, default=0.6, help="sampling temperature (default 0.6)"
    )
    parser.add_argument(
        "--num-warmups",
        type=int,
        default=1,
        help="short warm-up generations before timing (default 1)",
    )
    parser.add_argument(
        "--hf-timeout-s",
        type=float,
        default=None,
        help="--backend hf: stop after this many seconds",
    )
    parser.add_argument(
        "--no-roofline",
        action="store_true",
        help="skip the bandwidth measurement and bound on CUDA",
    )
    parser.add_argument("--output-json", default=None, help="write the results to this JSON file")
    add_engine_args(parser)
    # nano-vllm's budget; prompts are token ids, so no tokenizer is needed.
    parser.set_defaults(skip_tokenizer_init=True, max_num_seqs=256, max_num_batched_tokens=16384)


def engine_args_from_cli(args: argparse.Namespace) -> Any:
    from engine.engine.arg_utils import EngineArgs
    from engine.entrypoints.openai.cli_args import resolve_executor_backend

    kwargs = {f.name: getattr(args, f.name) for f in dataclasses.fields(EngineArgs)}
    kwargs["distributed_executor_backend"] = resolve_executor_backend(
        kwargs["distributed_executor_backend"]
    )
    return EngineArgs(**kwargs)


def get_requests(args: argparse.Namespace, vocab_size: int) -> tuple[list[SampleRequest], int]:
    """The requests, and the token-id ceiling actually used."""
    max_token_id = min(args.max_token_id, vocab_size - 1)
    requests = sample_random_requests(
        num_requests=args.num_prompts,
        input_len=parse_len_range(args.input_len, "--input-len"),
        output_len=parse_len_range(args.output_len, "--output-len"),
        seed=args.seed,
        max_token_id=max_token_id,
    )
    return requests, max_token_id


def _summary(requests: list[SampleRequest], elapsed: float, output_tokens: int) -> dict[str, Any]:
    prompt_tokens = sum(r.prompt_len for r in requests)
    return {
        "elapsed_time": elapsed,
        "num_requests": len(requests),
        "total_prompt_tokens": prompt_tokens,
        "total_output_tokens": output_tokens,
        "total_num_tokens": prompt_tokens + output_tokens,
        "requests_per_second": len(requests) / elapsed,
        "tokens_per_second": (prompt_tokens + output_tokens) / elapsed,
        "output_tokens_per_second": output_tokens / elapsed,
    }


# ----------------------------------------------------------------------------
# Glassbox
# ----------------------------------------------------------------------------
def run_glassbox(
    requests: list[SampleRequest], engine_args: Any, temperature: float = 0.6, num_warmups: int = 1
) -> dict[str, Any]:
    """Time one ``LLM.generate`` over ``requests`` (after warm-ups)."""
    from engine import LLM, SamplingParams

    fields = {f.name: getattr(engine_args, f.name) for f in dataclasses.fields(engine_args)}
    max_model_len = engine_args.create_engine_config(
        UsageContext.LLM_CLASS
    ).model_config.max_model_len
    longest = max(r.prompt_len + r.expected_output_len for r in requests)
    if longest > max_model_len:
        raise ValueError(
            f"a request needs {longest} tokens but max_model_len is {max_model_len}; "
            "raise --max-model-len"
        )
    start_engine = time.perf_counter()
    llm = LLM(**fields)
    startup = time.perf_counter() - start_engine
    try:
        for i in range(num_warmups):
            llm.generate(
                [{"prompt_token_ids": requests[i % len(requests)].prompt_token_ids[:16]}],
                SamplingParams(max_tokens=8, ignore_eos=True),
                use_tqdm=False,
            )
        params = [
            SamplingParams(
                temperature=temperature, ignore_eos=True, max_tokens=r.expected_output_len
            )
            for r in requests
        ]
        prompts = [{"prompt_token_ids": r.prompt_token_ids} for r in requests]
        _synchronize(engine_args.device)
        start = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        elapsed = time.perf_counter() - start
        output_tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
        metrics = (
            {} if engine_args.disable_log_stats else {m.name: m.value for m in llm.get_metrics()}
        )
    finally:
        llm.shutdown()
    result = _summary(requests, elapsed, output_tokens)
    result["all_lengths_as_requested"] = all(
        len(o.outputs[0].token_ids) == r.expected_output_len for o, r in zip(outputs, requests)
    )
    result["engine_startup_seconds"] = startup
    result["num_preemptions"] = metrics.get("glassbox:num_preemptions")
    return result


def _synchronize(device: str) -> None:
    import torch

    if device != "cpu" and torch.cuda.is_available():
        torch.cuda.synchronize()


def describe_engine(engine_args: Any) -> dict[str, Any]:
    """What the engine will run with: device, dtype, attention backend, graphs."""
    from engine.utils.torch_utils import resolve_dtype
    from engine.v1.attention.selector import get_attn_backend

    config = engine_args.create_engine_config(UsageContext.LLM_CLASS)
    device = config.device_config.resolve()
    return {
        "model": config.model_config.model,
        "load_format": engine_args.load_format,
        "device": device,
        "dtype": str(
            resolve_dtype(config.model_config.dtype, device, config.model_config.config_dtype)
        ).removeprefix("torch."),
        "attention_backend": get_attn_backend(config).get_name(),
        "optimization_level": int(config.optimization_level or 0),
        "compilation_mode": config.compilation_config.mode.name,
        "cudagraph_mode": config.compilation_config.cudagraph_mode.name
        if device == "cuda"
        else "NONE",
        "enforce_eager": engine_args.enforce_eager,
        "max_num_seqs": config.scheduler_config.max_num_seqs,
        "max_num_batched_tokens": config.scheduler_config.max_num_batched_tokens,
        "max_model_len": config.model_config.max_model_len,
        "block_size": config.cache_config.block_size,
        "enable_prefix_caching": config.cache_config.enable_prefix_caching,
        "async_scheduling": config.scheduler_config.async_scheduling,
    }


# ----------------------------------------------------------------------------
# HF transformers continuous batching
# ----------------------------------------------------------------------------
def _continuous_batching_config(cls: Any, values: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
    """Build ``ContinuousBatchingConfig`` from the values its version knows.

    transformers renamed ``block_size`` to ``page_size`` in 5.17 (5.24 keeps
    the old name as a deprecated alias; 5.17 itself has only ``block_size``),
    so the page size goes under whichever name exists. Returns the config and
    the values actually passed.
    """
    if dataclasses.is_dataclass(cls):
        known = {f.name for f in dataclasses.fields(cls)}
    else:
        known = set(inspect.signature(cls).parameters)
    values = dict(values)
    page_size = values.pop("page_size")
    values["page_size" if "page_size" in known else "block_size"] = page_size
    used = {k: v for k, v in values.items() if k in known}
    return cls(**used), used


def run_hf(
    requests: list[SampleRequest],
    model: str,
    *,
    device: str = "cuda",
    dtype: str = "auto",
    load_format: str = "auto",
    temperature: float = 0.6,
    page_size: int = 256,
    max_batch_tokens: int = 16384,
    max_requests_per_batch: int = 256,
    timeout_s: float | None = None,
    seed: int = 0,
) -> dict[str, Any]:
    """The requests through transformers' continuous-batching manager.

    The model is built from the checkpoint's config with random weights when
    ``load_format == "dummy"`` (as ours), else loaded. Each request goes in
    with its own ``max_new_tokens``; EOS is off (``eos_token_id=-1``), so
    every request produces exactly that many tokens. Sampling: temperature
    only (top-k 0, top-p 1), as ours. The manager is started (and, on CUDA,
    its graphs captured) before the clock starts, as our engine is. With
    ``timeout_s`` the run stops there; the result then says
    ``completed: false`` and counts only the finished requests' tokens.
    """
    import torch
    import transformers
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

    from engine.utils.torch_utils import resolve_dtype

    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    torch_dtype = resolve_dtype(dtype, device)
    torch.manual_seed(seed)
    if load_format == "dummy":
        with torch.device(device):
            hf_model = AutoModelForCausalLM.from_config(
                AutoConfig.from_pretrained(model), dtype=torch_dtype
            )
    else:
        hf_model = AutoModelForCausalLM.from_pretrained(model, dtype=torch_dtype).to(device)
    hf_model.eval()

    generation_config = GenerationConfig(
        max_new_tokens=max(r.expected_output_len for r in requests),
        do_sample=temperature > 0,
        temperature=temperature if temperature > 0 else None,
        top_k=0,
        top_p=1.0,
        eos_token_id=-1,  # never stop early: ignore_eos
    )
    cb_values = {
        "page_size": page_size,
        "max_batch_tokens": max_batch_tokens,
        "max_requests_per_batch": max_requests_per_batch,
    }
    if device == "cpu":
        # No graphs on CPU, and a cache sized to the requests (left alone,
        # transformers sizes it from free memory, which on a host is most of RAM).
        cb_values["use_cuda_graph"] = False
        cb_values["num_blocks"] = (
            sum(-(-(r.prompt_len + r.expected_output_len) // page_size) for r in requests) + 8
        )
    try:
        from transformers.generation import ContinuousBatchingConfig
    except ImportError:
        raise RuntimeError(
            f"transformers {transformers.__version__} has no ContinuousBatchingConfig; "
            "the hf backend was written against 5.17 and 5.24, which have it"
        ) from None
    cb_config, cb_used = _continuous_batching_config(ContinuousBatchingConfig, cb_values)

    results: dict[str, Any] = {}
    completed = True
    with hf_model.continuous_batching_context_manager(
        generation_config=generation_config,
        continuous_batching_config=cb_config,
        block=True,
        timeout=30,
    ) as manager:
        start = time.perf_counter()
        for i, r in enumerate(requests):
            manager.add_request(
                input_ids=r.prompt_token_ids,
                request_id=f"r{i}",
                max_new_tokens=r.expected_output_len,
            )
        while len(results) < len(requests):
            if timeout_s is not None and time.perf_counter() - start > timeout_s:
                completed = False
                break
            result = manager.get_result(timeout=1)
            if result is None:
                if not manager.is_running():
                    raise RuntimeError(
                        f"transformers' batching thread stopped after {len(results)} results"
                    )
                continue
            if result.is_finished():
                if result.error is not None:
                    raise RuntimeError(
                        f"transformers request {result.request_id} failed: {result.error}"
                    )
                results[result.request_id] = result
        elapsed = time.perf_counter() - start
        attn_implementation = hf_model.config._attn_implementation  # as switched for batching
    lengths = {int(k[1:]): len(v.generated_tokens) for k, v in results.items()}
    finished = [requests[i] for i in sorted(lengths)]
    out = _summary(finished or requests, elapsed, sum(lengths.values()))
    out.update(
        completed=completed,
        num_requests_submitted=len(requests),
        num_requests_finished=len(results),
        all_lengths_as_requested=all(
            lengths[i] == requests[i].expected_output_len for i in lengths
        ),
        transformers_version=transformers.__version__,
        attn_implementation=attn_implementation,
        dtype=str(torch_dtype).removeprefix("torch."),
        device=device,
        continuous_batching_config={
            k: repr(v) if not isinstance(v, (int, float, str, bool, type(None))) else v
            for k, v in dataclasses.asdict(cb_config).items()
        }
        if dataclasses.is_dataclass(cb_config)
        else cb_used,
        generation_config={
            "temperature": temperature,
            "top_k": 0,
            "top_p": 1.0,
            "eos_token_id": -1,
            "per_request_max_new_tokens": True,
        },
    )
    del hf_model
    if device == "cuda":
        torch.cuda.empty_cache()
    return out


# ----------------------------------------------------------------------------
# Roofline and provenance
# ----------------------------------------------------------------------------
def roofline_for(
    requests: list[SampleRequest], engine_args: Any, bandwidth: float
) -> dict[str, Any]:
    from engine.benchmarks.roofline import count_model_bytes, throughput_bound_seconds
    from engine.utils.torch_utils import resolve_dtype

    config = engine_args.create_engine_config(UsageContext.LLM_CLASS)
    model_config = config.model_config
    dtype = resolve_dtype(
        model_config.dtype, config.device_config.resolve(), model_config.config_dtype
    )
    model_bytes = count_model_bytes(config.model_config, dtype)
    seconds = throughput_bound_seconds(requests, model_bytes, bandwidth)
    return {
        "copy_bandwidth_GBps": bandwidth / 1e9,
        "weight_bytes_per_step": model_bytes.weight_bytes_per_step,
        "kv_bytes_per_token": model_bytes.kv_bytes_per_token,
        "seconds": seconds,
        "output_tokens_per_second": sum(r.expected_output_len for r in requests) / seconds,
    }


def provenance() -> dict[str, Any]:
    import torch

    info: dict[str, Any] = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
        "torch": torch.__version__,
        "python": sys.version.split()[0],
    }
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            timeout=10,
            check=False,
            cwd=os.path.dirname(os.path.abspath(__file__)),
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        commit = ""
    info["commit"] = commit or os.environ.get("GLASSBOX_COMMIT")
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name()
    for name in ("transformers", "triton", "flashinfer"):
        try:
            module = __import__(name)
            info[name] = getattr(module, "__version__", "unknown")
        except ImportError:
            info[name] = None
    return info


def main(args: argparse.Namespace) -> dict[str, Any]:
    engine_args = engine_args_from_cli(args)
    engine = describe_engine(engine_args)
    vocab_size = engine_args.create_engine_config(UsageContext.LLM_CLASS).model_config.vocab_size
    requests, max_token_id = get_requests(args, vocab_size)
    result: dict[str, Any] = {
        "benchmark": "throughput",
        "backend": args.backend,
        **provenance(),
        "workload": {
            "num_requests": len(requests),
            "input_len": args.input_len,
            "output_len": args.output_len,
            "max_token_id": max_token_id,
            "seed": args.seed,
            "temperature": args.temperature,
            "ignore_eos": True,
        },
    }
    roofline = None
    if engine["device"] == "cuda" and not args.no_roofline:
        from engine.benchmarks.roofline import measure_copy_bandwidth

        roofline = roofline_for(requests, engine_args, measure_copy_bandwidth())
    if args.backend == "glassbox":
        result["engine"] = engine
        result.update(run_glassbox(requests, engine_args, args.temperature, args.num_warmups))
    else:
        result.update(
            run_hf(
                requests,
                engine["model"],
                device=engine["device"],
                dtype=engine["dtype"],  # what our engine resolved "auto" to
                load_format=engine_args.load_format,
                temperature=args.temperature,
                max_batch_tokens=engine["max_num_batched_tokens"],
                max_requests_per_batch=engine["max_num_seqs"],
                timeout_s=args.hf_timeout_s,
                seed=args.seed,
            )
        )
    if roofline is not None:
        roofline["fraction_reached"] = (
            result["output_tokens_per_second"] / roofline["output_tokens_per_second"]
        )
        result["roofline"] = roofline
    print(
        f"Throughput: {result['requests_per_second']:.2f} requests/s, "
        f"{result['tokens_per_second']:.2f} total tokens/s, "
        f"{result['output_tokens_per_second']:.2f} output tokens/s"
    )
    print(f"Total num prompt tokens:  {result['total_prompt_tokens']}")
    print(f"Total num output tokens:  {result['total_output_tokens']}")
    if roofline is not None:
        print(
            f"Roofline: {roofline['output_tokens_per_second']:.0f} output tokens/s at "
            f"{roofline['copy_bandwidth_GBps']:.0f} GB/s; "
            f"reached {roofline['fraction_reached']:.1%}"
        )
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(result, f, indent=1)
    return result
