"""The shape of a ``glassbox bench`` sub-command.

vLLM twin: ``vllm/entrypoints/cli/benchmark/base.py`` (``BenchmarkSubcommandBase``).
Read it for the two things a benchmark adds to the CLI: its arguments and the
function that runs it. Sessions: 06.

Simpler than vLLM: not a ``CLISubcommand`` (our CLI registers plain
functions in ``engine/entrypoints/cli/main.py``); ``cmd`` returns an exit code.
"""

from __future__ import annotations

import argparse
from typing import ClassVar


class BenchmarkSubcommandBase:
    name: ClassVar[str]
    help: ClassVar[str]

    @classmethod
    def add_cli_args(cls, parser: argparse.ArgumentParser) -> None:
        raise NotImplementedError

    @staticmethod
    def cmd(args: argparse.Namespace) -> int:
        raise NotImplementedError
