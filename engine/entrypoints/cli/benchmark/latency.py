"""``glassbox bench latency`` (vLLM twin: ``vllm/entrypoints/cli/benchmark/latency.py``).

Wires ``engine/benchmarks/latency.py`` into the CLI. Sessions: 06.
"""

from __future__ import annotations

import argparse

from engine.entrypoints.cli.benchmark.base import BenchmarkSubcommandBase


class BenchmarkLatencySubcommand(BenchmarkSubcommandBase):
    name = "latency"
    help = "Wall time of one decode step at given batch sizes and context length."

    @classmethod
    def add_cli_args(cls, parser: argparse.ArgumentParser) -> None:
        from engine.benchmarks.latency import add_cli_args

        add_cli_args(parser)

    @staticmethod
    def cmd(args: argparse.Namespace) -> int:
        from engine.benchmarks.latency import main

        main(args)
        return 0
