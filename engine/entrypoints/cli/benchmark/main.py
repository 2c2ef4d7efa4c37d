"""``glassbox bench {throughput,latency}``.

vLLM twin: ``vllm/entrypoints/cli/benchmark/main.py`` (``BenchmarkSubcommand``).
Read it for how the nested sub-commands hang off ``glassbox bench``: each
``BenchmarkSubcommandBase`` subclass adds a parser under its ``name`` and
sets itself as the handler. Sessions: 06.

Simpler than vLLM: two benchmarks (no ``serve``, ``startup``, ``sweep`` or
``mm_processor``), listed here rather than discovered; their arguments are
built every time the CLI parser is (cheap: no torch import).

Differs from vLLM on purpose: a ``ValueError`` (a bad argument or model name,
raised while the engine config is built) is printed as one line with exit
code 2 instead of a traceback, as ``glassbox serve`` and ``glassbox trace`` do.
"""

from __future__ import annotations

import argparse
import sys

from engine.entrypoints.cli.benchmark.base import BenchmarkSubcommandBase
from engine.entrypoints.cli.benchmark.latency import BenchmarkLatencySubcommand
from engine.entrypoints.cli.benchmark.throughput import BenchmarkThroughputSubcommand

HELP = "Benchmark the engine offline: throughput (tokens/s) or per-step decode latency."

BENCHMARKS: tuple[type[BenchmarkSubcommandBase], ...] = (
    BenchmarkThroughputSubcommand,
    BenchmarkLatencySubcommand,
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="bench_type", metavar="BENCHMARK", required=True)
    for cmd_cls in BENCHMARKS:
        bench_parser = sub.add_parser(
            cmd_cls.name,
            help=cmd_cls.help,
            description=cmd_cls.help,
            usage=f"glassbox bench {cmd_cls.name} [options]",
            formatter_class=parser.formatter_class,
        )
        bench_parser.set_defaults(dispatch_function=cmd_cls.cmd)
        cmd_cls.add_cli_args(bench_parser)


def run(args: argparse.Namespace) -> int:
    try:
        return args.dispatch_function(args)
    except ValueError as e:
        print(f"glassbox bench {args.bench_type}: error: {e}", file=sys.stderr)
        return 2
