"""Print the docs/gpu.md results table from a gpu_throughput.json.

Usage: python3 benchmarks/results_table.py benchmarks/results/gpu_throughput_<date>_h200.json

Reads the file written by benchmarks/gpu_throughput.py and prints a Markdown
table (Glassbox, target, bound per figure) plus the missed targets, so the
numbers in the docs are copied from the results file by a program, not by
hand. Figures the file lacks are left out.
"""

from __future__ import annotations

import json
import sys


def _tps(x: float) -> str:
    return f"{x:,.0f} tok/s"


def _get(d: dict, *names: str):
    """The first of ``names`` present in ``d`` (the first results file used
    ``tokens_per_s``/``seconds``/``ms_per_step``; later ones vLLM's names)."""
    for name in names:
        if name in d:
            return d[name]
    return None


def table(r: dict) -> str:
    lines = ["| | Glassbox | target | bound |", "| --- | --- | --- | --- |"]
    roof = r.get("roofline", {})
    bound_tps = _get(roof, "output_tokens_per_second", "tokens_per_s")
    bound = (
        f"{_tps(bound_tps)} (roofline at the measured {r['copy_bandwidth_GBps'] / 1e3:.2f} TB/s)"
        if bound_tps else ""
    )
    targets = r.get("targets", {})
    backend = r.get("engine", {}).get("attention_backend", "?")
    graphs = r.get("throughput_cudagraphs", {})
    if _get(graphs, "output_tokens_per_second", "tokens_per_s"):
        tokens = _get(graphs, "total_output_tokens", "output_tokens")
        lines.append(
            f"| nano-vllm workload ({tokens:,} output tokens), {backend}, CUDA graphs | "
            f"{_tps(_get(graphs, 'output_tokens_per_second', 'tokens_per_s'))} "
            f"({_get(graphs, 'elapsed_time', 'seconds'):.1f} s, {graphs.get('fraction_of_roofline', 0):.0%} of bound) | "
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
            figure = (f"stopped after {hf['timeout_s']:.0f} s ({hf['num_requests_finished']} of "
                      f"{hf['num_requests_submitted']} done): at most {_tps(hf['output_tokens_per_second_upper_bound'])}")
        lines.append(
            f"| HF transformers {hf.get('transformers_version', '')} continuous batching ({scope}, "
            f"{hf.get('attn_implementation', '?')}) | {figure} | | |"
        )
    if r.get("ratio_to_transformers") is not None:
        kind = "≥ " if r.get("ratio_is_lower_bound") else ""
        lines.append(
            f"| Glassbox / transformers | {kind}{r['ratio_to_transformers']:.1f}x | "
            f"{targets.get('ratio_to_transformers', '')}x | |"
        )
    for name, label in (("decode_latency_cudagraphs", "CUDA graphs"), ("decode_latency_eager", "eager")):
        lat = r.get(name)
        if not isinstance(lat, dict) or "error" in lat:
            continue
        sizes = sorted(lat, key=int)
        ms = " / ".join(f"{_get(lat[b], 'mean_ms', 'ms_per_step'):.2f}" for b in sizes)
        floor = " / ".join(f"{lat[b]['floor_ms']:.2f}" for b in sizes if "floor_ms" in lat[b])
        target = f"{targets.get('decode_step_batch1_ms', '')} ms (batch 1)" if label == "CUDA graphs" else ""
        lines.append(
            f"| decode step, batch {' / '.join(sizes)}, ctx 512, {label} | {ms} ms | {target} | "
            f"{floor + ' ms floor' if floor else ''} |"
        )
    missed = r.get("missed_by", {})
    if missed:
        lines.append("")
        lines.extend(f"- {k}: {v}" for k, v in missed.items())
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print(__doc__.strip().splitlines()[2], file=sys.stderr)
        return 2
    with open(argv[0]) as f:
        result = json.load(f)
    head = (f"Measured on one {result.get('gpu', 'GPU')} ({result.get('date', '')[:10]}, torch {result.get('torch')}, "
            f"commit {result.get('commit')}); {result.get('model', '')}.")
    print(head + "\n\n" + table(result))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
