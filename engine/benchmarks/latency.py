"""``glassbox bench latency``: the wall time of one decode step.

vLLM twin: ``vllm/benchmarks/latency.py`` (``add_cli_args``, ``main``).
Read it for what a decode step costs at a given batch size and context: for
each batch size B it adds B requests whose prompts are ``--input-len``
tokens, steps the engine until every one of them is decoding, then times
``EngineCore.step_fn()`` one call at a time -- schedule, model forward (a
CUDA graph replay when one is captured for B), sampling, outputs -- and
reports the mean and percentiles in milliseconds. Each call waits for one
step's sampled tokens, so host timing is the step's time: with async
scheduling (the default) one call launches step N+1 and then reads step N,
and the host work of one hides behind the device work of the other.

``--client-itl`` also measures what a user sees: the time between a
request's consecutive tokens as they reach ``LLMEngine`` (EngineCore in its
own process, as under ``LLM.generate``), median over all gaps.

On CUDA each batch size also gets its floor: reading the weights once plus B
contexts of K/V, over the copy bandwidth measured in the same run
(``roofline.decode_step_floor_seconds``).
Sessions: 06 (performance), 04 (what a step does).

Different from vLLM: vLLM's latency benchmark times whole ``generate``
calls (one batch, ``--input-len`` 32, ``--output-len`` 128, ``--batch-size``
8) and so mixes prefill into the figure; this one isolates the decode step,
the figure the CUDA-graph and kernel work moves. ``--batch-size`` takes a
comma-separated list. EngineCore runs in this process.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

from engine.benchmarks.throughput import (
    describe_engine,
    engine_args_from_cli,
    provenance,
)
from engine.usage.usage_lib import UsageContext

# Give up on a batch whose prompts never all get through (a KV cache too small).
MAX_PREFILL_STEPS = 10_000


def _batch_sizes(value: str) -> list[int]:
    try:
        sizes = [int(v) for v in str(value).split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"--batch-size must be integers separated by commas, got {value!r}"
        ) from None
    if not sizes or any(s < 1 for s in sizes):
        raise argparse.ArgumentTypeError(
            f"--batch-size needs at least one size >= 1, got {value!r}"
        )
    return sizes


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    from engine.entrypoints.openai.cli_args import add_engine_args

    parser.add_argument(
        "--batch-size",
        type=_batch_sizes,
        default=[1, 16, 64, 256],
        help="decode batch sizes, comma-separated (default 1,16,64,256)",
    )
    parser.add_argument(
        "--input-len", type=int, default=512, help="prompt (context) length (default 512)"
    )
    parser.add_argument(
        "--num-iters-warmup", type=int, default=4, help="decode steps before timing (default 4)"
    )
    parser.add_argument("--num-iters", type=int, default=32, help="decode steps timed (default 32)")
    parser.add_argument(
        "--no-roofline",
        action="store_true",
        help="skip the bandwidth measurement and floor on CUDA",
    )
    parser.add_argument(
        "--client-itl",
        action="store_true",
        help="also time the gaps between tokens as the client receives them "
        "(EngineCore in its own process)",
    )
    parser.add_argument(
        "--output-len",
        type=int,
        default=128,
        help="tokens per request for --client-itl (default 128)",
    )
    parser.add_argument("--output-json", default=None, help="write the results to this JSON file")
    add_engine_args(parser)
    # Prefix caching would let later batch sizes reuse earlier prompts' KV.
    parser.set_defaults(
        skip_tokenizer_init=True,
        enable_prefix_caching=False,
        max_num_batched_tokens=16384,
        disable_log_stats=True,
        max_num_seqs=None,
    )


def _step(core: Any) -> None:
    """One turn of EngineCore's loop as its busy loop takes it: the step, then
    ``post_step`` (which hands a speculative run's drafts to the scheduler)."""
    _, model_executed = core.step_fn()
    core.post_step(model_executed)


def run_decode_latency(
    engine_args: Any,
    batch_sizes: list[int],
    input_len: int = 512,
    num_iters: int = 32,
    num_iters_warmup: int = 4,
    seed: int = 0,
) -> dict[str, dict[str, Any]]:
    """Per batch size: the step times in ms and their summary."""
    import random

    from engine.sampling_params import SamplingParams
    from engine.v1.engine.core import EngineCore
    from engine.v1.executor.abstract import Executor
    from engine.v1.request import Request

    if input_len < 1 or num_iters < 1 or num_iters_warmup < 0:
        raise ValueError(
            "need input_len >= 1, num_iters >= 1, num_iters_warmup >= 0; "
            f"got {input_len}, {num_iters}, {num_iters_warmup}"
        )
    config = engine_args.create_engine_config(UsageContext.LLM_CLASS)
    if max(batch_sizes) > config.scheduler_config.max_num_seqs:
        raise ValueError(
            f"batch size {max(batch_sizes)} exceeds "
            f"max_num_seqs={config.scheduler_config.max_num_seqs}"
        )
    if input_len + num_iters_warmup + num_iters + 2 > config.model_config.max_model_len:
        raise ValueError(
            f"--input-len {input_len} plus the steps exceeds "
            f"max_model_len={config.model_config.max_model_len}"
        )
    rng = random.Random(seed)
    max_token_id = min(10000, config.model_config.vocab_size - 1)
    core = EngineCore(config, Executor.get_class(config), log_stats=False)
    results: dict[str, dict[str, Any]] = {}
    try:
        for b in batch_sizes:
            params = SamplingParams(
                temperature=0, ignore_eos=True, max_tokens=num_iters_warmup + num_iters + 2
            )
            requests = [
                Request(
                    f"b{b}-{i}", [rng.randint(0, max_token_id) for _ in range(input_len)], params
                )
                for i in range(b)
            ]
            for r in requests:
                core.add_request(r)
            # Prefill (in chunks of the token budget) until every request decodes.
            steps = 0
            while any(r.num_output_tokens == 0 for r in requests):
                _step(core)
                steps += 1
                if steps > MAX_PREFILL_STEPS:
                    raise RuntimeError(
                        f"batch {b}: not every request was decoding after {steps} steps"
                    )
            for _ in range(num_iters_warmup):
                _step(core)
            scheduler = core.scheduler
            if len(scheduler.running) != b or scheduler.waiting:
                raise RuntimeError(
                    f"batch {b}: {len(scheduler.running)} running and "
                    f"{len(scheduler.waiting)} waiting "
                    "before timing; the KV cache may be too small for this batch"
                )
            times_ms = []
            for _ in range(num_iters):
                start = time.perf_counter()
                _step(core)
                times_ms.append((time.perf_counter() - start) * 1e3)
            core.abort_requests([r.request_id for r in requests])
            # Tell the worker, and read back any step still in flight.
            while core.scheduler.has_requests() or core.batch_queue:
                _step(core)
            ordered = sorted(times_ms)
            results[str(b)] = {
                "batch_size": b,
                "context_len": input_len,
                "mean_ms": statistics.fmean(times_ms),
                "median_ms": statistics.median(times_ms),
                "p90_ms": ordered[min(len(ordered) - 1, int(0.9 * len(ordered)))],
                "min_ms": ordered[0],
                "max_ms": ordered[-1],
                "step_ms": times_ms,
            }
    finally:
        core.shutdown()
        del core
        from engine.utils.torch_utils import release_device_memory

        release_device_memory()
    return results


def run_client_itl(
    engine_args: Any,
    batch_size: int,
    input_len: int = 512,
    output_len: int = 128,
    seed: int = 0,
) -> dict[str, Any]:
    """Inter-token times as the client sees them: ``batch_size`` requests of
    ``input_len`` random tokens, ``output_len`` tokens each (EOS ignored),
    through ``LLMEngine`` with EngineCore in its own process; every new token
    is stamped when ``step()`` hands it over. Returns the median, mean and
    p90 of the gaps between a request's consecutive tokens, in ms, and the
    time to first token."""
    import random

    from engine.sampling_params import RequestOutputKind, SamplingParams
    from engine.v1.engine.llm_engine import LLMEngine

    if output_len < 2:
        raise ValueError(f"output_len must be >= 2 to have a gap, got {output_len}")
    engine = LLMEngine.from_engine_args(engine_args, usage_context=UsageContext.LLM_CLASS)
    try:
        rng = random.Random(seed)
        vocab = min(10000, engine.glassbox_config.model_config.vocab_size - 1)
        params = SamplingParams(
            temperature=0,
            ignore_eos=True,
            max_tokens=output_len,
            output_kind=RequestOutputKind.DELTA,
        )
        # A short warm-up request first: kernels and graphs are ready when timing starts.
        warm = SamplingParams(temperature=0, ignore_eos=True, max_tokens=4)
        engine.add_request("warm-up", {"prompt_token_ids": [1] * min(16, input_len)}, warm)
        while engine.has_unfinished_requests():
            engine.step()
        start = time.perf_counter()
        for i in range(batch_size):
            prompt = [rng.randint(0, vocab) for _ in range(input_len)]
            engine.add_request(f"itl-{i}", {"prompt_token_ids": prompt}, params)
        stamps: dict[str, list[float]] = {f"itl-{i}": [] for i in range(batch_size)}
        while engine.has_unfinished_requests():
            for out in engine.step():
                now = time.perf_counter()
                stamps[out.request_id].extend([now] * len(out.outputs[0].token_ids))
    finally:
        engine.shutdown()
    gaps_ms = sorted((b - a) * 1e3 for times in stamps.values() for a, b in zip(times, times[1:]))
    ttft_ms = statistics.median((times[0] - start) * 1e3 for times in stamps.values())
    return {
        "batch_size": batch_size,
        "context_len": input_len,
        "output_len": output_len,
        "median_itl_ms": statistics.median(gaps_ms),
        "mean_itl_ms": statistics.fmean(gaps_ms),
        "p90_itl_ms": gaps_ms[min(len(gaps_ms) - 1, int(0.9 * len(gaps_ms)))],
        "median_ttft_ms": ttft_ms,
    }


def main(args: argparse.Namespace) -> dict[str, Any]:
    if args.max_num_seqs is None:
        args.max_num_seqs = max(args.batch_size)
    engine_args = engine_args_from_cli(args)
    engine = describe_engine(engine_args)
    result: dict[str, Any] = {
        "benchmark": "latency",
        **provenance(),
        "engine": engine,
        "input_len": args.input_len,
        "num_iters": args.num_iters,
        "num_iters_warmup": args.num_iters_warmup,
    }
    bandwidth = None
    if engine["device"] == "cuda" and not args.no_roofline:
        from engine.benchmarks.roofline import measure_copy_bandwidth

        bandwidth = measure_copy_bandwidth()
        result["copy_bandwidth_GBps"] = bandwidth / 1e9
    per_batch = run_decode_latency(
        engine_args,
        args.batch_size,
        args.input_len,
        args.num_iters,
        args.num_iters_warmup,
        args.seed,
    )
    if bandwidth is not None:
        import torch

        from engine.benchmarks.roofline import (
            count_model_bytes,
            decode_step_floor_seconds,
        )

        config = engine_args.create_engine_config(UsageContext.LLM_CLASS)
        model_bytes = count_model_bytes(config.model_config, getattr(torch, engine["dtype"]))
        for entry in per_batch.values():
            floor = decode_step_floor_seconds(
                entry["batch_size"], args.input_len, model_bytes, bandwidth
            )
            entry["floor_ms"] = floor * 1e3
    result["decode_latency"] = per_batch
    if args.client_itl:
        result["client_itl"] = {
            str(b): run_client_itl(engine_args, b, args.input_len, args.output_len, args.seed)
            for b in args.batch_size
        }
        for b, entry in result["client_itl"].items():
            print(
                f"batch {b:>4} ctx {args.input_len}: client inter-token time median "
                f"{entry['median_itl_ms']:.3f} ms, p90 {entry['p90_itl_ms']:.3f} ms "
                f"({entry['output_len']} tokens per request)"
            )
    for b, entry in per_batch.items():
        floor = f", floor {entry['floor_ms']:.3f} ms" if "floor_ms" in entry else ""
        print(
            f"batch {b:>4} ctx {args.input_len}: mean {entry['mean_ms']:.3f} ms, "
            f"median {entry['median_ms']:.3f} ms, "
            f"p90 {entry['p90_ms']:.3f} ms per decode step{floor}"
        )
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(result, f, indent=1)
    return result
