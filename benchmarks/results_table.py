"""The tables of benchmark figures in the docs, generated from benchmarks/results.

Every table of measured figures in README.md, benchmarks/README.md,
docs/gpu.md, docs/trace_format.md, docs/reliability.md, docs/spec_decode.md
and the other docs in ``DOCS`` (docs/parallelism.md among them) sits
between two marker comments::

    <!-- results-table:NAME -->
    ...generated...
    <!-- /results-table:NAME -->

and is written by this script from the current result files and
``history.jsonl`` (``results_store.py`` describes both), so the figures in
the docs are copied by a program, not by hand. ``BLOCKS`` lists every table
and the doc it belongs to.

Usage (from the repo root):
  python benchmarks/results_table.py --check        # exit 1 if a table or a file name drifted
  python benchmarks/results_table.py --write        # rewrite every table
  python benchmarks/results_table.py --record out/gpu_throughput_h200.json ... [--note TEXT]
      # store results written elsewhere (the GPU machine's $OUT; a .txt beside a
      # .json goes with it) as the current files, append them to history.jsonl,
      # then rewrite the tables
  python benchmarks/results_table.py FILE.json      # print the GPU table of a gpu_throughput file
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass
from decimal import ROUND_HALF_UP, Decimal
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from benchmarks import results_store  # noqa: E402

RESULTS = Path("benchmarks/results")  # relative to the repo root
# The docs that may name result files and hold tables.
DOCS = (
    "README.md",
    "benchmarks/README.md",
    "docs/gpu.md",
    "docs/trace_format.md",
    "docs/reliability.md",
    "docs/spec_decode.md",
    "docs/structured_outputs.md",
    "docs/quantization.md",
    "docs/compilation.md",
    "docs/parallelism.md",
    "docs/lora.md",
)
# Issue 3's goal for the CPU benchmark (cpu_vs_transformers.py records none itself).
CPU_RATIO_TARGET = 1.5
# How many of the functions tracing adds the GPU profile table shows.
PROFILE_ROWS = 10


def _tps(x: float) -> str:
    return f"{x:,.0f} tok/s"


def _get(d: dict, *names: str) -> Any:
    """The first of ``names`` present in ``d`` (the first results file used
    ``tokens_per_s``/``seconds``/``ms_per_step``; later ones vLLM's names)."""
    for name in names:
        if name in d:
            return d[name]
    return None


def _pct(x: float) -> str:
    """A slowdown: ``+4.3%``, ``−0.6%`` (a minus sign), ``0.0%``."""
    if round(x, 1) == 0:
        return "0.0%"
    return f"{x:+.1f}%".replace("-", "\N{MINUS SIGN}")


def _pct_of(run: dict[str, Any]) -> str:
    return f"{100 * run['fraction_of_roofline']:.0f}%"


def _day(date: str | None) -> str:
    return (date or "")[:10]


def _short(commit: str | None) -> str:
    """``"7330f34+uncommitted (a long note)"`` -> ``"7330f34+uncommitted"``; a full
    40-digit hash is cut to 7 digits (``GLASSBOX_COMMIT=$(git rev-parse HEAD)+x``)."""
    head = (commit or "unknown").split(" ")[0]
    return re.sub(r"^([0-9a-f]{7})[0-9a-f]{33}", r"\1", head)


# --- the data ------------------------------------------------------------------


@dataclass
class Results:
    """The current files (file name -> parsed JSON) and history.jsonl's lines."""

    current: dict[str, dict[str, Any]]
    history: list[dict[str, Any]]
    files: list[str]  # every file name in benchmarks/results

    @classmethod
    def load(cls, root: Path) -> Results:
        results_dir = root / RESULTS
        files = sorted(p.name for p in results_dir.iterdir() if p.is_file())
        current = {
            name: json.loads((results_dir / name).read_text())
            for name in files
            if name.endswith(".json")
        }
        return cls(current, results_store.read_history(results_dir), files)

    def series(self, current_file: str) -> list[dict[str, Any]]:
        """The history lines of one series, in the order stored."""
        return [r for r in self.history if r["current_file"] == current_file]

    def line_of(self, current_file: str) -> dict[str, Any]:
        """The history line the current file came from: its series' last."""
        lines = self.series(current_file)
        if not lines:
            raise ValueError(f"{current_file} has no line in history.jsonl")
        return lines[-1]


# --- tracing overhead ------------------------------------------------------------


def overhead(r: dict[str, Any]) -> dict[str, float]:
    """Slowdown per traced mode, %, against the file's baseline: ``off``
    (files from the subsystem trace objects on) or ``noop`` (earlier files:
    the tracer's entry points monkeypatched to no-ops)."""
    return r.get("slowdown_vs_off_percent") or r["slowdown_vs_noop_percent"]


def baseline(r: dict[str, Any]) -> str:
    return r.get("baseline", "noop")


def off_figure(r: dict[str, Any]) -> str:
    """``off``'s cost: the bound against no hooks (newer files), or the
    figure measured against the no-op run (earlier ones)."""
    if baseline(r) == "off":
        return f"≤ {r['off_upper_bound']['percent']:.2f}% (bound)"
    return _pct(r["slowdown_vs_noop_percent"]["off"])


def _medians(r: dict[str, Any]) -> dict[str, float]:
    key = "throughput_tok_per_wall_s" if r["headline_metric"] == "wall_clock" else None
    return r[key or "throughput_tok_per_cpu_s"]["median"]


def _samples(r: dict[str, Any]) -> dict[str, list[float]]:
    key = "throughput_tok_per_wall_s" if r["headline_metric"] == "wall_clock" else None
    return r[key or "throughput_tok_per_cpu_s"]["samples"]


def step_ms(r: dict[str, Any]) -> float | None:
    """One step of the baseline run, in the headline metric's time."""
    w = r["workload"]
    steps = w.get("engine_steps_per_run")
    if not steps:
        return None
    return 1e3 * w["num_prompts"] * w["max_tokens"] / _medians(r)[baseline(r)] / steps


def per_round(r: dict[str, Any], mode: str) -> float:
    """Median over rounds of the mode's slowdown against the baseline run of
    the same round (which cancels a host that drifts between rounds)."""
    samples = _samples(r)
    return results_store.per_round_slowdown(samples[baseline(r)], samples[mode])


def tracing_where(name: str, r: dict[str, Any]) -> tuple[str, str]:
    """(where, model) of a tracing_overhead series, for the tables."""
    threads = r.get("machine", {}).get("torch_threads", 1)
    if r.get("device") == "cpu":
        where = f"CPU, {threads} thread{'s' if threads != 1 else ''}, CPU time"
    else:
        gpu = r.get("gpu") or r.get("machine", {}).get("gpu", "GPU")
        where = f"{gpu.replace('NVIDIA ', '')}, wall clock"
    if name.endswith("_tiny.json"):
        model = "tiny 2-layer Llama (worst case: all bookkeeping)"
    elif r.get("device") == "cpu":
        model = "SmolLM2-135M (default), fp32"
    else:
        model = "SmolLM2-135M shapes, dummy weights, bf16"
    return where, model


def tracing_overhead_table(res: Results) -> str:
    """docs/trace_format.md: the current overhead of each level, per machine."""
    lines = [
        "| where | model | `off` | `lifecycle` | `full` | against | file |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for name in ("tracing_overhead_cpu_smollm2.json", "tracing_overhead_cpu_tiny.json"):
        lines.append(_overhead_row(res, name))
    for name in sorted(res.current):
        if name.startswith("tracing_overhead_gpu_"):
            lines.append(_overhead_row(res, name))
    return "\n".join(lines)


def _overhead_row(res: Results, name: str) -> str:
    r = res.current[name]
    where, model = tracing_where(name, r)
    s = overhead(r)
    line = res.line_of(name)
    return (
        f"| {where} | {model} | {off_figure(r)} | {_pct(s['lifecycle'])} | {_pct(s['full'])} | "
        f"`{baseline(r)}` | `{name}` ({_day(line['date'])}, {_short(line['commit'])}) |"
    )


def tracing_gpu_history_table(res: Results) -> str:
    """docs/gpu.md: every GPU tracing-overhead run, in the order stored."""
    lines = [
        "| date, commit | run | against | `off` | `lifecycle` | `full` | per round | hooks alone "
        "| step | tracer µs/event | source_file |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for line in res.history:
        r = line["result"]
        if line["benchmark"] != "tracing_overhead" or r.get("device") != "cuda":
            continue
        s = overhead(r)
        paired = f"{_pct(per_round(r, 'lifecycle'))} / {_pct(per_round(r, 'full'))}"
        hooks = (
            f"{_pct(s['lifecycle-hooks'])} / {_pct(s['full-hooks'])}"
            if "lifecycle-hooks" in s
            else ""
        )
        step = step_ms(r)
        us = r.get("tracer_us_per_event", {}).get("lifecycle")
        lines.append(
            f"| {_day(line['date'])}, {_short(line['commit'])} | {line.get('note', '')} | "
            f"`{baseline(r)}` | {off_figure(r)} | {_pct(s['lifecycle'])} | {_pct(s['full'])} | "
            f"{paired} | {hooks} | "
            f"{f'{step:.1f} ms' if step else ''} | {f'{us:.2f}' if us else ''} | "
            f"`{line['source_file']}` |"
        )
    return "\n".join(lines)


def tracing_profile_table(res: Results) -> str:
    """docs/gpu.md: the functions whose own time ``lifecycle`` adds the most."""
    name = "tracing_profile_gpu_h200.json"
    r = res.current[name]
    line = res.line_of(name)
    level = r["level"]
    un = r["unprofiled_step_us"]
    pr = r["profiled_step_us"]
    head = (
        f"`{name}` and `{name[:-5]}.txt` ({_day(line['date'])}, {_short(line['commit'])}): "
        f"step {un['off']:,.0f} µs at `off` and {un[level]:,.0f} µs at `{level}` unprofiled, "
        f"{pr['off']:,.0f} and {pr[level]:,.0f} µs under cProfile."
    )
    lines = [
        head,
        "",
        "| function | own +µs/step | cumulative +µs/step | +calls/step |",
        "| --- | --- | --- | --- |",
    ]
    for row in r["top_functions_by_added_own_time"][:PROFILE_ROWS]:
        lines.append(
            f"| `{row['function']}` | {row['own_us_per_step']:.1f} | "
            f"{row['cum_us_per_step']:.1f} | {row['calls_per_step']:.1f} |"
        )
    return "\n".join(lines)


# --- GPU throughput ----------------------------------------------------------------


def table(r: dict) -> str:
    """The figures of one gpu_throughput file: Glassbox, target, bound."""
    lines = ["| | Glassbox | target | bound |", "| --- | --- | --- | --- |"]
    roof = r.get("roofline", {})
    bound_tps = _get(roof, "output_tokens_per_second", "tokens_per_s")
    bound = (
        f"{_tps(bound_tps)} (roofline at the measured {r['copy_bandwidth_GBps'] / 1e3:.2f} TB/s)"
        if bound_tps
        else ""
    )
    targets = r.get("targets", {})
    backend = r.get("engine", {}).get("attention_backend", "?")
    graphs = r.get("throughput_cudagraphs", {})
    if _get(graphs, "output_tokens_per_second", "tokens_per_s"):
        tokens = _get(graphs, "total_output_tokens", "output_tokens")
        seconds = _get(graphs, "elapsed_time", "seconds")
        lines.append(
            f"| nano-vllm workload ({tokens:,} output tokens), {backend}, CUDA graphs | "
            f"{_tps(_get(graphs, 'output_tokens_per_second', 'tokens_per_s'))} "
            f"({seconds:.1f} s, {graphs.get('fraction_of_roofline', 0):.0%} of bound) | "
            f"{targets.get('throughput_tokens_per_s', 0):,} tok/s | {bound} |"
        )
    eager = r.get("throughput_eager", {})
    if _get(eager, "output_tokens_per_second", "tokens_per_s"):
        lines.append(
            f"| same, eager | {_tps(_get(eager, 'output_tokens_per_second', 'tokens_per_s'))} "
            f"({_get(eager, 'elapsed_time', 'seconds'):.1f} s) | | |"
        )
    hf = r.get("hf_transformers_continuous_batching")
    hf = hf if isinstance(hf, dict) else {}
    if "output_tokens_per_second" in hf:
        n = hf.get("capped_to_first_n_prompts")
        scope = f"first {n} prompts" if n else "same prompts"
        if hf.get("completed", True):
            figure = f"{_tps(hf['output_tokens_per_second'])} ({hf['elapsed_time']:.1f} s)"
        else:
            upper = _tps(hf["output_tokens_per_second_upper_bound"])
            figure = (
                f"stopped after {hf['timeout_s']:.0f} s ({hf['num_requests_finished']} of "
                f"{hf['num_requests_submitted']} done): at most {upper}"
            )
        attn = hf.get("attn_implementation", "?").replace("|", "\\|")
        lines.append(
            f"| HF transformers {hf.get('transformers_version', '')} continuous batching ({scope}, "
            f"{attn}) | {figure} | | |"
        )
    subset = r.get("throughput_cudagraphs_on_hf_subset")
    if isinstance(subset, dict) and "output_tokens_per_second" in subset:
        lines.append(
            f"| Glassbox on the same {subset.get('num_requests', '')} prompts | "
            f"{_tps(subset['output_tokens_per_second'])} ({subset['elapsed_time']:.1f} s) | | |"
        )
    if r.get("ratio_to_transformers") is not None:
        kind = "≥ " if r.get("ratio_is_lower_bound") else ""
        lines.append(
            f"| Glassbox / transformers | {kind}{r['ratio_to_transformers']:.1f}x | "
            f"{targets.get('ratio_to_transformers', '')}x | |"
        )
    for name, label in (
        ("decode_latency_cudagraphs", "CUDA graphs"),
        ("decode_latency_eager", "eager"),
    ):
        lat = r.get(name)
        if not isinstance(lat, dict) or "error" in lat:
            continue
        sizes = sorted(lat, key=int)
        ms = " / ".join(f"{_get(lat[b], 'mean_ms', 'ms_per_step'):.2f}" for b in sizes)
        floor = " / ".join(f"{lat[b]['floor_ms']:.2f}" for b in sizes if "floor_ms" in lat[b])
        target = (
            f"{targets.get('decode_step_batch1_ms', '')} ms (batch 1)"
            if label == "CUDA graphs"
            else ""
        )
        lines.append(
            f"| decode step, batch {' / '.join(sizes)}, ctx 512, {label} | {ms} ms | {target} | "
            f"{floor + ' ms floor' if floor else ''} |"
        )
    missed = r.get("missed_by", {})
    if missed:
        lines.append("")
        lines.extend(f"- {k}: {v}" for k, v in missed.items())
    return "\n".join(lines)


def gpu_head(r: dict) -> str:
    return (
        f"Measured on one {r.get('gpu', 'GPU')} ({_day(r.get('date'))}, torch {r.get('torch')}, "
        f"commit {_short(r.get('commit'))}); {r.get('model', '')}."
    )


def gpu_throughput_table(res: Results) -> str:
    """docs/gpu.md: the current gpu_throughput file."""
    name = "gpu_throughput_h200.json"
    r = res.current[name]
    versions = ", ".join(
        f"{k} {r[k]}" for k in ("flashinfer", "triton", "transformers") if r.get(k)
    )
    return f"`{name}` ({versions}). {gpu_head(r)}\n\n{table(r)}"


def gpu_throughput_history_table(res: Results) -> str:
    """docs/gpu.md: every gpu_throughput run, in the order stored."""
    lines = [
        "| date, commit | run | CUDA graphs | eager | transformers / ratio | decode step, "
        "batch 1, graphs | source_file |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for line in res.series("gpu_throughput_h200.json"):
        r = line["result"]
        graphs = _get(
            r.get("throughput_cudagraphs", {}), "output_tokens_per_second", "tokens_per_s"
        )
        eager = _get(r.get("throughput_eager", {}), "output_tokens_per_second", "tokens_per_s")
        ratio = r.get("ratio_to_transformers")
        ratio_text = ""
        if ratio is not None:
            ratio_text = f"{'≥ ' if r.get('ratio_is_lower_bound') else ''}{ratio:.1f}x"
        lat = r.get("decode_latency_cudagraphs", {})
        b1 = _get(lat.get("1", {}), "mean_ms", "ms_per_step") if isinstance(lat, dict) else None
        lines.append(
            f"| {_day(line['date'])}, {_short(line['commit'])} | {line.get('note', '')} | "
            f"{_tps(graphs) if graphs else ''} | {_tps(eager) if eager else ''} | {ratio_text} | "
            f"{f'{b1:.2f} ms' if b1 else ''} | `{line['source_file']}` |"
        )
    return "\n".join(lines)


def gpu_profile_step_table(res: Results) -> str:
    """docs/gpu.md: where one batch-1 decode step's time goes."""
    name = "gpu_profile_step_b1_h200.json"
    r = res.current[name]
    line = res.line_of(name)
    lines = [
        f"`{name}` and `{name[:-5]}.txt` ({_day(line['date'])}, {_short(line['commit'])}; "
        f"{r['model']}, context {r['context']}, {r['attention_backend']}, CUDA graphs):",
        "",
        "| per decode step, batch 1 | ms |",
        "| --- | --- |",
        f"| wall time (under cProfile) | {r['wall_ms_per_step']:.2f} |",
        f"| GPU busy ({r['gpu_kernels_per_step']:.0f} kernels) | {r['gpu_ms_per_step']:.2f} |",
    ]
    for phase, ms in r["host_ms_per_step_under_cprofile"].items():
        if ms:
            lines.append(f"| host, cumulative: `{phase}` | {ms:.2f} |")
    return "\n".join(lines)


# --- CPU against transformers -------------------------------------------------------


def cpu_summary(r: dict[str, Any]) -> dict[str, Any]:
    g = r["glassbox"]["batched"]
    t = r.get("transformers", {}).get("batched", {})
    ratio = r.get("ratio_glassbox_over_transformers_batched", {})
    agree = r.get("greedy_agreement_glassbox_vs_transformers_batched", {})
    return {
        "glassbox": g["output_tok_per_s_median"],
        "glassbox_s": g["wall_s_median"],
        "transformers": t.get("output_tok_per_s_median"),
        "transformers_s": t.get("wall_s_median"),
        "ratio_wall": ratio.get("wall_median"),
        "ratio_cpu": ratio.get("cpu_median"),
        "bs1": r["glassbox"].get("bs1", {}).get("output_tok_per_s_median"),
        "hf_bs1": r.get("transformers", {}).get("bs1", {}).get("output_tok_per_s_median"),
        "identical": f"{agree['identical']}/{agree['of']}" if agree else "",
        "threads": r.get("torch_num_threads"),
    }


def cpu_history_table(res: Results) -> str:
    """benchmarks/README.md: every CPU benchmark run, in the order stored."""
    lines = [
        "| date, commit | run | threads | Glassbox | transformers batched | ratio (wall) "
        "| ratio (CPU time) | Glassbox bs1 | transformers bs1 | identical greedy outputs "
        "| source_file |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]

    def num(x: float | None, fmt: str) -> str:
        return format(x, fmt) if x is not None else "—"

    for line in res.series("cpu_vs_transformers_cpu.json"):
        s = cpu_summary(line["result"])
        lines.append(
            f"| {_day(line['date'])}, {_short(line['commit'])} | {line.get('note', '')} | "
            f"{s['threads']} | **{s['glassbox']:.1f}** tok/s ({s['glassbox_s']:.2f} s) | "
            f"{num(s['transformers'], '.1f')} tok/s ({num(s['transformers_s'], '.2f')} s) | "
            f"**{num(s['ratio_wall'], '.2f')}×** | {num(s['ratio_cpu'], '.2f')}× | "
            f"{num(s['bs1'], '.1f')} | {num(s['hf_bs1'], '.1f')} | {s['identical']} | "
            f"`{line['source_file']}` |"
        )
    return "\n".join(lines)


# --- CPU threads ---------------------------------------------------------------------

# cpu_threads.py's modes as the table names them; an ompK mode is the new code with K threads.
THREAD_MODES = {
    "old": "old: torch's default threads",
    "new": "new: Glassbox's default",
    "omp1": "`OMP_NUM_THREADS=1`",
    "passive": "torch's default threads, `OMP_WAIT_POLICY=PASSIVE`",
}


def thread_mode(mode: str) -> str:
    if mode in THREAD_MODES:
        return THREAD_MODES[mode]
    m = re.fullmatch(r"omp(\d+)", mode)
    return f"new, `OMP_NUM_THREADS={m.group(1)}`" if m else f"`{mode}`"


def _secs(x: float) -> str:
    """Seconds to 2 decimals, half up from the figure as stored: 7.305 -> 7.31, which
    ``f"{7.305:.2f}"`` makes 7.30 (the binary float is a hair below)."""
    return str(Decimal(repr(x)).quantize(Decimal("0.01"), ROUND_HALF_UP))


def _threads(n: Any) -> str:
    return f"{n} thread{'' if n == 1 else 's'}"


def _batch_sizes(r: dict[str, Any]) -> list[int]:
    return [int(n) for n in r["workload"]["batch_sizes"]]


def core_threads(row: dict[str, Any], sizes: list[int]) -> str:
    """EngineCore's logged thread count over a mode's batches (``2 / 3`` if they differ)."""
    counts = {row.get(f"batch{n}_engine_core_threads") for n in sizes} - {None}
    return " / ".join(str(c) for c in sorted(counts)) or "—"


def cpu_threads_names(res: Results) -> list[str]:
    """The current cpu_threads files, fewest CPUs first (quiet before busy)."""
    names = [n for n in res.current if n.startswith("cpu_threads_")]
    return sorted(names, key=lambda n: (len(res.current[n]["machine"]["cpus_used"]), n))


def cpu_threads_table(res: Results) -> str:
    """docs/reliability.md: wall seconds per thread mode, one table per cpu_threads series."""
    parts = []
    for name in cpu_threads_names(res):
        r = res.current[name]
        line = res.line_of(name)
        machine, workload, summary = r["machine"], r["workload"], r["summary"]
        cpus = len(machine["cpus_used"])
        # --cores confines a run to some of the machine's CPUs.
        of = f" of {machine['logical_cpus']}" if machine.get("confined_with") else ""
        where = f"{cpus}{of} CPUs"
        busy = machine.get("busy_processes_alongside") or 0
        beside = f"{busy or 'no'} busy process{'es' if busy > 1 else ''} alongside"
        weights = ", dummy weights" if workload.get("load_format") == "dummy" else ""
        rounds = workload["repeats"]
        how = f"median of {rounds} rounds" if rounds > 1 else "1 round"
        note = line.get("note", "").rstrip(".")
        note = f" {note[:1].upper()}{note[1:]}." if note else ""
        model = workload["model"]
        model = model if model.startswith("default") else f"`{model}`"  # else a path
        parts.append(
            f"`{name}` ({_day(line['date'])}, {_short(line['commit'])}; {where}, {beside}; "
            f"model {model}{weights}; {how}).{note}"
        )
        modes = [m for m in r["modes"] if m in summary]
        sizes = _batch_sizes(r)
        trace = any("trace_wall_s" in summary[m] for m in modes)
        head = ["mode", "EngineCore threads"] + ["trace"] * trace + [f"batch {n}" for n in sizes]
        rows = [
            "| " + " | ".join(head) + " |",
            "|" + " --- |" * len(head),
        ]
        for mode in modes:
            row = summary[mode]
            keys = ["trace_wall_s"] * trace + [f"batch{n}_wall_s" for n in sizes]
            cells = [thread_mode(mode), core_threads(row, sizes)]
            cells += [_secs(row[k]) if k in row else "—" for k in keys]
            rows.append("| " + " | ".join(cells) + " |")
        parts.append("\n".join(rows))
    return "\n\n".join(parts)


def cpu_threads_says(r: dict[str, Any]) -> str:
    """One line on a cpu_threads file: its largest batch, mode by mode."""
    n = max(_batch_sizes(r))
    summary = r["summary"]
    modes = [m for m in r["modes"] if f"batch{n}_wall_s" in summary.get(m, {})]
    figures = ", ".join(
        f"{m} {_secs(summary[m][f'batch{n}_wall_s'])} s "
        f"({_threads(summary[m].get(f'batch{n}_engine_core_threads', '?'))})"
        for m in modes
    )
    return f"batch {n}, {len(r['machine']['cpus_used'])} CPUs: {figures}"


# --- summaries: README's status and the list of files ------------------------------------


def status_table(res: Results) -> str:
    """README.md: the current headline figures."""
    lines = [
        "| measured | figure | target | file (date, commit) |",
        "| --- | --- | --- | --- |",
    ]

    def source(name: str) -> str:
        line = res.line_of(name)
        return f"`{name}` ({_day(line['date'])}, {_short(line['commit'])})"

    gpu = res.current["gpu_throughput_h200.json"]
    targets = gpu.get("targets", {})
    tps = gpu["throughput_cudagraphs"]["output_tokens_per_second"]
    roof = gpu["roofline"]["output_tokens_per_second"]
    lines.append(
        "| H200, nano-vllm workload (Qwen3-0.6B shapes, dummy weights, bf16), eager model, "
        f"FULL_DECODE_ONLY graphs, serial loop | "
        f"{_tps(tps)} (roofline {_tps(roof)}) | {targets['throughput_tokens_per_s']:,} tok/s | "
        f"{source('gpu_throughput_h200.json')} |"
    )
    hf = gpu.get("hf_transformers_continuous_batching", {})
    scope = (
        f"the same first {hf['capped_to_first_n_prompts']}"
        if hf.get("capped_to_first_n_prompts")
        else "the same"
    )
    kind = "≥ " if gpu.get("ratio_is_lower_bound") else ""
    lines.append(
        f"| H200, against HF transformers' continuous batching on {scope} requests | "
        f"{kind}{gpu['ratio_to_transformers']:.1f}x | {targets['ratio_to_transformers']}x | "
        "same file |"
    )
    b1 = gpu["decode_latency_cudagraphs"]["1"]["mean_ms"]
    lines.append(
        f"| H200, one decode step at batch 1, context 512, the same engine | {b1:.2f} ms | "
        f"{targets['decode_step_batch1_ms']} ms | same file |"
    )
    modes = res.current.get("gpu_throughput_modes_h200.json", {}).get("throughput_cudagraphs")
    if modes:
        engine = res.current["gpu_throughput_modes_h200.json"]["engine"]
        lines.append(
            f"| H200, the same workload on the default engine (-O{engine['optimization_level']} "
            f"compiled, {engine['cudagraph_mode']}, async scheduling) | "
            f"{_tps(modes['output_tokens_per_second'])} ({_pct_of(modes)} of the roofline) | "
            f"{targets['throughput_tokens_per_s']:,} tok/s | "
            f"{source('gpu_throughput_modes_h200.json')} |"
        )
    fp8 = res.current.get("gpu_throughput_fp8_h200.json", {}).get("throughput_fp8")
    if modes and fp8 and "output_tokens_per_second" in fp8:
        lines.append(
            '| H200, the same workload and engine with `quantization="fp8"` (online W8A8), '
            f"against bf16 | {_tps(fp8['output_tokens_per_second'])} "
            f"(bf16: {_tps(modes['output_tokens_per_second'])}) | — | "
            f"{source('gpu_throughput_fp8_h200.json')} |"
        )
    if "async_scheduling_h200.json" in res.current:
        summary = res.current["async_scheduling_h200.json"]["summary"]
        itl = summary["async"]["client_itl_batch1_median_ms"]
        serial = summary["sync"]["client_itl_batch1_median_ms"]
        lines.append(
            "| H200, batch 1, context 512: time between tokens at the client, async scheduling "
            f"(serial loop) | {itl:.2f} ms ({serial:.2f} ms) | "
            f"{targets['decode_step_batch1_ms']} ms | {source('async_scheduling_h200.json')} |"
        )
    if "spec_decode_cpu.json" in res.current:
        r = res.current["spec_decode_cpu.json"]
        figures = spec_status(r)
        if figures:
            lines.append(
                "| CPU, default model, prompts that repeat their own text, batch 1: n-gram "
                f"speculation against none | {figures} | — | {source('spec_decode_cpu.json')} |"
            )
    if "structured_output_cost_h200.json" in res.current:
        rows = {
            (x["mode"], x["batch"]): x
            for x in res.current["structured_output_cost_h200.json"]["results"]
        }
        b = max(batch for _, batch in rows)
        if ("json_async", b) in rows and ("free_async", b) in rows:
            lines.append(
                f"| H200, Qwen3-0.6B shapes, batch {b}: decode step with every row JSON-masked "
                f"(free), async scheduling | {rows['json_async', b]['ms_per_step']:.2f} ms "
                f"({rows['free_async', b]['ms_per_step']:.2f} ms) | — | "
                f"{source('structured_output_cost_h200.json')} |"
            )
    cpu = cpu_summary(res.current["cpu_vs_transformers_cpu.json"])
    lines.append(
        f"| CPU, {cpu['threads']} thread, 32 chat prompts (default model, fp32): against "
        f"transformers' batched `generate` | {cpu['ratio_wall']:.2f}x ({cpu['glassbox']:.1f} "
        f"against {cpu['transformers']:.1f} tok/s) | {CPU_RATIO_TARGET}x | "
        f"{source('cpu_vs_transformers_cpu.json')} |"
    )
    for name, label in (
        ("tracing_overhead_gpu_h200.json", "H200, SmolLM2-135M shapes"),
        ("tracing_overhead_cpu_smollm2.json", "CPU, default model"),
    ):
        r = res.current[name]
        s = overhead(r)
        t = r["targets_percent"]
        lines.append(
            f"| tracing, {label}: `lifecycle` / `full` slower than `{baseline(r)}`; `off` | "
            f"{_pct(s['lifecycle'])} / {_pct(s['full'])}; {off_figure(r)} | "
            f"{t['lifecycle']:g}% / {t['full']:g}%; {t['off']:g}% | {source(name)} |"
        )
    return "\n".join(lines)


def _file_says(res: Results, name: str) -> str:
    """One line on what a current file holds."""
    if name == results_store.HISTORY_FILE:
        return f"every result stored so far, in the order stored ({len(res.history)} lines)"
    stem = name.rsplit(".", 1)[0]
    r = res.current.get(stem + ".json", {})
    if name.endswith(".txt"):
        return "the report printed beside the JSON (profile tables)"
    benchmark = res.line_of(name)["benchmark"]
    if benchmark == "cpu_vs_transformers":
        s = cpu_summary(r)
        return (
            f"Glassbox {s['glassbox']:.1f} tok/s, transformers {s['transformers']:.1f} tok/s: "
            f"{s['ratio_wall']:.2f}x, {s['identical']} identical"
        )
    if benchmark == "gpu_throughput" and "throughput_fp8" in r and "throughput_compiled" not in r:
        fp8 = r["throughput_fp8"]
        b1 = r.get("decode_latency_fp8", {}).get("1", {}).get("mean_ms")
        return f"quantization=fp8: {_tps(fp8['output_tokens_per_second'])}" + (
            f", batch-1 step {b1:.2f} ms" if b1 else ""
        )
    if benchmark == "gpu_throughput" and "throughput_mixed_lora" in r and "throughput_fp8" not in r:
        base = r["throughput_lora_engine_base_only"]["output_tokens_per_second"]
        mixed = r["throughput_mixed_lora"]["output_tokens_per_second"]
        return f"LoRA engine: base model {_tps(base)}, mixed adapters {_tps(mixed)}"
    if benchmark == "gpu_throughput" and "ratio_to_transformers" not in r:
        modes = ", ".join(
            f"{mode} {_tps(x['output_tokens_per_second'])}"
            for mode, x in r.get("throughput_compiled", {}).items()
        )
        return (
            f"the default (O2 FULL_AND_PIECEWISE) "
            f"{_tps(r['throughput_cudagraphs']['output_tokens_per_second'])}; {modes}"
        )
    if benchmark == "gpu_throughput":
        return (
            f"{_tps(r['throughput_cudagraphs']['output_tokens_per_second'])} with CUDA graphs, "
            f"{r['ratio_to_transformers']:.1f}x transformers, batch-1 step "
            f"{r['decode_latency_cudagraphs']['1']['mean_ms']:.2f} ms"
        )
    if benchmark == "gpu_profile_step":
        return (
            f"batch-1 step {r['wall_ms_per_step']:.2f} ms wall, GPU busy "
            f"{r['gpu_ms_per_step']:.2f} ms"
        )
    if benchmark == "gpu_profile_modes":
        return "; ".join(
            f"{mode} {m['wall_ms_per_step']:.2f} ms, {m['gpu_kernels_per_step']:.0f} kernels"
            for mode, m in r["modes"].items()
        )
    if benchmark == "skinny_gemm":
        cells = [
            f"{shape} x{rows} {e['cublas_us']:.1f} / {e['best_us']:.1f} us"
            for shape, v in r["shapes"].items()
            for rows, e in v["rows"].items()
            if "best_us" in e
        ]
        return "cuBLAS / Triton skinny GEMM: " + ", ".join(cells)
    if benchmark == "async_scheduling":
        sync, over = r["summary"]["sync"], r["summary"]["async"]
        return (
            f"sync / async: {_tps(sync['throughput_tokens_per_s'])} / "
            f"{_tps(over['throughput_tokens_per_s'])}; batch-1 client inter-token "
            f"{sync['client_itl_batch1_median_ms']:.2f} / "
            f"{over['client_itl_batch1_median_ms']:.2f} ms"
        )
    if benchmark == "tracing_overhead":
        s = overhead(r)
        return (
            f"`lifecycle` {_pct(s['lifecycle'])}, `full` {_pct(s['full'])} against "
            f"`{baseline(r)}`; `off` {off_figure(r)}"
        )
    if benchmark == "cpu_threads":
        return cpu_threads_says(r)
    if benchmark == "spec_decode":
        return spec_decode_says(r)
    if benchmark == "spec_verify_cost":
        return spec_verify_says(r)
    if benchmark == "structured_output_cost":
        worst = max(r["results"], key=lambda x: x["ratio_to_free"])
        return (
            f"a decode step with every row JSON-masked against a free one; dearest: "
            f"{worst['mode']} at batch {worst['batch']}, {worst['ratio_to_free']:.2f}x"
        )
    if benchmark == "tracing_profile":
        return f"where `{r['level']}`'s host time goes (cProfile, `off` against `{r['level']}`)"
    if benchmark == "broadcast":
        return broadcast_says(r)
    if benchmark == "tensor_parallel":
        return tensor_parallel_says(r)
    if benchmark == "quantization":
        q, f = r["variants"]["gguf_q4_1"], r["variants"]["float32"]
        return (
            f"SmolLM2 from its Q4_1 GGUF: {q['weight_fraction_of_float32']:.0%} of the float32 "
            f"weight bytes, {q['output_tokens_per_second']:.1f} against "
            f"{f['output_tokens_per_second']:.1f} tok/s"
        )
    return ""


ASYNC_ROWS = (
    ("throughput_tokens_per_s", "throughput, output tok/s", "{:,.0f}"),
    ("client_itl_batch1_median_ms", "batch 1: inter-token time at the client, median ms", "{:.2f}"),
    ("decode_step_batch1_median_ms", "batch 1: one decode step, median ms", "{:.2f}"),
    ("decode_step_batch16_median_ms", "batch 16: one decode step, median ms", "{:.2f}"),
    ("decode_step_batch64_median_ms", "batch 64: one decode step, median ms", "{:.2f}"),
)


def async_scheduling_table(res: Results) -> str:
    """docs/gpu.md: async scheduling off against on, per machine measured."""
    parts = []
    for name in sorted(n for n in res.current if n.startswith("async_scheduling_")):
        r = res.current[name]
        summary = r["summary"]
        line = res.line_of(name)
        parts.append(
            f"`{name}` ({_day(line['date'])}, {_short(line['commit'])}; {r['model']}; "
            f"throughput: {r['throughput_workload']}; medians of {r['rounds']} interleaved "
            "rounds):"
        )
        rows = [
            "| | serial loop | async scheduling | async / serial |",
            "| --- | --- | --- | --- |",
        ]
        for key, label, fmt in ASYNC_ROWS:
            if key in summary["sync"] and key in summary["async"]:
                rows.append(
                    f"| {label} | {fmt.format(summary['sync'][key])} | "
                    f"{fmt.format(summary['async'][key])} | "
                    f"{summary['async_over_sync'][key]:.2f} |"
                )
        parts.append("\n".join(rows))
    return "\n\n".join(parts)


# --- speculative decoding ------------------------------------------------------------


def spec_mode(r: dict[str, Any], mode: str) -> str:
    """A spec_decode mode as the table names it."""
    m = r["modes"][mode]
    config = m["speculative_config"]
    if config is None:
        return "off, " + ("async scheduling" if m["async_scheduling"] else "serial loop")
    lo, hi = config["prompt_lookup_min"], config["prompt_lookup_max"]
    window = f"{lo}" if lo == hi else f"{lo}–{hi}"
    return f"n-gram, k = {config['num_speculative_tokens']}, lookup {window}"


def _acceptance(p: dict[str, Any]) -> tuple[str, str, str]:
    """(mean acceptance length, acceptance rate, per position) of one part's summary."""
    if "mean_acceptance_length" not in p:
        return "", "", ""
    per_pos = " / ".join(f"{x:.2f}" for x in p["acceptance_per_position"])
    return f"{p['mean_acceptance_length']:.2f}", f"{p['acceptance_rate']:.0%}", per_pos


def spec_identical(r: dict[str, Any]) -> str:
    """Whether greedy outputs stayed the same with speculation."""
    n, of = len(r["mismatches"]), r["outputs_compared"]
    if not n:
        return f"greedy outputs token-identical to `off`'s ({of} outputs compared)"
    return f"**{n} of {of} greedy outputs differ from `off`'s** (`mismatches`)"


def _rounds(n: int) -> str:
    return f"medians of {n} interleaved rounds" if n > 1 else "1 round"


def spec_verify_says(r: dict[str, Any]) -> str:
    """One line: the dearest verification step against graphed decode."""
    worst = max(r["results"], key=lambda x: x["ratio_to_decode_graphs"])
    return (
        f"one step verifying k drafts against a plain decode step; dearest: "
        f"{worst['mode']} at batch {worst['batch']}, {worst['ratio_to_decode_graphs']:.2f}x"
    )


def _mode_batch_rows(r: dict[str, Any], value: str, ratio: str) -> list[str]:
    """A markdown table of ``r["results"]``: a row per mode, a column per batch
    size, each cell ``value`` in ms and ``ratio`` as a multiple."""
    batches = sorted({x["batch"] for x in r["results"]})
    cell = {(x["mode"], x["batch"]): x for x in r["results"]}
    lines = [
        "| mode | " + " | ".join(f"batch {b}" for b in batches) + " |",
        "| --- |" + " --- |" * len(batches),
    ]
    for mode in dict.fromkeys(x["mode"] for x in r["results"]):
        cells = [
            f"{cell[mode, b][value]:.2f} ({cell[mode, b][ratio]:.2f}x)"
            for b in batches
            if (mode, b) in cell
        ]
        lines.append(f"| {mode} | " + " | ".join(cells) + " |")
    return lines


def structured_output_cost_table(res: Results) -> str:
    """docs/structured_outputs.md: ms per step, free and JSON-masked, per loop and
    batch; then the grammar compile times."""
    parts = []
    for name in sorted(n for n in res.current if n.startswith("structured_output_cost_")):
        r = res.current[name]
        line = res.line_of(name)
        where = r.get("gpu") or "CPU"
        parts.append(
            f"`{name}` ({_day(line['date'])}, {_short(line['commit'])}; {where}; {r['model']}; "
            f"prompt {r['prompt_len']} tokens; ms per decode step, and × the free mode "
            "of the same loop):"
        )
        parts.append("")
        parts.extend(_mode_batch_rows(r, "ms_per_step", "ratio_to_free"))
        parts.append("")
        compiles = ", ".join(
            f"{schema}: cold {c['cold_s'] * 1e3:.1f} ms, cached {c['cached_s'] * 1e3:.3f} ms"
            for schema, c in r["compile"].items()
        )
        parts.append(f"Grammar compile ({where}): {compiles}.")
        parts.append("")
    return "\n".join(parts) if parts else "(no run recorded yet)\n"


def quantization_table(res: Results) -> str:
    """docs/quantization.md: per variant, bytes, memory and speed."""
    parts = []
    for name in sorted(n for n in res.current if n.startswith("quantization_")):
        r = res.current[name]
        line = res.line_of(name)
        parts.append(
            f"`{name}` ({_day(line['date'])}, {_short(line['commit'])}; {r['model']}; "
            f"{r['num_prompts']} prompts of {r['input_len']} tokens, {r['output_len']} greedy "
            "tokens each, one batch):"
        )
        parts.append("")
        parts.append(
            "| weights | weight bytes | resident memory after load | output tok/s | "
            "tokens equal float32 |"
        )
        parts.append("|---|---|---|---|---|")
        for variant, v in r["variants"].items():
            parts.append(
                f"| {variant} | {v['weight_bytes'] / 1e6:.1f} MB "
                f"({v['weight_fraction_of_float32']:.0%}) | "
                f"{v['rss_after_load_bytes'] / 1e6:.0f} MB | "
                f"{v['output_tokens_per_second']:.1f} | {v['tokens_equal_float32']} |"
            )
        parts.append("")
    return "\n".join(parts) if parts else "(no run recorded yet)\n"


# --- tensor parallelism (docs/parallelism.md) ------------------------------------------


def _us(x: float) -> str:
    return f"{x:,.0f} µs"


def _mb(x: float) -> str:
    return f"{x / 1e6:,.1f} MB"


STAR = r"\*"  # a literal * in Markdown: more processes than CPUs


def _over(oversubscribed: bool) -> str:
    return STAR if oversubscribed else ""


def _engine_rows(r: dict[str, Any]) -> dict[tuple[str, int], dict[str, Any]]:
    return {(row["model"], row["tp"]): row for row in r["engine"]}


def tensor_parallel_says(r: dict[str, Any]) -> str:
    rows = _engine_rows(r)
    cpus = r["machine"]["cpus_usable"]
    parts = []
    for model in dict.fromkeys(m for m, _ in rows):
        tps = sorted(tp for m, tp in rows if m == model)
        figures = " / ".join(f"{rows[model, tp]['output_tokens_per_second']:,.1f}" for tp in tps)
        parts.append(f"{model} at TP {'/'.join(map(str, tps))}: {figures} tok/s")
    top = max(rows.values(), key=lambda row: row["ranks"][0]["param_bytes"] * (row["tp"] > 1))
    frac = top["ranks"][0].get("fraction_of_tp1", {})
    memory = (
        f"; {top['model']} at TP={top['tp']}: parameters {frac['param_bytes']:.2f}, peak RSS "
        f"growth {max(k['fraction_of_tp1']['peak_rss'] for k in top['ranks']):.2f} of TP=1 "
        "per rank"
        if "peak_rss" in frac
        else ""
    )
    return f"{'; '.join(parts)} ({cpus} CPUs: more ranks share them){memory}"


def broadcast_says(r: dict[str, Any]) -> str:
    rows = {
        (x["readers"], x["batch"]): x
        for x in r["results"]
        if x["payload"] == "decode" and not x["gap_ms"]
    }
    readers = sorted({k for k, _ in rows})
    batch = 8 if any(b == 8 for _, b in rows) else max(b for _, b in rows)
    figures = " / ".join(
        f"{rows[k, batch]['median_us']:.1f}" for k in readers if (k, batch) in rows
    )
    return (
        f"one step's `SchedulerOutput` through the shared-memory ring: decode batch {batch} to "
        f"{'/'.join(map(str, readers))} readers {figures} µs (median)"
    )


def tensor_parallel_table(res: Results) -> str:
    """docs/parallelism.md: collectives alone, decode at each TP, memory per rank."""
    parts = []
    for name in sorted(n for n in res.current if n.startswith("tensor_parallel_")):
        r = res.current[name]
        line = res.line_of(name)
        m = r["machine"]
        w = r["workload"]
        parts.append(
            f"`{name}` ({_day(line['date'])}, {_short(line['commit'])}; {m['cpu_model']}, "
            f"{m['cpus_usable']} CPUs; one torch thread per process or rank; {STAR} = more "
            "processes than CPUs; TCP round trip on loopback "
            f"{m['tcp_loopback_round_trip_us']:.0f} µs). Collectives alone, gloo over loopback, "
            "median µs per call back to back (rank 0):"
        )
        parts.append("")
        worlds = sorted({c["world"] for c in r["collectives"]})
        over = {c["world"]: c["oversubscribed"] for c in r["collectives"]}
        parts.append(
            "| collective, fp32 | bytes per rank | "
            + " | ".join(f"{n} processes{_over(over[n])}" for n in worlds)
            + " |"
        )
        parts.append("|---|---|" + "---|" * len(worlds))
        cells: dict[tuple[str, str], dict[int, dict[str, Any]]] = {}
        for c in r["collectives"]:
            if c["op"] == "all_reduce":
                label = f"all-reduce [{c['shape'][0]}, {c['shape'][1]}]"
            else:
                label = f"all-gather [{c['shape'][0]}, 49152/N] (logits)"
            cells.setdefault((label, c["op"]), {})[c["world"]] = c
        for (label, op), by_world in cells.items():
            first = next(iter(by_world.values()))
            nbytes = (
                f"{first['bytes_per_rank']:,}"
                if op == "all_reduce"
                else f"{first['shape'][0] * 49152 * 4:,} / N"
            )
            parts.append(
                f"| {label} | {nbytes} | "
                + " | ".join(_us(by_world[n]["median_us"]) if n in by_world else "" for n in worlds)
                + " |"
            )
        parts.append("")
        parts.append(
            f"Decode, {w['num_prompts']} prompts of {w['input_len']} tokens, {w['output_len']} "
            f"greedy tokens each, one batch, fp32, `mp` executor at every TP (median of "
            f"{w['repeats']} runs); collectives per decode step from the workers' "
            "`worker.rpc_done` events (a second, traced run):"
        )
        parts.append("")
        parts.append(
            "| model | TP | output tok/s | decode step | all-reduces + all-gathers per step | "
            "in collectives per step (rank 0) | `execute_model` per step (rank 0) |"
        )
        parts.append("|---|---|---|---|---|---|---|")
        rows = _engine_rows(r)
        for (model, tp), row in rows.items():
            ref = rows.get((model, 1))
            step = f"{row['decode_step_mean_ms']:.1f} ms"
            if ref is not None and tp != 1:
                step += f" ({row['decode_step_mean_ms'] / ref['decode_step_mean_ms']:.1f}x)"
            ranks = row["traced"]["per_rank"]
            t = ranks[0] if ranks else {}
            parts.append(
                f"| {model} | {tp}{_over(row['oversubscribed'])} | "
                f"{row['output_tokens_per_second']:,.1f} | {step} | "
                f"{t.get('all_reduce_per_step', 0):g} + {t.get('all_gather_per_step', 0):g} | "
                f"{t.get('collective_ms_per_step', 0):.1f} ms | "
                f"{t.get('execute_model_ms_per_step', 0):.1f} ms |"
            )
        parts.append("")
        parts.append(
            "Memory per rank (rank 0; the peak: the highest rank), and its fraction of the same "
            "model's one rank. Weights: parameters and the oneDNN-packed copy of each linear "
            "weight that the CPU layers keep. Growth: over the worker's resident memory right "
            "before `load_model`; private = `RssAnon` after the runs (weights, packed copies, KV "
            "cache, activations); peak = `VmHWM`, which also counts the checkpoint pages a rank "
            "maps while it loads (page cache, shared by the ranks):"
        )
        parts.append("")
        parts.append(
            "| model | TP | parameters | weights in memory | KV cache | before loading | "
            "private growth | peak growth | checkpoint pages mapped while loading |"
        )
        parts.append("|---|---|---|---|---|---|---|---|---|")
        for (model, tp), row in rows.items():
            k = row["ranks"][0]
            if "growth_bytes" not in k:
                continue
            frac = k.get("fraction_of_tp1", {})

            def cell(value: float, key: str, frac: dict = frac, one: bool = tp == 1) -> str:
                return _mb(value) + (f" ({frac[key]:.2f})" if key in frac and not one else "")

            peak = max(row["ranks"], key=lambda x: x["growth_bytes"]["peak_rss"])
            peak_frac = peak.get("fraction_of_tp1", {})
            parts.append(
                f"| {model} | {tp}{_over(row['oversubscribed'])} | "
                f"{cell(k['param_bytes'], 'param_bytes')} | "
                f"{cell(k['weight_bytes'], 'weight_bytes')} | {_mb(k['kv_cache_bytes'])} | "
                f"{_mb(k['before_load']['VmRSS'])} | "
                f"{cell(k['growth_bytes']['anon_after_runs'], 'anon_after_runs')} | "
                + _mb(peak["growth_bytes"]["peak_rss"])
                + (f" ({peak_frac['peak_rss']:.2f})" if "peak_rss" in peak_frac and tp != 1 else "")
                + f" | {_mb(k['growth_bytes']['file_pages_during_load'])} |"
            )
        parts.append("")
    return "\n".join(parts).strip() or "No result stored yet."


def broadcast_table(res: Results) -> str:
    """docs/parallelism.md: one decode step's broadcast to 1/2/4 readers."""
    parts = []
    for name in sorted(n for n in res.current if n.startswith("broadcast_")):
        r = res.current[name]
        line = res.line_of(name)
        m = r["machine"]
        parts.append(
            f"`{name}` ({_day(line['date'])}, {_short(line['commit'])}; {m['cpu_model']}, "
            f"{m['cpus_usable']} CPUs; median µs from `enqueue` until every reader has the "
            f"message, over {r['results'][0]['iters']} broadcasts):"
        )
        parts.append("")
        rows: dict[tuple[str, int, float], dict[int, dict[str, Any]]] = {}
        for x in r["results"]:
            rows.setdefault((x["payload"], x["batch"], x["gap_ms"]), {})[x["readers"]] = x
        readers = sorted({x["readers"] for x in r["results"]})
        parts.append(
            "| step | requests | pickled | "
            + " | ".join(f"{n} reader{'s' if n > 1 else ''}" for n in readers)
            + " |"
        )
        parts.append("|---|---|---|" + "---|" * len(readers))
        for (payload, batch, gap), by_readers in sorted(
            rows.items(), key=lambda kv: (kv[0][0] != "decode", kv[0][2], kv[0][1])
        ):
            if payload != "decode" and batch not in (8, 256):
                continue
            first = next(iter(by_readers.values()))
            label = f"{payload}, after {gap:g} ms idle" if gap else f"{payload}, back to back"
            parts.append(
                f"| {label} | {batch} | {first['payload_bytes']:,} B | "
                + " | ".join(
                    _us(by_readers[n]["median_us"]) if n in by_readers else "" for n in readers
                )
                + " |"
            )
        parts.append("")
    return "\n".join(parts).strip() or "No result stored yet."


def gpu_profile_modes_table(res: Results) -> str:
    """docs/gpu.md: one decode step under each compilation / CUDA-graph mode."""
    parts = []
    for name in sorted(n for n in res.current if n.startswith("gpu_profile_modes_")):
        r = res.current[name]
        line = res.line_of(name)
        parts.append(
            f"`{name}` ({_day(line['date'])}, {_short(line['commit'])}; {r.get('gpu', 'CPU')}; "
            f"{r['model']}; batch {r['batch']}, context {r['context']}; per decode step, "
            f"mean of {r['steps']}):"
        )
        parts.append("")
        parts.append(
            "| mode | graph used | wall ms | GPU busy ms | kernels | kernel launches | "
            "graph launches | start-up s | run |"
        )
        parts.append("|---|---|---|---|---|---|---|---|---|")
        # A run of some modes only (--modes): the others from the series' last run of each.
        rows = [(mode, m, "this") for mode, m in r["modes"].items()]
        seen = set(r["modes"])
        for earlier in reversed(res.series(name)[:-1]):
            run = f"{_day(earlier['date'])}, {_short(earlier['commit'])}"
            missing = {k: m for k, m in earlier["result"]["modes"].items() if k not in seen}
            rows += [(mode, m, run) for mode, m in missing.items()]
            seen |= set(missing)
        for mode, m, run in rows:
            parts.append(
                f"| {mode} | {m['decode_graph_mode']} | {m['wall_ms_per_step']:.2f} | "
                f"{m['gpu_busy_ms_per_step']:.2f} | {m['gpu_kernels_per_step']:.0f} | "
                f"{m['kernel_launches_per_step']:.0f} | {m['graph_launches_per_step']:.0f} | "
                f"{m['engine_startup_seconds']:.1f} | {run} |"
            )
        parts.append("")
    return "\n".join(parts).strip() or "No result stored yet."


def skinny_gemm_table(res: Results) -> str:
    """docs/gpu.md: cuBLAS against the Triton skinny GEMM per layer shape and row count."""
    parts = []
    for name in sorted(n for n in res.current if n.startswith("skinny_gemm_")):
        r = res.current[name]
        if r.get("device") != "cuda":
            continue
        line = res.line_of(name)
        parts.append(
            f"`{name}` ({_day(line['date'])}, {_short(line['commit'])}; {r['gpu']}; {r['model']}; "
            f"{r['calls_per_graph']} calls per graph replay):"
        )
        parts.append("")
        parts.append(
            "| layer | N x K | rows | cuBLAS us | TB/s | skinny GEMM us | TB/s | best tile | "
            "speed-up |"
        )
        parts.append("|---|---|---|---|---|---|---|---|---|")
        for shape, v in r["shapes"].items():
            for rows, e in v["rows"].items():
                parts.append(
                    f"| {shape} | {v['n']} x {v['k']} | {rows} | {e['cublas_us']:.1f} | "
                    f"{e['cublas_tb_per_s']:.2f} | {e['best_us']:.1f} | "
                    f"{e['best_tb_per_s']:.2f} | `{e['best_tile']}` | "
                    f"{e['speedup_over_cublas']:.2f}x |"
                )
        parts.append("")
    return "\n".join(parts).strip() or "No result stored yet."


def lora_table(res: Results) -> str:
    """docs/lora.md: the mixed-adapter workload against the base model, same engine."""
    parts = []
    for name in sorted(n for n in res.current if n.startswith("gpu_throughput_lora_")):
        r = res.current[name]
        line = res.line_of(name)
        base = r.get("throughput_lora_engine_base_only", {})
        mixed = r.get("throughput_mixed_lora", {})
        if "output_tokens_per_second" not in base or "output_tokens_per_second" not in mixed:
            continue
        parts.append(
            f"`{name}` ({_day(line['date'])}, {_short(line['commit'])}; {r['gpu']}; {r['model']}; "
            f"{r['workload']}; one engine with `enable_lora=True`, {mixed['num_adapters']} "
            f"adapters of rank {mixed['lora_rank']} on q/k/v/o/gate/up/down, run eagerly):"
        )
        parts.append("")
        parts.append("| requests | output tok/s | seconds |")
        parts.append("|---|---|---|")
        n = mixed["num_requests"]
        parts.append(
            f"| all {n} on the base model | {_tps(base['output_tokens_per_second'])} | "
            f"{base['elapsed_time']:.1f} |"
        )
        on_base = mixed["requests_on_base_model"]
        parts.append(
            f"| {n - on_base} spread over the {mixed['num_adapters']} adapters, {on_base} on the "
            f"base model | {_tps(mixed['output_tokens_per_second'])} | "
            f"{mixed['elapsed_time']:.1f} |"
        )
        parts.append("")
        ratio = mixed["output_tokens_per_second"] / base["output_tokens_per_second"]
        parts.append(f"Mixed adapters / base model on the same engine: {ratio:.2f}.")
        parts.append("")
    return "\n".join(parts).strip() or "No result stored yet."


def spec_verify_table(res: Results) -> str:
    """docs/spec_decode.md: step time per mode and batch, and the ratio to graphed decode."""
    parts = []
    for name in sorted(n for n in res.current if n.startswith("spec_verify_cost_")):
        r = res.current[name]
        line = res.line_of(name)
        where = r.get("gpu") or "CPU"
        parts.append(
            f"`{name}` ({_day(line['date'])}, {_short(line['commit'])}; {where}; {r['model']}; "
            f"context {r['context']}; median step ms, and × graphed decode):"
        )
        parts.append("")
        parts.extend(_mode_batch_rows(r, "median_ms", "ratio_to_decode_graphs"))
        parts.append("")
    return "\n".join(parts).strip() or "No result stored yet."


def spec_decode_table(res: Results) -> str:
    """docs/spec_decode.md: tokens/s with and without n-gram speculation, per machine."""
    parts = []
    for name in sorted(n for n in res.current if n.startswith("spec_decode_")):
        r = res.current[name]
        line = res.line_of(name)
        w, summary = r["workload"], r["summary"]
        where = r.get("gpu") or f"CPU, {r['machine']['logical_cpus']} logical CPUs"
        parts.append(
            f"`{name}` ({_day(line['date'])}, {_short(line['commit'])}; {where}; {r['model']}; "
            f"{w['num_prompts']} prompts that repeat their own text, greedy, at most "
            f"{w['max_tokens']} tokens; {_rounds(r['rounds'])}; "
            f"{spec_identical(r)}):"
        )
        has = {p for m in summary.values() for p in m}
        head = ["mode"]
        if "batch" in has:
            head += [f"batch {w['num_prompts']}: tok/s", "× off"]
        if "batch1" in has:
            head += [f"batch 1 ({w['batch1_prompts']} prompts): tok/s", "× off"]
        head += ["mean acceptance length", "acceptance rate", "accepted per position"]
        rows = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
        for mode, s in summary.items():
            cells = [spec_mode(r, mode)]
            for part in ("batch", "batch1"):
                if part not in has:
                    continue
                p = s.get(part)
                speedup = f"{p['speedup']:.2f}" if p and "speedup" in p else ""
                cells += [f"{p['tokens_per_s']:,.1f}" if p else "failed", speedup]
            # Greedy outputs make the drafts of both parts the same when batch 1 runs
            # every prompt; the batch part's counters are shown, batch 1's where they differ.
            acc = _acceptance(s.get("batch") or s.get("batch1") or {})
            acc1 = _acceptance(s.get("batch1") or {})
            if "batch" in s and acc1 != acc and any(acc1):
                acc = tuple(f"{a} (batch 1: {b})" for a, b in zip(acc, acc1))
            rows.append("| " + " | ".join(cells + list(acc)) + " |")
        parts.append("\n".join(rows))
        off = summary["off"]
        tokens = [
            f"{'batch 1' if p == 'batch1' else 'batch'}: {off[p]['output_tokens']:,}"
            for p in ("batch", "batch1")
            if p in off
        ]
        parts.append(
            f"Output tokens of one `off` run: {'; '.join(tokens)}. "
            f"Machine: {r['machine']['cpu_model']}, torch {r['torch']}."
        )
    return "\n\n".join(parts)


def spec_status(r: dict[str, Any]) -> str:
    """README's status figure: each n-gram mode's batch-1 speedup and acceptance length."""
    figures = []
    for mode, s in r["summary"].items():
        p = s.get("batch1", {})
        if "speedup" in p and "mean_acceptance_length" in p:
            k = r["modes"][mode]["speculative_config"]["num_speculative_tokens"]
            figures.append(
                f"k = {k}: {p['speedup']:.2f}x, acceptance length {p['mean_acceptance_length']:.2f}"
            )
    if figures and r["mismatches"]:
        figures.append(f"{len(r['mismatches'])} greedy outputs differ")
    return "; ".join(figures)


def spec_decode_says(r: dict[str, Any]) -> str:
    """One line on a spec_decode file: each n-gram mode's speedup and acceptance length,
    at batch 1 where measured."""
    figures = []
    for mode, s in r["summary"].items():
        part = "batch1" if "batch1" in s else "batch"
        p = s.get(part, {})
        if "mean_acceptance_length" in p and "speedup" in p:
            figures.append(
                f"{mode} {p['speedup']:.2f}x ({'batch 1' if part == 'batch1' else 'batch'}), "
                f"acceptance length {p['mean_acceptance_length']:.2f}"
            )
    identical = "identical" if not r["mismatches"] else f"{len(r['mismatches'])} differ"
    return f"against off: {'; '.join(figures)}; greedy outputs {identical}"


def _script(benchmark: str) -> str:
    """The script of a benchmark: ``<benchmark>.py``, or ``<benchmark>_cpu.py`` where only
    that one exists (``broadcast_cpu.py``, ``quantization_cpu.py``, ...)."""
    for name in (f"{benchmark}.py", f"{benchmark}_cpu.py"):
        if (REPO_ROOT / "benchmarks" / name).exists():
            return name
    return f"{benchmark}.py"


def results_files_table(res: Results) -> str:
    """benchmarks/README.md: every file in benchmarks/results."""
    lines = [
        "| file | benchmark | date, commit | holds |",
        "| --- | --- | --- | --- |",
    ]
    for name in res.files:
        if name == results_store.HISTORY_FILE:
            lines.append(f"| `{name}` | all | | {_file_says(res, name)} |")
            continue
        if not res.series(name.rsplit(".", 1)[0] + ".json"):
            lines.append(f"| `{name}` | | | not a current result: no line in history.jsonl |")
            continue
        line = res.line_of(name.rsplit(".", 1)[0] + ".json")
        lines.append(
            f"| `{name}` | `{_script(line['benchmark'])}` | {_day(line['date'])}, "
            f"{_short(line['commit'])} | {_file_says(res, name)} |"
        )
    return "\n".join(lines)


# --- the blocks ----------------------------------------------------------------------


@dataclass(frozen=True)
class Block:
    name: str
    doc: str
    render: Callable[[Results], str]


BLOCKS = (
    Block("status", "README.md", status_table),
    Block("results-files", "benchmarks/README.md", results_files_table),
    Block("cpu-vs-transformers", "benchmarks/README.md", cpu_history_table),
    Block("gpu-throughput", "docs/gpu.md", gpu_throughput_table),
    Block("gpu-throughput-history", "docs/gpu.md", gpu_throughput_history_table),
    Block("gpu-profile-step", "docs/gpu.md", gpu_profile_step_table),
    Block("gpu-profile-modes", "docs/gpu.md", gpu_profile_modes_table),
    Block("skinny-gemm", "docs/gpu.md", skinny_gemm_table),
    Block("async-scheduling", "docs/gpu.md", async_scheduling_table),
    Block("tracing-overhead-gpu-history", "docs/gpu.md", tracing_gpu_history_table),
    Block("tracing-profile-gpu", "docs/gpu.md", tracing_profile_table),
    Block("tracing-overhead", "docs/trace_format.md", tracing_overhead_table),
    Block("cpu-threads", "docs/reliability.md", cpu_threads_table),
    Block("spec-decode", "docs/spec_decode.md", spec_decode_table),
    Block("spec-verify", "docs/spec_decode.md", spec_verify_table),
    Block("structured-output-cost", "docs/structured_outputs.md", structured_output_cost_table),
    Block("quantization", "docs/quantization.md", quantization_table),
    Block("tensor-parallel", "docs/parallelism.md", tensor_parallel_table),
    Block("broadcast", "docs/parallelism.md", broadcast_table),
    Block("lora", "docs/lora.md", lora_table),
)


def block_pattern(name: str) -> re.Pattern[str]:
    name = re.escape(name)
    return re.compile(
        rf"(<!-- results-table:{name} -->\n)(.*?)(<!-- /results-table:{name} -->)", re.S
    )


def render_doc(text: str, blocks: list[Block], res: Results) -> str:
    """``text`` with every block's content generated anew; a missing block
    raises ``KeyError``."""
    for block in blocks:
        pattern = block_pattern(block.name)
        if not pattern.search(text):
            raise KeyError(f"no <!-- results-table:{block.name} --> block")
        body = block.render(res).rstrip("\n") + "\n"
        text = pattern.sub(lambda m, body=body: m.group(1) + body + m.group(3), text, count=1)
    return text


def docs_by_name(root: Path) -> dict[str, list[Block]]:
    out: dict[str, list[Block]] = {}
    for block in BLOCKS:
        out.setdefault(block.doc, []).append(block)
    return out


def files_named_in_no_doc(root: Path) -> list[str]:
    """Files in benchmarks/results whose name appears in none of ``DOCS``."""
    text = "\n".join((root / doc).read_text() for doc in DOCS if (root / doc).exists())
    names = sorted(p.name for p in (root / RESULTS).iterdir() if p.is_file())
    return [name for name in names if name not in text]


def named_files_missing(root: Path) -> list[str]:
    """``benchmarks/results/NAME`` or ``results/NAME`` paths in the docs that are not there."""
    missing = []
    pattern = re.compile(r"(?:benchmarks/)?results/([\w.-]+\.(?:jsonl|json|txt))(?![\w.])")
    for doc in DOCS:
        path = root / doc
        if not path.exists():
            continue
        for name in pattern.findall(path.read_text()):
            if not (root / RESULTS / name).exists():
                missing.append(f"{doc}: results/{name}")
    return missing


def check(root: Path = REPO_ROOT) -> list[str]:
    """Every way the docs and benchmarks/results disagree (empty: none)."""
    res = Results.load(root)
    problems = []
    for doc, blocks in docs_by_name(root).items():
        text = (root / doc).read_text()
        try:
            expected = render_doc(text, blocks, res)
        except KeyError as e:
            problems.append(f"{doc}: {e.args[0]}")
            continue
        if expected != text:
            drifted = [
                b.name
                for b in blocks
                if block_pattern(b.name).search(text).group(2)  # type: ignore[union-attr]
                != block_pattern(b.name).search(expected).group(2)  # type: ignore[union-attr]
            ]
            problems.append(f"{doc}: table(s) {', '.join(drifted)} differ from benchmarks/results")
    problems += [
        f"{name} is the current file of no series in history.jsonl"
        for name in res.files
        if name != results_store.HISTORY_FILE and not res.series(name.rsplit(".", 1)[0] + ".json")
    ]
    problems += [f"{name} is named in no doc" for name in files_named_in_no_doc(root)]
    problems += [f"{where}, which does not exist" for where in named_files_missing(root)]
    return problems


def write(root: Path = REPO_ROOT) -> tuple[list[str], list[str]]:
    """Rewrite every block: (the docs that changed, the docs left alone for
    a missing block, with why)."""
    res = Results.load(root)
    changed, failed = [], []
    for doc, blocks in docs_by_name(root).items():
        path = root / doc
        text = path.read_text()
        try:
            new = render_doc(text, blocks, res)
        except KeyError as e:
            failed.append(f"{doc}: {e.args[0]}")
            continue
        if new != text:
            path.write_text(new)
            changed.append(doc)
    return changed, failed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    group = parser.add_mutually_exclusive_group(required=True)
    group.add_argument("--check", action="store_true", help="exit 1 if the docs drifted")
    group.add_argument("--write", action="store_true", help="rewrite every table")
    group.add_argument("--record", nargs="+", metavar="FILE", help="store results, then --write")
    group.add_argument("file", nargs="?", help="print the table of one gpu_throughput file")
    parser.add_argument("--note", help="with --record: what the run changed or measured")
    parser.add_argument("--root", type=Path, default=REPO_ROOT, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.file:
        result = json.loads(Path(args.file).read_text())
        print(gpu_head(result) + "\n\n" + table(result))
        return 0
    if args.record:
        for name in args.record:
            path = Path(name)
            result = json.loads(path.read_text())
            txt = path.with_suffix(".txt")
            text = txt.read_text() if txt.exists() else None
            stored = results_store.record(result, args.root / RESULTS, text=text, note=args.note)
            print(f"{path} -> {stored}" + (" (+ .txt)" if text is not None else ""))
    if args.check:
        problems = check(args.root)
        for problem in problems:
            print(problem, file=sys.stderr)
        if problems:
            print("run: python benchmarks/results_table.py --write", file=sys.stderr)
        return 1 if problems else 0
    changed, failed = write(args.root)
    for doc in changed:
        print(f"rewrote {doc}")
    for problem in failed:
        print(f"not rewritten: {problem}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
