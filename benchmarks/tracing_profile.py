"""Where tracing's time goes: a cProfile of the tracing-overhead workload at
trace level ``off`` and at ``lifecycle`` (or ``full``), and the functions
whose own time grew the most between the two.

``tracing_overhead.py`` says *how much* a level costs; this says *where*.
The workload and the engines are the same (``build_engine`` and
``workload`` from that module). The profiler slows Python down several
times over, so read the table as shares, not as absolute costs; the
unprofiled step times printed first are the real ones.

Run:  .venv/bin/python benchmarks/tracing_profile.py --model tiny --device cpu
      python3 benchmarks/tracing_profile.py --model smollm2-dummy --device cuda \\
          --max-tokens 96 --out $OUT/
``--out X.json`` writes the table as JSON and the printed report as ``X.txt``
(``--out DIR/``: ``DIR/<series>.json`` and ``.txt``, e.g. ``tracing_profile_gpu_h200``);
``--record`` stores both as the current result of the series
(``benchmarks/results/tracing_profile_<device>_<...>.{json,txt}``, see
``results_store.py``) and appends them to ``history.jsonl``.
"""

from __future__ import annotations

import argparse
import atexit
import cProfile
import datetime as _dt
import pstats
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

import torch  # noqa: E402

from benchmarks import results_store  # noqa: E402
from benchmarks.tracing_overhead import build_engine, machine, timed_run, workload  # noqa: E402


def _where(key: tuple[str, int, str]) -> str:
    path, line, name = key
    path = path.split(str(REPO_ROOT) + "/")[-1]
    return f"{path}:{line} {name}" if line else name


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument(
        "--model", default="tiny", help="'tiny', 'smollm2-dummy', 'default' or a path"
    )
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--level", default="lifecycle", choices=("lifecycle", "full"))
    parser.add_argument("--num-prompts", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=5, help="unprofiled timed rounds per level")
    parser.add_argument("--profiled-runs", type=int, default=3)
    parser.add_argument("--top", type=int, default=30)
    parser.add_argument("--cum", action="store_true", help="sort by added cumulative time")
    parser.add_argument(
        "--out",
        help="write the table as JSON to this file, or into this directory (DIR/), and the "
        "report beside it (.txt)",
    )
    results_store.add_record_arguments(parser)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)

    scratch = tempfile.mkdtemp(prefix="glassbox-trace-profile-")
    atexit.register(shutil.rmtree, scratch, True)
    levels = ("off", args.level)
    engines = {
        lv: build_engine(args.model, lv, scratch, args.device, args.num_prompts) for lv in levels
    }
    vocab = engines["off"].model_config.vocab_size
    requests = workload(engines["off"], args.num_prompts, args.max_tokens, vocab)
    counter = [0]
    for lv in levels:  # warm-up: graphs, kernels, allocator
        timed_run(engines[lv], requests, counter)

    wall: dict[str, list[float]] = {lv: [] for lv in levels}
    steps = args.max_tokens
    for _ in range(args.rounds):
        for lv in levels:
            _, elapsed, _, _ = timed_run(engines[lv], requests, counter)
            wall[lv].append(elapsed)
    step_us = {lv: statistics.median(w) / steps * 1e6 for lv, w in wall.items()}
    report: list[str] = []

    def say(line: str) -> None:
        print(line, flush=True)
        report.append(line)

    say(
        f"unprofiled step time (median of {args.rounds}): "
        + ", ".join(f"{lv} {us:.0f} us" for lv, us in step_us.items())
        + f"  -> {args.level} +{(step_us[args.level] / step_us['off'] - 1) * 100:.1f}%"
    )

    stats = {}
    for lv in levels:
        profiler = cProfile.Profile()
        profiler.enable()
        for _ in range(args.profiled_runs):
            timed_run(engines[lv], requests, counter)
        profiler.disable()
        stats[lv] = pstats.Stats(profiler).stats  # type: ignore[attr-defined]
    num_steps = steps * args.profiled_runs
    off, on = stats["off"], stats[args.level]
    rows = []
    for key, (_, ncalls, tottime, cumtime, _) in on.items():
        base = off.get(key)
        d_tot = tottime - (base[2] if base else 0.0)
        d_cum = cumtime - (base[3] if base else 0.0)
        d_calls = ncalls - (base[1] if base else 0)
        rows.append((d_tot, d_cum, d_calls, _where(key)))
    rows.sort(key=lambda r: r[1] if args.cum else r[0], reverse=True)
    total_off = sum(v[2] for v in off.values()) / num_steps * 1e6
    total_on = sum(v[2] for v in on.values()) / num_steps * 1e6
    say(f"profiled host time per step: off {total_off:.0f} us, {args.level} {total_on:.0f} us")
    say(f"{'own +us/step':>12} {'cum +us/step':>12} {'+calls/step':>11}  function")
    table = []
    for d_tot, d_cum, d_calls, where in rows[: args.top]:
        per = (d_tot / num_steps * 1e6, d_cum / num_steps * 1e6, d_calls / num_steps)
        say(f"{per[0]:12.1f} {per[1]:12.1f} {per[2]:11.1f}  {where}")
        table.append(
            {
                "function": where,
                "own_us_per_step": round(per[0], 2),
                "cum_us_per_step": round(per[1], 2),
                "calls_per_step": round(per[2], 2),
            }
        )
    result = {
        "benchmark": "tracing_profile",
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "commit": results_store.commit_id(),
        "machine": machine(),
        "model": args.model,
        "device": args.device,
        "level": args.level,
        "unprofiled_step_us": step_us,
        "profiled_step_us": {"off": total_off, args.level: total_on},
        "top_functions_by_added_own_time": table,
    }
    text = "\n".join(report) + "\n"
    if args.out:
        out = results_store.output_path(args.out, result)
        out.write_text(results_store.dump_result(result))
        out.with_suffix(".txt").write_text(text)
    if args.record:
        path = results_store.record(result, args.record, text=text, note=args.note)
        print(f"recorded {path} (and its history line)", file=sys.stderr)
    for engine in engines.values():
        engine.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
