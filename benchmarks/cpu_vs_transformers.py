"""CPU throughput: Glassbox ``LLM.chat`` against transformers ``generate``.

Workload: 32 short chat questions, 64 new tokens each (greedy, EOS does not
stop generation), on the default model (SmolLM2-135M-Instruct, float32, CPU).
Both engines run on the same machine in one run of this script, with the same
thread count (``torch.set_num_threads`` here, ``OMP_NUM_THREADS`` for the
EngineCore process Glassbox spawns); their timed runs are interleaved
(G, T, G, T, ...) so that background load on the machine hits both alike.

What is timed (wall clock, ``time.perf_counter``; CPU time of this process and
of the EngineCore process is recorded beside it):
  * Glassbox: one ``llm.chat(conversations, SamplingParams(temperature=0,
    max_tokens=64, ignore_eos=True), use_tqdm=False)`` call -- chat template,
    tokenization, scheduling, prefill, 64 decode steps, detokenization. The
    prefix cache is reset before every timed run, so a run never reuses the KV
    of an earlier run (prompts still share the chat template's system prompt
    *within* a run, as they would for any user).
  * transformers, batched (the strong baseline): chat template, tokenization of
    all 32 prompts as one left-padded batch, one ``model.generate(do_sample=False,
    max_new_tokens=64, min_new_tokens=64, use_cache=True)`` call, and
    ``batch_decode`` of the new tokens. EOS stopping is switched off
    (``eos_token_id=None``) to match ``ignore_eos=True``: with EOS on,
    ``min_new_tokens`` would mask the EOS logit and change the greedy tokens.
  * transformers, batch size 1 (context only): the same, one prompt at a time.
  * Glassbox, batch size 1 (context only): one ``llm.chat`` call per prompt.

Throughput = output tokens / wall time (output tokens only; prefill time
counts, prompt tokens don't), as in nano-vllm's and vLLM's offline benchmarks.

``--profile`` adds runs that do not count towards the headline: one Glassbox
run (EngineCore in-process) with section timers -- scheduler, model forward
split into linear / attention / norm / RoPE / activation, LM head, sampler,
detokenizer, the rest = Python glue -- and ``torch.profiler`` tables of the
busiest ops for one Glassbox and one transformers batched run.

Run:  .venv/bin/python benchmarks/cpu_vs_transformers.py --threads 1 --profile --record
(``--record`` stores the run as ``benchmarks/results/cpu_vs_transformers_cpu.json`` and
appends it to ``history.jsonl``; ``--out FILE`` writes the JSON anywhere.
benchmarks/README.md says why the committed results use one thread.)
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as _dt
import hashlib
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from benchmarks import results_store  # noqa: E402

# 32 varied, realistic short questions: facts, how-to, code, writing, advice.
QUESTIONS: list[str] = [
    "What is the capital of Australia?",
    "How do I reverse a list in Python?",
    "Explain photosynthesis in simple terms.",
    "What are three tips for improving sleep quality?",
    "Why is the sky blue?",
    "Can you suggest a name for a golden retriever puppy?",
    "What is the difference between a virus and a bacterium?",
    "How many minutes are there in a week?",
    "Write a haiku about autumn leaves.",
    "What does HTTP stand for?",
    "Give me a quick recipe for pancakes.",
    "Who wrote Pride and Prejudice?",
    "What is the boiling point of water at sea level in Fahrenheit?",
    "How can I politely decline a meeting invitation?",
    "What is machine learning?",
    "Summarize the plot of Romeo and Juliet in two sentences.",
    "What should I pack for a weekend hiking trip?",
    "How does a refrigerator keep food cold?",
    "Translate 'good morning' into Spanish and French.",
    "What is the Pythagorean theorem?",
    "Why do cats purr?",
    "What are the health benefits of drinking enough water?",
    "How do I make a strong password that I can still remember?",
    "What is the largest planet in our solar system?",
    "Explain what a black hole is to a ten-year-old.",
    "What is the difference between weather and climate?",
    "Suggest three indoor activities for a rainy day.",
    "How do vaccines train the immune system?",
    "What is a prime number? Give two examples.",
    "How do I fix a flat tire on a bicycle?",
    "What causes ocean tides?",
    "Write a short thank-you note to my math teacher.",
]

WARMUP_QUESTIONS = ["Hello! Who are you?", "Name a color."]
WARMUP_TOKENS = 8


# ---------------------------------------------------------------------------
# Machine / environment facts
# ---------------------------------------------------------------------------
def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def cpu_flags_of_interest() -> list[str]:
    wanted = ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile")
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                flags = set(line.split(":", 1)[1].split())
                return [f for f in wanted if f in flags]
    except OSError:
        pass
    return []


def mem_total_gib() -> float | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return round(int(line.split()[1]) / (1 << 20), 1)
    except OSError:
        pass
    return None


def load_average() -> list[float] | None:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def git_commit() -> dict[str, Any]:
    def run(*args: str) -> str:
        return subprocess.run(
            ["git", *args], cwd=REPO_ROOT, capture_output=True, text=True, check=False
        ).stdout

    # Uncommitted engine changes would make the commit hash a lie: record
    # which files differ and a hash of the diff, so the run can be traced.
    dirty = [line[3:] for line in run("status", "--porcelain", "--", "engine").splitlines()]
    diff = run("diff", "HEAD", "--", "engine")
    return {
        "commit": run("rev-parse", "HEAD").strip() or None,
        "engine_dirty": bool(dirty),
        "engine_uncommitted_files": dirty,
        "engine_diff_sha256": hashlib.sha256(diff.encode()).hexdigest() if dirty else None,
    }


# ---------------------------------------------------------------------------
# Glassbox
# ---------------------------------------------------------------------------
def conversations(questions: list[str]) -> list[list[dict[str, str]]]:
    return [[{"role": "user", "content": q}] for q in questions]


def process_cpu_seconds(pid: int) -> float:
    """utime + stime of another process, from /proc/<pid>/stat (clock ticks)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class Stopwatch:
    """Wall time and CPU time (all threads) of a block, this process plus
    ``other_pids`` (the EngineCore process when Glassbox runs multi-process).

    On a shared machine other programs steal cores: wall time then grows while
    CPU time barely moves, so with one torch thread CPU time is the
    contention-robust figure (with several threads it also counts spin-waits).
    """

    def __init__(self, other_pids: list[int] | None = None) -> None:
        self.other_pids = other_pids or []

    def _cpu_now(self) -> float:
        return time.process_time() + sum(process_cpu_seconds(p) for p in self.other_pids)

    def __enter__(self) -> Stopwatch:  # noqa: PYI034
        self._wall, self._cpu = time.perf_counter(), self._cpu_now()
        return self

    def __exit__(self, *exc: object) -> None:
        self.wall = time.perf_counter() - self._wall
        self.cpu = self._cpu_now() - self._cpu


def run_glassbox(llm: Any, questions: list[str], max_tokens: int) -> tuple[Stopwatch, list[Any]]:
    from engine import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    llm.reset_prefix_cache()
    with Stopwatch(engine_core_pids(llm)) as sw:
        outs = llm.chat(conversations(questions), params, use_tqdm=False)
    return sw, outs


def run_glassbox_bs1(
    llm: Any, questions: list[str], max_tokens: int
) -> tuple[Stopwatch, list[Any]]:
    from engine import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    llm.reset_prefix_cache()
    outs = []
    with Stopwatch(engine_core_pids(llm)) as sw:
        for q in questions:
            outs.extend(llm.chat(conversations([q]), params, use_tqdm=False))
    return sw, outs


def make_llm(path: str, engine_kwargs: dict[str, Any], multiprocess: bool | None) -> Any:
    """``multiprocess=None``: the engine's default (EngineCore in its own
    process unless GLASSBOX_ENABLE_MULTIPROCESSING=0)."""
    from engine import LLM

    env = "GLASSBOX_ENABLE_MULTIPROCESSING"
    saved = os.environ.get(env)
    if multiprocess is not None:
        os.environ[env] = "1" if multiprocess else "0"
    try:
        return LLM(path, **engine_kwargs)
    finally:
        if multiprocess is not None:
            if saved is None:
                os.environ.pop(env, None)
            else:
                os.environ[env] = saved


def engine_core_pids(llm: Any) -> list[int]:
    """The EngineCore process ids (empty when EngineCore runs in this process)."""
    return list(getattr(llm.llm_engine.engine_core, "engine_core_pids", []) or [])


def glassbox_prefix_cache_counters(llm: Any) -> dict[str, int]:
    try:
        metrics = llm.get_metrics()
    except (RuntimeError, AttributeError):  # metrics off / API changed: not essential
        return {}
    wanted = {"glassbox:prefix_cache_queries", "glassbox:prefix_cache_hits"}
    return {m.name.split(":", 1)[1]: int(m.value) for m in metrics if m.name in wanted}


# ---------------------------------------------------------------------------
# transformers
# ---------------------------------------------------------------------------
def hf_prompts(tokenizer: Any, questions: list[str]) -> list[str]:
    # Same text path as LLM.chat: template to text, then encode without
    # adding special tokens (the template already wrote them).
    return [
        tokenizer.apply_chat_template(c, tokenize=False, add_generation_prompt=True)
        for c in conversations(questions)
    ]


def hf_generate(
    model: Any,
    tokenizer: Any,
    questions: list[str],
    max_tokens: int,
    cache_implementation: str | None = None,
):
    """Chat template + left-padded batch + generate + decode. Returns
    (new token ids per prompt, texts, padded prompt length).
    ``cache_implementation=None``: transformers' default (a DynamicCache)."""
    cache_kwargs = (
        {} if cache_implementation is None else {"cache_implementation": cache_implementation}
    )
    enc = tokenizer(
        hf_prompts(tokenizer, questions),
        add_special_tokens=False,
        padding=True,
        padding_side="left",
        return_tensors="pt",
    )
    out = model.generate(
        **enc,
        do_sample=False,
        max_new_tokens=max_tokens,
        min_new_tokens=max_tokens,
        use_cache=True,
        eos_token_id=None,  # == ignore_eos: always produce max_tokens
        pad_token_id=tokenizer.pad_token_id,
        **cache_kwargs,
    )
    padded_len = enc["input_ids"].shape[1]
    new_ids = out[:, padded_len:].tolist()
    texts = tokenizer.batch_decode(new_ids, skip_special_tokens=True)
    return new_ids, texts, padded_len


def run_hf_batched(model, tokenizer, questions, max_tokens, cache_implementation=None):
    with torch.inference_mode(), Stopwatch() as sw:
        new_ids, _texts, padded_len = hf_generate(
            model, tokenizer, questions, max_tokens, cache_implementation
        )
    return sw, new_ids, padded_len


def run_hf_bs1(model, tokenizer, questions, max_tokens, cache_implementation=None):
    all_ids = []
    with torch.inference_mode(), Stopwatch() as sw:
        for q in questions:
            new_ids, _texts, _ = hf_generate(
                model, tokenizer, [q], max_tokens, cache_implementation
            )
            all_ids.extend(new_ids)
    return sw, all_ids


# ---------------------------------------------------------------------------
# Profiling Glassbox: section timers
# ---------------------------------------------------------------------------
class SectionTimers:
    """Wraps chosen callables with timers (inclusive wall and CPU seconds).

    The CPU backend runs synchronously, so the time spent inside a call is its
    cost. Wrapping is per instance (or module attribute), never by editing
    engine source, and ``restore`` undoes it.
    """

    def __init__(self) -> None:
        self.wall: dict[str, float] = defaultdict(float)
        self.cpu: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)
        self.missing: list[str] = []
        self._undo: list[Callable[[], None]] = []

    def wrap(self, owner: Any, attr: str, section: str, on_exit: Callable | None = None) -> None:
        fn = getattr(owner, attr, None)
        if fn is None:
            self.missing.append(f"{type(owner).__name__}.{attr}")
            return
        # Instance (or module) attribute: put it back; class attribute: drop ours.
        had_instance_attr = attr in getattr(owner, "__dict__", {})
        wall, cpu, calls = self.wall, self.cpu, self.calls
        perf, proc = time.perf_counter, time.process_time

        def timed(*args: Any, **kwargs: Any) -> Any:
            w0, c0 = perf(), proc()
            try:
                return fn(*args, **kwargs)
            finally:
                dw, dc = perf() - w0, proc() - c0
                wall[section] += dw
                cpu[section] += dc
                calls[section] += 1
                if on_exit is not None:
                    on_exit(args, dw, dc)

        setattr(owner, attr, timed)
        if had_instance_attr:
            self._undo.append(lambda: setattr(owner, attr, fn))
        else:
            self._undo.append(lambda: delattr(owner, attr))

    def restore(self) -> None:
        while self._undo:
            self._undo.pop()()


def glassbox_parts(llm: Any) -> tuple[Any, Any, Any]:
    engine = llm.llm_engine
    core = engine.engine_core.engine_core
    runner = core.model_executor.driver_worker.model_runner
    return engine, core, runner


def install_glassbox_timers(llm: Any) -> tuple[SectionTimers, list[dict[str, Any]]]:
    """Timers on an in-process LLM (GLASSBOX_ENABLE_MULTIPROCESSING=0)."""
    import engine.v1.worker.gpu_model_runner as runner_module
    from engine.model_executor.layers.activation import SiluAndMul
    from engine.model_executor.layers.attention.attention import Attention
    from engine.model_executor.layers.layernorm import RMSNorm
    from engine.model_executor.layers.linear import LinearBase
    from engine.model_executor.layers.rotary_embedding.base import RotaryEmbedding

    timers = SectionTimers()
    engine, core, runner = glassbox_parts(llm)
    steps: list[dict[str, Any]] = []

    def record_step(args: tuple, dw: float, dc: float) -> None:
        (scheduler_output,) = args
        steps.append(
            {
                "tokens": scheduler_output.total_num_scheduled_tokens,
                "reqs": len(scheduler_output.num_scheduled_tokens),
                "wall": dw,
                "cpu": dc,
            }
        )

    timers.wrap(engine, "add_request", "input: llm_engine.add_request")
    timers.wrap(engine.output_processor, "process_outputs", "output processor + detokenize")
    timers.wrap(core, "step", "engine core step")
    timers.wrap(core.scheduler, "schedule", "scheduler.schedule")
    timers.wrap(core.scheduler, "update_from_output", "scheduler.update_from_output")
    timers.wrap(runner, "execute_model", "runner.execute_model", on_exit=record_step)
    timers.wrap(runner, "_update_states", "runner._update_states")
    timers.wrap(runner, "_prepare_inputs", "runner._prepare_inputs")
    if runner.attn_metadata_builder is not None:
        timers.wrap(runner.attn_metadata_builder, "build", "attention metadata build")
    timers.wrap(runner.model, "forward", "model forward")
    timers.wrap(runner.model, "compute_logits", "LM head (compute_logits)")
    timers.wrap(runner, "sample_tokens", "runner.sample_tokens")
    timers.wrap(runner_module, "build_sampling_metadata", "sampling metadata build")
    timers.wrap(runner.sampler, "forward", "sampler forward")
    for module in runner.model.modules():
        if isinstance(module, LinearBase):
            timers.wrap(module, "forward", "forward: linear layers (matmul)")
        elif isinstance(module, Attention):
            timers.wrap(module.impl, "forward", "forward: attention backend (impl.forward)")
        elif isinstance(module, RMSNorm):
            timers.wrap(module, "forward", "forward: RMSNorm")
        elif isinstance(module, RotaryEmbedding):
            timers.wrap(module, "forward", "forward: RoPE")
        elif isinstance(module, SiluAndMul):
            timers.wrap(module, "forward", "forward: SiluAndMul")
    return timers, steps


def breakdown(timers: SectionTimers, total: Stopwatch) -> list[dict[str, Any]]:
    """Exclusive seconds per section (CPU and wall), rows adding up to the run."""

    def exclusive(t: dict[str, float], run_total: float) -> dict[str, float]:
        def g(k: str) -> float:
            return t.get(k, 0.0)

        leaf_forward = [k for k in t if k.startswith("forward: ")]
        rows = {k: g(k) for k in leaf_forward}
        rows["forward: rest (embedding, residual adds, splits, module calls)"] = g(
            "model forward"
        ) - sum(g(k) for k in leaf_forward)
        inner_exec = [
            "model forward",
            "LM head (compute_logits)",
            "attention metadata build",
            "runner._update_states",
            "runner._prepare_inputs",
        ]
        for k in inner_exec[1:]:
            rows[k] = g(k)
        rows["runner.execute_model: rest"] = g("runner.execute_model") - sum(
            g(k) for k in inner_exec
        )
        rows["sampling metadata build"] = g("sampling metadata build")
        rows["sampler forward"] = g("sampler forward")
        rows["runner.sample_tokens: rest"] = (
            g("runner.sample_tokens") - g("sampling metadata build") - g("sampler forward")
        )
        rows["scheduler.schedule"] = g("scheduler.schedule")
        rows["scheduler.update_from_output"] = g("scheduler.update_from_output")
        rows["engine core step: rest (executor/worker calls)"] = g("engine core step") - (
            g("scheduler.schedule")
            + g("scheduler.update_from_output")
            + g("runner.execute_model")
            + g("runner.sample_tokens")
        )
        rows["output processor + detokenize"] = g("output processor + detokenize")
        rows["input: llm_engine.add_request"] = g("input: llm_engine.add_request")
        rows["LLM.chat: rest (chat template, tokenize, loop glue)"] = run_total - sum(rows.values())
        return rows

    cpu_rows = exclusive(timers.cpu, total.cpu)
    wall_rows = exclusive(timers.wall, total.wall)
    return [
        {
            "section": k,
            "cpu_s": round(v, 4),
            "cpu_percent": round(100 * v / total.cpu, 1),
            "wall_s": round(wall_rows[k], 4),
            "calls": timers.calls.get(k),
        }
        for k, v in sorted(cpu_rows.items(), key=lambda kv: -kv[1])
    ]


def step_summary(steps: list[dict[str, Any]]) -> dict[str, Any]:
    """Prefill-carrying steps (more tokens than requests) against pure decodes."""
    prefill = [s for s in steps if s["tokens"] > s["reqs"]]
    decode = [s for s in steps if s["tokens"] == s["reqs"]]

    def agg(group: list[dict[str, Any]]) -> dict[str, Any]:
        if not group:
            return {"steps": 0}
        return {
            "steps": len(group),
            "tokens": sum(s["tokens"] for s in group),
            "cpu_s": round(sum(s["cpu"] for s in group), 3),
            "wall_s": round(sum(s["wall"] for s in group), 3),
            "cpu_ms_per_step_mean": round(1000 * statistics.mean(s["cpu"] for s in group), 2),
            "batch_sizes": sorted({s["reqs"] for s in group}),
        }

    return {"prefill_steps": agg(prefill), "decode_steps": agg(decode)}


def torch_op_table(run: Callable[[], Any], top: int = 20) -> list[dict[str, Any]]:
    """The ``top`` ops by self CPU time while ``run()`` executes (this process only)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        run()
    events = prof.key_averages()
    total_self = sum(e.self_cpu_time_total for e in events)
    rows = sorted(events, key=lambda e: -e.self_cpu_time_total)[:top]
    return [
        {
            "op": e.key,
            "self_cpu_ms": round(e.self_cpu_time_total / 1000, 1),
            "percent_of_op_time": round(100 * e.self_cpu_time_total / total_self, 1),
            "calls": e.count,
        }
        for e in rows
    ]


# ---------------------------------------------------------------------------
# Helpers
# ---------------------------------------------------------------------------
def agreement(a: list[list[int]], b: list[list[int]]) -> dict[str, Any]:
    identical = sum(x == y for x, y in zip(a, b))

    def common_prefix(x: list[int], y: list[int]) -> int:
        n = 0
        for p, q in zip(x, y):
            if p != q:
                break
            n += 1
        return n

    prefixes = [common_prefix(x, y) for x, y in zip(a, b)]
    return {
        "identical": identical,
        "of": len(a),
        "first_divergence_token_index": {
            str(i): p for i, p in enumerate(prefixes) if p < max(len(a[i]), len(b[i]))
        },
    }


def summarize(runs: list[Stopwatch], output_tokens: int) -> dict[str, Any]:
    wall = [r.wall for r in runs]
    cpu = [r.cpu for r in runs]
    return {
        "output_tokens": output_tokens,
        "wall_s_runs": [round(t, 3) for t in wall],
        "wall_s_median": round(statistics.median(wall), 3),
        "wall_s_best": round(min(wall), 3),
        "output_tok_per_s_median": round(output_tokens / statistics.median(wall), 2),
        "output_tok_per_s_best": round(output_tokens / min(wall), 2),
        "cpu_s_runs": [round(t, 3) for t in cpu],
        "cpu_s_median": round(statistics.median(cpu), 3),
        "output_tok_per_cpu_s_median": round(output_tokens / statistics.median(cpu), 2),
    }


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def timing(sw: Stopwatch, num_tokens: int) -> str:
    return f"{sw.wall:.2f}s wall / {sw.cpu:.2f}s cpu ({num_tokens / sw.wall:.1f} tok/s)"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, help="write the results JSON here")
    results_store.add_record_arguments(p)
    p.add_argument(
        "--threads",
        type=int,
        default=os.cpu_count(),
        help="torch.set_num_threads for both sides (default: all CPUs)",
    )
    p.add_argument(
        "--repeats",
        type=int,
        default=3,
        help="timed runs per side, interleaved (default 3)",
    )
    p.add_argument("--num-prompts", type=int, default=len(QUESTIONS), help=f"1..{len(QUESTIONS)}")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--skip-bs1", action="store_true", help="skip the batch-size-1 context runs")
    p.add_argument("--skip-hf", action="store_true", help="Glassbox only (for trying engine args)")
    p.add_argument(
        "--profile",
        action="store_true",
        help="add a Glassbox section-timer breakdown and torch.profiler op tables",
    )
    # Glassbox engine args (EngineArgs names); left out = the engine's defaults.
    p.add_argument("--block-size", type=int)
    p.add_argument("--max-num-batched-tokens", type=int)
    p.add_argument("--max-num-seqs", type=int)
    p.add_argument("--no-prefix-caching", action="store_true")
    p.add_argument(
        "--hf-cache",
        choices=["dynamic", "static"],
        default="dynamic",
        help="transformers' KV cache: dynamic (its default DynamicCache) or static "
        "(generate(cache_implementation='static'))",
    )
    p.add_argument(
        "--multiprocess",
        choices=["default", "on", "off"],
        default="default",
        help="EngineCore in its own process (GLASSBOX_ENABLE_MULTIPROCESSING); "
        "default: the engine's default",
    )
    args = p.parse_args(argv)
    if not 1 <= args.num_prompts <= len(QUESTIONS):
        p.error(f"--num-prompts must be in 1..{len(QUESTIONS)}, got {args.num_prompts}")
    if args.threads is None or args.threads < 1:
        p.error(f"--threads must be >= 1, got {args.threads}")
    if args.repeats < 1:
        p.error(f"--repeats must be >= 1, got {args.repeats}")
    if args.max_tokens < 1:
        p.error(f"--max-tokens must be >= 1, got {args.max_tokens}")
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    # This process, and (through the environment) a spawned EngineCore
    # process, whose torch reads OMP_NUM_THREADS when it starts.
    torch.set_num_threads(args.threads)
    os.environ["OMP_NUM_THREADS"] = str(args.threads)
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from engine.model_executor.model_loader.default_model import get_default_model_path
    from engine.v1.attention.selector import get_attn_backend

    questions = QUESTIONS[: args.num_prompts]
    hf_cache = None if args.hf_cache == "dynamic" else args.hf_cache
    n_out = len(questions) * args.max_tokens
    path = get_default_model_path()

    # Statistics on (LLM's default is off, as in vLLM): the prefix-cache counters are reported.
    engine_kwargs: dict[str, Any] = {"disable_log_stats": False}
    if args.block_size is not None:
        engine_kwargs["block_size"] = args.block_size
    if args.max_num_batched_tokens is not None:
        engine_kwargs["max_num_batched_tokens"] = args.max_num_batched_tokens
    if args.max_num_seqs is not None:
        engine_kwargs["max_num_seqs"] = args.max_num_seqs
    if args.no_prefix_caching:
        engine_kwargs["enable_prefix_caching"] = False

    result: dict[str, Any] = {
        "benchmark": "cpu_vs_transformers",
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "started_at": _dt.datetime.now().isoformat(timespec="seconds"),
        "commit": results_store.commit_id(),
        "git": git_commit(),
        "machine": {
            "cpu_model": cpu_model(),
            "logical_cpus": os.cpu_count(),
            "cpu_flags_of_interest": cpu_flags_of_interest(),
            "mem_total_gib": mem_total_gib(),
            "load_average_1_5_15_at_start": load_average(),
            "python": platform.python_version(),
        },
        "versions": {
            "torch": torch.__version__,
            "transformers": transformers.__version__,
        },
        "torch_num_threads": torch.get_num_threads(),
        "omp_num_threads_env": os.environ["OMP_NUM_THREADS"],
        "workload": {
            "model": "SmolLM2-135M-Instruct (embedded default, Q4_1 GGUF dequantized to float32)",
            "model_path": path,
            "dtype": "float32",
            "device": "cpu",
            "num_prompts": len(questions),
            "max_new_tokens": args.max_tokens,
            "sampling": "greedy; EOS does not stop (Glassbox ignore_eos=True, "
            "transformers eos_token_id=None)",
            "questions": questions,
        },
    }

    log(f"threads={torch.get_num_threads()} cpu={cpu_model()} load={load_average()}")
    multiprocess = None if args.multiprocess == "default" else args.multiprocess == "on"
    t0 = time.perf_counter()
    llm = make_llm(path, engine_kwargs, multiprocess)
    glassbox_init_s = time.perf_counter() - t0
    cfg = llm.llm_engine.glassbox_config
    result["glassbox"] = {
        "engine_args": engine_kwargs or "defaults",
        "engine_core_in_own_process": bool(engine_core_pids(llm)),
        "effective": {
            "block_size": cfg.cache_config.block_size,
            "enable_prefix_caching": cfg.cache_config.enable_prefix_caching,
            "max_num_batched_tokens": cfg.scheduler_config.max_num_batched_tokens,
            "max_num_seqs": cfg.scheduler_config.max_num_seqs,
            "enable_chunked_prefill": cfg.scheduler_config.enable_chunked_prefill,
            "attention_backend": get_attn_backend(cfg).get_name(),
        },
        "init_s": round(glassbox_init_s, 2),
    }
    log(f"Glassbox ready in {glassbox_init_s:.1f}s; warming up")
    run_glassbox(llm, WARMUP_QUESTIONS, WARMUP_TOKENS)

    hf_model = hf_tok = None
    if not args.skip_hf:
        hf_tok = AutoTokenizer.from_pretrained(path)
        hf_model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        result["transformers"] = {
            "attn_implementation": hf_model.config._attn_implementation,
            "generate_kwargs": {
                "do_sample": False,
                "max_new_tokens": args.max_tokens,
                "min_new_tokens": args.max_tokens,
                "use_cache": True,
                "cache_implementation": hf_cache,
                "eos_token_id": None,
                "padding_side": "left",
            },
        }
        log("transformers warming up")
        run_hf_batched(hf_model, hf_tok, WARMUP_QUESTIONS, WARMUP_TOKENS, hf_cache)

    # --- interleaved timed runs -------------------------------------------
    g_runs: list[Stopwatch] = []
    h_runs: list[Stopwatch] = []
    g_ids = h_ids = None
    g_prompt_ids = None
    padded_len = None
    for r in range(args.repeats):
        sw, outs = run_glassbox(llm, questions, args.max_tokens)
        g_runs.append(sw)
        g_ids = [list(o.outputs[0].token_ids) for o in outs]
        g_prompt_ids = [list(o.prompt_token_ids) for o in outs]
        log(f"run {r}: Glassbox {timing(sw, n_out)}")
        if hf_model is not None:
            sw, h_ids, padded_len = run_hf_batched(
                hf_model, hf_tok, questions, args.max_tokens, hf_cache
            )
            h_runs.append(sw)
            log(f"run {r}: transformers batched {timing(sw, n_out)}")
    assert g_ids is not None and g_prompt_ids is not None
    g_counted = sum(len(x) for x in g_ids)
    if g_counted != n_out:
        raise RuntimeError(f"Glassbox produced {g_counted} tokens, expected {n_out}")
    prompt_tokens = sum(len(p) for p in g_prompt_ids)
    result["workload"]["prompt_tokens"] = prompt_tokens
    result["workload"]["prompt_tokens_min_max"] = [
        min(len(p) for p in g_prompt_ids),
        max(len(p) for p in g_prompt_ids),
    ]
    result["glassbox"]["batched"] = summarize(g_runs, g_counted)
    result["glassbox"]["prefix_cache_counters_cumulative"] = glassbox_prefix_cache_counters(llm)

    if hf_model is not None:
        assert h_ids is not None and padded_len is not None
        h_counted = sum(len(x) for x in h_ids)
        if h_counted != n_out:
            raise RuntimeError(f"transformers produced {h_counted} tokens, expected {n_out}")
        # Both sides must have seen the same prompt tokens.
        hf_prompt_ids = [
            hf_tok(t, add_special_tokens=False)["input_ids"] for t in hf_prompts(hf_tok, questions)
        ]
        result["workload"]["prompt_token_ids_identical"] = hf_prompt_ids == g_prompt_ids
        result["transformers"]["batched"] = summarize(h_runs, h_counted)
        result["transformers"]["batched"]["padded_prompt_tokens"] = padded_len * len(questions)

        def med(runs: list[Stopwatch], attr: str) -> float:
            return statistics.median(getattr(x, attr) for x in runs)

        result["ratio_glassbox_over_transformers_batched"] = {
            "wall_median": round(med(h_runs, "wall") / med(g_runs, "wall"), 3),
            "wall_best": round(min(x.wall for x in h_runs) / min(x.wall for x in g_runs), 3),
            "cpu_median": round(med(h_runs, "cpu") / med(g_runs, "cpu"), 3),
        }
        result["greedy_agreement_glassbox_vs_transformers_batched"] = agreement(g_ids, h_ids)

    # --- batch-size-1 context runs -----------------------------------------
    if not args.skip_bs1:
        sw, outs = run_glassbox_bs1(llm, questions, args.max_tokens)
        g1_ids = [list(o.outputs[0].token_ids) for o in outs]
        result["glassbox"]["bs1"] = summarize([sw], sum(len(x) for x in g1_ids))
        log(f"Glassbox bs1 {timing(sw, n_out)}")
        result["greedy_agreement_glassbox_batched_vs_bs1"] = agreement(g_ids, g1_ids)
        if hf_model is not None:
            sw, h1_ids = run_hf_bs1(hf_model, hf_tok, questions, args.max_tokens, hf_cache)
            result["transformers"]["bs1"] = summarize([sw], sum(len(x) for x in h1_ids))
            log(f"transformers bs1 {timing(sw, n_out)}")
            result["greedy_agreement_glassbox_vs_transformers_bs1"] = agreement(g_ids, h1_ids)
            result["greedy_agreement_transformers_batched_vs_bs1"] = agreement(h_ids, h1_ids)

    # --- profile ---------------------------------------------------------------
    if args.profile:
        # The timers must reach the scheduler and model runner, so the profile
        # uses a second LLM with EngineCore in this process.
        if engine_core_pids(llm):
            llm.shutdown()
            llm = make_llm(path, engine_kwargs, multiprocess=False)
        run_glassbox(llm, WARMUP_QUESTIONS, WARMUP_TOKENS)
        log("profiling one Glassbox run (section timers)")
        timers, steps = install_glassbox_timers(llm)
        try:
            sw, _ = run_glassbox(llm, questions, args.max_tokens)
        finally:
            timers.restore()
        result["glassbox_profile"] = {
            "note": (
                "one extra Glassbox run, EngineCore in-process, with timers around engine "
                "methods and model submodules; exclusive seconds, sorted by CPU time"
            ),
            "wall_s": round(sw.wall, 3),
            "cpu_s": round(sw.cpu, 3),
            "steps": step_summary(steps),
            "sections": breakdown(timers, sw),
            "not_wrapped": timers.missing,
        }
        log("profiling one Glassbox run (torch.profiler)")
        result["glassbox_profile"]["torch_profiler_top_ops"] = torch_op_table(
            lambda: run_glassbox(llm, questions, args.max_tokens)
        )
        if hf_model is not None:
            log("profiling one transformers batched run (torch.profiler)")
            result["transformers_profile"] = {
                "torch_profiler_top_ops": torch_op_table(
                    lambda: run_hf_batched(hf_model, hf_tok, questions, args.max_tokens, hf_cache)
                )
            }

    result["machine"]["load_average_1_5_15_at_end"] = load_average()
    result["finished_at"] = _dt.datetime.now().isoformat(timespec="seconds")

    text = json.dumps(result, indent=2)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")
        log(f"wrote {args.out}")
    elif not args.record:
        print(text)
    if args.record:
        stored = results_store.record(result, args.record, note=args.note)
        log(f"recorded {stored} (and its history line)")
    return result


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        main()
