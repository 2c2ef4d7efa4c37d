"""What tracing costs: engine throughput with trace level off / lifecycle / full.

The question (issue 5): does the instrumented engine slow down when nobody
is tracing, and by how much when someone is? Three modes run the same
workload on the same engine configuration, in one process:

  * ``off``       -- the baseline: every subsystem holds the ``NULL`` twin of
    its trace object (``SchedulerTrace.NULL``, ``RunnerTrace.NULL``, ...),
    so every hook is a call of a method that does nothing;
  * ``lifecycle`` -- every scheduler, KV, runner, sampler and front-end event
    written to a JSON-lines file;
  * ``full``      -- lifecycle plus the sampler's per-stage top candidates and
    the runner's input-tensor summaries.

Targets, against ``off``: ``lifecycle`` at most 5 % slower, ``full`` at most 25 %.

What ``off`` itself costs, against an engine without hooks, is below what a
timing can resolve, so it is bounded instead (``off_upper_bound``, target
1 %): the hook calls of one step, counted in a lifecycle run (every public
method of every trace class wrapped with a counter), times the cost of one
call of a no-op hook (``timeit``), over the time of an ``off`` step. A
lifecycle run makes every call an ``off`` run makes, so the count is an upper
bound, and so is the call's cost (the widest hook, through an attribute).

``--split`` adds ``lifecycle-hooks`` and ``full-hooks``: the hooks alone --
they build their events, but ``Tracer.record`` / ``record_rows`` are no-ops
(monkeypatched on the class during those runs), so the tracer's own work of
keeping, encoding and writing the events is left out.

Also reported: ``tracer_us_per_event``, what one ``Tracer.record`` costs with
everything it leads to (the event kept, encoded in a batch, written), measured
by recording the typed events of the trace just written again into a fresh
tracer -- the tracer alone, without the hooks' own work of building the
events; and ``garbage_collections``, the collections that ran during each
mode's timed runs (events kept too long show up there: see ``Tracer.flush``).

Workload: 16 prompts (``--num-prompts``, with ``--max-num-seqs`` of them
running at once) sharing a 48-token prefix (so the prefix cache, KV
events and several concurrent requests are all in play), 32 new tokens each,
half greedy and half seeded random sampling with top-k / top-p, EOS ignored;
the engine runs in-process (``enable_multiprocessing=False``) so that only
the engine is measured, not the process hop. The prefix cache is reset
before every timed run. Each mode has its own engine (the trace level is
fixed at construction), all built up front; timed runs are interleaved in
rounds (every round runs every mode once, in a rotating order) so that
machine noise hits all modes alike, and the reported throughput is the
median over rounds.

Throughput = output tokens / time of the whole ``add_request`` + ``step()``
loop, reported twice: per second of this process's CPU time
(``time.process_time``, the headline) and per second of wall time. On the
CPU, CPU time is the headline because the development machines are small
(2 cores) and shared with other jobs, whose load moves wall-clock figures by
far more than the few percent being measured; CPU time counts only the work
this process did. Torch runs with one thread (``--threads``) so that CPU time
is not inflated by worker threads spinning while they wait. On a GPU
(``--device cuda``) the host mostly waits for the device, so wall time is the
headline there. Model: ``--model default`` (the embedded
SmolLM2-135M-Instruct, float32, CPU) is the headline; ``--model tiny`` (a
2-layer random Llama with hidden size 16) is engine-bound -- almost all its
time is Python bookkeeping -- and shows the worst case, where hooks are the
largest share of a step; ``--model smollm2-dummy`` is SmolLM2's shapes with
random weights (the GPU run).

Run:  .venv/bin/python benchmarks/tracing_overhead.py --model default --record
(``--record`` stores the run as ``benchmarks/results/tracing_overhead_cpu_smollm2.json``
and appends it to ``history.jsonl``; ``--out FILE`` writes the JSON anywhere.)
"""

from __future__ import annotations

import argparse
import atexit
import collections
import contextlib
import datetime as _dt
import functools
import gc
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
import timeit
import types
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

import torch  # noqa: E402

from benchmarks import results_store  # noqa: E402
from engine.engine.arg_utils import EngineArgs  # noqa: E402
from engine.sampling_params import SamplingParams  # noqa: E402
from engine.tracing import SchedStep, SubsystemTrace, TraceEvent, Tracer, load_trace  # noqa: E402
from engine.v1.engine.llm_engine import LLMEngine  # noqa: E402

MODES = ("off", "lifecycle", "full")
# Max slowdown against ``off``, %; for ``off`` the bound against no hooks at all.
TARGETS = {"off": 1.0, "lifecycle": 5.0, "full": 25.0}


SMOLLM2_135M_CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 576,
    "intermediate_size": 1536,
    "num_hidden_layers": 30,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "head_dim": 64,
    "vocab_size": 49152,
    "rope_theta": 100000,
    "tie_word_embeddings": True,
    "rms_norm_eps": 1e-5,
    "max_position_embeddings": 8192,
    "rope_scaling": None,
    "bos_token_id": 1,
    "eos_token_id": 2,
}


def _noop(*args: Any, **kwargs: Any) -> None:
    return None


def make_tiny_checkpoint(path: Path) -> str:
    """The tests' tiny tokenizer + config (random weights via load_format=dummy)."""
    from tests.helpers.tiny_model import make_tiny_model_dir

    make_tiny_model_dir(path)
    return str(path)


def build_engine(
    model: str, mode: str, trace_dir: str, device: str, max_num_seqs: int = 16
) -> LLMEngine:
    """The engine of one mode: ``off``, ``lifecycle``, ``full`` or ``LEVEL-hooks``."""
    level = mode.split("-")[0]
    kwargs: dict[str, Any] = dict(
        device=device,
        dtype="float32",
        block_size=16,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=2048,
        num_gpu_blocks_override=1024,
        trace_level=level,
        trace_path=None if level == "off" else os.path.join(trace_dir, f"{mode}.jsonl"),
        disable_log_stats=True,
    )
    if model == "tiny":
        model_path = make_tiny_checkpoint(Path(trace_dir) / "tiny")
        kwargs.update(load_format="dummy", hf_overrides={"intermediate_size": 32})
    elif model == "smollm2-dummy":
        # SmolLM2-135M's real config with dummy weights: the default model's
        # shapes where its 93 MB GGUF cannot travel (the GPU machine).
        model_path = os.path.join(trace_dir, "smollm2-dummy")
        os.makedirs(model_path, exist_ok=True)
        with open(os.path.join(model_path, "config.json"), "w") as f:
            json.dump(SMOLLM2_135M_CONFIG, f)
        kwargs.update(load_format="dummy", skip_tokenizer_init=True)
        if device == "cuda":
            kwargs["dtype"] = "auto"  # bf16 on CUDA
    else:
        model_path = model
    args = EngineArgs(model=None if model_path == "default" else model_path, **kwargs)
    return LLMEngine.from_engine_args(args, enable_multiprocessing=False)


def workload(engine: LLMEngine, num_prompts: int, max_tokens: int, vocab: int) -> list[tuple]:
    prefix = [(7 * i + 3) % (vocab - 10) + 5 for i in range(48)]
    requests = []
    for i in range(num_prompts):
        prompt = prefix + [(13 * i + j) % (vocab - 10) + 5 for j in range(8 + i % 5)]
        if i % 2:
            sp = SamplingParams(
                temperature=0.8, top_k=40, top_p=0.9, seed=i, max_tokens=max_tokens, ignore_eos=True
            )
        else:
            sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        requests.append((f"r{i}", {"prompt_token_ids": prompt}, sp))
    return requests


def timed_run(
    engine: LLMEngine, requests: list[tuple], counter: list[int]
) -> tuple[float, float, int, list]:
    engine.reset_prefix_cache()
    counter[0] += 1
    start = time.perf_counter()
    cpu_start = time.process_time()
    for rid, prompt, sp in requests:
        engine.add_request(f"{rid}-{counter[0]}", prompt, sp)
    outputs = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                outputs.append((out.request_id.split("-")[0], out.outputs[0].token_ids))
    elapsed = time.perf_counter() - start
    cpu = time.process_time() - cpu_start
    num_tokens = sum(len(t) for _, t in outputs)
    return cpu, elapsed, num_tokens, sorted(outputs)


def trace_classes() -> list[type[SubsystemTrace]]:
    """Every trace class a subsystem can receive (not their ``NULL`` twins)."""
    import engine.tracing.core_trace  # noqa: F401
    import engine.tracing.engine_trace  # noqa: F401
    import engine.tracing.worker_trace  # noqa: F401

    found, todo = [], list(SubsystemTrace.__subclasses__())
    while todo:
        cls = todo.pop()
        todo.extend(cls.__subclasses__())
        if cls.enabled:
            found.append(cls)
    return sorted(found, key=lambda c: c.__name__)


def hook_names(cls: type[SubsystemTrace]) -> list[str]:
    """The hooks ``cls`` defines: what its ``NULL`` twin turns into no-ops."""
    return [
        name
        for name, value in vars(cls).items()
        if callable(value) and not name.startswith("_") and name != "create"
    ]


class HookCounter:
    """Counts the hook calls the engine makes while installed (a context
    manager): every hook of every trace class is wrapped; the ``NULL`` twins
    define their own no-op methods and stay as they are. A hook that calls
    another (``RunnerTrace.sampled`` calls ``SamplerTrace.emit``) counts once:
    what is counted are the calls in the engine's own files."""

    def __init__(self) -> None:
        self.counts: collections.Counter[str] = collections.Counter()
        self._depth = 0
        self._undo: list[tuple[type, str, Any]] = []

    def __enter__(self) -> HookCounter:
        for cls in trace_classes():
            for name in hook_names(cls):
                hook = vars(cls)[name]
                self._undo.append((cls, name, hook))
                setattr(cls, name, self._counted(f"{cls.__name__}.{name}", hook))
        return self

    def __exit__(self, *exc: object) -> None:
        for cls, name, hook in reversed(self._undo):
            setattr(cls, name, hook)
        self._undo.clear()

    def _counted(self, label: str, hook: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(hook)
        def counted(*args: Any, **kwargs: Any) -> Any:
            if self._depth == 0:
                self.counts[label] += 1
            self._depth += 1
            try:
                return hook(*args, **kwargs)
            finally:
                self._depth -= 1

        return counted


def noop_hook_call_ns(repeats: int = 5, number: int = 200_000) -> float:
    """Nanoseconds one hook call costs with tracing off: the widest hook
    (``KVCacheTrace.cached``, five arguments) on its ``NULL`` object, reached
    through an attribute as the engine does (``self.trace.cached(...)``);
    best of ``repeats``, the loop's own cost included."""
    from engine.tracing.core_trace import KVCacheTrace

    host = types.SimpleNamespace(trace=KVCacheTrace.NULL)
    timer = timeit.Timer("host.trace.cached(a, a, a, a, a)", globals={"host": host, "a": None})
    return min(timer.repeat(repeats, number)) / number * 1e9


@contextlib.contextmanager
def tracer_writes_nothing() -> Iterator[None]:
    """``Tracer.record`` / ``record_rows`` as no-ops: the hooks still build
    their events, the tracer keeps and writes none of them."""
    record, record_rows = Tracer.record, Tracer.record_rows
    Tracer.record, Tracer.record_rows = _noop, _noop  # type: ignore[method-assign]
    try:
        yield
    finally:
        Tracer.record, Tracer.record_rows = record, record_rows  # type: ignore[method-assign]


def tracer_cost_per_event(events: list[TraceEvent], scratch_dir: str, repeats: int = 5) -> float:
    """Microseconds one ``Tracer.record`` costs, everything included (the
    event kept, encoded and written; ``close`` too): ``events`` (a trace just
    written, read back) recorded again into a fresh tracer, best of
    ``repeats``. Only the tracer: the hooks' own work (building the events)
    is not in it."""
    best = float("inf")
    for i in range(repeats):
        path = os.path.join(scratch_dir, f"record-{i}.jsonl")
        tracer = Tracer(path, "full")
        start = time.perf_counter_ns()
        for event in events:
            tracer.record(event)
        tracer.close()
        best = min(best, (time.perf_counter_ns() - start) / max(len(events), 1))
        os.remove(path)
    return best / 1000.0


def machine() -> dict[str, Any]:
    cpu = platform.processor() or ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    info = {
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cpu": cpu,
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "load_average_at_end": os.getloadavg(),
    }
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
    return info


class GCAccount:
    """Garbage collections during the timed runs, per mode and generation:
    how many and their total time (``gc.callbacks``). Events the tracer keeps
    are container objects the collector counts, so a tracer that holds them
    too long shows up here (see ``Tracer.flush``)."""

    def __init__(self) -> None:
        self.mode: str | None = None
        self.totals: dict[str, dict[int, list[float]]] = {}
        self._start = 0

    def __call__(self, phase: str, info: dict[str, int]) -> None:
        if self.mode is None:
            return
        if phase == "start":
            self._start = time.perf_counter_ns()
            return
        per_gen = self.totals.setdefault(self.mode, {})
        count_ms = per_gen.setdefault(info["generation"], [0, 0.0])
        count_ms[0] += 1
        count_ms[1] += (time.perf_counter_ns() - self._start) / 1e6

    def report(self, modes: tuple[str, ...], rounds: int) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for mode in modes:
            per_gen = self.totals.get(mode, {})
            out[mode] = {
                f"gen{g}": {"collections": int(c), "ms": round(ms, 2)}
                for g, (c, ms) in sorted(per_gen.items())
            }
            out[mode]["ms_per_run"] = round(sum(ms for _, ms in per_gen.values()) / rounds, 3)
        return out


def slowdown(median: dict[str, float], modes: tuple[str, ...]) -> dict[str, float]:
    """Percent slower than ``off`` (from throughputs), for every traced mode."""
    return {m: 100.0 * (median["off"] - median[m]) / median["off"] for m in modes if m != "off"}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument(
        "--model",
        default="default",
        help="'default' (SmolLM2-135M), 'tiny', 'smollm2-dummy' or a path",
    )
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--num-prompts", type=int, default=16)
    parser.add_argument(
        "--max-num-seqs",
        type=int,
        default=16,
        help="concurrent requests per step (raise it with --num-prompts: "
        "more per-request events per step)",
    )
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--threads", type=int, default=1, help="torch.set_num_threads")
    parser.add_argument(
        "--split",
        action="store_true",
        help="also time LEVEL-hooks: the hooks run, Tracer.record / record_rows are "
        "no-ops (the hooks' own work, without the tracer's)",
    )
    parser.add_argument(
        "--out", help="write the results JSON to this file, or into this directory (DIR/)"
    )
    results_store.add_record_arguments(parser)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)

    modes = MODES
    if args.split:
        modes += ("lifecycle-hooks", "full-hooks")
    trace_dir = tempfile.mkdtemp(prefix="glassbox-trace-overhead-")
    atexit.register(shutil.rmtree, trace_dir, True)
    engines = {
        mode: build_engine(args.model, mode, trace_dir, args.device, args.max_num_seqs)
        for mode in modes
    }
    vocab = engines["off"].model_config.vocab_size
    requests = workload(engines["off"], args.num_prompts, args.max_tokens, vocab)
    counter = [0]
    runs = collections.Counter()  # runs per mode, untimed ones included

    def run(mode: str) -> tuple[float, float, int, list]:
        runs[mode] += 1
        if mode.endswith("-hooks"):
            with tracer_writes_nothing():
                return timed_run(engines[mode], requests, counter)
        return timed_run(engines[mode], requests, counter)

    # Warm-up: one untimed run per mode; all modes must produce the same tokens.
    reference = None
    for mode in modes:
        *_, outputs = run(mode)
        if reference is None:
            reference = outputs
        elif outputs != reference:
            raise SystemExit(
                f"mode {mode} produced different tokens than off: tracing changed results"
            )
    # One more untimed lifecycle run, counting the hook calls (for the bound on off).
    with HookCounter() as hooks:
        *_, outputs = run("lifecycle")
    assert outputs == reference

    samples: dict[str, list[float]] = {m: [] for m in modes}
    wall_samples: dict[str, list[float]] = {m: [] for m in modes}
    gc_account = GCAccount()
    gc.callbacks.append(gc_account)
    for r in range(args.rounds):
        order = modes[r % len(modes) :] + modes[: r % len(modes)]
        for mode in order:
            gc_account.mode = mode
            cpu, elapsed, num_tokens, outputs = run(mode)
            gc_account.mode = None
            assert outputs == reference
            samples[mode].append(num_tokens / cpu)
            wall_samples[mode].append(num_tokens / elapsed)
            print(
                f"round {r + 1} {mode:>16}: {num_tokens / cpu:8.1f} tok/CPU-s "
                f"{num_tokens / elapsed:8.1f} tok/s wall",
                flush=True,
            )
    gc.callbacks.remove(gc_account)

    median = {m: statistics.median(v) for m, v in samples.items()}
    wall_median = {m: statistics.median(v) for m, v in wall_samples.items()}
    cpu_overhead = slowdown(median, modes)
    wall_overhead = slowdown(wall_median, modes)
    # On a GPU the host mostly waits for the device: wall time is what counts there.
    headline = "cpu_time" if args.device == "cpu" else "wall_clock"
    overhead = cpu_overhead if headline == "cpu_time" else wall_overhead
    headline_median = median if headline == "cpu_time" else wall_median
    headline_samples = samples if headline == "cpu_time" else wall_samples
    per_round = {
        m: results_store.per_round_slowdown(headline_samples["off"], headline_samples[m])
        for m in modes
        if m != "off"
    }
    for mode in ("lifecycle", "full"):
        engines[mode].tracer.flush()  # the files are whole now
    traces = {m: load_trace(os.path.join(trace_dir, f"{m}.jsonl")) for m in ("lifecycle", "full")}
    trace_sizes = {m: os.path.getsize(os.path.join(trace_dir, f"{m}.jsonl")) for m in traces}
    lifecycle_runs = runs["lifecycle"]
    num_steps = sum(type(e) is SchedStep for e in traces["lifecycle"]) // lifecycle_runs
    events_per_step = len(traces["lifecycle"]) / lifecycle_runs / max(num_steps, 1)
    tokens_per_run = args.num_prompts * args.max_tokens
    step_ns = 1e9 * tokens_per_run / headline_median["off"] / max(num_steps, 1)
    call_ns = noop_hook_call_ns()
    hook_calls_per_step = sum(hooks.counts.values()) / max(num_steps, 1)
    off_bound = 100.0 * hook_calls_per_step * call_ns / step_ns
    record_us = {m: round(tracer_cost_per_event(traces[m], trace_dir), 3) for m in traces}
    result = {
        "benchmark": "tracing_overhead",
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "commit": results_store.commit_id(),
        "machine": machine(),
        "model": engines["off"].model_config.model
        if args.model != "tiny"
        else "tiny random Llama (2 layers, hidden 16)",
        "model_arg": args.model,
        "device": args.device,
        "role": (
            "worst case, not the target workload: the engine-bound tiny model spends most of a "
            "step in Python bookkeeping, so every event is a large share of it"
            if args.model == "tiny"
            else "headline: the targets apply to this run"
        ),
        "workload": {
            "num_prompts": args.num_prompts,
            "max_num_seqs": args.max_num_seqs,
            "shared_prefix_tokens": 48,
            "max_tokens": args.max_tokens,
            "sampling": "half greedy, half seeded temperature 0.8 / top-k 40 / top-p 0.9",
            "engine_steps_per_run": num_steps,
            "lifecycle_events_per_step": round(events_per_step, 1),
            "rounds": args.rounds,
        },
        "throughput_tok_per_cpu_s": {"median": median, "samples": samples},
        "throughput_tok_per_wall_s": {"median": wall_median, "samples": wall_samples},
        "headline_metric": headline,
        "baseline": "off",
        "slowdown_vs_off_percent": overhead,
        "cpu_time_slowdown_vs_off_percent": cpu_overhead,
        "wall_clock_slowdown_vs_off_percent": wall_overhead,
        "per_round_slowdown_vs_off_percent": per_round,
        "targets_percent": TARGETS,
        "within_target": {
            "off": off_bound <= TARGETS["off"],
            **{m: overhead[m] <= TARGETS[m] for m in ("lifecycle", "full")},
        },
        "off_upper_bound": {
            "hook_calls_per_step": round(hook_calls_per_step, 1),
            "noop_hook_call_ns": round(call_ns, 1),
            "step_ms": round(step_ns / 1e6, 3),
            "percent": off_bound,
            "how": "what off costs against an engine without hooks, at most: hook calls per "
            "step (counted in a lifecycle run) x one call of a no-op hook (timeit) / the "
            f"off step's {headline.replace('_', ' ')}",
        },
        "hook_calls_per_step": {
            name: round(n / max(num_steps, 1), 2) for name, n in sorted(hooks.counts.items())
        },
        "garbage_collections": {
            **gc_account.report(modes, args.rounds),
            "how": "gc.callbacks during the timed runs: collections per generation and their "
            "total time; ms_per_run = all generations, per run of the workload",
        },
        "trace_bytes_per_run": {m: trace_sizes[m] // runs[m] for m in trace_sizes},
        "tracer_us_per_event": {
            **record_us,
            "how": "the typed events of the trace just written recorded again into a fresh "
            "Tracer (kept, encoded, written, closed), best of 5; the hooks' own work of "
            "building them is not in it",
        },
    }
    for engine in engines.values():
        engine.shutdown()
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        results_store.output_path(args.out, result).write_text(results_store.dump_result(result))
    if args.record:
        path = results_store.record(result, args.record, note=args.note)
        print(f"recorded {path} (and its history line)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
