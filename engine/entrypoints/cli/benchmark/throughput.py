"""``glassbox bench throughput`` (vLLM twin: ``vllm/entrypoints/cli/benchmark/throughput.py``).

Wires ``engine/benchmarks/throughput.py`` into the CLI. Sessions: 06.
"""

from __future__ import annotations

import argparse

from engine.entrypoints.cli.benchmark.base import BenchmarkSubcommandBase


class BenchmarkThroughputSubcommand(BenchmarkSubcommandBase):
    name = "throughput"
    help = "Offline throughput (output tokens/s) on nano-vllm's workload, or on your own lengths."

    @classmethod
    def add_cli_args(cls, parser: argparse.ArgumentParser) -> None:
        from engine.benchmarks.throughput import add_cli_args

        add_cli_args(parser)

    @staticmethod
    def cmd(args: argparse.Namespace) -> int:
        from engine.benchmarks.throughput import main

        main(args)
        return 0
