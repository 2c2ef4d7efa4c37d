"""``glassbox trace "PROMPT"``: run a prompt with tracing on, then watch it in the TUI.

vLLM twin: none (vLLM's CLI has ``vllm serve`` / ``vllm bench``; it has no
tracer). Read it for a run built to teach: the prompt goes in alongside a
few varied background requests on a deliberately small engine --

  * a small token budget per step (``--max-num-batched-tokens``, 64), so
    prompts are prefilled in chunks over several steps;
  * a small KV pool (``--num-gpu-blocks-override``, sized from the prompts
    to about 40% of what all requests could need at once), so requests wait
    for blocks and the scheduler preempts the newest running request when a
    running one needs a block and none is free;
  * one shared system prompt, so every request after the first hits the
    prefix cache for its first blocks; and one background request repeats
    your prompt a few steps later, hitting (almost) all of it.

The run is recorded with ``trace_level="full"`` (or ``lifecycle``) to
``--trace-path``; two extra events go in at the end through the engine's own
tracer: ``trace.cli`` (which request is yours, by the internal id the engine
gave it -- ``prompt-`` plus 8 hex characters, like every id in the trace) and
``trace.token_texts`` (the text of every token id the trace mentions, so the
TUI can show candidates and block contents without loading a tokenizer).
Then the TUI opens, following your request; ``--headless`` prints a text
summary of its lifecycle instead (and without a terminal the command stops
before recording, pointing at ``--headless``). Your request may not show
everything the run was built for -- a preemption depends on who runs out of
blocks first -- so the TUI's lifecycle panel and the summary name the
request that shows what yours does not (``TraceSession.highlights``).
The engine core runs in this process (``enable_multiprocessing=False``): the
trace is the same, and start-up is quicker.
Sessions: 01 (the engine loop, end to end); all (the tracer).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from dataclasses import dataclass
from typing import Any

from engine.tracing import (
    GrammarMasked,
    RequestAdded,
    RunnerInputs,
    SamplerSampled,
    SchedUpdate,
    load_trace,
)
from engine.tracing.engine_trace import CliTrace
from engine.utils.argparse_utils import optimization_level

HELP = "Run a prompt (plus background requests) with tracing on, then follow it in the TUI."

DEFAULT_TRACE_PATH = "glassbox_trace.jsonl"
DEFAULT_CONCURRENT = 5
FOLLOWED_REQUEST_ID = "prompt"

# Long enough to fill three 16-token KV blocks, which every request then shares.
SYSTEM_PROMPT = (
    "You are a concise assistant inside Glassbox, a small inference engine that its users "
    "read to learn how vLLM schedules requests, caches attention keys and values in blocks, "
    "and samples tokens. Answer in plain sentences."
)
# Background requests: (text, max_tokens, sampling overrides, arrival step).
# Varied on purpose: short and long answers, a long prompt (chunked prefill),
# greedy and random sampling. None as text means "your prompt again".
LONG_PASSAGE = (
    "Summarize this in one sentence: A paged KV cache stores the attention keys and values of "
    "every request in fixed-size blocks, the way an operating system stores memory in pages. "
    "A request's block table maps its token positions to physical blocks, so its cache need "
    "not be contiguous and no memory is reserved for tokens that never come. Blocks whose "
    "content is identical across requests, such as a shared system prompt, are found by "
    "hashing and reused instead of recomputed, and when memory runs out the scheduler "
    "preempts a request, frees its blocks and recomputes it later."
)
BACKGROUND_REQUESTS: list[tuple[str | None, int, dict[str, Any], int]] = [
    ("Write a short poem about the sea.", 64, {"temperature": 0.8, "top_p": 0.95}, 0),
    ("Name three primary colors.", 24, {"temperature": 0.0}, 0),
    (LONG_PASSAGE, 40, {"temperature": 0.0}, 0),
    (None, 24, {"temperature": 0.0}, 4),
    ("Count from one to twenty in words.", 64, {"temperature": 0.5, "top_k": 20}, 6),
    ("Give me one fun fact about octopuses.", 40, {"temperature": 0.7, "min_p": 0.05}, 8),
]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("prompt", metavar="PROMPT", help="the prompt to follow")
    parser.add_argument(
        "--model",
        default=None,
        help="HF checkpoint folder, or a Hub name already in the Hugging Face cache "
        "(default: the embedded SmolLM2-135M-Instruct)",
    )
    parser.add_argument(
        "--device",
        default="auto",
        choices=("auto", "cpu", "cuda"),
        help="where the model runs (auto: CUDA when torch sees a GPU)",
    )
    parser.add_argument(
        "--trace-level",
        default="full",
        choices=("lifecycle", "full"),
        help="full adds the sampler's candidates per stage",
    )
    parser.add_argument(
        "--concurrent",
        type=int,
        default=DEFAULT_CONCURRENT,
        metavar="N",
        help="background requests run alongside",
    )
    parser.add_argument(
        "--trace-path",
        default=DEFAULT_TRACE_PATH,
        metavar="P",
        help="where the trace is written",
    )
    parser.add_argument(
        "--headless",
        action="store_true",
        help="print a text summary of the prompt's lifecycle instead of the TUI",
    )
    parser.add_argument(
        "--max-tokens",
        type=int,
        default=48,
        help="new tokens per request at most: your prompt's limit, and a cap on "
        "the background requests' own",
    )
    parser.add_argument(
        "--temperature",
        type=float,
        default=0.6,
        help="your prompt's temperature (0 = greedy)",
    )
    parser.add_argument("--top-p", type=float, default=0.9, help="your prompt's top-p")
    parser.add_argument("--top-k", type=int, default=40, help="your prompt's top-k")
    parser.add_argument(
        "--seed",
        type=int,
        default=0,
        help="seed of every request's sampler (the run is reproducible)",
    )
    parser.add_argument(
        "--structured-outputs",
        type=json.loads,
        default=None,
        help="constrain your prompt's output, as JSON: '{\"json\": {...schema...}}', "
        '\'{"regex": "..."}\', \'{"choice": ["yes", "no"]}\' or \'{"grammar": "..."}\' '
        "(default: free)",
    )
    parser.add_argument(
        "--raw-prompt",
        action="store_true",
        help="send PROMPT as is instead of through the model's chat template",
    )
    engine = parser.add_argument_group(
        "engine options (defaults chosen to show chunking, prefix hits and preemption)"
    )
    engine.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=64,
        help="token budget of one step",
    )
    engine.add_argument(
        "--num-gpu-blocks-override",
        type=int,
        default=None,
        help="KV blocks in the pool, null block included (default: ~40%% of "
        "what all requests could need at once)",
    )
    engine.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    engine.add_argument(
        "--max-model-len",
        type=int,
        default=None,
        help="tokens per sequence at most (default: longest prompt + max tokens)",
    )
    engine.add_argument(
        "--max-num-seqs",
        type=int,
        default=None,
        help="running requests at most (default: the engine's)",
    )
    engine.add_argument(
        "--no-prefix-caching", action="store_true", help="turn the prefix cache off"
    )
    engine.add_argument(
        "--async-scheduling",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="overlap step N+1's scheduling with step N's forward (vLLM's default; "
        "--no-async-scheduling shows the serial loop) (default: on)",
    )
    engine.add_argument(
        "--speculative-config",
        type=json.loads,
        default=None,
        help='speculative decoding as JSON, e.g. \'{"method": "ngram", '
        '"num_speculative_tokens": 3}\' (default: off)',
    )
    engine.add_argument(
        "-O",
        "--optimization-level",
        type=optimization_level,
        default=None,
        metavar="{0,1,2,3}",
        help="0 eager; 1 compiled, piecewise CUDA graphs; 2, 3 compiled, full graphs for "
        "decodes (default: 2 on CUDA, 0 on the CPU)",
    )


@dataclass
class PlannedRequest:
    request_id: str
    text: str  # what the user typed (or the background prompt)
    max_tokens: int
    sampling: dict[str, Any]
    arrival_step: int
    prompt_text: str = ""  # after the chat template
    prompt_token_ids: list[int] | None = None


def _check_args(args: argparse.Namespace) -> None:
    if not args.prompt.strip():
        raise ValueError("PROMPT must not be empty")
    if args.concurrent < 0:
        raise ValueError(f"--concurrent must be >= 0, got {args.concurrent}")
    if args.max_tokens < 1:
        raise ValueError(f"--max-tokens must be >= 1, got {args.max_tokens}")
    if args.max_num_batched_tokens < 1:
        raise ValueError(
            f"--max-num-batched-tokens must be >= 1, got {args.max_num_batched_tokens}"
        )
    if args.block_size < 1:
        raise ValueError(f"--block-size must be >= 1, got {args.block_size}")


def plan_requests(args: argparse.Namespace) -> list[PlannedRequest]:
    """The followed prompt and ``--concurrent`` background requests, with the
    step at which each arrives. Background requests that arrive at step 0 are
    added before the prompt, so the prompt is the newest running request."""
    yours = dict(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k)
    planned = []
    for i in range(args.concurrent):
        text, max_tokens, sampling, arrival = BACKGROUND_REQUESTS[i % len(BACKGROUND_REQUESTS)]
        if i >= len(BACKGROUND_REQUESTS):
            arrival += 2 * (i // len(BACKGROUND_REQUESTS)) + 1
        if text is None:
            text, sampling = args.prompt, {**yours, "temperature": 0.0}
        max_tokens = min(max_tokens, args.max_tokens)
        planned.append(PlannedRequest(f"bg-{i + 1}", text, max_tokens, dict(sampling), arrival))
    first_late = next((k for k, r in enumerate(planned) if r.arrival_step > 0), len(planned))
    if args.structured_outputs is not None:
        from engine.sampling_params import StructuredOutputsParams

        # Only the followed prompt is constrained: the rest run free beside it.
        yours = {**yours, "structured_outputs": StructuredOutputsParams(**args.structured_outputs)}
    planned.insert(
        first_late, PlannedRequest(FOLLOWED_REQUEST_ID, args.prompt, args.max_tokens, yours, 0)
    )
    return planned


def _format_prompts(planned: list[PlannedRequest], tokenizer: Any, raw: bool) -> None:
    chat = not raw and getattr(tokenizer, "chat_template", None)
    for r in planned:
        if chat:
            messages = [
                {"role": "system", "content": SYSTEM_PROMPT},
                {"role": "user", "content": r.text},
            ]
            r.prompt_text = tokenizer.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=True
            )
            # The template wrote any BOS already.
            r.prompt_token_ids = tokenizer.encode(r.prompt_text, add_special_tokens=False)
        else:
            r.prompt_text = r.text
            r.prompt_token_ids = tokenizer.encode(r.text)


# The pool holds this fraction of the blocks all requests would need at their
# longest: requests wait for blocks and running ones get preempted, yet a run
# of a few short requests still finishes in well under a hundred steps.
POOL_FRACTION = 0.4


def _pool_size(planned: list[PlannedRequest], block_size: int, max_model_len: int) -> int:
    """``POOL_FRACTION`` of the blocks all requests would hold at their
    longest, but never less than one full-length sequence (+ the null block
    + 2 spare)."""
    need = sum(
        math.ceil((len(r.prompt_token_ids or []) + r.max_tokens) / block_size) for r in planned
    )
    floor = math.ceil(max_model_len / block_size) + 3
    return max(floor, int(POOL_FRACTION * need) + 1)


def record_trace(args: argparse.Namespace) -> str:
    """Run the planned requests with tracing on; returns the trace path."""
    from engine.config.model import resolve_model_path
    from engine.engine.arg_utils import EngineArgs
    from engine.model_executor.model_loader.default_model import resolve_model
    from engine.sampling_params import SamplingParams
    from engine.transformers_utils.tokenizer import get_tokenizer
    from engine.v1.engine.llm_engine import LLMEngine

    planned = plan_requests(args)
    # A folder before the tokenizer looks: a wrong name fails here, without the hub.
    model = resolve_model_path(resolve_model(args.model))
    tokenizer = get_tokenizer(model)
    _format_prompts(planned, tokenizer, args.raw_prompt)
    longest = max(len(r.prompt_token_ids or []) + r.max_tokens for r in planned)
    max_model_len = args.max_model_len or math.ceil(longest / args.block_size) * args.block_size
    if longest > max_model_len:
        raise ValueError(
            f"--max-model-len {max_model_len} is shorter than the longest request "
            f"({longest} tokens of prompt and output); raise it or lower --max-tokens"
        )
    num_blocks = args.num_gpu_blocks_override or _pool_size(planned, args.block_size, max_model_len)
    trace_path = os.path.abspath(args.trace_path)
    engine_args = EngineArgs(
        model=model,
        device=args.device,
        seed=args.seed,
        max_model_len=max_model_len,
        block_size=args.block_size,
        num_gpu_blocks_override=num_blocks,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_num_seqs=args.max_num_seqs,
        enable_prefix_caching=not args.no_prefix_caching,
        async_scheduling=args.async_scheduling,
        speculative_config=args.speculative_config,
        optimization_level=args.optimization_level,
        disable_log_stats=True,
        trace_path=trace_path,
        trace_level=args.trace_level,
    )
    if progress := sys.stderr.isatty():
        print(
            f"glassbox trace: {len(planned)} requests on {model} "
            f"({num_blocks} KV blocks of {args.block_size} tokens, "
            f"{args.max_num_batched_tokens} tokens per step)",
            file=sys.stderr,
        )
    engine = LLMEngine.from_engine_args(engine_args, enable_multiprocessing=False)
    tracer = engine.tracer
    trace = CliTrace.create(tracer)
    try:
        # The trace knows each request by the internal id the engine gave it.
        internal_ids: dict[str, str] = {}
        pending = sorted(planned, key=lambda r: r.arrival_step)  # stable: keeps step-0 order
        step = 0
        while pending or engine.has_unfinished_requests():
            if not engine.has_unfinished_requests() and pending:
                step = max(step, pending[0].arrival_step)
            while pending and pending[0].arrival_step <= step:
                r = pending.pop(0)
                params = SamplingParams(max_tokens=r.max_tokens, seed=args.seed, **r.sampling)
                internal_ids[r.request_id] = engine.add_request(
                    r.request_id,
                    {"prompt": r.prompt_text, "prompt_token_ids": r.prompt_token_ids},
                    params,
                )
            engine.step()
            step += 1
            if progress:
                print(f"\rglassbox trace: step {step}", end="", file=sys.stderr, flush=True)
        if progress:
            print(file=sys.stderr)
        arrival_steps = {internal_ids[r.request_id]: r.arrival_step for r in planned}
        trace.run_planned(internal_ids[FOLLOWED_REQUEST_ID], args.prompt, model, arrival_steps)
        tracer.flush()  # the token texts are read back from the file
        trace.token_texts(_token_texts(trace_path, tokenizer))
    finally:
        engine.shutdown()
    return trace_path


def _missing_terminal() -> str | None:
    from tui.terminal import missing_terminal

    return missing_terminal()


def _token_texts(trace_path: str, tokenizer: Any) -> dict[str, str]:
    """The decoded text of every token id the trace mentions so far."""
    ids: set[int] = set()
    for e in load_trace(trace_path):
        if isinstance(e, RequestAdded):
            ids.update(e.prompt_token_ids or [])
        elif isinstance(e, SchedUpdate):
            for tokens in e.new_token_ids.values():
                ids.update(tokens)
        elif isinstance(e, SamplerSampled):
            ids.add(e.token_id)
            for stage in e.stages or ():
                ids.update(stage.token_ids)
        elif isinstance(e, RunnerInputs):
            summary = e.input_ids
            for values in (summary.values, summary.head, summary.tail):
                ids.update(values or [])
        elif isinstance(e, GrammarMasked):
            ids.update(e.masked_top_token_ids)
            ids.update((e.top_token_id_before, e.top_token_id_after))
    # -1: a placeholder (async scheduling: the id was still on the device).
    return {str(t): tokenizer.decode([t]) for t in sorted(ids) if t >= 0}


def run(args: argparse.Namespace) -> int:
    try:
        _check_args(args)
        if not args.headless and (missing := _missing_terminal()):
            # Checked before the run: the TUI could not open at its end.
            print(
                f"glassbox trace: the TUI needs a terminal ({missing}). For a text summary, "
                "add --headless",
                file=sys.stderr,
            )
            return 2
        trace_path = record_trace(args)
    except (ValueError, OSError) as e:
        # Bad arguments, a model folder that is not there, a pool too small...
        print(f"glassbox trace: error: {e}", file=sys.stderr)
        return 2
    except RuntimeError as e:
        print(f"glassbox trace: error: the engine failed: {e}", file=sys.stderr)
        return 1
    from tui.session import TraceLoadError, open_session

    try:
        session = open_session(trace_path)
    except TraceLoadError as e:
        print(
            f"glassbox trace: the run finished but its trace cannot be shown: {e}", file=sys.stderr
        )
        return 1
    # Your request by the internal id the engine gave it (from trace.cli).
    followed = session.info.followed_request_id
    from engine.entrypoints.cli.main import command_name

    replay = f"replay it with: {command_name()} tui {trace_path}"
    if args.headless:
        from tui.summary import request_summary

        print(request_summary(session, followed))
        print(f"\nTrace written to {trace_path}; {replay}")
        return 0
    from tui.app import TraceApp

    TraceApp(session, follow=followed).run()
    print(f"Trace written to {trace_path}; {replay}")
    return 0
