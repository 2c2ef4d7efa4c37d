"""Thread oversubscription on the CPU (issue 17, point 11): old threads, new default, one thread.

Question: how much does the torch/OpenMP thread count of the engine processes
cost when more than one request runs, and does the default chosen by
``engine/utils/cpu_resource_utils.py`` (EngineCore: one thread per physical core
it may use minus one for the front end; CLI front ends: one thread) get the
speed of ``OMP_NUM_THREADS=1`` on a small machine without losing the cores of a
big one?

Modes (each measurement is a fresh process, so the settings apply from start):

  * ``old``  -- ``GLASSBOX_CPU_OMP_THREADS_BIND=nobind``: nothing is sized,
    torch's default threads in every process (the behaviour before the change);
  * ``new``  -- no setting: the new default;
  * ``omp1`` -- ``nobind`` plus ``OMP_NUM_THREADS=1``: the workaround issue 17
    measured;
  * ``passive`` (not run unless named in ``--modes``) -- ``nobind`` plus
    ``OMP_WAIT_POLICY=PASSIVE``: torch's default threads, but idle OpenMP
    threads sleep instead of spinning;
  * ``--threads-sweep 2,4,8`` adds ``ompK`` modes: the new code with
    ``OMP_NUM_THREADS=K`` (taken as EngineCore's count), to see where more
    threads stop paying on a bigger machine.

Workloads, with the default model (SmolLM2-135M-Instruct, float32):

  * ``trace``: ``glassbox trace --headless`` (EngineCore in the CLI's process,
    6 requests, 48 tokens at most each), timed as a whole command;
  * ``batch N`` for N in ``--batch-sizes`` (default 1,2,4,8): ``LLM.generate`` of
    N prompts, 64 new tokens each, greedy, EOS ignored, EngineCore in its own
    process (the default); only the ``generate`` call is timed, after a
    2-token warm-up.

Figures per run: wall seconds and CPU seconds (the command and everything it
started, from ``getrusage``; for a batch, the front end plus EngineCore, from
``/proc``), and for a batch the thread count EngineCore logged. CPU time well
above wall time x useful threads is threads spinning. Rounds are interleaved
(every round runs every mode once) so that background load hits all modes
alike; the summary takes medians.

``--busy K`` keeps K busy-looping processes running (on the same CPUs) through
every measurement: a reproducible stand-in for the other jobs of a shared
machine, where the old thread count lost most.

``--cores 0-1`` (a CPU list) or ``--cores 2`` (the first 2 allowed CPUs) runs
every measurement confined to those CPUs (``sched_setaffinity``, as
``taskset -c`` does), to emulate a smaller machine.

Run (about 3 minutes on a quiet 2-core machine with the defaults; with
``--busy 1`` the ``old`` mode alone takes about 3 minutes a round)::

    .venv/bin/python -m benchmarks.cpu_threads --repeats 3 --out OUT/
    .venv/bin/python -m benchmarks.cpu_threads --repeats 2 --busy 1 --out OUT/
    .venv/bin/python -m benchmarks.cpu_threads --cores 2 --repeats 2 --busy 1 --out OUT/
    .venv/bin/python -m benchmarks.cpu_threads --repeats 2 --threads-sweep 2,4,8 --out OUT/

``--out DIR`` writes ``DIR/cpu_threads_cpu_<N>c.json`` (N: the CPUs used;
``_busy<K>`` added with ``--busy K``); ``--out FILE.json`` writes that file.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as _dt
import json
import os
import platform
import re
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from benchmarks import results_store  # noqa: E402
from benchmarks.cpu_vs_transformers import cpu_model  # noqa: E402

BIND = "GLASSBOX_CPU_OMP_THREADS_BIND"
TRACE_PROMPT = "What is a KV cache?"
BATCH_PROMPTS = [
    "Explain what a KV cache is in two sentences.",
    "Name three primary colors.",
    "Write a short poem about the sea.",
    "Count from one to ten in words.",
    "Give me one fun fact about octopuses.",
    "What is the capital of France?",
    "Describe a paged memory allocator.",
    "Why is the sky blue?",
]
BATCH_TOKENS = 64
CORE_THREADS_RE = re.compile(r"CPU threads: torch uses (\d+) thread")


def mode_env(mode: str) -> dict[str, str | None]:
    """Environment changes of a mode (None: unset)."""
    return {"OMP_WAIT_POLICY": None, **_mode_env(mode)}


def _mode_env(mode: str) -> dict[str, str | None]:
    if mode == "old":
        return {BIND: "nobind", "OMP_NUM_THREADS": None}
    if mode == "new":
        return {BIND: None, "OMP_NUM_THREADS": None}
    if mode == "omp1":
        return {BIND: "nobind", "OMP_NUM_THREADS": "1"}
    if mode == "passive":
        return {BIND: "nobind", "OMP_NUM_THREADS": None, "OMP_WAIT_POLICY": "PASSIVE"}
    if m := re.fullmatch(r"omp(\d+)", mode):
        return {BIND: None, "OMP_NUM_THREADS": m.group(1)}
    raise ValueError(f"unknown mode {mode!r}")


BENCH_MODEL_ENV = "GLASSBOX_CPU_THREADS_MODEL"
BENCH_LOAD_FORMAT_ENV = "GLASSBOX_CPU_THREADS_LOAD_FORMAT"


def child_env(mode: str) -> dict[str, str]:
    env = dict(os.environ)
    for key, value in mode_env(mode).items():
        if value is None:
            env.pop(key, None)
        else:
            env[key] = value
    env.setdefault("HF_HUB_OFFLINE", "1")
    return env


def parse_cores(spec: str | None) -> list[int] | None:
    if spec is None:
        return None
    allowed = sorted(os.sched_getaffinity(0))
    if spec.isdigit():
        n = int(spec)
        if not 1 <= n <= len(allowed):
            raise SystemExit(f"--cores {n}: this process may use {len(allowed)} CPUs")
        return allowed[:n]
    from engine.utils.cpu_resource_utils import parse_id_list

    cpus = parse_id_list(spec, "--cores")
    if not set(cpus) <= set(allowed):
        raise SystemExit(f"--cores {spec}: not all of {cpus} are in the allowed CPUs {allowed}")
    return cpus


def run_timed(cmd: list[str], env: dict[str, str], cpus: list[int] | None, timeout: float):
    """(wall s, CPU s of the command and all it waited for, completed process)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    proc = subprocess.run(
        cmd,
        env=env,
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
        preexec_fn=(lambda: os.sched_setaffinity(0, cpus)) if cpus else None,
    )
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return wall, cpu, proc


def measure_trace(mode: str, cpus: list[int] | None, timeout: float) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [
            sys.executable,
            "-m",
            "engine.entrypoints.cli.main",
            "trace",
            "--headless",
            TRACE_PROMPT,
            "--trace-path",
            os.path.join(tmp, "trace.jsonl"),
            "--device",
            "cpu",  # a CPU benchmark, also on a machine with a GPU
        ]
        wall, cpu, proc = run_timed(cmd, child_env(mode), cpus, timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"trace ({mode}) failed:\n{proc.stderr[-2000:]}")
    return {"wall_s": round(wall, 2), "cpu_s": round(cpu, 2)}


def measure_batch(mode: str, n: int, cpus: list[int] | None, timeout: float) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "benchmarks.cpu_threads", "--_batch", str(n)]
    _, _, proc = run_timed(cmd, child_env(mode), cpus, timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"batch {n} ({mode}) failed:\n{proc.stderr[-2000:]}")
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    found = CORE_THREADS_RE.findall(proc.stderr)
    result["engine_core_threads"] = int(found[-1]) if found else None
    return result


def _proc_cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def batch_child(n: int) -> None:
    """One batch in this process (run by ``measure_batch`` with the mode's
    environment); prints one JSON line."""
    from engine.entrypoints.llm import LLM
    from engine.sampling_params import SamplingParams

    # --model / --load-format reach this child through the environment.
    llm = LLM(
        model=os.environ.get(BENCH_MODEL_ENV) or None,
        load_format=os.environ.get(BENCH_LOAD_FORMAT_ENV, "auto"),
        device="cpu",  # a CPU benchmark, also on a machine with a GPU
    )
    try:
        params = SamplingParams(temperature=0.0, max_tokens=BATCH_TOKENS, ignore_eos=True)
        llm.generate(BATCH_PROMPTS[:2], SamplingParams(max_tokens=2), use_tqdm=False)
        pids = [os.getpid(), *llm.llm_engine.engine_core.engine_core_pids]
        cpu0 = sum(_proc_cpu_s(p) for p in pids)
        start = time.perf_counter()
        outputs = llm.generate([BATCH_PROMPTS[i % len(BATCH_PROMPTS)] for i in range(n)], params)
        wall = time.perf_counter() - start
        cpu = sum(_proc_cpu_s(p) for p in pids) - cpu0
        tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    finally:
        llm.shutdown()
    print(json.dumps({"wall_s": round(wall, 3), "cpu_s": round(cpu, 3), "tokens": tokens}))


def summarize(modes: dict[str, Any]) -> dict[str, Any]:
    summary: dict[str, Any] = {}
    for mode, data in modes.items():
        row: dict[str, Any] = {}
        if data["trace"]:
            row["trace_wall_s"] = statistics.median(r["wall_s"] for r in data["trace"])
            row["trace_cpu_s"] = statistics.median(r["cpu_s"] for r in data["trace"])
        for n, runs in data["batch"].items():
            row[f"batch{n}_wall_s"] = statistics.median(r["wall_s"] for r in runs)
            row[f"batch{n}_cpu_s"] = statistics.median(r["cpu_s"] for r in runs)
            row[f"batch{n}_engine_core_threads"] = runs[-1]["engine_core_threads"]
        summary[mode] = row
    if "old" in summary and "new" in summary:
        summary["speedup_new_over_old"] = {
            k: round(summary["old"][k] / summary["new"][k], 2)
            for k in summary["new"]
            if k.endswith("wall_s") and summary["new"][k] > 0
        }
    return summary


def series_name(num_cpus: int, busy: int) -> str:
    """The result's series, as ``results_store.current_name`` should name it."""
    return f"cpu_threads_cpu_{num_cpus}c" + (f"_busy{busy}" if busy else "")


@contextlib.contextmanager
def busy_processes(count: int, cpus: list[int] | None) -> Iterator[None]:
    """``count`` processes spinning in a Python loop, stopped on exit."""
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", "while True: pass"],
            preexec_fn=(lambda: os.sched_setaffinity(0, cpus)) if cpus else None,
        )
        for _ in range(count)
    ]
    try:
        yield
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()


def run_rounds(args, modes: list[str], sizes: list[int], cpus, results: dict[str, Any]) -> None:
    for round_index in range(args.repeats):
        # Every round runs every mode once, starting one mode later each time.
        order = modes[round_index % len(modes) :] + modes[: round_index % len(modes)]
        for mode in order:
            if not args.skip_trace:
                r = measure_trace(mode, cpus, args.timeout)
                results[mode]["trace"].append(r)
                print(f"round {round_index} {mode:6s} trace   {r}", file=sys.stderr, flush=True)
            for n in sizes:
                r = measure_batch(mode, n, cpus, args.timeout)
                results[mode]["batch"][str(n)].append(r)
                print(f"round {round_index} {mode:6s} batch {n} {r}", file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="a directory (DIR/<series>.json) or a .json file")
    parser.add_argument("--cores", help="CPU list (0-1) or count (2) to confine the runs to")
    parser.add_argument("--repeats", type=int, default=1, help="rounds of every mode")
    parser.add_argument("--batch-sizes", default="1,2,4,8", help="comma-separated batch sizes")
    parser.add_argument("--modes", default="old,new,omp1", help="comma-separated modes")
    parser.add_argument("--threads-sweep", default="", help="extra ompK modes, e.g. 2,4,8")
    parser.add_argument("--skip-trace", action="store_true", help="batches only")
    parser.add_argument("--timeout", type=float, default=600, help="seconds per measurement")
    parser.add_argument("--busy", type=int, default=0, help="busy-looping processes alongside")
    parser.add_argument("--note", default="", help="free text stored with the result")
    parser.add_argument(
        "--model", help="batches only: model folder instead of the default (with --skip-trace)"
    )
    parser.add_argument(
        "--load-format", default="auto", help="batches: auto, or dummy (random weights)"
    )
    parser.add_argument("--_batch", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args._batch is not None:
        batch_child(args._batch)
        return 0

    if args.model:
        if not args.skip_trace:
            parser.error("--model needs --skip-trace (the trace runs the default model)")
        os.environ[BENCH_MODEL_ENV] = args.model
    os.environ[BENCH_LOAD_FORMAT_ENV] = args.load_format
    cpus = parse_cores(args.cores)
    used = cpus or sorted(os.sched_getaffinity(0))
    modes = [m for m in args.modes.split(",") if m]
    modes += [f"omp{k}" for k in args.threads_sweep.split(",") if k]
    for mode in modes:
        mode_env(mode)  # fail on a bad name before any run
    sizes = [int(s) for s in args.batch_sizes.split(",") if s]
    results: dict[str, Any] = {
        m: {"env": mode_env(m), "trace": [], "batch": {str(n): [] for n in sizes}} for m in modes
    }
    load_start = os.getloadavg()
    started = time.time()
    with busy_processes(args.busy, cpus):
        run_rounds(args, modes, sizes, cpus, results)
    result = {
        "benchmark": "cpu_threads",
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "commit": results_store.commit_id(),
        "note": args.note,
        "machine": {
            "cpu_model": cpu_model(),
            "logical_cpus": os.cpu_count(),
            "cpus_used": used,
            "confined_with": "sched_setaffinity" if cpus else None,
            "busy_processes_alongside": args.busy,
            "load_average_at_start": [round(x, 2) for x in load_start],
            "load_average_at_end": [round(x, 2) for x in os.getloadavg()],
            "python": platform.python_version(),
        },
        "workload": {
            "model": args.model or "default (SmolLM2-135M-Instruct, float32)",
            "load_format": args.load_format,
            "trace": f"glassbox trace --headless {TRACE_PROMPT!r} (EngineCore in-process)",
            "batch": f"LLM.generate of N prompts, {BATCH_TOKENS} tokens, greedy, ignore_eos; "
            "EngineCore in its own process; generate call only",
            "batch_sizes": sizes,
            "repeats": args.repeats,
        },
        "elapsed_s": round(time.time() - started, 1),
        "modes": results,
        "summary": summarize(results),
    }
    text = json.dumps(result, indent=1) + "\n"
    if args.out:
        out = Path(args.out)
        if out.suffix != ".json":
            out = out / f"{series_name(len(used), args.busy)}.json"
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(text)
        print(f"wrote {out}", file=sys.stderr)
    else:
        sys.stdout.write(text)
    print(json.dumps(result["summary"], indent=1), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
