"""Where benchmark results are kept: one current file per benchmark and machine,
and every result ever stored in ``history.jsonl``.

``benchmarks/results/`` holds, per series (a benchmark on a machine, with the
model or batch that tells its runs apart), the last result stored as
``<series>.json`` (a profile also as ``<series>.txt``), and
``history.jsonl``: one JSON object per line, appended to and never rewritten,
in the order the results were stored. A line is::

    {"benchmark": "tracing_overhead", "machine": "h200",
     "current_file": "tracing_overhead_gpu_h200.json", "date": "...", "commit": "b143b34",
     "source_file": "...", "note": "...", "result": {...the JSON...}, "text": "...the .txt..."}

``source_file`` is the name the result was first written under (older results
were kept under dated names); ``note`` (optional) says what the run changed
or measured; ``text`` is present for profiles. The lines from before this
file (moved in by date order) also say which commit added the file
(``committed_in``) and, where the result had no time of day, that ``date`` is
that commit's time (``date_note``).

Series names (``current_name``):

* ``cpu_vs_transformers_cpu``
* ``gpu_throughput_<gpu>``, e.g. ``gpu_throughput_h200``; ``gpu_throughput_modes_<gpu>`` for a
  run of the compiled CUDA-graph modes alone (``gpu_run.sh compile``),
  ``gpu_throughput_fp8_<gpu>`` for a run of ``--parts fp8`` alone,
  ``gpu_throughput_lora_<gpu>`` for ``--parts lora`` alone
* ``broadcast_<machine>`` (the executor's shared-memory broadcast of a step to the workers).
* ``tensor_parallel_<machine>`` (gloo's all-reduce and all-gather alone, decode throughput and
  step time at TP 1/2/3/4 with the collectives per step from a trace, each rank's memory).
* ``gpu_profile_step_b<batch>_<gpu>``
* ``gpu_profile_modes_b<batch>_<gpu>``
* ``tracing_overhead_cpu_<model>`` (``smollm2``: the default model; ``tiny``) and
  ``tracing_overhead_gpu_<gpu>`` (SmolLM2 shapes with dummy weights; another
  model adds ``_<model>``); ``tracing_profile_...`` the same way (``_full`` added for a
  profile of level ``full``).
* ``cpu_threads_cpu_<N>c`` (N: the CPUs the run used, ``cpus_used`` in its ``machine``;
  ``_busy<K>`` added for a run with K busy processes alongside), e.g. ``cpu_threads_cpu_16c``.
* ``skinny_gemm_<machine>`` (decode-sized GEMMs: cuBLAS against the Triton skinny GEMM).
* ``spec_decode_<machine>`` (``spec_decode_cpu``, ``spec_decode_h200``: the default model;
  another model adds ``_<model>``).
* ``spec_verify_cost_<machine>`` (a verification step against a decode step).
* ``structured_output_cost_<machine>`` (a decode step with every row masked by a
  JSON-schema grammar against a free one; grammar compile times).
* ``quantization_<machine>`` (the default model from its GGUF file against its
  float32 conversion: weight bytes, resident memory, tokens/s).

A benchmark stores its run with ``--record`` (CPU scripts) or, for results
written elsewhere (the GPU machine's ``$OUT``), with
``python benchmarks/results_table.py --record FILE.json ...``.
"""

from __future__ import annotations

import json
import os
import re
import statistics
import subprocess
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]
RESULTS_DIR = REPO_ROOT / "benchmarks" / "results"
HISTORY_FILE = "history.jsonl"

# The --model values of the tracing benchmarks, as series names spell them.
MODEL_SLUGS = {"default": "smollm2", "smollm2-dummy": "smollm2dummy", "tiny": "tiny"}
# The model the GPU tracing series is named after without a suffix.
GPU_TRACING_MODEL = "smollm2dummy"


def per_round_slowdown(base: list[float], mode: list[float]) -> float:
    """Median over rounds of a mode's throughput drop (%) against the baseline
    run of the same round: pairing by round cancels a host that drifts
    between rounds, which the ratio of the two medians does not."""
    return statistics.median(100.0 * (b - x) / b for b, x in zip(base, mode))


def commit_id() -> str:
    """The commit being measured: ``GLASSBOX_COMMIT`` if set (a machine whose
    git copy lags behind the tree it was sent), else ``git rev-parse --short
    HEAD``, with ``+dirty`` when the tree has uncommitted changes."""
    env = os.environ.get("GLASSBOX_COMMIT")
    if env:
        return env
    try:
        sha = subprocess.check_output(
            ["git", "rev-parse", "--short", "HEAD"], cwd=REPO_ROOT, text=True
        ).strip()
        dirty = subprocess.check_output(["git", "status", "--porcelain"], cwd=REPO_ROOT, text=True)
        return sha + ("+dirty" if dirty.strip() else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def slug(text: str) -> str:
    """``"NVIDIA H200"`` -> ``"h200"``: lower case, vendor words dropped,
    other characters than letters and digits folded to ``_``."""
    words = [w for w in re.split(r"[^a-z0-9]+", text.lower()) if w]
    return "_".join(w for w in words if w not in ("nvidia", "geforce")) or "unknown"


def machine_of(result: dict[str, Any]) -> str:
    """``"cpu"`` for a CPU run, else the GPU's slug (``"h200"``)."""
    machine = result.get("machine")
    gpu = result.get("gpu") or (machine.get("gpu") if isinstance(machine, dict) else None)
    device = result.get("device") or ("cuda" if gpu else "cpu")
    if device == "cpu" or not gpu:
        return "cpu"
    return slug(gpu)


def model_slug(result: dict[str, Any]) -> str:
    arg = str(result.get("model_arg") or result.get("model") or "unknown")
    return MODEL_SLUGS.get(arg, slug(os.path.basename(arg.rstrip("/"))))


def current_name(result: dict[str, Any]) -> str:
    """The series of ``result``: the stem of its current file."""
    benchmark = result.get("benchmark")
    machine = machine_of(result)
    if benchmark == "cpu_vs_transformers":
        return "cpu_vs_transformers_cpu"
    if benchmark == "gpu_throughput":
        # A run of some parts alone (gpu_run.sh compile: the graph modes; quant:
        # fp8) is a series of its own, so the full run's file keeps its figures.
        part = ""
        if "ratio_to_transformers" not in result:
            if "throughput_compiled" in result:
                part = "modes_"
            elif "throughput_fp8" in result:
                part = "fp8_"
            elif "throughput_mixed_lora" in result:
                part = "lora_"
        return f"gpu_throughput_{part}{machine}"
    if benchmark == "broadcast":
        return f"broadcast_{machine}"
    if benchmark == "tensor_parallel":
        return f"tensor_parallel_{machine}"
    if benchmark == "async_scheduling":
        return f"async_scheduling_{machine}"
    if benchmark == "cpu_threads":
        return cpu_threads_name(result)
    if benchmark == "spec_decode":
        model = str(result.get("model_arg") or "default")
        return f"spec_decode_{machine}" + ("" if model == "default" else f"_{model_slug(result)}")
    if benchmark == "gpu_profile_step":
        return f"gpu_profile_step_b{result.get('batch', 1)}_{machine}"
    if benchmark == "gpu_profile_modes":
        return f"gpu_profile_modes_b{result.get('batch', 1)}_{machine}"
    if benchmark == "spec_verify_cost":
        return f"spec_verify_cost_{machine}"
    if benchmark == "structured_output_cost":
        return f"structured_output_cost_{machine}"
    if benchmark == "skinny_gemm":
        return f"skinny_gemm_{machine}"
    if benchmark == "quantization":
        return f"quantization_{machine}"
    if benchmark in ("tracing_overhead", "tracing_profile"):
        model = model_slug(result)
        if machine == "cpu":
            name = f"{benchmark}_cpu_{model}"
        else:
            name = f"{benchmark}_gpu_{machine}" + (
                "" if model == GPU_TRACING_MODEL else f"_{model}"
            )
        # A profile of level full is a series of its own (lifecycle's is the default).
        return name + ("_full" if result.get("level") == "full" else "")
    raise ValueError(f"no series for a result of benchmark {benchmark!r}")


def cpu_threads_name(result: dict[str, Any]) -> str:
    """``cpu_threads_cpu_<N>c[_busy<K>]``, as ``benchmarks/cpu_threads.py --out DIR/`` names
    its file: N counts the CPUs used, not the machine's, so a run confined with
    ``--cores`` is a series of its own."""
    info = result.get("machine")
    info = info if isinstance(info, dict) else {}
    cpus = len(info.get("cpus_used") or []) or info.get("logical_cpus")
    if not cpus:
        raise ValueError("a cpu_threads result without machine.cpus_used")
    # Older files lack the key: they ran with none alongside.
    busy = info.get("busy_processes_alongside") or 0
    return f"cpu_threads_cpu_{cpus}c" + (f"_busy{busy}" if busy else "")


def history_record(
    result: dict[str, Any],
    *,
    source_file: str,
    text: str | None = None,
    note: str | None = None,
    current_file: str | None = None,
    machine: str | None = None,
    date: str | None = None,
    commit: str | None = None,
) -> dict[str, Any]:
    """One line of ``history.jsonl`` (the keyword arguments override what
    the result says, for results older than these conventions)."""
    record: dict[str, Any] = {
        "benchmark": result["benchmark"],
        "machine": machine or machine_of(result),
        "current_file": current_file or current_name(result) + ".json",
        "date": date or result["date"],
        "commit": commit or result.get("commit") or "unknown",
        "source_file": source_file,
    }
    if note:
        record["note"] = note
    record["result"] = result
    if text is not None:
        record["text"] = text
    return record


def read_history(results_dir: Path = RESULTS_DIR) -> list[dict[str, Any]]:
    path = Path(results_dir) / HISTORY_FILE
    if not path.exists():
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def dump_result(result: dict[str, Any]) -> str:
    """A current file's text (the one format every writer uses)."""
    return json.dumps(result, indent=1, ensure_ascii=False) + "\n"


def append_history(record: dict[str, Any], results_dir: Path = RESULTS_DIR) -> None:
    with open(Path(results_dir) / HISTORY_FILE, "a") as f:
        f.write(json.dumps(record, ensure_ascii=False) + "\n")


def record(
    result: dict[str, Any],
    results_dir: Path | str = RESULTS_DIR,
    *,
    text: str | None = None,
    note: str | None = None,
) -> Path:
    """Store ``result`` as the current result of its series: overwrite
    ``<series>.json`` (and ``<series>.txt`` when ``text`` is given, or remove
    a stale one) and append it to ``history.jsonl``. Returns the JSON's path.
    The tables in the docs are not rewritten: ``results_table.py --write`` does."""
    results_dir = Path(results_dir)
    results_dir.mkdir(parents=True, exist_ok=True)
    name = current_name(result)
    path = results_dir / f"{name}.json"
    path.write_text(dump_result(result))
    txt = results_dir / f"{name}.txt"
    if text is not None:
        txt.write_text(text)
    elif txt.exists():
        txt.unlink()
    append_history(history_record(result, source_file=path.name, text=text, note=note), results_dir)
    return path


def output_path(out: str | Path, result: dict[str, Any]) -> Path:
    """Where ``--out`` writes ``result``: ``out`` itself, or, when ``out`` is a
    directory (or ends with ``/``), ``out/<series>.json`` -- the name the
    current file will have (``scripts/gpu_run.sh`` passes ``$OUT/``)."""
    path = Path(out)
    if str(out).endswith("/") or path.is_dir():
        path.mkdir(parents=True, exist_ok=True)
        return path / f"{current_name(result)}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    return path


def add_record_arguments(parser: Any) -> None:
    """``--record [DIR]`` and ``--note TEXT`` for a benchmark's command line."""
    parser.add_argument(
        "--record",
        nargs="?",
        const=str(RESULTS_DIR),
        metavar="DIR",
        help="store the run as the current result of its series in DIR (default "
        "benchmarks/results): overwrite <series>.json, append to history.jsonl; then "
        "`python benchmarks/results_table.py --write` updates the docs' tables",
    )
    parser.add_argument("--note", help="with --record: what this run changed or measured")
